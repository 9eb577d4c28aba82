//! Shared scaffolding for the netns integration tests: a per-test world
//! (its own interface prefix, nft table and run dir) that is torn down on
//! drop, pass or fail, and helpers to run code inside a namespace.
//!
//! Network safety: tests only ever send traffic to loopback and to
//! addresses on interfaces and namespaces they create (10.201.x.x).

#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods
)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use zattera_netns::{NetConfig, NetNode};

/// Whether the host can run these tests. Without root or tools: a failure
/// under CI, a recorded skip otherwise (`zattera_testkit::require`).
pub fn ready(_test: &str) -> bool {
    let mut missing = Vec::new();
    if !zattera_testkit::is_root() {
        missing.push("root".to_owned());
    }
    for tool in ["nft", "ip", "nsenter"] {
        if Command::new(tool).arg("--version").output().is_err() {
            missing.push(format!("the {tool} binary"));
        }
    }
    zattera_testkit::require(&missing)
}

/// One test's private corner of the host.
pub struct World {
    pub prefix: String,
    pub table: String,
    pub dir: tempfile::TempDir,
    pub cfg: NetConfig,
    /// Extra namespace files the test made (outside-world netns).
    pub extra_netns: Vec<PathBuf>,
}

impl World {
    pub fn new(test: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let name_hash = test.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        let seed = u64::from(std::process::id()) ^ u64::from(nanos).rotate_left(17) ^ name_hash;
        let mut n = seed;
        let mut prefix = String::from("zt");
        for _ in 0..5 {
            prefix.push(char::from(b'a' + u8::try_from(n % 26).unwrap()));
            n /= 26;
        }
        let table = format!("zttest_{prefix}");
        let dir = tempfile::Builder::new()
            .prefix("zt-netns-test-")
            .tempdir()
            .unwrap();
        let cfg = NetConfig {
            bridge_prefix: prefix.clone(),
            nft_table: table.clone(),
            netns_dir: dir.path().join("netns"),
            ..NetConfig::default()
        };
        Self {
            prefix,
            table,
            dir,
            cfg,
            extra_netns: Vec::new(),
        }
    }

    pub fn node(&self) -> NetNode {
        NetNode::new(self.cfg.clone()).unwrap()
    }

    /// A test-only interface name under this world's prefix that never
    /// parses as one of the library's own names.
    pub fn extra_ifname(&self, tag: &str) -> String {
        let name = format!("{}x{tag}", self.prefix);
        assert!(name.len() <= 15, "{name}");
        name
    }
}

impl Drop for World {
    fn drop(&mut self) {
        // Links first (deleting a veth end takes its peer), then namespace
        // files, then our table. Everything is matched by this world's names.
        if let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let Some(name) = line.split(": ").nth(1) else {
                    continue;
                };
                let name = name.split('@').next().unwrap_or(name);
                if name.starts_with(&self.prefix) {
                    let _ = Command::new("ip").args(["link", "del", name]).output();
                }
            }
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.cfg.netns_dir)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        files.extend(self.extra_netns.iter().cloned());
        for f in files {
            let _ = nix::mount::umount2(&f, nix::mount::MntFlags::MNT_DETACH);
            let _ = std::fs::remove_file(&f);
        }
        // The library makes namespace dirs shared mounts of themselves:
        // unmount everything under our temp dir, deepest and newest first,
        // until nothing is left (bounded).
        for _ in 0..10 {
            let mounts = mounts_under(self.dir.path());
            if mounts.is_empty() {
                break;
            }
            for m in mounts.iter().rev() {
                let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
            }
        }
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.table])
            .output();
    }
}

/// Mount points at or under `dir`, in mount order.
fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(PathBuf::from)
        .filter(|p| p.starts_with(dir))
        .collect()
}

/// Runs `f` on a fresh thread that has entered the namespace at `path`.
pub fn in_ns<T: Send + 'static>(path: &Path, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = path.to_owned();
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        f()
    })
    .join()
    .unwrap()
}

/// A TCP server inside a namespace that answers every connection with
/// `<reply> <peer ip>` and stops when dropped. Bounded: it polls a flag.
pub struct Server {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub fn tcp_server(netns: Option<&Path>, bind: SocketAddrV4, reply: &'static str) -> Server {
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let flag = stop.clone();
    let netns = netns.map(Path::to_owned);
    let thread = std::thread::spawn(move || {
        if let Some(p) = netns {
            let file = std::fs::File::open(&p).unwrap();
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        }
        let l = TcpListener::bind(bind).unwrap();
        l.set_nonblocking(true).unwrap();
        tx.send(()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        while !flag.load(Ordering::SeqCst) && Instant::now() < deadline {
            match l.accept() {
                Ok((mut s, peer)) => {
                    let _ = s.set_nonblocking(false);
                    let _ = write!(s, "{reply} {}", peer.ip());
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("server did not start");
    Server {
        stop,
        thread: Some(thread),
    }
}

/// A UDP server inside a namespace answering each datagram with `reply`.
pub fn udp_server(netns: Option<&Path>, bind: SocketAddrV4, reply: &'static str) -> Server {
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let flag = stop.clone();
    let netns = netns.map(Path::to_owned);
    let thread = std::thread::spawn(move || {
        if let Some(p) = netns {
            let file = std::fs::File::open(&p).unwrap();
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        }
        let s = UdpSocket::bind(bind).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        tx.send(()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut buf = [0u8; 64];
        while !flag.load(Ordering::SeqCst) && Instant::now() < deadline {
            if let Ok((_, peer)) = s.recv_from(&mut buf) {
                let _ = s.send_to(reply.as_bytes(), peer);
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("server did not start");
    Server {
        stop,
        thread: Some(thread),
    }
}

/// Connects (from `netns`, or the host) and reads the server's reply.
pub fn tcp_get(netns: Option<&Path>, to: SocketAddrV4) -> Result<String, String> {
    let run = move || {
        let mut s = TcpStream::connect_timeout(&to.into(), Duration::from_millis(1500))
            .map_err(|e| format!("connect {to}: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out)
            .map_err(|e| format!("read {to}: {e}"))?;
        Ok(out)
    };
    match netns {
        Some(p) => in_ns(p, run),
        None => run(),
    }
}

/// Sends one datagram and waits for the answer (three tries).
pub fn udp_get(netns: Option<&Path>, to: SocketAddrV4) -> Result<String, String> {
    let run = move || {
        let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(700)))
            .unwrap();
        let mut buf = [0u8; 64];
        for _ in 0..3 {
            s.send_to(b"ping", to)
                .map_err(|e| format!("send {to}: {e}"))?;
            if let Ok((n, _)) = s.recv_from(&mut buf) {
                return Ok(String::from_utf8_lossy(&buf[..n]).into_owned());
            }
        }
        Err(format!("no UDP answer from {to}"))
    };
    match netns {
        Some(p) => in_ns(p, run),
        None => run(),
    }
}

/// Runs `ip ARGS` (test set-up only; the library never shells out) and
/// panics with its stderr on failure.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn link_exists(name: &str) -> bool {
    Command::new("ip")
        .args(["link", "show", "dev", name])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `nft list ruleset` without any `zattera*`/`zttest*` table: the part of
/// the host's ruleset the library must never change. Stateless (`-s`): the
/// host's own counters move with any traffic on the machine.
pub fn foreign_ruleset() -> String {
    let out = Command::new("nft")
        .args(["-s", "list", "ruleset"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let mut kept = String::new();
    let mut skipping = false;
    for line in text.lines() {
        if !skipping && line.starts_with("table ") {
            let name = line.split_whitespace().nth(2).unwrap_or("");
            skipping = name.starts_with("zattera") || name.starts_with("zttest");
        }
        if !skipping {
            kept.push_str(line);
            kept.push('\n');
        }
        if skipping && line == "}" {
            skipping = false;
        }
    }
    kept
}

/// Creates a dummy interface; on kernels built without `CONFIG_DUMMY` an
/// `ifb` device plays the same part (a non-bridge device that only holds
/// addresses and never forwards).
pub fn add_dummy(name: &str) {
    let out = Command::new("ip")
        .args(["link", "add", name, "type", "dummy"])
        .output()
        .unwrap();
    if !out.status.success() {
        eprintln!(
            "no dummy driver ({}), using ifb for {name}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        ip(&["link", "add", name, "type", "ifb"]);
    }
}
