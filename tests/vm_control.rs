//! The test control plane, served to the VM lane's cluster case (issue
//! 43.2f): the guests are real Debian machines driven by
//! `scripts/vm/lane.py`, and the control plane they join is the one the
//! in-namespace cluster tests use (`support/mesh_cluster.rs`), with two
//! control hosts in namespaces of their own on the lane's bridge.
//!
//! Not a test by itself, so ignored; the lane runs it as
//!
//!     ZATTERA_VM_NS=<lane ns> ZATTERA_VM_BRIDGE=<bridge> \
//!       cargo test --test vm_control -- --ignored --exact serve_the_vm_lane --nocapture
//!
//! and talks to it in JSON lines: one request a line on stdin, one answer a
//! line on stdout prefixed with `@ ` (libtest prints lines of its own).
//! It ends at the end of stdin, removing what it made.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "support/control/mod.rs"]
mod control_plane;
#[path = "support/mesh_cluster.rs"]
mod mesh_cluster;
mod support;

use std::net::Ipv4Addr;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt as _;

use control_plane::Record;
use mesh_cluster::{Cluster, TestNet};
use zattera_agent::proto::cluster::{Endpoint, InternalPort, InternalService, RouteSnapshot};
use zattera_agent::proto::v1::{InstanceState, PortSpec, Protocol};

const SECRET: &str = "vm-lane-secret";
/// The control hosts' addresses on the lane's bridge (guests are .10 up).
const CONTROLS: [(&str, &str, u8, u8); 2] = [("ctl-1", "c1", 201, 1), ("ctl-2", "c2", 202, 2)];

#[test]
#[ignore = "served to scripts/vm/lane.py's cluster case"]
fn serve_the_vm_lane() {
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} is not set"));
    let (ns, bridge) = (env("ZATTERA_VM_NS"), env("ZATTERA_VM_BRIDGE"));
    let net_prefix = std::env::var("ZATTERA_VM_NET").unwrap_or_else(|_| "10.254.250".into());
    let underlay = |n: u8| -> Ipv4Addr { format!("{net_prefix}.{n}").parse().unwrap() };
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let bin = std::path::PathBuf::from(support::agent::run_bin());
            // Named under the lane's prefix: its cleanup finds them.
            let mut net = TestNet::on_bridge("ztvm", &ns, &bridge);
            let mut cluster = Cluster::new(SECRET, &bin);
            for (i, (id, name, host, mesh)) in CONTROLS.iter().enumerate() {
                let host_ns = net.add_host(name, underlay(*host));
                cluster
                    .add_control(
                        id,
                        &host_ns,
                        underlay(*host),
                        Ipv4Addr::new(10, 90, 0, *mesh),
                        &format!("ztvmc{}", i + 1),
                        i == 0,
                    )
                    .await;
            }
            answer(&json!({
                "ready": true,
                "control": format!("{}:{}", underlay(CONTROLS[0].2), mesh_cluster::API_PORT),
                "token": cluster.ca.token(SECRET),
            }));
            let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let reply = match serde_json::from_str::<Value>(&line) {
                    Ok(req) => handle(&cluster, &req)
                        .await
                        .unwrap_or_else(|e| json!({ "error": e })),
                    Err(e) => json!({ "error": format!("not JSON: {e}") }),
                };
                answer(&reply);
            }
            drop(cluster);
            drop(net);
        });
}

fn answer(v: &Value) {
    println!("@ {v}");
}

/// One request: `op` names it; see the lane's `Control` for the callers.
async fn handle(cluster: &Cluster, req: &Value) -> Result<Value, String> {
    let s = |k: &str| req[k].as_str().unwrap_or_default().to_owned();
    let n = |k: &str, or: usize| {
        req[k]
            .as_u64()
            .and_then(|v| usize::try_from(v).ok())
            .unwrap_or(or)
    };
    let timeout = Duration::from_secs(req["timeout"].as_u64().unwrap_or(120));
    match req["op"].as_str().unwrap_or_default() {
        // `count` workers joined, each with a sync stream on the leader.
        "workers" => {
            let count = n("count", 1);
            poll(cluster, timeout, &format!("{count} workers with a sync stream"), |r| {
                let workers: Vec<_> = cluster.members().into_iter().filter(|m| !m.is_control).collect();
                let synced = workers.iter().all(|m| r.session_host_of(&m.node_id).is_some());
                (workers.len() >= count && synced).then(|| {
                    json!({ "workers": workers.iter().map(|m| json!({
                        "node_id": m.node_id, "mesh_ip": m.mesh_ip.to_string(), "endpoint": m.endpoint,
                    })).collect::<Vec<_>>() })
                })
            })
            .await
        }
        // The number of sync streams `node` opened on `host`, once more
        // than `after`.
        "sessions" => {
            let (node, host) = (s("node"), s("host"));
            let after = n("after", 0);
            poll(
                cluster,
                timeout,
                &format!("a sync stream of {node} on {host}"),
                |r| {
                    let n = r
                        .sessions
                        .iter()
                        .filter(|s| s.host == host && s.node == node)
                        .count();
                    (n > after).then(|| json!({ "sessions": n }))
                },
            )
            .await
        }
        "frames" => Ok(json!({ "frames": cluster.with(|r| r.frames.len()) })),
        // The newest report of `assignment` in `state` (HEALTHY also
        // answers RUNNING) among frames past `since`, from `host` if named.
        "state" => {
            let (assignment, host) = (s("assignment"), s("host"));
            let since = n("since", 0);
            let want = InstanceState::from_str_name(&format!("INSTANCE_STATE_{}", s("state")))
                .ok_or("unknown state")? as i32;
            let healthy = InstanceState::Healthy as i32;
            poll(cluster, timeout, &format!("{assignment} {}", s("state")), |r| {
                r.frames.iter().skip(since).rev().find_map(|(session, f)| {
                    let from = &r.sessions[*session].host;
                    if !host.is_empty() && *from != host {
                        return None;
                    }
                    let Some(zattera_agent::proto::cluster::agent_message::Body::Status(b)) = &f.body else {
                        return None;
                    };
                    let o = b.observed.get(&assignment)?;
                    (o.state == want || (want == InstanceState::Running as i32 && o.state == healthy))
                        .then(|| json!({
                            "host": from, "state": o.state, "container_id": o.container_id,
                            "mesh_port_bindings": o.mesh_port_bindings, "message": o.message,
                        }))
                })
            })
            .await
        }
        "push" => {
            let items = req["assignments"].as_array().ok_or("no assignments")?;
            let set = control_plane::set_of(
                req["version"].as_u64().unwrap_or(1),
                items.iter().map(assignment_of).collect(),
            );
            cluster.push_set_to(&s("node"), set);
            Ok(json!({}))
        }
        // A VIP for `fqdn` in `env` whose port `port` goes to `endpoint`
        // (assignment `assignment` on `node`).
        "route" => {
            cluster.push_routes(RouteSnapshot {
                version: req["version"].as_u64().unwrap_or(1),
                internal_services: vec![InternalService {
                    fqdn: s("fqdn"),
                    project_id: "proj".into(),
                    environment_id: s("env"),
                    vip: s("vip"),
                    ports: vec![InternalPort {
                        name: "http".into(),
                        port: u32::try_from(req["port"].as_u64().unwrap_or(80)).unwrap_or(80),
                        protocol: "tcp".into(),
                        endpoints: vec![Endpoint {
                            assignment_id: s("assignment"),
                            node_id: s("node"),
                            addr: s("endpoint"),
                            healthy: true,
                            local_hint_node_id_matches: false,
                        }],
                    }],
                }],
                ..RouteSnapshot::default()
            });
            Ok(json!({}))
        }
        "move_leader" => {
            cluster.move_leader(&s("node"));
            Ok(json!({}))
        }
        op => Err(format!("unknown op {op:?}")),
    }
}

/// `{id, env, slot, command, app?, vars?, http_port?}` as an assignment.
fn assignment_of(
    v: &Value,
) -> (
    zattera_agent::proto::v1::Assignment,
    zattera_agent::proto::cluster::AssignmentRuntime,
) {
    let s = |k: &str| v[k].as_str().unwrap_or_default();
    let slot = u8::try_from(v["slot"].as_u64().unwrap_or(50)).unwrap_or(50);
    let (mut a, mut rt) = control_plane::assignment(s("id"), s("env"), slot, s("command"));
    if !s("app").is_empty() {
        a.app_id = s("app").into();
    }
    if let Some(vars) = v["vars"].as_object() {
        rt.env = vars
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
            .collect();
    }
    if let Some(port) = v["http_port"].as_u64() {
        rt.spec.as_mut().unwrap().ports = vec![PortSpec {
            name: "http".into(),
            container_port: u32::try_from(port).unwrap_or(80),
            protocol: Protocol::Http as i32,
            public_l4_port: 0,
        }];
    }
    (a, rt)
}

/// Polls what control saw until `pred` answers, for up to `timeout`.
async fn poll(
    cluster: &Cluster,
    timeout: Duration,
    what: &str,
    pred: impl Fn(&Record) -> Option<Value>,
) -> Result<Value, String> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = cluster.with(&pred) {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= deadline {
            let seen = cluster.with(|r| {
                format!(
                    "{} joins, sessions {:?}, {} frames",
                    r.joins.len(),
                    r.sessions,
                    r.frames.len()
                )
            });
            return Err(format!("not {what} within {timeout:?}; control saw {seen}"));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
