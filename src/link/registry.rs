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

    /// Why a project may not use an image at `path` (the reference's path
    /// after the registry: `<project>/<app>`), or `None` when it may. The
    /// reference pushes every build to `<registry>/<project id>/<app id>`,
    /// ids being ULIDs lowercased; a path whose first segment is such an
    /// id names the project that owns it, and only that project (compared
    /// case-blind) may pull it with the node's credential or run it. Paths
    /// that name no project (a shared base image) stay open to all.
    /// [`Self::foreign_project`] for an image at `domain`/`path`: `None`
    /// when this registry does not serve `domain`.
    pub fn refuses(&self, domain: &str, path: &str, project_id: &str) -> Option<String> {
        if !self.serves(domain) {
            return None;
        }
        Self::foreign_project(path, project_id)
    }

    pub fn foreign_project(path: &str, project_id: &str) -> Option<String> {
        let first = path.split('/').next().unwrap_or_default();
        let names_a_project = path.contains('/') && is_ulid(first);
        (names_a_project && !first.eq_ignore_ascii_case(project_id)).then(|| {
            format!(
                "the cluster registry's {first}/ holds project {}'s images, and this is project {project_id:?}'s",
                first.to_ascii_uppercase()
            )
        })
    }

    /// The port the join's address names (every control node's registry
    /// listens on the same one).
    pub fn port(&self) -> Option<u16> {
        self.addr.rsplit_once(':')?.1.parse().ok()
    }
}

/// A ULID as the reference writes ids: 26 characters of Crockford's
/// base32 (no I, L, O or U), in either case.
fn is_ulid(s: &str) -> bool {
    s.len() == 26
        && s.bytes().all(|b| {
            let b = b.to_ascii_uppercase();
            b.is_ascii_digit()
                || (b.is_ascii_uppercase() && !matches!(b, b'I' | b'L' | b'O' | b'U'))
        })
}

/// The cluster registry as it is now; a re-join replaces it (the password
/// is minted anew on every join).
pub type ClusterRegistryWatch = watch::Receiver<Option<Arc<ClusterRegistry>>>;
/// What writes it: the renewal, and the peer sets (its other addresses).
pub type ClusterRegistryFeed = watch::Sender<Option<Arc<ClusterRegistry>>>;

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "01HZXK5V9P7W3Q2R8T6Y4M1N0B";
    const B: &str = "01HZXK6A2B3C4D5E6F7G8H9J0K";

    #[test]
    fn a_project_path_is_its_own_project_s_alone() {
        let a = A.to_ascii_lowercase();
        assert_eq!(
            ClusterRegistry::foreign_project(&format!("{a}/app"), A),
            None
        );
        let refused = ClusterRegistry::foreign_project(&format!("{a}/app"), B).unwrap();
        assert!(refused.contains(A) && refused.contains(B), "{refused}");
        // Paths that name no project stay shared: a base image, a single name.
        assert_eq!(ClusterRegistry::foreign_project("base/busybox", B), None);
        assert_eq!(ClusterRegistry::foreign_project(&a, B), None);
        // Not a ULID: 26 characters with a letter Crockford's base32 lacks.
        assert_eq!(
            ClusterRegistry::foreign_project("01hzxk5v9p7w3q2r8t6y4m1nou/app", B),
            None
        );
    }
}
