//! What `status` says of the instances: the rows the loop publishes
//! (desired, kept, and still being removed, each with its last
//! observation), and the rows containerd alone can give while the agent is
//! down.

use std::collections::{BTreeMap, BTreeSet};

use super::board::Board;
use super::diff::Desired;
use super::listing::list_owned;
use crate::labels::OwnedContainer;
use crate::runtime::containers::{self, TaskState};
use crate::runtime::{Containerd, RuntimeError};
use crate::status::{AssignmentStatus, State, StatusSnapshot};

/// One row per assignment that is desired, kept, or has a worker (one
/// being removed): the set's word for what it is, else its labels'.
pub(super) fn rows<'a>(
    desired: Option<&'a Desired>,
    owned: &'a BTreeMap<String, OwnedContainer>,
    workers: impl IntoIterator<Item = &'a str>,
    board: &Board,
) -> Vec<AssignmentStatus> {
    let ids: BTreeSet<&str> = desired
        .into_iter()
        .flat_map(|d| d.keys().map(String::as_str))
        .chain(owned.keys().map(String::as_str))
        .chain(workers)
        .collect();
    ids.into_iter()
        .map(|id| {
            let a = desired.and_then(|d| d.get(id)).map(|(a, _)| a);
            let o = owned.get(id);
            let obs = board.observation(id);
            AssignmentStatus {
                id: id.to_owned(),
                project: a
                    .map(|a| a.project_id.clone())
                    .or_else(|| o.map(|o| o.project_id.clone()))
                    .unwrap_or_default(),
                app: a
                    .map(|a| a.app_id.clone())
                    .or_else(|| o.map(|o| o.app_id.clone()))
                    .unwrap_or_default(),
                environment: a
                    .map(|a| a.environment_id.clone())
                    .or_else(|| o.map(|o| o.environment_id.clone()))
                    .unwrap_or_default(),
                state: obs.map_or(State::Pending, |obs| obs.state),
                container_id: o
                    .map(|o| o.container_id.clone())
                    .or_else(|| obs.map(|obs| obs.container_id.clone()))
                    .unwrap_or_default(),
                ip: o
                    .and_then(|o| o.ip)
                    .map(|ip| ip.to_string())
                    .unwrap_or_default(),
                ports: o.map(port_bindings).unwrap_or_default(),
                restarts: obs.map_or(0, |obs| obs.restarts),
                message: obs.map(|obs| obs.message.clone()).unwrap_or_default(),
            }
        })
        .collect()
}

/// The status as containerd alone shows it, for `status` while the agent
/// is down (DESIGN decision 8): owned containers and their task states.
pub async fn offline_status(ctd: &Containerd, why: &str) -> Result<StatusSnapshot, RuntimeError> {
    let mut rows = Vec::new();
    for o in list_owned(ctd).await? {
        let (state, message) = match containers::task_state(ctd, &o.container_id).await? {
            TaskState::Running { .. } | TaskState::Paused => (State::Running, String::new()),
            TaskState::Stopped { exit_code: 0 } => {
                (State::Stopped, "exited with code 0".to_owned())
            }
            TaskState::Stopped { exit_code } => {
                (State::Failed, format!("exited with code {exit_code}"))
            }
            TaskState::Absent | TaskState::Created => {
                (State::Pending, "no task (the agent starts it)".to_owned())
            }
            TaskState::Unknown => (
                State::Pending,
                "containerd could not read its task (the shim did not answer)".to_owned(),
            ),
        };
        rows.push(AssignmentStatus {
            id: o.assignment_id.clone(),
            project: o.project_id.clone(),
            app: o.app_name.clone(),
            environment: o.environment_name.clone(),
            state,
            container_id: o.container_id.clone(),
            ip: o.ip.map(|ip| ip.to_string()).unwrap_or_default(),
            ports: port_bindings(&o),
            restarts: 0,
            message,
        });
    }
    rows.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(StatusSnapshot {
        node_id: String::new(),
        source: format!("containerd only (agent not running: {why})"),
        assignments: rows,
        errors: Vec::new(),
        notices: Vec::new(),
        passes: 0,
    })
}

/// E-12: port name → host port, skipping unnamed or unpublished ports.
pub(super) fn port_bindings(o: &OwnedContainer) -> BTreeMap<String, u16> {
    o.ports
        .iter()
        .filter(|p| !p.name.is_empty() && p.port.host_port > 0)
        .map(|p| (p.name.clone(), p.port.host_port))
        .collect()
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::labels::NamedPort;
    use crate::proto::v1::{Assignment, Meta};
    use crate::status::Observation;
    use zattera_netns::{Proto, PublishedPort};

    #[test]
    fn every_desired_kept_or_leaving_instance_has_a_row() {
        let desired: Desired = BTreeMap::from([(
            "new".to_owned(),
            (
                Assignment {
                    meta: Some(Meta {
                        id: "new".into(),
                        ..Meta::default()
                    }),
                    project_id: "p".into(),
                    ..Assignment::default()
                },
                None,
            ),
        )]);
        let port = |name: &str, host_port| NamedPort {
            name: name.into(),
            port: PublishedPort {
                proto: Proto::Tcp,
                host_ip: std::net::Ipv4Addr::LOCALHOST,
                host_port,
                container_ip: std::net::Ipv4Addr::new(10, 201, 5, 2),
                container_port: 80,
            },
        };
        let kept = OwnedContainer {
            container_id: "c-kept".into(),
            assignment_id: "kept".into(),
            project_id: "from-labels".into(),
            ports: vec![port("http", 30001), port("", 30002), port("none", 0)],
            ..OwnedContainer::default()
        };
        let owned = BTreeMap::from([("kept".to_owned(), kept)]);
        let mut board = Board::new(None);
        board.emit(vec![
            Observation::new("kept", State::Healthy).container("c-kept"),
            Observation::new("leaving", State::Stopped).container("c-old"),
        ]);
        let rows = rows(Some(&desired), &owned, ["leaving"], &board);
        let by = |id: &str| rows.iter().find(|r| r.id == id).unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(by("new").state, State::Pending, "nothing seen yet");
        assert_eq!(by("new").project, "p");
        assert_eq!(by("kept").state, State::Healthy);
        assert_eq!(by("kept").project, "from-labels");
        // E-12: only named, published ports.
        assert_eq!(
            by("kept").ports,
            BTreeMap::from([("http".to_owned(), 30001)])
        );
        assert_eq!(
            by("leaving").container_id,
            "c-old",
            "the observation's container"
        );
    }
}
