//! The builds in flight, per call (BLD-12): CancelBuild cancels every call
//! running that build id, and a call's entry leaves with the call, so a
//! second RunBuild of the same id never loses the first one's handle.
//!
//! At most `max` run at once (`max-builds`); the next ones wait their turn
//! in a bounded queue ([`QUEUED_PER_SLOT`] per slot) instead of failing, as
//! control sends a build once and marks a refused one FAILED. A queued
//! build can be cancelled; past the queue, a build is refused.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// Builds that may wait per build slot, beyond those running.
pub const QUEUED_PER_SLOT: usize = 8;

#[derive(Debug)]
struct Call {
    cancel: CancellationToken,
    by_request: Arc<AtomicBool>,
}

/// The registry of builds, at most `max` running at once (0: no bound).
#[derive(Debug, Default)]
pub struct Builds {
    next: AtomicU64,
    calls: Mutex<HashMap<String, HashMap<u64, Call>>>,
    max: usize,
    /// The running builds' slots; `None` without a bound.
    slots: Option<Arc<Semaphore>>,
}

/// A build refused because `max` run and the queue is full (45.3).
#[derive(Debug, thiserror::Error)]
#[error(
    "this node already runs {max} builds (max-builds) and {queued} wait for a slot; try again later"
)]
pub struct Full {
    pub max: usize,
    pub queued: usize,
}

/// One call's registration; dropping it removes the call.
#[derive(Debug)]
pub struct Ticket {
    builds: Arc<Builds>,
    id: String,
    call: u64,
    pub cancel: CancellationToken,
    by_request: Arc<AtomicBool>,
    /// Builds registered before this one and not done at its start.
    pub ahead: usize,
}

impl Ticket {
    /// Whether CancelBuild (not the caller leaving) cancelled it.
    pub fn canceled_by_request(&self) -> bool {
        self.by_request.load(Ordering::SeqCst)
    }

    /// Waits for a build slot; `None` when the build was cancelled first.
    /// Without a bound, at once.
    pub async fn slot(&self) -> Option<Option<OwnedSemaphorePermit>> {
        let Some(slots) = &self.builds.slots else {
            return Some(None);
        };
        tokio::select! {
            biased;
            () = self.cancel.cancelled() => None,
            permit = Arc::clone(slots).acquire_owned() => permit.ok().map(Some),
        }
    }

    /// Whether a slot is free now (the build will not wait).
    pub fn runs_at_once(&self) -> bool {
        self.builds
            .slots
            .as_ref()
            .is_none_or(|s| s.available_permits() > 0)
    }

    /// The bound on builds running at once (0: none).
    pub fn max(&self) -> usize {
        self.builds.max
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Ok(mut calls) = self.builds.calls.lock()
            && let Some(of_id) = calls.get_mut(&self.id)
        {
            of_id.remove(&self.call);
            if of_id.is_empty() {
                calls.remove(&self.id);
            }
        }
    }
}

impl Builds {
    /// A registry running at most `max` builds at once.
    pub fn with_limit(max: usize) -> Self {
        Self {
            max,
            slots: (max > 0).then(|| Arc::new(Semaphore::new(max))),
            ..Self::default()
        }
    }

    /// Registers a call building `id` (running or waiting for a slot,
    /// [`Ticket::slot`]), unless the queue is full: a tenant cannot start
    /// builds without bound on one node.
    pub fn start(self: &Arc<Self>, id: &str) -> Result<Ticket, Full> {
        let call = self.next.fetch_add(1, Ordering::Relaxed);
        let cancel = CancellationToken::new();
        let by_request = Arc::new(AtomicBool::new(false));
        let mut ahead = 0;
        if let Ok(mut calls) = self.calls.lock() {
            ahead = calls.values().map(HashMap::len).sum();
            if self.max > 0 && ahead >= self.max * (1 + QUEUED_PER_SLOT) {
                return Err(Full {
                    max: self.max,
                    queued: ahead - self.max,
                });
            }
            calls.entry(id.to_owned()).or_default().insert(
                call,
                Call {
                    cancel: cancel.clone(),
                    by_request: Arc::clone(&by_request),
                },
            );
        }
        Ok(Ticket {
            builds: Arc::clone(self),
            id: id.to_owned(),
            call,
            cancel,
            by_request,
            ahead,
        })
    }

    /// Cancels every call building `id`; whether there was one.
    pub fn cancel(&self, id: &str) -> bool {
        let Ok(calls) = self.calls.lock() else {
            return false;
        };
        let Some(of_id) = calls.get(id) else {
            return false;
        };
        for call in of_id.values() {
            call.by_request.store(true, Ordering::SeqCst);
            call.cancel.cancel();
        }
        !of_id.is_empty()
    }

    /// Builds registered now, running or waiting.
    pub fn running(&self) -> usize {
        self.calls
            .lock()
            .map_or(0, |c| c.values().map(HashMap::len).sum())
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn past_the_limit_builds_wait_their_turn_and_past_the_queue_are_refused() {
        let builds = Arc::new(Builds::with_limit(1));
        let a = builds.start("a").unwrap();
        let a_slot = a.slot().await.unwrap();
        let b = builds.start("b").unwrap();
        assert_eq!(b.ahead, 1);
        assert!(!b.runs_at_once());
        let waiting = tokio::spawn(async move {
            let slot = b.slot().await;
            (b, slot.is_some())
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "b waits while a runs");
        let queued: Vec<_> = (0..QUEUED_PER_SLOT - 1)
            .map(|i| builds.start(&format!("q{i}")).unwrap())
            .collect();
        let refused = builds.start("over").unwrap_err();
        assert!(refused.to_string().contains("max-builds"), "{refused}");
        assert_eq!(refused.queued, QUEUED_PER_SLOT);
        drop((a_slot, a));
        let (b, got) = waiting.await.unwrap();
        assert!(got, "b runs once a ended");
        // A queued build can be cancelled while it waits.
        let q = &queued[0];
        assert!(builds.cancel("q0"));
        assert!(q.slot().await.is_none());
        drop(b);
    }

    #[test]
    fn calls_are_tracked_one_by_one() {
        let builds = Arc::new(Builds::default());
        assert!(!builds.cancel("b1"), "unknown id");
        let first = builds.start("b1").unwrap();
        let second = builds.start("b1").unwrap();
        drop(first);
        assert_eq!(builds.running(), 1);
        assert!(builds.cancel("b1"), "the second call is still known");
        assert!(second.cancel.is_cancelled() && second.canceled_by_request());
        drop(second);
        assert_eq!(builds.running(), 0);
        assert!(!builds.cancel("b1"));
    }
}
