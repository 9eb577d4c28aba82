//! The host's side of the instances: the published ports in our nftables
//! table, the bridges that nothing uses any more (N-5), the networks the
//! VIP rules need, and the DNS listeners on the gateways with, standalone,
//! the names of the healthy local instances. The loop says what is in use
//! ([`networks_in_use`], a pure function); [`Host`] makes the host so.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;
use zattera_dns::table::LocalInstance;
use zattera_dns::{DnsServer, ListenerSpec, NameTable, Scope};
use zattera_netns::{NetNode, PublishedPort, Subnet, network_name};

use super::LocalNetwork;
use super::diff::{self, Desired};
use super::listing;
use crate::labels::OwnedContainer;
use crate::proto::v1::AssignmentDesired;

/// Who uses a network: the project and environment *name* DNS scopes by
/// (D-7), and the network's name (the scope its bridge carries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct NetworkUse {
    pub project_id: String,
    pub environment: String,
    pub name: String,
}

/// A bring-up in flight: its network is in use before its container is kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Starting<'a> {
    pub subnet: Subnet,
    pub project_id: &'a str,
    pub environment: &'a str,
    pub scope: &'a str,
}

/// The networks in use. Of several holders of one subnet the desired one
/// wins, then a bring-up, then the last listed: each is looked at only
/// while its subnet has none yet (cloning a name per container costs a pass
/// over 1,000 more than the rest of it).
pub(super) fn networks_in_use<'a>(
    desired: &Desired,
    owned: &BTreeMap<String, OwnedContainer>,
    starting: impl IntoIterator<Item = Starting<'a>>,
    default_subnet: Option<Subnet>,
) -> BTreeMap<Subnet, NetworkUse> {
    let mut in_use: BTreeMap<Subnet, NetworkUse> = BTreeMap::new();
    for (a, rt) in desired.values().rev() {
        if let Some(s) = rt
            .as_ref()
            .and_then(|rt| diff::wanted_subnet(rt, default_subnet).ok().flatten())
            && !in_use.contains_key(&s)
            && a.desired == AssignmentDesired::Run as i32
            && owned.contains_key(a.meta.as_ref().map_or("", |m| m.id.as_str()))
        {
            let env = rt
                .as_ref()
                .and_then(|rt| rt.env.get("ZATTERA_ENV"))
                .unwrap_or(&a.environment_id);
            in_use.insert(
                s,
                NetworkUse {
                    project_id: a.project_id.clone(),
                    environment: env.clone(),
                    name: network_name(&a.project_id, &a.environment_id),
                },
            );
        }
    }
    for w in starting {
        in_use.entry(w.subnet).or_insert_with(|| NetworkUse {
            project_id: w.project_id.to_owned(),
            environment: w.environment.to_owned(),
            name: w.scope.to_owned(),
        });
    }
    for o in owned.values().rev() {
        if let Some(s) = o.subnet {
            in_use.entry(s).or_insert_with(|| NetworkUse {
                project_id: o.project_id.clone(),
                environment: o.environment_name.clone(),
                name: network_name(&o.project_id, &o.environment_id),
            });
        }
    }
    in_use
}

/// The loop awaits these calls, in its order. As a task of its own fed the
/// latest wants through a watch, the host could remove a bridge that looked
/// unused while a worker that was just spawned ensures and attaches to it:
/// that needs a guard shared between a worker's network step and the
/// removal first (issue 46.3, left).
pub(super) struct Host {
    net: Option<Arc<NetNode>>,
    dns: Option<Arc<DnsServer>>,
    default_subnet: Option<Subnet>,
    /// The subnets in use at the last sync.
    networks: BTreeSet<Subnet>,
    /// When the bridges were last read and none was left to remove.
    clean_at: Option<Instant>,
    networks_tx: watch::Sender<Arc<Vec<LocalNetwork>>>,
}

impl Host {
    pub fn new(
        net: Option<Arc<NetNode>>,
        dns: Option<Arc<DnsServer>>,
        default_subnet: Option<Subnet>,
        networks_tx: watch::Sender<Arc<Vec<LocalNetwork>>>,
    ) -> Self {
        Self {
            net,
            dns,
            default_subnet,
            networks: BTreeSet::new(),
            clean_at: None,
            networks_tx,
        }
    }

    /// Whether the agent manages the host's network at all.
    pub fn has_network(&self) -> bool {
        self.net.is_some()
    }

    /// The published ports become exactly `published`. `true` once the
    /// rules are in place: the sockets of the ports they no longer use may
    /// close.
    pub async fn publish(&self, published: Vec<PublishedPort>) -> bool {
        let Some(net) = &self.net else { return false };
        match net.set_published(published).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "publishing ports failed");
                false
            }
        }
    }

    /// Removes the networks nothing uses (N-5), tells the VIP rules which
    /// remain, and points DNS at them.
    pub async fn sync_networks(&mut self, mut in_use: BTreeMap<Subnet, NetworkUse>) {
        let Some(net) = self.net.clone() else {
            return;
        };
        let wanted: BTreeSet<Subnet> = in_use.keys().copied().collect();
        // The bridges are read again when what is in use changed, when the
        // last read found some to remove, and at least every MAX_AGE: only
        // the agent makes them, and only for a network in use.
        let now = Instant::now();
        let checked = wanted == self.networks
            && self
                .clean_at
                .is_some_and(|at| now.saturating_duration_since(at) < listing::MAX_AGE);
        if !checked {
            // The build bridge is the builds' (45.1), made per build.
            let builds = net.config().build_subnet;
            // Bridges only: the full inventory enters every namespace.
            let existing = zattera_netns::inventory::scoped_bridges(&net).await;
            self.clean_at = existing
                .as_ref()
                .is_ok_and(|e| e.iter().all(|s| wanted.contains(s) || Some(*s) == builds))
                .then_some(now);
            for subnet in existing
                .unwrap_or_else(|_| self.networks.clone())
                .difference(&wanted)
                .filter(|s| Some(**s) != builds)
            {
                match net.remove_network(*subnet).await {
                    Ok(()) => tracing::info!(%subnet, "removed a network nothing uses"),
                    Err(e) => tracing::debug!(%subnet, error = %e, "network not removed yet"),
                }
            }
        }
        self.networks = wanted;
        // The default network is shared by every project: it has no scope
        // for VIPs or internal names (its containers use the host's DNS).
        in_use.retain(|s, _| Some(*s) != self.default_subnet);
        let local: Vec<LocalNetwork> = in_use
            .values()
            .map(|u| LocalNetwork {
                name: u.name.clone(),
                project_id: u.project_id.clone(),
                environment: u.environment.clone(),
            })
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        self.networks_tx.send_if_modified(|n| {
            let changed = **n != local;
            if changed {
                *n = Arc::new(local);
            }
            changed
        });
        if let Some(dns) = &self.dns {
            let specs = in_use
                .iter()
                .map(|(s, u)| ListenerSpec {
                    addr: s.gateway().into(),
                    scope: Scope::new(u.project_id.clone(), u.environment.clone()),
                })
                .collect();
            for status in dns.reconcile(specs).await {
                if !status.is_serving() {
                    tracing::warn!(addr = %status.addr, state = ?status.state, "DNS listener not serving");
                }
            }
        }
    }

    /// A kill between a container's removal and its detach, or between an
    /// attach and the container's creation, leaves an attachment that no
    /// container owns. At boot nothing of ours is in flight, so every namespace
    /// file and veth of ours without a container is such a leftover. Bridges
    /// and the table are the passes' to manage.
    pub async fn collect_orphans(&self, live: &BTreeSet<String>) {
        let Some(net) = &self.net else { return };
        let inventory = match zattera_netns::inventory::read(net).await {
            Ok(i) => i,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list network attachments; leftovers stay until the next start");
                return;
            }
        };
        let mut plan = zattera_netns::inventory::plan(&inventory, Some(live));
        plan.bridges.clear();
        plan.delete_table = false;
        if plan.is_empty() {
            return;
        }
        tracing::info!(netns = ?plan.netns, veths = ?plan.veths, "removing network attachments no container owns");
        if let Err(e) = zattera_netns::inventory::apply(net, &plan).await {
            tracing::warn!(error = %e, "leftover attachments not all removed");
        }
    }

    /// Standalone: internal names answer these instances.
    pub fn set_names(&self, healthy: &[LocalInstance]) {
        if let Some(dns) = &self.dns {
            dns.set_table(NameTable::from_instances(healthy));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::cluster::AssignmentRuntime;
    use crate::proto::v1::{Assignment, Meta};

    fn desired(id: &str, subnet: &str, env_name: &str, run: bool) -> Desired {
        let a = Assignment {
            meta: Some(Meta {
                id: id.into(),
                ..Meta::default()
            }),
            project_id: "p".into(),
            environment_id: format!("env-{id}"),
            desired: if run {
                AssignmentDesired::Run as i32
            } else {
                AssignmentDesired::Stop as i32
            },
            ..Assignment::default()
        };
        let rt = AssignmentRuntime {
            subnet_cidr: subnet.into(),
            env: BTreeMap::from([("ZATTERA_ENV".to_owned(), env_name.to_owned())]),
            ..AssignmentRuntime::default()
        };
        BTreeMap::from([(id.to_owned(), (a, Some(rt)))])
    }

    fn owned(id: &str, slot: u8, env_name: &str) -> (String, OwnedContainer) {
        (
            id.to_owned(),
            OwnedContainer {
                container_id: format!("c-{id}"),
                assignment_id: id.into(),
                project_id: "p".into(),
                environment_id: format!("listed-{id}"),
                environment_name: env_name.into(),
                subnet: Some(Subnet::from_slot(slot)),
                ..OwnedContainer::default()
            },
        )
    }

    #[test]
    fn the_desired_holder_wins_then_a_bring_up_then_the_listed() {
        let s = Subnet::from_slot(60);
        let d = desired("a1", "10.201.60.0/24", "prod", true);
        let kept = BTreeMap::from([owned("a1", 60, "old-name")]);
        let in_use = networks_in_use(&d, &kept, [], None);
        assert_eq!(
            in_use[&s].environment, "prod",
            "the set's name, not the label's"
        );
        assert_eq!(in_use[&s].name, network_name("p", "env-a1"));

        // Not kept yet: a bring-up's word counts before the listed one.
        let kept = BTreeMap::from([owned("other", 60, "listed")]);
        let starting = [Starting {
            subnet: s,
            project_id: "p",
            environment: "coming",
            scope: "zt-p-coming",
        }];
        let in_use = networks_in_use(&d, &kept, starting.clone(), None);
        assert_eq!(in_use[&s].environment, "coming");
        let in_use = networks_in_use(&BTreeMap::new(), &kept, [], None);
        assert_eq!(in_use[&s].environment, "listed");
    }

    #[test]
    fn a_network_nobody_runs_on_is_not_in_use() {
        // Desired but stopped, and nothing kept or coming up on it.
        let d = desired("a1", "10.201.61.0/24", "prod", false);
        let kept = BTreeMap::from([owned("a1", 62, "prod")]);
        let in_use = networks_in_use(&d, &kept, [], None);
        assert_eq!(
            in_use.keys().copied().collect::<Vec<_>>(),
            vec![Subnet::from_slot(62)],
            "only the kept container's own subnet"
        );
        // An assignment without a subnet goes to the default network.
        let default = Subnet::from_slot(63);
        let d = desired("a2", "", "prod", true);
        let kept = BTreeMap::from([owned("a2", 63, "prod")]);
        let in_use = networks_in_use(&d, &kept, [], Some(default));
        assert!(in_use.contains_key(&default));
    }
}
