//! The stats store on disk (dataplane.md TS-8, TS-9), so that a restart or
//! a self-upgrade keeps the history `Stats` answers.
//!
//! `<data-dir>/metrics/tsdb.bin` is a checkpoint of the whole store,
//! written every [`CHECKPOINT_EVERY`] and when the agent stops (durably:
//! a temporary file, synced, renamed, the directory synced); each round of
//! samples between two checkpoints is in the write-ahead log beside it
//! ([`super::wal`]), replayed at start. Each checkpoint first drops series
//! with no raw point in [`GC_AFTER`]. A missing file is an empty start; an
//! unreadable one (a bad magic, another version, cut short) is set aside
//! (`tsdb.bin.broken-<time>`), never overwritten, and the store starts from
//! the log alone.
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
//! the reference keeps its history; the next checkpoint writes version 2.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::store::Store;
pub use super::store::{MAGIC, MAX_STRING, REFERENCE_VERSION, VERSION};
use super::wal::{Round, Wal};

/// How often the whole store is written; the log holds the rounds between.
pub const CHECKPOINT_EVERY: Duration = Duration::from_secs(15 * 60);
/// Series whose newest raw point is older than this are dropped on flush.
pub const GC_AFTER: Duration = Duration::from_secs(48 * 3600);

/// The store, its checkpoint file and its log. Rounds and checkpoints take
/// the log's lock first, then the store's: a checkpoint never misses a
/// round that the log it resets held.
#[derive(Debug, Clone)]
pub struct StoreFile {
    pub store: Arc<Mutex<Store>>,
    pub path: PathBuf,
    wal: Arc<Mutex<Wal>>,
}

/// `<data_dir>/metrics/tsdb.bin`.
pub fn path(data_dir: &Path) -> PathBuf {
    data_dir.join("metrics").join("tsdb.bin")
}

impl StoreFile {
    /// The store of `data_dir`: its checkpoint, then every round of its log.
    pub fn open(data_dir: &Path) -> Self {
        let path = path(data_dir);
        let mut store = load(&path);
        let mut wal = Wal::new(super::wal::path(data_dir));
        match wal.replay(&mut store) {
            Ok(0) => {}
            Ok(rounds) => tracing::info!(rounds, "stats rounds replayed from the log"),
            Err(e) => {
                tracing::warn!(error = %e, "the stats log could not be read; its rounds are lost");
            }
        }
        Self {
            store: Arc::new(Mutex::new(store)),
            path,
            wal: Arc::new(Mutex::new(wal)),
        }
    }

    /// Records one round in the store and appends it to the log, synced
    /// (blocking: called off the runtime's threads).
    pub fn record(&self, round: &Round) {
        let Ok(mut wal) = self.wal.lock() else {
            return;
        };
        if let Ok(mut store) = self.store.lock() {
            round.apply(&mut store);
        }
        if let Err(e) = wal.append(round) {
            tracing::warn!(error = %e, "a stats round was not logged; kept in memory until the next checkpoint");
        }
    }

    /// Garbage-collects the store as of `now` (unix seconds), writes it,
    /// and starts the log over.
    pub fn checkpoint(&self, now: u32) -> std::io::Result<()> {
        let mut wal = self
            .wal
            .lock()
            .map_err(|_| std::io::Error::other("stats log poisoned"))?;
        flush(&self.store, &self.path, now)?;
        wal.reset()
    }

    /// Checkpoints every [`CHECKPOINT_EVERY`] until the task is dropped;
    /// the agent checkpoints once more when it stops.
    pub async fn run(self) {
        let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
        tick.tick().await;
        loop {
            tick.tick().await;
            self.checkpoint_now().await;
        }
    }

    /// One checkpoint off the runtime's threads, logged if it fails.
    pub async fn checkpoint_now(&self) {
        let this = self.clone();
        let now = super::unix_now();
        let done = tokio::task::spawn_blocking(move || this.checkpoint(now)).await;
        if let Ok(Err(e)) = done {
            tracing::warn!(path = %self.path.display(), error = %e, "stats store not saved; its rounds stay in the log");
        }
    }
}

/// The store kept at `path`, or an empty one (TS-9); an unreadable file is
/// set aside.
pub fn load(path: &Path) -> Store {
    let unreadable = |e: &dyn std::fmt::Display| {
        let aside = crate::durable::set_aside(path);
        tracing::warn!(path = %path.display(), error = %e, aside = ?aside, "stats store unreadable; set aside, starting from the log");
        Store::default()
    };
    match std::fs::read(path) {
        Ok(bytes) => Store::decode(&bytes).unwrap_or_else(|e| unreadable(&e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Store::default(),
        Err(e) => unreadable(&e),
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
    crate::durable::write(path, &bytes, 0o600)
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
            assert!(!p.exists(), "set aside, not left to be overwritten");
            s.record(105, Scope::Node, "n1", "m", 1.0);
            assert_eq!(s.newest(), Some(105), "usable");
        }
    }

    /// 58.10: the rounds after the last checkpoint come back from the log
    /// (a cut lost everything since the last minute's rewrite before, and
    /// each minute rewrote the whole store); a checkpoint starts it over.
    #[test]
    fn rounds_since_the_checkpoint_come_back_from_the_log() {
        use crate::metrics::wal::{Point, Round};
        let dir = tempfile::tempdir().unwrap();
        let t0 = 1_790_000_000;
        let round = |i: u32| Round {
            at: t0 + i * 15,
            points: vec![Point {
                scope: Scope::Node,
                id: "n1".into(),
                metric: "cpu_percent".into(),
                value: f64::from(i),
            }],
        };
        let file = StoreFile::open(dir.path());
        for i in 0..4 {
            file.record(&round(i));
        }
        file.checkpoint(t0 + 60).unwrap();
        for i in 4..10 {
            file.record(&round(i));
        }
        let wal = crate::metrics::wal::path(dir.path());
        let logged = std::fs::metadata(&wal).unwrap().len();
        assert!(logged < 1024, "six rounds of one point: {logged} bytes");
        // The cut: nothing more is written. The next start has every round.
        let back = StoreFile::open(dir.path());
        let now = i64::from(t0) + 150;
        assert_eq!(points(&back.store.lock().unwrap(), now), 10);
        back.checkpoint(t0 + 150).unwrap();
        assert!(!wal.exists(), "the log starts over after a checkpoint");
        assert_eq!(
            points(&StoreFile::open(dir.path()).store.lock().unwrap(), now),
            10
        );
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
