//! Reconnect back-off (runtime.md S-8): 1 s doubling to 30 s, +/-25 %
//! jitter, reset after a session of at least 30 s.

use std::time::Duration;

const INITIAL: Duration = Duration::from_secs(1);
const CAP: Duration = Duration::from_secs(30);
pub const HEALTHY_SESSION: Duration = Duration::from_secs(30);

/// Back-off state of one reconnecting stream.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self { next: INITIAL }
    }
}

impl Backoff {
    /// The wait after a session that lasted `session`; `unit` in [0, 1)
    /// picks the jitter (uniform over [0.75, 1.25] x the back-off).
    pub fn after_session(&mut self, session: Duration, unit: f64) -> Duration {
        if session >= HEALTHY_SESSION {
            self.next = INITIAL;
        }
        let base = self.next;
        self.next = (base * 2).min(CAP);
        base.mul_f64(0.75 + 0.5 * unit.clamp(0.0, 1.0))
    }

    /// As [`Self::after_session`], with a random jitter.
    pub fn next_wait(&mut self, session: Duration) -> Duration {
        self.after_session(session, rand::random::<f64>())
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn doubles_caps_jitters_and_resets() {
        let mut b = Backoff::default();
        let short = Duration::from_secs(1);
        let waits: Vec<u64> = (0..8)
            .map(|_| b.after_session(short, 0.5).as_secs())
            .collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(b.after_session(short, 0.0), Duration::from_millis(22_500));
        assert_eq!(b.after_session(short, 1.0), Duration::from_millis(37_500));
        // A long session starts over at about 1 s.
        assert_eq!(
            b.after_session(Duration::from_secs(30), 0.0),
            Duration::from_millis(750)
        );
        assert_eq!(b.after_session(short, 0.5), Duration::from_secs(2));
        for _ in 0..100 {
            let w = Backoff::default().next_wait(short);
            assert!(w >= Duration::from_millis(750) && w <= Duration::from_millis(1250));
        }
    }
}
