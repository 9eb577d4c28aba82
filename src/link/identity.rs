//! The enrollment a join leaves under the data dir, and reading it back.
//!
//! `<data>/node/`: `node.key` (0600, never leaves the node), `node.crt`,
//! `ca.crt`, and `node.json` (0600: it holds the registry password) with the
//! node id, mesh IP, control and registry addresses, and the control-plane
//! node ids the join's peer set named (who may call the node API).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::registry::{ClusterRegistry, Credentials};
use super::tls::NodeTls;

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
    /// Whether the cluster runs the WireGuard mesh (`JoinResponse.mesh_enabled`).
    #[serde(default)]
    pub mesh_enabled: bool,
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
            .field("mesh_enabled", &self.mesh_enabled)
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
            also_at: Vec::new(),
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
        self.load_enrollment()
            .ok()
            .map(|e| e.node_id)
            .or_else(|| self.reference_node_id())
    }

    /// The node id a reference agent left (AGENT-6): a joined worker's
    /// `<data-dir>/node/id`, a bootstrapped control node's
    /// `<data-dir>/node-id`. A node moved from it joins again as the same
    /// node and keeps its assignments; `None` if there is none or it is
    /// not an id.
    fn reference_node_id(&self) -> Option<String> {
        let data_dir = self.dir.parent()?;
        [self.dir.join("id"), data_dir.join("node-id")]
            .iter()
            .find_map(|path| {
                let text = std::fs::read_to_string(path).ok()?;
                let id = text.trim();
                is_node_id(id).then(|| id.to_owned())
            })
    }

    pub fn load_enrollment(&self) -> Result<Enrollment, IdentityError> {
        self.recover_if_writable();
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
        self.recover_if_writable();
        Ok(NodeTls {
            key_pem: read(&self.key_path())?,
            cert_pem: read(&self.cert_path())?,
            ca_pem: read(&self.ca_path())?,
        })
    }

    /// Writes the whole enrollment as one change: every file is written
    /// beside its final name (`*.new`), then a commit marker, then the
    /// renames. A crash before the marker leaves the old enrollment; after
    /// it, [`Self::recover`] finishes the renames. A renewal never leaves a
    /// new key paired with an old certificate.
    pub fn store(&self, e: &Enrollment, tls: &NodeTls) -> Result<(), IdentityError> {
        std::fs::create_dir_all(&self.dir).map_err(|source| IdentityError::Io {
            path: self.dir.clone(),
            source,
        })?;
        let _ = std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700));
        self.recover()?;
        let json = serde_json::to_vec_pretty(e).map_err(|source| IdentityError::Json {
            path: self.state_path(),
            source,
        })?;
        let files: [(PathBuf, &[u8], u32); 4] = [
            (self.key_path(), &tls.key_pem, 0o600),
            (self.cert_path(), &tls.cert_pem, 0o644),
            (self.ca_path(), &tls.ca_pem, 0o644),
            (self.state_path(), &json, 0o600),
        ];
        for (path, bytes, mode) in &files {
            write_atomic(&staged(path), bytes, *mode)?;
        }
        write_atomic(&self.commit_path(), b"", 0o600)?;
        self.recover()
    }

    /// Finishes or undoes a [`Self::store`] a crash interrupted.
    #[allow(clippy::disallowed_methods)] // finishes a store whose files were written durably; the directory is synced below
    pub fn recover(&self) -> Result<(), IdentityError> {
        let committed = self.commit_path().exists();
        for path in [
            self.key_path(),
            self.cert_path(),
            self.ca_path(),
            self.state_path(),
        ] {
            let new = staged(&path);
            let io = |source| IdentityError::Io {
                path: new.clone(),
                source,
            };
            match (committed, new.exists()) {
                (true, true) => std::fs::rename(&new, &path).map_err(io)?,
                (false, true) => std::fs::remove_file(&new).map_err(io)?,
                (_, false) => {}
            }
        }
        if committed {
            sync_dir(&self.dir);
            std::fs::remove_file(self.commit_path()).map_err(|source| IdentityError::Io {
                path: self.commit_path(),
                source,
            })?;
        }
        Ok(())
    }

    /// Readers finish an interrupted store first; a reader that may not
    /// write (`status` as another user) reads what is there.
    fn recover_if_writable(&self) {
        if let Err(e) = self.recover() {
            tracing::debug!(error = %e, "identity recovery");
        }
    }

    fn commit_path(&self) -> PathBuf {
        self.dir.join("renewal.commit")
    }
}

/// Whether `id` is a node id: what the reference mints (a ULID), and no
/// path or control character, whatever a file holds.
pub fn is_node_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Where [`IdentityDir::store`] stages `path`.
fn staged(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".new");
    PathBuf::from(name)
}

/// Renames are durable once the directory is synced.
fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

fn read(path: &Path) -> Result<Vec<u8>, IdentityError> {
    std::fs::read(path).map_err(|source| IdentityError::Io {
        path: path.to_owned(),
        source,
    })
}

/// [`crate::durable::write`], its error naming the file. The mode is set
/// at creation: a key is never readable by others, not even for an instant.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), IdentityError> {
    crate::durable::write(path, bytes, mode).map_err(|source| IdentityError::Io {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
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
            mesh_enabled: true,
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

    #[test]
    fn an_interrupted_store_is_undone_before_its_commit_and_finished_after() {
        let dir = tempfile::tempdir().unwrap();
        let ids = IdentityDir::new(dir.path());
        let e = Enrollment {
            node_id: "n1".into(),
            ..Enrollment::default()
        };
        let tls = |tag: &str| NodeTls {
            key_pem: format!("key-{tag}").into_bytes(),
            cert_pem: format!("cert-{tag}").into_bytes(),
            ca_pem: b"ca".to_vec(),
        };
        ids.store(&e, &tls("old")).unwrap();
        // A crash after staging the new key and certificate, before the marker.
        std::fs::write(staged(&ids.key_path()), "key-new").unwrap();
        std::fs::write(staged(&ids.cert_path()), "cert-new").unwrap();
        let loaded = ids.load_tls().unwrap();
        assert_eq!(
            (loaded.key_pem, loaded.cert_pem),
            (b"key-old".to_vec(), b"cert-old".to_vec())
        );
        assert!(!staged(&ids.key_path()).exists());
        // A crash after the marker and one rename.
        std::fs::write(staged(&ids.cert_path()), "cert-new").unwrap();
        std::fs::write(ids.commit_path(), "").unwrap();
        std::fs::write(ids.key_path(), "key-new").unwrap();
        let loaded = ids.load_tls().unwrap();
        assert_eq!(
            (loaded.key_pem, loaded.cert_pem),
            (b"key-new".to_vec(), b"cert-new".to_vec())
        );
        assert!(!ids.commit_path().exists());
    }
}
