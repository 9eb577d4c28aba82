//! The status board: the last observation of every assignment (what
//! `status` shows and DNS reads), the retry counts of E-9, and the batches
//! for the control stream. One writer: the executor loop.

use std::collections::HashMap;

use tokio::sync::mpsc;

use crate::status::{Observation, State};

/// Bring-up attempts before an assignment is parked until its hash changes (E-9).
pub const MAX_FAILURES: u32 = 3;

#[derive(Debug, Default)]
struct Record {
    observation: Option<Observation>,
    failures: u32,
    failed_hash: String,
}

#[derive(Debug)]
pub(super) struct Board {
    records: HashMap<String, Record>,
    /// The control stream's batches; `None` in standalone.
    batches: Option<mpsc::UnboundedSender<Vec<Observation>>>,
}

impl Board {
    pub fn new(batches: Option<mpsc::UnboundedSender<Vec<Observation>>>) -> Self {
        Self {
            records: HashMap::new(),
            batches,
        }
    }

    /// Records `batch` and sends it on. A HEALTHY or UNHEALTHY verdict is
    /// not replaced by the same container's RUNNING (S-10), as control does.
    /// Records and sends a batch; whether a record changed in what the
    /// status shows (a poll's RUNNING that repeats the last one does not:
    /// at 1,000 instances that is 200 reports a second).
    pub fn emit(&mut self, batch: Vec<Observation>) -> bool {
        if batch.is_empty() {
            return false;
        }
        let mut changed = false;
        for obs in &batch {
            let record = self.records.entry(obs.assignment_id.clone()).or_default();
            let keep = obs.state == State::Running
                && record.observation.as_ref().is_some_and(|prev| {
                    matches!(prev.state, State::Healthy | State::Unhealthy)
                        && prev.container_id == obs.container_id
                });
            if !keep {
                changed |= !record
                    .observation
                    .as_ref()
                    .is_some_and(|prev| prev.shows_as(obs));
                record.observation = Some(obs.clone());
            }
        }
        // Unbounded, so never dropped: the queue task reads it at once
        // (it never waits for control) and folds per assignment.
        if let Some(tx) = &self.batches {
            let _ = tx.send(batch);
        }
        changed
    }

    pub fn observation(&self, id: &str) -> Option<&Observation> {
        self.records.get(id).and_then(|r| r.observation.as_ref())
    }

    #[cfg(test)]
    pub fn is_healthy(&self, id: &str) -> bool {
        self.observation(id)
            .is_some_and(|o| o.state == State::Healthy)
    }

    /// Whether the assignment is parked for this hash (E-9).
    pub fn parked(&mut self, id: &str, hash: &str) -> bool {
        let record = self.records.entry(id.to_owned()).or_default();
        if record.failed_hash != hash {
            record.failures = 0;
        }
        record.failures >= MAX_FAILURES
    }

    /// Counts one failed attempt for `hash`; `true` when this one parks it.
    pub fn failed(&mut self, id: &str, hash: &str) -> bool {
        let record = self.records.entry(id.to_owned()).or_default();
        if record.failed_hash != hash {
            record.failures = 0;
            hash.clone_into(&mut record.failed_hash);
        }
        record.failures += 1;
        record.failures == MAX_FAILURES
    }

    pub fn succeeded(&mut self, id: &str) {
        if let Some(r) = self.records.get_mut(id) {
            r.failures = 0;
            r.failed_hash.clear();
        }
    }

    /// An assignment no longer desired and no longer running.
    pub fn forget(&mut self, id: &str) {
        self.records.remove(id);
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn running_does_not_replace_a_verdict_of_the_same_container() {
        let mut b = Board::new(None);
        b.emit(vec![Observation::new("a", State::Healthy).container("c1")]);
        b.emit(vec![Observation::new("a", State::Running).container("c1")]);
        assert!(b.is_healthy("a"));
        // A new container starts over.
        b.emit(vec![Observation::new("a", State::Running).container("c2")]);
        assert!(!b.is_healthy("a"));
    }

    /// 59.2: a poll's RUNNING that repeats the last report changes no row,
    /// so the executor does not rebuild the status of every instance for it
    /// (200 times a second at 1,000 instances); it is still sent on.
    #[test]
    fn a_repeated_report_changes_nothing_shown_but_is_sent() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut b = Board::new(Some(tx));
        let running = || Observation::new("a", State::Running).container("c1");
        assert!(b.emit(vec![running()]), "the first report");
        let mut later = running();
        later.updated_at += std::time::Duration::from_secs(5);
        assert!(!b.emit(vec![later]), "the same report, 5 s later");
        assert!(b.emit(vec![running().message("restarting")]));
        assert!(b.emit(vec![Observation::new("a", State::Healthy).container("c1")]));
        assert!(!b.emit(vec![running()]), "RUNNING kept under HEALTHY");
        let mut n = 0;
        while let Ok(batch) = rx.try_recv() {
            n += batch.len();
        }
        assert_eq!(n, 5);
    }

    /// Issue 44.4: a bounded channel and `try_send` lost what did not fit,
    /// and a lost HEALTHY or FAILED was never sent again.
    #[test]
    fn every_batch_reaches_the_queue_however_slowly_it_reads() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut b = Board::new(Some(tx));
        for i in 0..300 {
            b.emit(vec![Observation::new(&format!("a{i}"), State::Healthy)]);
        }
        let mut n = 0;
        while let Ok(batch) = rx.try_recv() {
            n += batch.len();
        }
        assert_eq!(n, 300);
    }

    #[test]
    fn three_failures_of_one_hash_park_it_until_the_hash_changes() {
        let mut b = Board::new(None);
        assert!(!b.failed("a", "h1"));
        assert!(!b.failed("a", "h1"));
        assert!(b.failed("a", "h1"));
        assert!(b.parked("a", "h1"));
        assert!(!b.parked("a", "h2"), "a new hash gets new attempts");
    }
}
