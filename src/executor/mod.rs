//! The executor: converge containerd to the desired `AssignmentSet` and keep
//! it there (runtime.md §4 to §6).
//!
//! One task owns all the bookkeeping (IPAM, host ports, failure counters,
//! crash back-off, health monitors, the status board) and talks to the rest
//! through channels: the desired set arrives on a `watch`, task exits from
//! containerd's event stream, health changes from the monitors, and the
//! status goes out as a snapshot (`status`) and as batches (the control
//! stream). A pass removes (STOP) before it creates (RUN); removals, then
//! bring-ups, run in parallel with a bound, never overlapping each other.

pub mod backoff;
pub mod diff;
pub mod files;
pub mod instance;
pub mod labels;
pub mod status;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use zattera_dns::table::LocalInstance;
use zattera_dns::{DnsServer, ListenerSpec, NameTable, Scope};
use zattera_netns::{
    HostPorts, IpRecord, Ipam, NetNode, PortRange, Proto, PublishedPort, Subnet, SubnetError,
};

use self::instance::{Handles, Plan};
use self::labels::{NamedPort, OwnedContainer};
use self::status::{AssignmentStatus, Observation, SourceError, State, StatusSnapshot};
use crate::health::{self, ExecContext, HealthUpdate, Monitor};
use crate::proto::cluster::{AssignmentRuntime, AssignmentSet};
use crate::proto::v1::{Assignment, AssignmentDesired, Protocol};
use crate::runtime::containers::{self, TaskState};
use crate::runtime::events::{self, TaskEvent};
use crate::runtime::pull::Puller;
use crate::runtime::{Containerd, RuntimeError};

const TICK: Duration = Duration::from_secs(5);
/// Where a standalone manifest's `resources.pids` travels in the spec.
pub const PIDS_LIMIT_KEY: &str = "zattera.dev/pids-limit";
/// Processes per container unless configured (`pids-limit`): contains a
/// fork bomb, and far above what a service needs.
pub const DEFAULT_PIDS_LIMIT: u32 = 4096;
/// Bring-up attempts before an assignment is parked until its hash changes (E-9).
const MAX_FAILURES: u32 = 3;

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
    /// Standalone: requested host ports come from the desired
    /// `Assignment.mesh_port_bindings`, and DNS answers local instances.
    pub standalone: bool,
    /// What `status` says the source is.
    pub source: String,
}

/// Handle to a running executor.
#[derive(Debug, Clone)]
pub struct ExecutorHandle {
    pub desired: watch::Sender<Option<AssignmentSet>>,
    pub source_errors: watch::Sender<Vec<SourceError>>,
    pub status: watch::Receiver<Arc<StatusSnapshot>>,
}

/// Per-assignment bookkeeping that is not in containerd.
#[derive(Debug, Default)]
struct Record {
    observation: Option<Observation>,
    failures: u32,
    failed_hash: String,
    crash: Option<Crash>,
    /// The last back-off delay, so the next one doubles it.
    last_delay: Option<Duration>,
    started_at: Option<Instant>,
    restarts: u32,
    health_warned: bool,
}

/// A service that exited and waits for its back-off to end.
#[derive(Debug, Clone, Copy)]
struct Crash {
    due: Instant,
    exit_code: u32,
}

pub struct Executor {
    h: Handles,
    dns: Option<Arc<DnsServer>>,
    ipam: Ipam,
    ports: HostPorts,
    owned: BTreeMap<String, OwnedContainer>,
    records: HashMap<String, Record>,
    monitors: HashMap<String, Monitor>,
    desired_rx: watch::Receiver<Option<AssignmentSet>>,
    errors_rx: watch::Receiver<Vec<SourceError>>,
    status_tx: watch::Sender<Arc<StatusSnapshot>>,
    batches: Option<mpsc::Sender<Vec<Observation>>>,
    reports_rx: mpsc::UnboundedReceiver<Observation>,
    health_tx: mpsc::Sender<HealthUpdate>,
    health_rx: mpsc::Receiver<HealthUpdate>,
    networks: BTreeSet<Subnet>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("owned", &self.owned.len())
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
        batches: Option<mpsc::Sender<Vec<Observation>>>,
    ) -> (Self, ExecutorHandle) {
        let (desired_tx, desired_rx) = watch::channel(None);
        let (errors_tx, errors_rx) = watch::channel(Vec::new());
        let (status_tx, status_rx) = watch::channel(Arc::new(StatusSnapshot {
            node_id: cfg.node_id.clone(),
            source: cfg.source.clone(),
            ..StatusSnapshot::default()
        }));
        let (reports_tx, reports_rx) = mpsc::unbounded_channel();
        let (health_tx, health_rx) = mpsc::channel(256);
        let puller = Puller::new(ctd.clone(), vec![]);
        let ports = HostPorts::new(cfg.host_port_range);
        let h = Handles {
            ctd,
            puller,
            net,
            cfg: Arc::new(cfg),
            reports: reports_tx,
        };
        let exec = Self {
            h,
            dns,
            ipam: Ipam::default(),
            ports,
            owned: BTreeMap::new(),
            records: HashMap::new(),
            monitors: HashMap::new(),
            desired_rx,
            errors_rx,
            status_tx,
            batches,
            reports_rx,
            health_tx,
            health_rx,
            networks: BTreeSet::new(),
        };
        let handle = ExecutorHandle {
            desired: desired_tx,
            source_errors: errors_tx,
            status: status_rx,
        };
        (exec, handle)
    }

    /// Runs until every handle is dropped.
    pub async fn run(mut self) {
        if let Err(e) = self.boot().await {
            tracing::warn!(error = %e, "boot: could not adopt existing containers; will retry on the next pass");
        }
        let mut events = Box::pin(events::subscribe(&self.h.ctd));
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                changed = self.desired_rx.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    self.reconcile().await;
                }
                _ = self.errors_rx.changed() => self.publish_status(),
                _ = tick.tick() => {
                    self.reconcile().await;
                    self.liveness().await;
                }
                event = events.next() => match event {
                    Some(Ok(e @ TaskEvent::Exited { .. })) if e.is_init_exit() => self.liveness().await,
                    Some(Ok(_)) => {}
                    Some(Err(e)) => {
                        tracing::debug!(error = %e, "task event stream ended; re-subscribing");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        events = Box::pin(events::subscribe(&self.h.ctd));
                    }
                    None => {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        events = Box::pin(events::subscribe(&self.h.ctd));
                    }
                },
                Some(update) = self.health_rx.recv() => self.apply_health(&update),
            }
            self.drain_reports();
        }
        tracing::info!("executor stopped");
    }

    /// Before any source has spoken: adopt what exists, rebuild IPAM, ports
    /// and rules from labels, and restart tasks lost to a crash or a reboot
    /// (C-13), so the node serves again without waiting for anyone.
    async fn boot(&mut self) -> Result<(), RuntimeError> {
        let owned = self.list_owned().await?;
        let records: Vec<IpRecord> = owned
            .iter()
            .filter_map(|o| {
                Some(IpRecord {
                    holder: o.container_id.clone(),
                    ip: o.ip?,
                })
            })
            .collect();
        self.ipam = Ipam::from_records(&records).unwrap_or_default();
        // Every published port is held again before any rule uses it; a
        // container whose port someone took while we were down is removed,
        // and the next pass brings it up again (a fixed port: FAILED until
        // its holder lets go).
        let mut lost = Vec::new();
        for o in owned {
            match self.hold_ports(&o) {
                Ok(()) => {
                    self.owned.insert(o.assignment_id.clone(), o);
                }
                Err(e) => {
                    tracing::warn!(container = %o.container_id, error = %e, "a published port was taken while the agent was down; removing the container");
                    lost.push(o);
                }
            }
        }
        for o in lost {
            match instance::tear_down(&self.h, &o).await {
                Ok(()) => {
                    if let Some(ip) = o.ip {
                        self.ipam.release(&o.container_id, ip);
                    }
                }
                Err(e) => {
                    tracing::warn!(container = %o.container_id, error = %e, "could not remove it; retried next pass");
                }
            }
        }
        self.apply_firewall().await;
        let restart: Vec<OwnedContainer> = self
            .owned
            .values()
            .filter(|o| o.restart && o.exit_code.is_none())
            .cloned()
            .collect();
        for o in restart {
            match containers::task_state(&self.h.ctd, &o.container_id).await {
                Ok(TaskState::Running { .. } | TaskState::Paused) => {
                    self.records
                        .entry(o.assignment_id.clone())
                        .or_default()
                        .started_at = Some(Instant::now());
                }
                Ok(_) => match instance::restart(&self.h, &o).await {
                    Ok(()) => {
                        tracing::info!(container = %o.container_id, "restarted a task lost while the agent was down");
                    }
                    Err(e) => {
                        tracing::warn!(container = %o.container_id, error = %e.0, "could not restart at boot");
                    }
                },
                Err(e) => {
                    tracing::warn!(container = %o.container_id, error = %e, "task state unknown at boot");
                }
            }
        }
        self.sync_networks().await;
        self.publish_status();
        Ok(())
    }

    async fn list_owned(&self) -> Result<Vec<OwnedContainer>, RuntimeError> {
        let listed = containers::list(&self.h.ctd, &labels::OWNED_FILTER).await?;
        Ok(listed
            .iter()
            .filter_map(OwnedContainer::from_container)
            .collect())
    }

    /// The desired set for this node (E-4), by assignment id.
    fn desired(&self) -> Option<diff::Desired> {
        let set = self.desired_rx.borrow().clone()?;
        Some(diff::desired_for(set, &self.h.cfg.node_id))
    }

    /// One pass: classify, STOP, RUN, report, wire health, tidy networks.
    async fn reconcile(&mut self) {
        let Some(desired) = self.desired() else {
            return;
        };
        let listed = match self.list_owned().await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "reconcile abandoned: cannot list containers");
                return;
            }
        };
        // Classify (E-5); duplicates of one assignment are removed (E-2 deviation).
        let classified = diff::classify(&desired, listed);
        let mut batch = classified.stopped;
        let removals = classified.removals;
        self.owned = classified.owned;

        // STOP pass: every removal ends before any creation starts (E-6).
        for r in &removals {
            if !self.owned.contains_key(&r.assignment_id) {
                self.monitors.remove(&r.assignment_id);
            }
        }
        let h = &self.h;
        let parallel = self.h.cfg.parallelism.max(1);
        let removed: Vec<(OwnedContainer, Result<(), String>)> = futures::stream::iter(removals)
            .map(|o| async move {
                let r = instance::tear_down(h, &o).await;
                (o, r)
            })
            .buffer_unordered(parallel)
            .collect()
            .await;
        for (o, result) in removed {
            match result {
                Ok(()) => self.release(&o),
                Err(e) => {
                    tracing::warn!(container = %o.container_id, error = %e, "removal failed; retried next pass");
                }
            }
            if !desired.contains_key(&o.assignment_id) {
                self.records.remove(&o.assignment_id);
            }
        }

        // RUN pass: plan (allocations happen here, in one place), then bring up.
        let mut plans = Vec::new();
        for (id, (a, rt)) in &desired {
            if a.desired != AssignmentDesired::Run as i32 || self.owned.contains_key(id) {
                continue;
            }
            let record = self.records.entry(id.clone()).or_default();
            if record.failed_hash != a.config_hash {
                record.failures = 0;
            }
            if record.failures >= MAX_FAILURES {
                continue; // parked until the hash changes (E-9)
            }
            let Some(rt) = rt else {
                record.failures += 1;
                record.failed_hash.clone_from(&a.config_hash);
                batch.push(
                    Observation::new(id, State::Failed)
                        .message("no runtime payload (image/spec) for assignment"),
                );
                continue;
            };
            if let Some(reason) = fencing(a, rt, &self.h.cfg.node_id) {
                batch.push(Observation::new(id, State::Pending).message(reason));
                continue;
            }
            match self.plan(a, rt) {
                Ok(plan) => plans.push(plan),
                Err(e) => {
                    // A port someone else holds is retried every pass
                    // without counting toward parking: it frees by itself.
                    if !e.is_transient() {
                        let record = self.records.entry(id.clone()).or_default();
                        record.failures += 1;
                        record.failed_hash.clone_from(&a.config_hash);
                    }
                    batch.push(Observation::new(id, State::Failed).message(e.to_string()));
                }
            }
        }
        let h = &self.h;
        let results: Vec<(Plan, Result<OwnedContainer, instance::Failure>)> =
            futures::stream::iter(plans)
                .map(|p| async move {
                    let r = instance::bring_up(h, &p).await;
                    (p, r)
                })
                .buffer_unordered(parallel)
                .collect()
                .await;
        let mut results = results;
        results.sort_by(|a, b| a.0.assignment_id().cmp(b.0.assignment_id()));
        for (plan, result) in results {
            let id = plan.assignment_id().to_owned();
            let record = self.records.entry(id.clone()).or_default();
            match result {
                Ok(owned) => {
                    record.failures = 0;
                    record.failed_hash.clear();
                    record.crash = None;
                    record.started_at = Some(Instant::now());
                    batch.push(running(&owned));
                    self.owned.insert(id, owned);
                }
                Err(failure) => {
                    record.failures += 1;
                    record.failed_hash.clone_from(&plan.assignment.config_hash);
                    if record.failures >= MAX_FAILURES {
                        tracing::warn!(assignment = %id, "parking after {MAX_FAILURES} failed attempts: {}", failure.0);
                    }
                    if let Some(ip) = plan.ip {
                        self.ipam.release(&plan.container_id, ip);
                    }
                    for p in &plan.ports {
                        self.ports
                            .release(p.port.proto, p.port.host_ip, p.port.host_port);
                    }
                    batch.push(Observation::new(&id, State::Failed).message(failure.0));
                }
            }
        }

        // One batch for the pass, before health registration (E-11).
        self.drain_reports();
        self.emit(batch);
        self.wire_health(&desired);
        self.apply_firewall().await;
        self.sync_networks_with(&desired).await;
        self.publish_status();
    }

    /// Allocates what a bring-up needs: container id, IP, host ports.
    fn plan(&mut self, a: &Assignment, rt: &AssignmentRuntime) -> Result<Plan, PlanError> {
        let id = a.meta.as_ref().map(|m| m.id.clone()).unwrap_or_default();
        let container_id = labels::container_id(&id, &a.config_hash);
        let subnet = if rt.subnet_cidr.is_empty() {
            None
        } else {
            Some(rt.subnet_cidr.parse::<Subnet>()?)
        };
        let spec = rt.spec.clone().unwrap_or_default();
        for p in &spec.ports {
            if u16::try_from(p.container_port).is_err() {
                return Err(PlanError::ContainerPort {
                    name: p.name.clone(),
                    port: p.container_port,
                });
            }
        }
        let ip = match (subnet, &self.h.net) {
            (Some(s), Some(_)) => Some(
                self.ipam
                    .allocate(s, &container_id)
                    .map_err(|e| PlanError::Ipam(Box::new(e)))?,
            ),
            _ => None,
        };
        let mut ports = Vec::new();
        for p in &spec.ports {
            let Some(container_ip) = ip else { break };
            let proto = if p.protocol == Protocol::Udp as i32 {
                Proto::Udp
            } else {
                Proto::Tcp
            };
            let requested = if self.h.cfg.standalone {
                a.mesh_port_bindings
                    .get(&p.name)
                    .and_then(|v| u16::try_from(*v).ok())
                    .filter(|v| *v > 0)
            } else {
                None
            };
            let allocated = self.ports.allocate(proto, self.h.cfg.host_ip, requested);
            let host_port = match allocated {
                Ok(port) => port,
                Err(e) => {
                    // Undo this plan's allocations before failing it.
                    for done in &ports {
                        let done: &NamedPort = done;
                        self.ports
                            .release(done.port.proto, done.port.host_ip, done.port.host_port);
                    }
                    if let Some(ip) = ip {
                        self.ipam.release(&container_id, ip);
                    }
                    return Err(PlanError::HostPort {
                        name: p.name.clone(),
                        source: Box::new(e),
                    });
                }
            };
            ports.push(NamedPort {
                name: p.name.clone(),
                port: PublishedPort {
                    proto,
                    host_ip: self.h.cfg.host_ip,
                    host_port,
                    container_ip,
                    container_port: u16::try_from(p.container_port).unwrap_or_default(),
                },
            });
        }
        Ok(Plan {
            assignment: a.clone(),
            runtime: rt.clone(),
            container_id,
            subnet,
            ip,
            ports,
        })
    }

    /// Removes a container that cannot be restarted (its rootfs or record is
    /// damaged), so that the next RUN pass creates it afresh.
    async fn discard(&mut self, o: &OwnedContainer) {
        match instance::tear_down(&self.h, o).await {
            Ok(()) => {
                self.release(o);
                self.owned.remove(&o.assignment_id);
                self.monitors.remove(&o.assignment_id);
            }
            Err(e) => {
                tracing::warn!(container = %o.container_id, error = %e, "could not remove a broken container");
            }
        }
    }

    /// Holds every host port a container publishes (its record, at start).
    fn hold_ports(&mut self, o: &OwnedContainer) -> Result<(), zattera_netns::Error> {
        for (i, p) in o.ports.iter().enumerate() {
            if let Err(e) = self
                .ports
                .hold(p.port.proto, p.port.host_ip, p.port.host_port)
            {
                for done in &o.ports[..i] {
                    self.ports
                        .release(done.port.proto, done.port.host_ip, done.port.host_port);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    fn release(&mut self, o: &OwnedContainer) {
        if let Some(ip) = o.ip {
            self.ipam.release(&o.container_id, ip);
        }
        for p in &o.ports {
            self.ports
                .release(p.port.proto, p.port.host_ip, p.port.host_port);
        }
    }

    /// L-1: inspect every owned container; restart crashed services with
    /// back-off (C-13), report jobs' exits (L-5).
    async fn liveness(&mut self) {
        let mut batch = Vec::new();
        let owned: Vec<OwnedContainer> = self.owned.values().cloned().collect();
        for o in owned {
            let state = match containers::task_state(&self.h.ctd, &o.container_id).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(container = %o.container_id, error = %e, "inspect failed; skipped");
                    continue;
                }
            };
            let id = o.assignment_id.clone();
            let record = self.records.entry(id.clone()).or_default();
            match state {
                TaskState::Running { .. } | TaskState::Paused => {
                    record.crash = None;
                    let current = record.observation.as_ref().map(|obs| obs.state);
                    if !matches!(current, Some(State::Healthy | State::Unhealthy)) {
                        batch.push(running(&o));
                    }
                }
                TaskState::Stopped { exit_code: code } if !o.restart => {
                    let obs = if code == 0 {
                        Observation::new(&id, State::Stopped).container(&o.container_id)
                    } else {
                        let mut f = Observation::new(&id, State::Failed)
                            .container(&o.container_id)
                            .message(format!("exited with code {code}"));
                        f.exit_code = i32::try_from(code).ok();
                        f
                    };
                    if o.exit_code.is_none() {
                        let labels =
                            HashMap::from([(labels::EXIT_CODE.to_owned(), code.to_string())]);
                        let _ = containers::add_labels(&self.h.ctd, &o.container_id, labels).await;
                    }
                    batch.push(obs);
                }
                TaskState::Stopped { exit_code } => {
                    let now = Instant::now();
                    let crash = *record.crash.get_or_insert_with(|| {
                        let ran = record.started_at.map_or(Duration::ZERO, |s| now.duration_since(s));
                        let delay = backoff::next_delay(record.last_delay, ran);
                        record.last_delay = Some(delay);
                        tracing::info!(container = %o.container_id, exit_code, ?delay, "service exited; restarting after back-off");
                        Crash { due: now + delay, exit_code }
                    });
                    if now >= crash.due {
                        match instance::restart(&self.h, &o).await {
                            Ok(()) => {
                                let record = self.records.entry(id.clone()).or_default();
                                record.crash = None;
                                record.restarts += 1;
                                record.started_at = Some(Instant::now());
                                batch.push(running(&o));
                                continue;
                            }
                            Err(e) => {
                                tracing::warn!(container = %o.container_id, error = %e.0, "restart failed; re-creating the container");
                                self.discard(&o).await;
                            }
                        }
                    }
                    let mut f = Observation::new(&id, State::Failed)
                        .container(&o.container_id)
                        .message(format!("crash-looping: last exit code {}", crash.exit_code));
                    f.exit_code = i32::try_from(crash.exit_code).ok();
                    batch.push(f);
                }
                TaskState::Absent | TaskState::Created => {
                    // Lost (reboot) or never started: bring the task back now.
                    if let Err(e) = instance::restart(&self.h, &o).await {
                        tracing::warn!(container = %o.container_id, error = %e.0, "could not start a missing task; re-creating the container");
                        self.discard(&o).await;
                    }
                }
            }
        }
        self.emit(batch);
        self.publish_status();
    }

    fn apply_health(&mut self, update: &HealthUpdate) {
        if !self.owned.contains_key(&update.assignment_id) {
            return;
        }
        let mut obs =
            Observation::new(&update.assignment_id, update.state).container(&update.container_id);
        obs.restarts = self
            .records
            .get(&update.assignment_id)
            .map_or(0, |r| r.restarts);
        if let Some(o) = self.owned.get(&update.assignment_id) {
            obs.ports = port_bindings(o);
        }
        self.emit(vec![obs]);
        self.update_dns_table();
        self.publish_status();
    }

    /// E-13: prune monitors of what is not live, ensure one for what is.
    fn wire_health(&mut self, desired: &BTreeMap<String, (Assignment, Option<AssignmentRuntime>)>) {
        self.monitors.retain(|id, m| {
            self.owned
                .get(id)
                .is_some_and(|o| o.container_id == m.container_id)
        });
        for (id, o) in &self.owned {
            if self.monitors.contains_key(id) {
                continue;
            }
            let spec = desired
                .get(id)
                .and_then(|(_, rt)| rt.as_ref())
                .and_then(|rt| rt.spec.as_ref());
            let record = self.records.entry(id.clone()).or_default();
            let Some((probe, timing)) = health::resolve(spec, o.ip, &o.container_id) else {
                if !record.health_warned {
                    tracing::warn!(assignment = %id, "health check target not resolvable yet (no IP or port)");
                    record.health_warned = true;
                }
                continue;
            };
            record.health_warned = false;
            let ctx = ExecContext {
                ctd: self.h.ctd.clone(),
                fifo_dir: self.h.cfg.run_dir.join("exec"),
            };
            let monitor = health::spawn(
                id.clone(),
                o.container_id.clone(),
                probe,
                timing,
                ctx,
                self.health_tx.clone(),
            );
            self.monitors.insert(id.clone(), monitor);
        }
    }

    /// The whole rule set, from the owned containers (published ports) and
    /// the networks in use.
    /// Only ports we hold are published; once the rules are in place, the
    /// sockets of the ports they no longer use are closed.
    async fn apply_firewall(&mut self) {
        let Some(net) = &self.h.net else { return };
        let published: Vec<PublishedPort> = self
            .owned
            .values()
            .flat_map(|o| o.ports.iter().map(|p| p.port))
            .filter(|p| self.ports.is_held(p.proto, p.host_ip, p.host_port))
            .collect();
        match net.set_published(published).await {
            Ok(()) => self.ports.retire(),
            Err(e) => tracing::warn!(error = %e, "publishing ports failed"),
        }
    }

    async fn sync_networks(&mut self) {
        let desired = self.desired().unwrap_or_default();
        self.sync_networks_with(&desired).await;
    }

    /// Removes networks nothing uses (N-5), and points DNS at the rest.
    async fn sync_networks_with(
        &mut self,
        desired: &BTreeMap<String, (Assignment, Option<AssignmentRuntime>)>,
    ) {
        let Some(net) = self.h.net.clone() else {
            return;
        };
        let mut in_use: BTreeMap<Subnet, (String, String)> = BTreeMap::new();
        for o in self.owned.values() {
            if let Some(s) = o.subnet {
                in_use.insert(s, (o.project_id.clone(), o.environment_name.clone()));
            }
        }
        for (a, rt) in desired.values() {
            if let Some(s) = rt
                .as_ref()
                .and_then(|rt| rt.subnet_cidr.parse::<Subnet>().ok())
                && a.desired == AssignmentDesired::Run as i32
                && self
                    .owned
                    .contains_key(a.meta.as_ref().map_or("", |m| m.id.as_str()))
            {
                let env = rt
                    .as_ref()
                    .and_then(|rt| rt.env.get("ZATTERA_ENV"))
                    .unwrap_or(&a.environment_id);
                in_use.insert(s, (a.project_id.clone(), env.clone()));
            }
        }
        let existing: BTreeSet<Subnet> = match zattera_netns::inventory::read(&net).await {
            Ok(inv) => inv
                .bridges
                .iter()
                .filter(|b| b.scope.is_some())
                .map(|b| b.subnet)
                .collect(),
            Err(_) => self.networks.clone(),
        };
        for subnet in existing.difference(&in_use.keys().copied().collect()) {
            match net.remove_network(*subnet).await {
                Ok(()) => tracing::info!(%subnet, "removed a network nothing uses"),
                Err(e) => tracing::debug!(%subnet, error = %e, "network not removed yet"),
            }
        }
        self.networks = in_use.keys().copied().collect();
        if let Some(dns) = &self.dns {
            let specs = in_use
                .iter()
                .map(|(s, (project, env))| ListenerSpec {
                    addr: s.gateway().into(),
                    scope: Scope::new(project.clone(), env.clone()),
                })
                .collect();
            for status in dns.reconcile(specs).await {
                if !status.is_serving() {
                    tracing::warn!(addr = %status.addr, state = ?status.state, "DNS listener not serving");
                }
            }
        }
        self.update_dns_table();
    }

    /// Standalone: internal names answer the healthy local instances.
    fn update_dns_table(&self) {
        let (Some(dns), true) = (&self.dns, self.h.cfg.standalone) else {
            return;
        };
        let healthy: Vec<LocalInstance> = self
            .owned
            .values()
            .filter(|o| {
                self.records
                    .get(&o.assignment_id)
                    .and_then(|r| r.observation.as_ref())
                    .is_some_and(|obs| obs.state == State::Healthy)
            })
            .filter_map(|o| {
                Some(LocalInstance {
                    project_id: o.project_id.clone(),
                    project_name: o.project_id.clone(),
                    environment: o.environment_name.clone(),
                    app: o.app_name.clone(),
                    ip: o.ip?,
                })
            })
            .collect();
        dns.set_table(NameTable::from_instances(&healthy));
    }

    fn drain_reports(&mut self) {
        let mut early = Vec::new();
        while let Ok(obs) = self.reports_rx.try_recv() {
            early.push(obs);
        }
        for obs in early {
            self.emit(vec![obs]);
        }
    }

    /// Records observations and sends them as one batch.
    fn emit(&mut self, batch: Vec<Observation>) {
        if batch.is_empty() {
            return;
        }
        for obs in &batch {
            let record = self.records.entry(obs.assignment_id.clone()).or_default();
            let mut obs = obs.clone();
            obs.restarts = record.restarts;
            // A HEALTHY or UNHEALTHY verdict is not overwritten by RUNNING (S-10).
            let keep = obs.state == State::Running
                && record.observation.as_ref().is_some_and(|prev| {
                    matches!(prev.state, State::Healthy | State::Unhealthy)
                        && prev.container_id == obs.container_id
                });
            if !keep {
                record.observation = Some(obs);
            }
        }
        if let Some(tx) = &self.batches {
            let _ = tx.try_send(batch);
        }
        self.update_dns_table();
    }

    fn publish_status(&self) {
        let desired = self.desired();
        let mut rows = Vec::new();
        let ids: BTreeSet<String> = desired
            .as_ref()
            .map(|d| d.keys().cloned().collect::<BTreeSet<_>>())
            .unwrap_or_default()
            .into_iter()
            .chain(self.owned.keys().cloned())
            .collect();
        for id in ids {
            let a = desired.as_ref().and_then(|d| d.get(&id)).map(|(a, _)| a);
            let o = self.owned.get(&id);
            let obs = self.records.get(&id).and_then(|r| r.observation.as_ref());
            rows.push(AssignmentStatus {
                id: id.clone(),
                project: a
                    .map(|a| a.project_id.clone())
                    .or_else(|| o.map(|o| o.project_id.clone()))
                    .unwrap_or_default(),
                app: a
                    .map(|a| a.app_id.clone())
                    .or_else(|| o.map(|o| o.app_id.clone()))
                    .unwrap_or_default(),
                environment: a
                    .map(|a| a.environment_id.clone())
                    .or_else(|| o.map(|o| o.environment_id.clone()))
                    .unwrap_or_default(),
                state: obs.map_or(State::Pending, |obs| obs.state),
                container_id: o
                    .map(|o| o.container_id.clone())
                    .or_else(|| obs.map(|obs| obs.container_id.clone()))
                    .unwrap_or_default(),
                ip: o
                    .and_then(|o| o.ip)
                    .map(|ip| ip.to_string())
                    .unwrap_or_default(),
                ports: o.map(port_bindings).unwrap_or_default(),
                restarts: self.records.get(&id).map_or(0, |r| r.restarts),
                message: obs.map(|obs| obs.message.clone()).unwrap_or_default(),
            });
        }
        let snapshot = StatusSnapshot {
            node_id: self.h.cfg.node_id.clone(),
            source: self.h.cfg.source.clone(),
            assignments: rows,
            errors: self.errors_rx.borrow().clone(),
        };
        let _ = self.status_tx.send(Arc::new(snapshot));
    }
}

/// The status as containerd alone shows it, for `status` while the agent
/// is down (DESIGN decision 8): owned containers and their task states.
pub async fn offline_status(ctd: &Containerd, why: &str) -> Result<StatusSnapshot, RuntimeError> {
    let listed = containers::list(ctd, &labels::OWNED_FILTER).await?;
    let mut rows = Vec::new();
    for o in listed.iter().filter_map(OwnedContainer::from_container) {
        let (state, message) = match containers::task_state(ctd, &o.container_id).await? {
            TaskState::Running { .. } | TaskState::Paused => (State::Running, String::new()),
            TaskState::Stopped { exit_code: 0 } => {
                (State::Stopped, "exited with code 0".to_owned())
            }
            TaskState::Stopped { exit_code } => {
                (State::Failed, format!("exited with code {exit_code}"))
            }
            TaskState::Absent | TaskState::Created => {
                (State::Pending, "no task (the agent starts it)".to_owned())
            }
        };
        rows.push(AssignmentStatus {
            id: o.assignment_id.clone(),
            project: o.project_id.clone(),
            app: o.app_name.clone(),
            environment: o.environment_name.clone(),
            state,
            container_id: o.container_id.clone(),
            ip: o.ip.map(|ip| ip.to_string()).unwrap_or_default(),
            ports: port_bindings(&o),
            restarts: 0,
            message,
        });
    }
    rows.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(StatusSnapshot {
        node_id: String::new(),
        source: format!("containerd only (agent not running: {why})"),
        assignments: rows,
        errors: Vec::new(),
    })
}

/// Why an assignment could not be planned; the text is its FAILED message.
#[derive(Debug, thiserror::Error)]
enum PlanError {
    #[error("ensure network: {0}")]
    Subnet(#[from] SubnetError),
    #[error("ensure network: {0}")]
    Ipam(Box<zattera_netns::Error>),
    #[error("create: port {name}: {source}")]
    HostPort {
        name: String,
        source: Box<zattera_netns::Error>,
    },
    #[error("create: port {name}: container_port {port} is not a port")]
    ContainerPort { name: String, port: u32 },
}

impl PlanError {
    /// Retried every pass without counting toward parking (E-9): a host
    /// port held by another process frees by itself.
    fn is_transient(&self) -> bool {
        matches!(self, Self::HostPort { source, .. } if source.is_port_in_use())
    }
}

/// E-12: port name → host port, skipping unnamed or unpublished ports.
fn port_bindings(o: &OwnedContainer) -> BTreeMap<String, u16> {
    o.ports
        .iter()
        .filter(|p| !p.name.is_empty() && p.port.host_port > 0)
        .map(|p| (p.name.clone(), p.port.host_port))
        .collect()
}

fn running(o: &OwnedContainer) -> Observation {
    let mut obs = Observation::new(&o.assignment_id, State::Running).container(&o.container_id);
    obs.ports = port_bindings(o);
    obs
}

/// E-10: the reason a stateful assignment must wait, if it must.
fn fencing(a: &Assignment, rt: &AssignmentRuntime, node_id: &str) -> Option<String> {
    let spec = rt.spec.as_ref()?;
    if !spec.stateful || spec.volumes.is_empty() {
        return None;
    }
    let id = a.meta.as_ref().map_or("", |m| m.id.as_str());
    match &rt.volume_lease {
        None => Some("waiting for volume lease".into()),
        Some(lease) if lease.node_id != node_id => {
            Some(format!("volume leased to another node ({})", lease.node_id))
        }
        Some(lease) if lease.assignment_id != id => {
            Some("volume leased to another instance".into())
        }
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::v1::{Meta, ServiceSpec, VolumeLease, VolumeMount};

    fn stateful(lease: Option<VolumeLease>) -> (Assignment, AssignmentRuntime) {
        let a = Assignment {
            meta: Some(Meta {
                id: "a1".into(),
                ..Meta::default()
            }),
            ..Assignment::default()
        };
        let rt = AssignmentRuntime {
            spec: Some(ServiceSpec {
                stateful: true,
                volumes: vec![VolumeMount {
                    volume_name: "data".into(),
                    mount_path: "/data".into(),
                }],
                ..ServiceSpec::default()
            }),
            volume_lease: lease,
            ..AssignmentRuntime::default()
        };
        (a, rt)
    }

    #[test]
    fn fencing_follows_e10() {
        let (a, rt) = stateful(None);
        assert_eq!(
            fencing(&a, &rt, "n1").as_deref(),
            Some("waiting for volume lease")
        );
        let lease = |node: &str, id: &str| VolumeLease {
            node_id: node.into(),
            assignment_id: id.into(),
            ..VolumeLease::default()
        };
        let (a, rt) = stateful(Some(lease("n2", "a1")));
        assert_eq!(
            fencing(&a, &rt, "n1").as_deref(),
            Some("volume leased to another node (n2)")
        );
        let (a, rt) = stateful(Some(lease("n1", "a2")));
        assert_eq!(
            fencing(&a, &rt, "n1").as_deref(),
            Some("volume leased to another instance")
        );
        let (a, rt) = stateful(Some(lease("n1", "a1")));
        assert_eq!(fencing(&a, &rt, "n1"), None);
        let (a, mut rt) = stateful(None);
        rt.spec.as_mut().unwrap().stateful = false;
        assert_eq!(
            fencing(&a, &rt, "n1"),
            None,
            "only stateful services with volumes are fenced"
        );
    }
}
