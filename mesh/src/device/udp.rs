//! Batched datagram I/O on the device's UDP socket: every datagram waiting
//! comes in with one `recvmmsg`, a batch of sealed packets goes out in one
//! or a few sends (before: one `recvfrom` and one `sendto` per packet).
//! Buffers and message headers are made once per thread and reused.
//!
//! Out, the segments of one TSO super-packet are sealed to the same size
//! for the same peer: such a run leaves as one UDP GSO send (`UDP_SEGMENT`),
//! which crosses the IP stack, the veth and the bridge as one buffer and is
//! cut into datagrams only at the receiving socket, or not at all where
//! that socket takes UDP GRO: the per-datagram work of `sendmmsg` cost the
//! sender more than sealing (bench/mesh).

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;

use nix::sys::socket::{
    ControlMessage, MsgFlags, MultiHeaders, SockaddrStorage, recvmmsg, sendmmsg, sendmsg,
};

/// Datagrams per system call: a TSO super-packet from the tun splits into
/// up to about 45 segments at the mesh MTU, and wireguard-go's batch is
/// 128 too.
pub(crate) const BATCH: usize = 128;

/// The most datagrams one GSO send carries (the kernel's UDP_MAX_SEGMENTS
/// is 64 on older kernels) and their most bytes (one IP datagram).
const GSO_SEGMENTS: usize = 64;
const GSO_BYTES: usize = 65_000;

/// The datagram buffer size: the largest packet the device carries
/// ([`super::MAX_PACKET`]) sealed (32 bytes of header and tag, padding).
pub(crate) const DATAGRAM: usize = super::MAX_PACKET + 64;

/// Receive buffers: [`RECV_BATCH`] of them, each as large as a GRO
/// super-datagram.
const RECV_BATCH: usize = 32;
const SUPER_DATAGRAM: usize = 65_536;

/// Receive buffers and what the last receive put in them. With UDP GRO on
/// the socket ([`enable_gro`]), one buffer may hold a run of datagrams
/// from one sender, all as long as the `UDP_GRO` control message says but
/// the last; they are handed out one by one.
pub(crate) struct RecvBatch {
    buffers: Vec<Vec<u8>>,
    /// Datagrams of the last receive: (buffer, start, len, sender).
    got: Vec<(usize, usize, usize, SocketAddr)>,
    headers: MultiHeaders<SockaddrStorage>,
}

impl RecvBatch {
    pub(crate) fn new() -> Self {
        Self {
            buffers: (0..RECV_BATCH).map(|_| vec![0u8; SUPER_DATAGRAM]).collect(),
            got: Vec::with_capacity(BATCH),
            headers: MultiHeaders::preallocate(RECV_BATCH, Some(nix::cmsg_space!(i32))),
        }
    }

    /// Waits for a datagram on the blocking socket `fd` (up to its receive
    /// timeout: `WouldBlock`), then takes it and every one already waiting;
    /// returns how many datagrams came.
    pub(crate) fn recv(&mut self, fd: RawFd) -> io::Result<usize> {
        self.got.clear();
        // Made anew for each call: the kernel shrinks each header's control
        // length to what the last message had (none for a datagram that
        // was not coalesced), and nix's `recvmmsg` does not restore it, so
        // reused headers would lose the next `UDP_GRO` size (MSG_CTRUNC)
        // and hand a whole run over as one datagram that cannot open.
        self.headers = MultiHeaders::preallocate(RECV_BATCH, Some(nix::cmsg_space!(i32)));
        let mut slices: Vec<[IoSliceMut<'_>; 1]> = self
            .buffers
            .iter_mut()
            .map(|b| [IoSliceMut::new(b.as_mut_slice())])
            .collect();
        let results = recvmmsg(
            fd,
            &mut self.headers,
            slices.iter_mut(),
            MsgFlags::MSG_WAITFORONE,
            None,
        )
        .map_err(io::Error::from)?;
        for (buffer, msg) in results.enumerate() {
            // A cut datagram cannot authenticate; a sender that is not an
            // IP address cannot happen on this socket.
            if msg.flags.contains(MsgFlags::MSG_TRUNC) {
                continue;
            }
            let Some(from) = msg.address.as_ref().and_then(socket_addr) else {
                continue;
            };
            let segment = msg
                .cmsgs()
                .ok()
                .and_then(|mut c| {
                    c.find_map(|m| match m {
                        nix::sys::socket::ControlMessageOwned::UdpGroSegments(n) => {
                            usize::try_from(n).ok()
                        }
                        _ => None,
                    })
                })
                .unwrap_or(msg.bytes);
            for (start, len) in segments(msg.bytes, segment) {
                self.got.push((buffer, start, len, from));
            }
        }
        Ok(self.got.len())
    }

    /// The datagrams of the last receive with their senders.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], SocketAddr)> {
        self.got.iter().filter_map(|&(b, start, len, from)| {
            Some((self.buffers.get(b)?.get(start..start + len)?, from))
        })
    }
}

/// Asks the kernel to hand over a run of datagrams from one sender as one
/// (UDP GRO), the receiving end of the sender's GSO; without it each
/// datagram is queued and copied out on its own. Not fatal where refused.
pub(crate) fn enable_gro(fd: &impl std::os::fd::AsFd) {
    if let Err(e) =
        nix::sys::socket::setsockopt(fd, nix::sys::socket::sockopt::UdpGroSegment, &true)
    {
        tracing::info!(error = %e, "no UDP GRO on this socket");
    }
}

/// The datagrams of a GRO buffer of `total` bytes cut every `segment`
/// bytes: (start, len), the last one possibly shorter.
fn segments(total: usize, segment: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = if segment == 0 { total.max(1) } else { segment };
    (0..total)
        .step_by(step)
        .map(move |start| (start, step.min(total - start)))
}

/// Sealed packets waiting to go out, each with its destination.
pub(crate) struct SendBatch {
    buffers: Vec<Vec<u8>>,
    queued: Vec<(usize, SockaddrStorage)>,
    headers: MultiHeaders<SockaddrStorage>,
    /// Runs of the last send (start, count), reused.
    runs: Vec<(usize, usize)>,
    /// Whether the kernel takes GSO sends; off after the first refusal.
    gso: bool,
}

impl SendBatch {
    pub(crate) fn new() -> Self {
        Self {
            buffers: (0..BATCH).map(|_| vec![0u8; DATAGRAM]).collect(),
            queued: Vec::with_capacity(BATCH),
            headers: MultiHeaders::preallocate(BATCH, None),
            runs: Vec::with_capacity(BATCH),
            gso: true,
        }
    }

    pub(crate) fn is_full(&self) -> bool {
        self.queued.len() == BATCH
    }

    /// The buffer the next packet is sealed into; [`Self::push`] queues it.
    /// `None` when the batch is full (send it first).
    pub(crate) fn slot(&mut self) -> Option<&mut [u8]> {
        self.buffers
            .get_mut(self.queued.len())
            .map(Vec::as_mut_slice)
    }

    /// Queues the first `len` bytes of the current slot for `to`.
    pub(crate) fn push(&mut self, len: usize, to: SocketAddr) {
        if !self.is_full() {
            self.queued.push((len, SockaddrStorage::from(to)));
        }
    }

    /// Sends what is queued, as few calls as the kernel allows, and empties
    /// the batch; returns how many went out. A full socket buffer is waited
    /// out (the socket blocks): the tun side then waits too, which is the
    /// back-pressure TCP over the mesh needs. A datagram the kernel refuses
    /// on its own (an unreachable endpoint) is dropped, as a lost packet.
    pub(crate) fn send(&mut self, fd: RawFd) -> usize {
        let sent = if self.gso {
            self.send_runs(fd)
        } else {
            self.send_each(fd, 0)
        };
        self.queued.clear();
        sent
    }

    /// One send per run ([`runs`]); a run of one is a plain datagram.
    fn send_runs(&mut self, fd: RawFd) -> usize {
        runs(&self.queued, &mut self.runs);
        let lens = &self.queued;
        let mut sent = 0;
        for i in 0..self.runs.len() {
            let (start, count) = self.runs[i];
            let (size, to) = lens[start];
            let iov: Vec<IoSlice<'_>> = self.buffers[start..start + count]
                .iter()
                .zip(&lens[start..start + count])
                .map(|(b, (len, _))| IoSlice::new(&b[..*len]))
                .collect();
            let segment = u16::try_from(size).unwrap_or(u16::MAX);
            let gso = [ControlMessage::UdpGsoSegments(&segment)];
            let cmsgs: &[ControlMessage<'_>] = if count > 1 { &gso } else { &[] };
            match retrying(|| sendmsg(fd, &iov, cmsgs, MsgFlags::empty(), Some(&to))) {
                Ok(_) => sent += count,
                // No UDP GSO here (an old kernel, or an egress device that
                // cannot checksum): datagram by datagram from now on.
                Err(
                    nix::errno::Errno::EIO
                    | nix::errno::Errno::EINVAL
                    | nix::errno::Errno::ENOPROTOOPT,
                ) if count > 1 => {
                    tracing::info!("no UDP GSO on this socket: sending datagram by datagram");
                    self.gso = false;
                    return sent + self.send_each(fd, start);
                }
                Err(e) => tracing::debug!(error = %e, "mesh datagrams dropped"),
            }
        }
        sent
    }

    /// `sendmmsg` from the `from`th queued datagram on.
    fn send_each(&mut self, fd: RawFd, from: usize) -> usize {
        let mut sent = from;
        while sent < self.queued.len() {
            let chunk = &self.queued[sent..];
            let slices: Vec<[IoSlice<'_>; 1]> = self.buffers[sent..]
                .iter()
                .zip(chunk)
                .map(|(b, (len, _))| [IoSlice::new(&b[..*len])])
                .collect();
            let addrs: Vec<Option<SockaddrStorage>> = chunk.iter().map(|(_, a)| Some(*a)).collect();
            match sendmmsg(
                fd,
                &mut self.headers,
                &slices,
                &addrs,
                [],
                MsgFlags::empty(),
            ) {
                Ok(results) => sent += results.count().max(1),
                Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "mesh datagram dropped");
                    sent += 1;
                }
            }
        }
        sent - from
    }
}

fn retrying<T>(mut f: impl FnMut() -> nix::Result<T>) -> nix::Result<T> {
    loop {
        match f() {
            Err(nix::errno::Errno::EINTR) => {}
            r => return r,
        }
    }
}

/// Splits a batch of (length, destination) into runs one GSO send can
/// carry: the same destination, every datagram as long as the first but
/// the last, which may be shorter (and then ends the run), at most
/// [`GSO_SEGMENTS`] datagrams and [`GSO_BYTES`] bytes. Runs are
/// `(start, count)` into the batch, in order.
fn runs<A: PartialEq>(batch: &[(usize, A)], out: &mut Vec<(usize, usize)>) {
    out.clear();
    let mut i = 0;
    while i < batch.len() {
        let (size, to) = &batch[i];
        let mut count = 1;
        let mut bytes = *size;
        while let Some((len, next)) = batch.get(i + count) {
            if next != to || len > size || count == GSO_SEGMENTS || bytes + len > GSO_BYTES {
                break;
            }
            count += 1;
            bytes += len;
            if len < size {
                break;
            }
        }
        out.push((i, count));
        i += count;
    }
}

fn socket_addr(s: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = s.as_sockaddr_in() {
        return Some(SocketAddr::V4(SocketAddrV4::from(*v4)));
    }
    s.as_sockaddr_in6()
        .map(|v6| SocketAddr::V6(SocketAddrV6::from(*v6)))
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
    use std::os::fd::AsRawFd;

    #[test]
    fn a_batch_goes_out_in_order_and_comes_in_with_its_senders() {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = b.local_addr().unwrap();
        let mut out = SendBatch::new();
        for i in 0..5u8 {
            let slot = out.slot().unwrap();
            slot[..3].copy_from_slice(&[i; 3]);
            out.push(3, to);
        }
        assert_eq!(out.send(a.as_raw_fd()), 5);
        // Empty again: the next batch starts at the first buffer.
        assert!(!out.is_full());
        b.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let mut batch = RecvBatch::new();
        let mut got = Vec::new();
        while got.len() < 5 {
            batch.recv(b.as_raw_fd()).unwrap();
            got.extend(batch.iter().map(|(bytes, from)| (bytes.to_vec(), from)));
        }
        for (i, (bytes, from)) in (0u8..).zip(&got) {
            assert_eq!(bytes, &vec![i; 3]);
            assert_eq!(*from, a.local_addr().unwrap());
        }
    }

    #[test]
    fn runs_are_equal_datagrams_to_one_peer_with_a_shorter_last() {
        let mut out = Vec::new();
        let (a, b) = ('a', 'b');
        // A super-packet's segments, its shorter tail, another peer's
        // packet, then a longer one after a shorter.
        let batch = [
            (100, a),
            (100, a),
            (100, a),
            (40, a),
            (100, a),
            (60, b),
            (60, b),
            (90, b),
        ];
        runs(&batch, &mut out);
        assert_eq!(out, vec![(0, 4), (4, 1), (5, 2), (7, 1)]);
        // Capped by segments and bytes.
        let many = vec![(1000, a); 70];
        runs(&many, &mut out);
        assert_eq!(out, vec![(0, 64), (64, 6)]);
        let big = vec![(9000, a); 10];
        runs(&big, &mut out);
        assert_eq!(out, vec![(0, 7), (7, 3)]);
        runs::<char>(&[], &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn a_run_goes_out_as_one_gso_send_and_arrives_as_datagrams() {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = b.local_addr().unwrap();
        let mut out = SendBatch::new();
        for (i, len) in [(1u8, 500), (2, 500), (3, 200)] {
            out.slot().unwrap()[..len].fill(i);
            out.push(len, to);
        }
        assert_eq!(out.send(a.as_raw_fd()), 3);
        b.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let mut buf = [0u8; 1000];
        for (i, len) in [(1u8, 500), (2, 500), (3, 200)] {
            let n = b.recv(&mut buf).unwrap();
            assert_eq!(&buf[..n], &vec![i; len][..]);
        }
    }

    #[test]
    fn a_gro_buffer_cuts_into_its_datagrams() {
        let cut: Vec<_> = segments(250, 100).collect();
        assert_eq!(cut, vec![(0, 100), (100, 100), (200, 50)]);
        assert_eq!(segments(100, 100).collect::<Vec<_>>(), vec![(0, 100)]);
        assert_eq!(segments(7, 0).collect::<Vec<_>>(), vec![(0, 7)]);
        assert_eq!(segments(0, 100).count(), 0);
    }

    #[test]
    fn with_gro_a_gso_run_comes_in_as_its_datagrams() {
        let a = UdpSocket::bind("127.0.0.1:0").unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").unwrap();
        enable_gro(&b);
        b.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let mut batch = RecvBatch::new();
        // A lone datagram, then a run: whether loopback coalesces the run
        // or not, its datagrams come out whole and in order. (The reused-
        // header bug in `recv` showed only across the bench's bridge.)
        a.send_to(&[9; 5], b.local_addr().unwrap()).unwrap();
        assert_eq!(batch.recv(b.as_raw_fd()).unwrap(), 1);
        let mut out = SendBatch::new();
        for i in 0..10u8 {
            let len = if i == 9 { 30 } else { 300 };
            out.slot().unwrap()[..len].fill(i);
            out.push(len, b.local_addr().unwrap());
        }
        assert_eq!(out.send(a.as_raw_fd()), 10);
        b.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let mut batch = RecvBatch::new();
        let mut got = Vec::new();
        while got.len() < 10 {
            batch.recv(b.as_raw_fd()).unwrap();
            got.extend(batch.iter().map(|(bytes, _)| bytes.to_vec()));
        }
        for (i, bytes) in (0u8..).zip(&got) {
            assert_eq!(bytes, &vec![i; if i == 9 { 30 } else { 300 }]);
        }
    }

    fn unspecified() -> SocketAddr {
        SocketAddr::from(([0, 0, 0, 0], 0))
    }

    #[test]
    fn a_full_batch_takes_no_more() {
        let mut out = SendBatch::new();
        for _ in 0..BATCH {
            assert!(out.slot().is_some());
            out.push(1, unspecified());
        }
        assert!(out.is_full());
        assert!(out.slot().is_none());
        out.push(1, unspecified());
        assert_eq!(out.queued.len(), BATCH);
    }
}
