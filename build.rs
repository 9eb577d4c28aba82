//! Compiles the wire contract in `proto/` (see shared/spec/wire.md) into Rust
//! types, tonic clients and servers, and a file descriptor set for the drift test.
//!
//! The `.proto` files are parsed by `protox`, a protobuf compiler in Rust
//! that bundles the well-known types (`google/protobuf/timestamp.proto`, …):
//! the build needs no `protoc` and no system include directory for our own
//! contract, so it cannot pass on one machine and fail on another because a
//! `-dev` package happens to be installed.

use std::path::PathBuf;

use prost::Message as _;

#[allow(clippy::disallowed_methods)] // build output in OUT_DIR
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let files = [
        "proto/zattera/cluster/v1/agent.proto",
        "proto/zattera/cluster/v1/routes.proto",
        "proto/zattera/cluster/v1/mesh.proto",
    ];
    let fds = protox::compile(files, ["proto"])?;
    std::fs::write(out.join("zattera_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        // Ordered maps: equal sets compare without hashing, and whatever
        // is derived from a map (env order, labels) is deterministic.
        .btree_map(".")
        .compile_fds(fds)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
