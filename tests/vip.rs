//! The VIP proxy against real netlink and sockets: a route snapshot puts its
//! VIP on the agent's VIP interface, a connection to `VIP:port` reaches a
//! healthy endpoint, no healthy endpoint closes the client at once, and a
//! snapshot without the service removes the address again.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use zattera_agent::proto::cluster::{Endpoint, InternalPort, InternalService, RouteSnapshot};
use zattera_netns::{NetConfig, NetNode};

fn snapshot(version: u64, vip: &str, endpoint: &str, healthy: bool) -> RouteSnapshot {
    RouteSnapshot {
        version,
        internal_services: vec![InternalService {
            fqdn: "web.prod.shop.internal.".into(),
            project_id: "p".into(),
            environment_id: "e".into(),
            vip: vip.into(),
            ports: vec![InternalPort {
                name: "http".into(),
                port: 18080,
                protocol: "tcp".into(),
                endpoints: vec![Endpoint {
                    addr: endpoint.into(),
                    healthy,
                    ..Endpoint::default()
                }],
            }],
        }],
        ..RouteSnapshot::default()
    }
}

fn vip_addresses(ifname: &str) -> String {
    let out = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show", "dev", ifname])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    for _ in 0..100 {
        if ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn vip_connections_reach_healthy_endpoints_only() {
    let Some(_rig) = support::rig() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut cfg =
        NetConfig::for_namespace(&format!("zt-test-vip-{}", std::process::id()), dir.path())
            .unwrap();
    cfg.bridge_prefix = "ztvp".into();
    let _cleanup = support::NetCleanup {
        prefix: "ztvp".into(),
        table: cfg.nft_table.clone(),
        run_dir: dir.path().to_path_buf(),
    };
    let net = Arc::new(NetNode::new(cfg).unwrap());

    // The endpoint: an echo server on loopback, as a published port would be.
    let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = echo.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = echo.accept().await.unwrap();
            tokio::spawn(async move {
                let mut buf = [0u8; 64];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let _ = s.write_all(&buf[..n]).await;
            });
        }
    });

    let vip = "10.97.250.7";
    let (tx, rx) = tokio::sync::watch::channel(Some(Arc::new(snapshot(1, vip, &endpoint, true))));
    let (_networks_tx, networks) = tokio::sync::watch::channel(Arc::new(Vec::new()));
    let connections = prometheus_client::metrics::counter::Counter::<u64>::default();
    let shutdown = tokio_util::sync::CancellationToken::new();
    let proxy = tokio::spawn(zattera_agent::control::vip::run(
        Arc::clone(&net),
        rx,
        networks,
        connections.clone(),
        shutdown.clone(),
    ));
    wait_until("the VIP on ztvpvip", || {
        vip_addresses("ztvpvip").contains("10.97.250.7/32")
    })
    .await;

    let mut reply = Vec::new();
    for _ in 0..50 {
        if let Ok(mut s) = TcpStream::connect((vip.parse::<Ipv4Addr>().unwrap(), 18080)).await {
            s.write_all(b"ping").await.unwrap();
            reply.clear();
            let _ = s.read_to_end(&mut reply).await;
            if reply == b"ping" {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(reply, b"ping", "the VIP reaches the endpoint");

    // No healthy endpoint: the client is closed at once.
    tx.send(Some(Arc::new(snapshot(2, vip, &endpoint, false))))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut s = TcpStream::connect((vip.parse::<Ipv4Addr>().unwrap(), 18080))
        .await
        .unwrap();
    let mut buf = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut buf))
        .await
        .unwrap()
        .unwrap_or(0);
    assert_eq!(n, 0, "closed without data");
    // Every accepted connection is counted (zattera_vip_connections).
    assert!(
        connections.get() >= 2,
        "{} connections counted",
        connections.get()
    );

    // The service leaves the snapshot: listener closed, address removed.
    tx.send(Some(Arc::new(RouteSnapshot {
        version: 3,
        ..RouteSnapshot::default()
    })))
    .unwrap();
    wait_until("the VIP removed", || {
        !vip_addresses("ztvpvip").contains("10.97.250.7")
    })
    .await;

    // 44.8: an endpoint gone since the snapshot (a closed port) is
    // retried once on another: every client still gets through.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let mut two = snapshot(4, vip, &endpoint, true);
    let mut gone = two.internal_services[0].ports[0].endpoints[0].clone();
    gone.addr = dead;
    two.internal_services[0].ports[0].endpoints.insert(0, gone);
    tx.send(Some(Arc::new(two))).unwrap();
    wait_until("the VIP back", || {
        vip_addresses("ztvpvip").contains("10.97.250.7/32")
    })
    .await;
    let mut answered = 0;
    for _ in 0..20 {
        let mut s = loop {
            if let Ok(s) = TcpStream::connect((vip.parse::<Ipv4Addr>().unwrap(), 18080)).await {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        s.write_all(b"ping").await.unwrap();
        let mut reply = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut reply)).await;
        answered += usize::from(reply == b"ping");
    }
    assert_eq!(answered, 20, "clients lost to the dead endpoint");

    // 44.8 (V-2): at shutdown the listeners close and the VIPs go.
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), proxy)
        .await
        .expect("the proxy stops")
        .unwrap();
    assert!(
        !vip_addresses("ztvpvip").contains("10.97.250.7"),
        "the VIP is left"
    );
}
