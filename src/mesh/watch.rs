//! `MeshService.WatchPeers` (wire.md Appendix A), kept open on the control
//! leader like the route watch: every `PeerSet` is persisted, applied to
//! the interface, and its `leader_node_id` moves the control targets that
//! sync, routes and this watch itself dial.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::ClientConfig;
use tokio::sync::watch;
use zattera_mesh::Backend;

use super::{NodeMesh, peers};
use crate::control::follow;
use crate::control::target::{Dialer, Targets};
use crate::control::tls::{self, CurrentTls};
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
