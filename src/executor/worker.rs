//! One worker per container, the way kubelet runs one pod worker per pod: it
//! owns that container's bring-up, its supervision (exits, crash back-off,
//! the health monitor) and its teardown, and reports back to the executor
//! loop, which owns everything shared (IPAM, host ports, the status board,
//! what it wants of the host). A worker holds a lease on its network for
//! its life. The loop never waits on a container: a stalled
//! pull or a long stop grace holds only its own worker.
//!
//! A worker starts with what it is for ([`Start`]) and afterwards takes only
//! [`Cmd`]s: a later desire for another config is another container, hence
//! another worker; `Stop` is final.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;

use super::backoff;
use super::instance::{Failure, Plan, RestartFailure, TeardownError};
use super::instances::Instances;
use super::leases::NetworkLeases;
use crate::health::{self, HealthUpdate, Monitor};
use crate::labels::{self, OwnedContainer};
use crate::proto::v1::ServiceSpec;
use crate::runtime::containers::TaskState;
use crate::status::{Observation, State};

/// The liveness tick (L-1): every instance is reported on each one.
const POLL: Duration = Duration::from_secs(5);
/// While containerd's task event stream holds, exits arrive as events, and
/// a running task is read from containerd only this often (plus up to
/// [`SWEEP_JITTER`], so that a thousand reads do not fall on one tick):
/// the read catches what no event says (an event lost). The attachment is
/// still checked every tick (a statfs and one netlink request, no trip
/// through containerd to the shim). At 1,000 instances the 5 s read of every task was 200
/// task reads a second through containerd to the shims, most of the
/// agent's CPU at rest. A changed stream generation (events may have been
/// lost) makes every worker read at its next tick.
const SWEEP: Duration = Duration::from_secs(30);
const SWEEP_JITTER: Duration = Duration::from_secs(5);
/// Health updates queued for a worker (a monitor sends one per change).
const HEALTH_QUEUE: usize = 8;

/// What a worker is spawned for.
#[derive(Debug)]
pub(super) enum Start {
    /// Bring up a planned instance, then supervise it.
    Run(Box<Plan>),
    /// Supervise a container that already exists (adopted at start, or
    /// found by a pass), restarting a lost task at once (C-13).
    Adopt(OwnedContainer),
    /// Only remove it (a stale hash, a duplicate, an undesired one).
    Remove(OwnedContainer),
}

/// What the loop tells a running worker.
#[derive(Debug)]
pub(super) enum Cmd {
    /// Stop and remove the container; the worker ends with `Down`.
    Stop,
    /// The task's init process exited (from containerd's event stream).
    Exited,
    /// containerd saw the OOM killer act in the task.
    Oom,
    /// The service's current spec: a monitor is started if there is none.
    Spec(Option<Box<ServiceSpec>>),
    /// The host is going down: stop the task with its grace, keep the
    /// container (the next boot restarts it), answer, end.
    Halt(tokio::sync::oneshot::Sender<()>),
}

/// What a worker tells the loop, for its container.
#[derive(Debug)]
pub(super) enum Event {
    Observed(Observation),
    /// Created and started (Run), or adopted and running or restarted.
    Up(OwnedContainer),
    /// Bring-up failed; nothing it made is left behind.
    Failed {
        plan: Box<Plan>,
        failure: Failure,
    },
    /// Stopped and removed.
    Down(OwnedContainer),
    /// Removal failed; the container is left as it is (the next pass asks
    /// again).
    StopFailed {
        owned: OwnedContainer,
        error: TeardownError,
    },
    /// It could not be restarted (damaged rootfs or record) and was removed,
    /// so that the next pass makes it afresh.
    Discarded(OwnedContainer),
}

#[derive(Debug)]
pub(super) struct Report {
    pub container_id: String,
    pub event: Event,
}

/// What every worker shares.
#[derive(Debug, Clone)]
pub(super) struct Ctx {
    pub instances: Arc<dyn Instances>,
    /// Bring-ups and removals running at once.
    pub slots: Arc<Semaphore>,
    pub reports: mpsc::UnboundedSender<Report>,
    /// The networks the workers are on: the host removes none of them.
    pub leases: NetworkLeases,
    /// The task event stream's generation, bumped whenever it ends (and
    /// events may have been missed).
    pub events: tokio::sync::watch::Receiver<u64>,
}

/// Where the loop is with a worker (it learns it from the reports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    Starting,
    Up,
    Stopping,
}

/// The loop's handle on one worker.
#[derive(Debug)]
pub(super) struct Worker {
    pub assignment_id: String,
    /// `network_name` of its project and environment: STOP before RUN
    /// holds per scope.
    pub scope: String,
    /// Its network (subnet, project id, environment name): in use while it
    /// comes up, before the loop keeps its container.
    pub network: Option<(zattera_netns::Subnet, String, String)>,
    pub phase: Phase,
    /// Whether the worker was given its service spec (for the monitor).
    pub has_spec: bool,
    cmds: mpsc::UnboundedSender<Cmd>,
}

impl Worker {
    /// Spawns the worker for `container_id`.
    pub fn spawn(
        ctx: Ctx,
        container_id: String,
        assignment_id: String,
        scope: String,
        start: Start,
        spec: Option<ServiceSpec>,
    ) -> Self {
        let phase = match start {
            Start::Run(_) => Phase::Starting,
            Start::Adopt(_) => Phase::Up,
            Start::Remove(_) => Phase::Stopping,
        };
        let network = match &start {
            Start::Run(p) => p.subnet.map(|s| {
                (
                    s,
                    p.assignment.project_id.clone(),
                    p.environment_name().to_owned(),
                )
            }),
            Start::Adopt(o) | Start::Remove(o) => o
                .subnet
                .map(|s| (s, o.project_id.clone(), o.environment_name.clone())),
        };
        // A bring-up is handed its spec (or the lack of one) with the plan;
        // an adopted container waits for the desired set to say.
        let has_spec = matches!(start, Start::Run(_)) || spec.is_some();
        // Taken before the worker runs, so that no removal starts on a want
        // that predates it; held for the worker's life.
        let lease = network.as_ref().map(|(s, _, _)| ctx.leases.lease(*s));
        let (cmds, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            if let Some(lease) = &lease {
                lease.ready().await;
            }
            run(ctx, container_id, start, spec, rx).await;
            drop(lease);
        });
        Self {
            assignment_id,
            scope,
            network,
            phase,
            has_spec,
            cmds,
        }
    }

    pub fn send(&self, cmd: Cmd) {
        let _ = self.cmds.send(cmd);
    }

    /// Asks the worker to stop and remove its container (once).
    pub fn stop(&mut self) {
        if self.phase != Phase::Stopping {
            self.phase = Phase::Stopping;
            self.send(Cmd::Stop);
        }
    }
}

async fn run(
    ctx: Ctx,
    container_id: String,
    start: Start,
    spec: Option<ServiceSpec>,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
) {
    let report = |event| {
        let _ = ctx.reports.send(Report {
            container_id: container_id.clone(),
            event,
        });
    };
    match start {
        Start::Run(plan) => {
            let progress = |obs| report(Event::Observed(obs));
            let result = {
                let _slot = ctx.slots.acquire().await;
                ctx.instances.bring_up(&plan, &progress).await
            };
            match result {
                Ok(owned) => {
                    report(Event::Up(owned.clone()));
                    let mut s = Supervisor::new(&ctx, owned, spec, true);
                    s.report_running();
                    s.start_monitor();
                    s.supervise(&mut cmds).await;
                }
                Err(failure) => report(Event::Failed { plan, failure }),
            }
        }
        Start::Adopt(owned) => {
            let known = spec.is_some();
            let mut s = Supervisor::new(&ctx, owned, spec, known);
            if s.adopt().await {
                s.supervise(&mut cmds).await;
            }
        }
        Start::Remove(owned) => remove(&ctx, owned).await,
    }
}

/// Stops and removes `owned`, reporting `Down` or `StopFailed`.
async fn remove(ctx: &Ctx, owned: OwnedContainer) {
    let result = {
        let _slot = ctx.slots.acquire().await;
        ctx.instances.tear_down(&owned).await
    };
    let container_id = owned.container_id.clone();
    let event = match result {
        Ok(()) => Event::Down(owned),
        Err(error) => {
            tracing::warn!(container = %container_id, %error, "removal failed; retried next pass");
            Event::StopFailed { owned, error }
        }
    };
    let _ = ctx.reports.send(Report {
        container_id,
        event,
    });
}

/// A service that exited, or whose restart failed for a reason that may
/// pass, and waits for its back-off to end.
#[derive(Debug, Clone)]
struct Crash {
    due: Instant,
    /// The exit code, when the task exited.
    exit_code: Option<u32>,
    /// Its FAILED message: "crash-looping: last exit code N", "out of memory
    /// (limit N MiB)", or the restart's failure.
    why: String,
}

/// The supervision of one running container.
struct Supervisor<'a> {
    ctx: &'a Ctx,
    owned: OwnedContainer,
    spec: Option<ServiceSpec>,
    /// Whether `spec` is the desired set's word. An adopted container is
    /// known only by its labels, which carry no health check: until the
    /// spec comes it has no monitor and stays RUNNING, never HEALTHY on a
    /// check that was never run (H-11).
    spec_known: bool,
    monitor: Option<Monitor>,
    health_tx: mpsc::Sender<HealthUpdate>,
    health_rx: mpsc::Receiver<HealthUpdate>,
    crash: Option<Crash>,
    last_delay: Option<Duration>,
    started_at: Instant,
    restarts: u32,
    health_warned: bool,
    /// An OOM event for the current task (the cgroup is asked too).
    oom_seen: bool,
    /// When a read last found the task running, the event stream's
    /// generation then, and the task's pid: until the sweep is due the task
    /// is taken to be running, as no exit event came.
    read_running: Option<(Instant, u64, u32)>,
    /// This worker's sweep period ([`SWEEP`] and its share of the jitter).
    sweep: Duration,
}

impl<'a> Supervisor<'a> {
    fn new(
        ctx: &'a Ctx,
        owned: OwnedContainer,
        spec: Option<ServiceSpec>,
        spec_known: bool,
    ) -> Self {
        let (health_tx, health_rx) = mpsc::channel(HEALTH_QUEUE);
        let restarts = owned.restarts;
        Self {
            ctx,
            owned,
            spec,
            spec_known,
            monitor: None,
            health_tx,
            health_rx,
            crash: None,
            last_delay: None,
            started_at: Instant::now(),
            restarts,
            health_warned: false,
            oom_seen: false,
            read_running: None,
            sweep: SWEEP
                + Duration::from_millis(rand::random_range(
                    0..=u64::try_from(SWEEP_JITTER.as_millis()).unwrap_or(0),
                )),
        }
    }

    /// The task's pid when it is known to run without asking containerd:
    /// a read found it running within the sweep, under the same event
    /// stream, and no crash is pending.
    fn known_running(&self) -> Option<u32> {
        let (at, generation, pid) = self.read_running?;
        (self.crash.is_none()
            && generation == *self.ctx.events.borrow()
            && at.elapsed() < self.sweep)
            .then_some(pid)
    }

    fn report(&self, event: Event) {
        let _ = self.ctx.reports.send(Report {
            container_id: self.owned.container_id.clone(),
            event,
        });
    }

    fn observe(&self, state: State) -> Observation {
        let mut obs =
            Observation::new(&self.owned.assignment_id, state).container(&self.owned.container_id);
        obs.ports = super::report::port_bindings(&self.owned);
        obs.restarts = self.restarts;
        obs
    }

    fn report_running(&self) {
        self.report(Event::Observed(self.observe(State::Running)));
    }

    /// A fresh monitor (H-1) for the current task: a restarted instance is
    /// judged anew, so HEALTHY comes back after a crash loop (L-3, X-8).
    fn start_monitor(&mut self) {
        self.stop_monitor();
        if !self.spec_known {
            return;
        }
        let Some((probe, timing)) =
            health::resolve(self.spec.as_ref(), self.owned.ip, &self.owned.container_id)
        else {
            if self.spec.is_some() && !self.health_warned {
                tracing::warn!(assignment = %self.owned.assignment_id, "health check target not resolvable (no IP or port)");
                self.health_warned = true;
            }
            return;
        };
        let exec = self.ctx.instances.exec_context();
        self.monitor = Some(health::spawn(
            self.owned.assignment_id.clone(),
            self.owned.container_id.clone(),
            probe,
            timing,
            exec,
            self.health_tx.clone(),
        ));
    }

    /// Drops the monitor, and its channel with it: an update it had queued
    /// (a HEALTHY of the task that just crashed) is never read.
    fn stop_monitor(&mut self) {
        self.monitor = None;
        (self.health_tx, self.health_rx) = mpsc::channel(HEALTH_QUEUE);
    }

    /// An adopted container: running as it is, or its lost task started
    /// again now (a reboot, C-13). `false` when it had to be discarded.
    async fn adopt(&mut self) -> bool {
        self.report(Event::Up(self.owned.clone()));
        match self
            .ctx
            .instances
            .task_state(&self.owned.container_id)
            .await
        {
            Ok(TaskState::Running { .. } | TaskState::Paused) => {
                self.report_running();
                self.start_monitor();
                true
            }
            Ok(TaskState::Stopped { .. } | TaskState::Absent | TaskState::Created)
                if self.owned.restart && self.owned.exit_code.is_none() =>
            {
                // Said while it happens: a restart that takes long is
                // STARTING, not a silent PENDING.
                self.report(Event::Observed(self.observe(State::Starting)));
                match self.ctx.instances.restart(&self.owned).await {
                    Ok(()) => {
                        tracing::info!(container = %self.owned.container_id, "restarted a task lost while the agent was down");
                        self.started_at = Instant::now();
                        self.report_running();
                        self.start_monitor();
                        true
                    }
                    Err(e) => self.restart_failed(e).await,
                }
            }
            // A job that ran (the poll reports it), or a shim that did not
            // answer (a loaded host): never restarted on a guess, the poll
            // asks again.
            Ok(_) | Err(_) => true,
        }
    }

    async fn supervise(&mut self, cmds: &mut mpsc::UnboundedReceiver<Cmd>) {
        let mut poll = tokio::time::interval(POLL);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        poll.tick().await;
        loop {
            let due = self.crash.as_ref().map(|c| c.due);
            tokio::select! {
                cmd = cmds.recv() => match cmd {
                    None => return,
                    Some(Cmd::Stop) => {
                        self.stop_monitor();
                        remove(self.ctx, self.owned.clone()).await;
                        return;
                    }
                    Some(Cmd::Exited) => {
                        if !self.check().await {
                            return;
                        }
                    }
                    Some(Cmd::Oom) => self.oom_seen = true,
                    Some(Cmd::Halt(done)) => {
                        self.stop_monitor();
                        if let Err(e) = self.ctx.instances.halt(&self.owned).await {
                            tracing::warn!(container = %self.owned.container_id, error = %e, "not stopped for the host's shutdown");
                        }
                        let _ = done.send(());
                        return;
                    }
                    Some(Cmd::Spec(spec)) => {
                        self.spec = spec.map(|s| *s);
                        self.spec_known = true;
                        if self.monitor.is_none() {
                            self.start_monitor();
                        }
                    }
                },
                Some(update) = self.health_rx.recv() => {
                    // Only the current task's monitor speaks.
                    if update.container_id == self.owned.container_id {
                        self.report(Event::Observed(self.observe(update.state)));
                    }
                }
                _ = poll.tick() => {
                    if let Some(pid) = self.known_running() {
                        self.keep_attached(pid).await;
                        self.report_running();
                    } else if !self.check().await {
                        return;
                    }
                }
                () = sleep_until(due), if due.is_some() => {
                    if !self.check().await {
                        return;
                    }
                }
            }
        }
    }

    /// L-1 for this container: the poll's report, a crash's back-off and
    /// restart (C-13), a job's exit (L-5). `false` when the worker is done.
    async fn check(&mut self) -> bool {
        let generation = *self.ctx.events.borrow();
        self.read_running = None;
        let state = match self
            .ctx
            .instances
            .task_state(&self.owned.container_id)
            .await
        {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(container = %self.owned.container_id, error = %e, "inspect failed; skipped");
                return true;
            }
        };
        match state {
            TaskState::Running { pid } => {
                self.crash = None;
                self.read_running = Some((Instant::now(), generation, pid));
                self.keep_attached(pid).await;
                self.report_running();
            }
            TaskState::Paused => {
                self.crash = None;
                // RUNNING with its bindings on every poll, as wire.md's
                // status table has it: control, like the status board,
                // keeps a HEALTHY or UNHEALTHY verdict over it (S-10).
                self.report_running();
            }
            TaskState::Stopped { exit_code } if !self.owned.restart => {
                let obs = if exit_code == 0 {
                    self.observe(State::Stopped)
                } else {
                    let why = self
                        .oom_message()
                        .unwrap_or_else(|| format!("exited with code {exit_code}"));
                    let mut f = self.observe(State::Failed).message(why);
                    f.exit_code = i32::try_from(exit_code).ok();
                    f
                };
                if self.owned.exit_code.is_none() {
                    let labels = std::collections::HashMap::from([(
                        labels::EXIT_CODE.to_owned(),
                        exit_code.to_string(),
                    )]);
                    let _ = self
                        .ctx
                        .instances
                        .label(&self.owned.container_id, labels)
                        .await;
                    self.owned.exit_code = Some(exit_code);
                    self.stop_monitor();
                }
                self.report(Event::Observed(obs));
            }
            TaskState::Stopped { exit_code } => {
                let now = Instant::now();
                if self.crash.is_none() {
                    let delay = backoff::next_delay(self.last_delay, now - self.started_at);
                    self.last_delay = Some(delay);
                    self.stop_monitor();
                    let oom = self.oom_message();
                    tracing::info!(container = %self.owned.container_id, exit_code, ?delay, oom = oom.as_deref().unwrap_or("no"), "service exited; restarting after back-off");
                    self.crash = Some(Crash {
                        due: now + delay,
                        exit_code: Some(exit_code),
                        why: oom.unwrap_or_else(|| {
                            format!("crash-looping: last exit code {exit_code}")
                        }),
                    });
                }
                let Some(crash) = self.crash.clone() else {
                    return true;
                };
                if now >= crash.due {
                    return self.restart().await;
                }
                let mut f = self.observe(State::Failed).message(crash.why);
                f.exit_code = crash.exit_code.and_then(|c| i32::try_from(c).ok());
                self.report(Event::Observed(f));
            }
            // A job's task gone (a reboot): a job never runs twice. Its
            // labelled exit is its end; without one it was cut short.
            TaskState::Absent if !self.owned.restart => {
                self.stop_monitor();
                let obs = match self.owned.exit_code {
                    Some(0) => self.observe(State::Stopped),
                    Some(code) => {
                        let mut f = self
                            .observe(State::Failed)
                            .message(format!("exited with code {code}"));
                        f.exit_code = i32::try_from(code).ok();
                        f
                    }
                    None => self.observe(State::Failed).message(
                        "lost in a reboot before it ended; not run again (a job never runs twice)",
                    ),
                };
                self.report(Event::Observed(obs));
            }
            // A service's task lost (reboot), or any task never started:
            // bring it back now, or when the back-off of a failed restart
            // ends.
            TaskState::Absent | TaskState::Created => match self.crash.clone() {
                Some(crash) if Instant::now() < crash.due => {
                    self.report(Event::Observed(
                        self.observe(State::Failed).message(crash.why),
                    ));
                }
                _ => return self.restart().await,
            },
            // A shim that did not answer in time (a loaded host) says
            // nothing about the task: restarting on it would kill a live one.
            TaskState::Unknown => {
                tracing::warn!(container = %self.owned.container_id, "containerd could not read the task (its shim did not answer); asking again at the next poll");
            }
        }
        true
    }

    /// "out of memory (limit N MiB)" when the OOM killer ended the current
    /// task: its cgroup's count (while the stopped task still holds it) or
    /// containerd's OOM event.
    fn oom_message(&self) -> Option<String> {
        self.ctx
            .instances
            .oom_kills(&self.owned)
            .or_else(|| self.oom_seen.then(|| "out of memory".to_owned()))
    }

    /// A namespace file or host veth removed behind the agent's back is
    /// made again around the running task: same namespace, same address,
    /// no restart.
    async fn keep_attached(&self, pid: u32) {
        self.ctx.instances.keep_attached(&self.owned, pid).await;
    }

    async fn restart(&mut self) -> bool {
        match self.ctx.instances.restart(&self.owned).await {
            Ok(()) => {
                self.crash = None;
                self.oom_seen = false;
                self.restarts += 1;
                // Kept in a label so that an agent restart does not reset it.
                let count =
                    HashMap::from([(labels::RESTARTS.to_owned(), self.restarts.to_string())]);
                if let Err(e) = self
                    .ctx
                    .instances
                    .label(&self.owned.container_id, count)
                    .await
                {
                    tracing::debug!(container = %self.owned.container_id, error = %e, "restart count not recorded");
                }
                self.owned.restarts = self.restarts;
                self.started_at = Instant::now();
                self.report_running();
                self.start_monitor();
                true
            }
            Err(e) => self.restart_failed(e).await,
        }
    }

    /// A container that cannot be run is discarded, to be made afresh; any
    /// other failure keeps it (its writable layer is the tenant's) and is
    /// tried again after the crash back-off. `false` when discarded.
    async fn restart_failed(&mut self, e: RestartFailure) -> bool {
        match e {
            RestartFailure::Unusable(failure) => {
                tracing::warn!(container = %self.owned.container_id, error = %failure, "cannot be restarted; re-creating the container");
                self.discard().await;
                false
            }
            RestartFailure::Transient(failure) => {
                let delay = backoff::next_delay(self.last_delay, Duration::ZERO);
                self.last_delay = Some(delay);
                self.stop_monitor();
                tracing::warn!(container = %self.owned.container_id, error = %failure, ?delay, "restart failed; keeping the container and trying again after the back-off");
                let why = format!(
                    "restart failed ({failure}); trying again in {} s",
                    delay.as_secs()
                );
                self.report(Event::Observed(
                    self.observe(State::Failed).message(why.clone()),
                ));
                self.crash = Some(Crash {
                    due: Instant::now() + delay,
                    exit_code: None,
                    why,
                });
                true
            }
        }
    }

    /// Removes a container that cannot be restarted, so that it is made
    /// afresh.
    async fn discard(&mut self) {
        self.stop_monitor();
        let result = {
            let _slot = self.ctx.slots.acquire().await;
            self.ctx.instances.tear_down(&self.owned).await
        };
        match result {
            Ok(()) => self.report(Event::Discarded(self.owned.clone())),
            Err(error) => self.report(Event::StopFailed {
                owned: self.owned.clone(),
                error,
            }),
        }
    }
}

async fn sleep_until(due: Option<tokio::time::Instant>) {
    match due {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    //! The worker against a fake runtime, in paused time: what it reports,
    //! what it asks the runtime, and when.

    use std::collections::HashSet;
    use std::sync::Mutex;

    use super::*;
    use crate::health::ExecContext;
    use crate::proto::v1::{Assignment, Meta};
    use crate::runtime::{Containerd, RuntimeError};

    /// containerd as a map of tasks, and a log of what was asked.
    #[derive(Debug, Default)]
    struct Fake {
        tasks: Mutex<HashMap<String, TaskState>>,
        calls: Mutex<Vec<(Instant, String)>>,
        /// Containers whose restart fails (removed behind our back).
        broken: Mutex<HashSet<String>>,
        /// Containers whose pull never ends.
        hung: Mutex<HashSet<String>>,
        /// Containers whose next N restarts fail for a reason that passes
        /// (containerd slow in the boot storm).
        slow: Mutex<HashMap<String, u32>>,
    }

    impl Fake {
        fn set(&self, cid: &str, state: TaskState) {
            self.tasks.lock().unwrap().insert(cid.into(), state);
        }
        fn call(&self, what: String) {
            self.calls.lock().unwrap().push((Instant::now(), what));
        }
        fn asked(&self, what: &str) -> Vec<Instant> {
            let calls = self.calls.lock().unwrap();
            calls
                .iter()
                .filter(|(_, c)| c == what)
                .map(|(at, _)| *at)
                .collect()
        }
    }

    #[tonic::async_trait]
    impl Instances for Fake {
        async fn bring_up(
            &self,
            plan: &Plan,
            progress: super::super::instance::Progress<'_>,
        ) -> Result<OwnedContainer, Failure> {
            let cid = plan.container_id.clone();
            self.call(format!("bring_up {cid}"));
            progress(Observation::new(plan.assignment_id(), State::Pulling));
            if self.hung.lock().unwrap().contains(&cid) {
                std::future::pending::<()>().await;
            }
            self.set(&cid, TaskState::Running { pid: 1 });
            Ok(owned(&cid))
        }
        async fn restart(&self, o: &OwnedContainer) -> Result<(), RestartFailure> {
            self.call(format!("restart {}", o.container_id));
            if self.broken.lock().unwrap().contains(&o.container_id) {
                return Err(RestartFailure::Unusable(Failure {
                    step: super::super::instance::Step::Restart,
                    subject: None,
                    reason: "container not found".into(),
                }));
            }
            let mut slow = self.slow.lock().unwrap();
            if let Some(left) = slow.get_mut(&o.container_id).filter(|n| **n > 0) {
                *left -= 1;
                return Err(RestartFailure::Transient(Failure {
                    step: super::super::instance::Step::Start,
                    subject: None,
                    reason: "the task of c1 was not started within 60 s".into(),
                }));
            }
            drop(slow);
            self.set(&o.container_id, TaskState::Running { pid: 2 });
            Ok(())
        }
        async fn tear_down(&self, o: &OwnedContainer) -> Result<(), TeardownError> {
            self.call(format!("tear_down {}", o.container_id));
            self.tasks.lock().unwrap().remove(&o.container_id);
            Ok(())
        }
        async fn task_state(&self, cid: &str) -> Result<TaskState, RuntimeError> {
            self.call(format!("task_state {cid}"));
            Ok(self
                .tasks
                .lock()
                .unwrap()
                .get(cid)
                .copied()
                .unwrap_or(TaskState::Absent))
        }
        async fn halt(&self, o: &OwnedContainer) -> Result<(), RuntimeError> {
            self.call(format!("halt {}", o.container_id));
            self.set(&o.container_id, TaskState::Stopped { exit_code: 0 });
            Ok(())
        }
        async fn label(&self, cid: &str, l: HashMap<String, String>) -> Result<(), RuntimeError> {
            let mut l: Vec<_> = l.into_iter().map(|(k, v)| format!("{k}={v}")).collect();
            l.sort();
            self.call(format!("label {cid} {}", l.join(",")));
            Ok(())
        }
        async fn keep_attached(&self, _: &OwnedContainer, _: u32) {}
        fn oom_kills(&self, _: &OwnedContainer) -> Option<String> {
            None
        }
        fn exec_context(&self) -> ExecContext {
            ExecContext {
                ctd: Containerd::lazy(
                    std::path::Path::new("/nonexistent/containerd.sock"),
                    "zattera-unit".parse().unwrap(),
                ),
                fifo_dir: std::env::temp_dir(),
            }
        }
    }

    fn owned(cid: &str) -> OwnedContainer {
        OwnedContainer {
            container_id: cid.into(),
            assignment_id: format!("a-{cid}"),
            restart: true,
            stop_grace: Duration::from_secs(1),
            ..OwnedContainer::default()
        }
    }

    fn plan(cid: &str) -> Plan {
        Plan {
            assignment: Assignment {
                meta: Some(Meta {
                    id: format!("a-{cid}"),
                    ..Meta::default()
                }),
                ..Assignment::default()
            },
            runtime: crate::proto::cluster::AssignmentRuntime::default(),
            container_id: cid.into(),
            subnet: None,
            ip: None,
            ports: Vec::new(),
            shim_group: None,
        }
    }

    fn start(
        fake: &Arc<Fake>,
        cid: &str,
        start: Start,
    ) -> (Worker, mpsc::UnboundedReceiver<Report>) {
        start_with(fake, cid, start, tokio::sync::watch::channel(0).1)
    }

    fn start_with(
        fake: &Arc<Fake>,
        cid: &str,
        start: Start,
        events: tokio::sync::watch::Receiver<u64>,
    ) -> (Worker, mpsc::UnboundedReceiver<Report>) {
        let (reports, rx) = mpsc::unbounded_channel();
        let ctx = Ctx {
            instances: fake.clone(),
            slots: Arc::new(Semaphore::new(2)),
            reports,
            leases: NetworkLeases::default(),
            events,
        };
        let w = Worker::spawn(
            ctx,
            cid.into(),
            format!("a-{cid}"),
            "scope".into(),
            start,
            None,
        );
        (w, rx)
    }

    /// A report's state, or what other event it is.
    fn said(r: &Report) -> String {
        match &r.event {
            Event::Observed(o) if o.message.is_empty() => format!("{:?}", o.state),
            Event::Observed(o) => format!("{:?} {}", o.state, o.message),
            Event::Up(_) => "Up".into(),
            Event::Failed { failure, .. } => format!("Failed {failure}"),
            Event::Down(_) => "Down".into(),
            Event::StopFailed { .. } => "StopFailed".into(),
            Event::Discarded(_) => "Discarded".into(),
        }
    }

    /// Reports until one reads `want`; the ones before it.
    async fn until(rx: &mut mpsc::UnboundedReceiver<Report>, want: &str) -> Vec<String> {
        let mut seen = Vec::new();
        loop {
            let r = tokio::time::timeout(Duration::from_secs(3600), rx.recv())
                .await
                .unwrap_or_else(|_| panic!("no {want:?} within an hour; saw {seen:?}"))
                .unwrap_or_else(|| panic!("the worker ended before {want:?}; saw {seen:?}"));
            let s = said(&r);
            if s == want {
                return seen;
            }
            seen.push(s);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_crash_is_restarted_after_a_back_off_that_doubles() {
        let fake = Arc::new(Fake::default());
        fake.set("c1", TaskState::Running { pid: 1 });
        let (w, mut rx) = start(&fake, "c1", Start::Adopt(owned("c1")));
        until(&mut rx, "Running").await;

        let crashed = Instant::now();
        fake.set("c1", TaskState::Stopped { exit_code: 3 });
        w.send(Cmd::Exited);
        until(&mut rx, "Failed crash-looping: last exit code 3").await;
        until(&mut rx, "Running").await;
        let first = fake.asked("restart c1");
        assert_eq!(first.len(), 1);
        assert_eq!(
            first[0] - crashed,
            backoff::INITIAL,
            "restarted when the back-off ends, not before"
        );
        // Counted in a label, so that an agent restart does not reset it.
        let label = format!("label c1 {}=1", labels::RESTARTS);
        assert_eq!(fake.asked(&label).len(), 1);

        // It crashes again at once: the next back-off is twice as long. (A
        // poll due at the same instant as the restart may have queued one
        // more RUNNING: the crash's FAILED comes after it.)
        let crashed = Instant::now();
        fake.set("c1", TaskState::Stopped { exit_code: 3 });
        w.send(Cmd::Exited);
        until(&mut rx, "Failed crash-looping: last exit code 3").await;
        until(&mut rx, "Running").await;
        let second = fake.asked("restart c1");
        assert_eq!(second.len(), 2);
        assert_eq!(second[1] - crashed, backoff::INITIAL * 2);
    }

    /// 59.2: while the event stream holds, a running task is read from
    /// containerd once a sweep, not every tick, and still reported every
    /// tick (L-1); a new stream generation makes the next tick read; an
    /// exit event is acted on at once.
    #[tokio::test(start_paused = true)]
    async fn a_running_task_is_read_once_a_sweep_while_events_hold() {
        let fake = Arc::new(Fake::default());
        fake.set("c1", TaskState::Running { pid: 1 });
        let (events, events_rx) = tokio::sync::watch::channel(0u64);
        let (w, mut rx) = start_with(&fake, "c1", Start::Adopt(owned("c1")), events_rx);
        until(&mut rx, "Running").await;
        let reads = || fake.asked("task_state c1").len();
        let before = reads();
        tokio::time::sleep(Duration::from_secs(60)).await;
        let mut running = 0;
        while let Ok(r) = rx.try_recv() {
            running += usize::from(said(&r) == "Running");
        }
        assert!(running >= 11, "reported every tick: {running}");
        assert!(
            reads() - before <= 2,
            "{} reads in a minute, not one a tick",
            reads() - before
        );

        events.send_replace(1);
        let before = reads();
        tokio::time::sleep(POLL + Duration::from_millis(10)).await;
        assert_eq!(
            reads() - before,
            1,
            "read at the next tick after events may have been lost"
        );

        fake.set("c1", TaskState::Stopped { exit_code: 3 });
        w.send(Cmd::Exited);
        until(&mut rx, "Failed crash-looping: last exit code 3").await;
    }

    #[tokio::test(start_paused = true)]
    async fn an_adopted_container_whose_task_was_lost_is_started_again() {
        let fake = Arc::new(Fake::default());
        let (_w, mut rx) = start(&fake, "c1", Start::Adopt(owned("c1")));
        let before = until(&mut rx, "Running").await;
        assert_eq!(before, vec!["Up", "Starting"]);
        assert_eq!(fake.asked("restart c1").len(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_containerd_cannot_read_is_never_restarted_on_a_guess() {
        let fake = Arc::new(Fake::default());
        fake.set("c1", TaskState::Unknown);
        let (_w, mut rx) = start(&fake, "c1", Start::Adopt(owned("c1")));
        until(&mut rx, "Up").await;
        // A minute of polls that cannot read the task.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(
            fake.asked("restart c1").is_empty(),
            "{:?}",
            fake.calls.lock().unwrap()
        );
        fake.set("c1", TaskState::Running { pid: 1 });
        until(&mut rx, "Running").await;
        assert!(fake.asked("restart c1").is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_container_removed_behind_our_back_is_discarded_to_be_made_afresh() {
        let fake = Arc::new(Fake::default());
        fake.set("c1", TaskState::Running { pid: 1 });
        fake.broken.lock().unwrap().insert("c1".into());
        let (_w, mut rx) = start(&fake, "c1", Start::Adopt(owned("c1")));
        until(&mut rx, "Running").await;
        // Gone: the poll finds no task, the restart fails, the rest goes.
        fake.tasks.lock().unwrap().clear();
        until(&mut rx, "Discarded").await;
        assert_eq!(fake.asked("restart c1").len(), 1);
        assert_eq!(fake.asked("tear_down c1").len(), 1);
        assert!(rx.recv().await.is_none(), "the worker ends");
    }

    /// 58.8: containerd too slow at boot to start the task is no reason to
    /// throw the container (and its writable layer) away: it is kept, and
    /// the restart tried again after the crash back-off.
    #[tokio::test(start_paused = true)]
    async fn a_restart_that_fails_for_a_passing_reason_keeps_the_container() {
        let fake = Arc::new(Fake::default());
        fake.slow.lock().unwrap().insert("c1".into(), 2);
        let began = Instant::now();
        let (_w, mut rx) = start(&fake, "c1", Start::Adopt(owned("c1")));
        let before = until(&mut rx, "Running").await;
        assert_eq!(before[..2], ["Up", "Starting"]);
        assert!(
            before.iter().any(|s| s.starts_with("Failed restart failed (start: the task of c1 was not started within 60 s); trying again in 10 s")),
            "{before:?}"
        );
        let restarts = fake.asked("restart c1");
        assert_eq!(restarts.len(), 3, "two failures, then the start");
        assert_eq!(restarts[1] - began, backoff::INITIAL);
        assert_eq!(restarts[2] - restarts[1], backoff::INITIAL * 2);
        assert!(
            fake.asked("tear_down c1").is_empty(),
            "the container is kept: {:?}",
            fake.calls.lock().unwrap()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_pull_holds_only_its_own_worker() {
        let fake = Arc::new(Fake::default());
        fake.hung.lock().unwrap().insert("stuck".into());
        let (_stuck, mut stuck_rx) = start(&fake, "stuck", Start::Run(Box::new(plan("stuck"))));
        until(&mut stuck_rx, "Pulling").await;
        let (_w, mut rx) = start(&fake, "c2", Start::Run(Box::new(plan("c2"))));
        assert_eq!(until(&mut rx, "Running").await, vec!["Pulling", "Up"]);
        assert!(
            stuck_rx.try_recv().is_err(),
            "the stuck one says nothing more"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn stop_removes_the_container_and_ends_the_worker() {
        let fake = Arc::new(Fake::default());
        let (mut w, mut rx) = start(&fake, "c1", Start::Run(Box::new(plan("c1"))));
        until(&mut rx, "Running").await;
        w.stop();
        assert_eq!(w.phase, Phase::Stopping);
        until(&mut rx, "Down").await;
        assert_eq!(fake.asked("tear_down c1").len(), 1);
        assert!(rx.recv().await.is_none());
    }
}
