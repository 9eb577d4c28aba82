//! What a scrape reads at the moment it happens, from what the agent keeps
//! anyway: the status board (assignments by state, restarts), the DNS
//! server's counters, the sampler's latest instance samples (CPU, memory,
//! network), the cgroup v2 pressure files (PSI; absent on cgroup v1 hosts)
//! and the bytes the log directory holds.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use tokio::sync::watch;

use crate::metrics::InstanceSamples;
use crate::status::{AssignmentStatus, State, StatusSnapshot};

const STATES: [State; 8] = [
    State::Pending,
    State::Pulling,
    State::Starting,
    State::Running,
    State::Healthy,
    State::Unhealthy,
    State::Failed,
    State::Stopped,
];

/// Where a scrape reads.
#[derive(Debug)]
pub struct Sources {
    pub status: watch::Receiver<Arc<StatusSnapshot>>,
    pub dns: Option<Arc<zattera_dns::DnsServer>>,
    pub samples: watch::Receiver<InstanceSamples>,
    /// cgroupfs mount and the executor's parent: an instance's cgroup is
    /// `<root>/<parent>/<container id>`.
    pub cgroup_root: PathBuf,
    pub cgroup_parent: String,
    pub log_dir: PathBuf,
}

type Labels = Vec<(&'static str, String)>;

fn instance_labels(a: &AssignmentStatus) -> Labels {
    vec![
        ("assignment", a.id.clone()),
        ("app", a.app.clone()),
        ("environment", a.environment.clone()),
        ("project", a.project.clone()),
    ]
}

/// One family, labelled values, as counters or gauges.
fn family<V>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    kind: MetricType,
    rows: impl IntoIterator<Item = (Labels, V)>,
) -> Result<(), std::fmt::Error>
where
    V: Into<f64>,
{
    let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in rows {
        let value: f64 = value.into();
        let e = metric.encode_family(&labels)?;
        if kind == MetricType::Counter {
            ConstCounter::new(value).encode(e)?;
        } else {
            ConstGauge::new(value).encode(e)?;
        }
    }
    Ok(())
}

/// `some ... total=<µs>` of a PSI file, in seconds.
fn psi_total_seconds(text: &str) -> Option<f64> {
    let some = text.lines().find(|l| l.starts_with("some "))?;
    let total = some
        .split_whitespace()
        .find_map(|f| f.strip_prefix("total="))?;
    total.parse::<f64>().ok().map(|us| us / 1e6)
}

impl Collector for Sources {
    // Counts far below 2^52; metrics are f64 by nature.
    #[allow(clippy::cast_precision_loss)]
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let status = Arc::clone(&self.status.borrow());
        let rows = &status.assignments;
        family(
            &mut encoder,
            "zattera_assignments",
            "Assignments on this node by state",
            MetricType::Gauge,
            STATES.iter().map(|s| {
                let n = rows.iter().filter(|a| a.state == *s).count();
                let name = serde_json::to_value(s)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default();
                (vec![("state", name)], n as f64)
            }),
        )?;
        family(
            &mut encoder,
            "zattera_instance_restarts",
            "Restarts of each instance's task",
            MetricType::Counter,
            rows.iter()
                .map(|a| (instance_labels(a), f64::from(a.restarts))),
        )?;

        if let Some(dns) = &self.dns {
            let stats = dns.stats();
            family(
                &mut encoder,
                "zattera_dns_queries",
                "DNS queries by question type",
                MetricType::Counter,
                stats
                    .queries
                    .iter()
                    .map(|(t, n)| (vec![("type", (*t).to_owned())], *n as f64)),
            )?;
            family(
                &mut encoder,
                "zattera_dns_answers",
                "DNS queries by how they were answered (response code, forwarded, dropped)",
                MetricType::Counter,
                stats
                    .answers
                    .iter()
                    .map(|(t, n)| (vec![("answer", (*t).to_owned())], *n as f64)),
            )?;
        }

        let samples = Arc::clone(&self.samples.borrow());
        let sampled: Vec<(&AssignmentStatus, &crate::proto::cluster::InstanceSample)> = rows
            .iter()
            .filter_map(|a| samples.get(&a.id).map(|s| (a, s)))
            .collect();
        family(
            &mut encoder,
            "zattera_instance_cpu_percent",
            "CPU of the instance between the last two samples, percent of one core",
            MetricType::Gauge,
            sampled
                .iter()
                .map(|(a, s)| (instance_labels(a), s.cpu_percent)),
        )?;
        family(
            &mut encoder,
            "zattera_instance_memory_bytes",
            "Memory of the instance (usage less inactive file cache)",
            MetricType::Gauge,
            sampled
                .iter()
                .map(|(a, s)| (instance_labels(a), s.memory_bytes as f64)),
        )?;
        family(
            &mut encoder,
            "zattera_instance_network_receive_bytes",
            "Bytes received in the instance's network namespace",
            MetricType::Counter,
            sampled
                .iter()
                .map(|(a, s)| (instance_labels(a), s.net_rx_bytes as f64)),
        )?;
        family(
            &mut encoder,
            "zattera_instance_network_transmit_bytes",
            "Bytes sent from the instance's network namespace",
            MetricType::Counter,
            sampled
                .iter()
                .map(|(a, s)| (instance_labels(a), s.net_tx_bytes as f64)),
        )?;

        let mut pressure = Vec::new();
        for a in rows.iter().filter(|a| !a.container_id.is_empty()) {
            let dir = self
                .cgroup_root
                .join(self.cgroup_parent.trim_start_matches('/'))
                .join(&a.container_id);
            for resource in ["cpu", "memory", "io"] {
                let file = dir.join(format!("{resource}.pressure"));
                if let Some(secs) = std::fs::read_to_string(file)
                    .ok()
                    .as_deref()
                    .and_then(psi_total_seconds)
                {
                    let mut labels = instance_labels(a);
                    labels.push(("resource", resource.to_owned()));
                    pressure.push((labels, secs));
                }
            }
        }
        family(
            &mut encoder,
            "zattera_instance_pressure_seconds",
            "Time some task of the instance waited on the resource (cgroup v2 PSI)",
            MetricType::Counter,
            pressure,
        )?;

        let log_bytes: u64 = crate::logs::files::list(&self.log_dir)
            .unwrap_or_default()
            .iter()
            .map(|f| f.size)
            .sum();
        family(
            &mut encoder,
            "zattera_log_disk_bytes",
            "Bytes of container output on disk (live and compressed files)",
            MetricType::Gauge,
            [(Labels::new(), log_bytes as f64)],
        )?;
        Ok(())
    }
}

/// The text a scrape returns.
pub fn render(registry: &prometheus_client::registry::Registry) -> String {
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, registry).is_err() {
        out.clear();
        let _ = writeln!(out, "# encoding the metrics failed");
    }
    out
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn psi_reads_the_some_total() {
        let text = "some avg10=0.00 avg60=0.00 avg300=0.00 total=2500000\n\
                    full avg10=0.00 avg60=0.00 avg300=0.00 total=100\n";
        assert_eq!(psi_total_seconds(text), Some(2.5));
        assert_eq!(psi_total_seconds("garbage"), None);
    }
}
