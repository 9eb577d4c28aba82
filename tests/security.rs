//! Attacks on the running agent (issue 12): a hostile image, a hostile
//! container, a hostile enrolled node. Each test is an attack against the
//! real agent binary, containerd, runc, nftables and kernel that succeeded
//! before the fix it names; `ZATTERA_TEST_AGENT_BIN` runs them against
//! another build. Every test has its own containerd namespace, bridge
//! prefix, subnets and, where host listeners are involved, its own network
//! namespace, and removes them even when it fails.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "support/control/mod.rs"]
mod control_plane;
mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use control_plane::{
    CONTROL_NODE_ID, ControlPlane, ControlledAgent, assignment, controlled_agent, set_of,
};
use support::agent::{AgentProc, KillOnDrop, TestNetns, row};
use support::on_rig;
use zattera_agent::proto::cluster::{
    AgentExecInput, AgentExecStart, AgentListFilesRequest, AgentReadFileRequest,
    AgentRemoveVolumeRequest, AgentRestoreVolumeRequest, AgentSnapshotVolumeRequest,
    AgentTopRequest, AgentUpgradeRequest, AgentWriteFileChunk, CancelBuildRequest, RunBuildRequest,
    TcpChunk,
};
use zattera_agent::proto::v1::{LogQuery, StatsQuery};
use zattera_agent::runtime::exec::{ExecRequest, exec};
use zattera_agent::runtime::{Containerd, import_archive};

const SECRET: &str = "security-secret";
const TOOLS: &str = "docker.io/zattera/busybox:tools";
const SYMLINK: &str = "docker.io/zattera/busybox:symlink";
const HOST_SECRET: &str = "/var/lib/zattera-rig/host-secret";

/// Runs `script` with /bin/sh inside container `cid`; (exit code, stdout).
async fn sh(ctd: &Containerd, cid: &str, script: &str) -> (u32, String) {
    let fifos = tempfile::tempdir().unwrap();
    let out = exec(
        ctd,
        cid,
        fifos.path(),
        &ExecRequest {
            args: vec!["/bin/sh".into(), "-c".into(), script.into()],
            timeout: Duration::from_secs(10),
            ..ExecRequest::default()
        },
    )
    .await
    .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.exit_code, text)
}

async fn import(ctd: &Containerd, rig: &support::Rig, file: &str) {
    import_archive(ctd, &rig.images.join(file), None)
        .await
        .unwrap();
}

fn manifest(app: &str, env: &str, image: &str, command: &str, extra: &str) -> String {
    format!(
        "[app]\nname = \"{app}\"\nproject = \"p\"\n[build]\ntype = \"image\"\nimage = \"{image}\"\n\
         [env.{env}]\nstop_grace = \"1s\"\ncommand = \"{command}\"\n{extra}"
    )
}

const IDLE: &str = "trap 'exit 0' TERM; while true; do sleep 1; done";

fn container_of(status: &serde_json::Value, app: &str) -> String {
    row(status, app).unwrap()["container_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn ip_of(status: &serde_json::Value, app: &str) -> String {
    row(status, app).unwrap()["ip"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn an_image_symlink_never_copies_a_host_directory_into_a_volume() {
    on_rig("sec-copyup", |ctd, rig| async move {
        import(&ctd, &rig, "symlink-oci.tar").await;
        let before = std::fs::read_dir(HOST_SECRET).unwrap().count();
        let mut agent = AgentProc::new(&rig.socket, ctd.namespace().as_str(), "ztsa", "174-175");
        // `/data` and `/srv` are symlinks onto host paths in the image.
        agent.write_manifest(
            "evil.toml",
            &manifest(
                "evil",
                "prod",
                SYMLINK,
                IDLE,
                "[[env.prod.volumes]]\nname = \"d1\"\nmount_path = \"/data\"\n\
                 [[env.prod.volumes]]\nname = \"d2\"\nmount_path = \"/srv/host-secret\"\n",
            ),
        );
        agent.start();
        let status = agent.wait_for("evil up", |s| {
            row(s, "evil").is_some_and(|r| r["state"] == "HEALTHY")
        });
        // Whatever became of the instance, no volume holds a host file...
        let volumes = agent.data_dir().join("volumes");
        let mut found = Vec::new();
        for v in std::fs::read_dir(&volumes).into_iter().flatten().flatten() {
            let data = v.path().join("_data");
            for e in std::fs::read_dir(&data).into_iter().flatten().flatten() {
                found.push(e.path());
            }
        }
        let made = std::fs::read_dir(&volumes).map_or(0, Iterator::count);
        assert_eq!(made, 2, "both volumes exist (copy-up ran): {status:#}");
        assert!(
            found.is_empty(),
            "host files copied into the volumes: {found:?}"
        );
        // ...and the host directory is as it was.
        assert_eq!(std::fs::read_dir(HOST_SECRET).unwrap().count(), before);
        // The agent's own files are nobody else's to read.
        let mode = |p: &Path| {
            std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(p).unwrap().permissions())
                & 0o777
        };
        assert_eq!(mode(&agent.data_dir()), 0o700, "data dir");
        assert_eq!(mode(&agent.run_dir()), 0o700, "run dir");
        let cid = container_of(&status, "evil");
        let log = agent.data_dir().join("logs").join(format!("{cid}.log"));
        assert_eq!(mode(&log), 0o600, "container log file");
        assert_eq!(
            std::fs::read_to_string(Path::new(HOST_SECRET).join("secret.txt")).unwrap(),
            "host secret\n"
        );
    })
    .await;
}

/// A host process in `netns`: a TCP listener on 0.0.0.0:2222 (an SSH-like
/// service) and a UDP one on 127.0.0.1:5555; prints a line per event.
const HOST_SERVICES: &str = r#"
import select, socket
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("0.0.0.0", 2222)); t.listen(8)
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 5555))
print("ready", flush=True)
while True:
    r, _, _ = select.select([t, u], [], [])
    if t in r:
        c, peer = t.accept(); print("tcp", peer, flush=True); c.close()
    if u in r:
        data, peer = u.recvfrom(2048); print("udp", peer, data, flush=True)
"#;

/// A bridge's MAC address, as iproute2 shows it in `netns`.
fn bridge_mac(netns: &TestNetns, bridge: &str) -> String {
    let line = netns.run(&["ip", "-o", "link", "show", bridge]);
    line.split_whitespace()
        .skip_while(|w| *w != "link/ether")
        .nth(1)
        .unwrap()
        .to_owned()
}

/// The host services' events, once they print `ready`.
fn host_events(services: &mut KillOnDrop) -> std::sync::mpsc::Receiver<String> {
    let stdout = services.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    assert_eq!(rx.recv_timeout(Duration::from_secs(10)).unwrap(), "ready");
    rx
}

#[tokio::test]
async fn containers_reach_neither_the_host_nor_another_environment() {
    on_rig("sec-host", |ctd, rig| async move {
        import(&ctd, &rig, "tools-oci.tar").await;
        let netns = TestNetns::new("sech");
        let mut agent = AgentProc::new(&rig.socket, ctd.namespace().as_str(), "ztsb", "176-177");
        agent.netns = Some(netns.path());
        agent.write_manifest(
            "attacker.toml",
            &manifest("attacker", "prod", TOOLS, IDLE, ""),
        );
        agent.write_manifest(
            "db.toml",
            &manifest("db", "staging", TOOLS, "exec ztprobe udp-listen 5353", ""),
        );
        agent.start();
        let status = agent.wait_for("both up", |s| {
            ["attacker", "db"]
                .iter()
                .all(|a| row(s, a).is_some_and(|r| r["state"] == "HEALTHY"))
        });
        let (attacker, attacker_ip) = (
            container_of(&status, "attacker"),
            ip_of(&status, "attacker"),
        );
        let (db, db_ip) = (container_of(&status, "db"), ip_of(&status, "db"));
        let gw = |ip: &str| format!("{}.1", ip.rsplit_once('.').unwrap().0);
        let (prod_gw, staging_gw) = (gw(&attacker_ip), gw(&db_ip));
        let bridge = format!("ztsb{}", attacker_ip.split('.').nth(2).unwrap());
        let mac = bridge_mac(&netns, &bridge);

        let mut services = KillOnDrop(
            netns
                .command("python3")
                .args(["-c", HOST_SERVICES])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let events = host_events(&mut services);
        // Positive controls first: the host's services hear the host itself,
        // and db's listener hears a legitimate datagram and logs it. Only
        // then does silence after the attacks mean something.
        let host_send = |script: &str| {
            let python = format!("import socket\n{script}");
            netns.run(&["python3", "-c", &python]);
        };
        let control = "socket.create_connection(('127.0.0.1', 2222)).close()\n\
                       socket.socket(2, 2).sendto(b'control', ('127.0.0.1', 5555))";
        host_send(control);
        let seen = wait_for_events(&events, &["tcp", "udp"]);
        assert!(
            seen.iter()
                .all(|e| e.starts_with("tcp ('127.0.0.1'") || e.contains("b'control'")),
            "{seen:?}"
        );
        let db_log = agent.data_dir().join("logs").join(format!("{db}.log"));
        let db_heard = || -> Vec<String> {
            std::fs::read_to_string(&db_log)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains("got "))
                .map(str::to_owned)
                .collect()
        };
        wait_until("db listens", || {
            std::fs::read_to_string(&db_log).is_ok_and(|t| t.contains("listening on 5353"))
        });
        host_send(&format!(
            "socket.socket(2, 2).sendto(b'legit', ('{db_ip}', 5353))"
        ));
        wait_until("db hears a legitimate datagram", || db_heard().len() == 1);

        // Runs a script in the attacker's container; (exit code, output).
        let attack = |script: String| {
            let (ctd, attacker) = (&ctd, &attacker);
            async move { sh(ctd, attacker, &script).await }
        };

        // 1. The host's service on the gateway.
        let (_, out) = attack(format!("echo hi | nc -w 2 {prod_gw} 2222; echo rc=$?")).await;
        // 2. A crafted packet to the host's loopback (CVE-2020-8558).
        let (_, raw) = attack(format!(
            "ztprobe udp eth0 {mac} {attacker_ip} 127.0.0.1 40000 5555 pwned"
        ))
        .await;
        assert!(raw.contains("sent"), "the raw packet went out: {raw}");
        // 3. Another environment's resolver; its own answers.
        let (_, foreign) = attack(format!("nslookup db.internal {staging_gw}")).await;
        let (_, own) = attack(format!("nslookup attacker.internal {prod_gw}")).await;
        // 4. A query with db's address as its source: the answer would go to db.
        let (_, spoof) = attack(format!(
            "ztprobe udp eth0 {mac} {db_ip} {prod_gw} 5353 53 dns:attacker.internal"
        ))
        .await;
        assert!(spoof.contains("sent"), "{spoof}");

        // Markers sent after the attacks: once they arrive, anything the
        // attacks caused has arrived before them (no fixed sleep).
        host_send(&format!(
            "socket.socket(2, 2).sendto(b'marker', ('127.0.0.1', 5555))\n\
             socket.socket(2, 2).sendto(b'mark', ('{db_ip}', 5353))"
        ));
        let host_saw = wait_for_events(&events, &["b'marker'"]);
        drop(services);
        wait_until("db hears the marker", || db_heard().len() >= 2);
        let heard = db_heard();
        assert!(own.contains(&attacker_ip), "the own gateway answers: {own}");
        assert!(
            !foreign.contains(&db_ip),
            "another environment's resolver answered: {foreign}"
        );
        assert!(
            host_saw.len() == 1 && host_saw[0].contains("b'marker'"),
            "the host's services were reached from a container: {host_saw:?} (nc: {out})"
        );
        assert!(
            heard.len() == 2 && !heard.iter().any(|l| l.contains(&format!("{prod_gw}:53"))),
            "a spoofed query's answer reached the other environment: {heard:?}"
        );
    })
    .await;
}

/// The events up to and including the first that contains each of `wanted`,
/// in order; fails after 20 s.
fn wait_for_events(events: &std::sync::mpsc::Receiver<String>, wanted: &[&str]) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = Vec::new();
    let mut left: Vec<&str> = wanted.to_vec();
    while !left.is_empty() {
        let wait = deadline.saturating_duration_since(Instant::now());
        let event = events
            .recv_timeout(wait)
            .unwrap_or_else(|e| panic!("waiting for {left:?} ({e}); saw {seen:?}"));
        left.retain(|w| !event.contains(w));
        seen.push(event);
    }
    seen
}

/// Polls `done` every 100 ms; fails after 20 s.
fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done() {
        assert!(Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test]
async fn a_container_cannot_unshare_use_keys_or_fork_bomb_the_node() {
    on_rig("sec-confine", |ctd, rig| async move {
        import(&ctd, &rig, "tools-oci.tar").await;
        import(&ctd, &rig, "busybox-oci.tar").await;
        let mut agent = AgentProc::new(&rig.socket, ctd.namespace().as_str(), "ztsc", "178-179");
        agent.write_manifest(
            "bomb.toml",
            &manifest(
                "bomb",
                "prod",
                TOOLS,
                IDLE,
                "[env.prod.resources]\npids = 64\n",
            ),
        );
        agent.write_manifest(
            "bystander.toml",
            &manifest("bystander", "prod", support::TEST_IMAGE, IDLE, ""),
        );
        agent.start();
        let ids = agent.wait_all(2, "HEALTHY");
        let status = agent.status().unwrap();
        let bomb = container_of(&status, "bomb");

        for (probe, what) in [
            ("busybox unshare -U true; echo rc=$?", "unshare -U"),
            ("ztprobe syscall unshare-user", "unshare(CLONE_NEWUSER)"),
            ("ztprobe syscall keyctl", "keyctl"),
            ("ztprobe syscall add-key", "add_key"),
            ("ztprobe syscall bpf", "bpf"),
            ("ztprobe syscall mount", "mount"),
            ("ztprobe syscall settime", "clock_settime"),
        ] {
            let (_, out) = sh(&ctd, &bomb, probe).await;
            assert!(
                out.contains("blocked: EPERM") || out.contains("Operation not permitted"),
                "{what} is not refused: {out}"
            );
        }
        let (_, nnp) = sh(&ctd, &bomb, "grep NoNewPrivs /proc/self/status").await;
        assert!(
            nnp.split_whitespace().last() == Some("1"),
            "no_new_privileges: {nnp}"
        );
        let (_, ok) = sh(&ctd, &bomb, "ztprobe syscall getpid").await;
        assert!(ok.contains("allowed"), "ordinary calls work: {ok}");
        // An amd64 container has no business in the ia32 compat table: the
        // filter lists only the image's ABI, so even an allowed call made
        // through int 0x80 is refused: the kernel kills the process (SIGSYS).
        let (_, ia32) = sh(&ctd, &bomb, "ztprobe syscall ia32-getpid; echo rc=$?").await;
        assert!(
            ia32.contains("rc=159") || ia32.contains("blocked"),
            "the ia32 ABI is open (want SIGSYS, rc=159): {ia32}"
        );

        // A fork bomb stays inside its pids limit; the node carries on.
        let (_, _) = sh(&ctd, &bomb, "f() { f | f & }; f; sleep 3").await;
        let pids = support::agent::cgroup_pids(ctd.namespace().as_str(), &bomb);
        assert!(
            pids.is_some_and(|n| n <= 64),
            "pids in the container: {pids:?}"
        );
        assert_eq!(
            agent.wait_all(2, "HEALTHY"),
            ids,
            "no container was replaced"
        );
    })
    .await;
}

#[tokio::test]
async fn a_hanging_exec_probe_leaks_no_process_fifo_or_thread() {
    on_rig("sec-probe", |ctd, rig| async move {
        import(&ctd, &rig, "busybox-oci.tar").await;
        let mut agent = AgentProc::new(&rig.socket, ctd.namespace().as_str(), "ztsd", "180-181");
        agent.write_manifest(
            "hang.toml",
            &format!(
                "[app]\nname = \"hang\"\nproject = \"p\"\n[build]\ntype = \"image\"\nimage = \"{}\"\n\
                 [deploy.healthcheck]\ntype = \"exec\"\ncommand = \"sleep 1000; true\"\ninterval = \"1s\"\ntimeout = \"1s\"\n\
                 [env.prod]\nstop_grace = \"1s\"\ncommand = \"{IDLE}\"\n",
                support::TEST_IMAGE
            ),
        );
        agent.start();
        let status = agent.wait_for("hang running", |s| {
            row(s, "hang").is_some_and(|r| r["state"] == "RUNNING")
        });
        let cid = container_of(&status, "hang");
        tokio::time::sleep(Duration::from_secs(3)).await;
        let pid = agent.pid().unwrap();
        let threads = || std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().count();
        let fifos = || {
            std::fs::read_dir(agent.run_dir().join("exec")).map_or(0, Iterator::count)
        };
        let before = threads();
        // 20 intervals of a probe that never ends on its own.
        tokio::time::sleep(Duration::from_secs(22)).await;
        let (_, ps) = sh(&ctd, &cid, "ps -o pid,args | grep -c '[s]leep 1000' || true").await;
        let sleeping: usize = ps.trim().lines().last().unwrap_or("0").trim().parse().unwrap_or(99);
        assert!(
            sleeping <= 2,
            "probe processes left behind in the container: {sleeping}"
        );
        assert!(fifos() <= 1, "exec FIFO dirs left: {}", fifos());
        assert!(
            threads() <= before + 4,
            "agent threads grew from {before} to {}",
            threads()
        );
    })
    .await;
}

/// Whether a call was refused for who the caller is.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// PERMISSION_DENIED because the caller is not control.
    NotControl,
    /// Anything else: the call reached the method.
    None,
}

impl Refusal {
    fn of(s: &tonic::Status) -> Self {
        if s.code() == tonic::Code::PermissionDenied
            && s.message().contains("not a control-plane node")
        {
            Refusal::NotControl
        } else {
            Refusal::None
        }
    }
}

/// Every node API method, called; whether each was refused for its caller.
async fn call_every_method(
    api: &mut zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient<
        tonic::transport::Channel,
    >,
) -> Vec<(&'static str, Refusal)> {
    async fn first<T, S>(r: Result<tonic::Response<S>, tonic::Status>) -> Refusal
    where
        S: futures::Stream<Item = Result<T, tonic::Status>> + Unpin,
    {
        use futures::StreamExt;
        match r {
            Err(s) => Refusal::of(&s),
            Ok(resp) => {
                match tokio::time::timeout(Duration::from_secs(5), resp.into_inner().next()).await {
                    Ok(Some(Err(s))) => Refusal::of(&s),
                    _ => Refusal::None,
                }
            }
        }
    }
    fn code<T>(r: Result<tonic::Response<T>, tonic::Status>) -> Refusal {
        r.map_or_else(|s| Refusal::of(&s), |_| Refusal::None)
    }
    let one = |frame: TcpChunk| tokio_stream::iter(vec![frame]);
    vec![
        (
            "QueryLogs",
            first(api.query_logs(LogQuery::default()).await).await,
        ),
        (
            "Exec",
            first(
                api.exec(tokio_stream::iter(vec![AgentExecInput {
                    start: Some(AgentExecStart {
                        container_id: "x".into(),
                        command: vec!["true".into()],
                        ..AgentExecStart::default()
                    }),
                    ..AgentExecInput::default()
                }]))
                .await,
            )
            .await,
        ),
        (
            "Top",
            code(
                api.top(AgentTopRequest {
                    container_id: "x".into(),
                })
                .await,
            ),
        ),
        ("Stats", code(api.stats(StatsQuery::default()).await)),
        (
            "ProxyTCP",
            first(
                api.proxy_tcp(one(TcpChunk {
                    dial_addr: "127.0.0.1:1".into(),
                    data: Vec::new(),
                }))
                .await,
            )
            .await,
        ),
        (
            "RunBuild",
            first(api.run_build(RunBuildRequest::default()).await).await,
        ),
        (
            "CancelBuild",
            code(api.cancel_build(CancelBuildRequest::default()).await),
        ),
        (
            "SnapshotVolume",
            first(
                api.snapshot_volume(AgentSnapshotVolumeRequest::default())
                    .await,
            )
            .await,
        ),
        (
            "RestoreVolume",
            first(
                api.restore_volume(AgentRestoreVolumeRequest::default())
                    .await,
            )
            .await,
        ),
        (
            "ListVolumeFiles",
            code(
                api.list_volume_files(AgentListFilesRequest::default())
                    .await,
            ),
        ),
        (
            "ReadVolumeFile",
            first(api.read_volume_file(AgentReadFileRequest::default()).await).await,
        ),
        (
            "WriteVolumeFile",
            code(
                api.write_volume_file(tokio_stream::iter(vec![AgentWriteFileChunk::default()]))
                    .await,
            ),
        ),
        (
            "RemoveVolume",
            code(api.remove_volume(AgentRemoveVolumeRequest::default()).await),
        ),
        (
            "UpgradeBinary",
            code(api.upgrade_binary(AgentUpgradeRequest::default()).await),
        ),
    ]
}

/// Waits until the agent's node API serves a control caller.
async fn serving(agent: &ControlledAgent, cp: &ControlPlane) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut api = agent.api_as(cp, CONTROL_NODE_ID).await;
        match api
            .top(AgentTopRequest {
                container_id: "x".into(),
            })
            .await
        {
            Err(s) if s.code() == tonic::Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            _ => return,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_control_may_drive_the_node_api_and_port_forwards_stay_on_instances() {
    on_rig("sec-api", |ctd, rig| async move {
        import(&ctd, &rig, "busybox-oci.tar").await;
        let (cp, agent) = controlled_agent(SECRET, &rig, &ctd, "ztse", &[]).await;
        // web: a published port; idle: holds port-forwards open, never reads.
        let (mut web, mut web_rt) = assignment("w1", "env", 188, "httpd -f -p 80 -h /var/www");
        web.app_id = "web".into();
        web_rt.spec.as_mut().unwrap().ports = vec![zattera_agent::proto::v1::PortSpec {
            name: "http".into(),
            container_port: 80,
            protocol: zattera_agent::proto::v1::Protocol::Http as i32,
            public_l4_port: 0,
        }];
        let idle = assignment("i1", "env", 188, "nc -ll -p 9000 -e sleep 3600");
        cp.push_set(set_of(1, vec![(web, web_rt), idle]));
        serving(&agent, &cp).await;

        // A worker's certificate: refused on every method.
        let mut worker = agent.api_as(&cp, "worker-7").await;
        for (method, refusal) in call_every_method(&mut worker).await {
            assert_eq!(refusal, Refusal::NotControl, "{method} answered a worker");
        }
        // Control's: every call reaches the service.
        let mut control = agent.api_as(&cp, CONTROL_NODE_ID).await;
        for (method, refusal) in call_every_method(&mut control).await {
            assert_eq!(refusal, Refusal::None, "{method} refused control");
        }

        // Port-forwards: not to a host service, not to an unpublished port,
        // not to another machine.
        let host = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let host_port = host.local_addr().unwrap().port();
        for target in [
            format!("127.0.0.1:{host_port}"),
            "127.0.0.1:1".to_owned(),
            "192.0.2.1:80".to_owned(),
        ] {
            let r = control
                .proxy_tcp(tokio_stream::iter(vec![TcpChunk {
                    dial_addr: target.clone(),
                    data: Vec::new(),
                }]))
                .await;
            let code = match r {
                Err(s) => s.code(),
                Ok(resp) => {
                    let mut s = resp.into_inner();
                    s.message()
                        .await
                        .err()
                        .map_or(tonic::Code::Ok, |e| e.code())
                }
            };
            assert_eq!(code, tonic::Code::PermissionDenied, "ProxyTCP to {target}");
        }
        let accepted = tokio::time::timeout(Duration::from_millis(200), host.accept()).await;
        assert!(accepted.is_err(), "the host listener got a connection");

        // To an instance: works; when the caller goes away, the socket closes.
        let status = agent.wait_for("both instances up", |s| {
            ["w1", "i1"].iter().all(|id| {
                s["assignments"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|r| r["id"] == *id && r["state"] == "HEALTHY")
            })
        });
        let idle_ip = support::agent::rows_by_id(&status, "ip")["i1"].clone();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tx.send(TcpChunk {
            dial_addr: format!("{idle_ip}:9000"),
            data: b"hello".to_vec(),
        })
        .await
        .unwrap();
        let call = control
            .proxy_tcp(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap();
        let pid = agent.child.id();
        let deadline = Instant::now() + Duration::from_secs(20);
        while support::agent::tcp_sockets_to(pid, &idle_ip, 9000) == 0 {
            assert!(Instant::now() < deadline, "the forward never opened");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            support::agent::tcp_sockets_to(pid, &idle_ip, 9000),
            1,
            "the forward is open"
        );
        drop(call);
        drop(tx);
        let deadline = Instant::now() + Duration::from_secs(5);
        while support::agent::tcp_sockets_to(pid, &idle_ip, 9000) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            support::agent::tcp_sockets_to(pid, &idle_ip, 9000),
            0,
            "the upstream socket outlived its caller"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volume_files_never_leave_the_volume_and_a_mounted_volume_is_kept() {
    on_rig("sec-vol", |ctd, rig| async move {
        import(&ctd, &rig, "busybox-oci.tar").await;
        let (cp, agent) = controlled_agent(SECRET, &rig, &ctd, "ztsf", &[]).await;
        // Two environments whose ULIDs share their first 8 characters.
        let (env_a, env_b) = ("01JENVIR00000000000000000A", "01JENVIR00000000000000000B");
        let volume = |(mut a, mut rt): (
            zattera_agent::proto::v1::Assignment,
            zattera_agent::proto::cluster::AssignmentRuntime,
        )| {
            a.app_id = a.meta.as_ref().unwrap().id.clone();
            rt.spec.as_mut().unwrap().volumes = vec![zattera_agent::proto::v1::VolumeMount {
                volume_name: "data".into(),
                mount_path: "/data".into(),
            }];
            (a, rt)
        };
        // The workload swaps /data/f between a file, a link to a host file
        // and a FIFO, as fast as it can.
        let swap = format!(
            "cd /data; echo kept > keep; while true; do echo inside > f; ln -sfn {HOST_SECRET}/secret.txt f; \
             rm -f f; mkfifo f; rm -f f; ln -sfn {HOST_SECRET} f; rm -f f; done"
        );
        cp.push_set(set_of(
            1,
            vec![
                volume(assignment("va", env_a, 184, &swap)),
                volume(assignment("vb", env_b, 185, IDLE)),
            ],
        ));
        agent.wait_for("both volume users running", |s| {
            ["va", "vb"].iter().all(|id| {
                s["assignments"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|r| r["id"] == *id && r["state"] == "HEALTHY")
            })
        });
        let dirs: Vec<String> = std::fs::read_dir(agent.data_dir().join("volumes"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(dirs.len(), 2, "one directory per environment: {dirs:?}");

        let mut api = agent.api_as(&cp, CONTROL_NODE_ID).await;
        // What each round met at `f`. The race must reach the link to the
        // host file (refused as an escape) and plain reads, or it proved
        // nothing; at least 300 rounds, more until both were seen.
        let mut met = std::collections::BTreeMap::<String, u32>::new();
        let secret: &[u8] = b"host secret";
        for round in 0.. {
            let seen = |k: &str| met.get(k).copied().unwrap_or(0);
            if round >= 300 && seen("read") > 0 && seen("escape") > 0 {
                break;
            }
            assert!(round < 3000, "the race never reached both states: {met:?}");
            let call = api.read_volume_file(AgentReadFileRequest {
                environment_id: env_a.into(),
                volume_name: "data".into(),
                path: "f".into(),
            });
            let (body, outcome) = tokio::time::timeout(Duration::from_secs(5), async {
                let mut body = Vec::new();
                let outcome = match call.await {
                    Err(status) => refusal(&status),
                    Ok(resp) => {
                        let mut s = resp.into_inner();
                        loop {
                            match s.message().await {
                                Ok(Some(chunk)) => body.extend(chunk.data),
                                Ok(None) => break "read".to_owned(),
                                Err(status) => break format!("stream {}", refusal(&status)),
                            }
                        }
                    }
                };
                (body, outcome)
            })
            .await
            .expect("a ReadVolumeFile call hung (a FIFO swapped in?)");
            assert!(
                !body.windows(secret.len()).any(|w| w == secret),
                "a host file was read through the volume ({outcome}): {:?}",
                String::from_utf8_lossy(&body)
            );
            *met.entry(outcome).or_default() += 1;

            let listed = tokio::time::timeout(
                Duration::from_secs(5),
                api.list_volume_files(AgentListFilesRequest {
                    environment_id: env_a.into(),
                    volume_name: "data".into(),
                    path: "f".into(),
                }),
            )
            .await
            .expect("a ListVolumeFiles call hung");
            let outcome = match listed {
                Ok(l) => {
                    let files = l.into_inner().files;
                    assert!(
                        !files.iter().any(|f| f.name.contains("secret")),
                        "a host directory was listed through the volume: {files:?}"
                    );
                    "list".to_owned()
                }
                Err(status) => format!("list {}", refusal(&status)),
            };
            *met.entry(outcome).or_default() += 1;
        }
        eprintln!("rounds met: {met:?}");
        let unexpected: Vec<_> = met
            .keys()
            .filter(|k| k.contains("other:") || k.starts_with("stream"))
            .collect();
        assert!(unexpected.is_empty(), "unexpected outcomes: {met:?}");

        // The volume is mounted by a running container: it stays.
        let err = api
            .remove_volume(AgentRemoveVolumeRequest {
                environment_id: env_a.into(),
                volume_name: "data".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
        let keep = agent
            .data_dir()
            .join("volumes")
            .join(format!("zt-{env_a}-data/_data/keep"));
        assert_eq!(std::fs::read_to_string(keep).unwrap(), "kept\n");
    })
    .await;
}

/// What a refused volume-file call met at the path, from its status.
fn refusal(status: &tonic::Status) -> String {
    let m = status.message();
    if m.contains("escapes the volume") {
        "escape".into()
    } else if m.contains("is not a regular file")
        || m.contains("is a directory")
        || m.contains("is not a directory")
    {
        "not a file".into()
    } else if m.contains("does not exist") {
        "absent".into()
    } else {
        format!("other: {:?} {m}", status.code())
    }
}

/// Issue 45.5, attack: a container has CAP_MKNOD, so it can plant a device
/// node in its volume, and browsing the volume made the agent, outside the
/// container's device cgroup, open it as host root (opening a watchdog
/// arms it; a terminal becomes the controlling one). The node is planted
/// here as /dev/null's twin, and an inotify watch on it sees every open:
/// the old code opened it for ReadVolumeFile and ListVolumeFiles, the new
/// one opens nothing that is not a regular file or a directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_node_planted_in_a_volume_is_never_opened() {
    on_rig("sec-mknod", |ctd, rig| async move {
        import(&ctd, &rig, "busybox-oci.tar").await;
        let (cp, agent) = controlled_agent(SECRET, &rig, &ctd, "ztsg", &[]).await;
        let env = "01JENVMKNOD000000000000000";
        let (mut a, mut rt) = assignment(
            "mk",
            env,
            248,
            &format!("cd /data; echo plain > plain; mknod node c 1 3; {IDLE}"),
        );
        a.app_id = "app-mk".into();
        rt.spec.as_mut().unwrap().volumes = vec![zattera_agent::proto::v1::VolumeMount {
            volume_name: "data".into(),
            mount_path: "/data".into(),
        }];
        cp.push_set(set_of(1, vec![(a, rt)]));
        agent.wait_for("mk running", |s| {
            row(s, "app-mk").is_some_and(|r| r["state"] == "HEALTHY")
        });
        let find = |name: &str| {
            let volumes = agent.data_dir().join("volumes");
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let found = std::fs::read_dir(&volumes)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path().join("_data").join(name))
                    .find(|p| p.symlink_metadata().is_ok());
                if let Some(p) = found {
                    return p;
                }
                assert!(
                    Instant::now() < deadline,
                    "no {name} in {}",
                    volumes.display()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        };
        let node = find("node");
        find("plain");
        let mut watch = inotify::Inotify::init().unwrap();
        watch
            .watches()
            .add(&node, inotify::WatchMask::OPEN)
            .unwrap();

        let mut api = agent.api_as(&cp, CONTROL_NODE_ID).await;
        let read = |path: &str| AgentReadFileRequest {
            environment_id: env.into(),
            volume_name: "data".into(),
            path: path.into(),
        };
        let refused = api.read_volume_file(read("node")).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        let listed = api
            .list_volume_files(AgentListFilesRequest {
                environment_id: env.into(),
                volume_name: "data".into(),
                path: "node".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(listed.code(), tonic::Code::InvalidArgument, "{listed:?}");
        // A regular file still reads.
        let mut body = Vec::new();
        let mut s = api
            .read_volume_file(read("plain"))
            .await
            .unwrap()
            .into_inner();
        while let Some(chunk) = s.message().await.unwrap() {
            body.extend(chunk.data);
        }
        assert_eq!(body, b"plain\n");

        let mut buf = [0u8; 4096];
        let opens = match watch.read_events(&mut buf) {
            Ok(events) => events.count(),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
            Err(e) => panic!("inotify: {e}"),
        };
        assert_eq!(
            opens, 0,
            "the agent opened the planted device node {opens} times"
        );
    })
    .await;
}

/// Issue 56.1 and 56.8, attack: with the mesh, every published port is on
/// the node's mesh IP, so a container of project A read project B's port
/// (one with no host port, published for the VIP proxies) at that address;
/// it reached other nodes' mesh addresses, cloud metadata (169.254.169.254)
/// and the node's underlay. Played on one node: a dummy interface holds the
/// mesh IP, and an "outside" namespace answers another node's mesh IP, the
/// metadata address, an address in the operator's deny list and, as the
/// positive control, an ordinary address. Only the node's own processes
/// (the VIP proxies) may dial mesh addresses.
#[tokio::test]
async fn no_container_reaches_another_tenant_through_mesh_addresses_or_metadata() {
    on_rig("sec-mesh", |ctd, rig| async move {
        import(&ctd, &rig, "busybox-oci.tar").await;
        let netns = TestNetns::new("secm");
        let outside = TestNetns::new("seco");
        // The node's mesh IP, and a way out to everything else.
        // (On loopback: this kernel may have no dummy interfaces.)
        netns.run(&["ip", "addr", "add", "10.90.1.1/32", "dev", "lo"]);
        let veth = format!("ztsmo{}", std::process::id() % 1000);
        netns.run(&["ip", "link", "add", &veth, "type", "veth", "peer", "name", "ztsmx"]);
        netns.run(&["ip", "link", "set", "ztsmx", "netns", &outside.name]);
        netns.run(&["ip", "addr", "add", "192.0.2.1/30", "dev", &veth]);
        netns.run(&["ip", "link", "set", &veth, "up"]);
        outside.run(&["ip", "addr", "add", "192.0.2.2/30", "dev", "ztsmx"]);
        outside.run(&["ip", "link", "set", "ztsmx", "up"]);
        let far = [
            ("another node's mesh IP", "10.90.2.1"),
            ("cloud metadata", "169.254.169.254"),
            ("the operator's deny list", "198.18.0.1"),
            ("an ordinary address", "203.0.113.1"),
        ];
        for (_, ip) in far {
            outside.run(&["ip", "addr", "add", &format!("{ip}/32"), "dev", "ztsmx"]);
            netns.run(&["ip", "route", "add", &format!("{ip}/32"), "via", "192.0.2.2"]);
        }
        outside.run(&["ip", "route", "add", "default", "via", "192.0.2.1"]);
        let mut listener = KillOnDrop(
            outside
                .command("python3")
                .args([
                    "-c",
                    "import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                     s.bind(('0.0.0.0', 7000)); s.listen(16); print('ready', flush=True)\n\
                     while True:\n    c, peer = s.accept(); c.sendall(b'outside-secret\\n'); c.close()\n",
                ])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let ready = BufReader::new(listener.0.stdout.take().unwrap()).lines().next();
        assert_eq!(ready.unwrap().unwrap(), "ready");

        let mut agent = AgentProc::new(&rig.socket, ctd.namespace().as_str(), "ztsm", "210-211");
        agent.netns = Some(netns.path());
        agent.run_args = ["--host-ip", "10.90.1.1", "--egress-deny", "198.18.0.0/15"]
            .map(str::to_owned)
            .to_vec();
        agent.write_manifest("attacker.toml", &manifest("attacker", "a", support::TEST_IMAGE, IDLE, ""));
        agent.write_manifest(
            "db.toml",
            &manifest(
                "db",
                "b",
                support::TEST_IMAGE,
                "httpd -f -p 80 -h /var/www",
                "[[env.b.ports]]\nname = \"http\"\ncontainer_port = 80\nprotocol = \"http\"\n",
            )
            .replace("project = \"p\"", "project = \"other\""),
        );
        agent.start();
        let status = agent.wait_for("both up", |s| {
            ["attacker", "db"]
                .iter()
                .all(|a| row(s, a).is_some_and(|r| r["state"] == "HEALTHY"))
        });
        let attacker = container_of(&status, "attacker");
        let port = row(&status, "db").unwrap()["ports"]["http"].as_u64().unwrap();
        let dial = |ip: String, port: u64| {
            let (ctd, attacker) = (&ctd, &attacker);
            async move {
                let request = "printf 'GET / HTTP/1.0\\r\\n\\r\\n'";
                sh(ctd, attacker, &format!("{request} | nc -w 3 {ip} {port}; echo rc=$?"))
                    .await
                    .1
            }
        };
        // The positive controls: the host itself reaches db's port on the
        // mesh IP (as the VIP proxy does), and the container reaches an
        // ordinary address outside.
        let from_host = netns.run(&[
            "python3",
            "-c",
            &format!(
                "import socket; s = socket.create_connection(('10.90.1.1', {port}), 5); \
                 s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); print(s.recv(4096))"
            ),
        ]);
        assert!(from_host.contains("200 OK"), "{from_host}");
        let ordinary = dial("203.0.113.1".into(), 7000).await;
        assert!(ordinary.contains("outside-secret"), "the path out works: {ordinary}");

        // The attacks.
        let tenant = dial("10.90.1.1".into(), port).await;
        assert!(
            !tenant.contains("HTTP/1"),
            "another tenant's port answered through the mesh IP: {tenant}"
        );
        for (what, ip) in &far[..3] {
            let got = dial((*ip).to_owned(), 7000).await;
            assert!(!got.contains("outside-secret"), "{what} reached from a container: {got}");
        }
    })
    .await;
}
