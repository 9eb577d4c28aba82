//! Restoring a tar into a volume (SNAP-10, the Rewrite): a fresh staging
//! directory beside the volume root, every entry created beneath it without
//! following a link, then one atomic swap. A failure removes the staging
//! directory and leaves the volume as it was.
//!
//! Paths go through the VF-1 lexical clamp (`/a` is `a`, `..` stops at the
//! root). A parent directory is opened with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS)`, so a symlink in the snapshot (or planted by a
//! workload) can never carry a later entry outside; each entry is created
//! with `O_EXCL | O_NOFOLLOW`, `mkdirat`, `symlinkat`, `mknodat` or
//! `linkat` relative to that descriptor. Modes are applied exactly with
//! `fchmod` after `fchown` (so setuid/setgid survive, no umask), mtimes
//! after contents, directories' last.

use std::ffi::OsString;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use rustix::fs::Timespec;
use rustix::fs::{
    AtFlags, FileType, Gid, Mode, OFlags, RenameFlags, ResolveFlags, Timestamps, Uid,
};
use rustix::io::Errno;

use super::error::SnapshotError;

/// What an extraction wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Extracted {
    pub entries: u64,
    pub bytes: u64,
    pub skipped: u64,
}

/// A directory being filled beside `target`; removed on drop unless
/// committed.
#[derive(Debug)]
pub struct Staging {
    parent: OwnedFd,
    parent_path: PathBuf,
    name: OsString,
    target: OsString,
    dir: Option<OwnedFd>,
    committed: bool,
}

fn io(path: &Path, e: impl Into<std::io::Error>) -> SnapshotError {
    SnapshotError::RestoreIo {
        path: path.display().to_string(),
        source: e.into(),
    }
}

impl Staging {
    /// `<target>.restore-<id>` beside `target` (which may not exist yet);
    /// staging dirs left by an earlier crash are removed first.
    pub fn create(target: &Path, id: &str) -> Result<Self, SnapshotError> {
        let parent_path = target
            .parent()
            .ok_or_else(|| SnapshotError::Restore("the target has no parent directory".into()))?
            .to_owned();
        let target_name = target
            .file_name()
            .ok_or_else(|| SnapshotError::Restore("the target has no name".into()))?
            .to_owned();
        std::fs::create_dir_all(&parent_path).map_err(|e| io(&parent_path, e))?;
        let parent = rustix::fs::open(
            &parent_path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io(&parent_path, e))?;
        let stale = {
            let mut s = target_name.clone();
            s.push(".restore-");
            s
        };
        if let Ok(entries) = std::fs::read_dir(&parent_path) {
            for e in entries.flatten() {
                if e.file_name().as_bytes().starts_with(stale.as_bytes()) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        let mut name = stale;
        name.push(id);
        rustix::fs::mkdirat(&parent, name.as_os_str(), Mode::from_raw_mode(0o700))
            .map_err(|e| io(&parent_path.join(&name), e))?;
        let dir = rustix::fs::openat(
            &parent,
            name.as_os_str(),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io(&parent_path.join(&name), e))?;
        Ok(Self {
            parent,
            parent_path,
            name,
            target: target_name,
            dir: Some(dir),
            committed: false,
        })
    }

    pub fn dir(&self) -> Result<&OwnedFd, SnapshotError> {
        self.dir
            .as_ref()
            .ok_or_else(|| SnapshotError::Internal("staging directory closed".into()))
    }

    /// Swaps the staging directory in for the target in one rename (the
    /// root keeps the target's owner and mode), then removes the old tree.
    /// The restored tree is on disk before the swap, and the swap before
    /// the old tree goes (58.4): a power cut anywhere leaves one whole
    /// version, never neither.
    pub fn commit(mut self) -> Result<(), SnapshotError> {
        let dir = self
            .dir
            .take()
            .ok_or_else(|| SnapshotError::Internal("staging directory closed".into()))?;
        let target_path = self.parent_path.join(&self.target);
        let existing = rustix::fs::statat(
            &self.parent,
            self.target.as_os_str(),
            AtFlags::SYMLINK_NOFOLLOW,
        );
        let (mode, uid, gid) = match &existing {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory => {
                (st.st_mode & 0o7777, st.st_uid, st.st_gid)
            }
            _ => (0o755, 0, 0),
        };
        set_owner(&dir, uid, gid).map_err(|e| io(&target_path, e))?;
        rustix::fs::fchmod(&dir, Mode::from_raw_mode(mode)).map_err(|e| io(&target_path, e))?;
        rustix::fs::syncfs(&dir).map_err(|e| io(&target_path, e))?;
        drop(dir);
        let flags = if existing.is_ok() {
            RenameFlags::EXCHANGE
        } else {
            RenameFlags::NOREPLACE
        };
        rustix::fs::renameat_with(
            &self.parent,
            self.name.as_os_str(),
            &self.parent,
            self.target.as_os_str(),
            flags,
        )
        .map_err(|e| io(&target_path, e))?;
        self.committed = true;
        rustix::fs::fsync(&self.parent).map_err(|e| io(&target_path, e))?;
        if existing.is_ok() {
            // The old tree now sits at the staging name.
            let old = self.parent_path.join(&self.name);
            if let Err(e) = std::fs::remove_dir_all(&old) {
                tracing::warn!(path = %old.display(), error = %e, "restore: the previous contents were not removed");
            }
        }
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            self.dir = None;
            let _ = std::fs::remove_dir_all(self.parent_path.join(&self.name));
        }
    }
}

/// The VF-1 clamp: the components of `raw` read as if absolute.
pub fn clamp(raw: &[u8]) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = Vec::new();
    for part in raw.split(|&c| c == b'/') {
        match part {
            b"" | b"." => {}
            b".." => {
                out.pop();
            }
            p => out.push(p.to_vec()),
        }
    }
    out
}

fn join(parts: &[Vec<u8>]) -> Vec<u8> {
    parts.join(&b'/')
}

fn shown(parts: &[Vec<u8>]) -> String {
    String::from_utf8_lossy(&join(parts)).into_owned()
}

const BENEATH: ResolveFlags = ResolveFlags::BENEATH
    .union(ResolveFlags::NO_SYMLINKS)
    .union(ResolveFlags::NO_MAGICLINKS)
    .union(ResolveFlags::NO_XDEV);

/// Opens `parts` under `root` without following any link and without
/// leaving `root`: `openat2` when the kernel has it, else one `O_NOFOLLOW`
/// component at a time.
fn open_beneath(root: &OwnedFd, parts: &[Vec<u8>], flags: OFlags) -> Result<OwnedFd, Errno> {
    let path = if parts.is_empty() {
        b".".to_vec()
    } else {
        join(parts)
    };
    match rustix::fs::openat2(
        root,
        path.as_slice(),
        flags | OFlags::CLOEXEC,
        Mode::empty(),
        BENEATH,
    ) {
        Err(Errno::NOSYS) => {}
        other => return other,
    }
    let mut fd = rustix::fs::openat(
        root,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    for (i, p) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        let f = if last {
            flags
        } else {
            OFlags::RDONLY | OFlags::DIRECTORY
        };
        fd = rustix::fs::openat(
            &fd,
            p.as_slice(),
            f | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
    }
    Ok(fd)
}

fn set_owner(fd: impl AsFd, uid: u32, gid: u32) -> Result<(), Errno> {
    match rustix::fs::fchown(fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid))) {
        // Not root (an operator restoring into a directory of their own):
        // ownership is best effort, as in the reference.
        Err(Errno::PERM) if !rustix::process::geteuid().is_root() => Ok(()),
        other => other,
    }
}

fn times(mtime: i64) -> Timestamps {
    let t = Timespec {
        tv_sec: mtime,
        tv_nsec: 0,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

/// Metadata applied once a directory's contents are written.
struct DirMeta {
    parts: Vec<Vec<u8>>,
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: i64,
}

/// An entry's metadata, PAX records over the header's fields.
struct Meta {
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: i64,
}

fn meta_of<R: Read>(entry: &mut tar::Entry<'_, R>) -> Result<Meta, std::io::Error> {
    let h = entry.header();
    // Empty numeric fields read as 0, as Go's reader takes them.
    let mut uid = h.uid().unwrap_or(0);
    let mut gid = h.gid().unwrap_or(0);
    let mut mtime = i64::try_from(h.mtime().unwrap_or(0)).unwrap_or(0);
    let mode = h.mode()? & 0o7777;
    if let Some(exts) = entry.pax_extensions()? {
        for ext in exts.flatten() {
            let value = String::from_utf8_lossy(ext.value_bytes()).into_owned();
            let whole = value.split('.').next().unwrap_or("");
            match ext.key_bytes() {
                b"uid" => uid = whole.parse().unwrap_or(uid),
                b"gid" => gid = whole.parse().unwrap_or(gid),
                b"mtime" => mtime = whole.parse().unwrap_or(mtime),
                _ => {}
            }
        }
    }
    Ok(Meta {
        uid: u32::try_from(uid).unwrap_or(u32::MAX),
        gid: u32::try_from(gid).unwrap_or(u32::MAX),
        mode,
        mtime,
    })
}

/// Extracts the tar read from `input` into the staging directory `root`.
/// `warn` hears about skipped entries.
pub fn extract(
    input: impl Read,
    root: &OwnedFd,
    warn: &mut dyn FnMut(String),
) -> Result<Extracted, SnapshotError> {
    let mut archive = tar::Archive::new(input);
    let mut dirs: Vec<DirMeta> = Vec::new();
    let mut done = Extracted::default();
    let mut parent_cache: Option<(Vec<Vec<u8>>, OwnedFd)> = None;
    let bad = |parts: &[Vec<u8>], e: std::io::Error| SnapshotError::RestoreIo {
        path: shown(parts),
        source: e,
    };
    let entries = archive
        .entries()
        .map_err(|e| SnapshotError::Restore(format!("reading the snapshot's tar: {e}")))?;
    for entry in entries {
        let mut entry = entry
            .map_err(|e| SnapshotError::Restore(format!("reading the snapshot's tar: {e}")))?;
        let raw = entry.path_bytes().into_owned();
        let parts = clamp(&raw);
        let Some((name, parent)) = parts.split_last() else {
            continue; // the root itself
        };
        let kind = entry.header().entry_type();
        let meta = meta_of(&mut entry).map_err(|e| bad(&parts, e))?;

        let pdir = match &parent_cache {
            Some((p, fd)) if p.as_slice() == parent => fd,
            _ => {
                let fd = parent_dir(root, parent).map_err(|e| bad(parent, e.into()))?;
                &parent_cache.insert((parent.to_vec(), fd)).1
            }
        };
        let name = name.as_slice();
        let made = match kind {
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let fd = rustix::fs::openat(
                    pdir,
                    name,
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o600),
                )
                .map_err(|e| bad(&parts, e.into()))?;
                let mut file = std::fs::File::from(fd);
                done.bytes += std::io::copy(&mut entry, &mut file).map_err(|e| bad(&parts, e))?;
                set_owner(&file, meta.uid, meta.gid).map_err(|e| bad(&parts, e.into()))?;
                rustix::fs::fchmod(&file, Mode::from_raw_mode(meta.mode))
                    .map_err(|e| bad(&parts, e.into()))?;
                rustix::fs::futimens(&file, &times(meta.mtime))
                    .map_err(|e| bad(&parts, e.into()))?;
                true
            }
            tar::EntryType::Directory => {
                match rustix::fs::mkdirat(pdir, name, Mode::from_raw_mode(0o700)) {
                    Ok(()) => {}
                    // Made already as a missing parent of an earlier entry.
                    Err(Errno::EXIST)
                        if rustix::fs::statat(pdir, name, AtFlags::SYMLINK_NOFOLLOW).is_ok_and(
                            |st| FileType::from_raw_mode(st.st_mode) == FileType::Directory,
                        ) => {}
                    Err(e) => return Err(bad(&parts, e.into())),
                }
                dirs.push(DirMeta {
                    parts: parts.clone(),
                    uid: meta.uid,
                    gid: meta.gid,
                    mode: meta.mode,
                    mtime: meta.mtime,
                });
                true
            }
            tar::EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| {
                        SnapshotError::Restore(format!(
                            "{}: a symlink without a target",
                            shown(&parts)
                        ))
                    })?
                    .into_owned();
                rustix::fs::symlinkat(target.as_slice(), pdir, name)
                    .map_err(|e| bad(&parts, e.into()))?;
                node_meta(pdir, name, &meta, false).map_err(|e| bad(&parts, e.into()))?;
                true
            }
            tar::EntryType::Link => {
                let target = entry.link_name_bytes().ok_or_else(|| {
                    SnapshotError::Restore(format!(
                        "{}: a hard link without a target",
                        shown(&parts)
                    ))
                })?;
                let tparts = clamp(&target);
                let src = open_beneath(root, &tparts, OFlags::PATH | OFlags::NOFOLLOW)
                    .map_err(|e| bad(&tparts, e.into()))?;
                rustix::fs::linkat(&src, "", pdir, name, AtFlags::EMPTY_PATH)
                    .map_err(|e| bad(&parts, e.into()))?;
                true
            }
            tar::EntryType::Char | tar::EntryType::Block | tar::EntryType::Fifo => {
                let (ft, dev) = if kind == tar::EntryType::Fifo {
                    (FileType::Fifo, 0)
                } else {
                    let major = entry.header().device_major().ok().flatten().unwrap_or(0);
                    let minor = entry.header().device_minor().ok().flatten().unwrap_or(0);
                    let ft = if kind == tar::EntryType::Char {
                        FileType::CharacterDevice
                    } else {
                        FileType::BlockDevice
                    };
                    (ft, rustix::fs::makedev(major, minor))
                };
                rustix::fs::mknodat(pdir, name, ft, Mode::from_raw_mode(0o600), dev)
                    .map_err(|e| bad(&parts, e.into()))?;
                node_meta(pdir, name, &meta, true).map_err(|e| bad(&parts, e.into()))?;
                true
            }
            other => {
                warn(format!(
                    "{}: entry type {other:?} is not restored; skipped",
                    shown(&parts)
                ));
                false
            }
        };
        if made {
            done.entries += 1;
        } else {
            done.skipped += 1;
        }
    }
    drop(parent_cache);
    // Directories last, deepest first: their mtimes stay those of the snapshot.
    for d in dirs.iter().rev() {
        let fd = open_beneath(root, &d.parts, OFlags::RDONLY | OFlags::DIRECTORY)
            .map_err(|e| bad(&d.parts, e.into()))?;
        set_owner(&fd, d.uid, d.gid).map_err(|e| bad(&d.parts, e.into()))?;
        rustix::fs::fchmod(&fd, Mode::from_raw_mode(d.mode))
            .map_err(|e| bad(&d.parts, e.into()))?;
        rustix::fs::futimens(&fd, &times(d.mtime)).map_err(|e| bad(&d.parts, e.into()))?;
    }
    Ok(done)
}

/// Owner, mode (not for symlinks) and mtime of a node made by name.
fn node_meta(dir: &OwnedFd, name: &[u8], meta: &Meta, chmod: bool) -> Result<(), Errno> {
    match rustix::fs::chownat(
        dir,
        name,
        Some(Uid::from_raw(meta.uid)),
        Some(Gid::from_raw(meta.gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    ) {
        Err(Errno::PERM) if !rustix::process::geteuid().is_root() => {}
        other => other?,
    }
    if chmod {
        rustix::fs::chmodat(dir, name, Mode::from_raw_mode(meta.mode), AtFlags::empty())?;
    }
    rustix::fs::utimensat(dir, name, &times(meta.mtime), AtFlags::SYMLINK_NOFOLLOW)
}

/// The parent directory of an entry, created (0755, like `MkdirAll`) where
/// the tar did not list it; never through a link.
fn parent_dir(root: &OwnedFd, parts: &[Vec<u8>]) -> Result<OwnedFd, Errno> {
    match open_beneath(root, parts, OFlags::RDONLY | OFlags::DIRECTORY) {
        Err(Errno::NOENT) => {}
        other => return other,
    }
    let mut fd = open_beneath(root, &[], OFlags::RDONLY | OFlags::DIRECTORY)?;
    for p in parts {
        match rustix::fs::mkdirat(&fd, p.as_slice(), Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(e),
        }
        fd = rustix::fs::openat(
            &fd,
            p.as_slice(),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
    }
    Ok(fd)
}

/// `parts` as a path (tests, messages).
pub fn path_of(parts: &[Vec<u8>]) -> PathBuf {
    PathBuf::from(OsString::from_vec(join(parts)))
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn tar_with(entries: &[(&str, tar::EntryType, &str, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, link, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(0o644);
            h.set_size(data.len() as u64);
            h.set_mtime(1_600_000_000);
            // Raw names, so hostile ones (`..`, absolute) go in unchanged.
            let name = path.as_bytes();
            h.as_old_mut().name[..name.len()].copy_from_slice(name);
            if !link.is_empty() {
                h.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
            }
            h.set_cksum();
            b.append(&h, *data).unwrap();
        }
        b.into_inner().unwrap()
    }

    fn restore(tar: &[u8], target: &Path) -> Result<Extracted, SnapshotError> {
        let staging = Staging::create(target, "t")?;
        let done = extract(tar, staging.dir()?, &mut |_| {})?;
        staging.commit()?;
        Ok(done)
    }

    #[test]
    fn clamp_reads_paths_as_absolute() {
        assert_eq!(
            clamp(b"/a/../../b/./c/"),
            vec![b"b".to_vec(), b"c".to_vec()]
        );
        assert!(clamp(b"../..").is_empty());
    }

    #[test]
    fn a_restore_replaces_the_volume_exactly() {
        let d = tempfile::tempdir().unwrap();
        let vol = d.path().join("_data");
        std::fs::create_dir(&vol).unwrap();
        std::fs::write(vol.join("stale"), "not in the snapshot").unwrap();
        let tar = tar_with(&[
            ("dir/", tar::EntryType::Directory, "", b""),
            ("dir/f", tar::EntryType::Regular, "", b"hello"),
            ("s", tar::EntryType::Symlink, "dir/f", b""),
            ("h", tar::EntryType::Link, "dir/f", b""),
        ]);
        restore(&tar, &vol).unwrap();
        assert!(!vol.join("stale").exists(), "a restore is not a merge");
        assert_eq!(std::fs::read(vol.join("s")).unwrap(), b"hello");
        assert_eq!(
            std::fs::metadata(vol.join("h")).unwrap().ino(),
            std::fs::metadata(vol.join("dir/f")).unwrap().ino()
        );
        assert_eq!(
            std::fs::metadata(vol.join("dir")).unwrap().mtime(),
            1_600_000_000
        );
        let leftovers: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(leftovers, [std::ffi::OsString::from("_data")]);
    }

    #[test]
    fn modes_are_exact_setuid_included() {
        let d = tempfile::tempdir().unwrap();
        let vol = d.path().join("_data");
        let mut b = tar::Builder::new(Vec::new());
        for (name, mode) in [("suid", 0o4755), ("sgid", 0o2711), ("open", 0o777)] {
            let mut h = tar::Header::new_ustar();
            h.set_path(name).unwrap();
            h.set_mode(mode);
            h.set_size(0);
            h.set_cksum();
            b.append(&h, &[][..]).unwrap();
        }
        let mut h = tar::Header::new_ustar();
        h.set_path("sticky/").unwrap();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o1777);
        h.set_size(0);
        h.set_cksum();
        b.append(&h, &[][..]).unwrap();
        restore(&b.into_inner().unwrap(), &vol).unwrap();
        let mode = |n: &str| std::fs::metadata(vol.join(n)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(
            (mode("suid"), mode("sgid"), mode("open"), mode("sticky")),
            (0o4755, 0o2711, 0o777, 0o1777)
        );
    }

    /// A hostile snapshot: `..`, an absolute path, and a symlink followed by
    /// an entry through it. Nothing lands outside the staging directory.
    #[test]
    fn hostile_paths_stay_beneath_the_volume() {
        let d = tempfile::tempdir().unwrap();
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let vol = d.path().join("vol/_data");
        let escape = format!("{}", outside.display());
        let tar = tar_with(&[
            ("../../outside/dotdot", tar::EntryType::Regular, "", b"x"),
            (&format!("{escape}/abs"), tar::EntryType::Regular, "", b"x"),
        ]);
        restore(&tar, &vol).unwrap();
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        assert!(vol.join("outside/dotdot").exists(), "clamped inside");

        let through = tar_with(&[
            ("link", tar::EntryType::Symlink, &escape, b""),
            ("link/evil", tar::EntryType::Regular, "", b"x"),
        ]);
        let vol2 = d.path().join("vol2/_data");
        let err = restore(&through, &vol2).unwrap_err();
        assert!(err.to_string().contains("link"), "{err}");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        assert!(!vol2.exists(), "a failed restore leaves nothing");
    }

    /// A hard link whose target leads out of the volume, through a symlink
    /// or `..`, to a real file on the same filesystem: refused, and the
    /// file outside gains no link (a link would let the container rewrite
    /// it).
    #[test]
    fn hard_links_never_reach_a_file_outside_the_volume() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let outside = d.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        let secret = outside.join("secret");
        std::fs::write(&secret, b"host file").unwrap();
        let escape = outside.display().to_string();
        let through_symlink = [
            ("link", tar::EntryType::Symlink, escape.as_str(), &b""[..]),
            ("h", tar::EntryType::Link, "link/secret", b""),
        ];
        let dotdot = [(
            "h",
            tar::EntryType::Link,
            "../../../outside/secret",
            &b""[..],
        )];
        let absolute = format!("{escape}/secret");
        let absolute = [("h", tar::EntryType::Link, absolute.as_str(), &b""[..])];
        for (i, entries) in [&through_symlink[..], &dotdot, &absolute]
            .iter()
            .enumerate()
        {
            let vol = d.path().join(format!("vol{i}/_data"));
            let restored = restore(&tar_with(entries), &vol);
            assert_eq!(
                std::fs::metadata(&secret).unwrap().nlink(),
                1,
                "case {i}: the file outside gained a link ({restored:?})"
            );
            assert!(restored.is_err(), "case {i}: {restored:?}");
            assert!(!vol.exists(), "case {i}: a failed restore leaves nothing");
        }
        assert_eq!(std::fs::read(&secret).unwrap(), b"host file");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
    }

    #[test]
    fn a_failed_restore_leaves_the_volume_untouched() {
        let d = tempfile::tempdir().unwrap();
        let vol = d.path().join("_data");
        std::fs::create_dir(&vol).unwrap();
        std::fs::write(vol.join("keep"), "old").unwrap();
        let mut tar = tar_with(&[("a", tar::EntryType::Regular, "", &[1u8; 2000])]);
        tar.truncate(1024); // cut inside the file's data
        let staging = Staging::create(&vol, "x").unwrap();
        assert!(extract(&tar[..], staging.dir().unwrap(), &mut |_| {}).is_err());
        drop(staging);
        assert_eq!(std::fs::read(vol.join("keep")).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }
}
