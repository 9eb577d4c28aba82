//! A one-line progress display for `image pull` on a terminal.

use std::io::Write;
use std::sync::{Arc, Mutex};

use zattera_agent::runtime::pull::{ProgressFn, PullEvent};

#[derive(Debug, Default)]
struct State {
    layers: usize,
    layers_done: usize,
    total: u64,
    received: u64,
    unpacking: bool,
}

/// Redraws `pulling REF: 2/5 layers, 12.3/100.0 MiB` on stderr.
pub fn terminal(reference: String) -> ProgressFn {
    let state = Arc::new(Mutex::new(State::default()));
    Arc::new(move |event| {
        let Ok(mut s) = state.lock() else { return };
        match event {
            PullEvent::Resolved { layers, bytes, .. } => {
                s.layers = layers;
                s.total = bytes;
            }
            PullEvent::LayerBytes { bytes, .. } => s.received += bytes,
            PullEvent::LayerDone { .. } => s.layers_done += 1,
            PullEvent::Unpacking => s.unpacking = true,
        }
        #[allow(clippy::cast_precision_loss)]
        let mib = |b: u64| b as f64 / 1_048_576.0;
        let phase = if s.unpacking { ", unpacking" } else { "" };
        let _ = write!(
            std::io::stderr(),
            "\r\x1b[Kpulling {reference}: {}/{} layers, {:.1}/{:.1} MiB{phase}",
            s.layers_done,
            s.layers,
            mib(s.received),
            mib(s.total)
        );
    })
}
