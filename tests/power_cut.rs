//! Issue 58: after a power cut or a reboot, the node comes back with what it
//! had. The real agent binary under the test control plane, on the rig's
//! containerd; the "reboot" stops every task and empties the run dir (a
//! tmpfs), as `tests/agent.rs` does it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "support/control/mod.rs"]
mod control_plane;
mod support;

use std::time::Duration;

use control_plane::ControlledAgent;
use support::on_rig_with_image;
use zattera_agent::link::identity::IdentityDir;
use zattera_agent::runtime::Containerd;
use zattera_agent::runtime::containers::{self, TaskState};

const SECRET: &str = "power-cut-secret";
const WAIT: Duration = Duration::from_secs(60);

/// The pid of `cid`'s running task, once it runs (60 s).
async fn running_pid(ctd: &Containerd, cid: &str, agent: &ControlledAgent) -> u32 {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let TaskState::Running { pid } = containers::task_state(ctd, cid).await.unwrap() {
            return pid;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the task of {cid} was not started again within 60 s; agent log:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What a reboot leaves of `agent`'s containers: no task, an empty run dir.
async fn reboot(ctd: &Containerd, agent: &mut ControlledAgent, cids: &[String]) {
    let _ = agent.child.kill();
    let _ = agent.child.wait();
    let run_dir = agent.dir.path().join("run");
    for cid in cids {
        containers::stop(ctd, cid, 9, Duration::from_secs(1))
            .await
            .unwrap();
        let pin = run_dir.join("netns").join(cid);
        let _ = std::process::Command::new("umount").arg(&pin).status();
        let _ = std::fs::remove_file(&pin);
    }
    let _ = std::fs::remove_dir_all(run_dir.join("containers"));
}

/// 58.9: the enrollment record torn by the cut (an empty `node.json`). The
/// agent stopped at start before ("this node has no usable enrollment"),
/// with every container of the node down. Now the containers come back
/// first, `status` says why control is not followed, and once the record
/// reads again the agent follows control without restarting them.
/// Pushes one sleeping service `svc` in environment `env` (subnet slot
/// `slot`) and waits for it HEALTHY; its container id.
fn svc_healthy(
    cp: &control_plane::ControlPlane,
    agent: &mut ControlledAgent,
    env: &str,
    slot: u8,
) -> String {
    let (a, rt) = control_plane::assignment("svc", env, slot, "sleep 3600");
    cp.push_set(control_plane::set_of(1, vec![(a, rt)]));
    let status = agent.wait_for("svc HEALTHY", |s| {
        s["assignments"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|r| r["id"] == "svc" && r["state"] == "HEALTHY")
    });
    status["assignments"][0]["container_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_enrollment_holds_back_no_container_and_control_follows_once_it_reads() {
    on_rig_with_image("cut-enroll", |ctd, rig| async move {
        let (cp, mut agent) =
            control_plane::controlled_agent(SECRET, &rig, &ctd, "ztpa", &[]).await;
        let node = agent.node_id.clone();
        let cid = svc_healthy(&cp, &mut agent, "01JCUTENVIRONMENT000000001", 212);
        cp.wait_for("the first session", WAIT, |r| {
            (r.sessions_of(&node) == 1).then_some(())
        })
        .await;

        reboot(&ctd, &mut agent, std::slice::from_ref(&cid)).await;
        let record = IdentityDir::new(&agent.data_dir()).state_path();
        let kept = std::fs::read(&record).unwrap();
        std::fs::write(&record, b"").unwrap();
        agent.kill9_and_restart(&cp, &rig);

        let pid = running_pid(&ctd, &cid, &agent).await;
        let status = agent.wait_for("the control link's notice", |s| {
            s["notices"]
                .to_string()
                .contains("not following the control plane")
        });
        assert!(
            status["notices"].to_string().contains("node.json"),
            "the notice names the file: {status:#}"
        );
        assert_eq!(cp.with(|r| r.sessions_of(&node)), 1);

        std::fs::write(&record, &kept).unwrap();
        cp.wait_for("a session once the record reads", WAIT, |r| {
            (r.sessions_of(&node) == 2).then_some(())
        })
        .await;
        agent.wait_for("no notice left", |s| {
            !s["notices"]
                .to_string()
                .contains("not following the control plane")
        });
        assert_eq!(
            running_pid(&ctd, &cid, &agent).await,
            pid,
            "following control restarted the container"
        );
        let log = agent.log();
        assert!(log.contains("running again to follow control"), "{log}");
    })
    .await;
}

/// A broken release of the agent (examples/agent_that_cannot_run.rs), built
/// beside the agent by `cargo test` and `cargo nextest`.
fn broken_release() -> std::path::PathBuf {
    let bin = std::path::Path::new(support::agent::BIN);
    let example = bin.parent().unwrap().join("examples/agent_that_cannot_run");
    assert!(
        example.exists(),
        "{} is missing: `cargo build --example agent_that_cannot_run` (cargo test builds it)",
        example.display()
    );
    example
}

fn sha256(path: &std::path::Path) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(std::fs::read(path).unwrap()))
}

/// 58.6: an upgrade to a release that answers `version --json` but fails in
/// `run`. Before, systemd restarted the broken binary for ever, and control
/// could no longer reach the node to send another. Now the broken release
/// counts its starts, and the fourth start runs the previous binary again:
/// the node syncs with its old version, `status` says what happened, and
/// the container ran throughout. The test plays systemd's `Restart=always`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_that_cannot_run_is_rolled_back_after_three_starts() {
    on_rig_with_image("cut-upgrade", |ctd, rig| async move {
        let bins = tempfile::tempdir().unwrap();
        let bin = bins.path().join("zattera-agent");
        std::fs::copy(support::agent::run_bin(), &bin).unwrap();
        let good = sha256(&bin);
        let channel =
            control_plane::ReleaseChannel::serve(&broken_release(), &["v9.9.9-broken"]).await;
        let cp = control_plane::ControlPlane::start(&[SECRET]).await;
        let run = ["--upgrade-base-url", channel.base.as_str()];
        let mut agent = ControlledAgent::start_with(
            &cp,
            SECRET,
            &rig,
            ctd.namespace().as_str(),
            "ztpb",
            control_plane::AgentFlags {
                run: &run,
                binary: Some(&bin),
                ..control_plane::AgentFlags::default()
            },
        )
        .await;
        let node = agent.node_id.clone();
        let cid = svc_healthy(&cp, &mut agent, "01JCUTENVIRONMENT000000002", 213);
        let pid = running_pid(&ctd, &cid, &agent).await;

        let mut api = agent.api_as(&cp, control_plane::CONTROL_NODE_ID).await;
        api.upgrade_binary(zattera_agent::proto::cluster::AgentUpgradeRequest {
            version: "v9.9.9-broken".into(),
            url: String::new(),
            sha256: String::new(),
        })
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", agent.log()));
        assert_eq!(
            sha256(&bin),
            channel.assets[0].2,
            "the broken release is installed"
        );

        // systemd's part: a start that exits is started again.
        let mut starts = 0;
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            assert!(
                std::time::Instant::now() < deadline,
                "never settled; log:\n{}",
                agent.log()
            );
            std::thread::sleep(Duration::from_millis(500));
            if agent.child.try_wait().unwrap().is_some() {
                starts += 1;
                assert!(
                    starts <= 5,
                    "still failing after {starts} starts:\n{}",
                    agent.log()
                );
                agent.kill9_and_restart(&cp, &rig);
                continue;
            }
            if sha256(&bin) == good && cp.with(|r| r.sessions_of(&node)) >= 2 {
                break;
            }
        }
        assert_eq!(
            starts,
            3,
            "three failed starts of the broken release:\n{}",
            agent.log()
        );
        let record = cp.node_record(&node).unwrap();
        assert_eq!(record.binary_version, zattera_agent::version::tag());
        let prev = bins.path().join("zattera-agent.prev");
        assert!(
            !prev.exists(),
            "the previous binary is back in place, not beside it"
        );
        let status = agent.wait_for("the roll-back said", |s| {
            s["notices"].to_string().contains("rolled back")
        });
        let said = status["notices"].to_string();
        assert!(
            said.contains("v9.9.9-broken") && said.contains("started 3 times"),
            "{said}"
        );
        let log = agent.log();
        assert!(log.contains("a key this release refuses"), "{log}");
        assert_eq!(
            running_pid(&ctd, &cid, &agent).await,
            pid,
            "the container ran throughout"
        );
    })
    .await;
}
