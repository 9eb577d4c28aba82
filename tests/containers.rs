//! Containers and tasks against the rig's real containerd and runc: output
//! through the log shim in CRI format, graceful and forced stops, removal,
//! label filters.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use support::{Rig, TEST_IMAGE, list_snapshots, rig, with_namespace};
use zattera_agent::runtime::containers::{self, TaskState};
use zattera_agent::runtime::exec::{ExecRequest, exec};
use zattera_agent::runtime::spec::{self, ContainerSpec};
use zattera_agent::runtime::{Containerd, ImageRef, get_local, import_archive};
use zattera_agent::runtime::{events, stats};

/// Skips without the rig, else runs `body` in a fresh namespace with a log
/// directory for [`start_busybox`] that outlives the namespace.
async fn on_rig_with_logs<F, Fut>(test: &str, body: F)
where
    F: FnOnce(Containerd, Rig, PathBuf) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let Some(rig) = rig() else { return };
    let logs = tempfile::tempdir().unwrap();
    let logs_path = logs.path().to_path_buf();
    with_namespace(&rig, test, |ctd, rig| body(ctd, rig, logs_path)).await;
}

/// Removes container `id`, SIGKILLing its task at once (1 s grace).
async fn kill_and_remove(ctd: &Containerd, id: &str) {
    containers::remove(ctd, id, 9, Duration::from_secs(1))
        .await
        .unwrap();
}

/// Imports the test image and creates + starts a container running `script`.
async fn start_busybox(
    ctd: &Containerd,
    rig: &Rig,
    id: &str,
    script: &str,
    logs: &Path,
) -> PathBuf {
    import_archive(ctd, &rig.oci_archive(), None)
        .await
        .expect("import");
    let name: ImageRef = TEST_IMAGE.parse().unwrap();
    let image = get_local(ctd, &name)
        .await
        .unwrap()
        .expect("image is present");
    assert!(image.unpacked);
    let hostname: String = id.chars().take(12).collect();
    let cfg = image.config.config().clone().unwrap_or_default();
    let c = ContainerSpec {
        hostname: hostname.clone(),
        args: spec::process_args(&[], &[], script, true),
        env: spec::process_env(
            &hostname,
            &cfg.env().clone().unwrap_or_default(),
            [("GREETING", "hi")],
        )
        .unwrap(),
        cwd: "/".into(),
        cgroups_path: format!("/zattera-test/{}/{id}", ctd.namespace()).into(),
        ..ContainerSpec::default()
    };
    let log = logs.join(format!("{id}.log"));
    let labels = [
        ("dev.zattera/managed", "true"),
        ("dev.zattera/assignment-id", id),
    ];
    support::create_and_start(ctd, id, &name, image.chain_id, &labels, &c, &log).await;
    log
}

async fn wait_stopped(ctd: &Containerd, id: &str) -> u32 {
    for _ in 0..200 {
        if let TaskState::Stopped { exit_code } = containers::task_state(ctd, id).await.unwrap() {
            return exit_code;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("task {id} did not stop");
}

/// Log lines, once the file holds at least `want` of them (the shim drains after exit).
async fn read_log(path: &Path, want: usize) -> Vec<String> {
    for _ in 0..100 {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        if lines.len() >= want {
            return lines;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{} never reached {want} lines", path.display());
}

/// `(stream, tag, text)` of one CRI log line, after checking its timestamp.
fn parse_cri(line: &str) -> (String, String, String) {
    let parts: Vec<&str> = line.splitn(4, ' ').collect();
    assert_eq!(parts.len(), 4, "not a CRI line: {line:?}");
    humantime::parse_rfc3339(parts[0]).unwrap_or_else(|e| panic!("bad time in {line:?}: {e}"));
    (parts[1].into(), parts[2].into(), parts[3].into())
}

#[tokio::test]
async fn output_of_both_streams_lands_in_the_cri_log_in_order() {
    on_rig_with_logs("logs", |ctd, rig, logs_path| async move {
        let script = "echo $GREETING $HOSTNAME; for i in $(seq 1 300); do echo out $i; echo err $i >&2; done";
        let log = start_busybox(&ctd, &rig, "logs-1", script, &logs_path).await;
        assert_eq!(wait_stopped(&ctd, "logs-1").await, 0);
        let lines = read_log(&log, 601).await;
        let parsed: Vec<_> = lines.iter().map(|l| parse_cri(l)).collect();
        // Order holds within a stream; the two pipes interleave freely.
        let stdout: Vec<&str> = parsed.iter().filter(|p| p.0 == "stdout").map(|p| p.2.as_str()).collect();
        assert_eq!(stdout[0], "hi logs-1", "the container's env reached the process");
        let stdout = &stdout[1..];
        let stderr: Vec<&str> = parsed.iter().filter(|p| p.0 == "stderr").map(|p| p.2.as_str()).collect();
        let want_out: Vec<String> = (1..=300).map(|i| format!("out {i}")).collect();
        let want_err: Vec<String> = (1..=300).map(|i| format!("err {i}")).collect();
        assert_eq!(stdout, want_out);
        assert_eq!(stderr, want_err);
        assert!(parsed.iter().all(|p| p.1 == "F"));
        containers::remove(&ctd, "logs-1", 15, Duration::from_secs(1)).await.unwrap();
    })
    .await;
}

#[tokio::test]
async fn stop_honours_a_process_that_traps_sigterm() {
    on_rig_with_logs("trap", |ctd, rig, logs_path| async move {
        let script = "trap 'echo bye; exit 0' TERM; echo ready; while true; do sleep 0.1; done";
        let log = start_busybox(&ctd, &rig, "trap-1", script, &logs_path).await;
        read_log(&log, 1).await; // the trap is installed
        let started = Instant::now();
        let exit = containers::stop(&ctd, "trap-1", 15, Duration::from_secs(20))
            .await
            .unwrap();
        assert_eq!(exit, Some(0), "the trap's exit code, not a SIGKILL");
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "stopped within grace"
        );
        let lines = read_log(&log, 2).await;
        assert_eq!(
            parse_cri(&lines[1]),
            ("stdout".into(), "F".into(), "bye".into())
        );
        assert_eq!(
            containers::task_state(&ctd, "trap-1").await.unwrap(),
            TaskState::Absent
        );
        containers::remove(&ctd, "trap-1", 15, Duration::from_secs(1))
            .await
            .unwrap();
    })
    .await;
}

#[tokio::test]
async fn stop_kills_a_process_that_ignores_sigterm_after_grace() {
    on_rig_with_logs("ignore", |ctd, rig, logs_path| async move {
        let script = "trap '' TERM; echo ready; while true; do sleep 0.1; done";
        let log = start_busybox(&ctd, &rig, "ignore-1", script, &logs_path).await;
        read_log(&log, 1).await;
        let grace = Duration::from_secs(1);
        let started = Instant::now();
        let exit = containers::stop(&ctd, "ignore-1", 15, grace).await.unwrap();
        assert!(
            started.elapsed() >= grace,
            "SIGKILL only after the grace period"
        );
        assert_eq!(exit, Some(137), "128 + SIGKILL");
        containers::remove(&ctd, "ignore-1", 15, grace)
            .await
            .unwrap();
    })
    .await;
}

#[tokio::test]
async fn remove_is_idempotent_and_leaves_no_rootfs() {
    on_rig_with_logs("remove", |ctd, rig, logs_path| async move {
        start_busybox(&ctd, &rig, "rm-1", "sleep 1000", &logs_path).await;
        assert!(matches!(
            containers::task_state(&ctd, "rm-1").await.unwrap(),
            TaskState::Running { pid } if pid > 0
        ));
        assert!(list_snapshots(&ctd).await.contains(&"rm-1".to_owned()));
        // sleep as PID 1 ignores SIGTERM: this exercises the SIGKILL path too.
        containers::remove(&ctd, "rm-1", 15, Duration::from_millis(300))
            .await
            .unwrap();
        containers::remove(&ctd, "rm-1", 15, Duration::from_millis(300))
            .await
            .unwrap();
        assert!(containers::get(&ctd, "rm-1").await.unwrap().is_none());
        assert!(!list_snapshots(&ctd).await.contains(&"rm-1".to_owned()));
    })
    .await;
}

#[tokio::test]
async fn list_filters_by_labels() {
    on_rig_with_logs("list", |ctd, rig, logs_path| async move {
        start_busybox(&ctd, &rig, "list-a", "true", &logs_path).await;
        start_busybox(&ctd, &rig, "list-b", "true", &logs_path).await;
        let owned = containers::list(&ctd, &[("dev.zattera/managed", "true")])
            .await
            .unwrap();
        assert_eq!(owned.len(), 2);
        let one = containers::list(&ctd, &[("dev.zattera/assignment-id", "list-b")])
            .await
            .unwrap();
        assert_eq!(
            one.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(),
            ["list-b"]
        );
        let none = containers::list(&ctd, &[("dev.zattera/assignment-id", "nope")])
            .await
            .unwrap();
        assert!(none.is_empty());
        containers::add_labels(
            &ctd,
            "list-a",
            HashMap::from([("dev.zattera/exit-code".into(), "0".into())]),
        )
        .await
        .unwrap();
        let labelled = containers::get(&ctd, "list-a").await.unwrap().unwrap();
        assert_eq!(labelled.labels["dev.zattera/exit-code"], "0");
        assert_eq!(
            labelled.labels["dev.zattera/managed"], "true",
            "merged, not replaced"
        );
    })
    .await;
}

#[tokio::test]
async fn exec_returns_exit_codes_and_both_streams() {
    on_rig_with_logs("exec", |ctd, rig, logs_path| async move {
        start_busybox(&ctd, &rig, "exec-1", "sleep 1000", &logs_path).await;
        let fifo_dir = logs_path.join("fifos");
        let run = |args: &[&str], timeout_ms: u64| ExecRequest {
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            env: vec!["EXTRA=yes".into()],
            timeout: Duration::from_millis(timeout_ms),
            ..ExecRequest::default()
        };
        let ok = exec(&ctd, "exec-1", &fifo_dir, &run(&["true"], 10_000))
            .await
            .unwrap();
        assert_eq!((ok.exit_code, ok.timed_out), (0, false));
        let no = exec(&ctd, "exec-1", &fifo_dir, &run(&["false"], 10_000))
            .await
            .unwrap();
        assert_eq!(no.exit_code, 1);
        let out = exec(
            &ctd,
            "exec-1",
            &fifo_dir,
            &run(
                &["sh", "-c", "echo $EXTRA $GREETING; echo oops >&2; exit 3"],
                10_000,
            ),
        )
        .await
        .unwrap();
        assert_eq!(out.exit_code, 3);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "yes hi\n",
            "container env plus extra"
        );
        assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");

        let slow = exec(&ctd, "exec-1", &fifo_dir, &run(&["sleep", "100"], 300))
            .await
            .unwrap();
        assert!(slow.timed_out);
        assert_eq!(slow.exit_code, 137, "killed at the timeout");

        let missing = exec(
            &ctd,
            "exec-1",
            &fifo_dir,
            &run(&["/no/such/binary"], 10_000),
        )
        .await;
        assert!(
            missing.is_err(),
            "a command that cannot start is an error: {missing:?}"
        );
        let nobody = exec(&ctd, "nope", &fifo_dir, &run(&["true"], 1000))
            .await
            .unwrap_err();
        assert!(nobody.to_string().contains("nope"), "{nobody}");
        assert_eq!(
            std::fs::read_dir(&fifo_dir).unwrap().count(),
            0,
            "fifos are removed"
        );
        kill_and_remove(&ctd, "exec-1").await;
    })
    .await;
}

#[tokio::test]
async fn stats_see_cpu_and_memory_of_a_busy_container() {
    on_rig_with_logs("stats", |ctd, rig, logs_path| async move {
        start_busybox(&ctd, &rig, "stats-1", "while true; do :; done", &logs_path).await;
        let TaskState::Running { pid } = containers::task_state(&ctd, "stats-1").await.unwrap()
        else {
            panic!("not running");
        };
        let cgroup = PathBuf::from(format!("/zattera-test/{}/stats-1", ctd.namespace()));
        let first = stats::sample(&cgroup, pid).unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let second = stats::sample(&cgroup, pid).unwrap();
        let cpu = stats::cpu_percent(&first, &second);
        assert!(
            cpu > 10.0 && cpu < 220.0,
            "a busy loop uses most of a core, got {cpu}%"
        );
        assert!(second.memory_bytes > 0);
        kill_and_remove(&ctd, "stats-1").await;
    })
    .await;
}

#[tokio::test]
async fn container_events_name_the_container() {
    on_rig_with_logs("cevents", |ctd, rig, logs_path| async move {
        let mut events = Box::pin(events::subscribe(&ctd));
        // The first event is the one containerd answers the subscription with.
        start_busybox(&ctd, &rig, "cevents-1", "sleep 30", &logs_path).await;
        kill_and_remove(&ctd, "cevents-1").await;
        let changed = tokio::time::timeout(Duration::from_secs(20), async {
            let mut changed = Vec::new();
            while changed.len() < 2 {
                match events.next().await.expect("stream open").expect("event") {
                    events::TaskEvent::ContainerChanged { container_id } => {
                        changed.push(container_id);
                    }
                    events::TaskEvent::ContainersChanged => panic!("an event without its id"),
                    _ => {}
                }
            }
            changed
        })
        .await
        .expect("a create and a delete event within 20 s");
        assert_eq!(changed, ["cevents-1", "cevents-1"]);
    })
    .await;
}

#[tokio::test]
async fn exit_events_carry_the_exit_code() {
    on_rig_with_logs("events", |ctd, rig, logs_path| async move {
        let mut events = Box::pin(events::subscribe(&ctd));
        // The subscription is sent at once; the container's sleep covers its flight time.
        start_busybox(&ctd, &rig, "events-1", "sleep 1; exit 7", &logs_path).await;
        let event = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let e = events.next().await.expect("stream open").expect("event");
                if e.is_init_exit() {
                    return e;
                }
            }
        })
        .await
        .expect("an exit event within 20 s");
        assert_eq!(
            event,
            events::TaskEvent::Exited {
                container_id: "events-1".into(),
                exec_id: "events-1".into(),
                exit_code: 7
            }
        );
        kill_and_remove(&ctd, "events-1").await;
    })
    .await;
}

/// Issue 44.5 (EX-6): exec processes belong to the shim and outlive the
/// agent that started them. At start, those of the agent's own ids started
/// before it are killed and deleted; another tool's exec and one this
/// agent starts later are left alone.
#[tokio::test]
async fn exec_processes_an_earlier_agent_left_are_ended() {
    on_rig_with_logs("exec-orphans", |ctd, rig, logs_path| async move {
        start_busybox(&ctd, &rig, "orph-1", "sleep 1000", &logs_path).await;
        let ctr_exec = |exec_id: &str| support::ctr_exec_sleep(&rig, &ctd, "orph-1", exec_id);
        let start = std::time::SystemTime::now();
        let old = format!(
            "exec-{}",
            start
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
                - 1_000_000_000
        );
        let later = format!(
            "session-{}",
            start
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
                + 1_000_000_000
        );
        ctr_exec(&old);
        ctr_exec("someone-elses");
        ctr_exec(&later);
        let pids = || async {
            ctd.tasks()
                .list_pids(
                    ctd.request(containerd_client::services::v1::ListPidsRequest {
                        container_id: "orph-1".into(),
                    }),
                )
                .await
                .unwrap()
                .into_inner()
                .processes
                .len()
        };
        assert_eq!(pids().await, 4, "init and three execs");
        let ended = zattera_agent::runtime::exec_orphans::end(&ctd, "orph-1", start).await;
        assert_eq!(ended, vec![old.clone()]);
        assert_eq!(pids().await, 3, "the other two run on");
        // Cleanup of the two left: the namespace purge removes the task.
    })
    .await;
}
