//! Forwarding to a real upstream: a dnsmasq on loopback. Addresses
//! 127.77.10-19.x; the host's own resolvers are never used.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};
use support::{DNSMASQ, Dnsmasq, PORT, dig_async, require, serve_on, test_config, timed_query};
use tokio::net::UdpSocket;
use zattera_dns::{Config, DnsServer, Scope, UpstreamSource};

fn scope() -> Scope {
    Scope::new("proj-1", "production")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_names_are_relayed_over_udp_and_tcp() {
    if !require(
        "other_names_are_relayed_over_udp_and_tcp",
        false,
        &["dig", DNSMASQ],
    ) {
        return;
    }
    // A TXT record too big for 512 bytes: dnsmasq truncates it over UDP.
    let big = "x".repeat(200);
    let txt = format!("--txt-record=big.example.test,{big},{big},{big}");
    let upstream = Dnsmasq::start(Ipv4Addr::new(127, 77, 10, 2), PORT, &[&txt]);
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 10, 1));
    let server = DnsServer::new(test_config(vec![upstream.addr])).unwrap();
    serve_on(&server, ip, scope()).await;
    let at = SocketAddr::new(ip, PORT);

    let d = dig_async(at, &["+tries=1", "+time=3", "www.example.test"]).await;
    assert_eq!(d.status, "NOERROR", "{}", d.raw);
    assert_eq!(d.addrs(), vec!["192.0.2.1"]);
    // The upstream's answer comes back as it was: its flags (RA, which our
    // own answers never set), its EDNS size, its TTL.
    let direct = dig_async(upstream.addr, &["+tries=1", "+time=3", "www.example.test"]).await;
    assert_eq!(d.flags, direct.flags, "{}", d.raw);
    assert!(d.has_flag("ra"), "{}", d.raw);
    assert_eq!(d.edns_udp, direct.edns_udp);
    assert_eq!(d.answers, direct.answers);
    let d = dig_async(at, &["+tries=1", "+time=3", "+tcp", "www.example.test"]).await;
    assert_eq!(d.addrs(), vec!["192.0.2.1"], "{}", d.raw);

    // Over UDP without EDNS the upstream truncates, and we relay that as is;
    // over TCP the query goes upstream over TCP and comes back whole.
    let udp = dig_async(
        at,
        &[
            "+tries=1",
            "+time=3",
            "+noedns",
            "+ignore",
            "big.example.test",
            "TXT",
        ],
    )
    .await;
    assert!(udp.has_flag("tc"), "{}", udp.raw);
    let tcp = dig_async(
        at,
        &["+tries=1", "+time=3", "+tcp", "big.example.test", "TXT"],
    )
    .await;
    assert!(!tcp.has_flag("tc"), "{}", tcp.raw);
    assert_eq!(tcp.answers.len(), 1, "{}", tcp.raw);
    assert!(tcp.answers[0].3.len() > 600);
    server.shutdown().await;
}

fn query(id: u16, name: &str) -> Vec<u8> {
    let mut m = Message::new(id, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    m.to_vec().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_clients_with_the_same_id_get_their_own_answers() {
    if !require(
        "concurrent_clients_with_the_same_id_get_their_own_answers",
        false,
        &[DNSMASQ, "dig"],
    ) {
        return;
    }
    let upstream = Dnsmasq::start(Ipv4Addr::new(127, 77, 11, 2), PORT, &[]);
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 11, 1));
    let server = DnsServer::new(test_config(vec![upstream.addr])).unwrap();
    serve_on(&server, ip, scope()).await;
    let at = SocketAddr::new(ip, PORT);

    // 16 clients, all using id 0x4242 at the same moment, each for its own
    // name, 10 rounds each: every answer must carry the asker's question.
    let mut clients = Vec::new();
    for c in 0..16u32 {
        clients.push(tokio::spawn(async move {
            let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
            for round in 0..10u32 {
                let name = format!("c{c}-r{round}.example.test.");
                sock.send_to(&query(0x4242, &name), at).await.unwrap();
                let mut buf = [0u8; 1500];
                let len = tokio::time::timeout(Duration::from_secs(3), sock.recv(&mut buf))
                    .await
                    .expect("answer in time")
                    .unwrap();
                let m = Message::from_vec(&buf[..len]).unwrap();
                assert_eq!(m.metadata.id, 0x4242);
                assert_eq!(m.metadata.response_code, ResponseCode::NoError);
                assert_eq!(m.queries[0].name().to_ascii(), name);
                assert_eq!(m.answers.len(), 1);
            }
        }));
    }
    for c in clients {
        c.await.unwrap();
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_gives_servfail_within_the_timeout() {
    if !require(
        "upstream_down_gives_servfail_within_the_timeout",
        false,
        &["dig"],
    ) {
        return;
    }
    // A silent upstream: bound, never answers, so each try waits 2 s.
    let silent = UdpSocket::bind("127.77.12.2:10053").await.unwrap();
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 12, 1));
    let server = DnsServer::new(test_config(vec![silent.local_addr().unwrap()])).unwrap();
    serve_on(&server, ip, scope()).await;
    let at = SocketAddr::new(ip, PORT);

    // Timed from this process (no client to start): the forward's 2 s
    // timeout, with a wide margin above for a loaded machine; "at once" is
    // anything well before that timeout.
    let (code, took) = timed_query(at, "www.example.test.", false).await;
    assert_eq!(code, Some(ResponseCode::ServFail), "after {took:?}");
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(6),
        "SERVFAIL after {took:?}, wanted about 2 s"
    );
    // Over TCP the same: the silent upstream has no TCP port, refused at
    // once, so SERVFAIL comes quickly.
    let (code, took) = timed_query(at, "www.example.test.", true).await;
    assert_eq!(code, Some(ResponseCode::ServFail), "after {took:?}");
    assert!(took < Duration::from_millis(1900), "{took:?}");
    // Internal names never go upstream, so they still answer at once.
    let (code, took) = timed_query(at, "db.internal.", false).await;
    assert_eq!(code, Some(ResponseCode::NXDomain), "after {took:?}");
    assert!(took < Duration::from_millis(1900), "{took:?}");
    drop(silent);
    server.shutdown().await;

    // No upstream at all: SERVFAIL at once.
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 12, 3));
    let server = DnsServer::new(test_config(vec![])).unwrap();
    serve_on(&server, ip, scope()).await;
    let (code, took) = timed_query(SocketAddr::new(ip, PORT), "www.example.test.", false).await;
    assert_eq!(code, Some(ResponseCode::ServFail), "after {took:?}");
    assert!(took < Duration::from_millis(1900), "{took:?}");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_first_upstream_falls_through_to_the_next() {
    if !require(
        "a_dead_first_upstream_falls_through_to_the_next",
        false,
        &["dig", DNSMASQ],
    ) {
        return;
    }
    let upstream = Dnsmasq::start(Ipv4Addr::new(127, 77, 13, 2), PORT, &[]);
    // Nothing listens on 127.77.13.3: refused, next one tried at once.
    let dead: SocketAddr = "127.77.13.3:10053".parse().unwrap();
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 13, 1));
    let server = DnsServer::new(test_config(vec![dead, upstream.addr])).unwrap();
    serve_on(&server, ip, scope()).await;
    // At once: well before the dead upstream's 2 s timeout would pass.
    let (code, took) = timed_query(SocketAddr::new(ip, PORT), "a.example.test.", false).await;
    assert_eq!(code, Some(ResponseCode::NoError), "after {took:?}");
    assert!(took < Duration::from_millis(1900), "{took:?}");
    let d = dig_async(
        SocketAddr::new(ip, PORT),
        &["+tries=1", "+time=5", "a.example.test"],
    )
    .await;
    assert_eq!(d.addrs(), vec!["192.0.2.1"], "{}", d.raw);
    server.shutdown().await;
}

fn rewrite(path: &std::path::Path, text: &str) {
    // Replace the file the way resolvconf does: write aside, rename over.
    let tmp = path.with_extension("new");
    let mut f = std::fs::File::create(&tmp).unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f.sync_all().unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolv_conf_changes_are_followed() {
    // resolv.conf carries no port, so the upstream must sit on port 53.
    if !require("resolv_conf_changes_are_followed", true, &["dig", DNSMASQ]) {
        return;
    }
    let upstream = Dnsmasq::start(Ipv4Addr::new(127, 77, 14, 2), 53, &[]);
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("resolv.conf");
    let resolved = dir.path().join("resolved.conf");
    // Nothing on 127.77.14.3:53 yet.
    rewrite(&conf, "nameserver 127.77.14.3\n");
    let config = Config {
        upstreams: UpstreamSource::ResolvConf {
            path: conf.clone(),
            resolved: resolved.clone(),
        },
        upstream_poll: Duration::from_millis(100),
        ..test_config(vec![])
    };
    let server = Arc::new(DnsServer::new(config).unwrap());
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 14, 1));
    serve_on(&server, ip, scope()).await;
    let at = SocketAddr::new(ip, PORT);
    let d = dig_async(at, &["+tries=1", "+time=5", "www.example.test"]).await;
    assert_eq!(d.status, "SERVFAIL", "{}", d.raw);

    // The file now names the live upstream: followed within a few polls.
    rewrite(&conf, "# generated\nnameserver 127.77.14.2\n");
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let d = dig_async(at, &["+tries=1", "+time=5", "www.example.test"]).await;
        if d.addrs() == vec!["192.0.2.1"] {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "resolv.conf change not seen: {}",
            d.raw
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(server.upstreams(), vec!["127.77.14.2:53".parse().unwrap()]);

    // Only the systemd-resolved stub: its real list is used instead.
    rewrite(&resolved, "nameserver 127.77.14.2\n");
    rewrite(&conf, "nameserver 127.0.0.53\noptions edns0 trust-ad\n");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(server.upstreams(), vec!["127.77.14.2:53".parse().unwrap()]);
    let d = dig_async(at, &["+tries=1", "+time=5", "www.example.test"]).await;
    assert_eq!(d.addrs(), vec!["192.0.2.1"], "{}", d.raw);
    drop(upstream);
}
