//! The metrics sampler (runtime.md §11): one sample at start, then one every
//! 15 s, of every owned container whose task runs. Heartbeats carry the
//! latest published map (M-6), keyed by assignment id.
//!
//! CPU is the recommended deviation of M-7: the rate between two samples of
//! the same container (percent of one core), 0 on a container's first
//! sample, instead of the reference's lifetime average. Memory and network
//! counters come from the cgroup and the container's netns
//! ([`crate::runtime::stats`]). A container that cannot be sampled is
//! skipped (M-4).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::executor::status::StatusSnapshot;
use crate::proto::cluster::InstanceSample;
use crate::runtime::containers::{self, TaskState};
use crate::runtime::{Containerd, stats};

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
            out.send_replace(Arc::new(samples));
        }
    }
}
