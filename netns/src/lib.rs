//! zattera-netns: every change the node agent makes to the host's network.
//!
//! One Linux bridge per (project, environment) on `10.201.X.0/24` with the
//! gateway on `.1`, one network namespace and veth per container, and the
//! agent's own nftables table for NAT, isolation and published ports. It only
//! creates and removes what it owns (bridges named `ztbr…`, netns files under
//! the agent's run dir, the `inet zattera…` table).
//!
//! Today this crate holds the subnet pool ([`subnet`]); bridges, namespaces
//! and nftables land with the networking issue.

pub mod subnet;

pub use subnet::{Subnet, SubnetError, gateway_ip, next_free_subnet};
