//! Faults on purpose (issue 19): the real agent binary, standalone, on a
//! containerd of its own (so that it can be stopped and started) with a
//! 16 MiB content store, its own bridge prefix, subnet pool and nft table.
//! A seeded generator picks each fault; after every one the loop waits for
//! convergence and checks every invariant (`invariants::check`). A soak
//! with steady churn can follow, sampling the agent's RSS, descriptors,
//! tasks and nft rules.
//!
//! Sizes come from the environment, so `bench/chaos/run.sh` runs the same
//! code for longer:
//! - `ZATTERA_CHAOS_SEED`: a number, or `random` (printed either way so a
//!   failure replays); default 19.
//! - `ZATTERA_CHAOS_FAULTS`: how many faults (default 50).
//! - `ZATTERA_CHAOS_SOAK_SECS`: the soak after the faults (default 0).
//! - `ZATTERA_CHAOS_REPORT`: a file to write the figures to, as JSON.
//! - `ZATTERA_CHAOS_PREFIX`, `ZATTERA_CHAOS_POOL`: the bridge prefix and
//!   subnet slots (default `ztfa`, `240-245`; the control-plane run uses
//!   `ztfc` and 246-247), so that a long run and CI's
//!   run can share the machine.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]
// The figures are statistics over a few hundred samples: float casts are fine.
#![allow(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss
)]

#[path = "../support/control/mod.rs"]
mod control_plane;
#[path = "../support/mod.rs"]
mod support;

mod control;
mod faults;
mod invariants;
mod model;

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use containerd_client::services::v1::ListTasksRequest;
use futures::FutureExt;
use support::agent::AgentProc;
use support::private::PrivateContainerd;
use support::registry::Registry;
use support::{Rig, TEST_IMAGE, rig};
use zattera_agent::logs::shim::log_uri;
use zattera_agent::runtime::containers::{self, NewContainer};
use zattera_agent::runtime::spec::{self, ContainerSpec};
use zattera_agent::runtime::{Containerd, ImageRef, get_local};
use zattera_netns::NetNode;

use invariants::{Watched, World};
use model::{COUNTER, Desired, Rng};

/// The last 40 lines of an agent's `log`, newest first.
fn newest_first(log: &str) -> String {
    log.lines().rev().take(40).collect::<Vec<_>>().join("\n")
}

/// How long the agent may take to converge after a fault ends (every
/// instance of the desired set RUNNING or HEALTHY, nothing else).
const CONVERGE_BOUND: Duration = Duration::from_secs(60);
/// How long invariants may lag convergence (DNS and nft follow the pass).
const SETTLE: Duration = Duration::from_secs(10);
const PREFIX: &str = "ztfa";
const POOL: &str = "240-245";

fn env_or(key: &str, default: &str) -> String {
    std::env::var(key)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_owned())
}
/// Apps besides the counter at the start (three replicas each).
const START_APPS: u32 = 7;

#[derive(Debug)]
struct Sizes {
    seed: u64,
    faults: usize,
    soak: Duration,
    report: Option<PathBuf>,
}

fn sizes() -> Sizes {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let seed = match var("ZATTERA_CHAOS_SEED").as_deref() {
        None => 19,
        Some("random") => SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64 % 1_000_000_007),
        Some(n) => n.parse().expect("ZATTERA_CHAOS_SEED: a number or `random`"),
    };
    Sizes {
        seed,
        faults: var("ZATTERA_CHAOS_FAULTS")
            .map_or(50, |n| n.parse().expect("ZATTERA_CHAOS_FAULTS")),
        soak: Duration::from_secs(
            var("ZATTERA_CHAOS_SOAK_SECS")
                .map_or(0, |n| n.parse().expect("ZATTERA_CHAOS_SOAK_SECS")),
        ),
        report: var("ZATTERA_CHAOS_REPORT").map(PathBuf::from),
    }
}

/// Everything the faults act on.
#[derive(Debug)]
pub struct Lab {
    pub containerd: PrivateContainerd,
    pub ctd: Containerd,
    pub agent: AgentProc,
    pub net: NetNode,
    pub big_image: String,
    watched: Watched,
    _registry: Registry,
    _scratch: tempfile::TempDir,
}

#[derive(Debug, Default, serde::Serialize)]
struct Sample {
    at_secs: u64,
    rss_kib: u64,
    fds: usize,
    tasks: usize,
    nft_rules: usize,
}

#[derive(Debug, Default, serde::Serialize)]
struct Figures {
    seed: u64,
    faults: usize,
    by_kind: std::collections::BTreeMap<String, usize>,
    instances_at_start: u32,
    violations: Vec<String>,
    converge_ms: Vec<u64>,
    soak_secs: u64,
    soak_edits: usize,
    samples: Vec<Sample>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_in_any_order_break_no_promise() {
    let Some(rig) = rig() else { return };
    let sizes = sizes();
    println!(
        "chaos: seed {} (replay with ZATTERA_CHAOS_SEED={}), {} faults, soak {} s",
        sizes.seed,
        sizes.seed,
        sizes.faults,
        sizes.soak.as_secs()
    );
    let mut desired = Desired::initial(START_APPS);
    let mut lab = Lab::start(&rig, &desired).await;
    let outcome = AssertUnwindSafe(run(&mut lab, &mut desired, &sizes))
        .catch_unwind()
        .await;
    lab.agent.kill9();
    support::purge_namespace(&lab.ctd).await;
    let figures = outcome.unwrap_or_else(|p| std::panic::resume_unwind(p));
    let summary = summarize(&figures);
    println!("chaos figures: {summary}");
    if let Some(path) = &sizes.report {
        let mut full = serde_json::to_value(&figures).unwrap();
        full["summary"] = summary.clone();
        std::fs::write(path, serde_json::to_string_pretty(&full).unwrap()).unwrap();
    }
    assert!(
        figures.violations.is_empty(),
        "seed {}: {} invariant violations:\n{}\nagent log (newest first):\n{}",
        sizes.seed,
        figures.violations.len(),
        figures.violations.join("\n"),
        newest_first(&lab.agent.log())
    );
}

async fn run(lab: &mut Lab, desired: &mut Desired, sizes: &Sizes) -> Figures {
    let mut rng = Rng::new(sizes.seed);
    let mut fig = Figures {
        seed: sizes.seed,
        instances_at_start: desired.instances(),
        ..Figures::default()
    };
    // The start itself must already keep every promise.
    fig.violations.extend(
        lab.settle(desired)
            .await
            .into_iter()
            .map(|v| format!("at the start: {v}")),
    );

    for k in 0..sizes.faults {
        let fault = faults::choose(&mut rng, desired);
        *fig.by_kind.entry(fault.kind().to_owned()).or_default() += 1;
        if let Err(e) = fault.inflict(lab, desired, &mut rng).await {
            fig.violations.push(format!("fault {k} ({fault}): {e}"));
        }
        let ended = Instant::now();
        match lab.converge(desired, CONVERGE_BOUND).await {
            // Less the second that confirms it.
            Ok(()) => fig
                .converge_ms
                .push(ms(ended.elapsed()).saturating_sub(1000)),
            Err(last) => fig.violations.push(format!(
                "fault {k} ({fault}): not converged within {} s: {last}",
                CONVERGE_BOUND.as_secs()
            )),
        }
        let broken = lab.settle(desired).await;
        println!(
            "fault {k}: {fault}: converged in {} ms, {} violations",
            ms(ended.elapsed()),
            broken.len()
        );
        fig.violations.extend(
            broken
                .into_iter()
                .map(|v| format!("after fault {k} ({fault}): {v}")),
        );
        fig.faults = k + 1;
        if fig.violations.len() > 30 {
            break; // broken already; the seed replays it
        }
    }

    if !sizes.soak.is_zero() && fig.violations.is_empty() {
        soak(lab, desired, sizes, &mut rng, &mut fig).await;
    }
    fig
}

/// Steady churn: one app replaced every 30 s, checked after each, with a
/// sample of the agent's resources every minute.
async fn soak(
    lab: &mut Lab,
    desired: &mut Desired,
    sizes: &Sizes,
    rng: &mut Rng,
    fig: &mut Figures,
) {
    let start = Instant::now();
    fig.samples.push(lab.sample(0).await);
    let mut next_sample = Duration::from_secs(60);
    while start.elapsed() < sizes.soak {
        let tick = Instant::now();
        let editable = desired.editable();
        if let Some(app) = rng.pick(&editable).cloned()
            && let Some(a) = desired.apps.get_mut(&app)
        {
            a.generation += 1;
            lab.agent
                .write_manifest(&format!("{app}.toml"), &a.manifest(&app));
            fig.soak_edits += 1;
        }
        if let Err(last) = lab.converge(desired, CONVERGE_BOUND).await {
            fig.violations.push(format!(
                "soak edit {}: not converged: {last}",
                fig.soak_edits
            ));
        }
        let broken = lab.settle(desired).await;
        fig.violations.extend(
            broken
                .into_iter()
                .map(|v| format!("soak edit {}: {v}", fig.soak_edits)),
        );
        if start.elapsed() >= next_sample {
            fig.samples
                .push(lab.sample(start.elapsed().as_secs()).await);
            next_sample += Duration::from_secs(60);
        }
        if fig.violations.len() > 30 {
            break;
        }
        if let Some(rest) = Duration::from_secs(30).checked_sub(tick.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }
    fig.samples
        .push(lab.sample(start.elapsed().as_secs()).await);
    fig.soak_secs = start.elapsed().as_secs();
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn summarize(fig: &Figures) -> serde_json::Value {
    let mut sorted = fig.converge_ms.clone();
    sorted.sort_unstable();
    let slope = |f: fn(&Sample) -> f64| -> Option<f64> {
        let n = fig.samples.len();
        if n < 2 {
            return None;
        }
        let xs: Vec<f64> = fig
            .samples
            .iter()
            .map(|s| s.at_secs as f64 / 3600.0)
            .collect();
        let ys: Vec<f64> = fig.samples.iter().map(f).collect();
        let (mx, my) = (
            xs.iter().sum::<f64>() / n as f64,
            ys.iter().sum::<f64>() / n as f64,
        );
        let num: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
        let den: f64 = xs.iter().map(|x| (x - mx).powi(2)).sum();
        (den > 0.0).then(|| num / den)
    };
    serde_json::json!({
        "seed": fig.seed,
        "faults": fig.faults,
        "by_kind": fig.by_kind,
        "instances_at_start": fig.instances_at_start,
        "violations": fig.violations.len(),
        "converge_ms_p50": percentile(&sorted, 0.5),
        "converge_ms_p99": percentile(&sorted, 0.99),
        "converge_ms_max": sorted.last().copied().unwrap_or(0),
        "soak_secs": fig.soak_secs,
        "soak_edits": fig.soak_edits,
        "start": fig.samples.first(),
        "end": fig.samples.last(),
        "slope_per_hour": {
            "rss_kib": slope(|s| s.rss_kib as f64),
            "fds": slope(|s| s.fds as f64),
            "tasks": slope(|s| s.tasks as f64),
            "nft_rules": slope(|s| s.nft_rules as f64),
        },
    })
}

impl Lab {
    async fn start(rig: &Rig, desired: &Desired) -> Self {
        let scratch = tempfile::tempdir().unwrap();
        // Two incompressible 12 MiB layers for a 16 MiB content store.
        let big = rig.big_archive(scratch.path());
        let registry = Registry::start(None);
        let big_image = registry.push(&big, None, "zattera/big:1");

        let ns = format!("zt-test-chaos-{}", std::process::id());
        let containerd = PrivateContainerd::start_with_content_limit(16);
        let (containerd, ctd) = containerd.with_test_image(rig, &ns).await;
        let foreign = start_foreign(&ctd, scratch.path()).await;

        let prefix = env_or("ZATTERA_CHAOS_PREFIX", PREFIX);
        let pool = env_or("ZATTERA_CHAOS_POOL", POOL);
        let mut agent = AgentProc::new(&containerd.socket, &ns, &prefix, &pool);
        agent.run_args = vec!["--default-subnet".into(), "none".into()];
        for (name, app) in &desired.apps {
            agent.write_manifest(&format!("{name}.toml"), &app.manifest(name));
        }
        let mut cfg = zattera_netns::NetConfig::for_namespace(&ns, &agent.run_dir()).unwrap();
        cfg.bridge_prefix = prefix;
        let table = cfg.nft_table.clone();
        let net = NetNode::new(cfg).unwrap();
        agent.start();
        let mut lab = Self {
            containerd,
            ctd,
            agent,
            net,
            big_image,
            watched: Watched {
                table,
                foreign,
                counter: (String::new(), 0),
            },
            _registry: registry,
            _scratch: scratch,
        };
        if let Err(last) = lab.converge(desired, Duration::from_secs(180)).await {
            panic!(
                "the starting set did not converge: {last}\n{}",
                lab.agent.log()
            );
        }
        let cid = lab
            .rows()
            .into_iter()
            .find(|r| r.app == COUNTER)
            .map(|r| r.container_id)
            .unwrap();
        let pid = lab.task_pids().await.get(&cid).copied().unwrap_or(0);
        lab.watched.counter = (cid, pid);
        lab
    }

    fn world(&self) -> World<'_> {
        World::of(&self.ctd, &self.net, &self.watched, self.agent.data_dir())
    }

    /// Waits until the status rows are the desired set, all up.
    async fn converge(&self, desired: &Desired, bound: Duration) -> Result<(), String> {
        converge_rows(
            || self.rows(),
            |rows| invariants::converged(desired, rows),
            bound,
        )
        .await
    }

    /// Every invariant, retried for [`SETTLE`]; what still fails then.
    async fn settle(&self, desired: &Desired) -> Vec<String> {
        let deadline = Instant::now() + SETTLE;
        loop {
            let rows = self.rows();
            let broken = invariants::check(&self.world(), desired, &rows).await;
            if broken.is_empty() || Instant::now() > deadline {
                return broken;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    async fn task_pids(&self) -> HashMap<String, u32> {
        self.ctd
            .tasks()
            .list(self.ctd.request(ListTasksRequest {
                filter: String::new(),
            }))
            .await
            .map(|r| {
                r.into_inner()
                    .tasks
                    .into_iter()
                    .map(|t| (t.id, t.pid))
                    .collect()
            })
            .unwrap_or_default()
    }

    async fn sample(&self, at_secs: u64) -> Sample {
        let pid = self.agent.pid().unwrap_or(0);
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let rss_kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0);
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count);
        let nft = std::process::Command::new("nft")
            .args(["-j", "list", "table", "inet", &self.watched.table])
            .output()
            .map(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap_or_default())
            .unwrap_or_default();
        let nft_rules = nft["nftables"].as_array().map_or(0, |items| {
            items.iter().filter(|i| i.get("rule").is_some()).count()
        });
        Sample {
            at_secs,
            rss_kib,
            fds,
            tasks: self.task_pids().await.len(),
            nft_rules,
        }
    }
}

/// Waits until `done` holds for the status rows on two polls a second
/// apart (a pass in flight can look converged once); on timeout, the last
/// rows.
async fn converge_rows(
    rows: impl Fn() -> Vec<invariants::Row>,
    done: impl Fn(&[invariants::Row]) -> bool,
    bound: Duration,
) -> Result<(), String> {
    let deadline = Instant::now() + bound;
    let mut seen = false;
    loop {
        let now = rows();
        if done(&now) {
            if seen {
                return Ok(());
            }
            seen = true;
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        seen = false;
        if Instant::now() > deadline {
            let have: Vec<String> = now
                .iter()
                .map(|r| format!("{} {} {} {}", r.id, r.container_id, r.state, r.message))
                .collect();
            return Err(format!("status {have:?}"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A container the agent did not make (no labels), running: every fault
/// must leave it exactly as it is. Returns its id and task pid.
async fn start_foreign(ctd: &Containerd, dir: &Path) -> (String, u32) {
    let id = "not-the-agents".to_owned();
    let name: ImageRef = TEST_IMAGE.parse().unwrap();
    let image = get_local(ctd, &name).await.unwrap().unwrap();
    let cfg = image.config.config().clone().unwrap_or_default();
    let c = ContainerSpec {
        hostname: "foreign".into(),
        args: spec::process_args(&[], &[], "while true; do sleep 1; done", true),
        env: spec::process_env("foreign", &cfg.env().clone().unwrap_or_default(), []).unwrap(),
        cwd: "/".into(),
        cgroups_path: format!("/zattera-test/{}/{id}", ctd.namespace()).into(),
        ..ContainerSpec::default()
    };
    containers::create(
        ctd,
        &NewContainer {
            id: id.clone(),
            image: name.to_string(),
            chain_id: image.chain_id,
            labels: HashMap::new(),
            spec: spec::build(&c).unwrap(),
            runtime: zattera_agent::runtime::oci_runtime::OciRuntime::Runc,
        },
    )
    .await
    .unwrap();
    let log = dir.join("foreign.log");
    let pid = containers::start(
        ctd,
        &id,
        &log_uri(
            Path::new(support::agent::BIN),
            &log,
            zattera_agent::logs::Retention::default(),
        ),
    )
    .await
    .unwrap();
    (id, pid)
}
