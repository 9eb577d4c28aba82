//! Bringing the node's mesh up at start: the interface from the last peer
//! set (so the mesh is there before anything binds on its address or dials
//! control through it), then the task that keeps WatchPeers open and
//! follows the leader.

use std::net::Ipv4Addr;
use std::path::Path;

use tokio::sync::watch;

use super::MeshError;
use super::watch::{ControlFeed, MeshTask};
use crate::link::identity::Enrollment;
use crate::link::target::Targets;
use crate::link::tls::CurrentTls;

/// A mesh that is up.
#[derive(Debug)]
pub struct Started {
    pub mesh_ip: Ipv4Addr,
    /// The control targets the leader of each peer set names: what the
    /// sync stream follows.
    pub targets: watch::Receiver<Targets>,
    /// The WatchPeers task.
    pub task: tokio::task::JoinHandle<()>,
}

/// The link to control the mesh needs: who this node is, where control
/// is, and the identity it presents.
#[derive(Debug, Clone)]
pub struct Link {
    pub node_id: String,
    pub control_addr: String,
    pub tls: CurrentTls,
}

/// With an enrollment that has the mesh: brings the interface up from the
/// last peer set and keeps WatchPeers open. `None` without the mesh. Its
/// key and peer set live in `layout`'s data dir, its status in the run dir.
pub async fn start(
    settings: &super::settings::MeshSettings,
    layout: &crate::layout::Layout,
    enrollment: &Enrollment,
    link: Link,
    device_binary: &Path,
    controls: ControlFeed,
) -> Result<Option<Started>, MeshError> {
    if !enrollment.mesh_enabled {
        return Ok(None);
    }
    let mesh_ip: Ipv4Addr = enrollment
        .mesh_ip
        .parse()
        .map_err(|_| MeshError::BadMeshIp(enrollment.mesh_ip.clone()))?;
    let node = super::NodeMesh {
        node_id: link.node_id,
        mesh_ip,
        key: super::load_or_create_key(&layout.data_dir)?,
        interface: settings.interface.clone(),
        listen_port: settings.listen_port,
    };
    let backend = zattera_mesh::Backend::detect(
        settings.backend,
        &node.interface,
        device_binary.to_owned(),
        layout.run_dir.join(format!("mesh-{}.log", node.interface)),
    )
    .await;
    let (targets, targets_rx) = watch::channel(Targets::initial(&link.control_addr));
    let task = MeshTask {
        backend,
        node,
        control_addr: link.control_addr,
        tls: link.tls,
        targets,
        state_file: super::peers::path(&layout.data_dir),
        status_file: zattera_mesh::status_path(&layout.run_dir),
        controls,
    };
    task.restore().await;
    Ok(Some(Started {
        mesh_ip,
        targets: targets_rx,
        task: task.spawn(),
    }))
}
