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
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_enrollment_holds_back_no_container_and_control_follows_once_it_reads() {
    on_rig_with_image("cut-enroll", |ctd, rig| async move {
        let (cp, mut agent) =
            control_plane::controlled_agent(SECRET, &rig, &ctd, "ztpa", &[]).await;
        let node = agent.node_id.clone();
        let (a, rt) =
            control_plane::assignment("svc", "01JCUTENVIRONMENT000000001", 212, "sleep 3600");
        cp.push_set(control_plane::set_of(1, vec![(a, rt)]));
        let status = agent.wait_for("svc HEALTHY", |s| {
            s["assignments"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|r| r["id"] == "svc" && r["state"] == "HEALTHY")
        });
        let cid = status["assignments"][0]["container_id"]
            .as_str()
            .unwrap()
            .to_owned();
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
