//! Shared pieces of the integration tests: the root/tool gate, real DNS
//! clients (dig, busybox nslookup), a dnsmasq upstream on loopback, and
//! guards that delete the links and namespaces a test made, pass or fail.
//!
//! Every test owns its addresses (127.77.<n>.x on loopback, 10.201.<240+n>.x
//! on its own bridges) and names (`ztd<tag>…`), so tests run in parallel.

#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods
)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use zattera_dns::{Config, DnsServer, ListenerSpec, Scope, UpstreamSource};

/// High port for loopback listeners: no root needed for the listener.
pub const PORT: u16 = 10053;

fn have(tool: &str) -> bool {
    let path = Path::new(tool);
    if path.is_absolute() {
        return path.exists();
    }
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(tool).exists()))
}

/// Whether the test can run. Missing tools or root: a failure under CI, a
/// recorded skip otherwise (`zattera_testkit::require`).
#[must_use]
pub fn require(_test: &str, root: bool, tools: &[&str]) -> bool {
    let mut missing: Vec<String> = tools
        .iter()
        .filter(|t| !have(t))
        .map(|t| (*t).to_owned())
        .collect();
    if root && !zattera_testkit::is_root() {
        missing.push("root".to_owned());
    }
    zattera_testkit::require(&missing)
}

pub const DNSMASQ: &str = "/usr/sbin/dnsmasq";

/// A dnsmasq on a loopback address, answering `*.example.test` with
/// 192.0.2.1 (A) and 2001:db8::1 (AAAA), refusing the rest; killed on drop.
pub struct Dnsmasq {
    child: Child,
    pub addr: SocketAddr,
}

impl Dnsmasq {
    pub fn start(ip: Ipv4Addr, port: u16, extra: &[&str]) -> Self {
        let log = tempfile::NamedTempFile::new().expect("dnsmasq log file");
        let child = Command::new(DNSMASQ)
            .args([
                "-k",
                "--no-resolv",
                "--no-hosts",
                "--conf-file=/dev/null",
                "--pid-file=",
                "--bind-interfaces",
                "--cache-size=0",
                "--address=/example.test/192.0.2.1",
                "--address=/example.test/2001:db8::1",
            ])
            .arg(format!("--listen-address={ip}"))
            .arg(format!("--port={port}"))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log.reopen().expect("dnsmasq log file"))
            .spawn()
            .expect("start dnsmasq");
        let mut me = Self {
            child,
            addr: SocketAddr::new(IpAddr::V4(ip), port),
        };
        // Generous: a loaded CI machine can be slow to start processes.
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = me.child.try_wait() {
                let text = std::fs::read_to_string(log.path()).unwrap_or_default();
                panic!("dnsmasq on {} exited ({status}): {text}", me.addr);
            }
            let out = dig(me.addr, &["+tries=1", "+time=1", "probe.example.test"]);
            if out.status == "NOERROR" {
                return me;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let text = std::fs::read_to_string(log.path()).unwrap_or_default();
        panic!("dnsmasq on {} did not come up: {text}", me.addr);
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What dig printed, picked apart.
#[derive(Debug, Clone)]
pub struct Dig {
    /// `NOERROR`, `NXDOMAIN`, …; empty when no answer came.
    pub status: String,
    pub flags: Vec<String>,
    /// Answer section lines: (name, ttl, type, data).
    pub answers: Vec<(String, u32, String, String)>,
    /// The OPT pseudosection's `udp:` size, if one came back.
    pub edns_udp: Option<u16>,
    pub raw: String,
}

impl Dig {
    pub fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    pub fn addrs(&self) -> Vec<String> {
        self.answers
            .iter()
            .filter(|a| a.2 == "A")
            .map(|a| a.3.clone())
            .collect()
    }
}

/// One A query for `name` sent from this process (over TCP when `tcp`),
/// timing only the exchange, never a client's start: the response code
/// (`None` when none came within 8 s) and how long it took.
pub async fn timed_query(
    at: SocketAddr,
    name: &str,
    tcp: bool,
) -> (Option<hickory_proto::op::ResponseCode>, Duration) {
    use hickory_proto::op::{Message, MessageType, OpCode, Query};
    use hickory_proto::rr::{Name, RecordType};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut m = Message::new(7, MessageType::Query, OpCode::Query);
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    m.metadata.recursion_desired = true;
    let query = m.to_vec().unwrap();
    let started = Instant::now();
    let exchange = async {
        if tcp {
            let mut s = tokio::net::TcpStream::connect(at).await.ok()?;
            s.write_all(&u16::try_from(query.len()).unwrap().to_be_bytes())
                .await
                .ok()?;
            s.write_all(&query).await.ok()?;
            let mut len = [0u8; 2];
            s.read_exact(&mut len).await.ok()?;
            let mut reply = vec![0u8; usize::from(u16::from_be_bytes(len))];
            s.read_exact(&mut reply).await.ok()?;
            Some(reply)
        } else {
            let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.ok()?;
            sock.send_to(&query, at).await.ok()?;
            let mut buf = vec![0u8; 4096];
            let n = sock.recv(&mut buf).await.ok()?;
            buf.truncate(n);
            Some(buf)
        }
    };
    let reply = tokio::time::timeout(Duration::from_secs(8), exchange)
        .await
        .ok()
        .flatten();
    let code = reply
        .and_then(|r| Message::from_vec(&r).ok())
        .map(|m| m.metadata.response_code);
    (code, started.elapsed())
}

/// Runs `dig @server -p port ARGS` (blocking) and parses the result.
pub fn dig(server: SocketAddr, args: &[&str]) -> Dig {
    let out = Command::new("dig")
        .arg(format!("@{}", server.ip()))
        .arg("-p")
        .arg(server.port().to_string())
        .args(args)
        .output()
        .expect("run dig");
    parse_dig(&String::from_utf8_lossy(&out.stdout))
}

/// [`dig`] off the async runtime's worker threads. The arguments are
/// copied before the future starts, so it borrows nothing.
pub fn dig_async(server: SocketAddr, args: &[&str]) -> impl Future<Output = Dig> + use<> {
    let args: Vec<String> = args.iter().map(|s| (*s).to_owned()).collect();
    async move {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            dig(server, &args)
        })
        .await
        .unwrap()
    }
}

fn parse_dig(raw: &str) -> Dig {
    let mut d = Dig {
        status: String::new(),
        flags: Vec::new(),
        answers: Vec::new(),
        edns_udp: None,
        raw: raw.to_owned(),
    };
    let mut in_answer = false;
    for line in raw.lines() {
        if let Some(rest) = line.split("status: ").nth(1) {
            rest.split(',')
                .next()
                .unwrap_or_default()
                .trim()
                .clone_into(&mut d.status);
        } else if let Some(rest) = line.strip_prefix(";; flags:") {
            d.flags = rest
                .split(';')
                .next()
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_owned)
                .collect();
        } else if line.starts_with("; EDNS:") {
            d.edns_udp = line
                .split("udp: ")
                .nth(1)
                .and_then(|s| s.trim().parse().ok());
        } else if line.starts_with(";; ANSWER SECTION:") {
            in_answer = true;
        } else if in_answer {
            let parts: Vec<&str> = line.split_whitespace().collect();
            if parts.len() < 5 {
                in_answer = false;
                continue;
            }
            d.answers.push((
                parts[0].to_owned(),
                parts[1].parse().unwrap_or(u32::MAX),
                parts[3].to_owned(),
                parts[4..].join(" "),
            ));
        }
    }
    d
}

/// A started server with fixed upstreams and quick limits for tests.
pub fn test_config(upstreams: Vec<SocketAddr>) -> Config {
    Config {
        port: PORT,
        upstreams: UpstreamSource::Fixed(upstreams),
        udp_sockets: 2,
        ..Config::default()
    }
}

pub async fn serve_on(server: &DnsServer, ip: IpAddr, scope: Scope) {
    let status = server
        .reconcile(vec![ListenerSpec { addr: ip, scope }])
        .await;
    assert!(status[0].is_serving(), "{status:?}");
}

fn run(cmd: &str) -> bool {
    let parts: Vec<&str> = cmd.split_whitespace().collect();
    Command::new(parts[0])
        .args(&parts[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn must(cmd: &str) {
    let parts: Vec<&str> = cmd.split_whitespace().collect();
    let out = Command::new(parts[0])
        .args(&parts[1..])
        .output()
        .expect(cmd);
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Deletes, on drop, every link and namespace registered with it.
#[derive(Default)]
pub struct NetGuard {
    links: Vec<String>,
    netns: Vec<String>,
}

impl NetGuard {
    /// A bridge holding `gateway/24`, up.
    pub fn bridge(&mut self, name: &str, gateway: Ipv4Addr) {
        assert!(name.len() <= 15 && name.starts_with("ztd"));
        // A leftover from a killed run would make the add fail.
        run(&format!("ip link del {name}"));
        must(&format!("ip link add {name} type bridge"));
        self.links.push(name.to_owned());
        must(&format!("ip addr add {gateway}/24 dev {name}"));
        must(&format!("ip link set {name} up"));
    }

    /// A network namespace ("container") on `bridge` with address `ip/24`
    /// and a default route via `gateway`.
    pub fn container(&mut self, ns: &str, bridge: &str, ip: Ipv4Addr, gateway: Ipv4Addr) {
        assert!(ns.len() <= 13 && ns.starts_with("ztd"));
        let host = format!("{ns}h");
        let peer = format!("{ns}n");
        run(&format!("ip netns del {ns}"));
        run(&format!("ip link del {host}"));
        must(&format!("ip netns add {ns}"));
        self.netns.push(ns.to_owned());
        must(&format!("ip link add {host} type veth peer name {peer}"));
        self.links.push(host.clone());
        must(&format!("ip link set {peer} netns {ns}"));
        must(&format!("ip link set {host} master {bridge} up"));
        must(&format!("ip -n {ns} addr add {ip}/24 dev {peer}"));
        must(&format!("ip -n {ns} link set {peer} up"));
        must(&format!("ip -n {ns} link set lo up"));
        must(&format!("ip -n {ns} route add default via {gateway}"));
    }
}

impl Drop for NetGuard {
    fn drop(&mut self) {
        for ns in &self.netns {
            run(&format!("ip netns del {ns}"));
        }
        for link in &self.links {
            run(&format!("ip link del {link}"));
        }
    }
}

/// `busybox nslookup NAME SERVER` inside `ns`: (exit ok, output).
pub async fn nslookup_in(ns: &str, name: &str, server: Ipv4Addr) -> (bool, String) {
    let out = tokio::process::Command::new("ip")
        .args(["netns", "exec", ns, "busybox", "nslookup", name])
        .arg(server.to_string())
        .output()
        .await
        .expect("run busybox nslookup");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}
