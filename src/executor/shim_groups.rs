//! Which runc shim a container's task runs in. containerd's runc shim can
//! serve several containers from one process (the spec annotation
//! [`crate::labels::RUNC_GROUP_ANNOTATION`]); one shim per container costs the
//! node about 2.4 MiB and a process start each. Containers share a shim
//! only within their scope (a project's environment, the unit that already
//! shares a bridge and DNS), and at most `size` of them, so that a shim
//! that dies takes down a bounded group, which the workers bring back.
//!
//! A shim creates and starts its tasks one at a time. So a new container
//! joins a group none of whose containers is still coming up; when every
//! group with room has one coming up, a new group opens, up to as many
//! with room as bring-ups run at once: the bring-ups that run at once (the executor's parallelism)
//! land in different shims, and one that comes alone starts none.
//!
//! The group is recorded on the container ([`crate::labels::SHIM_GROUP`]) and
//! read back at boot ([`ShimGroups::adopt`]): nothing is persisted here.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use crate::labels::OwnedContainer;

#[derive(Debug, Default)]
pub struct ShimGroups {
    /// Containers per shim; 0 or 1: a shim each (no annotation).
    size: usize,
    /// Groups of one scope filled side by side: the executor's bring-ups
    /// that run at once.
    open: usize,
    members: BTreeMap<String, BTreeSet<String>>,
    group_of: HashMap<String, String>,
    /// Containers given a group whose task is not up yet.
    starting: HashSet<String>,
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
        if let Some(g) = self.group_of.get(container_id) {
            return Some(g.clone());
        }
        // Of n containers' groups, the first n + 1 hold one that is free.
        let names = (0..=self.group_of.len()).map(|k| format!("{scope}.{k}"));
        let mut open = Vec::new();
        let mut idle = None;
        let mut free = None;
        for g in names {
            match self.members.get(&g) {
                Some(m) if m.len() < self.size => {
                    if idle.is_none() && m.iter().all(|c| !self.starting.contains(c)) {
                        idle = Some(g.clone());
                    }
                    open.push((m.len(), g));
                }
                None if free.is_none() => free = Some(g),
                _ => {}
            }
        }
        let group = match (idle, open.len() < self.open, free) {
            (Some(idle), _, _) => idle,
            (None, true, Some(free)) => free,
            // The emptiest open group, the first of equals.
            (None, _, free) => open
                .into_iter()
                .min_by_key(|(n, _)| *n)
                .map(|(_, g)| g)
                .or(free)?,
        };
        self.join(&group, container_id);
        self.starting.insert(container_id.to_owned());
        Some(group)
    }

    /// Counts the groups of the containers found at boot, so new ones fill
    /// them up rather than start shims beside them.
    pub fn adopt<'a>(&mut self, owned: impl IntoIterator<Item = &'a OwnedContainer>) {
        for o in owned {
            if let Some(g) = &o.shim_group {
                self.join(g, &o.container_id);
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
        if let Some(g) = self.group_of.remove(container_id)
            && let Some(m) = self.members.get_mut(&g)
        {
            m.remove(container_id);
            if m.is_empty() {
                self.members.remove(&g);
            }
        }
    }

    fn join(&mut self, group: &str, container_id: &str) {
        self.members
            .entry(group.to_owned())
            .or_default()
            .insert(container_id.to_owned());
        self.group_of
            .insert(container_id.to_owned(), group.to_owned());
    }
}

#[cfg(test)]
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
        assert!(g.members.values().all(|m| m.len() <= 2));
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
