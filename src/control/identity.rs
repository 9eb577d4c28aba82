//! The enrollment a join leaves under the data dir, and reading it back.
//!
//! `<data>/node/`: `node.key` (0600, never leaves the node), `node.crt`,
//! `ca.crt`, and `node.json` (0600: it holds the registry password) with the
//! node id, mesh IP, control and registry addresses, and the control-plane
//! node ids the join's peer set named (who may call the node API).

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::tls::NodeTls;
use crate::runtime::pull::{ClusterRegistry, Credentials};

/// Everything `node.json` records.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Enrollment {
    pub node_id: String,
    pub mesh_ip: String,
    pub control_addr: String,
    pub registry_addr: String,
    pub registry_username: String,
    pub registry_password: String,
    /// `is_control` peers of the join's `initial_peers`.
    #[serde(default)]
    pub control_node_ids: Vec<String>,
}

impl std::fmt::Debug for Enrollment {
    // The registry password stays out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Enrollment")
            .field("node_id", &self.node_id)
            .field("mesh_ip", &self.mesh_ip)
            .field("control_addr", &self.control_addr)
            .field("registry_addr", &self.registry_addr)
            .field("control_node_ids", &self.control_node_ids)
            .finish_non_exhaustive()
    }
}

impl Enrollment {
    /// The cluster's embedded registry with this node's credential for it;
    /// `None` when the join named no registry (W-12).
    pub fn cluster_registry(&self, tls: &NodeTls) -> Option<ClusterRegistry> {
        if self.registry_addr.is_empty() {
            return None;
        }
        let credentials = if self.registry_username.is_empty() {
            Credentials::Anonymous
        } else {
            Credentials::Basic {
                username: self.registry_username.clone(),
                password: self.registry_password.clone(),
            }
        };
        Some(ClusterRegistry {
            addr: self.registry_addr.clone(),
            ca_pem: tls.ca_pem.clone(),
            credentials,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {source}", path.display())]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{}: node_id is empty", path.display())]
    NoNodeId { path: PathBuf },
}

/// The files of one node's enrollment.
#[derive(Debug, Clone)]
pub struct IdentityDir {
    dir: PathBuf,
}

impl IdentityDir {
    pub fn new(data_dir: &Path) -> Self {
        Self {
            dir: data_dir.join("node"),
        }
    }
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn key_path(&self) -> PathBuf {
        self.dir.join("node.key")
    }
    pub fn cert_path(&self) -> PathBuf {
        self.dir.join("node.crt")
    }
    pub fn ca_path(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
    pub fn state_path(&self) -> PathBuf {
        self.dir.join("node.json")
    }

    /// The node id of a previous enrollment, for re-enrolling; `None` when
    /// there is none or it cannot be read.
    pub fn previous_node_id(&self) -> Option<String> {
        self.load_enrollment().ok().map(|e| e.node_id)
    }

    pub fn load_enrollment(&self) -> Result<Enrollment, IdentityError> {
        let path = self.state_path();
        let text = read(&path)?;
        let e: Enrollment =
            serde_json::from_slice(&text).map_err(|source| IdentityError::Json {
                path: path.clone(),
                source,
            })?;
        if e.node_id.is_empty() {
            return Err(IdentityError::NoNodeId { path });
        }
        Ok(e)
    }

    pub fn load_tls(&self) -> Result<NodeTls, IdentityError> {
        Ok(NodeTls {
            key_pem: read(&self.key_path())?,
            cert_pem: read(&self.cert_path())?,
            ca_pem: read(&self.ca_path())?,
        })
    }

    /// Writes the whole enrollment, each file atomically (write, then
    /// rename), so no file is ever half-written. The files are replaced one
    /// by one, `node.json` last: a crash mid-way can pair a new key with an
    /// old certificate, which the next `join` (same node id) repairs.
    pub fn store(&self, e: &Enrollment, tls: &NodeTls) -> Result<(), IdentityError> {
        std::fs::create_dir_all(&self.dir).map_err(|source| IdentityError::Io {
            path: self.dir.clone(),
            source,
        })?;
        let _ = std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700));
        let json = serde_json::to_vec_pretty(e).map_err(|source| IdentityError::Json {
            path: self.state_path(),
            source,
        })?;
        write_atomic(&self.key_path(), &tls.key_pem, 0o600)?;
        write_atomic(&self.cert_path(), &tls.cert_pem, 0o644)?;
        write_atomic(&self.ca_path(), &tls.ca_pem, 0o644)?;
        write_atomic(&self.state_path(), &json, 0o600)
    }
}

fn read(path: &Path) -> Result<Vec<u8>, IdentityError> {
    std::fs::read(path).map_err(|source| IdentityError::Io {
        path: path.to_owned(),
        source,
    })
}

fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), IdentityError> {
    let tmp = path.with_extension("tmp");
    let io = |p: &Path| {
        let p = p.to_owned();
        move |source| IdentityError::Io { path: p, source }
    };
    let _ = std::fs::remove_file(&tmp);
    // The mode is set at creation: a key is never readable by others, not
    // even for an instant.
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_and_load_round_trip_with_private_modes() {
        let dir = tempfile::tempdir().unwrap();
        let ids = IdentityDir::new(dir.path());
        assert_eq!(ids.previous_node_id(), None);
        let e = Enrollment {
            node_id: "n1".into(),
            mesh_ip: "10.90.1.1".into(),
            control_addr: "127.0.0.1:8443".into(),
            registry_addr: "127.0.0.1:5000".into(),
            registry_username: "node-n1".into(),
            registry_password: "pw".into(),
            control_node_ids: vec!["c1".into()],
        };
        let tls = NodeTls {
            key_pem: b"key".to_vec(),
            cert_pem: b"cert".to_vec(),
            ca_pem: b"ca".to_vec(),
        };
        ids.store(&e, &tls).unwrap();
        assert_eq!(ids.load_enrollment().unwrap(), e);
        assert_eq!(ids.previous_node_id().as_deref(), Some("n1"));
        assert_eq!(ids.load_tls().unwrap().key_pem, b"key");
        let mode = |p: PathBuf| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(ids.key_path()), 0o600);
        assert_eq!(mode(ids.state_path()), 0o600);
        assert!(!format!("{e:?}").contains("pw"));
    }
}
