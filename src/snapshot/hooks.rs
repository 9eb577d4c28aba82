//! The containerd side of snapshots: which running managed containers
//! mount a volume (SNAP-9's in-use check, SNAP-2's hook container), and
//! the pre-hook itself, a non-TTY exec of `/bin/sh -c` waited for.

use std::path::Path;
use std::time::Duration;

use crate::labels::MANAGED;
use crate::runtime::Containerd;
use crate::runtime::containers::{self, TaskState};
use crate::runtime::exec::{ExecRequest, exec};

use super::error::SnapshotError;

/// A hook runs as long as the RPC does; this only bounds a forgotten one.
const HOOK_LIMIT: Duration = Duration::from_secs(6 * 3600);

/// Whether an OCI spec (JSON) bind-mounts `root` (or something inside it).
fn mounts(spec: &[u8], root: &Path) -> bool {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(spec) else {
        return false;
    };
    v.get("mounts")
        .and_then(|m| m.as_array())
        .is_some_and(|ms| {
            ms.iter().any(|m| {
                m.get("source")
                    .and_then(|s| s.as_str())
                    .is_some_and(|s| Path::new(s).starts_with(root))
            })
        })
}

/// The managed containers with a running task that mount `root`.
pub async fn running_users(ctd: &Containerd, root: &Path) -> Result<Vec<String>, SnapshotError> {
    let mut out = Vec::new();
    for c in containers::list(ctd, &[(MANAGED, "true")]).await? {
        let Some(spec) = &c.spec else { continue };
        if !mounts(&spec.value, root) {
            continue;
        }
        if matches!(
            containers::task_state(ctd, &c.id).await?,
            // A task whose shim did not answer may be writing: a user.
            TaskState::Running { .. } | TaskState::Unknown
        ) {
            out.push(c.id.clone());
        }
    }
    out.sort();
    Ok(out)
}

/// The managed containers with a running task that mount node-local volume
/// `local` (under its legacy name too, see [`crate::volumes::users`]).
pub async fn running_users_of(
    ctd: &Containerd,
    data_dir: &Path,
    local: &str,
) -> Result<Vec<String>, SnapshotError> {
    let mut out = Vec::new();
    for id in crate::volumes::users(ctd, data_dir, local).await? {
        if matches!(
            containers::task_state(ctd, &id).await?,
            TaskState::Running { .. } | TaskState::Unknown
        ) {
            out.push(id);
        }
    }
    out.sort();
    Ok(out)
}

/// Runs `/bin/sh -c command` in container `id` (SNAP-2): "pre-hook exec:
/// …" when it cannot run, "pre-hook exited N" when it fails.
pub async fn run_pre_hook(
    ctd: &Containerd,
    fifo_dir: &Path,
    id: &str,
    command: &str,
) -> Result<(), SnapshotError> {
    let req = ExecRequest {
        args: vec!["/bin/sh".into(), "-c".into(), command.into()],
        timeout: HOOK_LIMIT,
        ..ExecRequest::default()
    };
    let out = exec(ctd, id, fifo_dir, &req)
        .await
        .map_err(|e| SnapshotError::HookExec(e.to_string()))?;
    if out.exit_code != 0 {
        return Err(SnapshotError::HookExit(out.exit_code));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn mounts_are_read_from_the_spec() {
        let spec = br#"{"mounts":[{"destination":"/data","source":"/var/lib/zattera/volumes/zt-e-v/_data","type":"bind"}]}"#;
        assert!(mounts(
            spec,
            Path::new("/var/lib/zattera/volumes/zt-e-v/_data")
        ));
        assert!(!mounts(
            spec,
            Path::new("/var/lib/zattera/volumes/zt-e-w/_data")
        ));
        assert!(!mounts(b"not json", Path::new("/")));
    }
}
