//! `ProxyTCP`: the node's leg of a port-forward. The first frame names
//! `dial_addr`; the agent dials it (5 s), writes the frame's early data, then
//! copies both ways in 32 KiB reads, half-closing the TCP write side when the
//! caller half-closes.
//!
//! Targets (PX-3): only a host port currently published for a managed
//! container, on this node's host address or loopback, or an address of a
//! managed container, at any port. Never a host service, never another
//! machine: the node API is not a relay. Termination (PX-5): the RPC ends,
//! OK, once the target has closed and everything it sent is forwarded; when
//! the caller goes away the socket is closed at once.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::proto::cluster::TcpChunk;
use crate::status::StatusSnapshot;

use super::Out;

const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
const READ_SIZE: usize = 32 * 1024;

/// What a port-forward may reach right now: the executor's view.
#[derive(Debug, Clone)]
pub struct Targets {
    /// The addresses ports are published on (host IP, mesh IP).
    pub host_ips: Vec<IpAddr>,
    pub status: watch::Receiver<Arc<StatusSnapshot>>,
}

impl Targets {
    /// Why `addr` may not be dialed, if it may not.
    fn refuse(&self, addr: SocketAddr) -> Option<String> {
        let status = self.status.borrow();
        let ip = addr.ip();
        let on_host = ip.is_loopback() || self.host_ips.contains(&ip);
        if on_host {
            let published = status
                .assignments
                .iter()
                .any(|a| a.ports.values().any(|p| *p == addr.port()));
            return (!published)
                .then(|| format!("{addr} is not a published port of an instance on this node"));
        }
        let instance = status
            .assignments
            .iter()
            .any(|a| a.ip.parse::<IpAddr>().is_ok_and(|i| i == ip));
        (!instance).then(|| format!("{ip} is not an address of an instance on this node"))
    }
}

pub async fn proxy_tcp(
    targets: &Targets,
    mut inbound: Streaming<TcpChunk>,
) -> Result<Out<TcpChunk>, Status> {
    let first = inbound
        .message()
        .await?
        .ok_or_else(|| Status::invalid_argument("ProxyTCP: the stream ended before dial_addr"))?;
    let addr = target(&first.dial_addr)?;
    if let Some(why) = targets.refuse(addr) {
        return Err(Status::permission_denied(format!("ProxyTCP: {why}")));
    }
    let stream = tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| Status::unavailable(format!("ProxyTCP: dialing {addr} timed out after 5 s")))?
        .map_err(|e| Status::unavailable(format!("ProxyTCP: dialing {addr}: {e}")))?;
    let (tx, rx) = mpsc::channel::<Result<TcpChunk, Status>>(8);
    tokio::spawn(pump(stream, first.data, inbound, tx));
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Both directions in one task that owns the socket, so every way out of
/// the loop closes it.
async fn pump(
    stream: TcpStream,
    early: Vec<u8>,
    mut inbound: Streaming<TcpChunk>,
    tx: mpsc::Sender<Result<TcpChunk, Status>>,
) {
    let (mut reader, mut writer) = stream.into_split();
    if !early.is_empty() && writer.write_all(&early).await.is_err() {
        return;
    }
    let mut buf = vec![0u8; READ_SIZE];
    let mut caller_open = true;
    loop {
        tokio::select! {
            // The caller cancelled: the RPC stream is gone.
            () = tx.closed() => return,
            frame = inbound.message(), if caller_open => match frame {
                Ok(Some(chunk)) => {
                    if !chunk.data.is_empty() && writer.write_all(&chunk.data).await.is_err() {
                        return;
                    }
                }
                // A half-close from the caller half-closes the target.
                Ok(None) => {
                    let _ = writer.shutdown().await;
                    caller_open = false;
                }
                Err(_) => return,
            },
            read = reader.read(&mut buf) => match read {
                // The target's EOF ends the RPC: the caller's FIN signal.
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let chunk = TcpChunk {
                        data: buf[..n].to_vec(),
                        dial_addr: String::new(),
                    };
                    if tx.send(Ok(chunk)).await.is_err() {
                        return;
                    }
                }
            },
        }
    }
}

/// `dial_addr` as a socket address, or why not. Names are not resolved.
fn target(dial_addr: &str) -> Result<SocketAddr, Status> {
    if dial_addr.is_empty() {
        return Err(Status::invalid_argument(
            "first ProxyTCP chunk must set dial_addr",
        ));
    }
    dial_addr.parse().map_err(|_| {
        Status::invalid_argument(format!(
            "ProxyTCP: dial_addr {dial_addr:?} is not an IP:port"
        ))
    })
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::status::{AssignmentStatus, State};

    fn targets() -> Targets {
        let snapshot = StatusSnapshot {
            assignments: vec![AssignmentStatus {
                id: "a1".into(),
                project: "p".into(),
                app: "web".into(),
                environment: "e".into(),
                state: State::Healthy,
                container_id: "c1".into(),
                ip: "10.201.5.2".into(),
                ports: BTreeMap::from([("http".to_owned(), 30001)]),
                restarts: 0,
                message: String::new(),
            }],
            ..StatusSnapshot::default()
        };
        let (_tx, status) = watch::channel(Arc::new(snapshot));
        Targets {
            host_ips: vec!["10.90.0.7".parse().unwrap()],
            status,
        }
    }

    #[test]
    fn only_published_ports_and_instance_addresses_are_dialed() {
        let t = targets();
        let ok = |a: &str| t.refuse(a.parse().unwrap()).is_none();
        assert!(ok("127.0.0.1:30001"));
        assert!(ok("10.90.0.7:30001"), "the mesh address");
        assert!(
            ok("10.201.5.2:80") && ok("10.201.5.2:9999"),
            "the instance, any port"
        );
        for refused in [
            "127.0.0.1:22",    // a host service
            "127.0.0.1:30002", // not published
            "10.90.0.7:22",
            "10.201.5.3:80", // no instance there
            "192.0.2.1:80",  // TEST-NET-1: another machine
            "0.0.0.0:30001",
        ] {
            assert!(!ok(refused), "{refused}");
        }
        assert_eq!(target("").unwrap_err().code(), tonic::Code::InvalidArgument);
        assert_eq!(
            target("db.example:5432").unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }
}
