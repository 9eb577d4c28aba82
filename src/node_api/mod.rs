//! The node API server: `AgentLocalService`, which control dials on port
//! 8444 (wire.md §1.5), on every node (§9 item 2).
//!
//! Stricter than the reference (DESIGN.md decision 7, AGENT-4): the TLS
//! handshake requires a client certificate chaining to the cluster CA, and
//! every call requires the `zattera://node/` identity of a control-plane
//! node ([`ControlIds`]: the `is_control` peers of the latest peer set, and
//! any `control-node-ids` configured). A worker's certificate is as valid as
//! control's in the handshake, and is refused here with PERMISSION_DENIED:
//! one enrolled node must not drive another. HTTP/2 keepalive pings find a
//! dead caller, so its exec sessions and log follows end.
//!
//! Served: `QueryLogs` ([`crate::logs::query`]), `Exec` ([`exec`]), `Top`
//! ([`crate::runtime::top`]),
//! `Stats` (from [`crate::metrics::store`]), `ProxyTCP` ([`proxy`]),
//! `ListVolumeFiles`, `ReadVolumeFile`, `RemoveVolume`
//! ([`crate::volumes::files`]),
//! `SnapshotVolume`, `RestoreVolume` ([`snapshot`]) and `UpgradeBinary`
//! ([`crate::upgrade`]), `RunBuild` and `CancelBuild` ([`build`]) on a node with a
//! builder. The others (`WriteVolumeFile`) answer
//! UNIMPLEMENTED naming the missing capability,
//! which is what control expects from a node lacking an RPC.

pub mod build;
pub mod codes;
pub mod exec;
pub mod observe;
pub mod proxy;
pub mod snapshot;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio::sync::watch;
use tonic::{Request, Response, Status, Streaming};

use crate::proto::cluster::AssignmentSet;
use crate::proto::cluster::agent_local_service_server::{
    AgentLocalService, AgentLocalServiceServer,
};
use crate::proto::cluster::{
    AgentExecInput, AgentExecOutput, AgentListFilesRequest, AgentListFilesResponse,
    AgentReadFileRequest, AgentRemoveVolumeRequest, AgentRemoveVolumeResponse,
    AgentRestoreVolumeRequest, AgentSnapshotVolumeRequest, AgentTopRequest, AgentTopResponse,
    AgentUpgradeRequest, AgentUpgradeResponse, AgentWriteFileChunk, AgentWriteFileResponse,
    BuildEvent, CancelBuildRequest, CancelBuildResponse, RunBuildRequest, TcpChunk,
    VolumeOpProgress,
};
use crate::proto::v1::{LogLine, LogQuery, StatsQuery, StatsResponse};
use crate::runtime::Containerd;

use crate::link::tls::{self, ClientAuth, CurrentTls, NodeTls, PeerIdentity, TlsError};

#[derive(Debug, thiserror::Error)]
pub enum NodeApiError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("node API: cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// The node ids allowed to call the node API: control-plane nodes.
pub type ControlIds = watch::Receiver<BTreeSet<String>>;

/// Why the node API would refuse every caller, if it would: no control
/// node id is known, from the join or `control-node-ids`, and no peer set
/// will name one (the mesh is off). Said by `join`, `doctor`, `status` and
/// the log, naming the key that fixes it.
pub fn refuses_everyone(
    joined: &[String],
    configured: &[String],
    mesh_enabled: bool,
) -> Option<String> {
    (joined.is_empty() && configured.is_empty() && !mesh_enabled).then(|| {
        "the node API refuses every caller: no control-plane node id is known (this cluster \
         has no mesh, so no peer set names them); set control-node-ids = [\"<control node \
         id>\", ...] in agent.toml, or join again with --control-node-id"
            .to_owned()
    })
}

/// A fixed set of control ids (configuration, tests).
pub fn control_ids<S: Into<String>>(ids: impl IntoIterator<Item = S>) -> ControlIds {
    watch::channel(ids.into_iter().map(Into::into).collect()).1
}

/// What the served methods read: the node's containerd, the executor's
/// current set and status, the data dir (logs live under it), the run dir
/// (exec FIFOs), and the metrics store.
#[derive(Debug, Clone)]
pub struct NodeContext {
    pub ctd: Containerd,
    pub desired: watch::Receiver<Option<AssignmentSet>>,
    /// What port-forwards may reach (PX-3).
    pub targets: proxy::Targets,
    pub data_dir: PathBuf,
    pub run_dir: PathBuf,
    pub node_id: String,
    pub stats: Option<Arc<std::sync::Mutex<crate::metrics::store::Store>>>,
    pub upgrade: crate::upgrade::UpgradeConfig,
    /// The builder, or why this node has none (UNIMPLEMENTED).
    pub builder: Result<build::Builder, crate::image_build::NoBuilder>,
}

/// A bound node API server; [`Self::serve`] runs it.
#[derive(Debug)]
pub struct NodeApi {
    listener: tokio::net::TcpListener,
    tls: tokio::sync::watch::Receiver<Arc<rustls::ServerConfig>>,
    node: Option<NodeContext>,
    controls: ControlIds,
    metrics: Arc<crate::telemetry::AgentMetrics>,
}

/// Serves the node API on each of `listen` (serving `node`, callers
/// presenting `tls`'s CA and named in `controls`); the server tasks, for
/// the agent to own. A listener that cannot bind is logged: the sync
/// stream matters more than this door.
pub async fn spawn_servers(
    listen: &[SocketAddr],
    tls: CurrentTls,
    node: NodeContext,
    controls: ControlIds,
    metrics: Arc<crate::telemetry::AgentMetrics>,
) -> Vec<(&'static str, tokio::task::JoinHandle<()>)> {
    let mut tasks = Vec::new();
    for &listen in listen {
        match NodeApi::bind_current(listen, tls.clone(), Some(node.clone()), controls.clone()).await
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
    tasks
}

impl NodeApi {
    /// Calls are counted into `metrics` (by method and code).
    #[must_use]
    pub fn with_metrics(mut self, metrics: Arc<crate::telemetry::AgentMetrics>) -> Self {
        self.metrics = metrics;
        self
    }

    /// Binds `addr` with the node certificate; clients must present one of
    /// the cluster CA, naming a node in `controls`. Without `node` (no
    /// runtime) every method declines.
    pub async fn bind(
        addr: SocketAddr,
        identity: &NodeTls,
        node: Option<NodeContext>,
        controls: ControlIds,
    ) -> Result<Self, NodeApiError> {
        Self::bind_current(addr, tls::fixed(identity.clone()), node, controls).await
    }

    /// [`Self::bind`] presenting the node certificate as it is renewed.
    pub async fn bind_current(
        addr: SocketAddr,
        mut identity: CurrentTls,
        node: Option<NodeContext>,
        controls: ControlIds,
    ) -> Result<Self, NodeApiError> {
        let server_config = |id: &NodeTls| {
            tls::server(&id.cert_pem, &id.key_pem, ClientAuth::Required(&id.ca_pem)).map(Arc::new)
        };
        let (tls_tx, tls) =
            tokio::sync::watch::channel(server_config(&identity.borrow_and_update())?);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tls_tx.closed() => return,
                    () = tls::renewed(&mut identity) => {}
                }
                match server_config(&identity.borrow_and_update()) {
                    Ok(cfg) => {
                        tls_tx.send_replace(cfg);
                        tracing::info!("node API presents the renewed certificate");
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "renewed identity unusable for the node API");
                    }
                }
            }
        });
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| NodeApiError::Bind { addr, source })?;
        if let Some(n) = &node {
            // Exec sessions do not outlive the process that served them:
            // FIFOs left by a crash are stale.
            let _ = std::fs::remove_dir_all(n.run_dir.join("exec"));
        }
        Ok(Self {
            listener,
            tls,
            node,
            controls,
            metrics: Arc::default(),
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves until the task is dropped.
    pub async fn serve(self) -> Result<(), tonic::transport::Error> {
        tonic::transport::Server::builder()
            // A caller that vanished (a dead control connection) is found
            // within 30 s, and its streams end.
            .http2_keepalive_interval(Some(Duration::from_secs(15)))
            .http2_keepalive_timeout(Some(Duration::from_secs(15)))
            .layer(observe::ObserveLayer(self.metrics))
            .add_service(AgentLocalServiceServer::new(Service {
                node: self.node,
                controls: self.controls,
            }))
            .serve_with_incoming(tls::incoming_current(self.listener, self.tls))
            .await
    }
}

#[derive(Debug, Clone)]
struct Service {
    node: Option<NodeContext>,
    controls: ControlIds,
}

impl Service {
    /// The caller, checked, and the node context the method needs.
    fn serving<T>(&self, req: &Request<T>, capability: &str) -> Result<&NodeContext, Status> {
        let caller = self.authorize(req)?;
        tracing::debug!(%caller, capability, "node API call");
        self.node.as_ref().ok_or_else(|| {
            Status::unimplemented(format!("{capability}: this node has no container runtime"))
        })
    }

    /// The caller must be a control-plane node of the cluster (its
    /// certificate's URI SAN, and the control ids this node knows).
    fn authorize<T>(&self, req: &Request<T>) -> Result<String, Status> {
        let caller = req
            .extensions()
            .get::<PeerIdentity>()
            .and_then(|p| p.node_id.clone())
            .ok_or_else(|| {
                Status::permission_denied(
                    "node API: the client certificate carries no zattera://node/ identity",
                )
            })?;
        if self.controls.borrow().contains(&caller) {
            Ok(caller)
        } else {
            tracing::warn!(%caller, "node API call from a node that is not a control-plane node: refused");
            Err(Status::permission_denied(format!(
                "node API: node {caller} is not a control-plane node; only control may call this API"
            )))
        }
    }

    /// Checks the caller, then declines: `capability` has not landed here.
    fn declined<T, R>(&self, req: &Request<T>, capability: &str) -> Result<R, Status> {
        let caller = self.authorize(req)?;
        tracing::debug!(%caller, capability, "node API call for a capability not implemented");
        Err(Status::unimplemented(format!(
            "{capability} is not implemented on this node yet"
        )))
    }
}

pub(crate) type Out<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl AgentLocalService for Service {
    type QueryLogsStream = Out<LogLine>;
    type ExecStream = Out<AgentExecOutput>;
    type ProxyTCPStream = Out<TcpChunk>;
    type RunBuildStream = Out<BuildEvent>;
    type SnapshotVolumeStream = Out<VolumeOpProgress>;
    type RestoreVolumeStream = Out<VolumeOpProgress>;
    type ReadVolumeFileStream = Out<TcpChunk>;

    async fn query_logs(
        &self,
        req: Request<LogQuery>,
    ) -> Result<Response<Self::QueryLogsStream>, Status> {
        let node = self.serving(&req, "log query (QueryLogs)")?;
        let lines = crate::logs::query::query_logs(
            &node.ctd,
            &node.data_dir,
            &node.desired,
            req.into_inner(),
        )
        .await
        .map_err(|e| codes::query(&e))?;
        Ok(Response::new(Box::pin(futures::StreamExt::map(lines, Ok))))
    }
    async fn exec(
        &self,
        req: Request<Streaming<AgentExecInput>>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let node = self.serving(&req, "exec (Exec)")?;
        Ok(Response::new(exec::exec(node, req.into_inner()).await?))
    }
    async fn top(
        &self,
        req: Request<AgentTopRequest>,
    ) -> Result<Response<AgentTopResponse>, Status> {
        let node = self.serving(&req, "process listing (Top)")?;
        let id = req.into_inner().container_id;
        let top = crate::runtime::top::top(&node.ctd, &id)
            .await
            .map_err(|e| codes::top(&e))?;
        Ok(Response::new(top))
    }
    async fn stats(&self, req: Request<StatsQuery>) -> Result<Response<StatsResponse>, Status> {
        let node = self.serving(&req, "metrics store (Stats)")?;
        let store = node
            .stats
            .as_ref()
            .ok_or_else(|| Status::unimplemented("Stats: this node keeps no metrics"))?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let answer = store
            .lock()
            .map_err(|_| Status::internal("Stats: the metrics store is unusable"))?
            .query(req.get_ref(), &node.node_id, now);
        Ok(Response::new(answer))
    }
    async fn proxy_tcp(
        &self,
        req: Request<Streaming<TcpChunk>>,
    ) -> Result<Response<Self::ProxyTCPStream>, Status> {
        let node = self.serving(&req, "port-forward (ProxyTCP)")?;
        Ok(Response::new(
            proxy::proxy_tcp(&node.targets, req.into_inner()).await?,
        ))
    }
    async fn run_build(
        &self,
        req: Request<RunBuildRequest>,
    ) -> Result<Response<Self::RunBuildStream>, Status> {
        let node = self.serving(&req, "image builds (RunBuild)")?;
        let builder = node
            .builder
            .as_ref()
            .map_err(|why| Status::unimplemented(format!("RunBuild: {why}")))?;
        Ok(Response::new(build::run_build(builder, req.into_inner())?))
    }
    async fn cancel_build(
        &self,
        req: Request<CancelBuildRequest>,
    ) -> Result<Response<CancelBuildResponse>, Status> {
        let node = self.serving(&req, "image builds (CancelBuild)")?;
        let builder = node
            .builder
            .as_ref()
            .map_err(|why| Status::unimplemented(format!("CancelBuild: {why}")))?;
        Ok(Response::new(build::cancel_build(builder, req.get_ref())))
    }
    async fn snapshot_volume(
        &self,
        req: Request<AgentSnapshotVolumeRequest>,
    ) -> Result<Response<Self::SnapshotVolumeStream>, Status> {
        let node = self.serving(&req, "volume snapshots (SnapshotVolume)")?;
        Ok(Response::new(snapshot::snapshot(node, req.into_inner())))
    }
    async fn restore_volume(
        &self,
        req: Request<AgentRestoreVolumeRequest>,
    ) -> Result<Response<Self::RestoreVolumeStream>, Status> {
        let node = self.serving(&req, "volume restores (RestoreVolume)")?;
        Ok(Response::new(snapshot::restore(node, req.into_inner())))
    }
    async fn list_volume_files(
        &self,
        req: Request<AgentListFilesRequest>,
    ) -> Result<Response<AgentListFilesResponse>, Status> {
        let node = self.serving(&req, "volume files (ListVolumeFiles)")?;
        let listing = crate::volumes::files::list(&node.data_dir, req.into_inner())
            .await
            .map_err(|e| codes::volume(&e))?;
        Ok(Response::new(listing))
    }
    async fn read_volume_file(
        &self,
        req: Request<AgentReadFileRequest>,
    ) -> Result<Response<Self::ReadVolumeFileStream>, Status> {
        let node = self.serving(&req, "volume files (ReadVolumeFile)")?;
        let chunks = crate::volumes::files::read(&node.data_dir, req.into_inner())
            .await
            .map_err(|e| codes::volume(&e))?;
        Ok(Response::new(Box::pin(futures::StreamExt::map(
            chunks,
            |c| {
                c.map(|data| TcpChunk {
                    data,
                    dial_addr: String::new(),
                })
                .map_err(|e| codes::volume(&e))
            },
        ))))
    }
    async fn write_volume_file(
        &self,
        req: Request<Streaming<AgentWriteFileChunk>>,
    ) -> Result<Response<AgentWriteFileResponse>, Status> {
        self.declined(&req, "volume files (WriteVolumeFile)")
    }
    async fn remove_volume(
        &self,
        req: Request<AgentRemoveVolumeRequest>,
    ) -> Result<Response<AgentRemoveVolumeResponse>, Status> {
        let node = self.serving(&req, "volumes (RemoveVolume)")?;
        let r = req.into_inner();
        crate::volumes::files::remove(&node.ctd, &node.data_dir, &r.environment_id, &r.volume_name)
            .await
            .map_err(|e| codes::volume(&e))?;
        Ok(Response::new(AgentRemoveVolumeResponse {}))
    }
    async fn upgrade_binary(
        &self,
        req: Request<AgentUpgradeRequest>,
    ) -> Result<Response<AgentUpgradeResponse>, Status> {
        let node = self.serving(&req, "self-upgrade (UpgradeBinary)")?;
        Ok(Response::new(
            crate::upgrade::upgrade(&node.upgrade, req.into_inner())
                .await
                .map_err(|e| codes::upgrade(&e))?,
        ))
    }
}
