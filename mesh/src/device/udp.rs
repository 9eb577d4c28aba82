//! Batched datagram I/O on the device's UDP socket: every datagram waiting
//! comes in with one `recvmmsg`, a batch of sealed packets goes out with
//! one `sendmmsg` (before: one `recvfrom` and one `sendto` per packet).
//! Buffers and message headers are made once per thread and reused.

use std::io::{self, IoSlice, IoSliceMut};
use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;

use nix::sys::socket::{MsgFlags, MultiHeaders, SockaddrStorage, recvmmsg, sendmmsg};

/// Datagrams per system call: a TSO super-packet from the tun splits into
/// up to about 45 segments at the mesh MTU, and wireguard-go's batch is
/// 128 too.
pub(crate) const BATCH: usize = 128;

/// The datagram buffer size: the largest packet the device carries
/// ([`super::MAX_PACKET`]) sealed (32 bytes of header and tag, padding).
pub(crate) const DATAGRAM: usize = super::MAX_PACKET + 64;

/// Receive buffers and what the last receive put in them.
pub(crate) struct RecvBatch {
    buffers: Vec<Vec<u8>>,
    got: Vec<(usize, SocketAddr)>,
    headers: MultiHeaders<SockaddrStorage>,
}

impl RecvBatch {
    pub(crate) fn new() -> Self {
        Self {
            buffers: (0..BATCH).map(|_| vec![0u8; DATAGRAM]).collect(),
            got: Vec::with_capacity(BATCH),
            headers: MultiHeaders::preallocate(BATCH, None),
        }
    }

    /// Waits for a datagram on the blocking socket `fd` (up to its receive
    /// timeout: `WouldBlock`), then takes it and every one already waiting.
    pub(crate) fn recv(&mut self, fd: RawFd) -> io::Result<usize> {
        self.got.clear();
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
        for msg in results {
            // A cut datagram cannot authenticate: drop it here.
            if msg.flags.contains(MsgFlags::MSG_TRUNC) {
                self.got.push((0, unspecified()));
                continue;
            }
            let peer = msg.address.as_ref().and_then(socket_addr);
            self.got.push((msg.bytes, peer.unwrap_or_else(unspecified)));
        }
        Ok(self.got.len())
    }

    /// The datagrams of the last receive with their senders (empty ones,
    /// cut or from a non-IP sender, left out).
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], SocketAddr)> {
        self.buffers
            .iter()
            .zip(&self.got)
            .filter(|(_, (len, _))| *len > 0)
            .map(|(b, (len, from))| (&b[..*len], *from))
    }
}

fn unspecified() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 0))
}

/// Sealed packets waiting to go out, each with its destination.
pub(crate) struct SendBatch {
    buffers: Vec<Vec<u8>>,
    queued: Vec<(usize, SockaddrStorage)>,
    headers: MultiHeaders<SockaddrStorage>,
}

impl SendBatch {
    pub(crate) fn new() -> Self {
        Self {
            buffers: (0..BATCH).map(|_| vec![0u8; DATAGRAM]).collect(),
            queued: Vec::with_capacity(BATCH),
            headers: MultiHeaders::preallocate(BATCH, None),
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
            .map(|b| b.as_mut_slice())
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
        let mut sent = 0;
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
        self.queued.clear();
        sent
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
