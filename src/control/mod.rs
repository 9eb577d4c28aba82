//! Everything between the agent and a control plane (wire.md §1, §8):
//! enrollment, the node's TLS identity, the AgentSync and route streams.
//! The node API the control plane calls back is a server of its own
//! (`crate::node_api`).
//!
//! - [`join`]: `zattera-agent join`, the token, the CSR, the stored identity,
//!   and [`renew`], which renews it before it expires; [`moved`] takes over
//!   the enrollment a reference worker left;
//! - [`sync`]: the AgentSync client, with [`queue`] (status reports);
//! - [`routes`]: route snapshots (VIPs for DNS), persisted, and [`vip`], the
//!   proxy that answers on those VIPs;
//! - [`services`]: starts the node API server and the route watch beside
//!   the sync stream.
//!
//! The TLS identity, the dialer, the leader target and the back-off are the
//! link floor (`crate::link`), shared with the mesh and builds.

pub mod join;
pub mod moved;
pub mod queue;
pub mod renew;
pub mod routes;
pub mod services;
pub mod sync;
pub mod vip;
