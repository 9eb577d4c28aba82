//! The builds in flight, per call (BLD-12): CancelBuild cancels every call
//! running that build id, and a call's entry leaves with the call, so a
//! second RunBuild of the same id never loses the first one's handle.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

#[derive(Debug)]
struct Call {
    cancel: CancellationToken,
    by_request: Arc<AtomicBool>,
}

/// The registry of running builds, at most `max` at once (0: no bound).
#[derive(Debug, Default)]
pub struct Builds {
    next: AtomicU64,
    calls: Mutex<HashMap<String, HashMap<u64, Call>>>,
    max: usize,
}

/// A build refused because `max` already run (45.3).
#[derive(Debug, thiserror::Error)]
#[error("this node already runs {max} builds (max-builds); try again later")]
pub struct Full {
    pub max: usize,
}

/// One call's registration; dropping it removes the call.
#[derive(Debug)]
pub struct Ticket {
    builds: Arc<Builds>,
    id: String,
    call: u64,
    pub cancel: CancellationToken,
    by_request: Arc<AtomicBool>,
}

impl Ticket {
    /// Whether CancelBuild (not the caller leaving) cancelled it.
    pub fn canceled_by_request(&self) -> bool {
        self.by_request.load(Ordering::SeqCst)
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
            ..Self::default()
        }
    }

    /// Registers a call building `id`, unless `max` already run: a tenant
    /// cannot start builds without bound on one node.
    pub fn start(self: &Arc<Self>, id: &str) -> Result<Ticket, Full> {
        let call = self.next.fetch_add(1, Ordering::Relaxed);
        let cancel = CancellationToken::new();
        let by_request = Arc::new(AtomicBool::new(false));
        if let Ok(mut calls) = self.calls.lock() {
            let running: usize = calls.values().map(HashMap::len).sum();
            if self.max > 0 && running >= self.max {
                return Err(Full { max: self.max });
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

    /// Builds running now.
    pub fn running(&self) -> usize {
        self.calls
            .lock()
            .map_or(0, |c| c.values().map(HashMap::len).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_the_limit_a_build_is_refused_until_one_ends() {
        let builds = Arc::new(Builds::with_limit(2));
        let a = builds.start("a").unwrap();
        let _b = builds.start("b").unwrap();
        let refused = builds.start("c").unwrap_err();
        assert!(refused.to_string().contains("max-builds"), "{refused}");
        drop(a);
        assert!(builds.start("c").is_ok(), "room again once one ended");
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
