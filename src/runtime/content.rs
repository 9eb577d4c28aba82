//! Blobs in containerd's content store: existence checks, streamed writes
//! verified by digest, and GC labels.

use std::collections::HashMap;

use containerd_client::services::v1::{
    AbortRequest, Info, InfoRequest, ReadContentRequest, UpdateRequest, WriteAction,
    WriteContentRequest,
};
use futures::StreamExt;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

use super::connection::Containerd;
use super::descriptor::Descriptor;
use super::digest::Digest;
use super::error::RuntimeError;
use super::lease::Lease;

const CHUNK: usize = 1 << 20;
/// Manifests and configs are read whole; anything larger is not one.
pub const MAX_METADATA_BLOB: u64 = 16 << 20;

/// Whether the store has this blob (committed, in this namespace).
pub async fn exists(ctd: &Containerd, digest: &Digest) -> Result<bool, RuntimeError> {
    match ctd
        .content()
        .info(ctd.request(InfoRequest {
            digest: digest.to_string(),
        }))
        .await
    {
        Ok(_) => Ok(true),
        Err(s) if s.code() == Code::NotFound => Ok(false),
        Err(s) => Err(RuntimeError::grpc(format!("content info {digest}"))(s)),
    }
}

/// Makes sure the blob is in the store and held by `lease`: skipped when
/// present, otherwise streamed from `source` and committed, which containerd
/// refuses unless size and digest match `desc`. Returns whether it was
/// written. A second caller for the same digest waits for the first and
/// then finds the blob there.
pub async fn ensure_blob<R>(
    ctd: &Containerd,
    lease: &Lease,
    desc: &Descriptor,
    source: R,
) -> Result<bool, RuntimeError>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    let lock = ctd.ingests().of(&desc.digest);
    let _writing = lock.lock().await;
    if exists(ctd, &desc.digest).await? {
        lease.hold(ctd, "content", desc.digest.as_str()).await?;
        return Ok(false);
    }
    match write_blob(ctd, lease, desc, source).await {
        Err(e) if e.is_already_exists() => {
            lease.hold(ctd, "content", desc.digest.as_str()).await?;
            Ok(false)
        }
        other => other.map(|()| true),
    }
}

async fn write_blob<R>(
    ctd: &Containerd,
    lease: &Lease,
    desc: &Descriptor,
    mut source: R,
) -> Result<(), RuntimeError>
where
    R: AsyncRead + Unpin + Send + 'static,
{
    let reference = format!("zattera-ingest-{}", desc.digest.hex());
    // A crashed earlier write may have left a partial ingest under this ref.
    abort_ingest(ctd, &reference)
        .await
        .map_err(RuntimeError::grpc(format!(
            "abort stale ingest {reference}"
        )))?;

    let total = i64::try_from(desc.size)
        .map_err(|_| RuntimeError::Invalid(format!("blob {} is too large", desc.digest)))?;
    let expected = desc.digest.to_string();
    let (tx, rx) = mpsc::channel::<WriteContentRequest>(4);
    let feeder_ref = reference.clone();
    let feeder = tokio::spawn(async move {
        let mut offset: i64 = 0;
        let mut buf = vec![0u8; CHUNK];
        loop {
            // A network source yields a few KiB a read; containerd answers
            // every message, so each one carries a full chunk.
            let mut n = 0;
            while n < buf.len() {
                let got = source.read(&mut buf[n..]).await?;
                if got == 0 {
                    break;
                }
                n += got;
            }
            if n == 0 {
                break;
            }
            let request = WriteContentRequest {
                action: WriteAction::Write as i32,
                r#ref: feeder_ref.clone(),
                total,
                expected: expected.clone(),
                offset,
                data: buf[..n].to_vec(),
                labels: HashMap::new(),
            };
            offset += i64::try_from(n).unwrap_or(i64::MAX);
            if tx.send(request).await.is_err() {
                return Ok(offset); // the call failed; its error is reported below
            }
        }
        let commit = WriteContentRequest {
            action: WriteAction::Commit as i32,
            r#ref: feeder_ref,
            total,
            expected,
            offset,
            data: Vec::new(),
            labels: HashMap::new(),
        };
        let _ = tx.send(commit).await;
        Ok::<i64, std::io::Error>(offset)
    });

    let context = format!("write blob {}", desc.digest);
    let result = async {
        let mut responses = ctd
            .content()
            .write(ctd.leased_request(ReceiverStream::new(rx), lease.id()))
            .await
            .map_err(RuntimeError::grpc(context.clone()))?
            .into_inner();
        let mut committed = false;
        while let Some(response) = responses.next().await {
            let response = response.map_err(RuntimeError::grpc(context.clone()))?;
            if response.action == WriteAction::Commit as i32 {
                committed = true;
            }
        }
        Ok::<bool, RuntimeError>(committed)
    }
    .await;

    let outcome = match (feeder.await, result) {
        (Ok(Err(io)), _) => Err(RuntimeError::Invalid(format!(
            "{context}: reading source: {io}"
        ))),
        (Err(join), _) => Err(RuntimeError::Invalid(format!("{context}: {join}"))),
        (_, Err(e)) => Err(e),
        (Ok(Ok(_)), Ok(true)) => Ok(()),
        (Ok(Ok(written)), Ok(false)) => Err(RuntimeError::Invalid(format!(
            "{context}: containerd did not commit it ({written} of {total} bytes sent)"
        ))),
    };
    if outcome.is_err() {
        // A partial ingest holds its bytes until written again: on a full
        // disk that space is what everything else needs.
        let _ = abort_ingest(ctd, &reference).await;
    }
    outcome
}

/// Drops the ingest `reference` and its bytes; an absent one is fine.
async fn abort_ingest(ctd: &Containerd, reference: &str) -> Result<(), tonic::Status> {
    match ctd
        .content()
        .abort(ctd.request(AbortRequest {
            r#ref: reference.to_owned(),
        }))
        .await
    {
        Err(s) if s.code() != Code::NotFound => Err(s),
        _ => Ok(()),
    }
}

/// The labels on a manifest blob that keep its config and layers alive
/// through containerd's garbage collection.
pub fn manifest_gc_labels(config: &Descriptor, layers: &[Descriptor]) -> HashMap<String, String> {
    std::iter::once((
        "containerd.io/gc.ref.content.config".to_owned(),
        config.digest.to_string(),
    ))
    .chain(layers.iter().enumerate().map(|(i, l)| {
        (
            format!("containerd.io/gc.ref.content.l.{i}"),
            l.digest.to_string(),
        )
    }))
    .collect()
}

/// Merges `labels` into a blob's labels (GC references, uncompressed digests).
pub async fn add_labels(
    ctd: &Containerd,
    digest: &Digest,
    labels: HashMap<String, String>,
) -> Result<(), RuntimeError> {
    if labels.is_empty() {
        return Ok(());
    }
    let paths = labels.keys().map(|k| format!("labels.{k}")).collect();
    ctd.content()
        .update(ctd.request(UpdateRequest {
            info: Some(Info {
                digest: digest.to_string(),
                labels,
                ..Info::default()
            }),
            update_mask: Some(prost_types::FieldMask { paths }),
        }))
        .await
        .map_err(RuntimeError::grpc(format!("label blob {digest}")))?;
    Ok(())
}

/// A blob of the store as a byte stream.
pub async fn open_blob(
    ctd: &Containerd,
    digest: &Digest,
) -> Result<impl AsyncRead + Unpin + Send + 'static + use<>, RuntimeError> {
    let stream = ctd
        .content()
        .read(ctd.request(ReadContentRequest {
            digest: digest.to_string(),
            offset: 0,
            size: 0,
        }))
        .await
        .map_err(RuntimeError::grpc(format!("read blob {digest}")))?
        .into_inner()
        .map(|chunk| {
            chunk
                .map(|c| bytes::Bytes::from(c.data))
                .map_err(|s| std::io::Error::other(s.message().to_owned()))
        });
    Ok(tokio_util::io::StreamReader::new(stream))
}

/// Reads a small blob (manifest, index, config) whole.
pub async fn read_blob(ctd: &Containerd, digest: &Digest) -> Result<Vec<u8>, RuntimeError> {
    use tokio::io::AsyncReadExt as _;
    let context = format!("read blob {digest}");
    let mut data = Vec::new();
    open_blob(ctd, digest)
        .await?
        .take(MAX_METADATA_BLOB + 1)
        .read_to_end(&mut data)
        .await
        .map_err(|e| RuntimeError::Invalid(format!("{context}: {e}")))?;
    if data.len() as u64 > MAX_METADATA_BLOB {
        return Err(RuntimeError::Invalid(format!(
            "{context}: larger than {MAX_METADATA_BLOB} bytes"
        )));
    }
    if Digest::of(&data) != *digest {
        return Err(RuntimeError::Invalid(format!(
            "{context}: content does not match its digest"
        )));
    }
    Ok(data)
}
