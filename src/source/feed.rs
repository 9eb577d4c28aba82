//! Standalone: the executor fed from the manifest directory, loaded again
//! on every change. A directory that is missing, or goes, is looked for
//! again until it is back; what cannot load is a source error in `status`,
//! and the rest runs on.

use std::path::PathBuf;

use super::standalone::StandaloneSource;
use super::watch::watch;
use crate::executor::ExecutorHandle;
use crate::status::SourceError;

/// Feeds the executor from the manifest directory, reloading on changes.
pub async fn feed_from_manifests(
    dir: PathBuf,
    state_dir: PathBuf,
    pool: (u8, u8),
    handle: ExecutorHandle,
) {
    let mut source = StandaloneSource::new(dir.clone(), &state_dir);
    // Slots outside the pool belong to someone else (another agent, a test).
    source.reserve_subnets(
        (0..=255u8)
            .filter(|s| *s < pool.0 || *s > pool.1)
            .map(zattera_netns::Subnet::from_slot),
    );
    // A directory that is missing (not made yet, or removed) cannot be
    // watched: it is looked for again every WATCH_RETRY, and found, loaded.
    let mut watched = None;
    // What was logged last: the same again (a directory still missing) is
    // not logged every WATCH_RETRY.
    let (mut watch_error, mut load_errors) = (None, Vec::new());
    loop {
        if watched.is_none() {
            match watch(&dir) {
                Ok(w) => {
                    watched = Some(w);
                    watch_error = None;
                }
                Err(e) => {
                    let text = e.to_string();
                    if watch_error.as_ref() != Some(&text) {
                        tracing::error!(dir = %dir.display(), error = %e, "cannot watch the manifest directory; looking again every {} s", WATCH_RETRY.as_secs());
                    }
                    watch_error = Some(text);
                }
            }
        }
        let loaded = source.load();
        let texts: Vec<String> = loaded.errors.iter().map(|e| e.message.clone()).collect();
        if texts != load_errors {
            for e in &loaded.errors {
                tracing::error!(file = %e.file.display(), "{}", e.message);
            }
            load_errors = texts;
        }
        let errors = loaded
            .errors
            .iter()
            .map(|e| SourceError {
                file: e.file.display().to_string(),
                message: e.message.clone(),
            })
            .collect();
        let _ = handle.source_errors.send(errors);
        tracing::info!(
            assignments = loaded.set.assignments.len(),
            "manifests loaded"
        );
        let _ = handle.desired.send(Some(loaded.set));
        match watched.as_mut() {
            // The watch ends when the directory goes: look for it again.
            Some((_, changes)) => {
                if changes.recv().await.is_none() {
                    watched = None;
                }
            }
            None => tokio::time::sleep(WATCH_RETRY).await,
        }
    }
}

/// How often a manifest directory that cannot be watched is looked for.
const WATCH_RETRY: std::time::Duration = std::time::Duration::from_secs(5);
