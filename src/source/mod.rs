//! Assignment sources: where the desired set comes from. Like kubelet's
//! sources, each produces the same thing, a full `AssignmentSet`, so the
//! executor does not care whether a control plane or manifest files spoke.
//!
//! Standalone (manifest files on disk): [`manifest`] parses one file,
//! [`assign`] turns it into assignments, [`subnets`] gives each (project,
//! environment) a local subnet, [`standalone`] ties them into a full set, and
//! [`watch`] says when the directory changed.

pub mod assign;
mod keypath;
pub mod manifest;
pub mod name;
pub mod standalone;
pub mod subnets;
pub mod watch;

pub use standalone::{FileError, Loaded, StandaloneSource};
pub use subnets::SubnetBook;
pub use watch::{ManifestWatcher, watch};
