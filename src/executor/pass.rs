//! What one pass decides, as pure functions of what it sees: the desired
//! set, the classified containers ([`diff`](super::diff)) and the workers.
//! The loop then carries the decisions out (spawning, telling workers,
//! allocating). Tested here like `diff`: STOP before RUN per scope (E-6),
//! adoption, the spec told once, parking (E-9) and fencing (E-10).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use zattera_netns::network_name;

use super::diff::{Classified, Desired};
use super::worker::Phase;
use crate::labels::OwnedContainer;
use crate::proto::cluster::AssignmentRuntime;
use crate::proto::v1::{Assignment, AssignmentDesired, ServiceSpec};

/// What a pass reads of a worker.
pub(super) trait WorkerState {
    fn assignment_id(&self) -> &str;
    /// `network_name` of its project and environment.
    fn scope(&self) -> &str;
    fn phase(&self) -> Phase;
    /// Whether it was told its service spec (or that there is none).
    fn has_spec(&self) -> bool;
}

/// The supervision half of a pass, per container.
#[derive(Debug, PartialEq)]
pub(super) enum Supervise {
    /// A removal whose container has a worker: tell it to stop.
    Stop { container_id: String },
    /// A removal without a worker: spawn one that removes it.
    Remove(OwnedContainer),
    /// A kept container's worker learns its spec (`None`: the set has no
    /// spec for it, so there is no check).
    Spec {
        container_id: String,
        spec: Option<Box<ServiceSpec>>,
    },
    /// A kept container without a worker: adopt it.
    Adopt {
        owned: OwnedContainer,
        spec: Option<Box<ServiceSpec>>,
    },
}

/// What is kept after this pass, and what to do about each container.
///
/// Kept: the classified ones, plus those `before` kept that are still
/// coming up (not listed yet). A supervised container that vanished from
/// containerd behind our back is its worker's to find: no second worker
/// may touch the same container id meanwhile.
pub(super) fn supervise<W: WorkerState>(
    desired: &Desired,
    classified: Classified,
    before: &BTreeMap<String, OwnedContainer>,
    workers: &HashMap<String, W>,
) -> (BTreeMap<String, OwnedContainer>, Vec<Supervise>) {
    let mut kept = classified.owned;
    for (id, o) in before {
        if !kept.contains_key(id)
            && workers
                .get(&o.container_id)
                .is_some_and(|w| w.phase() == Phase::Starting)
        {
            kept.insert(id.clone(), o.clone());
        }
    }
    let mut steps = Vec::new();
    for r in classified.removals {
        steps.push(if workers.contains_key(&r.container_id) {
            Supervise::Stop {
                container_id: r.container_id,
            }
        } else {
            Supervise::Remove(r)
        });
    }
    // A spec is copied only for a worker that has none yet.
    let spec_of = |id: &str| {
        desired
            .get(id)
            .and_then(|(_, rt)| rt.as_ref())
            .and_then(|rt| rt.spec.clone())
            .map(Box::new)
    };
    for (id, o) in &kept {
        match workers.get(&o.container_id) {
            // Told even when the set has no spec for it: the worker then
            // knows there is no check, and reports HEALTHY.
            Some(w) if !w.has_spec() && desired.contains_key(id) => steps.push(Supervise::Spec {
                container_id: o.container_id.clone(),
                spec: spec_of(id),
            }),
            Some(_) => {}
            None => steps.push(Supervise::Adopt {
                owned: o.clone(),
                spec: spec_of(id),
            }),
        }
    }
    (kept, steps)
}

/// The RUN half of a pass, per desired instance that has neither a
/// container nor a worker.
#[derive(Debug, PartialEq)]
pub(super) enum Run<'a> {
    /// Plan it and bring it up.
    Start {
        id: &'a str,
        assignment: &'a Assignment,
        runtime: &'a AssignmentRuntime,
    },
    /// The set has no image or spec for it: FAILED, counted toward parking.
    NoRuntime { id: &'a str, config_hash: &'a str },
    /// A stateful instance waits for its volume lease (E-10): PENDING.
    Fenced { id: &'a str, reason: String },
}

/// RUN (E-7): every desired instance that has neither a container nor a
/// worker, unless its scope still has removals in flight (E-6: a freed host
/// port or name can then be reused) or it is `parked` (E-9).
pub(super) fn runs<'a, W: WorkerState>(
    desired: &'a Desired,
    kept: &BTreeMap<String, OwnedContainer>,
    workers: &HashMap<String, W>,
    mut parked: impl FnMut(&str, &str) -> bool,
    node_id: &str,
) -> Vec<Run<'a>> {
    let busy: BTreeSet<&str> = workers
        .values()
        .filter(|w| w.phase() == Phase::Stopping)
        .map(WorkerState::scope)
        .collect();
    let active: BTreeSet<&str> = workers
        .values()
        .filter(|w| w.phase() != Phase::Stopping)
        .map(WorkerState::assignment_id)
        .collect();
    let mut out = Vec::new();
    for (id, (a, rt)) in desired {
        if a.desired != AssignmentDesired::Run as i32
            || kept.contains_key(id)
            || active.contains(id.as_str())
            || (!busy.is_empty()
                && busy.contains(network_name(&a.project_id, &a.environment_id).as_str()))
            || parked(id, &a.config_hash)
        {
            continue;
        }
        out.push(match rt {
            None => Run::NoRuntime {
                id,
                config_hash: &a.config_hash,
            },
            Some(rt) => match fencing(a, rt, node_id) {
                Some(reason) => Run::Fenced { id, reason },
                None => Run::Start {
                    id,
                    assignment: a,
                    runtime: rt,
                },
            },
        });
    }
    out
}

/// E-10: the reason a stateful assignment must wait, if it must.
fn fencing(a: &Assignment, rt: &AssignmentRuntime, node_id: &str) -> Option<String> {
    let spec = rt.spec.as_ref()?;
    if !spec.stateful || spec.volumes.is_empty() {
        return None;
    }
    let id = a.meta.as_ref().map_or("", |m| m.id.as_str());
    match &rt.volume_lease {
        None => Some("waiting for volume lease".into()),
        Some(lease) if lease.node_id != node_id => {
            Some(format!("volume leased to another node ({})", lease.node_id))
        }
        Some(lease) if lease.assignment_id != id => {
            Some("volume leased to another instance".into())
        }
        Some(_) => None,
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::proto::v1::{Meta, VolumeLease, VolumeMount};

    struct FakeWorker {
        assignment_id: String,
        scope: String,
        phase: Phase,
        has_spec: bool,
    }

    impl WorkerState for FakeWorker {
        fn assignment_id(&self) -> &str {
            &self.assignment_id
        }
        fn scope(&self) -> &str {
            &self.scope
        }
        fn phase(&self) -> Phase {
            self.phase
        }
        fn has_spec(&self) -> bool {
            self.has_spec
        }
    }

    fn worker(id: &str, env: &str, phase: Phase, has_spec: bool) -> FakeWorker {
        FakeWorker {
            assignment_id: id.into(),
            scope: network_name("p", env),
            phase,
            has_spec,
        }
    }

    fn assignment(id: &str, env: &str, desired: AssignmentDesired) -> Assignment {
        Assignment {
            meta: Some(Meta {
                id: id.into(),
                ..Meta::default()
            }),
            project_id: "p".into(),
            environment_id: env.into(),
            config_hash: format!("h-{id}"),
            desired: desired as i32,
            ..Assignment::default()
        }
    }

    fn with_spec(check: &str) -> AssignmentRuntime {
        AssignmentRuntime {
            spec: Some(ServiceSpec {
                command: check.into(),
                ..ServiceSpec::default()
            }),
            ..AssignmentRuntime::default()
        }
    }

    fn desired(entries: &[(&str, &str, AssignmentDesired, bool)]) -> Desired {
        entries
            .iter()
            .map(|(id, env, d, rt)| {
                (
                    (*id).to_owned(),
                    (assignment(id, env, *d), rt.then(|| with_spec(id))),
                )
            })
            .collect()
    }

    fn owned(cid: &str, id: &str) -> OwnedContainer {
        OwnedContainer {
            container_id: cid.into(),
            assignment_id: id.into(),
            ..OwnedContainer::default()
        }
    }

    fn ids<'a>(runs: &[Run<'a>]) -> Vec<&'a str> {
        runs.iter()
            .map(|r| match r {
                Run::Start { id, .. } | Run::NoRuntime { id, .. } | Run::Fenced { id, .. } => *id,
            })
            .collect()
    }

    const RUN: AssignmentDesired = AssignmentDesired::Run;

    #[test]
    fn a_scope_with_a_removal_in_flight_starts_nothing_until_it_is_done() {
        let d = desired(&[("a1", "e1", RUN, true), ("b1", "e2", RUN, true)]);
        // The old instance of e1 is being stopped.
        let mut workers =
            HashMap::from([("old".to_owned(), worker("a0", "e1", Phase::Stopping, true))]);
        let none = |_: &str, _: &str| false;
        let r = runs(&d, &BTreeMap::new(), &workers, none, "n1");
        assert_eq!(ids(&r), vec!["b1"], "e2 goes on, e1 waits");
        workers.clear();
        let r = runs(&d, &BTreeMap::new(), &workers, none, "n1");
        assert_eq!(ids(&r), vec!["a1", "b1"]);
    }

    #[test]
    fn only_what_has_neither_a_container_nor_a_worker_is_started() {
        let d = desired(&[
            ("kept", "e", RUN, true),
            ("coming", "e", RUN, true),
            ("new", "e", RUN, true),
            ("stop", "e", AssignmentDesired::Stop, true),
            ("parked", "e", RUN, true),
            ("bare", "e", RUN, false),
        ]);
        let kept = BTreeMap::from([("kept".to_owned(), owned("c-kept", "kept"))]);
        let workers = HashMap::from([(
            "c-coming".to_owned(),
            worker("coming", "e", Phase::Starting, true),
        )]);
        let parked = |id: &str, hash: &str| id == "parked" && hash == "h-parked";
        let r = runs(&d, &kept, &workers, parked, "n1");
        assert_eq!(ids(&r), vec!["bare", "new"]);
        assert!(matches!(
            r[0],
            Run::NoRuntime {
                config_hash: "h-bare",
                ..
            }
        ));
        assert!(matches!(r[1], Run::Start { id: "new", .. }));
    }

    #[test]
    fn a_stateful_instance_waits_for_its_lease() {
        let mut d = desired(&[("s1", "e", RUN, true)]);
        let rt = d.get_mut("s1").and_then(|(_, rt)| rt.as_mut()).unwrap();
        let spec = rt.spec.as_mut().unwrap();
        spec.stateful = true;
        spec.volumes = vec![VolumeMount {
            volume_name: "data".into(),
            mount_path: "/data".into(),
        }];
        let workers: HashMap<String, FakeWorker> = HashMap::new();
        let r = runs(&d, &BTreeMap::new(), &workers, |_, _| false, "n1");
        assert_eq!(
            r,
            vec![Run::Fenced {
                id: "s1",
                reason: "waiting for volume lease".into()
            }]
        );
    }

    #[test]
    fn supervision_stops_removals_adopts_the_unwatched_and_tells_each_spec_once() {
        let d = desired(&[
            ("watched", "e", RUN, true),
            ("told", "e", RUN, true),
            ("orphan", "e", RUN, true),
            ("nospec", "e", RUN, false),
        ]);
        let classified = Classified {
            owned: BTreeMap::from([
                ("watched".to_owned(), owned("c-watched", "watched")),
                ("told".to_owned(), owned("c-told", "told")),
                ("orphan".to_owned(), owned("c-orphan", "orphan")),
                ("nospec".to_owned(), owned("c-nospec", "nospec")),
            ]),
            removals: vec![owned("c-stale", "watched"), owned("c-gone", "gone")],
            stopped: vec![],
        };
        let workers = HashMap::from([
            (
                "c-watched".to_owned(),
                worker("watched", "e", Phase::Up, false),
            ),
            ("c-told".to_owned(), worker("told", "e", Phase::Up, true)),
            (
                "c-nospec".to_owned(),
                worker("nospec", "e", Phase::Up, false),
            ),
            (
                "c-stale".to_owned(),
                worker("watched", "e", Phase::Up, true),
            ),
        ]);
        let (kept, steps) = supervise(&d, classified, &BTreeMap::new(), &workers);
        assert_eq!(kept.len(), 4);
        assert_eq!(
            steps,
            vec![
                Supervise::Stop {
                    container_id: "c-stale".into()
                },
                Supervise::Remove(owned("c-gone", "gone")),
                Supervise::Spec {
                    container_id: "c-nospec".into(),
                    spec: None,
                },
                Supervise::Adopt {
                    owned: owned("c-orphan", "orphan"),
                    spec: with_spec("orphan").spec.map(Box::new),
                },
                Supervise::Spec {
                    container_id: "c-watched".into(),
                    spec: with_spec("watched").spec.map(Box::new),
                },
            ]
        );
    }

    #[test]
    fn a_container_still_coming_up_is_kept_before_containerd_lists_it() {
        let d = desired(&[("a1", "e", RUN, true), ("a2", "e", RUN, true)]);
        let before = BTreeMap::from([
            ("a1".to_owned(), owned("c1", "a1")),
            ("a2".to_owned(), owned("c2", "a2")),
        ]);
        let workers = HashMap::from([
            ("c1".to_owned(), worker("a1", "e", Phase::Starting, true)),
            // Up, yet not listed: removed behind our back, its worker's to find.
            ("c2".to_owned(), worker("a2", "e", Phase::Up, true)),
        ]);
        let (kept, steps) = supervise(&d, Classified::default(), &before, &workers);
        assert_eq!(kept.keys().collect::<Vec<_>>(), vec!["a1"]);
        assert!(steps.is_empty(), "{steps:?}");
    }

    fn stateful(lease: Option<VolumeLease>) -> (Assignment, AssignmentRuntime) {
        let a = Assignment {
            meta: Some(Meta {
                id: "a1".into(),
                ..Meta::default()
            }),
            ..Assignment::default()
        };
        let rt = AssignmentRuntime {
            spec: Some(ServiceSpec {
                stateful: true,
                volumes: vec![VolumeMount {
                    volume_name: "data".into(),
                    mount_path: "/data".into(),
                }],
                ..ServiceSpec::default()
            }),
            volume_lease: lease,
            ..AssignmentRuntime::default()
        };
        (a, rt)
    }

    #[test]
    fn fencing_follows_e10() {
        let (a, rt) = stateful(None);
        assert_eq!(
            fencing(&a, &rt, "n1").as_deref(),
            Some("waiting for volume lease")
        );
        let lease = |node: &str, id: &str| VolumeLease {
            node_id: node.into(),
            assignment_id: id.into(),
            ..VolumeLease::default()
        };
        let (a, rt) = stateful(Some(lease("n2", "a1")));
        assert_eq!(
            fencing(&a, &rt, "n1").as_deref(),
            Some("volume leased to another node (n2)")
        );
        let (a, rt) = stateful(Some(lease("n1", "a2")));
        assert_eq!(
            fencing(&a, &rt, "n1").as_deref(),
            Some("volume leased to another instance")
        );
        let (a, rt) = stateful(Some(lease("n1", "a1")));
        assert_eq!(fencing(&a, &rt, "n1"), None);
        let (a, mut rt) = stateful(None);
        rt.spec.as_mut().unwrap().stateful = false;
        assert_eq!(
            fencing(&a, &rt, "n1"),
            None,
            "only stateful services with volumes are fenced"
        );
    }
}
