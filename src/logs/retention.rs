//! How long container output is kept (LOG-9): rotated files older than the
//! age cap go, and a stream's compressed files are cut, oldest first, to the
//! byte cap. A stream is an assignment: every container it ever had here,
//! by their meta files.
//!
//! The log shim applies the caps to its own container after each rotation;
//! the janitor ([`sweep`], hourly) covers quiet streams, whole assignments,
//! what a crash left half done, and containers that are gone: their files
//! go once they are older than the age cap, the live file included.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::files::{self, Kind, LogFile};

/// The caps; the reference's documented defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    pub max_age: Duration,
    /// Compressed bytes per stream.
    pub max_stream_bytes: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            max_age: DEFAULT_MAX_AGE,
            max_stream_bytes: DEFAULT_MAX_STREAM_BYTES,
        }
    }
}

pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
pub const DEFAULT_MAX_STREAM_BYTES: u64 = 100 * 1024 * 1024;

/// How long a half-done rotation (`.zst.tmp`, an uncompressed rotated
/// file) is left to the log shim doing it before the janitor takes over.
pub const GRACE: Duration = Duration::from_secs(600);

/// The rotated files of one stream (any order) that the caps delete:
/// every one older than `max_age`, then the oldest compressed ones while
/// the rest are over `max_stream_bytes`.
pub fn expired<'a>(
    stream: impl IntoIterator<Item = &'a LogFile>,
    caps: Retention,
    now: SystemTime,
) -> Vec<&'a LogFile> {
    let mut rotated: Vec<&LogFile> = stream.into_iter().filter(|f| f.is_rotated()).collect();
    rotated.sort_by_key(|f| (f.modified, f.path.clone()));
    let too_old = |f: &LogFile| {
        now.duration_since(f.modified)
            .is_ok_and(|a| a > caps.max_age)
    };
    let (mut gone, kept): (Vec<&LogFile>, Vec<&LogFile>) =
        rotated.into_iter().partition(|f| too_old(f));
    let mut total: u64 = kept
        .iter()
        .filter(|f| matches!(f.kind, Kind::Compressed(_)))
        .map(|f| f.size)
        .sum();
    for f in kept {
        if total <= caps.max_stream_bytes {
            break;
        }
        if matches!(f.kind, Kind::Compressed(_)) {
            total -= f.size;
            gone.push(f);
        }
    }
    gone
}

/// What one sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    pub removed: usize,
    pub bytes_freed: u64,
    pub compressed: usize,
    pub errors: Vec<String>,
}

/// One janitor pass over `dir`. `running` are the containers that exist:
/// their live files are never deleted, however quiet.
pub fn sweep(
    dir: &Path,
    caps: Retention,
    running: &BTreeSet<String>,
    now: SystemTime,
) -> io::Result<Swept> {
    let mut done = Swept::default();
    let stale = |f: &LogFile| now.duration_since(f.modified).is_ok_and(|a| a > GRACE);
    // What a crash left: finish the rotation or drop the attempt.
    for f in files::list(dir)? {
        match f.kind {
            Kind::Partial(_) if stale(&f) => remove(&f, &mut done),
            Kind::Raw(_) if stale(&f) => match files::compress(&f.path) {
                Ok(_) => done.compressed += 1,
                Err(e) => done
                    .errors
                    .push(format!("compress {}: {e}", f.path.display())),
            },
            _ => {}
        }
    }

    let all = files::list(dir)?;
    let stream_of: BTreeMap<&str, String> = all
        .iter()
        .filter(|f| f.kind == Kind::Meta)
        .filter_map(|f| {
            Some((
                f.container_id.as_str(),
                files::read_meta(&f.path)?.assignment_id,
            ))
        })
        .collect();
    let mut streams: BTreeMap<String, Vec<&LogFile>> = BTreeMap::new();
    for f in &all {
        let stream = stream_of
            .get(f.container_id.as_str())
            .cloned()
            .unwrap_or_else(|| format!("container {}", f.container_id));
        streams.entry(stream).or_default().push(f);
    }
    let mut left: BTreeSet<&str> = BTreeSet::new();
    for stream in streams.values() {
        let gone: BTreeSet<&Path> = expired(stream.iter().copied(), caps, now)
            .into_iter()
            .map(|f| f.path.as_path())
            .collect();
        for f in stream {
            let live_of_gone_container = f.kind == Kind::Live
                && !running.contains(&f.container_id)
                && now
                    .duration_since(f.modified)
                    .is_ok_and(|a| a > caps.max_age);
            if gone.contains(f.path.as_path()) || live_of_gone_container {
                remove(f, &mut done);
            } else if f.kind != Kind::Meta {
                left.insert(&f.container_id);
            }
        }
    }
    // A meta file outlives its container's output only while some is left.
    for f in all.iter().filter(|f| f.kind == Kind::Meta) {
        if !left.contains(f.container_id.as_str()) && !running.contains(&f.container_id) {
            remove(f, &mut done);
        }
    }
    let (removed, bytes) = super::reference::expire(dir, caps.max_age, now);
    done.removed += removed;
    done.bytes_freed += bytes;
    Ok(done)
}

fn remove(f: &LogFile, done: &mut Swept) {
    match std::fs::remove_file(&f.path) {
        Ok(()) => {
            done.removed += 1;
            done.bytes_freed += f.size;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => done
            .errors
            .push(format!("remove {}: {e}", f.path.display())),
    }
}

/// The paths [`expired`] picks among the files of the container whose live
/// file is `live` (the log shim's own check after a rotation).
pub fn expired_of_container(live: &Path, caps: Retention, now: SystemTime) -> Vec<PathBuf> {
    let mine = files::list_container(live);
    expired(&mine, caps, now)
        .into_iter()
        .map(|f| f.path.clone())
        .collect()
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::fs::{self, File};

    fn put(dir: &Path, name: &str, bytes: usize, age: Duration) -> PathBuf {
        let p = dir.join(name);
        fs::write(&p, vec![b'x'; bytes]).unwrap();
        File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_modified(SystemTime::now() - age)
            .unwrap();
        p
    }

    const MIN: Duration = Duration::from_secs(60);
    const DAY: Duration = Duration::from_secs(24 * 3600);

    fn names(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        n.sort();
        n
    }

    /// The VM lane's power cut: the segment compressed and named on disk,
    /// the raw file's removal lost and its data too (0 bytes). The sweep
    /// compressed the empty raw file over the whole segment; it keeps the
    /// segment and drops the raw file.
    #[test]
    fn a_raw_file_left_beside_its_segment_never_replaces_it() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let live = d.join("c.log");
        fs::write(&live, b"").unwrap();
        let lines = "2026-12-07T00:00:00Z stdout F line\n".repeat(1000);
        fs::write(d.join("c.log.1"), &lines).unwrap();
        files::compress(&d.join("c.log.1")).unwrap();
        let whole = fs::read(d.join("c.log.1.zst")).unwrap();
        put(d, "c.log.1", 0, 11 * MIN);
        let caps = Retention {
            max_age: 7 * DAY,
            max_stream_bytes: 1 << 30,
        };
        let running = BTreeSet::from(["c".to_owned()]);
        sweep(d, caps, &running, SystemTime::now()).unwrap();
        assert_eq!(names(d), ["c.log", "c.log.1.zst"]);
        assert_eq!(fs::read(d.join("c.log.1.zst")).unwrap(), whole);
        let mut text = String::new();
        std::io::Read::read_to_string(&mut files::open(&d.join("c.log.1.zst")).unwrap(), &mut text)
            .unwrap();
        assert_eq!(text, lines);
    }

    #[test]
    fn the_caps_take_the_old_then_the_oldest_over_the_budget() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        put(d, "c.log.1.zst", 100, 8 * DAY); // past the age cap
        put(d, "c.log.2.zst", 100, 3 * MIN);
        put(d, "c.log.3.zst", 100, 2 * MIN);
        put(d, "c.log.4.zst", 100, MIN);
        let live = put(d, "c.log", 5000, Duration::ZERO); // never counted
        let caps = Retention {
            max_age: 7 * DAY,
            max_stream_bytes: 200,
        };
        let gone = expired_of_container(&live, caps, SystemTime::now());
        let gone: Vec<_> = gone
            .iter()
            .map(|p| p.file_name().unwrap().to_owned())
            .collect();
        assert_eq!(gone, ["c.log.1.zst", "c.log.2.zst"]);
    }

    #[test]
    fn the_janitor_keeps_running_containers_and_sweeps_gone_ones_by_stream() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let meta = |cid: &str, assignment: &str| {
            files::write_meta(
                &d.join(format!("{cid}.log")),
                &files::StreamMeta {
                    assignment_id: assignment.into(),
                    ..Default::default()
                },
            )
            .unwrap();
        };
        // Assignment A: container old (replaced) and new (running).
        meta("old", "A");
        meta("new", "A");
        put(d, "old.log.1.zst", 300, 20 * MIN);
        put(d, "old.log", 10, 2 * MIN); // gone, but younger than the age cap
        put(d, "new.log.1.zst", 150, MIN);
        put(d, "new.log", 10, 9 * DAY); // quiet, but its container runs
        // Assignment B: removed nine days ago.
        meta("b", "B");
        put(d, "b.log.1.zst", 10, 9 * DAY);
        put(d, "b.log", 10, 9 * DAY);
        File::options()
            .write(true)
            .open(d.join("b.meta"))
            .unwrap()
            .set_modified(SystemTime::now() - 9 * DAY)
            .unwrap();
        // What crashes leave.
        put(d, "new.log.2.zst.tmp", 10, 11 * MIN);
        fs::write(d.join("new.log.3"), "2026-12-01T00:00:00Z stdout F hi\n").unwrap();
        File::options()
            .write(true)
            .open(d.join("new.log.3"))
            .unwrap()
            .set_modified(SystemTime::now() - 11 * MIN)
            .unwrap();
        put(d, "stranger.txt", 10, 30 * DAY);

        let caps = Retention {
            max_age: 7 * DAY,
            max_stream_bytes: 400,
        };
        let running = BTreeSet::from(["new".to_owned()]);
        let swept = sweep(d, caps, &running, SystemTime::now()).unwrap();
        assert!(swept.errors.is_empty(), "{:?}", swept.errors);
        assert_eq!(swept.compressed, 1);
        // A's compressed files, the recovered one included, are over 400
        // bytes: the oldest goes, whichever container wrote it.
        assert_eq!(
            names(d),
            [
                "new.log",
                "new.log.1.zst",
                "new.log.3.zst",
                "new.meta",
                "old.log",
                "old.meta",
                "stranger.txt"
            ]
        );
        let text = files::open(&d.join("new.log.3.zst")).unwrap();
        assert_eq!(std::io::BufRead::lines(text).count(), 1);
        // Nine days on, the replaced container's files go with their meta.
        let later = SystemTime::now() + 8 * DAY;
        sweep(d, caps, &running, later).unwrap();
        assert_eq!(names(d), ["new.log", "new.meta", "stranger.txt"]);
    }
}
