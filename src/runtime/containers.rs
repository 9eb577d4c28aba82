//! Containers and their tasks: create from an unpacked image,
//! start with output handed to the log shim, stop with grace, delete, list.
//!
//! A container record owns its rootfs snapshot (key = container id). Stop and
//! delete treat NotFound as success, so every step can be retried after a
//! crash at any point.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use containerd_client::services::v1::container::Runtime;
use containerd_client::services::v1::snapshots::{
    MountsRequest, PrepareSnapshotRequest, RemoveSnapshotRequest,
};
use containerd_client::services::v1::{
    Container, CreateContainerRequest, CreateTaskRequest, DeleteContainerRequest,
    DeleteTaskRequest, GetContainerRequest, GetRequest, KillRequest, ListContainersRequest,
    StartRequest, UpdateContainerRequest, WaitRequest,
};
use containerd_client::types::v1::Status;
use tonic::Code;

use super::connection::Containerd;
use super::digest::Digest;
use super::error::{RuntimeError, ignore_not_found};
use super::lease::Lease;
use super::names::validate_identifier;
use super::spec::SPEC_TYPE_URL;
use super::unpack::SNAPSHOTTER;

pub const RUNC_RUNTIME: &str = "io.containerd.runc.v2";
const SIGKILL: u32 = 9;
/// After SIGKILL a process is gone as soon as the kernel reaps it.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// What to create.
#[derive(Debug, Clone)]
pub struct NewContainer {
    pub id: String,
    /// Normalised image name (the image record).
    pub image: String,
    /// Top chain id of the unpacked image: the rootfs parent.
    pub chain_id: Digest,
    pub labels: HashMap<String, String>,
    pub spec: oci_spec::runtime::Spec,
    /// The OCI runtime the shim runs it with.
    pub runtime: super::oci_runtime::OciRuntime,
}

/// A task's state as the supervisor sees it (L-4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskState {
    /// No task: never started, deleted, or lost in a host reboot.
    Absent,
    Created,
    Running {
        pid: u32,
    },
    Paused,
    Stopped {
        exit_code: u32,
    },
    /// containerd could not read it: its shim did not answer in time (a
    /// loaded or frozen host). Not a verdict: the task may well be running,
    /// so nobody restarts or removes on it; ask again later.
    Unknown,
}

/// Creates the container record and its rootfs snapshot. An existing
/// snapshot with the container's key (a crash between the two steps) is reused.
pub async fn create(ctd: &Containerd, c: &NewContainer) -> Result<(), RuntimeError> {
    validate_identifier(&c.id)
        .map_err(|reason| RuntimeError::Invalid(format!("container id: {reason}")))?;
    let spec_json = serde_json::to_vec(&c.spec)
        .map_err(|e| RuntimeError::Invalid(format!("container {}: encoding spec: {e}", c.id)))?;
    let lease = Lease::create(ctd, "create", Duration::from_secs(600)).await?;
    let result = async {
        let prepared = ctd
            .snapshots()
            .prepare(ctd.leased_request(
                PrepareSnapshotRequest {
                    snapshotter: SNAPSHOTTER.into(),
                    key: c.id.clone(),
                    parent: c.chain_id.to_string(),
                    labels: HashMap::new(),
                },
                lease.id(),
            ))
            .await;
        match prepared {
            Ok(_) => {}
            Err(s) if s.code() == Code::AlreadyExists => {}
            Err(s) => return Err(RuntimeError::grpc(format!("prepare rootfs of {}", c.id))(s)),
        }
        let container = Container {
            id: c.id.clone(),
            labels: c.labels.clone(),
            image: c.image.clone(),
            runtime: Some(Runtime {
                name: RUNC_RUNTIME.into(),
                options: c.runtime.shim_options(),
            }),
            spec: Some(prost_types::Any {
                type_url: SPEC_TYPE_URL.into(),
                value: spec_json,
            }),
            snapshotter: SNAPSHOTTER.into(),
            snapshot_key: c.id.clone(),
            created_at: None,
            updated_at: None,
            extensions: HashMap::new(),
            sandbox: String::new(),
        };
        ctd.containers()
            .create(ctd.leased_request(
                CreateContainerRequest {
                    container: Some(container),
                },
                lease.id(),
            ))
            .await
            .map_err(RuntimeError::grpc(format!("create container {}", c.id)))?;
        Ok(())
    }
    .await;
    if result.is_err() {
        remove_snapshot(ctd, &c.id).await;
    }
    if let Err(e) = lease.release(ctd).await {
        tracing::warn!(error = %e, "could not release the create lease; it expires by itself");
    }
    result
}

/// Creates and starts the task, stdout and stderr going to `log_uri`.
/// The network namespace and bind-mount sources must exist already.
/// Longest a task may take to be created and started: past it the caller
/// gets an error it can clean up after, instead of waiting for ever on a
/// shim or logger that never answers.
pub const TASK_START_TIMEOUT: Duration = Duration::from_secs(60);

/// Creates and starts the task of `id`, its output to `log_uri`; the pid.
pub async fn start(ctd: &Containerd, id: &str, log_uri: &str) -> Result<u32, RuntimeError> {
    tokio::time::timeout(TASK_START_TIMEOUT, start_task(ctd, id, log_uri))
        .await
        .map_err(|_| {
            RuntimeError::Invalid(format!(
                "the task of {id} was not started within {} s",
                TASK_START_TIMEOUT.as_secs()
            ))
        })?
}

async fn start_task(ctd: &Containerd, id: &str, log_uri: &str) -> Result<u32, RuntimeError> {
    let began = Instant::now();
    let rootfs = ctd
        .snapshots()
        .mounts(ctd.request(MountsRequest {
            snapshotter: SNAPSHOTTER.into(),
            key: id.into(),
        }))
        .await
        .map_err(RuntimeError::grpc(format!("rootfs mounts of {id}")))?
        .into_inner()
        .mounts;
    let created = ctd
        .tasks()
        .create(ctd.request(CreateTaskRequest {
            container_id: id.into(),
            rootfs,
            stdin: String::new(),
            stdout: log_uri.into(),
            stderr: log_uri.into(),
            terminal: false,
            checkpoint: None,
            options: None,
            runtime_path: String::new(),
        }))
        .await
        .map_err(RuntimeError::grpc(format!("create task {id}")))?
        .into_inner();
    let created_at = Instant::now();
    if let Err(status) = ctd
        .tasks()
        .start(ctd.request(StartRequest {
            container_id: id.into(),
            exec_id: String::new(),
        }))
        .await
    {
        // Do not leave a CREATED task behind: the next start would fail on it.
        let _ = delete_task(ctd, id).await;
        return Err(RuntimeError::grpc(format!("start task {id}"))(status));
    }
    // Mounts and task create (the shim, `runc create`, the log shim), then
    // `runc start`: where a container's start time goes.
    let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    tracing::debug!(
        target: "zattera::bringup",
        container = id,
        task_create_us = us(created_at - began),
        task_start_us = us(created_at.elapsed()),
        "task started"
    );
    Ok(created.pid)
}

/// The state of a container's task.
pub async fn task_state(ctd: &Containerd, id: &str) -> Result<TaskState, RuntimeError> {
    let got = ctd
        .tasks()
        .get(ctd.request(GetRequest {
            container_id: id.into(),
            exec_id: String::new(),
        }))
        .await;
    let process = match got {
        Ok(r) => r.into_inner().process,
        Err(s) if s.code() == Code::NotFound => return Ok(TaskState::Absent),
        Err(s) => return Err(RuntimeError::grpc(format!("get task {id}"))(s)),
    };
    let Some(p) = process else {
        return Ok(TaskState::Absent);
    };
    Ok(
        match Status::try_from(p.status).unwrap_or(Status::Unknown) {
            Status::Running | Status::Pausing => TaskState::Running { pid: p.pid },
            Status::Created => TaskState::Created,
            Status::Paused => TaskState::Paused,
            Status::Stopped => TaskState::Stopped {
                exit_code: p.exit_status,
            },
            // containerd answers UNKNOWN when the shim's state call timed
            // out ("get state for ...: context deadline exceeded").
            Status::Unknown => TaskState::Unknown,
        },
    )
}

/// Waits for the task's exit, at most `timeout`; `None` when it did not exit.
async fn wait_exit(
    ctd: &Containerd,
    id: &str,
    timeout: Duration,
) -> Result<Option<u32>, RuntimeError> {
    let mut tasks = ctd.tasks();
    let wait = tasks.wait(ctd.request(WaitRequest {
        container_id: id.into(),
        exec_id: String::new(),
    }));
    match tokio::time::timeout(timeout, wait).await {
        Err(_) => Ok(None),
        Ok(Ok(r)) => Ok(Some(r.into_inner().exit_status)),
        Ok(Err(s)) if s.code() == Code::NotFound => Ok(Some(0)),
        Ok(Err(s)) => Err(RuntimeError::grpc(format!("wait for task {id}"))(s)),
    }
}

/// Signals the task's init process, or with `all` every process in it.
async fn kill(ctd: &Containerd, id: &str, signal: u32, all: bool) -> Result<(), RuntimeError> {
    let killed = ctd
        .tasks()
        .kill(ctd.request(KillRequest {
            container_id: id.into(),
            exec_id: String::new(),
            signal,
            all,
        }))
        .await;
    match killed {
        Ok(_) => Ok(()),
        // Already gone, or already exited and not yet deleted.
        Err(s) if matches!(s.code(), Code::NotFound | Code::FailedPrecondition) => Ok(()),
        Err(s) => Err(RuntimeError::grpc(format!("signal {signal} to task {id}"))(
            s,
        )),
    }
}

/// Stops the task: `signal`, then SIGKILL after `grace`, then deletes it.
/// Returns the exit code, or `None` when there was no task.
pub async fn stop(
    ctd: &Containerd,
    id: &str,
    signal: u32,
    grace: Duration,
) -> Result<Option<u32>, RuntimeError> {
    let exit = match task_state(ctd, id).await? {
        TaskState::Absent => return Ok(None),
        TaskState::Stopped { exit_code } => Some(exit_code),
        TaskState::Created | TaskState::Running { .. } | TaskState::Paused | TaskState::Unknown => {
            // Like Docker: the stop signal goes to PID 1, which owns shutdown.
            kill(ctd, id, signal, false).await?;
            if let Some(code) = wait_exit(ctd, id, grace).await? {
                Some(code)
            } else {
                tracing::info!(container = id, ?grace, "grace period over, sending SIGKILL");
                kill(ctd, id, SIGKILL, true).await?;
                wait_exit(ctd, id, KILL_WAIT).await?
            }
        }
    };
    delete_task(ctd, id).await?;
    Ok(exit)
}

/// Deletes an exited (or never started) task; NotFound is success.
pub async fn delete_task(ctd: &Containerd, id: &str) -> Result<(), RuntimeError> {
    ignore_not_found(
        ctd.tasks()
            .delete(ctd.request(DeleteTaskRequest {
                container_id: id.into(),
            }))
            .await,
    )
    .map_err(RuntimeError::grpc(format!("delete task {id}")))
}

/// Stops (with `grace`) and removes the container and its rootfs.
pub async fn remove(
    ctd: &Containerd,
    id: &str,
    signal: u32,
    grace: Duration,
) -> Result<(), RuntimeError> {
    stop(ctd, id, signal, grace).await?;
    ignore_not_found(
        ctd.containers()
            .delete(ctd.request(DeleteContainerRequest { id: id.into() }))
            .await,
    )
    .map_err(RuntimeError::grpc(format!("delete container {id}")))?;
    remove_snapshot(ctd, id).await;
    Ok(())
}

async fn remove_snapshot(ctd: &Containerd, key: &str) {
    let removed = ctd
        .snapshots()
        .remove(ctd.request(RemoveSnapshotRequest {
            snapshotter: SNAPSHOTTER.into(),
            key: key.into(),
        }))
        .await;
    if let Err(e) = ignore_not_found(removed) {
        // containerd's GC takes it once the container record is gone.
        tracing::debug!(%key, error = %e.message(), "rootfs snapshot not removed directly");
    }
}

/// Containers whose labels match every `key=value` in `labels`.
pub async fn list(
    ctd: &Containerd,
    labels: &[(&str, &str)],
) -> Result<Vec<Container>, RuntimeError> {
    let filter = labels
        .iter()
        .map(|(k, v)| format!("labels.{}=={}", quote(k), quote(v)))
        .collect::<Vec<_>>()
        .join(",");
    let filters = if filter.is_empty() {
        vec![]
    } else {
        vec![filter]
    };
    // Streamed, one container a message: a unary List answers every
    // container's spec in one message, past gRPC's 4 MiB limit at about 500
    // containers.
    let mut stream = ctd
        .containers()
        .list_stream(ctd.request(ListContainersRequest { filters }))
        .await
        .map_err(RuntimeError::grpc("list containers"))?
        .into_inner();
    let mut out = Vec::new();
    while let Some(msg) = stream
        .message()
        .await
        .map_err(RuntimeError::grpc("list containers"))?
    {
        out.extend(msg.container);
    }
    Ok(out)
}

/// containerd filter syntax: quote anything that is not a plain identifier.
fn quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        s.to_owned()
    } else {
        format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
    }
}

pub async fn get(ctd: &Containerd, id: &str) -> Result<Option<Container>, RuntimeError> {
    match ctd
        .containers()
        .get(ctd.request(GetContainerRequest { id: id.into() }))
        .await
    {
        Ok(r) => Ok(r.into_inner().container),
        Err(s) if s.code() == Code::NotFound => Ok(None),
        Err(s) => Err(RuntimeError::grpc(format!("get container {id}"))(s)),
    }
}

/// Merges labels into a container record (e.g. a job's exit code, C-13).
pub async fn add_labels(
    ctd: &Containerd,
    id: &str,
    labels: HashMap<String, String>,
) -> Result<(), RuntimeError> {
    let paths = labels.keys().map(|k| format!("labels.{k}")).collect();
    ctd.containers()
        .update(ctd.request(UpdateContainerRequest {
            container: Some(Container {
                id: id.into(),
                labels,
                ..Container::default()
            }),
            update_mask: Some(prost_types::FieldMask { paths }),
        }))
        .await
        .map_err(RuntimeError::grpc(format!("label container {id}")))?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::quote;

    #[test]
    fn filter_values_are_quoted_when_needed() {
        assert_eq!(quote("true"), "true");
        assert_eq!(quote("dev.zattera/managed"), "\"dev.zattera/managed\"");
        assert_eq!(quote("a\"b"), "\"a\\\"b\"");
    }
}
