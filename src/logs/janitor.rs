//! The log janitor (LOG-9's periodic pass): one [`sweep`] at start, then
//! one an hour, with the containers that exist at that moment, so quiet
//! streams and removed containers are held to retention too.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use super::retention::{Retention, Swept, sweep};
use crate::labels::MANAGED;
use crate::runtime::{Containerd, containers};

pub const EVERY: Duration = Duration::from_secs(3600);

/// Sweeps `dir` every `every` until the task is dropped, counting what
/// each sweep freed with `freed` (bytes).
pub async fn run(
    ctd: Containerd,
    dir: PathBuf,
    caps: Retention,
    every: Duration,
    freed: impl Fn(u64) + Send,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let swept = once(&ctd, dir.clone(), caps).await;
        if let Ok(s) = &swept {
            freed(s.bytes_freed);
        }
        match swept {
            Ok(s) if s.removed + s.compressed > 0 || !s.errors.is_empty() => tracing::info!(
                removed = s.removed,
                bytes_freed = s.bytes_freed,
                compressed = s.compressed,
                errors = ?s.errors,
                "log janitor"
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(dir = %dir.display(), "log janitor: {e}"),
        }
    }
}

/// One sweep. A containerd that cannot list its containers skips it: a
/// live file is never deleted on a guess.
pub async fn once(ctd: &Containerd, dir: PathBuf, caps: Retention) -> anyhow::Result<Swept> {
    let existing: BTreeSet<String> = containers::list(ctd, &[(MANAGED, "true")])
        .await?
        .into_iter()
        .map(|c| c.id)
        .collect();
    let swept =
        tokio::task::spawn_blocking(move || sweep(&dir, caps, &existing, SystemTime::now()))
            .await??;
    Ok(swept)
}
