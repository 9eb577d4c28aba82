//! What exists in the kernel under our names, read directly (no agent
//! needed), and the garbage-collection plan built from it.
//!
//! Without the agent's records, gc removes only what is provably broken:
//! namespace files that are not mounted or whose `eth0` has no address (a
//! crash in the middle of attach), veths of ours that are off any bridge or
//! whose other end is in no namespace file we keep, bridges with no port
//! left, and our table once no bridge is left. A caller that knows the live
//! containers (the agent) passes them as `keep`, and every other container's
//! namespace and veth goes too.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::PathBuf;

use crate::config::OwnedName;
use crate::error::Result;
use crate::netlink::in_netns;
use crate::network::owned_scope;
use crate::node::NetNode;
use crate::nsfile;
use crate::subnet::Subnet;

#[derive(Debug, Clone, serde::Serialize)]
pub struct BridgeInfo {
    pub name: String,
    /// The logical network name; `None` when the bridge is not ours.
    pub scope: Option<String>,
    pub subnet: Subnet,
    pub addresses: Vec<String>,
    pub ports: Vec<String>,
    pub up: bool,
    pub mtu: u32,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct VethInfo {
    pub name: String,
    pub index: u32,
    /// The container address the name was derived from.
    pub ip: Ipv4Addr,
    /// The bridge it is a port of.
    pub bridge: Option<String>,
    /// Whether the other end is in another namespace.
    pub peer_elsewhere: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct NetnsInfo {
    pub container_id: String,
    pub path: PathBuf,
    pub mounted: bool,
    /// `eth0`'s address inside, when present.
    pub ip: Option<Ipv4Addr>,
    /// Index, in the host namespace, of the veth end paired with `eth0`.
    pub host_ifindex: Option<u32>,
}

/// Everything of ours the kernel holds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Inventory {
    pub bridges: Vec<BridgeInfo>,
    /// Bridges left half-built by a crash during ensure (`<bridge>t`).
    pub unfinished_bridges: Vec<String>,
    pub veths: Vec<VethInfo>,
    pub netns: Vec<NetnsInfo>,
    pub table: String,
    pub table_present: bool,
}

/// The subnets of our bridges that belong to a network (carry a scope), for
/// a caller on a hot path (the executor's pass, every few seconds): one
/// dump the kernel filters to bridges, no namespaces entered, no ports or
/// addresses read.
pub async fn scoped_bridges(node: &NetNode) -> Result<BTreeSet<Subnet>> {
    Ok(node
        .netlink()
        .bridges()
        .await?
        .iter()
        .filter(|link| owned_scope(link).is_some())
        .filter_map(|link| match node.config().parse_ifname(&link.name) {
            Some(OwnedName::Bridge(subnet)) => Some(subnet),
            _ => None,
        })
        .collect())
}

async fn bridge_info(
    node: &NetNode,
    links: &[crate::netlink::Link],
    link: &crate::netlink::Link,
    subnet: crate::subnet::Subnet,
) -> Result<BridgeInfo> {
    let addresses = node
        .netlink()
        .ipv4_addresses(link.index, &link.name)
        .await?
        .into_iter()
        .map(|(a, p)| format!("{a}/{p}"))
        .collect();
    let ports = links
        .iter()
        .filter(|l| l.controller == Some(link.index))
        .map(|l| l.name.clone())
        .collect();
    Ok(BridgeInfo {
        name: link.name.clone(),
        scope: owned_scope(link).map(str::to_owned),
        subnet,
        addresses,
        ports,
        up: link.up,
        mtu: link.mtu,
    })
}

/// Everything we own on the node: bridges, veths, namespaces and the table.
pub async fn read(node: &NetNode) -> Result<Inventory> {
    let cfg = node.config();
    let nl = node.netlink();
    let links = nl.links().await?;
    let name_of = |index: u32| {
        links
            .iter()
            .find(|l| l.index == index)
            .map(|l| l.name.clone())
    };
    let mut bridges = Vec::new();
    let mut unfinished_bridges = Vec::new();
    let mut veths = Vec::new();
    for link in &links {
        match cfg.parse_ifname(&link.name) {
            Some(OwnedName::Bridge(subnet)) => {
                bridges.push(bridge_info(node, &links, link, subnet).await?);
            }
            Some(OwnedName::BridgeInProgress(_)) if link.is_bridge() => {
                unfinished_bridges.push(link.name.clone());
            }
            Some(OwnedName::HostVeth(ip)) if link.kind.as_deref() == Some("veth") => {
                veths.push(VethInfo {
                    name: link.name.clone(),
                    index: link.index,
                    ip,
                    bridge: link.controller.and_then(name_of),
                    peer_elsewhere: link.peer_netns_id.is_some_and(|id| id >= 0),
                });
            }
            _ => {}
        }
    }
    let mut netns = Vec::new();
    if let Ok(entries) = std::fs::read_dir(&cfg.netns_dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(id) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if crate::config::validate_container_id(&id).is_err()
                || !entry.file_type().is_ok_and(|t| t.is_file())
            {
                continue;
            }
            let mounted = nsfile::is_mounted(&path);
            let (ip, host_ifindex) = if mounted {
                eth0_of(path.clone()).await
            } else {
                (None, None)
            };
            netns.push(NetnsInfo {
                container_id: id,
                path,
                mounted,
                ip,
                host_ifindex,
            });
        }
    }
    netns.sort_by(|a, b| a.container_id.cmp(&b.container_id));
    let table_present = node.nft().list().await?.is_some();
    Ok(Inventory {
        bridges,
        unfinished_bridges,
        veths,
        netns,
        table: cfg.nft_table.clone(),
        table_present,
    })
}

/// `eth0`'s address and its peer's host ifindex, read from inside.
async fn eth0_of(path: PathBuf) -> (Option<Ipv4Addr>, Option<u32>) {
    let name = crate::attach::CONTAINER_IFNAME;
    in_netns(&path, move |nl| async move {
        let Some(eth) = nl.link(name).await? else {
            return Ok((None, None));
        };
        let ip = nl
            .ipv4_addresses(eth.index, name)
            .await?
            .first()
            .map(|(a, _)| *a);
        Ok((ip, eth.peer_index))
    })
    .await
    .unwrap_or((None, None))
}

/// What gc would remove.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct GcPlan {
    pub netns: Vec<PathBuf>,
    pub veths: Vec<String>,
    pub bridges: Vec<String>,
    pub delete_table: bool,
}

impl GcPlan {
    pub fn is_empty(&self) -> bool {
        self.netns.is_empty()
            && self.veths.is_empty()
            && self.bridges.is_empty()
            && !self.delete_table
    }
}

/// Builds the plan; see the module docs for what counts as garbage.
pub fn plan(inv: &Inventory, keep: Option<&BTreeSet<String>>) -> GcPlan {
    let mut plan = GcPlan::default();
    let mut live_ifindexes = BTreeSet::new();
    for ns in &inv.netns {
        let unwanted = keep.is_some_and(|k| !k.contains(&ns.container_id));
        if !ns.mounted || ns.ip.is_none() || unwanted {
            plan.netns.push(ns.path.clone());
        } else if let Some(index) = ns.host_ifindex {
            live_ifindexes.insert(index);
        }
    }
    for v in &inv.veths {
        if v.bridge.is_none() || !v.peer_elsewhere || !live_ifindexes.contains(&v.index) {
            plan.veths.push(v.name.clone());
        }
    }
    plan.bridges.extend(inv.unfinished_bridges.iter().cloned());
    let mut bridges_left = 0;
    for b in inv.bridges.iter().filter(|b| b.scope.is_some()) {
        if b.ports.iter().all(|p| plan.veths.contains(p)) {
            plan.bridges.push(b.name.clone());
        } else {
            bridges_left += 1;
        }
    }
    plan.delete_table = inv.table_present && bridges_left == 0;
    plan
}

/// Carries out a plan: veths, then namespace files, then bridges, then the
/// table. Each step is idempotent, so a failed gc can simply be run again.
pub async fn apply(node: &NetNode, plan: &GcPlan) -> Result<()> {
    let nl = node.netlink();
    for v in &plan.veths {
        nl.delete_by_name(v).await?;
    }
    for path in &plan.netns {
        nsfile::remove(path)?;
    }
    for b in &plan.bridges {
        // Re-checked at delete time: only bridges that still carry our
        // alias, or half-built ones under our temporary name.
        let unfinished = matches!(
            node.config().parse_ifname(b),
            Some(OwnedName::BridgeInProgress(_))
        );
        if let Some(link) = nl.link(b).await?
            && (owned_scope(&link).is_some() || (unfinished && link.is_bridge()))
        {
            nl.delete(link.index, b).await?;
        }
    }
    if plan.delete_table {
        node.remove_rules().await?;
    }
    Ok(())
}
