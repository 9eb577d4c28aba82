//! A node as a cluster sees it (issue 13): the real agent binary joined to
//! the test control plane, judged by what reaches control through the sync
//! stream. `ZATTERA_TEST_AGENT_BIN` runs these against another build.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/control.rs"]
mod control_plane;
mod support;

use std::time::Duration;

use control_plane::{ControlPlane, ControlledAgent, assignment, set_of};
use support::agent::KillOnDrop;
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
        let join = std::process::Command::new(&bin)
            .args(["--config", "/dev/null", "--data-dir"])
            .arg(&data)
            .args([
                "join",
                "--control",
                &join_addr,
                "--token",
                &cp.ca.token(SECRET),
            ])
            .output()
            .unwrap();
        assert!(
            join.status.success(),
            "join: {}",
            String::from_utf8_lossy(&join.stderr)
        );
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
