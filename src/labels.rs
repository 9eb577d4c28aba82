//! The ownership contract, read by the executor, the log janitor, volumes
//! and snapshots alike: the labels that make a container ours (runtime.md
//! E-1, E-2) and the records that must survive a crash or a reboot (DESIGN
//! decision 3): IP, subnet and published ports live on the container, so
//! IPAM and port state are rebuilt from containerd alone.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::Duration;

use containerd_client::services::v1::Container;
use zattera_netns::{PublishedPort, Subnet};

use crate::proto::v1::Assignment;

/// Where a standalone manifest's `resources.pids` travels in the spec (a
/// placement constraint: the wire has no field for it).
pub const PIDS_LIMIT_KEY: &str = "zattera.dev/pids-limit";
pub const MANAGED: &str = "dev.zattera/managed";
pub const ASSIGNMENT_ID: &str = "dev.zattera/assignment-id";
pub const ENVIRONMENT_ID: &str = "dev.zattera/environment-id";
pub const APP_ID: &str = "dev.zattera/app-id";
pub const PROJECT_ID: &str = "dev.zattera/project-id";
pub const CONFIG_HASH: &str = "dev.zattera/config-hash";
pub const RELEASE_ID: &str = "dev.zattera/release-id";
pub const ROLE: &str = "dev.zattera/role";
pub const ROLE_SERVICE: &str = "service";

// The agent's own records (not part of E-1).
pub const NAME: &str = "dev.zattera/name";
/// The app and environment names (control injects them as ZATTERA_APP and
/// ZATTERA_ENV); DNS scopes and names use names, not ids.
pub const APP_NAME: &str = "dev.zattera/app-name";
pub const ENV_NAME: &str = "dev.zattera/environment-name";
pub const IP: &str = "dev.zattera/ip";
pub const SUBNET: &str = "dev.zattera/subnet";
/// `name=<PublishedPort>` entries joined by `;`.
pub const PORTS: &str = "dev.zattera/ports";
pub const STOP_SIGNAL: &str = "dev.zattera/stop-signal";
pub const STOP_GRACE_MS: &str = "dev.zattera/stop-grace-ms";
pub const LOG_PATH: &str = "dev.zattera/log-path";
/// `unless-stopped` for services, `no` for one-shot jobs (C-13).
pub const RESTART: &str = "dev.zattera/restart";
/// A job's exit code, once it has one (survives restarts and reboots).
pub const EXIT_CODE: &str = "dev.zattera/exit-code";
/// How many times the agent restarted the task (X-7 deviation: counted,
/// and kept across agent restarts).
pub const RESTARTS: &str = "dev.zattera/restarts";
/// The runc shim group the container's task runs in (the value of
/// [`crate::runtime::spec::RUNC_GROUP_ANNOTATION`] in its spec), when it
/// shares a shim.
pub const SHIM_GROUP: &str = "dev.zattera/shim-group";

/// The E-2 filter: managed services.
pub const OWNED_FILTER: [(&str, &str); 2] = [(MANAGED, "true"), (ROLE, ROLE_SERVICE)];

/// One published port of an instance, by its spec name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedPort {
    pub name: String,
    pub port: PublishedPort,
}

/// E-1 labels for an assignment's container.
pub fn ownership(a: &Assignment) -> HashMap<String, String> {
    let id = a.meta.as_ref().map(|m| m.id.clone()).unwrap_or_default();
    HashMap::from([
        (MANAGED.to_owned(), "true".to_owned()),
        (ASSIGNMENT_ID.to_owned(), id),
        (ENVIRONMENT_ID.to_owned(), a.environment_id.clone()),
        (APP_ID.to_owned(), a.app_id.clone()),
        (PROJECT_ID.to_owned(), a.project_id.clone()),
        (CONFIG_HASH.to_owned(), a.config_hash.clone()),
        (RELEASE_ID.to_owned(), a.release_id.clone()),
        (ROLE.to_owned(), ROLE_SERVICE.to_owned()),
    ])
}

pub fn encode_ports(ports: &[NamedPort]) -> String {
    ports
        .iter()
        .map(|p| format!("{}={}", p.name, p.port))
        .collect::<Vec<_>>()
        .join(";")
}

pub fn decode_ports(s: &str) -> Vec<NamedPort> {
    s.split(';')
        .filter(|e| !e.is_empty())
        .filter_map(|e| {
            let (name, port) = e.split_once('=')?;
            Some(NamedPort {
                name: name.to_owned(),
                port: port.parse().ok()?,
            })
        })
        .collect()
}

/// What the executor knows of a container it owns, read from its labels.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OwnedContainer {
    pub container_id: String,
    pub assignment_id: String,
    pub project_id: String,
    pub app_id: String,
    pub environment_id: String,
    pub app_name: String,
    pub environment_name: String,
    pub config_hash: String,
    pub ip: Option<Ipv4Addr>,
    pub subnet: Option<Subnet>,
    pub ports: Vec<NamedPort>,
    pub stop_signal: u32,
    pub stop_grace: Duration,
    pub log_path: Option<String>,
    pub restart: bool,
    pub exit_code: Option<u32>,
    pub restarts: u32,
    pub shim_group: Option<String>,
}

impl OwnedContainer {
    /// `None` for a container that is not ours (E-2): no managed/role labels
    /// or no assignment id.
    pub fn from_container(c: &Container) -> Option<Self> {
        let l = &c.labels;
        let get = |k: &str| l.get(k).cloned().unwrap_or_default();
        if l.get(MANAGED).map(String::as_str) != Some("true")
            || l.get(ROLE).map(String::as_str) != Some(ROLE_SERVICE)
            || get(ASSIGNMENT_ID).is_empty()
        {
            return None;
        }
        Some(Self {
            container_id: c.id.clone(),
            assignment_id: get(ASSIGNMENT_ID),
            project_id: get(PROJECT_ID),
            app_id: get(APP_ID),
            environment_id: get(ENVIRONMENT_ID),
            app_name: l.get(APP_NAME).cloned().unwrap_or_else(|| get(APP_ID)),
            environment_name: l
                .get(ENV_NAME)
                .cloned()
                .unwrap_or_else(|| get(ENVIRONMENT_ID)),
            config_hash: get(CONFIG_HASH),
            ip: l.get(IP).and_then(|v| v.parse().ok()),
            subnet: l.get(SUBNET).and_then(|v| v.parse().ok()),
            ports: l.get(PORTS).map(|v| decode_ports(v)).unwrap_or_default(),
            stop_signal: l
                .get(STOP_SIGNAL)
                .and_then(|v| v.parse().ok())
                .unwrap_or(15),
            stop_grace: Duration::from_millis(
                l.get(STOP_GRACE_MS)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(10_000),
            ),
            log_path: l.get(LOG_PATH).cloned(),
            restart: l.get(RESTART).map(String::as_str) != Some("no"),
            exit_code: l.get(EXIT_CODE).and_then(|v| v.parse().ok()),
            restarts: l.get(RESTARTS).and_then(|v| v.parse().ok()).unwrap_or(0),
            shim_group: l.get(SHIM_GROUP).filter(|g| !g.is_empty()).cloned(),
        })
    }
}

/// A containerd id for an assignment's container: the full assignment id
/// plus the config hash prefix, so each incarnation has its own (C-1, X-5).
pub fn container_id(assignment_id: &str, config_hash: &str) -> String {
    let clean = |s: &str| -> String {
        let mut out = String::new();
        for c in s.chars() {
            let c = if c.is_ascii_alphanumeric() { c } else { '-' };
            if !(c == '-' && (out.is_empty() || out.ends_with('-'))) {
                out.push(c);
            }
        }
        out.trim_end_matches('-').to_owned()
    };
    let hash: String = clean(config_hash).chars().take(8).collect();
    let id = clean(assignment_id);
    let room = 76 - hash.len() - 1;
    let id: String = id.chars().take(room).collect();
    let id = id.trim_end_matches('-');
    if hash.is_empty() {
        id.to_owned()
    } else {
        format!("{id}-{hash}")
    }
}

/// The Docker-style name kept for humans (C-1).
pub fn display_name(a: &Assignment) -> String {
    let first8 = |s: &str| s.chars().take(8).collect::<String>();
    let id = a.meta.as_ref().map(|m| m.id.as_str()).unwrap_or_default();
    format!(
        "zt-{}-{}-{}",
        first8(&a.app_id),
        first8(&a.environment_id),
        first8(id)
    )
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::runtime::validate_identifier;

    #[test]
    fn container_ids_are_valid_and_unique_per_hash() {
        let a = container_id("demo-web-production-0", "0123456789abcdef");
        assert_eq!(a, "demo-web-production-0-01234567");
        assert_ne!(a, container_id("demo-web-production-0", "fedcba9876543210"));
        for weird in ["01HX/ENV::ID", &"x".repeat(200), "a--b__c", "-lead"] {
            let id = container_id(weird, "abc");
            assert!(validate_identifier(&id).is_ok(), "{weird} -> {id}");
        }
    }

    #[test]
    fn ports_round_trip_through_the_label() {
        let ports = vec![
            NamedPort {
                name: "http".into(),
                port: "tcp/127.0.0.1:8080->10.201.5.2:80".parse().unwrap(),
            },
            NamedPort {
                name: "dns".into(),
                port: "udp/127.0.0.1:5353->10.201.5.2:53".parse().unwrap(),
            },
        ];
        assert_eq!(decode_ports(&encode_ports(&ports)), ports);
        assert!(decode_ports("").is_empty());
        assert_eq!(
            decode_ports("junk;http=tcp/127.0.0.1:1->10.201.5.2:2").len(),
            1
        );
    }

    #[test]
    fn only_labelled_services_are_owned() {
        let mut c = Container {
            id: "x".into(),
            ..Container::default()
        };
        assert!(OwnedContainer::from_container(&c).is_none());
        c.labels = HashMap::from([
            (MANAGED.into(), "true".into()),
            (ROLE.into(), "service".into()),
        ]);
        assert!(
            OwnedContainer::from_container(&c).is_none(),
            "no assignment id"
        );
        c.labels.insert(ASSIGNMENT_ID.into(), "a1".into());
        c.labels.insert(IP.into(), "10.201.3.7".into());
        c.labels.insert(SUBNET.into(), "10.201.3.0/24".into());
        let owned = OwnedContainer::from_container(&c).unwrap();
        assert_eq!(owned.ip, Some(Ipv4Addr::new(10, 201, 3, 7)));
        assert_eq!(owned.subnet.unwrap().slot(), 3);
        assert!(owned.restart);
        assert_eq!(owned.stop_grace, Duration::from_secs(10));
    }
}
