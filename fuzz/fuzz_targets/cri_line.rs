//! The CRI log line parser (what QueryLogs and `logs` read every stored
//! line with): no input may panic it, and what it accepts lies within the
//! line it was given.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zattera_agent::logs::query::parse_cri;

fuzz_target!(|data: &[u8]| {
    let line = String::from_utf8_lossy(data);
    if let Some(l) = parse_cri(&line) {
        assert!(l.text.len() <= line.len());
    }
});
