//! Published host ports against host processes (issue 18): a port the agent
//! publishes is held by a socket of its own, so the kernel never hands it to
//! anyone else, and a host process's local connections never reach a
//! container. Each test runs the real agent binary inside a network
//! namespace of its own, so its loopback, port ranges, bridges and nft table
//! are shared with nothing else on the machine.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::time::{Duration, Instant};

use support::agent::{AgentProc, TestNetns, row};
use support::{TEST_IMAGE, on_rig_with_image};
use zattera_agent::runtime::containers::{self, TaskState};

/// A host process that, for `argv[1]` seconds, binds port 0 on loopback,
/// connects to itself and checks that its own listener answered. Prints one
/// JSON line: iterations, captures (answers that came from elsewhere) and
/// the ports they happened on.
const BINDER: &str = r#"
import json, socket, struct, sys, time
end = time.time() + float(sys.argv[1])
linger = struct.pack("ii", 1, 0)  # close with a reset: no TIME_WAIT eats the small range
stats = {"iterations": 0, "captured": 0, "busy": 0, "errors": 0, "samples": []}
while time.time() < end:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    try:
        srv.bind(("127.0.0.1", 0))
    except OSError:
        stats["busy"] += 1
        srv.close()
        time.sleep(0.005)
        continue
    srv.listen(1)
    srv.settimeout(1)
    port = srv.getsockname()[1]
    cli = socket.socket()
    cli.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    cli.settimeout(1)
    got = b"host"
    try:
        cli.connect(("127.0.0.1", port))
        cli.sendall(b"GET / HTTP/1.0\r\n\r\n")
        try:
            conn, _ = srv.accept()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
            conn.sendall(b"host")
            conn.close()
        except OSError:
            pass
        got = cli.recv(64)
    except OSError:
        stats["errors"] += 1  # e.g. no source port left: not an answer from anyone
    if got != b"host":
        stats["captured"] += 1
        if len(stats["samples"]) < 5:
            stats["samples"].append([port, got[:40].decode(errors="replace")])
    stats["iterations"] += 1
    cli.close()
    srv.close()
print(json.dumps(stats), flush=True)
"#;

/// Listens on 127.0.0.1:`argv[1]` and answers `host` to every connection;
/// prints `ready` once bound. SO_REUSEADDR, as servers set it: its closed
/// connections' TIME_WAIT then does not keep the port from the agent.
const SQUATTER: &str = r#"
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(16)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.recv(4096)  # the request first: unread data would make close() a reset
    c.sendall(b"host")
    c.close()
"#;

/// What a TCP connection to 127.0.0.1:`port` inside `netns` reads first
/// (or the error).
fn first_bytes(netns: &TestNetns, port: u16) -> String {
    let script = format!(
        "import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n\
         s.sendall(b'GET /whoami.txt HTTP/1.0\\r\\n\\r\\n')\n\
         print(b''.join(iter(lambda: s.recv(4096), b'')).decode(errors='replace'))"
    );
    let out = netns
        .command("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// Whether a host process in `netns` can bind 127.0.0.1:`port` (TCP) right
/// now. A port the agent holds cannot be bound (its socket is bound, not
/// listening, so no /proc/net/tcp line shows it).
fn port_is_free(netns: &TestNetns, port: u16) -> bool {
    let script = format!("import socket\nsocket.socket().bind(('127.0.0.1', {port}))");
    netns
        .command("python3")
        .args(["-c", &script])
        .status()
        .unwrap()
        .success()
}

fn web(app: &str, replicas: u32, host_port: Option<u16>, round: u32) -> String {
    let fixed = host_port.map_or(String::new(), |p| format!("host_port = {p}\n"));
    format!(
        "[app]\nname = \"{app}\"\nproject = \"p\"\n[build]\ntype = \"image\"\nimage = \"{TEST_IMAGE}\"\n\
         [deploy.healthcheck]\ntype = \"tcp\"\ninterval = \"1s\"\n\
         [env.prod]\nreplicas = {replicas}\nstop_grace = \"1s\"\n\
         command = \"echo container $HOSTNAME > /var/www/whoami.txt; exec httpd -f -p 80 -h /var/www\"\n\
         [env.prod.variables]\nROUND = \"{round}\"\n\
         [[env.prod.ports]]\nname = \"http\"\ncontainer_port = 80\nprotocol = \"http\"\n{fixed}"
    )
}

fn host_ports(status: &serde_json::Value) -> BTreeSet<u64> {
    status["assignments"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["ports"]["http"].as_u64())
        .collect()
}

#[tokio::test]
async fn host_processes_binding_port_zero_never_reach_a_container() {
    on_rig_with_image("ports-capture", |ctd, rig| async move {
        // A kernel ephemeral range of 40 ports, and the agent told to take
        // its ports from the very same range: only the held sockets keep
        // the two apart.
        let netns = TestNetns::new("pcap");
        netns.sysctl("net/ipv4/ip_local_port_range", "45000 45039");
        let mut agent = AgentProc::new(&rig.socket, ctd.namespace().as_str(), "ztpa", "170-171");
        agent.netns = Some(netns.path());
        agent.run_args = vec!["--host-port-range".into(), "45000-45039".into()];
        agent.write_manifest("web.toml", &web("web", 3, None, 0));
        agent.start();
        agent.wait_all(3, "HEALTHY");
        assert!(
            agent
                .log()
                .contains("overlaps the kernel's ephemeral port range"),
            "the overlap is warned about"
        );

        let mut binder = support::agent::KillOnDrop(
            netns
                .command("python3")
                .args(["-c", BINDER, "24"])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        // Meanwhile every replica is replaced every 2 s: new ports published,
        // old ones unpublished.
        let mut seen = BTreeSet::new();
        let end = Instant::now() + Duration::from_secs(22);
        let mut round = 0;
        let mut before_last = BTreeSet::new();
        while Instant::now() < end {
            before_last = support::agent::rows_by_id(&agent.status().unwrap(), "container_id")
                .into_values()
                .collect();
            round += 1;
            agent.write_manifest("web.toml", &web("web", 3, None, round));
            let step = Instant::now() + Duration::from_secs(2);
            while Instant::now() < step {
                if let Some(s) = agent.status() {
                    seen.extend(host_ports(&s));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        let mut line = String::new();
        BufReader::new(binder.0.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        binder.0.wait().unwrap();
        let stats: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(
            stats["captured"], 0,
            "a host process's connection reached a container: {stats}"
        );
        assert!(
            seen.len() >= 15,
            "published ports churned through the range: {seen:?}"
        );
        assert!(
            stats["iterations"].as_u64().unwrap() >= 500,
            "the host process kept binding: {stats}"
        );
        // The agent's ports are really published: once the last round is up,
        // each answers from its container.
        let status = agent.wait_for("the last round HEALTHY", |s| {
            let rows = s["assignments"].as_array().cloned().unwrap_or_default();
            rows.len() == 3
                && rows.iter().all(|r| {
                    r["state"] == "HEALTHY"
                        && !before_last.contains(r["container_id"].as_str().unwrap_or_default())
                })
        });
        for port in host_ports(&status) {
            let got = first_bytes(&netns, u16::try_from(port).unwrap());
            assert!(
                got.contains("container "),
                "port {port}: {got:?}\nstatus {status:#}\nrules {}\nlog {}",
                netns.run(&["nft", "list", "ruleset"]),
                agent.log()
            );
        }
    })
    .await;
}

#[tokio::test]
async fn ports_are_held_again_after_a_restart_and_a_stolen_one_fails_alone() {
    on_rig_with_image("ports-restart", |ctd, rig| async move {
        let netns = TestNetns::new("prst");
        let mut agent = AgentProc::new(&rig.socket, ctd.namespace().as_str(), "ztpb", "172-173");
        agent.netns = Some(netns.path());
        agent.write_manifest("web.toml", &web("web", 1, Some(18098), 0));
        agent.write_manifest("other.toml", &web("other", 1, None, 0));
        agent.start();
        agent.wait_all(2, "HEALTHY");
        let status = agent.status().unwrap();
        let other = row(&status, "other").unwrap().clone();
        let other_port = u16::try_from(other["ports"]["http"].as_u64().unwrap()).unwrap();
        assert!(
            zattera_netns::PortRange::DEFAULT.contains(other_port),
            "ephemeral ports come from the default range: {other_port}"
        );
        assert!(!port_is_free(&netns, 18098), "the fixed port is held");
        assert!(
            !port_is_free(&netns, other_port),
            "the ephemeral port is held"
        );
        let other_cid = other["container_id"].as_str().unwrap().to_owned();
        let TaskState::Running { pid: other_task } =
            containers::task_state(&ctd, &other_cid).await.unwrap()
        else {
            panic!("other is running");
        };

        // While the agent is down, a host process takes the fixed port.
        agent.kill9();
        assert!(
            port_is_free(&netns, 18098) && port_is_free(&netns, other_port),
            "they were held by the agent"
        );
        let mut squatter = support::agent::KillOnDrop(
            netns
                .command("python3")
                .args(["-c", SQUATTER, "18098"])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let mut ready = String::new();
        BufReader::new(squatter.0.stdout.take().unwrap())
            .read_line(&mut ready)
            .unwrap();
        assert_eq!(ready.trim(), "ready");

        agent.start();
        let status = agent.wait_for("web FAILED naming the holder, other HEALTHY", |s| {
            let (Some(w), Some(o)) = (row(s, "web"), row(s, "other")) else {
                return false;
            };
            w["state"] == "FAILED" && o["state"] == "HEALTHY"
        });
        let message = row(&status, "web").unwrap()["message"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(
            message.contains("127.0.0.1:18098/tcp")
                && message.contains(&format!("pid {}", squatter.0.id()))
                && message.contains("python3"),
            "{message}"
        );
        let other = row(&status, "other").unwrap();
        assert_eq!(
            other["container_id"],
            other_cid.as_str(),
            "other was adopted"
        );
        assert_eq!(
            containers::task_state(&ctd, &other_cid).await.unwrap(),
            TaskState::Running { pid: other_task },
            "other's task was not restarted"
        );
        assert!(
            !port_is_free(&netns, other_port),
            "held again after the restart"
        );
        // The stolen port is no longer DNATed: its holder gets its own connections.
        assert_eq!(first_bytes(&netns, 18098).trim(), "host");
        assert!(first_bytes(&netns, other_port).contains("container "));

        // Once the holder lets go, web comes back on its port (not parked).
        drop(squatter);
        agent.wait_all(2, "HEALTHY");
        assert!(!port_is_free(&netns, 18098), "held by the agent again");
        assert!(first_bytes(&netns, 18098).contains("container "));
    })
    .await;
}
