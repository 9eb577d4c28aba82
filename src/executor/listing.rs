//! The owned containers as last listed. A pass with nothing new reuses them
//! instead of asking containerd for every container (and its spec) again:
//! the listing is dropped when containerd reports a container created,
//! updated or deleted in the namespace, when a worker reports that it made
//! or removed one, when the event stream restarts (events may be lost), and
//! after [`MAX_AGE`] whatever happened.

use std::time::{Duration, Instant};

use super::labels::OwnedContainer;

/// A listing older than this is read again even if no event said so.
pub const MAX_AGE: Duration = Duration::from_secs(30);

#[derive(Debug, Default)]
pub struct Listing {
    cached: Option<(Instant, Vec<OwnedContainer>)>,
}

impl Listing {
    /// The containers of the last listing, if it is still good at `now`.
    pub fn fresh(&self, now: Instant) -> Option<&[OwnedContainer]> {
        match &self.cached {
            Some((at, owned)) if now.saturating_duration_since(*at) < MAX_AGE => Some(owned),
            _ => None,
        }
    }

    /// Keeps what a listing at `at` returned.
    pub fn store(&mut self, at: Instant, owned: Vec<OwnedContainer>) {
        self.cached = Some((at, owned));
    }

    /// Something changed: the next pass lists again.
    pub fn invalidate(&mut self) {
        self.cached = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::labels::{ASSIGNMENT_ID, MANAGED, ROLE, ROLE_SERVICE};

    fn one() -> Vec<OwnedContainer> {
        let c = containerd_client::services::v1::Container {
            id: "c1".into(),
            labels: [
                (MANAGED, "true"),
                (ROLE, ROLE_SERVICE),
                (ASSIGNMENT_ID, "a1"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
            ..Default::default()
        };
        OwnedContainer::from_container(&c).into_iter().collect()
    }

    #[test]
    fn a_listing_is_reused_until_invalidated() {
        let t0 = Instant::now();
        let mut l = Listing::default();
        assert!(l.fresh(t0).is_none(), "nothing listed yet");
        l.store(t0, one());
        assert_eq!(
            l.fresh(t0 + Duration::from_secs(5)).map(<[_]>::len),
            Some(1)
        );
        l.invalidate();
        assert!(l.fresh(t0 + Duration::from_secs(5)).is_none());
    }

    #[test]
    fn a_listing_expires_even_without_events() {
        let t0 = Instant::now();
        let mut l = Listing::default();
        l.store(t0, one());
        assert!(
            l.fresh(t0 + MAX_AGE.saturating_sub(Duration::from_millis(1)))
                .is_some()
        );
        assert!(l.fresh(t0 + MAX_AGE).is_none());
    }
}
