//! The UDP receive loop.
//!
//! Why not hickory-server: its `ServerFuture` spawns one task per UDP
//! request and builds a full request/response object graph for it, and its
//! handler API answers with its own messages, which rules out the raw relay
//! D-4 asks for. Here an internal query is answered inline in the receive
//! loop (decode, look up, encode, send: no task, no channel); only
//! forwarded queries, which wait on the network, get a task of their own.
//!
//! Each `SO_REUSEPORT` socket is served by a thread of its own that blocks
//! in `recvmmsg`: a batch costs two system calls (receive, send) and no
//! wakeup of the async runtime. The tokio loop this replaced spent four per
//! lone query (`epoll_wait`, the receive, the send and a receive that found
//! nothing) plus a worker's park and unpark; on the 2-core test machine that
//! was most of the gap to dnsmasq at low rates and a tenth of the peak.

use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread;
use std::time::Duration;

use nix::sys::socket::{MsgFlags, SockaddrStorage, sendto};
use tokio::runtime::Handle;
use tokio::sync::oneshot;
use tokio::task::JoinSet;
use tracing::debug;

use crate::context::ListenerCtx;
use crate::mmsg::{BATCH, RecvBatch, SendBatch};
use crate::request::{Outcome, Transport, respond};

/// A blocked receive wakes up this often to look at the stop flag, in case
/// the wakeup of [`UdpWorker::stop`] was missed.
const RECV_TIMEOUT: Duration = Duration::from_secs(1);
/// The loop keeps its buffers on the heap; its stack stays small.
const STACK_SIZE: usize = 256 * 1024;

/// The thread serving one UDP socket. Dropping it stops the thread;
/// [`UdpWorker::join`] also waits until the socket is closed.
#[derive(Debug)]
pub(crate) struct UdpWorker {
    socket: Option<Arc<UdpSocket>>,
    stop: Arc<AtomicBool>,
    done: Option<oneshot::Receiver<()>>,
}

impl UdpWorker {
    /// Starts serving `socket` (blocking mode) on a thread of its own;
    /// forwarded queries run as tasks on `runtime`.
    pub(crate) fn spawn(
        socket: UdpSocket,
        ctx: Arc<ListenerCtx>,
        runtime: Handle,
    ) -> io::Result<Self> {
        socket.set_nonblocking(false)?;
        socket.set_read_timeout(Some(RECV_TIMEOUT))?;
        let socket = Arc::new(socket);
        let stop = Arc::new(AtomicBool::new(false));
        let (done_tx, done) = oneshot::channel();
        let (s, flag) = (Arc::clone(&socket), Arc::clone(&stop));
        thread::Builder::new()
            .name("dns-udp".into())
            .stack_size(STACK_SIZE)
            .spawn(move || {
                serve(&s, &ctx, &runtime, &flag);
                drop(s);
                let _ = done_tx.send(());
            })?;
        Ok(Self {
            socket: Some(socket),
            stop,
            done: Some(done),
        })
    }

    /// Tells the thread to end and wakes it if it is blocked in a receive
    /// (`shutdown` wakes the readers of even an unconnected UDP socket; it
    /// reports `ENOTCONN`, which is expected).
    pub(crate) fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        if let Some(socket) = &self.socket {
            let _ =
                nix::sys::socket::shutdown(socket.as_raw_fd(), nix::sys::socket::Shutdown::Read);
        }
    }

    /// Stops the thread and waits until it has let go of the socket, which
    /// is then closed, so the same address can be bound again right away.
    pub(crate) async fn join(mut self) {
        self.stop();
        if let Some(done) = self.done.take() {
            let _ = done.await;
        }
        self.socket = None;
    }
}

impl Drop for UdpWorker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Serves one socket until `stop` is set. Forwarded queries live in a set
/// owned by this loop, so ending the loop cancels them too; they hold the
/// socket only weakly, so it closes when the listener goes.
///
/// Each turn takes every query waiting (up to a batch), answers the internal
/// ones in order and sends those answers together; see [`crate::mmsg`].
fn serve(socket: &Arc<UdpSocket>, ctx: &ListenerCtx, runtime: &Handle, stop: &AtomicBool) {
    let mut batch = RecvBatch::new();
    let mut sends = SendBatch::new();
    let mut replies: Vec<(Vec<u8>, SocketAddr)> = Vec::with_capacity(BATCH);
    let mut forwards = JoinSet::new();
    let fd = socket.as_raw_fd();
    while !stop.load(Ordering::Acquire) {
        match batch.recv_waiting(fd) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                continue;
            }
            Err(e) => {
                // UDP receive errors are per datagram (ICMP noise); pause
                // briefly in case one repeats.
                debug!(error = %e, "udp receive failed");
                thread::sleep(Duration::from_millis(1));
                continue;
            }
        }
        while forwards.try_join_next().is_some() {}
        let scope = ctx.scope.load();
        let table = ctx.shared.table.load();
        for (packet, got) in batch.iter() {
            let peer = got.peer;
            if got.truncated {
                debug!(%peer, "udp query longer than any real query dropped");
                ctx.shared.stats.count(packet, &Outcome::Drop);
                continue;
            }
            let outcome = respond(packet, &scope, &table, Transport::Udp);
            ctx.shared.stats.count(packet, &outcome);
            match outcome {
                Outcome::Reply(answer) => replies.push((answer, peer)),
                Outcome::Drop => debug!(%peer, len = packet.len(), "udp packet dropped"),
                Outcome::Forward(request) => {
                    let Some(slot) = ctx.forward_slot() else {
                        if let Some(answer) = request.servfail() {
                            replies.push((answer, peer));
                        }
                        continue;
                    };
                    let query = packet.to_vec();
                    let socket = Arc::downgrade(socket);
                    let shared = Arc::clone(&ctx.shared);
                    forwards.spawn_on(
                        async move {
                            let answer = shared.relay(slot, &query, &request, Transport::Udp);
                            if let Some(answer) = answer.await {
                                send_one(&socket, &answer, peer);
                            }
                        },
                        runtime,
                    );
                }
            }
        }
        flush(&mut sends, fd, &mut replies);
    }
    forwards.abort_all();
}

/// Sends the answers of one batch, as few calls as the kernel allows,
/// waiting for room in a full buffer so none is lost.
fn flush(sends: &mut SendBatch, fd: std::os::fd::RawFd, replies: &mut Vec<(Vec<u8>, SocketAddr)>) {
    if replies.is_empty() {
        return;
    }
    if let Err(e) = sends.send(fd, replies, true) {
        debug!(error = %e, "udp batch send failed");
    }
    replies.clear();
}

/// Sends a forwarded answer from a runtime task: never blocking a worker,
/// so a full buffer loses the datagram (the client asks again).
fn send_one(socket: &Weak<UdpSocket>, answer: &[u8], peer: SocketAddr) {
    let Some(socket) = socket.upgrade() else {
        return;
    };
    let to = SockaddrStorage::from(peer);
    if let Err(e) = sendto(socket.as_raw_fd(), answer, &to, MsgFlags::MSG_DONTWAIT) {
        debug!(%peer, error = %e, "udp send failed");
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::Scope;
    use crate::config::Config;
    use crate::context::Shared;
    use crate::upstream::Upstreams;
    use std::time::Instant;

    fn ctx() -> Arc<ListenerCtx> {
        let config = Config::default();
        let shared = Arc::new(Shared::new(
            config.clone(),
            Arc::new(Upstreams::new(config.upstreams.clone())),
        ));
        Arc::new(ListenerCtx::new(Scope::new("p", "e"), shared))
    }

    #[tokio::test]
    async fn join_wakes_a_blocked_receive_and_frees_the_address() {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let at = socket.local_addr().unwrap();
        let worker = UdpWorker::spawn(socket, ctx(), Handle::current()).unwrap();
        // Let the thread reach its blocking receive.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = Instant::now();
        worker.join().await;
        // Woken by the shutdown, not by the receive timeout.
        assert!(
            started.elapsed() < RECV_TIMEOUT / 2,
            "{:?}",
            started.elapsed()
        );
        UdpSocket::bind(at).unwrap();
    }
}
