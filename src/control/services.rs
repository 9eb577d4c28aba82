//! The node-side services that run beside the sync stream once a node is
//! enrolled: the node API server and the route snapshot watch.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::proto::cluster::RouteSnapshot;

use super::routes::{self, RoutesConfig};
use super::sync::SyncConfig;
use crate::node_api::{NodeApi, NodeContext};

/// What [`spawn`] started: the route snapshots, and the tasks, for the
/// agent to own.
#[derive(Debug)]
pub struct Services {
    pub routes: watch::Receiver<Option<Arc<RouteSnapshot>>>,
    pub tasks: Vec<(&'static str, JoinHandle<()>)>,
}

/// Starts the node API on each of `listen` (serving `node`) and the route watch for the node
/// `sync` describes. Neither failing stops the agent: the sync stream matters more.
pub async fn spawn(
    sync: &SyncConfig,
    listen: &[SocketAddr],
    node: NodeContext,
    controls: crate::node_api::ControlIds,
    metrics: Arc<crate::telemetry::AgentMetrics>,
) -> Services {
    let mut tasks = Vec::new();
    for &listen in listen {
        match NodeApi::bind_current(
            listen,
            sync.tls.clone(),
            Some(node.clone()),
            controls.clone(),
        )
        .await
        {
            Ok(api) => {
                let api = api.with_metrics(Arc::clone(&metrics));
                tracing::info!(%listen, "node API listening");
                let server = tokio::spawn(async move {
                    if let Err(e) = api.serve().await {
                        tracing::error!(error = %e, "node API stopped");
                    }
                });
                tasks.push(("node API", server));
            }
            Err(e) => tracing::error!(error = %e, "node API unavailable"),
        }
    }

    let (tx, rx) = watch::channel(None);
    let cfg = RoutesConfig {
        control_addr: sync.control_addr.clone(),
        targets: sync.targets.clone(),
        node_id: sync.node_id.clone(),
        tls: sync.tls.clone(),
        state_file: crate::link::identity::IdentityDir::new(&sync.data_dir)
            .dir()
            .join("routes.pb"),
    };
    match routes::spawn(cfg, tx) {
        Ok(watch) => tasks.push(("route watch", watch)),
        Err(e) => tracing::error!(error = %e, "route watch unavailable"),
    }
    Services { routes: rx, tasks }
}
