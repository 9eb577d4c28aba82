//! The deterministic PAX tar of a live volume (SNAP-3), written straight
//! into the chunker: nothing is staged on disk.
//!
//! Every path under the root (not the root itself) in byte order of the
//! whole relative path (`a.txt` before `a/b`), headers as Go's
//! `archive/tar` writes them for the reference (USTAR blocks, a PAX record
//! only for what USTAR cannot hold), so unchanged data dedups against the
//! reference's snapshots. The walk never follows a symlink: each directory
//! is opened `O_NOFOLLOW` relative to its parent's descriptor, so a
//! workload that swaps a directory for a link mid-walk cannot make the
//! snapshot read outside the volume.
//!
//! Differences from the reference (the Rewrite notes): sockets and other
//! unsupported types are skipped with a warning; a file that vanishes or
//! changes size while read is handled like GNU tar ("file changed as we
//! read it": exactly the header's size, zero-padded or cut, a warning);
//! hard links are stored as links to their first path.
//!
//! Memory: one 64 KiB read buffer, the sorted names of the directories on
//! the current path, and the first path of each multiply-linked inode.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{AtFlags, FileType, Mode, OFlags, Stat};
use rustix::io::Errno;
use sha2::{Digest, Sha256};

use super::error::SnapshotError;

pub const BLOCK: usize = 512;
const READ_BUF: usize = 64 * 1024;

/// What a finished walk wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TarSummary {
    pub bytes: u64,
    pub entries: u64,
    pub warnings: u64,
    /// SHA-256 over every header written plus each entry's device, inode
    /// and nanosecond mtime and ctime: two walks with the same fingerprint
    /// and no change since the first one's start wrote the same tar.
    pub fingerprint: [u8; 32],
    /// The newest ctime seen, in nanoseconds since the epoch.
    pub newest_ctime_ns: i64,
}

/// A tar header's fields, as Go's `tar.Header` holds them.
#[derive(Debug, Clone, Default)]
pub struct Header {
    pub name: Vec<u8>,
    pub typeflag: u8,
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub size: u64,
    pub mtime: i64,
    pub linkname: Vec<u8>,
    pub uname: String,
    pub gname: String,
    pub devmajor: u64,
    pub devminor: u64,
}

pub const TYPE_REG: u8 = b'0';
pub const TYPE_LINK: u8 = b'1';
pub const TYPE_SYMLINK: u8 = b'2';
pub const TYPE_CHAR: u8 = b'3';
pub const TYPE_BLOCK: u8 = b'4';
pub const TYPE_DIR: u8 = b'5';
pub const TYPE_FIFO: u8 = b'6';
const TYPE_PAX: u8 = b'x';

fn fits_octal(field: usize, x: i128) -> bool {
    x >= 0 && (field >= 22 || x < 1i128 << ((field - 1) * 3))
}

/// Go's `formatter.formatOctal`: zero-padded, NUL-terminated; 0 when the
/// value does not fit (a PAX record carries it then).
fn put_octal(b: &mut [u8], x: i128) {
    let x = if fits_octal(b.len(), x) { x } else { 0 };
    let digits = format!("{x:o}");
    let width = b.len() - 1;
    let s = if digits.len() < width {
        format!("{}{digits}", "0".repeat(width - digits.len()))
    } else {
        digits
    };
    put_str(b, s.as_bytes());
}

/// Go's `formatter.formatString`: truncated to the field, NUL after when
/// shorter.
fn put_str(b: &mut [u8], s: &[u8]) {
    let n = s.len().min(b.len());
    b[..n].copy_from_slice(&s[..n]);
    if n < b.len() {
        b[n] = 0;
    }
}

fn ascii_only(s: &[u8]) -> Vec<u8> {
    s.iter().copied().filter(u8::is_ascii).collect()
}

/// Go's `splitUSTARPath`: a long ASCII name as prefix (155) / name (100).
fn split_ustar(name: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut length = name.len();
    if length <= 100 || !name.is_ascii() {
        return None;
    } else if length > 156 {
        length = 156;
    } else if name[length - 1] == b'/' {
        length -= 1;
    }
    let i = name[..length].iter().rposition(|&c| c == b'/')?;
    let nlen = name.len() - i - 1;
    if i == 0 || nlen > 100 || nlen == 0 || i > 155 {
        return None;
    }
    Some((&name[..i], &name[i + 1..]))
}

fn pax_record(k: &str, v: &[u8]) -> Vec<u8> {
    let mut size = k.len() + v.len() + 3;
    size += size.to_string().len();
    let mut rec = format!("{size} {k}=").into_bytes();
    rec.extend_from_slice(v);
    rec.push(b'\n');
    if rec.len() != size {
        let size = rec.len();
        rec = format!("{size} {k}=").into_bytes();
        rec.extend_from_slice(v);
        rec.push(b'\n');
    }
    rec
}

fn checksum(blk: &mut [u8; BLOCK]) {
    blk[148..156].fill(b' ');
    let sum: u32 = blk.iter().map(|&b| u32::from(b)).sum();
    put_octal(&mut blk[148..155], i128::from(sum));
    blk[155] = b' ';
}

fn set_ustar_magic(blk: &mut [u8; BLOCK]) {
    blk[257..263].copy_from_slice(b"ustar\0");
    blk[263..265].copy_from_slice(b"00");
}

/// Go's `templateV7Plus` without the prefix.
fn main_block(h: &Header, name: &[u8], pax: bool) -> [u8; BLOCK] {
    let mut blk = [0u8; BLOCK];
    let s = |b: &mut [u8], v: &[u8]| {
        if pax {
            put_str(b, &ascii_only(v));
        } else {
            put_str(b, v);
        }
    };
    s(&mut blk[0..100], name);
    put_octal(&mut blk[100..108], i128::from(h.mode));
    put_octal(&mut blk[108..116], i128::from(h.uid));
    put_octal(&mut blk[116..124], i128::from(h.gid));
    put_octal(&mut blk[124..136], i128::from(h.size));
    put_octal(&mut blk[136..148], i128::from(h.mtime));
    blk[156] = h.typeflag;
    s(&mut blk[157..257], &h.linkname);
    s(&mut blk[265..297], h.uname.as_bytes());
    s(&mut blk[297..329], h.gname.as_bytes());
    put_octal(&mut blk[329..337], i128::from(h.devmajor));
    put_octal(&mut blk[337..345], i128::from(h.devminor));
    blk
}

/// The bytes Go's `tar.Writer.WriteHeader` writes for `h`.
pub fn encode_header(h: &Header) -> Vec<u8> {
    let long = |s: &[u8], n: usize| s.len() > n || !s.is_ascii();
    let mut pax: BTreeMap<&str, Vec<u8>> = BTreeMap::new();
    let mut no_ustar = false;
    if long(&h.name, 100) {
        pax.insert("path", h.name.clone());
        no_ustar |= split_ustar(&h.name).is_none();
    }
    for (key, value, n) in [
        ("linkpath", &h.linkname[..], 100),
        ("uname", h.uname.as_bytes(), 32),
        ("gname", h.gname.as_bytes(), 32),
    ] {
        if long(value, n) {
            pax.insert(key, value.to_vec());
            no_ustar = true;
        }
    }
    for (key, value, n) in [("uid", h.uid, 8), ("gid", h.gid, 8), ("size", h.size, 12)] {
        if !fits_octal(n, i128::from(value)) {
            pax.insert(key, value.to_string().into_bytes());
            no_ustar = true;
        }
    }
    if !fits_octal(12, i128::from(h.mtime)) {
        pax.insert("mtime", h.mtime.to_string().into_bytes());
        no_ustar = true;
    }

    let mut out = Vec::with_capacity(3 * BLOCK);
    if !no_ustar {
        let (prefix, name) = split_ustar(&h.name).unwrap_or((&[], &h.name));
        let mut blk = main_block(h, name, false);
        put_str(&mut blk[345..500], prefix);
        set_ustar_magic(&mut blk);
        checksum(&mut blk);
        out.extend_from_slice(&blk);
        return out;
    }

    // The extended header: `dir/PaxHeaders.0/file`, as Go names it.
    let data: Vec<u8> = pax.iter().flat_map(|(k, v)| pax_record(k, v)).collect();
    let (dir, file) = match h.name.iter().rposition(|&c| c == b'/') {
        Some(i) => (&h.name[..=i], &h.name[i + 1..]),
        None => (&[][..], &h.name[..]),
    };
    let mut xname = Vec::new();
    for part in [dir, b"PaxHeaders.0", file] {
        let part: &[u8] = if part.ends_with(b"/") {
            &part[..part.len() - 1]
        } else {
            part
        };
        if part.is_empty() {
            continue;
        }
        if !xname.is_empty() {
            xname.push(b'/');
        }
        xname.extend_from_slice(part);
    }
    let mut xname = ascii_only(&xname);
    xname.truncate(100);
    while xname.last() == Some(&b'/') {
        xname.pop();
    }
    let mut xblk = [0u8; BLOCK];
    put_str(&mut xblk[0..100], &xname);
    put_octal(&mut xblk[100..108], 0);
    put_octal(&mut xblk[108..116], 0);
    put_octal(&mut xblk[116..124], 0);
    put_octal(&mut xblk[124..136], data.len() as i128);
    put_octal(&mut xblk[136..148], 0);
    xblk[156] = TYPE_PAX;
    set_ustar_magic(&mut xblk);
    checksum(&mut xblk);
    out.extend_from_slice(&xblk);
    out.extend_from_slice(&data);
    out.resize(out.len().next_multiple_of(BLOCK), 0);

    let mut blk = main_block(h, &h.name, true);
    set_ustar_magic(&mut blk);
    checksum(&mut blk);
    out.extend_from_slice(&blk);
    out
}

/// One directory on the walk's current path.
struct Level {
    fd: OwnedFd,
    /// Its relative path with a trailing `/` (empty for the root).
    prefix: Vec<u8>,
    /// `name` (the entry) and `name/` (a directory's contents), sorted.
    keys: Vec<Vec<u8>>,
    next: usize,
}

fn dir_keys(fd: &OwnedFd) -> Result<Vec<Vec<u8>>, Errno> {
    let mut keys = Vec::new();
    for entry in rustix::fs::Dir::read_from(fd)? {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name == b"." || name == b".." {
            continue;
        }
        let is_dir = match entry.file_type() {
            FileType::Directory => true,
            FileType::Unknown => rustix::fs::statat(fd, name, AtFlags::SYMLINK_NOFOLLOW)
                .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory),
            _ => false,
        };
        if is_dir {
            let mut d = name.to_vec();
            d.push(b'/');
            keys.push(d);
        }
        keys.push(name.to_vec());
    }
    keys.sort_unstable();
    Ok(keys)
}

fn open_dir_nofollow(dir: &OwnedFd, name: &[u8]) -> Result<OwnedFd, Errno> {
    rustix::fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

fn shown(rel: &[u8]) -> String {
    String::from_utf8_lossy(rel).into_owned()
}

/// The walk's state besides the directory stack.
struct Writer<'w, W: Write> {
    out: &'w mut W,
    warn: &'w mut dyn FnMut(String),
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
    links: HashMap<(u64, u64), Vec<u8>>,
    summary: TarSummary,
    buf: Vec<u8>,
    fingerprint: Sha256,
    /// Metadata only: headers are computed, no file is opened or read.
    dry: bool,
}

impl<W: Write> Writer<'_, W> {
    fn write(&mut self, bytes: &[u8]) -> Result<(), SnapshotError> {
        self.out.write_all(bytes).map_err(SnapshotError::Sink)?;
        self.summary.bytes += bytes.len() as u64;
        Ok(())
    }

    fn warning(&mut self, text: String) {
        self.summary.warnings += 1;
        (self.warn)(text);
    }

    fn uname(&mut self, uid: u32) -> String {
        self.users
            .entry(uid)
            .or_insert_with(|| {
                nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid))
                    .ok()
                    .flatten()
                    .map(|u| u.name)
                    .unwrap_or_default()
            })
            .clone()
    }

    fn gname(&mut self, gid: u32) -> String {
        self.groups
            .entry(gid)
            .or_insert_with(|| {
                nix::unistd::Group::from_gid(nix::unistd::Gid::from_raw(gid))
                    .ok()
                    .flatten()
                    .map(|g| g.name)
                    .unwrap_or_default()
            })
            .clone()
    }

    fn header_of(&mut self, rel: &[u8], st: &Stat, typeflag: u8) -> Header {
        let mut name = rel.to_vec();
        if typeflag == TYPE_DIR {
            name.push(b'/');
        }
        let (devmajor, devminor) = if matches!(typeflag, TYPE_CHAR | TYPE_BLOCK) {
            (
                u64::from(rustix::fs::major(st.st_rdev)),
                u64::from(rustix::fs::minor(st.st_rdev)),
            )
        } else {
            (0, 0)
        };
        Header {
            name,
            typeflag,
            mode: st.st_mode & 0o7777,
            uid: u64::from(st.st_uid),
            gid: u64::from(st.st_gid),
            size: 0,
            mtime: st.st_mtime,
            linkname: Vec::new(),
            uname: self.uname(st.st_uid),
            gname: self.gname(st.st_gid),
            devmajor,
            devminor,
        }
    }

    fn emit(&mut self, h: &Header, st: &Stat) -> Result<(), SnapshotError> {
        let bytes = encode_header(h);
        self.fingerprint.update(&bytes);
        for v in [st.st_dev, st.st_ino] {
            self.fingerprint.update(v.to_le_bytes());
        }
        let nsec = |n| i64::try_from(n).unwrap_or(0);
        for v in [
            st.st_mtime,
            nsec(st.st_mtime_nsec),
            st.st_ctime,
            nsec(st.st_ctime_nsec),
        ] {
            self.fingerprint.update(v.to_le_bytes());
        }
        let ctime = st
            .st_ctime
            .saturating_mul(1_000_000_000)
            .saturating_add(nsec(st.st_ctime_nsec));
        self.summary.newest_ctime_ns = self.summary.newest_ctime_ns.max(ctime);
        if self.dry {
            self.summary.bytes += bytes.len() as u64;
        } else {
            self.write(&bytes)?;
        }
        self.summary.entries += 1;
        Ok(())
    }

    /// One entry of directory `dir`, named `name`, at `rel`.
    fn entry(&mut self, dir: &OwnedFd, name: &[u8], rel: &[u8]) -> Result<(), SnapshotError> {
        let fail = |source: Errno| SnapshotError::Walk {
            path: shown(rel),
            source: source.into(),
        };
        let st = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => {
                self.warning(format!(
                    "{}: file removed before we read it; skipped",
                    shown(rel)
                ));
                return Ok(());
            }
            Err(e) => return Err(fail(e)),
        };
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => {
                let h = self.header_of(rel, &st, TYPE_DIR);
                self.emit(&h, &st)
            }
            FileType::Symlink => {
                let target = match rustix::fs::readlinkat(dir, name, Vec::new()) {
                    Ok(t) => t.into_bytes(),
                    Err(Errno::NOENT | Errno::INVAL) => {
                        self.warning(format!(
                            "{}: link changed before we read it; skipped",
                            shown(rel)
                        ));
                        return Ok(());
                    }
                    Err(e) => return Err(fail(e)),
                };
                let mut h = self.header_of(rel, &st, TYPE_SYMLINK);
                h.linkname = target;
                self.emit(&h, &st)
            }
            FileType::RegularFile => self.regular(dir, name, rel, &st),
            FileType::CharacterDevice => {
                let h = self.header_of(rel, &st, TYPE_CHAR);
                self.emit(&h, &st)
            }
            FileType::BlockDevice => {
                let h = self.header_of(rel, &st, TYPE_BLOCK);
                self.emit(&h, &st)
            }
            FileType::Fifo => {
                let h = self.header_of(rel, &st, TYPE_FIFO);
                self.emit(&h, &st)
            }
            FileType::Socket | FileType::Unknown => {
                self.warning(format!(
                    "{}: a socket or unsupported file type; skipped",
                    shown(rel)
                ));
                Ok(())
            }
        }
    }

    fn regular(
        &mut self,
        dir: &OwnedFd,
        name: &[u8],
        rel: &[u8],
        st: &Stat,
    ) -> Result<(), SnapshotError> {
        let fail = |source: std::io::Error| SnapshotError::Walk {
            path: shown(rel),
            source,
        };
        if let Some(first) = (st.st_nlink > 1)
            .then(|| self.links.get(&(st.st_dev, st.st_ino)).cloned())
            .flatten()
        {
            let mut h = self.header_of(rel, st, TYPE_LINK);
            h.linkname = first;
            return self.emit(&h, st);
        }
        if self.dry {
            // The header the full walk makes from its fstat of the same inode.
            if st.st_nlink > 1 {
                self.links.insert((st.st_dev, st.st_ino), rel.to_vec());
            }
            let mut h = self.header_of(rel, st, TYPE_REG);
            h.size = u64::try_from(st.st_size).unwrap_or(0);
            self.emit(&h, st)?;
            self.summary.bytes += h.size.next_multiple_of(BLOCK as u64);
            return Ok(());
        }
        // Found without following and without opening (O_PATH): a file
        // swapped since the stat for a link is never read through, and for
        // a device node a container planted is never opened as host root.
        let handle = match rustix::fs::openat(
            dir,
            name,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(Errno::NOENT | Errno::LOOP | Errno::NXIO) => {
                self.warning(format!(
                    "{}: file removed before we read it; skipped",
                    shown(rel)
                ));
                return Ok(());
            }
            Err(e) => return Err(fail(e.into())),
        };
        let st = rustix::fs::fstat(&handle).map_err(|e| fail(e.into()))?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            self.warning(format!("{}: changed type while read; skipped", shown(rel)));
            return Ok(());
        }
        let fd =
            crate::beneath::reopen_for_reading(std::os::fd::AsFd::as_fd(&handle)).map_err(fail)?;
        if st.st_nlink > 1 {
            self.links.insert((st.st_dev, st.st_ino), rel.to_vec());
        }
        let mut h = self.header_of(rel, &st, TYPE_REG);
        let size = u64::try_from(st.st_size).unwrap_or(0);
        h.size = size;
        self.emit(&h, &st)?;

        let mut file = std::fs::File::from(fd);
        let mut left = size;
        let mut buf = std::mem::take(&mut self.buf);
        buf.resize(READ_BUF, 0);
        while left > 0 {
            let want = usize::try_from(left.min(READ_BUF as u64)).unwrap_or(READ_BUF);
            let n = match file.read(&mut buf[..want]) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(fail(e)),
            };
            if n == 0 {
                break;
            }
            self.write(&buf[..n])?;
            left -= n as u64;
        }
        if left > 0 {
            self.warning(format!(
                "{}: file changed as we read it (shrank by {left} bytes); padded with zeros",
                shown(rel)
            ));
            buf.fill(0);
            while left > 0 {
                let n = usize::try_from(left.min(READ_BUF as u64)).unwrap_or(READ_BUF);
                self.write(&buf[..n])?;
                left -= n as u64;
            }
        } else {
            let grew = matches!(file.read(&mut buf[..1]), Ok(n) if n > 0);
            let after = rustix::fs::fstat(&file).ok();
            let changed = after.is_some_and(|a| {
                a.st_size != st.st_size
                    || a.st_mtime != st.st_mtime
                    || a.st_mtime_nsec != st.st_mtime_nsec
            });
            if grew || changed {
                self.warning(format!(
                    "{}: file changed as we read it; stored as {size} bytes",
                    shown(rel)
                ));
            }
        }
        self.buf = buf;
        let pad = usize::try_from(size.next_multiple_of(BLOCK as u64) - size).unwrap_or(0);
        if pad > 0 {
            self.write(&[0u8; BLOCK][..pad])?;
        }
        Ok(())
    }
}

/// Writes the deterministic tar of the tree under `root` into `out`;
/// warnings (skipped or changed files) go to `warn`.
pub fn write_tree<W: Write>(
    root: &Path,
    out: &mut W,
    warn: &mut dyn FnMut(String),
) -> Result<TarSummary, SnapshotError> {
    walk(root, out, warn, false)
}

/// The summary `write_tree` would give, from metadata alone: no file is
/// opened or read.
pub fn scan_tree(root: &Path, warn: &mut dyn FnMut(String)) -> Result<TarSummary, SnapshotError> {
    walk(root, &mut std::io::sink(), warn, true)
}

fn walk<W: Write>(
    root: &Path,
    out: &mut W,
    warn: &mut dyn FnMut(String),
    dry: bool,
) -> Result<TarSummary, SnapshotError> {
    let root_fd = rustix::fs::open(
        root,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| SnapshotError::Walk {
        path: String::new(),
        source: e.into(),
    })?;
    let keys = dir_keys(&root_fd).map_err(|e| SnapshotError::Walk {
        path: String::new(),
        source: e.into(),
    })?;
    let mut w = Writer {
        out,
        warn,
        users: HashMap::new(),
        groups: HashMap::new(),
        links: HashMap::new(),
        summary: TarSummary::default(),
        buf: Vec::new(),
        fingerprint: Sha256::new(),
        dry,
    };
    let mut stack = vec![Level {
        fd: root_fd,
        prefix: Vec::new(),
        keys,
        next: 0,
    }];
    while let Some(top) = stack.last_mut() {
        let Some(key) = top.keys.get(top.next).cloned() else {
            stack.pop();
            continue;
        };
        top.next += 1;
        let descend = key.ends_with(b"/");
        let name = if descend {
            &key[..key.len() - 1]
        } else {
            &key[..]
        };
        let mut rel = top.prefix.clone();
        rel.extend_from_slice(name);
        if !descend {
            w.entry(&top.fd, name, &rel)?;
            continue;
        }
        let opened = open_dir_nofollow(&top.fd, name).and_then(|fd| Ok((dir_keys(&fd)?, fd)));
        match opened {
            Ok((keys, fd)) => {
                rel.push(b'/');
                stack.push(Level {
                    fd,
                    prefix: rel,
                    keys,
                    next: 0,
                });
            }
            Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => {
                w.warning(format!(
                    "{}: directory changed during the walk; its contents skipped",
                    shown(&rel)
                ));
            }
            Err(e) => {
                return Err(SnapshotError::Walk {
                    path: shown(&rel),
                    source: e.into(),
                });
            }
        }
    }
    if dry {
        w.summary.bytes += 2 * BLOCK as u64;
    } else {
        w.write(&[0u8; 2 * BLOCK])?;
    }
    w.summary.fingerprint = w.fingerprint.finalize().into();
    Ok(w.summary)
}

/// `rel` as a path (for messages and tests).
pub fn rel_path(rel: &[u8]) -> &Path {
    Path::new(OsStr::from_bytes(rel))
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn tar_of(root: &Path) -> (Vec<u8>, Vec<String>) {
        let mut out = Vec::new();
        let mut warnings = Vec::new();
        write_tree(root, &mut out, &mut |w| warnings.push(w)).unwrap();
        (out, warnings)
    }

    fn names(tar: &[u8]) -> Vec<String> {
        let mut a = ::tar::Archive::new(tar);
        a.entries()
            .unwrap()
            .map(|e| String::from_utf8_lossy(&e.unwrap().path_bytes()).into_owned())
            .collect()
    }

    #[test]
    fn order_is_byte_order_of_the_whole_path() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        std::fs::create_dir_all(r.join("a/b")).unwrap();
        std::fs::write(r.join("a.txt"), "x").unwrap();
        std::fs::write(r.join("a/b/c"), "y").unwrap();
        std::fs::write(r.join("a-z"), "").unwrap();
        std::fs::write(r.join("B"), "").unwrap();
        let (tar, warnings) = tar_of(r);
        assert!(warnings.is_empty());
        assert_eq!(names(&tar), ["B", "a/", "a-z", "a.txt", "a/b/", "a/b/c"]);
        assert_eq!(tar.len() % BLOCK, 0);
        assert_eq!(&tar[tar.len() - 1024..], &[0u8; 1024][..]);
    }

    #[test]
    fn a_metadata_scan_predicts_the_walk() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("dir")).unwrap();
        std::fs::write(d.path().join("dir/f"), vec![1u8; 1234]).unwrap();
        std::fs::write(d.path().join("h"), "x").unwrap();
        std::fs::hard_link(d.path().join("h"), d.path().join("h2")).unwrap();
        std::os::unix::fs::symlink("h", d.path().join("l")).unwrap();
        let mut out = Vec::new();
        let full = write_tree(d.path(), &mut out, &mut |_| {}).unwrap();
        let scan = scan_tree(d.path(), &mut |_| {}).unwrap();
        assert_eq!(full, scan);
        assert_eq!(scan.bytes, out.len() as u64);
        std::fs::write(d.path().join("dir/f"), vec![2u8; 1234]).unwrap();
        let after = scan_tree(d.path(), &mut |_| {}).unwrap();
        assert_ne!(
            after.fingerprint, scan.fingerprint,
            "a rewrite changes ctime"
        );
    }

    #[test]
    fn identical_trees_give_identical_tars() {
        let mk = || {
            let d = tempfile::tempdir().unwrap();
            std::fs::create_dir(d.path().join("dir")).unwrap();
            std::fs::write(d.path().join("dir/f"), vec![3u8; 70_000]).unwrap();
            std::os::unix::fs::symlink("dir/f", d.path().join("l")).unwrap();
            for p in ["dir/f", "dir", ""] {
                let t = std::fs::File::open(d.path().join(p)).unwrap();
                t.set_modified(
                    std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000),
                )
                .unwrap();
            }
            let l = d.path().join("l");
            let t = rustix::fs::Timespec {
                tv_sec: 1_700_000_000,
                tv_nsec: 0,
            };
            rustix::fs::utimensat(
                rustix::fs::CWD,
                &l,
                &rustix::fs::Timestamps {
                    last_access: t,
                    last_modification: t,
                },
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .unwrap();
            d
        };
        let (a, b) = (mk(), mk());
        assert_eq!(tar_of(a.path()).0, tar_of(b.path()).0);
    }

    #[test]
    fn headers_are_what_go_writes() {
        let h = Header {
            name: b"dir/file.txt".to_vec(),
            typeflag: TYPE_REG,
            mode: 0o4755,
            uid: 1000,
            gid: 1000,
            size: 5,
            mtime: 1_700_000_000,
            uname: "app".into(),
            gname: "app".into(),
            ..Header::default()
        };
        let b = encode_header(&h);
        assert_eq!(b.len(), 512);
        assert_eq!(&b[100..108], b"0004755\0");
        assert_eq!(&b[124..136], b"00000000005\0");
        assert_eq!(&b[136..148], b"14524770400\0");
        assert_eq!(&b[257..265], b"ustar\x0000");
        assert_eq!(&b[329..345], b"0000000\x000000000\0");
        assert_eq!(b[155], b' ');
        assert_eq!(b[154], 0);
        // A long ASCII path splits into prefix/name; a longer component
        // needs a PAX record, under Go's PaxHeaders.0 name.
        let long = Header {
            name: format!("{}/{}", "d".repeat(120), "f".repeat(20)).into_bytes(),
            ..h.clone()
        };
        let b = encode_header(&long);
        assert_eq!(b.len(), 512);
        assert_eq!(&b[345..465], "d".repeat(120).as_bytes());
        let pax = Header {
            name: format!("dir/{}", "x".repeat(150)).into_bytes(),
            ..h.clone()
        };
        let b = encode_header(&pax);
        assert_eq!(b.len(), 3 * 512);
        assert!(b.starts_with(b"dir/PaxHeaders.0/xxxx"));
        assert_eq!(b[156], b'x');
        let rec = format!("164 path=dir/{}\n", "x".repeat(150));
        assert_eq!(&b[512..512 + rec.len()], rec.as_bytes());
        let mut a = ::tar::Archive::new(&b[..]);
        let mut full = b.clone();
        full.extend_from_slice(&[0u8; 512]);
        full.extend_from_slice(&[0u8; 1024]);
        let mut a2 = ::tar::Archive::new(&full[..]);
        let e = a2.entries().unwrap().next().unwrap().unwrap();
        assert_eq!(e.path_bytes().len(), 154);
        drop(a.entries());
    }

    /// The tree of tests/data/tar/reference.tar: every type the reference
    /// writes (no hard links, no sockets), long and non-ASCII names,
    /// setuid, a nameless owner, fixed mtimes.
    fn go_tree(r: &Path) {
        use std::os::unix::fs::{PermissionsExt, symlink};
        let long_dir = format!("{}/{}", "p".repeat(60), "q".repeat(60));
        for d in ["a", "a/b", "private", &long_dir] {
            std::fs::create_dir_all(r.join(d)).unwrap();
        }
        let files: [(&str, &[u8], u32); 7] = [
            ("a.txt", b"hello\n", 0o644),
            ("a/b/data", &[7u8; 1000], 0o600),
            ("empty", b"", 0o644),
            ("suid", b"#!/bin/sh\n", 0o4755),
            ("h\u{e9}llo.txt", b"unicode", 0o644),
            ("private/owned", b"x", 0o640),
            ("a/b/c", b"y", 0o644),
        ];
        for (name, data, mode) in files {
            std::fs::write(r.join(name), data).unwrap();
            std::fs::set_permissions(r.join(name), std::fs::Permissions::from_mode(mode)).unwrap();
        }
        std::fs::write(r.join(&long_dir).join("f"), "long").unwrap();
        std::fs::write(r.join("a").join("x".repeat(120)), "pax").unwrap();
        symlink("a.txt", r.join("link")).unwrap();
        symlink("x".repeat(110), r.join("longlink")).unwrap();
        for (name, kind, mode, dev) in [
            ("fifo", FileType::Fifo, 0o644, (0, 0)),
            ("null", FileType::CharacterDevice, 0o666, (1, 3)),
        ] {
            rustix::fs::mknodat(
                rustix::fs::CWD,
                r.join(name),
                kind,
                Mode::from_raw_mode(mode),
                rustix::fs::makedev(dev.0, dev.1),
            )
            .unwrap();
        }
        std::fs::set_permissions(r.join("private"), std::fs::Permissions::from_mode(0o700))
            .unwrap();
        let mut all = Vec::new();
        let mut stack = vec![r.to_owned()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() && !p.is_symlink() {
                    stack.push(p.clone());
                }
                all.push(p);
            }
        }
        // Deepest first, so a directory's time is set after its children's.
        all.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
        for p in all {
            let owner = if p.ends_with("owned") { 1234 } else { 0 };
            std::os::unix::fs::lchown(&p, Some(owner), Some(owner + 4444)).unwrap();
            let t = rustix::fs::Timespec {
                tv_sec: 1_700_000_000,
                tv_nsec: 123,
            };
            rustix::fs::utimensat(
                rustix::fs::CWD,
                &p,
                &rustix::fs::Timestamps {
                    last_access: t,
                    last_modification: t,
                },
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .unwrap();
        }
        // chown cleared it.
        std::fs::set_permissions(r.join("suid"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    }

    /// Byte for byte what the reference's Go `archive/tar` writer makes of
    /// the same tree (tests/data/tar/gen.go wrote reference.tar), so
    /// unchanged data dedups against reference-made snapshots.
    #[test]
    fn the_tar_is_what_the_reference_writes() {
        if !zattera_testkit::require_root() {
            return; // owners and device nodes need root
        }
        let d = tempfile::tempdir().unwrap();
        let root = match std::env::var_os("ZT_KEEP_GO_TREE") {
            Some(p) => std::path::PathBuf::from(p),
            None => d.path().join("tree"),
        };
        std::fs::create_dir(&root).unwrap();
        go_tree(&root);
        let want = include_bytes!("../../tests/data/tar/reference.tar");
        let (got, warnings) = tar_of(&root);
        assert!(warnings.is_empty(), "{warnings:?}");
        let blocks = |t: &[u8]| t.chunks(BLOCK).map(<[u8]>::to_vec).collect::<Vec<_>>();
        for (i, (g, w)) in blocks(&got).iter().zip(blocks(want)).enumerate() {
            assert_eq!(
                String::from_utf8_lossy(g),
                String::from_utf8_lossy(&w),
                "block {i}"
            );
        }
        assert_eq!(got.len(), want.len());
    }

    #[test]
    fn hard_links_are_links_and_sockets_are_skipped() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a"), "data").unwrap();
        std::fs::hard_link(d.path().join("a"), d.path().join("b")).unwrap();
        let _sock = std::os::unix::net::UnixListener::bind(d.path().join("s")).unwrap();
        let (tar, warnings) = tar_of(d.path());
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].contains("socket"));
        let mut a = ::tar::Archive::new(&tar[..]);
        let kinds: Vec<(String, ::tar::EntryType, String)> = a
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    String::from_utf8_lossy(&e.path_bytes()).into_owned(),
                    e.header().entry_type(),
                    e.link_name_bytes()
                        .map(|l| String::from_utf8_lossy(&l).into_owned())
                        .unwrap_or_default(),
                )
            })
            .collect();
        assert_eq!(
            kinds,
            [
                ("a".into(), ::tar::EntryType::Regular, String::new()),
                ("b".into(), ::tar::EntryType::Link, "a".into()),
            ]
        );
    }
}
