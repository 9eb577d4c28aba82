//! A cluster on one machine (issue 14): hosts are network namespaces made
//! by the test, joined by veths to a test bridge (the "underlay"); two of
//! them are control hosts, each with a userspace WireGuard device of its
//! own (the agent binary's `mesh-device`), serving the one test control
//! plane (support/control/) on its mesh IP, of which one is the leader;
//! the others run the real agent binary inside their namespace. This file
//! owns that scaffolding: namespaces, veths, devices and processes.
//!
//! Everything is removed when the `TestNet` drops: processes in the
//! namespaces (agents, devices) are killed, then namespaces, veths and the
//! bridge are deleted.

#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods
)]
#![allow(clippy::type_complexity, clippy::needless_pass_by_value)]
#![allow(clippy::unused_self, clippy::single_match_else)]

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use zattera_agent::proto::cluster::PeerSet;
use zattera_mesh::{MeshState, Net, PeerConfig, PrivateKey, PublicKey};

use crate::control_plane::{ControlPlane, MESH_CIDR, Member, bind_retrying};

/// The API port every control host serves on.
pub const API_PORT: u16 = crate::control_plane::MESH_API_PORT;
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

/// The test cluster's control side: the one control plane
/// ([`ControlPlane::mesh`]), served by control hosts in namespaces, each
/// with a WireGuard device that follows the membership. Derefs to the
/// plane for pushes, membership and the record.
pub struct Cluster {
    plane: ControlPlane,
    /// Per control host: the tasks that keep its device in step with the
    /// membership and serve the plane.
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

impl std::ops::Deref for Cluster {
    type Target = ControlPlane;

    fn deref(&self) -> &ControlPlane {
        &self.plane
    }
}

impl Cluster {
    /// A control plane accepting join token `secret`, whose device
    /// processes run `binary mesh-device`.
    pub fn new(secret: &str, binary: &Path) -> Self {
        Self {
            plane: ControlPlane::mesh(secret),
            controls: Vec::new(),
            binary: binary.to_owned(),
        }
    }

    /// Adds control host `node_id` in namespace `ns` at `underlay` with
    /// mesh IP `mesh_ip` and WireGuard interface `interface`: its device
    /// follows the membership, and it serves the API on its mesh IP (and,
    /// with `join`, on its underlay address for joins).
    pub async fn add_control(
        &mut self,
        node_id: &str,
        ns: &str,
        underlay: Ipv4Addr,
        mesh_ip: Ipv4Addr,
        interface: &str,
        join: bool,
    ) {
        let key = PrivateKey::generate().unwrap();
        self.plane.add_member(Member {
            node_id: node_id.into(),
            public_key: key.public().to_base64(),
            mesh_ip,
            endpoint: format!("{underlay}:{WG_PORT}"),
            is_control: true,
        });
        let mut tasks = Vec::new();
        // The device: re-applied whenever the membership changes.
        let (ns2, key2, iface, bin, id) = (
            ns.to_owned(),
            key.clone(),
            interface.to_owned(),
            self.binary.clone(),
            node_id.to_owned(),
        );
        tasks.push(self.plane.follow_peer_set(node_id, move |set| {
            let want = mesh_state(&iface, &key2, mesh_ip, &set);
            let (ns3, bin2, iface2, id) = (ns2.clone(), bin.clone(), iface.clone(), id.clone());
            async move {
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
            }
        }));
        let mut addrs = vec![SocketAddr::from((mesh_ip, API_PORT))];
        if join {
            addrs.push(SocketAddr::from((underlay, API_PORT)));
        }
        let ips = [mesh_ip.to_string(), underlay.to_string()];
        let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
        for addr in addrs {
            // The mesh address exists once the device is up.
            let ns2 = ns.to_owned();
            let listener = bind_retrying(&format!("{addr} in {ns}"), 100, move || {
                let ns3 = ns2.clone();
                in_ns(
                    &ns3,
                    move || async move { std::net::TcpListener::bind(addr) },
                )
            })
            .await;
            tasks.push(
                self.plane
                    .serve_as(node_id, &ips, listener, std::future::pending()),
            );
        }
        self.controls.push(ControlHost {
            node_id: node_id.into(),
            ns: ns.into(),
            key,
            interface: interface.into(),
            tasks,
        });
    }
}

/// The device of a control host for `set`.
fn mesh_state(interface: &str, key: &PrivateKey, mesh_ip: Ipv4Addr, set: &PeerSet) -> MeshState {
    MeshState {
        interface: interface.to_owned(),
        private_key: key.clone(),
        listen_port: WG_PORT,
        address: mesh_ip,
        cidr: MESH_CIDR.parse().unwrap(),
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

/// The live WireGuard device of `interface` (userspace: its UAPI socket is
/// on the shared filesystem, whatever namespace runs it).
pub async fn device(interface: &str) -> Option<zattera_mesh::Inspect> {
    zattera_mesh::inspect(interface).await.ok().flatten()
}
