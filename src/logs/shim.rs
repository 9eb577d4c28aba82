//! The log shim: run by containerd's runc shim as the `binary://` logger of
//! one container (DESIGN decision 4, dataplane.md §3), as the small
//! `zattera-logshim` binary (one process per container: it must be cheap),
//! or as the agent binary itself where that is missing.
//!
//! The runc shim starts it with the container's stdout on fd 3, stderr on
//! fd 4 and a readiness pipe on fd 5, and owns it for the task's lifetime,
//! so output keeps flowing while the agent is down or upgrading. Each line is
//! written in the CRI log format that kubelet, fluent-bit, Vector and promtail
//! read: `<RFC3339Nano> <stdout|stderr> <F|P> <line>`, `P` marking a chunk of
//! a line longer than [`MAX_LINE`]. The file rotates at [`ROTATE_BYTES`] or
//! [`ROTATE_AGE`] (LOG-5) to `<file>.<seq>`, which a second thread
//! compresses to `<file>.<seq>.zst` and then applies the retention caps to
//! (LOG-6, LOG-9; see [`super::files`]), so the copy never waits for zstd.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use super::files;
use super::retention::{self, Retention};

/// The argv key the runc shim passes us (from the log URI's query).
pub const ARG: &str = "zattera-log";
/// The retention caps, in seconds and bytes.
pub const ARG_MAX_AGE: &str = "zattera-log-max-age";
pub const ARG_MAX_BYTES: &str = "zattera-log-max-bytes";
/// The log shim's own binary, a small one (see `src/bin/zattera-logshim.rs`).
pub const BINARY: &str = "zattera-logshim";
pub const MAX_LINE: usize = 16 * 1024;
pub const ROTATE_BYTES: u64 = 8 * 1024 * 1024;
pub const ROTATE_AGE: Duration = Duration::from_secs(3600);

/// The `binary://` URI that makes the runc shim run `agent_binary` as the
/// logger of a container, writing to `log_path`, keeping its rotated files
/// within `caps`.
pub fn log_uri(agent_binary: &Path, log_path: &Path, caps: Retention) -> String {
    format!(
        "binary://{}?{ARG}={}&{ARG_MAX_AGE}={}&{ARG_MAX_BYTES}={}",
        percent_encode(&agent_binary.to_string_lossy()),
        percent_encode(&log_path.to_string_lossy()),
        caps.max_age.as_secs(),
        caps.max_stream_bytes,
    )
}

/// The binary to run as the log shim of the agent at `agent`: the small
/// `zattera-logshim` beside it (a build directory) or in `../lib/zattera`
/// (the packages' `/usr/lib/zattera`), else the agent itself, which serves
/// as its own log shim too (containers made by an older agent still name it).
pub fn binary_for(agent: &Path) -> PathBuf {
    let Some(dir) = agent.parent() else {
        return agent.to_owned();
    };
    [dir.join(BINARY), dir.join("../lib/zattera").join(BINARY)]
        .into_iter()
        .find(|p| is_executable(p))
        // `/usr/bin/../lib/zattera/...` reads as `/usr/lib/zattera/...` in
        // the log URI and in `ps`.
        .map_or_else(|| agent.to_owned(), |p| fs::canonicalize(&p).unwrap_or(p))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn percent_encode(s: &str) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// What the runc shim started us with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShimArgs {
    pub log_path: PathBuf,
    pub caps: Retention,
}

/// If this process was started as a log shim (`<agent> zattera-log <path>
/// [<key> <value>]...`, the pairs in any order), what it was started with.
/// A cap that is absent or unreadable is the default.
pub fn invoked_as_shim(args: &[String]) -> Option<ShimArgs> {
    let pairs = args.get(1..)?;
    if pairs.len() % 2 != 0 {
        return None;
    }
    let value = |key: &str| pairs.chunks(2).find(|p| p[0] == key).map(|p| p[1].as_str());
    let number = |key: &str| value(key).and_then(|v| v.parse::<u64>().ok());
    let defaults = Retention::default();
    Some(ShimArgs {
        log_path: PathBuf::from(value(ARG)?),
        caps: Retention {
            max_age: number(ARG_MAX_AGE).map_or(defaults.max_age, Duration::from_secs),
            max_stream_bytes: number(ARG_MAX_BYTES).unwrap_or(defaults.max_stream_bytes),
        },
    })
}

/// Runs the shim until both streams reach EOF and every rotated file is
/// compressed. Errors go to stderr, which the runc shim forwards to its own
/// log.
pub fn run(args: &ShimArgs) -> io::Result<()> {
    // The runc shim sends SIGTERM when the task's IO closes; we exit at EOF
    // anyway, and must not die before draining what is still in the pipes.
    let mut term = nix::sys::signal::SigSet::empty();
    term.add(nix::sys::signal::Signal::SIGTERM);
    term.thread_block().map_err(io::Error::from)?;

    let (rotated_tx, rotated_rx) = mpsc::channel::<PathBuf>();
    let log_path = args.log_path.clone();
    let caps = args.caps;
    let compressor = std::thread::spawn(move || {
        for raw in rotated_rx {
            if let Err(e) = files::compress(&raw) {
                eprintln!("zattera-agent log shim: compress {}: {e}", raw.display());
            }
            for old in retention::expired_of_container(&log_path, caps, SystemTime::now()) {
                let _ = fs::remove_file(old);
            }
        }
    });

    let writer = Arc::new(Mutex::new(RotatingFile::open(
        args.log_path.clone(),
        Some(rotated_tx),
    )?));
    // Reopening through /proc gives our own read ends of the same pipes
    // without taking ownership of raw descriptors.
    let stdout = File::open("/proc/self/fd/3")?;
    let stderr = File::open("/proc/self/fd/4")?;
    // A larger pipe lets a burst wait in the kernel instead of blocking the
    // container's write while a line batch is on its way to disk.
    for pipe in [&stdout, &stderr] {
        let _ = nix::fcntl::fcntl(
            pipe,
            nix::fcntl::FcntlArg::F_SETPIPE_SZ(i32::try_from(PIPE_BYTES).unwrap_or(i32::MAX)),
        );
    }
    // Ready: the runc shim starts the task once fd 5 is closed.
    nix::unistd::close(5).map_err(io::Error::from)?;

    let handles: Vec<_> = [(stdout, "stdout"), (stderr, "stderr")]
        .into_iter()
        .map(|(input, stream)| {
            let writer = Arc::clone(&writer);
            std::thread::spawn(move || copy_lines(input, stream, &writer))
        })
        .collect();
    let mut result = Ok(());
    for h in handles {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => result = Err(e),
            Err(_) => result = Err(io::Error::other("log copy thread panicked")),
        }
    }
    // Both copies are done: dropping the writer ends the compressor's queue.
    drop(writer);
    if compressor.join().is_err() {
        result = Err(io::Error::other("log compressor thread panicked"));
    }
    result
}

/// Splits `input` into CRI lines until EOF: what one read brings is written
/// with one write, whole lines only.
fn copy_lines(mut input: impl Read, stream: &str, out: &Mutex<RotatingFile>) -> io::Result<()> {
    let mut buf = vec![0u8; READ_BYTES];
    let mut framer = Framer::new(stream);
    let mut batch: Vec<u8> = Vec::with_capacity(READ_BYTES * 2);
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        batch.clear();
        framer.frame(&buf[..n], SystemTime::now(), &mut batch);
        write_batch(out, &batch)?;
    }
    // Output that ended without a newline is still a whole line.
    batch.clear();
    framer.finish(SystemTime::now(), &mut batch);
    write_batch(out, &batch)
}

/// What one read takes from the pipe at most: every line of a read gets
/// its time, so a smaller read keeps the times close to when lines were
/// written (about 6 ms at 20 MiB/s) at the cost of a few more syscalls.
const READ_BYTES: usize = 128 << 10;
/// How much the pipe holds (F_SETPIPE_SZ; 1 MiB is what an unprivileged
/// process may ask for by default).
const PIPE_BYTES: usize = 1 << 20;

/// Turns a stream's bytes into CRI lines: `<time> <stream> F <line>`, and
/// `P` for each [`MAX_LINE`] chunk of a longer line. Bytes are copied once,
/// from the read buffer into the batch; every line of a read gets that
/// read's time.
#[derive(Debug)]
struct Framer {
    stream: &'static str,
    /// The start of a line whose end has not been read yet.
    pending: Vec<u8>,
}

impl Framer {
    fn new(stream: &str) -> Self {
        Self {
            stream: if stream == "stderr" {
                "stderr"
            } else {
                "stdout"
            },
            pending: Vec::with_capacity(MAX_LINE),
        }
    }

    fn frame(&mut self, mut chunk: &[u8], at: SystemTime, out: &mut Vec<u8>) {
        let time = humantime::format_rfc3339_nanos(at).to_string();
        while !chunk.is_empty() {
            let room = MAX_LINE - self.pending.len();
            let window = &chunk[..room.min(chunk.len())];
            if let Some(end) = memchr::memchr(b'\n', window) {
                self.emit(&time, 'F', &chunk[..end], out);
                chunk = &chunk[end + 1..];
            } else if chunk.len() >= room {
                self.emit(&time, 'P', window, out);
                chunk = &chunk[room..];
            } else {
                self.pending.extend_from_slice(chunk);
                chunk = &[];
            }
        }
    }

    fn finish(&mut self, at: SystemTime, out: &mut Vec<u8>) {
        if !self.pending.is_empty() {
            let time = humantime::format_rfc3339_nanos(at).to_string();
            self.emit(&time, 'F', &[], out);
        }
    }

    /// One line: the pending start, then `tail`.
    fn emit(&mut self, time: &str, tag: char, tail: &[u8], out: &mut Vec<u8>) {
        out.extend_from_slice(time.as_bytes());
        out.push(b' ');
        out.extend_from_slice(self.stream.as_bytes());
        out.push(b' ');
        out.push(if tag == 'F' { b'F' } else { b'P' });
        out.push(b' ');
        out.extend_from_slice(&self.pending);
        self.pending.clear();
        out.extend_from_slice(tail);
        out.push(b'\n');
    }
}

fn write_batch(out: &Mutex<RotatingFile>, batch: &[u8]) -> io::Result<()> {
    if batch.is_empty() {
        return Ok(());
    }
    let mut file = out
        .lock()
        .map_err(|_| io::Error::other("log writer lock poisoned"))?;
    file.append(batch)
}

/// The live log file; rotated files go to the compressor.
#[derive(Debug)]
struct RotatingFile {
    path: PathBuf,
    file: File,
    size: u64,
    opened: Instant,
    next_seq: u64,
    rotated: Option<mpsc::Sender<PathBuf>>,
}

/// A live file whose last line has no newline (a power cut, or a shim
/// killed in its write) is cut back to its last whole line, as journald
/// seals a torn journal: the next shim's first line is never glued to a
/// torn one (58.3). Its size after.
fn seal_torn_tail(file: &File) -> io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let size = file.metadata()?.len();
    if size == 0 {
        return Ok(0);
    }
    let mut last = [0u8; 1];
    file.read_exact_at(&mut last, size - 1)?;
    if last[0] == b'\n' {
        return Ok(size);
    }
    // Back from the end in 64 KiB steps to the last newline.
    let mut end = size;
    let mut buf = vec![0u8; 64 << 10];
    let keep = loop {
        let start = end.saturating_sub(buf.len() as u64);
        let chunk = &mut buf[..usize::try_from(end - start).unwrap_or(0)];
        file.read_exact_at(chunk, start)?;
        if let Some(i) = chunk.iter().rposition(|b| *b == b'\n') {
            break start + i as u64 + 1;
        }
        if start == 0 {
            break 0;
        }
        end = start;
    };
    file.set_len(keep)?;
    file.sync_data()?;
    Ok(keep)
}

impl RotatingFile {
    fn open(path: PathBuf, rotated: Option<mpsc::Sender<PathBuf>>) -> io::Result<Self> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        if let Some(dir) = path.parent() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
        }
        // Container output is nobody else's to read.
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .mode(0o600)
            .open(&path)?;
        let size = seal_torn_tail(&file)?;
        Ok(Self {
            next_seq: files::next_seq(&path),
            path,
            file,
            size,
            opened: Instant::now(),
            rotated,
        })
    }

    /// Appends whole lines; one write, so readers never see a torn line
    /// from the other stream.
    fn append(&mut self, lines: &[u8]) -> io::Result<()> {
        if self.size > 0 && (self.size >= ROTATE_BYTES || self.opened.elapsed() >= ROTATE_AGE) {
            self.rotate()?;
        }
        self.file.write_all(lines)?;
        self.size += lines.len() as u64;
        Ok(())
    }

    #[allow(clippy::disallowed_methods)] // a rotation: the segment is synced when compressed (files::compress)
    fn rotate(&mut self) -> io::Result<()> {
        let to = files::rotated(&self.path, self.next_seq);
        fs::rename(&self.path, &to)?;
        let rotated = self.rotated.take();
        *self = Self::open(self.path.clone(), None)?;
        if let Some(tx) = &rotated {
            // A compressor gone (it cannot be while we run) leaves the raw
            // file to the janitor.
            let _ = tx.send(to);
        }
        self.rotated = rotated;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    /// 58.3: a torn last line is cut away at open, so the next line starts
    /// a line of its own.
    #[test]
    fn a_torn_tail_is_sealed_when_a_shim_opens_the_file() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("c.log");
        let whole = "2026-12-07T00:00:00Z stdout F one\n";
        fs::write(&path, format!("{whole}2026-12-07T00:00:01Z stdout F tw")).unwrap();
        let mut f = RotatingFile::open(path.clone(), None).unwrap();
        f.append(b"2026-12-07T00:00:02Z stdout F three\n").unwrap();
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            format!("{whole}2026-12-07T00:00:02Z stdout F three\n")
        );
        // Whole files are left as they are; a file of one torn line empties.
        let whole_only = d.path().join("w.log");
        fs::write(&whole_only, whole).unwrap();
        assert_eq!(
            RotatingFile::open(whole_only, None).unwrap().size,
            whole.len() as u64
        );
        let torn_only = d.path().join("t.log");
        fs::write(&torn_only, "x".repeat(200_000)).unwrap();
        assert_eq!(RotatingFile::open(torn_only.clone(), None).unwrap().size, 0);
        assert_eq!(fs::metadata(&torn_only).unwrap().len(), 0);
    }

    #[test]
    fn the_small_shim_is_found_beside_the_agent_or_in_lib_zattera() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let bin = root.path().join("usr/bin");
        let lib = root.path().join("usr/lib/zattera");
        fs::create_dir_all(&bin).unwrap();
        fs::create_dir_all(&lib).unwrap();
        let agent = bin.join("zattera-agent");
        let put = |p: &Path, mode: u32| {
            fs::write(p, b"#!/bin/true\n").unwrap();
            fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
        };
        put(&agent, 0o755);
        // None: the agent is its own log shim.
        assert_eq!(binary_for(&agent), agent);
        // Not executable: not taken.
        put(&lib.join(BINARY), 0o644);
        assert_eq!(binary_for(&agent), agent);
        put(&lib.join(BINARY), 0o755);
        let canonical = |p: &Path| fs::canonicalize(p).unwrap();
        assert_eq!(
            binary_for(&agent),
            canonical(&lib.join(BINARY)),
            "no `..` in it"
        );
        // Beside the agent (a build directory) wins.
        put(&bin.join(BINARY), 0o755);
        assert_eq!(binary_for(&agent), canonical(&bin.join(BINARY)));
    }

    #[test]
    fn uri_encodes_paths_and_shim_args_round_trip() {
        let caps = Retention {
            max_age: Duration::from_secs(60),
            max_stream_bytes: 1000,
        };
        let uri = log_uri(
            Path::new("/usr/bin/zattera-agent"),
            Path::new("/var/lib/z/logs/a b.log"),
            caps,
        );
        assert_eq!(
            uri,
            "binary:///usr/bin/zattera-agent?zattera-log=/var/lib/z/logs/a%20b.log\
             &zattera-log-max-age=60&zattera-log-max-bytes=1000"
        );
        // The runc shim passes the pairs in any order.
        let args: Vec<String> = [
            "/usr/bin/zattera-agent",
            ARG_MAX_BYTES,
            "1000",
            ARG,
            "/x.log",
            ARG_MAX_AGE,
            "60",
        ]
        .map(String::from)
        .to_vec();
        let want = ShimArgs {
            log_path: PathBuf::from("/x.log"),
            caps,
        };
        assert_eq!(invoked_as_shim(&args), Some(want));
        // A shim started by an agent from before the caps: the defaults.
        let args: Vec<String> = ["/usr/bin/zattera-agent", ARG, "/x.log"]
            .map(String::from)
            .to_vec();
        assert_eq!(
            invoked_as_shim(&args).map(|a| a.caps),
            Some(Retention::default())
        );
        for args in [
            vec!["zattera-agent", "run"],
            vec!["zattera-agent", "run", "x"],
            vec![],
        ] {
            let args: Vec<String> = args.into_iter().map(String::from).collect();
            assert_eq!(invoked_as_shim(&args), None, "{args:?}");
        }
    }

    fn framed(framer: &mut Framer, chunks: &[&[u8]]) -> Vec<String> {
        let mut out = Vec::new();
        let at = SystemTime::UNIX_EPOCH;
        for c in chunks {
            framer.frame(c, at, &mut out);
        }
        framer.finish(at, &mut out);
        String::from_utf8(out)
            .unwrap()
            .lines()
            .map(|l| l.split_once(' ').unwrap().1.to_owned())
            .collect()
    }

    #[test]
    fn frames_lines_across_reads_and_marks_long_ones_partial() {
        let mut f = Framer::new("stdout");
        assert_eq!(
            framed(&mut f, &[b"one\ntw", b"o\n\n", b"end"]),
            ["stdout F one", "stdout F two", "stdout F ", "stdout F end"]
        );
        // A line of exactly MAX_LINE bytes: one full chunk, then its end.
        let mut exact = vec![b'x'; MAX_LINE];
        exact.push(b'\n');
        let got = framed(&mut Framer::new("stderr"), &[&exact]);
        assert_eq!(got.len(), 2);
        assert!(got[0].starts_with("stderr P xxx") && got[0].len() == 9 + MAX_LINE);
        assert_eq!(got[1], "stderr F ");
        // Longer, split over reads: chunks of MAX_LINE, the rest whole.
        let long = vec![b'y'; MAX_LINE + 10];
        let (a, b) = long.split_at(100);
        let got = framed(&mut Framer::new("stdout"), &[a, b, b"\n"]);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].len(), 9 + MAX_LINE);
        assert_eq!(got[1], format!("stdout F {}", "y".repeat(10)));
    }

    #[test]
    fn writes_cri_lines_and_rotates_to_the_compressor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.log");
        let (tx, rx) = mpsc::channel();
        let out = Mutex::new(RotatingFile::open(path.clone(), Some(tx)).unwrap());
        copy_lines(&b"hello\nworld"[..], "stderr", &out).unwrap();
        let text = fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        for (line, want) in lines.iter().zip(["hello", "world"]) {
            let parts: Vec<&str> = line.splitn(4, ' ').collect();
            assert!(humantime::parse_rfc3339(parts[0]).is_ok(), "{line}");
            assert_eq!(&parts[1..], ["stderr", "F", want]);
        }

        out.lock().unwrap().size = ROTATE_BYTES;
        copy_lines(&b"after\n"[..], "stdout", &out).unwrap();
        let first = rx.try_recv().unwrap();
        assert_eq!(first, dir.path().join("c.log.1"));
        assert!(fs::read_to_string(&first).unwrap().contains("hello"));
        let current = fs::read_to_string(&path).unwrap();
        assert!(current.ends_with(" stdout F after\n") && current.lines().count() == 1);

        // Seq only grows, past what is on disk from before.
        files::compress(&first).unwrap();
        out.lock().unwrap().size = ROTATE_BYTES;
        copy_lines(&b"again\n"[..], "stdout", &out).unwrap();
        assert_eq!(rx.try_recv().unwrap(), dir.path().join("c.log.2"));
    }
}
