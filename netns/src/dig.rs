//! `zattera-netns dig`: one DNS A query, sent from inside a container's
//! network namespace to its gateway, the way the container's resolver would
//! (its resolv.conf names the gateway, runtime.md C-10). A minimal client:
//! one question, recursion desired, A records and the response code back.

use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
use std::path::Path;
use std::time::Duration;

use crate::error::{Error, Result};

/// What came back.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Answer {
    pub server: SocketAddrV4,
    /// `NOERROR`, `NXDOMAIN`, `SERVFAIL`, ...
    pub rcode: &'static str,
    pub addresses: Vec<Ipv4Addr>,
    /// TTL of each address, in seconds.
    pub ttls: Vec<u32>,
}

fn rcode_name(code: u8) -> &'static str {
    match code {
        0 => "NOERROR",
        1 => "FORMERR",
        2 => "SERVFAIL",
        3 => "NXDOMAIN",
        4 => "NOTIMP",
        5 => "REFUSED",
        _ => "OTHER",
    }
}

/// Encodes a query for `name` (type A, class IN) with message id `id`.
fn encode(id: u16, name: &str) -> std::result::Result<Vec<u8>, String> {
    let mut q = Vec::with_capacity(32 + name.len());
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00]); // RD
    q.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]); // 1 question
    for label in name.trim_end_matches('.').split('.') {
        let len = u8::try_from(label.len())
            .ok()
            .filter(|l| (1..=63).contains(l));
        let Some(len) = len else {
            return Err(format!(
                "{name:?} is not a DNS name (empty or over-long label)"
            ));
        };
        q.push(len);
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    q.extend_from_slice(&[0, 1, 0, 1]); // A, IN
    Ok(q)
}

/// Skips a possibly compressed name at `pos`; returns the position after it.
fn skip_name(msg: &[u8], mut pos: usize) -> Option<usize> {
    // Bounded: a name has at most 128 labels.
    for _ in 0..128 {
        let len = *msg.get(pos)?;
        match len {
            0 => return Some(pos + 1),
            l if l & 0xc0 == 0xc0 => return Some(pos + 2),
            l => pos += 1 + usize::from(l),
        }
    }
    None
}

fn u16_at(msg: &[u8], pos: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*msg.get(pos)?, *msg.get(pos + 1)?]))
}

/// Parses a response to query `id`.
fn decode(id: u16, msg: &[u8]) -> Option<(u8, Vec<(Ipv4Addr, u32)>)> {
    if u16_at(msg, 0)? != id || msg.get(2)? & 0x80 == 0 {
        return None;
    }
    let rcode = msg.get(3)? & 0x0f;
    let qd = u16_at(msg, 4)?;
    let an = u16_at(msg, 6)?;
    let mut pos = 12;
    for _ in 0..qd {
        pos = skip_name(msg, pos)? + 4;
    }
    let mut out = Vec::new();
    for _ in 0..an {
        pos = skip_name(msg, pos)?;
        let (ty, class) = (u16_at(msg, pos)?, u16_at(msg, pos + 2)?);
        let ttl = u32::from_be_bytes(msg.get(pos + 4..pos + 8)?.try_into().ok()?);
        let len = usize::from(u16_at(msg, pos + 8)?);
        let data = msg.get(pos + 10..pos + 10 + len)?;
        if ty == 1 && class == 1 && len == 4 {
            out.push((Ipv4Addr::new(data[0], data[1], data[2], data[3]), ttl));
        }
        pos += 10 + len;
    }
    Some((rcode, out))
}

/// Asks `server` for the A records of `name` from inside the namespace at
/// `netns` (on a short-lived thread), three tries of `timeout` each.
pub fn query_from(
    netns: &Path,
    server: SocketAddrV4,
    name: &str,
    timeout: Duration,
) -> Result<Answer> {
    let fail = |cause: String| Error::Dns {
        server,
        name: name.to_owned(),
        cause,
    };
    let query = encode(0x5a7e, name).map_err(fail)?;
    let path = netns.to_owned();
    let handle = std::thread::Builder::new()
        .name("zt-dig".into())
        .spawn(
            move || -> std::result::Result<(u8, Vec<(Ipv4Addr, u32)>), String> {
                crate::nsfile::enter(&path).map_err(|e| e.to_string())?;
                let sock = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
                    .map_err(|e| format!("bind: {e}"))?;
                sock.set_read_timeout(Some(timeout))
                    .map_err(|e| e.to_string())?;
                let mut buf = [0u8; 1500];
                for _ in 0..3 {
                    sock.send_to(&query, server)
                        .map_err(|e| format!("send: {e}"))?;
                    while let Ok((n, from)) = sock.recv_from(&mut buf) {
                        if from == std::net::SocketAddr::V4(server)
                            && let Some(answer) = decode(0x5a7e, &buf[..n])
                        {
                            return Ok(answer);
                        }
                    }
                }
                Err(format!("no answer after 3 tries of {timeout:?}"))
            },
        )
        .map_err(|e| fail(format!("cannot start a thread: {e}")))?;
    let (rcode, records) = handle
        .join()
        .map_err(|_| fail("the query thread panicked".into()))?
        .map_err(fail)?;
    Ok(Answer {
        server,
        rcode: rcode_name(rcode),
        addresses: records.iter().map(|(a, _)| *a).collect(),
        ttls: records.iter().map(|(_, t)| *t).collect(),
    })
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn encodes_a_query_and_decodes_a_compressed_answer() {
        let q = encode(7, "web.internal.").unwrap();
        assert_eq!(&q[12..], b"\x03web\x08internal\x00\x00\x01\x00\x01");
        // The same question answered with one A record whose name is a
        // pointer to the question (0xc00c).
        let mut r = q.clone();
        r[2] = 0x81;
        r[3] = 0x80;
        r[7] = 1;
        r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 5, 0, 4, 10, 201, 9, 2]);
        assert_eq!(
            decode(7, &r),
            Some((0, vec![(Ipv4Addr::new(10, 201, 9, 2), 5)]))
        );
        // Another id, or a query rather than a response: not ours.
        assert_eq!(decode(8, &r), None);
        assert_eq!(decode(7, &q), None);
        let mut nx = q.clone();
        nx[2] = 0x81;
        nx[3] = 0x83;
        assert_eq!(decode(7, &nx).map(|(c, _)| rcode_name(c)), Some("NXDOMAIN"));
    }

    #[test]
    fn bad_names_and_truncated_answers_are_refused() {
        assert!(encode(1, "a..b").is_err());
        assert!(encode(1, &"x".repeat(64)).is_err());
        let mut r = encode(7, "a.b").unwrap();
        r[2] = 0x81;
        r[7] = 1;
        r.extend_from_slice(&[0xc0, 0x0c, 0, 1]);
        assert_eq!(decode(7, &r), None);
    }
}
