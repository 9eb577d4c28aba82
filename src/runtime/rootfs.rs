//! Reading a container's prepared rootfs from the host, for Docker's
//! "copy-up": an empty volume is first filled with what the image has at its
//! mount path (C-8). The snapshot's mounts are mounted on a private
//! directory, read, and unmounted again.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
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
    let relative = inside.trim_start_matches('/').to_owned();
    let (dest_owned, target_owned) = (dest.to_path_buf(), target.clone());
    let result = tokio::task::spawn_blocking(move || -> Result<(), String> {
        for m in &mounts {
            mount_one(m, &target_owned)
                .map_err(|e| format!("mounting the rootfs ({}): {e}", m.r#type))?;
        }
        let copied = {
            let source = target_owned.join(&relative);
            if source.is_dir() {
                copy_tree(&source, &dest_owned).map_err(|e| e.to_string())
            } else {
                Ok(())
            }
        };
        let unmounted = nix::mount::umount2(&target_owned, MntFlags::MNT_DETACH);
        copied?;
        unmounted.map_err(|e| format!("unmounting the rootfs: {e}"))
    })
    .await
    .map_err(|e| fail("task", &e))?;
    let _ = fs::remove_dir(&target);
    result.map_err(|e| fail("copy", &e))
}

/// Files larger than this are not read from an image.
const MAX_IMAGE_FILE: u64 = 1024 * 1024;

/// Reads small files (`etc/passwd`, …) from the rootfs of the image whose
/// top snapshot is `chain_id`, through a read-only view (C-5). A file that
/// is absent, too big, or resolves outside the rootfs (a symlink leading
/// out) reads as `None`. `scratch` is a private directory for the mount.
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
    let read = paths
        .iter()
        .map(|p| {
            let real = crate::volumes::resolve(target, p).ok()?;
            let meta = fs::metadata(&real).ok()?;
            (meta.is_file() && meta.len() <= MAX_IMAGE_FILE)
                .then(|| fs::read(&real).ok())
                .flatten()
        })
        .collect();
    nix::mount::umount2(target, MntFlags::MNT_DETACH).map_err(|e| format!("unmounting: {e}"))?;
    Ok(read)
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

/// Copies the contents of `from` into the existing directory `to`.
fn copy_tree(from: &Path, to: &Path) -> io::Result<()> {
    let meta = fs::symlink_metadata(from)?;
    fs::set_permissions(to, fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    std::os::unix::fs::lchown(to, Some(meta.uid()), Some(meta.gid()))?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let src = entry.path();
        let dst = to.join(entry.file_name());
        let meta = fs::symlink_metadata(&src)?;
        let kind = meta.file_type();
        if kind.is_dir() {
            fs::create_dir(&dst)?;
            copy_tree(&src, &dst)?;
        } else if kind.is_symlink() {
            std::os::unix::fs::symlink(fs::read_link(&src)?, &dst)?;
            std::os::unix::fs::lchown(&dst, Some(meta.uid()), Some(meta.gid()))?;
        } else if kind.is_file() {
            fs::copy(&src, &dst)?;
            fs::set_permissions(&dst, fs::Permissions::from_mode(meta.mode() & 0o7777))?;
            std::os::unix::fs::lchown(&dst, Some(meta.uid()), Some(meta.gid()))?;
        }
        // Devices, sockets and FIFOs are not copied: a volume holds data.
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::copy_tree;

    #[test]
    fn copies_files_dirs_links_and_modes() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        std::fs::create_dir(src.path().join("sub")).unwrap();
        std::fs::write(src.path().join("sub/a.txt"), "a").unwrap();
        std::os::unix::fs::symlink("sub/a.txt", src.path().join("link")).unwrap();
        std::fs::set_permissions(
            src.path().join("sub/a.txt"),
            std::fs::Permissions::from_mode(0o640),
        )
        .unwrap();
        copy_tree(src.path(), dst.path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(dst.path().join("sub/a.txt")).unwrap(),
            "a"
        );
        assert_eq!(
            std::fs::read_link(dst.path().join("link"))
                .unwrap()
                .to_str(),
            Some("sub/a.txt")
        );
        let mode = std::fs::metadata(dst.path().join("sub/a.txt"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(mode, 0o640);
    }
}
