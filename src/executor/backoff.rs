//! Crash-loop back-off for services the agent restarts itself (C-13), like
//! kubelet's: 10 s doubling to 5 min, reset after 10 min of running.

use std::time::Duration;

pub const INITIAL: Duration = Duration::from_secs(10);
pub const MAX: Duration = Duration::from_secs(300);
pub const RESET_AFTER: Duration = Duration::from_secs(600);

/// The delay before the next restart, given the one before (if any) and how
/// long the container ran this time.
pub fn next_delay(previous: Option<Duration>, ran_for: Duration) -> Duration {
    match previous {
        _ if ran_for >= RESET_AFTER => INITIAL,
        None => INITIAL,
        Some(d) => (d * 2).min(MAX),
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn doubles_to_the_cap_and_resets_after_a_long_run() {
        let short = Duration::from_secs(1);
        let mut d = next_delay(None, short);
        let mut seen = vec![d];
        for _ in 0..8 {
            d = next_delay(Some(d), short);
            seen.push(d);
        }
        let secs: Vec<u64> = seen.iter().map(Duration::as_secs).collect();
        assert_eq!(secs, [10, 20, 40, 80, 160, 300, 300, 300, 300]);
        assert_eq!(next_delay(Some(MAX), RESET_AFTER), INITIAL);
    }
}
