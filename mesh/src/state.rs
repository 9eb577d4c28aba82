//! What the mesh interface should be (`MeshState`, desired and whole) and
//! what it is (`Inspect`), plus the one rule between them: which peers a
//! change touches. A peer that did not change is never sent to the device,
//! so its session and handshake stay as they are.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use serde::Serialize;

use crate::key::{PrivateKey, PublicKey};

/// An IPv4 network, `addr/prefix`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Net {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl Net {
    pub fn host(addr: Ipv4Addr) -> Self {
        Self { addr, prefix: 32 }
    }
}

impl std::str::FromStr for Net {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        let bad = || crate::Error::Invalid(format!("{s:?} is not an IPv4 network (a.b.c.d/n)"));
        let (addr, prefix) = s.split_once('/').unwrap_or((s, "32"));
        let addr: Ipv4Addr = addr.parse().map_err(|_| bad())?;
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        if prefix > 32 {
            return Err(bad());
        }
        Ok(Self { addr, prefix })
    }
}

impl std::fmt::Display for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// One peer as the node wants it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerConfig {
    /// Candidate endpoints, best first; the device is given the first.
    pub endpoints: Vec<SocketAddr>,
    pub allowed_ips: Vec<Net>,
    /// Seconds; 0 is off.
    pub keepalive: u16,
}

/// The whole interface as the node wants it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshState {
    pub interface: String,
    pub private_key: PrivateKey,
    pub listen_port: u16,
    /// The node's mesh address.
    pub address: Ipv4Addr,
    /// The mesh CIDR, routed through the interface.
    pub cidr: Net,
    pub mtu: u32,
    pub peers: BTreeMap<PublicKey, PeerConfig>,
}

/// The kernel or userspace device as it is now.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Inspect {
    pub interface: String,
    pub backend: &'static str,
    pub public_key: Option<String>,
    pub listen_port: u16,
    pub peers: Vec<PeerStatus>,
}

/// One peer of a live device.
#[derive(Clone, Debug, Serialize)]
pub struct PeerStatus {
    pub public_key: String,
    #[serde(skip)]
    pub key: Option<PublicKey>,
    pub endpoint: Option<SocketAddr>,
    pub allowed_ips: Vec<Net>,
    pub keepalive: u16,
    /// Time since the latest handshake; `None` before the first.
    #[serde(serialize_with = "secs")]
    pub since_handshake: Option<Duration>,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

#[allow(clippy::ref_option)]
fn secs<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

impl PeerStatus {
    /// A peer known by its key only, before its attributes are read.
    pub fn named(key: Option<PublicKey>, text: &str) -> Self {
        Self {
            public_key: key.map_or_else(|| text.to_owned(), |k| k.to_base64()),
            key,
            endpoint: None,
            allowed_ips: Vec::new(),
            keepalive: 0,
            since_handshake: None,
            rx_bytes: 0,
            tx_bytes: 0,
        }
    }

    /// Whether the live peer already is what `want` asks for. An endpoint
    /// the device learned by roaming counts when it is one of the candidates.
    pub fn matches(&self, want: &PeerConfig) -> bool {
        let mut have_ips = self.allowed_ips.clone();
        let mut want_ips = want.allowed_ips.clone();
        have_ips.sort();
        want_ips.sort();
        let endpoint_ok = match self.endpoint {
            Some(e) => want.endpoints.is_empty() || want.endpoints.contains(&e),
            None => want.endpoints.is_empty(),
        };
        have_ips == want_ips && self.keepalive == want.keepalive && endpoint_ok
    }
}

/// Which peers a change from `have` to `want` adds or replaces, and which
/// it removes; every other peer is left alone.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PeerChanges {
    pub upsert: Vec<PublicKey>,
    pub remove: Vec<PublicKey>,
}

impl PeerChanges {
    pub fn between(have: &[PeerStatus], want: &BTreeMap<PublicKey, PeerConfig>) -> Self {
        let live: BTreeMap<PublicKey, &PeerStatus> =
            have.iter().filter_map(|p| Some((p.key?, p))).collect();
        let upsert = want
            .iter()
            .filter(|(k, w)| live.get(k).is_none_or(|p| !p.matches(w)))
            .map(|(k, _)| *k)
            .collect();
        let remove = live
            .keys()
            .filter(|k| !want.contains_key(k))
            .copied()
            .collect();
        Self { upsert, remove }
    }

    pub fn is_empty(&self) -> bool {
        self.upsert.is_empty() && self.remove.is_empty()
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn key(n: u8) -> PublicKey {
        PublicKey([n; 32])
    }

    fn want(port: u16) -> PeerConfig {
        PeerConfig {
            endpoints: vec![SocketAddr::from(([192, 0, 2, 1], port))],
            allowed_ips: vec!["10.90.1.2/32".parse().unwrap()],
            keepalive: 0,
        }
    }

    fn live(n: u8, c: &PeerConfig) -> PeerStatus {
        PeerStatus {
            public_key: key(n).to_base64(),
            key: Some(key(n)),
            endpoint: c.endpoints.first().copied(),
            allowed_ips: c.allowed_ips.clone(),
            keepalive: c.keepalive,
            since_handshake: None,
            rx_bytes: 0,
            tx_bytes: 0,
        }
    }

    #[test]
    fn only_changed_peers_are_touched() {
        let have = vec![live(1, &want(1)), live(2, &want(2)), live(3, &want(3))];
        let mut target = BTreeMap::new();
        target.insert(key(1), want(1)); // the same
        target.insert(key(2), want(20)); // a new endpoint
        target.insert(key(4), want(4)); // new
        let c = PeerChanges::between(&have, &target);
        assert_eq!(c.upsert, vec![key(2), key(4)]);
        assert_eq!(c.remove, vec![key(3)]);
        target.remove(&key(4));
        target.insert(key(2), want(2));
        target.insert(key(3), want(3));
        assert!(PeerChanges::between(&have, &target).is_empty());
    }

    #[test]
    fn a_roamed_endpoint_among_the_candidates_is_no_change() {
        let mut w = want(1);
        w.endpoints
            .push(SocketAddr::from(([198, 51, 100, 7], 51820)));
        let mut have = live(1, &w);
        have.endpoint = Some(w.endpoints[1]);
        assert!(have.matches(&w));
        have.endpoint = Some(SocketAddr::from(([203, 0, 113, 9], 1)));
        assert!(!have.matches(&w));
    }

    #[test]
    fn networks_parse() {
        assert_eq!("10.90.0.0/16".parse::<Net>().unwrap().prefix, 16);
        assert_eq!(
            "10.90.1.1".parse::<Net>().unwrap(),
            Net::host([10, 90, 1, 1].into())
        );
        assert!("10.90.0.0/33".parse::<Net>().is_err());
        assert!("nope/8".parse::<Net>().is_err());
    }
}
