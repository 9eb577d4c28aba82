//! One error for the crate; each variant names the interface or peer and,
//! where it matters, the backend.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("key: {0}")]
    Key(String),
    #[error("{0}")]
    Invalid(String),
    #[error("interface {interface}: {what}: {source}")]
    Netlink {
        interface: String,
        what: &'static str,
        source: Box<rtnetlink::Error>,
    },
    #[error("netlink socket: {0}")]
    Socket(std::io::Error),
    #[error("interface {interface} ({backend}): {what}")]
    Backend {
        interface: String,
        backend: &'static str,
        what: String,
    },
    #[error("UAPI socket {}: {source}", path.display())]
    Uapi {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("UAPI socket {}: the device answered errno={errno}", path.display())]
    UapiRefused { path: PathBuf, errno: i32 },
}

impl Error {
    pub(crate) fn netlink(interface: &str, what: &'static str, source: rtnetlink::Error) -> Self {
        Self::Netlink {
            interface: interface.to_owned(),
            what,
            source: Box::new(source),
        }
    }
}
