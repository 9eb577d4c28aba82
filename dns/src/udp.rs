//! The UDP receive loop.
//!
//! Why not hickory-server: its `ServerFuture` spawns one task per UDP
//! request and builds a full request/response object graph for it, and its
//! handler API answers with its own messages, which rules out the raw relay
//! D-4 asks for. Here an internal query is answered inline in the receive
//! loop (decode, look up, encode, send: no task, no channel), one loop per
//! `SO_REUSEPORT` socket; only forwarded queries, which wait on the network,
//! get a task of their own.

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::Interest;
use tokio::net::UdpSocket;
use tokio::task::JoinSet;
use tracing::debug;

use crate::context::ListenerCtx;
use crate::mmsg::{BATCH, RecvBatch, send_batch};
use crate::request::{Outcome, Transport, respond};

/// Serves one socket until the task is aborted. Forwarded queries live in a
/// set owned by this loop, so aborting the loop cancels them too and the
/// socket is really closed when the listener goes.
///
/// Each turn takes every query waiting (up to a batch), answers the internal
/// ones in order and sends those answers together; see [`crate::mmsg`].
pub(crate) async fn serve(socket: Arc<UdpSocket>, ctx: Arc<ListenerCtx>) {
    let mut batch = RecvBatch::new();
    let mut replies: Vec<(Vec<u8>, SocketAddr)> = Vec::with_capacity(BATCH);
    let mut forwards = JoinSet::new();
    let fd = socket.as_raw_fd();
    loop {
        let received = match socket.readable().await {
            Ok(()) => socket.try_io(Interest::READABLE, || batch.recv(fd)),
            Err(e) => Err(e),
        };
        match received {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                // UDP receive errors are per datagram (ICMP noise); pause
                // briefly in case one repeats.
                debug!(error = %e, "udp receive failed");
                if e.kind() != io::ErrorKind::Interrupted {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                continue;
            }
        }
        while forwards.try_join_next().is_some() {}
        {
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
                        let socket = Arc::clone(&socket);
                        let shared = Arc::clone(&ctx.shared);
                        forwards.spawn(async move {
                            let answer = shared.relay(slot, &query, &request, Transport::Udp);
                            if let Some(answer) = answer.await {
                                send(&socket, &answer, peer).await;
                            }
                        });
                    }
                }
            }
        }
        flush(&socket, &mut replies).await;
    }
}

/// Sends the answers of one batch: together while the socket takes them,
/// then one by one, waiting for room, so none is lost to a full buffer.
async fn flush(socket: &UdpSocket, replies: &mut Vec<(Vec<u8>, SocketAddr)>) {
    if replies.is_empty() {
        return;
    }
    let fd = socket.as_raw_fd();
    let sent = match socket.try_io(Interest::WRITABLE, || send_batch(fd, replies)) {
        Ok(n) => n,
        Err(e) => {
            if e.kind() != io::ErrorKind::WouldBlock {
                debug!(error = %e, "udp batch send failed");
            }
            0
        }
    };
    for (answer, peer) in replies.drain(..).skip(sent) {
        send(socket, &answer, peer).await;
    }
}

async fn send(socket: &UdpSocket, answer: &[u8], peer: SocketAddr) {
    if let Err(e) = socket.send_to(answer, peer).await {
        debug!(%peer, error = %e, "udp send failed");
    }
}
