//! Agent CPU with the control stream open and 50 instances (issue 7,
//! "Benchmarks"; goal ≤ 1 % of a core).
//!
//! The real `zattera-agent run --control` binary against the test control
//! plane (tests/support/control/, on loopback), after `zattera-agent join`.
//! Control pushes 50 busybox instances (`sleep`, no health check), and once
//! all are HEALTHY it behaves like the reference control plane does under a
//! steady cluster: it re-pushes the whole set every 2 s (its status commits
//! echo back as assignment changes) with a new version, and one route
//! snapshot with a VIP for the app. Over `IDLE_SECS` (default 60) the bench
//! reads the CPU time (`utime + stime`, /proc/<pid>/stat) of the agent and,
//! as the same-run peer, of the rig's containerd, which idles beside the same
//! 50 containers. Heartbeats go at the reference's 10 s.
//!
//! Root, after `scripts/rig.sh`: `cargo bench -p zattera-agent --bench control_cpu`
//! (bench/control/run.sh). Namespace `zt-bench-cp-<pid>`, bridge prefix
//! `ztbq`, subnet 10.201.141.0/24; everything is removed at the end.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "../tests/support/control/mod.rs"]
mod control_plane;
#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use control_plane::ControlPlane;
use zattera_agent::proto::cluster::{
    AssignmentRuntime, AssignmentSet, Endpoint, InternalPort, InternalService, RouteSnapshot,
};
use zattera_agent::proto::v1::{
    Assignment, AssignmentDesired, AssignmentObserved, InstanceState, Meta, ServiceSpec,
};
use zattera_agent::runtime::{containers, import_archive};

const SECRET: &str = "bench-secret";
const INSTANCES: usize = 50;

fn main() {
    let Some((rig, rt)) = support::bench_rig("control_cpu") else {
        return;
    };
    let idle: u64 = support::env_or("IDLE_SECS", 60);
    rt.block_on(support::with_namespace(
        &rig,
        "bench-cp",
        move |ctd, rig| async move {
            run(ctd, rig, idle).await;
        },
    ));
}

fn set(version: u64, echo: bool) -> AssignmentSet {
    let mut s = AssignmentSet {
        version,
        ..AssignmentSet::default()
    };
    for i in 0..INSTANCES {
        let id = format!("bench-{i:02}");
        s.assignments.push(Assignment {
            meta: Some(Meta {
                id: id.clone(),
                ..Meta::default()
            }),
            project_id: "proj".into(),
            app_id: "app".into(),
            environment_id: "env".into(),
            desired: AssignmentDesired::Run as i32,
            config_hash: "h1".into(),
            release_id: "r1".into(),
            observed: echo.then(|| AssignmentObserved {
                state: InstanceState::Healthy as i32,
                updated_at: Some(std::time::SystemTime::now().into()),
                ..AssignmentObserved::default()
            }),
            ..Assignment::default()
        });
        s.runtime.insert(
            id,
            AssignmentRuntime {
                image_ref: support::TEST_IMAGE.into(),
                spec: Some(ServiceSpec {
                    command: "sleep 100000".into(),
                    ..ServiceSpec::default()
                }),
                env: BTreeMap::from([("ZATTERA_APP".into(), "app".into())]),
                subnet_cidr: "10.201.141.0/24".into(),
                volume_lease: None,
            },
        );
    }
    s
}

/// utime + stime of `pid`, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of stat; after the comm, field 3 is index 0.
    let get = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    get(11) + get(12)
}

/// The rig's containerd: a `containerd` process started with the rig's
/// config, or the only `containerd` there is.
fn pid_of_containerd() -> Option<u32> {
    let candidates: Vec<(u32, String)> = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "containerd")
        })
        .map(|pid| {
            let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
                .unwrap_or_default()
                .replace('\0', " ");
            (pid, cmdline)
        })
        .collect();
    candidates
        .iter()
        .find(|(_, cmd)| cmd.contains("zattera-rig"))
        .or_else(|| (candidates.len() == 1).then(|| &candidates[0]))
        .map(|(pid, _)| *pid)
}

async fn run(ctd: zattera_agent::runtime::Containerd, rig: support::Rig, idle: u64) {
    import_archive(&ctd, &rig.oci_archive(), None)
        .await
        .expect("import the test image");
    let cp = ControlPlane::start(&[SECRET]).await;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let run_dir = dir.path().join("run");
    // AGENT measures another build (the code before a change) in the same run.
    let agent =
        std::env::var("AGENT").unwrap_or_else(|_| env!("CARGO_BIN_EXE_zattera-agent").into());
    let agent = agent.as_str();
    let joined = std::process::Command::new(agent)
        .args(["--config", "/dev/null", "--data-dir"])
        .arg(&data)
        .args([
            "join",
            "--control",
            &cp.address(),
            "--token",
            &cp.ca.token(SECRET),
        ])
        .output()
        .unwrap();
    assert!(joined.status.success(), "join: {joined:?}");
    let net_cfg =
        zattera_netns::NetConfig::for_namespace(ctd.namespace().as_str(), &run_dir).unwrap();
    let _cleanup = support::NetCleanup {
        prefix: "ztbq".into(),
        table: net_cfg.nft_table.clone(),
        run_dir: run_dir.clone(),
    };
    let api = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut child = cp
        .agent_command(&control_plane::AgentRun {
            binary: Path::new(agent),
            socket: &rig.socket,
            namespace: ctd.namespace().as_str(),
            run_dir: &run_dir,
            data_dir: &data,
            bridge_prefix: "ztbq",
            api_addr: &api,
        })
        .env("RUST_LOG", "warn")
        .stderr(std::fs::File::create(dir.path().join("agent.log")).unwrap())
        .spawn()
        .unwrap();
    let pid = child.id();

    let started = Instant::now();
    cp.push_set(set(1, false));
    let healthy = InstanceState::Healthy as i32;
    cp.wait_for("50 HEALTHY", Duration::from_secs(300), |r| {
        (0..INSTANCES)
            .all(|i| r.states_of(&format!("bench-{i:02}")).contains(&healthy))
            .then_some(())
    })
    .await;
    println!(
        "control_cpu bench: {INSTANCES} instances HEALTHY after {:.1?}",
        started.elapsed()
    );
    cp.push_routes(RouteSnapshot {
        version: 1,
        internal_services: vec![InternalService {
            fqdn: "app.env.proj.internal.".into(),
            project_id: "proj".into(),
            environment_id: "env".into(),
            vip: "10.97.251.1".into(),
            ports: vec![InternalPort {
                name: "http".into(),
                port: 18_081,
                protocol: "tcp".into(),
                endpoints: vec![Endpoint {
                    addr: "127.0.0.1:1".into(),
                    healthy: true,
                    ..Endpoint::default()
                }],
            }],
        }],
        ..RouteSnapshot::default()
    });
    // Let bring-up work settle before measuring.
    tokio::time::sleep(Duration::from_secs(10)).await;

    let ctd_pid = pid_of_containerd();
    let (a0, c0, t0) = (cpu_ticks(pid), ctd_pid.map_or(0, cpu_ticks), Instant::now());
    let mut version = 2;
    let mut pushes = 0;
    while t0.elapsed() < Duration::from_secs(idle) {
        tokio::time::sleep(Duration::from_secs(2)).await;
        cp.push_set(set(version, true));
        version += 1;
        pushes += 1;
    }
    let wall = t0.elapsed().as_secs_f64();
    let (a1, c1) = (cpu_ticks(pid), ctd_pid.map_or(0, cpu_ticks));
    let hz: u64 = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100);
    #[allow(clippy::cast_precision_loss)]
    let pct = |ticks: u64| ticks as f64 / hz as f64 / wall * 100.0;
    let (agent_pct, ctd_pct) = (pct(a1 - a0), pct(c1 - c0));
    let frames = cp.with(|r| r.frames.len());
    println!(
        "control_cpu bench: over {wall:.0} s with the stream open, {pushes} re-pushes of the set, {frames} frames from the agent in all"
    );
    println!(
        "  agent      {agent_pct:.2} % of a core  (goal <= 1 %: {})",
        if agent_pct <= 1.0 { "met" } else { "MISSED" }
    );
    match ctd_pid {
        Some(_) => println!(
            "  containerd {ctd_pct:.2} % of a core (same window, same 50 containers); agent / containerd {:.2}",
            agent_pct / ctd_pct.max(0.01)
        ),
        None => println!("  containerd: pid not found"),
    }

    // Converge to nothing through the agent, then stop it.
    cp.push_set(AssignmentSet {
        version: version + 1,
        ..AssignmentSet::default()
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    while !containers::list(&ctd, &[]).await.unwrap().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
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
