//! The owned containers as last listed. A pass with nothing new reuses them
//! instead of asking containerd for every container (and its spec) again.
//! A container that containerd reports created, updated or deleted, or that
//! a worker reports it made or removed, is marked stale and read again by
//! itself, so a change to 10 of 1,000 costs 10 reads, not a listing of
//! 1,000. Everything is listed again, before the next pass goes on, when
//! the event stream restarts (events may be lost), when an event does not
//! say which container it is about, and when more than [`MAX_STALE`] are
//! stale. After [`MAX_AGE`] whatever happened, a listing is read beside the
//! passes (a refresh), and replaces this one when it comes in: what changed
//! meanwhile stays stale.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::labels::OwnedContainer;

/// A listing older than this is refreshed even if no event said so.
pub const MAX_AGE: Duration = Duration::from_secs(30);
/// Past this many stale containers one listing is cheaper than reading each.
pub const MAX_STALE: usize = 64;

/// What the next pass must read from containerd.
#[derive(Debug, PartialEq, Eq)]
enum Need {
    /// Nothing: the listing is good.
    Nothing,
    /// These containers, each by itself.
    Some(Vec<String>),
    /// Every owned container.
    All,
}

#[derive(Debug, Default)]
pub struct Listing {
    cached: Option<Cached>,
    /// The last refresh asked for: only its answer is taken.
    last_refresh: u64,
}

/// Which refresh an answer belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refresh(u64);

#[derive(Debug)]
struct Cached {
    at: Instant,
    /// By container id: the order containerd lists them in.
    owned: BTreeMap<String, OwnedContainer>,
    stale: BTreeSet<String>,
    /// While a refresh is out: what changed since it was asked for.
    refreshing: Option<(Refresh, BTreeSet<String>)>,
}

impl Listing {
    /// What must be read for the listing to be good.
    fn need(&self) -> Need {
        match &self.cached {
            Some(c) if c.stale.is_empty() => Need::Nothing,
            Some(c) => Need::Some(c.stale.iter().cloned().collect()),
            None => Need::All,
        }
    }

    /// Whether the listing is good as it is (`need()` is `Nothing`).
    pub fn is_current(&self) -> bool {
        self.cached.as_ref().is_some_and(|c| c.stale.is_empty())
    }

    /// Whether to ask for a refresh now: the listing is [`MAX_AGE`] old and
    /// no refresh is out.
    fn refresh_due(&self, now: Instant) -> bool {
        self.cached.as_ref().is_some_and(|c| {
            c.refreshing.is_none() && now.saturating_duration_since(c.at) >= MAX_AGE
        })
    }

    /// A refresh is asked for; its answer goes to [`Self::refreshed`].
    fn refresh_started(&mut self) -> Refresh {
        self.last_refresh += 1;
        let r = Refresh(self.last_refresh);
        if let Some(c) = &mut self.cached {
            c.refreshing = Some((r, BTreeSet::new()));
        }
        r
    }

    /// What refresh `r`, asked for at `at`, found. `None`: it failed, and
    /// the next one is due at once. It is dropped if the listing was
    /// dropped or listed again meanwhile.
    pub fn refreshed(&mut self, r: Refresh, at: Instant, found: Option<Vec<OwnedContainer>>) {
        let Some(c) = &mut self.cached else { return };
        let Some((_, changed)) = c.refreshing.take_if(|(out, _)| *out == r) else {
            return;
        };
        if let Some(owned) = found {
            self.replace(at, owned, changed);
        }
    }

    /// The containers as listed, in container-id order (empty before the
    /// first listing).
    pub fn owned(&self) -> Vec<OwnedContainer> {
        self.cached
            .as_ref()
            .map(|c| c.owned.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Keeps what a listing at `at` returned; nothing is stale after it.
    pub fn store(&mut self, at: Instant, owned: Vec<OwnedContainer>) {
        self.replace(at, owned, BTreeSet::new());
    }

    fn replace(&mut self, at: Instant, owned: Vec<OwnedContainer>, stale: BTreeSet<String>) {
        let owned = owned
            .into_iter()
            .map(|o| (o.container_id.clone(), o))
            .collect();
        self.cached = Some(Cached {
            at,
            owned,
            stale,
            refreshing: None,
        });
    }

    /// What reading `container_id` again found: the container (if it is
    /// still there and ours) or nothing.
    fn patch(&mut self, container_id: &str, found: Option<OwnedContainer>) {
        let Some(c) = &mut self.cached else { return };
        c.stale.remove(container_id);
        match found {
            Some(o) => {
                c.owned.insert(container_id.to_owned(), o);
            }
            None => {
                c.owned.remove(container_id);
            }
        }
    }

    /// `container_id` changed: the next pass reads it again.
    pub fn changed(&mut self, container_id: &str) {
        let Some(c) = &mut self.cached else { return };
        c.stale.insert(container_id.to_owned());
        if let Some((_, changed)) = &mut c.refreshing {
            changed.insert(container_id.to_owned());
        }
        if c.stale.len() > MAX_STALE {
            self.invalidate();
        }
    }

    /// Anything may have changed: the next pass lists everything again.
    pub fn invalidate(&mut self) {
        self.cached = None;
    }
}

/// What a refresh of the listing found (`None`: it failed).
#[derive(Debug)]
pub(super) struct Refreshed {
    pub refresh: Refresh,
    pub at: Instant,
    pub found: Option<Vec<OwnedContainer>>,
}

/// Stale containers read from containerd at once.
const STALE_READS: usize = 8;

impl Listing {
    /// The owned containers: the last listing with what changed since read
    /// again, or a new listing.
    pub(super) async fn read(
        &mut self,
        ctd: &crate::runtime::Containerd,
    ) -> Result<Vec<OwnedContainer>, crate::runtime::RuntimeError> {
        let now = Instant::now();
        match self.need() {
            Need::Nothing => {}
            Need::Some(stale) => {
                let read: Vec<_> = futures::stream::iter(stale)
                    .map(|id| async move {
                        let found = crate::runtime::containers::get(ctd, &id).await;
                        (id, found)
                    })
                    .buffer_unordered(STALE_READS)
                    .collect()
                    .await;
                for (id, found) in read {
                    let found = found?;
                    self.patch(&id, found.as_ref().and_then(OwnedContainer::from_container));
                }
            }
            Need::All => {
                let owned = list_owned(ctd).await?;
                self.store(now, owned);
            }
        }
        Ok(self.owned())
    }

    /// Once a refresh is due, lists containerd beside the passes; the
    /// answer comes back on `tx`.
    pub(super) fn refresh_if_due(
        &mut self,
        ctd: &crate::runtime::Containerd,
        tx: tokio::sync::mpsc::Sender<Refreshed>,
    ) {
        let now = Instant::now();
        if !self.refresh_due(now) {
            return;
        }
        let refresh = self.refresh_started();
        let ctd = ctd.clone();
        tokio::spawn(async move {
            let found = match list_owned(&ctd).await {
                Ok(owned) => Some(owned),
                Err(e) => {
                    tracing::debug!(error = %e, "refreshing the container listing failed");
                    None
                }
            };
            let _ = tx
                .send(Refreshed {
                    refresh,
                    at: now,
                    found,
                })
                .await;
        });
    }
}

/// The containers this agent owns in its namespace, from their labels.
pub(super) async fn list_owned(
    ctd: &crate::runtime::Containerd,
) -> Result<Vec<OwnedContainer>, crate::runtime::RuntimeError> {
    let listed = crate::runtime::containers::list(ctd, &crate::labels::OWNED_FILTER).await?;
    Ok(listed
        .iter()
        .filter_map(OwnedContainer::from_container)
        .collect())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::labels::{ASSIGNMENT_ID, MANAGED, ROLE, ROLE_SERVICE};

    fn owned(id: &str) -> OwnedContainer {
        let c = containerd_client::services::v1::Container {
            id: id.into(),
            labels: [
                (MANAGED, "true"),
                (ROLE, ROLE_SERVICE),
                (ASSIGNMENT_ID, &format!("a-{id}")),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
            ..Default::default()
        };
        OwnedContainer::from_container(&c).expect("owned")
    }

    fn ids(l: &Listing) -> Vec<String> {
        l.owned().into_iter().map(|o| o.container_id).collect()
    }

    #[test]
    fn a_listing_is_reused_until_invalidated() {
        let t0 = Instant::now();
        let mut l = Listing::default();
        assert_eq!(l.need(), Need::All, "nothing listed yet");
        l.store(t0, vec![owned("c1")]);
        assert_eq!(l.need(), Need::Nothing);
        assert_eq!(ids(&l), ["c1"]);
        l.invalidate();
        assert_eq!(l.need(), Need::All);
    }

    #[test]
    fn an_old_listing_is_refreshed_beside_the_passes() {
        let t0 = Instant::now();
        let mut l = Listing::default();
        l.store(t0, vec![owned("c1")]);
        assert!(!l.refresh_due(t0 + MAX_AGE.saturating_sub(Duration::from_millis(1))));
        let t1 = t0 + MAX_AGE;
        assert!(l.refresh_due(t1));
        let r = l.refresh_started();
        assert!(!l.refresh_due(t1), "one refresh at a time");
        // The passes go on with the old listing meanwhile.
        assert_eq!(l.need(), Need::Nothing);
        // c2 changed after the refresh was asked for: it may be missing
        // from it, so it stays stale; the rest is what the refresh found.
        l.changed("c2");
        l.refreshed(r, t1, Some(vec![owned("c0")]));
        assert_eq!(ids(&l), ["c0"]);
        assert_eq!(l.need(), Need::Some(vec!["c2".into()]));
        assert!(!l.refresh_due(t1 + Duration::from_secs(1)));
    }

    #[test]
    fn a_failed_refresh_keeps_the_listing_and_is_due_again() {
        let t0 = Instant::now();
        let mut l = Listing::default();
        l.store(t0, vec![owned("c1")]);
        let r = l.refresh_started();
        l.refreshed(r, t0 + MAX_AGE, None);
        assert_eq!(ids(&l), ["c1"]);
        assert!(l.refresh_due(t0 + MAX_AGE));
    }

    #[test]
    fn a_refresh_that_outlives_its_listing_is_dropped() {
        let t0 = Instant::now();
        let mut l = Listing::default();
        l.store(t0, vec![owned("c1")]);
        let old = l.refresh_started();
        l.invalidate();
        l.refreshed(old, t0, Some(vec![owned("c9")]));
        assert_eq!(l.need(), Need::All);
        // Nor does it replace a newer listing, or answer a newer refresh.
        l.store(t0, vec![owned("c1")]);
        l.refreshed(old, t0, Some(vec![owned("c9")]));
        assert_eq!(ids(&l), ["c1"]);
        let new = l.refresh_started();
        l.refreshed(old, t0, Some(vec![owned("c9")]));
        assert_eq!(ids(&l), ["c1"]);
        l.refreshed(new, t0, Some(vec![owned("c2")]));
        assert_eq!(ids(&l), ["c2"]);
    }

    #[test]
    fn a_changed_container_alone_is_read_again() {
        let t0 = Instant::now();
        let mut l = Listing::default();
        l.store(t0, vec![owned("c1"), owned("c3")]);
        l.changed("c2");
        l.changed("c3");
        assert_eq!(l.need(), Need::Some(vec!["c2".into(), "c3".into()]));
        // c2 was made, c3 removed: the listing says so, in id order.
        l.patch("c2", Some(owned("c2")));
        assert_eq!(l.need(), Need::Some(vec!["c3".into()]));
        l.patch("c3", None);
        assert_eq!(l.need(), Need::Nothing);
        assert_eq!(ids(&l), ["c1", "c2"]);
    }

    #[test]
    fn too_many_changes_list_everything_again() {
        let t0 = Instant::now();
        let mut l = Listing::default();
        l.store(t0, vec![owned("c1")]);
        for i in 0..MAX_STALE {
            l.changed(&format!("x{i}"));
        }
        assert!(matches!(l.need(), Need::Some(v) if v.len() == MAX_STALE));
        l.changed("one-more");
        assert_eq!(l.need(), Need::All);
    }

    #[test]
    fn a_change_before_the_first_listing_is_in_that_listing() {
        let mut l = Listing::default();
        l.changed("c1");
        l.patch("c1", Some(owned("c1")));
        assert_eq!(l.need(), Need::All);
    }
}
