//! One error type for the crate: each variant names the object it is about
//! and the cause, so a log line is enough to act on.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use crate::subnet::{Subnet, SubnetError};

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid network configuration: {0}")]
    Config(String),

    #[error(transparent)]
    Subnet(#[from] SubnetError),

    #[error("netlink: cannot {op} {object}: {source}")]
    Netlink {
        op: &'static str,
        object: String,
        #[source]
        source: rtnetlink::Error,
    },

    #[error(
        "netlink: no answer to \"{op} {object}\" within {after:?} (the kernel may have dropped it: receive buffer overrun)"
    )]
    NetlinkTimeout {
        op: &'static str,
        object: String,
        after: std::time::Duration,
    },

    #[error("cannot open a netlink socket: {source}")]
    NetlinkSocket {
        #[source]
        source: std::io::Error,
    },

    #[error(
        "interface {name} exists but is {found}, not a bridge owned by this agent; remove or rename it"
    )]
    NotOurs { name: String, found: String },

    #[error(
        "bridge {bridge} carries {found} but {wanted} was asked for, and it still has {ports} attached port(s); detach them first"
    )]
    SubnetInUse {
        bridge: String,
        wanted: Subnet,
        found: String,
        ports: usize,
    },

    #[error(
        "bridge {bridge} belongs to network {found:?} but {wanted:?} was asked for, and it still has {ports} attached port(s)"
    )]
    ScopeInUse {
        bridge: String,
        wanted: String,
        found: String,
        ports: usize,
    },

    #[error(
        "bridge {bridge} still has {ports} attached port(s) ({names}); detach them before removing the network"
    )]
    NetworkInUse {
        bridge: String,
        ports: usize,
        names: String,
    },

    #[error("network for {0} does not exist (call ensure first)")]
    NoNetwork(Subnet),

    #[error("subnet {0}: no free address left in .2-.254")]
    IpExhausted(Subnet),

    #[error("address {ip} is not a container address of {subnet} (.2-.254)")]
    IpOutside { ip: Ipv4Addr, subnet: Subnet },

    #[error("address {ip} is already held by container {holder}")]
    IpTaken { ip: Ipv4Addr, holder: String },

    #[error("network namespace file {path}: cannot {op}: {source}")]
    Netns {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },

    #[error("sysctl {key}: cannot set to {value}: {source}")]
    Sysctl {
        key: String,
        value: &'static str,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "nft binary {binary} not found or not runnable ({source}); install the nftables package"
    )]
    NftMissing {
        binary: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("nft {action} on table inet {table} failed: {stderr}")]
    Nft {
        action: &'static str,
        table: String,
        stderr: String,
    },

    #[error("conntrack: cannot {op}: {source}")]
    Conntrack {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },

    #[error("host port {proto}/{ip}:{port}: {cause}")]
    Port {
        proto: &'static str,
        ip: Ipv4Addr,
        port: u16,
        cause: String,
    },

    #[error("host port {ip}:{port}/{proto} is in use by {}", holder.as_deref().unwrap_or("another socket on the host"))]
    PortInUse {
        proto: &'static str,
        ip: Ipv4Addr,
        port: u16,
        /// `pid N (command)` when it can be found in /proc.
        holder: Option<String>,
    },

    #[error("no free {proto} host port on {ip} in {lo}-{hi}")]
    PortsExhausted {
        proto: &'static str,
        ip: Ipv4Addr,
        lo: u16,
        hi: u16,
    },

    #[error("{0} vanished right after it was created (someone else is changing the same names?)")]
    Vanished(String),

    #[error("dns query for {name:?} to {server}: {cause}")]
    Dns {
        server: std::net::SocketAddrV4,
        name: String,
        cause: String,
    },

    #[error("worker thread for {0} panicked or could not start")]
    Thread(String),
}

impl Error {
    /// A host port someone else holds right now: worth retrying later, not
    /// a defect of the request.
    pub fn is_port_in_use(&self) -> bool {
        matches!(self, Self::PortInUse { .. })
    }

    pub(crate) fn netlink(
        op: &'static str,
        object: impl Into<String>,
        source: rtnetlink::Error,
    ) -> Self {
        Self::Netlink {
            op,
            object: object.into(),
            source,
        }
    }

    pub(crate) fn netns(
        path: &std::path::Path,
        op: &'static str,
        source: impl Into<std::io::Error>,
    ) -> Self {
        Self::Netns {
            path: path.to_owned(),
            op,
            source: source.into(),
        }
    }
}
