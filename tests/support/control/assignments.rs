//! Assignments and sets as control sends them.

use super::*;

/// One assignment of app `app` in environment `env`, with the test image
/// and `command`, on subnet slot `slot`.
pub fn assignment(
    id: &str,
    env: &str,
    slot: u8,
    command: &str,
) -> (
    zattera_agent::proto::v1::Assignment,
    zattera_agent::proto::cluster::AssignmentRuntime,
) {
    use zattera_agent::proto::v1::{Assignment, AssignmentDesired, Meta, ServiceSpec};
    let a = Assignment {
        meta: Some(Meta {
            id: id.into(),
            ..Meta::default()
        }),
        project_id: "proj".into(),
        app_id: format!("app-{id}"),
        environment_id: env.into(),
        desired: AssignmentDesired::Run as i32,
        config_hash: "h1".into(),
        release_id: "r1".into(),
        ..Assignment::default()
    };
    let rt = zattera_agent::proto::cluster::AssignmentRuntime {
        image_ref: crate::support::TEST_IMAGE.into(),
        spec: Some(ServiceSpec {
            command: command.into(),
            ..ServiceSpec::default()
        }),
        subnet_cidr: format!("10.201.{slot}.0/24"),
        ..Default::default()
    };
    (a, rt)
}

/// A set of the given assignments.
pub fn set_of(
    version: u64,
    items: Vec<(
        zattera_agent::proto::v1::Assignment,
        zattera_agent::proto::cluster::AssignmentRuntime,
    )>,
) -> AssignmentSet {
    let mut set = AssignmentSet {
        version,
        ..AssignmentSet::default()
    };
    for (a, rt) in items {
        let id = a.meta.as_ref().unwrap().id.clone();
        set.assignments.push(a);
        set.runtime.insert(id, rt);
    }
    set
}
