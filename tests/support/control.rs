//! The one test control plane: a tonic server with its own CA, serving
//! `JoinService`, `AgentSyncService`, `RouteService` and `MeshService`
//! (WatchPeers) the way wire.md describes control's side, and control's
//! build-source endpoint ([`blobs`]). It records what agents send and lets
//! a test push assignment sets, route snapshots and mesh membership, refuse
//! streams, and stop and restart on the same port.
//!
//! [`ControlPlane::start`] serves one control node on loopback, for a
//! cluster without the mesh; [`ControlPlane::mesh`] is the shared state of
//! a mesh whose control hosts (support/mesh_cluster.rs) each serve it with
//! [`ControlPlane::serve_as`] on their own address, one of them the leader.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
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
use zattera_agent::proto::cluster::mesh_service_server::{MeshService, MeshServiceServer};
use zattera_agent::proto::cluster::route_service_server::{RouteService, RouteServiceServer};
use zattera_agent::proto::cluster::{
    AgentMessage, AssignmentSet, ControlMessage, JoinRequest, JoinResponse, Peer, PeerSet,
    PunchCommand, PunchStreamRequest, ReportObservedEndpointRequest,
    ReportObservedEndpointResponse, RequestPunchRequest, RequestPunchResponse, RouteSnapshot,
    WatchPeersRequest, WatchRoutesRequest, control_message,
};
use zattera_agent::proto::v1::AssignmentObserved;

#[path = "blobs.rs"]
pub mod blobs;

/// The node id of the test control plane's own node certificate.
pub const CONTROL_NODE_ID: &str = "control-1";
/// The API port of every control host of a mesh.
pub const MESH_API_PORT: u16 = 8443;
/// The mesh's address range.
pub const MESH_CIDR: &str = "10.90.0.0/16";

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

    /// A node's TLS material presenting `identity` (cert PEM, key PEM) and
    /// trusting this CA.
    pub fn node_tls(&self, (cert, key): (String, String)) -> tls::NodeTls {
        tls::NodeTls {
            key_pem: key.into_bytes(),
            cert_pem: cert.into_bytes(),
            ca_pem: self.pem.clone().into_bytes(),
        }
    }

    /// A node-API client config presenting `identity` (cert PEM, key PEM)
    /// and trusting this CA.
    pub fn client_tls(&self, identity: (String, String)) -> rustls::ClientConfig {
        tls::node_client(&self.node_tls(identity)).unwrap()
    }
}

/// An accepted sync stream: the control host that took it and the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    pub host: String,
    pub node: String,
}

/// Everything the control plane saw and holds.
#[derive(Default)]
pub struct Record {
    pub joins: Vec<JoinRequest>,
    /// Node ids issued so far.
    pub nodes: Vec<String>,
    /// Accepted sync sessions, in order; frames carry their session index.
    pub sessions: Vec<Session>,
    pub frames: Vec<(usize, AgentMessage)>,
    /// Why streams were refused (the status message).
    pub refused: Vec<String>,
    pub route_watches: Vec<WatchRoutesRequest>,
    /// Every WatchPeers call, as (control host, node id).
    pub peer_watches: Vec<Session>,
}

impl Record {
    /// Every status report of `assignment`, in arrival order.
    pub fn states_of(&self, assignment: &str) -> Vec<i32> {
        self.states_where(assignment, |_| true)
    }

    /// Status reports of `assignment` that reached control host `host`.
    pub fn states_on(&self, host: &str, assignment: &str) -> Vec<i32> {
        self.states_where(assignment, |s| s.host == host)
    }

    fn states_where(&self, assignment: &str, keep: impl Fn(&Session) -> bool) -> Vec<i32> {
        self.frames
            .iter()
            .filter(|(s, _)| keep(&self.sessions[*s]))
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

    /// The control host of `node`'s newest sync stream.
    pub fn session_host_of(&self, node: &str) -> Option<&str> {
        self.sessions
            .iter()
            .rev()
            .find(|s| s.node == node)
            .map(|s| s.host.as_str())
    }

    /// How many sync streams `node` opened.
    pub fn sessions_of(&self, node: &str) -> usize {
        self.sessions.iter().filter(|s| s.node == node).count()
    }
}

/// One member of the mesh as control records it.
#[derive(Clone, Debug)]
pub struct Member {
    pub node_id: String,
    pub public_key: String,
    pub mesh_ip: Ipv4Addr,
    pub endpoint: String,
    pub is_control: bool,
}

/// The registry part of a JoinResponse; an empty user means `node-<id>`.
#[derive(Clone, Debug)]
pub struct RegistryGrant {
    pub addr: String,
    pub username: String,
    pub password: String,
}

type StreamTx = mpsc::Sender<Result<ControlMessage, Status>>;

/// An open sync stream, for pushes.
struct OpenStream {
    session: Session,
    tx: StreamTx,
}

struct Shared {
    /// Whether joins enrol nodes into a mesh (members with mesh IPs, peer
    /// sets from WatchPeers); false: a cluster without the mesh.
    mesh: bool,
    tokens: Mutex<HashSet<String>>,
    record: Mutex<Record>,
    /// Bumped on every change to `record`, for waiters.
    changed: watch::Sender<u64>,
    /// Open sync streams, oldest first.
    streams: Mutex<Vec<OpenStream>>,
    /// The set every new session gets first, unless its node has its own.
    latest_set: Mutex<Option<AssignmentSet>>,
    /// Sets of single nodes (pushed to their streams only).
    node_sets: Mutex<HashMap<String, AssignmentSet>>,
    routes: watch::Sender<RouteSnapshot>,
    /// The address joins name as control's (without the mesh).
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
    members: Mutex<Vec<Member>>,
    /// The control host that takes sync streams; the others refuse them.
    leader: Mutex<String>,
    /// Bumped on every membership or leader change: peer sets go out.
    peers: watch::Sender<u64>,
    /// Nodes control will not talk to (it is "away" for them).
    away: Mutex<HashSet<String>>,
    /// The control node that is the hub, in the reference's hub-and-spoke
    /// shape; `None`: a full mesh.
    hub: Mutex<Option<String>>,
}

impl Shared {
    fn new(mesh: bool, tokens: &[&str], leader: &str) -> Self {
        Self {
            mesh,
            tokens: Mutex::new(tokens.iter().map(|t| (*t).to_owned()).collect()),
            record: Mutex::new(Record::default()),
            changed: watch::channel(0).0,
            streams: Mutex::new(Vec::new()),
            latest_set: Mutex::new(None),
            node_sets: Mutex::new(HashMap::new()),
            routes: watch::channel(RouteSnapshot::default()).0,
            addr: Mutex::new(String::new()),
            registry: Mutex::new(RegistryGrant {
                addr: String::new(),
                username: String::new(),
                password: String::new(),
            }),
            cert_life: Mutex::new(Duration::from_secs(365 * 86_400)),
            initial_peers: Mutex::new(true),
            read_delay: Mutex::new(Duration::ZERO),
            members: Mutex::new(Vec::new()),
            leader: Mutex::new(leader.to_owned()),
            peers: watch::channel(1).0,
            away: Mutex::new(HashSet::new()),
            hub: Mutex::new(None),
        }
    }

    fn note(&self, f: impl FnOnce(&mut Record)) {
        f(&mut self.record.lock().unwrap());
        self.changed.send_modify(|n| *n += 1);
    }

    fn bump_peers(&self) {
        self.peers.send_modify(|v| *v += 1);
    }

    fn refuse_if_away(&self, node: &str) -> Result<(), Status> {
        if self.away.lock().unwrap().contains(node) {
            return Err(Status::unavailable("test: control is away for this node"));
        }
        Ok(())
    }

    /// Ends the streams `which` picks with `status` and forgets them.
    fn end_streams(&self, which: impl Fn(&Session) -> bool, status: &Status) {
        self.streams.lock().unwrap().retain(|s| {
            if which(&s.session) {
                let _ = s.tx.try_send(Err(status.clone()));
                false
            } else {
                true
            }
        });
    }

    /// The peer set `node` gets: every other member, each with its /32;
    /// for a worker under a hub, the reference's shape ([`Self::hub_set_for`]).
    fn peer_set_for(&self, node: &str) -> PeerSet {
        let members = self.members.lock().unwrap();
        if let Some(hub) = self.hub.lock().unwrap().clone()
            && let Some(me) = members.iter().find(|m| m.node_id == node && !m.is_control)
        {
            return self.hub_set_for(me, &members, &hub);
        }
        PeerSet {
            version: *self.peers.borrow(),
            peers: members
                .iter()
                .filter(|m| m.node_id != node)
                .map(|m| peer_of(m, vec![format!("{}/32", m.mesh_ip)], 0))
                .collect(),
            hub_and_spoke: false,
            leader_node_id: self.leader.lock().unwrap().clone(),
        }
    }

    /// A worker's peer set as the reference's control plane builds it
    /// under a hub: every control node, the hub carrying the mesh CIDR;
    /// a worker that advertised no endpoint counts as behind NAT and keeps
    /// its mappings open with a keepalive of 25 toward the controls; two
    /// workers that both advertised one are paired directly with /32s.
    fn hub_set_for(&self, me: &Member, members: &[Member], hub: &str) -> PeerSet {
        let reachable = |m: &Member| !m.endpoint.is_empty();
        PeerSet {
            version: *self.peers.borrow(),
            peers: members
                .iter()
                .filter(|m| m.node_id != me.node_id)
                .filter(|m| m.is_control || (reachable(me) && reachable(m)))
                .map(|m| {
                    let allowed = if m.node_id == hub {
                        vec![MESH_CIDR.to_owned()]
                    } else {
                        vec![format!("{}/32", m.mesh_ip)]
                    };
                    let keepalive = if m.is_control && !reachable(me) {
                        25
                    } else {
                        0
                    };
                    peer_of(m, allowed, keepalive)
                })
                .collect(),
            hub_and_spoke: true,
            leader_node_id: self.leader.lock().unwrap().clone(),
        }
    }

    /// The node id (and, in a mesh, the mesh IP) a join is given: the
    /// node's own on a re-join, else the next free one.
    fn enrol(&self, req: &JoinRequest) -> (String, Option<Ipv4Addr>) {
        let node_id = {
            let rec = self.record.lock().unwrap();
            if rec.nodes.contains(&req.existing_node_id) {
                req.existing_node_id.clone()
            } else if self.mesh {
                format!("01MESHNODE{:016}", rec.nodes.len() + 1)
            } else {
                format!("01TESTNODE{:016}", rec.nodes.len() + 1)
            }
        };
        let id = node_id.clone();
        self.note(|r| {
            r.joins.push(req.clone());
            if !r.nodes.contains(&id) {
                r.nodes.push(id);
            }
        });
        if !self.mesh {
            return (node_id, None);
        }
        let n = self
            .record
            .lock()
            .unwrap()
            .nodes
            .iter()
            .position(|n| *n == node_id);
        let mesh_ip = Ipv4Addr::new(10, 90, 1, u8::try_from(n.unwrap() + 1).unwrap());
        {
            let mut members = self.members.lock().unwrap();
            match members.iter_mut().find(|m| m.node_id == node_id) {
                Some(m) => m.public_key.clone_from(&req.wireguard_public_key),
                None => members.push(Member {
                    node_id: node_id.clone(),
                    public_key: req.wireguard_public_key.clone(),
                    mesh_ip,
                    endpoint: req.public_endpoints.first().cloned().unwrap_or_default(),
                    is_control: false,
                }),
            }
        }
        self.bump_peers();
        (node_id, Some(mesh_ip))
    }

    /// A join's initial peer set and the control address it names.
    fn join_peers(&self, node_id: &str) -> (Option<PeerSet>, String) {
        if self.mesh {
            let mut set = self.peer_set_for(node_id);
            set.peers.retain(|p| p.is_control);
            let first_control = set
                .peers
                .first()
                .map(|p| p.mesh_ip.clone())
                .unwrap_or_default();
            return (Some(set), format!("{first_control}:{MESH_API_PORT}"));
        }
        // The control node itself: the one identity the node API serves.
        let peers = (*self.initial_peers.lock().unwrap()).then(|| PeerSet {
            version: 1,
            peers: vec![Peer {
                node_id: CONTROL_NODE_ID.into(),
                is_control: true,
                ..Default::default()
            }],
            ..Default::default()
        });
        (peers, self.addr.lock().unwrap().clone())
    }
}

/// `m` as a peer routed `allowed_ips`, with `keepalive` seconds.
fn peer_of(m: &Member, allowed_ips: Vec<String>, keepalive: u32) -> Peer {
    Peer {
        node_id: m.node_id.clone(),
        wireguard_public_key: m.public_key.clone(),
        mesh_ip: m.mesh_ip.to_string(),
        endpoints: if m.endpoint.is_empty() {
            Vec::new()
        } else {
            vec![m.endpoint.clone()]
        },
        is_control: m.is_control,
        persistent_keepalive_seconds: keepalive,
        allowed_ips,
        ..Peer::default()
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

/// The test control plane: its state, and the servers that serve it.
pub struct ControlPlane {
    pub ca: Arc<TestCa>,
    /// The loopback address [`Self::start`] serves on (unspecified for a
    /// mesh plane, whose control hosts each serve on their own).
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
    /// Starts on a free loopback port as control node [`CONTROL_NODE_ID`],
    /// accepting join `tokens` (secrets), for a cluster without the mesh.
    pub async fn start(tokens: &[&str]) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shared = Shared::new(false, tokens, CONTROL_NODE_ID);
        *shared.addr.lock().unwrap() = addr.to_string();
        *shared.registry.lock().unwrap() = RegistryGrant {
            addr: "127.0.0.1:5000".into(),
            username: String::new(),
            password: "registry-secret".into(),
        };
        let mut cp = Self {
            ca: Arc::new(TestCa::new("zattera-cluster-ca")),
            addr,
            shared: Arc::new(shared),
            server: None,
        };
        cp.serve(listener);
        cp
    }

    /// A plane for a mesh, accepting join token `secret`, not serving yet:
    /// its control hosts are added with [`Self::add_member`] and served
    /// with [`Self::serve_as`]; the first control member leads.
    pub fn mesh(secret: &str) -> Self {
        Self {
            ca: Arc::new(TestCa::new("zattera-mesh-ca")),
            addr: SocketAddr::from(([0, 0, 0, 0], 0)),
            shared: Arc::new(Shared::new(true, &[secret], "")),
            server: None,
        }
    }

    /// What the next joins name as the cluster registry.
    pub fn set_registry(&self, grant: RegistryGrant) {
        *self.shared.registry.lock().unwrap() = grant;
    }

    /// Reads each sync frame `delay` after the one before.
    pub fn set_read_delay(&self, delay: Duration) {
        *self.shared.read_delay.lock().unwrap() = delay;
    }

    /// The next joins carry no peer set: a cluster without the mesh, where
    /// nothing names control's node ids.
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

    /// Serves Join, Sync, Routes and Peers as control host `host` on
    /// `listener`, with a certificate for `ips` (and localhost). Join comes
    /// without a client certificate; the others check the identity per
    /// call. The task serves until aborted.
    pub fn serve_as(
        &self,
        host: &str,
        ips: &[&str],
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let (chain, key) = self.ca.server_identity_for(ips);
        let cfg = tls::server(
            chain.as_bytes(),
            key.as_bytes(),
            ClientAuth::Optional(self.ca.pem.as_bytes()),
        )
        .unwrap();
        let svc = Svc {
            host: host.to_owned(),
            shared: Arc::clone(&self.shared),
            ca: Arc::clone(&self.ca),
        };
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(JoinServiceServer::new(svc.clone()))
                .add_service(AgentSyncServiceServer::new(svc.clone()))
                .add_service(RouteServiceServer::new(svc.clone()))
                .add_service(MeshServiceServer::new(svc))
                .serve_with_incoming_shutdown(tls::incoming(listener, Arc::new(cfg)), shutdown)
                .await;
        })
    }

    fn serve(&mut self, listener: tokio::net::TcpListener) {
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let task = self.serve_as(CONTROL_NODE_ID, &["127.0.0.1"], listener, async {
            let _ = stop_rx.await;
        });
        self.server = Some((stop_tx, task));
    }

    /// Stops serving like a crashed control node: open streams end with
    /// UNAVAILABLE and the port stops accepting.
    pub async fn stop(&mut self) {
        self.shared
            .end_streams(|_| true, &Status::unavailable("control restarting"));
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
        let addr = self.addr;
        let listener = bind_retrying(&addr.to_string(), 50, move || {
            std::net::TcpListener::bind(addr)
        })
        .await;
        self.serve(listener);
    }

    /// Pushes a full set to the newest session, and to every later one as
    /// its initial push (unless its node has a set of its own).
    pub fn push_set(&self, set: AssignmentSet) {
        *self.shared.latest_set.lock().unwrap() = Some(set.clone());
        self.push(ControlMessage {
            body: Some(control_message::Body::Assignments(set)),
        });
    }

    /// `node`'s assignment set, pushed to its streams (if open) and kept as
    /// the initial push of its next ones.
    pub fn push_set_to(&self, node: &str, set: AssignmentSet) {
        for s in self.shared.streams.lock().unwrap().iter() {
            if s.session.node == node {
                let _ = s.tx.try_send(Ok(ControlMessage {
                    body: Some(control_message::Body::Assignments(set.clone())),
                }));
            }
        }
        self.shared
            .node_sets
            .lock()
            .unwrap()
            .insert(node.to_owned(), set);
    }

    /// Sends one frame on the newest session, if any.
    pub fn push(&self, msg: ControlMessage) {
        if let Some(s) = self.shared.streams.lock().unwrap().last() {
            let _ = s.tx.try_send(Ok(msg));
        }
    }

    /// Publishes a route snapshot to every watcher.
    pub fn push_routes(&self, snapshot: RouteSnapshot) {
        self.shared.routes.send_replace(snapshot);
    }

    /// Adds `member` to the mesh: the next peer sets name it. The first
    /// control member becomes the leader.
    pub fn add_member(&self, member: Member) {
        {
            let mut leader = self.shared.leader.lock().unwrap();
            if member.is_control && leader.is_empty() {
                leader.clone_from(&member.node_id);
            }
        }
        self.shared.members.lock().unwrap().push(member);
        self.shared.bump_peers();
    }

    /// Adds a control member with no host behind it (a control node that
    /// joined after the workers): the next peer sets name it.
    pub fn add_control_member(&self, node: &str, mesh_ip: Ipv4Addr) {
        self.add_member(Member {
            node_id: node.into(),
            public_key: zattera_mesh::PrivateKey::generate()
                .unwrap()
                .public()
                .to_base64(),
            mesh_ip,
            // No endpoint: nobody ever sends to it.
            endpoint: String::new(),
            is_control: true,
        });
    }

    /// Drops `node` from the membership (and from every peer set).
    pub fn remove_member(&self, node: &str) {
        self.shared
            .members
            .lock()
            .unwrap()
            .retain(|m| m.node_id != node);
        self.shared.bump_peers();
    }

    /// The member `node`, as control knows it.
    pub fn member(&self, node: &str) -> Option<Member> {
        self.members().into_iter().find(|m| m.node_id == node)
    }

    pub fn members(&self) -> Vec<Member> {
        self.shared.members.lock().unwrap().clone()
    }

    /// Workers get the reference's hub-and-spoke peer sets, with control
    /// node `node` as the hub.
    pub fn set_hub(&self, node: &str) {
        *self.shared.hub.lock().unwrap() = Some(node.to_owned());
        self.shared.bump_peers();
    }

    /// Moves the leadership to `node`: the old leader ends its streams
    /// with UNAVAILABLE, as control does, and every peer set names the new one.
    pub fn move_leader(&self, node: &str) {
        let old = std::mem::replace(&mut *self.shared.leader.lock().unwrap(), node.to_owned());
        self.shared.bump_peers();
        self.shared
            .end_streams(|s| s.host == old, &Status::unavailable("not the leader"));
    }

    /// Control refuses (or takes back) every call of `node`.
    pub fn set_away(&self, node: &str, away: bool) {
        let mut set = self.shared.away.lock().unwrap();
        if away {
            set.insert(node.to_owned());
            self.shared
                .streams
                .lock()
                .unwrap()
                .retain(|s| s.session.node != node);
        } else {
            set.remove(node);
        }
    }

    /// Runs `apply` with `node`'s peer set now and after every membership
    /// or leader change, one at a time (how a control host's device
    /// follows the mesh); the task runs until aborted.
    pub fn follow_peer_set<F, Fut>(&self, node: &str, mut apply: F) -> tokio::task::JoinHandle<()>
    where
        F: FnMut(PeerSet) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send,
    {
        let (shared, node) = (Arc::clone(&self.shared), node.to_owned());
        tokio::spawn(async move {
            let mut versions = shared.peers.subscribe();
            loop {
                versions.borrow_and_update();
                apply(shared.peer_set_for(&node)).await;
                if versions.changed().await.is_err() {
                    return;
                }
            }
        })
    }

    /// Control's build-source endpoint, with a certificate of this plane's
    /// CA (see [`blobs`]).
    pub async fn serve_blobs(&self) -> blobs::BlobServer {
        let (chain, key) = self.ca.server_identity();
        blobs::BlobServer::start((&chain, &key), &self.ca.pem).await
    }

    /// Reads the record.
    pub fn with<T>(&self, f: impl FnOnce(&Record) -> T) -> T {
        f(&self.shared.record.lock().unwrap())
    }

    /// Waits up to `timeout` for `pred` to return something, looking again
    /// whenever the record changes; panics with a summary of the record.
    pub async fn wait_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Record) -> Option<T>,
    ) -> T {
        let mut changes = self.shared.changed.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            changes.borrow_and_update();
            if let Some(v) = self.with(&pred) {
                return v;
            }
            if tokio::time::timeout_at(deadline, changes.changed())
                .await
                .is_err()
            {
                let summary = self.with(|r| {
                    format!(
                        "{} joins, sessions {:?}, {} frames, refused {:?}, peer watches {:?}",
                        r.joins.len(),
                        r.sessions,
                        r.frames.len(),
                        r.refused,
                        r.peer_watches
                    )
                });
                panic!("timed out after {timeout:?} waiting for {what}; control saw {summary}");
            }
        }
    }
}

/// A listener from `bind`, tried every 100 ms up to `tries` times (a port
/// a closed server held, or an address not there yet), for `what`.
pub async fn bind_retrying(
    what: &str,
    tries: u32,
    bind: impl Fn() -> std::io::Result<std::net::TcpListener>,
) -> tokio::net::TcpListener {
    let mut tried = 0;
    loop {
        match bind() {
            Ok(l) => {
                l.set_nonblocking(true).unwrap();
                return tokio::net::TcpListener::from_std(l).unwrap();
            }
            Err(e) if tried < tries => {
                tried += 1;
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("binding {what}: {e}"),
        }
    }
}

#[derive(Clone)]
struct Svc {
    /// The control host serving.
    host: String,
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

    /// [`Self::node_of`] for a node control talks to now.
    fn present_node_of<T>(&self, req: &Request<T>) -> Result<String, Status> {
        let node = self.node_of(req)?;
        self.shared.refuse_if_away(&node)?;
        Ok(node)
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
        let (node_id, mesh_ip) = self.shared.enrol(&req);
        let life = *self.shared.cert_life.lock().unwrap();
        let cert = self
            .ca
            .sign_csr_for(&csr, &node_id, life)
            .map_err(|e| Status::invalid_argument(format!("csr: {e}")))?;
        let registry = self.shared.registry.lock().unwrap().clone();
        let (initial_peers, control_grpc_addr) = self.shared.join_peers(&node_id);
        Ok(Response::new(JoinResponse {
            node_id: node_id.clone(),
            mesh_ip: mesh_ip.map(|ip| ip.to_string()).unwrap_or_default(),
            mesh_enabled: self.shared.mesh,
            ca_cert_pem: self.ca.pem.clone().into_bytes(),
            node_cert_pem: cert.into_bytes(),
            control_grpc_addr,
            registry_addr: registry.addr,
            registry_username: if registry.username.is_empty() {
                format!("node-{node_id}")
            } else {
                registry.username
            },
            registry_password: registry.password,
            initial_peers,
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
        let node_id = self.present_node_of(&req)?;
        if *self.shared.leader.lock().unwrap() != self.host {
            return Err(Status::unavailable("not the leader"));
        }
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let (shared, host) = (Arc::clone(&self.shared), self.host.clone());
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
            let session = Session {
                host,
                node: node_id.clone(),
            };
            let index = shared.record.lock().unwrap().sessions.len();
            shared.note(|r| {
                r.sessions.push(session.clone());
                r.frames.push((index, hello));
            });
            shared.streams.lock().unwrap().push(OpenStream {
                session,
                tx: tx.clone(),
            });
            let own = shared.node_sets.lock().unwrap().get(&node_id).cloned();
            if let Some(set) = own.or_else(|| shared.latest_set.lock().unwrap().clone()) {
                let _ = tx.try_send(Ok(ControlMessage {
                    body: Some(control_message::Body::Assignments(set)),
                }));
            }
            loop {
                tokio::select! {
                    m = inbound.message() => match m {
                        Ok(Some(m)) => {
                            shared.note(|r| r.frames.push((index, m)));
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
        self.present_node_of(&req)?;
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

#[tonic::async_trait]
impl MeshService for Svc {
    type WatchPeersStream = Out<PeerSet>;
    type PunchStreamStream = Out<PunchCommand>;

    async fn watch_peers(
        &self,
        req: Request<WatchPeersRequest>,
    ) -> Result<Response<Self::WatchPeersStream>, Status> {
        if !self.shared.mesh {
            return Err(Status::unimplemented("a cluster without the mesh"));
        }
        let node = self.present_node_of(&req)?;
        let watch = Session {
            host: self.host.clone(),
            node: node.clone(),
        };
        self.shared.note(|r| r.peer_watches.push(watch));
        let shared = Arc::clone(&self.shared);
        let mut versions = shared.peers.subscribe();
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            loop {
                versions.borrow_and_update();
                if shared.away.lock().unwrap().contains(&node) {
                    let _ = tx
                        .send(Err(Status::unavailable("test: control is away")))
                        .await;
                    return;
                }
                if tx.send(Ok(shared.peer_set_for(&node))).await.is_err() {
                    return;
                }
                if versions.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn report_observed_endpoint(
        &self,
        _req: Request<ReportObservedEndpointRequest>,
    ) -> Result<Response<ReportObservedEndpointResponse>, Status> {
        Err(Status::unimplemented("not in the test control plane"))
    }

    async fn punch_stream(
        &self,
        _req: Request<PunchStreamRequest>,
    ) -> Result<Response<Self::PunchStreamStream>, Status> {
        Err(Status::unimplemented("not in the test control plane"))
    }

    async fn request_punch(
        &self,
        _req: Request<RequestPunchRequest>,
    ) -> Result<Response<RequestPunchResponse>, Status> {
        Err(Status::unimplemented("not in the test control plane"))
    }
}

/// A spawned task, aborted when this is dropped.
pub struct AbortOnDrop(pub tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Node API proxy targets: loopback only, with an empty status.
pub fn loopback_targets() -> zattera_agent::node_api::proxy::Targets {
    zattera_agent::node_api::proxy::Targets {
        host_ips: vec!["127.0.0.1".parse().unwrap()],
        status: watch::channel(Arc::new(zattera_agent::status::StatusSnapshot::default())).1,
    }
}

/// A node context for node `node_id` on `ctd` with its state in `data`:
/// loopback targets, no stats, no upgrade source and no builder.
pub fn node_context(
    ctd: &zattera_agent::runtime::Containerd,
    data: &std::path::Path,
    node_id: &str,
    desired: watch::Receiver<Option<AssignmentSet>>,
) -> zattera_agent::node_api::NodeContext {
    zattera_agent::node_api::NodeContext {
        ctd: ctd.clone(),
        desired,
        targets: loopback_targets(),
        data_dir: data.to_owned(),
        run_dir: data.join("run"),
        node_id: node_id.into(),
        stats: None,
        upgrade: zattera_agent::upgrade::UpgradeConfig {
            base_url: None,
            binary: data.join("bin/zattera-agent"),
            args: Vec::new(),
            busy: Arc::default(),
            stats: None,
        },
        builder: Err("no builder in this test".into()),
    }
}

/// Serves the node API as `node` (with `ctx`, if any) on a loopback port,
/// trusting [`CONTROL_NODE_ID`] as control; returns its address and task.
pub async fn serve_node_api(
    node: &tls::NodeTls,
    ctx: Option<zattera_agent::node_api::NodeContext>,
) -> (String, AbortOnDrop) {
    let api = zattera_agent::node_api::NodeApi::bind(
        "127.0.0.1:0".parse().unwrap(),
        node,
        ctx,
        zattera_agent::node_api::control_ids([CONTROL_NODE_ID]),
    )
    .await
    .unwrap();
    let addr = api.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let _ = api.serve().await;
    });
    (addr, AbortOnDrop(task))
}

/// A node API client for node `node_id` at `addr`, presenting `client`.
pub async fn node_api_client(
    addr: &str,
    node_id: &str,
    client: rustls::ClientConfig,
) -> zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient<
    tonic::transport::Channel,
> {
    let name = rustls::pki_types::ServerName::try_from(format!("node-{node_id}")).unwrap();
    zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient::new(
        tls::connect_as(addr, name, client).await.unwrap(),
    )
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

/// A new control plane accepting `secret` and an agent joined to it, run
/// in `ctd`'s namespace with bridge prefix `prefix` and extra `run` flags.
pub async fn controlled_agent(
    secret: &str,
    rig: &crate::support::Rig,
    ctd: &zattera_agent::runtime::Containerd,
    prefix: &str,
    run: &[&str],
) -> (ControlPlane, ControlledAgent) {
    let cp = ControlPlane::start(&[secret]).await;
    let flags = AgentFlags {
        run,
        ..AgentFlags::default()
    };
    let ns = ctd.namespace().as_str();
    let agent = ControlledAgent::start_with(&cp, secret, rig, ns, prefix, flags).await;
    (cp, agent)
}

/// What [`ControlledAgent::start_with`] adds to a plain join and run.
#[derive(Default)]
pub struct AgentFlags<'a> {
    /// Extra `join` flags.
    pub join: &'a [&'a str],
    /// Extra `run` flags.
    pub run: &'a [&'a str],
    /// Run with (data dir, node id) between the join and the agent's start.
    pub prepare: Option<Prepare<'a>>,
}

/// A step run on a joined node's (data dir, node id) before it starts.
pub type Prepare<'a> = Box<dyn FnOnce(&std::path::Path, &str) + 'a>;

/// The real agent binary joined to a test control plane and running under
/// it, with its node API on a loopback port. Killed, and its cgroup parent
/// removed, when dropped.
pub struct ControlledAgent {
    pub child: std::process::Child,
    /// Before `dir`: its netns pins are unmounted before the dir goes.
    net: crate::support::NetCleanup,
    pub dir: tempfile::TempDir,
    pub node_id: String,
    pub api_addr: String,
    pub namespace: String,
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
        Self::start_with(cp, secret, rig, namespace, prefix, AgentFlags::default()).await
    }

    /// [`Self::start`] with `flags`.
    pub async fn start_with(
        cp: &ControlPlane,
        secret: &str,
        rig: &crate::support::Rig,
        namespace: &str,
        prefix: &str,
        flags: AgentFlags<'_>,
    ) -> Self {
        let AgentFlags { join, run, prepare } = flags;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let run_dir = dir.path().join("run");
        let bin = crate::support::agent::run_bin();
        join_cli(&data, &cp.address(), &cp.ca.token(secret), join);
        let node_id = zattera_agent::link::identity::IdentityDir::new(&data)
            .load_enrollment()
            .unwrap()
            .node_id;
        if let Some(prepare) = prepare {
            prepare(&data, &node_id);
        }
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
            .args(run)
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

    /// What stops this agent's buildkitd and removes its namespaces.
    pub fn buildkitd_cleanup(&self, socket: &std::path::Path) -> BuildkitdCleanup {
        let worker = zattera_agent::build::buildkit::worker_namespace(&self.namespace);
        BuildkitdCleanup {
            pid_file: self.dir.path().join("run/buildkit/buildkitd.pid"),
            socket: socket.to_owned(),
            namespaces: vec![
                format!("{worker}_history"),
                worker,
                format!("{}_history", self.namespace),
            ],
        }
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
        let cfg = cp.ca.client_tls(cp.ca.node_identity(caller, false));
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

/// Stops the agent's buildkitd (it outlives the agent by design; SIGTERM
/// first, so that it gives its CNI namespaces back) and removes the
/// worker's namespace and the `_history` one BuildKit keeps beside it.
pub struct BuildkitdCleanup {
    pid_file: std::path::PathBuf,
    socket: std::path::PathBuf,
    namespaces: Vec<String>,
}

impl BuildkitdCleanup {
    pub async fn run(self) {
        if let Some(pid) = std::fs::read_to_string(&self.pid_file)
            .ok()
            .and_then(|t| t.trim().parse::<i32>().ok())
        {
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            for _ in 0..100 {
                if nix::sys::signal::kill(pid, None).is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        for ns in &self.namespaces {
            if let Ok(ns) = ns.parse()
                && let Ok(ctd) = zattera_agent::runtime::Containerd::connect(&self.socket, ns).await
            {
                crate::support::purge_namespace(&ctd).await;
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
