//! Everything between the agent and a control plane (wire.md §1, §8):
//! enrollment, the node's TLS identity, and the AgentSync stream.
//!
//! - [`join`]: `zattera-agent join`, the token, the CSR, the stored identity;
//! - [`identity`]: the files a join leaves under the data dir;
//! - [`tls`]: rustls configurations and the dialer every hop uses;
//! - [`sync`]: the AgentSync client, with [`queue`] (status reports),
//!   [`backoff`] (reconnects) and [`host`] (heartbeat samples).

pub mod backoff;
pub mod host;
pub mod identity;
pub mod join;
pub mod queue;
pub mod sync;
pub mod tls;
