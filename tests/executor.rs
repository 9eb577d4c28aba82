//! The executor end to end against real containerd, runc, netlink, nftables
//! and the gateway resolver: assignment sets in, healthy networked
//! containers out. Each test has its own containerd namespace, bridge
//! prefix, subnets, nft table and directories.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use support::{Rig, TEST_IMAGE, on_rig};
use zattera_agent::executor::{Executor, ExecutorHandle};
use zattera_agent::proto::cluster::{AssignmentRuntime, AssignmentSet};
use zattera_agent::proto::v1::{
    Assignment, AssignmentDesired, HealthCheck, HealthCheckType, Meta, PortSpec, Protocol,
    ServiceSpec,
};
use zattera_agent::runtime::{Containerd, import_archive};
use zattera_agent::source::local_names;
use zattera_agent::status::{AssignmentStatus, State, StatusSnapshot};
use zattera_netns::NetNode;

/// One test's agent: its executor task, handle and directories.
struct Agent {
    handle: ExecutorHandle,
    task: tokio::task::JoinHandle<()>,
    net: Arc<NetNode>,
    _cleanup: support::NetCleanup,
    dirs: tempfile::TempDir,
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Agent {
    fn start(ctd: &Containerd, prefix: &str) -> Self {
        Self::start_as(ctd, prefix, "")
    }

    /// An agent whose node id is `node_id` (E-4 filters on it).
    fn start_as(ctd: &Containerd, prefix: &str, node_id: &str) -> Self {
        let dirs = tempfile::tempdir().unwrap();
        let run_dir = dirs.path().join("run");
        let (net, dns, cleanup) = support::test_network(ctd, prefix, &run_dir);
        let cfg = support::executor_config(ctd, node_id, &dirs.path().join("data"), run_dir);
        let dns = Arc::new(dns);
        let (exec, handle) = Executor::new(
            cfg,
            ctd.clone(),
            Some(Arc::clone(&net)),
            Some(Arc::clone(&dns)),
            None,
        );
        // Standalone names come from the status, as the agent wires them.
        tokio::spawn(local_names::feed_dns(handle.status.clone(), dns));
        let task = tokio::spawn(exec.run());
        Self {
            handle,
            task,
            net,
            _cleanup: cleanup,
            dirs,
        }
    }

    /// A new executor on the same directories, networks and namespace, as
    /// after an agent restart; the old one is stopped first.
    fn restart(&mut self, ctd: &Containerd) {
        self.task.abort();
        let cfg = support::executor_config(
            ctd,
            "",
            &self.dirs.path().join("data"),
            self.dirs.path().join("run"),
        );
        let (exec, handle) =
            Executor::new(cfg, ctd.clone(), Some(Arc::clone(&self.net)), None, None);
        self.task = tokio::spawn(exec.run());
        self.handle = handle;
    }

    fn push(&self, set: AssignmentSet) {
        self.handle.desired.send(Some(set)).unwrap();
    }

    /// Waits until `pred` holds for the status snapshot.
    async fn wait_for(
        &mut self,
        what: &str,
        pred: impl Fn(&StatusSnapshot) -> bool,
    ) -> Arc<StatusSnapshot> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let snap = self.handle.status.borrow_and_update().clone();
            if pred(&snap) {
                return snap;
            }
            if tokio::time::timeout_at(deadline, self.handle.status.changed())
                .await
                .is_err()
            {
                panic!("timed out waiting for {what}; last status: {snap:#?}");
            }
        }
    }

    /// Waits until the executor has completed `n` more reconcile passes.
    async fn wait_passes(&mut self, n: u64) {
        let from = self.handle.status.borrow().passes;
        self.wait_for(&format!("{n} more passes after {from}"), |s| {
            s.passes >= from + n
        })
        .await;
    }

    /// Empties the set, waits for everything to go, then stops the task.
    async fn finish(mut self) {
        self.push(AssignmentSet::default());
        self.wait_for("everything removed", |s| s.assignments.is_empty())
            .await;
        let _ = self.net.remove_rules().await;
        self.task.abort();
    }
}

fn state_of(s: &StatusSnapshot, id: &str) -> Option<State> {
    s.assignments.iter().find(|a| a.id == id).map(|a| a.state)
}

/// The status row of assignment `id`; panics when there is none.
fn row<'a>(s: &'a StatusSnapshot, id: &str) -> &'a AssignmentStatus {
    s.assignments
        .iter()
        .find(|a| a.id == id)
        .unwrap_or_else(|| panic!("no status row for {id}"))
}

/// The client of the lifecycle test: resolves web.internal every second,
/// on web's subnet (slot 220).
fn dns_client() -> (Assignment, AssignmentRuntime) {
    let (a, mut rt) = assignment(
        "client-0",
        "client",
        "prod",
        220,
        "while true; do nslookup web.internal > /tmp/ns.txt 2>&1; sleep 1; done",
        "c1",
    );
    rt.subnet_cidr = "10.201.220.0/24".into();
    (a, rt)
}

/// One assignment of the busybox image.
fn assignment(
    id: &str,
    app: &str,
    env: &str,
    slot: u8,
    command: &str,
    hash: &str,
) -> (Assignment, AssignmentRuntime) {
    let a = Assignment {
        meta: Some(Meta {
            id: id.into(),
            ..Meta::default()
        }),
        project_id: "proj".into(),
        app_id: app.into(),
        environment_id: env.into(),
        desired: AssignmentDesired::Run as i32,
        config_hash: hash.into(),
        release_id: hash.into(),
        ..Assignment::default()
    };
    let rt = AssignmentRuntime {
        image_ref: TEST_IMAGE.into(),
        spec: Some(ServiceSpec {
            command: command.into(),
            ..ServiceSpec::default()
        }),
        env: BTreeMap::from([("ZATTERA_APP".into(), app.into())]),
        subnet_cidr: format!("10.201.{slot}.0/24"),
        volume_lease: None,
    };
    (a, rt)
}

fn web(id: &str, slot: u8, hash: &str) -> (Assignment, AssignmentRuntime) {
    let (a, mut rt) = assignment(id, "web", "prod", slot, "httpd -f -p 80 -h /var/www", hash);
    let spec = rt.spec.as_mut().unwrap();
    spec.ports = vec![PortSpec {
        name: "http".into(),
        container_port: 80,
        protocol: Protocol::Http as i32,
        public_l4_port: 0,
    }];
    spec.healthcheck = Some(HealthCheck {
        r#type: HealthCheckType::Http as i32,
        path: "/".into(),
        interval: Some(prost_types::Duration {
            seconds: 1,
            nanos: 0,
        }),
        timeout: Some(prost_types::Duration {
            seconds: 1,
            nanos: 0,
        }),
        ..HealthCheck::default()
    });
    (a, rt)
}

fn set(items: Vec<(Assignment, AssignmentRuntime)>) -> AssignmentSet {
    let mut s = AssignmentSet::default();
    for (a, rt) in items {
        let id = a.meta.as_ref().unwrap().id.clone();
        s.assignments.push(a);
        s.runtime.insert(id, rt);
    }
    s
}

async fn import(ctd: &Containerd, rig: &Rig) {
    import_archive(ctd, &rig.oci_archive(), None)
        .await
        .expect("import the test image");
}

/// The body of `GET /` (busybox's wget crashes on this Debian build; nc does not).
fn http_get(addr: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = TcpStream::connect(addr) else {
        return String::new();
    };
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let _ = s.write_all(b"GET / HTTP/1.0\r\n\r\n");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}

fn bridge_exists(name: &str) -> bool {
    std::path::Path::new("/sys/class/net").join(name).exists()
}

#[tokio::test]
async fn lifecycle_to_healthy_with_ports_dns_and_removal() {
    on_rig("exec-life", |ctd, rig| async move {
        import(&ctd, &rig).await;
        let mut agent = Agent::start(&ctd, "ztxa");
        // Same project and environment id: one bridge, one DNS scope.
        agent.push(set(vec![web("web-0", 220, "h1"), dns_client()]));

        let snap = agent
            .wait_for("web HEALTHY", |s| {
                state_of(s, "web-0") == Some(State::Healthy)
            })
            .await;
        let web_row = row(&snap, "web-0");
        assert!(web_row.ip.starts_with("10.201.220."), "{web_row:?}");
        let host_port = web_row.ports["http"];
        assert!(host_port > 0);
        assert!(bridge_exists("ztxa220"));

        // The published port answers on the host address.
        assert_eq!(
            http_get(&format!("127.0.0.1:{host_port}")),
            "hello from zattera\n"
        );
        assert!(TcpStream::connect(("127.0.0.1", host_port)).is_ok());

        // The client resolves web.internal through its gateway to web's IP.
        let web_ip = web_row.ip.clone();
        let client_cid = row(&snap, "client-0").container_id.clone();
        let mut resolved = String::new();
        for _ in 0..40 {
            let out = zattera_agent::runtime::exec::exec(
                &ctd,
                &client_cid,
                &agent.dirs.path().join("fifos"),
                &zattera_agent::runtime::exec::ExecRequest {
                    args: vec!["cat".into(), "/tmp/ns.txt".into()],
                    timeout: Duration::from_secs(5),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
            resolved = String::from_utf8_lossy(&out.stdout).into_owned();
            if resolved.contains(&web_ip) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        assert!(
            resolved.contains(&web_ip),
            "nslookup web.internal from the client: {resolved}"
        );

        // An edit replaces only the changed instance.
        let client_before = client_cid.clone();
        let web_before = web_row.container_id.clone();
        agent.push(set(vec![web("web-0", 220, "h2"), dns_client()]));
        let snap = agent
            .wait_for("web replaced and HEALTHY", |s| {
                s.assignments.iter().any(|a| {
                    a.id == "web-0" && a.container_id != web_before && a.state == State::Healthy
                })
            })
            .await;
        let client_after = row(&snap, "client-0").container_id.clone();
        assert_eq!(
            client_after, client_before,
            "the unchanged client is not restarted"
        );

        // Removing everything removes the bridge too.
        agent.finish().await;
        let mut gone = false;
        for _ in 0..50 {
            if !bridge_exists("ztxa220") {
                gone = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(gone, "the last instance took its bridge with it");
    })
    .await;
}

#[tokio::test]
async fn two_environments_are_isolated() {
    on_rig("exec-iso", |ctd, rig| async move {
        import(&ctd, &rig).await;
        let mut agent = Agent::start(&ctd, "ztxb");
        agent.push(set(vec![
            web("web-a", 221, "h1"),
            web("web-a2", 221, "h1"),
            {
                let (mut a, rt) = web("web-b", 222, "h1");
                a.environment_id = "staging".into();
                (a, rt)
            },
        ]));
        let snap = agent
            .wait_for("all HEALTHY", |s| {
                ["web-a", "web-a2", "web-b"]
                    .iter()
                    .all(|id| state_of(s, id) == Some(State::Healthy))
            })
            .await;
        let ip = |id: &str| row(&snap, id).ip.clone();
        let cid = |id: &str| row(&snap, id).container_id.clone();
        let fifo = agent.dirs.path().join("fifos");
        let wget = |target: String| zattera_agent::runtime::exec::ExecRequest {
            args: vec![
                "sh".into(),
                "-c".into(),
                format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 2 {target} 80"),
            ],
            timeout: Duration::from_secs(10),
            ..Default::default()
        };
        // Inside one environment: reachable.
        let peer =
            zattera_agent::runtime::exec::exec(&ctd, &cid("web-a"), &fifo, &wget(ip("web-a2")))
                .await
                .unwrap();
        assert_eq!(peer.exit_code, 0, "{peer:?}");
        assert!(
            String::from_utf8_lossy(&peer.stdout).ends_with("hello from zattera\n"),
            "{peer:?}"
        );
        // Across environments: never.
        let across =
            zattera_agent::runtime::exec::exec(&ctd, &cid("web-a"), &fifo, &wget(ip("web-b")))
                .await
                .unwrap();
        assert!(
            across.stdout.is_empty(),
            "staging must not be reachable from prod: {across:?}"
        );
        agent.finish().await;
    })
    .await;
}

#[tokio::test]
async fn failing_pulls_park_after_three_attempts_and_unpark_on_edit() {
    on_rig("exec-park", |ctd, rig| async move {
        import(&ctd, &rig).await;
        let mut agent = Agent::start(&ctd, "ztxc");
        // A registry that has no such manifest, and counts the asks.
        let registry = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = registry.local_addr().unwrap().port();
        let asks = Arc::new(std::sync::atomic::AtomicU32::new(0));
        std::thread::spawn({
            let asks = Arc::clone(&asks);
            move || {
                use std::io::{BufRead, Write};
                for conn in registry.incoming().map_while(Result::ok) {
                    let mut reader = std::io::BufReader::new(&conn);
                    let mut line = String::new();
                    while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                        if line.contains("/manifests/") {
                            asks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                        line.clear();
                    }
                    let _ = (&conn).write_all(
                        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                    );
                }
            }
        });
        let asked = || asks.load(std::sync::atomic::Ordering::SeqCst);
        let (a, mut rt) = assignment("bad-0", "bad", "prod", 223, "sleep 1000", "h1");
        rt.image_ref = format!("127.0.0.1:{port}/nope:1");
        agent.push(set(vec![(a, rt)]));
        let snap = agent
            .wait_for("FAILED with a pull message", |s| {
                state_of(s, "bad-0") == Some(State::Failed)
            })
            .await;
        let row = row(&snap, "bad-0");
        assert!(row.message.starts_with("pull 127.0.0.1:"), "{row:?}");
        // Three ticks (5 s apart) make the three attempts, each one ask
        // for the manifest.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while asked() < 3 {
            assert!(
                std::time::Instant::now() < deadline,
                "{} attempts in 60 s",
                asked()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Parked: two more passes ask nothing.
        agent.wait_passes(2).await;
        assert_eq!(asked(), 3, "attempts after parking");
        // The edit fixes the image: the assignment unparks and runs.
        let (a, rt) = assignment("bad-0", "bad", "prod", 223, "sleep 1000", "h2");
        agent.push(set(vec![(a, rt)]));
        agent
            .wait_for("HEALTHY after the edit", |s| {
                state_of(s, "bad-0") == Some(State::Healthy)
            })
            .await;
        agent.finish().await;
    })
    .await;
}

#[tokio::test]
async fn a_crashing_service_is_restarted_with_back_off() {
    on_rig("exec-crash", |ctd, rig| async move {
        import(&ctd, &rig).await;
        let mut agent = Agent::start(&ctd, "ztxd");
        let (a, rt) = assignment("crash-0", "crash", "prod", 224, "sleep 1; exit 3", "h1");
        agent.push(set(vec![(a, rt)]));
        let snap = agent
            .wait_for("crash-looping", |s| {
                s.assignments.iter().any(|a| {
                    a.id == "crash-0" && a.message.contains("crash-looping: last exit code 3")
                })
            })
            .await;
        assert_eq!(state_of(&snap, "crash-0"), Some(State::Failed));
        // The first back-off is 10 s; then it runs again and counts a restart.
        agent
            .wait_for("one restart", |s| {
                s.assignments
                    .iter()
                    .any(|a| a.id == "crash-0" && a.restarts >= 1)
            })
            .await;
        agent.finish().await;
    })
    .await;
}

#[tokio::test]
async fn an_empty_volume_is_filled_from_the_image_and_then_kept() {
    on_rig("exec-vol", |ctd, rig| async move {
        import(&ctd, &rig).await;
        let mut agent = Agent::start(&ctd, "ztxe");
        let (a, mut rt) = web("vol-0", 225, "h1");
        rt.spec.as_mut().unwrap().volumes = vec![zattera_agent::proto::v1::VolumeMount {
            volume_name: "www".into(),
            mount_path: "/var/www".into(),
        }];
        agent.push(set(vec![(a, rt)]));
        let snap = agent
            .wait_for("HEALTHY", |s| state_of(s, "vol-0") == Some(State::Healthy))
            .await;
        let port = snap.assignments[0].ports["http"];
        let volume = agent.dirs.path().join("data/volumes/zt-prod-www/_data");
        assert_eq!(
            std::fs::read_to_string(volume.join("index.html")).unwrap(),
            "hello from zattera\n",
            "copied up from the image"
        );
        // The container serves the volume, not its image layer.
        std::fs::write(volume.join("index.html"), "from the volume\n").unwrap();
        assert_eq!(http_get(&format!("127.0.0.1:{port}")), "from the volume\n");
        // A replacement finds the volume non-empty and leaves it alone.
        let (a, mut rt) = web("vol-0", 225, "h2");
        rt.spec.as_mut().unwrap().volumes = vec![zattera_agent::proto::v1::VolumeMount {
            volume_name: "www".into(),
            mount_path: "/var/www".into(),
        }];
        let before = snap.assignments[0].container_id.clone();
        agent.push(set(vec![(a, rt)]));
        agent
            .wait_for("replaced", |s| {
                s.assignments
                    .iter()
                    .any(|r| r.container_id != before && r.state == State::Healthy)
            })
            .await;
        assert_eq!(
            std::fs::read_to_string(volume.join("index.html")).unwrap(),
            "from the volume\n"
        );
        // 44.9 (VOL-4): emptied on purpose, it is not filled again at the
        // next bring-up (the old rule, "empty now", refilled it).
        std::fs::remove_file(volume.join("index.html")).unwrap();
        let replaced = agent.wait_for("the status", |_| true).await.assignments[0]
            .container_id
            .clone();
        let (a, mut rt) = web("vol-0", 225, "h3");
        rt.spec.as_mut().unwrap().volumes = vec![zattera_agent::proto::v1::VolumeMount {
            volume_name: "www".into(),
            mount_path: "/var/www".into(),
        }];
        agent.push(set(vec![(a, rt)]));
        agent
            .wait_for("replaced again and started", |s| {
                s.assignments.iter().any(|r| {
                    r.container_id != replaced
                        && !r.container_id.is_empty()
                        && matches!(r.state, State::Running | State::Healthy | State::Unhealthy)
                })
            })
            .await;
        assert!(
            !volume.join("index.html").exists(),
            "an emptied volume was filled from the image again"
        );
        agent.finish().await;
    })
    .await;
}

#[tokio::test]
async fn jobs_run_once_and_report_their_exit() {
    on_rig("exec-jobs", |ctd, rig| async move {
        import(&ctd, &rig).await;
        let mut agent = Agent::start(&ctd, "ztxf");
        let (mut ok, ok_rt) = assignment("job-ok", "jobs", "prod", 226, "echo done", "h1");
        ok.job_id = "j1".into();
        let (mut bad, bad_rt) = assignment("job-bad", "jobs", "prod", 226, "exit 4", "h1");
        bad.job_id = "j2".into();
        agent.push(set(vec![(ok, ok_rt), (bad, bad_rt)]));
        let snap = agent
            .wait_for("both finished", |s| {
                state_of(s, "job-ok") == Some(State::Stopped)
                    && state_of(s, "job-bad") == Some(State::Failed)
            })
            .await;
        let bad_row = row(&snap, "job-bad");
        assert_eq!(bad_row.message, "exited with code 4");
        // Passes go by; a job is never run again.
        agent.wait_passes(2).await;
        let snap = agent.handle.status.borrow().clone();
        for row in &snap.assignments {
            assert_eq!(row.restarts, 0, "{row:?}");
        }
        let cid = bad_row.container_id.clone();
        let labels = zattera_agent::runtime::containers::get(&ctd, &cid)
            .await
            .unwrap()
            .unwrap()
            .labels;
        assert_eq!(
            labels["dev.zattera/exit-code"], "4",
            "the exit code survives agent restarts"
        );
        agent.finish().await;
    })
    .await;
}

/// Issue 58.2: a job never runs twice. After a reboot (every task gone) a
/// finished job reports its labelled exit and one cut short is FAILED
/// "lost in a reboot"; neither is run again. Before, the poll restarted any
/// container whose task was gone, jobs included.
#[tokio::test]
async fn after_a_reboot_a_job_is_never_run_again() {
    on_rig("exec-job-boot", |ctd, rig| async move {
        import(&ctd, &rig).await;
        let mut agent = Agent::start(&ctd, "ztxl");
        let (mut done, done_rt) =
            assignment("job-done", "jobs", "prod", 208, "echo ran; exit 5", "h1");
        done.job_id = "j-done".into();
        let (mut long, long_rt) = assignment(
            "job-long",
            "jobs",
            "prod",
            208,
            "echo ran; sleep 1000",
            "h1",
        );
        long.job_id = "j-long".into();
        let jobs = set(vec![(done, done_rt), (long, long_rt)]);
        agent.push(jobs.clone());
        let snap = agent
            .wait_for("one finished, one running", |s| {
                state_of(s, "job-done") == Some(State::Failed)
                    && matches!(
                        state_of(s, "job-long"),
                        Some(State::Running | State::Healthy)
                    )
            })
            .await;
        let cids: Vec<String> = ["job-done", "job-long"]
            .iter()
            .map(|id| row(&snap, id).container_id.clone())
            .collect();
        // The reboot: the executor goes, and every task with it.
        agent.task.abort();
        for cid in &cids {
            zattera_agent::runtime::containers::stop(&ctd, cid, 9, Duration::from_secs(1))
                .await
                .unwrap();
            zattera_agent::runtime::containers::delete_task(&ctd, cid)
                .await
                .unwrap();
        }
        agent.restart(&ctd);
        agent.push(jobs);
        let snap = agent
            .wait_for("both reported without a run", |s| {
                state_of(s, "job-done") == Some(State::Failed)
                    && state_of(s, "job-long") == Some(State::Failed)
            })
            .await;
        assert_eq!(row(&snap, "job-done").message, "exited with code 5");
        assert!(
            row(&snap, "job-long").message.contains("lost in a reboot"),
            "{snap:?}"
        );
        agent.wait_passes(2).await;
        for cid in &cids {
            let log = agent.dirs.path().join(format!("data/logs/{cid}.log"));
            let runs = std::fs::read_to_string(&log)
                .unwrap()
                .matches(" ran")
                .count();
            assert_eq!(runs, 1, "{cid} ran again");
            assert!(matches!(
                zattera_agent::runtime::containers::task_state(&ctd, cid)
                    .await
                    .unwrap(),
                zattera_agent::runtime::containers::TaskState::Absent
            ));
        }
        agent.finish().await;
    })
    .await;
}

/// C-5: an image's `User: app` is resolved against the image's own
/// /etc/passwd and /etc/group, supplementary groups included.
#[tokio::test]
async fn image_user_names_are_resolved_from_the_image() {
    on_rig("exec-user", |ctd, rig| async move {
        import_archive(&ctd, &rig.images.join("busybox-user-oci.tar"), None)
            .await
            .expect("import the user test image");
        let mut agent = Agent::start(&ctd, "ztxi");
        let (a, mut rt) = assignment("named-0", "named", "prod", 229, "sleep 1000", "h1");
        rt.image_ref = "docker.io/zattera/busybox:user".into();
        agent.push(set(vec![(a, rt)]));
        let snap = agent
            .wait_for("named-0 healthy", |s| {
                state_of(s, "named-0") == Some(State::Healthy)
            })
            .await;
        let cid = snap.assignments[0].container_id.clone();
        let fifo = agent.dirs.path().join("fifos");
        let out = zattera_agent::runtime::exec::exec(
            &ctd,
            &cid,
            &fifo,
            &zattera_agent::runtime::exec::ExecRequest {
                args: vec!["id".into()],
                timeout: Duration::from_secs(10),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let id = String::from_utf8_lossy(&out.stdout);
        assert!(
            id.starts_with("uid=1000(app) gid=1000(app)") && id.contains("33(www)"),
            "{id}"
        );
        agent.finish().await;
    })
    .await;
}

#[tokio::test]
async fn a_stateful_service_without_its_lease_stays_pending() {
    on_rig("exec-lease", |ctd, rig| async move {
        import(&ctd, &rig).await;
        let mut agent = Agent::start(&ctd, "ztxg");
        let (a, mut rt) = assignment("db-0", "db", "prod", 227, "sleep 1000", "h1");
        let spec = rt.spec.as_mut().unwrap();
        spec.stateful = true;
        spec.volumes = vec![zattera_agent::proto::v1::VolumeMount {
            volume_name: "data".into(),
            mount_path: "/data".into(),
        }];
        agent.push(set(vec![(a.clone(), rt.clone())]));
        let snap = agent
            .wait_for("PENDING for the lease", |s| {
                s.assignments
                    .iter()
                    .any(|a| a.id == "db-0" && a.message == "waiting for volume lease")
            })
            .await;
        assert_eq!(snap.assignments[0].state, State::Pending);
        agent.wait_passes(2).await; // still fenced
        assert_eq!(
            state_of(&agent.handle.status.borrow().clone(), "db-0"),
            Some(State::Pending)
        );
        let owned =
            zattera_agent::runtime::containers::list(&ctd, &[("dev.zattera/managed", "true")])
                .await
                .unwrap();
        assert!(owned.is_empty(), "nothing is created while fenced");

        // The lease for this node and instance lets it start.
        rt.volume_lease = Some(zattera_agent::proto::v1::VolumeLease {
            node_id: String::new(),
            assignment_id: "db-0".into(),
            ..Default::default()
        });
        agent.push(set(vec![(a, rt)]));
        agent
            .wait_for("HEALTHY with the lease", |s| {
                state_of(s, "db-0") == Some(State::Healthy)
            })
            .await;
        agent.finish().await;
    })
    .await;
}

#[tokio::test]
async fn bad_assignments_are_reported_and_disturb_nothing() {
    on_rig("exec-bad", |ctd, rig| async move {
        import(&ctd, &rig).await;
        let mut agent = Agent::start_as(&ctd, "ztxh", "n1");
        let (good, good_rt) = assignment("good-0", "good", "prod", 228, "sleep 1000", "h1");
        let (mut elsewhere, elsewhere_rt) =
            assignment("else-0", "else", "prod", 228, "sleep 1000", "h1");
        elsewhere.node_id = "n2".into();
        let (no_image, mut no_image_rt) =
            assignment("noimg-0", "noimg", "prod", 228, "sleep 1000", "h1");
        no_image_rt.image_ref = String::new();
        let (outside, mut outside_rt) =
            assignment("outside-0", "outside", "prod", 228, "sleep 1000", "h1");
        outside_rt.subnet_cidr = "192.168.77.0/24".into();
        let (mut no_payload, _) =
            assignment("nopayload-0", "nopayload", "prod", 228, "sleep 1000", "h1");
        no_payload.node_id = "n1".into();
        let mut s = set(vec![
            (good, good_rt),
            (elsewhere, elsewhere_rt),
            (no_image, no_image_rt),
            (outside, outside_rt),
        ]);
        s.assignments.push(no_payload);
        agent.push(s);

        let snap = agent
            .wait_for("the good one HEALTHY and the bad ones FAILED", |s| {
                state_of(s, "good-0") == Some(State::Healthy)
                    && ["noimg-0", "outside-0", "nopayload-0"]
                        .iter()
                        .all(|id| state_of(s, id) == Some(State::Failed))
            })
            .await;
        let message = |id: &str| row(&snap, id).message.clone();
        assert!(
            message("noimg-0").starts_with("pull "),
            "{}",
            message("noimg-0")
        );
        assert!(
            message("outside-0").contains("192.168.77.0/24"),
            "{}",
            message("outside-0")
        );
        assert_eq!(
            message("nopayload-0"),
            "no runtime payload (image/spec) for assignment"
        );
        assert!(
            state_of(&snap, "else-0").is_none(),
            "an assignment for another node is not ours"
        );
        let owned =
            zattera_agent::runtime::containers::list(&ctd, &[("dev.zattera/managed", "true")])
                .await
                .unwrap();
        assert_eq!(owned.len(), 1, "only the good instance exists");
        agent.finish().await;
    })
    .await;
}

/// 57.11: an image `VOLUME` entry. The reference (Docker) makes it an
/// anonymous volume filled from the image; here the path stays in the
/// container's own writable layer, which holds the image's content there
/// and keeps what the container writes across a restart of its task, as
/// the anonymous volume does across restarts of its container.
#[tokio::test]
async fn an_image_volume_entry_holds_the_image_content_and_keeps_writes() {
    on_rig("exec-imgvol", |ctd, rig| async move {
        import_archive(&ctd, &rig.images.join("volume-oci.tar"), None)
            .await
            .unwrap();
        let mut agent = Agent::start(&ctd, "ztxj");
        // Appends once per start: a restart shows as a second line.
        let (a, mut rt) = assignment(
            "vol-img",
            "volimg",
            "prod",
            252,
            "echo start >> /data/seed.txt; sleep 2; exit 3",
            "h1",
        );
        rt.image_ref = "docker.io/zattera/busybox:volume".into();
        agent.push(set(vec![(a, rt)]));
        let snap = agent
            .wait_for("one restart", |s| {
                s.assignments
                    .iter()
                    .any(|a| a.id == "vol-img" && a.restarts >= 1)
            })
            .await;
        let cid = row(&snap, "vol-img").container_id.clone();
        let out = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let text = zattera_agent::runtime::exec::exec(
                    &ctd,
                    &cid,
                    &agent.dirs.path().join("exec"),
                    &zattera_agent::runtime::exec::ExecRequest {
                        args: vec!["cat".into(), "/data/seed.txt".into()],
                        timeout: Duration::from_secs(5),
                        ..Default::default()
                    },
                )
                .await
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
                if text.matches("start").count() >= 2 {
                    return text;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
        .expect("two starts written to /data");
        assert!(out.starts_with("from the image\n"), "{out:?}");
        agent.finish().await;
    })
    .await;
}

/// 57.11: TCP health probes, as the reference's multi-service guide checks
/// Postgres: a port that accepts is HEALTHY, a closed one goes UNHEALTHY
/// after its threshold once the grace period is over.
#[tokio::test]
async fn tcp_probes_pass_on_an_open_port_and_fail_on_a_closed_one() {
    on_rig("exec-tcp", |ctd, rig| async move {
        import(&ctd, &rig).await;
        let mut agent = Agent::start(&ctd, "ztxk");
        let tcp = |port: u32| HealthCheck {
            r#type: HealthCheckType::Tcp as i32,
            port,
            interval: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
            timeout: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
            // 0 would be the default grace (60 s).
            grace_period: Some(prost_types::Duration {
                seconds: 1,
                nanos: 0,
            }),
            unhealthy_threshold: 2,
            ..HealthCheck::default()
        };
        let serve = "httpd -f -p 5432 -h /var/www";
        let (open, mut open_rt) = assignment("tcp-open", "db", "prod", 207, serve, "h1");
        open_rt.spec.as_mut().unwrap().healthcheck = Some(tcp(5432));
        let (closed, mut closed_rt) = assignment("tcp-closed", "db2", "prod", 207, serve, "h1");
        closed_rt.spec.as_mut().unwrap().healthcheck = Some(tcp(5433));
        agent.push(set(vec![(open, open_rt), (closed, closed_rt)]));
        agent
            .wait_for("open HEALTHY, closed UNHEALTHY", |s| {
                state_of(s, "tcp-open") == Some(State::Healthy)
                    && state_of(s, "tcp-closed") == Some(State::Unhealthy)
            })
            .await;
        agent.finish().await;
    })
    .await;
}

/// 59.1 (wake): an app that answers 0.3 s after its start is HEALTHY long
/// before its first interval (10 s) has passed: the startup phase probes
/// every 100-250 ms until the first pass. With the interval schedule alone
/// HEALTHY came one interval after RUNNING at the earliest.
#[tokio::test]
async fn an_app_with_a_ten_second_interval_is_healthy_before_half_of_it() {
    on_rig("exec-wake", |ctd, rig| async move {
        import(&ctd, &rig).await;
        let mut agent = Agent::start(&ctd, "ztxm");
        // web() with its server answering 0.3 s after the start and the
        // default interval's 10 s.
        let (a, mut rt) = web("wake-0", 219, "h1");
        let spec = rt.spec.as_mut().unwrap();
        spec.command = "sh -c 'sleep 0.3; exec httpd -f -p 80 -h /var/www'".into();
        let check = spec.healthcheck.as_mut().unwrap();
        check.interval = Some(prost_types::Duration {
            seconds: 10,
            nanos: 0,
        });
        check.timeout = None;
        agent.push(set(vec![(a, rt)]));
        agent
            .wait_for("wake RUNNING", |s| {
                matches!(state_of(s, "wake-0"), Some(State::Running | State::Healthy))
            })
            .await;
        let running = std::time::Instant::now();
        agent
            .wait_for("wake HEALTHY", |s| {
                state_of(s, "wake-0") == Some(State::Healthy)
            })
            .await;
        let took = running.elapsed();
        // Half the interval: a wide margin for a loaded CI machine, and
        // still half of what the interval schedule could do.
        assert!(
            took < Duration::from_secs(5),
            "HEALTHY {took:?} after RUNNING"
        );
        agent.finish().await;
    })
    .await;
}
