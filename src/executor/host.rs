//! The host's side of the instances: the published ports in our nftables
//! table, the bridges that nothing uses any more (N-5), the networks the
//! VIP rules need, and the DNS listeners on the gateways. The loop says
//! what it wants ([`networks_in_use`] is a pure function) through a
//! [`HostHandle`], and never waits: [`Host`] is a task of its own that
//! makes the host so, fed the latest want through a watch. What keeps it
//! from removing a bridge a new worker is about to use is the workers'
//! [`NetworkLeases`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use zattera_dns::{DnsServer, ListenerSpec, Scope};
use zattera_netns::{NetNode, PublishedPort, Subnet, network_name};

use super::LocalNetwork;
use super::diff::{self, Desired};
use super::leases::NetworkLeases;
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

/// What the host should be, as the loop last said: its latest word
/// replaces any the host task has not acted on yet.
#[derive(Debug, Clone, Default)]
pub(super) struct Wanted {
    /// The published ports, with the mark the loop retires their sockets
    /// by ([`super::alloc::Alloc::retire_through`]); `None` until said.
    pub published: Option<(Vec<PublishedPort>, u64)>,
    /// The networks in use; `None` until said.
    pub networks: Option<BTreeMap<Subnet, NetworkUse>>,
}

/// The loop's side of the host task: it says what it wants and never
/// waits for the host to do it.
#[derive(Debug)]
pub(super) struct HostHandle {
    with_network: bool,
    wanted: watch::Sender<Wanted>,
    /// The mark of the last published set whose rules are in place.
    pub applied: watch::Receiver<u64>,
}

impl HostHandle {
    /// Starts the host task; it ends when this handle drops.
    pub fn spawn(&self, host: Host) -> tokio::task::JoinHandle<()> {
        tokio::spawn(host.run(self.wanted.subscribe()))
    }
}

impl HostHandle {
    /// Whether the agent manages the host's network at all.
    pub fn has_network(&self) -> bool {
        self.with_network
    }

    pub fn publish(&self, published: Vec<PublishedPort>, mark: u64) {
        self.wanted
            .send_modify(|w| w.published = Some((published, mark)));
    }

    pub fn use_networks(&self, in_use: BTreeMap<Subnet, NetworkUse>) {
        self.wanted.send_if_modified(|w| {
            let changed = w.networks.as_ref() != Some(&in_use);
            w.networks = Some(in_use);
            changed
        });
    }
}

/// How soon a failed rule update or a network left to remove is tried
/// again, when nothing new comes first.
const RETRY: Duration = Duration::from_secs(5);
/// How soon a network is looked at again that a worker still held: a
/// removal's worker lets go just after it reports.
const LEASED_RETRY: Duration = Duration::from_secs(1);

/// The host's state, owned by its task: firewall, bridges and DNS
/// listeners follow [`Wanted`], in that order, each time it changes and
/// while some of it is not done.
pub(super) struct Host {
    net: Arc<NetNode>,
    dns: Option<Arc<DnsServer>>,
    default_subnet: Option<Subnet>,
    leases: NetworkLeases,
    /// The ports whose rules are in place.
    published: Option<Vec<PublishedPort>>,
    /// The subnets in use at the last sync.
    networks: BTreeSet<Subnet>,
    /// When the bridges were last read and none was left to remove.
    clean_at: Option<Instant>,
    /// Whether the last sync skipped a network a worker held.
    skipped_leased: bool,
    networks_tx: watch::Sender<Arc<Vec<LocalNetwork>>>,
    applied: watch::Sender<u64>,
}

impl Host {
    /// The task's state and the loop's handle; `None` for the state when
    /// the agent manages no network (the handle then says so).
    pub fn new(
        net: Option<Arc<NetNode>>,
        dns: Option<Arc<DnsServer>>,
        default_subnet: Option<Subnet>,
        leases: NetworkLeases,
        networks_tx: watch::Sender<Arc<Vec<LocalNetwork>>>,
    ) -> (Option<Self>, HostHandle) {
        let (wanted, _) = watch::channel(Wanted::default());
        let (applied_tx, applied) = watch::channel(0);
        let handle = HostHandle {
            with_network: net.is_some(),
            wanted,
            applied,
        };
        let host = net.map(|net| Self {
            net,
            dns,
            default_subnet,
            leases,
            published: None,
            networks: BTreeSet::new(),
            clean_at: None,
            skipped_leased: false,
            networks_tx,
            applied: applied_tx,
        });
        (host, handle)
    }

    /// Follows the loop's wants until its handle drops.
    async fn run(mut self, mut wanted: watch::Receiver<Wanted>) {
        loop {
            let w = wanted.borrow_and_update().clone();
            let mut again = None;
            if let Some((ports, mark)) = w.published {
                if self.published.as_ref() != Some(&ports) {
                    if self.publish(&ports).await {
                        self.published = Some(ports);
                    } else {
                        again = Some(RETRY);
                    }
                }
                if again.is_none() {
                    self.applied
                        .send_if_modified(|m| std::mem::replace(m, mark) != mark);
                }
            }
            if let Some(in_use) = w.networks {
                self.sync_networks(in_use).await;
                let recheck = if self.skipped_leased {
                    LEASED_RETRY
                } else if self.clean_at.is_some() {
                    listing::MAX_AGE
                } else {
                    RETRY
                };
                again = Some(again.map_or(recheck, |a| a.min(recheck)));
            }
            tokio::select! {
                changed = wanted.changed() => if changed.is_err() {
                    return;
                },
                () = tokio::time::sleep(again.unwrap_or(RETRY)), if again.is_some() => {}
            }
        }
    }

    /// `true` once the rules publish exactly `published`.
    async fn publish(&self, published: &[PublishedPort]) -> bool {
        match self.net.set_published(published.to_vec()).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "publishing ports failed");
                false
            }
        }
    }

    /// Removes the networks nothing uses (N-5), tells the VIP rules which
    /// remain, and points DNS at them.
    async fn sync_networks(&mut self, mut in_use: BTreeMap<Subnet, NetworkUse>) {
        let net = self.net.clone();
        let wanted: BTreeSet<Subnet> = in_use.keys().copied().collect();
        // The bridges are read again when what is in use changed, when the
        // last read found some to remove, and at least every MAX_AGE: only
        // the agent makes them, and only for a network in use.
        let now = Instant::now();
        let checked = wanted == self.networks
            && self
                .clean_at
                .is_some_and(|at| now.saturating_duration_since(at) < listing::MAX_AGE);
        self.skipped_leased = false;
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
                // The want may be a moment old: a worker spawned since
                // holds its network already.
                let Some(_removal) = self.leases.try_remove(*subnet) else {
                    self.clean_at = None;
                    self.skipped_leased = true;
                    continue;
                };
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
}

/// A kill between a container's removal and its detach, or between an
/// attach and the container's creation, leaves an attachment that no
/// container owns. At boot nothing of ours is in flight, so every namespace
/// file and veth of ours without a container is such a leftover. Bridges
/// and the table are the host task's to manage.
pub(super) async fn collect_orphans(net: &NetNode, live: &BTreeSet<String>) {
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

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
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
