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
//! - runc, the floor: `runc run -d` of the agent's own spec (the same
//!   [`spec::build`] output, seccomp filter included) on the image's layers
//!   unpacked once into a plain directory: no containerd, no shim, no
//!   snapshot, no log shim. Timed from spawn until runc exits.
//!
//! Both run `sleep 1000` from `docker.io/zattera/busybox:test`, imported once
//! into a namespace of our own (`zt-bench-rt-<pid>`). Every round removes its
//! two containers (untimed); the namespace and its cgroups go at the end,
//! also when a round fails.
//!
//! Environment: `ROUNDS` (default 20); `ZATTERA_TEST_CONTAINERD` and
//! `ZATTERA_TEST_IMAGES` as for the tests (default: the rig's).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

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
    let Some((rig, rt)) = support::bench_rig("runtime") else {
        return;
    };
    let rounds: usize = support::env_or("ROUNDS", 20);
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
        Ok(samples) => report(&samples),
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

type Samples = Vec<Duration>;

#[derive(Default)]
struct Rounds {
    ours: Samples,
    create: Samples,
    start: Samples,
    ctr: Samples,
    runc: Samples,
}

async fn bench(
    ctd: &Containerd,
    socket: &Path,
    images: &Path,
    logs: &Path,
    rounds: usize,
) -> Rounds {
    let archive = images.join("busybox-oci.tar");
    import_archive(ctd, &archive, None)
        .await
        .expect("import the test image");
    let agent_binary = PathBuf::from(env!("CARGO_BIN_EXE_zattera-agent"));
    let runc = Runc::new(&archive, ctd.namespace().as_str());
    let mut samples = Rounds::default();
    // One warm-up of each (shim binaries, page cache), not counted.
    agent_once(ctd, &agent_binary, logs, "warm-a").await;
    ctr_once(ctd, socket, "warm-c");
    runc.run_once("warm-r");
    runc.remove("warm-r");
    for round in 0..rounds {
        let a = format!("a{round}");
        let c = format!("c{round}");
        let b = format!("r{round}");
        // Rotate who goes first, so none always follows a teardown.
        for peer in (0..3).map(|i| (i + round) % 3) {
            match peer {
                0 => {
                    let (t, cr, st) = agent_once(ctd, &agent_binary, logs, &a).await;
                    samples.ours.push(t);
                    samples.create.push(cr);
                    samples.start.push(st);
                }
                1 => samples.ctr.push(ctr_once(ctd, socket, &c)),
                _ => samples.runc.push(runc.run_once(&b)),
            }
        }
        for id in [&a, &c] {
            assert_running(ctd, id).await;
        }
        runc.assert_running(&b);
        for id in [&a, &c] {
            containers::remove(ctd, id, 9, Duration::from_secs(5))
                .await
                .unwrap_or_else(|e| panic!("remove {id}: {e}"));
        }
        runc.remove(&b);
    }
    for id in ["warm-a", "warm-c"] {
        let _ = containers::remove(ctd, id, 9, Duration::from_secs(5)).await;
    }
    samples
}

/// The agent's spec, as [`agent_once`] builds it.
fn bench_spec(namespace: &str, id: &str, image_env: &[String]) -> ContainerSpec {
    ContainerSpec {
        hostname: id.into(),
        args: vec!["sleep".into(), "1000".into()],
        env: spec::process_env(id, image_env, []).unwrap(),
        cwd: "/".into(),
        // ctr's default: /<namespace>/<id>.
        cgroups_path: format!("/{namespace}/{id}").into(),
        image_architecture: "amd64".into(),
        ..ContainerSpec::default()
    }
}

/// Bare runc on the image unpacked into a directory (its own `--root`, so
/// it never sees another runc's containers).
struct Runc {
    dir: tempfile::TempDir,
    namespace: String,
    image_env: Vec<String>,
}

impl Runc {
    fn new(archive: &Path, namespace: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let image_env = unpack_archive(archive, &dir.path().join("rootfs"));
        std::fs::create_dir(dir.path().join("state")).unwrap();
        Runc {
            dir,
            namespace: namespace.into(),
            image_env,
        }
    }

    fn runc(&self) -> Command {
        let mut cmd = Command::new("runc");
        cmd.arg("--root").arg(self.dir.path().join("state"));
        cmd.stdin(Stdio::null()).stdout(Stdio::null());
        cmd
    }

    fn run_once(&self, id: &str) -> Duration {
        let bundle = self.dir.path().join(id);
        std::fs::create_dir(&bundle).unwrap();
        let mut oci = spec::build(&bench_spec(&self.namespace, id, &self.image_env)).unwrap();
        oci.set_root(Some(
            oci_spec::runtime::RootBuilder::default()
                .path(self.dir.path().join("rootfs"))
                .readonly(false)
                .build()
                .unwrap(),
        ));
        oci.save(bundle.join("config.json")).unwrap();
        // The container inherits runc's stdio: a pipe would never close.
        let stderr_path = self.dir.path().join(format!("{id}.stderr"));
        let stderr = std::fs::File::create(&stderr_path).unwrap();
        let t0 = Instant::now();
        let status = self
            .runc()
            .args(["run", "-d", "--bundle"])
            .arg(&bundle)
            .arg(id)
            .stderr(stderr)
            .status()
            .expect("runc (apt install runc)");
        let elapsed = t0.elapsed();
        assert!(
            status.success(),
            "runc run {id}: {}",
            std::fs::read_to_string(&stderr_path).unwrap_or_default()
        );
        elapsed
    }

    fn assert_running(&self, id: &str) {
        let out = self
            .runc()
            .args(["state", id])
            .stdout(Stdio::piped())
            .output()
            .unwrap();
        let state: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        assert_eq!(state["status"], "running", "runc {id}: {state}");
    }

    fn remove(&self, id: &str) {
        let _ = self
            .runc()
            .args(["delete", "-f", id])
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(self.dir.path().join(id));
        let _ = std::fs::remove_file(self.dir.path().join(format!("{id}.stderr")));
    }
}

impl Drop for Runc {
    fn drop(&mut self) {
        let state = self.dir.path().join("state");
        for entry in std::fs::read_dir(&state).into_iter().flatten().flatten() {
            self.remove(&entry.file_name().to_string_lossy());
        }
    }
}

/// Unpacks the first image of an OCI archive into `rootfs`; returns its Env.
fn unpack_archive(archive: &Path, rootfs: &Path) -> Vec<String> {
    let layout = tempfile::tempdir().unwrap();
    tar::Archive::new(std::fs::File::open(archive).unwrap())
        .unpack(layout.path())
        .unwrap();
    let blob = |digest: &str| {
        let hex = digest.strip_prefix("sha256:").unwrap();
        layout.path().join("blobs/sha256").join(hex)
    };
    let json = |path: PathBuf| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
    };
    let index = json(layout.path().join("index.json"));
    let manifest = json(blob(index["manifests"][0]["digest"].as_str().unwrap()));
    for layer in manifest["layers"].as_array().unwrap() {
        let file = std::fs::File::open(blob(layer["digest"].as_str().unwrap())).unwrap();
        let media = layer["mediaType"].as_str().unwrap_or_default();
        let reader: Box<dyn std::io::Read> = if media.ends_with("gzip") {
            Box::new(flate2::read::GzDecoder::new(file))
        } else {
            Box::new(file)
        };
        let mut layer = tar::Archive::new(reader);
        layer.set_preserve_permissions(true);
        layer.unpack(rootfs).unwrap();
    }
    let config = json(blob(manifest["config"]["digest"].as_str().unwrap()));
    config["config"]["Env"]
        .as_array()
        .map(|env| {
            env.iter()
                .filter_map(|e| e.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
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
    let mut c = bench_spec(
        ctd.namespace().as_str(),
        id,
        &cfg.env().clone().unwrap_or_default(),
    );
    c.image_architecture = image.config.architecture().to_string();
    let labels = HashMap::from([("dev.zattera/managed".to_owned(), "true".to_owned())]);
    containers::create(
        ctd,
        &NewContainer {
            id: id.into(),
            image: name.to_string(),
            chain_id: image.chain_id,
            labels,
            spec: spec::build(&c).unwrap(),
            runtime: zattera_agent::runtime::oci_runtime::OciRuntime::Runc,
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

fn report(r: &Rounds) {
    println!(
        "== create-to-running, {} interleaved rounds, same image, same containerd",
        r.ours.len()
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
    row("agent get_local+create+start (log shim)", &r.ours);
    row("  of which create (snapshot + record)", &r.create);
    row("  of which start (task create + start)", &r.start);
    row("ctr run -d", &r.ctr);
    row("runc run -d, same spec, plain rootfs (floor)", &r.runc);
    let r50 = ms(pct(&r.ours, 50)) / ms(pct(&r.ctr, 50));
    let r90 = ms(pct(&r.ours, 90)) / ms(pct(&r.ctr, 90));
    let floor50 = ms(pct(&r.ours, 50)) / ms(pct(&r.runc, 50));
    println!(
        "ratio agent/ctr: p50 {r50:.2} ({}), p90 {r90:.2}  (goal <= 1.0); agent/runc p50 {floor50:.2}",
        if r50 <= 1.0 { "met" } else { "MISSED" }
    );
    println!(
        "RESULT create_p50_ratio={r50:.3} create_p90_ratio={r90:.3} agent_p50_ms={:.1} ctr_p50_ms={:.1} runc_p50_ms={:.1} runc_p50_ratio={floor50:.3}",
        ms(pct(&r.ours, 50)),
        ms(pct(&r.ctr, 50)),
        ms(pct(&r.runc, 50))
    );
}
