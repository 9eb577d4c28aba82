//! Create-to-running latency of one container (issue 3, "Benchmarks"):
//! the agent's library path against `ctr run -d` of the same image, in the
//! same containerd, interleaved round by round so that both see the same
//! noise. Run with `cargo bench -p zattera-agent --bench runtime` as root
//! after `scripts/rig.sh` (bench/runtime/run.sh does both).
//!
//! - agent: image lookup (`get_local`), spec, `containers::create` (rootfs
//!   snapshot + container record), `containers::start` with the `binary://`
//!   log shim, exactly as the executor and tests/containers.rs do it; timed
//!   until `start` returns the task's pid.
//! - ctr: `ctr --address <sock> -n <ns> run -d <image> <id> sleep 1000`,
//!   timed from spawn until the process exits (it exits once the task runs).
//!
//! Both run `sleep 1000` from `docker.io/zattera/busybox:test`, imported once
//! into a namespace of our own (`zt-bench-rt-<pid>`). Every round removes its
//! two containers (untimed); the namespace and its cgroups go at the end,
//! also when a round fails.
//!
//! Environment: `ROUNDS` (default 20); `ZATTERA_TEST_CONTAINERD` and
//! `ZATTERA_TEST_IMAGES` as for the tests (default: the rig's).

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::FutureExt;
use zattera_agent::logs::{Retention, shim::log_uri};
use zattera_agent::runtime::containers::{self, NewContainer, TaskState};
use zattera_agent::runtime::spec::{self, ContainerSpec};
use zattera_agent::runtime::{Containerd, ImageRef, Namespace, get_local, import_archive};

const IMAGE: &str = support::TEST_IMAGE;

fn main() {
    let Some(rig) = support::rig() else {
        println!("runtime bench: skipped");
        return;
    };
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(20);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run(&rig.socket, &rig.images, rounds));
}

async fn run(socket: &Path, images: &Path, rounds: usize) {
    let ns: Namespace = format!("zt-bench-rt-{}", std::process::id())
        .parse()
        .unwrap();
    let ctd = Containerd::connect(socket, ns.clone())
        .await
        .expect("connect to containerd");
    let logs = tempfile::tempdir().unwrap();
    let outcome = std::panic::AssertUnwindSafe(bench(&ctd, socket, images, logs.path(), rounds))
        .catch_unwind()
        .await;
    support::purge_namespace(&ctd).await;
    remove_cgroups(ns.as_str());
    match outcome {
        Ok((ours, ctr, create, start)) => report(&ours, &ctr, &create, &start),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

type Samples = Vec<Duration>;

async fn bench(
    ctd: &Containerd,
    socket: &Path,
    images: &Path,
    logs: &Path,
    rounds: usize,
) -> (Samples, Samples, Samples, Samples) {
    import_archive(ctd, &images.join("busybox-oci.tar"), None)
        .await
        .expect("import the test image");
    let agent_binary = PathBuf::from(env!("CARGO_BIN_EXE_zattera-agent"));
    let (mut ours, mut ctr, mut create, mut start) = (vec![], vec![], vec![], vec![]);
    // One warm-up of each (shim binaries, page cache), not counted.
    agent_once(ctd, &agent_binary, logs, "warm-a").await;
    ctr_once(ctd, socket, "warm-c");
    for round in 0..rounds {
        let a = format!("a{round}");
        let c = format!("c{round}");
        // Alternate who goes first, so neither always follows a teardown.
        if round % 2 == 0 {
            let (t, cr, st) = agent_once(ctd, &agent_binary, logs, &a).await;
            ours.push(t);
            create.push(cr);
            start.push(st);
            ctr.push(ctr_once(ctd, socket, &c));
        } else {
            ctr.push(ctr_once(ctd, socket, &c));
            let (t, cr, st) = agent_once(ctd, &agent_binary, logs, &a).await;
            ours.push(t);
            create.push(cr);
            start.push(st);
        }
        for id in [&a, &c] {
            assert_running(ctd, id).await;
        }
        for id in [&a, &c] {
            containers::remove(ctd, id, 9, Duration::from_secs(5))
                .await
                .unwrap_or_else(|e| panic!("remove {id}: {e}"));
        }
    }
    for id in ["warm-a", "warm-c"] {
        let _ = containers::remove(ctd, id, 9, Duration::from_secs(5)).await;
    }
    (ours, ctr, create, start)
}

/// The agent's path; returns (total, create part, start part).
async fn agent_once(
    ctd: &Containerd,
    agent_binary: &Path,
    logs: &Path,
    id: &str,
) -> (Duration, Duration, Duration) {
    let t0 = Instant::now();
    let name: ImageRef = IMAGE.parse().unwrap();
    let image = get_local(ctd, &name)
        .await
        .expect("image lookup")
        .expect("image present");
    let cfg = image.config.config().clone().unwrap_or_default();
    let c = ContainerSpec {
        hostname: id.into(),
        args: vec!["sleep".into(), "1000".into()],
        env: spec::process_env(id, &cfg.env().clone().unwrap_or_default(), []),
        cwd: "/".into(),
        // ctr's default: /<namespace>/<id>.
        cgroups_path: format!("/{}/{id}", ctd.namespace()).into(),
        ..ContainerSpec::default()
    };
    let labels = HashMap::from([("dev.zattera/managed".to_owned(), "true".to_owned())]);
    containers::create(
        ctd,
        &NewContainer {
            id: id.into(),
            image: name.to_string(),
            chain_id: image.chain_id,
            labels,
            spec: spec::build(&c).unwrap(),
        },
    )
    .await
    .expect("create");
    let t1 = Instant::now();
    containers::start(
        ctd,
        id,
        &log_uri(
            agent_binary,
            &logs.join(format!("{id}.log")),
            Retention::default(),
        ),
    )
    .await
    .expect("start");
    let t2 = Instant::now();
    (t2 - t0, t1 - t0, t2 - t1)
}

fn ctr_once(ctd: &Containerd, socket: &Path, id: &str) -> Duration {
    let t0 = Instant::now();
    let out = Command::new("ctr")
        .arg("--address")
        .arg(socket)
        .args([
            "-n",
            ctd.namespace().as_str(),
            "run",
            "-d",
            IMAGE,
            id,
            "sleep",
            "1000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .expect("ctr (apt install containerd)");
    let elapsed = t0.elapsed();
    assert!(
        out.status.success(),
        "ctr run {id}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    elapsed
}

async fn assert_running(ctd: &Containerd, id: &str) {
    let state = containers::task_state(ctd, id).await.unwrap();
    assert!(
        matches!(state, TaskState::Running { .. }),
        "{id} is not running: {state:?}"
    );
}

/// runc removes each container's leaf cgroup; this removes `/<namespace>`.
fn remove_cgroups(namespace: &str) {
    let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    let mut dirs = vec![PathBuf::from("/sys/fs/cgroup").join(namespace)];
    dirs.extend(hierarchies.flatten().map(|h| h.path().join(namespace)));
    for dir in dirs {
        if let Ok(children) = std::fs::read_dir(&dir) {
            for child in children.flatten().filter(|c| c.path().is_dir()) {
                let _ = std::fs::remove_dir(child.path());
            }
        }
        let _ = std::fs::remove_dir(&dir);
    }
}

fn pct(samples: &[Duration], p: usize) -> Duration {
    let mut s = samples.to_vec();
    s.sort_unstable();
    // Nearest rank.
    let rank = (p * s.len()).div_ceil(100).max(1);
    s[rank - 1]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn report(ours: &[Duration], ctr: &[Duration], create: &[Duration], start: &[Duration]) {
    println!(
        "== create-to-running, {} interleaved rounds, same image, same containerd",
        ours.len()
    );
    println!(
        "{:<44} {:>9} {:>9} {:>9} {:>9}",
        "", "min ms", "p50 ms", "p90 ms", "max ms"
    );
    let row = |name: &str, s: &[Duration]| {
        println!(
            "{name:<44} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
            ms(pct(s, 0)),
            ms(pct(s, 50)),
            ms(pct(s, 90)),
            ms(pct(s, 100))
        );
    };
    row("agent get_local+create+start (log shim)", ours);
    row("  of which create (snapshot + record)", create);
    row("  of which start (task create + start)", start);
    row("ctr run -d", ctr);
    let r50 = ms(pct(ours, 50)) / ms(pct(ctr, 50));
    let r90 = ms(pct(ours, 90)) / ms(pct(ctr, 90));
    println!(
        "ratio agent/ctr: p50 {r50:.2} ({}), p90 {r90:.2}  (goal <= 1.0)",
        if r50 <= 1.0 { "met" } else { "MISSED" }
    );
    println!(
        "RESULT create_p50_ratio={r50:.3} create_p90_ratio={r90:.3} agent_p50_ms={:.1} ctr_p50_ms={:.1}",
        ms(pct(ours, 50)),
        ms(pct(ctr, 50))
    );
}
