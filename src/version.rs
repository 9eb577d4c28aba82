//! Which release this binary is: the tag it reports in the hello (what a
//! reference control plane's `zt cluster upgrade` waits for), in `version`
//! and in `--version`.
//!
//! The tag is set when the package is built (`ZATTERA_VERSION`, which
//! `scripts/package.sh` sets), and defaults to the crate's version. It lives
//! in a marked slot of the binary, so a built binary can also be stamped
//! with another tag afterwards ([`stamp`]), as Go's `-X` link flag sets the
//! reference's: a release channel, or a test's, makes the binaries of
//! several releases from one build.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

/// What precedes the tag in the binary.
const MARK: &[u8; 24] = b"\0zattera-release-tag-v1\0";
/// Room for the tag (NUL-padded).
const ROOM: usize = 64;

const fn slot() -> [u8; MARK.len() + ROOM] {
    let tag = match option_env!("ZATTERA_VERSION") {
        Some(t) => t.as_bytes(),
        None => env!("CARGO_PKG_VERSION").as_bytes(),
    };
    assert!(tag.len() < ROOM, "ZATTERA_VERSION is too long");
    let mut out = [0u8; MARK.len() + ROOM];
    let mut i = 0;
    while i < MARK.len() {
        out[i] = MARK[i];
        i += 1;
    }
    let mut j = 0;
    while j < tag.len() {
        out[MARK.len() + j] = tag[j];
        j += 1;
    }
    out
}

/// The tag's home in the binary, read at run time (never folded into the
/// code at compile time, so a stamp takes effect).
#[used]
static SLOT: [u8; MARK.len() + ROOM] = slot();

/// This binary's release tag.
pub fn tag() -> &'static str {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TAG.get_or_init(|| {
        let slot: &[u8] = std::hint::black_box(&SLOT[MARK.len()..]);
        let end = slot.iter().position(|b| *b == 0).unwrap_or(slot.len());
        String::from_utf8_lossy(&slot[..end]).into_owned()
    })
}

#[derive(Debug, thiserror::Error)]
pub enum StampError {
    #[error("{0:?} is not a release tag: 1 to 63 printable ASCII characters, no spaces")]
    BadTag(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error("{}: no release-tag slot (not a zattera-agent built from this source)", .0.display())]
    NoSlot(std::path::PathBuf),
}

/// Whether `tag` can be stamped: printable ASCII without spaces, short
/// enough for the slot.
pub fn valid_tag(tag: &str) -> bool {
    !tag.is_empty() && tag.len() < ROOM && tag.bytes().all(|b| b.is_ascii_graphic())
}

/// Writes `tag` into the release-tag slot of the binary at `path`, in
/// place: the binary then reports `tag`.
pub fn stamp(path: &Path, tag: &str) -> Result<(), StampError> {
    if !valid_tag(tag) {
        return Err(StampError::BadTag(tag.to_owned()));
    }
    let io = |source| StampError::Io {
        path: path.to_owned(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(io)?;
    let at = find_mark(&mut file)
        .map_err(io)?
        .ok_or_else(|| StampError::NoSlot(path.to_owned()))?;
    let mut room = [0u8; ROOM];
    room[..tag.len()].copy_from_slice(tag.as_bytes());
    file.seek(SeekFrom::Start(at + MARK.len() as u64))
        .map_err(io)?;
    file.write_all(&room).map_err(io)?;
    file.sync_all().map_err(io)
}

/// The offset of the mark in `file`, read in chunks (a debug binary is
/// hundreds of MB).
fn find_mark(file: &mut std::fs::File) -> std::io::Result<Option<u64>> {
    const CHUNK: usize = 8 << 20;
    let finder = memchr::memmem::Finder::new(MARK);
    let mut buf = vec![0u8; CHUNK + MARK.len()];
    let (mut base, mut kept) = (0u64, 0usize);
    file.seek(SeekFrom::Start(0))?;
    loop {
        let n = file.read(&mut buf[kept..])?;
        if n == 0 {
            return Ok(None);
        }
        let filled = kept + n;
        if let Some(i) = finder.find(&buf[..filled]) {
            return Ok(Some(base + i as u64));
        }
        // Keep the tail: a mark may straddle two reads.
        let keep = (MARK.len() - 1).min(filled);
        buf.copy_within(filled - keep..filled, 0);
        base += (filled - keep) as u64;
        kept = keep;
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn the_tag_is_the_build_time_one() {
        let want = option_env!("ZATTERA_VERSION").unwrap_or(env!("CARGO_PKG_VERSION"));
        assert_eq!(tag(), want);
    }

    #[test]
    fn a_stamp_replaces_the_tag_where_the_mark_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bin");
        // The mark straddles the first chunk's end.
        let mut bytes = vec![7u8; (8 << 20) - 5];
        bytes.extend_from_slice(&slot());
        bytes.extend_from_slice(b"tail");
        std::fs::write(&path, &bytes).unwrap();
        stamp(&path, "v9.8.7-rc1").unwrap();
        let after = std::fs::read(&path).unwrap();
        let at = (8 << 20) - 5 + MARK.len();
        assert_eq!(&after[at..at + 11], b"v9.8.7-rc1\0");
        assert_eq!(after.len(), bytes.len());
        assert!(after.ends_with(b"tail"));
        assert!(matches!(
            stamp(&path, "has space"),
            Err(StampError::BadTag(_))
        ));
        std::fs::write(&path, b"no slot here").unwrap();
        assert!(matches!(stamp(&path, "v1"), Err(StampError::NoSlot(_))));
    }
}
