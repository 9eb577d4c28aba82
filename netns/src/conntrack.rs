//! Forgetting conntrack entries that would route a packet past our rules:
//! - the flows of an unpublished UDP port (runtime.md C-7): a UDP
//!   "connection" lives as long as its client keeps sending, so without this
//!   a client would keep reaching the old container after the port is
//!   unpublished or moved;
//! - the stale, un-NATed flows to a port just published: if a host process
//!   served that port until a moment ago, its closed connections linger in
//!   conntrack (CLOSE, TIME_WAIT), and Linux reopens such an entry for a new
//!   SYN from the same client port *without* NAT, so that client's connection
//!   is refused instead of reaching the container. No live connection can be
//!   among them: the port could only be bound by us if none was left.
//!
//! Talks ctnetlink directly: dump the IPv4 table, pick the entries that are
//! exactly our DNAT of that port (original destination port and address,
//! reply source = the container's address and port), and delete each by its
//! full tuple. It never sends a delete without a tuple, which would flush the
//! whole table.

use std::net::Ipv4Addr;
use std::time::Duration;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::error::{Error, Result};
use crate::firewall::{Proto, PublishedPort};

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_GET: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;
const NLA_TYPE_MASK: u16 = 0x3fff;
const AF_INET: u8 = 2;

const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_ZONE: u16 = 18;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;

const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

/// One direction of a connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Tuple {
    src: Option<Ipv4Addr>,
    dst: Option<Ipv4Addr>,
    proto: Option<u8>,
    sport: Option<u16>,
    dport: Option<u16>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Entry {
    orig: Tuple,
    reply: Tuple,
    zone: Option<u16>,
}

impl Entry {
    /// Whether this flow went to `port`'s host address and port and was not
    /// translated (a host socket served it).
    fn is_unnated_to(&self, port: &PublishedPort) -> bool {
        let proto = match port.proto {
            Proto::Tcp => IPPROTO_TCP,
            Proto::Udp => IPPROTO_UDP,
        };
        let to_host = match self.orig.dst {
            Some(dst) if port.host_ip.is_unspecified() => dst.is_loopback(),
            Some(dst) => dst == port.host_ip,
            None => false,
        };
        self.orig.proto == Some(proto)
            && self.orig.dport == Some(port.host_port)
            && to_host
            && self.reply.src == self.orig.dst
            && self.reply.sport == self.orig.dport
    }

    /// Whether this is a flow DNATed through `port`.
    fn is_flow_of(&self, port: &PublishedPort) -> bool {
        let proto = match port.proto {
            Proto::Tcp => IPPROTO_TCP,
            Proto::Udp => IPPROTO_UDP,
        };
        self.orig.proto == Some(proto)
            && self.orig.dport == Some(port.host_port)
            && (port.host_ip.is_unspecified() || self.orig.dst == Some(port.host_ip))
            && self.reply.src == Some(port.container_ip)
            && self.reply.sport == Some(port.container_port)
    }
}

fn io_err(op: &'static str, e: impl Into<std::io::Error>) -> Error {
    Error::Conntrack {
        op,
        source: e.into(),
    }
}

/// Deletes the conntrack entries of flows through `ports`; returns how many.
pub fn forget(ports: &[PublishedPort]) -> Result<usize> {
    forget_where(ports, Entry::is_flow_of)
}

/// Deletes the un-NATed entries toward ports that were just published
/// (see the module doc); returns how many.
pub fn forget_stale(ports: &[PublishedPort]) -> Result<usize> {
    forget_where(ports, Entry::is_unnated_to)
}

fn forget_where(
    ports: &[PublishedPort],
    matches: fn(&Entry, &PublishedPort) -> bool,
) -> Result<usize> {
    if ports.is_empty() {
        return Ok(0);
    }
    let mut sock =
        Socket::new(NETLINK_NETFILTER).map_err(|e| io_err("open a ctnetlink socket", e))?;
    sock.bind_auto()
        .map_err(|e| io_err("bind the ctnetlink socket", e))?;
    sock.connect(&SocketAddr::new(0, 0))
        .map_err(|e| io_err("connect the ctnetlink socket", e))?;
    // Never wait on the kernel for ever.
    nix::sys::socket::setsockopt(
        &sock,
        nix::sys::socket::sockopt::ReceiveTimeout,
        &nix::sys::time::TimeVal::from(libc_timeval(Duration::from_secs(5))),
    )
    .map_err(|e| io_err("set a timeout on the ctnetlink socket", e))?;

    let entries = dump(&sock)?;
    let mut deleted = 0;
    for (seq, entry) in (2u32..).zip(
        entries
            .iter()
            .filter(|e| ports.iter().any(|p| matches(e, p))),
    ) {
        if delete(&sock, seq, entry)? {
            deleted += 1;
        }
    }
    Ok(deleted)
}

fn libc_timeval(d: Duration) -> nix::libc::timeval {
    nix::libc::timeval {
        tv_sec: nix::libc::time_t::try_from(d.as_secs()).unwrap_or(5),
        tv_usec: 0,
    }
}

fn header(buf: &mut Vec<u8>, msg_type: u16, flags: u16, seq: u32) {
    buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched by finish
    buf.extend_from_slice(&msg_type.to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes());
    // nfgenmsg: family, version 0, resource id 0 (big-endian)
    buf.extend_from_slice(&[AF_INET, 0, 0, 0]);
}

fn finish(buf: &mut [u8]) {
    let len = u32::try_from(buf.len()).unwrap_or(u32::MAX);
    buf[..4].copy_from_slice(&len.to_ne_bytes());
}

fn attr(buf: &mut Vec<u8>, ty: u16, payload: &[u8]) {
    let len = u16::try_from(4 + payload.len()).unwrap_or(u16::MAX);
    buf.extend_from_slice(&len.to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(payload);
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

fn tuple_attr(buf: &mut Vec<u8>, ty: u16, t: &Tuple) {
    let mut ip = Vec::new();
    if let Some(a) = t.src {
        attr(&mut ip, CTA_IP_V4_SRC, &a.octets());
    }
    if let Some(a) = t.dst {
        attr(&mut ip, CTA_IP_V4_DST, &a.octets());
    }
    let mut proto = Vec::new();
    if let Some(p) = t.proto {
        attr(&mut proto, CTA_PROTO_NUM, &[p]);
    }
    if let Some(p) = t.sport {
        attr(&mut proto, CTA_PROTO_SRC_PORT, &p.to_be_bytes());
    }
    if let Some(p) = t.dport {
        attr(&mut proto, CTA_PROTO_DST_PORT, &p.to_be_bytes());
    }
    let mut inner = Vec::new();
    attr(&mut inner, CTA_TUPLE_IP | NLA_F_NESTED, &ip);
    attr(&mut inner, CTA_TUPLE_PROTO | NLA_F_NESTED, &proto);
    attr(buf, ty | NLA_F_NESTED, &inner);
}

/// Attributes of a netlink payload, as (type without flags, value).
fn attrs(mut data: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while data.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([data[0], data[1]]));
        let ty = u16::from_ne_bytes([data[2], data[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > data.len() {
            break;
        }
        out.push((ty, &data[4..len]));
        let next = (len + 3) & !3;
        data = data.get(next..).unwrap_or(&[]);
    }
    out
}

fn be16(v: &[u8]) -> Option<u16> {
    Some(u16::from_be_bytes(v.get(..2)?.try_into().ok()?))
}

fn v4(v: &[u8]) -> Option<Ipv4Addr> {
    let o: [u8; 4] = v.get(..4)?.try_into().ok()?;
    Some(Ipv4Addr::from(o))
}

fn parse_tuple(data: &[u8]) -> Tuple {
    let mut t = Tuple::default();
    for (ty, v) in attrs(data) {
        match ty {
            CTA_TUPLE_IP => {
                for (ty, v) in attrs(v) {
                    match ty {
                        CTA_IP_V4_SRC => t.src = v4(v),
                        CTA_IP_V4_DST => t.dst = v4(v),
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_PROTO => {
                for (ty, v) in attrs(v) {
                    match ty {
                        CTA_PROTO_NUM => t.proto = v.first().copied(),
                        CTA_PROTO_SRC_PORT => t.sport = be16(v),
                        CTA_PROTO_DST_PORT => t.dport = be16(v),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    t
}

fn parse_entry(payload: &[u8]) -> Entry {
    let mut e = Entry::default();
    for (ty, v) in attrs(payload) {
        match ty {
            CTA_TUPLE_ORIG => e.orig = parse_tuple(v),
            CTA_TUPLE_REPLY => e.reply = parse_tuple(v),
            CTA_ZONE => e.zone = be16(v),
            _ => {}
        }
    }
    e
}

/// Splits a receive buffer into (type, payload after nfgenmsg, error code).
fn messages(buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut rest = buf;
    while rest.len() >= 16 {
        let len =
            usize::try_from(u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]])).unwrap_or(0);
        if len < 16 || len > rest.len() {
            break;
        }
        let ty = u16::from_ne_bytes([rest[4], rest[5]]);
        out.push((ty, &rest[16..len]));
        rest = rest.get((len + 3) & !3..).unwrap_or(&[]);
    }
    out
}

fn error_code(payload: &[u8]) -> i32 {
    payload
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .map_or(0, i32::from_ne_bytes)
}

fn dump(sock: &Socket) -> Result<Vec<Entry>> {
    let mut req = Vec::new();
    header(
        &mut req,
        (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET,
        NLM_F_REQUEST | NLM_F_DUMP,
        1,
    );
    finish(&mut req);
    sock.send(&req, 0)
        .map_err(|e| io_err("request the conntrack table", e))?;
    let mut entries = Vec::new();
    loop {
        let (buf, _) = sock
            .recv_from_full()
            .map_err(|e| io_err("read the conntrack table", e))?;
        if buf.is_empty() {
            return Ok(entries);
        }
        for (ty, payload) in messages(&buf) {
            match ty {
                NLMSG_DONE => return Ok(entries),
                NLMSG_ERROR => {
                    let code = error_code(payload);
                    if code != 0 {
                        return Err(io_err(
                            "read the conntrack table",
                            std::io::Error::from_raw_os_error(-code),
                        ));
                    }
                }
                _ => entries.push(parse_entry(payload.get(4..).unwrap_or(&[]))),
            }
        }
    }
}

/// Deletes one entry by its full original tuple; `false` if it was gone.
fn delete(sock: &Socket, seq: u32, entry: &Entry) -> Result<bool> {
    let mut req = Vec::new();
    header(
        &mut req,
        (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
    );
    tuple_attr(&mut req, CTA_TUPLE_ORIG, &entry.orig);
    if let Some(zone) = entry.zone.filter(|z| *z != 0) {
        attr(&mut req, CTA_ZONE, &zone.to_be_bytes());
    }
    finish(&mut req);
    sock.send(&req, 0)
        .map_err(|e| io_err("delete a conntrack entry", e))?;
    let (buf, _) = sock
        .recv_from_full()
        .map_err(|e| io_err("delete a conntrack entry", e))?;
    for (ty, payload) in messages(&buf) {
        if ty == NLMSG_ERROR {
            return match -error_code(payload) {
                0 => Ok(true),
                ENOENT => Ok(false),
                code => Err(io_err(
                    "delete a conntrack entry",
                    std::io::Error::from_raw_os_error(code),
                )),
            };
        }
    }
    Ok(true)
}

const ENOENT: i32 = 2;

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn tuples_round_trip_through_the_wire_format() {
        let t = Tuple {
            src: Some(Ipv4Addr::new(10, 201, 5, 9)),
            dst: Some(Ipv4Addr::LOCALHOST),
            proto: Some(IPPROTO_UDP),
            sport: Some(40_000),
            dport: Some(5353),
        };
        let mut buf = Vec::new();
        tuple_attr(&mut buf, CTA_TUPLE_ORIG, &t);
        let parsed = attrs(&buf);
        assert_eq!(parsed.len(), 1);
        assert_eq!(parsed[0].0, CTA_TUPLE_ORIG);
        assert_eq!(parse_tuple(parsed[0].1), t);
    }

    #[test]
    fn only_our_dnat_flows_match() {
        let port = PublishedPort {
            proto: Proto::Udp,
            host_ip: Ipv4Addr::LOCALHOST,
            host_port: 5353,
            container_ip: Ipv4Addr::new(10, 201, 5, 2),
            container_port: 53,
        };
        let ours = Entry {
            orig: Tuple {
                dst: Some(Ipv4Addr::LOCALHOST),
                proto: Some(IPPROTO_UDP),
                dport: Some(5353),
                ..Tuple::default()
            },
            reply: Tuple {
                src: Some(Ipv4Addr::new(10, 201, 5, 2)),
                sport: Some(53),
                ..Tuple::default()
            },
            zone: None,
        };
        assert!(ours.is_flow_of(&port));
        // A plain local socket on the same port (not DNATed) is left alone.
        let mut local = ours;
        local.reply.src = Some(Ipv4Addr::LOCALHOST);
        assert!(!local.is_flow_of(&port));
        let mut tcp = ours;
        tcp.orig.proto = Some(IPPROTO_TCP);
        assert!(!tcp.is_flow_of(&port));
    }

    #[test]
    fn only_untranslated_flows_to_a_new_port_are_stale() {
        let port = PublishedPort {
            proto: Proto::Tcp,
            host_ip: Ipv4Addr::LOCALHOST,
            host_port: 45011,
            container_ip: Ipv4Addr::new(10, 201, 5, 2),
            container_port: 80,
        };
        let lo = Some(Ipv4Addr::LOCALHOST);
        let stale = Entry {
            orig: Tuple {
                src: lo,
                dst: lo,
                proto: Some(IPPROTO_TCP),
                sport: Some(45016),
                dport: Some(45011),
            },
            reply: Tuple {
                src: lo,
                dst: lo,
                proto: Some(IPPROTO_TCP),
                sport: Some(45011),
                dport: Some(45016),
            },
            zone: None,
        };
        assert!(stale.is_unnated_to(&port));
        let mut any = port;
        any.host_ip = Ipv4Addr::UNSPECIFIED;
        assert!(stale.is_unnated_to(&any), "0.0.0.0 covers loopback");
        // Our own DNAT of that port is not stale.
        let mut ours = stale;
        ours.reply.src = Some(port.container_ip);
        ours.reply.sport = Some(80);
        assert!(!ours.is_unnated_to(&port) && ours.is_flow_of(&port));
        // Another address, port or protocol is not ours to touch.
        let mut other = stale;
        other.orig.dport = Some(45012);
        assert!(!other.is_unnated_to(&port));
        let mut remote = stale;
        remote.orig.dst = Some(Ipv4Addr::new(192, 0, 2, 1));
        remote.reply.src = remote.orig.dst;
        assert!(!remote.is_unnated_to(&port) && !remote.is_unnated_to(&any));
    }
}
