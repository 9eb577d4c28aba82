//! A BuildKit session: the client side of `Control.Session`. The call's
//! byte stream carries one HTTP/2 connection on which the *daemon* is the
//! gRPC client and this side serves `FileSync.DiffCopy` (the build's
//! local directories), `Auth.Credentials` (the one registry credential,
//! held in memory) and `Health.Check`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use bollard_buildkit_proto::fsutil::types::{Packet, packet::PacketType};
use bollard_buildkit_proto::health::health_server::{Health, HealthServer};
use bollard_buildkit_proto::health::{
    HealthCheckRequest, HealthCheckResponse, HealthListRequest, HealthListResponse,
    health_check_response::ServingStatus,
};
use bollard_buildkit_proto::moby::buildkit::v1::BytesMessage;
use bollard_buildkit_proto::moby::buildkit::v1::control_client::ControlClient;
use bollard_buildkit_proto::moby::filesync::v1::auth_server::{Auth, AuthServer};
use bollard_buildkit_proto::moby::filesync::v1::file_sync_server::{FileSync, FileSyncServer};
use bollard_buildkit_proto::moby::filesync::v1::{
    CredentialsRequest, CredentialsResponse, FetchTokenRequest, FetchTokenResponse,
    GetTokenAuthorityRequest, GetTokenAuthorityResponse, VerifyTokenAuthorityRequest,
    VerifyTokenAuthorityResponse,
};
use futures::{Stream, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

use super::filesync::{Filter, Sender};
use crate::image_build::RegistryAuth;

/// What this session exposes, announced in the call's headers.
const METHODS: [&str; 6] = [
    "/moby.filesync.v1.FileSync/DiffCopy",
    "/moby.filesync.v1.Auth/Credentials",
    "/moby.filesync.v1.Auth/FetchToken",
    "/moby.filesync.v1.Auth/GetTokenAuthority",
    "/moby.filesync.v1.Auth/VerifyTokenAuthority",
    "/grpc.health.v1.Health/Check",
];

/// An open session; dropping it closes the call and stops serving.
#[derive(Debug)]
pub struct Session {
    pub id: String,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Session {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The key the daemon caches this node's build contexts under.
const SHARED_KEY: &str = "zattera-build-context";

/// Opens a session serving `dirs` (local name → directory) and `auth`.
pub fn open(
    control: &ControlClient<Channel>,
    dirs: HashMap<String, PathBuf>,
    auth: Vec<RegistryAuth>,
) -> Result<Session, Status> {
    let id = super::random_id();
    let (ours, theirs) = tokio::io::duplex(1 << 20);
    let (out_tx, out_rx) = mpsc::channel::<BytesMessage>(64);
    let mut req = Request::new(ReceiverStream::new(out_rx));
    let md = req.metadata_mut();
    let value = |s: &str| {
        s.parse::<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>()
            .map_err(|e| Status::internal(format!("session header: {e}")))
    };
    md.insert("x-docker-expose-session-uuid", value(&id)?);
    md.insert("x-docker-expose-session-name", value("zattera-build")?);
    // The daemon keeps a build's local sources under (name, this key) and
    // syncs the next session's into that copy, sending only the files whose
    // size, mode or time changed (the unpack keeps times). A key per session
    // would send every file of every build. The sync leaves exactly the new
    // context, and a copy in use by one build is never handed to another.
    md.insert("x-docker-expose-session-sharedkey", value(SHARED_KEY)?);
    for m in METHODS {
        md.append("x-docker-expose-session-grpc-method", value(m)?);
    }
    let mut control = control.clone();
    let (mut read_half, mut write_half) = tokio::io::split(theirs);
    let mut tasks = Vec::new();
    // The call runs on its own task: its response headers come only once
    // the daemon dials through it.
    tasks.push(tokio::spawn(async move {
        let Ok(resp) = control.session(req).await else {
            return;
        };
        let mut incoming = resp.into_inner();
        while let Ok(Some(msg)) = incoming.message().await {
            if write_half.write_all(&msg.data).await.is_err() {
                return;
            }
        }
        let _ = write_half.shutdown().await;
    }));
    tasks.push(tokio::spawn(async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            match read_half.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let msg = BytesMessage {
                        data: buf[..n].to_vec(),
                    };
                    if out_tx.send(msg).await.is_err() {
                        return;
                    }
                }
            }
        }
    }));
    let files = Files {
        dirs: Arc::new(dirs),
    };
    let creds = Credentials {
        registries: Arc::new(auth),
    };
    tasks.push(tokio::spawn(async move {
        // One connection, never a second: the incoming stream stays open
        // so the server keeps serving it until the session is dropped.
        let incoming = futures::stream::once(async move { Ok::<_, std::io::Error>(ours) })
            .chain(futures::stream::pending());
        let served = tonic::transport::Server::builder()
            .add_service(FileSyncServer::new(files))
            .add_service(AuthServer::new(creds))
            .add_service(HealthServer::new(Alive))
            .serve_with_incoming(incoming)
            .await;
        if let Err(e) = served {
            tracing::debug!(error = %e, "build session ended");
        }
    }));
    Ok(Session { id, tasks })
}

type PacketStream = Pin<Box<dyn Stream<Item = Result<Packet, Status>> + Send>>;

#[derive(Debug, Clone)]
struct Files {
    dirs: Arc<HashMap<String, PathBuf>>,
}

fn header_list(md: &tonic::metadata::MetadataMap, key: &str) -> Vec<String> {
    let encoded = md
        .get(format!("{key}-encoded"))
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == "true" || v == "1");
    md.get_all(key)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(|v| {
            if encoded {
                url::form_urlencoded::parse(format!("x={v}").as_bytes())
                    .next()
                    .map_or_else(|| v.to_owned(), |(_, d)| d.into_owned())
            } else {
                v.to_owned()
            }
        })
        .collect()
}

#[tonic::async_trait]
impl FileSync for Files {
    type DiffCopyStream = PacketStream;
    type TarStreamStream = PacketStream;

    async fn diff_copy(
        &self,
        request: Request<Streaming<Packet>>,
    ) -> Result<Response<Self::DiffCopyStream>, Status> {
        let md = request.metadata();
        let name = header_list(md, "dir-name")
            .into_iter()
            .next()
            .unwrap_or_default();
        let dir = self
            .dirs
            .get(&name)
            .cloned()
            .ok_or_else(|| Status::not_found(format!("no access allowed to dir {name:?}")))?;
        let mut includes = header_list(md, "include-patterns");
        includes.extend(header_list(md, "followpaths"));
        let excludes = header_list(md, "exclude-patterns");
        let filter = Filter::new(&includes, &excludes).map_err(Status::invalid_argument)?;
        let mut from_daemon = request.into_inner();
        let (tx, rx) = mpsc::channel::<Result<Packet, Status>>(64);
        tokio::spawn(async move {
            let start = tokio::task::spawn_blocking(move || Sender::start(&dir, &filter)).await;
            let (stats, sender) = match start {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    let _ = tx.send(Ok(error_packet(&e.to_string()))).await;
                    return;
                }
                Err(e) => {
                    let _ = tx.send(Ok(error_packet(&e.to_string()))).await;
                    return;
                }
            };
            for p in stats {
                if tx.send(Ok(p)).await.is_err() {
                    return;
                }
            }
            let sender = Arc::new(std::sync::Mutex::new(sender));
            while let Ok(Some(p)) = from_daemon.message().await {
                match PacketType::try_from(p.r#type) {
                    Ok(PacketType::PacketReq) => {
                        let (sender, body_tx) = (Arc::clone(&sender), tx.clone());
                        let sent = tokio::task::spawn_blocking(move || {
                            let Ok(mut s) = sender.lock() else {
                                return Err("sender poisoned".to_owned());
                            };
                            s.body(p.id, |packet| body_tx.blocking_send(Ok(packet)).is_ok())
                        })
                        .await;
                        if let Ok(Err(e)) | Err(e) = sent.map_err(|e| e.to_string()) {
                            let _ = tx.send(Ok(error_packet(&e))).await;
                            return;
                        }
                    }
                    Ok(PacketType::PacketFin) => {
                        let _ = tx
                            .send(Ok(Packet {
                                r#type: PacketType::PacketFin as i32,
                                ..Packet::default()
                            }))
                            .await;
                        return;
                    }
                    Ok(PacketType::PacketErr) => {
                        tracing::warn!(
                            error = %String::from_utf8_lossy(&p.data),
                            "BuildKit could not receive the build context"
                        );
                        return;
                    }
                    _ => {}
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn tar_stream(
        &self,
        _request: Request<Streaming<Packet>>,
    ) -> Result<Response<Self::TarStreamStream>, Status> {
        Err(Status::unimplemented("TarStream is not offered"))
    }
}

fn error_packet(text: &str) -> Packet {
    Packet {
        r#type: PacketType::PacketErr as i32,
        data: text.as_bytes().to_vec(),
        ..Packet::default()
    }
}

/// The single credential of the build, for its registry only.
#[derive(Clone)]
struct Credentials {
    registries: Arc<Vec<RegistryAuth>>,
}

#[tonic::async_trait]
impl Auth for Credentials {
    async fn credentials(
        &self,
        request: Request<CredentialsRequest>,
    ) -> Result<Response<CredentialsResponse>, Status> {
        let host = request.into_inner().host;
        let found = self.registries.iter().find(|r| r.host == host);
        Ok(Response::new(match found {
            Some(r) if !r.username.is_empty() => CredentialsResponse {
                username: r.username.clone(),
                secret: r.password.clone(),
            },
            _ => CredentialsResponse::default(),
        }))
    }
    // No token authority: the daemon falls back to the basic credential.
    async fn fetch_token(
        &self,
        _request: Request<FetchTokenRequest>,
    ) -> Result<Response<FetchTokenResponse>, Status> {
        Err(Status::unimplemented("no token service"))
    }
    async fn get_token_authority(
        &self,
        _request: Request<GetTokenAuthorityRequest>,
    ) -> Result<Response<GetTokenAuthorityResponse>, Status> {
        Err(Status::unimplemented("no token authority"))
    }
    async fn verify_token_authority(
        &self,
        _request: Request<VerifyTokenAuthorityRequest>,
    ) -> Result<Response<VerifyTokenAuthorityResponse>, Status> {
        Err(Status::unimplemented("no token authority"))
    }
}

#[derive(Debug, Clone, Copy)]
struct Alive;

#[tonic::async_trait]
impl Health for Alive {
    type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

    async fn check(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        Ok(Response::new(HealthCheckResponse {
            status: ServingStatus::Serving as i32,
        }))
    }
    async fn list(
        &self,
        _request: Request<HealthListRequest>,
    ) -> Result<Response<HealthListResponse>, Status> {
        Err(Status::unimplemented("List"))
    }
    async fn watch(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let once = HealthCheckResponse {
            status: ServingStatus::Serving as i32,
        };
        Ok(Response::new(Box::pin(
            futures::stream::once(async move { Ok(once) }).chain(futures::stream::pending()),
        )))
    }
}
