//! Node-local volumes: where a logical volume lives, and how a path a caller
//! gives is resolved inside it (wire.md §1.5 "Volume path rules", §7).
//!
//! A volume of environment E named N is the directory
//! `<data dir>/volumes/zt-<E[..8]>-<N>/_data`, bind-mounted into containers;
//! the derivation is the reference's Docker volume name, so
//! `volume_docker_name` keeps resolving. A name that could leave the volume
//! root (`/`, `..`) is refused, wherever it comes from.

use std::path::{Component, Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VolumeError {
    #[error("volume name {0:?} is not a plain name (1 to 200 characters, no '/', not '.' or '..')")]
    BadName(String),
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
}

/// The node-local name of logical volume `name` of `environment_id`.
pub fn local_name(environment_id: &str, name: &str) -> Result<String, VolumeError> {
    let plain = !name.is_empty()
        && name.len() <= 200
        && name != "."
        && name != ".."
        && !name.contains(['/', '\0']);
    if !plain {
        return Err(VolumeError::BadName(name.to_owned()));
    }
    let env: String = environment_id.chars().take(8).collect();
    if env.contains(['/', '\0']) || env == "." || env == ".." {
        return Err(VolumeError::BadName(environment_id.to_owned()));
    }
    Ok(format!("zt-{env}-{name}"))
}

/// The directory holding a volume (removed whole by `RemoveVolume`).
pub fn volume_dir(data_dir: &Path, local: &str) -> PathBuf {
    data_dir.join("volumes").join(local)
}

/// The volume's root: what containers see at the mount path.
pub fn volume_root(data_dir: &Path, local: &str) -> PathBuf {
    volume_dir(data_dir, local).join("_data")
}

/// Resolves `request` inside `root`: read as if absolute (`/a` and `a` are
/// the same; `..` stops at the root), then with symlinks followed, it must
/// still lie inside the root. Errors name the request, never a host path.
pub fn resolve(root: &Path, request: &str) -> Result<PathBuf, VolumeError> {
    let real_root = root.canonicalize().map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => VolumeError::NoVolume(String::new()),
        _ => io_error(request, &e),
    })?;
    let mut lexical = PathBuf::new();
    for part in Path::new(request).components() {
        match part {
            Component::Normal(p) => lexical.push(p),
            Component::ParentDir => {
                lexical.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    let real = real_root
        .join(&lexical)
        .canonicalize()
        .map_err(|e| io_error(request, &e))?;
    if real.starts_with(&real_root) {
        Ok(real)
    } else {
        Err(VolumeError::Escapes(request.to_owned()))
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
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let ft = meta.file_type();
    let mode = meta.permissions().mode();
    let mut s = String::new();
    if ft.is_dir() {
        s.push('d');
    }
    if ft.is_symlink() {
        s.push('L');
    }
    if ft.is_block_device() || ft.is_char_device() {
        s.push('D');
    }
    if ft.is_fifo() {
        s.push('p');
    }
    if ft.is_socket() {
        s.push('S');
    }
    if mode & 0o4000 != 0 {
        s.push('u');
    }
    if mode & 0o2000 != 0 {
        s.push('g');
    }
    if ft.is_char_device() {
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
mod tests {
    use super::*;

    #[test]
    fn local_names_follow_the_reference_and_refuse_escapes() {
        assert_eq!(
            local_name("01JENVIRONMENT", "data").unwrap(),
            "zt-01JENVIR-data"
        );
        for bad in ["", ".", "..", "a/b", "../../etc", "x\0y"] {
            assert!(local_name("env", bad).is_err(), "{bad:?}");
        }
        assert!(local_name("../../x", "data").is_err());
    }

    #[test]
    fn paths_resolve_inside_the_root_only() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("vol");
        std::fs::create_dir_all(root.join("a/b")).unwrap();
        std::fs::write(root.join("a/b/f.txt"), "x").unwrap();
        std::fs::write(dir.path().join("secret"), "no").unwrap();
        std::os::unix::fs::symlink(dir.path().join("secret"), root.join("out")).unwrap();
        std::os::unix::fs::symlink("b", root.join("a/in")).unwrap();
        let real = root.canonicalize().unwrap();

        assert_eq!(resolve(&root, "").unwrap(), real);
        assert_eq!(resolve(&root, "/").unwrap(), real);
        assert_eq!(
            resolve(&root, "/a/b/f.txt").unwrap(),
            real.join("a/b/f.txt")
        );
        assert_eq!(resolve(&root, "a/b/f.txt").unwrap(), real.join("a/b/f.txt"));
        // `..` stops at the root.
        assert_eq!(resolve(&root, "../../a").unwrap(), real.join("a"));
        // A symlink inside is fine; one leading out is refused.
        assert_eq!(
            resolve(&root, "a/in/f.txt").unwrap(),
            real.join("a/b/f.txt")
        );
        assert_eq!(
            resolve(&root, "out").unwrap_err(),
            VolumeError::Escapes("out".into())
        );
        let missing = resolve(&root, "nope").unwrap_err();
        assert_eq!(missing, VolumeError::NotFound("nope".into()));
        // No host path in any message.
        assert!(
            !missing
                .to_string()
                .contains(&dir.path().display().to_string())
        );
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
    }
}
