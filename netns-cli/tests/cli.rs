//! The `zattera-netns` binary against a real node: bridges, namespaces and
//! our nftables table made by the library, read back by the operator's CLI.
//! Subnet slots 213 to 215, shared with the library's tests (netns/tests).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "../../netns/tests/support/mod.rs"]
mod support;

use std::net::Ipv4Addr;

use support::{World, link_exists, ready};
use zattera_netns::{Proto, PublishedPort, ScopedVip, Subnet, nsfile};

/// A one-name DNS server on `ip:53` (host side): `name` gets one A record
/// `answer`, every other name NXDOMAIN. Stops when dropped.
fn fake_dns(ip: Ipv4Addr, name: &'static str, answer: Ipv4Addr) -> FakeDns {
    let sock = std::net::UdpSocket::bind((ip, 53)).unwrap();
    sock.set_read_timeout(Some(std::time::Duration::from_millis(20)))
        .unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    let thread = std::thread::spawn(move || {
        let mut wire_name = Vec::new();
        for label in name.split('.') {
            wire_name.push(u8::try_from(label.len()).unwrap());
            wire_name.extend_from_slice(label.as_bytes());
        }
        wire_name.push(0);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut buf = [0u8; 512];
        while !flag.load(std::sync::atomic::Ordering::SeqCst)
            && std::time::Instant::now() < deadline
        {
            let Ok((n, peer)) = sock.recv_from(&mut buf) else {
                continue;
            };
            let mut r = buf[..n].to_vec();
            r[2] = 0x81;
            if r.get(12..12 + wire_name.len()) == Some(&wire_name[..]) {
                r[3] = 0x80;
                r[7] = 1;
                r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4]);
                r.extend_from_slice(&answer.octets());
            } else {
                r[3] = 0x83;
            }
            let _ = sock.send_to(&r, peer);
        }
    });
    FakeDns {
        stop,
        thread: Some(thread),
    }
}

struct FakeDns {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for FakeDns {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn cli(w: &World, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_zattera-netns"))
        .arg("--run-dir")
        .arg(w.dir.path())
        .args(["--bridge-prefix", &w.prefix, "--nft-table", &w.table])
        .args(args)
        .output()
        .unwrap()
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_lists_inspects_execs_and_collects() {
    if !ready("cli") {
        return;
    }
    let w = World::new("cli");
    let node = w.node();
    let s = Subnet::from_slot(213);
    node.ensure_network("zt-p-cli", s).await.unwrap();
    let c = node.attach("clic1", s, s.host(7)).await.unwrap();
    node.set_published(vec![PublishedPort {
        proto: Proto::Tcp,
        host_ip: Ipv4Addr::LOCALHOST,
        host_port: 18_213,
        container_ip: c.ip,
        container_port: 80,
    }])
    .await
    .unwrap();

    let out = cli(&w, &["ls", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let net = &doc["networks"][0];
    assert_eq!(net["network"], "zt-p-cli");
    assert_eq!(net["subnet"], "10.201.213.0/24");
    assert_eq!(net["gateway"], "10.201.213.1");
    assert_eq!(net["members"][0]["container_id"], "clic1");
    assert_eq!(net["members"][0]["ip"], "10.201.213.7");
    assert_eq!(net["members"][0]["veth"], c.host_veth.as_str());
    assert_eq!(net["published"][0]["host"], "127.0.0.1:18213");

    let out = cli(&w, &["inspect", "zt-p-cli"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("clic1")
            && t.contains("10.201.213.7")
            && t.contains("127.0.0.1:18213 -> 10.201.213.7:80"),
        "{t}"
    );
    assert!(t.contains("masquerade"), "{t}");
    let out = cli(&w, &["inspect", "nope"]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("zt-p-cli"),
        "the error lists what exists: {}",
        text(&out)
    );

    // exec runs a host program inside the container's namespace.
    let out = cli(
        &w,
        &[
            "exec", "clic1", "--", "ip", "-o", "-4", "addr", "show", "dev", "eth0",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    assert!(text(&out).contains("10.201.213.7/24"), "{}", text(&out));
    let out = cli(&w, &["exec", "nosuch", "--", "true"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("clic1"), "{}", text(&out));
    // dig asks the gateway from inside the container's namespace.
    let _dns = fake_dns(s.gateway(), "web.internal", Ipv4Addr::new(10, 201, 213, 99));
    let out = cli(&w, &["dig", "web.internal", "--from", "clic1", "--json"]);
    assert!(out.status.success(), "{}", text(&out));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["rcode"], "NOERROR", "{answer}");
    assert_eq!(answer["addresses"][0], "10.201.213.99", "{answer}");
    assert_eq!(answer["server"], "10.201.213.1:53");
    let out = cli(&w, &["dig", "nope.internal", "--from", "clic1"]);
    assert!(text(&out).contains("NXDOMAIN"), "{}", text(&out));
    let out = cli(&w, &["dig", "web.internal", "--from", "nosuch"]);
    assert!(
        !out.status.success() && text(&out).contains("clic1"),
        "{}",
        text(&out)
    );

    // gc: nothing to do, then a crash leftover that --apply removes.
    let out = cli(&w, &["gc"]);
    assert!(text(&out).contains("nothing to collect"), "{}", text(&out));
    let half = w.cfg.netns_path("half").unwrap();
    nsfile::create(&half).await.unwrap();
    let out = cli(&w, &["gc"]);
    assert!(
        text(&out).contains("would remove netns file"),
        "{}",
        text(&out)
    );
    assert!(half.exists());
    let out = cli(&w, &["gc", "--apply"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(!half.exists());
    assert!(
        c.netns_path.exists() && link_exists(&c.host_veth),
        "a live attachment is kept"
    );

    node.detach("clic1", Some(c.ip)).await.unwrap();
    node.remove_network(s).await.unwrap();
    node.remove_rules().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_keeps_the_rules_of_networks_it_has_not_touched_yet() {
    if !ready("restart") {
        return;
    }
    let w = World::new("restart");
    let (s1, s2) = (Subnet::from_slot(214), Subnet::from_slot(215));
    let published = PublishedPort {
        proto: Proto::Udp,
        host_ip: Ipv4Addr::LOCALHOST,
        host_port: 18_214,
        container_ip: s1.host(2),
        container_port: 53,
    };
    {
        let node = w.node();
        node.ensure_network("zt-p-r1", s1).await.unwrap();
        node.ensure_network("zt-p-r2", s2).await.unwrap();
        node.set_published(vec![published]).await.unwrap();
        // Data only: no traffic is sent to this address.
        node.set_vips(vec![ScopedVip {
            addr: Ipv4Addr::new(10, 97, 0, 5),
            scope: "zt-p-r1".into(),
        }])
        .await
        .unwrap();
    }
    // A new process: it ensures only the second network.
    let node = w.node();
    node.ensure_network("zt-p-r2", s2).await.unwrap();
    let rules = node.rules().await.unwrap();
    let mut names: Vec<_> = rules.bridges.iter().map(|b| b.bridge.clone()).collect();
    names.sort();
    assert_eq!(names, vec![w.cfg.bridge_name(s1), w.cfg.bridge_name(s2)]);
    assert_eq!(rules.published, vec![published]);
    // The VIP keeps its scope: the restarted node read it back from the
    // bridge that may reach it.
    assert_eq!(
        rules.vips,
        vec![ScopedVip {
            addr: Ipv4Addr::new(10, 97, 0, 5),
            scope: "zt-p-r1".into(),
        }]
    );
    assert_eq!(
        rules.vip_access(),
        vec![(w.cfg.bridge_name(s1), Ipv4Addr::new(10, 97, 0, 5))]
    );
    // The operator's view: which network may reach which VIP.
    let out = cli(&w, &["ls", "--json"]);
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let vips_of = |bridge: String| {
        doc["networks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["bridge"] == bridge.as_str())
            .map(|n| n["vips"].clone())
    };
    assert_eq!(
        vips_of(w.cfg.bridge_name(s1)),
        Some(serde_json::json!(["10.97.0.5"])),
        "{}",
        text(&out)
    );
    assert_eq!(
        vips_of(w.cfg.bridge_name(s2)),
        Some(serde_json::json!([])),
        "{}",
        text(&out)
    );
    assert_eq!(node.nft().published().await.unwrap(), vec![published]);
    let table = node.nft().list().await.unwrap().unwrap();
    assert!(
        table.contains("ip saddr 10.201.214.0/24 oifname != @bridges masquerade"),
        "{table}"
    );

    node.remove_network(s1).await.unwrap();
    assert!(
        node.rules().await.unwrap().published.is_empty(),
        "ports into a removed network go with it"
    );
    node.remove_network(s2).await.unwrap();
    node.remove_rules().await.unwrap();
}
