//! The stats store's write-ahead log (58.10), as Prometheus keeps its head:
//! every round of samples is appended to `<data-dir>/metrics/tsdb.wal` and
//! synced, and the whole store is written to `tsdb.bin` only now and then
//! (a checkpoint), after which the log starts over. A power cut costs at
//! most the round being written; a round no longer rewrites the store
//! (about 47 MB a minute at 100 instances before).
//!
//! A record: `u32` length of the payload, `u32` CRC-32 of it, the payload:
//! `u32` unix seconds, `u32` points, and per point its scope, id and metric
//! (`u32` length, bytes each) and an `f32` value, little-endian. Reading
//! stops at the first record cut short or whose checksum fails (the torn
//! tail of a cut), and the log is cut back to the records before it.

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::store::{MAX_STRING, Scope, Store};

/// One point of a round.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub scope: Scope,
    pub id: String,
    pub metric: String,
    pub value: f64,
}

/// One round of samples, all taken at `at` (unix seconds).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Round {
    pub at: u32,
    pub points: Vec<Point>,
}

impl Round {
    /// Records the round's points in `store`.
    pub fn apply(&self, store: &mut Store) {
        for p in &self.points {
            store.record(self.at, p.scope, &p.id, &p.metric, p.value);
        }
        store.forget_stale(self.at);
    }

    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.at.to_le_bytes());
        put_u32(&mut out, self.points.len());
        for p in &self.points {
            for text in [p.scope.label(), p.id.as_str(), p.metric.as_str()] {
                put_u32(&mut out, text.len());
                out.extend_from_slice(text.as_bytes());
            }
            #[allow(clippy::cast_possible_truncation)]
            out.extend_from_slice(&(p.value as f32).to_le_bytes());
        }
        out
    }

    fn decode(mut bytes: &[u8]) -> Option<Self> {
        let at = take_u32(&mut bytes)?;
        let n = take_u32(&mut bytes)?;
        let mut points = Vec::new();
        for _ in 0..n {
            let scope = Scope::from_label(&take_text(&mut bytes)?)?;
            let id = take_text(&mut bytes)?;
            let metric = take_text(&mut bytes)?;
            let value = f32::from_le_bytes(take(&mut bytes, 4)?.try_into().ok()?);
            points.push(Point {
                scope,
                id,
                metric,
                value: f64::from(value),
            });
        }
        bytes.is_empty().then_some(Self { at, points })
    }
}

/// `<data_dir>/metrics/tsdb.wal`.
pub fn path(data_dir: &Path) -> PathBuf {
    data_dir.join("metrics").join("tsdb.wal")
}

/// The log, open for appending once the first round comes.
#[derive(Debug)]
pub struct Wal {
    path: PathBuf,
    file: Option<File>,
}

impl Wal {
    pub fn new(path: PathBuf) -> Self {
        Self { path, file: None }
    }

    /// Appends `round` and syncs it: on disk when this returns.
    pub fn append(&mut self, round: &Round) -> io::Result<()> {
        if self.file.is_none() {
            if let Some(dir) = self.path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(&self.path)?;
            crate::durable::sync_parent(&self.path)?;
            self.file = Some(file);
        }
        let payload = round.encode();
        let mut record = Vec::with_capacity(payload.len() + 8);
        put_u32(&mut record, payload.len());
        record.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
        record.extend_from_slice(&payload);
        let Some(file) = self.file.as_mut() else {
            return Ok(());
        };
        file.write_all(&record)?;
        file.sync_data()
    }

    /// After a checkpoint holds every round: the log starts over.
    pub fn reset(&mut self) -> io::Result<()> {
        self.file = None;
        match std::fs::remove_file(&self.path) {
            Ok(()) => crate::durable::sync_parent(&self.path),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Applies every whole record of the log to `store`, in order, and cuts
    /// a torn tail away. How many rounds were applied.
    pub fn replay(&mut self, store: &mut Store) -> io::Result<usize> {
        let bytes = match std::fs::read(&self.path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut rest = bytes.as_slice();
        let mut rounds = 0;
        while let Some(round) = next_record(&mut rest) {
            round.apply(store);
            rounds += 1;
        }
        if !rest.is_empty() {
            let good = bytes.len() - rest.len();
            tracing::warn!(
                path = %self.path.display(),
                kept = rounds,
                cut = rest.len(),
                "the stats log ends in a torn record (a power cut); cut back to the rounds before it"
            );
            let file = std::fs::OpenOptions::new().write(true).open(&self.path)?;
            file.set_len(u64::try_from(good).unwrap_or(0))?;
            file.sync_all()?;
        }
        Ok(rounds)
    }
}

/// The next whole, checksummed record of `rest`, which then starts after
/// it; `None` (and `rest` untouched) at the end or at a torn record.
fn next_record(rest: &mut &[u8]) -> Option<Round> {
    let mut r = *rest;
    let len = usize::try_from(take_u32(&mut r)?).ok()?;
    let crc = take_u32(&mut r)?;
    let payload = take(&mut r, len)?;
    if crc32fast::hash(payload) != crc {
        return None;
    }
    let round = Round::decode(payload)?;
    *rest = r;
    Some(round)
}

fn put_u32(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
}

fn take<'a>(bytes: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if bytes.len() < n {
        return None;
    }
    let (head, tail) = bytes.split_at(n);
    *bytes = tail;
    Some(head)
}

fn take_u32(bytes: &mut &[u8]) -> Option<u32> {
    Some(u32::from_le_bytes(take(bytes, 4)?.try_into().ok()?))
}

fn take_text(bytes: &mut &[u8]) -> Option<String> {
    let n = usize::try_from(take_u32(bytes)?).ok()?;
    if n > MAX_STRING {
        return None;
    }
    String::from_utf8(take(bytes, n)?.to_vec()).ok()
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn round(at: u32, value: f64) -> Round {
        Round {
            at,
            points: vec![
                Point {
                    scope: Scope::Node,
                    id: "n1".into(),
                    metric: "cpu_percent".into(),
                    value,
                },
                Point {
                    scope: Scope::Instance,
                    id: "web-0".into(),
                    metric: "memory_bytes".into(),
                    value: 1024.0,
                },
            ],
        }
    }

    #[test]
    fn rounds_come_back_in_order_and_a_torn_tail_is_cut_away() {
        let dir = tempfile::tempdir().unwrap();
        let p = path(dir.path());
        let mut wal = Wal::new(p.clone());
        let t0 = 1_790_000_000;
        let mut expected = Store::default();
        for i in 0..5 {
            let r = round(t0 + i * 15, f64::from(i));
            wal.append(&r).unwrap();
            r.apply(&mut expected);
        }
        let whole = std::fs::metadata(&p).unwrap().len();
        // A cut in the middle of the sixth round.
        wal.append(&round(t0 + 75, 9.0)).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(whole + 11).unwrap();

        let mut store = Store::default();
        assert_eq!(Wal::new(p.clone()).replay(&mut store).unwrap(), 5);
        assert_eq!(store.encode(), expected.encode());
        assert_eq!(std::fs::metadata(&p).unwrap().len(), whole, "cut back");

        // A flipped bit ends the log there too.
        let mut bytes = std::fs::read(&p).unwrap();
        let last = bytes.len() - 3;
        bytes[last] ^= 0x40;
        std::fs::write(&p, &bytes).unwrap();
        let mut store = Store::default();
        assert_eq!(Wal::new(p).replay(&mut store).unwrap(), 4);
    }

    #[test]
    fn a_reset_log_replays_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let mut wal = Wal::new(path(dir.path()));
        wal.append(&round(1_790_000_000, 1.0)).unwrap();
        wal.reset().unwrap();
        let mut store = Store::default();
        assert_eq!(wal.replay(&mut store).unwrap(), 0);
        wal.append(&round(1_790_000_015, 2.0)).unwrap();
        assert_eq!(wal.replay(&mut store).unwrap(), 1);
    }
}
