//! The node's link to its cluster, shared by everything that dials the
//! control plane or presents the node's identity: the sync stream and node
//! API (`control`), the mesh's peer watch (`mesh`) and source fetches of
//! builds (`build`).
//!
//! - [`tls`]: rustls configurations for the cluster CA, the node identity
//!   as it is now ([`tls::CurrentTls`]), peer identities.
//! - [`identity`]: the enrollment on disk (key, certificate, CA, registry
//!   credential), written atomically.
//! - [`registry`]: what the enrollment grants pulls (credentials, the
//!   cluster's embedded registry).
//! - [`target`]: where to dial, following the leader of each peer set.
//! - [`follow`]: a stream that follows the target, re-dialing with
//!   [`backoff`].

pub mod backoff;
pub mod follow;
pub mod identity;
pub mod registry;
pub mod target;
pub mod tls;
