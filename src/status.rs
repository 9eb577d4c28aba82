//! The vocabulary of instance status, spoken by everyone above the runtime:
//! what the executor reports, one observation per assignment (E-14), the
//! batches a pass emits (E-11), and the snapshot `zattera-agent status`
//! shows. The health prober, the sync queue, telemetry and the admin socket
//! read it; it depends on nothing of theirs.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::proto::v1::{AssignmentObserved, InstanceState};

/// The instance states of the wire contract, by their short names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum State {
    Pending,
    Pulling,
    Starting,
    Running,
    Healthy,
    Unhealthy,
    Failed,
    Stopped,
}

impl State {
    pub fn to_proto(self) -> InstanceState {
        match self {
            Self::Pending => InstanceState::Pending,
            Self::Pulling => InstanceState::Pulling,
            Self::Starting => InstanceState::Starting,
            Self::Running => InstanceState::Running,
            Self::Healthy => InstanceState::Healthy,
            Self::Unhealthy => InstanceState::Unhealthy,
            Self::Failed => InstanceState::Failed,
            Self::Stopped => InstanceState::Stopped,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Pending => "PENDING",
            Self::Pulling => "PULLING",
            Self::Starting => "STARTING",
            Self::Running => "RUNNING",
            Self::Healthy => "HEALTHY",
            Self::Unhealthy => "UNHEALTHY",
            Self::Failed => "FAILED",
            Self::Stopped => "STOPPED",
        }
    }
}

/// One report about one assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub assignment_id: String,
    pub state: State,
    pub container_id: String,
    pub message: String,
    pub exit_code: Option<i32>,
    pub restarts: u32,
    /// Port name → effective host port (E-12).
    pub ports: BTreeMap<String, u16>,
    pub updated_at: SystemTime,
}

impl Observation {
    /// Whether `other` says the same as this one, but for when it was made.
    pub fn shows_as(&self, other: &Self) -> bool {
        Self {
            updated_at: other.updated_at,
            ..self.clone()
        } == *other
    }

    pub fn new(assignment_id: &str, state: State) -> Self {
        Self {
            assignment_id: assignment_id.to_owned(),
            state,
            container_id: String::new(),
            message: String::new(),
            exit_code: None,
            restarts: 0,
            ports: BTreeMap::new(),
            updated_at: SystemTime::now(),
        }
    }

    #[must_use]
    pub fn container(mut self, id: &str) -> Self {
        id.clone_into(&mut self.container_id);
        self
    }

    #[must_use]
    pub fn message(mut self, m: impl Into<String>) -> Self {
        self.message = m.into();
        self
    }

    pub fn to_proto(&self) -> AssignmentObserved {
        AssignmentObserved {
            state: self.state.to_proto() as i32,
            container_id: self.container_id.clone(),
            restarts: self.restarts,
            exit_code: self.exit_code.unwrap_or(0),
            message: self.message.clone(),
            updated_at: Some(prost_types::Timestamp::from(self.updated_at)),
            mesh_port_bindings: self
                .ports
                .iter()
                .map(|(k, v)| (k.clone(), u32::from(*v)))
                .collect(),
        }
    }
}

/// One row of `zattera-agent status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssignmentStatus {
    pub id: String,
    pub project: String,
    pub app: String,
    pub environment: String,
    pub state: State,
    pub container_id: String,
    pub ip: String,
    pub ports: BTreeMap<String, u16>,
    pub restarts: u32,
    pub message: String,
}

/// A manifest (or other source input) that could not be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceError {
    pub file: String,
    pub message: String,
}

/// Everything `status --json` prints.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusSnapshot {
    pub node_id: String,
    pub source: String,
    pub assignments: Vec<AssignmentStatus>,
    pub errors: Vec<SourceError>,
    /// Node-level warnings (an expiring certificate), added by the admin
    /// socket.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notices: Vec<String>,
    /// Reconcile passes completed since the agent started: one every tick
    /// (5 s) and one per change. Waiting for it to grow is waiting for the
    /// agent to have looked again, which a fixed sleep cannot promise.
    #[serde(default)]
    pub passes: u64,
}

impl StatusSnapshot {
    /// The table people read.
    pub fn render_table(&self) -> String {
        let mut out = format!(
            "node {}  source {}\n",
            if self.node_id.is_empty() {
                "-"
            } else {
                &self.node_id
            },
            self.source
        );
        for n in &self.notices {
            let _ = writeln!(out, "warning: {n}");
        }
        let header = [
            "ASSIGNMENT",
            "APP",
            "ENV",
            "PROJECT",
            "STATE",
            "IP",
            "PORTS",
            "RESTARTS",
            "MESSAGE",
        ];
        let rows: Vec<[String; 9]> = self
            .assignments
            .iter()
            .map(|a| {
                let ports = a
                    .ports
                    .iter()
                    .map(|(n, p)| format!("{n}:{p}"))
                    .collect::<Vec<_>>()
                    .join(",");
                [
                    a.id.clone(),
                    a.app.clone(),
                    a.environment.clone(),
                    a.project.clone(),
                    a.state.name().to_owned(),
                    if a.ip.is_empty() {
                        "-".into()
                    } else {
                        a.ip.clone()
                    },
                    if ports.is_empty() { "-".into() } else { ports },
                    a.restarts.to_string(),
                    a.message.clone(),
                ]
            })
            .collect();
        let mut widths = header.map(str::len);
        for r in &rows {
            for (w, c) in widths.iter_mut().zip(r) {
                *w = (*w).max(c.len());
            }
        }
        let line = |cells: &[String]| {
            let mut l = String::new();
            for (i, (c, w)) in cells.iter().zip(widths).enumerate() {
                if i + 1 == cells.len() {
                    l.push_str(c);
                } else {
                    let _ = write!(l, "{c:<w$}  ");
                }
            }
            l.trim_end().to_owned() + "\n"
        };
        out.push_str(&line(&header.map(String::from)));
        for r in &rows {
            out.push_str(&line(r));
        }
        if self.assignments.is_empty() {
            out.push_str("(no assignments)\n");
        }
        for e in &self.errors {
            let _ = writeln!(out, "error: {}: {}", e.file, e.message);
        }
        out
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn states_serialise_as_the_wire_names() {
        assert_eq!(
            serde_json::to_string(&State::Healthy).unwrap(),
            "\"HEALTHY\""
        );
        assert_eq!(State::Unhealthy.to_proto(), InstanceState::Unhealthy);
    }

    #[test]
    fn table_lists_rows_and_errors() {
        let snap = StatusSnapshot {
            node_id: String::new(),
            source: "manifests /etc/zattera/manifests".into(),
            assignments: vec![AssignmentStatus {
                id: "demo-web-production-0".into(),
                project: "demo".into(),
                app: "web".into(),
                environment: "production".into(),
                state: State::Healthy,
                container_id: "c".into(),
                ip: "10.201.0.2".into(),
                ports: BTreeMap::from([("http".into(), 8080)]),
                restarts: 0,
                message: String::new(),
            }],
            errors: vec![SourceError {
                file: "bad.toml".into(),
                message: "unknown key".into(),
            }],
            notices: vec!["the node certificate expires in 9 days".into()],
            passes: 0,
        };
        let t = snap.render_table();
        assert!(
            t.contains("demo-web-production-0") && t.contains("HEALTHY") && t.contains("http:8080"),
            "{t}"
        );
        assert!(t.contains("error: bad.toml: unknown key"));
        assert!(t.contains("warning: the node certificate expires in 9 days"));
    }
}
