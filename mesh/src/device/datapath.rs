//! The two directions of the data path, each on its own thread so that
//! sealing and opening run side by side on two cores.
//!
//! - out: one read from the tun gives a whole TSO super-packet (up to
//!   64 KiB, split here into MTU-sized segments by `tun-rs`), each segment is
//!   sealed for its peer, and the batch leaves as one UDP GSO send per run
//!   of equal datagrams to one peer ([`super::udp`]);
//! - in: one `recvmmsg` takes every datagram waiting (with UDP GRO, runs
//!   of them from one sender as one buffer each), each is opened, and the
//!   plaintexts are coalesced back into super-packets (GRO) and written to
//!   the tun in as few writes as that allows.
//!
//! Before (boringtun's device): a read and a `sendto` per packet out, a
//! `recvfrom` and a write per packet in, all on one thread.

use std::io;
use std::os::fd::AsRawFd;

use boringtun::noise::{Tunn, TunnResult};
use tun_rs::{GROTable, VIRTIO_NET_HDR_LEN};

use super::udp::{BATCH, RecvBatch, SendBatch};
use super::{Device, MAX_PACKET};

/// Room for a whole TSO super-packet and its virtio header.
const SUPER_PACKET: usize = VIRTIO_NET_HDR_LEN + 65536;

/// Tun → mesh until the tun fails (its interface deleted).
pub(crate) fn outbound(dev: &Device) -> io::Result<()> {
    let mut raw = vec![0u8; SUPER_PACKET];
    let mut segments = vec![vec![0u8; MAX_PACKET]; BATCH];
    let mut sizes = vec![0usize; BATCH];
    let mut out = SendBatch::new();
    loop {
        let n = match dev
            .tun
            .recv_multiple(&mut raw, &mut segments, &mut sizes, 0)
        {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if fatal(&e) => return Err(e),
            // A super-packet that would not split (too many segments): lost.
            Err(e) => {
                tracing::debug!(error = %e, "tun read dropped");
                continue;
            }
        };
        let socket = dev.socket();
        {
            let peers = dev.peers();
            for (seg, &len) in segments.iter().zip(&sizes).take(n) {
                let packet = &seg[..len];
                let Some(peer) = Tunn::dst_address(packet).and_then(|d| peers.route(d)) else {
                    continue;
                };
                let Some(to) = peer.endpoint() else { continue };
                let Some(slot) = out.slot() else { break };
                // A packet without a session starts a handshake and waits in
                // the tunnel's queue; the initiation goes out instead.
                let sealed = match peer.tunn().encapsulate(packet, slot) {
                    TunnResult::WriteToNetwork(p) => p.len(),
                    _ => continue,
                };
                out.push(sealed, to);
            }
        }
        out.send(socket.as_raw_fd());
    }
}

/// Mesh → tun until the tun fails.
pub(crate) fn inbound(dev: &Device) -> io::Result<()> {
    let mut recv = RecvBatch::new();
    // Plaintexts at the offset the virtio header goes in front of. GRO
    // appends a packet to an earlier one only within that one's capacity
    // (twice the offset counted), so each has room for a whole super-packet:
    // at 9 KiB writes carried 5.6 segments each, against about 38 per
    // super-packet the sender read. Untouched capacity costs no memory.
    let mut plain: Vec<Vec<u8>> = (0..BATCH)
        .map(|_| {
            let mut b = Vec::with_capacity(SUPER_PACKET + VIRTIO_NET_HDR_LEN);
            b.resize(VIRTIO_NET_HDR_LEN + MAX_PACKET, 0);
            b
        })
        .collect();
    let mut gro = GROTable::new();
    let mut reply = vec![0u8; MAX_PACKET + 64];
    loop {
        let socket = dev.socket();
        match recv.recv(socket.as_raw_fd()) {
            Ok(_) => {}
            // The receive timeout: look at the socket again (a new port).
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(e) => {
                tracing::debug!(error = %e, "mesh receive failed");
                continue;
            }
        }
        let mut ready = 0;
        {
            let peers = dev.peers();
            for (datagram, from) in recv.iter() {
                let Some(peer) = peers.for_datagram(datagram) else {
                    continue;
                };
                let Some(buf) = plain.get_mut(ready) else {
                    break;
                };
                // Room for the plaintext (never longer than the datagram) or
                // a handshake answer or cookie (at most 148 bytes); not
                // MAX_PACKET, since every byte `resize` adds is zeroed (3%
                // of the receiver's CPU).
                buf.resize(VIRTIO_NET_HDR_LEN + datagram.len().max(148), 0);
                let mut tunn = peer.tunn();
                let kind = datagram.first().copied();
                let outcome = match tunn.decapsulate(
                    Some(from.ip()),
                    datagram,
                    &mut buf[VIRTIO_NET_HDR_LEN..],
                ) {
                    TunnResult::WriteToTunnelV4(p, src) => {
                        let len = p.len();
                        if peer.allows(src.into()) {
                            buf.truncate(VIRTIO_NET_HDR_LEN + len);
                            ready += 1;
                        }
                        Outcome::Opened
                    }
                    // A handshake answer or cookie, then what waited for
                    // the session: rare, sent one by one.
                    TunnResult::WriteToNetwork(p) => {
                        let first = p.first().copied();
                        let _ = socket.send_to(p, from);
                        while let TunnResult::WriteToNetwork(p) =
                            tunn.decapsulate(None, &[], &mut reply)
                        {
                            let _ = socket.send_to(p, from);
                        }
                        Outcome::Answered(first)
                    }
                    TunnResult::Done => Outcome::Done,
                    // IPv6 is not routed into the mesh (its allowed IPs are
                    // IPv4); errors are the peer's or an attacker's.
                    _ => Outcome::Refused,
                };
                drop(tunn);
                if proves_the_peer(kind, outcome) {
                    peer.set_endpoint(from);
                }
            }
        }
        if ready == 0 {
            continue;
        }
        if let Err(e) = dev
            .tun
            .send_multiple(&mut gro, &mut plain[..ready], VIRTIO_NET_HDR_LEN)
        {
            if fatal(&e) {
                return Err(e);
            }
            tracing::debug!(error = %e, "tun write dropped");
        }
    }
}

/// WireGuard's message types (the first byte of a datagram).
const HANDSHAKE_INITIATION: u8 = 1;
const HANDSHAKE_RESPONSE: u8 = 2;
const TRANSPORT_DATA: u8 = 4;

/// What opening one datagram came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// A packet decrypted for the tun.
    Opened,
    /// Something sent back, starting with this message type.
    Answered(Option<u8>),
    /// Taken, nothing to deliver (a keepalive, a completed handshake).
    Done,
    Refused,
}

/// Whether a datagram proved it came from the peer, so that its source
/// becomes the peer's endpoint: a transport packet that decrypted (data or
/// a keepalive), a handshake response that completed a handshake, or an
/// initiation answered with a response. Never a cookie reply: under load
/// boringtun answers any initiation with a valid mac1 with one, and mac1
/// needs only public keys, which every mesh node has; moving the endpoint
/// on that let a forger take a peer's traffic, and keepalives never moved
/// it back.
fn proves_the_peer(kind: Option<u8>, outcome: Outcome) -> bool {
    matches!(
        (kind, outcome),
        (Some(TRANSPORT_DATA), Outcome::Opened | Outcome::Done)
            | (
                Some(HANDSHAKE_RESPONSE),
                Outcome::Done | Outcome::Answered(_)
            )
            | (
                Some(HANDSHAKE_INITIATION),
                Outcome::Answered(Some(HANDSHAKE_RESPONSE))
            )
    )
}

/// The tun's interface is gone: the device has nothing left to carry.
fn fatal(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc_ebadfd) if libc_ebadfd == nix::errno::Errno::EBADFD as i32)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use boringtun::noise::rate_limiter::RateLimiter;
    use boringtun::x25519;
    use std::sync::Arc;

    /// What a datagram's opening comes to, as the in-path classifies it.
    fn open(tunn: &mut Tunn, datagram: &[u8]) -> Outcome {
        let mut dst = vec![0u8; 2048];
        match tunn.decapsulate(Some([192, 0, 2, 9].into()), datagram, &mut dst) {
            TunnResult::WriteToTunnelV4(..) => Outcome::Opened,
            TunnResult::WriteToNetwork(p) => Outcome::Answered(p.first().copied()),
            TunnResult::Done => Outcome::Done,
            _ => Outcome::Refused,
        }
    }

    /// Issue 56.7 with boringtun's real messages: a forged or replayed
    /// initiation answered with a cookie (under load) proves nothing, and
    /// neither does a cookie; a completed handshake, data and keepalives do.
    #[test]
    fn only_an_authenticated_datagram_moves_a_peers_endpoint() {
        let (a_key, b_key) = (
            x25519::StaticSecret::from([7u8; 32]),
            x25519::StaticSecret::from([9u8; 32]),
        );
        let (a_pub, b_pub) = (
            x25519::PublicKey::from(&a_key),
            x25519::PublicKey::from(&b_key),
        );
        let mut a = Tunn::new(a_key, b_pub, None, None, 1, None);
        let mut b = Tunn::new(b_key.clone(), a_pub, None, None, 2, None);
        let mut buf = vec![0u8; 2048];
        let init = match a.format_handshake_initiation(&mut buf, false) {
            TunnResult::WriteToNetwork(p) => p.to_vec(),
            other => panic!("{other:?}"),
        };
        // Under load (a limit of 0): any initiation with a valid mac1, the
        // attacker's replay of this one included, gets a cookie reply,
        // which the old in-path took for proof like any answer.
        let loaded = Arc::new(RateLimiter::new(&b_pub, 0));
        let mut b_loaded = Tunn::new(b_key, a_pub, None, None, 3, Some(loaded));
        let cookie = open(&mut b_loaded, &init);
        assert!(matches!(cookie, Outcome::Answered(Some(3))), "{cookie:?}");
        assert!(!proves_the_peer(Some(HANDSHAKE_INITIATION), cookie));
        // Not under load: the initiation is answered with a response, the
        // response completes the initiator's handshake.
        let mut reply = vec![0u8; 2048];
        let response = match b.decapsulate(Some([192, 0, 2, 9].into()), &init, &mut reply) {
            TunnResult::WriteToNetwork(p) => p.to_vec(),
            other => panic!("{other:?}"),
        };
        assert_eq!(response[0], HANDSHAKE_RESPONSE);
        assert!(proves_the_peer(
            Some(HANDSHAKE_INITIATION),
            Outcome::Answered(Some(HANDSHAKE_RESPONSE))
        ));
        let done = open(&mut a, &response);
        assert!(proves_the_peer(Some(HANDSHAKE_RESPONSE), done), "{done:?}");
        // Data and a keepalive, sealed by the initiator.
        let ip = [
            0x45u8, 0, 0, 20, 0, 0, 0, 0, 64, 17, 0, 0, 10, 90, 1, 1, 10, 90, 1, 2,
        ];
        let mut sealed = vec![0u8; 2048];
        let data = match a.encapsulate(&ip, &mut sealed) {
            TunnResult::WriteToNetwork(p) => p.to_vec(),
            other => panic!("{other:?}"),
        };
        assert!(proves_the_peer(data.first().copied(), open(&mut b, &data)));
        let keepalive = match a.encapsulate(&[], &mut sealed) {
            TunnResult::WriteToNetwork(p) => p.to_vec(),
            other => panic!("{other:?}"),
        };
        assert!(proves_the_peer(
            keepalive.first().copied(),
            open(&mut b, &keepalive)
        ));
        // A datagram that does not decrypt (flipped) proves nothing.
        let mut forged = data.clone();
        let last = forged.len() - 1;
        forged[last] ^= 1;
        assert!(!proves_the_peer(
            forged.first().copied(),
            open(&mut b, &forged)
        ));
    }
}
