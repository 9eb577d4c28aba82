//! The reference agent's log store (dataplane.md LOG-1 to LOG-8, Tier B),
//! read so that a node moved from the reference keeps the output its
//! instances wrote before the move. Nothing here writes that store: this
//! agent's own output goes to the log shim's files ([`super::files`]).
//!
//! A stream is `<data>/logs/<stream>/`, named by the assignment id (LOG-2).
//! It holds closed segments `seg-NNNNNNNN.zst` (with a `.idx` of their time
//! range), maybe a `seg-NNNNNNNN.raw` a crash left mid-rotation, and the
//! open `active.log`. A segment is a run of records: `uvarint(9 + len)`,
//! then `i64` unix nanoseconds (little-endian), a flag byte (bit 0:
//! stderr) and the line (LOG-3). A reader stops quietly at a torn tail.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// Whether `name` is a file the reference's store makes (LOG-1).
fn is_store_file(name: &str) -> bool {
    if name == "active.log" {
        return true;
    }
    let Some(rest) = name.strip_prefix("seg-") else {
        return false;
    };
    let (seq, ext) = rest.split_once('.').unwrap_or((rest, ""));
    seq.len() == 8
        && seq.bytes().all(|b| b.is_ascii_digit())
        && matches!(ext, "zst" | "idx" | "raw" | "zst.tmp" | "idx.tmp")
}

/// Removes each reference stream under `logs` whose newest file is older
/// than `max_age`, as this agent's own output is (the reference never ran
/// its retention, LOG-9). A directory holding anything but the store's own
/// file names is not a stream and is left alone. Returns the files removed
/// and their bytes.
pub fn expire(logs: &Path, max_age: Duration, now: SystemTime) -> (usize, u64) {
    let mut done = (0, 0);
    let Ok(entries) = std::fs::read_dir(logs) else {
        return done;
    };
    for entry in entries.flatten() {
        if !entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let dir = entry.path();
        let Ok(files) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut found = Vec::new();
        let mut newest = SystemTime::UNIX_EPOCH;
        let mut is_stream = true;
        for f in files.flatten() {
            let (Some(name), Ok(meta)) = (f.file_name().to_str().map(str::to_owned), f.metadata())
            else {
                is_stream = false;
                break;
            };
            if !meta.is_file() || !is_store_file(&name) {
                is_stream = false;
                break;
            }
            newest = newest.max(meta.modified().unwrap_or(now));
            found.push((f.path(), meta.len()));
        }
        if !is_stream || found.is_empty() || now.duration_since(newest).is_ok_and(|a| a <= max_age)
        {
            continue;
        }
        for (path, size) in found {
            if std::fs::remove_file(&path).is_ok() {
                done.0 += 1;
                done.1 += size;
            }
        }
        let _ = std::fs::remove_dir(&dir);
    }
    done
}

/// A record longer than this is taken for corruption: the reference's
/// lines are at most Docker's 16 KiB chunks.
const MAX_RECORD: u64 = 1 << 20;

/// One line of a reference stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Unix nanoseconds.
    pub time_ns: i64,
    pub stderr: bool,
    pub line: String,
}

/// The directory of `stream` under `logs`, if the reference left one: the
/// id with every character outside `[A-Za-z0-9._-]` as `_` (LOG-2); `.`
/// and `..` are never streams.
pub fn stream_dir(logs: &Path, stream: &str) -> Option<PathBuf> {
    let name: String = stream
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() || name == "." || name == ".." {
        return None;
    }
    let dir = logs.join(name);
    let found = dir.join("active.log").symlink_metadata().is_ok() || !segments(&dir).is_empty();
    found.then_some(dir)
}

/// A segment file and how to read it.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Segment {
    Compressed(u64, PathBuf),
    Raw(u64, PathBuf),
}

/// The closed segments of `dir`, oldest first (sequence numbers only grow,
/// LOG-6); a number with both a `.raw` and a `.zst` is read from the `.zst`.
fn segments(dir: &Path) -> Vec<Segment> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found = std::collections::BTreeMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name.strip_prefix("seg-") else {
            continue;
        };
        let (seq, ext) = rest.split_once('.').unwrap_or((rest, ""));
        let Ok(seq) = seq.parse::<u64>() else {
            continue;
        };
        match ext {
            "zst" => {
                found.insert(seq, Segment::Compressed(seq, entry.path()));
            }
            "raw" => {
                found.entry(seq).or_insert(Segment::Raw(seq, entry.path()));
            }
            _ => {}
        }
    }
    found.into_values().collect()
}

/// A segment's `[min, max]` time from its index (LOG-7), if it has a
/// readable one.
fn index_range(zst: &Path) -> Option<(i64, i64)> {
    let mut head = [0u8; 16];
    File::open(zst.with_extension("idx"))
        .ok()?
        .read_exact(&mut head)
        .ok()?;
    let (min, max) = head.split_at(8);
    Some((
        i64::from_le_bytes(min.try_into().ok()?),
        i64::from_le_bytes(max.try_into().ok()?),
    ))
}

/// Feeds `each` every entry of the stream at `dir` whose time is within
/// `since..=until` (unix nanoseconds), oldest segment first, `active.log`
/// last. Segments the index puts outside the range are skipped.
pub fn read(dir: &Path, since: Option<i64>, until: Option<i64>, mut each: impl FnMut(Entry)) {
    let within = |t: i64| since.is_none_or(|s| t >= s) && until.is_none_or(|u| t <= u);
    for segment in segments(dir) {
        match segment {
            Segment::Compressed(_, path) => {
                if let Some((min, max)) = index_range(&path)
                    && (until.is_some_and(|u| min > u) || since.is_some_and(|s| max < s))
                {
                    continue;
                }
                let Ok(file) = File::open(&path) else {
                    continue;
                };
                let Ok(decoder) = zstd::Decoder::new(file) else {
                    continue;
                };
                records(decoder, |e| {
                    if within(e.time_ns) {
                        each(e);
                    }
                });
            }
            Segment::Raw(_, path) => {
                if let Ok(file) = File::open(&path) {
                    records(BufReader::new(file), |e| {
                        if within(e.time_ns) {
                            each(e);
                        }
                    });
                }
            }
        }
    }
    if let Ok(file) = File::open(dir.join("active.log")) {
        records(BufReader::new(file), |e| {
            if within(e.time_ns) {
                each(e);
            }
        });
    }
}

/// Decodes LOG-3 records until the end or the first torn or bad one.
fn records(mut r: impl Read, mut each: impl FnMut(Entry)) {
    let mut body = Vec::new();
    while let Some(len) = uvarint(&mut r) {
        if !(9..=MAX_RECORD).contains(&len) {
            return;
        }
        body.clear();
        if (&mut r).take(len).read_to_end(&mut body).is_err() || body.len() as u64 != len {
            return;
        }
        let (time, rest) = body.split_at(8);
        let Ok(time) = <[u8; 8]>::try_from(time) else {
            return;
        };
        each(Entry {
            time_ns: i64::from_le_bytes(time),
            stderr: rest[0] & 1 == 1,
            line: String::from_utf8_lossy(&rest[1..]).into_owned(),
        });
    }
}

/// An unsigned LEB128 value; `None` at the end or a torn or overlong one.
fn uvarint(r: &mut impl Read) -> Option<u64> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let mut byte = [0u8; 1];
        r.read_exact(&mut byte).ok()?;
        value |= u64::from(byte[0] & 0x7f) << shift;
        if byte[0] & 0x80 == 0 {
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn record(out: &mut Vec<u8>, time_ns: i64, stderr: bool, line: &str) {
        let mut len = 9 + line.len() as u64;
        loop {
            let byte = (len & 0x7f) as u8;
            len >>= 7;
            if len == 0 {
                out.push(byte);
                break;
            }
            out.push(byte | 0x80);
        }
        out.extend_from_slice(&time_ns.to_le_bytes());
        out.push(u8::from(stderr));
        out.extend_from_slice(line.as_bytes());
    }

    fn index(min: i64, max: i64) -> Vec<u8> {
        [
            &min.to_le_bytes()[..],
            &max.to_le_bytes(),
            &0u32.to_le_bytes(),
        ]
        .concat()
    }

    /// A stream as the reference leaves it: two closed segments, one
    /// interrupted rotation, and an active segment with a torn tail.
    fn stream(dir: &Path) {
        std::fs::create_dir_all(dir).unwrap();
        let mut seg = Vec::new();
        record(&mut seg, 1_000, false, "zero");
        record(&mut seg, 2_000, true, "one");
        std::fs::write(
            dir.join("seg-00000000.zst"),
            zstd::encode_all(&seg[..], 3).unwrap(),
        )
        .unwrap();
        std::fs::write(dir.join("seg-00000000.idx"), index(1_000, 2_000)).unwrap();
        let mut seg = Vec::new();
        record(&mut seg, 3_000, false, &"x".repeat(200));
        std::fs::write(dir.join("seg-00000001.raw"), &seg).unwrap();
        let mut active = Vec::new();
        record(&mut active, 4_000, false, "four");
        record(&mut active, 5_000, false, "five");
        active.extend_from_slice(&[20, 1, 2]); // torn
        std::fs::write(dir.join("active.log"), active).unwrap();
        std::fs::write(dir.join("seg-00000002.zst.tmp"), b"half").unwrap();
    }

    fn all(dir: &Path, since: Option<i64>, until: Option<i64>) -> Vec<(i64, bool, String)> {
        let mut out = Vec::new();
        read(dir, since, until, |e| {
            out.push((e.time_ns, e.stderr, e.line));
        });
        out
    }

    #[test]
    fn every_segment_in_order_and_a_torn_tail_ends_quietly() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(stream_dir(tmp.path(), "01HZX").is_none());
        stream(&tmp.path().join("01HZX"));
        let dir = stream_dir(tmp.path(), "01HZX").unwrap();
        let got = all(&dir, None, None);
        let times: Vec<i64> = got.iter().map(|g| g.0).collect();
        assert_eq!(times, [1_000, 2_000, 3_000, 4_000, 5_000]);
        assert!(got[1].1, "stderr");
        assert_eq!(got[2].2.len(), 200);
        // Inclusive bounds; the index skips the first segment.
        let times: Vec<i64> = all(&dir, Some(2_000), Some(4_000))
            .iter()
            .map(|g| g.0)
            .collect();
        assert_eq!(times, [2_000, 3_000, 4_000]);
    }

    #[test]
    fn names_are_mapped_and_dot_names_refused() {
        let tmp = tempfile::tempdir().unwrap();
        stream(&tmp.path().join("a_b"));
        assert!(stream_dir(tmp.path(), "a/b").is_some());
        assert!(stream_dir(tmp.path(), "..").is_none());
        assert!(stream_dir(tmp.path(), ".").is_none());
        assert!(stream_dir(tmp.path(), "").is_none());
        assert!(stream_dir(tmp.path(), "missing").is_none());
    }

    #[test]
    fn streams_past_retention_go_and_other_directories_stay() {
        let tmp = tempfile::tempdir().unwrap();
        stream(&tmp.path().join("old"));
        stream(&tmp.path().join("foreign"));
        std::fs::write(tmp.path().join("foreign/notes.txt"), b"mine").unwrap();
        let later = SystemTime::now() + Duration::from_secs(8 * 86_400);
        let week = Duration::from_secs(7 * 86_400);
        assert_eq!(expire(tmp.path(), week, SystemTime::now()).0, 0, "young");
        let (removed, _) = expire(tmp.path(), week, later);
        assert_eq!(removed, 5);
        assert!(!tmp.path().join("old").exists());
        assert!(tmp.path().join("foreign/active.log").exists());
    }

    #[test]
    fn garbage_and_overlong_records_end_the_read() {
        let mut out = Vec::new();
        records(&[0xff; 32][..], |e| out.push(e));
        records(&[3, 0, 0, 0][..], |e| out.push(e));
        assert!(out.is_empty());
    }
}
