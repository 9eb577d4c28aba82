//! The seam between a worker and what it drives: bring an instance up,
//! restart its task, tear it down, read its task. [`Containerd`] is the
//! real thing (containerd, the host's network, the cgroup files); the
//! workers' unit tests put a fake in its place, so crash back-off, adoption
//! and removal are tested without a runtime.

use std::collections::HashMap;
use std::path::Path;

use super::instance::{self, Failure, Handles, Plan, Progress, RestartFailure, TeardownError};
use crate::health::ExecContext;
use crate::labels::OwnedContainer;
use crate::runtime::RuntimeError;
use crate::runtime::containers::{self, TaskState};

#[tonic::async_trait]
pub(super) trait Instances: Send + Sync + std::fmt::Debug {
    /// Brings one planned instance up; on failure nothing it made is left.
    async fn bring_up(
        &self,
        plan: &Plan,
        progress: Progress<'_>,
    ) -> Result<OwnedContainer, Failure>;

    /// Starts the task of an existing container again (C-13).
    async fn restart(&self, owned: &OwnedContainer) -> Result<(), RestartFailure>;

    /// Stops and removes the container and what it had (network, files).
    async fn tear_down(&self, owned: &OwnedContainer) -> Result<(), TeardownError>;

    async fn task_state(&self, container_id: &str) -> Result<TaskState, RuntimeError>;

    /// Stops the task with the container's grace and keeps the container:
    /// the host is going down, and the next boot starts it again.
    async fn halt(&self, owned: &OwnedContainer) -> Result<(), RuntimeError>;

    /// Adds labels to the container's record (exit code, restart count).
    async fn label(
        &self,
        container_id: &str,
        labels: HashMap<String, String>,
    ) -> Result<(), RuntimeError>;

    /// Makes a network attachment removed behind the agent's back again
    /// around the running task `pid`.
    async fn keep_attached(&self, owned: &OwnedContainer, pid: u32);

    /// "out of memory (limit N MiB)" when the OOM killer acted in the
    /// container's cgroup.
    fn oom_kills(&self, owned: &OwnedContainer) -> Option<String>;

    /// Where exec probes run.
    fn exec_context(&self) -> ExecContext;
}

/// The instances of containerd on this host.
#[derive(Debug, Clone)]
pub(super) struct Containerd {
    pub h: Handles,
}

#[tonic::async_trait]
impl Instances for Containerd {
    async fn bring_up(
        &self,
        plan: &Plan,
        progress: Progress<'_>,
    ) -> Result<OwnedContainer, Failure> {
        instance::bring_up(&self.h, plan, progress).await
    }

    async fn restart(&self, owned: &OwnedContainer) -> Result<(), RestartFailure> {
        instance::restart(&self.h, owned).await
    }

    async fn tear_down(&self, owned: &OwnedContainer) -> Result<(), TeardownError> {
        instance::tear_down(&self.h, owned).await
    }

    async fn task_state(&self, container_id: &str) -> Result<TaskState, RuntimeError> {
        containers::task_state(&self.h.ctd, container_id).await
    }

    async fn halt(&self, owned: &OwnedContainer) -> Result<(), RuntimeError> {
        containers::stop(
            &self.h.ctd,
            &owned.container_id,
            owned.stop_signal,
            owned.stop_grace,
        )
        .await
        .map(|_| ())
    }

    async fn label(
        &self,
        container_id: &str,
        labels: HashMap<String, String>,
    ) -> Result<(), RuntimeError> {
        containers::add_labels(&self.h.ctd, container_id, labels).await
    }

    async fn keep_attached(&self, owned: &OwnedContainer, pid: u32) {
        let (Some(net), Some(subnet), Some(ip)) = (&self.h.net, owned.subnet, owned.ip) else {
            return;
        };
        let cid = &owned.container_id;
        match net.attachment_intact(cid, ip).await {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => {
                tracing::debug!(container = %cid, error = %e, "attachment not checked");
                return;
            }
        }
        match net.repair_attachment(cid, subnet, ip, pid).await {
            Ok(r) if r.anything() => tracing::warn!(
                container = %cid,
                netns_file = r.netns_file,
                veth = r.veth,
                "network attachment removed behind the agent's back; made again"
            ),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(container = %cid, error = %e, "network attachment broken and not repaired");
            }
        }
    }

    fn oom_kills(&self, owned: &OwnedContainer) -> Option<String> {
        let cgroup = Path::new(&self.h.cfg.cgroup_parent).join(&owned.container_id);
        crate::runtime::oom::read(Path::new("/sys/fs/cgroup"), &cgroup)
            .filter(|r| r.kills > 0)
            .map(|r| r.message())
    }

    fn exec_context(&self) -> ExecContext {
        ExecContext {
            ctd: self.h.ctd.clone(),
            fifo_dir: self.h.cfg.run_dir.join("exec"),
        }
    }
}
