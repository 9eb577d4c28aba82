//! Builds as control runs them (issue 47.5): `RunBuild` through the node
//! API of a running agent, against the same build run by hand with the
//! peer's own CLI, cold and cached, in one run.
//!
//! The real release agent (`ZATTERA_TEST_AGENT_BIN`), joined to the test
//! control plane on loopback, builds a context that control serves as a
//! tarball over mTLS (its blob endpoint), the way control asks for a build:
//! fetch, unpack, build, load the image into the agent's namespace. The
//! Dockerfile copies 50 files of 1 MiB and runs a command, `FROM` a plain
//! registry on loopback.
//!
//! - **BuildKit** (`BUILDKITD`, with `buildctl` beside it): the agent's own
//!   buildkitd and its long-lived client session, against `buildctl build`
//!   on that same daemon socket with the same frontend and image exporter
//!   (`unpack=true`), its context already on disk. Cold: `buildctl prune
//!   --all` before each build of either.
//! - **buildah**: a second agent with `--build-backend buildah`, against
//!   `buildah bud` (same flags: `--isolation oci --layers`) plus the load a
//!   user would do: `buildah push` to an OCI archive and `ctr images
//!   import`. Cold: both storages emptied before each build.
//!
//! `RUNS` (default 5) of each, the peers alternating; medians. Prints `ROW`
//! lines for bench/report.sh. Root, after `scripts/rig.sh`; run by
//! bench/build/run.sh.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "../tests/support/control/mod.rs"]
mod control_plane;
#[path = "../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use control_plane::{AgentFlags, ControlPlane, ControlledAgent};
use zattera_agent::proto::cluster::RunBuildRequest;
use zattera_agent::proto::v1::{Build, BuildStatus, Meta};

const SECRET: &str = "bench-build-secret";
const FILES: usize = 50;

fn runs() -> usize {
    support::env_or("RUNS", 5)
}

fn main() {
    let Some((rig, rt)) = support::bench_rig("build_api") else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let ctx = work.path().join("ctx");
    write_files(&ctx);
    println!("context: {FILES} files of 1 MiB and a Dockerfile, sent by control as a tar.gz");
    if let Some(bin) = std::env::var("BUILDKITD").ok().filter(|b| !b.is_empty()) {
        rt.block_on(support::with_namespace(
            &rig,
            "bench-bapi-bk",
            |ctd, rig| {
                let ctx = ctx.clone();
                async move { buildkit(&ctd, &rig, &bin, &ctx).await }
            },
        ));
    } else {
        println!("BuildKit: skipped (BUILDKITD names no buildkitd)");
    }
    rt.block_on(support::with_namespace(
        &rig,
        "bench-bapi-ba",
        |ctd, rig| {
            let (ctx, dir) = (ctx.clone(), work.path().to_owned());
            async move { buildah(&ctd, &rig, &ctx, &dir).await }
        },
    ));
}

/// The context's 50 MiB of incompressible files.
fn write_files(ctx: &Path) {
    use ring::rand::SecureRandom;
    std::fs::create_dir_all(ctx.join("files")).unwrap();
    let rng = ring::rand::SystemRandom::new();
    let mut data = vec![0u8; 1 << 20];
    for i in 0..FILES {
        rng.fill(&mut data).unwrap();
        std::fs::write(ctx.join(format!("files/f{i}.bin")), &data).unwrap();
    }
}

/// The Dockerfile, `FROM base`; the context as control's tarball.
fn dockerfile(ctx: &Path, base: &str) -> Vec<u8> {
    std::fs::write(
        ctx.join("Dockerfile"),
        format!(
            "FROM {base}\nCOPY files /data\n\
             RUN find /data -type f | wc -l > /count && sha256sum /data/f1.bin > /sum\n"
        ),
    )
    .unwrap();
    tar_gz(ctx)
}

fn tar_gz(dir: &Path) -> Vec<u8> {
    let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::fast(),
    ));
    builder.append_dir_all(".", dir).unwrap();
    builder.into_inner().unwrap().finish().unwrap()
}

/// An agent joined to `cp` with `backend` flags, and control's blob
/// endpoint serving `tarball`: (agent, blob server, source URL).
async fn agent(
    cp: &ControlPlane,
    rig: &support::Rig,
    ns: &str,
    prefix: &str,
    backend: &[&str],
    tarball: Vec<u8>,
) -> (ControlledAgent, control_plane::blobs::BlobServer, String) {
    let blobs = cp.serve_blobs().await;
    let url = blobs.put(tarball);
    let agent = ControlledAgent::start_with(
        cp,
        SECRET,
        rig,
        ns,
        prefix,
        AgentFlags {
            run: backend,
            ..AgentFlags::default()
        },
    )
    .await;
    (agent, blobs, url)
}

/// One RunBuild as control sends it, timed to its terminal event.
async fn run_build(agent: &ControlledAgent, cp: &ControlPlane, id: &str, url: &str) -> Duration {
    let mut api = agent.api_as(cp, control_plane::CONTROL_NODE_ID).await;
    let req = RunBuildRequest {
        build: Some(Build {
            meta: Some(Meta {
                id: id.into(),
                ..Meta::default()
            }),
            ..Default::default()
        }),
        source_url: url.into(),
        ..Default::default()
    };
    let started = Instant::now();
    let mut stream = api.run_build(req).await.unwrap().into_inner();
    let mut end = None;
    let mut lines = Vec::new();
    while let Some(event) = stream.message().await.unwrap() {
        if let Some(log) = &event.log {
            lines.push((started.elapsed().as_millis(), log.line.clone()));
        }
        if event.status != 0 || !event.error.is_empty() {
            end = Some(event);
        }
    }
    let took = started.elapsed();
    // The first of each series shows where its time went.
    if id.ends_with("-0") {
        println!("      {id}, its log lines as they arrived:");
        for (ms, line) in lines {
            println!(
                "      +{ms:>5} ms  {}",
                line.chars().take(110).collect::<String>()
            );
        }
        println!("      +{:>5} ms  (the terminal event)", took.as_millis());
    }
    let end = end.unwrap_or_default();
    assert_eq!(
        end.status,
        BuildStatus::Succeeded as i32,
        "{id}: {end:?}\nagent log:\n{}",
        agent.log()
    );
    took
}

fn timed(what: &str, cmd: &mut Command) -> Duration {
    let started = Instant::now();
    let out = cmd.output().unwrap();
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    took
}

fn run_quiet(what: &str, cmd: &mut Command) {
    let _ = timed(what, cmd);
}

fn median(mut v: Vec<Duration>) -> f64 {
    v.sort_unstable();
    v[v.len() / 2].as_secs_f64() * 1000.0
}

/// `RUNS` rounds of (agent, peer), alternating which goes first, each
/// after `prepare`; prints both medians, the ratio and a ROW line.
async fn compare(
    row: &str,
    peer_name: &str,
    mut prepare: impl FnMut(),
    mut agent: impl AsyncFnMut(usize) -> Duration,
    mut peer: impl FnMut(usize) -> Duration,
) {
    let (mut a, mut p) = (Vec::new(), Vec::new());
    for r in 0..runs() {
        if r % 2 == 0 {
            prepare();
            a.push(agent(r).await);
            prepare();
            p.push(peer(r));
        } else {
            prepare();
            p.push(peer(r));
            prepare();
            a.push(agent(r).await);
        }
    }
    let show = |v: &[Duration]| {
        v.iter()
            .map(|d| format!("{}", d.as_millis()))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!(
        "   {row}: RunBuild ms {} | {peer_name} ms {}",
        show(&a),
        show(&p)
    );
    let (am, pm) = (median(a), median(p));
    let ratio = am / pm;
    println!(
        "ROW build | {row}, p50 ms | {am:.0} | {peer_name} | {pm:.0} | {ratio:.2} | <= 1.05 | {}",
        if ratio <= 1.05 { "met" } else { "MISSED" }
    );
}

/// A backend's two series against its peer: cold, each build after
/// `empty`; then, after one more of each, cached.
struct Series {
    tag: &'static str,
    name: &'static str,
    cold: &'static str,
    peer: &'static str,
}

impl Series {
    async fn run(
        &self,
        agent: &ControlledAgent,
        cp: &ControlPlane,
        url: &str,
        empty: impl FnMut(),
        by_hand: impl FnMut(usize) -> Duration + Copy,
    ) {
        let tag = self.tag;
        let cold = format!("{} cold ({})", self.name, self.cold);
        compare(
            &cold,
            self.peer,
            empty,
            async |r| run_build(agent, cp, &format!("{tag}-cold-{r}"), url).await,
            by_hand,
        )
        .await;
        run_build(agent, cp, &format!("{tag}-warm"), url).await;
        let mut warm = by_hand;
        warm(99);
        let cached = format!("{} cached", self.name);
        compare(
            &cached,
            self.peer,
            || {},
            async |r| run_build(agent, cp, &format!("{tag}-cached-{r}"), url).await,
            by_hand,
        )
        .await;
    }
}

async fn buildkit(
    ctd: &zattera_agent::runtime::Containerd,
    rig: &support::Rig,
    bin: &str,
    ctx: &Path,
) {
    // BuildKit speaks plain HTTP to a loopback registry.
    let registry = support::registry::Registry::start_with(None, None);
    let base = registry.push(&rig.oci_archive(), None, "base/busybox:1");
    let tarball = dockerfile(ctx, &base);
    let backend = [
        "--build-backend",
        "buildkit",
        "--buildkitd-binary",
        bin,
        "--build-subnet",
        "10.202.230.0/24",
    ];
    let ns = ctd.namespace().as_str().to_owned();
    let cp = ControlPlane::start(&[SECRET]).await;
    let (agent, _blobs, url) = agent(&cp, rig, &ns, "ztbq", &backend, tarball).await;
    let cleanup = agent.buildkitd_cleanup(&rig.socket);
    // The first build starts the agent's buildkitd; it is not timed.
    run_build(&agent, &cp, "bk-start", &url).await;
    let buildctl = Path::new(bin).with_file_name("buildctl");
    let addr = format!(
        "unix://{}",
        agent
            .dir
            .path()
            .join("run/buildkit/buildkitd.sock")
            .display()
    );
    let ctl = |args: &[&str]| {
        let mut c = Command::new(&buildctl);
        c.arg("--addr").arg(&addr).args(args);
        c
    };
    let by_hand = |r: usize| {
        let local = |name: &str| format!("{name}={}", ctx.display());
        let output =
            format!("type=image,name=zattera.local/bench/bkctl:{r},push=false,unpack=true");
        timed(
            "buildctl build",
            ctl(&["build", "--frontend", "dockerfile.v0"])
                .args([
                    "--local",
                    &local("context"),
                    "--local",
                    &local("dockerfile"),
                ])
                .args(["--output", &output]),
        )
    };
    println!("BuildKit, the agent's buildkitd ({bin}):");
    let prune = || run_quiet("buildctl prune", &mut ctl(&["prune", "--all"]));
    let series = Series {
        tag: "bk",
        name: "BuildKit",
        cold: "cache pruned",
        peer: "buildctl build, same daemon",
    };
    series.run(&agent, &cp, &url, prune, by_hand).await;
    drop(agent);
    cleanup.run().await;
}

async fn buildah(
    ctd: &zattera_agent::runtime::Containerd,
    rig: &support::Rig,
    ctx: &Path,
    work: &Path,
) {
    // buildah speaks TLS only: the base is on the cluster's registry, with
    // its CA and credentials, as control grants it.
    let cp = ControlPlane::start(&[SECRET]).await;
    let (chain, key) = cp.ca.server_identity();
    let registry = support::registry::Registry::start_with(
        Some(("builder", "build-pw")),
        Some((&chain, &key)),
    );
    let base = registry.push(&rig.oci_archive(), None, "base/busybox:1");
    cp.set_registry(control_plane::RegistryGrant {
        addr: registry.addr.to_string(),
        username: "builder".into(),
        password: "build-pw".into(),
    });
    let certs = work.join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    std::fs::write(certs.join("ca.crt"), &cp.ca.pem).unwrap();
    let tarball = dockerfile(ctx, &base);
    let backend = [
        "--build-backend",
        "buildah",
        "--build-subnet",
        "10.202.231.0/24",
    ];
    let ns = ctd.namespace().as_str().to_owned();
    let (agent, _blobs, url) = agent(&cp, rig, &ns, "ztbz", &backend, tarball).await;
    let agent_storage = agent.data_dir().join("buildah");
    let store = work.join("buildah-peer");
    let archive = work.join("by-hand.tar");
    let buildah_cmd = || {
        let mut c = Command::new("buildah");
        c.arg("--root")
            .arg(store.join("root"))
            .arg("--runroot")
            .arg(store.join("run"))
            .args(["--storage-driver", "overlay"]);
        c
    };
    let by_hand = |r: usize| {
        let tag = format!("localhost/bench/app:{r}");
        let started = Instant::now();
        run_quiet(
            "buildah bud",
            buildah_cmd()
                .args([
                    "bud",
                    "--isolation",
                    "oci",
                    "--network",
                    "host",
                    "--layers",
                    "-t",
                    &tag,
                ])
                .args(["--creds", "builder:build-pw", "--cert-dir"])
                .arg(&certs)
                .arg(ctx),
        );
        let _ = std::fs::remove_file(&archive);
        run_quiet(
            "buildah push",
            buildah_cmd()
                .args(["push", "--disable-compression", &tag])
                .arg(format!(
                    "oci-archive:{}:zattera.local/bench/hand:{r}",
                    archive.display()
                )),
        );
        run_quiet(
            "ctr images import",
            Command::new("ctr")
                .arg("--address")
                .arg(&rig.socket)
                .args(["-n", &ns, "images", "import"])
                .arg(&archive),
        );
        started.elapsed()
    };
    let empty = || {
        unmount_under(&store);
        unmount_under(&agent_storage);
        let _ = std::fs::remove_dir_all(&store);
        let _ = std::fs::remove_dir_all(&agent_storage);
    };
    println!("buildah, bud and the load into containerd:");
    let series = Series {
        tag: "ba",
        name: "buildah",
        cold: "storage emptied",
        peer: "buildah bud + push + ctr import",
    };
    series.run(&agent, &cp, &url, empty, by_hand).await;
    drop(agent);
    empty();
}

/// Unmounts whatever buildah left mounted under `dir` (its overlay layers).
fn unmount_under(dir: &Path) {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let prefix = dir.to_string_lossy().into_owned();
    let mut ours: Vec<PathBuf> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|m| m.starts_with(&prefix))
        .map(PathBuf::from)
        .collect();
    ours.sort_unstable_by_key(|m| std::cmp::Reverse(m.as_os_str().len()));
    for m in ours {
        let _ = Command::new("umount").arg("-l").arg(&m).status();
    }
}
