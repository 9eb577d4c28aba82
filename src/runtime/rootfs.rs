//! Reading a container's prepared rootfs from the host, for Docker's
//! "copy-up": an empty volume is first filled with what the image has at its
//! mount path (C-8). The snapshot's mounts are mounted on a private
//! directory, read, and unmounted again.

use std::fs;
use std::path::Path;

use containerd_client::services::v1::snapshots::{
    MountsRequest, RemoveSnapshotRequest, ViewSnapshotRequest,
};
use nix::mount::{MntFlags, MsFlags};

use super::connection::Containerd;
use super::error::RuntimeError;
use super::lease::Lease;
use super::unpack::SNAPSHOTTER;

/// Copies `inside` (an absolute path in the container's rootfs) into the
/// empty directory `dest`, keeping modes, owners and symlinks. A path the
/// image does not have copies nothing. `scratch` is a private directory for
/// the temporary mount.
pub async fn copy_up(
    ctd: &Containerd,
    snapshot_key: &str,
    inside: &str,
    dest: &Path,
    scratch: &Path,
) -> Result<(), RuntimeError> {
    let mounts = ctd
        .snapshots()
        .mounts(ctd.request(MountsRequest {
            snapshotter: SNAPSHOTTER.into(),
            key: snapshot_key.into(),
        }))
        .await
        .map_err(RuntimeError::grpc(format!(
            "rootfs mounts of {snapshot_key}"
        )))?
        .into_inner()
        .mounts;
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        RuntimeError::Invalid(format!(
            "copy-up of {inside} from {snapshot_key}: {what}: {e}"
        ))
    };
    let target = scratch.join(format!("rootfs-{snapshot_key}"));
    fs::create_dir_all(&target).map_err(|e| fail("scratch dir", &e))?;
    let inside = Path::new(inside).to_owned();
    let (dest_owned, target_owned) = (dest.to_path_buf(), target.clone());
    let result = tokio::task::spawn_blocking(move || -> Result<(), String> {
        for m in &mounts {
            mount_one(m, &target_owned)
                .map_err(|e| format!("mounting the rootfs ({}): {e}", m.r#type))?;
        }
        let copied = copy_image_dir(&target_owned, &inside, &dest_owned);
        let unmounted = nix::mount::umount2(&target_owned, MntFlags::MNT_DETACH);
        copied?;
        unmounted.map_err(|e| format!("unmounting the rootfs: {e}"))
    })
    .await
    .map_err(|e| fail("task", &e))?;
    let _ = fs::remove_dir(&target);
    result.map_err(|e| fail("copy", &e))
}

/// The image directory `inside`, resolved as the container would resolve it
/// (its symlinks lead somewhere inside the rootfs, never onto the host),
/// copied into the empty volume root `dest` through directory handles.
fn copy_image_dir(rootfs: &Path, inside: &Path, dest: &Path) -> Result<(), String> {
    use std::os::fd::AsFd;
    let root = crate::beneath::open_dir(rootfs).map_err(|e| format!("opening the rootfs: {e}"))?;
    let source = match crate::beneath::open_in_root(
        root.as_fd(),
        inside,
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_DIRECTORY,
    ) {
        Ok(fd) => fd,
        // The image has nothing there, or not a directory: nothing to copy.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(nix::libc::ENOENT | nix::libc::ENOTDIR)
            ) =>
        {
            return Ok(());
        }
        Err(e) => return Err(format!("opening {} in the image: {e}", inside.display())),
    };
    let dest = crate::beneath::open_dir(dest).map_err(|e| format!("opening the volume: {e}"))?;
    if !crate::beneath::names(dest.as_fd())
        .map_err(|e| format!("reading the volume: {e}"))?
        .is_empty()
    {
        // Filled meanwhile (another container of the volume): leave it be.
        return Ok(());
    }
    crate::beneath::copy_tree(source.as_fd(), dest.as_fd()).map_err(|e| e.to_string())
}

/// Files larger than this are not read from an image.
const MAX_IMAGE_FILE: u64 = 1024 * 1024;

/// Reads small files (`etc/passwd`, …) from the rootfs of the image whose
/// top snapshot is `chain_id`, through a read-only view (C-5). A file that
/// is absent, too big or not a regular file reads as `None`; symlinks
/// resolve inside the rootfs, as in the container. `scratch` is a private directory for the mount.
pub async fn read_image_files(
    ctd: &Containerd,
    chain_id: &str,
    paths: &[&str],
    scratch: &Path,
) -> Result<Vec<Option<Vec<u8>>>, RuntimeError> {
    let lease = Lease::create(ctd, "view", std::time::Duration::from_secs(60)).await?;
    let key = format!("{}-view", lease.id());
    let viewed = ctd
        .snapshots()
        .view(ctd.leased_request(
            ViewSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: key.clone(),
                parent: chain_id.into(),
                labels: std::collections::HashMap::new(),
            },
            lease.id(),
        ))
        .await;
    let result = match viewed {
        Ok(r) => {
            let mounts = r.into_inner().mounts;
            let target = scratch.join(&key);
            let paths: Vec<String> = paths.iter().map(|p| (*p).to_owned()).collect();
            tokio::task::spawn_blocking(move || {
                let read = read_mounted(&mounts, &target, &paths);
                let _ = fs::remove_dir(&target);
                read
            })
            .await
            .map_err(|e| RuntimeError::Invalid(format!("reading the image rootfs: {e}")))?
            .map_err(|e| RuntimeError::Invalid(format!("reading the image rootfs: {e}")))
        }
        Err(s) => Err(RuntimeError::grpc(format!("view of snapshot {chain_id}"))(
            s,
        )),
    };
    let _ = ctd
        .snapshots()
        .remove(ctd.request(RemoveSnapshotRequest {
            snapshotter: SNAPSHOTTER.into(),
            key,
        }))
        .await;
    let _ = lease.release(ctd).await;
    result
}

fn read_mounted(
    mounts: &[containerd_client::types::Mount],
    target: &Path,
    paths: &[String],
) -> Result<Vec<Option<Vec<u8>>>, String> {
    fs::create_dir_all(target).map_err(|e| format!("scratch dir: {e}"))?;
    for m in mounts {
        mount_one(m, target).map_err(|e| format!("mounting ({}): {e}", m.r#type))?;
    }
    let read = crate::beneath::open_dir(target).ok().map_or_else(
        || vec![None; paths.len()],
        |root| paths.iter().map(|p| read_small_file(&root, p)).collect(),
    );
    nix::mount::umount2(target, MntFlags::MNT_DETACH).map_err(|e| format!("unmounting: {e}"))?;
    Ok(read)
}

/// A regular file of the image, resolved inside its rootfs.
fn read_small_file(root: &std::os::fd::OwnedFd, path: &str) -> Option<Vec<u8>> {
    use std::io::Read;
    use std::os::fd::AsFd;
    let fd = crate::beneath::open_in_root(
        root.as_fd(),
        Path::new(path),
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_NONBLOCK,
    )
    .ok()?;
    let file = fs::File::from(fd);
    let meta = file.metadata().ok()?;
    if !meta.is_file() || meta.len() > MAX_IMAGE_FILE {
        return None;
    }
    let mut bytes = Vec::new();
    file.take(MAX_IMAGE_FILE).read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

fn mount_one(m: &containerd_client::types::Mount, target: &Path) -> nix::Result<()> {
    let mut flags = MsFlags::empty();
    let mut data = Vec::new();
    for o in &m.options {
        match o.as_str() {
            "bind" | "rbind" => flags |= MsFlags::MS_BIND,
            "ro" => flags |= MsFlags::MS_RDONLY,
            "rw" => {}
            other => data.push(other),
        }
    }
    let data = data.join(",");
    let fstype = if flags.contains(MsFlags::MS_BIND) {
        None
    } else {
        Some(m.r#type.as_str())
    };
    nix::mount::mount(
        Some(m.source.as_str()),
        target,
        fstype,
        flags,
        (!data.is_empty()).then_some(data.as_str()),
    )
}
