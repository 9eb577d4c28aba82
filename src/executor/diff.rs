//! The pure half of a reconcile pass (runtime.md E-4, E-5): which desired
//! assignments are this node's, and what the containers it owns become:
//! kept (adopted by config hash), removed, or reported STOPPED. No I/O, so a
//! pass with nothing to change costs only this (see `benches/apply.rs`).

use std::collections::BTreeMap;

use zattera_netns::Subnet;

use crate::labels::OwnedContainer;
use crate::proto::cluster::{AssignmentRuntime, AssignmentSet};
use crate::proto::v1::{Assignment, AssignmentDesired};
use crate::status::{Observation, State};

/// This node's assignments with their runtime payloads, by assignment id.
pub type Desired = BTreeMap<String, (Assignment, Option<AssignmentRuntime>)>;

/// E-4: the assignments bound to `node_id` (all of them when either side
/// has no node id, as standalone). Entries without an id are dropped.
pub fn desired_for(set: AssignmentSet, node_id: &str) -> Desired {
    let mut runtime = set.runtime;
    set.assignments
        .into_iter()
        .filter(|a| a.node_id.is_empty() || node_id.is_empty() || a.node_id == node_id)
        .filter_map(|a| {
            let id = a.meta.as_ref()?.id.clone();
            // Taken in place: removing from the map would shift its entries.
            let rt = runtime.get_mut(&id).map(std::mem::take);
            Some((id, (a, rt)))
        })
        .collect()
}

/// What becomes of the listed containers.
#[derive(Debug, Default)]
pub struct Classified {
    /// The one container kept per RUN assignment whose hash matches.
    pub owned: BTreeMap<String, OwnedContainer>,
    /// Containers of unlisted or non-RUN assignments, stale hashes and
    /// duplicates (E-2 deviation).
    pub removals: Vec<OwnedContainer>,
    /// STOPPED for each container of a listed, non-RUN assignment.
    pub stopped: Vec<Observation>,
}

/// E-5: classifies the containers the agent owns against `desired`. Of
/// several containers of one assignment with the right hash, the first
/// listed is kept.
pub fn classify(
    desired: &Desired,
    listed: Vec<OwnedContainer>,
    default_subnet: Option<Subnet>,
) -> Classified {
    let mut out = Classified::default();
    for c in listed {
        match desired.get(&c.assignment_id) {
            None => out.removals.push(c),
            Some((a, _)) if a.desired != AssignmentDesired::Run as i32 => {
                out.stopped.push(
                    Observation::new(&c.assignment_id, State::Stopped).container(&c.container_id),
                );
                out.removals.push(c);
            }
            Some((a, rt)) => {
                if c.config_hash == a.config_hash
                    && !subnet_drifted(&c, rt.as_ref(), default_subnet)
                    && !out.owned.contains_key(&c.assignment_id)
                {
                    out.owned.insert(c.assignment_id.clone(), c);
                } else {
                    out.removals.push(c);
                }
            }
        }
    }
    out
}

/// the subnet is not part of the config hash, so a container made
/// before its subnet was pushed (or on an older one) is replaced once the
/// desired subnet differs. A subnet that does not parse changes nothing
/// (the bring-up reports it).
fn subnet_drifted(
    c: &OwnedContainer,
    rt: Option<&AssignmentRuntime>,
    default_subnet: Option<Subnet>,
) -> bool {
    let Some(rt) = rt else { return false };
    match wanted_subnet(rt, default_subnet) {
        Ok(wanted) => c.subnet != wanted,
        Err(_) => false,
    }
}

/// The network an assignment goes on: its pushed subnet, or without one
/// the node's default network (C-9, X-26); `None` only when the node has
/// none configured.
pub fn wanted_subnet(
    rt: &AssignmentRuntime,
    default_subnet: Option<Subnet>,
) -> Result<Option<Subnet>, zattera_netns::SubnetError> {
    if rt.subnet_cidr.is_empty() {
        Ok(default_subnet)
    } else {
        rt.subnet_cidr.parse::<Subnet>().map(Some)
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::proto::v1::Meta;

    fn assignment(id: &str, node: &str, hash: &str, desired: AssignmentDesired) -> Assignment {
        Assignment {
            meta: Some(Meta {
                id: id.into(),
                ..Meta::default()
            }),
            node_id: node.into(),
            config_hash: hash.into(),
            desired: desired as i32,
            ..Assignment::default()
        }
    }

    fn owned(cid: &str, id: &str, hash: &str) -> OwnedContainer {
        OwnedContainer {
            container_id: cid.into(),
            assignment_id: id.into(),
            project_id: String::new(),
            app_id: String::new(),
            environment_id: String::new(),
            app_name: String::new(),
            environment_name: String::new(),
            config_hash: hash.into(),
            ip: None,
            subnet: None,
            ports: Vec::new(),
            stop_signal: 15,
            stop_grace: std::time::Duration::from_secs(10),
            log_path: None,
            restart: true,
            exit_code: None,
            restarts: 0,
            shim_group: None,
        }
    }

    #[test]
    fn only_this_nodes_assignments_with_ids_are_desired() {
        let set = AssignmentSet {
            assignments: vec![
                assignment("a", "n1", "h", AssignmentDesired::Run),
                assignment("b", "n2", "h", AssignmentDesired::Run),
                assignment("c", "", "h", AssignmentDesired::Run),
                Assignment::default(),
            ],
            ..AssignmentSet::default()
        };
        let d = desired_for(set, "n1");
        assert_eq!(d.keys().collect::<Vec<_>>(), ["a", "c"]);
    }

    #[test]
    fn classify_keeps_matching_hashes_once_and_removes_the_rest() {
        let set = AssignmentSet {
            assignments: vec![
                assignment("keep", "", "h1", AssignmentDesired::Run),
                assignment("stale", "", "h2", AssignmentDesired::Run),
                assignment("stop", "", "h1", AssignmentDesired::Stop),
            ],
            ..AssignmentSet::default()
        };
        let d = desired_for(set, "");
        let c = classify(
            &d,
            vec![
                owned("k1", "keep", "h1"),
                owned("k2", "keep", "h1"),
                owned("s1", "stale", "h1"),
                owned("p1", "stop", "h1"),
                owned("g1", "gone", "h1"),
            ],
            None,
        );
        assert_eq!(c.owned.len(), 1);
        assert_eq!(c.owned["keep"].container_id, "k1");
        let mut removed: Vec<_> = c.removals.iter().map(|o| o.container_id.as_str()).collect();
        removed.sort_unstable();
        assert_eq!(removed, ["g1", "k2", "p1", "s1"]);
        assert_eq!(c.stopped.len(), 1);
        assert_eq!(c.stopped[0].state, State::Stopped);
    }

    #[test]
    fn a_changed_subnet_replaces_the_container_and_a_bad_one_changes_nothing() {
        let runtime = |cidr: &str| AssignmentRuntime {
            subnet_cidr: cidr.into(),
            ..AssignmentRuntime::default()
        };
        let on = |subnet: Option<u8>| OwnedContainer {
            subnet: subnet.map(Subnet::from_slot),
            ..owned("c", "a", "h1")
        };
        for (cidr, had, replaced) in [
            ("10.201.5.0/24", Some(5), false),
            ("10.201.6.0/24", Some(5), true),
            ("10.201.6.0/24", None, true),
            ("", Some(5), true),
            ("", None, false),
            ("not a subnet", Some(5), false),
        ] {
            let set = AssignmentSet {
                assignments: vec![assignment("a", "", "h1", AssignmentDesired::Run)],
                runtime: BTreeMap::from([("a".to_owned(), runtime(cidr))]),
                ..AssignmentSet::default()
            };
            let c = classify(&desired_for(set, ""), vec![on(had)], None);
            assert_eq!(c.removals.len() == 1, replaced, "{cidr:?} on {had:?}");
            assert_eq!(c.owned.is_empty(), replaced, "{cidr:?} on {had:?}");
        }
        // With a default network, no subnet means that network: a container
        // with none (only `lo`) is replaced onto it.
        let d = Subnet::any_24("10.202.0.0/24").unwrap();
        let on_default = OwnedContainer {
            subnet: Some(d),
            ..owned("c", "a", "h1")
        };
        for (cidr, had, replaced) in [
            ("", on_default.clone(), false),
            ("", on(None), true),
            ("10.201.5.0/24", on_default.clone(), true),
        ] {
            let set = AssignmentSet {
                assignments: vec![assignment("a", "", "h1", AssignmentDesired::Run)],
                runtime: BTreeMap::from([("a".to_owned(), runtime(cidr))]),
                ..AssignmentSet::default()
            };
            let c = classify(&desired_for(set, ""), vec![had.clone()], Some(d));
            assert_eq!(
                c.removals.len() == 1,
                replaced,
                "{cidr:?} on {:?}",
                had.subnet
            );
        }
    }
}
