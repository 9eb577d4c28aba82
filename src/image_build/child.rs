//! The processes a build runs (the planner, buildah): output merged
//! into lines, and stopping them with a grace.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::mpsc;

/// Output lines longer than this are split into pieces of this size: a
/// `RUN` step can print gigabytes without a newline (45.3).
pub const MAX_LINE: usize = 64 * 1024;

/// The child's stdout and stderr, merged, line by line; closes when both
/// pipes have. Bytes, not text: a long line is split at [`MAX_LINE`] and
/// invalid UTF-8 is decoded lossily, so the pipes are always drained (a
/// reader that stopped on bad UTF-8 left the child blocked on a full pipe).
pub fn merged_lines(child: &mut tokio::process::Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel::<String>(64);
    let pipes: [Option<Box<dyn AsyncRead + Unpin + Send>>; 2] = [
        child.stdout.take().map(|p| Box::new(p) as _),
        child.stderr.take().map(|p| Box::new(p) as _),
    ];
    for pipe in pipes.into_iter().flatten() {
        tokio::spawn(forward_lines(pipe, tx.clone()));
    }
    rx
}

/// Sends every line of `pipe` (split at [`MAX_LINE`], without its `\n` or
/// `\r\n`), until it ends or nobody listens.
async fn forward_lines(pipe: impl AsyncRead + Unpin, tx: mpsc::Sender<String>) {
    let mut reader = BufReader::new(pipe);
    let mut line: Vec<u8> = Vec::new();
    loop {
        let buf = match reader.fill_buf().await {
            Ok(buf) if !buf.is_empty() => buf,
            _ => break,
        };
        let room = MAX_LINE - line.len();
        let (take, ends) = match memchr::memchr(b'\n', buf) {
            Some(i) if i < room => (i + 1, true),
            _ => (buf.len().min(room), false),
        };
        line.extend_from_slice(&buf[..take]);
        reader.consume(take);
        if ends {
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
        } else if line.len() < MAX_LINE {
            continue;
        }
        let text = String::from_utf8_lossy(&line).into_owned();
        line.clear();
        if tx.send(text).await.is_err() {
            return;
        }
    }
    if !line.is_empty() {
        let _ = tx.send(String::from_utf8_lossy(&line).into_owned()).await;
    }
}

/// SIGKILL to the process group led by `pid`.
pub fn kill_group(pid: Option<u32>) {
    if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// `signal` to the child (its own handler cleans up: buildah removes its
/// working container), then SIGKILL to its group if it has not exited
/// within `grace`. Whatever the child had started when the stop began is
/// then killed too and waited for: a `RUN` step's container runs in a
/// session of its own, which the group signal does not reach and which
/// can outlive buildah by a moment (or for good, after a SIGKILL).
pub async fn stop(
    child: &mut tokio::process::Child,
    signal: nix::sys::signal::Signal,
    grace: Duration,
) {
    let pid = child.id();
    let started: Vec<Proc> = pid
        .and_then(|p| i32::try_from(p).ok())
        .map(descendants)
        .unwrap_or_default();
    if let Some(p) = pid.and_then(|p| i32::try_from(p).ok()) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), signal);
    }
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        kill_group(pid);
        let _ = child.wait().await;
    }
    for p in started.iter().filter(|p| p.alive()) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p.pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let deadline = tokio::time::Instant::now() + LEFTOVER_WAIT;
    while started.iter().any(Proc::alive) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How long [`stop`] waits for a killed leftover to be gone.
const LEFTOVER_WAIT: Duration = Duration::from_secs(5);

/// A process, with its start time so that a reused pid is not taken for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Proc {
    pid: i32,
    start: u64,
}

impl Proc {
    /// Still there and not yet a zombie.
    fn alive(&self) -> bool {
        read_stat(self.pid).is_some_and(|s| s.start == self.start && s.state != 'Z')
    }
}

struct Stat {
    state: char,
    ppid: i32,
    start: u64,
}

/// Fields 3, 4 and 22 of `/proc/<pid>/stat` (after the command name, which
/// may itself hold spaces and parentheses).
fn read_stat(pid: i32) -> Option<Stat> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&stat)
}

fn parse_stat(stat: &str) -> Option<Stat> {
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(Stat {
        state: fields.first()?.chars().next()?,
        ppid: fields.get(1)?.parse().ok()?,
        start: fields.get(19)?.parse().ok()?,
    })
}

/// Every process below `root` now, from one reading of /proc.
fn descendants(root: i32) -> Vec<Proc> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let all: Vec<(i32, Stat)> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter_map(|pid| Some((pid, read_stat(pid)?)))
        .collect();
    let mut found = Vec::new();
    let mut parents = vec![root];
    while let Some(parent) = parents.pop() {
        for (pid, stat) in all.iter().filter(|(_, s)| s.ppid == parent) {
            found.push(Proc {
                pid: *pid,
                start: stat.start,
            });
            parents.push(*pid);
        }
    }
    found
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_after_a_command_name_with_spaces() {
        let line =
            "4242 (buildah (x) y) S 17 4242 4242 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 98765 1 2";
        let s = parse_stat(line).unwrap();
        assert_eq!((s.state, s.ppid, s.start), ('S', 17, 98765));
        assert!(parse_stat("4242 (x) S").is_none());
    }

    /// 45.3: one line of a MiB and invalid UTF-8 neither grow one string
    /// nor stop the reader (which left the child blocked on a full pipe).
    #[tokio::test]
    async fn long_lines_are_split_and_bad_utf8_does_not_stop_the_reader() {
        let mut child = tokio::process::Command::new("sh")
            .args([
                "-c",
                "head -c 1000000 /dev/zero | tr '\\0' A; printf '\\377\\376 bad\\r\\n'; echo after",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut rx = merged_lines(&mut child);
        let mut lines = Vec::new();
        while let Some(l) = rx.recv().await {
            lines.push(l);
        }
        assert!(lines.iter().all(|l| l.len() <= MAX_LINE));
        let a: usize = lines
            .iter()
            .map(|l| l.chars().filter(|c| *c == 'A').count())
            .sum();
        assert_eq!(a, 1_000_000, "every byte arrives");
        assert!(
            lines
                .iter()
                .any(|l| l.ends_with(" bad") && l.contains('\u{fffd}')),
            "{:?}",
            &lines[lines.len() - 2..]
        );
        assert_eq!(lines.last().map(String::as_str), Some("after"));
    }

    #[tokio::test]
    async fn stop_kills_what_the_child_started_in_a_session_of_its_own() {
        // sh starts a grandchild that leaves the group (setsid), as a RUN
        // step's container does, then waits for it to be killed.
        let mut cmd = tokio::process::Command::new("sh");
        // Not `sleep 300`: tests/build.rs looks for a RUN step of that name
        // on the whole machine.
        cmd.args(["-c", "setsid sleep 299 & echo $! ; wait"])
            .stdout(std::process::Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd.spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let grandchild: i32 = out.next_line().await.unwrap().unwrap().parse().unwrap();
        let before = read_stat(grandchild).unwrap();
        stop(
            &mut child,
            nix::sys::signal::Signal::SIGTERM,
            Duration::from_millis(200),
        )
        .await;
        let gone = Proc {
            pid: grandchild,
            start: before.start,
        };
        assert!(!gone.alive(), "the setsid grandchild outlived the stop");
    }
}
