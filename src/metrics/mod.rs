//! The metrics sampler (runtime.md §11): one sample at start, then one every
//! 15 s, of the node and of every owned container whose task runs.
//! Heartbeats carry the latest published instance map (M-6), keyed by
//! assignment id; every sample also goes into the [`store`] that answers
//! the node API's `Stats`.
//!
//! CPU is the recommended deviation of M-7: the rate between two samples of
//! the same container (percent of one core), 0 on a container's first
//! sample, instead of the reference's lifetime average. Memory and network
//! counters come from the cgroup and the container's netns
//! ([`crate::runtime::stats`]). A container that cannot be sampled is
//! skipped (M-4).

pub mod host;
pub mod persist;
pub mod store;
pub mod wal;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use crate::proto::cluster::InstanceSample;
use crate::runtime::containers::{self, TaskState};
use crate::runtime::{Containerd, stats};
use crate::status::StatusSnapshot;

/// The reference's sampling interval (wire.md §1.6).
pub const SAMPLE_EVERY: Duration = Duration::from_secs(15);

/// The latest samples, assignment id → sample.
pub type InstanceSamples = Arc<BTreeMap<String, InstanceSample>>;

/// A receiver that never gets a sample: for a node without a sampler.
pub fn none() -> watch::Receiver<InstanceSamples> {
    watch::channel(InstanceSamples::default()).1
}

/// What the sampler reads.
#[derive(Debug)]
pub struct Sampler {
    pub ctd: Containerd,
    /// The executor's cgroup parent: a container's cgroup is
    /// `<parent>/<container id>`.
    pub cgroup_parent: String,
    pub status: watch::Receiver<Arc<StatusSnapshot>>,
    pub every: Duration,
    /// Where every sample is kept for `Stats`, with the node's id and data
    /// dir (whose filesystem is the node's disk).
    pub store: Option<StoreFeed>,
}

/// The store a sampler feeds, and what node-scope points need.
#[derive(Debug, Clone)]
pub struct StoreFeed {
    pub store: persist::StoreFile,
    pub node_id: String,
    pub data_dir: PathBuf,
}

impl Sampler {
    /// Starts sampling; the receiver sees every published map.
    pub fn spawn(
        self,
    ) -> (
        watch::Receiver<InstanceSamples>,
        tokio::task::JoinHandle<()>,
    ) {
        let (tx, rx) = watch::channel(InstanceSamples::default());
        (rx, tokio::spawn(self.run(tx)))
    }

    async fn run(self, out: watch::Sender<InstanceSamples>) {
        let mut previous: HashMap<String, stats::Sample> = HashMap::new();
        // Its own CPU baseline, not the heartbeat's (M-8 deviation).
        let mut cpu = crate::metrics::host::CpuMeter::default();
        let mut tick = tokio::time::interval(self.every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let snapshot = self.status.borrow().clone();
            let mut samples = BTreeMap::new();
            let mut current = HashMap::new();
            for a in snapshot
                .assignments
                .iter()
                .filter(|a| !a.id.is_empty() && !a.container_id.is_empty())
            {
                let Ok(TaskState::Running { pid }) =
                    containers::task_state(&self.ctd, &a.container_id).await
                else {
                    continue;
                };
                let cgroup = PathBuf::from(&self.cgroup_parent).join(&a.container_id);
                let Ok(Ok(sample)) =
                    tokio::task::spawn_blocking(move || stats::sample(&cgroup, pid)).await
                else {
                    continue;
                };
                let cpu_percent = previous
                    .get(&a.container_id)
                    .map_or(0.0, |prev| stats::cpu_percent(prev, &sample));
                samples.insert(
                    a.id.clone(),
                    InstanceSample {
                        cpu_percent,
                        memory_bytes: sample.memory_bytes,
                        net_rx_bytes: sample.rx_bytes,
                        net_tx_bytes: sample.tx_bytes,
                    },
                );
                current.insert(a.container_id.clone(), sample);
            }
            // Baselines of containers that went away go with them.
            previous = current;
            if let Some(feed) = &self.store {
                // The log's append is synced: off the runtime's threads.
                let (feed, cpu, samples) = (feed.clone(), cpu.sample(), samples.clone());
                let logged = tokio::task::spawn_blocking(move || record(&feed, cpu, &samples));
                if let Err(e) = logged.await {
                    tracing::warn!(error = %e, "a stats round was not recorded");
                }
            }
            out.send_replace(Arc::new(samples));
        }
    }
}

/// Now, in the store's unix seconds.
pub fn unix_now() -> u32 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX))
}

/// Records one round of samples (the node's now, and the instances') in
/// the store and its log.
fn record(feed: &StoreFeed, cpu_percent: f64, instances: &BTreeMap<String, InstanceSample>) {
    use crate::metrics::host;
    use store::Scope;
    use wal::{Point, Round};
    let (mem_used, mem_total) = host::memory();
    let (disk_used, disk_total) = host::disk(&feed.data_dir);
    let (rx, tx) = host::net_totals();
    #[allow(clippy::cast_precision_loss)]
    let node = [
        ("cpu_percent", cpu_percent),
        ("memory_used_bytes", mem_used as f64),
        ("memory_total_bytes", mem_total as f64),
        ("disk_used_bytes", disk_used as f64),
        ("disk_total_bytes", disk_total as f64),
        ("net_rx_bytes", rx as f64),
        ("net_tx_bytes", tx as f64),
    ];
    let point = |scope, id: &str, metric: &str, value| Point {
        scope,
        id: id.to_owned(),
        metric: metric.to_owned(),
        value,
    };
    let mut round = Round {
        at: unix_now(),
        points: Vec::new(),
    };
    for (metric, value) in node {
        round
            .points
            .push(point(Scope::Node, &feed.node_id, metric, value));
    }
    for (id, s) in instances {
        #[allow(clippy::cast_precision_loss)]
        let points = [
            ("cpu_percent", s.cpu_percent),
            ("memory_bytes", s.memory_bytes as f64),
            ("net_rx_bytes", s.net_rx_bytes as f64),
            ("net_tx_bytes", s.net_tx_bytes as f64),
        ];
        for (metric, value) in points {
            round.points.push(point(Scope::Instance, id, metric, value));
        }
    }
    feed.store.record(&round);
}
