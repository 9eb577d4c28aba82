//! One container on one network: a namespace file, a veth pair with the host
//! end on the bridge and `eth0` inside, its address, `lo` up and a default
//! route via the gateway.
//!
//! The veth is made in one netlink request: the host end up and on the
//! bridge, the other end created directly inside the container's namespace
//! as `eth0` (no move, no rename, no temporary name in the host namespace).
//!
//! Names are derived from the container id (namespace file) and its address
//! (host veth), so detach needs nothing but the durable record, and works
//! after a crash whatever is left: file or not, veth or not. Attach replaces
//! whatever a previous attach of the same container id left behind.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use crate::config::NetConfig;
use crate::error::{Error, Result};
use crate::netlink::{Netlink, in_netns};
use crate::network::Network;
use crate::nsfile;
use crate::subnet::Subnet;

/// What attach built; enough for the runtime spec and for detach.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Attachment {
    pub container_id: String,
    pub subnet: Subnet,
    pub ip: Ipv4Addr,
    pub gateway: Ipv4Addr,
    /// Reference this as the OCI spec's `network` namespace path.
    pub netns_path: PathBuf,
    pub host_veth: String,
    pub mtu: u32,
}

/// The interface name a container sees.
pub const CONTAINER_IFNAME: &str = "eth0";

pub(crate) async fn attach(
    cfg: &NetConfig,
    nl: &Netlink,
    net: &Network,
    container_id: &str,
    ip: Ipv4Addr,
) -> Result<Attachment> {
    let host = ip.octets()[3];
    if !net.subnet.contains(ip) || !(2..=254).contains(&host) {
        return Err(Error::IpOutside {
            ip,
            subnet: net.subnet,
        });
    }
    let att = Attachment {
        container_id: container_id.to_owned(),
        subnet: net.subnet,
        ip,
        gateway: net.gateway,
        netns_path: cfg.netns_path(container_id)?,
        host_veth: cfg.host_veth_name(ip),
        mtu: net.mtu,
    };
    let result = build(nl, net, &att).await;
    if let Err(e) = &result {
        tracing::warn!(container = container_id, %ip, error = %e, "attach failed; undoing");
        let _ = detach(cfg, nl, container_id, Some(ip)).await;
    }
    result.map(|()| att)
}

async fn build(nl: &Netlink, net: &Network, att: &Attachment) -> Result<()> {
    // IPAM says the address is free, so a same-named veth is a crash leftover.
    nl.delete_by_name(&att.host_veth).await?;
    nsfile::create(&att.netns_path).await?;
    build_veth(nl, net, att).await
}

/// The veth pair into the namespace already at `att.netns_path`, and
/// `eth0`'s address, `lo` and the default route inside.
async fn build_veth(nl: &Netlink, net: &Network, att: &Attachment) -> Result<()> {
    let ns = nsfile::open(&att.netns_path)?;
    nl.create_veth_into(&att.host_veth, net.index, CONTAINER_IFNAME, &ns, net.mtu)
        .await?;
    drop(ns);

    // The address may have been another container's a moment ago.
    nl.forget_neighbour(net.index, &net.bridge, att.ip).await?;
    let (ip, gateway) = (att.ip, att.gateway);
    in_netns(&att.netns_path, move |inner| async move {
        if let Some(lo) = inner.link("lo").await? {
            inner.set_up(lo.index, "lo").await?;
        }
        let eth = inner
            .link(CONTAINER_IFNAME)
            .await?
            .ok_or_else(|| Error::Vanished(format!("{CONTAINER_IFNAME} inside the namespace")))?;
        inner
            .add_address(eth.index, CONTAINER_IFNAME, ip, 24)
            .await?;
        inner.set_up(eth.index, CONTAINER_IFNAME).await?;
        inner.add_default_route(gateway).await
    })
    .await
}

/// What [`repair`] had to make again.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Repaired {
    /// The namespace file, pinned again from the running task.
    pub netns_file: bool,
    /// The veth pair (and `eth0` inside).
    pub veth: bool,
}

impl Repaired {
    pub fn anything(self) -> bool {
        self.netns_file || self.veth
    }
}

/// Whether the namespace file is a live mount and the host veth exists.
pub(crate) async fn intact(
    cfg: &NetConfig,
    nl: &Netlink,
    container_id: &str,
    ip: Ipv4Addr,
) -> Result<bool> {
    let path = cfg.netns_path(container_id)?;
    if !nsfile::is_mounted(&path) {
        return Ok(false);
    }
    let veth = cfg.host_veth_name(ip);
    match link_exists(&veth) {
        Some(exists) => Ok(exists),
        None => Ok(nl.link(&veth).await?.is_some()),
    }
}

/// Whether this namespace has an interface `name` (`None`: not known):
/// one `if_nametoindex` ioctl, not an RTM_GETLINK. The kernel's answer to
/// that names a veth's peer namespace by its id, found by walking every id
/// the host's namespace holds; asked for every instance every few seconds,
/// that cost grew with the square of the instances (59.2).
fn link_exists(name: &str) -> Option<bool> {
    match nix::net::if_::if_nametoindex(name) {
        Ok(_) => Some(true),
        Err(nix::errno::Errno::ENODEV) => Some(false),
        Err(_) => None,
    }
}

/// Puts back what was removed behind our back from the attachment of a
/// container whose task runs as `pid`: the namespace file is pinned again
/// from the task's own namespace (the container keeps its sockets and
/// nothing restarts), and a deleted veth pair is made again into it with
/// the same address.
pub(crate) async fn repair(
    cfg: &NetConfig,
    nl: &Netlink,
    net: &Network,
    container_id: &str,
    ip: Ipv4Addr,
    pid: u32,
) -> Result<Repaired> {
    let path = cfg.netns_path(container_id)?;
    let mut done = Repaired::default();
    if !nsfile::is_mounted(&path) {
        nsfile::pin(&path, std::path::Path::new(&format!("/proc/{pid}/ns/net")))?;
        done.netns_file = true;
    }
    let host_veth = cfg.host_veth_name(ip);
    if nl.link(&host_veth).await?.is_none() {
        let att = Attachment {
            container_id: container_id.to_owned(),
            subnet: net.subnet,
            ip,
            gateway: net.gateway,
            netns_path: path,
            host_veth,
            mtu: net.mtu,
        };
        // Deleting the host end took `eth0` with it; a stray one would be
        // a half-made repair, so it goes first.
        let stale = att.netns_path.clone();
        in_netns(&stale, |inner| async move {
            match inner.link(CONTAINER_IFNAME).await? {
                Some(eth) => inner.delete(eth.index, CONTAINER_IFNAME).await,
                None => Ok(()),
            }
        })
        .await?;
        build_veth(nl, net, &att).await?;
        done.veth = true;
    }
    Ok(done)
}

/// Removes a container's veth and namespace file. Every part may already be
/// gone. Without `ip` the veth is not looked for: it disappears with the
/// namespace once no process holds it.
pub(crate) async fn detach(
    cfg: &NetConfig,
    nl: &Netlink,
    container_id: &str,
    ip: Option<Ipv4Addr>,
) -> Result<()> {
    let path = cfg.netns_path(container_id)?;
    if let Some(ip) = ip {
        // Deleting one end deletes the pair, even if a process still sits in
        // the namespace.
        nl.delete_by_name(&cfg.host_veth_name(ip)).await?;
    }
    nsfile::remove(&path)
}
