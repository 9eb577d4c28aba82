//! Node-local volumes: where a logical volume lives, and how a path a caller
//! gives is resolved inside it (wire.md §1.5 "Volume path rules", §7).
//!
//! A volume of environment E named N is the directory
//! `<data dir>/volumes/zt-<E>-<N>/_data`, bind-mounted into containers. The
//! reference kept only 8 characters of E, so two environments whose ULIDs
//! were minted within about a second shared one directory (VOL-1); the full
//! id is used here, and a volume under its old short name is moved to the
//! new one by [`ensure`] the first time its environment asks for it (the old
//! name stays as a symlink, for containers created before the move). Names
//! follow Docker's rule, `[A-Za-z0-9][A-Za-z0-9_.-]*`, which also keeps any
//! path trick out, wherever a name comes from.

pub mod adopt;
pub mod files;

use std::path::{Component, Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VolumeError {
    #[error("volume name {0:?} is not a name: [A-Za-z0-9][A-Za-z0-9_.-]*, at most 200 characters")]
    BadName(String),
    #[error("environment id {0:?} is not an id: [A-Za-z0-9][A-Za-z0-9_.-]*")]
    BadEnvironment(String),
    #[error("volume {volume:?} is in use by container(s) {}", containers.join(", "))]
    InUse {
        volume: String,
        containers: Vec<String>,
    },
    #[error("path {0:?} escapes the volume")]
    Escapes(String),
    #[error("volume {0:?} does not exist on this node")]
    NoVolume(String),
    #[error("{0:?} does not exist in the volume")]
    NotFound(String),
    #[error("{0:?}: permission denied")]
    PermissionDenied(String),
    #[error("{path:?}: {message}")]
    Io { path: String, message: String },
    #[error("mount path {0:?} is not an absolute path without '..' (and not /)")]
    BadMountPath(String),
    #[error("volume name is required")]
    NameRequired,
    #[error("{0:?} is not a directory")]
    NotADirectory(String),
    #[error("{0:?} is a directory")]
    IsADirectory(String),
    #[error("{0:?} is not a regular file")]
    NotARegularFile(String),
    /// containerd could not say which containers mount it.
    #[error("listing the containers that mount it: {0}")]
    UsersUnknown(String),
    /// A blocking task died.
    #[error("{0}")]
    Interrupted(String),
}

/// Where a volume may be mounted in a container: an absolute path, not `/`,
/// with no `..` component (wherever the assignment came from).
pub fn check_mount_path(path: &str) -> Result<(), VolumeError> {
    let p = Path::new(path);
    let ok = p.is_absolute()
        && !path.contains('\0')
        && p.components().any(|c| matches!(c, Component::Normal(_)))
        && !p.components().any(|c| matches!(c, Component::ParentDir));
    if ok {
        Ok(())
    } else {
        Err(VolumeError::BadMountPath(path.to_owned()))
    }
}

/// Docker's rule for names: `[A-Za-z0-9][A-Za-z0-9_.-]*`.
fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
        && s.len() <= 200
}

/// The node-local name of logical volume `name` of `environment_id`.
pub fn local_name(environment_id: &str, name: &str) -> Result<String, VolumeError> {
    if !is_name(name) {
        return Err(VolumeError::BadName(name.to_owned()));
    }
    if !is_name(environment_id) {
        return Err(VolumeError::BadEnvironment(environment_id.to_owned()));
    }
    Ok(format!("zt-{environment_id}-{name}"))
}

/// The reference's name (8 characters of the environment id), which
/// volumes made before VOL-1's fix still carry.
fn legacy_name(environment_id: &str, name: &str) -> Option<String> {
    let short: String = environment_id.chars().take(8).collect();
    (short.len() < environment_id.len()).then(|| format!("zt-{short}-{name}"))
}

/// The volume's local name, with a volume kept under its legacy name moved
/// to it first (module doc). Creates nothing else.
#[allow(clippy::disallowed_methods)] // a rename within the volumes directory, kept in place by the symlink made next
pub fn ensure(data_dir: &Path, environment_id: &str, name: &str) -> Result<String, VolumeError> {
    let local = local_name(environment_id, name)?;
    let new = volume_dir(data_dir, &local);
    if std::fs::symlink_metadata(&new).is_ok() {
        return Ok(local);
    }
    let Some(legacy) = legacy_name(environment_id, name) else {
        return Ok(local);
    };
    let old = volume_dir(data_dir, &legacy);
    // Only a real directory moves: a symlink there is an earlier move's.
    if std::fs::symlink_metadata(&old).is_ok_and(|m| m.is_dir()) {
        std::fs::rename(&old, &new).map_err(|e| io_error(name, &e))?;
        std::os::unix::fs::symlink(&local, &old).map_err(|e| io_error(name, &e))?;
        tracing::info!(from = %legacy, to = %local, "volume moved to its full-id name (VOL-1)");
    }
    Ok(local)
}

/// Managed containers whose spec mounts the volume directory `dir` (or its
/// legacy symlink), running or stopped (VOL-5).
pub async fn users(
    ctd: &crate::runtime::Containerd,
    data_dir: &Path,
    local: &str,
) -> Result<Vec<String>, crate::runtime::RuntimeError> {
    let dir = volume_dir(data_dir, local);
    let listed = crate::runtime::containers::list(ctd, &crate::labels::OWNED_FILTER).await?;
    let aliases: Vec<PathBuf> = std::fs::read_dir(data_dir.join("volumes"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == Path::new(local)))
        .map(|e| e.path())
        .chain(std::iter::once(dir))
        .collect();
    Ok(listed
        .iter()
        .filter(|c| {
            let spec = c
                .spec
                .as_ref()
                .and_then(|any| serde_json::from_slice::<oci_spec::runtime::Spec>(&any.value).ok());
            spec.and_then(|s| s.mounts().clone())
                .unwrap_or_default()
                .iter()
                .any(|m| {
                    m.source()
                        .as_ref()
                        .is_some_and(|src| aliases.iter().any(|a| src.starts_with(a)))
                })
        })
        .map(|c| c.id.clone())
        .collect())
}

/// Removes the legacy-name symlinks that lead to `local` (after a removal).
pub fn remove_aliases(data_dir: &Path, local: &str) {
    let Ok(entries) = std::fs::read_dir(data_dir.join("volumes")) else {
        return;
    };
    for e in entries.flatten() {
        if std::fs::read_link(e.path()).is_ok_and(|t| t == Path::new(local)) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The directory holding a volume (removed whole by `RemoveVolume`).
pub fn volume_dir(data_dir: &Path, local: &str) -> PathBuf {
    data_dir.join("volumes").join(local)
}

/// The volume's root: what containers see at the mount path.
pub fn volume_root(data_dir: &Path, local: &str) -> PathBuf {
    volume_dir(data_dir, local).join("_data")
}

/// Beside `_data`, out of containers' reach: the image's content was copied
/// into this volume once already (VOL-4).
const COPIED_UP: &str = "copied-up";
/// Beside `_data`: a copy-up was promised and has not completed (58.5).
const COPY_UP_PENDING: &str = "copy-up-pending";
/// Beside `_data`: where a copy-up writes before it becomes `_data`.
const COPY_UP_STAGING: &str = "_data.copy-up";

/// Makes the volume's root, and says whether the image's content is to be
/// copied in (VOL-4, C-8): at its first use, and again while a copy-up
/// promised then has not completed (an interrupted bring-up, a power cut),
/// so a volume never stays empty or half full for ever (58.5). Never once
/// one completed: a volume an app emptied on purpose is not filled again.
/// A volume made by an earlier agent, which kept no record, counts as
/// copied up already.
pub fn first_use(data_dir: &Path, local: &str) -> std::io::Result<bool> {
    let dir = volume_dir(data_dir, local);
    if dir.join(COPIED_UP).exists() {
        return Ok(false);
    }
    if dir.join(COPY_UP_PENDING).exists() {
        std::fs::create_dir_all(dir.join("_data"))?;
        return Ok(true);
    }
    let existed = std::fs::symlink_metadata(&dir).is_ok();
    if existed {
        std::fs::create_dir_all(dir.join("_data"))?;
        mark_copied_up(data_dir, local)?;
        return Ok(false);
    }
    // The promise first, durably, then the root.
    std::fs::create_dir_all(&dir)?;
    crate::durable::write(&dir.join(COPY_UP_PENDING), b"", 0o600)?;
    std::fs::create_dir_all(dir.join("_data"))?;
    Ok(true)
}

/// Where a copy-up writes the image's content: a fresh directory beside
/// `_data`, which [`finish_copy_up`] makes the volume's root.
pub fn copy_up_staging(data_dir: &Path, local: &str) -> std::io::Result<PathBuf> {
    let staging = volume_dir(data_dir, local).join(COPY_UP_STAGING);
    if std::fs::symlink_metadata(&staging).is_ok() {
        std::fs::remove_dir_all(&staging)?;
    }
    std::fs::create_dir(&staging)?;
    Ok(staging)
}

/// A copy-up's content is on disk, becomes `_data` (whatever an earlier,
/// interrupted one left there goes), and the volume is marked copied up,
/// durably, in that order.
pub fn finish_copy_up(data_dir: &Path, local: &str) -> std::io::Result<()> {
    let dir = volume_dir(data_dir, local);
    let staging = dir.join(COPY_UP_STAGING);
    crate::durable::sync_tree(&staging)?;
    let root = dir.join("_data");
    if std::fs::symlink_metadata(&root).is_ok() {
        std::fs::remove_dir_all(&root)?;
    }
    crate::durable::rename(&staging, &root)?;
    mark_copied_up(data_dir, local)
}

/// Records that the volume had its copy-up (or needed none).
pub fn mark_copied_up(data_dir: &Path, local: &str) -> std::io::Result<()> {
    let dir = volume_dir(data_dir, local);
    crate::durable::write(&dir.join(COPIED_UP), b"", 0o600)?;
    match std::fs::remove_file(dir.join(COPY_UP_PENDING)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => crate::durable::sync_dir(&dir),
    }
}

pub(crate) fn io_error(request: &str, e: &std::io::Error) -> VolumeError {
    match e.kind() {
        std::io::ErrorKind::NotFound => VolumeError::NotFound(request.to_owned()),
        std::io::ErrorKind::PermissionDenied => VolumeError::PermissionDenied(request.to_owned()),
        // The OS text only: it never carries the path.
        kind => VolumeError::Io {
            path: request.to_owned(),
            message: kind.to_string(),
        },
    }
}

/// Go's `FileMode.String()` notation (`drwxr-xr-x`, `-rw-r--r--`,
/// `Lrwxrwxrwx`, `Dcrw-rw-rw-`), which control shows as is.
pub fn go_mode_string(meta: &std::fs::Metadata) -> String {
    use std::os::unix::fs::PermissionsExt;
    go_mode_string_of(meta.permissions().mode())
}

/// The same from a raw `st_mode` (type and permission bits).
pub fn go_mode_string_of(mode: u32) -> String {
    let kind = mode & 0o170_000;
    let mut s = String::new();
    if kind == 0o040_000 {
        s.push('d');
    }
    if kind == 0o120_000 {
        s.push('L');
    }
    if kind == 0o060_000 || kind == 0o020_000 {
        s.push('D');
    }
    if kind == 0o010_000 {
        s.push('p');
    }
    if kind == 0o140_000 {
        s.push('S');
    }
    if mode & 0o4000 != 0 {
        s.push('u');
    }
    if mode & 0o2000 != 0 {
        s.push('g');
    }
    if kind == 0o020_000 {
        s.push('c');
    }
    if mode & 0o1000 != 0 {
        s.push('t');
    }
    if s.is_empty() {
        s.push('-');
    }
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if mode & (1 << (8 - i)) != 0 { c } else { '-' });
    }
    s
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn the_copy_up_happens_at_the_first_use_only() {
        let data = tempfile::tempdir().unwrap();
        assert!(first_use(data.path(), "zt-e-new").unwrap(), "a new volume");
        assert!(volume_root(data.path(), "zt-e-new").is_dir());
        mark_copied_up(data.path(), "zt-e-new").unwrap();
        assert!(
            !first_use(data.path(), "zt-e-new").unwrap(),
            "emptied or not, never again"
        );
        // A volume an earlier agent made (no record): counts as copied up.
        std::fs::create_dir_all(volume_root(data.path(), "zt-e-old")).unwrap();
        assert!(!first_use(data.path(), "zt-e-old").unwrap());
        assert!(volume_dir(data.path(), "zt-e-old").join(COPIED_UP).exists());
    }

    /// 58.5: a copy-up interrupted anywhere before its marker (a failed
    /// bring-up, a power cut) is done again, whole, at the next bring-up;
    /// before, the volume counted as done and stayed half full.
    #[test]
    fn an_interrupted_copy_up_is_redone_whole() {
        let data = tempfile::tempdir().unwrap();
        let (d, v) = (data.path(), "zt-e-db");
        assert!(first_use(d, v).unwrap());
        // Half a copy, then the bring-up fails.
        let staging = copy_up_staging(d, v).unwrap();
        std::fs::write(staging.join("half"), b"h").unwrap();
        assert!(first_use(d, v).unwrap(), "the promise stands");
        let staging = copy_up_staging(d, v).unwrap();
        assert!(!staging.join("half").exists(), "a fresh staging");
        std::fs::write(staging.join("whole"), b"w").unwrap();
        finish_copy_up(d, v).unwrap();
        assert!(volume_root(d, v).join("whole").exists());
        assert!(!volume_root(d, v).join("half").exists());
        assert!(!first_use(d, v).unwrap(), "done: never again");
        assert!(!volume_dir(d, v).join(COPY_UP_PENDING).exists());
    }

    #[test]
    fn local_names_use_the_whole_environment_id_and_refuse_escapes() {
        assert_eq!(
            local_name("01JENVIRONMENT", "data").unwrap(),
            "zt-01JENVIRONMENT-data"
        );
        // Two ULIDs of the same second no longer share a name.
        assert_ne!(
            local_name("01JENVIR00000000000000000A", "pg").unwrap(),
            local_name("01JENVIR00000000000000000B", "pg").unwrap()
        );
        for bad in [
            "",
            ".",
            "..",
            "a/b",
            "../../etc",
            "x\0y",
            "-x",
            "_x",
            "a b",
            "é",
        ] {
            assert!(local_name("env", bad).is_err(), "{bad:?}");
        }
        for good in ["data", "pg-data", "a.b_c", "0"] {
            assert!(local_name("env", good).is_ok(), "{good:?}");
        }
        assert!(local_name("../../x", "data").is_err());
    }

    #[test]
    fn a_legacy_volume_moves_to_its_full_name_without_losing_data() {
        let dir = tempfile::tempdir().unwrap();
        let env = "01JENVIR00000000000000000A";
        let legacy = volume_dir(dir.path(), "zt-01JENVIR-pg");
        std::fs::create_dir_all(legacy.join("_data")).unwrap();
        std::fs::write(legacy.join("_data/db"), "rows").unwrap();
        let local = ensure(dir.path(), env, "pg").unwrap();
        assert_eq!(local, format!("zt-{env}-pg"));
        assert_eq!(
            std::fs::read_to_string(volume_root(dir.path(), &local).join("db")).unwrap(),
            "rows"
        );
        // The old name still leads there (containers made before the move).
        assert_eq!(
            std::fs::read_to_string(legacy.join("_data/db")).unwrap(),
            "rows"
        );
        // Another environment of the same second gets its own, empty one.
        let other = ensure(dir.path(), "01JENVIR00000000000000000B", "pg").unwrap();
        assert!(!volume_dir(dir.path(), &other).exists());
        assert_eq!(ensure(dir.path(), env, "pg").unwrap(), local, "idempotent");
    }

    #[test]
    fn modes_read_like_go() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, "x").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(
            go_mode_string(&std::fs::metadata(&f).unwrap()),
            "-rw-r--r--"
        );
        assert_eq!(
            go_mode_string(&std::fs::metadata(dir.path()).unwrap()),
            "drwxr-xr-x"
        );
        std::os::unix::fs::symlink("f", dir.path().join("l")).unwrap();
        let l = std::fs::symlink_metadata(dir.path().join("l")).unwrap();
        assert_eq!(go_mode_string(&l), "Lrwxrwxrwx");
        assert_eq!(go_mode_string_of(0o104_755), "urwxr-xr-x");
        assert_eq!(go_mode_string_of(0o041_777), "dtrwxrwxrwx");
        assert_eq!(go_mode_string_of(0o020_666), "Dcrw-rw-rw-");
    }
}
