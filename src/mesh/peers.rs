//! The last `PeerSet` on disk (`<data>/node/peers.pb`): written before it
//! is applied, read at start, so after a restart the mesh is back before
//! control answers. A join writes its `initial_peers` here.

use std::path::{Path, PathBuf};

use prost::Message;

use super::MeshError;
use crate::proto::cluster::PeerSet;

pub fn path(data_dir: &Path) -> PathBuf {
    crate::link::identity::IdentityDir::new(data_dir)
        .dir()
        .join("peers.pb")
}

/// The persisted set, if any.
pub fn load(path: &Path) -> Result<Option<PeerSet>, MeshError> {
    match std::fs::read(path) {
        Ok(bytes) => PeerSet::decode(bytes.as_slice())
            .map(Some)
            .map_err(|source| MeshError::Decode {
                path: path.to_owned(),
                source,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(MeshError::Io {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Replaces the persisted set atomically.
pub fn store(path: &Path, set: &PeerSet) -> Result<(), MeshError> {
    crate::link::identity::write_atomic(path, &set.encode_to_vec(), 0o600)?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::proto::cluster::Peer;

    #[test]
    fn a_set_round_trips_and_garbage_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("peers.pb");
        assert!(load(&p).unwrap().is_none());
        let set = PeerSet {
            version: 9,
            peers: vec![Peer {
                node_id: "c1".into(),
                ..Peer::default()
            }],
            leader_node_id: "c1".into(),
            ..PeerSet::default()
        };
        store(&p, &set).unwrap();
        assert_eq!(load(&p).unwrap(), Some(set));
        std::fs::write(&p, b"\xff\xff\xff").unwrap();
        assert!(matches!(load(&p), Err(MeshError::Decode { .. })));
    }
}
