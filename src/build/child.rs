//! The processes a build runs (the planner, buildah): output merged
//! into lines, and stopping them with a grace.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::mpsc;

/// The child's stdout and stderr, merged, line by line; closes when both
/// pipes have.
pub fn merged_lines(child: &mut tokio::process::Child) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel::<String>(64);
    let pipes: [Option<Box<dyn AsyncRead + Unpin + Send>>; 2] = [
        child.stdout.take().map(|p| Box::new(p) as _),
        child.stderr.take().map(|p| Box::new(p) as _),
    ];
    for pipe in pipes.into_iter().flatten() {
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(pipe).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if tx.send(line).await.is_err() {
                    return;
                }
            }
        });
    }
    rx
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
/// working container), then SIGKILL to its
/// group if it has not exited within `grace`.
pub async fn stop(
    child: &mut tokio::process::Child,
    signal: nix::sys::signal::Signal,
    grace: Duration,
) {
    let pid = child.id();
    if let Some(p) = pid.and_then(|p| i32::try_from(p).ok()) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), signal);
    }
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        kill_group(pid);
        let _ = child.wait().await;
    }
}
