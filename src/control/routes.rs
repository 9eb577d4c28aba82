//! The route snapshot client (`RouteService.WatchRoutes`, wire.md appendix
//! B; runtime.md W-7).
//!
//! One task keeps the watch open with the node certificate and the sync
//! stream's back-off. Every snapshot is persisted (atomically) before it is
//! published, and the persisted one is published at start, so DNS keeps
//! answering VIPs across agent restarts while control is away. The
//! snapshot's version goes back as `have_version`, letting control skip an
//! unchanged resend.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use prost::Message;
use rustls::ClientConfig;
use tokio::sync::watch;

use crate::proto::cluster::route_service_client::RouteServiceClient;
use crate::proto::cluster::{RouteSnapshot, WatchRoutesRequest};

use crate::link::follow;
use crate::link::target::{Dialer, Targets};
use crate::link::tls::{self, TlsError};

/// What the route client needs.
#[derive(Debug, Clone)]
pub struct RoutesConfig {
    pub control_addr: String,
    pub targets: watch::Receiver<Targets>,
    pub node_id: String,
    pub tls: tls::CurrentTls,
    /// Where the last snapshot is kept, e.g. `<data>/node/routes.pb`.
    pub state_file: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum RoutesError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("control answered {code:?}: {message}", code = .0.code(), message = .0.message())]
    Status(#[from] tonic::Status),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a RouteSnapshot: {source}", path.display())]
    Decode {
        path: PathBuf,
        source: prost::DecodeError,
    },
}

/// The DNS table a snapshot describes: every internal service's VIP.
pub fn name_table(snapshot: &RouteSnapshot) -> zattera_dns::NameTable {
    let services: Vec<zattera_dns::RouteService> = snapshot
        .internal_services
        .iter()
        .map(|s| zattera_dns::RouteService {
            fqdn: s.fqdn.clone(),
            project_id: s.project_id.clone(),
            environment_id: s.environment_id.clone(),
            vip: s.vip.clone(),
        })
        .collect();
    zattera_dns::NameTable::from_routes(&services)
}

/// The persisted snapshot, if there is one.
pub fn load(path: &Path) -> Result<Option<RouteSnapshot>, RoutesError> {
    match std::fs::read(path) {
        // An empty file decodes as a valid empty snapshot, which would
        // answer NXDOMAIN for every VIP: it is what a cut can leave of an
        // unsynced write, never a snapshot control sent (58.10).
        Ok(bytes) if bytes.is_empty() => {
            let aside = crate::durable::set_aside(path);
            tracing::warn!(path = %path.display(), aside = ?aside, "an empty route snapshot file is not a snapshot; set aside");
            Ok(None)
        }
        Ok(bytes) => RouteSnapshot::decode(bytes.as_slice())
            .map(Some)
            .map_err(|source| RoutesError::Decode {
                path: path.to_owned(),
                source,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(RoutesError::Io {
            path: path.to_owned(),
            source,
        }),
    }
}

fn store(path: &Path, snapshot: &RouteSnapshot) -> Result<(), RoutesError> {
    let io = |source| RoutesError::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    crate::durable::write(path, &snapshot.encode_to_vec(), 0o600).map_err(io)
}

/// Starts the client; `out` gets the persisted snapshot at once (if any),
/// then every snapshot control sends.
pub fn spawn(
    cfg: RoutesConfig,
    out: watch::Sender<Option<Arc<RouteSnapshot>>>,
) -> Result<tokio::task::JoinHandle<()>, TlsError> {
    tls::node_client(&cfg.tls.borrow())?;
    tls::server_name_of(&cfg.control_addr)?;
    Ok(tokio::spawn(run(cfg, out)))
}

async fn run(cfg: RoutesConfig, out: watch::Sender<Option<Arc<RouteSnapshot>>>) {
    match load(&cfg.state_file) {
        Ok(Some(snapshot)) => {
            tracing::info!(
                version = snapshot.version,
                "serving the persisted route snapshot"
            );
            out.send_replace(Some(Arc::new(snapshot)));
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(error = %e, "persisted route snapshot ignored"),
    }
    let cfg = Arc::new(cfg);
    let dialer = Dialer::new(cfg.targets.clone());
    follow::keep_open("route watch", cfg.tls.clone(), dialer, |target, client| {
        session(Arc::clone(&cfg), target, client, out.clone())
    })
    .await;
}

async fn session(
    cfg: Arc<RoutesConfig>,
    target: String,
    client: ClientConfig,
    out: watch::Sender<Option<Arc<RouteSnapshot>>>,
) -> Result<(), RoutesError> {
    let channel = tls::connect(&target, client).await?;
    let have = out.borrow().as_ref().map_or(0, |s| s.version);
    let mut stream = RouteServiceClient::new(channel)
        .max_decoding_message_size(64 * 1024 * 1024)
        .watch_routes(WatchRoutesRequest {
            node_id: cfg.node_id.clone(),
            have_version: have,
        })
        .await?
        .into_inner();
    while let Some(snapshot) = stream.message().await? {
        // Persisted first: what DNS serves must survive a restart.
        if let Err(e) = store(&cfg.state_file, &snapshot) {
            tracing::warn!(error = %e, "route snapshot not persisted");
        }
        tracing::info!(
            version = snapshot.version,
            services = snapshot.internal_services.len(),
            "route snapshot received"
        );
        out.send_replace(Some(Arc::new(snapshot)));
    }
    Ok(())
}

/// Swaps the DNS name table whenever a route snapshot arrives.
pub async fn feed_dns(
    mut routes: watch::Receiver<Option<Arc<RouteSnapshot>>>,
    dns: Arc<zattera_dns::DnsServer>,
) {
    loop {
        let snapshot = routes.borrow_and_update().clone();
        if let Some(snapshot) = snapshot {
            dns.set_table(name_table(&snapshot));
            tracing::info!(version = snapshot.version, "DNS follows route snapshot");
        }
        if routes.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::proto::cluster::InternalService;

    #[test]
    fn snapshot_round_trips_and_builds_the_table() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node/routes.pb");
        assert!(load(&path).unwrap().is_none());
        let snap = RouteSnapshot {
            version: 4,
            internal_services: vec![
                InternalService {
                    fqdn: "web.prod.shop.internal.".into(),
                    project_id: "p1".into(),
                    environment_id: "e1".into(),
                    vip: "10.97.0.5".into(),
                    ports: vec![],
                },
                InternalService {
                    fqdn: "novip.prod.shop.internal.".into(),
                    project_id: "p1".into(),
                    environment_id: "e1".into(),
                    vip: String::new(),
                    ports: vec![],
                },
            ],
            ..RouteSnapshot::default()
        };
        store(&path, &snap).unwrap();
        assert_eq!(load(&path).unwrap(), Some(snap.clone()));
        assert_eq!(name_table(&snap).len(), 1);
        std::fs::write(&path, b"\xff\xff\xff").unwrap();
        assert!(matches!(load(&path), Err(RoutesError::Decode { .. })));
        // 58.10: an empty file (a cut's leftover) is no empty snapshot.
        std::fs::write(&path, b"").unwrap();
        assert_eq!(load(&path).unwrap(), None);
        assert!(!path.exists(), "set aside");
    }
}
