//! A node moved from the reference agent keeps its enrollment.
//!
//! A joined reference worker keeps its identity in `<data-dir>/node/`: `id`
//! (the bare node id), `node.crt`, `node.key` (SEC1 EC), `ca.crt` and
//! `mesh.json` (node id, mesh IP, control and registry addresses, the
//! registry credential, whether the mesh is on), and its WireGuard key in
//! `<data-dir>/wg.key`. Only a bootstrapped control node writes
//! `<data-dir>/node-id`. When this agent finds those files and no
//! enrollment of its own, it takes them over: no token is needed, control
//! keeps the node's record (labels, cordon, stateful instances), and the
//! mesh keeps its key. Nothing read is trusted unchecked: the id must be an
//! id, the addresses `host:port`, the mesh IP an IPv4 address, the
//! certificate valid now, chained to `ca.crt`, naming that id and matching
//! the key. Anything else leaves the files alone and says why; a kept join
//! token then joins again as the same node (`existing_node_id`).

use std::path::Path;

use serde::Deserialize;

use crate::link::identity::{Enrollment, IdentityDir, is_node_id};
use crate::link::tls::NodeTls;

/// `node/mesh.json` as the reference writes it (`joinResult`).
#[derive(Deserialize)]
struct MeshJson {
    node_id: String,
    #[serde(default)]
    mesh_ip: String,
    #[serde(default)]
    control_grpc_addr: String,
    #[serde(default)]
    registry_addr: String,
    #[serde(default)]
    registry_username: String,
    #[serde(default)]
    registry_password: String,
    #[serde(default)]
    mesh_enabled: bool,
}

/// What taking over a reference enrollment gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Moved {
    /// The identity is this agent's now.
    Adopted { node_id: String },
    /// Files of a reference enrollment that cannot be used, and why.
    Unusable { why: String },
    /// Nothing to take over (this agent's own enrollment, or none at all).
    Nothing,
}

/// Whether `addr` is `host:port` (an empty one is allowed by `optional`).
fn is_host_port(addr: &str, optional: bool) -> bool {
    if addr.is_empty() {
        return optional;
    }
    addr.rsplit_once(':').is_some_and(|(host, port)| {
        port.parse::<u16>().is_ok_and(|p| p > 0)
            && !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'[' | b']' | b':'))
    })
}

/// The reference's node id in `<data-dir>/node/id`, if it is an id.
pub fn reference_node_id(ids: &IdentityDir) -> Option<String> {
    let text = std::fs::read_to_string(ids.dir().join("id")).ok()?;
    let id = text.trim();
    is_node_id(id).then(|| id.to_owned())
}

/// Takes over a reference worker's enrollment under `data_dir` when this
/// agent has none (module doc). `control`: the address the operator gives
/// now (`--control`), which the sync stream dials first; the reference's
/// `control_grpc_addr` otherwise.
pub fn adopt(data_dir: &Path, control: Option<&str>) -> Moved {
    let ids = IdentityDir::new(data_dir);
    if ids.state_path().exists() || !ids.dir().join("mesh.json").exists() {
        return Moved::Nothing;
    }
    match read_and_check(&ids, control) {
        Ok((enrollment, tls)) => {
            if let Err(e) = carry_wireguard_key(data_dir) {
                return Moved::Unusable { why: e };
            }
            if let Err(e) = ids.store(&enrollment, &tls) {
                return Moved::Unusable { why: e.to_string() };
            }
            Moved::Adopted {
                node_id: enrollment.node_id,
            }
        }
        Err(why) => Moved::Unusable { why },
    }
}

fn read_and_check(
    ids: &IdentityDir,
    control: Option<&str>,
) -> Result<(Enrollment, NodeTls), String> {
    let id = reference_node_id(ids).ok_or_else(|| "node/id holds no node id".to_owned())?;
    let path = ids.dir().join("mesh.json");
    let text = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mesh: MeshJson =
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if mesh.node_id != id {
        return Err(format!(
            "mesh.json names node {:?}, node/id {id:?}",
            mesh.node_id
        ));
    }
    if mesh.mesh_enabled && mesh.mesh_ip.parse::<std::net::Ipv4Addr>().is_err() {
        return Err(format!(
            "mesh.json: mesh_ip {:?} is not an IPv4 address",
            mesh.mesh_ip
        ));
    }
    for (key, addr, optional) in [
        (
            "control_grpc_addr",
            mesh.control_grpc_addr.as_str(),
            control.is_some(),
        ),
        ("registry_addr", mesh.registry_addr.as_str(), true),
    ] {
        if !is_host_port(addr, optional) {
            return Err(format!("mesh.json: {key} {addr:?} is not host:port"));
        }
    }
    let tls = ids.load_tls().map_err(|e| e.to_string())?;
    if let Some(why) = crate::link::tls::identity_problem(&tls, &id) {
        return Err(why);
    }
    let enrollment = Enrollment {
        node_id: id,
        mesh_ip: mesh.mesh_ip,
        control_addr: control.map_or(mesh.control_grpc_addr, str::to_owned),
        registry_addr: mesh.registry_addr,
        registry_username: mesh.registry_username,
        registry_password: mesh.registry_password,
        control_node_ids: Vec::new(),
        mesh_enabled: mesh.mesh_enabled,
    };
    Ok((enrollment, tls))
}

/// The reference's `<data-dir>/wg.key` becomes this agent's key, so the
/// peers keep knowing the node by its public key. Checked to be a key.
fn carry_wireguard_key(data_dir: &Path) -> Result<(), String> {
    let theirs = data_dir.join("wg.key");
    let ours = crate::mesh::key_path(data_dir);
    if ours.exists() || !theirs.exists() {
        return Ok(());
    }
    let text =
        std::fs::read_to_string(&theirs).map_err(|e| format!("{}: {e}", theirs.display()))?;
    zattera_mesh::PrivateKey::from_base64(text.trim())
        .map_err(|e| format!("{}: not a WireGuard key: {e}", theirs.display()))?;
    crate::link::identity::write_atomic(&ours, format!("{}\n", text.trim()).as_bytes(), 0o600)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_addresses_are_checked_before_use() {
        assert!(is_node_id("01JABCDEFGHJKMNPQRSTVWXYZ0"));
        for bad in ["", "../etc", "a/b", "id\n", &"x".repeat(200)] {
            assert!(!is_node_id(bad), "{bad:?}");
        }
        assert!(is_host_port("10.90.0.1:8443", false));
        assert!(is_host_port("control.example:8443", false));
        assert!(is_host_port("", true));
        for bad in [
            "",
            "10.90.0.1",
            "10.90.0.1:0",
            "h:99999",
            "/etc/passwd:1",
            "a b:1",
        ] {
            assert!(!is_host_port(bad, false), "{bad:?}");
        }
    }

    #[test]
    fn a_data_dir_without_a_reference_enrollment_is_left_alone() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(adopt(d.path(), None), Moved::Nothing);
        std::fs::create_dir_all(d.path().join("node")).unwrap();
        std::fs::write(d.path().join("node/id"), "../../etc").unwrap();
        std::fs::write(d.path().join("node/mesh.json"), "{\"node_id\":\"x\"}").unwrap();
        match adopt(d.path(), None) {
            Moved::Unusable { why } => assert!(why.contains("no node id"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(!IdentityDir::new(d.path()).state_path().exists());
    }
}
