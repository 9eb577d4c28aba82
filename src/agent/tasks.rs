//! The agent's long-running tasks, owned in one place: each runs under a
//! cancellation token, and the agent stops them group by group, waiting
//! for each group (bounded) before the next, instead of detaching some and
//! aborting others one by one.

use std::future::Future;
use std::time::Duration;

use tokio::task::{AbortHandle, JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;

/// A group of tasks that stop together.
#[derive(Debug, Default)]
pub struct Tasks {
    set: JoinSet<()>,
    cancel: CancellationToken,
}

impl Tasks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `work` until it ends or the group stops. A task that ends on
    /// its own before that is logged: the agent's tasks run for its life.
    pub fn spawn(&mut self, name: &'static str, work: impl Future<Output = ()> + Send + 'static) {
        let cancel = self.cancel.clone();
        self.set.spawn(async move {
            tokio::select! {
                () = cancel.cancelled() => {}
                () = work => tracing::debug!(task = name, "task ended"),
            }
        });
    }

    /// A task another module spawned: aborted when the group stops.
    pub fn adopt<T: Send + 'static>(&mut self, name: &'static str, handle: JoinHandle<T>) {
        let abort = AbortOnDrop(handle.abort_handle());
        self.spawn(name, async move {
            let _abort = abort;
            let _ = handle.await;
        });
    }

    /// Stops every task of the group and waits for them, at most `within`.
    /// How many did not end in time (they are aborted).
    pub async fn stop(self, within: Duration) -> usize {
        self.cancel.cancel();
        self.drain(within).await
    }

    /// Waits for tasks told to stop by their own means (a token of their
    /// own), at most `within`; then aborts the rest. How many were late.
    pub async fn drain(mut self, within: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + within;
        while !self.set.is_empty() {
            match tokio::time::timeout_at(deadline, self.set.join_next()).await {
                Ok(Some(Err(e))) if e.is_panic() => tracing::error!(error = %e, "a task panicked"),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => break,
            }
        }
        let late = self.set.len();
        if late > 0 {
            tracing::warn!(late, ?within, "tasks did not stop in time; aborted");
        }
        self.set.abort_all();
        while self.set.join_next().await.is_some() {}
        late
    }
}

struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// Sets its flag when dropped: the task holding it is gone.
    struct Gone(Arc<AtomicBool>);
    impl Drop for Gone {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn stop_ends_every_task_and_the_ones_it_adopted() {
        let mut tasks = Tasks::new();
        let (own, adopted) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let guard = Gone(own.clone());
        tasks.spawn("own", async move {
            let _guard = guard;
            std::future::pending::<()>().await;
        });
        let guard = Gone(adopted.clone());
        tasks.adopt(
            "adopted",
            tokio::spawn(async move {
                let _guard = guard;
                std::future::pending::<()>().await;
            }),
        );
        assert_eq!(tasks.stop(Duration::from_secs(5)).await, 0);
        assert!(own.load(Ordering::SeqCst));
        // The adopted task is aborted, not detached.
        tokio::time::timeout(Duration::from_secs(5), async {
            while !adopted.load(Ordering::SeqCst) {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the adopted task was aborted");
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_will_not_stop_is_aborted_when_its_time_is_up() {
        let mut tasks = Tasks::new();
        let stuck = Arc::new(AtomicBool::new(false));
        let guard = Gone(stuck.clone());
        // Outside the token's reach, as a task stuck in its clean-up is.
        tasks.set.spawn(async move {
            let _guard = guard;
            tokio::time::sleep(Duration::from_secs(3600)).await;
        });
        assert_eq!(tasks.stop(Duration::from_secs(5)).await, 1);
        assert!(stuck.load(Ordering::SeqCst), "aborted");
    }
}
