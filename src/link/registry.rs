//! What a node is granted to pull with: registry credentials, and the
//! cluster's embedded registry as the join and the peer sets describe it.
//! Words of the link (the enrollment grants them), used by the puller.

use std::sync::Arc;

use tokio::sync::watch;

/// Registry credentials.
#[derive(Clone, Default)]
pub enum Credentials {
    #[default]
    Anonymous,
    Basic {
        username: String,
        password: String,
    },
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Anonymous => f.write_str("Anonymous"),
            Self::Basic { username, .. } => write!(f, "Basic({username}, <redacted>)"),
        }
    }
}

/// The cluster's embedded registry (W-11, W-12): the only registry that is
/// sent the node's credential, reached over TLS chained to the cluster CA.
/// Every control node runs one: builds push to the leader, and an image's
/// reference names the registry of the control node that built it, so the
/// same grant holds at every control node's mesh IP (`also_at`, from the
/// peer sets).
#[derive(Clone, Debug)]
pub struct ClusterRegistry {
    /// `host:port`, compared with a reference's domain as written.
    pub addr: String,
    /// PEM of the cluster CA, trusted for this registry only.
    pub ca_pem: Vec<u8>,
    pub credentials: Credentials,
    /// The same registry at the other control nodes (`host:port`).
    pub also_at: Vec<String>,
}

impl ClusterRegistry {
    /// Whether an image reference's domain is this registry.
    pub fn serves(&self, domain: &str) -> bool {
        !domain.is_empty() && (self.addr == domain || self.also_at.iter().any(|a| a == domain))
    }

    /// Every `host:port` it answers at, the join's first.
    pub fn hosts(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.addr.as_str()).chain(self.also_at.iter().map(String::as_str))
    }

    /// The port the join's address names (every control node's registry
    /// listens on the same one).
    pub fn port(&self) -> Option<u16> {
        self.addr.rsplit_once(':')?.1.parse().ok()
    }
}

/// The cluster registry as it is now; a re-join replaces it (the password
/// is minted anew on every join).
pub type ClusterRegistryWatch = watch::Receiver<Option<Arc<ClusterRegistry>>>;
/// What writes it: the renewal, and the peer sets (its other addresses).
pub type ClusterRegistryFeed = watch::Sender<Option<Arc<ClusterRegistry>>>;
