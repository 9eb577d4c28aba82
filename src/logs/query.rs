//! `QueryLogs`: instance output from the files the log shim writes (CRI
//! format, rotated and compressed as [`crate::logs::files`] lays out).
//!
//! Streams are the assignments that match the selector (W-9, LQ-1): those
//! of the current set, and those the meta files on disk name, so output of
//! a replaced or removed container stays queryable until retention deletes
//! it, and a query right after a restart finds it too. The history is
//! the newest `limit` lines (0 = 1000, at most [`MAX_LIMIT`]) within
//! `since..=until`, across all selected streams, in time order, in memory
//! bounded by the limit; an empty selector selects every instance of the
//! current set, as the reference's does. With `follow` the files are then tailed
//! (every 250 ms; across a rotation, the old file is read to its end
//! first) until the caller goes away. Unlike the
//! reference there is no separate log store: the shim's files are it, so
//! lines written while the agent was down are there too. A stream the
//! reference agent left (a node moved from it) is read before them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use super::files::{self, StreamMeta};
use super::reference;
use crate::labels::{OWNED_FILTER, OwnedContainer};
use crate::proto::cluster::AssignmentSet;
use crate::proto::v1::{LogLine, LogQuery, LogSelector, LogSource};
use crate::runtime::{Containerd, RuntimeError, containers};

/// The lines a query answers, history then (with `follow`) new ones.
pub type LogLines = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = LogLine> + Send>>;

/// Why a query could not start.
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// containerd could not list the containers.
    #[error("QueryLogs: {0}")]
    Runtime(#[from] RuntimeError),
    /// A reading task died.
    #[error("QueryLogs: {0}")]
    Internal(String),
}

const DEFAULT_LIMIT: usize = 1000;
/// The most history lines one query returns (the lines are held in memory
/// to merge the streams by time); a larger `limit` is cut to this.
pub const MAX_LIMIT: usize = 10_000;
const FOLLOW_EVERY: Duration = Duration::from_millis(250);

/// One instance's output: the live file of each of its containers here,
/// the one written to last, last; and the stream a reference agent kept
/// for it before this node moved to this agent, if any (read first: it is
/// older than anything this agent wrote).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogStream {
    pub instance_id: String,
    pub live: Vec<PathBuf>,
    pub reference: Option<PathBuf>,
}

/// One parsed CRI line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CriLine<'a> {
    pub time: SystemTime,
    pub source: LogSource,
    /// `false` for a chunk of a longer line (`P`).
    pub full: bool,
    pub text: &'a str,
}

/// `<RFC3339Nano> <stdout|stderr> <F|P> <text>`; `None` for anything else.
pub fn parse_cri(line: &str) -> Option<CriLine<'_>> {
    let mut parts = line.splitn(4, ' ');
    let time = humantime::parse_rfc3339(parts.next()?).ok()?;
    let source = match parts.next()? {
        "stdout" => LogSource::Stdout,
        "stderr" => LogSource::Stderr,
        _ => return None,
    };
    let full = match parts.next()? {
        "F" => true,
        "P" => false,
        _ => return None,
    };
    Some(CriLine {
        time,
        source,
        full,
        text: parts.next().unwrap_or(""),
    })
}

/// Whether assignment `a` of the set matches `sel` (empty filters match all;
/// `deployment_id` is not applied, as in the reference).
fn selected(sel: &LogSelector, a: &crate::proto::v1::Assignment) -> bool {
    let id = a.meta.as_ref().map_or("", |m| m.id.as_str());
    let ok = |want: &str, have: &str| want.is_empty() || want == have;
    ok(&sel.project_id, &a.project_id)
        && ok(&sel.app_id, &a.app_id)
        && ok(&sel.environment_id, &a.environment_id)
        && ok(&sel.job_id, &a.job_id)
        && ok(&sel.instance_id, id)
}

/// Whether the container whose output `m` describes matches `sel`.
fn selected_meta(sel: &LogSelector, m: &StreamMeta) -> bool {
    let ok = |want: &str, have: &str| want.is_empty() || want == have;
    ok(&sel.project_id, &m.project_id)
        && ok(&sel.app_id, &m.app_id)
        && ok(&sel.environment_id, &m.environment_id)
        && ok(&sel.job_id, &m.job_id)
        && ok(&sel.instance_id, &m.assignment_id)
}

/// Every meta file in the log directory: container id → what it ran for.
fn metas(dir: &Path) -> Vec<(String, StreamMeta)> {
    files::list(dir)
        .unwrap_or_default()
        .into_iter()
        .filter(|f| f.kind == files::Kind::Meta)
        .filter_map(|f| Some((f.container_id, files::read_meta(&f.path)?)))
        .collect()
}

/// The log files of the selected instances: of containers here now, and of
/// those gone whose output is still on disk.
pub async fn streams(
    ctd: &Containerd,
    data_dir: &Path,
    set: Option<&AssignmentSet>,
    sel: &LogSelector,
) -> Result<Vec<LogStream>, QueryError> {
    // Builds log elsewhere: a build id selects nothing here.
    if !sel.build_id.is_empty() {
        return Ok(Vec::new());
    }
    let dir = data_dir.join("logs");
    let on_disk = {
        let dir = dir.clone();
        tokio::task::spawn_blocking(move || metas(&dir))
            .await
            .unwrap_or_default()
    };
    let mut wanted: BTreeSet<String> = set
        .map(|set| {
            set.assignments
                .iter()
                .filter(|a| selected(sel, a))
                .filter_map(|a| a.meta.as_ref().map(|m| m.id.clone()))
                .collect()
        })
        .unwrap_or_default();
    // An empty selector is every instance control placed here now (as the
    // reference answers it); output of instances gone since stays out.
    if *sel != LogSelector::default() {
        wanted.extend(
            on_disk
                .iter()
                .filter(|(_, m)| selected_meta(sel, m))
                .map(|(_, m)| m.assignment_id.clone()),
        );
    }
    // A reference agent's stream is named by the instance alone.
    if !sel.instance_id.is_empty() && reference::stream_dir(&dir, &sel.instance_id).is_some() {
        wanted.insert(sel.instance_id.clone());
    }
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let mut live: BTreeMap<String, BTreeSet<PathBuf>> = wanted
        .iter()
        .map(|id| (id.clone(), BTreeSet::new()))
        .collect();
    for (cid, m) in &on_disk {
        if wanted.contains(&m.assignment_id) {
            let path = dir.join(format!("{cid}.log"));
            live.entry(m.assignment_id.clone())
                .or_default()
                .insert(path);
        }
    }
    let listed = containers::list(ctd, &OWNED_FILTER).await?;
    for o in listed.iter().filter_map(OwnedContainer::from_container) {
        if wanted.contains(&o.assignment_id) {
            let path = o.log_path.map_or_else(
                || dir.join(format!("{}.log", o.container_id)),
                PathBuf::from,
            );
            live.entry(o.assignment_id).or_default().insert(path);
        }
    }
    let out = tokio::task::spawn_blocking(move || {
        live.into_iter()
            .map(|(instance_id, paths)| {
                let mut live: Vec<PathBuf> = paths.into_iter().collect();
                // A replaced container wrote before its successor.
                live.sort_by_cached_key(|p| {
                    std::fs::metadata(p)
                        .and_then(|m| m.modified())
                        .unwrap_or(SystemTime::UNIX_EPOCH)
                });
                let reference = reference::stream_dir(&dir, &instance_id);
                LogStream {
                    instance_id,
                    live,
                    reference,
                }
            })
            .filter(|s| !s.live.is_empty() || s.reference.is_some())
            .collect()
    })
    .await
    .map_err(|e| QueryError::Internal(e.to_string()))?;
    Ok(out)
}

/// A log line longer than this is cut here and marked (45.3): a container
/// that prints gigabytes without a newline makes one line of `P` chunks,
/// and retention counts compressed bytes (such output compresses ~1000:1),
/// so joining them whole would build a multi-GB string in the agent.
pub const MAX_LINE: usize = 1 << 20;

/// Joins `P` chunks into whole lines, per source, each at most
/// [`MAX_LINE`] bytes.
#[derive(Debug, Default)]
struct Assembler {
    partial: [Partial; 2],
}

#[derive(Debug, Default)]
struct Partial {
    text: String,
    /// Bytes cut from the line being joined.
    cut: u64,
}

impl Assembler {
    fn push(&mut self, l: &CriLine<'_>) -> Option<String> {
        let slot = &mut self.partial[usize::from(l.source == LogSource::Stderr)];
        let room = MAX_LINE.saturating_sub(slot.text.len());
        if l.text.len() <= room {
            slot.text.push_str(l.text);
        } else {
            let mut keep = room;
            while !l.text.is_char_boundary(keep) {
                keep -= 1;
            }
            slot.text.push_str(&l.text[..keep]);
            slot.cut += (l.text.len() - keep) as u64;
        }
        if !l.full {
            return None;
        }
        let mut line = std::mem::take(&mut slot.text);
        let cut = std::mem::take(&mut slot.cut);
        if cut > 0 {
            use std::fmt::Write as _;
            let _ = write!(line, " [zattera: line truncated, {cut} more bytes]");
        }
        Some(line)
    }

    /// One raw file line in: the whole log line it completes, if that line
    /// falls in `window`.
    fn take(&mut self, raw: &str, window: Window, instance_id: &str) -> Option<LogLine> {
        let l = parse_cri(raw)?;
        let line = self.push(&l)?;
        window
            .contains(l.time)
            .then(|| log_line(instance_id, l.source, l.time, line))
    }
}

/// Time bounds of a query; `None` is unbounded.
#[derive(Debug, Clone, Copy)]
struct Window {
    since: Option<SystemTime>,
    until: Option<SystemTime>,
}

impl Window {
    fn of(q: &LogQuery) -> Self {
        let at =
            |t: &Option<prost_types::Timestamp>| (*t).and_then(|t| SystemTime::try_from(t).ok());
        Self {
            since: at(&q.since),
            until: at(&q.until),
        }
    }
    fn contains(self, t: SystemTime) -> bool {
        self.since.is_none_or(|s| t >= s) && self.until.is_none_or(|u| t <= u)
    }
}

fn log_line(instance_id: &str, source: LogSource, time: SystemTime, line: String) -> LogLine {
    LogLine {
        time: Some(time.into()),
        instance_id: instance_id.to_owned(),
        app_name: String::new(),
        environment_name: String::new(),
        source: source as i32,
        line,
    }
}

/// Where history reading ended in one live file: the open file (kept open
/// so the follower drains it even after a rotation renames or deletes it)
/// and how far it was read.
#[derive(Debug)]
struct Offset {
    path: PathBuf,
    file: Option<std::fs::File>,
    consumed: u64,
    /// The rotation number the held file gets when the shim rotates it.
    seq: u64,
}

/// The live file at `live`, open, with the rotation number it will get:
/// the next one free when it was opened (retried if a rotation came
/// between the two).
fn open_live(live: &Path) -> Option<(std::fs::File, u64)> {
    for _ in 0..10 {
        let file = std::fs::File::open(live).ok()?;
        let seq = files::next_seq(live);
        let again = std::fs::File::open(live).ok()?;
        if same_file(&file, &again) {
            return Some((file, seq));
        }
    }
    None
}

/// The newest `limit` lines of one stream within `window`, oldest first,
/// and where each live file's reading ended.
fn history(stream: &LogStream, window: Window, limit: usize) -> (VecDeque<LogLine>, Vec<Offset>) {
    let mut keep: VecDeque<LogLine> = VecDeque::with_capacity(limit.min(4096));
    let mut offsets = Vec::with_capacity(stream.live.len());
    if let Some(dir) = &stream.reference {
        let ns = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        };
        let (since, until) = (window.since.map(ns), window.until.map(ns));
        reference::read(dir, since, until, |e| {
            let time = u64::try_from(e.time_ns).map_or(SystemTime::UNIX_EPOCH, |t| {
                SystemTime::UNIX_EPOCH + Duration::from_nanos(t)
            });
            let source = if e.stderr {
                LogSource::Stderr
            } else {
                LogSource::Stdout
            };
            if keep.len() == limit {
                keep.pop_front();
            }
            keep.push_back(log_line(&stream.instance_id, source, time, e.line));
        });
    }
    for live in &stream.live {
        let mut asm = Assembler::default();
        let mut offset = Offset {
            path: live.clone(),
            file: None,
            consumed: 0,
            seq: 0,
        };
        for path in files::of_container(live) {
            let is_live = &path == live;
            let reader: Box<dyn BufRead + Send> = if is_live {
                let Some((f, seq)) = open_live(&path) else {
                    continue;
                };
                offset.file = f.try_clone().ok();
                offset.seq = seq;
                Box::new(BufReader::new(f))
            } else {
                match files::open(&path) {
                    Ok(r) => r,
                    Err(_) => continue,
                }
            };
            let consumed = read_lines(reader, |raw| {
                if let Some(line) = asm.take(raw, window, &stream.instance_id) {
                    if keep.len() == limit {
                        keep.pop_front();
                    }
                    keep.push_back(line);
                }
            });
            if is_live {
                offset.consumed = consumed;
            }
        }
        offsets.push(offset);
    }
    (keep, offsets)
}

/// Feeds every complete line of `reader` to `each`; returns the bytes
/// consumed (a line still being written is left to the follower).
fn read_lines(mut reader: impl BufRead, mut each: impl FnMut(&str)) -> u64 {
    let mut consumed: u64 = 0;
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if buf.last() != Some(&b'\n') {
            break;
        }
        consumed += n as u64;
        each(&String::from_utf8_lossy(&buf[..n - 1]));
    }
    consumed
}

/// The selected history, merged across streams by time, newest `limit`.
/// Memory stays within about two `limit`s of lines whatever the number of
/// streams (an empty selector reads every instance of the node): each
/// stream's newest `limit` go through a heap that keeps only the newest
/// `limit` of all.
fn merged_history(
    streams: &[LogStream],
    window: Window,
    limit: usize,
) -> (Vec<LogLine>, Vec<Vec<Offset>>) {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    // A min-heap by (time, arrival): the oldest line kept is popped first.
    let mut newest: BinaryHeap<Reverse<Kept>> = BinaryHeap::new();
    let mut offsets = Vec::with_capacity(streams.len());
    let mut arrival = 0u64;
    for s in streams {
        let (lines, ends) = history(s, window, limit);
        offsets.push(ends);
        for line in lines {
            arrival += 1;
            let time = line.time.as_ref().map_or((0, 0), |t| (t.seconds, t.nanos));
            newest.push(Reverse(Kept {
                key: (time, arrival),
                line,
            }));
            if newest.len() > limit {
                newest.pop();
            }
        }
    }
    let mut kept: Vec<Kept> = newest.into_iter().map(|Reverse(k)| k).collect();
    kept.sort_by_key(|k| k.key);
    (kept.into_iter().map(|k| k.line).collect(), offsets)
}

/// A line in the heap, ordered by (time, arrival) alone.
#[derive(Debug)]
struct Kept {
    key: ((i64, i32), u64),
    line: LogLine,
}

impl PartialEq for Kept {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}
impl Eq for Kept {}
impl PartialOrd for Kept {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Kept {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key.cmp(&other.key)
    }
}

pub async fn query_logs(
    ctd: &Containerd,
    data_dir: &Path,
    desired: &watch::Receiver<Option<AssignmentSet>>,
    query: LogQuery,
) -> Result<LogLines, QueryError> {
    let selector = query.selector.clone().unwrap_or_default();
    let set = desired.borrow().clone();
    let streams = streams(ctd, data_dir, set.as_ref(), &selector).await?;
    let window = Window::of(&query);
    let limit = match query.limit {
        0 => DEFAULT_LIMIT,
        n => usize::try_from(n).unwrap_or(MAX_LIMIT).min(MAX_LIMIT),
    };
    let (tx, rx) = mpsc::channel::<LogLine>(256);
    let follow = query.follow;
    tokio::spawn(async move {
        let read = streams.clone();
        let Ok((lines, offsets)) =
            tokio::task::spawn_blocking(move || merged_history(&read, window, limit)).await
        else {
            return;
        };
        for line in lines {
            if tx.send(line).await.is_err() {
                return;
            }
        }
        if follow && !streams.is_empty() {
            tail(streams, offsets, window, tx).await;
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// One followed live file: the file open under its name when last looked
/// at, how far it was read, and bytes of a line not yet ended.
#[derive(Debug)]
struct Follower {
    instance_id: String,
    at: Offset,
    rest: Vec<u8>,
    asm: Assembler,
}

impl Follower {
    fn new(instance_id: String, at: Offset) -> Self {
        Self {
            instance_id,
            at,
            rest: Vec::new(),
            asm: Assembler::default(),
        }
    }

    /// New complete lines since the last call. When the shim has rotated
    /// (once or more since the last look), the held file is read to its
    /// end, then every rotation after it in order (raw, or compressed by
    /// now), then the new live file from its start.
    fn poll(&mut self, window: Window) -> Vec<LogLine> {
        let mut out = Vec::new();
        loop {
            self.drain(window, &mut out);
            let Ok(current) = std::fs::File::open(&self.at.path) else {
                return out;
            };
            if self
                .at
                .file
                .as_ref()
                .is_some_and(|f| same_file(f, &current))
            {
                return out;
            }
            // Renamed away: nothing more is written to it; what came after
            // the last read is its tail.
            self.drain(window, &mut out);
            let Some((file, seq)) = open_live(&self.at.path) else {
                return out;
            };
            if self.at.file.is_some() {
                for n in self.at.seq + 1..seq {
                    self.read_rotated(n, window, &mut out);
                }
            }
            self.at.file = Some(file);
            self.at.seq = seq;
            self.at.consumed = 0;
            self.rest.clear();
        }
    }

    /// A whole rotation of this file, by its number (gone to retention:
    /// nothing).
    fn read_rotated(&mut self, n: u64, window: Window, out: &mut Vec<LogLine>) {
        let raw = files::rotated(&self.at.path, n);
        let reader: Box<dyn BufRead + Send> = match std::fs::File::open(&raw) {
            Ok(f) => Box::new(BufReader::new(f)),
            Err(_) => match files::open(&PathBuf::from(format!("{}.zst", raw.display()))) {
                Ok(r) => r,
                Err(_) => return,
            },
        };
        let (asm, id) = (&mut self.asm, &self.instance_id);
        read_lines(reader, |l| {
            if let Some(line) = asm.take(l, window, id) {
                out.push(line);
            }
        });
    }

    fn drain(&mut self, window: Window, out: &mut Vec<LogLine>) {
        let Some(file) = self.at.file.as_mut() else {
            return;
        };
        if file.seek(SeekFrom::Start(self.at.consumed)).is_err() {
            return;
        }
        let mut fresh = Vec::new();
        if file.read_to_end(&mut fresh).is_err() || fresh.is_empty() {
            return;
        }
        self.at.consumed += fresh.len() as u64;
        self.rest.extend_from_slice(&fresh);
        let Some(end) = self.rest.iter().rposition(|b| *b == b'\n') else {
            return;
        };
        let complete: Vec<u8> = self.rest.drain(..=end).collect();
        out.extend(
            String::from_utf8_lossy(&complete)
                .lines()
                .filter_map(|raw| self.asm.take(raw, window, &self.instance_id)),
        );
    }
}

fn same_file(a: &std::fs::File, b: &std::fs::File) -> bool {
    match (a.metadata(), b.metadata()) {
        (Ok(a), Ok(b)) => a.ino() == b.ino() && a.dev() == b.dev(),
        _ => false,
    }
}

async fn tail(
    streams: Vec<LogStream>,
    offsets: Vec<Vec<Offset>>,
    window: Window,
    tx: mpsc::Sender<LogLine>,
) {
    let mut followers: Vec<Follower> = streams
        .into_iter()
        .zip(offsets)
        .flat_map(|(stream, ends)| {
            ends.into_iter()
                .map(move |at| Follower::new(stream.instance_id.clone(), at))
        })
        .collect();
    loop {
        tokio::select! {
            () = tx.closed() => return,
            () = tokio::time::sleep(FOLLOW_EVERY) => {}
        }
        for f in &mut followers {
            for line in f.poll(window) {
                if tx.send(line).await.is_err() {
                    return;
                }
            }
        }
        if window.until.is_some_and(|u| SystemTime::now() > u) {
            return;
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn cri_lines_parse_and_garbage_does_not() {
        let l = parse_cri("2026-11-30T10:00:00.123456789Z stderr P half a li").unwrap();
        assert_eq!(l.source, LogSource::Stderr);
        assert!(!l.full);
        assert_eq!(l.text, "half a li");
        assert_eq!(
            parse_cri("2026-11-30T10:00:00Z stdout F ").unwrap().text,
            ""
        );
        for bad in [
            "",
            "nonsense",
            "2026-11-30T10:00:00Z stdin F x",
            "2026-11-30T10:00:00Z stdout X x",
        ] {
            assert!(parse_cri(bad).is_none(), "{bad}");
        }
    }

    fn write_lines(path: &Path, lines: &[(u64, &str, &str, &str)]) {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        for (secs, stream, tag, text) in lines {
            let t = humantime::format_rfc3339_nanos(
                SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs),
            );
            writeln!(f, "{t} {stream} {tag} {text}").unwrap();
        }
    }

    fn aged(path: &Path, secs: u64) {
        std::fs::File::options()
            .write(true)
            .open(path)
            .unwrap()
            .set_modified(SystemTime::now() - Duration::from_secs(secs))
            .unwrap();
    }

    #[test]
    fn a_line_without_end_is_cut_at_max_line_and_marked() {
        let mut asm = Assembler::default();
        let chunk = "A".repeat(16 * 1024);
        let partial = format!("2026-01-01T00:00:00Z stdout P {chunk}");
        // 64 MiB of one line, fed in the shim's 16 KiB chunks.
        for _ in 0..4096 {
            assert!(asm.push(&parse_cri(&partial).unwrap()).is_none());
            assert!(asm.partial[0].text.len() <= MAX_LINE, "grew past the cap");
        }
        let line = asm
            .push(&parse_cri("2026-01-01T00:00:00Z stdout F end").unwrap())
            .unwrap();
        assert!(line.starts_with("AAAA"));
        assert_eq!(&line[..MAX_LINE], chunk.repeat(64).as_str());
        assert!(
            line.ends_with(&format!(
                " [zattera: line truncated, {} more bytes]",
                64 * 1024 * 1024 - MAX_LINE + 3
            )),
            "{}",
            &line[MAX_LINE..]
        );
        // The next line starts clean.
        let next = asm
            .push(&parse_cri("2026-01-01T00:00:01Z stdout F ok").unwrap())
            .unwrap();
        assert_eq!(next, "ok");
    }

    #[test]
    fn history_spans_compressed_files_and_containers_joins_chunks_and_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        // A replaced container's output, then its successor's, one rotation
        // each, compressed.
        let old = dir.path().join("old.log");
        write_lines(&files::rotated(&old, 1), &[(1, "stdout", "F", "zero")]);
        aged(&files::rotated(&old, 1), 40);
        files::compress(&files::rotated(&old, 1)).unwrap();
        std::fs::write(&old, "").unwrap();
        aged(&old, 30);
        let path = dir.path().join("c.log");
        write_lines(
            &files::rotated(&path, 1),
            &[(1, "stdout", "F", "one"), (2, "stdout", "P", "tw")],
        );
        aged(&files::rotated(&path, 1), 20);
        files::compress(&files::rotated(&path, 1)).unwrap();
        write_lines(
            &path,
            &[
                (3, "stdout", "F", "o"),
                (4, "stderr", "F", "three"),
                (5, "stdout", "F", "four"),
            ],
        );
        let s = LogStream {
            instance_id: "a1".into(),
            live: vec![old.clone(), path.clone()],
            reference: None,
        };
        let all = Window {
            since: None,
            until: None,
        };
        let (lines, mut ends) = history(&s, all, 10);
        let text: Vec<&str> = lines.iter().map(|l| l.line.as_str()).collect();
        assert_eq!(text, ["zero", "one", "two", "three", "four"]);
        assert_eq!(ends[1].consumed, std::fs::metadata(&path).unwrap().len());
        assert_eq!(lines[3].source, LogSource::Stderr as i32);
        let (newest, _) = history(&s, all, 2);
        assert_eq!(newest.len(), 2);
        assert_eq!(newest[0].line, "three");
        let since = Window {
            since: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_004)),
            until: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_004)),
        };
        let (bounded, _) = history(&s, since, 10);
        assert_eq!(bounded.len(), 1);
        assert_eq!(bounded[0].line, "three");

        // Following picks up complete lines only, and every line across a
        // rotation: the old file's tail first, then the new file.
        let mut f = Follower::new("a1".into(), ends.remove(1));
        assert!(f.poll(all).is_empty());
        write_lines(&path, &[(6, "stdout", "F", "five")]);
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        write!(file, "2026-").unwrap();
        let got: Vec<String> = f.poll(all).into_iter().map(|l| l.line).collect();
        assert_eq!(got, ["five"]);
        writeln!(file, "12-01T00:00:00Z stdout F finished").unwrap();
        drop(file);
        write_lines(&path, &[(7, "stdout", "F", "tail of the old file")]);
        std::fs::rename(&path, files::rotated(&path, 2)).unwrap();
        write_lines(&path, &[(8, "stdout", "F", "six")]);
        let got: Vec<String> = f.poll(all).into_iter().map(|l| l.line).collect();
        assert_eq!(got, ["finished", "tail of the old file", "six"]);
        // Two rotations between two looks, the second already compressed:
        // nothing of the middle file is skipped.
        write_lines(&path, &[(9, "stdout", "F", "seven")]);
        std::fs::rename(&path, files::rotated(&path, 3)).unwrap();
        write_lines(&path, &[(10, "stdout", "F", "eight")]);
        std::fs::rename(&path, files::rotated(&path, 4)).unwrap();
        files::compress(&files::rotated(&path, 4)).unwrap();
        write_lines(&path, &[(11, "stdout", "F", "nine")]);
        let got: Vec<String> = f.poll(all).into_iter().map(|l| l.line).collect();
        assert_eq!(got, ["seven", "eight", "nine"]);
    }

    #[test]
    fn a_meta_matches_the_selector_fields() {
        let m = StreamMeta {
            assignment_id: "a1".into(),
            project_id: "p".into(),
            app_id: "app".into(),
            environment_id: "env".into(),
            job_id: String::new(),
        };
        let sel = |f: fn(&mut LogSelector)| {
            let mut s = LogSelector::default();
            f(&mut s);
            s
        };
        assert!(selected_meta(&sel(|s| s.app_id = "app".into()), &m));
        assert!(selected_meta(&sel(|s| s.instance_id = "a1".into()), &m));
        assert!(!selected_meta(&sel(|s| s.instance_id = "a2".into()), &m));
        assert!(!selected_meta(
            &sel(|s| {
                s.app_id = "app".into();
                s.environment_id = "other".into();
            }),
            &m
        ));
        assert!(!selected_meta(&sel(|s| s.job_id = "j".into()), &m));
    }
}
