//! The status queue between the executor and the control stream
//! (runtime.md S-5, with the allowed deviation).
//!
//! It belongs to the agent, not to a session, so it buffers while control
//! is away. Reports queue as batches in arrival order; a batch never holds
//! two reports of one assignment, so every transition goes out in order.
//! When more than `batches` are waiting, or more than `entries` reports,
//! the two oldest batches are merged per assignment (latest state wins; the
//! last non-empty port bindings are kept). The latest report of an
//! assignment is never dropped (the reference drops the newest when full):
//! past the cap only older states of assignments with newer ones waiting
//! go, so what waits is at most one report per assignment. It also
//! remembers the latest report of every assignment of the current set and
//! re-queues them after each hello, so a report lost with a broken session
//! is resent (control's last-write-wins makes that safe).

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use tokio::sync::{mpsc, oneshot};

use crate::proto::cluster::StatusBatch;
use crate::proto::v1::AssignmentObserved;
use crate::status::Observation;

/// Batches waiting, as in the reference (wire.md §1.6).
pub const DEFAULT_BATCHES: usize = 64;
/// Reports waiting in all batches together.
pub const DEFAULT_ENTRIES: usize = 4096;

/// One frame's worth of reports, at most one per assignment, in arrival
/// order (a fold keeps it).
#[derive(Debug, Default)]
struct Batch {
    order: VecDeque<String>,
    map: BTreeMap<String, AssignmentObserved>,
}

impl Batch {
    fn contains(&self, id: &str) -> bool {
        self.map.contains_key(id)
    }
    /// Adds or replaces (then as the newest); true if it replaced one.
    fn put(&mut self, id: String, obs: AssignmentObserved) -> bool {
        let replaced = self.map.insert(id.clone(), obs).is_some();
        if replaced {
            self.order.retain(|o| *o != id);
        }
        self.order.push_back(id);
        replaced
    }
    fn len(&self) -> usize {
        self.map.len()
    }
}

/// The queue's state; owned by the queue task, plain data for tests.
#[derive(Debug)]
pub struct StatusQueue {
    max_batches: usize,
    max_entries: usize,
    batches: VecDeque<Batch>,
    entries: usize,
    latest: HashMap<String, AssignmentObserved>,
    /// Older states replaced by a newer one of the same assignment.
    folded: u64,
}

impl StatusQueue {
    pub fn new(max_batches: usize, max_entries: usize) -> Self {
        Self {
            max_batches: max_batches.max(1),
            max_entries: max_entries.max(1),
            batches: VecDeque::new(),
            entries: 0,
            latest: HashMap::new(),
            folded: 0,
        }
    }

    /// Queues one report of assignment `id`.
    pub fn push(&mut self, id: &str, mut obs: AssignmentObserved) {
        if obs.mesh_port_bindings.is_empty()
            && let Some(prev) = self.latest.get(id)
        {
            obs.mesh_port_bindings.clone_from(&prev.mesh_port_bindings);
        }
        self.latest.insert(id.to_owned(), obs.clone());
        self.append(id.to_owned(), obs);
    }

    fn append(&mut self, id: String, obs: AssignmentObserved) {
        match self.batches.back_mut() {
            Some(last) if !last.contains(&id) => {
                last.put(id, obs);
            }
            _ => {
                let mut b = Batch::default();
                b.put(id, obs);
                self.batches.push_back(b);
            }
        }
        self.entries += 1;
        self.bound();
    }

    fn bound(&mut self) {
        // Too many batches or reports: fold the oldest two, the newer report
        // winning. One batch holds one report per assignment, so folding
        // ends with every assignment's latest state and nothing else.
        while self.batches.len() > 1
            && (self.batches.len() > self.max_batches || self.entries > self.max_entries)
        {
            let (Some(mut oldest), Some(next)) =
                (self.batches.pop_front(), self.batches.pop_front())
            else {
                break;
            };
            let Batch { order, mut map } = next;
            for id in order {
                if let Some(obs) = map.remove(&id)
                    && oldest.put(id, obs)
                {
                    self.entries -= 1;
                    self.folded += 1;
                }
            }
            self.batches.push_front(oldest);
        }
    }

    /// The oldest batch; `None` when nothing waits.
    pub fn take(&mut self) -> Option<StatusBatch> {
        let batch = self.batches.pop_front()?;
        self.entries -= batch.len();
        Some(StatusBatch {
            observed: batch.map,
        })
    }

    /// Puts back a batch that was never sent, minus the assignments that
    /// have newer reports waiting.
    pub fn restore(&mut self, batch: StatusBatch) {
        let mut restored = Batch::default();
        for (id, obs) in batch.observed {
            if !self.batches.iter().any(|b| b.contains(&id)) {
                restored.put(id, obs);
            }
        }
        if !restored.map.is_empty() {
            self.entries += restored.len();
            self.batches.push_front(restored);
            self.bound();
        }
    }

    /// Re-queues the latest report of every known assignment that has
    /// nothing waiting (a new session).
    pub fn resync(&mut self) {
        let missing: Vec<_> = self
            .latest
            .iter()
            .filter(|(id, _)| !self.batches.iter().any(|b| b.contains(id)))
            .map(|(id, o)| (id.clone(), o.clone()))
            .collect();
        for (id, obs) in missing {
            self.append(id, obs);
        }
    }

    /// Forgets the latest reports of assignments no longer in the set.
    pub fn retain(&mut self, ids: &HashSet<String>) {
        self.latest.retain(|id, _| ids.contains(id));
    }

    /// Reports waiting.
    pub fn len(&self) -> usize {
        self.entries
    }
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }
    pub fn folded(&self) -> u64 {
        self.folded
    }
}

enum Command {
    Take(oneshot::Sender<StatusBatch>),
    Resync,
    Retain(HashSet<String>),
}

/// Talks to the queue task.
#[derive(Debug, Clone)]
pub struct QueueHandle {
    tx: mpsc::Sender<Command>,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Command::Take(_) => "Take",
            Command::Resync => "Resync",
            Command::Retain(_) => "Retain",
        })
    }
}

impl QueueHandle {
    /// Waits for the next non-empty batch; `None` once the queue task ended.
    pub async fn next_batch(&self) -> Option<StatusBatch> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::Take(tx)).await.ok()?;
        rx.await.ok()
    }
    pub async fn resync(&self) {
        let _ = self.tx.send(Command::Resync).await;
    }
    pub async fn retain(&self, ids: HashSet<String>) {
        let _ = self.tx.send(Command::Retain(ids)).await;
    }
}

/// Starts the queue task fed by the executor's `batches`.
pub fn spawn(
    queue: StatusQueue,
    batches: mpsc::UnboundedReceiver<Vec<Observation>>,
) -> QueueHandle {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(run(queue, batches, rx));
    QueueHandle { tx }
}

async fn run(
    mut q: StatusQueue,
    mut batches: mpsc::UnboundedReceiver<Vec<Observation>>,
    mut commands: mpsc::Receiver<Command>,
) {
    let mut waiter: Option<oneshot::Sender<StatusBatch>> = None;
    let mut executor_open = true;
    loop {
        tokio::select! {
            batch = batches.recv(), if executor_open => match batch {
                Some(batch) => {
                    for obs in batch {
                        q.push(&obs.assignment_id, obs.to_proto());
                    }
                }
                None => executor_open = false,
            },
            cmd = commands.recv() => match cmd {
                Some(Command::Take(tx)) => waiter = Some(tx),
                Some(Command::Resync) => q.resync(),
                Some(Command::Retain(ids)) => q.retain(&ids),
                None => return,
            },
        }
        if waiter.as_ref().is_some_and(oneshot::Sender::is_closed) {
            waiter = None;
        }
        if waiter.is_some()
            && let Some(batch) = q.take()
            && let Some(tx) = waiter.take()
            && let Err(batch) = tx.send(batch)
        {
            // The session went away while asking: keep the reports.
            q.restore(batch);
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::proto::v1::InstanceState;

    fn obs(state: InstanceState, ports: &[(&str, u32)]) -> AssignmentObserved {
        AssignmentObserved {
            state: state as i32,
            mesh_port_bindings: ports.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect(),
            ..AssignmentObserved::default()
        }
    }

    fn state(b: &StatusBatch, id: &str) -> Option<i32> {
        b.observed.get(id).map(|o| o.state)
    }

    #[test]
    fn keeps_every_transition_in_order() {
        let mut q = StatusQueue::new(8, 64);
        assert!(q.take().is_none());
        q.push("a", obs(InstanceState::Pulling, &[]));
        q.push("b", obs(InstanceState::Pulling, &[]));
        q.push("a", obs(InstanceState::Starting, &[]));
        q.push("a", obs(InstanceState::Running, &[("http", 8080)]));
        q.push("a", obs(InstanceState::Healthy, &[]));
        assert_eq!(q.len(), 5);
        let mut seen = Vec::new();
        while let Some(b) = q.take() {
            seen.push(state(&b, "a"));
        }
        let s = |st: InstanceState| Some(st as i32);
        assert_eq!(
            seen,
            [
                s(InstanceState::Pulling),
                s(InstanceState::Starting),
                s(InstanceState::Running),
                s(InstanceState::Healthy)
            ]
        );
        assert!(q.is_empty());
        // The last non-empty bindings ride along with later reports.
        q.push("a", obs(InstanceState::Unhealthy, &[]));
        assert_eq!(
            q.take().unwrap().observed["a"].mesh_port_bindings["http"],
            8080
        );
    }

    #[test]
    fn coalesces_the_oldest_batches_when_too_many_wait() {
        let mut q = StatusQueue::new(2, 64);
        q.push("a", obs(InstanceState::Pulling, &[]));
        q.push("a", obs(InstanceState::Starting, &[]));
        q.push("b", obs(InstanceState::Running, &[]));
        q.push("a", obs(InstanceState::Running, &[]));
        // [a:P] [a:S b:R] [a:R] -> [a:S b:R] [a:R]
        assert_eq!(q.len(), 3);
        let first = q.take().unwrap();
        assert_eq!(state(&first, "a"), Some(InstanceState::Starting as i32));
        assert_eq!(state(&first, "b"), Some(InstanceState::Running as i32));
        assert_eq!(
            state(&q.take().unwrap(), "a"),
            Some(InstanceState::Running as i32)
        );
    }

    /// Issue 44.4: past the cap, older states fold into newer ones; the
    /// latest report of every assignment stays, however many there are.
    #[test]
    fn never_drops_the_latest_report_of_an_assignment() {
        let mut q = StatusQueue::new(4, 8);
        for round in [
            InstanceState::Starting,
            InstanceState::Running,
            InstanceState::Healthy,
        ] {
            for i in 0..300 {
                q.push(&format!("a{i}"), obs(round, &[]));
            }
        }
        let mut seen = BTreeMap::new();
        while let Some(b) = q.take() {
            for (id, o) in b.observed {
                seen.insert(id, o.state);
            }
        }
        assert_eq!(seen.len(), 300, "every assignment reaches control");
        assert!(
            seen.values().all(|s| *s == InstanceState::Healthy as i32),
            "with its last state"
        );
        assert_eq!(q.folded(), 600);
    }

    #[test]
    fn restore_and_resync_keep_reports_across_sessions() {
        let mut q = StatusQueue::new(8, 64);
        q.push("a", obs(InstanceState::Running, &[]));
        let lost = q.take().unwrap();
        q.push("b", obs(InstanceState::Starting, &[]));
        q.restore(lost);
        let b = q.take().unwrap();
        assert_eq!(state(&b, "a"), Some(InstanceState::Running as i32));
        assert!(q.take().is_some());
        // Newer reports win over a restored one.
        q.push("a", obs(InstanceState::Running, &[]));
        let old = q.take().unwrap();
        q.push("a", obs(InstanceState::Healthy, &[]));
        q.restore(old);
        assert_eq!(q.len(), 1);
        assert_eq!(
            state(&q.take().unwrap(), "a"),
            Some(InstanceState::Healthy as i32)
        );
        // A new session resends the latest of every assignment still listed.
        q.push("b", obs(InstanceState::Running, &[]));
        q.take();
        q.retain(&HashSet::from(["a".to_owned()]));
        q.resync();
        let b = q.take().unwrap();
        assert_eq!(b.observed.len(), 1);
        assert_eq!(state(&b, "a"), Some(InstanceState::Healthy as i32));
    }

    #[tokio::test]
    async fn task_hands_out_batches_and_keeps_them_for_a_dead_taker() {
        let (tx, rx) = mpsc::unbounded_channel();
        let q = spawn(StatusQueue::new(8, 64), rx);
        tx.send(vec![Observation::new("a", crate::status::State::Pulling)])
            .unwrap();
        let b = q.next_batch().await.unwrap();
        assert_eq!(state(&b, "a"), Some(InstanceState::Pulling as i32));
        // A taker that gives up loses nothing.
        let gave_up =
            tokio::time::timeout(std::time::Duration::from_millis(50), q.next_batch()).await;
        assert!(gave_up.is_err());
        tx.send(vec![Observation::new("b", crate::status::State::Running)])
            .unwrap();
        let b = q.next_batch().await.unwrap();
        assert_eq!(state(&b, "b"), Some(InstanceState::Running as i32));
    }
}
