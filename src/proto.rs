//! The wire contract (shared/spec/wire.md), compiled from `proto/` at build time.
//!
//! The module tree mirrors the protobuf packages so that prost's relative paths
//! between `zattera.cluster.v1` and `zattera.v1` resolve.

#[allow(
    clippy::all,
    clippy::pedantic,
    missing_docs,
    missing_debug_implementations
)]
pub mod zattera {
    pub mod v1 {
        tonic::include_proto!("zattera.v1");
    }
    pub mod cluster {
        pub mod v1 {
            tonic::include_proto!("zattera.cluster.v1");
        }
    }
}

pub use zattera::cluster::v1 as cluster;
pub use zattera::v1;

/// The compiled `FileDescriptorSet` of every file in `proto/`, for the drift test
/// and for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/zattera_descriptor.bin"));
