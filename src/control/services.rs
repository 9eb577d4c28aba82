//! The node-side services that run beside the sync stream once a node is
//! enrolled: the node API server and the route snapshot watch.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::watch;

use crate::proto::cluster::RouteSnapshot;

use super::node_api::{DEFAULT_PORT, NodeApi};
use super::routes::{self, RoutesConfig};
use super::sync::SyncConfig;

/// Overrides the node API's listen address (`0.0.0.0:8444` by default),
/// e.g. for several agents on one host.
pub const NODE_API_ENV: &str = "ZATTERA_NODE_API_LISTEN";

/// Starts the node API and the route watch for the node `sync` describes.
/// Neither failing stops the agent: the sync stream matters more.
pub async fn spawn(sync: &SyncConfig) -> watch::Receiver<Option<Arc<RouteSnapshot>>> {
    let listen = std::env::var(NODE_API_ENV)
        .ok()
        .and_then(|v| {
            v.parse::<SocketAddr>()
                .map_err(|e| tracing::error!(%v, error = %e, "{NODE_API_ENV}: not an address"))
                .ok()
        })
        .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], DEFAULT_PORT)));
    match NodeApi::bind(listen, &sync.tls).await {
        Ok(api) => {
            tracing::info!(%listen, "node API listening");
            tokio::spawn(async move {
                if let Err(e) = api.serve().await {
                    tracing::error!(error = %e, "node API stopped");
                }
            });
        }
        Err(e) => tracing::error!(error = %e, "node API unavailable"),
    }

    let (tx, rx) = watch::channel(None);
    let cfg = RoutesConfig {
        control_addr: sync.control_addr.clone(),
        node_id: sync.node_id.clone(),
        tls: sync.tls.clone(),
        state_file: super::identity::IdentityDir::new(&sync.data_dir)
            .dir()
            .join("routes.pb"),
    };
    if let Err(e) = routes::spawn(cfg, tx) {
        tracing::error!(error = %e, "route watch unavailable");
    }
    rx
}
