//! `SnapshotVolume` and `RestoreVolume` (dataplane.md SNAP-1, SNAP-9) on
//! the engine of [`crate::snapshot`], with the Rewrite's additions: the
//! pre-hook runs in the running managed container that mounts the volume
//! when control names none (SNAP-2); a per-volume lock; a restore under a
//! running container is refused; the final snapshot frame's `bytes_done`
//! is what this snapshot uploaded, `bytes_total` the tar size (SNAP-1).
//!
//! Every failure is one `phase: "error"` frame, then the stream ends with
//! the status `codes::snapshot` picks (SNAP-12). Credentials are never logged.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::proto::cluster::{
    AgentRestoreVolumeRequest, AgentSnapshotVolumeRequest, S3Target, VolumeOpProgress,
};
use crate::snapshot::{self, Engine, Event, S3Config, SnapshotError, VolumeLock, hooks};
use crate::volumes;

use super::{NodeContext, Out, codes};

fn frame(phase: &str) -> VolumeOpProgress {
    VolumeOpProgress {
        phase: phase.to_owned(),
        ..VolumeOpProgress::default()
    }
}

type Tx = mpsc::Sender<Result<VolumeOpProgress, Status>>;

/// Runs `op` on a task feeding the stream; an error becomes the error
/// frame and the status. A caller that goes away cancels the operation.
fn streamed<F, Fut>(method: &'static str, op: F) -> Out<VolumeOpProgress>
where
    F: FnOnce(Tx) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<VolumeOpProgress, SnapshotError>> + Send,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let result = tokio::select! {
            r = op(tx.clone()) => r,
            () = tx.closed() => {
                tracing::info!(method, "the caller went away; operation cancelled");
                return;
            }
        };
        match result {
            Ok(done) => {
                let _ = tx.send(Ok(done)).await;
            }
            Err(e) => {
                tracing::warn!(method, error = %e, "volume operation failed");
                let mut f = frame("error");
                f.error = e.to_string();
                let _ = tx.send(Ok(f)).await;
                let _ = tx
                    .send(Err(Status::new(
                        codes::snapshot(&e),
                        format!("{method}: {e}"),
                    )))
                    .await;
            }
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

/// Progress frames are best effort (SNAP-8): a full channel drops one,
/// the next carries the cumulative count anyway.
fn send(tx: &Tx, f: VolumeOpProgress) {
    let _ = tx.try_send(Ok(f));
}

fn engine(target: Option<S3Target>) -> Result<Engine, SnapshotError> {
    let t = target.ok_or(SnapshotError::NoTarget)?;
    Engine::new(
        &S3Config {
            endpoint: t.endpoint,
            bucket: t.bucket,
            prefix: t.prefix,
            region: t.region,
            access_key: t.access_key,
            secret_key: t.secret_key,
        },
        &t.data_key,
    )
}

/// The volume's logical name, node-local name and root; a volume kept
/// under its legacy name is moved first ([`volumes::ensure`]).
fn located(
    data_dir: &std::path::Path,
    v: Option<&crate::proto::v1::Volume>,
) -> Result<(String, String, std::path::PathBuf), SnapshotError> {
    let v = v.ok_or_else(|| SnapshotError::BadRequest("no volume given".into()))?;
    let local = volumes::ensure(data_dir, &v.environment_id, &v.name)
        .map_err(|e| SnapshotError::BadRequest(e.to_string()))?;
    let root = volumes::volume_root(data_dir, &local);
    Ok((v.name.clone(), local, root))
}

pub fn snapshot(node: &NodeContext, req: AgentSnapshotVolumeRequest) -> Out<VolumeOpProgress> {
    let node = node.clone();
    streamed("SnapshotVolume", move |tx| async move {
        let (name, local, root) = located(&node.data_dir, req.volume.as_ref())?;
        if !root.is_dir() {
            return Err(SnapshotError::NoVolume(name));
        }
        let _lock = VolumeLock::acquire(&root, &name)?;
        let command = req.pre_hook_command.trim();
        if !command.is_empty() {
            let container = if req.pre_hook_container_id.is_empty() {
                hooks::running_users_of(&node.ctd, &node.data_dir, &local)
                    .await?
                    .into_iter()
                    .next()
            } else {
                Some(req.pre_hook_container_id.clone())
            };
            match container {
                Some(id) => {
                    send(&tx, frame("hooks"));
                    tracing::info!(volume = %name, container = %id, "running the snapshot pre-hook");
                    hooks::run_pre_hook(&node.ctd, &node.run_dir.join("exec"), &id, command)
                        .await?;
                }
                None => {
                    tracing::warn!(volume = %name, "pre-hook set but no running container mounts the volume; snapshot without it");
                }
            }
        }
        let engine = engine(req.s3)?.with_cache(node.data_dir.join("snapshot-cache"));
        let meta = req.snapshot.and_then(|s| s.meta).unwrap_or_default();
        let created = meta.created_at.map_or_else(
            || {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0))
            },
            |t| t.seconds,
        );
        send(&tx, frame("upload"));
        let progress_tx = tx.clone();
        let progress: snapshot::ProgressFn = Arc::new(move |e| {
            if let Event::Chunk {
                new: true,
                stored_bytes,
                ..
            } = e
            {
                let mut f = frame("upload");
                f.bytes_done = stored_bytes;
                send(&progress_tx, f);
            }
        });
        let out = engine.snapshot(&root, &meta.id, created, progress).await?;
        tracing::info!(
            volume = %name, snapshot = %out.manifest_key, tar_bytes = out.tar_bytes,
            new_bytes = out.new_bytes, chunks = out.chunks, new_chunks = out.new_chunks,
            warnings = out.warnings, reused = out.reused, "volume snapshot done"
        );
        Ok(VolumeOpProgress {
            phase: "done".into(),
            manifest_key: out.manifest_key,
            bytes_done: out.new_bytes,
            bytes_total: out.tar_bytes,
            error: String::new(),
        })
    })
}

pub fn restore(node: &NodeContext, req: AgentRestoreVolumeRequest) -> Out<VolumeOpProgress> {
    let node = node.clone();
    streamed("RestoreVolume", move |tx| async move {
        let (name, local, root) = located(&node.data_dir, req.volume.as_ref())?;
        if req.manifest_key.is_empty() {
            return Err(SnapshotError::BadRequest("no manifest_key given".into()));
        }
        let _lock = VolumeLock::acquire(&root, &name)?;
        if let Some(container) = hooks::running_users_of(&node.ctd, &node.data_dir, &local)
            .await?
            .into_iter()
            .next()
        {
            return Err(SnapshotError::InUse {
                volume: name,
                container,
            });
        }
        std::fs::create_dir_all(&root).map_err(|e| SnapshotError::RestoreIo {
            path: name.clone(),
            source: e,
        })?;
        let engine = engine(req.s3)?;
        send(&tx, frame("download"));
        let out = engine
            .restore(&req.manifest_key, &root, Arc::new(|_| {}))
            .await?;
        tracing::info!(volume = %name, snapshot = %req.manifest_key, tar_bytes = out.tar_bytes, entries = out.entries, "volume restored");
        Ok(VolumeOpProgress {
            phase: "done".into(),
            manifest_key: req.manifest_key,
            bytes_done: out.tar_bytes,
            bytes_total: out.tar_bytes,
            error: String::new(),
        })
    })
}
