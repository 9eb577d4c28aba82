//! Assignment sources: where the desired set comes from. Like kubelet's
//! sources, each produces the same thing, a full `AssignmentSet`, so the
//! executor does not care whether a control plane or manifest files spoke.
//!
//! Standalone (manifest files on disk): [`manifest`] parses one file,
//! [`assign`] turns it into assignments, [`subnets`] gives each (project,
//! environment) a local subnet, [`standalone`] ties them into a full set, and
//! [`watch`](mod@watch) says when the directory changed. The agent's loop is:
//!
//! ```text
//! let mut source = StandaloneSource::new(dir, data_dir.join("standalone"));
//! let (_watcher, mut changed) = watch(dir)?;
//! loop { let Loaded { set, errors } = source.load(); /* log errors, submit set */
//!        changed.recv().await; }
//! ```
//!
//! One thing differs from a control plane's set, and the executor must know
//! it: a manifest's fixed `host_port` arrives in the desired
//! `Assignment.mesh_port_bindings` (port name → requested host port), which
//! control never fills. In standalone mode the executor publishes a port
//! named there on that host port, and picks an ephemeral one otherwise.

pub mod assign;
mod claims;
pub mod feed;
mod keypath;
pub mod local_names;
pub mod manifest;
pub mod name;
pub mod standalone;
pub mod subnets;
pub mod watch;

pub use standalone::{FileError, Loaded, StandaloneSource};
pub use subnets::SubnetBook;
pub use watch::{ManifestWatcher, watch};
