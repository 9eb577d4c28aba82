//! When to probe (H-9, with the wake deviation): fast from the monitor's
//! start until the first pass, then every interval.
//!
//! With the interval schedule alone an app with a health check waits one
//! interval (10 s by default) for its first probe, so every cold start cost
//! at least that, though the app answered in a few hundred milliseconds.
//! The startup phase probes every 100 ms, then every 150 and 225, then
//! every 250 ms (an exec probe, which costs a runtime exec and a process
//! each, steps on up to one a second), until the first pass or the end of
//! the grace period. Its
//! failures never count toward the unhealthy threshold (an app that is still
//! starting is not failing); after the grace period a check that never
//! passed is judged at the interval, as before. Probes never overlap: the
//! next wait begins when a probe ends.

use std::time::Duration;

use super::Timing;

/// The first wait of the startup phase.
pub const STARTUP_FIRST: Duration = Duration::from_millis(100);
/// The longest wait of the startup phase: a slow app costs a few cheap
/// probes a second, not a delay.
pub const STARTUP_LONGEST: Duration = Duration::from_millis(250);
/// The same for an exec probe: each is a `runc exec` (a process, FIFOs,
/// about 20 ms of CPU), so a check that keeps failing through a long grace
/// period costs one a second, not four.
pub const STARTUP_LONGEST_EXEC: Duration = Duration::from_secs(1);

/// The probing schedule of one monitor, apart from any clock.
#[derive(Debug, Clone)]
pub struct Schedule {
    interval: Duration,
    grace: Duration,
    step: Duration,
    longest: Duration,
    passed: bool,
}

impl Schedule {
    /// The startup phase steps up to `longest` ([`STARTUP_LONGEST`], or
    /// [`STARTUP_LONGEST_EXEC`] for an exec probe).
    pub fn new(timing: &Timing, longest: Duration) -> Self {
        Self {
            interval: timing.interval,
            grace: timing.grace,
            step: STARTUP_FIRST,
            longest,
            passed: false,
        }
    }

    /// Whether a probe beginning `elapsed` after the monitor's start belongs
    /// to the startup phase.
    pub fn starting(&self, elapsed: Duration) -> bool {
        !self.passed && elapsed < self.grace
    }

    /// The wait before the next probe, `elapsed` after the monitor's start
    /// (when the last probe ended).
    pub fn next_wait(&mut self, elapsed: Duration) -> Duration {
        if !self.starting(elapsed) {
            return self.interval;
        }
        let wait = self.step.min(self.interval);
        self.step = (self.step * 3 / 2).min(self.longest);
        // The phase ends with the grace period: no fast probe after it.
        wait.min(self.grace.saturating_sub(elapsed))
            .max(Duration::from_millis(1))
    }

    /// Whether the result of a probe that began `began` after the monitor's
    /// start reaches the state machine: every pass does, and every failure
    /// but those of the startup phase.
    pub fn counts(&mut self, passed: bool, began: Duration) -> bool {
        if passed {
            self.passed = true;
            return true;
        }
        !self.starting(began)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timing(interval: u64, grace: u64) -> Timing {
        Timing {
            interval: Duration::from_secs(interval),
            timeout: Duration::from_secs(5),
            grace: Duration::from_secs(grace),
            threshold: 3,
        }
    }

    #[test]
    fn the_startup_phase_steps_up_to_a_quarter_second() {
        let mut s = Schedule::new(&timing(10, 60), STARTUP_LONGEST);
        let mut at = Duration::ZERO;
        let mut waits = Vec::new();
        for _ in 0..6 {
            let w = s.next_wait(at);
            waits.push(w.as_millis());
            at += w;
        }
        assert_eq!(waits, [100, 150, 225, 250, 250, 250]);
    }

    #[test]
    fn an_exec_probe_steps_on_to_one_a_second() {
        let mut s = Schedule::new(&timing(10, 60), STARTUP_LONGEST_EXEC);
        let mut at = Duration::ZERO;
        let mut waits = Vec::new();
        for _ in 0..9 {
            let w = s.next_wait(at);
            waits.push(w.as_millis());
            at += w;
        }
        assert_eq!(waits, [100, 150, 225, 337, 506, 759, 1000, 1000, 1000]);
        // Sixty seconds of a failing check: about 60 execs, not 240.
        let mut probes = 0;
        while at < Duration::from_secs(60) {
            at += s.next_wait(at);
            probes += 1;
        }
        assert!(probes <= 60, "{probes} probes");
    }

    #[test]
    fn the_interval_follows_the_first_pass() {
        let mut s = Schedule::new(&timing(10, 60), STARTUP_LONGEST);
        let t = Duration::from_millis(350);
        assert!(!s.counts(false, Duration::from_millis(100)));
        assert!(s.counts(true, t));
        assert_eq!(s.next_wait(t), Duration::from_secs(10));
        assert!(s.counts(false, t * 2), "after a pass every failure counts");
        assert_eq!(s.next_wait(t * 2), Duration::from_secs(10));
    }

    #[test]
    fn the_phase_ends_with_the_grace_period() {
        let mut s = Schedule::new(&timing(10, 2), STARTUP_LONGEST);
        assert!(!s.counts(false, Duration::from_millis(1_900)));
        assert_eq!(
            s.next_wait(Duration::from_millis(1_900)),
            Duration::from_millis(100),
            "no fast probe after grace"
        );
        assert!(s.counts(false, Duration::from_secs(2)));
        assert_eq!(s.next_wait(Duration::from_secs(2)), Duration::from_secs(10));
    }

    #[test]
    fn a_short_interval_bounds_the_startup_step() {
        let mut s = Schedule::new(&timing(0, 60), STARTUP_LONGEST);
        s.interval = Duration::from_millis(120);
        let mut at = Duration::ZERO;
        for _ in 0..5 {
            let w = s.next_wait(at);
            assert!(w <= Duration::from_millis(120), "{w:?}");
            at += w;
        }
    }
}
