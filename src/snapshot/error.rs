//! The snapshot engine's one error (STYLE 3(c)); the node API maps each
//! variant to a gRPC code in one place (`node_api::codes::snapshot`). The
//! texts never carry a host path or a credential.

use super::seal::SealError;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("no s3 target provided")]
    NoTarget,
    #[error(transparent)]
    Key(SealError),
    #[error("s3 target: {0}")]
    BadTarget(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("volume {0:?} does not exist on this node")]
    NoVolume(String),
    #[error("volume {0:?} is busy: another snapshot or restore of it is running")]
    Busy(String),
    #[error(
        "volume {volume:?} is mounted by running container {container}; stop it before a restore"
    )]
    InUse { volume: String, container: String },
    #[error("pre-hook exec: {0}")]
    HookExec(String),
    #[error("pre-hook exited {0}")]
    HookExit(u32),
    #[error("reading the volume at {path:?}: {source}")]
    Walk {
        path: String,
        source: std::io::Error,
    },
    /// The chunk pipeline stopped taking data (an upload failed, or the
    /// caller went away).
    #[error("snapshot stream: {0}")]
    Sink(std::io::Error),
    #[error("s3 {op} {key}: {message}")]
    S3 {
        op: &'static str,
        key: String,
        message: String,
        /// The server could not be reached (or kept failing).
        unreachable: bool,
    },
    #[error("snapshot {0:?} not found (no manifest)")]
    NoManifest(String),
    #[error("{what} {key}: {source}")]
    Open {
        what: &'static str,
        key: String,
        source: SealError,
    },
    #[error("manifest {key}: {message}")]
    Manifest { key: String, message: String },
    #[error("chunk {hash}: content does not match its hash (swapped or corrupted object)")]
    HashMismatch { hash: String },
    #[error("restore: {0}")]
    Restore(String),
    #[error("restore: {path:?}: {source}")]
    RestoreIo {
        path: String,
        source: std::io::Error,
    },
    #[error("containerd: {0}")]
    Runtime(#[from] crate::runtime::RuntimeError),
    #[error("internal: {0}")]
    Internal(String),
}

impl SnapshotError {
    /// The object store or the runtime is down, not the request wrong.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            Self::S3 {
                unreachable: true,
                ..
            }
        )
    }
}
