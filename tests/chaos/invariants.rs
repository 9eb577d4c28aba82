//! The promises the agent keeps after any fault, checked by one function
//! against fresh listings of containerd, the kernel, DNS and the process
//! table. Each violation names the object it is about.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::time::Duration;

use containerd_client::services::v1::{
    ListContainersRequest, ListStatusesRequest, ListTasksRequest,
};
use zattera_agent::runtime::Containerd;
use zattera_netns::{NetNode, Subnet, inventory};

use crate::model::Desired;

const ASSIGNMENT_ID: &str = "dev.zattera/assignment-id";
const MANAGED: &str = "dev.zattera/managed";

/// One status row, as `status --json` prints it.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: String,
    pub app: String,
    pub environment: String,
    pub state: String,
    pub container_id: String,
    pub ip: String,
    pub ports: BTreeMap<String, u16>,
    pub restarts: u64,
    pub message: String,
}

pub fn rows(status: &serde_json::Value) -> Vec<Row> {
    let text = |r: &serde_json::Value, k: &str| r[k].as_str().unwrap_or_default().to_owned();
    status["assignments"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|r| Row {
            id: text(r, "id"),
            app: text(r, "app"),
            environment: text(r, "environment"),
            state: text(r, "state"),
            container_id: text(r, "container_id"),
            ip: text(r, "ip"),
            ports: r["ports"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, v)| Some((k.clone(), u16::try_from(v.as_u64()?).ok()?)))
                        .collect()
                })
                .unwrap_or_default(),
            restarts: r["restarts"].as_u64().unwrap_or(0),
            message: text(r, "message"),
        })
        .collect()
}

/// Whether the rows are exactly the desired instances, all up.
pub fn converged(desired: &Desired, rows: &[Row]) -> bool {
    let mut per_app: BTreeMap<&str, u32> = BTreeMap::new();
    for r in rows {
        if !matches!(r.state.as_str(), "HEALTHY" | "RUNNING")
            || r.container_id.is_empty()
            || desired.stale.contains(&r.container_id)
        {
            return false;
        }
        *per_app.entry(r.app.as_str()).or_default() += 1;
    }
    let want: BTreeMap<&str, u32> = desired
        .apps
        .iter()
        .filter(|(_, a)| a.replicas > 0)
        .map(|(n, a)| (n.as_str(), a.replicas))
        .collect();
    per_app == want
}

/// What the checks need to know beyond the desired set.
#[derive(Debug)]
pub struct World<'a> {
    pub ctd: &'a Containerd,
    pub net: &'a NetNode,
    pub table: String,
    pub data_dir: PathBuf,
    /// A container the agent did not make: it must stay exactly as it is.
    pub foreign: (&'a str, u32),
    /// The counter's container and task pid since the start.
    pub counter: (&'a str, u32),
}

/// What a lab watches on its node besides containerd and the network.
#[derive(Debug)]
pub struct Watched {
    /// The agent's nft table.
    pub table: String,
    /// The foreign container and its task pid.
    pub foreign: (String, u32),
    /// The counter's container and task pid (empty until it first runs).
    pub counter: (String, u32),
}

impl<'a> World<'a> {
    /// The world of a lab's node, whose agent keeps its state in `data_dir`.
    pub fn of(
        ctd: &'a Containerd,
        net: &'a NetNode,
        watched: &'a Watched,
        data_dir: PathBuf,
    ) -> Self {
        Self {
            ctd,
            net,
            table: watched.table.clone(),
            data_dir,
            foreign: (&watched.foreign.0, watched.foreign.1),
            counter: (&watched.counter.0, watched.counter.1),
        }
    }
}

/// Every invariant of the standalone node, once. An empty result means
/// all hold.
pub async fn check(world: &World<'_>, desired: &Desired, rows: &[Row]) -> Vec<String> {
    let mut v = Vec::new();
    instances(desired, rows, &mut v);
    dns(world, desired, rows, &mut v).await;
    v.extend(check_node(world, rows).await);
    v
}

/// What holds whatever the source of assignments: containers, processes,
/// the kernel's objects, the firewall, the counter's log.
pub async fn check_node(world: &World<'_>, rows: &[Row]) -> Vec<String> {
    let mut v = Vec::new();
    let mut ids = BTreeSet::new();
    for r in rows {
        if !ids.insert(&r.id) {
            v.push(format!("assignment {}: two status rows", r.id));
        }
    }
    containers(world, rows, &mut v).await;
    processes(world, &mut v).await;
    kernel(world, rows, &mut v).await;
    firewall(world, rows, &mut v);
    counter_log(world, rows, &mut v);
    v
}

fn instances(desired: &Desired, rows: &[Row], v: &mut Vec<String>) {
    if !converged(desired, rows) {
        let have: Vec<String> = rows
            .iter()
            .map(|r| format!("{} {} {}", r.id, r.state, r.message))
            .collect();
        v.push(format!(
            "instances: want {} across {:?}, have {have:?}",
            desired.instances(),
            desired
                .apps
                .iter()
                .map(|(n, a)| (n, a.replicas))
                .collect::<Vec<_>>()
        ));
    }
}

/// Exactly one container per assignment, the one status names; nothing of
/// ours for an assignment that is not wanted; the foreign container as it
/// was.
async fn containers(world: &World<'_>, rows: &[Row], v: &mut Vec<String>) {
    let ctd = world.ctd;
    let listed = match ctd
        .containers()
        .list(ctd.request(ListContainersRequest { filters: vec![] }))
        .await
    {
        Ok(r) => r.into_inner().containers,
        Err(e) => return v.push(format!("containerd: list containers: {e}")),
    };
    let mut by_assignment: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut foreign_seen = false;
    for c in &listed {
        if c.id == world.foreign.0 {
            foreign_seen = true;
            if !c.labels.is_empty() {
                v.push(format!(
                    "foreign container {}: labels now {:?}",
                    c.id, c.labels
                ));
            }
            continue;
        }
        if c.labels.get(MANAGED).map(String::as_str) != Some("true") {
            v.push(format!(
                "container {}: neither ours nor the foreign one",
                c.id
            ));
            continue;
        }
        let aid = c.labels.get(ASSIGNMENT_ID).cloned().unwrap_or_default();
        by_assignment.entry(aid).or_default().push(c.id.clone());
    }
    if !foreign_seen {
        v.push(format!("foreign container {}: gone", world.foreign.0));
    }
    let wanted: BTreeMap<&str, &str> = rows
        .iter()
        .map(|r| (r.id.as_str(), r.container_id.as_str()))
        .collect();
    for (aid, cids) in &by_assignment {
        match wanted.get(aid.as_str()) {
            None => v.push(format!(
                "assignment {aid}: containers {cids:?} but not wanted"
            )),
            Some(want) if cids.len() != 1 || cids[0] != *want => v.push(format!(
                "assignment {aid}: containers {cids:?}, status says {want}"
            )),
            Some(_) => {}
        }
    }
    for (aid, cid) in &wanted {
        if !by_assignment.contains_key(*aid) {
            v.push(format!(
                "assignment {aid}: status names {cid}, containerd has none"
            ));
        }
    }
    // A pull that failed (the full disk) must not leave an ingest holding space.
    if let Ok(s) = ctd
        .content()
        .list_statuses(ctd.request(ListStatusesRequest { filters: vec![] }))
        .await
    {
        for ingest in s.into_inner().statuses {
            v.push(format!("content: partial ingest {} left", ingest.r#ref));
        }
    }
}

/// Tasks, their runc shims and our log shims, from containerd and /proc:
/// no shim or log shim outlives its task.
async fn processes(world: &World<'_>, v: &mut Vec<String>) {
    let ctd = world.ctd;
    let tasks = match ctd
        .tasks()
        .list(ctd.request(ListTasksRequest {
            filter: String::new(),
        }))
        .await
    {
        Ok(r) => r.into_inner().tasks,
        Err(e) => return v.push(format!("containerd: list tasks: {e}")),
    };
    // Status 2 is RUNNING in containerd's task API.
    let all: BTreeSet<String> = tasks.iter().map(|t| t.id.clone()).collect();
    let running: BTreeSet<String> = tasks
        .iter()
        .filter(|t| t.status == 2)
        .map(|t| t.id.clone())
        .collect();
    match running.iter().find(|id| **id == world.foreign.0) {
        Some(_) => {
            let pid = tasks
                .iter()
                .find(|t| t.id == world.foreign.0)
                .map(|t| t.pid);
            if pid != Some(world.foreign.1) {
                v.push(format!(
                    "foreign task {}: pid {pid:?}, was {}",
                    world.foreign.0, world.foreign.1
                ));
            }
        }
        None => v.push(format!("foreign task {}: not running", world.foreign.0)),
    }
    let counter_pid = tasks
        .iter()
        .find(|t| t.id == world.counter.0)
        .map(|t| t.pid);
    if counter_pid != Some(world.counter.1) {
        v.push(format!(
            "counter task {}: pid {counter_pid:?}, was {} (restarted)",
            world.counter.0, world.counter.1
        ));
    }
    let ns = ctd.namespace().to_string();
    let logs = world.data_dir.join("logs");
    let (shims, log_shims, parents) = shim_processes(&ns, &logs);
    // A shim may serve a group of tasks (its -id is the first of them, which
    // may be gone): it must be the parent of a running task of ours, or
    // still have the task it was started for.
    let served: BTreeSet<u32> = tasks
        .iter()
        .filter(|t| t.status == 2)
        .filter_map(|t| parents.get(&t.pid).copied())
        .collect();
    for (id, pid) in &shims {
        if !all.contains(id) && !served.contains(pid) {
            v.push(format!("runc shim pid {pid} of {id}: serves no task"));
        }
    }
    let shim_pids: BTreeSet<u32> = shims.values().copied().collect();
    for t in tasks.iter().filter(|t| t.status == 2) {
        if t.id != world.foreign.0 && !parents.get(&t.pid).is_some_and(|p| shim_pids.contains(p)) {
            v.push(format!(
                "task {}: running without a shim of this namespace",
                t.id
            ));
        }
    }
    for (id, pid) in &log_shims {
        if !all.contains(id) {
            v.push(format!("log shim pid {pid} of {id}: its task is gone"));
        }
    }
    // And the other way (which also proves the listing above finds them):
    // a running task of ours writes through its log shim.
    for id in running.iter().filter(|id| **id != world.foreign.0) {
        if !log_shims.contains_key(id) {
            v.push(format!("task {id}: running without its log shim"));
        }
    }
}

/// container id → pid of every `containerd-shim-runc-v2 -namespace <ns> -id
/// <id>`, of every log shim writing under `logs`, and every process's
/// parent (pid → ppid).
fn shim_processes(
    ns: &str,
    logs: &Path,
) -> (
    BTreeMap<String, u32>,
    BTreeMap<String, u32>,
    BTreeMap<u32, u32>,
) {
    let mut shims = BTreeMap::new();
    let mut log_shims = BTreeMap::new();
    let mut parents = BTreeMap::new();
    for p in crate::support::processes() {
        let pid = u32::try_from(p.pid).unwrap_or(0);
        parents.insert(pid, u32::try_from(p.ppid).unwrap_or(0));
        if p.is_runc_shim() && p.flag("-namespace") == Some(ns) {
            if let Some(id) = p.flag("-id") {
                shims.insert(id.to_owned(), pid);
            }
        } else if let Some(shim) = zattera_agent::logs::shim::invoked_as_shim(&p.argv)
            && shim.log_path.starts_with(logs)
        {
            let id = shim
                .log_path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default();
            log_shims.insert(id, pid);
        }
    }
    (shims, log_shims, parents)
}

/// Namespace files, veths and bridges against the rows: `zattera-netns gc`'s
/// own plan finds nothing, one attachment per instance at its status IP.
async fn kernel(world: &World<'_>, rows: &[Row], v: &mut Vec<String>) {
    let inv = match inventory::read(world.net).await {
        Ok(i) => i,
        Err(e) => return v.push(format!("kernel: inventory: {e}")),
    };
    let live: BTreeSet<String> = rows.iter().map(|r| r.container_id.clone()).collect();
    let plan = inventory::plan(&inv, Some(&live));
    if !plan.is_empty() {
        v.push(format!("gc would collect: {plan:?}"));
    }
    let attached: BTreeMap<&str, Option<Ipv4Addr>> = inv
        .netns
        .iter()
        .map(|n| (n.container_id.as_str(), n.ip))
        .collect();
    let mut ips = BTreeMap::new();
    for r in rows {
        match attached.get(r.container_id.as_str()) {
            None => v.push(format!(
                "instance {}: no namespace file for {}",
                r.id, r.container_id
            )),
            Some(ip) if ip.map(|i| i.to_string()).as_deref() != Some(r.ip.as_str()) => v.push(
                format!("instance {}: eth0 is {ip:?}, status says {}", r.id, r.ip),
            ),
            Some(_) => {}
        }
        if let Some(other) = ips.insert(r.ip.clone(), r.id.clone()) {
            v.push(format!("IPAM: {} held by {} and {}", r.ip, other, r.id));
        }
    }
    if inv.netns.len() != rows.len() {
        v.push(format!(
            "kernel: {} namespace files for {} instances",
            inv.netns.len(),
            rows.len()
        ));
    }
    if inv.veths.len() != rows.len() {
        let names: Vec<&str> = inv.veths.iter().map(|x| x.name.as_str()).collect();
        v.push(format!(
            "kernel: veths {names:?} for {} instances",
            rows.len()
        ));
    }
    let subnets: BTreeSet<String> = rows
        .iter()
        .filter_map(|r| r.ip.parse().ok().and_then(Subnet::of))
        .map(|s| s.to_string())
        .collect();
    for b in &inv.bridges {
        if !subnets.contains(&b.subnet.to_string()) {
            v.push(format!(
                "bridge {} ({}): no instance on it",
                b.name, b.subnet
            ));
        }
    }
    if !inv.unfinished_bridges.is_empty() {
        v.push(format!(
            "kernel: half-built bridges {:?}",
            inv.unfinished_bridges
        ));
    }
}

/// The nft table's sets and maps against the kernel's bridges and the
/// rows' published ports.
fn firewall(world: &World<'_>, rows: &[Row], v: &mut Vec<String>) {
    let out = std::process::Command::new("nft")
        .args(["-j", "list", "table", "inet", &world.table])
        .output();
    let Ok(out) = out else {
        return v.push("nft: cannot run".into());
    };
    if !out.status.success() {
        if rows.is_empty() {
            return;
        }
        return v.push(format!(
            "nft table {}: {}",
            world.table,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    let mut published = BTreeSet::new();
    let mut bridges = BTreeSet::new();
    for item in json["nftables"].as_array().cloned().unwrap_or_default() {
        let (kind, body) = if item.get("map").is_some() {
            ("map", &item["map"])
        } else if item.get("set").is_some() {
            ("set", &item["set"])
        } else {
            continue;
        };
        let name = body["name"].as_str().unwrap_or_default();
        let elems = body["elem"].as_array().cloned().unwrap_or_default();
        match (kind, name) {
            ("set", "bridges") => {
                bridges.extend(elems.iter().filter_map(|e| e.as_str().map(str::to_owned)));
            }
            ("map", "puball_tcp" | "pub_tcp") => {
                for e in elems {
                    published.insert(published_element(&e));
                }
            }
            _ => {}
        }
    }
    let mut want = BTreeSet::new();
    let mut ports = BTreeMap::new();
    for r in rows {
        for port in r.ports.values() {
            if let Some(other) = ports.insert(*port, r.id.clone()) {
                v.push(format!("host port {port}: held by {other} and {}", r.id));
            }
            want.insert(format!("{port} -> {}:8080", r.ip));
        }
    }
    if published != want {
        let extra: Vec<_> = published.difference(&want).collect();
        let missing: Vec<_> = want.difference(&published).collect();
        v.push(format!(
            "nft published ports: extra {extra:?}, missing {missing:?}"
        ));
    }
    let subnets: BTreeSet<String> = rows
        .iter()
        .filter_map(|r| r.ip.parse().ok().and_then(Subnet::of))
        .map(|s| s.to_string())
        .collect();
    if bridges.len() != subnets.len() {
        v.push(format!(
            "nft set bridges {bridges:?} for subnets {subnets:?}"
        ));
    }
}

/// A map element as `host port -> container ip:port`, from either map
/// form: `[port, {concat: [ip, port]}]` or `[{concat: [host ip, port]}, …]`.
fn published_element(e: &serde_json::Value) -> String {
    let key = &e[0];
    let port = key["concat"][1]
        .as_u64()
        .or_else(|| key.as_u64())
        .unwrap_or(0);
    let to = &e[1]["concat"];
    format!(
        "{port} -> {}:{}",
        to[0].as_str().unwrap_or("?"),
        to[1].as_u64().unwrap_or(0)
    )
}

/// How many numbered lines `files` (oldest first) hold, all in sequence
/// from 1 (from any first number when `any_start`).
fn counter_lines(files: &[PathBuf], any_start: bool) -> Result<u64, String> {
    let mut next: Option<u64> = (!any_start).then_some(1);
    let mut lines = 0u64;
    for file in files {
        let reader = zattera_agent::logs::files::open(file)
            .map_err(|e| format!("{}: {e}", file.display()))?;
        for line in std::io::BufRead::lines(reader) {
            let line = line.map_err(|e| format!("{}: {e}", file.display()))?;
            let n = line
                .splitn(4, ' ')
                .nth(3)
                .and_then(|n| n.parse::<u64>().ok());
            match (n, next) {
                (Some(n), Some(want)) if n == want => next = Some(n + 1),
                (Some(n), None) => next = Some(n + 1),
                _ => {
                    return Err(format!(
                        "{}: want line {next:?}, found {line:?}",
                        file.display()
                    ));
                }
            }
            lines += 1;
        }
    }
    Ok(lines)
}

#[test]
fn the_counter_check_follows_rotations_and_sees_a_gap() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, from: u64, to: u64| {
        let mut text = String::new();
        for n in from..=to {
            writeln!(text, "2026-12-01T00:00:00Z stdout F {n}").unwrap();
        }
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let compressed = |p: PathBuf| zattera_agent::logs::files::compress(&p).unwrap().0;
    let files = [
        compressed(write("c.log.1", 1, 100)),
        compressed(write("c.log.2", 101, 150)),
        write("c.log", 151, 160),
    ];
    assert_eq!(counter_lines(&files, false), Ok(160));
    // The oldest rotation dropped: any start, but still no gap.
    assert_eq!(counter_lines(&files[1..], true), Ok(60));
    assert!(
        counter_lines(&files[1..], false).is_err(),
        "starts at 101, not 1"
    );
    let gap = [write("g.log.1", 1, 10), write("g.log", 12, 20)];
    assert!(
        counter_lines(&gap, false)
            .unwrap_err()
            .contains("want line Some(11)")
    );
}

/// Each scope's resolver answers every instance of its apps, and nothing
/// for apps that are gone.
async fn dns(world: &World<'_>, desired: &Desired, rows: &[Row], v: &mut Vec<String>) {
    let _ = world;
    let mut scopes: BTreeMap<&str, &Row> = BTreeMap::new();
    for r in rows {
        scopes.entry(r.environment.as_str()).or_insert(r);
    }
    for (env, asker) in scopes {
        let Some(gateway) = asker
            .ip
            .parse()
            .ok()
            .and_then(Subnet::of)
            .map(Subnet::gateway)
        else {
            continue;
        };
        let netns = world.net.config().netns_dir.join(&asker.container_id);
        let mut names: Vec<(String, BTreeSet<String>)> = desired
            .apps
            .iter()
            .filter(|(_, a)| a.env == env && a.replicas > 0)
            .map(|(n, _)| {
                let ips = rows
                    .iter()
                    .filter(|r| r.app == *n)
                    .map(|r| r.ip.clone())
                    .collect();
                (n.clone(), ips)
            })
            .collect();
        names.extend(desired.gone.iter().map(|g| (g.clone(), BTreeSet::new())));
        for (app, want) in names {
            let name = format!("{app}.internal");
            let server = SocketAddrV4::new(gateway, 53);
            let path = netns.clone();
            let q = name.clone();
            let answer = tokio::task::spawn_blocking(move || {
                zattera_netns::dig::query_from(&path, server, &q, Duration::from_secs(1))
            })
            .await;
            match answer {
                Ok(Ok(a)) => {
                    let got: BTreeSet<String> =
                        a.addresses.iter().map(Ipv4Addr::to_string).collect();
                    let rcode_ok = if want.is_empty() {
                        a.rcode == "NXDOMAIN"
                    } else {
                        a.rcode == "NOERROR"
                    };
                    if got != want || !rcode_ok {
                        v.push(format!(
                            "DNS {name} in {env}: {} {got:?}, want {want:?}",
                            a.rcode
                        ));
                    }
                }
                Ok(Err(e)) => {
                    let host = std::process::Command::new("dig")
                        .args([
                            "+short",
                            "+time=1",
                            "+tries=1",
                            &format!("@{gateway}"),
                            &name,
                        ])
                        .output()
                        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
                    let neigh = std::process::Command::new("nsenter")
                        .arg(format!("--net={}", netns.display()))
                        .args(["ip", "neigh", "show", &gateway.to_string()])
                        .output()
                        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
                    v.push(format!(
                        "DNS {name} in {env}, asked from {} ({}): {e}; from the host: {host:?}; its neighbour entry {neigh:?}",
                        asker.id, asker.ip
                    ));
                }
                Err(e) => v.push(format!("DNS {name} in {env}: {e}")),
            }
        }
    }
}

/// The counter kept running through every fault, so its log has every line
/// from 1 up, in order, across the log shim's rotations (compressed, oldest
/// first, then the live file). Once retention has dropped the first
/// rotation (seq 1), the first line kept may be any.
fn counter_log(world: &World<'_>, rows: &[Row], v: &mut Vec<String>) {
    let (cid, _) = world.counter;
    if !rows.iter().any(|r| r.container_id == cid) {
        return v.push(format!("counter: container {cid} is gone from status"));
    }
    let path = world.data_dir.join("logs").join(format!("{cid}.log"));
    let files = zattera_agent::logs::files::of_container(&path);
    let first = |f: &PathBuf| {
        let name = f.to_string_lossy();
        *f == path || name.ends_with(".log.1.zst") || name.ends_with(".log.1")
    };
    let dropped = !files.first().is_some_and(first);
    let lines = match counter_lines(&files, dropped) {
        Ok(n) => n,
        Err(e) => return v.push(format!("counter log: {e}")),
    };
    if lines < 100 {
        v.push(format!(
            "counter log {}: only {lines} lines",
            path.display()
        ));
    }
}
