//! Unpacking image layers into the overlayfs snapshotter (R-2 step 8).
//!
//! Each layer becomes a committed snapshot named by its chain id, so an
//! unpacked layer is shared by every image that has it and unpacking is
//! skipped when the snapshot is already there. containerd's Diff service
//! decompresses (gzip, zstd or none) and applies server-side.
//!
//! A layer is on disk before its snapshot is committed (58.1): a committed
//! snapshot whose files a power cut left empty breaks every container of
//! the image, and a pull never repairs it (the snapshot "exists"). The
//! apply asks containerd to sync (`sync_fs`, honoured from 1.7 on), and the
//! agent syncs the prepared snapshot's filesystem itself (`syncfs`) before
//! the commit, for a containerd that ignores the field.

use std::collections::HashMap;

use containerd_client::services::v1::ApplyRequest;
use containerd_client::services::v1::snapshots::{
    CommitSnapshotRequest, PrepareSnapshotRequest, RemoveSnapshotRequest, StatSnapshotRequest,
};
use sha2::{Digest as _, Sha256};
use tonic::Code;

use super::connection::Containerd;
use super::descriptor::Descriptor;
use super::digest::Digest;
use super::error::{RuntimeError, ignore_not_found};
use super::lease::Lease;

pub const SNAPSHOTTER: &str = "overlayfs";
pub const LABEL_UNCOMPRESSED: &str = "containerd.io/uncompressed";
pub const LABEL_GC_SNAPSHOT: &str = "containerd.io/gc.ref.snapshot.overlayfs";

/// The uncompressed layer digests (`rootfs.diff_ids`) of an image config.
pub fn diff_ids(
    config: &oci_spec::image::ImageConfiguration,
) -> Result<Vec<Digest>, super::digest::InvalidDigest> {
    config
        .rootfs()
        .diff_ids()
        .iter()
        .map(|d| d.parse())
        .collect()
}

/// Chain ids of a layer stack: `chain₀ = diff₀`, `chainᵢ = sha256(chainᵢ₋₁ + " " + diffᵢ)`.
pub fn chain_ids(diff_ids: &[Digest]) -> Vec<Digest> {
    let mut out: Vec<Digest> = Vec::with_capacity(diff_ids.len());
    for diff in diff_ids {
        let next = match out.last() {
            None => diff.clone(),
            Some(parent) => {
                Digest::from_hasher(Sha256::new_with_prefix(format!("{parent} {diff}")))
            }
        };
        out.push(next);
    }
    out
}

/// Whether a committed snapshot exists.
pub async fn snapshot_exists(ctd: &Containerd, key: &str) -> Result<bool, RuntimeError> {
    match ctd
        .snapshots()
        .stat(ctd.request(StatSnapshotRequest {
            snapshotter: SNAPSHOTTER.into(),
            key: key.into(),
        }))
        .await
    {
        Ok(_) => Ok(true),
        Err(s) if s.code() == Code::NotFound => Ok(false),
        Err(s) => Err(RuntimeError::grpc(format!("stat snapshot {key}"))(s)),
    }
}

/// Unpacks `layers` (whose uncompressed digests are `diff_ids`) and returns the
/// top chain id. Every layer blob is labelled with its uncompressed digest.
pub async fn unpack(
    ctd: &Containerd,
    lease: &Lease,
    layers: &[Descriptor],
    diff_ids: &[Digest],
) -> Result<Digest, RuntimeError> {
    let mut stack = LayerStack::new(layers, diff_ids)?;
    while stack.unpacked() < layers.len() {
        stack.unpack_next(ctd, lease).await?;
    }
    Ok(stack.top().clone())
}

/// A layer stack unpacked bottom up, one layer at a time, so that a pull can
/// unpack each layer as soon as it and the layers below it are in.
#[derive(Debug)]
pub struct LayerStack<'a> {
    layers: &'a [Descriptor],
    diff_ids: &'a [Digest],
    chains: Vec<Digest>,
    next: usize,
}

impl<'a> LayerStack<'a> {
    /// Checks that the manifest and the config agree on the layer count.
    pub fn new(layers: &'a [Descriptor], diff_ids: &'a [Digest]) -> Result<Self, RuntimeError> {
        if layers.len() != diff_ids.len() {
            return Err(RuntimeError::Invalid(format!(
                "manifest has {} layers but the config lists {} diff ids",
                layers.len(),
                diff_ids.len()
            )));
        }
        if layers.is_empty() {
            return Err(RuntimeError::Invalid("image has no layers".into()));
        }
        Ok(Self {
            layers,
            diff_ids,
            chains: chain_ids(diff_ids),
            next: 0,
        })
    }

    /// How many layers, from the bottom, are unpacked.
    pub fn unpacked(&self) -> usize {
        self.next
    }

    /// The top chain id: the image's snapshot once every layer is unpacked.
    pub fn top(&self) -> &Digest {
        // Not empty: `new` refuses an image without layers.
        &self.chains[self.chains.len() - 1]
    }

    /// Unpacks the lowest layer not yet unpacked (its blob must be in the
    /// content store), or only holds its snapshot if it exists already.
    pub async fn unpack_next(
        &mut self,
        ctd: &Containerd,
        lease: &Lease,
    ) -> Result<(), RuntimeError> {
        let i = self.next;
        let (Some(layer), Some(chain)) = (self.layers.get(i), self.chains.get(i)) else {
            return Ok(());
        };
        if snapshot_exists(ctd, chain.as_str()).await? {
            lease
                .hold(ctd, &format!("snapshots/{SNAPSHOTTER}"), chain.as_str())
                .await?;
        } else {
            let parent = if i == 0 {
                String::new()
            } else {
                self.chains[i - 1].to_string()
            };
            apply_layer(ctd, lease, layer, &self.diff_ids[i], &parent, chain).await?;
        }
        let labels = HashMap::from([(LABEL_UNCOMPRESSED.to_owned(), self.diff_ids[i].to_string())]);
        super::content::add_labels(ctd, &layer.digest, labels).await?;
        self.next += 1;
        Ok(())
    }
}

/// Where a prepared snapshot's files are written: the overlay's upper
/// directory, or a bind mount's source (the first layer).
fn snapshot_dir(mounts: &[containerd_client::types::Mount]) -> Option<std::path::PathBuf> {
    let m = mounts.first()?;
    let upper = m
        .options
        .iter()
        .find_map(|o| o.strip_prefix("upperdir="))
        .map(std::path::PathBuf::from);
    upper.or_else(|| (m.r#type == "bind").then(|| std::path::PathBuf::from(&m.source)))
}

async fn apply_layer(
    ctd: &Containerd,
    lease: &Lease,
    layer: &Descriptor,
    diff_id: &Digest,
    parent: &str,
    chain: &Digest,
) -> Result<(), RuntimeError> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let key = format!("zattera-extract-{nanos}-{chain}");
    let mounts = ctd
        .snapshots()
        .prepare(ctd.leased_request(
            PrepareSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: key.clone(),
                parent: parent.to_owned(),
                labels: HashMap::new(),
            },
            lease.id(),
        ))
        .await
        .map_err(RuntimeError::grpc(format!(
            "prepare snapshot for layer {}",
            layer.digest
        )))?
        .into_inner()
        .mounts;

    let result = async {
        let applied = ctd
            .diff()
            .apply(ctd.leased_request(
                ApplyRequest {
                    diff: Some(layer.to_containerd()),
                    mounts: mounts.clone(),
                    payloads: HashMap::new(),
                    sync_fs: true,
                },
                lease.id(),
            ))
            .await
            .map_err(RuntimeError::grpc(format!("apply layer {}", layer.digest)))?
            .into_inner()
            .applied
            .map(|d| d.digest)
            .unwrap_or_default();
        if applied != diff_id.as_str() {
            return Err(RuntimeError::Invalid(format!(
                "layer {} unpacked to {applied}, but the image config says {diff_id}",
                layer.digest
            )));
        }
        if let Some(dir) = snapshot_dir(&mounts) {
            let synced = tokio::task::spawn_blocking(move || crate::durable::sync_tree(&dir)).await;
            if !matches!(synced, Ok(Ok(()))) {
                tracing::warn!(layer = %layer.digest, "could not sync the unpacked layer; committing what containerd synced");
            }
        }
        match ctd
            .snapshots()
            .commit(ctd.leased_request(
                CommitSnapshotRequest {
                    snapshotter: SNAPSHOTTER.into(),
                    name: chain.to_string(),
                    key: key.clone(),
                    labels: HashMap::new(),
                },
                lease.id(),
            ))
            .await
        {
            Ok(_) => Ok(true),
            // Another unpack of the same layer won the race; ours is redundant.
            Err(s) if s.code() == Code::AlreadyExists => Ok(false),
            Err(s) => Err(RuntimeError::grpc(format!("commit snapshot {chain}"))(s)),
        }
    }
    .await;

    if !matches!(result, Ok(true)) {
        let removed = ctd
            .snapshots()
            .remove(ctd.request(RemoveSnapshotRequest {
                snapshotter: SNAPSHOTTER.into(),
                key: key.clone(),
            }))
            .await;
        if let Err(e) = ignore_not_found(removed) {
            tracing::warn!(%key, error = %e, "could not remove an abandoned extract snapshot");
        }
    }
    result.map(|_| ())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn chain_ids_follow_the_oci_definition() {
        let a = Digest::of(b"a");
        let b = Digest::of(b"b");
        let chains = chain_ids(&[a.clone(), b.clone()]);
        assert_eq!(chains[0], a);
        assert_eq!(chains[1], Digest::of(format!("{a} {b}").as_bytes()));
        assert!(chain_ids(&[]).is_empty());
    }
}
