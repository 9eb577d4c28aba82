//! Bring-up and teardown of one instance (runtime.md E-6, E-8, §5): the
//! steps between an assignment and a running, networked, logged container.
//! Everything here is a free function over shared handles, so the executor
//! can run several bring-ups at once while it alone owns the bookkeeping.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use zattera_netns::{NetNode, Subnet, network_name};

pub use super::plan::Plan;
use super::{ExecutorConfig, compose, files};
use crate::labels::OwnedContainer;
use crate::logs;
use crate::runtime::containers::{self, NewContainer};
use crate::runtime::pull::{Credentials, ProgressFn, PullEvent, Puller};
use crate::runtime::spec;
use crate::runtime::{Containerd, ImageRef, RuntimeError};
use crate::status::{Observation, State};

/// Shared handles a bring-up or teardown needs.
#[derive(Debug, Clone)]
pub struct Handles {
    pub ctd: Containerd,
    pub puller: Puller,
    pub net: Option<Arc<NetNode>>,
    pub cfg: Arc<ExecutorConfig>,
}

impl Handles {
    /// The node's directories.
    pub fn layout(&self) -> crate::layout::Layout {
        crate::layout::Layout::new(&self.cfg.data_dir, &self.cfg.run_dir)
    }

    /// What the node decides for every container it composes.
    fn node_facts(&self) -> compose::NodeFacts {
        compose::NodeFacts {
            layout: self.layout(),
            cgroup_parent: self.cfg.cgroup_parent.clone(),
            cgroup_v2: spec::host_has_cgroup_v2(),
            pids_limit: self.cfg.pids_limit,
            standalone: self.cfg.standalone,
            default_subnet: self.cfg.default_subnet,
            networked: self.net.is_some(),
        }
    }
}

/// Where a bring-up sends its intermediate reports (PULLING, STARTING) as
/// they happen (E-8): the worker's own channel, so they stay in order with
/// what the worker says afterwards.
pub type Progress<'a> = &'a (dyn Fn(Observation) + Send + Sync);

/// The step of a bring-up (or a restart) that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Resolving, fetching and unpacking the image.
    Pull,
    /// The volume's directory, mount path and first-use copy.
    Volume,
    /// The bridge, then the container's namespace and veth.
    Network,
    /// The files, the OCI spec and the container record.
    Create,
    /// The task: shim, log shim, `runc create` and `runc start`.
    Start,
    /// An existing container's old task, before a new one starts.
    Restart,
}

/// Why a bring-up failed: its step, what it was about (the image, the
/// volume, the network) and why. Its text is the FAILED message (E-8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub step: Step,
    pub subject: Option<String>,
    pub reason: String,
}

impl Failure {
    /// A plan that cannot make a container: a volume's fault names it.
    fn composing(e: compose::ComposeError) -> Self {
        match e {
            compose::ComposeError::Volume { name, error } => Self::of(Step::Volume, name, error),
            e => Self::new(Step::Create, e),
        }
    }

    fn new(step: Step, reason: impl std::fmt::Display) -> Self {
        Self {
            step,
            subject: None,
            reason: reason.to_string(),
        }
    }

    fn of(step: Step, subject: impl std::fmt::Display, reason: impl std::fmt::Display) -> Self {
        Self {
            step,
            subject: Some(subject.to_string()),
            reason: reason.to_string(),
        }
    }

    /// A pull's failure: the puller's own refusals name no image, so the
    /// image is said once either way.
    fn pull(reference: &ImageRef, e: RuntimeError) -> Self {
        let reason = match e {
            RuntimeError::Pull { reason, .. } => reason,
            e => e.to_string(),
        };
        Self::of(Step::Pull, reference, reason)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let step = match self.step {
            Step::Pull => "pull",
            Step::Volume => "ensure volume",
            Step::Network => "ensure network",
            Step::Create => "create",
            Step::Start => "start",
            Step::Restart => "restart",
        };
        match &self.subject {
            Some(subject) => write!(f, "{step} {subject}: {}", self.reason),
            None => write!(f, "{step}: {}", self.reason),
        }
    }
}

impl std::error::Error for Failure {}

/// Why a restart failed, and so what becomes of the container (58.8).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestartFailure {
    /// Its record or its root filesystem is gone or cannot be run: only a
    /// re-create brings it back, at the cost of its writable layer.
    Unusable(Failure),
    /// Anything else (containerd slow in a boot storm, a netlink hiccup, a
    /// full disk): the container is kept, and the restart is tried again
    /// after the crash back-off.
    Transient(Failure),
}

impl RestartFailure {
    /// Sorts a runtime error of the restart: unusable when containerd has no
    /// such container or snapshot, or the runtime cannot run what the
    /// rootfs holds (the entrypoint missing or not an executable, the rootfs
    /// not mountable).
    fn of(step: Step, e: RuntimeError) -> Self {
        let unusable = e.is_not_found() || rootfs_broken(&e.to_string());
        let failure = Failure::new(step, e);
        if unusable {
            Self::Unusable(failure)
        } else {
            Self::Transient(failure)
        }
    }

    pub fn failure(&self) -> &Failure {
        match self {
            Self::Unusable(f) | Self::Transient(f) => f,
        }
    }
}

impl std::fmt::Display for RestartFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.failure().fmt(f)
    }
}

/// What runc says when the rootfs itself is at fault.
fn rootfs_broken(message: &str) -> bool {
    const SIGNS: [&str; 4] = [
        "exec format error",
        "executable file not found",
        "no such file or directory: unknown",
        "rootfs",
    ];
    let message = message.to_ascii_lowercase();
    SIGNS.iter().any(|s| message.contains(s))
}

/// Wall time of each step of one bring-up, logged at debug under the target
/// `zattera::bringup` so that a slow start says where its time went. Create
/// is the rootfs snapshot and the container record; start is a fresh
/// volume's copy-up, the shim, `runc create` with the log shim and `runc
/// start` (`containers::start` splits the last two at the same target).
struct Phases {
    began: Instant,
    last: Instant,
    pull_check: Duration,
    volumes: Duration,
    network: Duration,
    spec: Duration,
    create: Duration,
    start: Duration,
}

impl Phases {
    fn start() -> Self {
        let now = Instant::now();
        Phases {
            began: now,
            last: now,
            pull_check: Duration::ZERO,
            volumes: Duration::ZERO,
            network: Duration::ZERO,
            spec: Duration::ZERO,
            create: Duration::ZERO,
            start: Duration::ZERO,
        }
    }

    /// The time since the previous lap.
    fn lap(&mut self) -> Duration {
        let now = Instant::now();
        let lap = now - self.last;
        self.last = now;
        lap
    }

    fn log(&self, container: &str) {
        let us = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        tracing::debug!(
            target: "zattera::bringup",
            container,
            total_us = us(self.last - self.began),
            pull_check_us = us(self.pull_check),
            volumes_us = us(self.volumes),
            network_us = us(self.network),
            spec_us = us(self.spec),
            create_us = us(self.create),
            start_us = us(self.start),
            "brought up"
        );
    }
}

/// Brings one instance up: the image, then what the container is made of
/// (composed with no I/O), then small steps that each make one thing. On
/// failure the undo list takes back, newest first, what they made: nothing
/// is left behind.
pub async fn bring_up(
    h: &Handles,
    plan: &Plan,
    progress: Progress<'_>,
) -> Result<OwnedContainer, Failure> {
    let id = plan.assignment_id().to_owned();
    let mut phases = Phases::start();
    progress(Observation::new(&id, State::Pulling));
    let image = pull(h, plan).await?;
    phases.pull_check = phases.lap();
    let facts = compose::ImageFacts::of(&image);
    let cfg = image.config.config().clone().unwrap_or_default();
    let user = image_user(h, &image, cfg.user().as_deref().unwrap_or_default()).await?;
    let netns = match &h.net {
        Some(net) if plan.ip.is_some() => Some(
            net.config()
                .netns_path(&plan.container_id)
                .map_err(|e| Failure::new(Step::Network, e))?,
        ),
        _ => None,
    };
    let composed =
        compose::compose(plan, &facts, user, netns, &h.node_facts()).map_err(Failure::composing)?;
    phases.spec = phases.lap();
    let fresh = volumes(h, plan, &composed, progress)?;
    phases.volumes = phases.lap();

    let mut undo = Undo::new(h, &composed, plan.ip);
    let made = async {
        network(h, plan, &mut undo).await?;
        phases.network = phases.lap();
        write_files(plan, &composed)?;
        create(h, &image, &composed, &mut undo).await?;
        phases.create = phases.lap();
        copy_up(h, &composed, &fresh).await?;
        progress(Observation::new(&id, State::Starting).container(&composed.container_id));
        start(h, &composed).await
    }
    .await;
    if let Err(failure) = made {
        undo.unwind().await;
        return Err(failure);
    }
    phases.start = phases.lap();
    phases.log(&composed.container_id);
    let container = containerd_client::services::v1::Container {
        id: composed.container_id.clone(),
        labels: composed.labels.clone(),
        ..Default::default()
    };
    OwnedContainer::from_container(&container)
        .ok_or_else(|| Failure::new(Step::Create, "labels do not round-trip"))
}

/// The image of `plan`, present or pulled (bounded by `pull-timeout`);
/// pulls that really happen are counted.
async fn pull(h: &Handles, plan: &Plan) -> Result<crate::runtime::LocalImage, Failure> {
    let reference: ImageRef = plan
        .runtime
        .image_ref
        .parse()
        .map_err(|e| Failure::of(Step::Pull, &plan.runtime.image_ref, e))?;
    if let Some(why) = h
        .puller
        .foreign_project(&reference, &plan.assignment.project_id)
    {
        return Err(Failure::of(Step::Pull, &reference, why));
    }
    // Counted only when a pull really happens (an image present is not one).
    let pulled = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let counted: ProgressFn = {
        let (pulled, metrics) = (Arc::clone(&pulled), Arc::clone(&h.cfg.metrics));
        Arc::new(move |event| {
            if let PullEvent::Resolved { bytes, .. } = event {
                pulled.store(true, std::sync::atomic::Ordering::Relaxed);
                metrics.pull_bytes.inc_by(bytes);
            }
        })
    };
    let pull = h
        .puller
        .ensure(&reference, &Credentials::Anonymous, Some(counted));
    let image = tokio::time::timeout(h.cfg.pull_timeout, pull).await;
    if pulled.load(std::sync::atomic::Ordering::Relaxed) {
        let result = if matches!(image, Ok(Ok(_))) {
            "ok"
        } else {
            "failed"
        };
        h.cfg
            .metrics
            .pulls
            .get_or_create(&crate::telemetry::ResultLabel { result })
            .inc();
    }
    image
        .map_err(|_| {
            Failure::of(
                Step::Pull,
                &reference,
                format_args!(
                    "not done after {} (pull-timeout)",
                    humantime::format_duration(h.cfg.pull_timeout)
                ),
            )
        })?
        .map_err(|e| Failure::pull(&reference, e))
}

/// A volume that fills from the image at its first use (C-8, VOL-4).
struct Fresh {
    local: String,
    mount_path: String,
}

/// Each volume's directory (a Docker volume of a moved node taken over),
/// and which of them are at their first use.
fn volumes(
    h: &Handles,
    plan: &Plan,
    composed: &compose::Composed,
    progress: Progress<'_>,
) -> Result<Vec<Fresh>, Failure> {
    let env = &plan.assignment.environment_id;
    let mut fresh = Vec::new();
    for v in &composed.volumes {
        let local = crate::volumes::ensure(&h.cfg.data_dir, env, &v.name)
            .map_err(|e| Failure::new(Step::Volume, e))?;
        let at = |e: &dyn std::fmt::Display| Failure::of(Step::Volume, &local, e);
        let docker = &h.cfg.docker_volumes;
        if let Some(adopted) =
            crate::volumes::adopt::adopt(docker, &h.cfg.data_dir, env, &v.name, &local)
                .map_err(|e| at(&e))?
        {
            progress(
                Observation::new(plan.assignment_id(), State::Pulling)
                    .message(format!("volume {}: {adopted}", v.name)),
            );
        }
        if crate::volumes::first_use(&h.cfg.data_dir, &local).map_err(|e| at(&e))? {
            fresh.push(Fresh {
                local,
                mount_path: v.mount_path.clone(),
            });
        }
    }
    Ok(fresh)
}

/// The bridge, then this container's namespace and veth.
async fn network(h: &Handles, plan: &Plan, undo: &mut Undo<'_>) -> Result<(), Failure> {
    let (Some(net), Some(subnet), Some(ip)) = (&h.net, plan.subnet, plan.ip) else {
        return Ok(());
    };
    let name = scope_of(
        h,
        subnet,
        &plan.assignment.project_id,
        &plan.assignment.environment_id,
    );
    net.ensure_network(&name, subnet)
        .await
        .map_err(|e| Failure::of(Step::Network, &name, e))?;
    undo.made(Made::Attachment);
    net.attach(&plan.container_id, subnet, ip)
        .await
        .map_err(|e| Failure::of(Step::Network, &name, format_args!("attach: {e}")))?;
    Ok(())
}

/// The files over the image's `/etc`: resolv.conf (the gateway answers
/// internal names on environment networks; on the default network the
/// host's resolvers do, C-10), hosts, hostname.
fn write_files(plan: &Plan, composed: &compose::Composed) -> Result<(), Failure> {
    let dir = &composed.files_dir;
    files::write(
        dir,
        &composed.hostname,
        plan.ip,
        composed.gateway,
        &read_host_resolv(),
    )
    .map(|_| ())
    .map_err(|e| Failure::new(Step::Create, format_args!("writing {}: {e}", dir.display())))
}

/// The container record, with its rootfs snapshot.
async fn create(
    h: &Handles,
    image: &crate::runtime::LocalImage,
    composed: &compose::Composed,
    undo: &mut Undo<'_>,
) -> Result<(), Failure> {
    containers::create(
        &h.ctd,
        &NewContainer {
            id: composed.container_id.clone(),
            image: image.name.to_string(),
            chain_id: image.chain_id.clone(),
            labels: composed.labels.clone(),
            spec: composed.spec.clone(),
            runtime: h.cfg.oci_runtime.clone(),
        },
    )
    .await
    .map_err(|e| Failure::new(Step::Create, e))?;
    undo.made(Made::Container);
    Ok(())
}

/// The image's content into each volume at its first use: into a staging
/// directory, made the root only once whole and on disk, so that an
/// interruption is redone, never taken for done.
async fn copy_up(
    h: &Handles,
    composed: &compose::Composed,
    fresh: &[Fresh],
) -> Result<(), Failure> {
    let scratch = h.layout().scratch();
    for v in fresh {
        let copied = async {
            let staging = crate::volumes::copy_up_staging(&h.cfg.data_dir, &v.local)
                .map_err(|e| e.to_string())?;
            crate::runtime::rootfs::copy_up(
                &h.ctd,
                &composed.container_id,
                &v.mount_path,
                &staging,
                &scratch,
            )
            .await
            .map_err(|e| e.to_string())?;
            crate::volumes::finish_copy_up(&h.cfg.data_dir, &v.local).map_err(|e| e.to_string())
        }
        .await;
        copied.map_err(|e| Failure::of(Step::Volume, &v.local, e))?;
    }
    Ok(())
}

/// The log's metadata (its output stays queryable by its assignment after
/// it is gone), then the task with its log shim.
async fn start(h: &Handles, composed: &compose::Composed) -> Result<(), Failure> {
    logs::files::write_meta(&composed.log_path, &composed.log_meta)
        .map_err(|e| Failure::new(Step::Create, format_args!("log meta: {e}")))?;
    let uri = logs::shim::log_uri(
        &h.cfg.logger_binary,
        &composed.log_path,
        h.cfg.log_retention,
    );
    containers::start(&h.ctd, &composed.container_id, &uri)
        .await
        .map(|_| ())
        .map_err(|e| Failure::new(Step::Start, e))
}

/// What a bring-up made so far, taken back newest first if it fails.
enum Made {
    /// The container's namespace and veth (and nothing else of the bridge).
    Attachment,
    /// The container record, its snapshot and any task.
    Container,
}

/// The undo list of one bring-up.
struct Undo<'a> {
    h: &'a Handles,
    container_id: String,
    ip: Option<Ipv4Addr>,
    stop_signal: u32,
    files_dir: PathBuf,
    made: Vec<Made>,
}

impl<'a> Undo<'a> {
    fn new(h: &'a Handles, composed: &compose::Composed, ip: Option<Ipv4Addr>) -> Self {
        Self {
            h,
            container_id: composed.container_id.clone(),
            ip,
            stop_signal: composed.stop_signal,
            files_dir: composed.files_dir.clone(),
            made: Vec::new(),
        }
    }

    fn made(&mut self, m: Made) {
        self.made.push(m);
    }

    /// Never leaves a dead container to be adopted, nor a namespace or a
    /// veth to be found. What fails here is logged: the bring-up's own
    /// failure is the one reported.
    async fn unwind(self) {
        let cid = &self.container_id;
        for m in self.made.into_iter().rev() {
            let undone = match m {
                Made::Container => {
                    containers::remove(&self.h.ctd, cid, self.stop_signal, UNDO_GRACE)
                        .await
                        .map_err(|e| e.to_string())
                }
                Made::Attachment => match &self.h.net {
                    Some(net) => net.detach(cid, self.ip).await.map_err(|e| e.to_string()),
                    None => Ok(()),
                },
            };
            if let Err(e) = undone {
                tracing::warn!(container = %cid, error = %e, "a failed bring-up left something behind");
            }
        }
        let _ = std::fs::remove_dir_all(&self.files_dir);
    }
}

/// How long the task of a failed bring-up gets before SIGKILL.
const UNDO_GRACE: Duration = Duration::from_secs(1);

/// Restarts the task of an existing container (crash or reboot), reusing its
/// container, snapshot, IP, ports and log file (C-13). A network attachment
/// lost in a reboot (or half removed) is made again with the same address.
pub async fn restart(h: &Handles, owned: &OwnedContainer) -> Result<(), RestartFailure> {
    containers::delete_task(&h.ctd, &owned.container_id)
        .await
        .map_err(|e| RestartFailure::of(Step::Restart, e))?;
    // The network and the files are the host's, never the container's
    // fault: a failure there keeps the container for the next try.
    if let (Some(net), Some(subnet), Some(ip)) = (&h.net, owned.subnet, owned.ip) {
        let name = scope_of(h, subnet, &owned.project_id, &owned.environment_id);
        net.ensure_network(&name, subnet)
            .await
            .map_err(|e| RestartFailure::Transient(Failure::of(Step::Network, &name, e)))?;
        // Lost in a reboot, or a part of it removed behind our back: the
        // task is down, so a fresh attachment with the same address is fine.
        let intact = net
            .attachment_intact(&owned.container_id, ip)
            .await
            .map_err(|e| RestartFailure::Transient(Failure::new(Step::Restart, e)))?;
        if !intact {
            let _ = net.detach(&owned.container_id, Some(ip)).await;
            net.attach(&owned.container_id, subnet, ip)
                .await
                .map_err(|e| {
                    RestartFailure::Transient(Failure::of(
                        Step::Network,
                        &name,
                        format_args!("attach: {e}"),
                    ))
                })?;
        }
    }
    restore_files(h, owned).map_err(RestartFailure::Transient)?;
    let log_path = owned.log_path.clone().map_or_else(
        || {
            h.cfg
                .data_dir
                .join("logs")
                .join(format!("{}.log", owned.container_id))
        },
        PathBuf::from,
    );
    let uri = logs::shim::log_uri(&h.cfg.logger_binary, &log_path, h.cfg.log_retention);
    containers::start(&h.ctd, &owned.container_id, &uri)
        .await
        .map(|_| ())
        .map_err(|e| RestartFailure::of(Step::Start, e))
}

/// The files bind-mounted over the image's `/etc` live in the run dir, a
/// tmpfs that a reboot empties: written again, as at creation, or runc
/// cannot start the container and it would be re-created, losing its
/// writable layer.
fn restore_files(h: &Handles, owned: &OwnedContainer) -> Result<(), Failure> {
    let dir = h.cfg.run_dir.join("containers").join(&owned.container_id);
    if ["resolv.conf", "hosts", "hostname"]
        .iter()
        .all(|f| dir.join(f).exists())
    {
        return Ok(());
    }
    let gateway = owned
        .subnet
        .filter(|s| h.net.is_some() && owned.ip.is_some() && Some(*s) != h.cfg.default_subnet)
        .map(Subnet::gateway);
    files::write(
        &dir,
        &compose::hostname_of(&owned.container_id),
        owned.ip,
        gateway,
        &read_host_resolv(),
    )
    .map(|_| ())
    .map_err(|e| {
        Failure::new(
            Step::Restart,
            format_args!("writing {}: {e}", dir.display()),
        )
    })
}

/// Why a removal did not finish; the container is left as it is and the
/// next pass asks again.
#[derive(Debug, thiserror::Error)]
pub enum TeardownError {
    /// containerd did not stop or delete it.
    #[error("stop and remove: {0}")]
    Container(#[from] RuntimeError),
    /// Its network namespace or veth is still there.
    #[error("detach from the network: {0}")]
    Network(#[from] zattera_netns::Error),
}

/// Stops and removes an instance, then its network attachment (E-6).
pub async fn tear_down(h: &Handles, owned: &OwnedContainer) -> Result<(), TeardownError> {
    containers::remove(
        &h.ctd,
        &owned.container_id,
        owned.stop_signal,
        owned.stop_grace,
    )
    .await?;
    if let Some(net) = &h.net {
        net.detach(&owned.container_id, owned.ip).await?;
    }
    let _ = std::fs::remove_dir_all(h.cfg.run_dir.join("containers").join(&owned.container_id));
    Ok(())
}

/// The network scope of `subnet`: its environment's, or the default one.
fn scope_of(h: &Handles, subnet: Subnet, project_id: &str, environment_id: &str) -> String {
    if h.cfg.default_subnet == Some(subnet) {
        DEFAULT_NETWORK.to_owned()
    } else {
        network_name(project_id, environment_id)
    }
}

/// The scope name of the node-local default network.
pub const DEFAULT_NETWORK: &str = "zattera-default";

fn read_host_resolv() -> String {
    let text = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    let only_stub = text
        .lines()
        .filter(|l| l.starts_with("nameserver"))
        .all(|l| l.split_whitespace().nth(1) == Some("127.0.0.53"));
    if only_stub && text.contains("127.0.0.53") {
        std::fs::read_to_string("/run/systemd/resolve/resolv.conf").unwrap_or(text)
    } else {
        text
    }
}

/// The image's `User` as ids (C-5): root without one; otherwise resolved
/// against the image's own passwd and group files.
async fn image_user(
    h: &Handles,
    image: &crate::runtime::LocalImage,
    user: &str,
) -> Result<spec::ProcessUser, Failure> {
    if user.trim().is_empty() {
        return Ok(spec::ProcessUser::default());
    }
    let scratch = h.cfg.run_dir.join("scratch");
    let files = crate::runtime::rootfs::read_image_files(
        &h.ctd,
        &image.chain_id.to_string(),
        &["etc/passwd", "etc/group"],
        &scratch,
    )
    .await
    .map_err(|e| Failure::new(Step::Create, format_args!("user {user:?}: {e}")))?;
    let text = |i: usize| {
        files
            .get(i)
            .and_then(Option::as_ref)
            .map(|b| String::from_utf8_lossy(b).into_owned())
    };
    crate::runtime::user::resolve(user, text(0).as_deref(), text(1).as_deref())
        .map_err(|e| Failure::new(Step::Create, e))
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_is_given_up_only_for_a_missing_record_or_a_broken_rootfs() {
        let grpc = |code, message: &str| RuntimeError::Grpc {
            context: "create task web-0".into(),
            status: tonic::Status::new(code, message),
        };
        let unusable = [
            grpc(tonic::Code::NotFound, "container \"web-0\": not found"),
            grpc(
                tonic::Code::Unknown,
                "OCI runtime create failed: runc create failed: unable to start container process: exec: \"/app\": exec format error: unknown",
            ),
            grpc(
                tonic::Code::Unknown,
                "OCI runtime create failed: runc create failed: unable to start container process: exec: \"/app\": stat /app: no such file or directory: unknown",
            ),
        ];
        for e in unusable {
            let text = e.to_string();
            assert!(
                matches!(
                    RestartFailure::of(Step::Start, e),
                    RestartFailure::Unusable(_)
                ),
                "{text}"
            );
        }
        let transient = [
            grpc(tonic::Code::DeadlineExceeded, "context deadline exceeded"),
            grpc(tonic::Code::Unavailable, "connection refused"),
            RuntimeError::Invalid("the task of web-0 was not started within 60 s".into()),
        ];
        for e in transient {
            let text = e.to_string();
            assert!(
                matches!(
                    RestartFailure::of(Step::Start, e),
                    RestartFailure::Transient(_)
                ),
                "{text}"
            );
        }
    }

    #[test]
    fn a_failure_reads_as_the_failed_messages_always_did() {
        let image: ImageRef = "registry.test/shop/web:1".parse().unwrap();
        let cases = [
            (
                Failure::pull(
                    &image,
                    RuntimeError::Pull {
                        reference: image.to_string(),
                        reason: "no linux/amd64 manifest".into(),
                    },
                ),
                "pull registry.test/shop/web:1: no linux/amd64 manifest",
            ),
            (
                Failure::pull(&image, RuntimeError::Invalid("401 Unauthorized".into())),
                "pull registry.test/shop/web:1: 401 Unauthorized",
            ),
            (
                Failure::of(Step::Pull, &image, "not done after 5m (pull-timeout)"),
                "pull registry.test/shop/web:1: not done after 5m (pull-timeout)",
            ),
            (
                Failure::new(Step::Volume, "bad name"),
                "ensure volume: bad name",
            ),
            (
                Failure::of(Step::Network, "zt-p-e", "attach: busy"),
                "ensure network zt-p-e: attach: busy",
            ),
            (
                Failure::new(Step::Create, "the image has no command and none was given"),
                "create: the image has no command and none was given",
            ),
            (
                Failure::new(Step::Start, "runc: exit 1"),
                "start: runc: exit 1",
            ),
        ];
        for (failure, text) in cases {
            assert_eq!(failure.to_string(), text);
        }
        assert_eq!(
            Failure::pull(&image, RuntimeError::Invalid(String::new())).step,
            Step::Pull
        );
    }
}
