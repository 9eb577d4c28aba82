//! The forward path (D-4): a raw packet relay. The client's bytes go to each
//! upstream in turn, unchanged, and the first matching answer comes back
//! unchanged, so flags, EDNS and rcodes are the upstream's own.
//!
//! Every relayed query gets its own upstream socket (UDP) or connection
//! (TCP). Query ids therefore never need rewriting: two clients that pick
//! the same id talk to the upstream from different ports, and an answer can
//! only reach the socket its query left from. On top of that an answer must
//! carry the query's id and question, so a stray or spoofed datagram is
//! ignored rather than relayed.
//!
//! Unlike the reference, TCP queries are relayed over TCP, so an answer too
//! big for UDP reaches a TCP client whole.

use std::io;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::time::timeout;
use tracing::debug;

use crate::request::question_end;

/// Relays `query` over UDP; `None` when no upstream answered in time.
pub(crate) async fn over_udp(
    query: &[u8],
    upstreams: &[SocketAddr],
    per_upstream: Duration,
) -> Option<Vec<u8>> {
    for &upstream in upstreams {
        match timeout(per_upstream, ask_udp(query, upstream)).await {
            Ok(Ok(answer)) => return Some(answer),
            Ok(Err(e)) => debug!(%upstream, error = %e, "upstream failed over udp"),
            Err(_) => debug!(%upstream, "upstream timed out over udp"),
        }
    }
    None
}

/// Relays `query` over TCP; `None` when no upstream answered in time.
pub(crate) async fn over_tcp(
    query: &[u8],
    upstreams: &[SocketAddr],
    per_upstream: Duration,
) -> Option<Vec<u8>> {
    for &upstream in upstreams {
        match timeout(per_upstream, ask_tcp(query, upstream)).await {
            Ok(Ok(answer)) => return Some(answer),
            Ok(Err(e)) => debug!(%upstream, error = %e, "upstream failed over tcp"),
            Err(_) => debug!(%upstream, "upstream timed out over tcp"),
        }
    }
    None
}

async fn ask_udp(query: &[u8], upstream: SocketAddr) -> io::Result<Vec<u8>> {
    let local: SocketAddr = if upstream.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(local).await?;
    // Connected: the kernel filters other sources, and a closed upstream
    // port shows up at once as ECONNREFUSED instead of a 2 s wait.
    socket.connect(upstream).await?;
    socket.send(query).await?;
    let mut buf = vec![0u8; usize::from(u16::MAX)];
    loop {
        let len = socket.recv(&mut buf).await?;
        let answer = &buf[..len];
        if answers(query, answer) {
            return Ok(answer.to_vec());
        }
        debug!(%upstream, "ignored an upstream datagram that does not answer the query");
    }
}

async fn ask_tcp(query: &[u8], upstream: SocketAddr) -> io::Result<Vec<u8>> {
    let len = u16::try_from(query.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "query over 64 KiB"))?;
    let mut stream = TcpStream::connect(upstream).await?;
    stream.set_nodelay(true)?;
    let mut framed = Vec::with_capacity(query.len() + 2);
    framed.extend_from_slice(&len.to_be_bytes());
    framed.extend_from_slice(query);
    stream.write_all(&framed).await?;
    // The caller's timeout bounds this loop.
    loop {
        let mut len = [0u8; 2];
        stream.read_exact(&mut len).await?;
        let mut answer = vec![0u8; usize::from(u16::from_be_bytes(len))];
        stream.read_exact(&mut answer).await?;
        if answers(query, &answer) {
            return Ok(answer);
        }
    }
}

/// Whether `answer` is a response to `query`: QR set, same id, and the same
/// question (compared without case, as RFC 5452 allows servers to echo it).
fn answers(query: &[u8], answer: &[u8]) -> bool {
    let Some(end) = question_end(query) else {
        // An odd query we still relay: fall back to id and QR.
        return answer.len() >= 12 && answer[..2] == query[..2] && answer[2] & 0x80 != 0;
    };
    answer.len() >= end
        && answer[..2] == query[..2]
        && answer[2] & 0x80 != 0
        && answer[4..6] == query[4..6]
        && answer[12..end].eq_ignore_ascii_case(&query[12..end])
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn query() -> Vec<u8> {
        let mut q = vec![0xbe, 0xef, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        q.extend_from_slice(b"\x07example\x04test\x00\x00\x01\x00\x01");
        q
    }

    #[test]
    fn only_a_matching_response_counts() {
        let q = query();
        let mut a = q.clone();
        a[2] |= 0x80;
        assert!(answers(&q, &a));
        let mut upper = a.clone();
        upper[13] = b'E';
        assert!(answers(&q, &upper));
        let mut other_id = a.clone();
        other_id[1] ^= 1;
        assert!(!answers(&q, &other_id));
        let mut other_name = a.clone();
        other_name[14] = b'z';
        assert!(!answers(&q, &other_name));
        assert!(!answers(&q, &q), "a query is not an answer");
        assert!(!answers(&q, &a[..20]));
    }

    #[tokio::test]
    async fn a_closed_upstream_fails_fast_and_the_next_one_is_tried() {
        // Nothing listens on this address of the tests' own loopback range,
        // so the port is closed (an ephemeral port, bound then dropped,
        // could be reused by another test in the meantime).
        let closed_addr: SocketAddr = "127.77.40.3:10053".parse().unwrap();
        let live = UdpSocket::bind("127.77.40.2:0").await.unwrap();
        let live_addr = live.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let mut buf = [0u8; 512];
            let (len, peer) = live.recv_from(&mut buf).await.unwrap();
            // A wrong id first, which must be ignored, then the answer.
            let mut wrong = buf[..len].to_vec();
            wrong[2] |= 0x80;
            wrong[0] ^= 0xff;
            live.send_to(&wrong, peer).await.unwrap();
            let mut right = buf[..len].to_vec();
            right[2] |= 0x80;
            live.send_to(&right, peer).await.unwrap();
        });
        let started = std::time::Instant::now();
        let got = over_udp(&query(), &[closed_addr, live_addr], Duration::from_secs(2)).await;
        let got = got.expect("the live upstream answers");
        assert_eq!(got[..2], query()[..2]);
        assert!(started.elapsed() < Duration::from_secs(1));
        server.await.unwrap();
    }

    #[tokio::test]
    async fn no_upstream_answering_gives_none_after_the_timeout() {
        let silent = UdpSocket::bind("127.77.40.4:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let started = std::time::Instant::now();
        let got = over_udp(&query(), &[addr], Duration::from_millis(300)).await;
        assert!(got.is_none());
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(2));
        assert!(
            over_udp(&query(), &[], Duration::from_secs(2))
                .await
                .is_none()
        );
    }
}
