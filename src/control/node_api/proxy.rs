//! `ProxyTCP`: the node's leg of a port-forward. The first frame names
//! `dial_addr`; the agent dials it (5 s), writes the frame's early data, then
//! copies both ways in 32 KiB reads, half-closing the TCP write side when the
//! caller half-closes.
//!
//! Stricter than the reference: `dial_addr` must be an IP literal that is an
//! address of this host (loopback included), since control only ever asks
//! for `<this node's mesh IP>:<host port>`. The node API never becomes a way
//! to reach other machines.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use crate::proto::cluster::TcpChunk;

use super::Out;

const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
const READ_SIZE: usize = 32 * 1024;

pub async fn proxy_tcp(mut inbound: Streaming<TcpChunk>) -> Result<Out<TcpChunk>, Status> {
    let first = inbound
        .message()
        .await?
        .ok_or_else(|| Status::invalid_argument("ProxyTCP: the stream ended before dial_addr"))?;
    let addr = target(&first.dial_addr)?;
    let stream = tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| Status::unavailable(format!("ProxyTCP: dialing {addr} timed out after 5 s")))?
        .map_err(|e| Status::unavailable(format!("ProxyTCP: dialing {addr}: {e}")))?;
    let (mut reader, mut writer) = stream.into_split();
    if !first.data.is_empty() {
        writer
            .write_all(&first.data)
            .await
            .map_err(|e| Status::unavailable(format!("ProxyTCP: writing to {addr}: {e}")))?;
    }
    let (tx, rx) = mpsc::channel::<Result<TcpChunk, Status>>(8);
    // Caller → target; a half-close from the caller half-closes the target.
    tokio::spawn(async move {
        while let Ok(Some(chunk)) = inbound.message().await {
            if !chunk.data.is_empty() && writer.write_all(&chunk.data).await.is_err() {
                return;
            }
        }
        let _ = writer.shutdown().await;
    });
    // Target → caller, until the target closes or the caller goes away.
    tokio::spawn(async move {
        let mut buf = vec![0u8; READ_SIZE];
        loop {
            match reader.read(&mut buf).await {
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
            }
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// `dial_addr` as a socket address of this host, or why not.
fn target(dial_addr: &str) -> Result<SocketAddr, Status> {
    if dial_addr.is_empty() {
        return Err(Status::invalid_argument(
            "ProxyTCP: the first frame has no dial_addr",
        ));
    }
    let addr: SocketAddr = dial_addr.parse().map_err(|_| {
        Status::invalid_argument(format!(
            "ProxyTCP: dial_addr {dial_addr:?} is not an IP:port"
        ))
    })?;
    if !is_local(addr.ip()) {
        return Err(Status::permission_denied(format!(
            "ProxyTCP: {} is not an address of this node",
            addr.ip()
        )));
    }
    Ok(addr)
}

/// Whether `ip` is one of this host's addresses: only those can be bound.
fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || (!ip.is_unspecified() && std::net::UdpSocket::bind((ip, 0)).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_local_ip_literals_are_dialed() {
        assert_eq!(target("127.0.0.1:8080").unwrap().port(), 8080);
        assert_eq!(target("").unwrap_err().code(), tonic::Code::InvalidArgument);
        assert_eq!(
            target("db.example:5432").unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        // TEST-NET-1 (RFC 5737) is never a local address; nothing is dialed.
        assert_eq!(
            target("192.0.2.1:80").unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        assert_eq!(
            target("0.0.0.0:80").unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
    }
}
