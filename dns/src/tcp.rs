//! DNS over TCP (RFC 7766): two-byte length, then the message; several
//! queries may follow on one connection and are answered in order.
//!
//! Connections are bounded per listener in number (extra ones are closed
//! at once) and in idle time (also while a message is half sent), so slow or
//! silent clients cannot pin memory or tasks.
//!
//! hickory-server is not used here either: TCP goes through the same
//! [`respond`] as UDP, so both transports answer identically, and forwarded
//! queries are relayed as raw bytes (D-4), which its handler API cannot do.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tokio::time::timeout;
use tracing::debug;

use crate::context::ListenerCtx;
use crate::request::{Outcome, Transport, respond};

/// Accepts until the task is aborted. Connections live in a set owned by
/// this loop, so they close with the listener.
pub(crate) async fn serve(listener: TcpListener, ctx: Arc<ListenerCtx>) {
    let mut connections = JoinSet::new();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(got) => got,
            Err(e) => {
                // Out of file descriptors, usually: back off instead of spinning.
                debug!(error = %e, "tcp accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        while connections.try_join_next().is_some() {}
        if connections.len() >= ctx.shared.config.tcp_max_connections {
            debug!(%peer, "tcp connection refused: too many open");
            drop(stream);
            continue;
        }
        let ctx = Arc::clone(&ctx);
        connections.spawn(async move {
            if let Err(e) = connection(stream, &ctx).await {
                debug!(%peer, error = %e, "tcp connection ended");
            }
        });
    }
}

async fn connection(mut stream: TcpStream, ctx: &ListenerCtx) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let idle = ctx.shared.config.tcp_idle_timeout;
    loop {
        let mut len = [0u8; 2];
        match timeout(idle, stream.read_exact(&mut len)).await {
            Ok(Ok(_)) => {}
            // Closed by the client between messages: the normal end.
            Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Err(io::ErrorKind::TimedOut.into()),
        }
        let mut query = vec![0u8; usize::from(u16::from_be_bytes(len))];
        timeout(idle, stream.read_exact(&mut query))
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
        let outcome = {
            let scope = ctx.scope.load();
            let table = ctx.shared.table.load();
            respond(&query, &scope, &table, Transport::Tcp)
        };
        ctx.shared.stats.count(&query, &outcome);
        let answer = match outcome {
            Outcome::Reply(answer) => answer,
            Outcome::Forward(request) => {
                let answer = match ctx.forward_slot() {
                    Some(slot) => {
                        ctx.shared
                            .relay(slot, &query, &request, Transport::Tcp)
                            .await
                    }
                    None => request.servfail(),
                };
                match answer {
                    Some(answer) => answer,
                    None => return Ok(()),
                }
            }
            // Not a DNS client: stop reading its stream.
            Outcome::Drop => return Ok(()),
        };
        let Ok(alen) = u16::try_from(answer.len()) else {
            return Ok(());
        };
        let mut framed = Vec::with_capacity(answer.len() + 2);
        framed.extend_from_slice(&alen.to_be_bytes());
        framed.extend_from_slice(&answer);
        timeout(idle, stream.write_all(&framed))
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
    }
}
