//! Internal answers seen by a real client (dig) on loopback listeners:
//! table swaps, truncation and TCP, EDNS, rotation. Addresses 127.77.1-9.x.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use support::{PORT, dig_async, require, serve_on, test_config};
use zattera_dns::{DnsServer, LocalInstance, NameTable, RouteService, Scope};

fn route(fqdn: &str, vip: &str) -> RouteService {
    RouteService {
        fqdn: fqdn.into(),
        project_id: "proj-1".into(),
        environment_id: "env-id-of-some-app".into(),
        vip: vip.into(),
    }
}

fn prod() -> Scope {
    Scope::new("proj-1", "production")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_update_changes_answers_at_once() {
    if !require("a_table_update_changes_answers_at_once", false, &["dig"]) {
        return;
    }
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 1, 1));
    let server = DnsServer::new(test_config(vec![])).unwrap();
    serve_on(&server, ip, prod()).await;
    let at = SocketAddr::new(ip, PORT);

    // Before the first snapshot every internal name is NXDOMAIN.
    let d = dig_async(at, &["+tries=1", "+time=2", "db.internal"]).await;
    assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);

    server.set_table(NameTable::from_routes(&[route(
        "db.production.shop.internal.",
        "10.97.0.5",
    )]));
    let d = dig_async(at, &["+tries=1", "+time=2", "db.internal"]).await;
    assert_eq!(d.status, "NOERROR", "{}", d.raw);
    assert_eq!(d.addrs(), vec!["10.97.0.5"]);
    assert!(d.has_flag("aa"), "{}", d.raw);
    assert_eq!(d.answers[0].1, 5, "TTL 5");

    for round in 0..20u8 {
        let vip = format!("10.97.1.{round}");
        server.set_table(NameTable::from_routes(&[route(
            "db.production.shop.internal.",
            &vip,
        )]));
        // No sleep: the very next query sees the new table.
        let d = dig_async(at, &["+tries=1", "+time=2", "db.production.shop.internal"]).await;
        assert_eq!(d.addrs(), vec![vip], "{}", d.raw);
    }
    server.set_table(NameTable::empty());
    let d = dig_async(at, &["+tries=1", "+time=2", "db.internal"]).await;
    assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_types_and_case_follow_the_rules() {
    if !require("names_types_and_case_follow_the_rules", false, &["dig"]) {
        return;
    }
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 2, 1));
    let server = DnsServer::new(test_config(vec![])).unwrap();
    serve_on(&server, ip, Scope::new("proj-1", "Production")).await;
    server.set_table(NameTable::from_routes(&[
        route("db.production.shop.internal.", "10.97.0.5"),
        route("db.staging.shop.internal.", "10.97.0.6"),
    ]));
    let at = SocketAddr::new(ip, PORT);
    let q = |args: &'static [&'static str]| dig_async(at, args);

    let d = q(&["+tries=1", "+time=2", "DB.Production.SHOP.internal"]).await;
    assert_eq!(d.addrs(), vec!["10.97.0.5"], "{}", d.raw);
    // Owner name as the client wrote it.
    assert_eq!(d.answers[0].0, "DB.Production.SHOP.internal.");
    let d = q(&["+tries=1", "+time=2", "db.internal", "AAAA"]).await;
    assert_eq!(d.status, "NOERROR", "{}", d.raw);
    assert!(d.answers.is_empty(), "{}", d.raw);
    assert!(d.has_flag("aa"));
    let d = q(&["+tries=1", "+time=2", "db.internal", "TXT"]).await;
    assert_eq!((d.status.as_str(), d.answers.len()), ("NOERROR", 0));
    let d = q(&["+tries=1", "+time=2", "db.internal", "ANY"]).await;
    assert_eq!(d.addrs(), vec!["10.97.0.5"], "{}", d.raw);
    for name in [
        "nope.internal",
        "db.staging.shop.internal",
        "internal",
        "db.shop.internal",
        "x.db.production.shop.internal",
    ] {
        let d = dig_async(at, &["+tries=1", "+time=2", name]).await;
        assert_eq!(d.status, "NXDOMAIN", "{name}: {}", d.raw);
        assert!(d.answers.is_empty());
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn big_answers_truncate_over_udp_and_complete_over_tcp() {
    if !require(
        "big_answers_truncate_over_udp_and_complete_over_tcp",
        false,
        &["dig"],
    ) {
        return;
    }
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 3, 1));
    let server = DnsServer::new(test_config(vec![])).unwrap();
    serve_on(&server, ip, prod()).await;
    let instances: Vec<LocalInstance> = (1..=100u8)
        .map(|i| LocalInstance {
            project_id: "proj-1".into(),
            project_name: "shop".into(),
            environment: "production".into(),
            app: "web".into(),
            ip: Ipv4Addr::new(10, 201, 9, i),
        })
        .collect();
    server.set_table(NameTable::from_instances(&instances));
    let at = SocketAddr::new(ip, PORT);

    // Plain UDP, no EDNS, no TCP retry: truncated, no answers.
    let d = dig_async(
        at,
        &["+tries=1", "+time=2", "+noedns", "+ignore", "web.internal"],
    )
    .await;
    assert!(d.has_flag("tc"), "{}", d.raw);
    assert!(d.answers.is_empty(), "{}", d.raw);
    // EDNS with a big buffer: still over our 1232 cap, so truncated too.
    let d = dig_async(
        at,
        &[
            "+tries=1",
            "+time=2",
            "+bufsize=4096",
            "+ignore",
            "web.internal",
        ],
    )
    .await;
    assert!(d.has_flag("tc"), "{}", d.raw);
    assert_eq!(d.edns_udp, Some(1232), "{}", d.raw);
    // Over TCP, and dig's own retry after TC: all 100.
    let tcp = dig_async(at, &["+tries=1", "+time=2", "+tcp", "web.internal"]).await;
    assert_eq!(tcp.addrs().len(), 100, "{}", tcp.raw);
    assert!(!tcp.has_flag("tc"));
    let retried = dig_async(at, &["+tries=1", "+time=2", "web.internal"]).await;
    assert_eq!(retried.addrs().len(), 100, "{}", retried.raw);
    // The order rotates per answer.
    let again = dig_async(at, &["+tries=1", "+time=2", "+tcp", "web.internal"]).await;
    assert_ne!(tcp.addrs()[0], again.addrs()[0]);
    let mut sorted = again.addrs();
    sorted.sort();
    let mut first = tcp.addrs();
    first.sort();
    assert_eq!(sorted, first);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edns_is_answered_correctly() {
    if !require("edns_is_answered_correctly", false, &["dig"]) {
        return;
    }
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 4, 1));
    let server = DnsServer::new(test_config(vec![])).unwrap();
    serve_on(&server, ip, prod()).await;
    server.set_table(NameTable::from_routes(&[route(
        "db.production.shop.internal.",
        "10.97.0.5",
    )]));
    let at = SocketAddr::new(ip, PORT);
    let d = dig_async(at, &["+tries=1", "+time=2", "+edns=0", "db.internal"]).await;
    assert_eq!(d.edns_udp, Some(1232), "{}", d.raw);
    assert_eq!(d.addrs(), vec!["10.97.0.5"]);
    let d = dig_async(at, &["+tries=1", "+time=2", "+noedns", "db.internal"]).await;
    assert_eq!(d.edns_udp, None, "{}", d.raw);
    assert_eq!(d.addrs(), vec!["10.97.0.5"]);
    let d = dig_async(
        at,
        &[
            "+tries=1",
            "+time=2",
            "+edns=1",
            "+noednsnegotiation",
            "db.internal",
        ],
    )
    .await;
    assert_eq!(d.status, "BADVERS", "{}", d.raw);
    server.shutdown().await;
}
