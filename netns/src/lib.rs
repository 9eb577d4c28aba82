//! zattera-netns: every change the node agent makes to the host's network.
//!
//! One Linux bridge per (project, environment) on `10.201.X.0/24` with the
//! gateway on `.1`, one network namespace and veth per container, and the
//! agent's own nftables table for NAT, isolation and published ports
//! (runtime.md §7, C-7, C-9; DESIGN decisions 2, 3, 5).
//!
//! # What it owns, and nothing else
//!
//! Every name comes from one [`NetConfig`], so tests and several agents run
//! side by side:
//! - bridges `<prefix><slot>` (default `ztbr7` for `10.201.7.0/24`), which
//!   carry the alias `zattera:<network name>` as proof of ownership; a
//!   bridge is built as `<prefix><slot>t` and renamed into place when done;
//! - host veth ends `<prefix><slot>v<host octet>`, named after the address;
//! - namespace files `<netns_dir>/<container id>`, the directory made a
//!   shared bind mount of itself the way iproute2 treats /run/netns;
//! - the nftables table `inet <nft_table>`, always replaced whole in one
//!   transaction and never anything else (no flush of the ruleset).
//!
//! Host-wide, [`NetNode::ensure_network`] sets `net.ipv4.ip_forward=1`, as any
//! container host must.
//!
//! # State
//!
//! The crate keeps no state file. IP and port records live with the caller
//! (the agent keeps them in container labels) and rebuild [`Ipam`] and
//! [`HostPorts`] at start; the bridges, veths and namespace files are read
//! back from the kernel ([`inventory`]), and the rules from our table.
//!
//! # Use, in the executor's order
//!
//! ```text
//! let node  = NetNode::new(cfg)?;                       // netlink connection; touches nothing
//! let mut ipam  = Ipam::from_records(&records)?;          // from container labels
//! let mut ports = HostPorts::new(PortRange::DEFAULT);    // then ports.hold(..) per record
//! // at start, from records: cfg.bridge_rules(subnet) per network and
//! // "tcp/127.0.0.1:8080->10.201.5.2:80".parse::<PublishedPort>() per port label
//! node.apply_rules(state).await?;                         // whole table, one transaction
//! let net = node.ensure_network("zt-proj-env", subnet).await?;  // bridge, gateway, sysctls, rules
//! let ip  = ipam.allocate(subnet, container_id)?;
//! let att = node.attach(container_id, subnet, ip).await?;       // netns file, veth, eth0, route
//! // the OCI spec's network namespace path is att.netns_path; DNS is att.gateway
//! let hp  = ports.allocate(Proto::Tcp, host_ip, None)?;         // an ephemeral port, held by a socket
//! node.set_published(all_published_ports).await?;               // DNAT maps rebuilt; UDP flows forgotten
//! ports.release(..); node.set_published(..).await?; ports.retire(); // unpublish: rule first, then the socket
//! node.detach(container_id, Some(ip)).await?;                   // idempotent, crash-safe
//! node.remove_network(subnet).await?;                           // rules, then bridge
//! let plan = inventory::plan(&inventory::read(&node).await?, Some(&live_ids));
//! inventory::apply(&node, &plan).await?;                        // orphans after a crash (N-5)
//! ```
//!
//! Modules, one job each: [`config`] (names), [`subnet`] (the /24 pool),
//! [`ipam`] (addresses), [`ports`] (host ports), [`netlink`] (the rtnetlink
//! surface), [`nsfile`] (namespace files), [`network`] (bridges), [`attach`]
//! (veths), [`firewall`] (desired rules → nft script), [`nft`] (running
//! `nft` on our table), [`conntrack`] (forgetting
//! unpublished flows), [`sysctl`], [`inventory`] (what exists, for `ls` and
//! `gc`), [`dig`] (a DNS query from inside a container's namespace),
//! [`node`] (the facade), [`error`].

pub mod attach;
pub mod config;
pub mod conntrack;
pub mod dig;
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
pub mod target;
pub mod vip;

pub use attach::{Attachment, Repaired};
pub use config::NetConfig;
pub use error::{Error, Result};
pub use firewall::{BridgeRules, FirewallState, Proto, PublishedPort, ScopedVip};
pub use ipam::{IpRecord, Ipam};
pub use network::{Network, network_name};
pub use node::NetNode;
pub use ports::{HostPorts, PortRange};
pub use subnet::{Subnet, SubnetError, gateway_ip, next_free_subnet};
