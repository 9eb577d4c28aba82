//! Watching the manifest directory (inotify, through `notify`), so adding,
//! editing or deleting a file converges without a restart.
//!
//! Editors and `cp` produce bursts of events (create, several writes, close,
//! rename); the agent wants one reload per burst. Events are therefore
//! debounced on a small thread: a signal goes out once no relevant event has
//! arrived for [`DEBOUNCE`] (or at the latest [`MAX_DELAY`] after the burst
//! began, so a file written without pause still gets loaded). The channel
//! holds one pending signal; more changes before the agent reloads merge into
//! it, since a reload reads the whole directory anyway.
//!
//! Only events that can change what [`super::standalone`] reads count: a
//! non-hidden `*.toml` file, the directory itself, or an event that names no
//! path (an inotify queue overflow, which asks for a rescan). The watch is not
//! recursive. If the directory itself is deleted the watch ends; the agent
//! then looks for it every few seconds, and watches it again once it exists.

use std::path::{Path, PathBuf};
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use notify::event::{AccessKind, AccessMode};
use notify::{Event, EventKind, RecommendedWatcher, RecursiveMode, Watcher as _};
use tokio::sync::mpsc;

/// Quiet time that ends a burst of changes.
pub const DEBOUNCE: Duration = Duration::from_millis(200);
/// Longest a signal waits while changes keep coming.
pub const MAX_DELAY: Duration = Duration::from_secs(2);

/// Keeps the watch alive; dropping it stops watching and closes the channel.
#[derive(Debug)]
pub struct ManifestWatcher {
    _watcher: RecommendedWatcher,
}

#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot watch the manifest directory {}: {source}", dir.display())]
    Notify {
        dir: PathBuf,
        #[source]
        source: notify::Error,
    },
    #[error("cannot start the manifest watch thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Watches `dir` and sends `()` once per burst of relevant changes.
pub fn watch(dir: &Path) -> Result<(ManifestWatcher, mpsc::Receiver<()>), WatchError> {
    let (raw_tx, raw_rx) = std_mpsc::channel::<()>();
    let (tx, rx) = mpsc::channel(1);
    let root = dir.to_owned();
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<Event>| {
        let relevant = match res {
            Ok(event) => is_relevant(&event, &root),
            Err(e) => {
                tracing::warn!(dir = %root.display(), error = %e, "manifest watch error; reloading");
                true
            }
        };
        if relevant {
            // The debounce thread is gone only when the agent dropped the channel.
            let _ = raw_tx.send(());
        }
    })
    .map_err(|source| WatchError::Notify {
        dir: dir.to_owned(),
        source,
    })?;
    watcher
        .watch(dir, RecursiveMode::NonRecursive)
        .map_err(|source| WatchError::Notify {
            dir: dir.to_owned(),
            source,
        })?;
    std::thread::Builder::new()
        .name("manifest-watch".into())
        .spawn(move || debounce(&raw_rx, &tx, DEBOUNCE, MAX_DELAY))
        .map_err(WatchError::Thread)?;
    Ok((ManifestWatcher { _watcher: watcher }, rx))
}

fn is_relevant(event: &Event, dir: &Path) -> bool {
    match event.kind {
        // Opening or reading changes nothing; closing after a write does.
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => {}
        EventKind::Access(_) => return false,
        _ => {}
    }
    event.paths.is_empty()
        || event.paths.iter().any(|p| {
            p == dir
                || (p
                    .file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| !n.starts_with('.'))
                    && p.extension().is_some_and(|e| e == "toml"))
        })
}

/// Turns bursts on `raw` into single signals on `out`. Returns when either
/// side is closed.
fn debounce(
    raw: &std_mpsc::Receiver<()>,
    out: &mpsc::Sender<()>,
    quiet: Duration,
    max_delay: Duration,
) {
    while raw.recv().is_ok() {
        let began = Instant::now();
        let mut closed = false;
        loop {
            let left = max_delay.saturating_sub(began.elapsed());
            if left.is_zero() {
                break;
            }
            match raw.recv_timeout(quiet.min(left)) {
                Ok(()) => {}
                Err(std_mpsc::RecvTimeoutError::Timeout) => break,
                Err(std_mpsc::RecvTimeoutError::Disconnected) => {
                    closed = true;
                    break;
                }
            }
        }
        if let Err(mpsc::error::TrySendError::Closed(())) = out.try_send(()) {
            return;
        }
        if closed {
            return;
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::fs;

    use tokio::time::timeout;

    use super::*;

    /// Waits for a signal; `None` when none came within `wait`.
    async fn next(rx: &mut mpsc::Receiver<()>, wait: Duration) -> Option<()> {
        timeout(wait, rx.recv()).await.ok().flatten()
    }

    #[tokio::test]
    async fn one_signal_per_burst_of_manifest_changes() {
        let dir = tempfile::tempdir().unwrap();
        let (_watcher, mut rx) = watch(dir.path()).unwrap();

        for i in 0..5 {
            fs::write(dir.path().join(format!("app{i}.toml")), "x").unwrap();
        }
        assert_eq!(next(&mut rx, Duration::from_secs(5)).await, Some(()));
        assert_eq!(
            next(&mut rx, Duration::from_millis(700)).await,
            None,
            "the burst gave a second signal"
        );

        fs::remove_file(dir.path().join("app3.toml")).unwrap();
        assert_eq!(
            next(&mut rx, Duration::from_secs(5)).await,
            Some(()),
            "deletion"
        );
        fs::rename(dir.path().join("app1.toml"), dir.path().join("web.toml")).unwrap();
        assert_eq!(
            next(&mut rx, Duration::from_secs(5)).await,
            Some(()),
            "rename"
        );
    }

    #[tokio::test]
    async fn other_files_do_not_signal() {
        let dir = tempfile::tempdir().unwrap();
        let (_watcher, mut rx) = watch(dir.path()).unwrap();
        fs::write(dir.path().join(".web.toml.swp"), "x").unwrap();
        fs::write(dir.path().join("notes.txt"), "x").unwrap();
        fs::write(dir.path().join("web.toml~"), "x").unwrap();
        fs::create_dir(dir.path().join("sub")).unwrap();
        fs::write(dir.path().join("sub/deep.toml"), "x").unwrap();
        assert_eq!(next(&mut rx, Duration::from_millis(800)).await, None);
        // The watch is alive: a manifest does signal.
        fs::write(dir.path().join("web.toml"), "x").unwrap();
        assert_eq!(next(&mut rx, Duration::from_secs(5)).await, Some(()));
    }

    #[tokio::test]
    async fn dropping_the_watcher_closes_the_channel() {
        let dir = tempfile::tempdir().unwrap();
        let (watcher, mut rx) = watch(dir.path()).unwrap();
        drop(watcher);
        let closed = timeout(Duration::from_secs(5), rx.recv()).await;
        assert_eq!(closed, Ok(None), "the debounce thread must end");
    }

    #[test]
    fn a_missing_directory_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let err = watch(&missing).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
    }

    #[test]
    fn a_steady_stream_still_signals_within_the_max_delay() {
        let (raw_tx, raw_rx) = std_mpsc::channel();
        let (tx, mut rx) = mpsc::channel(1);
        let worker = std::thread::spawn(move || {
            debounce(
                &raw_rx,
                &tx,
                Duration::from_millis(100),
                Duration::from_millis(300),
            );
        });
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(1) {
            raw_tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(rx.try_recv(), Ok(()), "a signal despite no quiet time");
        drop(raw_tx);
        worker.join().unwrap();
    }
}
