//! Compiles the wire contract in `proto/` (see shared/spec/wire.md) into Rust
//! types, tonic clients and servers, and a file descriptor set for the drift test.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let files = [
        "proto/zattera/cluster/v1/agent.proto",
        "proto/zattera/cluster/v1/routes.proto",
    ];
    tonic_prost_build::configure()
        // Ordered maps: equal sets compare without hashing, and whatever
        // is derived from a map (env order, labels) is deterministic.
        .btree_map(".")
        .file_descriptor_set_path(out.join("zattera_descriptor.bin"))
        .compile_protos(&files, &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
