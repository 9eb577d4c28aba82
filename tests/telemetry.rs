//! Prometheus metrics (issue 17.4): the real `zattera-agent run` binary
//! with `--metrics-listen`, scraped over HTTP and parsed by the official
//! Python client's OpenMetrics parser (the rig's venv): every
//! documented family is there, labels are right, and counters move when
//! their events happen (passes, DNS queries answered on a bridge the agent
//! made, GC runs).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::agent::AgentProc;
use support::{rig, with_namespace};
use zattera_agent::runtime::import_archive;

/// Every family the README documents (counters without `_total`).
const FAMILIES: [&str; 18] = [
    "zattera_reconcile_passes",
    "zattera_reconcile_duration_seconds",
    "zattera_image_pulls",
    "zattera_image_pull_bytes",
    "zattera_vip_connections",
    "zattera_node_api_calls",
    "zattera_gc_runs",
    "zattera_gc_freed_bytes",
    "zattera_assignments",
    "zattera_instance_restarts",
    "zattera_dns_queries",
    "zattera_dns_answers",
    "zattera_instance_cpu_percent",
    "zattera_instance_memory_bytes",
    "zattera_instance_network_receive_bytes",
    "zattera_instance_network_transmit_bytes",
    "zattera_instance_pressure_seconds",
    "zattera_log_disk_bytes",
];

const PARSE: &str = r#"
import json, sys, urllib.request
from prometheus_client.openmetrics.parser import text_string_to_metric_families
text = urllib.request.urlopen(sys.argv[1], timeout=10).read().decode()
out = {}
for f in text_string_to_metric_families(text):
    out[f.name] = {"type": f.type, "samples": [[s.name, s.labels, s.value] for s in f.samples]}
print(json.dumps(out))
"#;

fn python() -> String {
    std::env::var("ZATTERA_TEST_S3_PYTHON")
        .unwrap_or_else(|_| "/var/lib/zattera-rig/s3-venv/bin/python".into())
}

/// One scrape, parsed: family → {type, samples: [name, labels, value]}.
fn scrape(port: u16) -> BTreeMap<String, Value> {
    let out = std::process::Command::new(python())
        .args(["-c", PARSE, &format!("http://127.0.0.1:{port}/metrics")])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scrape: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The value of the sample `name` whose labels include `labels`.
fn value(
    m: &BTreeMap<String, Value>,
    family: &str,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<f64> {
    m.get(family)?["samples"].as_array()?.iter().find_map(|s| {
        let ok = s[0] == name && labels.iter().all(|(k, v)| s[1][*k] == *v);
        ok.then(|| s[2].as_f64()).flatten()
    })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[tokio::test]
async fn metrics_are_served_parsed_labelled_and_move() {
    let Some(rig) = rig() else { return };
    if !std::path::Path::new(&python()).exists() {
        zattera_testkit::missing(&format!(
            "the rig's venv python {} (run `sudo scripts/rig.sh` first)",
            python()
        ));
        return;
    }
    with_namespace(&rig, "telemetry", |ctd, rig| async move {
        import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .unwrap();
        let port = free_port();
        let mut agent = AgentProc::new(&rig.socket, ctd.namespace().as_str(), "ztld", "233-233");
        agent.run_args = vec!["--metrics-listen".into(), port.to_string()];
        agent.write_manifest(
            "svc.toml",
            &support::agent::app_manifest("svc", "sleep 1000000"),
        );
        agent.start();
        let ids = agent.wait_all(1, "HEALTHY");
        let assignment = ids.keys().next().unwrap().clone();

        let first = scrape(port);
        for f in FAMILIES {
            let on_v1 = !std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
            let per_instance =
                f.starts_with("zattera_instance_") && f != "zattera_instance_restarts";
            // Instance figures come with the sampler's samples; PSI only on cgroup v2.
            if per_instance || (on_v1 && f == "zattera_instance_pressure_seconds") {
                continue;
            }
            assert!(
                first.contains_key(f),
                "{f} missing; families: {:?}",
                first.keys()
            );
        }
        assert_eq!(first["zattera_reconcile_passes"]["type"], "counter");
        assert_eq!(
            first["zattera_reconcile_duration_seconds"]["type"],
            "histogram"
        );
        assert_eq!(
            value(
                &first,
                "zattera_assignments",
                "zattera_assignments",
                &[("state", "HEALTHY")]
            ),
            Some(1.0)
        );
        assert_eq!(
            value(
                &first,
                "zattera_assignments",
                "zattera_assignments",
                &[("state", "FAILED")]
            ),
            Some(0.0),
            "every state has a series"
        );
        // Counters exist from 0.
        for (family, labels) in [
            ("zattera_image_pulls", vec![("result", "ok")]),
            ("zattera_image_pulls", vec![("result", "failed")]),
            ("zattera_vip_connections", vec![]),
            (
                "zattera_node_api_calls",
                vec![("method", "QueryLogs"), ("code", "OK")],
            ),
        ] {
            assert_eq!(
                value(&first, family, &format!("{family}_total"), &labels),
                Some(0.0),
                "{family} {labels:?}: {:?}",
                first.get(family)
            );
        }
        assert_eq!(
            value(
                &first,
                "zattera_instance_restarts",
                "zattera_instance_restarts_total",
                &[
                    ("assignment", &assignment),
                    ("app", "svc"),
                    ("environment", "prod"),
                    ("project", "p")
                ]
            ),
            Some(0.0)
        );
        // The log janitor and the image collector ran once at start.
        for kind in ["log", "image"] {
            assert!(
                value(
                    &first,
                    "zattera_gc_runs",
                    "zattera_gc_runs_total",
                    &[("kind", kind)]
                ) >= Some(1.0),
                "gc {kind}"
            );
        }

        // DNS asked on the gateway of the bridge the agent made.
        let gateway = "10.201.233.1";
        let before = value(
            &first,
            "zattera_dns_answers",
            "zattera_dns_answers_total",
            &[("answer", "NXDOMAIN")],
        )
        .unwrap_or(0.0);
        let dig = std::process::Command::new("dig")
            .args([
                "+tries=1",
                "+time=2",
                &format!("@{gateway}"),
                "nobody.internal",
                "A",
            ])
            .output()
            .unwrap();
        assert!(
            String::from_utf8_lossy(&dig.stdout).contains("NXDOMAIN"),
            "{dig:?}"
        );

        // Instance figures arrive with the sampler's next sample (15 s).
        let deadline = Instant::now() + Duration::from_secs(40);
        let later = loop {
            let m = scrape(port);
            let memory = value(
                &m,
                "zattera_instance_memory_bytes",
                "zattera_instance_memory_bytes",
                &[("assignment", &assignment), ("app", "svc")],
            );
            if memory.is_some_and(|b| b > 0.0) {
                break m;
            }
            assert!(
                Instant::now() < deadline,
                "no instance memory: {:?}",
                m.get("zattera_instance_memory_bytes")
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        };
        for f in [
            "zattera_instance_cpu_percent",
            "zattera_instance_network_receive_bytes",
            "zattera_instance_network_transmit_bytes",
        ] {
            assert!(later.contains_key(f), "{f} missing");
        }
        let passes = |m: &BTreeMap<String, Value>| {
            value(
                m,
                "zattera_reconcile_passes",
                "zattera_reconcile_passes_total",
                &[],
            )
            .unwrap()
        };
        assert!(
            passes(&later) > passes(&first),
            "reconcile passes did not move"
        );
        let after = value(
            &later,
            "zattera_dns_answers",
            "zattera_dns_answers_total",
            &[("answer", "NXDOMAIN")],
        )
        .unwrap();
        assert!(after >= before + 1.0, "NXDOMAIN {before} -> {after}");
        assert!(
            value(
                &later,
                "zattera_dns_queries",
                "zattera_dns_queries_total",
                &[("type", "A")]
            ) >= Some(1.0)
        );
        assert!(
            value(
                &later,
                "zattera_log_disk_bytes",
                "zattera_log_disk_bytes",
                &[]
            ) >= Some(0.0)
        );

        // Anything else than GET /metrics.
        let other = std::process::Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                &format!("http://127.0.0.1:{port}/"),
            ])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&other.stdout), "404");

        agent.kill9();
        support::purge_namespace(&ctd).await;
    })
    .await;
}
