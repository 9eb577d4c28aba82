//! The control plane's shared state, the handle a test drives, and the
//! services it serves (join, sync, routes, peers).

use super::*;

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
    /// The roles joins grant (the token's, as the reference stores them).
    roles: Mutex<Vec<i32>>,
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
            roles: Mutex::new(vec![zattera_agent::proto::v1::NodeRole::Worker as i32]),
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
                r.nodes.push(id.clone());
            }
            // The reference replaces the record wholesale on every join
            // (`registerNode`): labels are the join's, the cordon is undone.
            let mut labels = req.detected_labels.clone();
            if !req.os_arch.is_empty() {
                labels.insert("zattera.dev/os-arch".into(), req.os_arch.clone());
            }
            r.node_records.insert(
                id,
                NodeRecord {
                    labels,
                    schedulable: true,
                    binary_version: req.binary_version.clone(),
                    os_arch: req.os_arch.clone(),
                },
            );
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
    /// The roles the next joins are granted (a control-role token).
    pub fn grant_roles(&self, roles: &[zattera_agent::proto::v1::NodeRole]) {
        *self.shared.roles.lock().unwrap() = roles.iter().map(|r| *r as i32).collect();
    }

    /// `zt nodes label NODE KEY=VALUE` as the reference's CLI does it: the
    /// node's own `zattera.dev/` keys are refused, the rest merged into
    /// the record.
    pub fn label_node(&self, node: &str, key: &str, value: &str) {
        assert!(
            !key.starts_with("zattera.dev/"),
            "label {key:?} is reserved: zattera.dev/* labels are set by the node itself"
        );
        self.shared.note(|r| {
            let n = r.node_records.get_mut(node).expect("no such node");
            n.labels.insert(key.into(), value.into());
        });
    }

    /// `zt nodes cordon` / `uncordon`.
    pub fn set_schedulable(&self, node: &str, schedulable: bool) {
        self.shared.note(|r| {
            r.node_records
                .get_mut(node)
                .expect("no such node")
                .schedulable = schedulable;
        });
    }

    /// The record of `node`, if it ever joined.
    pub fn node_record(&self, node: &str) -> Option<NodeRecord> {
        self.shared
            .record
            .lock()
            .unwrap()
            .node_records
            .get(node)
            .cloned()
    }

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
            roles: self.shared.roles.lock().unwrap().clone(),
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
            let version = h.binary_version.clone();
            shared.note(|r| {
                r.sessions.push(session.clone());
                r.frames.push((index, hello));
                // recordNodeVersion: a non-empty version that differs.
                if let Some(n) = r.node_records.get_mut(&node_id)
                    && !version.is_empty()
                {
                    n.binary_version = version;
                }
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
