//! Image records: importing archives into containerd and checking what is
//! already there. Pull (issue: containerd runtime) shares `store_and_unpack`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use containerd_client::services::v1::{CreateImageRequest, Image, UpdateImageRequest};
use tonic::Code;

use super::archive::{ImageArchive, PlannedImage};
use super::connection::Containerd;
use super::content;
use super::descriptor::Descriptor;
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

/// Creates the image record, or points an existing one at the new target.
pub async fn put_image_record(
    ctd: &Containerd,
    name: &ImageRef,
    target: &Descriptor,
) -> Result<(), RuntimeError> {
    let image = Image {
        name: name.to_string(),
        labels: HashMap::new(),
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
                        paths: vec!["target".into()],
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
