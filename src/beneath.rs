//! File operations relative to a directory handle that cannot leave it.
//!
//! A tree another party controls (an image's rootfs, a volume a container
//! writes to) can swap any path component for a symlink or a FIFO at any
//! moment. So nothing here resolves a path twice or follows a link out:
//! paths are opened with `openat2` (`RESOLVE_BENEATH` or `RESOLVE_IN_ROOT`,
//! never through magic links like `/proc/self/root`), and trees are walked
//! with `*at` calls on directory handles (`O_NOFOLLOW`, `AT_SYMLINK_NOFOLLOW`)
//! and entries created with `O_EXCL`, so a link planted meanwhile is met as
//! an error, never written through.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{FileStat, Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;

/// Deeper trees than this are refused: a hostile image must not exhaust
/// the stack.
const MAX_DEPTH: usize = 256;

fn io_err(e: Errno) -> io::Error {
    io::Error::from(e)
}

/// Opens a directory the agent itself names (a mount point, a volume root).
pub fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    nix::fcntl::open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::empty(),
    )
    .map_err(io_err)
}

/// `request` read as an absolute path (`/a` and `a` are the same, `..`
/// stops at the top), relative to the directory it is opened under.
pub fn clean(request: &str) -> PathBuf {
    let mut out = PathBuf::new();
    for part in Path::new(request).components() {
        match part {
            Component::Normal(p) => out.push(p),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

fn dot_if_empty(rel: &Path) -> &Path {
    if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    }
}

/// Opens `rel` under `dir`; the kernel refuses (EXDEV) any resolution that
/// would leave it, through `..` or an absolute or escaping symlink.
pub fn open_beneath(dir: BorrowedFd<'_>, rel: &Path, flags: OFlag) -> io::Result<OwnedFd> {
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    nix::fcntl::openat2(dir, dot_if_empty(rel), how).map_err(io_err)
}

/// Opens, for reading, the very inode `handle` (an `O_PATH` handle, checked
/// through it) refers to, through `/proc/self/fd`: never a node swapped in
/// at its name since. `O_NOCTTY`: a terminal never becomes ours.
pub fn reopen_for_reading(handle: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let path = PathBuf::from(format!("/proc/self/fd/{}", handle.as_raw_fd()));
    nix::fcntl::open(
        &path,
        OFlag::O_RDONLY | OFlag::O_NOCTTY | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_err)
}

/// Opens `path` as if `root` were `/`: absolute symlinks and `..` resolve
/// inside it, as they would inside the container.
pub fn open_in_root(root: BorrowedFd<'_>, path: &Path, flags: OFlag) -> io::Result<OwnedFd> {
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    nix::fcntl::openat2(root, dot_if_empty(path), how).map_err(io_err)
}

/// The names in a directory (no `.` and `..`), in the order read.
pub fn names(dir: BorrowedFd<'_>) -> io::Result<Vec<OsString>> {
    let mut out = Vec::new();
    each_name(dir, |name| {
        out.push(name.to_owned());
        true
    })?;
    Ok(out)
}

/// Calls `f` with each name in a directory until it returns `false`.
pub fn each_name(dir: BorrowedFd<'_>, mut f: impl FnMut(&OsStr) -> bool) -> io::Result<()> {
    // A fresh handle: the directory stream owns its own read position.
    let own = open_beneath(dir, Path::new("."), OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
    let mut stream = nix::dir::Dir::from_fd(own).map_err(io_err)?;
    for entry in stream.iter() {
        let entry = entry.map_err(io_err)?;
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        if name == "." || name == ".." {
            continue;
        }
        if !f(name) {
            break;
        }
    }
    Ok(())
}

/// `lstat` of one entry of `dir`.
pub fn stat_entry(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<FileStat> {
    nix::sys::stat::fstatat(dir, name, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(io_err)
}

pub fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT
}

/// Copies the contents of directory `from` into the empty directory `to`,
/// with modes (setuid, setgid and sticky included), owners, mtimes and
/// symlinks as links; devices, sockets and FIFOs are skipped (a volume holds
/// data). `to` itself takes `from`'s owner, mode and mtime.
pub fn copy_tree(from: BorrowedFd<'_>, to: BorrowedFd<'_>) -> io::Result<()> {
    copy_dir(from, to, 0)?;
    let st = nix::sys::stat::fstat(from).map_err(io_err)?;
    set_meta(to, &st)
}

fn copy_dir(from: BorrowedFd<'_>, to: BorrowedFd<'_>, depth: usize) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Err(io::Error::other(format!(
            "more than {MAX_DEPTH} nested directories"
        )));
    }
    for name in names(from)? {
        let st = stat_entry(from, &name)?;
        let k = kind(&st);
        if k == SFlag::S_IFDIR {
            nix::sys::stat::mkdirat(to, name.as_os_str(), Mode::from_bits_truncate(0o700))
                .map_err(io_err)?;
            let src = open_child(from, &name, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
            let dst = open_child(to, &name, OFlag::O_RDONLY | OFlag::O_DIRECTORY)?;
            copy_dir(src.as_fd(), dst.as_fd(), depth + 1)?;
            set_meta(dst.as_fd(), &st)?;
        } else if k == SFlag::S_IFREG {
            let src = open_child(from, &name, OFlag::O_RDONLY | OFlag::O_NONBLOCK)?;
            let dst = nix::fcntl::openat(
                to,
                name.as_os_str(),
                OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(0o600),
            )
            .map_err(io_err)?;
            let (mut src, mut dst) = (File::from(src), File::from(dst));
            io::copy(&mut src, &mut dst)?;
            set_meta(dst.as_fd(), &st)?;
        } else if k == SFlag::S_IFLNK {
            let target = nix::fcntl::readlinkat(from, name.as_os_str()).map_err(io_err)?;
            nix::unistd::symlinkat(target.as_os_str(), to, name.as_os_str()).map_err(io_err)?;
            nix::unistd::fchownat(
                to,
                name.as_os_str(),
                Some(st.st_uid.into()),
                Some(st.st_gid.into()),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(io_err)?;
            let (atime, mtime) = times(&st);
            nix::sys::stat::utimensat(
                to,
                name.as_os_str(),
                &atime,
                &mtime,
                UtimensatFlags::NoFollowSymlink,
            )
            .map_err(io_err)?;
        }
    }
    Ok(())
}

/// One entry of `dir`, never through a link.
fn open_child(dir: BorrowedFd<'_>, name: &OsStr, flags: OFlag) -> io::Result<OwnedFd> {
    nix::fcntl::openat(
        dir,
        name,
        flags | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io_err)
}

fn times(st: &FileStat) -> (TimeSpec, TimeSpec) {
    (
        TimeSpec::new(st.st_atime, st.st_atime_nsec),
        TimeSpec::new(st.st_mtime, st.st_mtime_nsec),
    )
}

/// Owner, then mode (a chown clears setuid and setgid), then times.
fn set_meta(fd: BorrowedFd<'_>, st: &FileStat) -> io::Result<()> {
    nix::unistd::fchown(fd, Some(st.st_uid.into()), Some(st.st_gid.into())).map_err(io_err)?;
    nix::sys::stat::fchmod(fd, Mode::from_bits_truncate(st.st_mode & 0o7777)).map_err(io_err)?;
    let (atime, mtime) = times(st);
    nix::sys::stat::futimens(fd, &atime, &mtime).map_err(io_err)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    #[test]
    fn paths_clean_like_an_absolute_path() {
        assert_eq!(clean(""), PathBuf::new());
        assert_eq!(clean("/"), PathBuf::new());
        assert_eq!(clean("../../a/./b/../c"), PathBuf::from("a/c"));
        assert_eq!(clean("/x/../../y"), PathBuf::from("y"));
    }

    #[test]
    fn nothing_is_opened_outside_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::fs::write(dir.path().join("secret"), "no").unwrap();
        std::fs::write(root.join("a/f"), "yes").unwrap();
        std::os::unix::fs::symlink(dir.path().join("secret"), root.join("abs")).unwrap();
        std::os::unix::fs::symlink("../secret", root.join("rel")).unwrap();
        std::os::unix::fs::symlink("a/f", root.join("inside")).unwrap();
        let fd = open_dir(&root).unwrap();
        let read = |p: &str| {
            open_beneath(fd.as_fd(), Path::new(p), OFlag::O_RDONLY)
                .map(|f| std::io::read_to_string(File::from(f)).unwrap())
                .map_err(|e| e.raw_os_error())
        };
        assert_eq!(read("a/f").unwrap(), "yes");
        assert_eq!(read("inside").unwrap(), "yes");
        for escape in ["abs", "rel", "../secret", "/etc/passwd"] {
            assert_eq!(read(escape), Err(Some(nix::libc::EXDEV)), "{escape}");
        }
        // In-root resolution reads the absolute link inside the root instead.
        std::os::unix::fs::symlink("/a/f", root.join("rooted")).unwrap();
        let f = open_in_root(fd.as_fd(), Path::new("/rooted"), OFlag::O_RDONLY).unwrap();
        assert_eq!(std::io::read_to_string(File::from(f)).unwrap(), "yes");
        assert!(open_in_root(fd.as_fd(), Path::new("/abs"), OFlag::O_RDONLY).is_err());
    }

    #[test]
    fn trees_copy_with_modes_links_and_times() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        std::fs::create_dir(src.path().join("sub")).unwrap();
        std::fs::write(src.path().join("sub/a.txt"), "a").unwrap();
        std::fs::write(src.path().join("suid"), "s").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", src.path().join("link")).unwrap();
        std::fs::set_permissions(
            src.path().join("suid"),
            std::fs::Permissions::from_mode(0o4755),
        )
        .unwrap();
        std::fs::set_permissions(src.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
        let (s, d) = (open_dir(src.path()).unwrap(), open_dir(dst.path()).unwrap());
        copy_tree(s.as_fd(), d.as_fd()).unwrap();
        assert_eq!(
            std::fs::read_to_string(dst.path().join("sub/a.txt")).unwrap(),
            "a"
        );
        // The link is copied as a link, never followed.
        assert_eq!(
            std::fs::read_link(dst.path().join("link")).unwrap(),
            Path::new("/etc/passwd")
        );
        let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&dst.path().join("suid")), 0o4755);
        assert_eq!(mode(dst.path()), 0o1777);
        let mtime = |p: &Path| std::fs::metadata(p).unwrap().mtime();
        assert_eq!(
            mtime(&dst.path().join("sub/a.txt")),
            mtime(&src.path().join("sub/a.txt"))
        );
    }

    #[test]
    fn a_planted_entry_is_never_written_through() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(src.path().join("f"), "image").unwrap();
        // Someone plants a link where the copy would write.
        std::os::unix::fs::symlink(outside.path().join("victim"), dst.path().join("f")).unwrap();
        let (s, d) = (open_dir(src.path()).unwrap(), open_dir(dst.path()).unwrap());
        assert!(copy_tree(s.as_fd(), d.as_fd()).is_err());
        assert!(!outside.path().join("victim").exists());
    }
}
