//! What the agent says of its mesh beside the device (`<run_dir>/mesh.json`):
//! the names behind the keys and the control leader. The agent writes it;
//! `zattera-netns mesh` reads it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The file under a run dir.
pub fn status_path(run_dir: &Path) -> PathBuf {
    run_dir.join("mesh.json")
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct MeshStatus {
    pub node_id: String,
    pub interface: String,
    pub backend: String,
    pub mesh_ip: String,
    /// The `PeerSet.version` last applied (or tried).
    pub version: u64,
    pub applied: bool,
    pub leader_node_id: String,
    /// Where the node's control streams dial.
    pub leader_addr: String,
    pub peers: Vec<PeerName>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PeerName {
    pub node_id: String,
    pub public_key: String,
    pub mesh_ip: String,
    pub is_control: bool,
}

impl MeshStatus {
    /// Replaces the file atomically.
    #[allow(clippy::disallowed_methods)] // the status file lives in the run dir, a tmpfs: a cut empties it anyway
    pub fn store(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("json.tmp");
        std::fs::write(
            &tmp,
            serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?,
        )?;
        std::fs::rename(&tmp, path)
    }

    /// The file, if the agent wrote one.
    pub fn load(path: &Path) -> Option<Self> {
        serde_json::from_slice(&std::fs::read(path).ok()?).ok()
    }
}
