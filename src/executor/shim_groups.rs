//! Which runc shim a container's task runs in. containerd's runc shim can
//! serve several containers from one process (the spec annotation
//! [`crate::runtime::spec::RUNC_GROUP_ANNOTATION`]); one shim per container costs the
//! node about 2.4 MiB and a process start each. Containers share a shim
//! only within their scope (a project's environment, the unit that already
//! shares a bridge and DNS), and at most `size` of them, so that a shim
//! that dies takes down a bounded group, which the workers bring back.
//!
//! A shim creates and starts its tasks one at a time. So a new container
//! joins a group none of whose containers is still coming up; when every
//! group with room has one coming up, a new group opens, up to `open`
//! groups with room (the executor's parallelism): bring-ups that run
//! together land in different shims, and one that comes alone starts none.
//!
//! The group is recorded on the container ([`crate::labels::SHIM_GROUP`]) and
//! read back at boot ([`ShimGroups::adopt`]): nothing is persisted here.

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::labels::OwnedContainer;

#[derive(Debug, Default)]
pub struct ShimGroups {
    /// Containers per shim; 0 or 1: a shim each (no annotation).
    size: usize,
    /// Groups of one scope filled side by side: the executor's bring-ups
    /// that run at once.
    open: usize,
    /// Per scope, the members of its group `k` at index `k` (empty: free).
    scopes: HashMap<String, Vec<BTreeSet<String>>>,
    /// Container id -> (scope, group index).
    group_of: HashMap<String, (String, usize)>,
    /// Containers given a group whose task is not up yet.
    starting: HashSet<String>,
}

/// The group's name, as the annotation and the label carry it.
fn name(scope: &str, k: usize) -> String {
    format!("{scope}.{k}")
}

impl ShimGroups {
    pub fn new(size: usize, open: usize) -> Self {
        Self {
            size,
            open: open.max(1),
            ..Self::default()
        }
    }

    /// The group for a new container of `scope`: the first with room and
    /// no bring-up in flight; else a new one while fewer than `open` have
    /// room; else the emptiest with room. `None` when containers do not
    /// share shims.
    pub fn assign(&mut self, scope: &str, container_id: &str) -> Option<String> {
        if self.size <= 1 {
            return None;
        }
        if let Some((scope, k)) = self.group_of.get(container_id) {
            return Some(name(scope, *k));
        }
        let groups = self.scopes.get(scope).map_or(&[][..], Vec::as_slice);
        let with_room = || (0..groups.len()).filter(|k| (1..self.size).contains(&groups[*k].len()));
        let idle = with_room().find(|k| groups[*k].iter().all(|c| !self.starting.contains(c)));
        let free = (0..groups.len())
            .find(|k| groups[*k].is_empty())
            .unwrap_or(groups.len());
        let k = match idle {
            Some(k) => k,
            None if with_room().count() < self.open => free,
            // The emptiest with room, the first of equals.
            None => with_room().min_by_key(|k| groups[*k].len()).unwrap_or(free),
        };
        self.join(scope, k, container_id);
        self.starting.insert(container_id.to_owned());
        Some(name(scope, k))
    }

    /// Counts the groups of the containers found at boot, so new ones fill
    /// them up rather than start shims beside them.
    pub fn adopt<'a>(&mut self, owned: impl IntoIterator<Item = &'a OwnedContainer>) {
        for o in owned {
            let found = o.shim_group.as_deref().and_then(|g| g.rsplit_once('.'));
            if let Some((scope, k)) = found
                && let Ok(k) = k.parse()
            {
                self.join(scope, k, &o.container_id);
            }
        }
    }

    /// The container's task is up: its shim may take the next bring-up.
    pub fn brought_up(&mut self, container_id: &str) {
        self.starting.remove(container_id);
    }

    /// The container is gone: its place in the group is free.
    pub fn release(&mut self, container_id: &str) {
        self.starting.remove(container_id);
        if let Some((scope, k)) = self.group_of.remove(container_id)
            && let Some(m) = self.scopes.get_mut(&scope).and_then(|g| g.get_mut(k))
        {
            m.remove(container_id);
        }
    }

    fn join(&mut self, scope: &str, k: usize, container_id: &str) {
        let groups = self.scopes.entry(scope.to_owned()).or_default();
        if groups.len() <= k {
            groups.resize_with(k + 1, BTreeSet::new);
        }
        groups[k].insert(container_id.to_owned());
        self.group_of
            .insert(container_id.to_owned(), (scope.to_owned(), k));
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    const OPEN: usize = 4;

    #[test]
    fn a_scope_fills_its_groups_side_by_side_and_reuses_a_freed_place() {
        let mut g = ShimGroups::new(2, OPEN);
        let mut got = |id: &str| g.assign("zt-a", id).unwrap_or_default();
        let all: Vec<String> = (0..40).map(|i| got(&format!("c{i}"))).collect();
        // The bring-ups that run at once go to as many shims.
        let first: BTreeSet<&String> = all[..OPEN].iter().collect();
        assert_eq!(first.len(), OPEN, "{all:?}");
        // Asked again (a retried plan): the same group, not a new place.
        assert_eq!(got("c0"), all[0]);
        // Never more than `size` a shim, and only OPEN - 1 shims short.
        let groups: BTreeSet<&String> = all.iter().collect();
        assert!(groups.len() < 40 / 2 + OPEN, "{all:?}");
        assert!(g.scopes.values().flatten().all(|m| m.len() <= 2));
        // Another scope never shares a shim with this one.
        assert_eq!(g.assign("zt-b", "x").as_deref(), Some("zt-b.0"));
        // A freed place is taken again before a new shim starts.
        g.release("c1");
        assert_eq!(g.assign("zt-a", "e0"), Some(all[1].clone()));
    }

    #[test]
    fn a_bring_up_that_comes_alone_joins_a_shim_that_runs() {
        let mut g = ShimGroups::new(8, OPEN);
        assert_eq!(g.assign("zt-a", "c0").as_deref(), Some("zt-a.0"));
        // c0 still coming up: c1 goes to a shim of its own, to run beside it.
        assert_eq!(g.assign("zt-a", "c1").as_deref(), Some("zt-a.1"));
        g.brought_up("c0");
        g.brought_up("c1");
        // Later ones, one at a time, start no shim.
        for i in 2..10 {
            let id = format!("c{i}");
            let want = if i <= 8 { "zt-a.0" } else { "zt-a.1" };
            assert_eq!(g.assign("zt-a", &id).as_deref(), Some(want), "{id}");
            g.brought_up(&id);
        }
    }

    #[test]
    fn found_containers_count_and_size_one_shares_nothing() {
        let found = |id: &str, group: &str| OwnedContainer {
            container_id: id.into(),
            shim_group: Some(group.into()),
            ..OwnedContainer::default()
        };
        let mut g = ShimGroups::new(2, OPEN);
        g.adopt(&[found("c1", "zt-a.0"), found("c2", "zt-a.0")]);
        // zt-a.0 is full: never a third member.
        for i in 3..10 {
            assert_ne!(
                g.assign("zt-a", &format!("c{i}")).as_deref(),
                Some("zt-a.0")
            );
        }

        let mut single = ShimGroups::new(1, OPEN);
        assert_eq!(single.assign("zt-a", "c1"), None);
        assert_eq!(ShimGroups::new(0, OPEN).assign("zt-a", "c1"), None);
    }
}
