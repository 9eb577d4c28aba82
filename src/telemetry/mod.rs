//! Prometheus metrics (issue 17.4): the agent's own counters, bumped where
//! their events happen ([`AgentMetrics`], handed to each service), and the
//! figures read at scrape time from what the agent already keeps
//! ([`collect`]: status, DNS counters, instance samples, cgroup PSI, log
//! disk use), served by [`serve`] on the opt-in `metrics-listen` address as
//! OpenMetrics text (which Prometheus scrapes). Every counter exists from 0.

pub mod collect;
pub mod serve;

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    pub result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub method: &'static str,
    pub code: String,
}

/// The node API's methods, so each has a series from the start.
pub const NODE_API_METHODS: [&str; 14] = [
    "QueryLogs",
    "Exec",
    "Top",
    "Stats",
    "ProxyTCP",
    "RunBuild",
    "CancelBuild",
    "SnapshotVolume",
    "RestoreVolume",
    "ListVolumeFiles",
    "ReadVolumeFile",
    "WriteVolumeFile",
    "RemoveVolume",
    "UpgradeBinary",
];

/// The counters services bump. Cheap to clone (every metric is shared).
#[derive(Debug, Clone)]
pub struct AgentMetrics {
    pub reconcile_passes: Counter,
    pub reconcile_seconds: Histogram,
    pub pulls: Family<ResultLabel, Counter>,
    pub pull_bytes: Counter,
    pub vip_connections: Counter,
    pub node_api_calls: Family<CallLabels, Counter>,
    pub gc_runs: Family<KindLabel, Counter>,
    pub gc_bytes_freed: Family<KindLabel, Counter>,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        let m = Self {
            reconcile_passes: Counter::default(),
            // 100 µs to ~1.6 s: a no-op pass is a few ms, a loaded one more.
            reconcile_seconds: Histogram::new(
                prometheus_client::metrics::histogram::exponential_buckets(0.0001, 2.0, 15),
            ),
            pulls: Family::default(),
            pull_bytes: Counter::default(),
            vip_connections: Counter::default(),
            node_api_calls: Family::default(),
            gc_runs: Family::default(),
            gc_bytes_freed: Family::default(),
        };
        for result in ["ok", "failed"] {
            let _ = m.pulls.get_or_create(&ResultLabel { result });
        }
        for kind in ["image", "log"] {
            let _ = m.gc_runs.get_or_create(&KindLabel { kind });
            let _ = m.gc_bytes_freed.get_or_create(&KindLabel { kind });
        }
        for method in NODE_API_METHODS {
            let _ = m.node_api_calls.get_or_create(&CallLabels {
                method,
                code: "OK".into(),
            });
        }
        m
    }
}

impl AgentMetrics {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A node API call answered with `code` (`OK` when its stream started).
    pub fn node_api_call(&self, method: &'static str, code: tonic::Code) {
        let code = if code == tonic::Code::Ok {
            "OK".to_owned()
        } else {
            format!("{code:?}")
        };
        self.node_api_calls
            .get_or_create(&CallLabels { method, code })
            .inc();
    }

    /// A GC pass of `kind` (`image`, `log`) that freed `bytes`.
    pub fn gc_run(&self, kind: &'static str, bytes: u64) {
        self.gc_runs.get_or_create(&KindLabel { kind }).inc();
        self.gc_bytes_freed
            .get_or_create(&KindLabel { kind })
            .inc_by(bytes);
    }

    fn register(&self, r: &mut Registry) {
        r.register(
            "zattera_reconcile_passes",
            "Reconcile passes of the executor",
            self.reconcile_passes.clone(),
        );
        r.register(
            "zattera_reconcile_duration_seconds",
            "Duration of one reconcile pass (bring-ups excluded)",
            self.reconcile_seconds.clone(),
        );
        r.register(
            "zattera_image_pulls",
            "Image pulls by result",
            self.pulls.clone(),
        );
        r.register(
            "zattera_image_pull_bytes",
            "Layer bytes of the images pulled",
            self.pull_bytes.clone(),
        );
        r.register(
            "zattera_vip_connections",
            "Connections accepted on service VIPs",
            self.vip_connections.clone(),
        );
        r.register(
            "zattera_node_api_calls",
            "Node API calls by method and gRPC code",
            self.node_api_calls.clone(),
        );
        r.register(
            "zattera_gc_runs",
            "Garbage collection passes by kind (image, log)",
            self.gc_runs.clone(),
        );
        r.register(
            "zattera_gc_freed_bytes",
            "Bytes freed by garbage collection by kind",
            self.gc_bytes_freed.clone(),
        );
    }
}

/// The registry a scrape encodes: the counters plus the scrape-time
/// collector.
pub fn registry(metrics: &AgentMetrics, sources: collect::Sources) -> Registry {
    let mut r = Registry::default();
    metrics.register(&mut r);
    r.register_collector(Box::new(sources));
    r
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn counters_exist_from_zero() {
        let m = AgentMetrics::default();
        let mut r = Registry::default();
        m.register(&mut r);
        let text = collect::render(&r);
        for line in [
            "zattera_image_pulls_total{result=\"ok\"} 0",
            "zattera_gc_runs_total{kind=\"log\"} 0",
            "zattera_node_api_calls_total{method=\"QueryLogs\",code=\"OK\"} 0",
            "zattera_vip_connections_total 0",
        ] {
            assert!(text.contains(line), "{line} missing from:\n{text}");
        }
        m.node_api_call("Exec", tonic::Code::PermissionDenied);
        let text = collect::render(&r);
        assert!(
            text.contains(
                "zattera_node_api_calls_total{method=\"Exec\",code=\"PermissionDenied\"} 1"
            ),
            "{text}"
        );
    }
}
