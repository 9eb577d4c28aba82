//! Everything between the agent and a control plane (wire.md §1, §8):
//! enrollment, the node's TLS identity, the AgentSync and route streams,
//! and the node API server.
//!
//! - [`join`]: `zattera-agent join`, the token, the CSR, the stored identity;
//! - [`identity`]: the files a join leaves under the data dir;
//! - [`tls`]: rustls configurations and the dialer every hop uses;
//! - [`sync`]: the AgentSync client, with [`queue`] (status reports),
//!   [`backoff`] (reconnects) and [`host`] (heartbeat samples);
//! - [`routes`]: route snapshots (VIPs for DNS), persisted;
//! - [`node_api`]: the `AgentLocalService` server control dials;
//! - [`services`]: starts those two beside the sync stream.

pub mod join;
pub mod node_api;
pub mod queue;
pub mod renew;
pub mod routes;
pub mod services;
pub mod sync;
pub mod vip;
