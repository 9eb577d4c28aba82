//! Host ports for published container ports, held open for as long as they
//! are published.
//!
//! A DNAT rule publishes a port the kernel's socket table knows nothing
//! about: if nothing holds it, the kernel may hand it to any host process
//! (an ephemeral bind, a test server), and that process's local connections
//! then silently reach a container. So every published port is held by a
//! socket of ours, the way Docker's userland proxy and kube-proxy hold theirs:
//! - TCP: bound, never listening, so a packet the DNAT rule does not catch
//!   gets a reset instead of sitting in an accept queue;
//! - UDP: bound, with the smallest receive buffer;
//! - never `SO_REUSEADDR` or `SO_REUSEPORT`, so no other socket can bind the
//!   address (with or without those options), and the kernel skips the port
//!   for ephemeral binds and outgoing connections.
//!
//! A port stops being held only after the rules that used it are gone:
//! [`HostPorts::release`] parks the socket and [`HostPorts::retire`], called
//! once the new rules are in place, closes it. Ephemeral ports come from a
//! [`PortRange`] that by default lies outside the kernel's own ephemeral
//! range (`ip_local_port_range`), so even while the agent is down (no
//! sockets) the kernel does not give them out.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddrV4};

use socket2::{Domain, Protocol, Socket, Type};

use crate::error::{Error, Result};
use crate::firewall::Proto;

/// An inclusive range of host ports, written `LO-HI`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    pub lo: u16,
    pub hi: u16,
}

impl PortRange {
    /// Ephemeral host ports by default: 30000-32767, Kubernetes' NodePort
    /// range, chosen for the same reason: it lies just below Linux's default
    /// `ip_local_port_range` (32768-60999), so the kernel never hands these
    /// ports to a host process's ephemeral bind.
    pub const DEFAULT: PortRange = PortRange {
        lo: 30000,
        hi: 32767,
    };

    pub fn contains(self, port: u16) -> bool {
        (self.lo..=self.hi).contains(&port)
    }

    pub fn overlaps(self, other: PortRange) -> bool {
        self.lo <= other.hi && other.lo <= self.hi
    }

    fn len(self) -> u32 {
        u32::from(self.hi - self.lo) + 1
    }

    /// The kernel's ephemeral range in this network namespace, if readable.
    pub fn kernel_ephemeral() -> Option<PortRange> {
        let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
        let mut it = text.split_whitespace().map(str::parse::<u16>);
        match (it.next(), it.next()) {
            (Some(Ok(lo)), Some(Ok(hi))) if lo > 0 && lo <= hi => Some(PortRange { lo, hi }),
            _ => None,
        }
    }
}

impl Default for PortRange {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl std::fmt::Display for PortRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.lo, self.hi)
    }
}

impl std::str::FromStr for PortRange {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::Config(format!(
                "port range {s:?} is not LO-HI with 1 <= LO <= HI <= 65535"
            ))
        };
        let (lo, hi) = s.split_once('-').ok_or_else(bad)?;
        let lo: u16 = lo.trim().parse().map_err(|_| bad())?;
        let hi: u16 = hi.trim().parse().map_err(|_| bad())?;
        if lo == 0 || lo > hi {
            return Err(bad());
        }
        Ok(PortRange { lo, hi })
    }
}

type Key = (Proto, Ipv4Addr, u16);

/// The host ports this agent publishes, each held by a bound socket.
#[derive(Debug, Default)]
pub struct HostPorts {
    range: PortRange,
    held: BTreeMap<Key, Socket>,
    /// Released, but still bound until the rules without them are applied;
    /// with the [`mark`](HostPorts::mark) they were released under.
    retiring: BTreeMap<Key, (Socket, u64)>,
    cursor: u16,
    /// The mark the next published set will carry.
    epoch: u64,
}

impl HostPorts {
    pub fn new(range: PortRange) -> Self {
        Self {
            range,
            ..Self::default()
        }
    }

    pub fn range(&self) -> PortRange {
        self.range
    }

    /// Holds a port that an existing container already publishes (its
    /// record, at start). Fails when someone else took it meanwhile.
    pub fn hold(&mut self, proto: Proto, ip: Ipv4Addr, port: u16) -> Result<()> {
        if self.held.contains_key(&(proto, ip, port)) {
            return Ok(());
        }
        if self.clashes(proto, ip, port) {
            return Err(already_ours(proto, ip, port));
        }
        let socket = self.take((proto, ip, port))?;
        self.held.insert((proto, ip, port), socket);
        Ok(())
    }

    /// Holds `requested`, or an ephemeral port from the range when `None`.
    pub fn allocate(&mut self, proto: Proto, ip: Ipv4Addr, requested: Option<u16>) -> Result<u16> {
        if let Some(port) = requested {
            if self.held.contains_key(&(proto, ip, port)) || self.clashes(proto, ip, port) {
                return Err(already_ours(proto, ip, port));
            }
            let socket = self.take((proto, ip, port))?;
            self.held.insert((proto, ip, port), socket);
            return Ok(port);
        }
        let range = self.range;
        let start = if range.contains(self.cursor) {
            self.cursor
        } else {
            range.hi
        };
        for step in 1..=range.len() {
            let offset = (u32::from(start - range.lo) + step) % range.len();
            let Ok(port) = u16::try_from(u32::from(range.lo) + offset) else {
                continue;
            };
            let key = (proto, ip, port);
            // A retiring port is skipped too: its old rule may still be live.
            if self.clashes(proto, ip, port) || self.retiring.contains_key(&key) {
                continue;
            }
            if let Ok(socket) = bind(proto, ip, port) {
                self.held.insert(key, socket);
                self.cursor = port;
                return Ok(port);
            }
        }
        Err(Error::PortsExhausted {
            proto: proto.name(),
            ip,
            lo: range.lo,
            hi: range.hi,
        })
    }

    /// Stops publishing a port. Its socket stays bound until [`retire`]:
    /// closing it before the rule is gone would let a host process bind the
    /// port and lose its connections to the old rule.
    ///
    /// [`retire`]: HostPorts::retire
    pub fn release(&mut self, proto: Proto, ip: Ipv4Addr, port: u16) {
        if let Some(socket) = self.held.remove(&(proto, ip, port)) {
            self.retiring
                .insert((proto, ip, port), (socket, self.epoch));
        }
    }

    /// Closes the sockets of released ports: call once the rules without
    /// them are in place.
    pub fn retire(&mut self) {
        self.retiring.clear();
    }

    /// Marks the set of held ports about to be published: the rules of a
    /// set are applied later, elsewhere, and [`retire_through`] its mark
    /// closes only what was released before the set was taken.
    ///
    /// [`retire_through`]: HostPorts::retire_through
    pub fn mark(&mut self) -> u64 {
        let mark = self.epoch;
        self.epoch += 1;
        mark
    }

    /// Closes the sockets released before [`mark`](HostPorts::mark)
    /// returned `mark`: the rules of that set are in place.
    pub fn retire_through(&mut self, mark: u64) {
        self.retiring.retain(|_, (_, released)| *released > mark);
    }

    /// Whether this port is held (published by us right now).
    pub fn is_held(&self, proto: Proto, ip: Ipv4Addr, port: u16) -> bool {
        self.held.contains_key(&(proto, ip, port))
    }

    /// The socket for `key`: a retiring one of ours (the port is published
    /// again, e.g. by the replacement of a container), else a new bind.
    fn take(&mut self, key: Key) -> Result<Socket> {
        if let Some((socket, _)) = self.retiring.remove(&key) {
            return Ok(socket);
        }
        let (proto, ip, port) = key;
        bind(proto, ip, port).map_err(|e| match e.kind() {
            std::io::ErrorKind::AddrInUse => Error::PortInUse {
                proto: proto.name(),
                ip,
                port,
                holder: holder::find(proto, port),
            },
            _ => Error::Port {
                proto: proto.name(),
                ip,
                port,
                cause: format!("cannot bind: {e}"),
            },
        })
    }

    /// 0.0.0.0 covers every address, so it clashes with all of them.
    fn clashes(&self, proto: Proto, ip: Ipv4Addr, port: u16) -> bool {
        self.held.keys().any(|&(p, i, n)| {
            p == proto && n == port && (i == ip || i.is_unspecified() || ip.is_unspecified())
        })
    }
}

fn already_ours(proto: Proto, ip: Ipv4Addr, port: u16) -> Error {
    Error::Port {
        proto: proto.name(),
        ip,
        port,
        cause: "already published by another container".into(),
    }
}

/// A bound socket that holds `ip:port` and accepts nothing.
fn bind(proto: Proto, ip: Ipv4Addr, port: u16) -> std::io::Result<Socket> {
    let (ty, protocol) = match proto {
        Proto::Tcp => (Type::STREAM, Protocol::TCP),
        Proto::Udp => (Type::DGRAM, Protocol::UDP),
    };
    let addr = SocketAddrV4::new(ip, port).into();
    let socket = Socket::new(Domain::IPV4, ty, Some(protocol))?;
    if proto == Proto::Udp {
        socket.set_recv_buffer_size(0)?;
    }
    match socket.bind(&addr) {
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && proto == Proto::Tcp => {
            // Connections a departed server left in TIME_WAIT keep the port
            // for a minute. SO_REUSEADDR binds over them (and over nothing
            // live), and is cleared at once, so no one else can bind it.
            let retry = Socket::new(Domain::IPV4, ty, Some(protocol))?;
            retry.set_reuse_address(true)?;
            retry.bind(&addr).map_err(|_| e)?;
            retry.set_reuse_address(false)?;
            Ok(retry)
        }
        Err(e) => Err(e),
        Ok(()) => Ok(socket),
    }
}

/// Who holds a port, for the error that says why it cannot be published.
pub mod holder {
    use std::collections::BTreeSet;

    use crate::firewall::Proto;

    /// `pid 1234 (python3)` for the first process with a socket bound to
    /// `port` in this network namespace, from /proc.
    pub fn find(proto: Proto, port: u16) -> Option<String> {
        let tables: &[&str] = match proto {
            Proto::Tcp => &["/proc/net/tcp", "/proc/net/tcp6"],
            Proto::Udp => &["/proc/net/udp", "/proc/net/udp6"],
        };
        let inodes: BTreeSet<u64> = tables
            .iter()
            .filter_map(|t| std::fs::read_to_string(t).ok())
            .flat_map(|text| socket_inodes(&text, port))
            .collect();
        if inodes.is_empty() {
            return None;
        }
        let procs = std::fs::read_dir("/proc").ok()?;
        for entry in procs.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
                continue;
            };
            let holds = fds.flatten().any(|fd| {
                std::fs::read_link(fd.path()).is_ok_and(|target| {
                    socket_inode(&target.to_string_lossy()).is_some_and(|i| inodes.contains(&i))
                })
            });
            if holds {
                let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
                return Some(format!("pid {pid} ({})", comm.trim()));
            }
        }
        None
    }

    /// Inodes of the sockets in a /proc/net table whose local port is `port`.
    pub(crate) fn socket_inodes(table: &str, port: u16) -> Vec<u64> {
        table
            .lines()
            .skip(1)
            .filter_map(|line| {
                let cols: Vec<&str> = line.split_whitespace().collect();
                let local = cols.get(1)?;
                let (_, hex_port) = local.rsplit_once(':')?;
                (u16::from_str_radix(hex_port, 16).ok()? == port)
                    .then(|| cols.get(9)?.parse::<u64>().ok())
                    .flatten()
            })
            .filter(|inode| *inode != 0)
            .collect()
    }

    fn socket_inode(link: &str) -> Option<u64> {
        link.strip_prefix("socket:[")?
            .strip_suffix(']')?
            .parse()
            .ok()
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::net::{TcpListener, TcpStream, UdpSocket};

    use super::*;

    fn range_with_free_ports() -> PortRange {
        // High ports are rarely bound by anything on a test machine.
        PortRange {
            lo: 61000,
            hi: 61999,
        }
    }

    #[test]
    fn ranges_parse_and_compare() {
        let r: PortRange = "30000-32767".parse().unwrap();
        assert_eq!(r, PortRange::DEFAULT);
        assert_eq!(r.to_string(), "30000-32767");
        for bad in ["", "1", "0-5", "9-3", "1-70000", "a-b"] {
            assert!(bad.parse::<PortRange>().is_err(), "{bad}");
        }
        let kernel_default = PortRange {
            lo: 32768,
            hi: 60999,
        };
        assert!(!PortRange::DEFAULT.overlaps(kernel_default));
        assert!(
            PortRange {
                lo: 32000,
                hi: 33000
            }
            .overlaps(kernel_default)
        );
    }

    #[test]
    fn a_held_port_cannot_be_bound_by_anyone_else() {
        let lo = Ipv4Addr::LOCALHOST;
        let mut ports = HostPorts::new(range_with_free_ports());
        let tcp = ports.allocate(Proto::Tcp, lo, None).unwrap();
        let udp = ports.allocate(Proto::Udp, lo, None).unwrap();
        assert!(ports.range().contains(tcp) && ports.range().contains(udp));
        // std sets SO_REUSEADDR on listeners: still refused.
        assert!(TcpListener::bind((lo, tcp)).is_err());
        assert!(TcpListener::bind((Ipv4Addr::UNSPECIFIED, tcp)).is_err());
        assert!(UdpSocket::bind((lo, udp)).is_err());
        // Nothing listens: a connection that no DNAT rule catches is refused.
        assert!(TcpStream::connect((lo, tcp)).is_err());

        // Released, it stays held until the rules are applied.
        ports.release(Proto::Tcp, lo, tcp);
        assert!(!ports.is_held(Proto::Tcp, lo, tcp));
        assert!(TcpListener::bind((lo, tcp)).is_err());
        ports.retire();
        drop(TcpListener::bind((lo, tcp)).unwrap());
    }

    #[test]
    fn a_released_port_asked_for_again_keeps_its_socket() {
        let lo = Ipv4Addr::LOCALHOST;
        let mut ports = HostPorts::new(range_with_free_ports());
        let p = ports.allocate(Proto::Tcp, lo, None).unwrap();
        ports.release(Proto::Tcp, lo, p);
        // A replacement container asks for the same fixed port.
        assert_eq!(ports.allocate(Proto::Tcp, lo, Some(p)).unwrap(), p);
        ports.retire();
        assert!(ports.is_held(Proto::Tcp, lo, p));
        assert!(TcpListener::bind((lo, p)).is_err());
    }

    #[test]
    fn a_mark_retires_only_what_was_released_before_it() {
        let lo = Ipv4Addr::LOCALHOST;
        let mut ports = HostPorts::new(range_with_free_ports());
        let early = ports.allocate(Proto::Tcp, lo, None).unwrap();
        let late = ports.allocate(Proto::Tcp, lo, None).unwrap();
        ports.release(Proto::Tcp, lo, early);
        // The set without `early` is taken; `late` goes after, so that
        // set's rules still point at it.
        let mark = ports.mark();
        ports.release(Proto::Tcp, lo, late);
        ports.retire_through(mark);
        drop(TcpListener::bind((lo, early)).unwrap());
        assert!(TcpListener::bind((lo, late)).is_err(), "still in the rules");
        let next = ports.mark();
        ports.retire_through(next);
        drop(TcpListener::bind((lo, late)).unwrap());
    }

    #[test]
    fn published_and_foreign_ports_are_refused_with_the_holder() {
        let lo = Ipv4Addr::LOCALHOST;
        let mut ports = HostPorts::new(range_with_free_ports());
        let a = ports.allocate(Proto::Tcp, lo, None).unwrap();
        let b = ports.allocate(Proto::Tcp, lo, None).unwrap();
        assert_ne!(a, b);
        let err = ports.allocate(Proto::Tcp, lo, Some(a)).unwrap_err();
        assert!(err.to_string().contains("already published"), "{err}");
        assert!(
            ports
                .allocate(Proto::Tcp, Ipv4Addr::UNSPECIFIED, Some(a))
                .is_err()
        );
        // The other protocol is independent.
        ports.allocate(Proto::Udp, lo, Some(a)).unwrap();

        let foreign = TcpListener::bind((lo, 0)).unwrap();
        let busy = foreign.local_addr().unwrap().port();
        let err = ports.allocate(Proto::Tcp, lo, Some(busy)).unwrap_err();
        let text = err.to_string();
        assert!(text.contains(&format!("127.0.0.1:{busy}/tcp")), "{text}");
        assert!(
            text.contains(&format!("pid {}", std::process::id())),
            "the holder is named: {text}"
        );
        assert!(ports.hold(Proto::Tcp, lo, busy).is_err());
    }

    #[test]
    fn a_port_left_in_time_wait_is_held_and_then_refused_to_others() {
        use std::io::{Read, Write};
        let lo = Ipv4Addr::LOCALHOST;
        let server = TcpListener::bind((lo, 0)).unwrap();
        let port = server.local_addr().unwrap().port();
        let mut client = TcpStream::connect((lo, port)).unwrap();
        let (mut accepted, _) = server.accept().unwrap();
        // The server side closes first: its end of the connection sits in
        // TIME_WAIT on the port.
        accepted.write_all(b"bye").unwrap();
        drop(accepted);
        let mut buf = Vec::new();
        client.read_to_end(&mut buf).unwrap();
        drop(client);
        drop(server);
        let mut ports = HostPorts::new(range_with_free_ports());
        ports.hold(Proto::Tcp, lo, port).unwrap();
        // Held: not even a SO_REUSEADDR listener (std's) may take it.
        assert!(TcpListener::bind((lo, port)).is_err());
    }

    #[test]
    fn ephemeral_ports_skip_what_is_bound() {
        let lo = Ipv4Addr::LOCALHOST;
        let range = PortRange {
            lo: 61500,
            hi: 61503,
        };
        let taken: Vec<TcpListener> = [61501, 61502]
            .iter()
            .filter_map(|p| TcpListener::bind((lo, *p)).ok())
            .collect();
        let mut ports = HostPorts::new(range);
        let mut got = Vec::new();
        while let Ok(p) = ports.allocate(Proto::Tcp, lo, None) {
            got.push(p);
        }
        assert_eq!(got.len(), 4 - taken.len(), "{got:?}");
        let err = ports.allocate(Proto::Tcp, lo, None).unwrap_err();
        assert!(err.to_string().contains("61500-61503"), "{err}");
    }

    #[test]
    fn proc_net_tables_are_read_by_local_port() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
           0: 0100007F:4732 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 12345 1 0000000000000000 100 0 0 10 0\n\
           1: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 777 1 0000000000000000 100 0 0 10 0\n";
        assert_eq!(holder::socket_inodes(table, 0x4732), vec![12345]);
        assert_eq!(holder::socket_inodes(table, 8080), vec![777]);
        assert!(holder::socket_inodes(table, 1).is_empty());
    }
}
