//! The node's side of the WireGuard mesh (wire.md §1.1 step 2, §1.2):
//! the node's WireGuard key, the last `PeerSet` (kept across restarts, so
//! the mesh comes back before control answers), the `PeerSet` →
//! [`zattera_mesh::MeshState`] mapping, and the task that keeps
//! `MeshService.WatchPeers` open ([`watch`]), applies every set and feeds
//! the leader to [`crate::link::target`].
//!
//! The interface itself, kernel or userspace, is `zattera-mesh`'s.

pub mod peers;
pub mod settings;
pub mod start;
pub mod status;
pub mod watch;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};

use zattera_mesh::{Backend, MeshState, Net, PeerConfig, PrivateKey, PublicKey};

use crate::proto::cluster::PeerSet;

/// The mesh CIDR (wire.md §0.4).
pub const MESH_CIDR: Net = Net {
    addr: Ipv4Addr::new(10, 90, 0, 0),
    prefix: 16,
};

#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Key {
        path: PathBuf,
        source: zattera_mesh::Error,
    },
    #[error("{}: not a PeerSet: {source}", path.display())]
    Decode {
        path: PathBuf,
        source: prost::DecodeError,
    },
    #[error("mesh IP {0:?} is not an IPv4 address")]
    BadMeshIp(String),
    #[error(transparent)]
    Mesh(#[from] zattera_mesh::Error),
    #[error(transparent)]
    Identity(#[from] crate::link::identity::IdentityError),
}

/// `<data>/node/wireguard.key`, beside the node key.
pub fn key_path(data_dir: &Path) -> PathBuf {
    crate::link::identity::IdentityDir::new(data_dir)
        .dir()
        .join("wireguard.key")
}

/// The node's WireGuard key: the stored one, or a new one stored 0600.
pub fn load_or_create_key(data_dir: &Path) -> Result<PrivateKey, MeshError> {
    let path = key_path(data_dir);
    let io = |source| MeshError::Io {
        path: path.clone(),
        source,
    };
    match std::fs::read_to_string(&path) {
        Ok(text) => PrivateKey::from_base64(&text).map_err(|source| MeshError::Key {
            path: path.clone(),
            source,
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = PrivateKey::generate()?;
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(io)?;
            }
            crate::link::identity::write_atomic(
                &path,
                format!("{}\n", key.to_base64()).as_bytes(),
                0o600,
            )?;
            Ok(key)
        }
        Err(e) => Err(io(e)),
    }
}

/// What the node knows of itself in the mesh.
#[derive(Debug, Clone)]
pub struct NodeMesh {
    pub node_id: String,
    pub mesh_ip: Ipv4Addr,
    pub key: PrivateKey,
    pub interface: String,
    pub listen_port: u16,
}

impl NodeMesh {
    /// The interface `set` asks for. Peers that are this node, or whose
    /// key or addresses do not parse, are left out (with a warning).
    pub fn desired(&self, set: &PeerSet) -> MeshState {
        let own = self.key.public();
        let mut peers = std::collections::BTreeMap::new();
        for p in &set.peers {
            if p.node_id == self.node_id {
                continue;
            }
            let key = match PublicKey::from_base64(&p.wireguard_public_key) {
                Ok(k) if k != own => k,
                Ok(_) => continue,
                Err(e) => {
                    tracing::warn!(peer = %p.node_id, error = %e, "peer left out: bad WireGuard key");
                    continue;
                }
            };
            let endpoints = p
                .endpoints
                .iter()
                .filter_map(|e| {
                    e.parse::<SocketAddr>()
                        .map_err(|_| tracing::warn!(peer = %p.node_id, endpoint = %e, "endpoint ignored: not IP:PORT"))
                        .ok()
                })
                .collect();
            let mut allowed_ips: Vec<Net> = p
                .allowed_ips
                .iter()
                .filter_map(|n| {
                    n.parse()
                        .map_err(
                            |e| tracing::warn!(peer = %p.node_id, error = %e, "allowed IP ignored"),
                        )
                        .ok()
                })
                .collect();
            if allowed_ips.is_empty()
                && let Ok(ip) = p.mesh_ip.parse::<Ipv4Addr>()
            {
                allowed_ips.push(Net::host(ip));
            }
            peers.insert(
                key,
                PeerConfig {
                    endpoints,
                    allowed_ips,
                    keepalive: u16::try_from(p.persistent_keepalive_seconds).unwrap_or(u16::MAX),
                },
            );
        }
        MeshState {
            interface: self.interface.clone(),
            private_key: self.key.clone(),
            listen_port: self.listen_port,
            address: self.mesh_ip,
            cidr: MESH_CIDR,
            mtu: zattera_mesh::MTU,
            peers,
        }
    }
}

/// Applies `set` to the interface; an error is logged, never fatal: the
/// next set tries again.
pub async fn apply(backend: &Backend, node: &NodeMesh, set: &PeerSet) -> bool {
    let want = node.desired(set);
    match backend.apply(&want).await {
        Ok(()) => {
            tracing::info!(
                interface = %node.interface,
                version = set.version,
                peers = want.peers.len(),
                leader = %set.leader_node_id,
                "mesh applied"
            );
            true
        }
        Err(e) => {
            tracing::error!(interface = %node.interface, error = %e, "mesh not applied");
            false
        }
    }
}

/// The address of this host's default route, when other nodes can reach
/// it there: only a globally routable one. Behind NAT (or a cloud's 1:1
/// NAT) that address is private, and advertising it makes the reference
/// control plane treat the node as reachable: no keepalive toward the hubs,
/// and /32s to private endpoints between two such workers, which win over
/// the hub's route and drop their traffic. The reference advertises only
/// configured endpoints. Connecting a UDP socket sends nothing.
pub fn default_endpoint(port: u16) -> Option<SocketAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    let ip = match s.local_addr().ok()?.ip() {
        std::net::IpAddr::V4(ip) => ip,
        std::net::IpAddr::V6(_) => return None,
    };
    if !crate::addr_scope::is_global_v4(ip) {
        tracing::info!(%ip, "the default route's address is not globally routable: no mesh endpoint advertised (set mesh-endpoints where other nodes reach this one directly)");
        return None;
    }
    Some(SocketAddr::new(ip.into(), port))
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::proto::cluster::Peer;

    #[test]
    fn a_peer_set_maps_to_the_interface() {
        let me = NodeMesh {
            node_id: "w1".into(),
            mesh_ip: Ipv4Addr::new(10, 90, 1, 1),
            key: PrivateKey::generate().unwrap(),
            interface: "zt0".into(),
            listen_port: 51820,
        };
        let other = PrivateKey::generate().unwrap().public();
        let set = PeerSet {
            version: 3,
            peers: vec![
                Peer {
                    node_id: "w1".into(),
                    wireguard_public_key: me.key.public().to_base64(),
                    ..Peer::default()
                },
                Peer {
                    node_id: "c1".into(),
                    wireguard_public_key: other.to_base64(),
                    mesh_ip: "10.90.0.1".into(),
                    endpoints: vec!["192.0.2.1:51820".into(), "nope".into()],
                    persistent_keepalive_seconds: 25,
                    is_control: true,
                    ..Peer::default()
                },
                Peer {
                    node_id: "bad".into(),
                    wireguard_public_key: "not base64!".into(),
                    ..Peer::default()
                },
            ],
            ..PeerSet::default()
        };
        let want = me.desired(&set);
        assert_eq!(want.peers.len(), 1, "self and the bad key are left out");
        let c1 = &want.peers[&other];
        assert_eq!(
            c1.endpoints,
            vec!["192.0.2.1:51820".parse::<SocketAddr>().unwrap()]
        );
        assert_eq!(
            c1.allowed_ips,
            vec![Net::host(Ipv4Addr::new(10, 90, 0, 1))],
            "the mesh IP when none is given"
        );
        assert_eq!(c1.keepalive, 25);
        assert_eq!(want.address, me.mesh_ip);
    }
}
