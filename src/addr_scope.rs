//! Whether an address is reachable from the internet at large, or lies in
//! a range that only this node or its networks reach (loopback, private,
//! link-local: the node's bridges, the mesh, cloud metadata).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Whether `ip` is globally routable: none of the private, shared (CGNAT),
/// loopback, link-local, documentation, benchmark, multicast or reserved
/// ranges.
pub fn is_global_v4(ip: Ipv4Addr) -> bool {
    let [a, b, c, _] = ip.octets();
    !(ip.is_private()
        || ip.is_loopback()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_documentation()
        || ip.is_multicast()
        || a == 0
        || (a == 100 && (64..128).contains(&b))
        || (a == 192 && b == 0 && c == 0)
        || (a == 198 && (18..20).contains(&b))
        || a >= 240)
}

/// As [`is_global_v4`], for either family: an IPv6 address must be global
/// unicast (2000::/3) outside the documentation range; one that embeds an
/// IPv4 address (mapped, NAT64) is judged by that address.
pub fn is_global(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_global_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = embedded_v4(v6) {
                return is_global_v4(v4);
            }
            let first = v6.segments()[0];
            (first & 0xe000) == 0x2000 && !(first == 0x2001 && v6.segments()[1] == 0x0db8)
        }
    }
}

fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let nat64 = v6.segments()[..6] == [0x64, 0xff9b, 0, 0, 0, 0];
    let [.., a, b, c, d] = v6.octets();
    (nat64 || v6.to_ipv4_mapped().is_some()).then(|| Ipv4Addr::new(a, b, c, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 44.11 (a private default-route address is never advertised as a
    /// mesh endpoint) and 56.10 (no redirect into the node's networks).
    #[test]
    fn only_public_addresses_are_global() {
        for local in [
            "172.16.0.1",
            "192.0.2.1",
            "198.18.0.1",
            "0.1.2.3",
            "240.0.0.1",
            "224.0.0.1",
            "127.0.0.2",
            "10.201.3.4",
            "10.90.1.1",
            "169.254.169.254",
            "192.168.1.1",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2001:db8::1",
        ] {
            assert!(!is_global(local.parse().unwrap()), "{local}");
        }
        for public in [
            "1.1.1.1",
            "100.128.0.1",
            "172.32.0.1",
            "203.0.114.1",
            "2606:4700::1111",
            "::ffff:1.1.1.1",
        ] {
            assert!(is_global(public.parse().unwrap()), "{public}");
        }
    }
}
