//! Typed errors of the crate.

use std::io;
use std::net::SocketAddr;

/// Starting the server failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the DNS server must be created inside a tokio runtime")]
    NoRuntime,
}

/// A listener could not be opened. It is retried at the next reconcile.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("cannot bind DNS over UDP on {addr}: {source}{}", hint(.source))]
    Udp {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("cannot bind DNS over TCP on {addr}: {source}{}", hint(.source))]
    Tcp {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
}

impl BindError {
    /// The I/O error kind, for callers that react to "address in use".
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            Self::Udp { source, .. } | Self::Tcp { source, .. } => source.kind(),
        }
    }
}

/// What an operator most likely needs to know for the common failures.
fn hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::AddrInUse => {
            " (another process holds this port, on this address or on every address \
             (0.0.0.0): stop it or make it bind only its own addresses)"
        }
        io::ErrorKind::AddrNotAvailable => " (the gateway address is not on any interface yet)",
        io::ErrorKind::PermissionDenied => " (port 53 needs root or CAP_NET_BIND_SERVICE)",
        _ => "",
    }
}
