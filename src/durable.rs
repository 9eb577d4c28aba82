//! Writing state that survives a power cut (issue 58).
//!
//! On ext4 with delayed allocation, a file written and renamed without an
//! fsync comes back empty after a power cut while the rename is already on
//! disk; XFS does not even order a rename over an existing file. Every
//! state file of the agent is therefore written by [`write`]: a temporary
//! file beside it (created exclusively, with its final mode), its bytes,
//! `sync_data`, the rename, then an fsync of the directory so the rename
//! itself is durable. [`sync_tree`] makes a whole tree durable at once
//! (`syncfs`), [`sync_dir`] a directory's entries, and [`set_aside`] moves
//! an unreadable file out of the way (`<name>.broken-<seconds>`) instead of
//! overwriting what an operator may want to look at.
//!
//! `std::fs::write` and `std::fs::rename` are disallowed elsewhere
//! (clippy.toml): a call outside this module says why it needs no
//! durability (a tmpfs, a test).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` durably (module doc), with `mode` from the
/// first byte on; a missing parent directory is made.
#[allow(clippy::disallowed_methods)]
pub fn write(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = temporary_beside(path);
    let _ = std::fs::remove_file(&tmp);
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_data()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        sync_parent(path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Renames `from` to `to` and makes the rename durable (both parents).
#[allow(clippy::disallowed_methods)]
pub fn rename(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::rename(from, to)?;
    sync_parent(to)?;
    if from.parent() != to.parent() {
        sync_parent(from)?;
    }
    Ok(())
}

/// Removes `path` (absent is fine) and makes the removal durable.
pub fn remove(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => sync_parent(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// fsync of the directory holding `path`: its entries (a rename, a new
/// file, an unlink) are on disk when this returns.
pub fn sync_parent(path: &Path) -> std::io::Result<()> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(dir) => sync_dir(dir),
        None => sync_dir(Path::new(".")),
    }
}

/// fsync of a directory.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Everything written to the filesystem holding `path` is on disk when
/// this returns (`syncfs`): a tree of many files at once.
pub fn sync_tree(path: &Path) -> std::io::Result<()> {
    let dir = std::fs::File::open(path)?;
    rustix::fs::syncfs(&dir)?;
    Ok(())
}

/// Moves an unreadable state file aside, `<name>.broken-<unix seconds>`,
/// so that a fresh one can be written without losing it; its new path.
pub fn set_aside(path: &Path) -> std::io::Result<PathBuf> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".broken-{secs}"));
    let aside = PathBuf::from(name);
    rename(path, &aside)?;
    Ok(aside)
}

fn temporary_beside(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".tmp-{}", std::process::id()));
    PathBuf::from(name)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_write_replaces_the_file_whole_with_its_mode_and_leaves_nothing_beside() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("state.json");
        write(&path, b"one", 0o600).unwrap();
        write(&path, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, ["state.json"]);
        sync_tree(d.path()).unwrap();
    }

    #[test]
    fn an_unreadable_file_is_set_aside_not_overwritten() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("routes.pb");
        write(&path, b"\xff\xff", 0o600).unwrap();
        let aside = set_aside(&path).unwrap();
        assert!(!path.exists());
        assert_eq!(std::fs::read(&aside).unwrap(), b"\xff\xff");
        assert!(
            aside
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("routes.pb.broken-")
        );
    }
}
