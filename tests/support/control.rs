//! A test control plane: a tonic server on a loopback port with its own CA,
//! serving `JoinService`, `AgentSyncService` and `RouteService` the way
//! wire.md describes control's side. It records what agents send and lets a
//! test push assignment sets and route snapshots, refuse streams, and stop
//! and restart on the same port.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::Stream;
use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use zattera_agent::link::tls::{self, ClientAuth, PeerIdentity};
use zattera_agent::proto::cluster::agent_message::Body;
use zattera_agent::proto::cluster::agent_sync_service_server::{
    AgentSyncService, AgentSyncServiceServer,
};
use zattera_agent::proto::cluster::join_service_server::{JoinService, JoinServiceServer};
use zattera_agent::proto::cluster::route_service_server::{RouteService, RouteServiceServer};
use zattera_agent::proto::cluster::{
    AgentMessage, AssignmentSet, ControlMessage, JoinRequest, JoinResponse, RouteSnapshot,
    WatchRoutesRequest, control_message,
};
use zattera_agent::proto::v1::AssignmentObserved;

/// The node id of the test control plane's own node certificate.
pub const CONTROL_NODE_ID: &str = "control-1";

/// A cluster CA made for one test.
pub struct TestCa {
    issuer: Issuer<'static, KeyPair>,
    pub pem: String,
    pub der: Vec<u8>,
}

impl TestCa {
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).unwrap();
        Self {
            pem: cert.pem(),
            der: cert.der().to_vec(),
            issuer: Issuer::new(params, key),
        }
    }

    /// The join token's CA pin.
    pub fn pin(&self) -> String {
        tls::pin_of(&self.der)
    }

    /// A join token for `secret` pinned to this CA.
    pub fn token(&self, secret: &str) -> String {
        format!("K10{}::{secret}", self.pin())
    }

    /// The control API's certificate (IP SAN 127.0.0.1) and key, the chain
    /// as control sends it: leaf + root.
    pub fn server_identity(&self) -> (String, String) {
        self.server_identity_for(&["127.0.0.1"])
    }

    /// [`Self::server_identity`] with the IP SANs `ips` (a control node
    /// carries its mesh IP).
    pub fn server_identity_for(&self, ips: &[&str]) -> (String, String) {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let names: Vec<String> = std::iter::once("localhost")
            .chain(ips.iter().copied())
            .map(str::to_owned)
            .collect();
        let mut params = CertificateParams::new(names).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "zattera-control");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (format!("{}{}", cert.pem(), self.pem), key.serialize_pem())
    }

    /// Params control imposes on a node certificate (wire.md §8), valid
    /// from 5 minutes ago for `valid_for` (negative: already expired).
    fn node_params(node_id: &str, expired: bool) -> CertificateParams {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(DnType::CommonName, format!("node-{node_id}"));
        params.subject_alt_names = vec![
            SanType::URI(format!("zattera://node/{node_id}").try_into().unwrap()),
            SanType::DnsName(format!("node-{node_id}").try_into().unwrap()),
        ];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        let now = SystemTime::now();
        if expired {
            params.not_before = (now - Duration::from_secs(2 * 86_400)).into();
            params.not_after = (now - Duration::from_secs(86_400)).into();
        } else {
            params.not_before = (now - Duration::from_secs(300)).into();
            params.not_after = (now + Duration::from_secs(365 * 86_400)).into();
        }
        params
    }

    /// Signs a CSR as control does: its subject and SANs are replaced.
    pub fn sign_csr(&self, csr_pem: &str, node_id: &str) -> Result<String, rcgen::Error> {
        self.sign_csr_for(csr_pem, node_id, Duration::from_secs(365 * 86_400))
    }

    /// [`Self::sign_csr`] for a certificate valid from 5 minutes ago until
    /// `life` from now.
    pub fn sign_csr_for(
        &self,
        csr_pem: &str,
        node_id: &str,
        life: Duration,
    ) -> Result<String, rcgen::Error> {
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem)?;
        csr.params = Self::node_params(node_id, false);
        // A short-lived certificate (a renewal test) starts now, so a third
        // of its life is a third of `life`.
        let now = SystemTime::now();
        if life < Duration::from_secs(3600) {
            csr.params.not_before = (now - Duration::from_secs(2)).into();
        }
        csr.params.not_after = (now + life).into();
        Ok(csr.signed_by(&self.issuer)?.pem())
    }

    /// A node certificate and key made directly (cert PEM, key PEM).
    pub fn node_identity(&self, node_id: &str, expired: bool) -> (String, String) {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = Self::node_params(node_id, expired)
            .signed_by(&key, &self.issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// Everything the control plane saw and holds.
#[derive(Default)]
pub struct Record {
    pub joins: Vec<JoinRequest>,
    /// Node ids issued so far.
    pub nodes: Vec<String>,
    /// Accepted sync sessions, in order; frames carry their session index.
    pub sessions: Vec<String>,
    pub frames: Vec<(usize, AgentMessage)>,
    /// Why streams were refused (the status message).
    pub refused: Vec<String>,
    pub route_watches: Vec<WatchRoutesRequest>,
}

impl Record {
    /// Every status report of `assignment`, in arrival order.
    pub fn states_of(&self, assignment: &str) -> Vec<i32> {
        self.frames
            .iter()
            .filter_map(|(_, f)| match &f.body {
                Some(Body::Status(b)) => b.observed.get(assignment).map(|o| o.state),
                _ => None,
            })
            .collect()
    }

    /// The newest status report of `assignment`.
    pub fn latest_of(&self, assignment: &str) -> Option<AssignmentObserved> {
        self.frames.iter().rev().find_map(|(_, f)| match &f.body {
            Some(Body::Status(b)) => b.observed.get(assignment).cloned(),
            _ => None,
        })
    }
}

struct Shared {
    tokens: Mutex<HashSet<String>>,
    record: Mutex<Record>,
    /// Bumped on every change to `record`, for waiters.
    changed: watch::Sender<u64>,
    /// The stream of the newest session, for pushes.
    current: Mutex<Option<mpsc::Sender<Result<ControlMessage, Status>>>>,
    latest_set: Mutex<Option<AssignmentSet>>,
    routes: watch::Sender<RouteSnapshot>,
    addr: Mutex<String>,
    /// What joins hand out as the cluster registry.
    registry: Mutex<RegistryGrant>,
    /// How long node certificates from joins last.
    cert_life: Mutex<Duration>,
    /// Whether joins carry a peer set naming the control node (false: as
    /// the reference does on a cluster without the mesh).
    initial_peers: Mutex<bool>,
    /// How long the sync handler waits after each frame it reads: a slow
    /// control node, whose stream backs up into the agent.
    read_delay: Mutex<Duration>,
}

/// The registry part of a JoinResponse; an empty user means `node-<id>`.
#[derive(Clone, Debug)]
pub struct RegistryGrant {
    pub addr: String,
    pub username: String,
    pub password: String,
}

impl Shared {
    fn note(&self, f: impl FnOnce(&mut Record)) {
        f(&mut self.record.lock().unwrap());
        self.changed.send_modify(|n| *n += 1);
    }
}

/// One agent binary run: its own containerd namespace, dirs, bridge prefix
/// and node API address, so several run side by side.
pub struct AgentRun<'a> {
    pub binary: &'a std::path::Path,
    pub socket: &'a std::path::Path,
    pub namespace: &'a str,
    pub run_dir: &'a std::path::Path,
    pub data_dir: &'a std::path::Path,
    pub bridge_prefix: &'a str,
    pub api_addr: &'a str,
}

/// A running (or stopped) test control plane.
pub struct ControlPlane {
    pub ca: Arc<TestCa>,
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    server: Option<(oneshot::Sender<()>, tokio::task::JoinHandle<()>)>,
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Some((_, task)) = self.server.take() {
            task.abort();
        }
    }
}

impl ControlPlane {
    /// Starts on a free loopback port, accepting join `tokens` (secrets).
    pub async fn start(tokens: &[&str]) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(Shared {
            tokens: Mutex::new(tokens.iter().map(|t| (*t).to_owned()).collect()),
            record: Mutex::new(Record::default()),
            changed: watch::channel(0).0,
            current: Mutex::new(None),
            latest_set: Mutex::new(None),
            routes: watch::channel(RouteSnapshot::default()).0,
            addr: Mutex::new(addr.to_string()),
            registry: Mutex::new(RegistryGrant {
                addr: "127.0.0.1:5000".into(),
                username: String::new(),
                password: "registry-secret".into(),
            }),
            cert_life: Mutex::new(Duration::from_secs(365 * 86_400)),
            initial_peers: Mutex::new(true),
            read_delay: Mutex::new(Duration::ZERO),
        });
        let mut cp = Self {
            ca: Arc::new(TestCa::new("zattera-cluster-ca")),
            addr,
            shared,
            server: None,
        };
        cp.serve(listener);
        cp
    }

    /// What the next joins name as the cluster registry.
    pub fn set_registry(&self, grant: RegistryGrant) {
        *self.shared.registry.lock().unwrap() = grant;
    }

    /// The next joins carry no peer set: a cluster without the mesh, where
    /// nothing names control's node ids.
    /// Reads each sync frame `delay` after the one before.
    pub fn set_read_delay(&self, delay: Duration) {
        *self.shared.read_delay.lock().unwrap() = delay;
    }

    pub fn without_initial_peers(&self) {
        *self.shared.initial_peers.lock().unwrap() = false;
    }

    /// How long the node certificates of the next joins last.
    pub fn set_cert_life(&self, life: Duration) {
        *self.shared.cert_life.lock().unwrap() = life;
    }

    /// The address agents dial.
    pub fn address(&self) -> String {
        self.addr.to_string()
    }

    /// `run --control` of the agent `r` describes, against this control
    /// plane; callers add flags, environment and output, then spawn.
    pub fn agent_command(&self, r: &AgentRun<'_>) -> std::process::Command {
        let mut cmd = std::process::Command::new(r.binary);
        cmd.arg("--containerd-address")
            .arg(r.socket)
            .args(["--namespace", r.namespace, "--config", "/dev/null"])
            .arg("--run-dir")
            .arg(r.run_dir)
            .arg("--data-dir")
            .arg(r.data_dir)
            .args(["run", "--bridge-prefix", r.bridge_prefix])
            .args(["--control", &self.address()])
            .args(["--node-api-listen", r.api_addr])
            .stdout(std::process::Stdio::null());
        cmd
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let (chain, key) = self.ca.server_identity();
        // Join comes without a client certificate; sync and routes check
        // the identity per call.
        let cfg = tls::server(
            chain.as_bytes(),
            key.as_bytes(),
            ClientAuth::Optional(self.ca.pem.as_bytes()),
        )
        .unwrap();
        let svc = Svc {
            shared: Arc::clone(&self.shared),
            ca: Arc::clone(&self.ca),
        };
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(JoinServiceServer::new(svc.clone()))
                .add_service(AgentSyncServiceServer::new(svc.clone()))
                .add_service(RouteServiceServer::new(svc))
                .serve_with_incoming_shutdown(tls::incoming(listener, Arc::new(cfg)), async {
                    let _ = stop_rx.await;
                })
                .await;
        });
        self.server = Some((stop_tx, task));
    }

    /// Stops serving like a crashed control node: open streams end with
    /// UNAVAILABLE and the port stops accepting.
    pub async fn stop(&mut self) {
        if let Some(tx) = self.shared.current.lock().unwrap().take() {
            let _ = tx.try_send(Err(Status::unavailable("control restarting")));
        }
        if let Some((stop, task)) = self.server.take() {
            let _ = stop.send(());
            // Graceful shutdown would wait for the streams; do not.
            tokio::time::sleep(Duration::from_millis(100)).await;
            task.abort();
            let _ = task.await;
        }
    }

    /// Serves again on the same port.
    pub async fn restart(&mut self) {
        let mut tries = 0;
        let listener = loop {
            match tokio::net::TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(e) if tries < 50 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("rebinding {}: {e}", self.addr),
            }
        };
        self.serve(listener);
    }

    /// Pushes a full set to the newest session, and to every later one as
    /// its initial push.
    pub fn push_set(&self, set: AssignmentSet) {
        *self.shared.latest_set.lock().unwrap() = Some(set.clone());
        self.push(ControlMessage {
            body: Some(control_message::Body::Assignments(set)),
        });
    }

    /// Sends one frame on the newest session, if any.
    pub fn push(&self, msg: ControlMessage) {
        if let Some(tx) = self.shared.current.lock().unwrap().as_ref() {
            let _ = tx.try_send(Ok(msg));
        }
    }

    /// Publishes a route snapshot to every watcher.
    pub fn push_routes(&self, snapshot: RouteSnapshot) {
        self.shared.routes.send_replace(snapshot);
    }

    /// Reads the record.
    pub fn with<T>(&self, f: impl FnOnce(&Record) -> T) -> T {
        f(&self.shared.record.lock().unwrap())
    }

    /// Waits up to `timeout` for `pred` to return something.
    pub async fn wait_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Record) -> Option<T>,
    ) -> T {
        wait_on_record(
            what,
            timeout,
            &self.shared.changed,
            &self.shared.record,
            pred,
            |r| {
                format!(
                    "{} joins, sessions {:?}, {} frames, refused {:?}",
                    r.joins.len(),
                    r.sessions,
                    r.frames.len(),
                    r.refused
                )
            },
        )
        .await
    }
}

/// Waits up to `timeout` for `pred` over `record` to return something,
/// looking again whenever `changed` is bumped; panics naming `what` and
/// `summary` of the record.
pub async fn wait_on_record<R, T>(
    what: &str,
    timeout: Duration,
    changed: &watch::Sender<u64>,
    record: &Mutex<R>,
    pred: impl Fn(&R) -> Option<T>,
    summary: impl Fn(&R) -> String,
) -> T {
    let mut changes = changed.subscribe();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        changes.borrow_and_update();
        if let Some(v) = pred(&record.lock().unwrap()) {
            return v;
        }
        if tokio::time::timeout_at(deadline, changes.changed())
            .await
            .is_err()
        {
            let summary = summary(&record.lock().unwrap());
            panic!("timed out after {timeout:?} waiting for {what}; control saw {summary}");
        }
    }
}

#[derive(Clone)]
struct Svc {
    shared: Arc<Shared>,
    ca: Arc<TestCa>,
}

impl Svc {
    /// The caller's node identity, or the refusal control gives.
    fn node_of<T>(&self, req: &Request<T>) -> Result<String, Status> {
        let peer = req
            .extensions()
            .get::<PeerIdentity>()
            .cloned()
            .unwrap_or_default();
        peer.node_id.ok_or_else(|| {
            let msg = "method restricted to cluster nodes".to_owned();
            self.shared.note(|r| r.refused.push(msg.clone()));
            Status::permission_denied(msg)
        })
    }
}

#[tonic::async_trait]
impl JoinService for Svc {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinResponse>, Status> {
        let req = req.into_inner();
        if !self
            .shared
            .tokens
            .lock()
            .unwrap()
            .contains(&req.token_secret)
        {
            self.shared.note(|r| r.joins.push(req.clone()));
            return Err(Status::permission_denied("invalid join token"));
        }
        let csr = String::from_utf8(req.csr_pem.clone())
            .map_err(|_| Status::invalid_argument("csr_pem is not UTF-8"))?;
        let node_id = {
            let rec = self.shared.record.lock().unwrap();
            if rec.nodes.contains(&req.existing_node_id) {
                req.existing_node_id.clone()
            } else {
                format!("01TESTNODE{:016}", rec.nodes.len() + 1)
            }
        };
        let life = *self.shared.cert_life.lock().unwrap();
        let cert = self
            .ca
            .sign_csr_for(&csr, &node_id, life)
            .map_err(|e| Status::invalid_argument(format!("csr: {e}")))?;
        let id = node_id.clone();
        let registry = self.shared.registry.lock().unwrap().clone();
        self.shared.note(|r| {
            r.joins.push(req);
            if !r.nodes.contains(&id) {
                r.nodes.push(id);
            }
        });
        Ok(Response::new(JoinResponse {
            node_id: node_id.clone(),
            ca_cert_pem: self.ca.pem.clone().into_bytes(),
            node_cert_pem: cert.into_bytes(),
            control_grpc_addr: self.shared.addr.lock().unwrap().clone(),
            registry_addr: registry.addr,
            registry_username: if registry.username.is_empty() {
                format!("node-{node_id}")
            } else {
                registry.username
            },
            registry_password: registry.password,
            // The control node itself: the one identity the node API serves.
            initial_peers: (*self.shared.initial_peers.lock().unwrap()).then(|| {
                zattera_agent::proto::cluster::PeerSet {
                    version: 1,
                    peers: vec![zattera_agent::proto::cluster::Peer {
                        node_id: CONTROL_NODE_ID.into(),
                        is_control: true,
                        ..Default::default()
                    }],
                    ..Default::default()
                }
            }),
            ..JoinResponse::default()
        }))
    }
}

type Out<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl AgentSyncService for Svc {
    type SyncStream = Out<ControlMessage>;

    async fn sync(
        &self,
        req: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        let node_id = self.node_of(&req)?;
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let shared = Arc::clone(&self.shared);
        tokio::spawn(async move {
            let refuse = |status: Status| {
                shared.note(|r| r.refused.push(status.message().to_owned()));
                let _ = tx.try_send(Err(status));
            };
            let Ok(Some(hello)) = inbound.message().await else {
                return;
            };
            let Some(Body::Hello(h)) = &hello.body else {
                refuse(Status::invalid_argument("first frame must be a hello"));
                return;
            };
            if !h.node_id.is_empty() && h.node_id != node_id {
                refuse(Status::permission_denied(format!(
                    "hello names node {} but the certificate is node {node_id}",
                    h.node_id
                )));
                return;
            }
            let session = shared.record.lock().unwrap().sessions.len();
            shared.note(|r| {
                r.sessions.push(node_id.clone());
                r.frames.push((session, hello));
            });
            *shared.current.lock().unwrap() = Some(tx.clone());
            if let Some(set) = shared.latest_set.lock().unwrap().clone() {
                let _ = tx.try_send(Ok(ControlMessage {
                    body: Some(control_message::Body::Assignments(set)),
                }));
            }
            loop {
                tokio::select! {
                    m = inbound.message() => match m {
                        Ok(Some(m)) => {
                            shared.note(|r| r.frames.push((session, m)));
                            let delay = *shared.read_delay.lock().unwrap();
                            if !delay.is_zero() {
                                tokio::time::sleep(delay).await;
                            }
                        }
                        _ => return,
                    },
                    // A stopped control plane drops its side of the stream.
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

#[tonic::async_trait]
impl RouteService for Svc {
    type WatchRoutesStream = Out<RouteSnapshot>;

    async fn watch_routes(
        &self,
        req: Request<WatchRoutesRequest>,
    ) -> Result<Response<Self::WatchRoutesStream>, Status> {
        self.node_of(&req)?;
        let req = req.into_inner();
        let have = req.have_version;
        self.shared.note(|r| r.route_watches.push(req));
        let mut routes = self.shared.routes.subscribe();
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            let mut first = true;
            loop {
                let snap = routes.borrow_and_update().clone();
                let skip = first && snap.version == have;
                first = false;
                if !skip && tx.send(Ok(snap)).await.is_err() {
                    return;
                }
                if routes.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// A free loopback `host:port` (bound, then released).
pub async fn free_loopback_addr() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    addr
}

/// One assignment of app `app` in environment `env`, with the test image
/// and `command`, on subnet slot `slot`.
pub fn assignment(
    id: &str,
    env: &str,
    slot: u8,
    command: &str,
) -> (
    zattera_agent::proto::v1::Assignment,
    zattera_agent::proto::cluster::AssignmentRuntime,
) {
    use zattera_agent::proto::v1::{Assignment, AssignmentDesired, Meta, ServiceSpec};
    let a = Assignment {
        meta: Some(Meta {
            id: id.into(),
            ..Meta::default()
        }),
        project_id: "proj".into(),
        app_id: format!("app-{id}"),
        environment_id: env.into(),
        desired: AssignmentDesired::Run as i32,
        config_hash: "h1".into(),
        release_id: "r1".into(),
        ..Assignment::default()
    };
    let rt = zattera_agent::proto::cluster::AssignmentRuntime {
        image_ref: crate::support::TEST_IMAGE.into(),
        spec: Some(ServiceSpec {
            command: command.into(),
            ..ServiceSpec::default()
        }),
        subnet_cidr: format!("10.201.{slot}.0/24"),
        ..Default::default()
    };
    (a, rt)
}

/// A set of the given assignments.
pub fn set_of(
    version: u64,
    items: Vec<(
        zattera_agent::proto::v1::Assignment,
        zattera_agent::proto::cluster::AssignmentRuntime,
    )>,
) -> AssignmentSet {
    let mut set = AssignmentSet {
        version,
        ..AssignmentSet::default()
    };
    for (a, rt) in items {
        let id = a.meta.as_ref().unwrap().id.clone();
        set.assignments.push(a);
        set.runtime.insert(id, rt);
    }
    set
}

/// `zattera-agent join` (the binary under test) into `data`; panics with
/// its stderr when it fails.
pub fn join_cli(data: &std::path::Path, control: &str, token: &str, extra: &[&str]) {
    let join = std::process::Command::new(crate::support::agent::run_bin())
        .args(["--config", "/dev/null", "--data-dir"])
        .arg(data)
        .args(["join", "--control", control, "--token", token])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        join.status.success(),
        "join: {}",
        String::from_utf8_lossy(&join.stderr)
    );
}

/// The real agent binary joined to a test control plane and running under
/// it, with its node API on a loopback port. Killed, and its cgroup parent
/// removed, when dropped.
pub struct ControlledAgent {
    pub child: std::process::Child,
    pub dir: tempfile::TempDir,
    pub node_id: String,
    pub api_addr: String,
    pub namespace: String,
    net: crate::support::NetCleanup,
}

impl ControlledAgent {
    /// Joins with token `secret` (one `cp` accepts) and starts the agent.
    pub async fn start(
        cp: &ControlPlane,
        secret: &str,
        rig: &crate::support::Rig,
        namespace: &str,
        prefix: &str,
    ) -> Self {
        Self::start_with(cp, secret, rig, namespace, prefix, &[]).await
    }

    /// [`Self::start`] with extra `join` flags.
    pub async fn start_joined_with(
        cp: &ControlPlane,
        secret: &str,
        rig: &crate::support::Rig,
        namespace: &str,
        prefix: &str,
        join: &[&str],
    ) -> Self {
        Self::start_full(cp, secret, rig, namespace, prefix, join, &[], |_, _| {}).await
    }

    /// [`Self::start`] with extra `run` flags.
    pub async fn start_with(
        cp: &ControlPlane,
        secret: &str,
        rig: &crate::support::Rig,
        namespace: &str,
        prefix: &str,
        extra: &[&str],
    ) -> Self {
        Self::start_full(cp, secret, rig, namespace, prefix, &[], extra, |_, _| {}).await
    }

    /// [`Self::start`], with `prepare(data dir, node id)` run between the
    /// join and the agent's start.
    pub async fn start_prepared(
        cp: &ControlPlane,
        secret: &str,
        rig: &crate::support::Rig,
        namespace: &str,
        prefix: &str,
        prepare: impl FnOnce(&std::path::Path, &str),
    ) -> Self {
        Self::start_full(cp, secret, rig, namespace, prefix, &[], &[], prepare).await
    }

    #[allow(clippy::too_many_arguments)]
    async fn start_full(
        cp: &ControlPlane,
        secret: &str,
        rig: &crate::support::Rig,
        namespace: &str,
        prefix: &str,
        join: &[&str],
        extra: &[&str],
        prepare: impl FnOnce(&std::path::Path, &str),
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let run_dir = dir.path().join("run");
        let bin = crate::support::agent::run_bin();
        join_cli(&data, &cp.address(), &cp.ca.token(secret), join);
        let node_id = zattera_agent::link::identity::IdentityDir::new(&data)
            .load_enrollment()
            .unwrap()
            .node_id;
        prepare(&data, &node_id);
        let net_cfg = zattera_netns::NetConfig::for_namespace(namespace, &run_dir).unwrap();
        let net = crate::support::NetCleanup {
            prefix: prefix.into(),
            table: net_cfg.nft_table.clone(),
            run_dir: run_dir.clone(),
        };
        let api_addr = free_loopback_addr().await;
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let child = cp
            .agent_command(&AgentRun {
                binary: std::path::Path::new(&bin),
                socket: &rig.socket,
                namespace,
                run_dir: &run_dir,
                data_dir: &data,
                bridge_prefix: prefix,
                api_addr: &api_addr,
            })
            .args(extra)
            .env("RUST_LOG", "info")
            .stderr(log)
            .spawn()
            .unwrap();
        Self {
            child,
            dir,
            node_id,
            api_addr,
            namespace: namespace.into(),
            net,
        }
    }

    pub fn data_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("data")
    }

    /// The agent binary with this agent's directories, running `args`.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new(crate::support::agent::run_bin())
            .args(["--config", "/dev/null", "--data-dir"])
            .arg(self.data_dir())
            .arg("--run-dir")
            .arg(self.dir.path().join("run"))
            .args(args)
            .output()
            .unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// SIGKILLs the agent and starts it again on the same dirs and address.
    pub fn kill9_and_restart(&mut self, cp: &ControlPlane, rig: &crate::support::Rig) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.path().join("agent.log"))
            .unwrap();
        let bin = crate::support::agent::run_bin();
        self.child = cp
            .agent_command(&AgentRun {
                binary: std::path::Path::new(&bin),
                socket: &rig.socket,
                namespace: &self.namespace,
                run_dir: &self.dir.path().join("run"),
                data_dir: &self.data_dir(),
                bridge_prefix: &self.net.prefix,
                api_addr: &self.api_addr,
            })
            .env("RUST_LOG", "info")
            .stderr(log)
            .spawn()
            .unwrap();
    }

    /// Polls `status --json` until `done` holds (90 s).
    pub fn wait_for(
        &self,
        what: &str,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        let mut last = None;
        while std::time::Instant::now() < deadline {
            let out = std::process::Command::new(crate::support::agent::BIN)
                .arg("--run-dir")
                .arg(self.dir.path().join("run"))
                .args(["status", "--json"])
                .output()
                .unwrap();
            if let Ok(s) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
                if done(&s) {
                    return s;
                }
                last = Some(s);
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        panic!(
            "not {what} within 90 s; last status {last:#?}\nagent log:\n{}",
            self.log()
        );
    }

    /// A node API client presenting a certificate for `caller`.
    pub async fn api_as(
        &self,
        cp: &ControlPlane,
        caller: &str,
    ) -> zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient<
        tonic::transport::Channel,
    > {
        let (cert, key) = cp.ca.node_identity(caller, false);
        let cfg = tls::node_client(&zattera_agent::link::tls::NodeTls {
            key_pem: key.into_bytes(),
            cert_pem: cert.into_bytes(),
            ca_pem: cp.ca.pem.clone().into_bytes(),
        })
        .unwrap();
        let name =
            rustls::pki_types::ServerName::try_from(format!("node-{}", self.node_id)).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match tls::connect_as(&self.api_addr, name.clone(), cfg.clone()).await {
                Ok(channel) => {
                    return zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient::new(channel);
                }
                Err(e) if std::time::Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!(
                    "node API at {}: {e}; agent log:\n{}",
                    self.api_addr,
                    self.log()
                ),
            }
        }
    }
}

impl Drop for ControlledAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
