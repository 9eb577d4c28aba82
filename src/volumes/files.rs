//! `ListVolumeFiles`, `ReadVolumeFile` and `RemoveVolume`: the volume
//! browser of the dashboard, on the node-local volume directories
//! ([`crate::volumes`]). Paths follow the volume path rules (VF-1) with
//! kernel-enforced containment: everything is opened beneath a handle on the
//! volume root ([`crate::beneath`]), never checked and then reopened by
//! path, so a workload swapping a path component for a symlink or a FIFO
//! gets nothing outside the volume and cannot hang a thread. No error text
//! carries a host path.

use std::collections::BinaryHeap;
use std::ffi::OsString;
use std::io::Read;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;

use nix::fcntl::OFlag;
use nix::sys::stat::SFlag;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::beneath;
use crate::proto::cluster::{
    AgentFileInfo, AgentListFilesRequest, AgentListFilesResponse, AgentReadFileRequest,
};
use crate::runtime::Containerd;
use crate::volumes::{self, VolumeError};

/// A file's bytes, in frames of at most [`READ_CHUNK`]; an error ends it.
pub type Chunks =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<Vec<u8>, VolumeError>> + Send>>;

/// Entries per listing (the reference's cap).
pub const LIST_CAP: usize = 5000;
/// Entries read from one directory at most: a directory of millions is
/// reported truncated instead of taking the node's time.
pub const SCAN_CAP: usize = 200_000;
/// Bytes per `ReadVolumeFile` frame.
pub const READ_CHUNK: usize = 64 * 1024;

/// A handle on the existing root of a volume, or NOT_FOUND naming it.
fn root_of(data_dir: &Path, environment_id: &str, name: &str) -> Result<OwnedFd, VolumeError> {
    if name.is_empty() {
        return Err(VolumeError::NameRequired);
    }
    let local = volumes::ensure(data_dir, environment_id, name)?;
    let root = volumes::volume_root(data_dir, &local);
    match beneath::open_dir(&root) {
        Ok(fd) => Ok(fd),
        Err(_) => Err(VolumeError::NoVolume(name.to_owned())),
    }
}

/// Opens the caller's `request` beneath the volume root (VF-1): `..` is
/// clamped at the root, links inside are followed, anything leading out is
/// refused by the kernel.
fn open_in(root_fd: &OwnedFd, request: &str, flags: OFlag) -> Result<OwnedFd, VolumeError> {
    let rel = beneath::clean(request);
    match beneath::open_beneath(root_fd.as_fd(), &rel, flags) {
        Ok(fd) => Ok(fd),
        // Leaving the root is an escape whether or not the target exists:
        // the reference answers NOT_FOUND for a missing one, which tells a
        // tenant (a link in its volume) whether any host path exists
        // (56.10). Nothing outside is looked at.
        Err(e) if e.raw_os_error() == Some(nix::libc::EXDEV) => {
            Err(VolumeError::Escapes(request.to_owned()))
        }
        // Asked for a directory (O_DIRECTORY), and not one.
        Err(e) if e.raw_os_error() == Some(nix::libc::ENOTDIR) => {
            Err(VolumeError::NotADirectory(request.to_owned()))
        }
        Err(e) => Err(volumes::io_error(request, &e)),
    }
}

pub async fn list(
    data_dir: &Path,
    req: AgentListFilesRequest,
) -> Result<AgentListFilesResponse, VolumeError> {
    let data_dir = data_dir.to_owned();
    tokio::task::spawn_blocking(move || list_blocking(&data_dir, &req))
        .await
        .map_err(|e| VolumeError::Interrupted(e.to_string()))?
}

fn list_blocking(
    data_dir: &Path,
    req: &AgentListFilesRequest,
) -> Result<AgentListFilesResponse, VolumeError> {
    let root_fd = root_of(data_dir, &req.environment_id, &req.volume_name)?;
    // O_DIRECTORY: anything else is refused before it is opened (a
    // device node would be, as host root).
    let dir = open_in(
        &root_fd,
        &req.path,
        OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_DIRECTORY,
    )?;
    let st =
        nix::sys::stat::fstat(dir.as_fd()).map_err(|e| volumes::io_error(&req.path, &e.into()))?;
    if beneath::kind(&st) != SFlag::S_IFDIR {
        return Err(VolumeError::NotADirectory(req.path.clone()));
    }
    // The first LIST_CAP names by byte order, kept while reading: memory
    // stays bounded by the cap, not by the directory.
    let mut kept: BinaryHeap<OsString> = BinaryHeap::new();
    let (mut seen, mut scan_truncated) = (0usize, false);
    beneath::each_name(dir.as_fd(), |name| {
        seen += 1;
        if seen > SCAN_CAP {
            scan_truncated = true;
            return false;
        }
        if kept.len() < LIST_CAP {
            kept.push(name.to_owned());
        } else if kept
            .peek()
            .is_some_and(|largest| name < largest.as_os_str())
        {
            kept.pop();
            kept.push(name.to_owned());
        }
        true
    })
    .map_err(|e| volumes::io_error(&req.path, &e))?;
    let truncated = scan_truncated || seen > LIST_CAP;
    let mut files: Vec<AgentFileInfo> = kept
        .into_vec()
        .into_iter()
        .filter_map(|name| {
            // Listing shows links as links: nothing is followed.
            let st = beneath::stat_entry(dir.as_fd(), &name).ok()?;
            let mod_time_unix_ms = st
                .st_mtime
                .saturating_mul(1000)
                .saturating_add(st.st_mtime_nsec / 1_000_000);
            Some(AgentFileInfo {
                name: name.to_string_lossy().into_owned(),
                dir: beneath::kind(&st) == SFlag::S_IFDIR,
                size_bytes: u64::try_from(st.st_size).unwrap_or(0),
                mod_time_unix_ms,
                mode: volumes::go_mode_string_of(st.st_mode),
            })
        })
        .collect();
    files.sort_by(|a, b| b.dir.cmp(&a.dir).then_with(|| a.name.cmp(&b.name)));
    Ok(AgentListFilesResponse { files, truncated })
}

pub async fn read(data_dir: &Path, req: AgentReadFileRequest) -> Result<Chunks, VolumeError> {
    let data_dir = data_dir.to_owned();
    let shown = req.path.clone();
    let mut file = tokio::task::spawn_blocking(move || open_regular(&data_dir, &req))
        .await
        .map_err(|e| VolumeError::Interrupted(e.to_string()))??;
    let (tx, rx) = mpsc::channel::<Result<Vec<u8>, VolumeError>>(4);
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; READ_CHUNK];
        loop {
            let frame = match file.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => Ok(buf[..n].to_vec()),
                Err(e) => Err(volumes::io_error(&shown, &e)),
            };
            let failed = frame.is_err();
            if tx.blocking_send(frame).is_err() || failed {
                return;
            }
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// The regular file `req` names. Found with an `O_PATH` handle, which opens
/// nothing: a device node a container planted (it has CAP_MKNOD, and the
/// agent is outside its device cgroup) is never opened as host root, where
/// opening alone can arm a watchdog or take a terminal. Only a regular file
/// is then opened for reading, through that same handle.
fn open_regular(data_dir: &Path, req: &AgentReadFileRequest) -> Result<std::fs::File, VolumeError> {
    let root_fd = root_of(data_dir, &req.environment_id, &req.volume_name)?;
    let handle = open_in(&root_fd, &req.path, OFlag::O_PATH)?;
    let st = nix::sys::stat::fstat(handle.as_fd())
        .map_err(|e| volumes::io_error(&req.path, &e.into()))?;
    match beneath::kind(&st) {
        SFlag::S_IFREG => beneath::reopen_for_reading(handle.as_fd())
            .map(std::fs::File::from)
            .map_err(|e| volumes::io_error(&req.path, &e)),
        SFlag::S_IFDIR => Err(VolumeError::IsADirectory(req.path.clone())),
        _ => Err(VolumeError::NotARegularFile(req.path.clone())),
    }
}

/// Deletes the volume's directory; an absent volume is already removed.
/// Refused while any managed container, running or stopped, mounts it
/// (VOL-5): its data would go from under it.
pub async fn remove(
    ctd: &Containerd,
    data_dir: &Path,
    environment_id: &str,
    name: &str,
) -> Result<(), VolumeError> {
    let local = volumes::ensure(data_dir, environment_id, name)?;
    let users = volumes::users(ctd, data_dir, &local)
        .await
        .map_err(|e| VolumeError::UsersUnknown(e.to_string()))?;
    if !users.is_empty() {
        return Err(VolumeError::InUse {
            volume: name.to_owned(),
            containers: users,
        });
    }
    let dir = volumes::volume_dir(data_dir, &local);
    match tokio::fs::remove_dir_all(&dir).await {
        Ok(()) => {
            volumes::remove_aliases(data_dir, &local);
            tracing::info!(volume = %local, "volume removed");
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(volumes::io_error(name, &e)),
    }
}
