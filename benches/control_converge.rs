//! A pushed set of 1,000 assignments where 10 change (issue 13,
//! "Benchmarks"): the pass converges only those 10.
//!
//! The real `zattera-agent run --control` binary, after `join`, against the
//! test control plane on loopback, with its containerd socket pointed at a
//! counting gRPC proxy in front of the rig's containerd: every call is
//! counted by method. Control pushes `ASSIGNMENTS` (default 1,000) busybox
//! `sleep`s on four environment subnets (10.201.142-145.0/24, bridge prefix
//! `ztbv`) and waits for all of them HEALTHY. Then:
//!
//! 1. steady state for `WINDOW_SECS` (default 30): the calls per second of
//!    a node with nothing to do (workers' polls), and the 5 s tick's no-op
//!    pass times, read from the agent's `zattera::pass` debug log;
//! 2. a push where `CHANGED` (default 10) config hashes change: the calls
//!    until those are HEALTHY on their new containers and the old ones are
//!    gone, less the steady rate over the same time, and the time of the
//!    pass that started them, as a ratio to the no-op pass.
//!
//! Root, after `scripts/rig.sh`: `cargo bench -p zattera-agent --bench
//! control_converge` (bench/control/run.sh). Everything is removed at the end.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "../tests/support/control/mod.rs"]
mod control_plane;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use control_plane::ControlPlane;
use zattera_agent::proto::cluster::{AssignmentRuntime, AssignmentSet};
use zattera_agent::proto::v1::{Assignment, AssignmentDesired, InstanceState, Meta, ServiceSpec};
use zattera_agent::runtime::{containers, import_archive};

const SECRET: &str = "bench-secret";
const PREFIX: &str = "ztbv";
const FIRST_SLOT: usize = 142;
const PER_SUBNET: usize = 250;

type Counts = Arc<Mutex<BTreeMap<String, u64>>>;

fn main() {
    let Some((rig, rt)) = support::bench_rig("control_converge") else {
        return;
    };
    rt.block_on(support::with_namespace(
        &rig,
        "bench-cv",
        |ctd, rig| async move { run(ctd, rig).await },
    ));
}

fn id(i: usize) -> String {
    format!("cv-{i:04}")
}

fn set(version: u64, n: usize, changed: usize) -> AssignmentSet {
    let mut s = AssignmentSet {
        version,
        ..AssignmentSet::default()
    };
    for i in 0..n {
        let slot = FIRST_SLOT + i / PER_SUBNET;
        s.assignments.push(Assignment {
            meta: Some(Meta {
                id: id(i),
                ..Meta::default()
            }),
            project_id: "proj".into(),
            app_id: format!("app-{slot}"),
            environment_id: format!("env-{slot}"),
            desired: AssignmentDesired::Run as i32,
            config_hash: if i < changed { "h2" } else { "h1" }.into(),
            release_id: "r1".into(),
            ..Assignment::default()
        });
        s.runtime.insert(
            id(i),
            AssignmentRuntime {
                image_ref: support::TEST_IMAGE.into(),
                spec: Some(ServiceSpec {
                    // Exits on SIGTERM at once: the stops measure the agent, not a grace period.
                    command: "trap 'exit 0' TERM; sleep 100000 & wait".into(),
                    ..ServiceSpec::default()
                }),
                subnet_cidr: format!("10.201.{slot}.0/24"),
                ..AssignmentRuntime::default()
            },
        );
    }
    s
}

/// A gRPC (HTTP/2) proxy on `socket` to containerd at `upstream` that
/// counts every request by its path.
async fn counting_proxy(socket: PathBuf, upstream: PathBuf, counts: Counts) {
    let listener = tokio::net::UnixListener::bind(&socket).unwrap();
    loop {
        let Ok((conn, _)) = listener.accept().await else {
            continue;
        };
        let (upstream, counts) = (upstream.clone(), Arc::clone(&counts));
        tokio::spawn(async move {
            let Ok(mut server) = h2::server::handshake(conn).await else {
                return;
            };
            let up = tokio::net::UnixStream::connect(&upstream).await.unwrap();
            let (client, connection) = h2::client::handshake(up).await.unwrap();
            tokio::spawn(connection);
            while let Some(Ok((req, respond))) = server.accept().await {
                *counts
                    .lock()
                    .unwrap()
                    .entry(req.uri().path().to_owned())
                    .or_default() += 1;
                tokio::spawn(forward(req, respond, client.clone()));
            }
        });
    }
}

async fn forward(
    req: http::Request<h2::RecvStream>,
    mut respond: h2::server::SendResponse<bytes::Bytes>,
    client: h2::client::SendRequest<bytes::Bytes>,
) -> Result<(), h2::Error> {
    let (parts, body) = req.into_parts();
    let mut client = client.ready().await?;
    let (response, send) = client.send_request(http::Request::from_parts(parts, ()), false)?;
    tokio::spawn(pump(body, send));
    let (parts, body) = response.await?.into_parts();
    let send = respond.send_response(http::Response::from_parts(parts, ()), false)?;
    pump(body, send).await
}

/// Copies one side of a call: its data frames, then its trailers.
async fn pump(
    mut body: h2::RecvStream,
    mut send: h2::SendStream<bytes::Bytes>,
) -> Result<(), h2::Error> {
    while let Some(chunk) = body.data().await {
        let chunk = chunk?;
        let _ = body.flow_control().release_capacity(chunk.len());
        send.send_data(chunk, false)?;
    }
    match body.trailers().await? {
        Some(t) => send.send_trailers(t),
        None => send.send_data(bytes::Bytes::new(), true),
    }
}

/// The assignments control has seen HEALTHY on a container whose id ends
/// with `suffix` (control keeps HEALTHY over the polls' RUNNING).
fn healthy_ids(r: &control_plane::Record, suffix: &str) -> std::collections::HashSet<String> {
    use zattera_agent::proto::cluster::agent_message::Body;
    r.frames
        .iter()
        .filter_map(|(_, f)| match &f.body {
            Some(Body::Status(b)) => Some(&b.observed),
            _ => None,
        })
        .flat_map(|observed| observed.iter())
        .filter(|(_, o)| {
            o.state == InstanceState::Healthy as i32 && o.container_id.ends_with(suffix)
        })
        .map(|(id, _)| id.clone())
        .collect()
}

/// `(elapsed_us, runs, removals)` of every pass logged after byte `from`.
fn passes(log: &Path, from: usize) -> Vec<(u64, u64, u64)> {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let field = |line: &str, key: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse::<u64>().ok())
    };
    text.get(from..)
        .unwrap_or("")
        .lines()
        .filter(|l| l.contains("reconcile pass"))
        .filter_map(|l| {
            Some((
                field(l, "elapsed_us=")?,
                field(l, "runs=")?,
                field(l, "removals=")?,
            ))
        })
        .collect()
}

fn log_len(log: &Path) -> usize {
    std::fs::metadata(log).map_or(0, |m| usize::try_from(m.len()).unwrap_or(0))
}

fn p50(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

#[allow(clippy::too_many_lines, clippy::cast_precision_loss)]
async fn run(ctd: zattera_agent::runtime::Containerd, rig: support::Rig) {
    let n: usize = support::env_or("ASSIGNMENTS", 1000).min(PER_SUBNET * 4);
    let changed: usize = support::env_or("CHANGED", 10).min(n);
    let window = Duration::from_secs(support::env_or("WINDOW_SECS", 30));
    let converge_limit = Duration::from_secs(support::env_or("CONVERGE_SECS", 1800));
    import_archive(&ctd, &rig.oci_archive(), None)
        .await
        .expect("import the test image");
    let dir = tempfile::tempdir().unwrap();
    let counts: Counts = Arc::default();
    let proxy_socket = dir.path().join("containerd.sock");
    tokio::spawn(counting_proxy(
        proxy_socket.clone(),
        rig.socket.clone(),
        Arc::clone(&counts),
    ));
    let cp = ControlPlane::start(&[SECRET]).await;
    let data = dir.path().join("data");
    let run_dir = dir.path().join("run");
    // AGENT measures another build (the code before a change) in the same run.
    let agent =
        std::env::var("AGENT").unwrap_or_else(|_| env!("CARGO_BIN_EXE_zattera-agent").into());
    let agent = agent.as_str();
    control_plane::join_cli(&data, &cp.address(), &cp.ca.token(SECRET), &[]);
    let net_cfg =
        zattera_netns::NetConfig::for_namespace(ctd.namespace().as_str(), &run_dir).unwrap();
    let _cleanup = support::NetCleanup {
        prefix: PREFIX.into(),
        table: net_cfg.nft_table.clone(),
        run_dir: run_dir.clone(),
    };
    let api = control_plane::free_loopback_addr().await;
    let log = dir.path().join("agent.log");
    let mut child = cp
        .agent_command(&control_plane::AgentRun {
            binary: Path::new(agent),
            socket: &proxy_socket,
            namespace: ctd.namespace().as_str(),
            run_dir: &run_dir,
            data_dir: &data,
            bridge_prefix: PREFIX,
            api_addr: &api,
        })
        .env("RUST_LOG", "warn,zattera::pass=debug")
        .env("NO_COLOR", "1")
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();

    let started = Instant::now();
    cp.push_set(set(1, n, 0));
    let mut last_print = Instant::now();
    loop {
        let up = cp.with(|r| healthy_ids(r, "-h1").len());
        if up == n {
            break;
        }
        // Failing (and so purging the namespace) before bench/report.py's
        // limit stops the process and strands its containers.
        assert!(
            started.elapsed() < converge_limit,
            "only {up} of {n} HEALTHY after {converge_limit:?}; agent log {}",
            log.display()
        );
        if last_print.elapsed() > Duration::from_secs(30) {
            println!("  {up} of {n} HEALTHY after {:.0?}", started.elapsed());
            last_print = Instant::now();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    println!(
        "control_converge bench: {n} instances HEALTHY after {:.0?}",
        started.elapsed()
    );
    tokio::time::sleep(Duration::from_secs(12)).await;

    // 1. Steady state.
    let from = log_len(&log);
    counts.lock().unwrap().clear();
    let t = Instant::now();
    tokio::time::sleep(window).await;
    let steady_secs = t.elapsed().as_secs_f64();
    let steady = counts.lock().unwrap().clone();
    let noop: Vec<u64> = passes(&log, from)
        .into_iter()
        .filter(|(_, runs, removals)| *runs == 0 && *removals == 0)
        .map(|(us, _, _)| us)
        .collect();

    // 2. Ten changes.
    let from = log_len(&log);
    counts.lock().unwrap().clear();
    let t = Instant::now();
    cp.push_set(set(2, n, changed));
    loop {
        let moved = cp.with(|r| healthy_ids(r, "-h2").len() == changed);
        let listed = containers::list(&ctd, &[("dev.zattera/managed", "true")])
            .await
            .map_or(usize::MAX, |l| l.len());
        if moved && listed == n {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(300),
            "the {changed} changes did not converge in 5 min"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let change_secs = t.elapsed().as_secs_f64();
    let during = counts.lock().unwrap().clone();
    let change_pass: Vec<u64> = passes(&log, from)
        .into_iter()
        .filter(|(_, runs, removals)| *runs > 0 || *removals > 0)
        .map(|(us, _, _)| us)
        .collect();

    println!(
        "  steady: {:.0} containerd calls/s over {steady_secs:.0} s; no-op pass p50 {:.1} ms ({} passes)",
        steady.values().sum::<u64>() as f64 / steady_secs,
        p50(noop.clone()) as f64 / 1000.0,
        noop.len()
    );
    println!(
        "  {changed} changes: converged in {change_secs:.1} s; passes that started or stopped work: {:?} ms",
        change_pass
            .iter()
            .map(|us| format!("{:.1}", *us as f64 / 1000.0))
            .collect::<Vec<_>>()
    );
    if let (Some(first), true) = (change_pass.first(), !noop.is_empty()) {
        println!(
            "  change pass / no-op pass: {:.2}",
            *first as f64 / p50(noop).max(1) as f64
        );
    }
    println!("  containerd calls in the change window, less the steady rate over it:");
    let mut attributed = 0.0;
    for (method, count) in &during {
        let base = steady.get(method).copied().unwrap_or(0) as f64 / steady_secs * change_secs;
        let extra = *count as f64 - base;
        if extra >= 0.5 {
            attributed += extra;
            println!("    {extra:>7.0}  {method}");
        }
    }
    println!(
        "  = {attributed:.0} calls for {changed} changed instances of {n} ({:.1} per change)",
        attributed / changed.max(1) as f64
    );

    // Converge to nothing through the agent, then stop it.
    cp.push_set(AssignmentSet {
        version: 3,
        ..AssignmentSet::default()
    });
    let deadline = Instant::now() + Duration::from_secs(900);
    while !containers::list(&ctd, &[]).await.unwrap().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        let _ = std::fs::remove_dir(
            Path::new(root)
                .join("zattera")
                .join(ctd.namespace().as_str()),
        );
    }
}
