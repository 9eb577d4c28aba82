//! The executor: converge containerd to the desired `AssignmentSet` and keep
//! it there (runtime.md §4 to §6).
//!
//! A thin loop under per-container workers ([`worker`]), shaped like
//! kubelet's sync loop and pod workers. The loop owns what is shared: the
//! desired set, the containers it keeps, addresses, host ports and shim
//! groups ([`alloc`]) and the status board ([`board`], [`report`]). The
//! host's firewall, bridges and DNS listeners are a task of its own
//! ([`host`]), told the latest want and never waited for; workers lease
//! their networks ([`leases`]) so it removes none in use. Internal names
//! come from the status or route snapshots, not from here. A pass (on every
//! new set and every 5 s) reads the listing ([`listing`]), classifies
//! ([`diff`]), decides ([`pass`], pure), stops leaving workers and spawns
//! workers for what is missing, each with its [`plan`]; exit events go to
//! their container's worker; workers report back (RUNNING, HEALTHY, up,
//! down, failed). No arm of the loop waits on a container: a stalled pull or
//! a slow stop holds only its own worker. Workers drive containers through
//! [`instances`] (containerd's, or a fake in their unit tests), and
//! [`instance`] holds the steps of a bring-up.
//!
//! STOP before RUN (E-6) holds per scope (a project's environment): a new
//! instance of a scope is planned only once every removal in that scope is
//! done, so a freed host port or name can be reused; other scopes go on.

pub mod alloc;
pub mod backoff;
mod board;
pub mod compose;
pub mod diff;
pub mod files;
mod host;
pub mod instance;
mod instances;
mod leases;
pub mod listing;
mod pass;
mod plan;
mod report;
mod shim_groups;
mod worker;

pub use report::offline_status;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{mpsc, oneshot, watch};
use zattera_dns::DnsServer;
use zattera_netns::{NetNode, PortRange, Subnet, network_name};

use self::alloc::Alloc;
use self::board::Board;
use self::host::{Host, HostHandle};
use self::instance::Handles;
use self::leases::NetworkLeases;
use self::listing::{Listing, Refreshed, list_owned};
use self::pass::{Run, Supervise};
use self::shim_groups::ShimGroups;
use self::worker::{Cmd, Ctx, Event, Phase, Report, Start, Worker};
use crate::labels::OwnedContainer;
use crate::proto::cluster::AssignmentSet;
use crate::proto::v1::AssignmentDesired;
use crate::runtime::events::{self, TaskEvent};
use crate::runtime::pull::{ClusterRegistryWatch, Puller};
use crate::runtime::{Containerd, RuntimeError};
use crate::status::{Observation, SourceError, State, StatusSnapshot};

const TICK: Duration = Duration::from_secs(5);
/// How long after the task event stream ended it is subscribed again.
const RESUBSCRIBE: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct ExecutorConfig {
    pub node_id: String,
    pub host_ip: Ipv4Addr,
    pub data_dir: PathBuf,
    pub run_dir: PathBuf,
    /// The binary the runc shim runs as each container's logger.
    pub logger_binary: PathBuf,
    /// cgroupfs parent of every container, e.g. `/zattera/<namespace>`.
    pub cgroup_parent: String,
    /// Removals and bring-ups that run at once.
    pub parallelism: usize,
    /// Where ephemeral host ports come from.
    pub host_port_range: PortRange,
    /// Processes per container (0 = unlimited); a manifest may lower it.
    pub pids_limit: u32,
    /// Containers of one scope that share a runc shim (see
    /// [`shim_groups`]); 1: a shim each.
    pub shim_group_size: usize,
    /// The OCI runtime containers are created with (runc or crun).
    pub oci_runtime: crate::runtime::oci_runtime::OciRuntime,
    /// Longest one pull may take before the bring-up fails.
    pub pull_timeout: Duration,
    /// Standalone: requested host ports come from the desired
    /// `Assignment.mesh_port_bindings`, and DNS answers local instances.
    pub standalone: bool,
    /// What `status` says the source is.
    pub source: String,
    /// The cluster's registry and the node's credential for it (control
    /// mode); `None` pulls anonymously everywhere.
    pub cluster_registry: Option<ClusterRegistryWatch>,
    /// Where assignments without a subnet go; `None`: only `lo`.
    pub default_subnet: Option<Subnet>,
    /// How long each container's log shim keeps its rotated files.
    pub log_retention: crate::logs::Retention,
    /// Where the reference agent's Docker volumes are (adopted at first use).
    pub docker_volumes: PathBuf,
    /// Passes and pulls are counted here.
    pub metrics: Arc<crate::telemetry::AgentMetrics>,
}

/// Handle to a running executor.
#[derive(Debug, Clone)]
pub struct ExecutorHandle {
    pub desired: watch::Sender<Option<AssignmentSet>>,
    pub source_errors: watch::Sender<Vec<SourceError>>,
    pub status: watch::Receiver<Arc<StatusSnapshot>>,
    /// The networks in use on this node (for the VIP rules).
    pub networks: watch::Receiver<Arc<Vec<LocalNetwork>>>,
    halt: mpsc::Sender<HaltRequest>,
}

/// A halt: told how long it may take (the longest grace and the kill
/// wait) as it begins, and how many instances it stopped when done.
struct HaltRequest {
    bound: oneshot::Sender<Duration>,
    done: oneshot::Sender<usize>,
}

impl ExecutorHandle {
    /// The host is going down: every instance is stopped with its grace
    /// (containers kept, so the next boot restarts them) and the executor
    /// stops. `bound` hears, as it begins, how long it may take (systemd's
    /// stop timeout is extended by it). Returns how many were stopped,
    /// `None` if it was gone already.
    pub async fn halt(&self, bound: impl FnOnce(Duration)) -> Option<usize> {
        let (bound_tx, bound_rx) = oneshot::channel();
        let (done, rx) = oneshot::channel();
        self.halt
            .send(HaltRequest {
                bound: bound_tx,
                done,
            })
            .await
            .ok()?;
        if let Ok(d) = bound_rx.await {
            bound(d);
        }
        rx.await.ok()
    }
}

impl pass::WorkerState for Worker {
    fn assignment_id(&self) -> &str {
        &self.assignment_id
    }
    fn scope(&self) -> &str {
        &self.scope
    }
    fn phase(&self) -> Phase {
        self.phase
    }
    fn has_spec(&self) -> bool {
        self.has_spec
    }
}

/// A network of this node as the VIP rules need it: its name (the scope
/// its bridge carries) and the project and environment *name* that DNS
/// scopes by (D-7). Environment ids are per app (N-7), so the apps of one
/// project and environment name have a network each, and reach each other's
/// VIPs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct LocalNetwork {
    pub name: String,
    pub project_id: String,
    pub environment: String,
}

pub struct Executor {
    h: Handles,
    /// Firewall, networks and DNS: what the loop wants of them.
    host: HostHandle,
    /// The task that makes the host so, until `run` starts it.
    host_task: Option<Host>,
    /// Addresses and host ports.
    alloc: Alloc,
    /// The container kept per assignment.
    owned: BTreeMap<String, OwnedContainer>,
    /// One per container being brought up, supervised or removed.
    workers: HashMap<String, Worker>,
    board: Board,
    desired_rx: watch::Receiver<Option<AssignmentSet>>,
    /// This node's part of the last set, selected once per new set: a pass
    /// over an unchanged set neither copies nor selects it again.
    desired: Option<Arc<diff::Desired>>,
    /// The owned containers as last listed (see [`listing`]).
    listing: Listing,
    /// The set the last classification was of, while nothing it depends on
    /// changed since (see `reconcile`).
    settled: Option<Arc<diff::Desired>>,
    /// Refreshes of the listing, read beside the passes.
    refresh_tx: mpsc::Sender<Refreshed>,
    refresh_rx: mpsc::Receiver<Refreshed>,
    errors_rx: watch::Receiver<Vec<SourceError>>,
    status_tx: watch::Sender<Arc<StatusSnapshot>>,
    /// The task event stream's generation, read by the workers.
    events_generation: watch::Sender<u64>,
    ctx: Ctx,
    reports_rx: mpsc::UnboundedReceiver<Report>,
    halt_rx: mpsc::Receiver<HaltRequest>,
    /// Reconcile passes completed (shown in the status).
    passes: u64,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("owned", &self.owned.len())
            .field("workers", &self.workers.len())
            .finish_non_exhaustive()
    }
}

impl Executor {
    /// Builds the executor and the handle that feeds it. `batches` receives
    /// every status batch (the control stream); `None` in standalone.
    pub fn new(
        cfg: ExecutorConfig,
        ctd: Containerd,
        net: Option<Arc<NetNode>>,
        dns: Option<Arc<DnsServer>>,
        batches: Option<mpsc::UnboundedSender<Vec<Observation>>>,
    ) -> (Self, ExecutorHandle) {
        let (desired_tx, desired_rx) = watch::channel(None);
        let (halt_tx, halt_rx) = mpsc::channel(1);
        let (errors_tx, errors_rx) = watch::channel(Vec::new());
        let (status_tx, status_rx) = watch::channel(Arc::new(StatusSnapshot {
            node_id: cfg.node_id.clone(),
            source: cfg.source.clone(),
            ..StatusSnapshot::default()
        }));
        let (reports_tx, reports_rx) = mpsc::unbounded_channel();
        let (refresh_tx, refresh_rx) = mpsc::channel(1);
        let (networks_tx, networks_rx) = watch::channel(Arc::new(Vec::new()));
        let mut puller = Puller::new(ctd.clone(), vec![]);
        if let Some(cluster) = &cfg.cluster_registry {
            puller = puller.with_cluster_registry(cluster.clone());
        }
        let alloc = Alloc::new(
            cfg.host_port_range,
            ShimGroups::new(cfg.shim_group_size, cfg.parallelism),
        );
        let leases = NetworkLeases::default();
        let (host_task, host) = Host::new(
            net.clone(),
            dns,
            cfg.default_subnet,
            leases.clone(),
            networks_tx,
        );
        let slots = Arc::new(tokio::sync::Semaphore::new(cfg.parallelism.max(1)));
        let h = Handles {
            ctd,
            puller,
            net,
            cfg: Arc::new(cfg),
        };
        let (events_generation, events) = watch::channel(0);
        let ctx = Ctx {
            instances: Arc::new(instances::Containerd { h: h.clone() }),
            slots,
            reports: reports_tx,
            leases,
            events,
        };
        let exec = Self {
            h,
            host,
            host_task,
            alloc,
            owned: BTreeMap::new(),
            workers: HashMap::new(),
            board: Board::new(batches),
            desired_rx,
            desired: None,
            listing: Listing::default(),
            settled: None,
            refresh_tx,
            refresh_rx,
            errors_rx,
            status_tx,
            events_generation,
            ctx,
            reports_rx,
            halt_rx,
            passes: 0,
        };
        let handle = ExecutorHandle {
            desired: desired_tx,
            source_errors: errors_tx,
            status: status_rx,
            networks: networks_rx,
            halt: halt_tx,
        };
        (exec, handle)
    }

    /// Runs until every handle is dropped.
    pub async fn run(mut self) {
        let host_task = self.host_task.take().map(|h| self.host.spawn(h));
        if let Err(e) = self.boot().await {
            tracing::warn!(error = %e, "boot: could not adopt existing containers; will retry on the next pass");
        }
        let mut events = task_events(&self.h.ctd, Duration::ZERO);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                changed = self.desired_rx.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    self.select_desired();
                    self.reconcile().await;
                }
                _ = self.errors_rx.changed() => self.publish_status(),
                _ = tick.tick() => {
                    self.reconcile().await;
                    self.refresh_listing();
                }
                Some(Refreshed { refresh, at, found }) = self.refresh_rx.recv() => {
                    self.listing.refreshed(refresh, at, found);
                    self.settled = None;
                }
                event = events.next() => match event {
                    Some(Ok(e @ TaskEvent::Exited { .. })) if e.is_init_exit() => {
                        if let TaskEvent::Exited { container_id, .. } = &e
                            && let Some(w) = self.workers.get(container_id)
                        {
                            w.send(Cmd::Exited);
                        }
                    }
                    Some(Ok(TaskEvent::OomKilled { container_id })) => {
                        if let Some(w) = self.workers.get(&container_id) {
                            w.send(Cmd::Oom);
                        }
                    }
                    Some(Ok(TaskEvent::ContainerChanged { container_id })) => {
                        self.listing.changed(&container_id);
                    }
                    Some(Ok(TaskEvent::ContainersChanged)) => self.listing.invalidate(),
                    Some(Ok(_)) => {}
                    ended => {
                        if let Some(Err(e)) = ended {
                            tracing::debug!(error = %e, "task event stream ended; re-subscribing");
                        }
                        // Events may have been missed: list everything
                        // again, and every worker reads its task.
                        self.listing.invalidate();
                        self.events_generation.send_modify(|g| *g += 1);
                        events = task_events(&self.h.ctd, RESUBSCRIBE);
                    }
                },
                Some(report) = self.reports_rx.recv() => self.on_report(report),
                Ok(()) = self.host.applied.changed(), if self.host.has_network() => {
                    let mark = *self.host.applied.borrow_and_update();
                    self.alloc.retire_through(mark);
                }
                Some(req) = self.halt_rx.recv() => {
                    let _ = req.done.send(self.halt_all(req.bound).await);
                    break;
                }
            }
        }
        // The host task ends with its handle, after its last want is done.
        drop(self);
        if let Some(task) = host_task {
            let _ = task.await;
        }
        tracing::info!("executor stopped");
    }

    /// Every worker stops its task with the container's grace and ends;
    /// waits for all (each bounded by its grace, plus the kill wait).
    async fn halt_all(&mut self, bound: oneshot::Sender<Duration>) -> usize {
        let longest = self
            .owned
            .values()
            .map(|o| o.stop_grace)
            .max()
            .unwrap_or_default();
        let _ = bound.send(longest + HALT_SLACK);
        let acks: Vec<_> = self
            .workers
            .values()
            .map(|w| {
                let (tx, rx) = oneshot::channel();
                w.send(Cmd::Halt(tx));
                rx
            })
            .collect();
        let n = acks.len();
        tracing::info!(
            instances = n,
            ?longest,
            "host shutting down: stopping every instance with its grace"
        );
        let all = futures::future::join_all(acks);
        if tokio::time::timeout(longest + HALT_SLACK, all)
            .await
            .is_err()
        {
            tracing::warn!("host shutdown: not every instance stopped in time");
        }
        n
    }

    /// Before any source has spoken: adopt what exists, rebuild IPAM, ports
    /// and rules from labels, and give every container a worker, which
    /// restarts a task lost to a crash or a reboot (C-13), so the node
    /// serves again without waiting for anyone.
    async fn boot(&mut self) -> Result<(), RuntimeError> {
        let started = std::time::SystemTime::now();
        let owned = list_owned(&self.h.ctd).await?;
        // Exec processes (probes, sessions) an earlier agent left: ended
        // beside the boot, never one this agent starts from now on.
        let (ctd, ids, fifos) = (
            self.h.ctd.clone(),
            owned
                .iter()
                .map(|o| o.container_id.clone())
                .collect::<Vec<_>>(),
            self.h.cfg.run_dir.join("exec"),
        );
        tokio::spawn(async move {
            // First the shims blocked on a FIFO an earlier agent never
            // opened: they answer nothing else until it is.
            let held = crate::runtime::exec_orphans::open_fifos(&fifos, started);
            for id in ids {
                crate::runtime::exec_orphans::end(&ctd, &id, started).await;
            }
            drop(held);
            crate::runtime::exec_orphans::remove_fifo_dirs(&fifos, started);
        });
        let live: BTreeSet<String> = owned.iter().map(|o| o.container_id.clone()).collect();
        if let Some(net) = &self.h.net {
            host::collect_orphans(net, &live).await;
        }
        self.alloc.adopt(&owned);
        // Every published port is held again before any rule uses it; a
        // container whose port someone took while we were down is removed,
        // and the next pass brings it up again (a fixed port: FAILED until
        // its holder lets go).
        for o in owned {
            match self.alloc.hold(&o) {
                Ok(()) => {
                    self.owned.insert(o.assignment_id.clone(), o);
                }
                Err(e) => {
                    tracing::warn!(container = %o.container_id, error = %e, "a published port was taken while the agent was down; removing the container");
                    self.spawn(Start::Remove(o), None);
                }
            }
        }
        self.apply_firewall();
        let adopt: Vec<OwnedContainer> = self.owned.values().cloned().collect();
        for o in adopt {
            self.spawn(Start::Adopt(o), None);
        }
        self.sync_networks();
        self.publish_status();
        Ok(())
    }

    /// Asks for a refresh of the listing once it is due; the passes go on
    /// with the old one until the answer comes in.
    fn refresh_listing(&mut self) {
        self.listing
            .refresh_if_due(&self.h.ctd, self.refresh_tx.clone());
    }

    /// Selects this node's part of the newest set (E-4), by assignment id.
    fn select_desired(&mut self) {
        let set = self.desired_rx.borrow_and_update().clone();
        self.desired = set.map(|set| Arc::new(diff::desired_for(set, &self.h.cfg.node_id)));
    }

    /// The desired set for this node, as last selected.
    fn desired(&self) -> Option<Arc<diff::Desired>> {
        self.desired.clone()
    }

    /// The owned containers: the last listing with what changed since read
    /// again, or a new listing (see [`listing`]).
    async fn listed_owned(&mut self) -> Result<Vec<OwnedContainer>, RuntimeError> {
        self.listing.read(&self.h.ctd).await
    }

    /// A worker for `start`'s container.
    fn spawn(&mut self, start: Start, spec: Option<crate::proto::v1::ServiceSpec>) {
        let (cid, aid, scope) = match &start {
            Start::Run(p) => (
                p.container_id.clone(),
                p.assignment_id().to_owned(),
                network_name(&p.assignment.project_id, &p.assignment.environment_id),
            ),
            Start::Adopt(o) | Start::Remove(o) => (
                o.container_id.clone(),
                o.assignment_id.clone(),
                network_name(&o.project_id, &o.environment_id),
            ),
        };
        // One worker per container id, ever at a time: two would race on
        // the same namespace file, veth and task.
        if self.workers.contains_key(&cid) {
            tracing::debug!(container = %cid, "a worker for it runs already");
            return;
        }
        let worker = Worker::spawn(self.ctx.clone(), cid.clone(), aid, scope, start, spec);
        self.workers.insert(cid, worker);
        self.settled = None;
    }

    /// One pass: classify what containerd has, stop what leaves, start what
    /// is missing. It waits for nothing but the one listing.
    async fn reconcile(&mut self) {
        let Some(desired) = self.desired() else {
            return;
        };
        let started = std::time::Instant::now();
        // The same set and listing, and no worker come or gone since the
        // last pass classified them: it would classify the same.
        let settled = self
            .settled
            .as_ref()
            .is_some_and(|d| Arc::ptr_eq(d, &desired))
            && self.listing.is_current();
        let removals = if settled {
            0
        } else {
            match self.supervise(&desired).await {
                Ok(removals) => removals,
                Err(e) => {
                    tracing::warn!(error = %e, "reconcile abandoned: cannot list containers");
                    return;
                }
            }
        };
        // STOPPED goes out once the removal is done (E-15), with `Down`.
        let mut batch = Vec::new();
        let runs = self.start_runs(&desired, &mut batch);
        self.board.emit(batch);
        self.apply_firewall();
        self.sync_networks_with(&desired);
        self.passes += 1;
        self.publish_status();
        self.h.cfg.metrics.reconcile_passes.inc();
        self.h
            .cfg
            .metrics
            .reconcile_seconds
            .observe(started.elapsed().as_secs_f64());
        // What bench/control reads: the pass itself, bring-ups excluded.
        tracing::debug!(
            target: "zattera::pass",
            elapsed_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
            desired = desired.len(),
            kept = self.owned.len(),
            removals,
            runs,
            "reconcile pass"
        );
    }

    /// Classifies the listing (E-5), keeps what stays, has every removal
    /// stopped and every kept container supervised. The number of removals.
    async fn supervise(&mut self, desired: &Arc<diff::Desired>) -> Result<usize, RuntimeError> {
        let listed = self.listed_owned().await?;
        // Duplicates of one assignment are removed (E-2 deviation).
        let classified = diff::classify(desired, listed, self.h.cfg.default_subnet);
        let removals = classified.removals.len();
        let (kept, steps) = pass::supervise(desired, classified, &self.owned, &self.workers);
        self.owned = kept;
        // Until a spawn or a report says otherwise.
        self.settled = Some(desired.clone());
        for step in steps {
            match step {
                Supervise::Stop { container_id } => {
                    if let Some(w) = self.workers.get_mut(&container_id) {
                        w.stop();
                    }
                }
                Supervise::Remove(r) => self.spawn(Start::Remove(r), None),
                Supervise::Spec { container_id, spec } => {
                    if let Some(w) = self.workers.get_mut(&container_id) {
                        w.has_spec = true;
                        w.send(Cmd::Spec(spec));
                    }
                }
                Supervise::Adopt { owned, spec } => {
                    self.spawn(Start::Adopt(owned), spec.map(|s| *s));
                }
            }
        }
        Ok(removals)
    }

    /// RUN (E-7), as [`pass::runs`] decides: a worker for every desired
    /// instance that has neither a container nor a worker, once its scope's
    /// removals are done (E-6), unless parked (E-9) or fenced (E-10).
    fn start_runs(&mut self, desired: &diff::Desired, batch: &mut Vec<Observation>) -> usize {
        let mut runs = 0;
        let placement = self.placement();
        let board = &mut self.board;
        let steps = pass::runs(
            desired,
            &self.owned,
            &self.workers,
            |id, hash| board.parked(id, hash),
            &self.h.cfg.node_id,
        );
        for step in steps {
            match step {
                Run::NoRuntime { id, config_hash } => {
                    self.board.failed(id, config_hash);
                    batch.push(
                        Observation::new(id, State::Failed)
                            .message("no runtime payload (image/spec) for assignment"),
                    );
                }
                Run::Fenced { id, reason } => {
                    batch.push(Observation::new(id, State::Pending).message(reason));
                }
                Run::Start {
                    id,
                    assignment: a,
                    runtime: rt,
                } => match plan::plan(&mut self.alloc, placement, a, rt) {
                    Ok(plan) => {
                        let spec = rt.spec.clone();
                        self.spawn(Start::Run(Box::new(plan)), spec);
                        runs += 1;
                    }
                    Err(e) => {
                        // A port someone else holds is retried every pass
                        // without counting toward parking: it frees by itself.
                        if !e.is_transient() && self.board.failed(id, &a.config_hash) {
                            tracing::warn!(assignment = %id, "parking after {} failed attempts: {e}", board::MAX_FAILURES);
                        }
                        batch.push(Observation::new(id, State::Failed).message(e.to_string()));
                    }
                },
            }
        }
        runs
    }

    /// What a worker says about its container.
    fn on_report(&mut self, report: Report) {
        let Report {
            container_id,
            event,
        } = report;
        // Every report but an observation follows a change to a container.
        if !matches!(event, Event::Observed(_)) {
            self.listing.changed(&container_id);
            self.settled = None;
        }
        // A status snapshot is all rows: built only when one changed.
        let mut publish = true;
        match event {
            Event::Observed(obs) => {
                // A report of a container no longer ours comes too late.
                publish = self.workers.contains_key(&container_id) && self.board.emit(vec![obs]);
            }
            Event::Up(owned) => {
                if let Some(w) = self.workers.get_mut(&container_id)
                    && w.phase == Phase::Starting
                {
                    w.phase = Phase::Up;
                }
                self.board.succeeded(&owned.assignment_id);
                self.alloc.brought_up(&owned.container_id);
                self.owned.insert(owned.assignment_id.clone(), owned);
                self.apply_firewall();
                self.sync_networks();
            }
            Event::Failed { plan, failure } => {
                self.workers.remove(&container_id);
                let id = plan.assignment_id().to_owned();
                self.alloc.release(&plan.container_id, plan.ip, &plan.ports);
                if self.board.failed(&id, &plan.assignment.config_hash) {
                    tracing::warn!(assignment = %id, "parking after {} failed attempts: {failure}", board::MAX_FAILURES);
                }
                self.board.emit(vec![
                    Observation::new(&id, State::Failed).message(failure.to_string()),
                ]);
                self.apply_firewall();
            }
            Event::Down(o) | Event::Discarded(o) => {
                self.workers.remove(&container_id);
                self.alloc.release(&o.container_id, o.ip, &o.ports);
                if self
                    .owned
                    .get(&o.assignment_id)
                    .is_some_and(|k| k.container_id == o.container_id)
                {
                    self.owned.remove(&o.assignment_id);
                }
                let desired = self.desired().unwrap_or_default();
                let mut batch = Vec::new();
                match desired.get(&o.assignment_id) {
                    // Listed but not RUN: STOPPED, after stop and remove.
                    Some((a, _)) if a.desired != AssignmentDesired::Run as i32 => batch.push(
                        Observation::new(&o.assignment_id, State::Stopped)
                            .container(&o.container_id),
                    ),
                    Some(_) => {}
                    None => {
                        if !self
                            .workers
                            .values()
                            .any(|w| w.assignment_id == o.assignment_id)
                        {
                            self.board.forget(&o.assignment_id);
                        }
                    }
                }
                // The scope may be free for its new instances now.
                self.start_runs(&desired, &mut batch);
                self.board.emit(batch);
                self.apply_firewall();
                self.sync_networks_with(&desired);
            }
            Event::StopFailed { owned, error } => {
                self.workers.remove(&container_id);
                tracing::debug!(container = %owned.container_id, %error, "removal left for the next pass");
            }
        }
        if publish {
            self.publish_status();
        }
    }

    fn placement(&self) -> plan::Placement {
        plan::Placement {
            host_ip: self.h.cfg.host_ip,
            default_subnet: self.h.cfg.default_subnet,
            standalone: self.h.cfg.standalone,
            with_network: self.h.net.is_some(),
        }
    }

    /// Only ports we hold are published; once the host task has the rules
    /// in place, the sockets of the ports they no longer use are closed.
    fn apply_firewall(&mut self) {
        if !self.host.has_network() {
            return;
        }
        let (published, mark) = self.alloc.published(&self.owned);
        self.host.publish(published, mark);
    }

    fn sync_networks(&mut self) {
        let desired = self.desired().unwrap_or_default();
        self.sync_networks_with(&desired);
    }

    /// Tells the host task the networks in use: it removes the others
    /// (N-5), and points DNS at these.
    fn sync_networks_with(&mut self, desired: &diff::Desired) {
        if !self.host.has_network() {
            return;
        }
        // A bring-up in flight uses its network already.
        let starting = self
            .workers
            .values()
            .filter(|w| w.phase == Phase::Starting)
            .filter_map(|w| {
                let (subnet, project_id, environment) = w.network.as_ref()?;
                Some(host::Starting {
                    subnet: *subnet,
                    project_id,
                    environment,
                    scope: &w.scope,
                })
            });
        let in_use =
            host::networks_in_use(desired, &self.owned, starting, self.h.cfg.default_subnet);
        self.host.use_networks(in_use);
    }

    fn publish_status(&self) {
        let desired = self.desired();
        let snapshot = StatusSnapshot {
            node_id: self.h.cfg.node_id.clone(),
            source: self.h.cfg.source.clone(),
            assignments: report::rows(
                desired.as_deref(),
                &self.owned,
                self.workers.values().map(|w| w.assignment_id.as_str()),
                &self.board,
            ),
            errors: self.errors_rx.borrow().clone(),
            notices: Vec::new(),
            passes: self.passes,
        };
        let _ = self.status_tx.send(Arc::new(snapshot));
    }
}

type TaskEvents =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<TaskEvent, RuntimeError>> + Send>>;

/// containerd's task events, subscribed to after `delay`. The wait is the
/// stream's, so the loop goes on serving reports and passes meanwhile.
fn task_events(ctd: &Containerd, delay: Duration) -> TaskEvents {
    let ctd = ctd.clone();
    Box::pin(
        futures::stream::once(tokio::time::sleep(delay))
            .flat_map(move |()| events::subscribe(&ctd)),
    )
}

/// Beyond the longest grace: the SIGKILL wait and the task deletes.
const HALT_SLACK: Duration = Duration::from_secs(5);
