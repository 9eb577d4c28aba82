//! Where a container's output lives, in `<data>/logs/`:
//!
//! - `<cid>.log`: the live file the log shim appends to (CRI format);
//! - `<cid>.log.<seq>.zst`: a rotated file, zstd-compressed (LOG-6); `seq`
//!   only grows, so a rotation never renames older files under a reader;
//! - `<cid>.log.<seq>`: rotated, not compressed yet (the shim compresses it
//!   at once; a crash leaves it to the janitor); also what log shims older
//!   than compression left, numbered the other way round;
//! - `<cid>.log.<seq>.zst.tmp`: a compression under way;
//! - `<cid>.meta`: the assignment the container ran for ([`StreamMeta`]), so
//!   its files stay queryable by that assignment after the container is
//!   replaced or removed (LQ-1), until retention deletes them.
//!
//! Files of one container are ordered by modification time (the time of
//! their last line), then by `seq`; compression keeps the time.

use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// What a name in the log directory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Live,
    Raw(u64),
    Compressed(u64),
    Partial(u64),
    Meta,
}

/// One file of the log directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogFile {
    pub path: PathBuf,
    pub container_id: String,
    pub kind: Kind,
    pub modified: SystemTime,
    pub size: u64,
}

impl LogFile {
    /// A rotated file (raw or compressed): history retention may delete.
    pub fn is_rotated(&self) -> bool {
        matches!(self.kind, Kind::Raw(_) | Kind::Compressed(_))
    }

    fn order(&self) -> (u8, SystemTime, u64) {
        match self.kind {
            Kind::Raw(n) | Kind::Compressed(n) | Kind::Partial(n) => (0, self.modified, n),
            Kind::Live | Kind::Meta => (1, self.modified, 0),
        }
    }
}

/// `name`'s container id and kind; `None` for a name that is not ours.
pub fn classify(name: &str) -> Option<(&str, Kind)> {
    if let Some(cid) = name.strip_suffix(".meta") {
        return (!cid.is_empty()).then_some((cid, Kind::Meta));
    }
    if let Some(cid) = name.strip_suffix(".log") {
        return (!cid.is_empty()).then_some((cid, Kind::Live));
    }
    let (rest, wrap): (&str, fn(u64) -> Kind) = if let Some(r) = name.strip_suffix(".zst.tmp") {
        (r, Kind::Partial)
    } else if let Some(r) = name.strip_suffix(".zst") {
        (r, Kind::Compressed)
    } else {
        (name, Kind::Raw)
    };
    let (stem, seq) = rest.rsplit_once('.')?;
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let cid = stem.strip_suffix(".log").filter(|c| !c.is_empty())?;
    Some((cid, wrap(seq.parse().ok()?)))
}

/// Every file of ours in `dir`, each container's in order (rotated oldest
/// first, then the live file, then the meta file).
pub fn list(dir: &Path) -> io::Result<Vec<LogFile>> {
    let mut out = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some((cid, kind)) = name.to_str().and_then(classify) else {
            continue;
        };
        // Gone between the listing and the stat: a rotation or a sweep.
        let Ok(meta) = entry.metadata() else { continue };
        if !meta.is_file() {
            continue;
        }
        out.push(LogFile {
            path: entry.path(),
            container_id: cid.to_owned(),
            kind,
            modified: meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            size: meta.len(),
        });
    }
    out.sort_by(|a, b| {
        (a.container_id.as_str(), a.order()).cmp(&(b.container_id.as_str(), b.order()))
    });
    Ok(out)
}

/// The directory and container id of the live file `<dir>/<cid>.log`.
pub fn split_live(live: &Path) -> Option<(&Path, &str)> {
    let cid = live.file_name()?.to_str()?.strip_suffix(".log")?;
    Some((live.parent()?, cid))
}

/// Every file of the container whose live file is `live`, in order.
pub fn list_container(live: &Path) -> Vec<LogFile> {
    let Some((dir, cid)) = split_live(live) else {
        return Vec::new();
    };
    list(dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|f| f.container_id == cid)
        .collect()
}

/// The readable files of the container whose live file is `live`, oldest
/// first, the live file last (when it exists).
pub fn of_container(live: &Path) -> Vec<PathBuf> {
    if split_live(live).is_none() {
        return vec![live.to_path_buf()];
    }
    list_container(live)
        .into_iter()
        .filter(|f| f.is_rotated() || f.kind == Kind::Live)
        .map(|f| f.path)
        .collect()
}

/// The `seq` of the next rotation of `live`: one past every one in use.
pub fn next_seq(live: &Path) -> u64 {
    list_container(live)
        .iter()
        .filter_map(|f| match f.kind {
            Kind::Raw(n) | Kind::Compressed(n) | Kind::Partial(n) => Some(n),
            _ => None,
        })
        .max()
        .map_or(1, |n| n + 1)
}

/// The rotated name `<live>.<seq>`.
pub fn rotated(live: &Path, seq: u64) -> PathBuf {
    PathBuf::from(format!("{}.{seq}", live.display()))
}

/// A reader of `path`'s lines, decompressing a `.zst` file.
pub fn open(path: &Path) -> io::Result<Box<dyn BufRead + Send>> {
    let file = File::open(path)?;
    if path.extension().is_some_and(|e| e == "zst") {
        Ok(Box::new(BufReader::new(zstd::stream::read::Decoder::new(
            file,
        )?)))
    } else {
        Ok(Box::new(BufReader::new(file)))
    }
}

/// Compresses the rotated file `raw` into `<raw>.zst` (through `.zst.tmp`,
/// keeping its modification time), then removes `raw`. Returns the new
/// file's path and size.
///
/// A `<raw>.zst` already there is whole (it is synced before it is named):
/// `raw` is what a power cut left after the compression finished, its
/// removal never on disk, and perhaps its data neither. It is removed, and
/// the segment kept; compressing it again wrote an empty segment over a
/// full one (the VM lane's power cut found it).
pub fn compress(raw: &Path) -> io::Result<(PathBuf, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let done = PathBuf::from(format!("{}.zst", raw.display()));
    let tmp = PathBuf::from(format!("{}.zst.tmp", raw.display()));
    if let Ok(meta) = fs::symlink_metadata(&done) {
        crate::durable::remove(raw)?;
        return Ok((done, meta.len()));
    }
    let mut input = File::open(raw)?;
    let modified = input.metadata()?.modified()?;
    let out = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    let result = (|| {
        let mut enc = zstd::stream::write::Encoder::new(out, 0)?;
        io::copy(&mut input, &mut enc)?;
        let out = enc.finish()?;
        out.set_modified(modified)?;
        // The segment is on disk, and named, before its raw file goes: a
        // power cut between the two loses neither (58.3).
        out.sync_data()?;
        let size = out.metadata()?.len();
        crate::durable::rename(&tmp, &done)?;
        Ok(size)
    })();
    match result {
        Ok(size) => {
            crate::durable::remove(raw)?;
            Ok((done, size))
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// What a container's output belongs to: the selector fields QueryLogs
/// matches (LQ-1), written beside its files when it is created.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamMeta {
    pub assignment_id: String,
    #[serde(default)]
    pub project_id: String,
    #[serde(default)]
    pub app_id: String,
    #[serde(default)]
    pub environment_id: String,
    #[serde(default)]
    pub job_id: String,
}

/// `<dir>/<cid>.meta` for the live file `<dir>/<cid>.log`.
pub fn meta_path(live: &Path) -> PathBuf {
    live.with_extension("meta")
}

pub fn write_meta(live: &Path, meta: &StreamMeta) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(dir) = live.parent() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    crate::durable::write(
        &meta_path(live),
        &serde_json::to_vec(meta).map_err(io::Error::other)?,
        0o600,
    )
}

/// The meta file at `path`; `None` when absent or unreadable.
pub fn read_meta(path: &Path) -> Option<StreamMeta> {
    let mut text = String::new();
    File::open(path).ok()?.read_to_string(&mut text).ok()?;
    serde_json::from_str(&text).ok()
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::Duration;

    #[test]
    fn names_classify_and_strangers_do_not() {
        assert_eq!(classify("c1.log"), Some(("c1", Kind::Live)));
        assert_eq!(classify("c1.log.7"), Some(("c1", Kind::Raw(7))));
        assert_eq!(classify("c1.log.7.zst"), Some(("c1", Kind::Compressed(7))));
        assert_eq!(classify("c1.log.7.zst.tmp"), Some(("c1", Kind::Partial(7))));
        assert_eq!(classify("c1.meta"), Some(("c1", Kind::Meta)));
        assert_eq!(
            classify("a.b.log.2.zst"),
            Some(("a.b", Kind::Compressed(2)))
        );
        for stranger in [
            ".log",
            "c1.log.",
            "c1.log.x",
            "c1.txt",
            "c1.log.7.gz",
            "c1.7",
            "lost+found",
        ] {
            assert_eq!(classify(stranger), None, "{stranger}");
        }
    }

    #[test]
    fn compression_keeps_lines_and_time_and_rotations_order_by_time() {
        let dir = tempfile::tempdir().unwrap();
        let live = dir.path().join("c.log");
        let old = SystemTime::now() - Duration::from_secs(3600);
        // A legacy rotation (.2 older than .1) and one of ours.
        for (name, text, age) in [
            ("c.log.2", "a\n", 300),
            ("c.log.1", "b\n", 200),
            ("c.log.9", "c\n", 100),
        ] {
            let p = dir.path().join(name);
            fs::write(&p, text).unwrap();
            File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(SystemTime::now() - Duration::from_secs(age))
                .unwrap();
        }
        fs::write(&live, "d\n").unwrap();
        let (zst, size) = compress(&dir.path().join("c.log.9")).unwrap();
        assert!(size > 0 && !dir.path().join("c.log.9").exists());
        File::options()
            .write(true)
            .open(&zst)
            .unwrap()
            .set_modified(old + Duration::from_secs(3500))
            .unwrap();
        let files = of_container(&live);
        let names: Vec<_> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
            .collect();
        assert_eq!(names, ["c.log.2", "c.log.1", "c.log.9.zst", "c.log"]);
        let text: Vec<String> = files
            .iter()
            .flat_map(|p| {
                open(p)
                    .unwrap()
                    .lines()
                    .map(Result::unwrap)
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(text, ["a", "b", "c", "d"]);
        assert_eq!(next_seq(&live), 10);
        assert_eq!(next_seq(&dir.path().join("other.log")), 1);
    }

    #[test]
    fn a_meta_file_round_trips_and_garbage_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let live = dir.path().join("logs/c.log");
        let meta = StreamMeta {
            assignment_id: "a1".into(),
            app_id: "app".into(),
            ..StreamMeta::default()
        };
        write_meta(&live, &meta).unwrap();
        assert_eq!(read_meta(&meta_path(&live)), Some(meta));
        let mut f = File::create(dir.path().join("logs/bad.meta")).unwrap();
        f.write_all(b"{not json").unwrap();
        assert_eq!(read_meta(&dir.path().join("logs/bad.meta")), None);
    }
}
