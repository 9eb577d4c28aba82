//! Network namespaces kept alive as files: a namespace is created by a
//! short-lived thread that unshares its network namespace and bind-mounts
//! `/proc/thread-self/ns/net` onto an empty file (the iproute2 convention,
//! so `ip netns exec` and `nsenter --net=FILE` work on it too). No `unsafe`:
//! nix wraps unshare, setns and mount safely.

use std::fs::File;
use std::io::ErrorKind;
use std::path::Path;

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;

use crate::error::{Error, Result};

/// Creates a fresh network namespace pinned at `path`. An existing file is
/// first removed (a leftover from a crash is never reused: it may hold half
/// of an old attachment).
pub async fn create(path: &Path) -> Result<()> {
    remove(path)?;
    if let Some(dir) = path.parent() {
        prepare_dir(dir)?;
    }
    File::create(path).map_err(|e| Error::netns(path, "create", e))?;
    let owned = path.to_owned();
    let (tx, rx) = tokio::sync::oneshot::channel();
    // The thread ends right after, taking its changed namespace with it.
    std::thread::Builder::new()
        .name("zt-unshare".into())
        .spawn(move || {
            let _ = tx.send(unshare_and_pin(&owned));
        })
        .map_err(|e| Error::netns(path, "spawn a thread for", e))?;
    let result = rx
        .await
        .map_err(|_| Error::Thread(format!("netns {}", path.display())))
        .and_then(|r| r);
    if result.is_err() {
        let _ = remove(path);
    }
    result
}

/// Pins the existing namespace `source` (a `/proc/<pid>/ns/net`) at `path`
/// again, replacing whatever file is there.
pub fn pin(path: &Path, source: &Path) -> Result<()> {
    remove(path)?;
    if let Some(dir) = path.parent() {
        prepare_dir(dir)?;
    }
    File::create(path).map_err(|e| Error::netns(path, "create", e))?;
    let pinned = nix::mount::mount(
        Some(source),
        path,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| Error::netns(path, "bind-mount the namespace onto", e));
    if pinned.is_err() {
        let _ = remove(path);
    }
    pinned
}

/// Makes `dir` a mount point with shared propagation, as iproute2 does for
/// /run/netns: a mount namespace created later (a service with a private
/// /tmp, say) then sees our unmounts too, instead of keeping a copy of the
/// namespace mount alive after detach. Cheap when already done.
pub fn prepare_dir(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::netns(dir, "create directory", e))?;
    let shared = MsFlags::MS_SHARED | MsFlags::MS_REC;
    match nix::mount::mount(None::<&str>, dir, None::<&str>, shared, None::<&str>) {
        Ok(()) => return Ok(()),
        // Not a mount point yet.
        Err(Errno::EINVAL) => {}
        Err(e) => return Err(Error::netns(dir, "make shared", e)),
    }
    nix::mount::mount(
        Some(dir),
        dir,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| Error::netns(dir, "bind-mount onto itself", e))?;
    nix::mount::mount(None::<&str>, dir, None::<&str>, shared, None::<&str>)
        .map_err(|e| Error::netns(dir, "make shared", e))
}

fn unshare_and_pin(path: &Path) -> Result<()> {
    nix::sched::unshare(CloneFlags::CLONE_NEWNET)
        .map_err(|e| Error::netns(path, "unshare a network namespace for", e))?;
    nix::mount::mount(
        Some("/proc/thread-self/ns/net"),
        path,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(|e| Error::netns(path, "bind-mount the namespace onto", e))
}

/// Unmounts and deletes a namespace file. Idempotent: a missing file or one
/// that is no longer mounted is fine. The namespace itself goes away once no
/// process is left in it.
pub fn remove(path: &Path) -> Result<()> {
    match nix::mount::umount2(path, MntFlags::MNT_DETACH) {
        Ok(()) | Err(Errno::EINVAL | Errno::ENOENT) => {}
        Err(e) => return Err(Error::netns(path, "unmount", e)),
    }
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != ErrorKind::NotFound => Err(Error::netns(path, "delete", e)),
        _ => Ok(()),
    }
}

/// Whether `path` is a live namespace mount (not just a leftover file).
pub fn is_mounted(path: &Path) -> bool {
    // A bind-mounted namespace reports nsfs; the empty file under it does not.
    nix::sys::statfs::statfs(path)
        .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::NSFS_MAGIC)
}

/// Opens a namespace file for `setns`.
pub fn open(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| Error::netns(path, "open", e))
}

/// Moves the calling thread into the namespace at `path`. Used by the CLI
/// right before it execs a program; a library caller wants [`crate::netlink::in_netns`].
pub fn enter(path: &Path) -> Result<()> {
    if !is_mounted(path) {
        return Err(Error::netns(
            path,
            "enter",
            std::io::Error::new(ErrorKind::InvalidInput, "not a mounted network namespace"),
        ));
    }
    let file = open(path)?;
    nix::sched::setns(&file, CloneFlags::CLONE_NEWNET)
        .map_err(|e| Error::netns(path, "enter (setns)", e))
}
