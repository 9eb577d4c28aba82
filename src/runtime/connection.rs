//! The gRPC connection to containerd, scoped to one namespace.
//!
//! Every request built here carries `containerd-namespace`, so no call can
//! wander into another namespace (Docker's `moby`, CRI's `k8s.io`). The channel
//! reconnects by itself when containerd restarts; a call made while containerd
//! is down fails with [`RuntimeError::Unavailable`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use containerd_client::services::v1::{
    containers_client::ContainersClient, content_client::ContentClient, diff_client::DiffClient,
    events_client::EventsClient, images_client::ImagesClient,
    introspection_client::IntrospectionClient, leases_client::LeasesClient,
    namespaces_client::NamespacesClient, snapshots::snapshots_client::SnapshotsClient,
    tasks_client::TasksClient, version_client::VersionClient,
};
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};

use super::digest::Digest;
use super::error::RuntimeError;
use super::names::Namespace;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// A connection to containerd in one namespace. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Containerd {
    channel: Channel,
    namespace: Namespace,
    socket: PathBuf,
    /// One writer per blob at a time, across this connection's clones.
    ingests: IngestLocks,
}

impl Containerd {
    pub(crate) fn ingests(&self) -> &IngestLocks {
        &self.ingests
    }

    /// Connects and checks that containerd answers, so that a wrong socket is
    /// reported once, clearly, instead of on the first real call.
    pub async fn connect(socket: &Path, namespace: Namespace) -> Result<Self, RuntimeError> {
        let this = Self::lazy(socket, namespace);
        this.answers().await?;
        Ok(this)
    }

    /// A connection that dials on first use and checks nothing: the agent
    /// holds one from its start, whether containerd is up or not (W-2).
    pub fn lazy(socket: &Path, namespace: Namespace) -> Self {
        let path = socket.to_path_buf();
        // The URI is required by tonic but unused: the connector dials the socket.
        let channel = Endpoint::from_static("http://containerd.invalid")
            // No per-request timeout on the channel: event streams and task
            // waits are long-lived. Callers bound what must be bounded.
            .connect_timeout(CONNECT_TIMEOUT)
            .connect_with_connector_lazy(tower::service_fn(move |_| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }));
        Self {
            channel,
            namespace,
            socket: socket.to_path_buf(),
            ingests: IngestLocks::default(),
        }
    }

    /// Whether containerd answers on this socket now; the error says why
    /// not (no socket, not a socket, no answer).
    pub async fn answers(&self) -> Result<(), RuntimeError> {
        let unavailable = |reason: String| RuntimeError::Unavailable {
            socket: self.socket.clone(),
            reason,
        };
        match std::fs::metadata(&self.socket) {
            Ok(m) if !std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => {
                return Err(unavailable("not a unix socket".into()));
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(unavailable(
                    "no such socket: is containerd running? (set --containerd-address)".into(),
                ));
            }
            Err(e) => return Err(unavailable(e.to_string())),
        }
        let version = self.version().await?;
        tracing::debug!(socket = %self.socket.display(), %version, "connected to containerd");
        Ok(())
    }

    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    /// containerd's version string (`1.6.20~ds1`).
    pub async fn version(&self) -> Result<String, RuntimeError> {
        let reply = tokio::time::timeout(
            CONNECT_TIMEOUT,
            VersionClient::new(self.channel.clone()).version(()),
        )
        .await
        .map_err(|_| RuntimeError::Unavailable {
            socket: self.socket.clone(),
            reason: format!("no answer within {CONNECT_TIMEOUT:?}"),
        })?
        .map_err(|status| RuntimeError::Unavailable {
            socket: self.socket.clone(),
            reason: describe_connect_failure(&status),
        })?;
        Ok(reply.into_inner().version)
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// A request in this connection's namespace.
    pub fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(message);
        // Namespaces are validated identifiers, so they are valid header values.
        if let Ok(ns) = MetadataValue::try_from(self.namespace.as_str()) {
            req.metadata_mut().insert("containerd-namespace", ns);
        }
        req
    }

    /// A request in this namespace that also holds `lease`, so what it
    /// creates is protected from garbage collection until the lease goes.
    pub fn leased_request<T>(&self, message: T, lease: &str) -> tonic::Request<T> {
        let mut req = self.request(message);
        if let Ok(l) = MetadataValue::try_from(lease) {
            req.metadata_mut().insert("containerd-lease", l);
        }
        req
    }

    pub fn content(&self) -> ContentClient<Channel> {
        ContentClient::new(self.channel.clone())
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20)
    }

    pub fn introspection(&self) -> IntrospectionClient<Channel> {
        IntrospectionClient::new(self.channel.clone())
    }

    /// The directory of containerd's content store, from the content
    /// plugin's exports: the filesystem images fill.
    pub async fn content_root(&self) -> Result<PathBuf, RuntimeError> {
        let reply = self
            .introspection()
            .plugins(
                self.request(containerd_client::services::v1::PluginsRequest {
                    filters: vec!["type==io.containerd.content.v1".into()],
                }),
            )
            .await
            .map_err(RuntimeError::grpc("introspection: plugins"))?
            .into_inner();
        reply
            .plugins
            .iter()
            .find_map(|p| p.exports.get("root"))
            .map(PathBuf::from)
            .ok_or_else(|| {
                RuntimeError::Invalid("containerd's content plugin exports no root".into())
            })
    }

    pub fn images(&self) -> ImagesClient<Channel> {
        ImagesClient::new(self.channel.clone())
    }

    pub fn snapshots(&self) -> SnapshotsClient<Channel> {
        SnapshotsClient::new(self.channel.clone())
    }

    pub fn diff(&self) -> DiffClient<Channel> {
        DiffClient::new(self.channel.clone())
    }

    pub fn leases(&self) -> LeasesClient<Channel> {
        LeasesClient::new(self.channel.clone())
    }

    pub fn containers(&self) -> ContainersClient<Channel> {
        ContainersClient::new(self.channel.clone())
    }

    pub fn tasks(&self) -> TasksClient<Channel> {
        TasksClient::new(self.channel.clone())
    }

    pub fn events(&self) -> EventsClient<Channel> {
        EventsClient::new(self.channel.clone())
    }

    pub fn namespaces(&self) -> NamespacesClient<Channel> {
        NamespacesClient::new(self.channel.clone())
    }
}

/// Turns tonic's nested transport error into the one cause a person needs.
fn describe_connect_failure(status: &tonic::Status) -> String {
    let mut source: Option<&dyn std::error::Error> = std::error::Error::source(status);
    let mut innermost = None;
    while let Some(s) = source {
        innermost = Some(s.to_string());
        source = s.source();
    }
    innermost.unwrap_or_else(|| status.message().to_owned())
}

/// Per-digest locks on writing a blob. Two pulls of one layer (two images
/// that share it, from two registries) would otherwise share the ingest ref,
/// and each one's clean-up of a stale ingest would abort the other's write:
/// in step, on every retry.
#[derive(Debug, Clone, Default)]
pub struct IngestLocks(
    std::sync::Arc<std::sync::Mutex<HashMap<String, std::sync::Arc<tokio::sync::Mutex<()>>>>>,
);

impl IngestLocks {
    pub(crate) fn of(&self, digest: &Digest) -> std::sync::Arc<tokio::sync::Mutex<()>> {
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        // Locks nobody holds or waits for are dropped as new ones come.
        map.retain(|_, l| std::sync::Arc::strong_count(l) > 1);
        std::sync::Arc::clone(map.entry(digest.to_string()).or_default())
    }
}
