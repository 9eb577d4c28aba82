//! Image garbage collection and disk pressure (issue 17.2).
//!
//! One pass every `every` (default 5 minutes): images past the maximum age
//! go ([`policy`]); then, while the filesystem of containerd's content store
//! is over the high mark, the unused image used longest ago goes, measured
//! again after each removal, until it is under the low mark. Each removal is
//! an image-record delete with containerd's synchronous GC, which frees the
//! content and snapshots nothing else references (pull leases are released
//! when a pull ends, and a running container holds its own snapshot), so
//! the space comes back before the next measurement. Volumes live under the
//! agent's data dir and are never looked at.
//!
//! A filesystem still over the high mark after a pass is disk pressure:
//! `status` says so, and pulls that cannot fit are refused by the puller's
//! space check ([`crate::runtime::pull`]).

pub mod policy;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::runtime::disk::Usage;
use crate::runtime::images;
use crate::runtime::{Containerd, containers};
pub use policy::{GcPolicy, Pin, Reason};

pub const DEFAULT_EVERY: Duration = Duration::from_secs(300);

/// What one pass did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    pub removed: Vec<(String, Reason)>,
    pub bytes_freed: u64,
    pub percent_before: f64,
    pub percent_after: f64,
    /// Still over the high mark.
    pub pressure: bool,
}

/// The collector: owns its record of when each image was last used.
#[derive(Debug)]
pub struct ImageGc {
    pub ctd: Containerd,
    pub policy: GcPolicy,
    pub every: Duration,
    /// `<data-dir>/images/last-used.json`.
    pub record: PathBuf,
    /// The disk-pressure notice for `status` (empty without pressure).
    pub notices: watch::Sender<Vec<String>>,
    pub metrics: std::sync::Arc<crate::telemetry::AgentMetrics>,
}

impl ImageGc {
    pub fn record_path(data_dir: &Path) -> PathBuf {
        data_dir.join("images").join("last-used.json")
    }

    /// Passes until the task is dropped.
    pub async fn run(self) {
        let mut last_used = load_record(&self.record);
        let mut tick = tokio::time::interval(self.every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match self.pass(&mut last_used).await {
                Ok(r) => {
                    self.metrics.gc_run("image", r.bytes_freed);
                    if !r.removed.is_empty() {
                        tracing::info!(
                            removed = ?r
                            .removed
                            .iter()
                            .map(|(name, why)| format!("{name} ({why})"))
                            .collect::<Vec<_>>(),
                            bytes_freed = r.bytes_freed,
                            before = format!("{:.1}%", r.percent_before),
                            after = format!("{:.1}%", r.percent_after),
                            "image gc"
                        );
                    }
                }
                Err(e) => tracing::warn!("image gc: {e}"),
            }
        }
    }

    /// One pass; `last_used` is updated (and saved) with what is in use now.
    pub async fn pass(
        &self,
        last_used: &mut BTreeMap<String, SystemTime>,
    ) -> anyhow::Result<Report> {
        let root = self.ctd.content_root().await?;
        let listed = images::list_images(&self.ctd).await?;
        // Any container of the namespace, ours or not, keeps its image.
        let in_use: BTreeSet<String> = containers::list(&self.ctd, &[])
            .await?
            .into_iter()
            .map(|c| c.image)
            .collect();
        let now = SystemTime::now();
        for name in &in_use {
            last_used.insert(name.clone(), now);
        }
        last_used.retain(|name, _| listed.iter().any(|i| &i.name == name));
        save(&self.record, last_used);

        let found = policy::candidates(&listed, &in_use, last_used, &self.policy, now);
        let mut usage = Usage::of(&root)?;
        let mut report = Report {
            percent_before: usage.percent(),
            ..Report::default()
        };
        let start_used = usage.used_bytes;
        for name in &found.expired {
            self.remove(name, Reason::Age, &mut report).await;
        }
        usage = Usage::of(&root)?;
        if usage.percent() >= f64::from(self.policy.high_percent) {
            for name in &found.by_age {
                if usage.percent() < f64::from(self.policy.low_percent) {
                    break;
                }
                self.remove(name, Reason::DiskPressure, &mut report).await;
                usage = Usage::of(&root)?;
            }
        }
        report.percent_after = usage.percent();
        report.bytes_freed = start_used.saturating_sub(usage.used_bytes);
        report.pressure = report.percent_after >= f64::from(self.policy.high_percent);
        let notice = report.pressure.then(|| {
            format!(
                "disk pressure: {} is {:.0}% full (high mark {}%) with no unused image left to \
                 remove; pulls that do not fit are refused",
                root.display(),
                report.percent_after,
                self.policy.high_percent
            )
        });
        self.notices.send_replace(notice.into_iter().collect());
        Ok(report)
    }

    async fn remove(&self, name: &str, reason: Reason, report: &mut Report) {
        match images::delete_image(&self.ctd, name).await {
            Ok(()) => report.removed.push((name.to_owned(), reason)),
            Err(e) => tracing::warn!(image = name, "image gc: {e}"),
        }
    }
}

/// The last-use record at `path` (empty when absent or unreadable).
pub fn load_record(path: &Path) -> BTreeMap<String, SystemTime> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return BTreeMap::new();
    };
    let secs: BTreeMap<String, u64> = serde_json::from_str(&text).unwrap_or_default();
    secs.into_iter()
        .map(|(k, s)| (k, SystemTime::UNIX_EPOCH + Duration::from_secs(s)))
        .collect()
}

fn save(path: &Path, last_used: &BTreeMap<String, SystemTime>) {
    let secs: BTreeMap<&String, u64> = last_used
        .iter()
        .map(|(k, t)| {
            let s = t
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            (k, s)
        })
        .collect();
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        crate::durable::write(
            path,
            &serde_json::to_vec(&secs).map_err(std::io::Error::other)?,
            0o600,
        )
    };
    if let Err(e) = write() {
        tracing::warn!(path = %path.display(), "image gc: cannot keep the last-use record: {e}");
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn the_record_round_trips_and_garbage_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("images/last-used.json");
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let record = BTreeMap::from([("a".to_owned(), t)]);
        save(&path, &record);
        assert_eq!(load_record(&path), record);
        std::fs::write(&path, "garbage").unwrap();
        assert!(load_record(&path).is_empty());
    }
}
