//! The stats store on disk (dataplane.md TS-8, TS-9), so that a restart or
//! a self-upgrade keeps the history `Stats` answers.
//!
//! `<data-dir>/metrics/tsdb.bin`, flushed every [`FLUSH_EVERY`] and when the
//! agent stops: written to `tsdb.bin.tmp`, fsynced, renamed over the old
//! file. Each flush first drops series with no raw point in [`GC_AFTER`].
//! A missing file is an empty start; a corrupt one, a bad magic or another
//! version is logged and the store starts empty (the next flush replaces it).
//!
//! Deviation: the reference writes fixed rings (about 186 KiB per series,
//! TS-10); this writes the points there are, 8 bytes each, so an hour-old
//! series costs a few KiB. Layout, little-endian: `u32` magic, `u32` version
//! (2; the reference's is 1), `u32` series; per series three strings (`u32`
//! length, bytes: metric, scope, id), the open 5-minute bucket (`u8` flag,
//! then `u32` start, `f64` sum, `u32` count), then the raw and the 5-minute
//! points, each a `u32` count of `(u32 unix seconds, f32 value)`.
//!
//! A reference agent's file (version 1) is read too, so a node moved from
//! the reference keeps its history; the next flush writes version 2.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::store::Store;
pub use super::store::{MAGIC, MAX_STRING, REFERENCE_VERSION, VERSION};

pub const FLUSH_EVERY: Duration = Duration::from_secs(60);
/// Series whose newest raw point is older than this are dropped on flush.
pub const GC_AFTER: Duration = Duration::from_secs(48 * 3600);

/// A store and the file it is kept in.
pub type StoreFile = (Arc<Mutex<Store>>, PathBuf);

/// `<data_dir>/metrics/tsdb.bin`.
pub fn path(data_dir: &Path) -> PathBuf {
    data_dir.join("metrics").join("tsdb.bin")
}

/// The store kept at `path`, or an empty one (TS-9).
pub fn load(path: &Path) -> Store {
    match std::fs::read(path) {
        Ok(bytes) => Store::decode(&bytes).unwrap_or_else(|e| {
            tracing::warn!(path = %path.display(), error = %e, "stats store unreadable; starting empty");
            Store::default()
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Store::default(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "stats store unreadable; starting empty");
            Store::default()
        }
    }
}

/// Garbage-collects `store` as of `now` (unix seconds) and writes it.
pub fn flush(store: &Mutex<Store>, path: &Path, now: u32) -> std::io::Result<()> {
    let bytes = {
        let mut s = store
            .lock()
            .map_err(|_| std::io::Error::other("stats store poisoned"))?;
        #[allow(clippy::cast_possible_truncation)]
        s.collect_garbage(now, GC_AFTER.as_secs() as u32);
        s.encode()
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    crate::durable::write(path, &bytes, 0o600)
}

/// Flushes every [`FLUSH_EVERY`] until the task is dropped; the agent
/// flushes once more when it stops.
pub async fn run(store: Arc<Mutex<Store>>, path: PathBuf) {
    let mut tick = tokio::time::interval(FLUSH_EVERY);
    tick.tick().await;
    loop {
        tick.tick().await;
        flush_now(&store, &path).await;
    }
}

/// One flush off the runtime's threads, logged if it fails.
pub async fn flush_now(store: &Arc<Mutex<Store>>, path: &Path) {
    let (store, path) = (Arc::clone(store), path.to_owned());
    let now = super::unix_now();
    let done =
        tokio::task::spawn_blocking(move || flush(&store, &path, now).map_err(|e| (path, e))).await;
    if let Ok(Err((path, e))) = done {
        tracing::warn!(path = %path.display(), error = %e, "stats store not saved");
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::metrics::store::Scope;
    use crate::proto::v1::StatsQuery;

    fn points(s: &Store, now: i64) -> usize {
        s.query(
            &StatsQuery {
                node_id: "n1".into(),
                ..StatsQuery::default()
            },
            "n1",
            now,
        )
        .series
        .iter()
        .map(|x| x.points.len())
        .sum()
    }

    #[test]
    fn a_flushed_store_loads_back_with_its_points() {
        let dir = tempfile::tempdir().unwrap();
        let p = path(dir.path());
        let store = Mutex::new(Store::default());
        let t0 = 1_790_000_000;
        for i in 0..10 {
            store.lock().unwrap().record(
                t0 + i * 15,
                Scope::Node,
                "n1",
                "cpu_percent",
                f64::from(i),
            );
        }
        flush(&store, &p, t0 + 150).unwrap();
        assert!(!p.with_extension("bin.tmp").exists());
        let back = load(&p);
        assert_eq!(back.encode(), store.lock().unwrap().encode());
        assert_eq!(points(&back, i64::from(t0) + 150), 10);
    }

    #[test]
    fn garbage_missing_and_foreign_files_start_empty() {
        let dir = tempfile::tempdir().unwrap();
        let p = path(dir.path());
        assert_eq!(load(&p).newest(), None, "missing");
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        for bytes in [
            b"garbage bytes".to_vec(),
            [MAGIC.to_le_bytes(), 7u32.to_le_bytes(), 0u32.to_le_bytes()].concat(),
            // The reference's version with a series cut short.
            [MAGIC.to_le_bytes(), 1u32.to_le_bytes(), 1u32.to_le_bytes()].concat(),
            [
                MAGIC.to_le_bytes(),
                VERSION.to_le_bytes(),
                5u32.to_le_bytes(),
            ]
            .concat(),
        ] {
            std::fs::write(&p, bytes).unwrap();
            let mut s = load(&p);
            assert_eq!(s.newest(), None);
            s.record(105, Scope::Node, "n1", "m", 1.0);
            assert_eq!(s.newest(), Some(105), "usable");
        }
    }

    #[test]
    fn a_flush_drops_series_silent_for_two_days() {
        let store = Mutex::new(Store::default());
        let now = 1_790_000_000;
        store
            .lock()
            .unwrap()
            .record(now - 49 * 3600, Scope::Instance, "old", "m", 1.0);
        store
            .lock()
            .unwrap()
            .record(now - 3600, Scope::Instance, "new", "m", 1.0);
        let dir = tempfile::tempdir().unwrap();
        flush(&store, &path(dir.path()), now).unwrap();
        let text = String::from_utf8_lossy(&store.lock().unwrap().encode()).into_owned();
        assert!(text.contains("new") && !text.contains("old"), "{text:?}");
    }
}
