//! `ListVolumeFiles`, `ReadVolumeFile` and `RemoveVolume`: the volume
//! browser of the dashboard, on the node-local volume directories
//! ([`crate::volumes`]). Paths follow the volume path rules; no error text
//! carries a host path.

use std::io::Read;
use std::path::Path;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::proto::cluster::{
    AgentFileInfo, AgentListFilesRequest, AgentListFilesResponse, AgentReadFileRequest, TcpChunk,
};
use crate::volumes::{self, VolumeError};

use super::Out;

/// Entries per listing (the reference's cap).
pub const LIST_CAP: usize = 5000;
/// Bytes per `ReadVolumeFile` frame.
pub const READ_CHUNK: usize = 64 * 1024;

fn status(e: &VolumeError) -> Status {
    let text = e.to_string();
    match e {
        VolumeError::BadName(_) | VolumeError::Escapes(_) => Status::invalid_argument(text),
        VolumeError::NoVolume(_) | VolumeError::NotFound(_) => Status::not_found(text),
        VolumeError::PermissionDenied(_) => Status::permission_denied(text),
        VolumeError::Io { .. } => Status::internal(text),
    }
}

/// The existing root of a volume, or NOT_FOUND naming it.
fn root_of(
    data_dir: &Path,
    environment_id: &str,
    name: &str,
) -> Result<std::path::PathBuf, Status> {
    let local = volumes::local_name(environment_id, name).map_err(|e| status(&e))?;
    let root = volumes::volume_root(data_dir, &local);
    if root.is_dir() {
        Ok(root)
    } else {
        Err(status(&VolumeError::NoVolume(name.to_owned())))
    }
}

pub async fn list(
    data_dir: &Path,
    req: AgentListFilesRequest,
) -> Result<AgentListFilesResponse, Status> {
    let data_dir = data_dir.to_owned();
    tokio::task::spawn_blocking(move || list_blocking(&data_dir, &req))
        .await
        .map_err(|e| Status::internal(format!("ListVolumeFiles: {e}")))?
}

fn list_blocking(
    data_dir: &Path,
    req: &AgentListFilesRequest,
) -> Result<AgentListFilesResponse, Status> {
    let root = root_of(data_dir, &req.environment_id, &req.volume_name)?;
    let dir = volumes::resolve(&root, &req.path).map_err(|e| status(&e))?;
    if !dir.is_dir() {
        return Err(Status::invalid_argument(format!(
            "{:?} is not a directory",
            req.path
        )));
    }
    let entries = std::fs::read_dir(&dir).map_err(|e| status(&volumes::io_error(&req.path, &e)))?;
    let mut files: Vec<AgentFileInfo> = entries
        .flatten()
        .filter_map(|entry| {
            // Listing shows links as links: nothing is followed.
            let meta = entry.metadata().ok()?;
            let mod_time_unix_ms = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
            Some(AgentFileInfo {
                name: entry.file_name().to_string_lossy().into_owned(),
                dir: meta.is_dir(),
                size_bytes: meta.len(),
                mod_time_unix_ms,
                mode: volumes::go_mode_string(&meta),
            })
        })
        .collect();
    files.sort_by(|a, b| b.dir.cmp(&a.dir).then_with(|| a.name.cmp(&b.name)));
    let truncated = files.len() > LIST_CAP;
    files.truncate(LIST_CAP);
    Ok(AgentListFilesResponse { files, truncated })
}

pub async fn read(data_dir: &Path, req: AgentReadFileRequest) -> Result<Out<TcpChunk>, Status> {
    let data_dir = data_dir.to_owned();
    let shown = req.path.clone();
    let mut file = tokio::task::spawn_blocking(move || open_regular(&data_dir, &req))
        .await
        .map_err(|e| Status::internal(format!("ReadVolumeFile: {e}")))??;
    let (tx, rx) = mpsc::channel::<Result<TcpChunk, Status>>(4);
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            let frame = match file.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => Ok(TcpChunk {
                    data: buf[..n].to_vec(),
                    dial_addr: String::new(),
                }),
                Err(e) => Err(status(&volumes::io_error(&shown, &e))),
            };
            let failed = frame.is_err();
            if tx.blocking_send(frame).is_err() || failed {
                return;
            }
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// The regular file `req` names, opened.
fn open_regular(data_dir: &Path, req: &AgentReadFileRequest) -> Result<std::fs::File, Status> {
    let root = root_of(data_dir, &req.environment_id, &req.volume_name)?;
    let path = volumes::resolve(&root, &req.path).map_err(|e| status(&e))?;
    let meta = std::fs::metadata(&path).map_err(|e| status(&volumes::io_error(&req.path, &e)))?;
    if !meta.is_file() {
        return Err(Status::invalid_argument(format!(
            "{:?} is not a regular file",
            req.path
        )));
    }
    std::fs::File::open(&path).map_err(|e| status(&volumes::io_error(&req.path, &e)))
}

/// Deletes the volume's directory; an absent volume is already removed.
pub async fn remove(data_dir: &Path, environment_id: &str, name: &str) -> Result<(), Status> {
    let local = volumes::local_name(environment_id, name).map_err(|e| status(&e))?;
    let dir = volumes::volume_dir(data_dir, &local);
    match tokio::fs::remove_dir_all(&dir).await {
        Ok(()) => {
            tracing::info!(volume = %local, "volume removed");
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(status(&volumes::io_error(name, &e))),
    }
}
