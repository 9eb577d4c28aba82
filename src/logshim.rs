//! The log shim: the agent binary run by containerd's runc shim as the
//! `binary://` logger of one container (DESIGN decision 4, dataplane.md §3).
//!
//! The runc shim starts it with the container's stdout on fd 3, stderr on
//! fd 4 and a readiness pipe on fd 5, and owns it for the task's lifetime,
//! so output keeps flowing while the agent is down or upgrading. Each line is
//! written in the CRI log format that kubelet, fluent-bit, Vector and promtail
//! read: `<RFC3339Nano> <stdout|stderr> <F|P> <line>`, `P` marking a chunk of
//! a line longer than [`MAX_LINE`]. Files rotate at [`ROTATE_BYTES`] or
//! [`ROTATE_AGE`] (LOG-5), keeping [`KEEP_ROTATED`] old files (~100 MiB).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// The argv key the runc shim passes us (from the log URI's query).
pub const ARG: &str = "zattera-log";
pub const MAX_LINE: usize = 16 * 1024;
pub const ROTATE_BYTES: u64 = 8 * 1024 * 1024;
pub const ROTATE_AGE: Duration = Duration::from_secs(3600);
pub const KEEP_ROTATED: usize = 12;

/// The `binary://` URI that makes the runc shim run `agent_binary` as the
/// logger of a container, writing to `log_path`.
pub fn log_uri(agent_binary: &Path, log_path: &Path) -> String {
    format!(
        "binary://{}?{ARG}={}",
        percent_encode(&agent_binary.to_string_lossy()),
        percent_encode(&log_path.to_string_lossy())
    )
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

/// If this process was started as a log shim (`<agent> zattera-log <path>`),
/// returns the log file path.
pub fn invoked_as_shim(args: &[String]) -> Option<PathBuf> {
    match args {
        [_, key, path] if key == ARG => Some(PathBuf::from(path)),
        _ => None,
    }
}

/// Runs the shim until both streams reach EOF. Errors go to stderr, which
/// the runc shim forwards to its own log.
pub fn run(log_path: &Path) -> io::Result<()> {
    // The runc shim sends SIGTERM when the task's IO closes; we exit at EOF
    // anyway, and must not die before draining what is still in the pipes.
    let mut term = nix::sys::signal::SigSet::empty();
    term.add(nix::sys::signal::Signal::SIGTERM);
    term.thread_block().map_err(io::Error::from)?;

    let writer = Arc::new(Mutex::new(RotatingFile::open(log_path.to_path_buf())?));
    // Reopening through /proc gives our own read ends of the same pipes
    // without taking ownership of raw descriptors.
    let stdout = File::open("/proc/self/fd/3")?;
    let stderr = File::open("/proc/self/fd/4")?;
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
    result
}

/// Splits `input` into CRI lines until EOF.
fn copy_lines(mut input: impl Read, stream: &str, out: &Mutex<RotatingFile>) -> io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut pending: Vec<u8> = Vec::with_capacity(MAX_LINE);
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        for record in split_records(&mut pending, &buf[..n]) {
            write_record(out, stream, &record)?;
        }
    }
    if !pending.is_empty() {
        // Output that ended without a newline is still a whole line.
        write_record(
            out,
            stream,
            &Record {
                full: true,
                data: std::mem::take(&mut pending),
            },
        )?;
    }
    Ok(())
}

#[derive(Debug, PartialEq, Eq)]
struct Record {
    full: bool,
    data: Vec<u8>,
}

/// Feeds `chunk` into the line assembler; returns the finished records.
fn split_records(pending: &mut Vec<u8>, chunk: &[u8]) -> Vec<Record> {
    let mut out = Vec::new();
    for &b in chunk {
        if b == b'\n' {
            out.push(Record {
                full: true,
                data: std::mem::take(pending),
            });
        } else {
            pending.push(b);
            if pending.len() >= MAX_LINE {
                out.push(Record {
                    full: false,
                    data: std::mem::take(pending),
                });
            }
        }
    }
    out
}

fn write_record(out: &Mutex<RotatingFile>, stream: &str, record: &Record) -> io::Result<()> {
    let time = humantime::format_rfc3339_nanos(SystemTime::now());
    let tag = if record.full { 'F' } else { 'P' };
    let mut line = Vec::with_capacity(record.data.len() + 48);
    write!(line, "{time} {stream} {tag} ")?;
    line.extend_from_slice(&record.data);
    line.push(b'\n');
    let mut file = out
        .lock()
        .map_err(|_| io::Error::other("log writer lock poisoned"))?;
    file.append(&line)
}

/// The current log file plus its rotated predecessors `<path>.1` … `<path>.N`.
#[derive(Debug)]
struct RotatingFile {
    path: PathBuf,
    file: File,
    size: u64,
    opened: Instant,
}

impl RotatingFile {
    fn open(path: PathBuf) -> io::Result<Self> {
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
            .mode(0o600)
            .open(&path)?;
        let size = file.metadata()?.len();
        Ok(Self {
            path,
            file,
            size,
            opened: Instant::now(),
        })
    }

    fn append(&mut self, line: &[u8]) -> io::Result<()> {
        if self.size > 0 && (self.size >= ROTATE_BYTES || self.opened.elapsed() >= ROTATE_AGE) {
            self.rotate()?;
        }
        // One write per line: readers never see a torn line from the other stream.
        self.file.write_all(line)?;
        self.size += line.len() as u64;
        Ok(())
    }

    fn rotate(&mut self) -> io::Result<()> {
        let numbered = |n: usize| PathBuf::from(format!("{}.{n}", self.path.display()));
        let _ = fs::remove_file(numbered(KEEP_ROTATED));
        for n in (1..KEEP_ROTATED).rev() {
            let from = numbered(n);
            if from.exists() {
                fs::rename(&from, numbered(n + 1))?;
            }
        }
        fs::rename(&self.path, numbered(1))?;
        *self = Self::open(self.path.clone())?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_encodes_paths_and_shim_args_round_trip() {
        let uri = log_uri(
            Path::new("/usr/bin/zattera-agent"),
            Path::new("/var/lib/z/logs/a b.log"),
        );
        assert_eq!(
            uri,
            "binary:///usr/bin/zattera-agent?zattera-log=/var/lib/z/logs/a%20b.log"
        );
        let args: Vec<String> = ["/usr/bin/zattera-agent", ARG, "/x.log"]
            .map(String::from)
            .to_vec();
        assert_eq!(invoked_as_shim(&args), Some(PathBuf::from("/x.log")));
        let args: Vec<String> = ["zattera-agent", "run"].map(String::from).to_vec();
        assert_eq!(invoked_as_shim(&args), None);
    }

    #[test]
    fn splits_lines_and_marks_long_ones_partial() {
        let mut pending = Vec::new();
        let r = split_records(&mut pending, b"one\ntw");
        assert_eq!(
            r,
            vec![Record {
                full: true,
                data: b"one".to_vec()
            }]
        );
        let r = split_records(&mut pending, b"o\n\n");
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].data, b"two");
        assert!(r[1].full && r[1].data.is_empty());

        let long = vec![b'x'; MAX_LINE + 10];
        let mut input = long.clone();
        input.push(b'\n');
        let r = split_records(&mut pending, &input);
        assert_eq!(r.len(), 2);
        assert!(!r[0].full && r[0].data.len() == MAX_LINE);
        assert!(r[1].full && r[1].data.len() == 10);
    }

    #[test]
    fn writes_cri_lines_and_rotates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.log");
        let out = Mutex::new(RotatingFile::open(path.clone()).unwrap());
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
        assert!(
            fs::read_to_string(format!("{}.1", path.display()))
                .unwrap()
                .contains("hello")
        );
        let current = fs::read_to_string(&path).unwrap();
        assert!(current.ends_with(" stdout F after\n") && current.lines().count() == 1);
    }
}
