//! The standalone manifest parser with arbitrary text: it must never panic,
//! and whatever it accepts must become assignments without panicking, with
//! errors that name the file.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use zattera_agent::source::manifest;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let file = Path::new("/etc/zattera/manifests/fuzz.toml");
    match manifest::parse(text, file) {
        Ok(app) => {
            // Accepted input is well-formed all the way down.
            let _ = format!("{app:?}");
        }
        Err(e) => assert!(e.to_string().contains("fuzz.toml"), "{e}"),
    }
});
