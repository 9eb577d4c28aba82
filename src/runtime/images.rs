//! Image records: importing archives into containerd and checking what is
//! already there. Pull (issue: containerd runtime) shares `store_and_unpack`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use containerd_client::services::v1::{
    CreateImageRequest, DeleteImageRequest, GetImageRequest, Image, ListImagesRequest,
    UpdateImageRequest,
};
use oci_spec::image::{ImageConfiguration, ImageIndex, ImageManifest};
use tonic::Code;

use super::archive::{ImageArchive, PlannedImage};
use super::connection::Containerd;
use super::content;
use super::descriptor::{Descriptor, media, select_manifest};
use super::digest::Digest;
use super::error::RuntimeError;
use super::lease::Lease;
use super::reference::ImageRef;
use super::unpack::{self, LABEL_GC_SNAPSHOT};

/// An import lease outlives any sane import; it only matters if we crash.
const IMPORT_LEASE_TTL: Duration = Duration::from_secs(3600);

/// What one import produced.
#[derive(Debug, Clone)]
pub struct ImportedImage {
    pub names: Vec<ImageRef>,
    pub target: Descriptor,
    /// Top chain id: the snapshot a container's rootfs is prepared from.
    pub chain_id: Digest,
    /// Blobs written (the rest were already in the store).
    pub blobs_written: usize,
}

/// Imports every image of an OCI layout or `docker save` archive, unpacked
/// into overlayfs. `name` names the archive's single image.
pub async fn import_archive(
    ctd: &Containerd,
    path: &Path,
    name: Option<ImageRef>,
) -> Result<Vec<ImportedImage>, RuntimeError> {
    let owned_path = path.to_path_buf();
    let (archive, plans) = tokio::task::spawn_blocking(move || {
        let archive = ImageArchive::open(&owned_path)?;
        let plans = archive.plan(name.as_ref())?;
        Ok::<_, RuntimeError>((archive, plans))
    })
    .await
    .map_err(|e| RuntimeError::Invalid(format!("import {}: {e}", path.display())))??;
    let archive = Arc::new(archive);

    let lease = Lease::create(ctd, "import", IMPORT_LEASE_TTL).await?;
    let result = async {
        let mut imported = Vec::with_capacity(plans.len());
        for plan in plans {
            imported.push(store_and_unpack(ctd, &lease, &archive, plan).await?);
        }
        Ok(imported)
    }
    .await;
    // On failure the lease goes too, so GC takes whatever was half-written.
    if let Err(e) = lease.release(ctd).await {
        tracing::warn!(error = %e, "could not release the import lease; it expires by itself");
    }
    result
}

async fn store_and_unpack(
    ctd: &Containerd,
    lease: &Lease,
    archive: &ImageArchive,
    plan: PlannedImage,
) -> Result<ImportedImage, RuntimeError> {
    let mut blobs_written = 0;
    for blob in &plan.blobs {
        let source = archive.open_blob(&blob.source).await?;
        if content::ensure_blob(ctd, lease, &blob.desc, source).await? {
            blobs_written += 1;
        }
        content::add_labels(ctd, &blob.desc.digest, blob.labels.clone()).await?;
    }
    let chain_id = unpack::unpack(ctd, lease, &plan.layers, &plan.diff_ids).await?;
    // The config keeps the unpacked snapshot alive for as long as the image lives.
    content::add_labels(
        ctd,
        &plan.config,
        HashMap::from([(LABEL_GC_SNAPSHOT.to_owned(), chain_id.to_string())]),
    )
    .await?;
    for name in &plan.names {
        put_image_record(ctd, name, &plan.target).await?;
    }
    Ok(ImportedImage {
        names: plan.names,
        target: plan.target,
        chain_id,
        blobs_written,
    })
}

/// The label on every image record the agent made (a pull or an import):
/// image garbage collection removes no other.
pub const OWNED_LABEL: &str = "dev.zattera/managed";

/// Creates the image record, or points an existing one at the new target.
pub async fn put_image_record(
    ctd: &Containerd,
    name: &ImageRef,
    target: &Descriptor,
) -> Result<(), RuntimeError> {
    let image = Image {
        name: name.to_string(),
        labels: HashMap::from([(OWNED_LABEL.to_owned(), "true".to_owned())]),
        target: Some(target.to_containerd()),
        created_at: None,
        updated_at: None,
    };
    let created = ctd
        .images()
        .create(ctd.request(CreateImageRequest {
            image: Some(image.clone()),
            source_date_epoch: None,
        }))
        .await;
    match created {
        Ok(_) => Ok(()),
        Err(s) if s.code() == Code::AlreadyExists => {
            ctd.images()
                .update(ctd.request(UpdateImageRequest {
                    image: Some(image),
                    update_mask: Some(prost_types::FieldMask {
                        paths: vec!["target".into(), format!("labels.{OWNED_LABEL}")],
                    }),
                    source_date_epoch: None,
                }))
                .await
                .map_err(RuntimeError::grpc(format!("update image {name}")))?;
            Ok(())
        }
        Err(s) => Err(RuntimeError::grpc(format!("create image {name}"))(s)),
    }
}

/// An image record of the namespace, as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRecord {
    pub name: String,
    /// Made by this agent ([`OWNED_LABEL`]).
    pub owned: bool,
    /// When the record was created or last pointed at a new target.
    pub updated: std::time::SystemTime,
}

/// Every image record of the namespace.
pub async fn list_images(ctd: &Containerd) -> Result<Vec<ImageRecord>, RuntimeError> {
    let images = ctd
        .images()
        .list(ctd.request(ListImagesRequest { filters: vec![] }))
        .await
        .map_err(RuntimeError::grpc("list images"))?
        .into_inner()
        .images;
    let at = |t: Option<prost_types::Timestamp>| {
        t.and_then(|t| std::time::SystemTime::try_from(t).ok())
            .unwrap_or(std::time::UNIX_EPOCH)
    };
    Ok(images
        .into_iter()
        .map(|i| ImageRecord {
            owned: i.labels.get(OWNED_LABEL).is_some_and(|v| v == "true"),
            updated: at(i.updated_at).max(at(i.created_at)),
            name: i.name,
        })
        .collect())
}

/// Deletes an image record and, before answering, lets containerd's garbage
/// collector free what only it referenced (its content and snapshots).
pub async fn delete_image(ctd: &Containerd, name: &str) -> Result<(), RuntimeError> {
    match ctd
        .images()
        .delete(ctd.request(DeleteImageRequest {
            name: name.to_owned(),
            sync: true,
            target: None,
        }))
        .await
    {
        Ok(_) => Ok(()),
        Err(s) if s.code() == Code::NotFound => Ok(()),
        Err(s) => Err(RuntimeError::grpc(format!("delete image {name}"))(s)),
    }
}

/// An image present in the namespace, resolved for this platform.
#[derive(Debug, Clone)]
pub struct LocalImage {
    pub name: ImageRef,
    pub target: Descriptor,
    pub config: ImageConfiguration,
    /// Top chain id: the rootfs parent snapshot.
    pub chain_id: Digest,
    /// Whether that snapshot exists (unpacked for overlayfs).
    pub unpacked: bool,
    /// The layers' size as stored (compressed).
    pub layer_bytes: u64,
}

/// The target of image record `name`; `None` when there is no record.
pub async fn get_target(
    ctd: &Containerd,
    name: &ImageRef,
) -> Result<Option<Descriptor>, RuntimeError> {
    let got = ctd
        .images()
        .get(ctd.request(GetImageRequest {
            name: name.to_string(),
        }))
        .await;
    let image = match got {
        Ok(r) => r.into_inner().image,
        Err(s) if s.code() == Code::NotFound => return Ok(None),
        Err(s) => return Err(RuntimeError::grpc(format!("get image {name}"))(s)),
    };
    let Some(target) = image.and_then(|i| i.target) else {
        return Ok(None);
    };
    Ok(Some(Descriptor {
        digest: target
            .digest
            .parse()
            .map_err(|e: super::digest::InvalidDigest| {
                RuntimeError::Invalid(format!("image {name}: {e}"))
            })?,
        size: u64::try_from(target.size).unwrap_or(0),
        media_type: target.media_type,
    }))
}

/// The manifest an image record points at for this platform: the target
/// itself, or the host's entry of the index it names. Its descriptor, its
/// bytes and the manifest; `bad` words what is malformed or missing.
pub(super) async fn platform_manifest(
    ctd: &Containerd,
    target: &Descriptor,
    bad: &impl Fn(String) -> RuntimeError,
) -> Result<(Descriptor, Vec<u8>, ImageManifest), RuntimeError> {
    let desc = if media::is_index(&target.media_type) {
        let index = ImageIndex::from_reader(&content::read_blob(ctd, &target.digest).await?[..])
            .map_err(|e| bad(format!("index {}: {e}", target.digest)))?;
        let chosen = select_manifest(&index).ok_or_else(|| {
            bad(format!(
                "no manifest for linux/{}",
                super::descriptor::host_architecture()
            ))
        })?;
        Descriptor::from_oci(chosen)?
    } else {
        target.clone()
    };
    let bytes = content::read_blob(ctd, &desc.digest).await?;
    let manifest = ImageManifest::from_reader(&bytes[..])
        .map_err(|e| bad(format!("manifest {}: {e}", desc.digest)))?;
    Ok((desc, bytes, manifest))
}

/// Looks an image up by name; `None` when there is no record.
pub async fn get_local(
    ctd: &Containerd,
    name: &ImageRef,
) -> Result<Option<LocalImage>, RuntimeError> {
    let Some(target) = get_target(ctd, name).await? else {
        return Ok(None);
    };
    let bad = |what: String| RuntimeError::Invalid(format!("image {name}: {what}"));
    let (_, _, manifest) = platform_manifest(ctd, &target, &bad).await?;
    let config_digest = Descriptor::from_oci(manifest.config())?.digest;
    let config =
        ImageConfiguration::from_reader(&content::read_blob(ctd, &config_digest).await?[..])
            .map_err(|e| bad(format!("config {config_digest}: {e}")))?;
    let diff_ids = unpack::diff_ids(&config).map_err(|e| bad(e.to_string()))?;
    let chain_id = unpack::chain_ids(&diff_ids)
        .pop()
        .ok_or_else(|| bad("image has no layers".into()))?;
    let unpacked = unpack::snapshot_exists(ctd, chain_id.as_str()).await?;
    let layer_bytes = manifest
        .layers()
        .iter()
        .map(oci_spec::image::Descriptor::size)
        .sum();
    Ok(Some(LocalImage {
        name: name.clone(),
        target,
        config,
        chain_id,
        unpacked,
        layer_bytes,
    }))
}
