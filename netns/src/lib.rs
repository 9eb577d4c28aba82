//! zattera-netns: every change the node agent makes to the host's network.
//!
//! One Linux bridge per (project, environment) on `10.201.X.0/24` with the
//! gateway on `.1`, one network namespace and veth per container, and the
//! agent's own nftables table for NAT, isolation and published ports. It only
//! creates and removes what it owns: interfaces named with the configured
//! prefix (bridges carry an alias `zattera:<network name>` as proof of
//! ownership), namespace files under the configured directory, and the
//! `inet <table>` table. Every name comes from one [`NetConfig`], so tests and
//! several agents run side by side.
//!
//! The executor's use, in order:
//!
//! ```text
//! let node  = NetNode::new(cfg)?;                       // netlink + nft, touches nothing
//! let mut ipam  = Ipam::from_records(&records)?;          // from container labels
//! let mut ports = HostPorts::from_records(published);     // idem
//! node.apply_rules(state)?;                               // at start: whole table, one transaction
//! let net = node.ensure_network("zt-proj-env", subnet).await?;  // bridge, gateway, sysctls, rules
//! let ip  = ipam.allocate(subnet, container_id)?;
//! let att = node.attach(container_id, subnet, ip).await?;       // netns file, veth, eth0, route
//! let hp  = ports.allocate(Proto::Tcp, host_ip, None)?;         // bind-tested ephemeral port
//! node.set_published(all_published_ports)?;                     // DNAT maps rebuilt
//! node.detach(container_id, Some(ip)).await?;                   // idempotent, crash-safe
//! node.remove_network(subnet).await?;                           // rules, then bridge
//! ```
//!
//! Modules, one job each: [`config`] (names), [`subnet`] (the /24 pool),
//! [`ipam`] (addresses), [`ports`] (host ports), [`netlink`] (the rtnetlink
//! surface), [`nsfile`] (namespace files), [`network`] (bridges), [`attach`]
//! (veths), [`firewall`] (desired rules → nft script), [`nft`] (running
//! `nft` on our table), [`sysctl`], [`inventory`] (what exists, for `ls` and
//! `gc`), [`node`] (the facade).

pub mod attach;
pub mod config;
pub mod error;
pub mod firewall;
pub mod inventory;
pub mod ipam;
pub mod netlink;
pub mod network;
pub mod nft;
pub mod node;
pub mod nsfile;
pub mod ports;
pub mod subnet;
pub mod sysctl;

pub use attach::Attachment;
pub use config::NetConfig;
pub use error::{Error, Result};
pub use firewall::{BridgeRules, FirewallState, Proto, PublishedPort};
pub use ipam::{IpRecord, Ipam};
pub use network::{Network, network_name};
pub use node::NetNode;
pub use ports::HostPorts;
pub use subnet::{Subnet, SubnetError, gateway_ip, next_free_subnet};
