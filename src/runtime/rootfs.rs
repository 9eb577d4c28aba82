//! Reading a container's prepared rootfs from the host, for Docker's
//! "copy-up": an empty volume is first filled with what the image has at its
//! mount path (C-8). The snapshot's mounts are mounted on a private
//! directory, read, and unmounted again.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use containerd_client::services::v1::snapshots::MountsRequest;
use nix::mount::{MntFlags, MsFlags};

use super::connection::Containerd;
use super::error::RuntimeError;
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
