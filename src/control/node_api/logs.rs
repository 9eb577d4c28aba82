//! `QueryLogs`: instance output from the files the log shim writes (CRI
//! format, rotated as `<file>.1` … `<file>.N`, oldest last).
//!
//! Streams are the assignments of the current set that match the selector
//! (W-9); each one's file comes from its container's label. The history is
//! the newest `limit` lines (0 = 1000, at most [`MAX_LIMIT`]) within
//! `since..=until`, across all
//! selected streams, in time order (an empty selector is refused: it would
//! read every log on the node); with `follow` the files are then tailed
//! (every 250 ms, rotation included) until the caller goes away. Unlike the
//! reference there is no separate log store: the shim's files are it, so
//! lines written while the agent was down are there too.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::executor::labels::{OWNED_FILTER, OwnedContainer};
use crate::logshim::KEEP_ROTATED;
use crate::proto::cluster::AssignmentSet;
use crate::proto::v1::{LogLine, LogQuery, LogSelector, LogSource};
use crate::runtime::{Containerd, containers};

use super::Out;

const DEFAULT_LIMIT: usize = 1000;
/// The most history lines one query returns (the lines are held in memory
/// to merge the streams by time); a larger `limit` is cut to this.
pub const MAX_LIMIT: usize = 10_000;
const FOLLOW_EVERY: Duration = Duration::from_millis(250);

/// One instance's log file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogStream {
    pub instance_id: String,
    pub path: PathBuf,
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

/// The log files of the selected instances that have a container here.
pub async fn streams(
    ctd: &Containerd,
    data_dir: &Path,
    set: Option<&AssignmentSet>,
    sel: &LogSelector,
) -> Result<Vec<LogStream>, Status> {
    // Builds log elsewhere: a build id selects nothing here.
    let Some(set) = set.filter(|_| sel.build_id.is_empty()) else {
        return Ok(Vec::new());
    };
    let wanted: std::collections::BTreeSet<&str> = set
        .assignments
        .iter()
        .filter(|a| selected(sel, a))
        .filter_map(|a| a.meta.as_ref().map(|m| m.id.as_str()))
        .collect();
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let listed = containers::list(ctd, &OWNED_FILTER)
        .await
        .map_err(|e| Status::internal(format!("QueryLogs: {e}")))?;
    let mut out: Vec<LogStream> = listed
        .iter()
        .filter_map(OwnedContainer::from_container)
        .filter(|o| wanted.contains(o.assignment_id.as_str()))
        .map(|o| LogStream {
            path: o.log_path.map_or_else(
                || {
                    data_dir
                        .join("logs")
                        .join(format!("{}.log", o.container_id))
                },
                PathBuf::from,
            ),
            instance_id: o.assignment_id,
        })
        .collect();
    out.sort_by(|a, b| a.instance_id.cmp(&b.instance_id));
    Ok(out)
}

/// Joins `P` chunks into whole lines, per source.
#[derive(Debug, Default)]
struct Assembler {
    partial: [String; 2],
}

impl Assembler {
    fn push(&mut self, l: &CriLine<'_>) -> Option<String> {
        let slot = &mut self.partial[usize::from(l.source == LogSource::Stderr)];
        slot.push_str(l.text);
        l.full.then(|| std::mem::take(slot))
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

/// Where a stream's history ended: the current file (inode) and its length.
type Offset = (u64, u64);

/// The newest `limit` lines of one stream within `window`, oldest first,
/// and the current file's length at the time.
fn history(stream: &LogStream, window: Window, limit: usize) -> (VecDeque<LogLine>, Offset) {
    let mut keep: VecDeque<LogLine> = VecDeque::with_capacity(limit.min(4096));
    let mut asm = Assembler::default();
    let mut files: Vec<PathBuf> = (1..=KEEP_ROTATED)
        .rev()
        .map(|n| PathBuf::from(format!("{}.{n}", stream.path.display())))
        .collect();
    files.push(stream.path.clone());
    let mut offset = (0, 0);
    for file in files {
        let Ok(f) = std::fs::File::open(&file) else {
            continue;
        };
        let ino = f.metadata().map_or(0, |m| m.ino());
        let mut reader = BufReader::new(f);
        let mut consumed: u64 = 0;
        let mut buf = Vec::new();
        loop {
            buf.clear();
            let n = match reader.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            // A line still being written is left to the follower.
            if buf.last() != Some(&b'\n') {
                break;
            }
            consumed += n as u64;
            let raw = String::from_utf8_lossy(&buf[..n - 1]);
            if let Some(line) = asm.take(&raw, window, &stream.instance_id) {
                if keep.len() == limit {
                    keep.pop_front();
                }
                keep.push_back(line);
            }
        }
        if file == stream.path {
            offset = (ino, consumed);
        }
    }
    (keep, offset)
}

/// The selected history, merged across streams by time, newest `limit`.
fn merged_history(
    streams: &[LogStream],
    window: Window,
    limit: usize,
) -> (Vec<LogLine>, Vec<Offset>) {
    let mut all = Vec::new();
    let mut offsets = Vec::with_capacity(streams.len());
    for s in streams {
        let (lines, offset) = history(s, window, limit);
        all.extend(lines);
        offsets.push(offset);
    }
    let key = |l: &LogLine| l.time.as_ref().map_or((0, 0), |t| (t.seconds, t.nanos));
    all.sort_by_key(key);
    let skip = all.len().saturating_sub(limit);
    (all.split_off(skip), offsets)
}

pub async fn query_logs(
    ctd: &Containerd,
    data_dir: &Path,
    desired: &watch::Receiver<Option<AssignmentSet>>,
    query: LogQuery,
) -> Result<Out<LogLine>, Status> {
    let selector = query.selector.clone().unwrap_or_default();
    if selector == LogSelector::default() {
        // The reference reads every stream on the node for this.
        return Err(Status::invalid_argument(
            "QueryLogs: an empty selector would read every log on the node; \
             name an instance, app, environment, project or job",
        ));
    }
    let set = desired.borrow().clone();
    let streams = streams(ctd, data_dir, set.as_ref(), &selector).await?;
    let window = Window::of(&query);
    let limit = match query.limit {
        0 => DEFAULT_LIMIT,
        n => usize::try_from(n).unwrap_or(MAX_LIMIT).min(MAX_LIMIT),
    };
    let (tx, rx) = mpsc::channel::<Result<LogLine, Status>>(256);
    let follow = query.follow;
    tokio::spawn(async move {
        let read = streams.clone();
        let Ok((lines, offsets)) =
            tokio::task::spawn_blocking(move || merged_history(&read, window, limit)).await
        else {
            return;
        };
        for line in lines {
            if tx.send(Ok(line)).await.is_err() {
                return;
            }
        }
        if follow && !streams.is_empty() {
            tail(streams, offsets, window, tx).await;
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// One followed file: where reading got to, and bytes of a line not yet
/// ended by a newline.
#[derive(Debug)]
struct Follower {
    stream: LogStream,
    ino: u64,
    offset: u64,
    rest: Vec<u8>,
    asm: Assembler,
}

impl Follower {
    /// New complete lines since the last call. Another file under the
    /// name (a rotation) is read from its start.
    fn poll(&mut self, window: Window) -> Vec<LogLine> {
        let Ok(mut file) = std::fs::File::open(&self.stream.path) else {
            return Vec::new();
        };
        let (ino, len) = file.metadata().map_or((0, 0), |m| (m.ino(), m.len()));
        if ino != self.ino || len < self.offset {
            self.ino = ino;
            self.offset = 0;
            self.rest.clear();
        }
        if len == self.offset || file.seek(SeekFrom::Start(self.offset)).is_err() {
            return Vec::new();
        }
        let mut fresh = Vec::new();
        if file.read_to_end(&mut fresh).is_err() {
            return Vec::new();
        }
        self.offset += fresh.len() as u64;
        self.rest.extend_from_slice(&fresh);
        let Some(end) = self.rest.iter().rposition(|b| *b == b'\n') else {
            return Vec::new();
        };
        let complete: Vec<u8> = self.rest.drain(..=end).collect();
        String::from_utf8_lossy(&complete)
            .lines()
            .filter_map(|raw| self.asm.take(raw, window, &self.stream.instance_id))
            .collect()
    }
}

async fn tail(
    streams: Vec<LogStream>,
    offsets: Vec<Offset>,
    window: Window,
    tx: mpsc::Sender<Result<LogLine, Status>>,
) {
    let mut followers: Vec<Follower> = streams
        .into_iter()
        .zip(offsets)
        .map(|(stream, (ino, offset))| Follower {
            stream,
            ino,
            offset,
            rest: Vec::new(),
            asm: Assembler::default(),
        })
        .collect();
    loop {
        tokio::select! {
            () = tx.closed() => return,
            () = tokio::time::sleep(FOLLOW_EVERY) => {}
        }
        for f in &mut followers {
            for line in f.poll(window) {
                if tx.send(Ok(line)).await.is_err() {
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

    #[test]
    fn history_spans_rotated_files_joins_chunks_and_keeps_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.log");
        write_lines(
            &PathBuf::from(format!("{}.1", path.display())),
            &[(1, "stdout", "F", "one"), (2, "stdout", "P", "tw")],
        );
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
            path: path.clone(),
        };
        let all = Window {
            since: None,
            until: None,
        };
        let (lines, offset) = history(&s, all, 10);
        let text: Vec<&str> = lines.iter().map(|l| l.line.as_str()).collect();
        assert_eq!(text, ["one", "two", "three", "four"]);
        assert_eq!(offset.1, std::fs::metadata(&path).unwrap().len());
        assert_eq!(lines[2].source, LogSource::Stderr as i32);
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

        // Following picks up complete lines only, and a rotation.
        let mut f = Follower {
            stream: s,
            ino: offset.0,
            offset: offset.1,
            rest: Vec::new(),
            asm: Assembler::default(),
        };
        assert!(f.poll(all).is_empty());
        write_lines(&path, &[(6, "stdout", "F", "five")]);
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        write!(file, "2026-").unwrap();
        let got: Vec<String> = f.poll(all).into_iter().map(|l| l.line).collect();
        assert_eq!(got, ["five"]);
        std::fs::rename(&path, format!("{}.1", path.display())).unwrap();
        write_lines(&path, &[(7, "stdout", "F", "six")]);
        let got: Vec<String> = f.poll(all).into_iter().map(|l| l.line).collect();
        assert_eq!(got, ["six"]);
    }
}
