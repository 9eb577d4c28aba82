//! TARGET as DESIGN.md defines it ([`zattera_netns::target`]), over the
//! status board's rows.

use crate::status::{AssignmentStatus, StatusSnapshot};

/// The instance `target` names; the error lists what runs.
pub fn resolve<'a>(
    status: &'a StatusSnapshot,
    target: &str,
) -> Result<&'a AssignmentStatus, String> {
    let named: Vec<zattera_netns::target::Named<'_>> = status
        .assignments
        .iter()
        .map(|a| zattera_netns::target::Named {
            id: &a.id,
            project: &a.project,
            app: &a.app,
            environment: &a.environment,
            container_id: &a.container_id,
        })
        .collect();
    zattera_netns::target::resolve(&named, target).map(|n| &status.assignments[n])
}
