//! Host ports for published container ports. The kernel never sees a socket
//! on a DNATed port, so a port is "free" when no socket is bound to it (a
//! bind test) and no other published port of ours maps it.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, UdpSocket};

use crate::error::{Error, Result};
use crate::firewall::Proto;

/// Docker's fallback when `ip_local_port_range` cannot be read.
const FALLBACK_RANGE: (u16, u16) = (49153, 65535);

/// The ports already published by us, rebuilt from durable records.
#[derive(Debug, Default)]
pub struct HostPorts {
    taken: BTreeSet<(Proto, Ipv4Addr, u16)>,
    cursor: u16,
}

impl HostPorts {
    pub fn from_records(records: impl IntoIterator<Item = (Proto, Ipv4Addr, u16)>) -> Self {
        Self {
            taken: records.into_iter().collect(),
            cursor: 0,
        }
    }

    fn clashes(&self, proto: Proto, ip: Ipv4Addr, port: u16) -> bool {
        // 0.0.0.0 covers every address, so it clashes with all of them.
        self.taken.iter().any(|&(p, i, n)| {
            p == proto && n == port && (i == ip || i.is_unspecified() || ip.is_unspecified())
        })
    }

    /// Reserves `requested`, or an ephemeral port when it is `None`.
    pub fn allocate(&mut self, proto: Proto, ip: Ipv4Addr, requested: Option<u16>) -> Result<u16> {
        if let Some(port) = requested {
            if self.clashes(proto, ip, port) {
                return Err(Error::Port {
                    proto: proto.name(),
                    ip,
                    port,
                    cause: "already published by another container".into(),
                });
            }
            bind_test(proto, ip, port).map_err(|e| Error::Port {
                proto: proto.name(),
                ip,
                port,
                cause: format!("in use on the host ({e})"),
            })?;
            self.taken.insert((proto, ip, port));
            return Ok(port);
        }
        let (lo, hi) = ephemeral_range();
        let span = u32::from(hi - lo) + 1;
        let start = if (lo..=hi).contains(&self.cursor) {
            self.cursor
        } else {
            lo
        };
        for step in 1..=span {
            let Ok(port) = u16::try_from(u32::from(lo) + (u32::from(start - lo) + step) % span)
            else {
                continue;
            };
            if !self.clashes(proto, ip, port) && bind_test(proto, ip, port).is_ok() {
                self.taken.insert((proto, ip, port));
                self.cursor = port;
                return Ok(port);
            }
        }
        Err(Error::PortsExhausted {
            proto: proto.name(),
            ip,
            lo,
            hi,
        })
    }

    pub fn release(&mut self, proto: Proto, ip: Ipv4Addr, port: u16) {
        self.taken.remove(&(proto, ip, port));
    }
}

/// Binds and drops a socket: the port is free right now.
fn bind_test(proto: Proto, ip: Ipv4Addr, port: u16) -> std::io::Result<()> {
    let addr = SocketAddrV4::new(ip, port);
    match proto {
        Proto::Tcp => TcpListener::bind(addr).map(drop),
        Proto::Udp => UdpSocket::bind(addr).map(drop),
    }
}

fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(str::parse::<u16>);
            match (it.next(), it.next()) {
                (Some(Ok(lo)), Some(Ok(hi))) if lo > 0 && lo <= hi => Some((lo, hi)),
                _ => None,
            }
        })
        .unwrap_or(FALLBACK_RANGE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ephemeral_ports_avoid_bound_and_published_ports() {
        let lo = Ipv4Addr::LOCALHOST;
        let mut ports = HostPorts::default();
        let a = ports.allocate(Proto::Tcp, lo, None).unwrap();
        let b = ports.allocate(Proto::Tcp, lo, None).unwrap();
        assert_ne!(a, b);
        // A port someone is listening on is refused when asked for.
        let l = TcpListener::bind((lo, 0)).unwrap();
        let busy = l.local_addr().unwrap().port();
        assert!(ports.allocate(Proto::Tcp, lo, Some(busy)).is_err());
        // A published port is refused even though nothing is bound to it.
        assert!(ports.allocate(Proto::Tcp, lo, Some(a)).is_err());
        assert!(
            ports
                .allocate(Proto::Tcp, Ipv4Addr::UNSPECIFIED, Some(a))
                .is_err()
        );
        // The other protocol is independent.
        ports.allocate(Proto::Udp, lo, Some(a)).unwrap();
        ports.release(Proto::Tcp, lo, a);
        ports.allocate(Proto::Tcp, lo, Some(a)).unwrap();
    }
}
