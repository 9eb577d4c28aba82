//! [`NetNode`]: the one object the agent's executor holds. It ties the
//! config, a netlink connection and our nftables table together and keeps
//! the last firewall state it applied, so ensuring or removing a network
//! updates that network's rules too.

use std::net::Ipv4Addr;

use crate::attach::{self, Attachment};
use crate::config::{NetConfig, OwnedName};
use crate::conntrack;
use crate::error::{Error, Result};
use crate::firewall::{BridgeRules, FirewallState, Proto, PublishedPort, ScopedVip};
use crate::netlink::Netlink;
use crate::network::{self, Network};
use crate::nft::Nft;
use crate::subnet::Subnet;
use crate::sysctl;

/// How long an unchanged rule set goes without being written again.
pub const REASSERT_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

#[derive(Debug)]
pub struct NetNode {
    cfg: NetConfig,
    nl: Netlink,
    nft: Nft,
    /// What the table holds, rebuilt whole from this on every change. `None`
    /// until first needed, then read back from the kernel, so a restarted
    /// agent that ensures one network keeps the others' rules and ports.
    rules: tokio::sync::Mutex<Option<FirewallState>>,
    /// When the table was last written: an unchanged state is written again
    /// only after [`REASSERT_EVERY`], so a table someone deleted comes back.
    applied_at: std::sync::Mutex<Option<std::time::Instant>>,
    /// Serialises ensure and remove, which look, then create or delete.
    networks: tokio::sync::Mutex<()>,
}

impl NetNode {
    /// Validates `cfg` and opens a netlink connection on the current tokio
    /// runtime. Touches nothing yet.
    pub fn new(cfg: NetConfig) -> Result<Self> {
        cfg.validate()?;
        let nft = Nft::new(cfg.nft_binary.clone(), cfg.nft_table.clone());
        Ok(Self {
            nl: Netlink::connect()?,
            nft,
            cfg,
            rules: tokio::sync::Mutex::new(None),
            applied_at: std::sync::Mutex::new(None),
            networks: tokio::sync::Mutex::new(()),
        })
    }

    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    pub fn netlink(&self) -> &Netlink {
        &self.nl
    }

    pub fn nft(&self) -> &Nft {
        &self.nft
    }

    /// runtime.md N-4: the bridge for `subnet`, named after its slot, carrying
    /// `scope` as its logical name, with the gateway `.1/24`, up; forwarding
    /// and `route_localnet` on; the network's rules in our table. Idempotent.
    /// An existing bridge with another subnet or scope is re-created when
    /// nothing is attached to it, and is an error naming both otherwise.
    pub async fn ensure_network(&self, scope: &str, subnet: Subnet) -> Result<Network> {
        let _one_at_a_time = self.networks.lock().await;
        let name = self.cfg.bridge_name(subnet);
        // Reading the table first fails early (no nft, no nf_tables) before
        // anything is created.
        self.rules().await?;
        let existed = self.nl.link(&name).await?.is_some();
        let net = network::ensure_bridge(&self.nl, &name, scope, subnet).await?;
        let finished = async {
            sysctl::enable_forwarding()?;
            sysctl::enable_route_localnet(&name)?;
            sysctl::enable_rp_filter(&name)?;
            self.update_rules(|s| {
                s.bridges.retain(|b| b.bridge != name);
                s.bridges.push(BridgeRules {
                    bridge: name.clone(),
                    subnet,
                    scope: scope.to_owned(),
                });
            })
            .await
        }
        .await;
        if let Err(e) = finished {
            if !existed {
                // No half-built network: the bridge goes with the failure.
                let _ = self.nl.delete(net.index, &name).await;
            }
            return Err(e);
        }
        Ok(net)
    }

    /// The network of `subnet` if its bridge exists.
    pub async fn network(&self, subnet: Subnet) -> Result<Option<Network>> {
        network::lookup(&self.nl, &self.cfg.bridge_name(subnet), subnet).await
    }

    /// runtime.md N-5: removes the network's rules (and published ports into
    /// it), then its bridge. Idempotent. Refused while containers are
    /// attached (detach them, or let gc take crash leftovers).
    pub async fn remove_network(&self, subnet: Subnet) -> Result<()> {
        let _one_at_a_time = self.networks.lock().await;
        let name = self.cfg.bridge_name(subnet);
        // Refuse before changing anything if the name is not ours or in use.
        let existing = network::lookup(&self.nl, &name, subnet).await?;
        if let Some(net) = &existing {
            let ports = self.nl.ports_of(net.index).await?;
            if !ports.is_empty() {
                return Err(Error::NetworkInUse {
                    bridge: name,
                    ports: ports.len(),
                    names: ports
                        .iter()
                        .map(|p| p.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
        self.update_rules(|s| {
            s.bridges.retain(|b| b.bridge != name);
            s.published.retain(|p| !subnet.contains(p.container_ip));
        })
        .await?;
        if let Some(net) = existing {
            self.nl.delete(net.index, &name).await?;
        }
        Ok(())
    }

    /// Attaches a container with address `ip` (from [`crate::Ipam`]) to the
    /// network of `subnet`, which must have been ensured.
    pub async fn attach(
        &self,
        container_id: &str,
        subnet: Subnet,
        ip: Ipv4Addr,
    ) -> Result<Attachment> {
        let net = self
            .network(subnet)
            .await?
            .ok_or(Error::NoNetwork(subnet))?;
        attach::attach(&self.cfg, &self.nl, &net, container_id, ip).await
    }

    /// Whether a container's namespace file is mounted and its host veth
    /// exists (one statfs and one link look-up).
    pub async fn attachment_intact(&self, container_id: &str, ip: Ipv4Addr) -> Result<bool> {
        attach::intact(&self.cfg, &self.nl, container_id, ip).await
    }

    /// Makes again the parts of a running container's attachment that were
    /// removed behind the agent's back (see [`attach::repair`]).
    pub async fn repair_attachment(
        &self,
        container_id: &str,
        subnet: Subnet,
        ip: Ipv4Addr,
        task_pid: u32,
    ) -> Result<attach::Repaired> {
        let net = self
            .network(subnet)
            .await?
            .ok_or(Error::NoNetwork(subnet))?;
        attach::repair(&self.cfg, &self.nl, &net, container_id, ip, task_pid).await
    }

    /// Removes a container's veth and namespace file; idempotent, and fine
    /// after a crash that left any part of them. Pass the address from the
    /// container's record when known.
    pub async fn detach(&self, container_id: &str, ip: Option<Ipv4Addr>) -> Result<()> {
        attach::detach(&self.cfg, &self.nl, container_id, ip).await
    }

    /// Replaces the service VIPs, each reachable from the bridges of its
    /// scope only, and rebuilds the table.
    pub async fn set_vips(&self, vips: Vec<ScopedVip>) -> Result<()> {
        self.update_rules(|s| s.vips = vips).await
    }

    /// Replaces the published ports and rebuilds the table.
    pub async fn set_published(&self, ports: Vec<PublishedPort>) -> Result<()> {
        self.update_rules(|s| s.published = ports).await
    }

    /// Rebuilds the whole table from `state` (at start, from the agent's
    /// records), in one transaction.
    pub async fn apply_rules(&self, state: FirewallState) -> Result<()> {
        self.update_rules(|s| *s = state).await
    }

    /// Deletes our table: the host's ruleset is as it was before us.
    pub async fn remove_rules(&self) -> Result<()> {
        let mut guard = self.rules.lock().await;
        self.nft.delete().await?;
        *guard = Some(FirewallState::default());
        Ok(())
    }

    /// The rules state the table holds.
    pub async fn rules(&self) -> Result<FirewallState> {
        let mut guard = self.rules.lock().await;
        self.load(&mut guard).await.cloned()
    }

    async fn load<'a>(&self, slot: &'a mut Option<FirewallState>) -> Result<&'a mut FirewallState> {
        if slot.is_none() {
            let current = self.nft.current().await?.unwrap_or_default();
            let mut bridges = Vec::new();
            for bridge in current.bridges {
                let Some(OwnedName::Bridge(subnet)) = self.cfg.parse_ifname(&bridge) else {
                    continue;
                };
                // The scope lives on the bridge itself (its alias).
                let scope = match network::lookup(&self.nl, &bridge, subnet).await {
                    Ok(Some(net)) => net.scope,
                    Ok(None) | Err(_) => String::new(),
                };
                bridges.push(BridgeRules {
                    bridge,
                    subnet,
                    scope,
                });
            }
            // A VIP's scopes are those of the bridges allowed to reach it;
            // one no bridge reaches stays unscoped until its owner sets it.
            let mut vips = Vec::new();
            for addr in &current.vips {
                let mut scopes: Vec<String> = current
                    .vip_access
                    .iter()
                    .filter(|(_, ip)| ip == addr)
                    .filter_map(|(name, _)| {
                        bridges
                            .iter()
                            .find(|b| &b.bridge == name)
                            .map(|b| b.scope.clone())
                    })
                    .collect();
                scopes.sort();
                scopes.dedup();
                if scopes.is_empty() {
                    scopes.push(String::new());
                }
                vips.extend(
                    scopes
                        .into_iter()
                        .map(|scope| ScopedVip { addr: *addr, scope }),
                );
            }
            *slot = Some(FirewallState {
                bridges,
                published: current.published,
                vips,
                egress_deny: self.cfg.egress_deny.clone(),
            });
        }
        Ok(slot.get_or_insert_with(FirewallState::default))
    }

    async fn update_rules(&self, change: impl FnOnce(&mut FirewallState)) -> Result<()> {
        let mut guard = self.rules.lock().await;
        let current = self.load(&mut guard).await?;
        let mut next = current.clone();
        change(&mut next);
        // An agent pass asks every few seconds; `nft` costs a process.
        let recent = self
            .applied_at
            .lock()
            .ok()
            .and_then(|t| *t)
            .is_some_and(|t| t.elapsed() < REASSERT_EVERY);
        if next == *current && recent {
            return Ok(());
        }
        // Keep the current state on failure: the kernel still holds it.
        self.nft.apply(&next).await?;
        if let Ok(mut t) = self.applied_at.lock() {
            *t = Some(std::time::Instant::now());
        }
        // UDP flows of ports that went away would otherwise keep their old
        // DNAT for as long as the client sends (C-7). TCP flows end by
        // themselves and are left alone.
        let gone: Vec<PublishedPort> = current
            .published
            .iter()
            .filter(|p| p.proto == Proto::Udp && !next.published.contains(p))
            .copied()
            .collect();
        // A port just published may have stale un-NATed flows of the host
        // process that had it before (conntrack module doc).
        let new: Vec<PublishedPort> = next
            .published
            .iter()
            .filter(|p| !current.published.iter().any(|c| c.same_host_port(p)))
            .copied()
            .collect();
        *current = next;
        if !gone.is_empty() || !new.is_empty() {
            let forgot = tokio::task::spawn_blocking(move || {
                conntrack::forget(&gone).and(conntrack::forget_stale(&new))
            })
            .await;
            match forgot {
                Ok(Ok(_)) => {}
                // The rules are right; stale flows expire on their own.
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "could not forget stale conntrack entries of changed ports");
                }
                Err(e) => tracing::warn!(error = %e, "conntrack clean-up task failed"),
            }
        }
        Ok(())
    }
}
