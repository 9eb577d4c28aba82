//! Hostile input against a live listener: garbage, truncated and oversized
//! packets over UDP and TCP, idle and excess TCP connections. The listener
//! must keep answering real clients throughout. Addresses 127.77.30-39.x.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{Name, RecordType};
use support::{PORT, dig_async, require, serve_on, test_config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use zattera_dns::{Config, DnsServer, NameTable, RouteService, Scope};

fn table() -> NameTable {
    NameTable::from_routes(&[RouteService {
        fqdn: "db.production.shop.internal.".into(),
        project_id: "proj-1".into(),
        environment_id: "e".into(),
        vip: "10.97.0.5".into(),
    }])
}

/// A small deterministic generator, so a failure replays the same bytes.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next().to_le_bytes()[0]).collect()
    }
}

fn query(id: u16, name: &str) -> Vec<u8> {
    let mut m = Message::new(id, MessageType::Query, OpCode::Query);
    m.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::A));
    m.to_vec().unwrap()
}

async fn still_answers(at: SocketAddr) {
    let d = dig_async(at, &["+tries=1", "+time=2", "db.internal"]).await;
    assert_eq!(
        d.addrs(),
        vec!["10.97.0.5"],
        "listener stopped answering: {}",
        d.raw
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_over_udp_gets_formerr_or_nothing() {
    if !require("garbage_over_udp_gets_formerr_or_nothing", false, &["dig"]) {
        return;
    }
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 30, 1));
    let server = DnsServer::new(test_config(vec![])).unwrap();
    serve_on(&server, ip, Scope::new("proj-1", "production")).await;
    server.set_table(table());
    let at = SocketAddr::new(ip, PORT);
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();

    // A header that promises a question, followed by a cut-off name.
    let cut = [
        0xab, 0xcd, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 0x3f, b'x', b'y',
    ];
    sock.send_to(&cut, at).await.unwrap();
    let mut buf = vec![0u8; 65535];
    let len = tokio::time::timeout(Duration::from_secs(2), sock.recv(&mut buf))
        .await
        .expect("FORMERR in time")
        .unwrap();
    let m = Message::from_vec(&buf[..len]).unwrap();
    assert_eq!(m.metadata.id, 0xabcd);
    assert_eq!(m.metadata.message_type, MessageType::Response);
    assert_eq!(m.metadata.response_code, ResponseCode::FormErr);

    // Random junk of every size, every prefix of a real query, a response
    // (QR set), and a near-64 KiB datagram.
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    for i in 0..2000usize {
        let junk = rng.bytes(i % 700);
        sock.send_to(&junk, at).await.unwrap();
    }
    let real = query(7, "db.internal.");
    for len in 0..real.len() {
        sock.send_to(&real[..len], at).await.unwrap();
    }
    let mut reply = real.clone();
    reply[2] |= 0x80;
    sock.send_to(&reply, at).await.unwrap();
    let mut huge = real.clone();
    huge.resize(65_000, 0xee);
    sock.send_to(&huge, at).await.unwrap();
    // Whatever came back for all that (FORMERR or answers), drain it.
    let drain_until = Instant::now() + Duration::from_millis(500);
    while tokio::time::timeout_at(drain_until.into(), sock.recv(&mut buf))
        .await
        .is_ok()
    {}
    still_answers(at).await;

    // The same socket still gets a correct answer to a real query.
    sock.send_to(&real, at).await.unwrap();
    let len = tokio::time::timeout(Duration::from_secs(2), sock.recv(&mut buf))
        .await
        .expect("answer in time")
        .unwrap();
    let m = Message::from_vec(&buf[..len]).unwrap();
    assert_eq!((m.metadata.id, m.answers.len()), (7, 1));
    server.shutdown().await;
}

async fn read_framed(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).await.ok()?;
    let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
    stream.read_exact(&mut msg).await.ok()?;
    Some(msg)
}

async fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        tokio::time::timeout(limit, stream.read(&mut byte)).await,
        Ok(Ok(0) | Err(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_connections_are_bounded_in_number_and_idle_time() {
    if !require(
        "tcp_connections_are_bounded_in_number_and_idle_time",
        false,
        &["dig"],
    ) {
        return;
    }
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 31, 1));
    let server = DnsServer::new(Config {
        tcp_max_connections: 4,
        tcp_idle_timeout: Duration::from_millis(1500),
        ..test_config(vec![])
    })
    .unwrap();
    serve_on(&server, ip, Scope::new("proj-1", "production")).await;
    server.set_table(table());
    let at = SocketAddr::new(ip, PORT);

    // Framed garbage with a readable header: FORMERR, and the connection
    // stays usable for a real query after it.
    let mut s = TcpStream::connect(at).await.unwrap();
    let junk = [0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0, 0x3f, b'x'];
    s.write_all(&[0, 14]).await.unwrap();
    s.write_all(&junk).await.unwrap();
    let m = Message::from_vec(&read_framed(&mut s).await.unwrap()).unwrap();
    assert_eq!(m.metadata.response_code, ResponseCode::FormErr);
    let real = query(9, "db.internal.");
    s.write_all(&u16::try_from(real.len()).unwrap().to_be_bytes())
        .await
        .unwrap();
    s.write_all(&real).await.unwrap();
    let m = Message::from_vec(&read_framed(&mut s).await.unwrap()).unwrap();
    assert_eq!((m.metadata.id, m.answers.len()), (9, 1));
    drop(s);

    // A message cut short then silence: open for a while, closed after the
    // idle time.
    let mut s = TcpStream::connect(at).await.unwrap();
    s.write_all(&[0x03, 0xe8, 1, 2, 3]).await.unwrap();
    assert!(!closed_within(&mut s, Duration::from_millis(500)).await);
    assert!(closed_within(&mut s, Duration::from_secs(4)).await);
    // A zero-length frame or a response instead of a query: closed at once,
    // well before the idle time.
    let mut s = TcpStream::connect(at).await.unwrap();
    s.write_all(&[0, 0]).await.unwrap();
    assert!(closed_within(&mut s, Duration::from_millis(500)).await);
    let mut reply = real.clone();
    reply[2] |= 0x80;
    let mut s = TcpStream::connect(at).await.unwrap();
    s.write_all(&u16::try_from(reply.len()).unwrap().to_be_bytes())
        .await
        .unwrap();
    s.write_all(&reply).await.unwrap();
    assert!(closed_within(&mut s, Duration::from_millis(500)).await);

    // Fill every slot with connections the server has answered on (the
    // slot of a connection above can take a moment to be reaped: a new
    // connection closed unanswered is tried again).
    let mut idle = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while idle.len() < 4 {
        assert!(
            Instant::now() < deadline,
            "only {} connections served",
            idle.len()
        );
        let mut s = TcpStream::connect(at).await.unwrap();
        s.write_all(&u16::try_from(real.len()).unwrap().to_be_bytes())
            .await
            .unwrap();
        s.write_all(&real).await.unwrap();
        match tokio::time::timeout(Duration::from_secs(1), read_framed(&mut s)).await {
            Ok(Some(_)) => idle.push(s),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    // The fifth is accepted by the kernel and closed by us at once.
    let mut fifth = TcpStream::connect(at).await.unwrap();
    assert!(closed_within(&mut fifth, Duration::from_millis(500)).await);
    // UDP is unaffected meanwhile.
    still_answers(at).await;
    // The idle ones are closed after the idle time, freeing the slots.
    for s in &mut idle {
        assert!(closed_within(s, Duration::from_secs(3)).await);
    }
    let d = dig_async(at, &["+tries=1", "+time=2", "+tcp", "db.internal"]).await;
    assert_eq!(d.addrs(), vec!["10.97.0.5"], "{}", d.raw);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_in_flight_are_bounded() {
    if !require("forwards_in_flight_are_bounded", false, &[]) {
        return;
    }
    // A silent upstream holds every forward for the full 2 s.
    let silent = UdpSocket::bind("127.77.32.2:10053").await.unwrap();
    let ip = IpAddr::V4(Ipv4Addr::new(127, 77, 32, 1));
    let server = DnsServer::new(Config {
        max_forwards: 2,
        ..test_config(vec![silent.local_addr().unwrap()])
    })
    .unwrap();
    serve_on(&server, ip, Scope::new("proj-1", "production")).await;
    let at = SocketAddr::new(ip, PORT);
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    for id in 1..=3u16 {
        sock.send_to(&query(id, &format!("q{id}.example.test.")), at)
            .await
            .unwrap();
    }
    // Past the limit: SERVFAIL at once, while the two in flight still wait.
    let mut buf = [0u8; 512];
    let started = Instant::now();
    let len = tokio::time::timeout(Duration::from_secs(1), sock.recv(&mut buf))
        .await
        .expect("the third query is refused at once")
        .unwrap();
    let m = Message::from_vec(&buf[..len]).unwrap();
    assert_eq!(m.metadata.id, 3);
    assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
    // Then the two held ones time out to SERVFAIL after about 2 s.
    let mut ids = Vec::new();
    for _ in 0..2 {
        let len = tokio::time::timeout(Duration::from_secs(4), sock.recv(&mut buf))
            .await
            .expect("held queries answered after the upstream timeout")
            .unwrap();
        let m = Message::from_vec(&buf[..len]).unwrap();
        assert_eq!(m.metadata.response_code, ResponseCode::ServFail);
        ids.push(m.metadata.id);
    }
    ids.sort_unstable();
    assert_eq!(ids, vec![1, 2]);
    assert!(started.elapsed() >= Duration::from_millis(1800));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_environment_flooding_a_dead_domain_starves_no_other() {
    if !require(
        "one_environment_flooding_a_dead_domain_starves_no_other",
        false,
        &[],
    ) {
        return;
    }
    // An upstream that answers `*.live.test` and never `*.dead.test`.
    let upstream = UdpSocket::bind("127.77.33.9:10053").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    let fake = tokio::spawn(async move {
        let mut buf = [0u8; 512];
        loop {
            let Ok((len, from)) = upstream.recv_from(&mut buf).await else {
                return;
            };
            let Ok(mut m) = Message::from_vec(&buf[..len]) else {
                continue;
            };
            if m.queries
                .iter()
                .any(|q| q.name().to_string().contains("live"))
            {
                m.metadata.message_type = MessageType::Response;
                let _ = upstream.send_to(&m.to_vec().unwrap(), from).await;
            }
        }
    });
    // The default limits: 1024 forwards in flight per server, 128 per listener.
    let server = DnsServer::new(test_config(vec![upstream_addr])).unwrap();
    let (flooded, quiet) = (
        IpAddr::V4(Ipv4Addr::new(127, 77, 33, 1)),
        IpAddr::V4(Ipv4Addr::new(127, 77, 33, 2)),
    );
    // Both listeners at once (a reconcile names the whole set).
    let status = server
        .reconcile(vec![
            zattera_dns::ListenerSpec {
                addr: flooded,
                scope: Scope::new("proj-1", "production"),
            },
            zattera_dns::ListenerSpec {
                addr: quiet,
                scope: Scope::new("proj-2", "production"),
            },
        ])
        .await;
    assert!(
        status.iter().all(zattera_dns::ListenerStatus::is_serving),
        "{status:?}"
    );
    let sock = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    // The flooded environment sends more dead-domain queries than the
    // whole server may have in flight...
    for id in 1..=1100u16 {
        sock.send_to(
            &query(id, &format!("q{id}.dead.test.")),
            SocketAddr::new(flooded, PORT),
        )
        .await
        .unwrap();
        // Paced, so the receive buffer does not drop them.
        if id % 50 == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    // ...and the other environment's lookup is still relayed and answered.
    let other = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    other
        .send_to(&query(99, "www.live.test."), SocketAddr::new(quiet, PORT))
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let answer = loop {
        let len = tokio::time::timeout(Duration::from_secs(2), other.recv(&mut buf))
            .await
            .expect("the quiet environment got an answer")
            .unwrap();
        let m = Message::from_vec(&buf[..len]).unwrap();
        if m.metadata.id == 99 {
            break m;
        }
    };
    assert_eq!(
        answer.metadata.response_code,
        ResponseCode::NoError,
        "the quiet environment was starved of forward slots"
    );
    fake.abort();
    server.shutdown().await;
}
