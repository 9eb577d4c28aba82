//! Issue 47.3: containers of one environment share runc shims, a bounded
//! number per shim (`--shim-group-size`), and what that costs in failure
//! isolation: a SIGKILLed shim takes down its group only, which is found
//! dead, reported and brought back; an agent restart adopts grouped
//! containers without restarting them; exec and logs stay per container;
//! the last container's teardown ends the shim.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use support::agent::{AgentProc, rows_by_id};
use support::{TEST_IMAGE, rig, with_namespace};
use zattera_agent::runtime::containers::{self, TaskState};
use zattera_agent::runtime::exec::{ExecRequest, exec};
use zattera_agent::runtime::{Containerd, import_archive};

/// Nine instances in `prod` (the executor fills eight groups side by side,
/// its parallelism, so the ninth shares one) and one in `stage` (a group of
/// its own: environments never share a shim).
fn manifest() -> String {
    let env = |name: &str, replicas: u32| {
        format!(
            "[env.{name}]\nreplicas = {replicas}\nstop_grace = \"2s\"\n\
             command = \"echo up $HOSTNAME; trap 'exit 0' TERM; while true; do sleep 1; done\"\n"
        )
    };
    format!(
        "[app]\nname = \"web\"\nproject = \"p\"\n[build]\ntype = \"image\"\nimage = \"{TEST_IMAGE}\"\n{}{}",
        env("prod", 9),
        env("stage", 1)
    )
}

/// Container id → its task's pid, and → the shim that is its parent.
async fn tasks(ctd: &Containerd, ids: &[String]) -> (BTreeMap<String, u32>, BTreeMap<String, i32>) {
    let procs = support::processes();
    let mut pids = BTreeMap::new();
    let mut shims = BTreeMap::new();
    for id in ids {
        if let TaskState::Running { pid } = containers::task_state(ctd, id).await.unwrap() {
            pids.insert(id.clone(), pid);
            if let Some(p) = procs.iter().find(|p| p.pid == i32::try_from(pid).unwrap()) {
                shims.insert(id.clone(), p.ppid);
            }
        }
    }
    (pids, shims)
}

async fn group_labels(ctd: &Containerd, ids: &[String]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for id in ids {
        let c = containers::get(ctd, id).await.unwrap().unwrap();
        out.insert(
            id.clone(),
            c.labels
                .get("dev.zattera/shim-group")
                .cloned()
                .unwrap_or_default(),
        );
    }
    out
}

fn shims_of(ns: &str) -> usize {
    support::processes()
        .iter()
        .filter(|p| p.is_runc_shim() && p.flag("-namespace") == Some(ns))
        .count()
}

#[tokio::test]
async fn an_environment_shares_bounded_shims_and_a_dead_one_takes_only_its_group() {
    let Some(rig) = rig() else { return };
    with_namespace(&rig, "shim-groups", |ctd, rig| async move {
        import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .unwrap();
        let ns = ctd.namespace().as_str().to_owned();
        let mut agent = AgentProc::new(&rig.socket, &ns, "ztsh", "246-247");
        agent.run_args = vec!["--shim-group-size".into(), "2".into()];
        agent.write_manifest("web.toml", &manifest());
        agent.start();
        let first = agent.wait_all(10, "HEALTHY");
        let ids: Vec<String> = first.values().cloned().collect();

        // Ten containers, nine shims: prod's eight groups and stage's one.
        let groups = group_labels(&ctd, &ids).await;
        let distinct: BTreeSet<&String> = groups.values().collect();
        assert_eq!(distinct.len(), 9, "{groups:?}");
        assert_eq!(shims_of(&ns), 9, "{groups:?}");
        let (pids, shims) = tasks(&ctd, &ids).await;
        for (a, b) in ids.iter().zip(ids.iter().skip(1)) {
            assert_eq!(
                groups[a] == groups[b],
                shims[a] == shims[b],
                "a group is one shim: {groups:?} {shims:?}"
            );
        }

        // Exec and logs stay per container.
        let fifos = agent.run_dir().join("test-fifos");
        for id in &ids {
            let out = exec(
                &ctd,
                id,
                &fifos,
                &ExecRequest {
                    args: vec!["hostname".into()],
                    timeout: Duration::from_secs(10),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
            let host = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            let log =
                std::fs::read_to_string(agent.data_dir().join("logs").join(format!("{id}.log")))
                    .unwrap();
            assert!(log.contains(&format!("up {host}")), "{id}: {host} / {log}");
        }

        // SIGKILL the shim of a full group: both of its containers die and
        // come back; no other container is touched.
        let (victim, _) = groups
            .iter()
            .find(|(_, g)| groups.values().filter(|h| h == g).count() == 2)
            .unwrap();
        let shim = shims[victim];
        let hit: BTreeSet<&String> = ids
            .iter()
            .filter(|id| groups[*id] == groups[victim])
            .collect();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(shim),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let s = agent.wait_for("the group restarted and all HEALTHY", |s| {
            let rows = s["assignments"].as_array().cloned().unwrap_or_default();
            rows.len() == 10
                && rows.iter().all(|r| r["state"] == "HEALTHY")
                && rows
                    .iter()
                    .filter(|r| r["restarts"].as_u64() >= Some(1))
                    .count()
                    == 2
        });
        let restarts = rows_by_id(&s, "container_id");
        assert_eq!(restarts, first, "restarted in place, same containers");
        let (after, _) = tasks(&ctd, &ids).await;
        for id in &ids {
            assert_eq!(
                after[id] != pids[id],
                hit.contains(id),
                "{id}: only the dead shim's group restarts ({pids:?} -> {after:?})"
            );
        }
        assert_eq!(shims_of(&ns), 9, "the group has a shim again");

        // An agent restart adopts them all, grouped, and restarts none.
        assert!(agent.term().is_some_and(|s| s.success()));
        agent.start();
        agent.wait_all(10, "HEALTHY");
        let (adopted, _) = tasks(&ctd, &ids).await;
        assert_eq!(adopted, after, "no task restarted by the adoption");

        // The last container's teardown ends its shim.
        std::fs::remove_file(agent.manifests().join("web.toml")).unwrap();
        agent.wait_for("all removed", |s| {
            s["assignments"].as_array().is_some_and(Vec::is_empty)
        });
        let deadline = Instant::now() + Duration::from_secs(30);
        while shims_of(&ns) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(shims_of(&ns), 0, "no shim outlives its group");
        agent.term();
    })
    .await;
}
