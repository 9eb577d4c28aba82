//! Apply of an AssignmentSet of 1,000 assignments with nothing to change
//! (issue 7, "Benchmarks"; goal ≤ 5 ms): the CPU path of a reconcile pass
//! that finds every instance already running with its config hash.
//!
//! Timed, per round: decode the `ControlMessage` bytes as the sync stream
//! receives them, pick this node's assignments (`diff::desired_for`), read
//! the 1,000 owned containers' labels back (`OwnedContainer::from_container`,
//! as the pass does after containerd's List), and classify
//! (`diff::classify`). Untimed: containerd's List RPC itself, which is a read
//! and depends on containerd, not on the agent.
//!
//! Also timed: a repeat of the previous set (control's usual push: the same
//! set, a new version, the echo of our reports), which the sync client
//! decodes, compares (`sync::same_assignments`) and stores without waking the
//! executor. Same-run reference: prost decoding alone of the same bytes. `cargo bench -p zattera-agent --bench apply`; no root needed.
//! Environment: `ROUNDS` (default 300), `ASSIGNMENTS` (default 1000).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::many_single_char_names
)]

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use containerd_client::services::v1::Container;
use prost::Message;
use zattera_agent::control::sync;
use zattera_agent::executor::diff;
use zattera_agent::executor::labels::{self, NamedPort, OwnedContainer};
use zattera_agent::proto::cluster::control_message::Body;
use zattera_agent::proto::cluster::{AssignmentRuntime, AssignmentSet, ControlMessage};
use zattera_agent::proto::v1::{
    Assignment, AssignmentDesired, HealthCheck, HealthCheckType, Meta, PortSpec, Protocol,
    ResourceLimits, ServiceSpec,
};

const NODE: &str = "01JNODE0000000000000000001";

fn main() {
    let rounds: usize = env_or("ROUNDS", 300);
    let n: usize = env_or("ASSIGNMENTS", 1000);
    let (bytes, containers) = fixture(n);
    println!(
        "apply bench: {n} assignments, ControlMessage {} KiB, {rounds} rounds",
        bytes.len() / 1024
    );

    let mut decode_only = Vec::with_capacity(rounds);
    let mut apply = Vec::with_capacity(rounds);
    let mut repeat = Vec::with_capacity(rounds);
    let mut stored = Some(set_of(&bytes));
    for round in 0..rounds + 10 {
        let t = Instant::now();
        let msg = ControlMessage::decode(bytes.as_slice()).unwrap();
        let d = t.elapsed();
        black_box(msg);

        let t = Instant::now();
        let kept = apply_once(&bytes, &containers);
        let a = t.elapsed();
        assert_eq!(kept, n, "every instance is kept: nothing to change");

        let t = Instant::now();
        let changed = repeat_once(&bytes, &mut stored);
        let r = t.elapsed();
        assert!(!changed, "a repeat is not a change");
        if round >= 10 {
            decode_only.push(d);
            apply.push(a);
            repeat.push(r);
        }
    }
    // Where the time goes, one step at a time (medians).
    let mut steps: [Vec<Duration>; 5] = Default::default();
    for _ in 0..rounds.min(100) {
        let (a, mut b) = (set_of(&bytes), set_of(&bytes));
        b.version += 1;
        let t = Instant::now();
        black_box(sync::same_assignments(&a, &b));
        steps[3].push(t.elapsed());
        let t = Instant::now();
        drop(a);
        steps[4].push(t.elapsed());
        let msg = ControlMessage::decode(bytes.as_slice()).unwrap();
        let Some(Body::Assignments(set)) = msg.body else {
            unreachable!()
        };
        let t = Instant::now();
        let desired = diff::desired_for(set, NODE);
        steps[0].push(t.elapsed());
        let t = Instant::now();
        let owned: Vec<OwnedContainer> = containers
            .iter()
            .filter_map(OwnedContainer::from_container)
            .collect();
        steps[1].push(t.elapsed());
        let t = Instant::now();
        black_box(diff::classify(&desired, owned, None));
        steps[2].push(t.elapsed());
    }
    for (name, samples) in ["select", "labels", "classify", "compare", "drop set"]
        .iter()
        .zip(steps.iter_mut())
    {
        println!("  step {name:<9} p50 {:>9.3?}", percentiles(samples).0);
    }
    let (d50, d99) = percentiles(&mut decode_only);
    let (a50, a99) = percentiles(&mut apply);
    let (r50, r99) = percentiles(&mut repeat);
    let verdict = |p50: Duration| {
        if p50 <= Duration::from_millis(5) {
            "met"
        } else {
            "MISSED"
        }
    };
    println!("decode only          p50 {d50:>9.3?}  p99 {d99:>9.3?}");
    println!(
        "repeat (no wake)     p50 {r50:>9.3?}  p99 {r99:>9.3?}  ratio to decode {:.2}  goal <= 5 ms {}",
        r50.as_secs_f64() / d50.as_secs_f64(),
        verdict(r50)
    );
    println!(
        "full no-op pass      p50 {a50:>9.3?}  p99 {a99:>9.3?}  ratio to decode {:.2}  goal <= 5 ms {}",
        a50.as_secs_f64() / d50.as_secs_f64(),
        verdict(a50)
    );
}

fn set_of(bytes: &[u8]) -> AssignmentSet {
    match ControlMessage::decode(bytes).unwrap().body {
        Some(Body::Assignments(set)) => set,
        _ => panic!("not an assignment set"),
    }
}

/// What the sync client does with a push: decode, compare with the stored
/// set, store. Returns whether the executor would be woken.
fn repeat_once(bytes: &[u8], stored: &mut Option<AssignmentSet>) -> bool {
    let mut set = set_of(bytes);
    set.version += 1;
    let changed = !stored
        .as_ref()
        .is_some_and(|cur| sync::same_assignments(cur, &set));
    *stored = Some(set);
    changed
}

/// One no-op pass; returns how many containers were kept.
fn apply_once(bytes: &[u8], listed: &[Container]) -> usize {
    let msg = ControlMessage::decode(bytes).unwrap();
    let Some(Body::Assignments(set)) = msg.body else {
        panic!("not an assignment set");
    };
    let desired = diff::desired_for(set, NODE);
    let owned: Vec<OwnedContainer> = listed
        .iter()
        .filter_map(OwnedContainer::from_container)
        .collect();
    let classified = diff::classify(&desired, owned, None);
    assert!(classified.removals.is_empty());
    classified.owned.len()
}

/// A set shaped like control's pushes (runtime payload with spec, a dozen
/// environment variables, a subnet) and the containers the agent would have
/// made for it, labels and all.
fn fixture(n: usize) -> (Vec<u8>, Vec<Container>) {
    let mut set = AssignmentSet {
        version: 42,
        ..AssignmentSet::default()
    };
    let mut containers = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("01JASSIGN{i:017}");
        let hash = format!("{:064x}", i * 7919 + 1);
        let a = Assignment {
            meta: Some(Meta {
                id: id.clone(),
                ..Meta::default()
            }),
            project_id: format!("01JPROJECT{:016}", i % 10),
            app_id: format!("01JAPP{:020}", i % 100),
            environment_id: format!("01JENV{:020}", i % 30),
            node_id: NODE.into(),
            release_id: format!("01JRELEASE{:016}", i % 100),
            desired: AssignmentDesired::Run as i32,
            config_hash: hash.clone(),
            ..Assignment::default()
        };
        let env: BTreeMap<String, String> = (0..12)
            .map(|k| {
                (
                    format!("VAR_{k}"),
                    format!("value-{k}-{i}-{}", "x".repeat(24)),
                )
            })
            .collect();
        let rt = AssignmentRuntime {
            image_ref: format!("registry.internal:5000/app{}@sha256:{hash}", i % 100),
            spec: Some(ServiceSpec {
                command: "/app/server --listen :8080".into(),
                ports: vec![PortSpec {
                    name: "http".into(),
                    container_port: 8080,
                    protocol: Protocol::Http as i32,
                    public_l4_port: 0,
                }],
                healthcheck: Some(HealthCheck {
                    r#type: HealthCheckType::Http as i32,
                    path: "/healthz".into(),
                    ..HealthCheck::default()
                }),
                resources: Some(ResourceLimits {
                    cpu_millis: 500,
                    memory_mb: 256,
                }),
                ..ServiceSpec::default()
            }),
            env,
            subnet_cidr: format!("10.201.{}.0/24", i % 30),
            volume_lease: None,
        };
        let mut labels = labels::ownership(&a);
        labels.insert(
            labels::IP.into(),
            format!("10.201.{}.{}", i % 30, 2 + i / 30),
        );
        labels.insert(labels::SUBNET.into(), rt.subnet_cidr.clone());
        labels.insert(
            labels::PORTS.into(),
            labels::encode_ports(&[NamedPort {
                name: "http".into(),
                port: format!(
                    "tcp/127.0.0.1:{}->10.201.{}.{}:8080",
                    20_000 + i,
                    i % 30,
                    2 + i / 30
                )
                .parse()
                .unwrap(),
            }]),
        );
        labels.insert(labels::STOP_SIGNAL.into(), "15".into());
        labels.insert(labels::STOP_GRACE_MS.into(), "10000".into());
        labels.insert(
            labels::LOG_PATH.into(),
            format!("/var/lib/zattera/logs/{id}.log"),
        );
        containers.push(Container {
            id: labels::container_id(&id, &hash),
            labels,
            ..Container::default()
        });
        set.runtime.insert(id, rt);
        set.assignments.push(a);
    }
    let msg = ControlMessage {
        body: Some(Body::Assignments(set)),
    };
    (msg.encode_to_vec(), containers)
}

fn percentiles(samples: &mut [Duration]) -> (Duration, Duration) {
    samples.sort_unstable();
    let at = |q: f64| {
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let i = ((samples.len() - 1) as f64 * q).round() as usize;
        samples[i]
    };
    (at(0.5), at(0.99))
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
