//! The device's side of the UAPI protocol ([`crate::uapi`] is the agent's):
//! a `set=1` body parsed into a [`Set`] (pure, tested here), and the
//! `get=1` answer written from the device's state. Errors answer
//! `errno=22` (EINVAL), as wireguard-go and boringtun do.

use std::fmt::Write as _;
use std::net::SocketAddr;

use crate::key::{PrivateKey, PublicKey};
use crate::state::Net;

pub(crate) const EINVAL: i32 = 22;

/// One `set=1` request.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Set {
    pub private_key: Option<[u8; 32]>,
    pub listen_port: Option<u16>,
    pub replace_peers: bool,
    pub peers: Vec<PeerSet>,
}

/// What a `set=1` says of one peer (the lines after its `public_key=`).
#[derive(Debug, PartialEq)]
pub(crate) struct PeerSet {
    pub key: PublicKey,
    pub remove: bool,
    pub update_only: bool,
    pub endpoint: Option<SocketAddr>,
    pub keepalive: Option<u16>,
    pub preshared_key: Option<[u8; 32]>,
    pub replace_allowed_ips: bool,
    pub allowed_ips: Vec<Net>,
}

impl PeerSet {
    fn new(key: PublicKey) -> Self {
        Self {
            key,
            remove: false,
            update_only: false,
            endpoint: None,
            keepalive: None,
            preshared_key: None,
            replace_allowed_ips: false,
            allowed_ips: Vec::new(),
        }
    }
}

/// Parses the lines of a `set=1` request after its first line, up to the
/// empty line. An unknown key, a bad value, an IPv6 allowed IP (the mesh is
/// IPv4) or a non-zero fwmark (not supported) refuse the whole request.
pub(crate) fn parse_set(body: &str) -> Result<Set, i32> {
    let mut set = Set::default();
    for line in body.lines() {
        if line.is_empty() {
            break;
        }
        let (k, v) = line.split_once('=').ok_or(EINVAL)?;
        let bad = |_| EINVAL;
        if k == "public_key" {
            set.peers
                .push(PeerSet::new(PublicKey::from_hex(v).map_err(bad)?));
            continue;
        }
        let Some(peer) = set.peers.last_mut() else {
            match k {
                "private_key" => {
                    set.private_key = Some(PrivateKey::from_hex(v).map_err(bad)?.bytes());
                }
                "listen_port" => set.listen_port = Some(v.parse().map_err(|_| EINVAL)?),
                "fwmark" if v == "0" || v.is_empty() => {}
                "replace_peers" => set.replace_peers = v == "true",
                _ => return Err(EINVAL),
            }
            continue;
        };
        match k {
            "remove" => peer.remove = v == "true",
            "update_only" => peer.update_only = v == "true",
            "endpoint" => peer.endpoint = Some(v.parse().map_err(|_| EINVAL)?),
            "persistent_keepalive_interval" => {
                peer.keepalive = Some(v.parse().map_err(|_| EINVAL)?);
            }
            "preshared_key" => {
                peer.preshared_key = Some(PublicKey::from_hex(v).map_err(bad)?.0);
            }
            "replace_allowed_ips" => peer.replace_allowed_ips = v == "true",
            "allowed_ip" => peer.allowed_ips.push(v.parse().map_err(bad)?),
            "protocol_version" if v == "1" => {}
            _ => return Err(EINVAL),
        }
    }
    Ok(set)
}

/// One peer as `get=1` reports it.
pub(crate) struct PeerGet {
    pub key: PublicKey,
    pub endpoint: Option<SocketAddr>,
    pub allowed_ips: Vec<Net>,
    pub keepalive: u16,
    /// Time since the last handshake (boringtun's meaning of
    /// `last_handshake_time_*`, which [`crate::uapi::parse_get`] reads).
    pub since_handshake: Option<std::time::Duration>,
    pub rx_bytes: usize,
    pub tx_bytes: usize,
}

/// The `get=1` answer, `errno=0` and the closing empty line included.
pub(crate) fn format_get(own: Option<PublicKey>, listen_port: u16, peers: &[PeerGet]) -> String {
    let mut out = String::new();
    if let Some(k) = own {
        let _ = writeln!(out, "own_public_key={}", k.to_hex());
    }
    let _ = writeln!(out, "listen_port={listen_port}");
    for p in peers {
        let _ = writeln!(out, "public_key={}", p.key.to_hex());
        if let Some(e) = p.endpoint {
            let _ = writeln!(out, "endpoint={e}");
        }
        for ip in &p.allowed_ips {
            let _ = writeln!(out, "allowed_ip={ip}");
        }
        let _ = writeln!(out, "persistent_keepalive_interval={}", p.keepalive);
        if let Some(d) = p.since_handshake {
            let _ = writeln!(out, "last_handshake_time_sec={}", d.as_secs());
            let _ = writeln!(out, "last_handshake_time_nsec={}", d.subsec_nanos());
        }
        let _ = writeln!(out, "rx_bytes={}\ntx_bytes={}", p.rx_bytes, p.tx_bytes);
    }
    out.push_str("errno=0\n\n");
    out
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::uapi::parse_get;

    #[test]
    fn what_the_agent_sends_parses() {
        let own = PrivateKey::generate().unwrap();
        let two = PublicKey([2; 32]);
        let body = format!(
            "private_key={}\nlisten_port=51820\npublic_key={}\nremove=true\npublic_key={}\nendpoint=192.0.2.2:51820\npersistent_keepalive_interval=25\nallowed_ip=10.90.1.2/32\n\n",
            own.to_hex(),
            two.to_hex(),
            two.to_hex()
        );
        let set = parse_set(&body).unwrap();
        assert_eq!(set.private_key, Some(own.bytes()));
        assert_eq!(set.listen_port, Some(51820));
        assert_eq!(set.peers.len(), 2);
        assert!(set.peers[0].remove);
        let p = &set.peers[1];
        assert_eq!((p.key, p.remove, p.keepalive), (two, false, Some(25)));
        assert_eq!(p.endpoint, Some("192.0.2.2:51820".parse().unwrap()));
        assert_eq!(p.allowed_ips, vec![Net::host([10, 90, 1, 2].into())]);
    }

    #[test]
    fn what_the_device_cannot_do_is_refused() {
        assert_eq!(parse_set("fwmark=7\n"), Err(EINVAL));
        assert_eq!(parse_set("listen_port=x\n"), Err(EINVAL));
        assert_eq!(parse_set("endpoint=192.0.2.1:1\n"), Err(EINVAL));
        let six = format!(
            "public_key={}\nallowed_ip=fd00::1/128\n",
            PublicKey([1; 32]).to_hex()
        );
        assert_eq!(parse_set(&six), Err(EINVAL));
        assert_eq!(
            parse_set("fwmark=0\n\nignored after the end"),
            Ok(Set::default())
        );
    }

    #[test]
    fn the_get_answer_reads_back_as_the_agent_reads_it() {
        let own = PrivateKey::generate().unwrap().public();
        let peer = PeerGet {
            key: PublicKey([3; 32]),
            endpoint: Some("192.0.2.3:51820".parse().unwrap()),
            allowed_ips: vec![Net::host([10, 90, 1, 3].into())],
            keepalive: 25,
            since_handshake: Some(std::time::Duration::new(4, 2)),
            rx_bytes: 7,
            tx_bytes: 9,
        };
        let have = parse_get(&format_get(Some(own), 51820, &[peer])).unwrap();
        assert_eq!(have.public_key, Some(own.to_base64()));
        assert_eq!(have.listen_port, 51820);
        let p = &have.peers[0];
        assert_eq!(p.key, Some(PublicKey([3; 32])));
        assert_eq!((p.rx_bytes, p.tx_bytes, p.keepalive), (7, 9, 25));
        assert_eq!(p.since_handshake, Some(std::time::Duration::new(4, 2)));
        assert_eq!(p.allowed_ips, vec![Net::host([10, 90, 1, 3].into())]);
    }
}
