//! Benchmarks for zattera-netns (issue 4), run with
//! `cargo bench -p zattera-netns --bench netns` as root.
//!
//! Everything runs inside a private network namespace that the benchmark
//! unshares first, so neither our nftables table nor the CNI plugins'
//! iptables chains ever touch the host's network.
//!
//! 1. Attach + publish one port + detach + unpublish, 200 rounds, against the
//!    CNI `bridge` + `host-local` + `portmap` plugins doing the same set-up
//!    (Debian's containernetworking-plugins in /usr/lib/cni): p50 and p99.
//! 2. Rebuilding the whole rules table with 500 published ports.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use zattera_netns::{
    BridgeRules, FirewallState, NetConfig, NetNode, Proto, PublishedPort, Subnet, nsfile,
};

const ROUNDS: usize = 200;
const CNI_DIR: &str = "/usr/lib/cni";

fn main() {
    if !nix::unistd::Uid::effective().is_root() {
        println!("netns bench: needs root; skipped");
        return;
    }
    // Before any thread exists, so every thread and child is in it.
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare a private netns");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run());
}

async fn run() {
    let dir = tempfile::tempdir().unwrap();
    let ours = bench_ours(dir.path()).await;
    report("zattera-netns attach+publish+detach", &ours);
    let cni_ok =
        Path::new(CNI_DIR).join("bridge").exists() && Path::new(CNI_DIR).join("portmap").exists();
    if cni_ok {
        let cni = bench_cni(dir.path()).await;
        report("CNI bridge+host-local+portmap ADD+DEL", &cni);
        println!(
            "p50 ratio ours/CNI: {:.2} (goal <= 0.5); p99 ratio: {:.2}",
            pct(&ours, 50).as_secs_f64() / pct(&cni, 50).as_secs_f64(),
            pct(&ours, 99).as_secs_f64() / pct(&cni, 99).as_secs_f64()
        );
    } else {
        println!(
            "CNI plugins not found in {CNI_DIR} (apt-get install containernetworking-plugins): comparison skipped"
        );
    }
    bench_rules(dir.path()).await;
}

async fn bench_ours(dir: &Path) -> Vec<Duration> {
    let node = NetNode::new(NetConfig {
        bridge_prefix: "ztbench".into(),
        nft_table: "ztbench".into(),
        netns_dir: dir.join("ours"),
        ..NetConfig::default()
    })
    .unwrap();
    let s = Subnet::from_slot(250);
    node.ensure_network("zt-bench", s).await.unwrap();
    let mut times = Vec::with_capacity(ROUNDS);
    for i in 0..ROUNDS {
        let id = format!("c{i}");
        let ip = s.host(u8::try_from(2 + i % 250).unwrap());
        let t = Instant::now();
        node.attach(&id, s, ip).await.unwrap();
        node.set_published(vec![PublishedPort {
            proto: Proto::Tcp,
            host_ip: Ipv4Addr::UNSPECIFIED,
            host_port: 20_000,
            container_ip: ip,
            container_port: 80,
        }])
        .await
        .unwrap();
        node.set_published(Vec::new()).await.unwrap();
        node.detach(&id, Some(ip)).await.unwrap();
        times.push(t.elapsed());
    }
    node.remove_network(s).await.unwrap();
    node.remove_rules().await.unwrap();
    times
}

fn cni(
    command: &str,
    plugin: &str,
    id: &str,
    netns: &Path,
    config: &serde_json::Value,
) -> serde_json::Value {
    let mut child = Command::new(Path::new(CNI_DIR).join(plugin))
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", id)
        .env("CNI_NETNS", netns)
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", CNI_DIR)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(config.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "CNI {plugin} {command}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
}

async fn bench_cni(dir: &Path) -> Vec<Duration> {
    let bridge = serde_json::json!({
        "cniVersion": "1.0.0", "name": "ztbench", "type": "bridge", "bridge": "ztcnibr0",
        "isGateway": true, "ipMasq": true, "hairpinMode": true,
        "ipam": {"type": "host-local", "subnet": "10.201.251.0/24", "dataDir": dir.join("cni-ipam")}
    });
    let mut times = Vec::with_capacity(ROUNDS);
    for i in 0..ROUNDS {
        let id = format!("c{i}");
        let netns = dir.join("cni").join(&id);
        let t = Instant::now();
        nsfile::create(&netns).await.unwrap();
        let result = cni("ADD", "bridge", &id, &netns, &bridge);
        let portmap = serde_json::json!({
            "cniVersion": "1.0.0", "name": "ztbench", "type": "portmap",
            "capabilities": {"portMappings": true},
            "runtimeConfig": {"portMappings": [{"hostPort": 20000, "containerPort": 80, "protocol": "tcp"}]},
            "prevResult": result,
        });
        cni("ADD", "portmap", &id, &netns, &portmap);
        cni("DEL", "portmap", &id, &netns, &portmap);
        cni("DEL", "bridge", &id, &netns, &bridge);
        nsfile::remove(&netns).unwrap();
        times.push(t.elapsed());
    }
    times
}

async fn bench_rules(dir: &Path) {
    let node = NetNode::new(NetConfig {
        bridge_prefix: "ztbenchr".into(),
        nft_table: "ztbench_rules".into(),
        netns_dir: dir.join("rules"),
        ..NetConfig::default()
    })
    .unwrap();
    let bridges: Vec<BridgeRules> = (0..10u8)
        .map(|slot| BridgeRules {
            bridge: format!("ztbenchr{slot}"),
            subnet: Subnet::from_slot(slot),
            scope: format!("zt-bench-{slot}"),
        })
        .collect();
    // The growth curve of one rebuild: 10, 100 and 1,000 published ports.
    for count in [10u16, 100, 1000] {
        let state = FirewallState {
            bridges: bridges.clone(),
            published: published_ports(count),
            vips: Vec::new(),
            egress_deny: Vec::new(),
        };
        // Two states that differ in every port, alternating: applying an
        // unchanged state is skipped, which would time nothing.
        let mut other = state.clone();
        for p in &mut other.published {
            p.container_port = 8081;
        }
        let mut times = Vec::new();
        for round in 0..20 {
            let next = if round % 2 == 0 { &state } else { &other };
            let t = Instant::now();
            node.apply_rules(next.clone()).await.unwrap();
            times.push(t.elapsed());
        }
        assert_eq!(
            node.nft().published().await.unwrap().len(),
            usize::from(count)
        );
        report(
            &format!("rules rebuild, {count} published ports, 10 bridges"),
            &times,
        );
        println!(
            "CURVE rules_rebuild_ms {count} {:.2} ms",
            pct(&times, 50).as_secs_f64() * 1e3
        );
    }
    println!("goal: p50 <= 50 ms at 1000 ports");
    node.remove_rules().await.unwrap();
}

/// `count` ports over the 10 bridges, a fifth UDP, half on loopback only.
fn published_ports(count: u16) -> Vec<PublishedPort> {
    (0..count)
        .map(|i| PublishedPort {
            proto: if i % 5 == 0 { Proto::Udp } else { Proto::Tcp },
            host_ip: if i % 2 == 0 {
                Ipv4Addr::LOCALHOST
            } else {
                Ipv4Addr::UNSPECIFIED
            },
            host_port: 30_000 + i,
            container_ip: Subnet::from_slot(u8::try_from(i % 10).unwrap())
                .host(u8::try_from(2 + i / 10).unwrap()),
            container_port: 8080,
        })
        .collect()
}

fn pct(times: &[Duration], p: usize) -> Duration {
    let mut v = times.to_vec();
    v.sort();
    v[(v.len() * p / 100).min(v.len() - 1)]
}

fn report(what: &str, times: &[Duration]) {
    println!(
        "{what}: n={} p50={:.2} ms p99={:.2} ms",
        times.len(),
        pct(times, 50).as_secs_f64() * 1e3,
        pct(times, 99).as_secs_f64() * 1e3
    );
}
