//! The executor's pass over 1,000 assignments (issue 20; goal: the no-op
//! pass ≤ 5 ms p50), in the pieces the pass runs on the CPU:
//!
//! - **no-op pass** (every 5 s tick with nothing new): the set was selected
//!   when it arrived (`diff::desired_for`, kept as is), the listing of owned
//!   containers is the one kept since the last change (`listing::Listing`),
//!   and the pass classifies (`diff::classify`).
//! - **pass after a change** (a containerd event, a worker's report, or every
//!   30 s): the listing is read again, every container's labels parsed
//!   (`OwnedContainer::from_container`), then classified. containerd's List
//!   RPC itself is not timed: it depends on containerd, not on the agent.
//! - **10 changed**: a new set in which 10 assignments have a new config
//!   hash: selected, then classified against the kept listing (10 removals;
//!   the 10 bring-ups are their workers' and run beside the loop).
//! - **new set**: what arriving costs once per push: decode the
//!   `ControlMessage` bytes as the sync stream receives them and select.
//! - **repeat (no wake)**: control's usual push, the same set with a new
//!   version, decoded, compared (`sync::same_assignments`) and stored
//!   without waking the executor.
//!
//! Same-run reference: prost decoding alone of the same bytes.
//! `cargo bench -p zattera-agent --bench apply`; no root needed.
//! Environment: `ROUNDS` (default 300), `ASSIGNMENTS` (default 1000).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::many_single_char_names,
    clippy::disallowed_methods
)]

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use containerd_client::services::v1::Container;
use prost::Message;
use zattera_agent::control::sync;
use zattera_agent::executor::diff;
use zattera_agent::executor::listing::Listing;
use zattera_agent::labels::{self, NamedPort, OwnedContainer};
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
    let (changed_bytes, _) = fixture_with(n, 10);
    println!(
        "apply bench: {n} assignments, ControlMessage {} KiB, {rounds} rounds",
        bytes.len() / 1024
    );
    let desired = diff::desired_for(set_of(&bytes), NODE);
    let mut listing = Listing::default();
    listing.store(Instant::now(), parse(&containers));

    let mut decode_only = Vec::with_capacity(rounds);
    let mut noop = Vec::with_capacity(rounds);
    let mut relist = Vec::with_capacity(rounds);
    let mut changed = Vec::with_capacity(rounds);
    let mut arrive = Vec::with_capacity(rounds);
    let mut repeat = Vec::with_capacity(rounds);
    let mut stored = Some(set_of(&bytes));
    for round in 0..rounds + 10 {
        let t = Instant::now();
        let msg = ControlMessage::decode(bytes.as_slice()).unwrap();
        let d = t.elapsed();
        black_box(msg);

        let t = Instant::now();
        let owned = listing.owned();
        let c = diff::classify(&desired, owned, None);
        let p = t.elapsed();
        assert_eq!(
            (c.owned.len(), c.removals.len()),
            (n, 0),
            "nothing to change"
        );
        drop(c);

        let t = Instant::now();
        let c = diff::classify(&desired, parse(&containers), None);
        let l = t.elapsed();
        assert_eq!(c.owned.len(), n);
        drop(c);

        let t = Instant::now();
        let new = diff::desired_for(set_of(&changed_bytes), NODE);
        let owned = listing.owned();
        let c = diff::classify(&new, owned, None);
        let ch = t.elapsed();
        assert_eq!(c.removals.len(), 10, "the 10 changed ones leave");
        drop((c, new));

        let t = Instant::now();
        black_box(diff::desired_for(set_of(&bytes), NODE));
        let ar = t.elapsed();

        let t = Instant::now();
        let was_changed = repeat_once(&bytes, &mut stored);
        let r = t.elapsed();
        assert!(!was_changed, "a repeat is not a change");
        if round >= 10 {
            decode_only.push(d);
            noop.push(p);
            relist.push(l);
            changed.push(ch);
            arrive.push(ar);
            repeat.push(r);
        }
    }
    let verdict = |p50: Duration| {
        if p50 <= Duration::from_millis(5) {
            "met"
        } else {
            "MISSED"
        }
    };
    let (d50, d99) = percentiles(&mut decode_only);
    println!("decode only          p50 {d50:>9.3?}  p99 {d99:>9.3?}");
    for (name, samples, goal) in [
        ("new set (per push)", &mut arrive, false),
        ("repeat (no wake)", &mut repeat, true),
        ("pass after a change", &mut relist, false),
        ("10 changed", &mut changed, false),
        ("no-op pass", &mut noop, true),
    ] {
        let (p50, p99) = percentiles(samples);
        let goal = if goal {
            format!("  goal <= 5 ms {}", verdict(p50))
        } else {
            String::new()
        };
        println!(
            "{name:<20} p50 {p50:>9.3?}  p99 {p99:>9.3?}  ratio to decode {:.2}{goal}",
            p50.as_secs_f64() / d50.as_secs_f64(),
        );
    }
}

fn parse(listed: &[Container]) -> Vec<OwnedContainer> {
    listed
        .iter()
        .filter_map(OwnedContainer::from_container)
        .collect()
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

/// A set shaped like control's pushes (runtime payload with spec, a dozen
/// environment variables, a subnet) and the containers the agent would have
/// made for it, labels and all.
fn fixture(n: usize) -> (Vec<u8>, Vec<Container>) {
    fixture_with(n, 0)
}

/// The same, with the first `changed` assignments under a new config hash
/// (the containers keep the old one).
fn fixture_with(n: usize, changed: usize) -> (Vec<u8>, Vec<Container>) {
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
            config_hash: if i < changed {
                format!("{:064x}", i * 7919 + 2)
            } else {
                hash.clone()
            },
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
        labels.insert(labels::CONFIG_HASH.into(), hash.clone());
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
