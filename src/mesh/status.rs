//! `<run_dir>/mesh.json`, rewritten on every applied peer set: the names
//! behind the device's keys and the leader, which only the agent knows,
//! for `zattera-netns mesh` (it reads the device itself).

use std::path::Path;

use zattera_mesh::status::{MeshStatus, PeerName};

use super::NodeMesh;
use crate::link::target::Targets;
use crate::proto::cluster::PeerSet;

/// Writes what the node knows after `set` to `path`.
pub fn store(
    path: &Path,
    node: &NodeMesh,
    backend: zattera_mesh::BackendKind,
    set: &PeerSet,
    applied: bool,
    targets: &Targets,
) -> std::io::Result<()> {
    MeshStatus {
        node_id: node.node_id.clone(),
        interface: node.interface.clone(),
        backend: backend.to_string(),
        mesh_ip: node.mesh_ip.to_string(),
        version: set.version,
        applied,
        leader_node_id: set.leader_node_id.clone(),
        leader_addr: targets.leader.clone(),
        peers: set
            .peers
            .iter()
            .map(|p| PeerName {
                node_id: p.node_id.clone(),
                public_key: p.wireguard_public_key.clone(),
                mesh_ip: p.mesh_ip.clone(),
                is_control: p.is_control,
            })
            .collect(),
    }
    .store(path)
}
