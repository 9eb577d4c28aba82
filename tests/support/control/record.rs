//! What the control plane saw: joins, sessions, frames, refusals, watches.

use super::*;

/// An accepted sync stream: the control host that took it and the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    pub host: String,
    pub node: String,
}

/// Everything the control plane saw and holds.
#[derive(Default)]
pub struct Record {
    pub joins: Vec<JoinRequest>,
    /// Node ids issued so far.
    pub nodes: Vec<String>,
    /// Accepted sync sessions, in order; frames carry their session index.
    pub sessions: Vec<Session>,
    pub frames: Vec<(usize, AgentMessage)>,
    /// Why streams were refused (the status message).
    pub refused: Vec<String>,
    pub route_watches: Vec<WatchRoutesRequest>,
    /// Every WatchPeers call, as (control host, node id).
    pub peer_watches: Vec<Session>,
    /// The node records, as the reference's control plane keeps them.
    pub node_records: std::collections::BTreeMap<String, NodeRecord>,
}

/// A node as the reference's control plane records it
/// (`internal/daemon/api/join.go` `nodeRecord`, `nodes.go`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeRecord {
    /// Operator labels (`zt nodes label`) and the node's own.
    pub labels: std::collections::BTreeMap<String, String>,
    /// False: cordoned (nothing new is placed there).
    pub schedulable: bool,
    /// From the join, then from every hello that names one.
    pub binary_version: String,
    pub os_arch: String,
}

impl Record {
    /// Every status report of `assignment`, in arrival order.
    pub fn states_of(&self, assignment: &str) -> Vec<i32> {
        self.states_where(assignment, |_| true)
    }

    /// Status reports of `assignment` that reached control host `host`.
    pub fn states_on(&self, host: &str, assignment: &str) -> Vec<i32> {
        self.states_where(assignment, |s| s.host == host)
    }

    fn states_where(&self, assignment: &str, keep: impl Fn(&Session) -> bool) -> Vec<i32> {
        self.frames
            .iter()
            .filter(|(s, _)| keep(&self.sessions[*s]))
            .filter_map(|(_, f)| match &f.body {
                Some(Body::Status(b)) => b.observed.get(assignment).map(|o| o.state),
                _ => None,
            })
            .collect()
    }

    /// The newest status report of `assignment`.
    pub fn latest_of(&self, assignment: &str) -> Option<AssignmentObserved> {
        self.frames.iter().rev().find_map(|(_, f)| match &f.body {
            Some(Body::Status(b)) => b.observed.get(assignment).cloned(),
            _ => None,
        })
    }

    /// The control host of `node`'s newest sync stream.
    pub fn session_host_of(&self, node: &str) -> Option<&str> {
        self.sessions
            .iter()
            .rev()
            .find(|s| s.node == node)
            .map(|s| s.host.as_str())
    }

    /// How many sync streams `node` opened.
    pub fn sessions_of(&self, node: &str) -> usize {
        self.sessions.iter().filter(|s| s.node == node).count()
    }
}

/// One member of the mesh as control records it.
#[derive(Clone, Debug)]
pub struct Member {
    pub node_id: String,
    pub public_key: String,
    pub mesh_ip: Ipv4Addr,
    pub endpoint: String,
    pub is_control: bool,
}

/// The registry part of a JoinResponse; an empty user means `node-<id>`.
#[derive(Clone, Debug)]
pub struct RegistryGrant {
    pub addr: String,
    pub username: String,
    pub password: String,
}
