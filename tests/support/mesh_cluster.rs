//! A cluster on one machine (issue 14): hosts are network namespaces made
//! by the test, joined by veths to a test bridge (the "underlay"); two of
//! them are control hosts, each with a userspace WireGuard device of its
//! own (the agent binary's `mesh-device`) and a test control plane serving
//! Join, Sync, WatchPeers and WatchRoutes on its mesh IP, of which one is
//! the leader; the others run the real agent binary inside their namespace.
//!
//! Everything is removed when the `TestNet` drops: processes in the
//! namespaces (agents, devices) are killed, then namespaces, veths and the
//! bridge are deleted.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::type_complexity, clippy::needless_pass_by_value)]
#![allow(clippy::unused_self, clippy::single_match_else)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use tokio::sync::{mpsc, watch};
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
use zattera_mesh::{MeshState, Net, PeerConfig, PrivateKey, PublicKey};

use crate::control_plane::TestCa;

/// The API port every control host serves on.
pub const API_PORT: u16 = 8443;
/// WireGuard's port on every host.
pub const WG_PORT: u16 = 51820;

/// Runs `f` on a thread inside the network namespace `ns` (a name under
/// /run/netns) with a runtime of its own: sockets and devices it makes
/// live in that namespace.
pub fn in_ns<T, F, Fut>(ns: &str, f: F) -> T
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T>,
{
    let path = Path::new("/run/netns").join(ns);
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f())
    })
    .join()
    .unwrap()
}

/// A TCP listener bound inside `ns`, served by the caller's runtime.
pub fn listen_in(ns: &str, addr: SocketAddr) -> tokio::net::TcpListener {
    let std = in_ns(ns, move || async move {
        let l = std::net::TcpListener::bind(addr).unwrap();
        l.set_nonblocking(true).unwrap();
        l
    });
    tokio::net::TcpListener::from_std(std).unwrap()
}

/// A TCP connection made from inside `ns`.
pub fn connect_in(ns: &str, addr: SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let std = in_ns(ns, move || async move {
        let s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
        s.set_nonblocking(true)?;
        Ok::<_, std::io::Error>(s)
    })?;
    tokio::net::TcpStream::from_std(std)
}

/// A loopback port in the test's own namespace that forwards every
/// connection to `to` as dialed from inside `ns`: how a control host's
/// view of the mesh is reached from the test.
pub async fn forward_from(ns: &str, to: SocketAddr) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let ns = ns.to_owned();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = l.accept().await {
            let ns = ns.clone();
            tokio::spawn(async move {
                let Ok(mut out) = tokio::task::spawn_blocking(move || connect_in(&ns, to))
                    .await
                    .unwrap()
                else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
            });
        }
    });
    addr
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `argv` inside `ns` (its network only) and returns stdout.
pub fn run_in(ns: &str, argv: &[&str]) -> std::process::Output {
    Command::new("nsenter")
        .arg(format!("--net=/run/netns/{ns}"))
        .arg("--")
        .args(argv)
        .output()
        .unwrap()
}

/// The underlay: a bridge in the test's namespace and a namespace per host.
pub struct TestNet {
    pub bridge: String,
    prefix: String,
    hosts: Vec<String>,
    /// The namespace of a bridge made by someone else (the VM lane's),
    /// which the net joins and leaves in place; `None`: the bridge is the
    /// net's own, in the test's namespace.
    foreign: Option<String>,
}

impl TestNet {
    /// A bridge named `<prefix>br`; host namespaces will be `<prefix>-<name>`.
    pub fn new(prefix: &str) -> Self {
        let net = Self::joining(prefix, None, &format!("{prefix}br"));
        let _ = Command::new("ip")
            .args(["link", "del", &net.bridge])
            .output();
        ip(&["link", "add", &net.bridge, "type", "bridge"]);
        ip(&["link", "set", &net.bridge, "up"]);
        net
    }

    /// Hosts on `bridge` in namespace `bridge_ns`, made by someone else and
    /// left as it is; host namespaces will be `<prefix>-<name>`.
    pub fn on_bridge(prefix: &str, bridge_ns: &str, bridge: &str) -> Self {
        Self::joining(prefix, Some(bridge_ns.to_owned()), bridge)
    }

    fn joining(prefix: &str, foreign: Option<String>, bridge: &str) -> Self {
        let net = Self {
            bridge: bridge.to_owned(),
            prefix: prefix.to_owned(),
            hosts: Vec::new(),
            foreign,
        };
        // What a killed earlier run left.
        for name in ["c1", "c2", "a", "b", "c", "d", "an", "bn"] {
            kill_all_in(&format!("{prefix}-{name}"));
            let _ = Command::new("ip")
                .args(["netns", "del", &format!("{prefix}-{name}")])
                .output();
            // A namespace lingers while orphaned TCP sockets in it time out.
            let _ = Command::new("ip")
                .args(net.on_bridge_side(&["link", "del", &format!("{prefix}v{name}")]))
                .output();
        }
        net
    }

    /// `ip` arguments run where the bridge is.
    fn on_bridge_side<'a>(&'a self, args: &[&'a str]) -> Vec<&'a str> {
        match &self.foreign {
            Some(ns) => [&["-n", ns.as_str()], args].concat(),
            None => args.to_vec(),
        }
    }

    /// A host `name` at `addr` on the underlay; returns its namespace name.
    pub fn add_host(&mut self, name: &str, addr: Ipv4Addr) -> String {
        let ns = format!("{}-{name}", self.prefix);
        let outside = format!("{}v{name}", self.prefix);
        ip(&["netns", "add", &ns]);
        self.hosts.push(ns.clone());
        ip(&self.on_bridge_side(&[
            "link", "add", &outside, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]));
        ip(&self.on_bridge_side(&["link", "set", &outside, "master", &self.bridge, "up"]));
        let cidr = format!("{addr}/24");
        for argv in [
            vec!["ip", "link", "set", "lo", "up"],
            vec!["ip", "link", "set", "eth0", "up"],
            vec!["ip", "addr", "add", cidr.as_str(), "dev", "eth0"],
            vec!["sysctl", "-qw", "net.ipv4.ip_forward=1"],
        ] {
            let out = run_in(&ns, &argv);
            assert!(out.status.success(), "{argv:?} in {ns}: {out:?}");
        }
        ns
    }

    /// A host `name` behind a NAT of its own: a namespace `<name>n` on the
    /// underlay at `addr` that masquerades, and behind it the host's
    /// namespace on 192.168.`inner`.0/24, routed through it. Returns the
    /// host's namespace.
    pub fn add_host_behind_nat(&mut self, name: &str, addr: Ipv4Addr, inner: u8) -> String {
        let nat = self.add_host(&format!("{name}n"), addr);
        let ns = format!("{}-{name}", self.prefix);
        ip(&["netns", "add", &ns]);
        self.hosts.push(ns.clone());
        ip(&[
            "-n", &nat, "link", "add", "in0", "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        let (gw, me) = (
            format!("192.168.{inner}.1/24"),
            format!("192.168.{inner}.2/24"),
        );
        let via = format!("192.168.{inner}.1");
        for (at, argv) in [
            (&nat, vec!["ip", "link", "set", "in0", "up"]),
            (&nat, vec!["ip", "addr", "add", gw.as_str(), "dev", "in0"]),
            (&nat, vec!["nft", "add", "table", "ip", "ztnat"]),
            (
                &nat,
                vec![
                    "nft",
                    "add",
                    "chain",
                    "ip",
                    "ztnat",
                    "post",
                    "{ type nat hook postrouting priority 100 ; }",
                ],
            ),
            (
                &nat,
                vec![
                    "nft",
                    "add",
                    "rule",
                    "ip",
                    "ztnat",
                    "post",
                    "oifname",
                    "eth0",
                    "masquerade",
                ],
            ),
            (&ns, vec!["ip", "link", "set", "lo", "up"]),
            (&ns, vec!["ip", "link", "set", "eth0", "up"]),
            (&ns, vec!["ip", "addr", "add", me.as_str(), "dev", "eth0"]),
            (
                &ns,
                vec!["ip", "route", "add", "default", "via", via.as_str()],
            ),
        ] {
            let out = run_in(at, &argv);
            assert!(out.status.success(), "{argv:?} in {at}: {out:?}");
        }
        ns
    }

    pub fn remove_host(&mut self, ns: &str) {
        kill_all_in(ns);
        let _ = Command::new("ip").args(["netns", "del", ns]).output();
        self.hosts.retain(|h| h != ns);
    }
}

/// SIGKILLs every process whose network namespace is `ns`.
pub fn kill_all_in(ns: &str) {
    let out = Command::new("ip").args(["netns", "pids", ns]).output();
    let Ok(out) = out else { return };
    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        if let Ok(pid) = pid.parse::<i32>() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for ns in std::mem::take(&mut self.hosts) {
            self.remove_host(&ns);
        }
        if self.foreign.is_none() {
            let _ = Command::new("ip")
                .args(["link", "del", &self.bridge])
                .output();
        }
        // The UAPI sockets the killed devices left.
        if let Ok(dir) = std::fs::read_dir(zattera_mesh::uapi::socket_path("x").parent().unwrap()) {
            for e in dir.flatten() {
                if e.file_name().to_string_lossy().starts_with(&self.prefix) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
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

/// What the control plane saw.
#[derive(Default)]
pub struct Record {
    pub joins: Vec<JoinRequest>,
    /// (control host, node id) of every accepted sync stream, in order.
    pub sessions: Vec<(String, String)>,
    /// (control host, node id, frame).
    pub frames: Vec<(String, String, AgentMessage)>,
    /// (control host, node id) of every WatchPeers call.
    pub peer_watches: Vec<(String, String)>,
}

impl Record {
    /// The control host of `node`'s newest sync stream.
    pub fn session_host_of(&self, node: &str) -> Option<&str> {
        self.sessions
            .iter()
            .rev()
            .find(|(_, n)| n == node)
            .map(|(h, _)| h.as_str())
    }

    /// Status reports of `assignment` that reached control host `host`.
    pub fn states_on(&self, host: &str, assignment: &str) -> Vec<i32> {
        self.frames
            .iter()
            .filter(|(h, _, _)| h == host)
            .filter_map(|(_, _, f)| match &f.body {
                Some(Body::Status(b)) => b.observed.get(assignment).map(|o| o.state),
                _ => None,
            })
            .collect()
    }

    pub fn latest_of(
        &self,
        assignment: &str,
    ) -> Option<zattera_agent::proto::v1::AssignmentObserved> {
        self.frames
            .iter()
            .rev()
            .find_map(|(_, _, f)| match &f.body {
                Some(Body::Status(b)) => b.observed.get(assignment).cloned(),
                _ => None,
            })
    }
}

type Out<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

struct Shared {
    token: String,
    ca: Arc<TestCa>,
    members: Mutex<Vec<Member>>,
    leader: Mutex<String>,
    /// Bumped on every membership or leader change: peer sets go out.
    peers: watch::Sender<u64>,
    sets: Mutex<HashMap<String, AssignmentSet>>,
    /// Open sync streams: (control host, node) → sender.
    streams: Mutex<HashMap<(String, String), mpsc::Sender<Result<ControlMessage, Status>>>>,
    routes: watch::Sender<RouteSnapshot>,
    /// Nodes control will not talk to (it is "away" for them).
    away: Mutex<HashSet<String>>,
    /// The control node that is the hub, in the reference's hub-and-spoke
    /// shape; `None`: a full mesh.
    hub: Mutex<Option<String>>,
    record: Mutex<Record>,
    changed: watch::Sender<u64>,
}

impl Shared {
    fn note(&self, f: impl FnOnce(&mut Record)) {
        f(&mut self.record.lock().unwrap());
        self.changed.send_modify(|n| *n += 1);
    }

    /// The peer set `node` gets: every other member, each with its /32;
    /// for a worker under a hub, the reference's shape ([`Self::hub_set_for`]).
    fn peer_set_for(&self, node: &str) -> PeerSet {
        if let Some(hub) = self.hub.lock().unwrap().clone() {
            let members = self.members.lock().unwrap();
            if let Some(me) = members.iter().find(|m| m.node_id == node && !m.is_control) {
                return self.hub_set_for(me, &members, &hub);
            }
        }
        let members = self.members.lock().unwrap();
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
                        vec!["10.90.0.0/16".to_owned()]
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

    fn refuse_if_away(&self, node: &str) -> Result<(), Status> {
        if self.away.lock().unwrap().contains(node) {
            return Err(Status::unavailable("test: control is away for this node"));
        }
        Ok(())
    }
}

/// `m` as a peer routed `allowed_ips`, with `keepalive` seconds.
fn peer_of(m: &Member, allowed_ips: Vec<String>, keepalive: u32) -> Peer {
    Peer {
        node_id: m.node_id.clone(),
        wireguard_public_key: m.public_key.clone(),
        mesh_ip: m.mesh_ip.to_string(),
        endpoints: endpoints_of(m),
        is_control: m.is_control,
        persistent_keepalive_seconds: keepalive,
        allowed_ips,
        ..Peer::default()
    }
}

/// What a member advertised: nothing, or its one endpoint.
fn endpoints_of(m: &Member) -> Vec<String> {
    if m.endpoint.is_empty() {
        Vec::new()
    } else {
        vec![m.endpoint.clone()]
    }
}

/// The control plane of the test cluster: its state, shared by the
/// control hosts that serve it.
pub struct Cluster {
    pub ca: Arc<TestCa>,
    shared: Arc<Shared>,
    /// Per control host: its namespace, WireGuard key and the task that
    /// keeps its device in step with the membership.
    controls: Vec<ControlHost>,
    binary: PathBuf,
}

struct ControlHost {
    node_id: String,
    ns: String,
    key: PrivateKey,
    interface: String,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for c in &self.controls {
            for t in &c.tasks {
                t.abort();
            }
        }
    }
}

impl Cluster {
    /// A control plane accepting join token `secret`, whose device
    /// processes run `binary mesh-device`.
    pub fn new(secret: &str, binary: &Path) -> Self {
        let ca = Arc::new(TestCa::new("zattera-mesh-ca"));
        Self {
            ca: Arc::clone(&ca),
            shared: Arc::new(Shared {
                token: secret.to_owned(),
                ca,
                members: Mutex::new(Vec::new()),
                leader: Mutex::new(String::new()),
                peers: watch::channel(1).0,
                sets: Mutex::new(HashMap::new()),
                streams: Mutex::new(HashMap::new()),
                routes: watch::channel(RouteSnapshot::default()).0,
                away: Mutex::new(HashSet::new()),
                hub: Mutex::new(None),
                record: Mutex::new(Record::default()),
                changed: watch::channel(0).0,
            }),
            controls: Vec::new(),
            binary: binary.to_owned(),
        }
    }

    /// Adds control host `node_id` in namespace `ns` at `underlay` with
    /// mesh IP `mesh_ip` and WireGuard interface `interface`: its device
    /// follows the membership, and it serves the API on its mesh IP (and,
    /// with `join`, on its underlay address for joins).
    pub fn add_control(
        &mut self,
        node_id: &str,
        ns: &str,
        underlay: Ipv4Addr,
        mesh_ip: Ipv4Addr,
        interface: &str,
        join: bool,
    ) {
        let key = PrivateKey::generate().unwrap();
        self.shared.members.lock().unwrap().push(Member {
            node_id: node_id.into(),
            public_key: key.public().to_base64(),
            mesh_ip,
            endpoint: format!("{underlay}:{WG_PORT}"),
            is_control: true,
        });
        if self.shared.leader.lock().unwrap().is_empty() {
            node_id.clone_into(&mut self.shared.leader.lock().unwrap());
        }
        let mut tasks = Vec::new();
        // The device: re-applied whenever the membership changes.
        let (shared, ns2, key2, iface, bin) = (
            Arc::clone(&self.shared),
            ns.to_owned(),
            key.clone(),
            interface.to_owned(),
            self.binary.clone(),
        );
        let id = node_id.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut peers = shared.peers.subscribe();
            loop {
                let set = shared.peer_set_for(&id);
                let want = mesh_state(&iface, &key2, mesh_ip, &set);
                let (ns3, bin2, iface2) = (ns2.clone(), bin.clone(), iface.clone());
                let r = tokio::task::spawn_blocking(move || {
                    in_ns(&ns3, move || async move {
                        zattera_mesh::userspace::Userspace {
                            interface: iface2.clone(),
                            device_binary: bin2,
                            log: std::env::temp_dir().join(format!("{iface2}.log")),
                        }
                        .apply(&want)
                        .await
                    })
                })
                .await
                .unwrap();
                if let Err(e) = r {
                    eprintln!("control host {id}: mesh not applied: {e}");
                }
                if peers.changed().await.is_err() {
                    return;
                }
            }
        }));
        let (chain, tls_key) = self
            .ca
            .server_identity_for(&[&mesh_ip.to_string(), &underlay.to_string()]);
        let cfg = Arc::new(
            tls::server(
                chain.as_bytes(),
                tls_key.as_bytes(),
                ClientAuth::Optional(self.ca.pem.as_bytes()),
            )
            .unwrap(),
        );
        let mut addrs = vec![SocketAddr::from((mesh_ip, API_PORT))];
        if join {
            addrs.push(SocketAddr::from((underlay, API_PORT)));
        }
        for addr in addrs {
            // The mesh address exists once the device is up.
            let listener = {
                let mut tries = 0;
                loop {
                    let ns2 = ns.to_owned();
                    let r = std::thread::spawn(move || {
                        in_ns(
                            &ns2,
                            move || async move { std::net::TcpListener::bind(addr) },
                        )
                    })
                    .join()
                    .unwrap();
                    match r {
                        Ok(l) => {
                            l.set_nonblocking(true).unwrap();
                            break tokio::net::TcpListener::from_std(l).unwrap();
                        }
                        Err(e) if tries < 100 => {
                            let _ = e;
                            tries += 1;
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        Err(e) => panic!("binding {addr} in {ns}: {e}"),
                    }
                }
            };
            let svc = Svc {
                host: node_id.to_owned(),
                shared: Arc::clone(&self.shared),
            };
            let cfg = Arc::clone(&cfg);
            tasks.push(tokio::spawn(async move {
                let _ = tonic::transport::Server::builder()
                    .add_service(JoinServiceServer::new(svc.clone()))
                    .add_service(AgentSyncServiceServer::new(svc.clone()))
                    .add_service(RouteServiceServer::new(svc.clone()))
                    .add_service(MeshServiceServer::new(svc))
                    .serve_with_incoming(tls::incoming(listener, cfg))
                    .await;
            }));
        }
        self.controls.push(ControlHost {
            node_id: node_id.into(),
            ns: ns.into(),
            key,
            interface: interface.into(),
            tasks,
        });
    }

    /// Workers get the reference's hub-and-spoke peer sets, with control
    /// node `node` as the hub.
    pub fn set_hub(&self, node: &str) {
        *self.shared.hub.lock().unwrap() = Some(node.to_owned());
        self.shared.peers.send_modify(|v| *v += 1);
    }

    /// `node`'s WireGuard public key as the control hosts know it.
    pub fn member(&self, node: &str) -> Option<Member> {
        self.shared
            .members
            .lock()
            .unwrap()
            .iter()
            .find(|m| m.node_id == node)
            .cloned()
    }

    pub fn members(&self) -> Vec<Member> {
        self.shared.members.lock().unwrap().clone()
    }

    /// Moves the leadership to `node`: the old leader ends its streams
    /// with UNAVAILABLE, as control does, and every peer set names the new one.
    pub fn move_leader(&self, node: &str) {
        let old = std::mem::replace(&mut *self.shared.leader.lock().unwrap(), node.to_owned());
        self.shared.peers.send_modify(|v| *v += 1);
        let mut streams = self.shared.streams.lock().unwrap();
        streams.retain(|(host, _), tx| {
            if *host == old {
                let _ = tx.try_send(Err(Status::unavailable("not the leader")));
                false
            } else {
                true
            }
        });
    }

    /// Adds a control member with no host behind it (a control node that
    /// joined after the workers): the next peer sets name it.
    pub fn add_control_member(&self, node: &str, mesh_ip: Ipv4Addr) {
        self.shared.members.lock().unwrap().push(Member {
            node_id: node.into(),
            public_key: PrivateKey::generate().unwrap().public().to_base64(),
            mesh_ip,
            // No endpoint: nobody ever sends to it.
            endpoint: String::new(),
            is_control: true,
        });
        self.shared.peers.send_modify(|v| *v += 1);
    }

    /// Drops `node` from the membership (and from every peer set).
    pub fn remove_member(&self, node: &str) {
        self.shared
            .members
            .lock()
            .unwrap()
            .retain(|m| m.node_id != node);
        self.shared.peers.send_modify(|v| *v += 1);
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
                .retain(|(_, n), _| n != node);
        } else {
            set.remove(node);
        }
    }

    /// `node`'s assignment set, pushed to its stream (if open) and kept as
    /// the initial push of its next ones.
    pub fn push_set(&self, node: &str, set: AssignmentSet) {
        self.shared
            .sets
            .lock()
            .unwrap()
            .insert(node.to_owned(), set.clone());
        for ((_, n), tx) in self.shared.streams.lock().unwrap().iter() {
            if n == node {
                let _ = tx.try_send(Ok(ControlMessage {
                    body: Some(control_message::Body::Assignments(set.clone())),
                }));
            }
        }
    }

    pub fn push_routes(&self, snapshot: RouteSnapshot) {
        self.shared.routes.send_replace(snapshot);
    }

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
        crate::control_plane::wait_on_record(
            what,
            timeout,
            &self.shared.changed,
            &self.shared.record,
            pred,
            |r| {
                format!(
                    "{} joins, sessions {:?}, {} frames, peer watches {:?}",
                    r.joins.len(),
                    r.sessions,
                    r.frames.len(),
                    r.peer_watches
                )
            },
        )
        .await
    }
}

/// The device of a control host for `set`.
fn mesh_state(interface: &str, key: &PrivateKey, mesh_ip: Ipv4Addr, set: &PeerSet) -> MeshState {
    MeshState {
        interface: interface.to_owned(),
        private_key: key.clone(),
        listen_port: WG_PORT,
        address: mesh_ip,
        cidr: "10.90.0.0/16".parse().unwrap(),
        mtu: zattera_mesh::MTU,
        peers: set
            .peers
            .iter()
            .map(|p| {
                (
                    PublicKey::from_base64(&p.wireguard_public_key).unwrap(),
                    PeerConfig {
                        endpoints: p.endpoints.iter().filter_map(|e| e.parse().ok()).collect(),
                        allowed_ips: p
                            .allowed_ips
                            .iter()
                            .map(|n| n.parse::<Net>().unwrap())
                            .collect(),
                        keepalive: 0,
                    },
                )
            })
            .collect::<BTreeMap<_, _>>(),
    }
}

#[derive(Clone)]
struct Svc {
    /// The control host serving.
    host: String,
    shared: Arc<Shared>,
}

impl Svc {
    fn node_of<T>(&self, req: &Request<T>) -> Result<String, Status> {
        req.extensions()
            .get::<PeerIdentity>()
            .and_then(|p| p.node_id.clone())
            .ok_or_else(|| Status::permission_denied("method restricted to cluster nodes"))
    }
}

#[tonic::async_trait]
impl JoinService for Svc {
    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinResponse>, Status> {
        let req = req.into_inner();
        if req.token_secret != self.shared.token {
            return Err(Status::permission_denied("invalid join token"));
        }
        let csr = String::from_utf8(req.csr_pem.clone())
            .map_err(|_| Status::invalid_argument("csr_pem is not UTF-8"))?;
        let (node_id, mesh_ip) = {
            let mut members = self.shared.members.lock().unwrap();
            let workers = members.iter().filter(|m| !m.is_control).count();
            let existing = members
                .iter_mut()
                .find(|m| !req.existing_node_id.is_empty() && m.node_id == req.existing_node_id);
            match existing {
                Some(m) => {
                    m.public_key.clone_from(&req.wireguard_public_key);
                    (m.node_id.clone(), m.mesh_ip)
                }
                None => {
                    let n = u8::try_from(workers + 1).unwrap();
                    let m = Member {
                        node_id: format!("01MESHNODE{n:016}"),
                        public_key: req.wireguard_public_key.clone(),
                        mesh_ip: Ipv4Addr::new(10, 90, 1, n),
                        endpoint: req.public_endpoints.first().cloned().unwrap_or_default(),
                        is_control: false,
                    };
                    let out = (m.node_id.clone(), m.mesh_ip);
                    members.push(m);
                    out
                }
            }
        };
        self.shared.peers.send_modify(|v| *v += 1);
        let cert = self
            .shared
            .ca
            .sign_csr(&csr, &node_id)
            .map_err(|e| Status::invalid_argument(format!("csr: {e}")))?;
        let initial = {
            let mut set = self.shared.peer_set_for(&node_id);
            set.peers.retain(|p| p.is_control);
            set
        };
        let first_control = initial
            .peers
            .first()
            .map(|p| p.mesh_ip.clone())
            .unwrap_or_default();
        self.shared.note(|r| r.joins.push(req));
        Ok(Response::new(JoinResponse {
            node_id: node_id.clone(),
            mesh_ip: mesh_ip.to_string(),
            ca_cert_pem: self.shared.ca.pem.clone().into_bytes(),
            node_cert_pem: cert.into_bytes(),
            initial_peers: Some(initial),
            control_grpc_addr: format!("{first_control}:{API_PORT}"),
            registry_username: format!("node-{node_id}"),
            mesh_enabled: true,
            ..JoinResponse::default()
        }))
    }
}

#[tonic::async_trait]
impl AgentSyncService for Svc {
    type SyncStream = Out<ControlMessage>;

    async fn sync(
        &self,
        req: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        let node = self.node_of(&req)?;
        self.shared.refuse_if_away(&node)?;
        if *self.shared.leader.lock().unwrap() != self.host {
            return Err(Status::unavailable("not the leader"));
        }
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let (shared, host) = (Arc::clone(&self.shared), self.host.clone());
        tokio::spawn(async move {
            let Ok(Some(hello)) = inbound.message().await else {
                return;
            };
            if !matches!(hello.body, Some(Body::Hello(_))) {
                let _ = tx.try_send(Err(Status::invalid_argument("first frame must be a hello")));
                return;
            }
            shared.note(|r| {
                r.sessions.push((host.clone(), node.clone()));
                r.frames.push((host.clone(), node.clone(), hello));
            });
            shared
                .streams
                .lock()
                .unwrap()
                .insert((host.clone(), node.clone()), tx.clone());
            if let Some(set) = shared.sets.lock().unwrap().get(&node).cloned() {
                let _ = tx.try_send(Ok(ControlMessage {
                    body: Some(control_message::Body::Assignments(set)),
                }));
            }
            loop {
                tokio::select! {
                    m = inbound.message() => match m {
                        Ok(Some(m)) => shared.note(|r| r.frames.push((host.clone(), node.clone(), m))),
                        _ => return,
                    },
                    () = tx.closed() => return,
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
        let node = self.node_of(&req)?;
        self.shared.refuse_if_away(&node)?;
        self.shared
            .note(|r| r.peer_watches.push((self.host.clone(), node.clone())));
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

#[tonic::async_trait]
impl RouteService for Svc {
    type WatchRoutesStream = Out<RouteSnapshot>;

    async fn watch_routes(
        &self,
        req: Request<WatchRoutesRequest>,
    ) -> Result<Response<Self::WatchRoutesStream>, Status> {
        let node = self.node_of(&req)?;
        self.shared.refuse_if_away(&node)?;
        let mut routes = self.shared.routes.subscribe();
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            loop {
                let snap = routes.borrow_and_update().clone();
                if tx.send(Ok(snap)).await.is_err() || routes.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// The live WireGuard device of `interface` (userspace: its UAPI socket is
/// on the shared filesystem, whatever namespace runs it).
pub async fn device(interface: &str) -> Option<zattera_mesh::Inspect> {
    zattera_mesh::inspect(interface).await.ok().flatten()
}
