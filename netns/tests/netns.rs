//! Integration tests: real netlink, real namespaces, real nft, as root.
//! Each test has its own interface prefix, nft table, run dir and subnet
//! slots (200-238, 221 the gateway address test; 237 is the egress test's outside link, 239 is for dummy
//! host addresses), so they run in parallel with each other and with the
//! rest of the project's tests.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::many_single_char_names,
    clippy::disallowed_methods
)]

mod support;

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddrV4};

use socket2::{Domain, Socket, Type};

use support::{
    World, foreign_ruleset, ip, link_exists, ready, tcp_get, tcp_server, udp_get, udp_server,
};
use zattera_netns::inventory;
use zattera_netns::{
    Error, HostPorts, Ipam, NetConfig, NetNode, Proto, PublishedPort, Subnet, nsfile,
};

fn sa(ip: Ipv4Addr, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip, port)
}

/// eth0's address inside a namespace, read with iproute2 (not our code).
fn eth0_of(path: &std::path::Path) -> Ipv4Addr {
    let out = std::process::Command::new("nsenter")
        .arg(format!("--net={}", path.display()))
        .args(["ip", "-o", "-4", "addr", "show", "dev", "eth0"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let addr = text
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .unwrap();
    addr.split('/').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ensure_is_idempotent_checks_subnet_and_scope_and_refuses_foreign_names() {
    if !ready("ensure") {
        return;
    }
    let before = foreign_ruleset();
    let w = World::new("ensure");
    let node = w.node();
    let s = Subnet::from_slot(206);
    let bridge = w.cfg.bridge_name(s);

    let net = node.ensure_network("zt-proj-envone", s).await.unwrap();
    assert_eq!(net.bridge, bridge);
    assert_eq!(net.gateway, Ipv4Addr::new(10, 201, 206, 1));
    let again = node.ensure_network("zt-proj-envone", s).await.unwrap();
    assert_eq!(net, again);
    let addrs = std::process::Command::new("ip")
        .args(["-o", "-4", "addr", "show", "dev", &bridge])
        .output()
        .unwrap();
    let addrs = String::from_utf8_lossy(&addrs.stdout);
    assert_eq!(addrs.matches("inet ").count(), 1, "{addrs}");
    assert!(addrs.contains("10.201.206.1/24"), "{addrs}");
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .unwrap()
            .trim(),
        "1"
    );
    assert_eq!(
        std::fs::read_to_string(format!("/proc/sys/net/ipv4/conf/{bridge}/route_localnet"))
            .unwrap()
            .trim(),
        "1"
    );
    let table = node.nft().list().await.unwrap().expect("our table exists");
    assert!(table.contains(&bridge), "{table}");

    // Another scope on an empty bridge: re-created for the new owner.
    let other = node.ensure_network("zt-proj-envtwo", s).await.unwrap();
    assert_eq!(other.scope, "zt-proj-envtwo");

    // A stale address on an empty bridge: re-created with the right one.
    ip(&["addr", "add", "10.201.206.77/24", "dev", &bridge]);
    node.ensure_network("zt-proj-envtwo", s).await.unwrap();
    let addrs = std::process::Command::new("ip")
        .args(["-o", "-4", "addr", "show", "dev", &bridge])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&addrs.stdout).contains("10.201.206.77"));

    // With a container attached, a mismatch is an error naming both sides.
    let att = node
        .attach("c-ensure", s, Ipv4Addr::new(10, 201, 206, 2))
        .await
        .unwrap();
    let err = node
        .ensure_network("zt-proj-envthree", s)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::ScopeInUse { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("zt-proj-envthree") && msg.contains("zt-proj-envtwo"),
        "{msg}"
    );
    ip(&["addr", "add", "10.201.206.78/24", "dev", &bridge]);
    let err = node.ensure_network("zt-proj-envtwo", s).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::SubnetInUse { .. }), "{msg}");
    assert!(
        msg.contains("10.201.206.0/24") && msg.contains("10.201.206.78/24"),
        "{msg}"
    );
    let err = node.remove_network(s).await.unwrap_err();
    assert!(matches!(err, Error::NetworkInUse { .. }), "{err}");
    assert!(err.to_string().contains(&att.host_veth), "{err}");
    assert!(link_exists(&bridge));
    node.detach(&att.container_id, Some(att.ip)).await.unwrap();

    // An interface with our bridge's name that is not our bridge.
    let s2 = Subnet::from_slot(207);
    let foreign = w.cfg.bridge_name(s2);
    support::add_dummy(&foreign);
    let err = node.ensure_network("zt-proj-x", s2).await.unwrap_err();
    assert!(matches!(err, Error::NotOurs { .. }), "{err}");
    assert!(err.to_string().contains(&foreign));
    ip(&["link", "del", &foreign]);
    // A bridge that lacks our alias is not ours either.
    ip(&["link", "add", &foreign, "type", "bridge"]);
    assert!(matches!(
        node.ensure_network("zt-proj-x", s2).await,
        Err(Error::NotOurs { .. })
    ));
    assert!(matches!(
        node.remove_network(s2).await,
        Err(Error::NotOurs { .. })
    ));
    assert!(
        link_exists(&foreign),
        "a foreign bridge must never be deleted"
    );

    // Removal takes the bridge and its rules; a second removal is a no-op.
    node.remove_network(s).await.unwrap();
    assert!(!link_exists(&bridge));
    let table = node.nft().list().await.unwrap().unwrap();
    assert!(!table.contains(&format!("\"{bridge}\"")), "{table}");
    node.remove_network(s).await.unwrap();
    node.remove_rules().await.unwrap();
    assert!(node.nft().list().await.unwrap().is_none());
    assert_eq!(
        before,
        foreign_ruleset(),
        "the host's ruleset outside our tables changed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_nft_binary_is_a_clear_error() {
    if !ready("nft_missing") {
        return;
    }
    let w = World::new("nft_missing");
    let node = NetNode::new(NetConfig {
        nft_binary: "/nonexistent/nft".into(),
        ..w.cfg.clone()
    })
    .unwrap();
    let err = node
        .ensure_network("zt-p-e", Subnet::from_slot(208))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NftMissing { .. }), "{err}");
    assert!(err.to_string().contains("/nonexistent/nft"), "{err}");
    assert!(
        !link_exists(&w.cfg.bridge_name(Subnet::from_slot(208))),
        "a failed ensure leaves no bridge"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn environments_reach_inside_and_never_across() {
    if !ready("isolation") {
        return;
    }
    let w = World::new("isolation");
    let node = w.node();
    let (sa_, sb) = (Subnet::from_slot(200), Subnet::from_slot(201));
    node.ensure_network("zt-p-a", sa_).await.unwrap();
    node.ensure_network("zt-p-b", sb).await.unwrap();
    let mut ipam = Ipam::default();
    let mut attach = async |id: &str, s: Subnet| {
        let ip = ipam.allocate(s, id).unwrap();
        node.attach(id, s, ip).await.unwrap()
    };
    let a1 = attach("a1", sa_).await;
    let a2 = attach("a2", sa_).await;
    let b1 = attach("b1", sb).await;
    assert_ne!(a1.ip, a2.ip);
    assert_eq!(eth0_of(&a1.netns_path), a1.ip);

    let _srv_a1 = tcp_server(Some(&a1.netns_path), sa(a1.ip, 7000), "a1");
    let _srv_b1 = tcp_server(Some(&b1.netns_path), sa(b1.ip, 7000), "b1");

    // Inside one environment: yes.
    let got = tcp_get(Some(&a2.netns_path), sa(a1.ip, 7000)).unwrap();
    assert_eq!(got, format!("a1 {}", a2.ip));
    // The path to B works (host to B1, A1 to B's gateway)...
    assert!(tcp_get(None, sa(b1.ip, 7000)).unwrap().starts_with("b1"));
    // ...but from A to B and B to A: never.
    let err = tcp_get(Some(&a1.netns_path), sa(b1.ip, 7000)).unwrap_err();
    assert!(err.contains("connect"), "{err}");
    assert!(tcp_get(Some(&b1.netns_path), sa(a1.ip, 7000)).is_err());

    // DNS on the gateway (where the agent's resolver listens) answers.
    let gw = sa_.gateway();
    let _dns = udp_server(None, sa(gw, 53), "dns-a");
    assert_eq!(udp_get(Some(&a2.netns_path), sa(gw, 53)).unwrap(), "dns-a");
    let rules = node.nft().list().await.unwrap().unwrap();
    assert!(
        rules.contains(&format!("ip daddr {gw} udp dport 53 accept")),
        "{rules}"
    );

    for att in [&a1, &a2, &b1] {
        node.detach(&att.container_id, Some(att.ip)).await.unwrap();
    }
    node.remove_network(sa_).await.unwrap();
    node.remove_network(sb).await.unwrap();
    node.remove_rules().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn published_ports_answer_on_loopback_and_a_second_address_from_host_and_containers() {
    if !ready("publish") {
        return;
    }
    let before = foreign_ruleset();
    let w = World::new("publish");
    let node = w.node();
    let s = Subnet::from_slot(202);
    let other = Subnet::from_slot(209);
    node.ensure_network("zt-p-pub", s).await.unwrap();
    node.ensure_network("zt-p-other", other).await.unwrap();
    let p1 = node.attach("p1", s, s.host(10)).await.unwrap();
    let p2 = node.attach("p2", s, s.host(11)).await.unwrap();
    let o1 = node.attach("o1", other, other.host(10)).await.unwrap();

    // A second host address on a dummy we own.
    let dummy = w.extra_ifname("d");
    let host2 = Ipv4Addr::new(10, 201, 239, 202);
    support::add_dummy(&dummy);
    ip(&["addr", "add", &format!("{host2}/32"), "dev", &dummy]);
    ip(&["link", "set", &dummy, "up"]);

    let _tcp = tcp_server(Some(&p1.netns_path), sa(Ipv4Addr::UNSPECIFIED, 8080), "web");
    let _udp = udp_server(Some(&p1.netns_path), sa(Ipv4Addr::UNSPECIFIED, 5353), "dns");

    let mut ports = HostPorts::default();
    let lo_port = ports
        .allocate(Proto::Tcp, Ipv4Addr::LOCALHOST, None)
        .unwrap();
    let h2_port = ports.allocate(Proto::Tcp, host2, None).unwrap();
    let udp_port = ports.allocate(Proto::Udp, host2, None).unwrap();
    let pubs = vec![
        PublishedPort {
            proto: Proto::Tcp,
            host_ip: Ipv4Addr::LOCALHOST,
            host_port: lo_port,
            container_ip: p1.ip,
            container_port: 8080,
        },
        PublishedPort {
            proto: Proto::Tcp,
            host_ip: host2,
            host_port: h2_port,
            container_ip: p1.ip,
            container_port: 8080,
        },
        PublishedPort {
            proto: Proto::Udp,
            host_ip: host2,
            host_port: udp_port,
            container_ip: p1.ip,
            container_port: 5353,
        },
    ];
    node.set_published(pubs).await.unwrap();

    // From the host: loopback (output DNAT + route_localnet + masquerade)...
    let got = tcp_get(None, sa(Ipv4Addr::LOCALHOST, lo_port)).unwrap();
    assert!(got.starts_with("web "), "{got}");
    // ...and the second address.
    assert!(
        tcp_get(None, sa(host2, h2_port))
            .unwrap()
            .starts_with("web ")
    );
    assert_eq!(udp_get(None, sa(host2, udp_port)).unwrap(), "dns");
    // From a container on the same bridge (hairpin), from the container
    // itself, and from a container of another environment.
    let got = tcp_get(Some(&p2.netns_path), sa(host2, h2_port)).unwrap();
    assert_eq!(
        got,
        format!("web {}", s.gateway()),
        "hairpin is masqueraded to the gateway"
    );
    assert!(
        tcp_get(Some(&p1.netns_path), sa(host2, h2_port))
            .unwrap()
            .starts_with("web ")
    );
    assert!(
        tcp_get(Some(&o1.netns_path), sa(host2, h2_port))
            .unwrap()
            .starts_with("web ")
    );
    assert_eq!(
        udp_get(Some(&p2.netns_path), sa(host2, udp_port)).unwrap(),
        "dns"
    );
    // A port we did not publish does not answer.
    assert!(tcp_get(None, sa(host2, 8080)).is_err());

    // Unpublishing takes the DNAT away.
    node.set_published(Vec::new()).await.unwrap();
    assert!(tcp_get(None, sa(host2, h2_port)).is_err());

    for att in [&p1, &p2, &o1] {
        node.detach(&att.container_id, Some(att.ip)).await.unwrap();
    }
    node.remove_network(s).await.unwrap();
    node.remove_network(other).await.unwrap();
    node.remove_rules().await.unwrap();
    assert_eq!(
        before,
        foreign_ruleset(),
        "the host's ruleset outside our tables changed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn egress_is_masqueraded_and_published_ports_answer_from_outside() {
    if !ready("egress") {
        return;
    }
    let mut w = World::new("egress");
    let node = w.node();
    let s = Subnet::from_slot(203);
    node.ensure_network("zt-p-egress", s).await.unwrap();
    let c = node.attach("eg1", s, s.host(2)).await.unwrap();

    // The outside world: a namespace of our own behind a veth.
    let world = w.dir.path().join("outside").join("world");
    w.extra_netns.push(world.clone());
    nsfile::create(&world).await.unwrap();
    let (host_end, world_end) = (w.extra_ifname("h"), w.extra_ifname("w"));
    let host_ip = Ipv4Addr::new(10, 201, 237, 1);
    let world_ip = Ipv4Addr::new(10, 201, 237, 2);
    ip(&[
        "link", "add", &host_end, "type", "veth", "peer", "name", &world_end,
    ]);
    ip(&["link", "set", &world_end, "netns", world.to_str().unwrap()]);
    ip(&["addr", "add", &format!("{host_ip}/24"), "dev", &host_end]);
    ip(&["link", "set", &host_end, "up"]);
    let ns = format!("--net={}", world.display());
    for args in [
        vec![
            "ip",
            "addr",
            "add",
            "10.201.237.2/24",
            "dev",
            world_end.as_str(),
        ],
        vec!["ip", "link", "set", world_end.as_str(), "up"],
        vec!["ip", "link", "set", "lo", "up"],
    ] {
        let out = std::process::Command::new("nsenter")
            .arg(&ns)
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // Egress: the connection arrives from the host's address, not 10.201.203.x.
    let _outside = tcp_server(Some(&world), sa(world_ip, 9000), "outside");
    let got = tcp_get(Some(&c.netns_path), sa(world_ip, 9000)).unwrap();
    assert_eq!(got, format!("outside {host_ip}"));

    // From outside: a port published on every host address (0.0.0.0).
    let _web = tcp_server(Some(&c.netns_path), sa(Ipv4Addr::UNSPECIFIED, 80), "web");
    let port = HostPorts::default()
        .allocate(Proto::Tcp, Ipv4Addr::UNSPECIFIED, None)
        .unwrap();
    node.set_published(vec![PublishedPort {
        proto: Proto::Tcp,
        host_ip: Ipv4Addr::UNSPECIFIED,
        host_port: port,
        container_ip: c.ip,
        container_port: 80,
    }])
    .await
    .unwrap();
    let got = tcp_get(Some(&world), sa(host_ip, port)).unwrap();
    assert_eq!(
        got,
        format!("web {world_ip}"),
        "outside clients keep their address"
    );
    // Unsolicited traffic from outside straight to a container is dropped.
    assert!(tcp_get(Some(&world), sa(c.ip, 80)).is_err());

    node.detach("eg1", Some(c.ip)).await.unwrap();
    node.remove_network(s).await.unwrap();
    node.remove_rules().await.unwrap();
}

/// The bridge's hardware address, read with iproute2 (not our code).
fn mac_of(link: &str) -> String {
    let out = std::process::Command::new("ip")
        .args(["-j", "link", "show", "dev", link])
        .output()
        .unwrap();
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    json[0]["address"].as_str().unwrap().to_owned()
}

/// Found by the chaos test (seed 19): a Linux bridge with no address of its
/// own takes the lowest of its ports' and changes it as containers come and
/// go, so a running container's ARP entry for the gateway points at a MAC
/// nobody answers for and its DNS queries time out. The gateway's address
/// is fixed at creation, and pinned on a bridge made before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_keeps_its_hardware_address_while_ports_come_and_go() {
    if !ready("gwmac") {
        return;
    }
    let w = World::new("gwmac");
    let node = w.node();
    let s = Subnet::from_slot(221);
    node.ensure_network("zt-p-gwmac", s).await.unwrap();
    let bridge = w.cfg.bridge_name(s);
    let want = "02:7a:0a:c9:dd:01";
    assert_eq!(mac_of(&bridge), want, "fixed at creation");
    let mut attached = Vec::new();
    for (i, host) in [2u8, 3, 4, 5].into_iter().enumerate() {
        let id = format!("m{i}");
        attached.push((id.clone(), node.attach(&id, s, s.host(host)).await.unwrap()));
        assert_eq!(mac_of(&bridge), want, "after port {i} joined");
    }
    for (id, a) in attached.drain(..2) {
        node.detach(&id, Some(a.ip)).await.unwrap();
        assert_eq!(mac_of(&bridge), want, "after {id} left");
    }
    // A bridge whose address is not ours (made by an older agent) is pinned.
    ip(&[
        "link",
        "set",
        "dev",
        &bridge,
        "address",
        "02:00:00:00:00:99",
    ]);
    node.ensure_network("zt-p-gwmac", s).await.unwrap();
    assert_eq!(mac_of(&bridge), want, "pinned on ensure");
    for (id, a) in attached {
        node.detach(&id, Some(a.ip)).await.unwrap();
    }
    node.remove_network(s).await.unwrap();
    node.remove_rules().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_is_idempotent_and_survives_half_gone_attachments() {
    if !ready("crash") {
        return;
    }
    let w = World::new("crash");
    let node = w.node();
    let s = Subnet::from_slot(204);
    node.ensure_network("zt-p-crash", s).await.unwrap();

    // The namespace file is already gone.
    let a = node.attach("k1", s, s.host(2)).await.unwrap();
    nsfile::remove(&a.netns_path).unwrap();
    node.detach("k1", Some(a.ip)).await.unwrap();
    assert!(!link_exists(&a.host_veth));
    assert!(!a.netns_path.exists());

    // The veth is already gone.
    let b = node.attach("k2", s, s.host(3)).await.unwrap();
    ip(&["link", "del", &b.host_veth]);
    node.detach("k2", Some(b.ip)).await.unwrap();
    assert!(!b.netns_path.exists());

    // Nothing is left at all, twice; and without knowing the address.
    node.detach("k2", Some(b.ip)).await.unwrap();
    node.detach("never-attached", None).await.unwrap();

    // Attaching over leftovers of a crashed attach (same id, same address).
    let c = node.attach("k3", s, s.host(4)).await.unwrap();
    let again = node.attach("k3", s, s.host(4)).await.unwrap();
    assert_eq!(c, again);
    assert_eq!(eth0_of(&again.netns_path), s.host(4));
    node.detach("k3", Some(c.ip)).await.unwrap();
    assert!(!link_exists(&c.host_veth));

    // Attaching to a network that was never ensured says so.
    let err = node
        .attach("k4", Subnet::from_slot(210), Subnet::from_slot(210).host(2))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::NoNetwork(_)), "{err}");
    // An address outside the subnet or on the gateway is refused, and leaves nothing.
    assert!(matches!(
        node.attach("k5", s, s.gateway()).await,
        Err(Error::IpOutside { .. })
    ));
    assert!(!w.cfg.netns_path("k5").unwrap().exists());

    node.remove_network(s).await.unwrap();
    node.remove_rules().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_removes_crash_leftovers_and_keeps_live_attachments() {
    if !ready("gc") {
        return;
    }
    let w = World::new("gc");
    let node = w.node();
    let s = Subnet::from_slot(211);
    let empty = Subnet::from_slot(212);
    node.ensure_network("zt-p-gc", s).await.unwrap();
    node.ensure_network("zt-p-gcempty", empty).await.unwrap();
    let live = node.attach("live", s, s.host(2)).await.unwrap();
    let dead = node.attach("dead", s, s.host(3)).await.unwrap();

    // Crash leftovers: a namespace file with no eth0 (killed before the veth
    // was made), a veth of ours off any bridge, a file that is no mount.
    let half = w.cfg.netns_path("half").unwrap();
    nsfile::create(&half).await.unwrap();
    let (hv, pv) = (w.cfg.host_veth_name(s.host(9)), w.extra_ifname("p"));
    ip(&["link", "add", &hv, "type", "veth", "peer", "name", &pv]);
    std::fs::write(w.cfg.netns_path("stale").unwrap(), b"").unwrap();
    // A bridge whose ensure was killed before it was renamed into place.
    let unfinished = format!("{}t", w.cfg.bridge_name(Subnet::from_slot(218)));
    ip(&["link", "add", &unfinished, "type", "bridge"]);
    // A whole attachment whose namespace file is gone while something still
    // holds the namespace open: its veth lives on, tied to no file.
    let ghost = node.attach("ghost", s, s.host(5)).await.unwrap();
    let holder = std::fs::File::open(&ghost.netns_path).unwrap();
    nsfile::remove(&ghost.netns_path).unwrap();
    assert!(link_exists(&ghost.host_veth));

    let inv = inventory::read(&node).await.unwrap();
    assert!(inv.table_present);
    // Kernel only: what is provably broken, and the empty bridge.
    let plan = inventory::plan(&inv, None);
    let netns: BTreeSet<_> = plan
        .netns
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        netns,
        BTreeSet::from(["half".to_owned(), "stale".to_owned()])
    );
    assert_eq!(
        BTreeSet::from_iter(plan.veths.clone()),
        BTreeSet::from([hv.clone(), ghost.host_veth.clone()])
    );
    assert_eq!(
        BTreeSet::from_iter(plan.bridges.clone()),
        BTreeSet::from([w.cfg.bridge_name(empty), unfinished.clone()])
    );
    assert!(!plan.delete_table);
    // With the live set known, the dead container goes too.
    let keep = BTreeSet::from(["live".to_owned()]);
    let plan = inventory::plan(&inv, Some(&keep));
    assert!(plan.netns.contains(&dead.netns_path));
    assert!(plan.veths.contains(&dead.host_veth));
    inventory::apply(&node, &plan).await.unwrap();

    assert!(!half.exists() && !dead.netns_path.exists());
    assert!(!link_exists(&hv) && !link_exists(&pv) && !link_exists(&dead.host_veth));
    assert!(!link_exists(&ghost.host_veth));
    drop(holder);
    assert!(!link_exists(&w.cfg.bridge_name(empty)) && !link_exists(&unfinished));
    assert!(live.netns_path.exists() && link_exists(&live.host_veth));
    let after = inventory::read(&node).await.unwrap();
    assert!(
        inventory::plan(&after, Some(&keep)).is_empty(),
        "{:?}",
        inventory::plan(&after, Some(&keep))
    );

    // Once the last container goes, gc takes the bridge and the table.
    node.detach("live", Some(live.ip)).await.unwrap();
    let plan = inventory::plan(&inventory::read(&node).await.unwrap(), None);
    assert!(plan.delete_table);
    inventory::apply(&node, &plan).await.unwrap();
    assert!(!link_exists(&w.cfg.bridge_name(s)));
    assert!(node.nft().list().await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_containers_on_one_bridge() {
    if !ready("many") {
        return;
    }
    let w = World::new("many");
    let node = w.node();
    let s = Subnet::from_slot(205);
    let net = node.ensure_network("zt-p-many", s).await.unwrap();
    let mut ipam = Ipam::default();
    let mut atts = Vec::new();
    for i in 0..200 {
        let id = format!("m{i}");
        let ip = ipam.allocate(s, &id).unwrap();
        atts.push(node.attach(&id, s, ip).await.unwrap());
    }
    let ips: BTreeSet<_> = atts.iter().map(|a| a.ip).collect();
    assert_eq!(ips.len(), 200);
    // A second bridge with a port of its own: the kernel-filtered dumps
    // must tell the two apart.
    let other = Subnet::from_slot(199);
    node.ensure_network("zt-p-many2", other).await.unwrap();
    let lone = node
        .attach("lone", other, ipam.allocate(other, "lone").unwrap())
        .await
        .unwrap();
    let ports = ports_on(&node, s).await;
    assert_eq!(ports.len(), 200);
    assert!(ports.iter().all(|p| p.mtu == net.mtu));
    assert_eq!(ports_on(&node, other).await.len(), 1);
    let bridges = node.netlink().bridges().await.unwrap();
    assert!(
        bridges.iter().all(zattera_netns::netlink::Link::is_bridge),
        "{bridges:?}"
    );
    for subnet in [s, other] {
        let name = node.config().bridge_name(subnet);
        assert!(
            bridges.iter().any(|b| b.name == name),
            "{name} not in {bridges:?}"
        );
    }
    assert_eq!(
        zattera_netns::inventory::scoped_bridges(&node)
            .await
            .unwrap()
            .into_iter()
            .filter(|b| [s, other].contains(b))
            .count(),
        2
    );
    node.detach(&lone.container_id, Some(lone.ip))
        .await
        .unwrap();
    node.remove_network(other).await.unwrap();
    // Spot-check both ends of the range.
    for a in [&atts[0], &atts[199]] {
        assert_eq!(eth0_of(&a.netns_path), a.ip);
    }
    let _srv = tcp_server(Some(&atts[0].netns_path), sa(atts[0].ip, 7100), "first");
    assert!(
        tcp_get(Some(&atts[199].netns_path), sa(atts[0].ip, 7100))
            .unwrap()
            .starts_with("first")
    );
    for a in &atts {
        node.detach(&a.container_id, Some(a.ip)).await.unwrap();
        ipam.release(&a.container_id, a.ip);
    }
    assert!(ports_on(&node, s).await.is_empty());
    assert_eq!(std::fs::read_dir(&w.cfg.netns_dir).unwrap().count(), 0);
    node.remove_network(s).await.unwrap();
    node.remove_rules().await.unwrap();
}

async fn ports_on(node: &NetNode, s: Subnet) -> Vec<zattera_netns::netlink::Link> {
    node.netlink()
        .ports_of(net_index(node, s).await)
        .await
        .unwrap()
}

async fn net_index(node: &NetNode, s: Subnet) -> u32 {
    node.netlink()
        .link(&node.config().bridge_name(s))
        .await
        .unwrap()
        .unwrap()
        .index
}

/// Not a test on its own: the child process of the SIGKILL test, which
/// attaches containers in a loop until it is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by sigkill_in_the_middle_of_attach_then_gc_leaves_nothing"]
async fn sigkill_child_attach_loop() {
    let (Ok(prefix), Ok(table), Ok(dir)) = (
        std::env::var("ZT_CHILD_PREFIX"),
        std::env::var("ZT_CHILD_TABLE"),
        std::env::var("ZT_CHILD_NETNS_DIR"),
    ) else {
        panic!("only run by the SIGKILL test");
    };
    let node = NetNode::new(NetConfig {
        bridge_prefix: prefix,
        nft_table: table,
        netns_dir: dir.into(),
        ..NetConfig::default()
    })
    .unwrap();
    let s = Subnet::from_slot(216);
    for i in 2..200u8 {
        node.attach(&format!("k{i}"), s, s.host(i)).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_in_the_middle_of_attach_then_gc_leaves_nothing() {
    if !ready("sigkill") {
        return;
    }
    let before = foreign_ruleset();
    let w = World::new("sigkill");
    let node = w.node();
    let s = Subnet::from_slot(216);
    node.ensure_network("zt-p-kill", s).await.unwrap();
    node.set_published(vec![PublishedPort {
        proto: Proto::Tcp,
        host_ip: Ipv4Addr::LOCALHOST,
        host_port: 18_216,
        container_ip: s.host(2),
        container_port: 80,
    }])
    .await
    .unwrap();

    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "sigkill_child_attach_loop",
            "--ignored",
            "--nocapture",
        ])
        .env("ZT_CHILD_PREFIX", &w.prefix)
        .env("ZT_CHILD_TABLE", &w.table)
        .env("ZT_CHILD_NETNS_DIR", &w.cfg.netns_dir)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Let it get going, then kill it at an arbitrary point of an attach.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while std::fs::read_dir(&w.cfg.netns_dir).map_or(0, Iterator::count) < 5 {
        assert!(
            std::time::Instant::now() < deadline,
            "the child never attached"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the child exited early"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let jitter = u64::from(std::process::id() % 17);
    std::thread::sleep(std::time::Duration::from_millis(jitter));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap()),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    child.wait().unwrap();

    // "Restart": a new node. Kernel-only gc leaves only whole attachments.
    let node = w.node();
    let plan = inventory::plan(&inventory::read(&node).await.unwrap(), None);
    eprintln!("kernel-only gc after SIGKILL: {plan:?}");
    inventory::apply(&node, &plan).await.unwrap();
    let inv = inventory::read(&node).await.unwrap();
    for ns in &inv.netns {
        assert!(
            ns.mounted && ns.ip.is_some(),
            "half-built namespace left: {ns:?}"
        );
    }
    for v in &inv.veths {
        assert!(
            v.bridge.is_some() && v.peer_elsewhere,
            "half-built veth left: {v:?}"
        );
    }
    // The agent owns no container (none was ever created): everything goes.
    let plan = inventory::plan(&inv, Some(&BTreeSet::new()));
    inventory::apply(&node, &plan).await.unwrap();
    let inv = inventory::read(&node).await.unwrap();
    assert!(inv.netns.is_empty(), "{:?}", inv.netns);
    assert!(inv.veths.is_empty(), "{:?}", inv.veths);
    assert!(inv.bridges.is_empty(), "{:?}", inv.bridges);
    assert!(!inv.table_present);
    assert_eq!(std::fs::read_dir(&w.cfg.netns_dir).unwrap().count(), 0);
    assert_eq!(
        before,
        foreign_ruleset(),
        "the host's ruleset outside our tables changed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_ensures_of_one_network_both_succeed() {
    if !ready("race") {
        return;
    }
    let w = World::new("race");
    let n1 = w.node();
    let s = Subnet::from_slot(217);
    for _ in 0..5 {
        let (a, b) = tokio::join!(
            n1.ensure_network("zt-p-race", s),
            n1.ensure_network("zt-p-race", s)
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a, b);
        n1.remove_network(s).await.unwrap();
    }
    n1.remove_rules().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_a_udp_port_forgets_the_old_flow() {
    if !ready("udpmove") {
        return;
    }
    let w = World::new("udpmove");
    let node = w.node();
    let s = Subnet::from_slot(219);
    node.ensure_network("zt-p-udp", s).await.unwrap();
    let c1 = node.attach("u1", s, s.host(2)).await.unwrap();
    let c2 = node.attach("u2", s, s.host(3)).await.unwrap();
    let _s1 = udp_server(Some(&c1.netns_path), sa(Ipv4Addr::UNSPECIFIED, 53), "c1");
    let _s2 = udp_server(Some(&c2.netns_path), sa(Ipv4Addr::UNSPECIFIED, 53), "c2");
    let port = HostPorts::default()
        .allocate(Proto::Udp, Ipv4Addr::LOCALHOST, None)
        .unwrap();
    let to = |c: &zattera_netns::Attachment| PublishedPort {
        proto: Proto::Udp,
        host_ip: Ipv4Addr::LOCALHOST,
        host_port: port,
        container_ip: c.ip,
        container_port: 53,
    };
    // One client socket, so both sends belong to the same conntrack flow.
    let client = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    client
        .set_read_timeout(Some(std::time::Duration::from_millis(700)))
        .unwrap();
    let ask = || {
        let mut buf = [0u8; 16];
        for _ in 0..3 {
            client.send_to(b"q", (Ipv4Addr::LOCALHOST, port)).unwrap();
            if let Ok(n) = client.recv(&mut buf) {
                return String::from_utf8_lossy(&buf[..n]).into_owned();
            }
        }
        panic!("no UDP answer on 127.0.0.1:{port}");
    };
    node.set_published(vec![to(&c1)]).await.unwrap();
    assert_eq!(ask(), "c1");
    node.set_published(vec![to(&c2)]).await.unwrap();
    assert_eq!(
        ask(),
        "c2",
        "the old flow kept its DNAT to the first container"
    );

    for c in [&c1, &c2] {
        node.detach(&c.container_id, Some(c.ip)).await.unwrap();
    }
    node.remove_network(s).await.unwrap();
    node.remove_rules().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_published_after_a_host_server_reaches_the_container_from_its_old_clients() {
    if !ready("stalect") {
        return;
    }
    let w = World::new("stalect");
    let node = w.node();
    let s = Subnet::from_slot(220);
    node.ensure_network("zt-p-stale", s).await.unwrap();
    let c = node.attach("s1", s, s.host(2)).await.unwrap();
    let _web = tcp_server(Some(&c.netns_path), sa(Ipv4Addr::UNSPECIFIED, 80), "web");

    // A host process serves a port, and a client talks to it from port S;
    // both ends close with a reset, so conntrack keeps a CLOSE entry.
    let lo = Ipv4Addr::LOCALHOST;
    let rst = |sock: &Socket| sock.set_linger(Some(std::time::Duration::ZERO)).unwrap();
    let listener = std::net::TcpListener::bind((lo, 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    let client = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    rst(&client);
    client.bind(&sa(lo, 0).into()).unwrap();
    let client_port = client.local_addr().unwrap().as_socket().unwrap().port();
    client.connect(&sa(lo, port).into()).unwrap();
    let (served, _) = listener.accept().unwrap();
    rst(&Socket::from(served));
    drop(client);
    drop(listener);

    // The port is then published, and that client comes back from port S.
    let mut ports = HostPorts::default();
    ports.allocate(Proto::Tcp, lo, Some(port)).unwrap();
    node.set_published(vec![PublishedPort {
        proto: Proto::Tcp,
        host_ip: lo,
        host_port: port,
        container_ip: c.ip,
        container_port: 80,
    }])
    .await
    .unwrap();
    let again = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
    again.set_reuse_address(true).unwrap();
    again.bind(&sa(lo, client_port).into()).unwrap();
    again
        .connect_timeout(&sa(lo, port).into(), std::time::Duration::from_secs(2))
        .unwrap_or_else(|e| panic!("the stale flow kept the client from the container: {e}"));
    let mut reply = String::new();
    std::io::Read::read_to_string(&mut std::net::TcpStream::from(again), &mut reply).unwrap();
    assert!(reply.starts_with("web "), "{reply}");

    node.detach(&c.container_id, Some(c.ip)).await.unwrap();
    node.remove_network(s).await.unwrap();
    node.remove_rules().await.unwrap();
}

/// Found on a Debian 12 guest (kernel 6.1): the bridge is built under a
/// temporary name and renamed into place, and kernels before 6.2 refuse to
/// rename a link that is up (EBUSY), so no network came up there. A new
/// bridge must be down until the build brings it up under its real name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_bridge_is_down_so_that_any_kernel_renames_it() {
    if !ready("brdown") {
        return;
    }
    let w = World::new("brdown");
    let node = w.node();
    let name = w.extra_ifname("b");
    node.netlink().create_bridge(&name, None).await.unwrap();
    let link = node.netlink().link(&name).await.unwrap().unwrap();
    assert!(!link.up, "{name} was created up");
    // And the network built from one ends up, under its real name.
    let s = Subnet::from_slot(222);
    let net = node.ensure_network("zt-p-brdown", s).await.unwrap();
    let built = node.netlink().link(&net.bridge).await.unwrap().unwrap();
    assert!(built.up, "{} is not up", net.bridge);
    node.remove_network(s).await.unwrap();
    node.remove_rules().await.unwrap();
}
