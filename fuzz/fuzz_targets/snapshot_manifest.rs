//! What a snapshot restore reads from the store: the manifest JSON and a
//! chunk's compressed body. Neither may panic, and decompression never
//! yields more than its limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zattera_agent::snapshot::Manifest;
use zattera_agent::snapshot::seal::decompress;

fuzz_target!(|data: &[u8]| {
    let _ = serde_json::from_slice::<Manifest>(data);
    if let Ok(plain) = decompress(data, 64 << 10) {
        assert!(plain.len() <= 64 << 10);
    }
});
