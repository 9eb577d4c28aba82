//! Which networks the workers are on, so that the host task, working from
//! a want that may be a moment old, never removes a bridge a worker is
//! about to ensure or uses (N-5). A worker takes its lease when the loop
//! spawns it, before anything of it runs, and holds it for its life; the
//! host removes a network only under a [`Removal`], which no lease allows
//! and which a new lease waits out.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;
use zattera_netns::Subnet;

#[derive(Debug, Default)]
struct Table {
    leased: BTreeMap<Subnet, usize>,
    removing: BTreeSet<Subnet>,
}

/// The leases of one executor, shared by its workers and its host task.
#[derive(Debug, Clone, Default)]
pub struct NetworkLeases {
    table: Arc<Mutex<Table>>,
    removed: Arc<Notify>,
}

impl NetworkLeases {
    fn with<T>(&self, f: impl FnOnce(&mut Table) -> T) -> T {
        // The table is consistent at every await point: a panic elsewhere
        // cannot leave it half-changed.
        f(&mut self.table.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Holds `subnet` until the lease drops. Takes effect at once: a
    /// removal that starts later skips the subnet. One already under way
    /// is waited out by [`Lease::ready`].
    pub fn lease(&self, subnet: Subnet) -> Lease {
        self.with(|t| *t.leased.entry(subnet).or_default() += 1);
        Lease {
            leases: self.clone(),
            subnet,
        }
    }

    /// Starts removing `subnet`, unless a worker holds it.
    pub fn try_remove(&self, subnet: Subnet) -> Option<Removal> {
        self.with(|t| {
            (!t.leased.contains_key(&subnet) && t.removing.insert(subnet)).then(|| Removal {
                leases: self.clone(),
                subnet,
            })
        })
    }

    fn removing(&self, subnet: Subnet) -> bool {
        self.with(|t| t.removing.contains(&subnet))
    }
}

/// A worker's hold on its network.
#[derive(Debug)]
pub struct Lease {
    leases: NetworkLeases,
    subnet: Subnet,
}

impl Lease {
    /// Waits until no removal of the network is under way: after it, the
    /// bridge stays until the lease drops.
    pub async fn ready(&self) {
        loop {
            let removed = self.leases.removed.notified();
            if !self.leases.removing(self.subnet) {
                return;
            }
            removed.await;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.leases.with(|t| {
            if let Some(n) = t.leased.get_mut(&self.subnet) {
                *n -= 1;
                if *n == 0 {
                    t.leased.remove(&self.subnet);
                }
            }
        });
    }
}

/// The host's removal of a network nobody leases; ends when dropped.
#[derive(Debug)]
pub struct Removal {
    leases: NetworkLeases,
    subnet: Subnet,
}

impl Drop for Removal {
    fn drop(&mut self) {
        self.leases.with(|t| t.removing.remove(&self.subnet));
        self.leases.removed.notify_waiters();
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn a_leased_network_is_not_removed_until_its_last_lease_drops() {
        let leases = NetworkLeases::default();
        let s = Subnet::from_slot(60);
        let (a, b) = (leases.lease(s), leases.lease(s));
        assert!(leases.try_remove(s).is_none());
        drop(a);
        assert!(leases.try_remove(s).is_none(), "b still holds it");
        drop(b);
        let removal = leases.try_remove(s).expect("nobody holds it");
        assert!(leases.try_remove(s).is_none(), "one removal at a time");
        drop(removal);
        assert!(leases.try_remove(Subnet::from_slot(61)).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_taken_during_a_removal_is_ready_once_it_ends() {
        let leases = NetworkLeases::default();
        let s = Subnet::from_slot(62);
        let removal = leases.try_remove(s).unwrap();
        let lease = leases.lease(s);
        let ready = tokio::spawn(async move {
            lease.ready().await;
            lease
        });
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!ready.is_finished(), "the bridge is still being removed");
        drop(removal);
        let lease = tokio::time::timeout(Duration::from_secs(1), ready)
            .await
            .unwrap()
            .unwrap();
        assert!(leases.try_remove(s).is_none(), "held again");
        drop(lease);
    }
}
