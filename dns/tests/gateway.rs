//! Listeners on port 53 of real bridge gateways the tests create, asked by
//! dig from the host and by busybox nslookup from inside a network
//! namespace on the bridge (a container without the container runtime).
//!
//! Each test owns its bridges 10.201.<240+n>.0/24, its link and namespace
//! names (`ztd<tag>…`), and a dnsmasq upstream on 127.77.<20+n>.2.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use support::{DNSMASQ, Dnsmasq, NetGuard, PORT, dig_async, nslookup_in, require, test_config};
use zattera_dns::{Config, DnsServer, ListenerSpec, ListenerState, NameTable, RouteService, Scope};

const TOOLS: &[&str] = &["ip", "dig", "busybox", DNSMASQ];

fn route(fqdn: &str, project: &str, vip: &str) -> RouteService {
    RouteService {
        fqdn: fqdn.into(),
        project_id: project.into(),
        environment_id: format!("id-of-{fqdn}"),
        vip: vip.into(),
    }
}

fn config(upstream: SocketAddr) -> Config {
    Config {
        port: 53,
        ..test_config(vec![upstream])
    }
}

fn at(gw: Ipv4Addr) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(gw), 53)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_environments_are_isolated_on_their_gateways() {
    if !require(
        "two_environments_are_isolated_on_their_gateways",
        true,
        TOOLS,
    ) {
        return;
    }
    let mut net = NetGuard::default();
    let gw_prod = Ipv4Addr::new(10, 201, 240, 1);
    let gw_stag = Ipv4Addr::new(10, 201, 241, 1);
    net.bridge("ztdiso0b", gw_prod);
    net.bridge("ztdiso1b", gw_stag);
    net.container(
        "ztdiso0",
        "ztdiso0b",
        Ipv4Addr::new(10, 201, 240, 2),
        gw_prod,
    );
    net.container(
        "ztdiso1",
        "ztdiso1b",
        Ipv4Addr::new(10, 201, 241, 2),
        gw_stag,
    );
    let upstream = Dnsmasq::start(Ipv4Addr::new(127, 77, 20, 2), PORT, &[]);

    let server = DnsServer::new(config(upstream.addr)).unwrap();
    let status = server
        .reconcile(vec![
            ListenerSpec {
                addr: gw_prod.into(),
                scope: Scope::new("proj-1", "production"),
            },
            ListenerSpec {
                addr: gw_stag.into(),
                scope: Scope::new("proj-1", "staging"),
            },
        ])
        .await;
    assert!(
        status.iter().all(zattera_dns::ListenerStatus::is_serving),
        "{status:?}"
    );
    // Two apps' environments named alike share a scope (D-7): api finds db.
    server.set_table(NameTable::from_routes(&[
        route("db.production.shop.internal.", "proj-1", "10.97.0.5"),
        route("api.production.shop.internal.", "proj-1", "10.97.0.7"),
        route("db.staging.shop.internal.", "proj-1", "10.97.0.6"),
        route("db.production.other.internal.", "proj-2", "10.97.0.9"),
    ]));

    // From the host.
    let q = |gw, name: &'static str| dig_async(at(gw), &["+tries=1", "+time=3", name]);
    assert_eq!(q(gw_prod, "db.internal").await.addrs(), vec!["10.97.0.5"]);
    assert_eq!(q(gw_stag, "db.internal").await.addrs(), vec!["10.97.0.6"]);
    assert_eq!(q(gw_prod, "api.internal").await.addrs(), vec!["10.97.0.7"]);
    assert_eq!(q(gw_stag, "api.internal").await.status, "NXDOMAIN");
    assert_eq!(
        q(gw_prod, "db.production.shop.internal").await.addrs(),
        vec!["10.97.0.5"]
    );
    assert_eq!(
        q(gw_prod, "db.staging.shop.internal").await.status,
        "NXDOMAIN"
    );
    assert_eq!(
        q(gw_stag, "db.staging.shop.internal").await.addrs(),
        vec!["10.97.0.6"]
    );
    assert_eq!(
        q(gw_prod, "db.production.other.internal").await.status,
        "NXDOMAIN"
    );
    let d = dig_async(at(gw_prod), &["+tries=1", "+time=3", "+tcp", "db.internal"]).await;
    assert_eq!(d.addrs(), vec!["10.97.0.5"], "{}", d.raw);

    // From inside each "container", with busybox's resolver.
    let (ok, out) = nslookup_in("ztdiso0", "db.internal", gw_prod).await;
    assert!(ok && out.contains("10.97.0.5"), "{out}");
    let (ok, out) = nslookup_in("ztdiso1", "db.internal", gw_stag).await;
    assert!(
        ok && out.contains("10.97.0.6") && !out.contains("10.97.0.5"),
        "{out}"
    );
    let (_, out) = nslookup_in("ztdiso1", "db.production.shop.internal", gw_stag).await;
    assert!(
        out.contains("NXDOMAIN") && !out.contains("10.97.0.5"),
        "{out}"
    );
    // Other names reach the upstream through the gateway.
    let (ok, out) = nslookup_in("ztdiso0", "www.example.test", gw_prod).await;
    assert!(ok && out.contains("192.0.2.1"), "{out}");

    server.shutdown().await;
    drop(net);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_follow_reconcile_and_close_when_removed() {
    if !require(
        "listeners_follow_reconcile_and_close_when_removed",
        true,
        TOOLS,
    ) {
        return;
    }
    let mut net = NetGuard::default();
    let gw = Ipv4Addr::new(10, 201, 242, 1);
    let upstream = Dnsmasq::start(Ipv4Addr::new(127, 77, 22, 2), PORT, &[]);
    let server = DnsServer::new(Config {
        // Without IP_FREEBIND a gateway that is not up yet fails to bind.
        freebind: false,
        ..config(upstream.addr)
    })
    .unwrap();
    server.set_table(NameTable::from_routes(&[
        route("db.production.shop.internal.", "proj-1", "10.97.0.5"),
        route("db.staging.shop.internal.", "proj-1", "10.97.0.6"),
    ]));
    let spec = |env: &str| {
        vec![ListenerSpec {
            addr: gw.into(),
            scope: Scope::new("proj-1", env),
        }]
    };

    // The bridge does not exist yet: reported, not fatal.
    let status = server.reconcile(spec("production")).await;
    match &status[0].state {
        ListenerState::Failed(e) => {
            assert_eq!(e.kind(), std::io::ErrorKind::AddrNotAvailable, "{e}");
            assert!(e.to_string().contains("10.201.242.1:53"), "{e}");
        }
        ListenerState::Serving => panic!("bound an address that does not exist"),
    }
    // The bridge appears: the next reconcile retries and serves.
    net.bridge("ztdrecb", gw);
    let status = server.reconcile(spec("production")).await;
    assert!(status[0].is_serving(), "{status:?}");
    let q = || dig_async(at(gw), &["+tries=1", "+time=2", "db.internal"]);
    assert_eq!(q().await.addrs(), vec!["10.97.0.5"]);

    // Same gateway, new scope: answers switch without a rebind.
    let status = server.reconcile(spec("staging")).await;
    assert!(status[0].is_serving());
    assert_eq!(q().await.addrs(), vec!["10.97.0.6"]);

    // Removed: both ports are closed.
    assert!(server.reconcile(vec![]).await.is_empty());
    assert!(server.serving().await.is_empty());
    let d = q().await;
    assert!(d.status.is_empty(), "still answering: {}", d.raw);
    let tcp = std::net::TcpStream::connect_timeout(&at(gw), Duration::from_secs(1));
    assert!(tcp.is_err(), "tcp still open");

    // And it can come back on the same address at once.
    let status = server.reconcile(spec("production")).await;
    assert!(status[0].is_serving(), "{status:?}");
    assert_eq!(q().await.addrs(), vec!["10.97.0.5"]);
    server.shutdown().await;
    drop(net);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_held_by_another_process_is_reported_and_retried() {
    if !require(
        "a_port_held_by_another_process_is_reported_and_retried",
        false,
        &["dig"],
    ) {
        return;
    }
    // Loopback and a high port: no root needed for this one.
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 23, 1));
    let squatter = std::net::UdpSocket::bind(SocketAddr::new(ip, PORT)).unwrap();
    let server = DnsServer::new(test_config(vec![])).unwrap();
    let spec = vec![ListenerSpec {
        addr: ip,
        scope: Scope::new("p", "e"),
    }];
    let status = server.reconcile(spec.clone()).await;
    match &status[0].state {
        ListenerState::Failed(e) => {
            assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
            assert!(e.to_string().contains("another process"), "{e}");
        }
        ListenerState::Serving => panic!("bound a held port"),
    }
    // Nothing half-open was left behind: TCP is not listening either.
    assert!(std::net::TcpStream::connect(SocketAddr::new(ip, PORT)).is_err());
    drop(squatter);
    let status = server.reconcile(spec).await;
    assert!(status[0].is_serving(), "{status:?}");
    let d = dig_async(
        SocketAddr::new(ip, PORT),
        &["+tries=1", "+time=2", "x.internal"],
    )
    .await;
    assert_eq!(d.status, "NXDOMAIN", "{}", d.raw);
    server.shutdown().await;
}
