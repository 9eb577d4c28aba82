//! A node as a cluster sees it (issue 13): the real agent binary joined to
//! the test control plane, judged by what reaches control through the sync
//! stream. `ZATTERA_TEST_AGENT_BIN` runs these against another build.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "support/control/mod.rs"]
mod control_plane;
#[path = "support/mesh_cluster.rs"]
mod mesh_cluster;
mod support;

use std::time::Duration;

use futures::FutureExt as _;

use control_plane::{
    AgentFlags, ControlPlane, ControlledAgent, RegistryGrant, assignment, controlled_agent, set_of,
};
use support::agent::KillOnDrop;
use support::registry::Registry;
use support::{on_rig, on_rig_with_image, rig};
use zattera_agent::proto::v1::{HealthCheck, HealthCheckType, InstanceState};
use zattera_agent::runtime::import_archive;

const SECRET: &str = "cluster-secret";

/// A shell that fails its first `fails` runs (each after `delay` seconds)
/// and then stays up; the count lives in the container's own rootfs, which
/// a restart of the task keeps.
fn crashing(fails: u32, delay: u32) -> String {
    format!(
        "n=$(cat /run.count 2>/dev/null || echo 0); n=$((n+1)); echo $n > /run.count; \
         if [ $n -le {fails} ]; then sleep {delay}; exit 3; fi; exec sleep 3600"
    )
}

fn seconds(s: i64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: s,
        nanos: 0,
    }
}

/// L-3, X-8: after FAILED and a restart by the supervisor, HEALTHY comes
/// back, for a service without a health check and for one whose probe
/// passed before the crash (its state did not change across it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_comes_back_after_a_crash_loop() {
    on_rig_with_image("cl-heal", |ctd, rig| async move {
        let (cp, agent) = controlled_agent(SECRET, &rig, &ctd, "ztcl", &[]).await;
        // No health check: crashes twice at once, then stays up.
        let plain = assignment("plain", "env", 190, &crashing(2, 0));
        // An exec probe that always passes: HEALTHY, a crash after 4 s, up again.
        let (probed, mut probed_rt) = assignment("probed", "env", 190, &crashing(1, 4));
        probed_rt.spec.as_mut().unwrap().healthcheck = Some(HealthCheck {
            r#type: HealthCheckType::Exec as i32,
            command: "true".into(),
            interval: Some(seconds(1)),
            timeout: Some(seconds(1)),
            grace_period: Some(seconds(0)),
            ..HealthCheck::default()
        });
        cp.push_set(set_of(1, vec![plain, (probed, probed_rt)]));

        let (healthy, failed) = (InstanceState::Healthy as i32, InstanceState::Failed as i32);
        for id in ["plain", "probed"] {
            let states = cp
                .wait_for(
                    &format!("{id}: HEALTHY after FAILED"),
                    Duration::from_secs(90),
                    |r| {
                        let s = r.states_of(id);
                        let last_failed = s.iter().rposition(|x| *x == failed)?;
                        s[last_failed..].contains(&healthy).then_some(s)
                    },
                )
                .await;
            if id == "probed" {
                let first_failed = states.iter().position(|x| *x == failed).unwrap();
                assert!(
                    states[..first_failed].contains(&healthy),
                    "probed was HEALTHY before its crash: {states:?}"
                );
            }
            let latest = cp.with(|r| r.latest_of(id)).unwrap();
            assert!(latest.restarts >= 1, "{id}: {latest:?}");
        }
        drop(agent);
    })
    .await;
}

/// A TCP forwarder from a fresh loopback port to `to`, until dropped.
async fn forwarder(to: String) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let to = to.clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(&to).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (addr, task)
}

/// wire.md 1.2, issue 13.9: the sync target is the `control_grpc_addr` the
/// join returned. Joined through an address that is gone afterwards, a
/// bare `run` (the packaged unit's) and `run --control <join address>`
/// both open the stream with the enrolled address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_after_join_syncs_with_the_address_the_join_returned() {
    on_rig("cl-join", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let (join_addr, forward) = forwarder(cp.address()).await;
        let dir = tempfile::tempdir().unwrap();
        let (data, run_dir) = (dir.path().join("data"), dir.path().join("run"));
        let bin = support::agent::run_bin();
        control_plane::join_cli(&data, &join_addr, &cp.ca.token(SECRET), &[]);
        // The join address is gone: only the enrolled one answers.
        forward.abort();
        let _ = forward.await;

        let net_cfg =
            zattera_netns::NetConfig::for_namespace(ctd.namespace().as_str(), &run_dir).unwrap();
        let _net = support::NetCleanup {
            prefix: "ztcj".into(),
            table: net_cfg.nft_table.clone(),
            run_dir: run_dir.clone(),
        };
        let log_path = dir.path().join("agent.log");
        let api_addr = control_plane::free_loopback_addr().await;
        let start = |extra: &[&str]| {
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log_path)
                .unwrap();
            let child = std::process::Command::new(&bin)
                .arg("--containerd-address")
                .arg(&rig.socket)
                .args([
                    "--namespace",
                    ctd.namespace().as_str(),
                    "--config",
                    "/dev/null",
                ])
                .arg("--run-dir")
                .arg(&run_dir)
                .arg("--data-dir")
                .arg(&data)
                .args([
                    "run",
                    "--bridge-prefix",
                    "ztcj",
                    "--node-api-listen",
                    &api_addr,
                ])
                .args(extra)
                .env("RUST_LOG", "info")
                .stdout(std::process::Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap();
            KillOnDrop(child)
        };
        for (session, extra) in [(0, vec![]), (1, vec!["--control", join_addr.as_str()])] {
            let agent = start(&extra);
            let what = format!("a hello from `run {}`", extra.join(" "));
            let waited = tokio::time::timeout(
                Duration::from_secs(40),
                cp.wait_for(&what, Duration::from_secs(60), |r| {
                    (r.sessions.len() > session).then_some(())
                }),
            )
            .await;
            assert!(
                waited.is_ok(),
                "no {what}; agent log:\n{}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
            drop(agent);
        }
    })
    .await;
}

/// X-4, issue 13.6: the subnet is not in the config hash; a pushed change of
/// it replaces the instance onto the new network.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_subnet_replaces_the_instance() {
    on_rig_with_image("cl-subnet", |ctd, rig| async move {
        let (cp, agent) = controlled_agent(SECRET, &rig, &ctd, "ztcs", &[]).await;
        let ip_in = |slot: u8| {
            move |s: &serde_json::Value| {
                s["assignments"].as_array().is_some_and(|rows| {
                    rows.iter().any(|r| {
                        r["id"] == "moved"
                            && r["state"] == "HEALTHY"
                            && r["ip"]
                                .as_str()
                                .is_some_and(|ip| ip.starts_with(&format!("10.201.{slot}.")))
                    })
                })
            }
        };
        cp.push_set(set_of(
            1,
            vec![assignment("moved", "env", 191, "sleep 3600")],
        ));
        agent.wait_for("HEALTHY on 10.201.191.0/24", ip_in(191));
        cp.push_set(set_of(
            2,
            vec![assignment("moved", "env", 192, "sleep 3600")],
        ));
        agent.wait_for("HEALTHY on 10.201.192.0/24", ip_in(192));
        let owned =
            zattera_agent::runtime::containers::list(&ctd, &[("dev.zattera/managed", "true")])
                .await
                .unwrap();
        assert_eq!(owned.len(), 1, "the old container is gone");
    })
    .await;
}

/// A registry that answers 200 and then drips one byte every 50 s: under
/// the pull client's read timeout, so a pull from it never ends by itself.
async fn tarpit() -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let head = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n";
                if s.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                loop {
                    tokio::time::sleep(Duration::from_secs(50)).await;
                    if s.write_all(b" ").await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, task)
}

/// Every report of `id` that reached control, in order.
fn reports(
    r: &control_plane::Record,
    id: &str,
) -> Vec<zattera_agent::proto::v1::AssignmentObserved> {
    use zattera_agent::proto::cluster::agent_message::Body;
    r.frames
        .iter()
        .filter_map(|(_, f)| match &f.body {
            Some(Body::Status(b)) => b.observed.get(id).cloned(),
            _ => None,
        })
        .collect()
}

/// Issue 13.4 and 13.5: one pull that hangs (a tarpit registry) stalls
/// nothing else. While it hangs, a crashed service is restarted to HEALTHY,
/// an edit of another app converges, the fast app's RUNNING with its port
/// bindings is re-reported on the 5 s poll, and PULLING and STARTING reach
/// control as they happen; the hanging pull fails at the pull deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_pull_stalls_nothing_else() {
    on_rig_with_image("cl-tarpit", |ctd, rig| async move {
        let (registry, _tarpit) = tarpit().await;
        let (cp, agent) =
            controlled_agent(SECRET, &rig, &ctd, "ztct", &["--pull-timeout", "40s"]).await;
        let (slow, mut slow_rt) = assignment("slow", "env", 193, "sleep 3600");
        slow_rt.image_ref = format!("{registry}/tarpit/app:1");
        let fast = |hash: &str| {
            let (mut a, mut rt) = assignment("fast", "env", 193, "httpd -f -p 80 -h /var/www");
            a.config_hash = hash.into();
            rt.spec.as_mut().unwrap().ports = vec![zattera_agent::proto::v1::PortSpec {
                name: "http".into(),
                container_port: 80,
                protocol: zattera_agent::proto::v1::Protocol::Http as i32,
                public_l4_port: 0,
            }];
            (a, rt)
        };
        let crash = assignment("crash", "env", 193, &crashing(1, 3));
        let pushed = std::time::Instant::now();
        cp.push_set(set_of(
            1,
            vec![(slow.clone(), slow_rt.clone()), fast("h1"), crash.clone()],
        ));

        let state = |s: InstanceState| s as i32;
        let pulling_slow = || {
            cp.with(|r| r.latest_of("slow"))
                .is_some_and(|o| o.state == state(InstanceState::Pulling))
        };
        // The crash loop ends HEALTHY while the pull hangs.
        cp.wait_for("crash HEALTHY after FAILED", Duration::from_secs(60), |r| {
            let s = r.states_of("crash");
            let failed = s.iter().rposition(|x| *x == state(InstanceState::Failed))?;
            s[failed..]
                .contains(&state(InstanceState::Healthy))
                .then_some(())
        })
        .await;
        assert!(pulling_slow(), "slow is still pulling");

        // The fast app's reports: PULLING, STARTING, then RUNNING with its
        // binding, again every poll.
        tokio::time::sleep(Duration::from_secs(11)).await;
        let fast_reports = cp.with(|r| reports(r, "fast"));
        let states: Vec<i32> = fast_reports.iter().map(|o| o.state).collect();
        assert_eq!(
            &states[..2],
            &[
                state(InstanceState::Pulling),
                state(InstanceState::Starting)
            ],
            "{states:?}"
        );
        let running: Vec<_> = fast_reports
            .iter()
            .filter(|o| o.state == state(InstanceState::Running))
            .collect();
        assert!(
            running.len() >= 3,
            "RUNNING is re-reported on the poll: {states:?}"
        );
        assert!(
            running
                .iter()
                .all(|o| o.mesh_port_bindings.contains_key("http")),
            "every RUNNING carries the binding: {running:?}"
        );
        let at = |o: &&zattera_agent::proto::v1::AssignmentObserved| {
            o.updated_at
                .as_ref()
                .map_or(0, |t| t.seconds * 1000 + i64::from(t.nanos) / 1_000_000)
        };
        for pair in running.windows(2) {
            let gap = at(&pair[1]) - at(&pair[0]);
            assert!(
                gap < 7_500,
                "RUNNING re-reported {gap} ms apart: {running:?}"
            );
        }
        // The slow one's PULLING went out as it happened, not at the end.
        let slow_first = cp.with(|r| reports(r, "slow")).first().cloned().unwrap();
        assert_eq!(slow_first.state, state(InstanceState::Pulling));
        assert!(
            at(&&slow_first) - at(&running[0]) < 5_000,
            "slow's PULLING was sent late: {slow_first:?}"
        );
        assert!(pulling_slow(), "slow is still pulling");

        // An edit of the fast app converges meanwhile.
        cp.push_set(set_of(2, vec![(slow, slow_rt), fast("h2"), crash]));
        cp.wait_for("fast-h2 HEALTHY", Duration::from_secs(30), |r| {
            r.latest_of("fast").filter(|o| {
                o.state == state(InstanceState::Healthy) && o.container_id.ends_with("-h2")
            })
        })
        .await;
        assert!(pulling_slow(), "slow is still pulling");

        // The deadline ends the pull: FAILED, naming it.
        let failed = cp
            .wait_for(
                "slow FAILED at the pull deadline",
                Duration::from_secs(60),
                |r| {
                    r.latest_of("slow")
                        .filter(|o| o.state == state(InstanceState::Failed))
                },
            )
            .await;
        assert!(failed.message.contains("pull-timeout"), "{failed:?}");
        assert!(
            pushed.elapsed() >= Duration::from_secs(40),
            "not before the deadline"
        );
        drop(agent);
    })
    .await;
}

/// A containerd of the test's own (to stop and start), the rig pointing
/// at it, a namespace `zt-test-cl-<tag>-<pid>` and the test image in it.
async fn private_containerd(
    rig: support::Rig,
    tag: &str,
) -> (
    support::private::PrivateContainerd,
    support::Rig,
    String,
    zattera_agent::runtime::Containerd,
) {
    let ns = format!("zt-test-cl-{tag}-{}", std::process::id());
    let private = support::private::PrivateContainerd::start();
    let (private, ctd) = private.with_test_image(&rig, &ns).await;
    let rig = support::Rig {
        socket: private.socket.clone(),
        ..rig
    };
    (private, rig, ns, ctd)
}

/// Issue 13.10: containerd restarts in the middle of a sync session. The
/// running tasks are not touched, a set pushed while containerd is down
/// converges once it is back, and every report reaches control.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_containerd_restart_during_sync_loses_nothing() {
    let Some(rig) = rig() else { return };
    let (mut private, rig, ns, ctd) = private_containerd(rig, "ctd").await;
    let cp = ControlPlane::start(&[SECRET]).await;
    let agent = ControlledAgent::start(&cp, SECRET, &rig, &ns, "ztcr").await;
    let healthy = InstanceState::Healthy as i32;
    let first = assignment("first", "env", 194, "sleep 3600");
    cp.push_set(set_of(1, vec![first.clone()]));
    cp.wait_for("first HEALTHY", Duration::from_secs(60), |r| {
        r.states_of("first").contains(&healthy).then_some(())
    })
    .await;
    let cid = cp.with(|r| r.latest_of("first")).unwrap().container_id;
    let pid = |ctd: zattera_agent::runtime::Containerd, cid: String| async move {
        match zattera_agent::runtime::containers::task_state(&ctd, &cid).await {
            Ok(zattera_agent::runtime::containers::TaskState::Running { pid }) => Some(pid),
            _ => None,
        }
    };
    let before = pid(ctd.clone(), cid.clone()).await;
    assert!(before.is_some());

    // containerd goes; a new set arrives meanwhile; containerd comes back.
    private.down();
    let late = assignment("late", "env", 194, "sleep 3600");
    cp.push_set(set_of(2, vec![first, late]));
    tokio::time::sleep(Duration::from_secs(8)).await; // passes fail meanwhile
    private.up();

    cp.wait_for("late HEALTHY", Duration::from_secs(90), |r| {
        r.states_of("late").contains(&healthy).then_some(())
    })
    .await;
    let ctd = zattera_agent::runtime::Containerd::connect(&rig.socket, ns.parse().unwrap())
        .await
        .unwrap();
    assert_eq!(
        pid(ctd.clone(), cid.clone()).await,
        before,
        "first's task is untouched"
    );
    // Still reported, on the same session: nothing was dropped or restarted.
    let (sessions, first_after) = cp
        .wait_for("first re-reported after the restart", Duration::from_secs(20), |r| {
            let n = r.frames.len();
            r.frames[n.saturating_sub(20)..]
                .iter()
                .any(|(_, f)| {
                    matches!(&f.body, Some(zattera_agent::proto::cluster::agent_message::Body::Status(b)) if b.observed.contains_key("first"))
                })
                .then(|| (r.sessions.len(), r.latest_of("first")))
        })
        .await;
    assert_eq!(sessions, 1, "the stream stayed up");
    assert_eq!(first_after.unwrap().container_id, cid);
    let owned = zattera_agent::runtime::containers::list(&ctd, &[("dev.zattera/managed", "true")])
        .await
        .unwrap();
    assert_eq!(owned.len(), 2, "nothing duplicated");
    drop(agent);
    support::purge_namespace(&ctd).await;
}

/// W-2: a node whose containerd is down when the agent starts still says
/// hello and sends heartbeats (control would otherwise mark it DOWN and
/// move its work), `status` says what it waits for, and once containerd
/// answers, what control sent meanwhile converges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_containerd_is_down_at_start_still_heartbeats() {
    use zattera_agent::proto::cluster::agent_message::Body;
    let Some(rig) = rig() else { return };
    let (mut private, rig, ns, _ctd) = private_containerd(rig, "down").await;
    private.down();

    let cp = ControlPlane::start(&[SECRET]).await;
    let agent = ControlledAgent::start(&cp, SECRET, &rig, &ns, "ztcw").await;
    cp.wait_for("hello and two heartbeats", Duration::from_secs(40), |r| {
        let hello = r
            .frames
            .iter()
            .any(|(_, f)| matches!(f.body, Some(Body::Hello(_))));
        let beats = r
            .frames
            .iter()
            .filter(|(_, f)| matches!(f.body, Some(Body::Heartbeat(_))))
            .count();
        (hello && beats >= 2).then_some(())
    })
    .await;
    let status = agent.wait_for("status names the wait", |s| {
        s["notices"].as_array().is_some_and(|n| {
            n.iter().any(|n| {
                n.as_str()
                    .is_some_and(|n| n.contains("waiting for containerd"))
            })
        })
    });
    assert!(status["assignments"].as_array().is_none_or(Vec::is_empty));

    let healthy = InstanceState::Healthy as i32;
    cp.push_set(set_of(
        1,
        vec![assignment("waits", "env", 120, "sleep 3600")],
    ));
    tokio::time::sleep(Duration::from_secs(3)).await;
    private.up();
    cp.wait_for(
        "waits HEALTHY once containerd answers",
        Duration::from_secs(90),
        |r| r.states_of("waits").contains(&healthy).then_some(()),
    )
    .await;
    assert_eq!(cp.with(|r| r.sessions.len()), 1, "one stream throughout");
    agent.wait_for("the notice gone", |s| {
        s["notices"].as_array().is_none_or(|n| {
            !n.iter().any(|n| {
                n.as_str()
                    .is_some_and(|n| n.contains("waiting for containerd"))
            })
        })
    });
    drop(agent);
    let ctd = zattera_agent::runtime::Containerd::connect(&rig.socket, ns.parse().unwrap())
        .await
        .unwrap();
    support::purge_namespace(&ctd).await;
}

/// 44.4: no status report is dropped. 300 instances are adopted at boot
/// (after a SIGKILL) while control reads the stream slowly; every
/// instance's HEALTHY reaches control on the new session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_instances_adopted_under_a_slow_control_all_report() {
    use zattera_agent::proto::cluster::agent_message::Body;
    on_rig_with_image("cl-300", |ctd, rig| async move {
        let (cp, mut agent) = controlled_agent(SECRET, &rig, &ctd, "ztch", &[]).await;
        // Two environments: a /24 holds 253 instances.
        let ids: Vec<String> = (0..300).map(|i| format!("i{i:03}")).collect();
        let set = ids
            .iter()
            .enumerate()
            .map(|(n, id)| {
                let (env, slot) = if n < 150 {
                    ("env-a", 122)
                } else {
                    ("env-b", 123)
                };
                assignment(id, env, slot, "exec sleep 3600")
            })
            .collect();
        cp.push_set(set_of(1, set));
        let healthy = InstanceState::Healthy as i32;
        // The 5 s poll repeats RUNNING, which control does not let replace
        // the same container's HEALTHY (S-10): HEALTHY once is the last state.
        let all_healthy = |r: &control_plane::Record, from_session: usize| {
            let mut seen = std::collections::BTreeSet::new();
            for (session, f) in &r.frames {
                if let (true, Some(Body::Status(b))) = (*session >= from_session, &f.body) {
                    seen.extend(
                        b.observed
                            .iter()
                            .filter(|(_, o)| o.state == healthy)
                            .map(|(id, _)| id.clone()),
                    );
                }
            }
            ids.iter().all(|id| seen.contains(id)).then_some(())
        };
        let started = std::time::Instant::now();
        cp.wait_for("300 HEALTHY", Duration::from_secs(600), |r| {
            all_healthy(r, 0)
        })
        .await;
        eprintln!("300 HEALTHY after {:?}", started.elapsed());

        cp.set_read_delay(Duration::from_millis(50));
        agent.kill9_and_restart(&cp, &rig);
        let started = std::time::Instant::now();
        cp.wait_for(
            "every instance HEALTHY again on the new session, read slowly",
            Duration::from_secs(120),
            |r| all_healthy(r, 1),
        )
        .await;
        eprintln!("all adopted and reported after {:?}", started.elapsed());
        let owned =
            zattera_agent::runtime::containers::list(&ctd, &[("dev.zattera/managed", "true")])
                .await
                .unwrap();
        assert_eq!(owned.len(), 300, "adopted, none replaced or duplicated");
        drop(agent);
    })
    .await;
}

/// The times (unix ms) of the node's `Stats` points in the last hour.
async fn node_points(agent: &ControlledAgent, cp: &ControlPlane) -> Vec<i64> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut api = agent.api_as(cp, control_plane::CONTROL_NODE_ID).await;
        let got = api
            .stats(zattera_agent::proto::v1::StatsQuery {
                node_id: agent.node_id.clone(),
                metrics: vec!["memory_total_bytes".into()],
                ..Default::default()
            })
            .await;
        match got {
            Ok(r) => {
                let mut at: Vec<i64> = r
                    .into_inner()
                    .series
                    .iter()
                    .flat_map(|s| s.points.iter())
                    .map(|p| p.time_unix_ms)
                    .collect();
                at.sort_unstable();
                return at;
            }
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(e) => panic!("Stats: {e}"),
        }
    }
}

/// Issue 13.7 (W-6, TS-8, TS-9): the stats store is kept in the data dir
/// and loaded at start, so points sampled before a SIGKILL are answered by
/// `Stats` after the restart. 58.10: each round is in the log as it is
/// sampled; the kill comes before any checkpoint (every 15 minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_survive_a_sigkill() {
    on_rig("cl-stats", |ctd, rig| async move {
        let (cp, mut agent) = controlled_agent(SECRET, &rig, &ctd, "ztcm", &[]).await;
        let log = agent.data_dir().join("metrics/tsdb.wal");
        let deadline = std::time::Instant::now() + Duration::from_secs(100);
        while !log.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "no round in the stats log; agent log:\n{}",
                agent.log()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let before = node_points(&agent, &cp).await;
        assert!(!before.is_empty(), "sampled before the kill");
        assert!(
            !agent.data_dir().join("metrics/tsdb.bin").exists(),
            "a checkpoint came before the kill: the log is not what is tested"
        );

        agent.kill9_and_restart(&cp, &rig);
        let after = node_points(&agent, &cp).await;
        assert!(
            after.contains(&before[0]),
            "the first point ({}) is answered after the restart: {after:?}",
            before[0]
        );
    })
    .await;
}

/// 44.10 and 44.7 (TS-8): a node moved from the reference agent keeps its
/// history. Its log stream (closed zstd segment with index, active
/// segment) and its `tsdb.bin` (version 1), written by a script from the
/// spec's byte layouts, are read: QueryLogs and `zattera-agent logs` give
/// the reference's lines, then this agent's, in time order; `Stats` answers
/// the reference's points.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_moved_from_the_reference_agent_keeps_its_logs_and_metrics() {
    use zattera_agent::proto::v1::{LogQuery, LogSelector, LogSource};
    on_rig_with_image("cl-moved", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let id = "01JMOVED0000000000000000AA";
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let t0 = (now - 1800) / 300 * 300;
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/support/reference_store.py"
        );
        let agent = ControlledAgent::start_with(
            &cp,
            SECRET,
            &rig,
            ctd.namespace().as_str(),
            "ztcv",
            AgentFlags {
                prepare: Some(Box::new(|data, node_id| {
                    let status = std::process::Command::new("python3")
                        .arg(script)
                        .arg(data)
                        .args([node_id, id, &t0.to_string()])
                        .status()
                        .unwrap();
                    assert!(status.success(), "{script}");
                })),
                ..AgentFlags::default()
            },
        )
        .await;
        let healthy = InstanceState::Healthy as i32;
        cp.push_set(set_of(
            1,
            vec![assignment(
                id,
                "env",
                121,
                "echo after the move; exec sleep 3600",
            )],
        ));
        cp.wait_for("the moved instance HEALTHY", Duration::from_secs(60), |r| {
            r.states_of(id).contains(&healthy).then_some(())
        })
        .await;

        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let lines = loop {
            let mut api = agent.api_as(&cp, control_plane::CONTROL_NODE_ID).await;
            let mut stream = api
                .query_logs(LogQuery {
                    selector: Some(LogSelector {
                        instance_id: id.into(),
                        ..LogSelector::default()
                    }),
                    ..LogQuery::default()
                })
                .await
                .unwrap()
                .into_inner();
            let mut lines = Vec::new();
            while let Some(line) = stream.message().await.unwrap() {
                lines.push(line);
            }
            if lines.iter().any(|l| l.line == "after the move")
                || std::time::Instant::now() > deadline
            {
                break lines;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        };
        let text: Vec<&str> = lines.iter().map(|l| l.line.as_str()).collect();
        assert_eq!(
            text,
            [
                "reference line 1",
                "reference line 2",
                "reference line 3",
                "after the move"
            ]
        );
        assert_eq!(lines[1].source, LogSource::Stderr as i32);
        assert_eq!(lines[0].time.unwrap().seconds, i64::try_from(t0).unwrap());
        assert!(lines.iter().all(|l| l.instance_id == id));

        let out = agent.cli(&["logs", id]);
        let printed = String::from_utf8_lossy(&out.stdout);
        let order: Vec<usize> = ["reference line 1", "reference line 3", "after the move"]
            .iter()
            .map(|l| {
                printed
                    .find(l)
                    .unwrap_or_else(|| panic!("{l:?} in {printed}"))
            })
            .collect();
        assert!(order.is_sorted(), "{printed}");

        let points = node_points(&agent, &cp).await;
        // TS-3: this agent's own points sit in 15 s slots too.
        assert!(points.iter().all(|t| t % 15_000 == 0), "{points:?}");
        let t0_ms = i64::try_from(t0).unwrap() * 1000;
        for slot in 0..4 {
            assert!(
                points.contains(&(t0_ms + slot * 15_000)),
                "the reference's point {slot} in {points:?}"
            );
        }
    })
    .await;
}

/// A test network `prefix` on the underlay 10.203.`subnet`.0/24 and a
/// cluster of the run binary whose control host ctl-1 (mesh 10.90.0.1,
/// the hub when `hub`) runs on its host c1 (.11); returns c1 too.
async fn cluster_with_ctl1(
    prefix: &str,
    subnet: u8,
    hub: bool,
) -> (mesh_cluster::TestNet, mesh_cluster::Cluster, String) {
    let bin = std::path::PathBuf::from(support::agent::run_bin());
    let mut net = mesh_cluster::TestNet::new(prefix);
    let c1_addr = std::net::Ipv4Addr::new(10, 203, subnet, 11);
    let c1 = net.add_host("c1", c1_addr);
    let mut cluster = mesh_cluster::Cluster::new(SECRET, &bin);
    if hub {
        cluster.set_hub("ctl-1");
    }
    let mesh_ip = std::net::Ipv4Addr::new(10, 90, 0, 1);
    cluster
        .add_control("ctl-1", &c1, c1_addr, mesh_ip, &format!("{prefix}c1"), true)
        .await;
    (net, cluster, c1)
}

/// A fresh containerd namespace for each of `tags`.
fn namespaces(tags: &[&str]) -> Vec<zattera_agent::runtime::Namespace> {
    tags.iter().map(|t| support::unique_namespace(t)).collect()
}

/// 44.11: workers behind NAT, in the reference's shape. The hub (ctl-1)
/// carries 10.90.0.0/16; each worker sits behind a NAT of its own (a
/// namespace that masquerades) with no `mesh-endpoint`, so its join must
/// advertise nothing (its default route's address is private), control
/// then gives it a keepalive of 25 toward the hub and no direct peer, and
/// the two workers reach each other through the hub. Had a worker
/// advertised its private address, control would pair the two directly
/// with /32s, which win over the hub's /16, and their traffic would go
/// nowhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_behind_nat_reach_each_other_through_the_hub() {
    use mesh_cluster::{TestNet, run_in};
    use std::net::Ipv4Addr;

    let Some(rig) = rig() else { return };
    let underlay = |n: u8| Ipv4Addr::new(10, 203, 78, n);
    let (mut net, cluster, _c1) = cluster_with_ctl1("ztn", 78, true).await;
    let namespaces = namespaces(&["nata", "natb"]);
    let token = cluster.ca.token(SECRET);
    let node = |name: &str, n: u8, idx: usize, net: &mut TestNet| {
        let ns = net.add_host_behind_nat(name, underlay(n), u8::try_from(idx).unwrap() + 1);
        MeshNode::spawn(
            ns,
            &rig.socket,
            namespaces[idx].as_str(),
            &format!("ztn{name}"),
            &format!("{}:8443", underlay(11)),
            &token,
            &[],
        )
    };
    let outcome = std::panic::AssertUnwindSafe(async {
        let a = node("a", 21, 0, &mut net);
        let b = node("b", 22, 1, &mut net);
        let dump = |m: &MeshNode| format!("--- {} log:\n{}", m.ns, m.log());
        eventually("two workers joined", 60, || async {
            cluster.members().iter().filter(|m| !m.is_control).count() >= 2
        })
        .await;
        let workers: Vec<control_plane::Member> = cluster
            .members()
            .into_iter()
            .filter(|m| !m.is_control)
            .collect();
        for w in &workers {
            assert_eq!(
                w.endpoint, "",
                "a worker behind NAT advertised {:?}",
                w.endpoint
            );
        }
        // Each reaches the other's mesh IP through the hub.
        for (from, target) in [(&a, workers[1].mesh_ip), (&b, workers[0].mesh_ip)] {
            let (ns, ip) = (from.ns.clone(), target.to_string());
            let ok = tokio::time::timeout(
                Duration::from_secs(60),
                eventually(&format!("ping {ip} from {ns}"), 60, || {
                    let (ns, ip) = (ns.clone(), ip.clone());
                    async move {
                        tokio::task::spawn_blocking(move || {
                            run_in(&ns, &["busybox", "ping", "-c1", "-W1", &ip])
                                .status
                                .success()
                        })
                        .await
                        .unwrap()
                    }
                }),
            )
            .await;
            assert!(ok.is_ok(), "{}\n{}", dump(&a), dump(&b));
        }
        // `zattera-netns mesh` on A shows the one peer: the hub, with the
        // mesh CIDR, the keepalive and a handshake.
        let netns_bin = std::path::Path::new(support::agent::BIN).with_file_name("zattera-netns");
        let run_dir = a.dir.path().join("run");
        let out = run_in(
            &a.ns,
            &[
                netns_bin.to_str().unwrap(),
                "--run-dir",
                run_dir.to_str().unwrap(),
                "mesh",
                "--json",
            ],
        );
        let view: serde_json::Value =
            serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {out:?}"));
        let peers = view["peers"].as_array().unwrap();
        assert_eq!(peers.len(), 1, "{view:#}");
        assert_eq!(peers[0]["node_id"], "ctl-1", "{view:#}");
        assert_eq!(
            peers[0]["allowed_ips"],
            serde_json::json!(["10.90.0.0/16"]),
            "{view:#}"
        );
        assert_eq!(peers[0]["keepalive"], 25, "{view:#}");
        assert!(
            peers[0]["latest_handshake_seconds_ago"].is_number(),
            "{view:#}"
        );
        drop(a);
        drop(b);
    })
    .catch_unwind()
    .await;
    for ns in &namespaces {
        if let Ok(ctd) = zattera_agent::runtime::Containerd::connect(&rig.socket, ns.clone()).await
        {
            support::purge_namespace(&ctd).await;
        }
    }
    drop(cluster);
    drop(net);
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// A TCP relay to `target` that keeps every byte its clients send (the
/// request heads), to see what the agent sends to a registry.
async fn recording_relay(
    target: std::net::SocketAddr,
) -> (
    String,
    std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    tokio::task::JoinHandle<()>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = std::sync::Arc::clone(&seen);
    let task = tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let record = std::sync::Arc::clone(&record);
            tokio::spawn(async move {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                let upstream = async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    while let Ok(n) = cr.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        record.lock().unwrap().extend_from_slice(&buf[..n]);
                        if sw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    let _ = sw.shutdown().await;
                };
                let downstream = async move {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                    let _ = cw.shutdown().await;
                };
                tokio::join!(upstream, downstream);
            });
        }
    });
    (addr, seen, task)
}

/// Issue 13.1 (W-11, W-12, X-14): an image in the cluster's registry (TLS
/// from the cluster CA, htpasswd basic auth) is pulled with the node's
/// credential from the join; an image of another registry is pulled too,
/// and that registry never sees the credential.
#[tokio::test(flavor = "multi_thread")]
async fn the_cluster_registry_alone_gets_the_node_credential() {
    on_rig("cl-registry", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let (chain, key) = cp.ca.server_identity();
        let (user, password) = ("node-builder", "the-node-password");
        let cluster = Registry::start_with(Some((user, password)), Some((&chain, &key)));
        let api_image = cluster.push(&rig.oci_archive(), None, "apps/api:1");
        let other = Registry::start(None);
        other.push(&rig.oci_archive(), None, "apps/web:1");
        let (relay, seen, _relay) = recording_relay(other.addr).await;
        cp.set_registry(RegistryGrant {
            addr: cluster.addr.to_string(),
            username: user.into(),
            password: password.into(),
        });
        let agent =
            ControlledAgent::start(&cp, SECRET, &rig, ctd.namespace().as_str(), "ztcg").await;
        let (api, mut api_rt) = assignment("api", "env", 195, "sleep 3600");
        api_rt.image_ref = api_image;
        let (web, mut web_rt) = assignment("web", "env", 195, "sleep 3600");
        web_rt.image_ref = format!("{relay}/apps/web:1");
        cp.push_set(set_of(1, vec![(api, api_rt), (web, web_rt)]));
        let healthy = InstanceState::Healthy as i32;
        let done = tokio::time::timeout(
            Duration::from_secs(90),
            cp.wait_for("api and web HEALTHY", Duration::from_secs(120), |r| {
                let up = |id| r.latest_of(id).is_some_and(|o| o.state == healthy);
                (up("api") && up("web")).then_some(())
            }),
        )
        .await;
        assert!(
            done.is_ok(),
            "api {:?}, web {:?}; agent log:\n{}",
            cp.with(|r| r.latest_of("api")),
            cp.with(|r| r.latest_of("web")),
            agent.log()
        );

        let sent = String::from_utf8_lossy(&seen.lock().unwrap()).to_ascii_lowercase();
        assert!(
            sent.contains("get /v2/apps/web/manifests/1"),
            "the other registry served the pull: {sent}"
        );
        assert!(
            !sent.contains("authorization:") && !sent.contains(password),
            "the other registry was sent a credential: {sent}"
        );
    })
    .await;
}

/// Issue 13.1: a wrong registry password is a FAILED status that names the
/// registry and the 401; other assignments keep running.
#[tokio::test(flavor = "multi_thread")]
async fn a_refused_registry_credential_fails_only_its_assignment() {
    on_rig_with_image("cl-reg401", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let (chain, key) = cp.ca.server_identity();
        let cluster = Registry::start_with(
            Some(("node-builder", "the-right-one")),
            Some((&chain, &key)),
        );
        let api_image = cluster.push(&rig.oci_archive(), None, "apps/api:1");
        cp.set_registry(RegistryGrant {
            addr: cluster.addr.to_string(),
            username: "node-builder".into(),
            password: "a-wrong-one".into(),
        });
        let _agent =
            ControlledAgent::start(&cp, SECRET, &rig, ctd.namespace().as_str(), "ztch").await;
        let (api, mut api_rt) = assignment("api", "env", 196, "sleep 3600");
        api_rt.image_ref = api_image;
        let web = assignment("web", "env", 196, "sleep 3600");
        cp.push_set(set_of(1, vec![(api, api_rt), web]));
        let failed = cp
            .wait_for("api FAILED", Duration::from_secs(60), |r| {
                r.latest_of("api")
                    .filter(|o| o.state == InstanceState::Failed as i32)
            })
            .await;
        eprintln!("api: {}", failed.message);
        assert!(
            failed.message.contains(&cluster.addr.to_string()) && failed.message.contains("401"),
            "the failure names the registry and the 401: {failed:?}"
        );
        assert!(
            failed.message.matches("pull ").count() == 1,
            "said once: {failed:?}"
        );
        cp.wait_for("web HEALTHY", Duration::from_secs(60), |r| {
            r.latest_of("web")
                .filter(|o| o.state == InstanceState::Healthy as i32)
        })
        .await;
    })
    .await;
}

/// Issue 13.8 (wire.md 1.2): with a kept join token the node re-joins at
/// start and again when a third of its certificate's life is left, with the
/// same node id; once every certificate but the newest has expired, a
/// fresh session (control restarted) is still accepted.
#[tokio::test(flavor = "multi_thread")]
async fn a_kept_join_token_renews_the_identity_before_it_ends() {
    on_rig_with_image("cl-renew", |ctd, rig| async move {
        let mut cp = ControlPlane::start(&[SECRET]).await;
        let life = Duration::from_secs(45);
        cp.set_cert_life(life);
        let token = cp.ca.token(SECRET);
        let started = std::time::Instant::now();
        let agent = ControlledAgent::start_with(
            &cp,
            SECRET,
            &rig,
            ctd.namespace().as_str(),
            "ztcn",
            AgentFlags {
                run: &["--join-token", &token],
                ..AgentFlags::default()
            },
        )
        .await;
        let cert_path = agent.data_dir().join("node/node.crt");
        let first = std::fs::read(&cert_path).unwrap();
        cp.push_set(set_of(1, vec![assignment("web", "env", 197, "sleep 3600")]));
        let healthy = InstanceState::Healthy as i32;
        let up = cp
            .wait_for("web HEALTHY", Duration::from_secs(60), |r| {
                r.latest_of("web").filter(|o| o.state == healthy)
            })
            .await;
        // The join, the re-join at start, and the renewal at two thirds.
        cp.wait_for("two re-joins", Duration::from_secs(60), |r| {
            (r.joins.len() >= 3).then_some(())
        })
        .await;
        let resumed: Vec<String> = cp.with(|r| {
            r.joins
                .iter()
                .skip(1)
                .map(|j| j.existing_node_id.clone())
                .collect()
        });
        assert!(
            resumed.iter().all(|id| *id == agent.node_id),
            "every re-join resumes node {}: {resumed:?}",
            agent.node_id
        );
        let end = |pem: &[u8]| zattera_agent::link::tls::validity_of(pem).unwrap().1;
        // Control notes a join before it answers: the agent stores it after.
        let mut stored = false;
        for _ in 0..50 {
            if end(&std::fs::read(&cert_path).unwrap()) > end(&first) {
                stored = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(stored, "the stored certificate is the new one");

        // Past the end of the certificates from the join and the start.
        let past = (started + 2 * life + Duration::from_secs(3))
            .saturating_duration_since(std::time::Instant::now());
        tokio::time::sleep(past).await;
        let sessions = cp.with(|r| r.sessions.len());
        cp.stop().await;
        cp.restart().await;
        cp.wait_for(
            "a status frame in a session after the restart",
            Duration::from_secs(30),
            |r| {
                r.frames
                    .iter()
                    .any(|(s, f)| {
                        *s >= sessions
                            && matches!(
                                f.body,
                                Some(zattera_agent::proto::cluster::agent_message::Body::Status(
                                    _
                                ))
                            )
                    })
                    .then_some(())
            },
        )
        .await;
        let last = cp.with(|r| r.latest_of("web")).unwrap();
        assert!(
            last.container_id == up.container_id
                && last.restarts == 0
                && [InstanceState::Running as i32, healthy].contains(&last.state),
            "the container lived through every renewal: {last:?}"
        );
        let log = agent.log();
        assert!(log.contains("node identity renewed"), "{log}");
    })
    .await;
}

/// Issue 13.8: without a join token, a certificate with less than 30 days
/// left is a warning in the log and in `status`.
#[tokio::test(flavor = "multi_thread")]
async fn an_expiring_certificate_without_a_token_is_a_warning() {
    on_rig("cl-expiry", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        cp.set_cert_life(Duration::from_secs(10 * 86_400));
        let agent =
            ControlledAgent::start(&cp, SECRET, &rig, ctd.namespace().as_str(), "ztco").await;
        let says = |s: &serde_json::Value| {
            s["notices"].as_array().is_some_and(|n| {
                n.iter()
                    .any(|m| m.as_str().unwrap_or("").contains("expires in 9 days"))
            })
        };
        agent.wait_for("a certificate warning in status", says);
        let table = std::process::Command::new(support::agent::BIN)
            .arg("--run-dir")
            .arg(agent.dir.path().join("run"))
            .arg("status")
            .output()
            .unwrap();
        let table = String::from_utf8_lossy(&table.stdout);
        assert!(
            table.contains("warning: the node certificate expires in 9 days"),
            "{table}"
        );
        let log = agent.log();
        assert!(log.contains("expires in 9 days"), "{log}");
    })
    .await;
}

/// Issue 13.6 (C-9, X-26): an assignment pushed without a subnet lands on
/// the node-local default network (its own bridge, outside the zattera
/// ranges), not in a namespace with only `lo`: the host reaches its page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_assignment_without_a_subnet_gets_the_default_network() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    on_rig_with_image("cl-default", |ctd, rig| async move {
        let (cp, agent) = controlled_agent(
            SECRET,
            &rig,
            &ctd,
            "ztdn",
            &["--default-subnet", "10.202.198.0/24"],
        )
        .await;
        let (a, mut rt) = assignment("plain", "env", 0, "httpd -f -p 80 -h /etc");
        rt.subnet_cidr = String::new();
        cp.push_set(set_of(1, vec![(a, rt)]));
        let status = agent.wait_for("HEALTHY on the default network", |s| {
            s["assignments"].as_array().is_some_and(|rows| {
                rows.iter().any(|r| {
                    r["id"] == "plain"
                        && r["state"] == "HEALTHY"
                        && r["ip"]
                            .as_str()
                            .is_some_and(|ip| ip.starts_with("10.202.198."))
                })
            })
        });
        let ip = status["assignments"][0]["ip"].as_str().unwrap().to_owned();
        let mut page = String::new();
        for _ in 0..50 {
            if let Ok(mut s) = tokio::net::TcpStream::connect((ip.as_str(), 80)).await {
                s.write_all(b"GET /hostname HTTP/1.0\r\n\r\n")
                    .await
                    .unwrap();
                s.read_to_string(&mut page).await.unwrap();
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(
            page.starts_with("HTTP/1.") && page.contains(" 200 "),
            "{ip}: {page:?}"
        );
        let bridges = std::process::Command::new("ip")
            .args(["-o", "addr", "show", "dev", "ztdnd"])
            .output()
            .unwrap();
        let bridges = String::from_utf8_lossy(&bridges.stdout);
        assert!(
            bridges.contains("10.202.198.1/24"),
            "the default bridge: {bridges}"
        );
    })
    .await;
}

/// One agent of the mesh test, running inside its host's namespace.
struct MeshNode {
    ns: String,
    /// Before `dir`: its netns pins are unmounted before the dir goes.
    _net: support::NetCleanup,
    dir: tempfile::TempDir,
    child: Option<std::process::Child>,
    args: Vec<String>,
}

impl MeshNode {
    /// The agent binary in host namespace `ns`, a worker of the mesh
    /// cluster: containerd namespace `namespace`, bridge prefix and mesh
    /// interface `<prefix>` / `<prefix>0`, joining `control` with `token`;
    /// `extra` are more `run` flags.
    fn spawn(
        ns: String,
        socket: &std::path::Path,
        namespace: &str,
        prefix: &str,
        control: &str,
        token: &str,
        extra: &[String],
    ) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut args: Vec<String> = [
            "--containerd-address",
            socket.to_str().unwrap(),
            "--namespace",
            namespace,
            "--config",
            "/dev/null",
            "--run-dir",
            dir.path().join("run").to_str().unwrap(),
            "--data-dir",
            dir.path().join("data").to_str().unwrap(),
            "run",
            "--bridge-prefix",
            prefix,
            "--control",
            control,
            "--join-token",
            token,
            "--mesh-interface",
            &format!("{prefix}0"),
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        args.extend(extra.iter().cloned());
        let run_dir = dir.path().join("run");
        let net = support::NetCleanup {
            prefix: prefix.into(),
            table: zattera_netns::NetConfig::for_namespace(namespace, &run_dir)
                .unwrap()
                .nft_table,
            run_dir,
        };
        let mut m = MeshNode {
            ns,
            _net: net,
            dir,
            child: None,
            args,
        };
        m.start();
        m
    }

    fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("agent.log"))
            .unwrap();
        self.child = Some(
            std::process::Command::new("nsenter")
                .arg(format!("--net=/run/netns/{}", self.ns))
                .arg("--")
                .arg(support::agent::run_bin())
                .args(&self.args)
                .env("RUST_LOG", "info")
                .stdout(std::process::Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap(),
        );
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    fn data_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("data")
    }
}

impl Drop for MeshNode {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits (up to `secs`) until `ok` holds, else panics naming `what`.
async fn eventually<F, Fut>(what: &str, secs: u64, mut ok: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !ok().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {secs} s: {what}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Three workers and two control hosts on one machine (issue 14): joins,
/// the mesh, the node API over mesh IPs, a VIP endpoint on another node
/// reached through WireGuard only, the leader moving, a node joining and
/// leaving without disturbing the others' sessions, and a SIGKILLed node
/// whose mesh and containers come back before control answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_multi_node_cluster_meshes_follows_the_leader_and_survives_a_kill() {
    use mesh_cluster::{TestNet, device, forward_from, run_in};
    use std::net::{Ipv4Addr, SocketAddr};
    use zattera_agent::proto::cluster::{Endpoint, InternalPort, InternalService, RouteSnapshot};
    use zattera_agent::proto::v1::{PortSpec, Protocol};

    let Some(rig) = rig() else { return };
    let underlay = |n: u8| Ipv4Addr::new(10, 203, 77, n);
    let (mut net, mut cluster, c1) = cluster_with_ctl1("ztm", 77, false).await;
    let c2 = net.add_host("c2", underlay(12));
    cluster
        .add_control(
            "ctl-2",
            &c2,
            underlay(12),
            Ipv4Addr::new(10, 90, 0, 2),
            "ztmc2",
            false,
        )
        .await;

    let namespaces = namespaces(&["mesha", "meshb", "meshc", "meshd"]);
    let mut ctds = Vec::new();
    for ns in &namespaces {
        let ctd = zattera_agent::runtime::Containerd::connect(&rig.socket, ns.clone())
            .await
            .unwrap();
        import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .unwrap();
        ctds.push(ctd);
    }
    let token = cluster.ca.token(SECRET);
    let node = |name: &str, n: u8, idx: usize, net: &mut TestNet| {
        let ns = net.add_host(name, underlay(n));
        MeshNode::spawn(
            ns,
            &rig.socket,
            namespaces[idx].as_str(),
            &format!("ztm{name}"),
            &format!("{}:8443", underlay(11)),
            &token,
            &[
                "--mesh-endpoint".to_owned(),
                format!("{}:51820", underlay(n)),
            ],
        )
    };
    let outcome = std::panic::AssertUnwindSafe(async {
        let a = node("a", 21, 0, &mut net);
        let mut b = node("b", 22, 1, &mut net);
        let c = node("c", 23, 2, &mut net);
        let dump = |m: &MeshNode| format!("--- {} log:\n{}", m.ns, m.log());

        // Every node joins, and syncs with the leader over the mesh.
        let workers = |n: usize| {
            let cluster = &cluster;
            move || async move { cluster.members().iter().filter(|m| !m.is_control).count() >= n }
        };
        eventually("three workers joined", 60, workers(3)).await;
        let id_of = |n: u8| {
            cluster
                .members()
                .into_iter()
                .find(|m| m.endpoint == format!("{}:51820", underlay(n)))
                .unwrap()
        };
        let (ma, mb, mc) = (id_of(21), id_of(22), id_of(23));
        for (m, agent) in [(&ma, &a), (&mb, &b), (&mc, &c)] {
            let id = m.node_id.clone();
            tokio::time::timeout(
                Duration::from_secs(60),
                cluster.wait_for("a sync stream on ctl-1", Duration::from_secs(60), |r| {
                    (r.session_host_of(&id) == Some("ctl-1")).then_some(())
                }),
            )
            .await
            .unwrap_or_else(|_| panic!("{}", dump(agent)));
        }
        let key_path = zattera_agent::mesh::key_path(&a.data_dir());
        let mode = std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&key_path).unwrap().permissions());
        assert_eq!(mode & 0o777, 0o600, "the WireGuard key is private");

        // The mesh forms: traffic between every pair, a handshake on each.
        let hosts = [
            (c1.clone(), "ztmc1", Ipv4Addr::new(10, 90, 0, 1)),
            (c2.clone(), "ztmc2", Ipv4Addr::new(10, 90, 0, 2)),
            (a.ns.clone(), "ztma0", ma.mesh_ip),
            (b.ns.clone(), "ztmb0", mb.mesh_ip),
            (c.ns.clone(), "ztmc0", mc.mesh_ip),
        ];
        for (i, (from, _, _)) in hosts.iter().enumerate() {
            for (_, _, to) in &hosts[i + 1..] {
                let (from, to) = (from.clone(), to.to_string());
                eventually(&format!("ping {to} from {from}"), 20, || {
                    let (from, to) = (from.clone(), to.clone());
                    async move {
                        tokio::task::spawn_blocking(move || {
                            run_in(&from, &["busybox", "ping", "-c1", "-W1", &to]).status.success()
                        })
                        .await
                        .unwrap()
                    }
                })
                .await;
            }
        }
        for (_, iface, _) in &hosts {
            let d = device(iface).await.unwrap_or_else(|| panic!("no device {iface}"));
            assert_eq!(d.peers.len(), 4, "{iface}: {d:?}");
            assert!(
                d.peers.iter().all(|p| p.since_handshake.is_some()),
                "{iface}: a peer without a handshake: {d:?}"
            );
        }

        // Control reaches each node API at <mesh_ip>:8444, from ctl-1.
        let api_as = |caller: &'static str, m: &control_plane::Member| {
            let (cluster_ca, m) = (cluster.ca.clone(), m.clone());
            let c1 = c1.clone();
            async move {
                let addr = forward_from(&c1, SocketAddr::from((m.mesh_ip, 8444))).await;
                let cfg = cluster_ca.client_tls(cluster_ca.node_identity(caller, false));
                control_plane::node_api_client(&addr, &m.node_id, cfg).await
            }
        };
        for m in [&ma, &mb, &mc] {
            let mut client = api_as("ctl-1", m).await;
            client
                .stats(zattera_agent::proto::v1::StatsQuery::default())
                .await
                .unwrap_or_else(|e| panic!("Stats at {}:8444 over the mesh: {e}", m.mesh_ip));
        }

        // Issue 44.2 (AGENT-4): the node API follows every peer set. A
        // control node that joins after the workers may call at once; once
        // removed, it may not (the join's list was frozen before).
        let stats_as = |caller: &'static str| {
            let ma = ma.clone();
            let api_as = &api_as;
            move || async move {
                api_as(caller, &ma)
                    .await
                    .stats(zattera_agent::proto::v1::StatsQuery::default())
                    .await
                    .map_err(|e| e.code())
            }
        };
        assert_eq!(stats_as("ctl-9")().await.err(), Some(tonic::Code::PermissionDenied));
        cluster.add_control_member("ctl-9", Ipv4Addr::new(10, 90, 0, 9));
        eventually("ctl-9 may call the node API once a peer set names it", 30, || async {
            stats_as("ctl-9")().await.is_ok()
        })
        .await;
        cluster.remove_member("ctl-9");
        eventually("ctl-9 is refused once it leaves the peer set", 30, || async {
            stats_as("ctl-9")().await.err() == Some(tonic::Code::PermissionDenied)
        })
        .await;
        assert!(stats_as("ctl-1")().await.is_ok(), "ctl-1 stays allowed");

        // web on B, a client on A; the client reaches web.internal → VIP →
        // B's published port on B's mesh IP.
        let (mut web, mut web_rt) = control_plane::assignment("web1", "env-web", 50, "httpd -f -p 80 -h /var/www");
        web.app_id = "app-web".into();
        web_rt.env.insert("ZATTERA_ENV".into(), "prod".into());
        web_rt.spec.as_mut().unwrap().ports = vec![PortSpec {
            name: "http".into(),
            container_port: 80,
            protocol: Protocol::Http as i32,
            public_l4_port: 0,
        }];
        cluster.push_set_to(&mb.node_id, set_of(1, vec![(web, web_rt)]));
        let (client_a, mut client_rt) = control_plane::assignment("cli1", "env-cli", 51, "sleep 100000");
        client_rt.env.insert("ZATTERA_ENV".into(), "prod".into());
        cluster.push_set_to(&ma.node_id, set_of(1, vec![(client_a, client_rt)]));
        let healthy = InstanceState::Healthy as i32;
        let running = InstanceState::Running as i32;
        tokio::time::timeout(
            Duration::from_secs(90),
            cluster.wait_for("web1 HEALTHY", Duration::from_secs(90), |r| {
                r.states_on("ctl-1", "web1").contains(&healthy).then_some(())
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("{}", dump(&b)));
        cluster
            .wait_for("cli1 RUNNING", Duration::from_secs(90), |r| {
                r.states_on("ctl-1", "cli1").iter().any(|s| *s == running || *s == healthy).then_some(())
            })
            .await;
        let web_obs = cluster.with(|r| r.latest_of("web1")).unwrap();
        let host_port = web_obs.mesh_port_bindings["http"];
        let vip = "10.97.0.9";
        cluster.push_routes(RouteSnapshot {
            version: 2,
            internal_services: vec![InternalService {
                fqdn: "web.prod.proj.internal.".into(),
                project_id: "proj".into(),
                environment_id: "env-web".into(),
                vip: vip.into(),
                ports: vec![InternalPort {
                    name: "http".into(),
                    port: 80,
                    protocol: "tcp".into(),
                    endpoints: vec![Endpoint {
                        assignment_id: "web1".into(),
                        node_id: mb.node_id.clone(),
                        addr: format!("{}:{host_port}", mb.mesh_ip),
                        healthy: true,
                        local_hint_node_id_matches: false,
                    }],
                }],
            }],
            ..RouteSnapshot::default()
        });
        // Everything on the test bridge from here on is captured.
        let pcap = tempfile::NamedTempFile::new().unwrap();
        let mut capture = std::process::Command::new("tcpdump")
            .args(["-i", &net.bridge, "-n", "-U", "--immediate-mode", "-w"])
            .arg(pcap.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("tcpdump (scripts/rig.sh installs it)");
        // Traffic starts only once tcpdump says it listens, and each packet
        // reaches it at once (`--immediate-mode`): by default the kernel
        // hands packets over in blocks retired after a second, so traffic
        // in the first second of a capture ended by SIGTERM was lost. A
        // fixed 500 ms pause was too short on a loaded CI machine, and
        // the capture saw nothing.
        // Its stderr is drained to the end, so its last words never meet
        // a closed pipe.
        let said = capture.stderr.take().unwrap();
        let (listening, heard) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            let mut listening = Some(listening);
            for line in std::io::BufReader::new(said).lines().map_while(Result::ok) {
                if line.contains("listening on")
                    && let Some(tx) = listening.take()
                {
                    let _ = tx.send(());
                }
            }
        });
        assert!(
            tokio::time::timeout(Duration::from_secs(30), heard)
                .await
                .is_ok_and(|r| r.is_ok()),
            "tcpdump did not start listening on {} within 30 s",
            net.bridge
        );
        let client_id = cluster.with(|r| r.latest_of("cli1")).unwrap().container_id;
        let fifo = a.dir.path().join("fifos");
        let fetch = |ctd: zattera_agent::runtime::Containerd, client: String, fifo: std::path::PathBuf| async move {
            let out = zattera_agent::runtime::exec::exec(
                &ctd,
                &client,
                &fifo,
                &zattera_agent::runtime::exec::ExecRequest {
                    args: vec![
                        "sh".into(),
                        "-c".into(),
                        "printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 web.internal 80".into(),
                    ],
                    timeout: Duration::from_secs(10),
                    ..Default::default()
                },
            )
            .await;
            out.is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("hello from zattera"))
        };
        eventually(&format!("web.internal from A's client\n{}\n{}", dump(&a), dump(&b)), 60, || {
            fetch(ctds[0].clone(), client_id.clone(), fifo.clone())
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(capture.id()).unwrap()),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = capture.wait();
        let read = |filter: &str| {
            let out = std::process::Command::new("tcpdump")
                .args(["-n", "-r"])
                .arg(pcap.path())
                .arg(filter)
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).lines().map(str::to_owned).collect::<Vec<_>>()
        };
        let wireguard = read("udp port 51820");
        let clear = read("ip and not (udp src port 51820 and udp dst port 51820)");
        eprintln!("capture: {} WireGuard packets, {} others in clear", wireguard.len(), clear.len());
        assert!(!wireguard.is_empty(), "the capture saw no WireGuard at all");
        assert!(clear.is_empty(), "traffic in clear between hosts: {clear:#?}");

        // By hand: ZATTERA_MESH_HOLD=SECS keeps the cluster up here.
        if let Some(secs) = std::env::var("ZATTERA_MESH_HOLD").ok().and_then(|s| s.parse::<u64>().ok()) {
            eprintln!(
                "cluster up for {secs} s. Watch it with:\n  zattera-netns --run-dir {} mesh      (host A; B: {})\n  nsenter --net=/run/netns/{} ip route\n  tcpdump -ni {} udp port 51820",
                a.dir.path().join("run").display(),
                b.dir.path().join("run").display(),
                a.ns,
                net.bridge
            );
            tokio::time::sleep(Duration::from_secs(secs)).await;
        }

        // The leader moves: every stream is on ctl-2 within seconds, and
        // what the nodes report reaches it.
        let moved = std::time::Instant::now();
        cluster.move_leader("ctl-2");
        for m in [&ma, &mb, &mc] {
            let id = m.node_id.clone();
            cluster
                .wait_for("a sync stream on ctl-2", Duration::from_secs(15), |r| {
                    (r.session_host_of(&id) == Some("ctl-2")).then_some(())
                })
                .await;
        }
        let followed = moved.elapsed();
        eprintln!("every stream followed the leader in {followed:?}");
        assert!(followed < Duration::from_secs(10), "streams took {followed:?} to follow the leader");
        cluster
            .wait_for("web1's state on ctl-2", Duration::from_secs(15), |r| {
                (!r.states_on("ctl-2", "web1").is_empty()).then_some(())
            })
            .await;

        // A new node joins: the others add it and keep their sessions (a
        // peer re-added would restart its byte counters).
        let before = device("ztma0").await.unwrap();
        let d = node("d", 24, 3, &mut net);
        eventually("a fourth worker joined", 60, workers(4)).await;
        let md = id_of(24);
        let d_key = md.public_key.clone();
        eventually(&format!("A adds D\n{}", dump(&d)), 30, || {
            let d_key = d_key.clone();
            async move { device("ztma0").await.is_some_and(|i| i.peers.iter().any(|p| p.public_key == d_key)) }
        })
        .await;
        let after = device("ztma0").await.unwrap();
        for p in &before.peers {
            let now = after.peers.iter().find(|q| q.public_key == p.public_key).unwrap();
            assert!(
                now.rx_bytes >= p.rx_bytes && now.tx_bytes >= p.tx_bytes,
                "peer {} was reset: {p:?} then {now:?}",
                p.public_key
            );
        }
        let (d_ns, d_ip) = (d.ns.clone(), ma.mesh_ip.to_string());
        eventually("D reaches A", 20, || {
            let (ns, ip) = (d_ns.clone(), d_ip.clone());
            async move {
                tokio::task::spawn_blocking(move || run_in(&ns, &["busybox", "ping", "-c1", "-W1", &ip]).status.success())
                    .await
                    .unwrap()
            }
        })
        .await;
        cluster.remove_member(&md.node_id);
        eventually("A drops D", 30, || {
            let d_key = d_key.clone();
            async move { device("ztma0").await.is_some_and(|i| !i.peers.iter().any(|p| p.public_key == d_key)) }
        })
        .await;
        drop(d);

        // B's agent and its WireGuard device are SIGKILLed; control is away
        // for B. The mesh comes back from the persisted peer set and web
        // keeps running: A's client reaches it again before control answers.
        let web_before = cluster.with(|r| r.latest_of("web1")).unwrap().container_id;
        if let Some(mut child) = b.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        cluster.set_away(&mb.node_id, true);
        mesh_cluster::kill_all_in(&b.ns);
        eventually("B's device gone", 10, || async { device("ztmb0").await.is_none() }).await;
        b.start();
        eventually(&format!("B's mesh back\n{}", dump(&b)), 30, || async {
            device("ztmb0").await.is_some_and(|i| i.peers.len() == 4)
        })
        .await;
        eventually(&format!("web.internal from A after B's restart\n{}", dump(&b)), 60, || {
            fetch(ctds[0].clone(), client_id.clone(), fifo.clone())
        })
        .await;
        let sessions_before = cluster.with(|r| r.sessions_of(&mb.node_id));
        cluster.set_away(&mb.node_id, false);
        let id = mb.node_id.clone();
        cluster
            .wait_for("B back on ctl-2", Duration::from_secs(60), |r| {
                (r.sessions_of(&id) > sessions_before).then_some(())
            })
            .await;
        let web_after = cluster.with(|r| r.latest_of("web1")).unwrap().container_id;
        assert_eq!(web_before, web_after, "web was adopted, not replaced");
        // With C's agent gone, gc removes its mesh interface.
        let c_run = c.dir.path().join("run");
        let c_ns = c.ns.clone();
        let mut c = c;
        if let Some(mut child) = c.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let netns_bin = std::path::Path::new(support::agent::BIN).with_file_name("zattera-netns");
        let gc = run_in(
            &c_ns,
            &[netns_bin.to_str().unwrap(), "--run-dir", c_run.to_str().unwrap(), "gc", "--apply"],
        );
        let said = String::from_utf8_lossy(&gc.stdout);
        assert!(
            gc.status.success() && said.contains("mesh interface ztmc0"),
            "gc: {gc:?}; {:?}: {:?}",
            c_run.join("mesh.json"),
            std::fs::read_to_string(c_run.join("mesh.json"))
        );
        eventually("gc removed ztmc0", 10, || async { device("ztmc0").await.is_none() }).await;
        drop(c);
        drop(a);
    })
    .catch_unwind()
    .await;
    for ctd in &ctds {
        support::purge_namespace(ctd).await;
    }
    drop(cluster);
    drop(net);
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}
