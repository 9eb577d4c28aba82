//! A node as a cluster sees it (issue 13): the real agent binary joined to
//! the test control plane, judged by what reaches control through the sync
//! stream. `ZATTERA_TEST_AGENT_BIN` runs these against another build.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/control.rs"]
mod control_plane;
mod support;

use std::time::Duration;

use control_plane::{ControlPlane, ControlledAgent, RegistryGrant, assignment, set_of};
use support::agent::KillOnDrop;
use support::registry::Registry;
use support::{rig, with_namespace};
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
    let Some(rig) = rig() else { return };
    with_namespace(&rig, "cl-heal", |ctd, rig| async move {
        import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .unwrap();
        let cp = ControlPlane::start(&[SECRET]).await;
        let agent =
            ControlledAgent::start(&cp, SECRET, &rig, ctd.namespace().as_str(), "ztcl").await;
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
    let Some(rig) = rig() else { return };
    with_namespace(&rig, "cl-join", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let (join_addr, forward) = forwarder(cp.address()).await;
        let dir = tempfile::tempdir().unwrap();
        let (data, run_dir) = (dir.path().join("data"), dir.path().join("run"));
        let bin = support::agent::run_bin();
        control_plane::join_cli(&data, &join_addr, &cp.ca.token(SECRET));
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
    let Some(rig) = rig() else { return };
    with_namespace(&rig, "cl-subnet", |ctd, rig| async move {
        import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .unwrap();
        let cp = ControlPlane::start(&[SECRET]).await;
        let agent =
            ControlledAgent::start(&cp, SECRET, &rig, ctd.namespace().as_str(), "ztcs").await;
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
    let Some(rig) = rig() else { return };
    with_namespace(&rig, "cl-tarpit", |ctd, rig| async move {
        import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .unwrap();
        let (registry, _tarpit) = tarpit().await;
        let cp = ControlPlane::start(&[SECRET]).await;
        let agent = ControlledAgent::start_with(
            &cp,
            SECRET,
            &rig,
            ctd.namespace().as_str(),
            "ztct",
            &["--pull-timeout", "40s"],
        )
        .await;
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

/// Issue 13.10: containerd restarts in the middle of a sync session. The
/// running tasks are not touched, a set pushed while containerd is down
/// converges once it is back, and every report reaches control.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_containerd_restart_during_sync_loses_nothing() {
    let Some(rig) = rig() else { return };
    let mut private = support::private::PrivateContainerd::start();
    let rig = support::Rig {
        socket: private.socket.clone(),
        ..rig
    };
    let ns = format!("zt-test-cl-ctd-{}", std::process::id());
    let ctd = zattera_agent::runtime::Containerd::connect(&rig.socket, ns.parse().unwrap())
        .await
        .unwrap();
    import_archive(&ctd, &rig.oci_archive(), None)
        .await
        .unwrap();
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

/// Issue 13.7 (W-6, TS-8, TS-9): the stats store is flushed to the data dir
/// and loaded at start, so points sampled before a SIGKILL are answered by
/// `Stats` after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_survive_a_sigkill() {
    let Some(rig) = rig() else { return };
    with_namespace(&rig, "cl-stats", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let mut agent =
            ControlledAgent::start(&cp, SECRET, &rig, ctd.namespace().as_str(), "ztcm").await;
        let file = agent.data_dir().join("metrics/tsdb.bin");
        let deadline = std::time::Instant::now() + Duration::from_secs(100);
        while !file.exists() {
            assert!(
                std::time::Instant::now() < deadline,
                "no flush of the stats store; agent log:\n{}",
                agent.log()
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let before = node_points(&agent, &cp).await;
        assert!(!before.is_empty(), "sampled before the kill");

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
    let Some(rig) = rig() else { return };
    with_namespace(&rig, "cl-registry", |ctd, rig| async move {
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
        let _agent =
            ControlledAgent::start(&cp, SECRET, &rig, ctd.namespace().as_str(), "ztcg").await;
        let (api, mut api_rt) = assignment("api", "env", 195, "sleep 3600");
        api_rt.image_ref = api_image;
        let (web, mut web_rt) = assignment("web", "env", 195, "sleep 3600");
        web_rt.image_ref = format!("{relay}/apps/web:1");
        cp.push_set(set_of(1, vec![(api, api_rt), (web, web_rt)]));
        let healthy = InstanceState::Healthy as i32;
        cp.wait_for("api and web HEALTHY", Duration::from_secs(90), |r| {
            let up = |id| r.latest_of(id).is_some_and(|o| o.state == healthy);
            (up("api") && up("web")).then_some(())
        })
        .await;

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
    let Some(rig) = rig() else { return };
    with_namespace(&rig, "cl-reg401", |ctd, rig| async move {
        import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .unwrap();
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
    let Some(rig) = rig() else { return };
    with_namespace(&rig, "cl-renew", |ctd, rig| async move {
        import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .unwrap();
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
            &["--join-token", &token],
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
        let end = |pem: &[u8]| zattera_agent::control::tls::validity_of(pem).unwrap().1;
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
    let Some(rig) = rig() else { return };
    with_namespace(&rig, "cl-expiry", |ctd, rig| async move {
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
    let Some(rig) = rig() else { return };
    with_namespace(&rig, "cl-default", |ctd, rig| async move {
        import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .unwrap();
        let cp = ControlPlane::start(&[SECRET]).await;
        let agent = ControlledAgent::start_with(
            &cp,
            SECRET,
            &rig,
            ctd.namespace().as_str(),
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
