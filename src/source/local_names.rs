//! Standalone: internal names answer the healthy local instances. With no
//! control plane there are no route snapshots, so the names come from the
//! executor's own status; the executor itself knows nothing of DNS names.
//! In a manifest's assignments the project, app and environment *are* their
//! names ([`super::assign`]).

use std::sync::Arc;

use tokio::sync::watch;
use zattera_dns::table::LocalInstance;
use zattera_dns::{DnsServer, NameTable};

use crate::status::{State, StatusSnapshot};

/// The instances internal names answer: the healthy ones with an address.
pub fn healthy_instances(status: &StatusSnapshot) -> Vec<LocalInstance> {
    status
        .assignments
        .iter()
        .filter(|a| a.state == State::Healthy)
        .filter_map(|a| {
            Some(LocalInstance {
                project_id: a.project.clone(),
                project_name: a.project.clone(),
                environment: a.environment.clone(),
                app: a.app.clone(),
                ip: a.ip.parse().ok()?,
            })
        })
        .collect()
}

/// Swaps the name table whenever the healthy instances change.
pub async fn feed_dns(mut status: watch::Receiver<Arc<StatusSnapshot>>, dns: Arc<DnsServer>) {
    let mut served = None;
    loop {
        let healthy = healthy_instances(&status.borrow_and_update());
        if served.as_ref() != Some(&healthy) {
            dns.set_table(NameTable::from_instances(&healthy));
            served = Some(healthy);
        }
        if status.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::status::AssignmentStatus;

    fn row(id: &str, state: State, ip: &str) -> AssignmentStatus {
        AssignmentStatus {
            id: id.into(),
            project: "shop".into(),
            app: id.into(),
            environment: "prod".into(),
            state,
            container_id: format!("c-{id}"),
            ip: ip.into(),
            ports: std::collections::BTreeMap::new(),
            restarts: 0,
            message: String::new(),
        }
    }

    #[test]
    fn only_healthy_instances_with_an_address_have_names() {
        let status = StatusSnapshot {
            assignments: vec![
                row("web", State::Healthy, "10.201.7.2"),
                row("api", State::Running, "10.201.7.3"),
                row("db", State::Healthy, ""),
            ],
            ..StatusSnapshot::default()
        };
        let names = healthy_instances(&status);
        assert_eq!(names.len(), 1);
        assert_eq!(
            (names[0].app.as_str(), names[0].environment.as_str()),
            ("web", "prod")
        );
        assert_eq!(names[0].ip, std::net::Ipv4Addr::new(10, 201, 7, 2));
    }
}
