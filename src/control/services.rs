//! The route snapshot watch that runs beside the sync stream once a node
//! is enrolled. (The node API is a door: the agent starts it, with
//! [`crate::node_api::spawn_servers`].)

use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::proto::cluster::RouteSnapshot;

use super::routes::{self, RoutesConfig};
use super::sync::SyncConfig;

/// What [`spawn`] started: the route snapshots, and the task, for the agent
/// to own.
#[derive(Debug)]
pub struct Services {
    pub routes: watch::Receiver<Option<Arc<RouteSnapshot>>>,
    pub tasks: Vec<(&'static str, JoinHandle<()>)>,
}

/// Starts the route watch for the node `sync` describes. Its failing does
/// not stop the agent: the sync stream matters more.
pub fn spawn(sync: &SyncConfig) -> Services {
    let mut tasks = Vec::new();
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
