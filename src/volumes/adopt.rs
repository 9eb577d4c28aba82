//! A volume the reference agent kept in Docker, taken over at its first use
//! here (a node moved from the reference agent keeps its data).
//!
//! The reference names a volume of environment E `zt-<first 8 characters of
//! E>-<name>`, a Docker local volume whose data is
//! `<docker volumes dir>/<that name>/_data`. When an environment first asks
//! this agent for volume `name` and none exists here yet, that directory
//! becomes this volume's root: renamed when it is on the same filesystem,
//! else copied (owners, modes, times, links, hard links, devices, FIFOs and
//! extended attributes), with progress in the log, then verified entry by
//! entry before it is used; the Docker copy is left as it was. An adopted
//! volume is marked copied-up: the image's content never goes over adopted
//! data. What was adopted is recorded beside `_data` (`adopted-from`), said
//! in the log and in the instance's status message.

use std::collections::HashMap;
use std::ffi::OsString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{VolumeError, io_error, volume_dir, volume_root};

/// Where Docker keeps local volumes unless configured otherwise.
pub const DEFAULT_DOCKER_VOLUMES: &str = "/var/lib/docker/volumes";
/// Beside `_data`: where the volume came from.
const ADOPTED_FROM: &str = "adopted-from";

/// How a volume was taken over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adopted {
    Renamed {
        from: PathBuf,
    },
    Copied {
        from: PathBuf,
        entries: u64,
        bytes: u64,
    },
}

impl std::fmt::Display for Adopted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Renamed { from } => write!(f, "adopted from {} (renamed)", from.display()),
            Self::Copied {
                from,
                entries,
                bytes,
            } => write!(
                f,
                "adopted from {} (copied and verified: {entries} entries, {bytes} bytes)",
                from.display()
            ),
        }
    }
}

/// The reference's Docker volume of `environment_id`'s `name`, if one is
/// there: a real directory (not a symlink) with a real `_data`.
pub fn reference_volume(
    docker_volumes: &Path,
    environment_id: &str,
    name: &str,
) -> Option<PathBuf> {
    let short: String = environment_id.chars().take(8).collect();
    let dir = docker_volumes.join(format!("zt-{short}-{name}"));
    let data = dir.join("_data");
    let real_dir = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir());
    (real_dir(&dir) && real_dir(&data)).then_some(data)
}

/// Takes the reference's volume over as `local` when this node has no
/// volume of that name yet; `None` when there is nothing to take.
#[allow(clippy::disallowed_methods)] // renames within one directory, synced right after
pub fn adopt(
    docker_volumes: &Path,
    data_dir: &Path,
    environment_id: &str,
    name: &str,
    local: &str,
) -> Result<Option<Adopted>, VolumeError> {
    let ours = volume_dir(data_dir, local);
    if std::fs::symlink_metadata(&ours).is_ok() {
        return Ok(None);
    }
    let Some(from) = reference_volume(docker_volumes, environment_id, name) else {
        return Ok(None);
    };
    let err = |e: std::io::Error| io_error(name, &e);
    let volumes = data_dir.join("volumes");
    std::fs::create_dir_all(&volumes).map_err(err)?;
    let same_fs = std::fs::metadata(&from).map_err(err)?.dev()
        == std::fs::metadata(&volumes).map_err(err)?.dev();
    // Staged under a name no bring-up takes for a volume, then renamed in.
    let staging = volumes.join(format!(".adopting-{local}"));
    if std::fs::symlink_metadata(&staging).is_ok() {
        // An interrupted copy: start it again.
        std::fs::remove_dir_all(&staging).map_err(err)?;
    }
    std::fs::create_dir(&staging).map_err(err)?;
    let adopted = if same_fs {
        std::fs::rename(&from, staging.join("_data")).map_err(err)?;
        Adopted::Renamed { from: from.clone() }
    } else {
        let (entries, bytes) = copy_tree(&from, &staging.join("_data")).map_err(err)?;
        let (want, got) = (
            listing(&from).map_err(err)?,
            listing(&staging.join("_data")).map_err(err)?,
        );
        if want != got {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(VolumeError::Io {
                path: name.to_owned(),
                message: format!(
                    "the copy of {} does not verify; nothing adopted",
                    from.display()
                ),
            });
        }
        Adopted::Copied {
            from: from.clone(),
            entries,
            bytes,
        }
    };
    std::fs::write(staging.join(ADOPTED_FROM), format!("{adopted}\n")).map_err(err)?;
    std::fs::write(staging.join(super::COPIED_UP), b"").map_err(err)?;
    std::fs::rename(&staging, &ours).map_err(err)?;
    if let Ok(d) = std::fs::File::open(&volumes) {
        let _ = d.sync_all();
    }
    tracing::info!(volume = %local, "{adopted}");
    debug_assert!(volume_root(data_dir, local).exists());
    Ok(Some(adopted))
}

/// Copies the tree at `from` to `to` (which must not exist), keeping what
/// [`listing`] compares; returns (entries, bytes). Logs progress every 5 s.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<(u64, u64)> {
    let mut links: HashMap<(u64, u64), PathBuf> = HashMap::new();
    let (mut entries, mut bytes) = (0u64, 0u64);
    let mut said = Instant::now();
    let mut dirs = Vec::new();
    let mut stack = vec![(from.to_path_buf(), to.to_path_buf())];
    while let Some((src, dst)) = stack.pop() {
        let meta = std::fs::symlink_metadata(&src)?;
        let ft = meta.file_type();
        entries += 1;
        if ft.is_dir() {
            std::fs::create_dir(&dst)?;
            for e in std::fs::read_dir(&src)? {
                let e = e?;
                stack.push((e.path(), dst.join(e.file_name())));
            }
            dirs.push((dst.clone(), meta.clone()));
            copy_xattrs(&src, &dst)?;
            continue;
        }
        if meta.nlink() > 1 && !ft.is_dir() {
            if let Some(first) = links.get(&(meta.dev(), meta.ino())) {
                std::fs::hard_link(first, &dst)?;
                continue;
            }
            links.insert((meta.dev(), meta.ino()), dst.clone());
        }
        if ft.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&src)?, &dst)?;
        } else if ft.is_file() {
            bytes += std::fs::copy(&src, &dst)?;
        } else {
            // Devices, FIFOs, sockets: the node itself, not its content.
            let kind = rustix::fs::FileType::from_raw_mode(meta.mode());
            rustix::fs::mknodat(
                rustix::fs::CWD,
                &dst,
                kind,
                rustix::fs::Mode::from_raw_mode(meta.mode() & 0o7777),
                meta.rdev(),
            )?;
        }
        copy_xattrs(&src, &dst)?;
        set_owner_mode_time(&dst, &meta)?;
        if said.elapsed() >= Duration::from_secs(5) {
            tracing::info!(from = %from.display(), entries, bytes, "copying a volume from Docker");
            said = Instant::now();
        }
    }
    // Directories last, deepest first: their times stay the source's.
    for (dir, meta) in dirs.iter().rev() {
        set_owner_mode_time(dir, meta)?;
    }
    Ok((entries, bytes))
}

fn set_owner_mode_time(path: &Path, meta: &std::fs::Metadata) -> std::io::Result<()> {
    std::os::unix::fs::lchown(path, Some(meta.uid()), Some(meta.gid()))?;
    if !meta.file_type().is_symlink() {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    }
    let times = rustix::fs::Timestamps {
        last_access: rustix::fs::Timespec {
            tv_sec: meta.atime(),
            tv_nsec: meta.atime_nsec(),
        },
        last_modification: rustix::fs::Timespec {
            tv_sec: meta.mtime(),
            tv_nsec: meta.mtime_nsec(),
        },
    };
    rustix::fs::utimensat(
        rustix::fs::CWD,
        path,
        &times,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )?;
    Ok(())
}

fn copy_xattrs(from: &Path, to: &Path) -> std::io::Result<()> {
    for name in xattr_names(from)? {
        let mut value = vec![0u8; 64 * 1024];
        let n = rustix::fs::lgetxattr(from, name.as_os_str(), &mut value)?;
        rustix::fs::lsetxattr(
            to,
            name.as_os_str(),
            &value[..n],
            rustix::fs::XattrFlags::empty(),
        )?;
    }
    Ok(())
}

fn xattr_names(path: &Path) -> std::io::Result<Vec<OsString>> {
    let mut buf = vec![0u8; 64 * 1024];
    let n = match rustix::fs::llistxattr(path, &mut buf) {
        Ok(n) => n,
        Err(rustix::io::Errno::NOTSUP) => 0,
        Err(e) => return Err(e.into()),
    };
    Ok(buf[..n]
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(|n| OsString::from(std::ffi::OsStr::from_bytes(n)))
        .collect())
}

/// Every entry below `root`, read with lstat: type, mode, owner, size,
/// link target, content digest, device, xattrs and which paths share an
/// inode; what a copy must reproduce.
fn listing(root: &Path) -> std::io::Result<Vec<String>> {
    use sha2::{Digest, Sha256};
    let mut paths = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        if std::fs::symlink_metadata(&p)?.is_dir() {
            for e in std::fs::read_dir(&p)? {
                stack.push(e?.path());
            }
        }
        paths.push(p);
    }
    paths.sort();
    let mut first_of: HashMap<(u64, u64), String> = HashMap::new();
    let mut out = Vec::with_capacity(paths.len());
    for p in paths {
        let rel = p.strip_prefix(root).unwrap_or(&p).display().to_string();
        let m = std::fs::symlink_metadata(&p)?;
        let what = if m.file_type().is_symlink() {
            format!("-> {}", std::fs::read_link(&p)?.display())
        } else if m.is_file() {
            let mut h = Sha256::new();
            std::io::copy(&mut std::fs::File::open(&p)?, &mut h)?;
            let same = if m.nlink() > 1 {
                first_of
                    .entry((m.dev(), m.ino()))
                    .or_insert_with(|| rel.clone())
                    .clone()
            } else {
                rel.clone()
            };
            format!("{} {:x} {same}", m.len(), h.finalize())
        } else {
            format!("rdev {}", m.rdev())
        };
        let mode = if m.file_type().is_symlink() {
            0
        } else {
            m.mode()
        };
        let mut xattrs = xattr_names(&p)?;
        xattrs.sort();
        out.push(format!(
            "{rel} {mode:o} {}:{} {what} {xattrs:?}",
            m.uid(),
            m.gid()
        ));
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn reference_tree(docker: &Path, env: &str) -> PathBuf {
        let data = docker.join(format!("zt-{}-db/_data", &env[..8]));
        std::fs::create_dir_all(data.join("base/sub")).unwrap();
        std::fs::write(data.join("base/sub/rows"), b"1\n2\n3\n").unwrap();
        std::fs::write(data.join("pg_version"), b"16\n").unwrap();
        std::os::unix::fs::symlink("pg_version", data.join("link")).unwrap();
        std::fs::hard_link(data.join("pg_version"), data.join("hard")).unwrap();
        std::fs::set_permissions(data.join("base"), std::fs::Permissions::from_mode(0o700))
            .unwrap();
        data
    }

    #[test]
    fn the_copy_keeps_every_entry_and_verifies() {
        let d = tempfile::tempdir().unwrap();
        let from = reference_tree(d.path(), "01JENVIRONMENT");
        let to = d.path().join("copy");
        let (entries, bytes) = copy_tree(&from, &to).unwrap();
        assert_eq!(listing(&from).unwrap(), listing(&to).unwrap());
        assert_eq!(
            (entries, bytes),
            (7, 9),
            "5 files and links, 2 dirs besides the root"
        );
        assert_eq!(
            std::fs::metadata(to.join("hard")).unwrap().ino(),
            std::fs::metadata(to.join("pg_version")).unwrap().ino()
        );
    }

    #[test]
    fn a_reference_volume_is_renamed_in_once_and_marked_copied_up() {
        let d = tempfile::tempdir().unwrap();
        let (docker, data) = (d.path().join("docker"), d.path().join("data"));
        let env = "01JENVIRONMENTXXXXXXXXXXXX";
        let from = reference_tree(&docker, env);
        let want = listing(&from).unwrap();
        let local = super::super::local_name(env, "db").unwrap();
        let got = adopt(&docker, &data, env, "db", &local).unwrap();
        assert_eq!(got, Some(Adopted::Renamed { from: from.clone() }));
        assert_eq!(listing(&volume_root(&data, &local)).unwrap(), want);
        assert!(
            !super::super::first_use(&data, &local).unwrap(),
            "no copy-up over adopted data"
        );
        assert_eq!(
            adopt(&docker, &data, env, "db", &local).unwrap(),
            None,
            "once"
        );
        // Another environment whose first 8 characters match is no longer
        // the reference's (it was renamed away): nothing to adopt.
        let other = super::super::local_name("01JENVIRONMENTYYYYYYYYYYYY", "db").unwrap();
        assert_eq!(
            adopt(&docker, &data, "01JENVIRONMENTYYYYYYYYYYYY", "db", &other).unwrap(),
            None
        );
    }

    #[test]
    fn only_a_real_docker_volume_is_taken() {
        let d = tempfile::tempdir().unwrap();
        let docker = d.path().join("docker");
        std::fs::create_dir_all(&docker).unwrap();
        std::os::unix::fs::symlink("/etc", docker.join("zt-01JENVIR-db")).unwrap();
        assert_eq!(reference_volume(&docker, "01JENVIRONMENT", "db"), None);
    }
}
