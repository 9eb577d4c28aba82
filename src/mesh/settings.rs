//! The node's side of the mesh as the config resolves it (`config.rs`
//! reads the keys; the mesh owns what they mean), as `build/settings.rs`
//! does for builds.

use std::net::SocketAddr;

/// The node's side of the WireGuard mesh, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshSettings {
    pub interface: String,
    pub listen_port: u16,
    /// What the join advertises; empty: nothing but what autodetection finds.
    pub endpoints: Vec<SocketAddr>,
    /// `mesh-endpoints = ["auto"]`: also the default route's address at
    /// join time, if globally routable (two such workers get direct /32
    /// routes to each other, which a firewall dropping UDP 51820 cuts off).
    pub autodetect_endpoint: bool,
    pub backend: zattera_mesh::BackendKind,
}

impl Default for MeshSettings {
    fn default() -> Self {
        Self {
            interface: "zt0".into(),
            listen_port: zattera_mesh::DEFAULT_PORT,
            endpoints: Vec::new(),
            autodetect_endpoint: false,
            backend: zattera_mesh::BackendKind::Auto,
        }
    }
}
