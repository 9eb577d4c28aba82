//! `MeshService.WatchPeers` (wire.md Appendix A), kept open on the control
//! leader like the route watch: every `PeerSet` is persisted, applied to
//! the interface, and its `leader_node_id` moves the control targets that
//! sync, routes and this watch itself dial.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;

use rustls::ClientConfig;
use tokio::sync::watch;
use zattera_mesh::Backend;

use super::{NodeMesh, peers};
use crate::link::follow;
use crate::link::target::{Dialer, Targets};
use crate::link::tls::{self, CurrentTls};
use crate::proto::cluster::mesh_service_client::MeshServiceClient;
use crate::proto::cluster::{PeerSet, WatchPeersRequest};

/// Everything the mesh task owns.
#[derive(Debug)]
pub struct MeshTask {
    pub backend: Backend,
    pub node: NodeMesh,
    /// The join's `control_grpc_addr`.
    pub control_addr: String,
    pub tls: CurrentTls,
    pub targets: watch::Sender<Targets>,
    pub state_file: PathBuf,
    /// `<run_dir>/mesh.json`: what `zattera-netns mesh` shows beside the
    /// device (node names, the leader).
    pub status_file: PathBuf,
    /// Who may call the node API, following every peer set.
    pub controls: ControlFeed,
}

/// The node API's control ids as the peer sets say (AGENT-4): the set's
/// `is_control` peers, plus the ids the operator configured. A control node
/// added after the join may call at once, and a removed one no longer can;
/// the persisted set brings the last word back at start.
#[derive(Debug)]
pub struct ControlFeed {
    pub tx: watch::Sender<BTreeSet<String>>,
    pub configured: BTreeSet<String>,
    /// The cluster registry's grant: it holds at every control peer's mesh
    /// IP, on the join registry's port.
    pub registry: Option<crate::link::registry::ClusterRegistryFeed>,
}

impl ControlFeed {
    fn take(&self, set: &PeerSet) {
        if let Some(registry) = &self.registry {
            registry.send_if_modified(|grant| {
                let Some(g) = grant.as_mut() else {
                    return false;
                };
                let Some(port) = g.port() else {
                    return false;
                };
                let also_at: Vec<String> = set
                    .peers
                    .iter()
                    .filter(|p| p.is_control && !p.mesh_ip.is_empty())
                    .filter_map(|p| p.mesh_ip.parse::<std::net::Ipv4Addr>().ok())
                    .map(|ip| format!("{ip}:{port}"))
                    .filter(|a| *a != g.addr)
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect();
                if g.also_at == also_at {
                    return false;
                }
                tracing::info!(at = ?also_at, "the cluster registry at the control nodes");
                std::sync::Arc::make_mut(g).also_at = also_at;
                true
            });
        }
        let next = control_ids(set, &self.configured);
        self.tx.send_if_modified(|ids| {
            if *ids == next {
                return false;
            }
            tracing::info!(from = ?ids, to = ?next, "control-plane nodes allowed on the node API");
            if next.is_empty() {
                tracing::warn!(
                    "the peer set names no control node: the node API refuses every caller"
                );
            }
            *ids = next;
            true
        });
    }
}

/// The control ids of `set`, with `configured` added.
fn control_ids(set: &PeerSet, configured: &BTreeSet<String>) -> BTreeSet<String> {
    set.peers
        .iter()
        .filter(|p| p.is_control)
        .map(|p| p.node_id.clone())
        .chain(configured.iter().cloned())
        .collect()
}

impl MeshTask {
    /// Brings the interface up from the persisted set, before any stream:
    /// the mesh (and the leader to dial) survive a restart while control is
    /// away. Returns whether a set was applied.
    pub async fn restore(&self) -> bool {
        match peers::load(&self.state_file) {
            Ok(Some(set)) => {
                tracing::info!(
                    version = set.version,
                    "bringing the mesh up from the persisted peer set"
                );
                self.take(set).await
            }
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(error = %e, "persisted peer set ignored");
                false
            }
        }
    }

    async fn take(&self, set: PeerSet) -> bool {
        self.controls.take(&set);
        let applied = super::apply(&self.backend, &self.node, &set).await;
        let next = self.targets.borrow().after(&self.control_addr, &set);
        self.targets.send_if_modified(|t| {
            let changed = *t != next;
            if t.leader != next.leader {
                tracing::info!(from = %t.leader, to = %next.leader, "control leader");
            }
            *t = next;
            changed
        });
        let targets = self.targets.borrow().clone();
        let kind = self.backend.kind();
        if let Err(e) =
            super::status::store(&self.status_file, &self.node, kind, &set, applied, &targets)
        {
            tracing::warn!(error = %e, "mesh status not written");
        }
        applied
    }

    /// Keeps the watch open for ever.
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let task = Arc::new(self);
            let dialer = Dialer::new(task.targets.subscribe());
            follow::keep_open("peer watch", task.tls.clone(), dialer, |target, client| {
                session(Arc::clone(&task), target, client)
            })
            .await;
        })
    }
}

#[derive(Debug, thiserror::Error)]
enum WatchError {
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("control answered {code:?}: {message}", code = .0.code(), message = .0.message())]
    Status(#[from] tonic::Status),
}

async fn session(
    task: Arc<MeshTask>,
    target: String,
    client: ClientConfig,
) -> Result<(), WatchError> {
    let channel = tls::connect(&target, client).await?;
    let mut stream = MeshServiceClient::new(channel)
        .max_decoding_message_size(16 * 1024 * 1024)
        .watch_peers(WatchPeersRequest {
            node_id: task.node.node_id.clone(),
        })
        .await?
        .into_inner();
    while let Some(set) = stream.message().await? {
        // Persisted first: the mesh must come back after a restart.
        if let Err(e) = peers::store(&task.state_file, &set) {
            tracing::warn!(error = %e, "peer set not persisted");
        }
        task.take(set).await;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::proto::cluster::Peer;

    fn set(controls: &[&str], workers: &[&str]) -> PeerSet {
        let peer = |id: &&str, is_control| Peer {
            node_id: (*id).to_owned(),
            is_control,
            ..Peer::default()
        };
        PeerSet {
            peers: controls
                .iter()
                .map(|c| peer(c, true))
                .chain(workers.iter().map(|w| peer(w, false)))
                .collect(),
            ..PeerSet::default()
        }
    }

    #[test]
    fn control_ids_follow_every_peer_set() {
        let configured = BTreeSet::from(["ops".to_owned()]);
        let (tx, rx) = watch::channel(BTreeSet::from(["c1".to_owned()]));
        let feed = ControlFeed {
            tx,
            configured,
            registry: None,
        };
        let ids = |rx: &watch::Receiver<BTreeSet<String>>| -> Vec<String> {
            rx.borrow().iter().cloned().collect()
        };
        feed.take(&set(&["c1", "c2"], &["w1"]));
        assert_eq!(ids(&rx), ["c1", "c2", "ops"], "a control node added later");
        feed.take(&set(&["c2"], &["w1", "w2"]));
        assert_eq!(
            ids(&rx),
            ["c2", "ops"],
            "a removed one loses access; workers never get it"
        );
    }

    #[test]
    fn the_registry_grant_follows_the_control_peers_addresses() {
        use crate::link::registry::{ClusterRegistry, Credentials};
        let grant = ClusterRegistry {
            addr: "10.90.0.1:5000".into(),
            ca_pem: Vec::new(),
            credentials: Credentials::Anonymous,
            also_at: Vec::new(),
        };
        let (registry, rx) = watch::channel(Some(std::sync::Arc::new(grant)));
        let feed = ControlFeed {
            tx: watch::channel(BTreeSet::new()).0,
            configured: BTreeSet::new(),
            registry: Some(registry),
        };
        let mut peers = set(&["c1", "c2", "c3"], &["w1"]);
        for (p, ip) in peers
            .peers
            .iter_mut()
            .zip(["10.90.0.1", "10.90.0.2", "", "10.90.1.1"])
        {
            p.mesh_ip = ip.into();
        }
        feed.take(&peers);
        let also = rx.borrow().as_ref().unwrap().also_at.clone();
        assert_eq!(
            also,
            ["10.90.0.2:5000"],
            "control peers only, the join's own left out"
        );
        assert!(rx.borrow().as_ref().unwrap().serves("10.90.0.2:5000"));
        assert!(
            !rx.borrow().as_ref().unwrap().serves("10.90.1.1:5000"),
            "a worker is no registry"
        );
    }
}
