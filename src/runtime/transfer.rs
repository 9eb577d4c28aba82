//! Copying an image from one of the agent's containerd namespaces into
//! another: BuildKit builds in a namespace of its own (so no build reads
//! what another tenant pulled), and a build loaded on the node is copied
//! into the agent's. The blobs go through the content API (under
//! containerd's default shared content policy, a blob already on disk is
//! only recorded in the new namespace), the layers are unpacked there, and
//! the image record is made last, pointing at this platform's manifest.

use std::collections::HashMap;
use std::io::Cursor;
use std::time::Duration;

use oci_spec::image::ImageConfiguration;

use super::connection::Containerd;
use super::content;
use super::descriptor::Descriptor;
use super::error::RuntimeError;
use super::images::{ImportedImage, get_target, platform_manifest, put_image_record};
use super::lease::Lease;
use super::reference::ImageRef;
use super::unpack::{self, LABEL_GC_SNAPSHOT};

/// Outlives any sane copy; it only matters if the agent dies mid-copy.
const COPY_LEASE_TTL: Duration = Duration::from_secs(3600);

/// Copies image `name` of `from` into `to` under the same name, unpacked;
/// an error when `from` has no such image.
pub async fn copy_image(
    from: &Containerd,
    to: &Containerd,
    name: &ImageRef,
) -> Result<ImportedImage, RuntimeError> {
    let bad = |what: String| RuntimeError::Invalid(format!("copy image {name}: {what}"));
    let target = get_target(from, name)
        .await?
        .ok_or_else(|| bad(format!("no such image in namespace {}", from.namespace())))?;
    let (manifest_desc, manifest_bytes, manifest) = platform_manifest(from, &target, &bad).await?;
    let (config_desc, layers) = Descriptor::parts_of(&manifest)?;
    let config_bytes = content::read_blob(from, &config_desc.digest).await?;
    let config = ImageConfiguration::from_reader(&config_bytes[..])
        .map_err(|e| bad(format!("config {}: {e}", config_desc.digest)))?;
    let diff_ids = unpack::diff_ids(&config).map_err(|e| bad(e.to_string()))?;

    let lease = Lease::create(to, "copy", COPY_LEASE_TTL).await?;
    let result = async {
        let mut blobs_written = 0;
        for layer in &layers {
            if content::ensure_blob(
                to,
                &lease,
                layer,
                content::open_blob(from, &layer.digest).await?,
            )
            .await?
            {
                blobs_written += 1;
            }
        }
        if content::ensure_blob(to, &lease, &config_desc, Cursor::new(config_bytes)).await? {
            blobs_written += 1;
        }
        let chain_id = unpack::unpack(to, &lease, &layers, &diff_ids).await?;
        content::add_labels(
            to,
            &config_desc.digest,
            HashMap::from([(LABEL_GC_SNAPSHOT.to_owned(), chain_id.to_string())]),
        )
        .await?;
        if content::ensure_blob(to, &lease, &manifest_desc, Cursor::new(manifest_bytes)).await? {
            blobs_written += 1;
        }
        content::add_labels(
            to,
            &manifest_desc.digest,
            content::manifest_gc_labels(&config_desc, &layers),
        )
        .await?;
        put_image_record(to, name, &manifest_desc).await?;
        Ok(ImportedImage {
            names: vec![name.clone()],
            target: manifest_desc.clone(),
            chain_id,
            blobs_written,
        })
    }
    .await;
    if let Err(e) = lease.release(to).await {
        tracing::warn!(error = %e, "could not release the copy lease; it expires by itself");
    }
    result
}
