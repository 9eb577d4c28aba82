//! Unpacks a build context (dataplane.md BLD-3): a gzip-compressed tar
//! into an empty scratch directory, with the Rewrite's limits.
//!
//! Every entry's name must stay inside the destination (an absolute name is
//! taken as relative to it); one that does not fails the whole build before
//! anything of it is written. Regular files count their *declared* size
//! toward [`Limits::max_bytes`] and must carry exactly that many bytes (a
//! short body fails, unlike the reference). Directories are 0755, file
//! modes are masked to 0o777; links, devices and FIFOs are skipped, so no
//! entry can point outside. Entries and decompressed bytes are capped too,
//! which bounds a gzip bomb made of headers.
//!
//! Files and directories keep their modification times (the reference sets
//! none): BuildKit sends only the files whose size, mode or time changed
//! since the last build it cached under the same key, so a rebuild of the
//! same source moves only what changed.
//!
//! GNU long names and PAX headers are read here, not by the tar crate, which
//! reads their bodies whole (up to the decompressed cap, 1 GiB) and copies
//! them into every later message: a body over [`MAX_EXTENSION`] or a name
//! over [`MAX_NAME`] is refused before it is read, and a name quoted in an
//! error is cut to [`SHOWN_NAME`] bytes.

use std::fs::{self, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

/// The longest entry name (Linux's PATH_MAX).
pub const MAX_NAME: u64 = 4096;
/// The largest PAX or GNU extension body: a name and a few records.
pub const MAX_EXTENSION: u64 = 64 << 10;
/// How much of a name an error quotes.
const SHOWN_NAME: usize = 256;

/// The bounds of one context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Sum of the declared sizes of regular files (512 MiB).
    pub max_bytes: u64,
    /// Tar entries of any type.
    pub max_entries: u64,
    /// Bytes out of the gzip stream, headers and padding included.
    pub max_decompressed: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_bytes: 512 << 20,
            max_entries: 100_000,
            max_decompressed: 1 << 30,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    #[error("gzip: {0}")]
    Gzip(io::Error),
    #[error("tar: {0}")]
    Tar(io::Error),
    #[error("unsafe path in context: {0:?}")]
    UnsafePath(String),
    #[error("context exceeds {0} bytes")]
    TooLarge(u64),
    #[error("context has more than {0} entries")]
    TooManyEntries(u64),
    #[error("context decompresses to more than {0} bytes")]
    Bomb(u64),
    #[error("{name:?}: the body ends after {got} of its {declared} bytes")]
    ShortBody {
        name: String,
        got: u64,
        declared: u64,
    },
    #[error("{}: {source}", path.display())]
    Write { path: PathBuf, source: io::Error },
    #[error("a {kind} header of {size} bytes (at most {max})")]
    ExtensionTooLarge {
        kind: &'static str,
        size: u64,
        max: u64,
    },
    #[error("an entry name of {0} bytes (at most {MAX_NAME})")]
    NameTooLong(u64),
}

/// What an unpack wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unpacked {
    pub files: u64,
    pub bytes: u64,
    pub skipped: u64,
}

/// Reads the gzip stream, tagging its faults and stopping past the cap, so
/// a read error inside the tar reader still says where it came from.
struct Decompressed<R> {
    gz: flate2::read::GzDecoder<R>,
    left: u64,
}

#[derive(Debug, thiserror::Error)]
enum StreamFault {
    #[error("{0}")]
    Gzip(io::Error),
    #[error("decompressed size cap reached")]
    Cap,
}

impl<R: Read> Read for Decompressed<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self
            .gz
            .read(buf)
            .map_err(|e| io::Error::other(StreamFault::Gzip(e)))?;
        self.left = self
            .left
            .checked_sub(n as u64)
            .ok_or_else(|| io::Error::other(StreamFault::Cap))?;
        Ok(n)
    }
}

/// The destination-relative path of a tar name, or `None` when it would
/// leave the destination. `/etc/passwd` is `etc/passwd`; `a/../b` is `b`.
pub fn contained(name: &str) -> Option<PathBuf> {
    let mut out = PathBuf::new();
    for part in Path::new(name).components() {
        match part {
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            Component::ParentDir => {
                if !out.pop() {
                    return None;
                }
            }
            Component::Normal(p) => out.push(p),
        }
    }
    Some(out)
}

/// Unpacks `tgz` into `dest` (an existing, empty directory).
pub fn unpack(tgz: impl Read, dest: &Path, limits: Limits) -> Result<Unpacked, UnpackError> {
    let stream = Decompressed {
        gz: flate2::read::GzDecoder::new(tgz),
        left: limits.max_decompressed,
    };
    let mut archive = tar::Archive::new(stream);
    let mut done = Unpacked::default();
    let mut entries_seen = 0u64;
    let mut declared_total = 0u64;
    // The name a GNU `L` or PAX `path` record gives the next entry.
    let mut long_name: Option<Vec<u8>> = None;
    // Set last: every file written into a directory moves its time.
    let mut dir_times = Vec::new();
    let fault = |e: io::Error| stream_error(e, limits);
    for entry in archive.entries().map_err(fault)?.raw(true) {
        let mut entry = entry.map_err(fault)?;
        entries_seen += 1;
        if entries_seen > limits.max_entries {
            return Err(UnpackError::TooManyEntries(limits.max_entries));
        }
        let kind = entry.header().entry_type();
        if let Some(what) = extension_kind(kind) {
            let size = entry.header().size().map_err(UnpackError::Tar)?;
            if size > MAX_EXTENSION {
                return Err(UnpackError::ExtensionTooLarge {
                    kind: what,
                    size,
                    max: MAX_EXTENSION,
                });
            }
            let mut body = Vec::new();
            (&mut entry)
                .take(size)
                .read_to_end(&mut body)
                .map_err(fault)?;
            let named = match kind {
                tar::EntryType::GNULongName => Some(trim_nuls(body)),
                tar::EntryType::XHeader => pax_path(&body),
                // Link targets are never used; global records name nothing.
                _ => None,
            };
            if let Some(n) = named {
                if n.len() as u64 > MAX_NAME {
                    return Err(UnpackError::NameTooLong(n.len() as u64));
                }
                long_name = Some(n);
            }
            continue;
        }
        let name_bytes = long_name
            .take()
            .unwrap_or_else(|| entry.path_bytes().into_owned());
        let name = shown(&name_bytes);
        let rel = contained(&String::from_utf8_lossy(&name_bytes))
            .ok_or_else(|| UnpackError::UnsafePath(name.clone()))?;
        let target = dest.join(&rel);
        let mtime = entry
            .header()
            .mtime()
            .ok()
            .and_then(|secs| SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs)));
        if kind.is_dir() {
            mkdirs(&target)?;
            dir_times.extend(mtime.map(|t| (target.clone(), t)));
        } else if kind.is_file() || kind == tar::EntryType::Continuous {
            let declared = entry.header().size().map_err(UnpackError::Tar)?;
            declared_total = declared_total.saturating_add(declared);
            if declared_total > limits.max_bytes {
                return Err(UnpackError::TooLarge(limits.max_bytes));
            }
            if rel.as_os_str().is_empty() {
                return Err(UnpackError::UnsafePath(name));
            }
            if let Some(parent) = target.parent() {
                mkdirs(parent)?;
            }
            let mode = entry.header().mode().map_err(UnpackError::Tar)? & 0o777;
            let mode = if mode == 0 { 0o644 } else { mode };
            let write = |source| UnpackError::Write {
                path: target.clone(),
                source,
            };
            // An earlier entry of the same name is replaced, never followed.
            let _ = fs::remove_file(&target);
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(mode)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(&target)
                .map_err(write)?;
            let got = io::copy(&mut (&mut entry).take(declared), &mut file).map_err(fault)?;
            if got < declared {
                return Err(UnpackError::ShortBody {
                    name,
                    got,
                    declared,
                });
            }
            // A time that cannot be set costs a cache hit, not the build.
            if let Some(t) = mtime {
                let _ = file.set_modified(t);
            }
            done.files += 1;
            done.bytes += got;
        } else {
            // Symlinks, hard links, devices, FIFOs: skipped (BLD-3).
            done.skipped += 1;
        }
    }
    for (dir, t) in dir_times {
        let _ = fs::File::open(&dir).and_then(|d| d.set_modified(t));
    }
    Ok(done)
}

/// What an extension entry is called in an error, or `None` for an entry
/// that is not one.
fn extension_kind(kind: tar::EntryType) -> Option<&'static str> {
    match kind {
        tar::EntryType::GNULongName => Some("GNU long name"),
        tar::EntryType::GNULongLink => Some("GNU long link"),
        tar::EntryType::XHeader => Some("PAX"),
        tar::EntryType::XGlobalHeader => Some("PAX global"),
        _ => None,
    }
}

/// A GNU long name's body without its trailing NULs.
fn trim_nuls(mut body: Vec<u8>) -> Vec<u8> {
    while body.last() == Some(&0) {
        body.pop();
    }
    body
}

/// The `path` record of a PAX header, if it has one.
fn pax_path(body: &[u8]) -> Option<Vec<u8>> {
    tar::PaxExtensions::new(body)
        .filter_map(Result::ok)
        .filter(|e| e.key() == Ok("path"))
        .last()
        .map(|e| e.value_bytes().to_vec())
}

/// A name as an error quotes it: lossy UTF-8, at most [`SHOWN_NAME`] bytes.
fn shown(name: &[u8]) -> String {
    let cut = name.len().min(SHOWN_NAME);
    let mut text = String::from_utf8_lossy(&name[..cut]).into_owned();
    if name.len() > cut {
        text.push('…');
    }
    text
}

/// A read error: the cap, a gzip fault, or a tar one.
fn stream_error(e: io::Error, limits: Limits) -> UnpackError {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<StreamFault>())
    {
        Some(StreamFault::Cap) => UnpackError::Bomb(limits.max_decompressed),
        Some(StreamFault::Gzip(g)) => UnpackError::Gzip(io::Error::new(g.kind(), g.to_string())),
        None => UnpackError::Tar(e),
    }
}

fn mkdirs(dir: &Path) -> Result<(), UnpackError> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
        .map_err(|source| UnpackError::Write {
            path: dir.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::disallowed_methods)]
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;

    /// A tar.gz of raw headers: (name, type, mode, declared size, body).
    fn tgz(entries: &[(&str, tar::EntryType, u32, u64, &[u8])]) -> Vec<u8> {
        let mut raw = Vec::new();
        for (name, kind, mode, size, body) in entries {
            let mut h = tar::Header::new_gnu();
            // Written by hand: tar's set_path refuses `..`, which is the point.
            let bytes = name.as_bytes();
            h.as_old_mut().name[..bytes.len()].copy_from_slice(bytes);
            h.set_entry_type(*kind);
            h.set_mode(*mode);
            h.set_size(*size);
            h.set_mtime(MTIME);
            if *kind == tar::EntryType::Symlink {
                h.set_link_name("/etc/shadow").unwrap();
            }
            h.set_cksum();
            raw.extend_from_slice(h.as_bytes());
            raw.extend_from_slice(body);
            let pad = (512 - body.len() % 512) % 512;
            raw.extend(std::iter::repeat_n(0u8, pad));
        }
        raw.extend([0u8; 1024]);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&raw).unwrap();
        gz.finish().unwrap()
    }

    const F: tar::EntryType = tar::EntryType::Regular;
    /// Every test entry's modification time.
    const MTIME: u64 = 1_700_000_000;

    fn run(data: &[u8]) -> (tempfile::TempDir, Result<Unpacked, UnpackError>) {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("ctx");
        fs::create_dir(&dest).unwrap();
        let r = unpack(data, &dest, Limits::default());
        (dir, r)
    }

    #[test]
    fn files_and_directories_keep_their_times() {
        let data = tgz(&[
            ("app/", tar::EntryType::Directory, 0o755, 0, b""),
            ("app/main.go", F, 0o644, 13, b"package main\n"),
            ("app/lib/x.go", F, 0o644, 10, b"package x\n"),
        ]);
        let (dir, r) = run(&data);
        r.unwrap();
        let want = SystemTime::UNIX_EPOCH + Duration::from_secs(MTIME);
        let ctx = dir.path().join("ctx");
        for path in ["app", "app/main.go", "app/lib/x.go"] {
            let got = fs::metadata(ctx.join(path)).unwrap().modified().unwrap();
            assert_eq!(got, want, "{path}");
        }
    }

    #[test]
    fn a_context_is_reproduced() {
        let data = tgz(&[
            ("Dockerfile", F, 0o644, 12, b"FROM alpine\n"),
            ("app/", tar::EntryType::Directory, 0o700, 0, b""),
            ("app/main.go", F, 0o755, 13, b"package main\n"),
        ]);
        let (dir, r) = run(&data);
        assert_eq!(r.unwrap().files, 2);
        let ctx = dir.path().join("ctx");
        assert_eq!(fs::read(ctx.join("Dockerfile")).unwrap(), b"FROM alpine\n");
        assert_eq!(
            fs::read(ctx.join("app/main.go")).unwrap(),
            b"package main\n"
        );
        let mode = |p: &str| fs::metadata(ctx.join(p)).unwrap().permissions().mode() & 0o7777;
        assert_eq!(
            mode("app"),
            0o755,
            "directories are 0755 whatever the header says"
        );
        assert_eq!(mode("app/main.go"), 0o755);
    }

    #[test]
    fn escaping_names_fail_the_whole_context_and_write_nothing_outside() {
        // The context sits three levels down, so every name lands inside
        // the temporary directory if it escapes, in a directory that exists.
        for (name, lands) in [
            ("../escape.txt", "a/b/escape.txt"),
            ("dir/../../evil", "a/b/evil"),
            ("../../etc/shadow", "a/etc/shadow"),
            ("../../../evil", "evil"),
        ] {
            let data = tgz(&[("ok.txt", F, 0o644, 2, b"ok"), (name, F, 0o644, 4, b"evil")]);
            let dir = tempfile::tempdir().unwrap();
            let dest = dir.path().join("a/b/ctx");
            fs::create_dir_all(&dest).unwrap();
            fs::create_dir_all(dir.path().join("a/etc")).unwrap();
            let landing = dir.path().join(lands);
            assert_eq!(
                lexical(&dest.join(name)),
                landing,
                "where {name} would land"
            );
            let e = unpack(data.as_slice(), &dest, Limits::default()).unwrap_err();
            assert_eq!(e.to_string(), format!("unsafe path in context: {name:?}"));
            assert!(!landing.exists(), "{name} wrote {}", landing.display());
        }
    }

    /// `a/b/../c` -> `a/c`, without touching the filesystem.
    fn lexical(path: &Path) -> PathBuf {
        let mut out = PathBuf::new();
        for c in path.components() {
            match c {
                Component::ParentDir => {
                    out.pop();
                }
                Component::CurDir => {}
                other => out.push(other),
            }
        }
        out
    }

    #[test]
    fn absolute_names_land_inside() {
        let (dir, r) = run(&tgz(&[("/etc/passwd", F, 0o644, 4, b"root")]));
        r.unwrap();
        assert_eq!(
            fs::read(dir.path().join("ctx/etc/passwd")).unwrap(),
            b"root"
        );
    }

    #[test]
    fn special_bits_are_dropped_and_zero_modes_become_0644() {
        let (dir, r) = run(&tgz(&[
            ("suid", F, 0o6755, 1, b"x"),
            ("zero", F, 0, 1, b"y"),
        ]));
        r.unwrap();
        let mode = |p: &str| {
            fs::metadata(dir.path().join("ctx").join(p))
                .unwrap()
                .permissions()
                .mode()
                & 0o7777
        };
        assert_eq!(mode("suid"), 0o755);
        assert_eq!(mode("zero"), 0o644);
    }

    #[test]
    fn links_and_devices_are_skipped() {
        let (dir, r) = run(&tgz(&[
            ("link", tar::EntryType::Symlink, 0o777, 0, b""),
            ("fifo", tar::EntryType::Fifo, 0o644, 0, b""),
            ("dev", tar::EntryType::Char, 0o644, 0, b""),
        ]));
        assert_eq!(r.unwrap().skipped, 3);
        assert!(fs::symlink_metadata(dir.path().join("ctx/link")).is_err());
        assert!(fs::symlink_metadata(dir.path().join("ctx/dev")).is_err());
    }

    #[test]
    fn a_declared_size_over_the_cap_fails_even_with_a_short_body() {
        let (_dir, r) = run(&tgz(&[("big", F, 0o644, (512 << 20) + 1, b"tiny")]));
        assert_eq!(
            r.unwrap_err().to_string(),
            "context exceeds 536870912 bytes"
        );
    }

    #[test]
    fn a_short_body_fails() {
        // The header says 100 bytes; the stream ends after 10.
        let mut h = tar::Header::new_gnu();
        h.set_path("short.txt").unwrap();
        h.set_size(100);
        h.set_mode(0o644);
        h.set_cksum();
        let mut raw = h.as_bytes().to_vec();
        raw.extend_from_slice(b"0123456789");
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&raw).unwrap();
        let (_dir, r) = run(&gz.finish().unwrap());
        let e = r.unwrap_err();
        assert!(
            matches!(e, UnpackError::ShortBody { .. } | UnpackError::Tar(_)),
            "{e}"
        );
    }

    #[test]
    fn not_gzip_is_a_gzip_error() {
        let (_dir, r) = run(b"PK\x03\x04 this is a zip");
        assert!(r.unwrap_err().to_string().starts_with("gzip: "));
    }

    #[test]
    fn entry_count_and_decompressed_bytes_are_capped() {
        let many: Vec<(String, tar::EntryType, u32, u64, &[u8])> = (0..20)
            .map(|i| {
                (
                    format!("d{i}/"),
                    tar::EntryType::Directory,
                    0o755,
                    0,
                    &b""[..],
                )
            })
            .collect();
        let refs: Vec<_> = many
            .iter()
            .map(|(n, k, m, s, b)| (n.as_str(), *k, *m, *s, *b))
            .collect();
        let data = tgz(&refs);
        let dir = tempfile::tempdir().unwrap();
        let few = Limits {
            max_entries: 10,
            ..Limits::default()
        };
        let e = unpack(&data[..], dir.path(), few).unwrap_err();
        assert_eq!(e.to_string(), "context has more than 10 entries");
        let small = Limits {
            max_decompressed: 4096,
            ..Limits::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let e = unpack(&data[..], dir.path(), small).unwrap_err();
        assert!(matches!(e, UnpackError::Bomb(4096)), "{e}");
    }

    fn gz(raw: &[u8]) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(raw).unwrap();
        gz.finish().unwrap()
    }

    /// One extension entry of `kind` with `body`, then a file `short.txt`.
    fn with_extension(kind: tar::EntryType, body: &[u8]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_ustar();
        h.set_path("././@Ext").unwrap();
        h.set_entry_type(kind);
        h.set_size(body.len() as u64);
        h.set_cksum();
        b.append(&h, body).unwrap();
        let mut f = tar::Header::new_ustar();
        f.set_path("short.txt").unwrap();
        f.set_size(2);
        f.set_mode(0o644);
        f.set_cksum();
        b.append(&f, &b"ok"[..]).unwrap();
        gz(&b.into_inner().unwrap())
    }

    fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
        // "<len> <key>=<value>\n", where len counts itself.
        let rest = key.len() + value.len() + 3;
        let mut len = rest + 1;
        while len.to_string().len() + rest != len {
            len += 1;
        }
        let mut r = format!("{len} {key}=").into_bytes();
        r.extend_from_slice(value);
        r.push(b'\n');
        r
    }

    #[test]
    fn long_gnu_and_pax_names_name_the_next_entry() {
        let long = format!("{}file.txt", format!("{}/", "d".repeat(60)).repeat(5));
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(4);
        h.set_mode(0o644);
        b.append_data(&mut h, &long, &b"long"[..]).unwrap();
        let (dir, r) = run(&gz(&b.into_inner().unwrap()));
        r.unwrap();
        assert_eq!(
            fs::read(dir.path().join("ctx").join(&long)).unwrap(),
            b"long"
        );

        let deep = format!("{}p.txt", format!("{}/", "p".repeat(50)).repeat(4));
        let pax = pax_record("path", deep.as_bytes());
        let (dir, r) = run(&with_extension(tar::EntryType::XHeader, &pax));
        r.unwrap();
        let named = dir.path().join("ctx").join(&deep);
        assert_eq!(
            fs::read(named).unwrap(),
            b"ok",
            "the PAX path replaces the header's"
        );
    }

    /// The tar crate read a PAX or GNU body whole, whatever its size (up to
    /// the 1 GiB decompressed cap), and held and copied it: a 2 MiB PAX
    /// comment unpacked fine on the old code. Now it is refused unread.
    #[test]
    fn oversized_extension_headers_are_refused_before_they_are_read() {
        let comment = pax_record("comment", &vec![b'A'; 2 << 20]);
        let (_dir, r) = run(&with_extension(tar::EntryType::XHeader, &comment));
        let e = r.unwrap_err();
        assert!(
            matches!(
                e,
                UnpackError::ExtensionTooLarge {
                    kind: "PAX",
                    max: MAX_EXTENSION,
                    ..
                }
            ),
            "{e}"
        );
        let (_dir, r) = run(&with_extension(
            tar::EntryType::GNULongName,
            &vec![b'n'; 1 << 20],
        ));
        assert!(matches!(
            r.unwrap_err(),
            UnpackError::ExtensionTooLarge {
                kind: "GNU long name",
                ..
            }
        ));
        let (_dir, r) = run(&with_extension(
            tar::EntryType::GNULongName,
            &vec![b'n'; 8192],
        ));
        assert!(matches!(r.unwrap_err(), UnpackError::NameTooLong(8192)));
    }

    #[test]
    fn an_error_quotes_a_long_name_short() {
        let name = format!("{}evil", "../".repeat(1300));
        let mut long = name.clone().into_bytes();
        long.push(0);
        let (_dir, r) = run(&with_extension(tar::EntryType::GNULongName, &long));
        let text = r.unwrap_err().to_string();
        assert!(
            text.starts_with("unsafe path in context: \"../../"),
            "{text}"
        );
        assert!(text.len() < 300, "{} bytes", text.len());
    }

    #[test]
    fn containment() {
        assert_eq!(contained("a/./b/../c"), Some(PathBuf::from("a/c")));
        assert_eq!(contained("/x"), Some(PathBuf::from("x")));
        assert_eq!(contained("a/../../b"), None);
    }
}
