//! The WireGuard mesh between zattera nodes (wire.md §0.4, §1.1 step 2).
//!
//! - [`state`]: `MeshState`, what the interface should be (whole, desired),
//!   `Inspect`, what it is, and which peers a change touches;
//! - [`backend`]: the `WgBackend` trait and the choice between
//!   [`kernel`] (in-kernel WireGuard over generic netlink) and
//!   [`userspace`] (boringtun over `/dev/net/tun`, configured through its
//!   [`uapi`] socket, in a process that outlives the agent);
//! - [`link`]: the interface's MTU, address and the mesh route, over
//!   rtnetlink, the same for both;
//! - [`key`]: Curve25519 keys.
//!
//! The crate knows nothing of the wire protocol: the agent turns a
//! `PeerSet` into a `MeshState` and hands it to [`Backend::apply`].

pub mod backend;
#[cfg(feature = "userspace")]
mod device;
mod error;
pub mod kernel;
pub mod key;
mod link;
pub mod state;
pub mod status;
pub mod uapi;
pub mod userspace;

pub use backend::{Backend, BackendKind, WgBackend, inspect};
pub use error::{Error, Result};
pub use key::{PrivateKey, PublicKey};
pub use state::{Inspect, MeshState, Net, PeerConfig, PeerStatus};
pub use status::status_path;
pub use userspace::run_device;

/// The reference's mesh MTU (runtime.md §1).
pub const MTU: u32 = 1420;
/// The reference's WireGuard port.
pub const DEFAULT_PORT: u16 = 51820;
