//! The containerd runtime: the agent's only door to containers.
//!
//! Everything goes through containerd's gRPC API in the agent's own namespace
//! ([`Containerd`]); nothing shells out to `ctr`. Images are stored client-side
//! (content writes under a lease, image records, unpack with the Diff and
//! Snapshots services) so that containerd 1.6, which has no Transfer service,
//! works as well as 2.x.

pub mod archive;
mod connection;
pub mod containers;
pub mod content;
pub mod descriptor;
pub mod digest;
pub mod disk;
mod error;
pub mod events;
pub mod exec;
pub mod exec_orphans;
pub mod exec_session;
pub mod images;
pub mod lease;
pub mod manifest_get;
mod names;
pub mod oci_runtime;
pub mod oom;
pub mod pull;
pub mod reference;
pub mod rootfs;
pub mod seccomp;
pub mod spec;
pub mod stats;
pub mod top;
pub mod transfer;
pub mod unpack;
pub mod user;

pub use connection::Containerd;
pub use digest::Digest;
pub use error::RuntimeError;
pub use images::{ImportedImage, LocalImage, get_local, import_archive};
pub use names::{InvalidName, Namespace, validate_identifier};
pub use reference::ImageRef;
