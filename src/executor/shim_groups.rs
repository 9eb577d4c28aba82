//! Which runc shim a container's task runs in. containerd's runc shim can
//! serve several containers from one process (the spec annotation
//! [`crate::labels::RUNC_GROUP_ANNOTATION`]); one shim per container costs the
//! node about 2.4 MiB and a process start each. Containers share a shim
//! only within their scope (a project's environment, the unit that already
//! shares a bridge and DNS), and at most `size` of them, so that a shim
//! that dies takes down a bounded group, which the workers bring back.
//!
//! The group is recorded on the container ([`crate::labels::SHIM_GROUP`]) and
//! read back at boot ([`ShimGroups::adopt`]): nothing is persisted here.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::labels::OwnedContainer;

#[derive(Debug, Default)]
pub struct ShimGroups {
    /// Containers per shim; 0 or 1: a shim each (no annotation).
    size: usize,
    members: BTreeMap<String, BTreeSet<String>>,
    group_of: HashMap<String, String>,
}

impl ShimGroups {
    pub fn new(size: usize) -> Self {
        Self {
            size,
            ..Self::default()
        }
    }

    /// The group for a new container of `scope`: the first of the scope's
    /// groups with room. `None` when containers do not share shims.
    pub fn assign(&mut self, scope: &str, container_id: &str) -> Option<String> {
        if self.size <= 1 {
            return None;
        }
        if let Some(g) = self.group_of.get(container_id) {
            return Some(g.clone());
        }
        // Of n containers' groups one has room among the first n + 1.
        let group = (0..=self.group_of.len())
            .map(|k| format!("{scope}.{k}"))
            .find(|g| self.members.get(g).is_none_or(|m| m.len() < self.size))?;
        self.join(&group, container_id);
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

    /// The container is gone: its place in the group is free.
    pub fn release(&mut self, container_id: &str) {
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

    #[test]
    fn a_scope_fills_its_groups_in_order_and_reuses_a_freed_place() {
        let mut g = ShimGroups::new(2);
        assert_eq!(g.assign("zt-a", "c1").as_deref(), Some("zt-a.0"));
        assert_eq!(g.assign("zt-a", "c2").as_deref(), Some("zt-a.0"));
        assert_eq!(g.assign("zt-a", "c3").as_deref(), Some("zt-a.1"));
        // Another scope never shares a shim with this one.
        assert_eq!(g.assign("zt-b", "c4").as_deref(), Some("zt-b.0"));
        // Asked again (a retried plan): the same group, not a new place.
        assert_eq!(g.assign("zt-a", "c3").as_deref(), Some("zt-a.1"));
        g.release("c1");
        assert_eq!(g.assign("zt-a", "c5").as_deref(), Some("zt-a.0"));
        assert_eq!(g.assign("zt-a", "c6").as_deref(), Some("zt-a.1"));
    }

    #[test]
    fn found_containers_count_and_size_one_shares_nothing() {
        let found = |id: &str, group: &str| OwnedContainer {
            container_id: id.into(),
            shim_group: Some(group.into()),
            ..OwnedContainer::default()
        };
        let mut g = ShimGroups::new(2);
        g.adopt(&[found("c1", "zt-a.0"), found("c2", "zt-a.0")]);
        assert_eq!(g.assign("zt-a", "c3").as_deref(), Some("zt-a.1"));

        let mut single = ShimGroups::new(1);
        assert_eq!(single.assign("zt-a", "c1"), None);
        assert_eq!(ShimGroups::new(0).assign("zt-a", "c1"), None);
    }
}
