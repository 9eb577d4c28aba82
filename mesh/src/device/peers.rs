//! The device's peers: each one's tunnel (boringtun's `Tunn`, the noise
//! state machine), endpoint and allowed IPs, and the lookups the data path
//! makes per packet.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};

use boringtun::noise::handshake::parse_handshake_anon;
use boringtun::noise::{Packet, Tunn};
use boringtun::x25519;

use super::config::PeerSet;
use crate::key::PublicKey;
use crate::state::Net;

pub(crate) struct Peer {
    pub key: PublicKey,
    /// The receiver index its tunnel answers to (the top 24 bits of a
    /// packet's `receiver_idx`).
    pub index: u32,
    pub keepalive: u16,
    pub preshared_key: Option<[u8; 32]>,
    pub allowed_ips: Vec<Net>,
    tunn: Mutex<Tunn>,
    endpoint: Mutex<Option<SocketAddr>>,
}

impl Peer {
    /// The tunnel, locked. A poisoned lock (a thread panicked holding it)
    /// still holds a usable tunnel: the noise state is updated in place.
    pub fn tunn(&self) -> MutexGuard<'_, Tunn> {
        self.tunn
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub fn endpoint(&self) -> Option<SocketAddr> {
        *self
            .endpoint
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Roaming: the peer's last authenticated source address is where its
    /// packets go.
    pub fn set_endpoint(&self, at: SocketAddr) {
        let mut e = self
            .endpoint
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *e != Some(at) {
            *e = Some(at);
        }
    }

    pub fn allows(&self, ip: IpAddr) -> bool {
        matches!(ip, IpAddr::V4(v4) if self.allowed_ips.iter().any(|n| contains(*n, v4)))
    }
}

fn contains(net: Net, ip: Ipv4Addr) -> bool {
    let mask = u32::MAX
        .checked_shl(32 - u32::from(net.prefix))
        .unwrap_or(0);
    u32::from(net.addr) & mask == u32::from(ip) & mask
}

/// The device's key and peers. Read by the data path once per batch;
/// written by `set=1`.
#[derive(Default)]
pub(crate) struct Peers {
    pub key: Option<(x25519::StaticSecret, x25519::PublicKey)>,
    pub list: Vec<Arc<Peer>>,
    next_index: u32,
}

impl Peers {
    /// The peer whose allowed IPs hold `dst`, longest prefix first. A
    /// scan: a mesh has tens of peers, and a hash per packet costs as much.
    pub fn route(&self, dst: IpAddr) -> Option<&Arc<Peer>> {
        let IpAddr::V4(v4) = dst else { return None };
        self.list
            .iter()
            .filter_map(|p| {
                let best = p
                    .allowed_ips
                    .iter()
                    .filter(|n| contains(**n, v4))
                    .map(|n| n.prefix)
                    .max()?;
                Some((best, p))
            })
            .max_by_key(|(prefix, _)| *prefix)
            .map(|(_, p)| p)
    }

    /// The peer an incoming datagram is for: by the initiator's static key
    /// for a handshake initiation, by the receiver index otherwise.
    pub fn for_datagram(&self, datagram: &[u8]) -> Option<&Arc<Peer>> {
        let index = match Tunn::parse_incoming_packet(datagram).ok()? {
            Packet::HandshakeInit(p) => {
                let (secret, public) = self.key.as_ref()?;
                let half = parse_handshake_anon(secret, public, &p).ok()?;
                let key = PublicKey(half.peer_static_public);
                return self.list.iter().find(|peer| peer.key == key);
            }
            Packet::HandshakeResponse(p) => p.receiver_idx,
            Packet::PacketCookieReply(p) => p.receiver_idx,
            Packet::PacketData(p) => p.receiver_idx,
        };
        self.list.iter().find(|peer| peer.index == index >> 8)
    }

    /// Sets the device key; every tunnel starts over with it.
    pub fn set_key(&mut self, secret: [u8; 32]) {
        let secret = x25519::StaticSecret::from(secret);
        let public = x25519::PublicKey::from(&secret);
        if self.key.as_ref().map(|k| k.1) == Some(public) {
            return;
        }
        self.key = Some((secret, public));
        let old = std::mem::take(&mut self.list);
        for p in old {
            let endpoint = p.endpoint();
            self.add(
                p.key,
                p.preshared_key,
                p.keepalive,
                p.allowed_ips.clone(),
                endpoint,
            );
        }
    }

    /// Applies one peer's lines of a `set=1`. A peer that exists and whose
    /// keepalive or preshared key changes gets a new tunnel (boringtun
    /// cannot change those in place); endpoint and allowed IPs change in
    /// place. Without a device key no peer can be added: `Err`.
    pub fn apply(&mut self, set: &PeerSet) -> Result<(), ()> {
        let at = self.list.iter().position(|p| p.key == set.key);
        if set.remove {
            if let Some(i) = at {
                self.list.remove(i);
            }
            return Ok(());
        }
        let old = match at {
            Some(i) => Some(self.list.remove(i)),
            None if set.update_only => return Ok(()),
            None => None,
        };
        let mut allowed = match (&old, set.replace_allowed_ips) {
            (Some(p), false) => p.allowed_ips.clone(),
            _ => Vec::new(),
        };
        allowed.extend(
            set.allowed_ips
                .iter()
                .filter(|n| !allowed.contains(n))
                .copied()
                .collect::<Vec<_>>(),
        );
        let endpoint = set
            .endpoint
            .or_else(|| old.as_ref().and_then(|p| p.endpoint()));
        let keepalive = set
            .keepalive
            .or(old.as_ref().map(|p| p.keepalive))
            .unwrap_or(0);
        let psk = set
            .preshared_key
            .or(old.as_ref().and_then(|p| p.preshared_key));
        if let Some(p) = old.filter(|p| p.keepalive == keepalive && p.preshared_key == psk) {
            // Same tunnel, new routing: the session survives.
            let same = Peer {
                key: p.key,
                index: p.index,
                keepalive,
                preshared_key: psk,
                allowed_ips: allowed,
                tunn: Mutex::new(take_tunn(p)),
                endpoint: Mutex::new(endpoint),
            };
            self.list.push(Arc::new(same));
            return Ok(());
        }
        if self.key.is_none() {
            return Err(());
        }
        self.add(set.key, psk, keepalive, allowed, endpoint);
        Ok(())
    }

    fn add(
        &mut self,
        key: PublicKey,
        psk: Option<[u8; 32]>,
        keepalive: u16,
        allowed_ips: Vec<Net>,
        endpoint: Option<SocketAddr>,
    ) {
        let Some(secret) = self.key.as_ref().map(|k| k.0.clone()) else {
            return;
        };
        let index = self.fresh_index();
        let tunn = Tunn::new(
            secret,
            x25519::PublicKey::from(key.0),
            psk,
            (keepalive > 0).then_some(keepalive),
            index,
            None,
        );
        self.list.push(Arc::new(Peer {
            key,
            index,
            keepalive,
            preshared_key: psk,
            allowed_ips,
            tunn: Mutex::new(tunn),
            endpoint: Mutex::new(endpoint),
        }));
    }

    /// A 24-bit index no live peer has, starting from a random one so that
    /// a restarted device does not reuse its predecessor's.
    fn fresh_index(&mut self) -> u32 {
        if self.next_index == 0 {
            let mut b = [0u8; 4];
            let _ = getrandom::getrandom(&mut b);
            self.next_index = u32::from_le_bytes(b) & 0xff_ffff;
        }
        loop {
            self.next_index = (self.next_index + 1) & 0xff_ffff;
            let i = self.next_index;
            if i != 0 && !self.list.iter().any(|p| p.index == i) {
                return i;
            }
        }
    }
}

/// The tunnel out of a peer being rebuilt. The data path may still hold
/// a clone of the old `Arc` for the rest of its batch; then the tunnel is
/// moved out from under the lock and the old peer keeps a dummy.
fn take_tunn(p: Arc<Peer>) -> Tunn {
    match Arc::try_unwrap(p) {
        Ok(p) => p
            .tunn
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
        Err(shared) => {
            let mut guard = shared.tunn();
            let dummy_key = x25519::StaticSecret::from([0u8; 32]);
            let dummy = Tunn::new(
                dummy_key,
                x25519::PublicKey::from([0u8; 32]),
                None,
                None,
                0,
                None,
            );
            std::mem::replace(&mut *guard, dummy)
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn peer_set(n: u8, nets: &[&str]) -> PeerSet {
        let mut s = super::super::config::parse_set(&format!(
            "public_key={}\n",
            PublicKey([n; 32]).to_hex()
        ))
        .unwrap()
        .peers
        .remove(0);
        s.allowed_ips = nets.iter().map(|n| n.parse().unwrap()).collect();
        s
    }

    #[test]
    fn packets_go_to_the_longest_prefix_and_a_peer_changes_in_place() {
        let mut peers = Peers::default();
        assert!(
            peers.apply(&peer_set(1, &["10.90.0.0/16"])).is_err(),
            "no key yet"
        );
        peers.set_key([7; 32]);
        peers.apply(&peer_set(1, &["10.90.0.0/16"])).unwrap();
        peers.apply(&peer_set(2, &["10.90.1.2/32"])).unwrap();
        let to = |ip: [u8; 4]| peers.route(IpAddr::from(ip)).map(|p| p.key.0[0]);
        assert_eq!(to([10, 90, 1, 2]), Some(2));
        assert_eq!(to([10, 90, 7, 7]), Some(1));
        assert_eq!(to([10, 91, 0, 1]), None);

        let index = peers.list[1].index;
        let mut more = peer_set(2, &["10.90.1.3/32"]);
        more.endpoint = Some("192.0.2.2:51820".parse().unwrap());
        peers.apply(&more).unwrap();
        let two = peers.list.iter().find(|p| p.key.0[0] == 2).unwrap();
        assert_eq!(two.index, index, "same tunnel");
        assert_eq!(two.allowed_ips.len(), 2);
        assert!(two.allows(IpAddr::from([10, 90, 1, 3])));
        assert_eq!(two.endpoint(), Some("192.0.2.2:51820".parse().unwrap()));

        let mut gone = peer_set(2, &[]);
        gone.remove = true;
        peers.apply(&gone).unwrap();
        assert_eq!(peers.list.len(), 1);
        assert_ne!(peers.list[0].index, index);
    }

    #[test]
    fn a_handshake_finds_its_peer_by_key() {
        // b initiates to a; a's table finds b from the initiation alone.
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let public = |s: [u8; 32]| {
            PublicKey(x25519::PublicKey::from(&x25519::StaticSecret::from(s)).to_bytes())
        };
        let mut at_a = Peers::default();
        at_a.set_key(a);
        at_a.apply(&peer_set_key(public(b))).unwrap();
        let mut at_b = Peers::default();
        at_b.set_key(b);
        at_b.apply(&peer_set_key(public(a))).unwrap();
        let mut buf = vec![0u8; 2048];
        let init = match at_b.list[0]
            .tunn()
            .format_handshake_initiation(&mut buf, false)
        {
            boringtun::noise::TunnResult::WriteToNetwork(p) => p.to_vec(),
            _ => panic!("no initiation"),
        };
        assert_eq!(at_a.for_datagram(&init).map(|p| p.key), Some(public(b)));
        assert!(at_a.for_datagram(&[4, 0, 0, 0, 1, 2, 3]).is_none());
    }

    fn peer_set_key(key: PublicKey) -> PeerSet {
        let mut s = peer_set(0, &["10.90.0.0/16"]);
        s.key = key;
        s
    }
}
