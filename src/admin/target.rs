//! TARGET as DESIGN.md defines it: an assignment id, a containerd
//! container id, or `app.env.project` (its first instance by id).

use crate::executor::status::{AssignmentStatus, StatusSnapshot};

/// The instance `target` names; the error lists what runs.
pub fn resolve<'a>(
    status: &'a StatusSnapshot,
    target: &str,
) -> Result<&'a AssignmentStatus, String> {
    let rows = &status.assignments;
    if let Some(a) = rows
        .iter()
        .find(|a| a.id == target || (!a.container_id.is_empty() && a.container_id == target))
    {
        return Ok(a);
    }
    if let [app, env, project] = target.split('.').collect::<Vec<_>>()[..] {
        let mut matching: Vec<&AssignmentStatus> = rows
            .iter()
            .filter(|a| a.app == app && a.environment == env && a.project == project)
            .collect();
        matching.sort_by(|a, b| a.id.cmp(&b.id));
        if let Some(first) = matching.first() {
            return Ok(first);
        }
    }
    let known: Vec<String> = rows
        .iter()
        .map(|a| format!("{} ({}.{}.{})", a.id, a.app, a.environment, a.project))
        .collect();
    Err(format!(
        "no instance {target:?}; the agent runs: {}",
        if known.is_empty() {
            "nothing".to_owned()
        } else {
            known.join(", ")
        }
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::status::State;

    fn row(id: &str, app: &str, cid: &str) -> AssignmentStatus {
        AssignmentStatus {
            id: id.into(),
            project: "p".into(),
            app: app.into(),
            environment: "prod".into(),
            state: State::Running,
            container_id: cid.into(),
            ip: String::new(),
            ports: std::collections::BTreeMap::default(),
            restarts: 0,
            message: String::new(),
        }
    }

    #[test]
    fn a_target_is_an_id_a_container_or_app_env_project() {
        let s = StatusSnapshot {
            assignments: vec![row("web-1", "web", "c1"), row("web-0", "web", "c0")],
            ..StatusSnapshot::default()
        };
        assert_eq!(resolve(&s, "web-1").unwrap().id, "web-1");
        assert_eq!(resolve(&s, "c1").unwrap().id, "web-1");
        assert_eq!(resolve(&s, "web.prod.p").unwrap().id, "web-0");
        let e = resolve(&s, "db.prod.p").unwrap_err();
        assert!(e.contains("web-0 (web.prod.p)"), "{e}");
    }
}
