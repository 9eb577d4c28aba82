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
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UdpSocket;
use tokio::task::JoinSet;
use tracing::debug;

use crate::context::ListenerCtx;
use crate::request::{Outcome, Transport, respond};

/// Serves one socket until the task is aborted. Forwarded queries live in a
/// set owned by this loop, so aborting the loop cancels them too and the
/// socket is really closed when the listener goes.
pub(crate) async fn serve(socket: Arc<UdpSocket>, ctx: Arc<ListenerCtx>) {
    let mut buf = vec![0u8; usize::from(u16::MAX)];
    let mut forwards = JoinSet::new();
    loop {
        let (len, peer) = match socket.recv_from(&mut buf).await {
            Ok(got) => got,
            Err(e) => {
                // UDP receive errors are per datagram (ICMP noise, a packet
                // bigger than the buffer); pause briefly in case one repeats.
                debug!(error = %e, "udp receive failed");
                if e.kind() != io::ErrorKind::Interrupted {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                continue;
            }
        };
        while forwards.try_join_next().is_some() {}
        let packet = &buf[..len];
        let outcome = {
            let scope = ctx.scope.load();
            let table = ctx.shared.table.load();
            respond(packet, &scope, &table, Transport::Udp)
        };
        ctx.shared.stats.count(packet, &outcome);
        match outcome {
            Outcome::Reply(answer) => send(&socket, &answer, peer).await,
            Outcome::Drop => debug!(%peer, len, "udp packet dropped"),
            Outcome::Forward(request) => {
                let Some(slot) = ctx.forward_slot() else {
                    if let Some(answer) = request.servfail() {
                        send(&socket, &answer, peer).await;
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

async fn send(socket: &UdpSocket, answer: &[u8], peer: std::net::SocketAddr) {
    if let Err(e) = socket.send_to(answer, peer).await {
        debug!(%peer, error = %e, "udp send failed");
    }
}
