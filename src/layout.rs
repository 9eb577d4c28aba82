//! Where the agent keeps things on the node: one type, so that a path is
//! spelled out once. The data dir (`/var/lib/zattera`) survives reboots; the
//! run dir (`/run/zattera`) is a tmpfs that a reboot empties.

use std::path::{Path, PathBuf};

/// The node's two directories and what lives under them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub data_dir: PathBuf,
    pub run_dir: PathBuf,
}

impl Layout {
    pub fn new(data_dir: impl Into<PathBuf>, run_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            run_dir: run_dir.into(),
        }
    }

    /// Every container's log, and the segments rotated out of it.
    pub fn logs(&self) -> PathBuf {
        logs(&self.data_dir)
    }

    /// The live log of container `cid`.
    pub fn log_path(&self, cid: &str) -> PathBuf {
        self.logs().join(format!("{cid}.log"))
    }

    /// The files bind-mounted over a container's `/etc` (resolv.conf,
    /// hosts, hostname), written again at every start.
    pub fn container_files(&self, cid: &str) -> PathBuf {
        self.run_dir.join("containers").join(cid)
    }

    /// Where snapshots are mounted for a moment (copy-up, reading an
    /// image's passwd).
    pub fn scratch(&self) -> PathBuf {
        self.run_dir.join("scratch")
    }

    /// Every named volume.
    pub fn volumes(&self) -> PathBuf {
        volumes(&self.data_dir)
    }
}

/// `<data_dir>/logs`.
pub fn logs(data_dir: &Path) -> PathBuf {
    data_dir.join("logs")
}

/// `<data_dir>/volumes`.
pub fn volumes(data_dir: &Path) -> PathBuf {
    data_dir.join("volumes")
}
