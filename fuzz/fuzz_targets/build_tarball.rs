//! The build context unpacker with arbitrary bytes (gzip or not): it must
//! never panic, never write outside its destination, and stay within its
//! caps; what it refuses it refuses with an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zattera_agent::image_build::unpack::{Limits, unpack};

fuzz_target!(|data: &[u8]| {
    let Ok(base) = tempfile::tempdir() else {
        return;
    };
    let dest = base.path().join("ctx");
    let limits = Limits {
        max_bytes: 1 << 20,
        max_entries: 1000,
        max_decompressed: 4 << 20,
    };
    let _ = unpack(data, &dest, limits);
    // Nothing beside the destination.
    let names: Vec<_> = std::fs::read_dir(base.path())
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(names.iter().all(|n| n == "ctx"), "wrote outside: {names:?}");
});
