//! The AgentSync client (wire.md §1.3, runtime.md §3).
//!
//! One task reconnects forever with back-off; each session dials a fresh
//! mTLS channel, sends the hello first, then one writer sends heartbeats,
//! status batches (from the [`queue`](super::queue)) and acks, while the
//! receive loop hands every AssignmentSet to the executor, whatever its
//! version, and never writes itself (S-1).

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use rustls::ClientConfig;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::metrics::InstanceSamples;
use crate::proto::cluster::agent_message::Body;
use crate::proto::cluster::agent_sync_service_client::AgentSyncServiceClient;
use crate::proto::cluster::control_message::Body as ControlBody;
use crate::proto::cluster::{
    AgentHello, AgentMessage, AssignmentSet, AssignmentsAck, Heartbeat, StatusBatch,
};
use crate::proto::v1::Assignment;
use crate::status::Observation;

use super::queue::{self, QueueHandle};
use crate::link::backoff::Backoff;
use crate::link::target::{Dialer, Targets};
use crate::link::tls::{self, CurrentTls, TlsError};
use crate::metrics::host::{self, CpuMeter};

/// The reference's heartbeat interval (wire.md §1.6).
pub const HEARTBEAT: Duration = Duration::from_secs(10);
/// Outgoing frames buffered per session; acks beyond it are dropped.
const OUTGOING: usize = 8;

/// What a sync client needs.
#[derive(Debug, Clone)]
pub struct SyncConfig {
    /// `host:port` of the control API the join returned.
    pub control_addr: String,
    /// Where to dial: the leader, followed (see [`crate::link::target`]).
    pub targets: watch::Receiver<Targets>,
    pub node_id: String,
    /// The node identity; a renewal reconnects with the new one at once.
    pub tls: CurrentTls,
    pub binary_version: String,
    /// Its filesystem is the one heartbeats report on.
    pub data_dir: PathBuf,
    pub heartbeat: Duration,
    /// Limits of the status queue: batches, reports.
    pub queue_limits: (usize, usize),
    /// Control-plane node ids known from the enrollment.
    pub control_node_ids: Vec<String>,
    /// Counts the sessions control accepted (an upgrade is confirmed by
    /// the first).
    pub opened: watch::Sender<u64>,
}

impl SyncConfig {
    /// The config of an enrolled node: identity from `<data_dir>/node`,
    /// control at `control_addr`, reference numbers otherwise.
    pub fn load(
        control_addr: &str,
        data_dir: &std::path::Path,
    ) -> Result<Self, crate::link::identity::IdentityError> {
        let ids = crate::link::identity::IdentityDir::new(data_dir);
        let enrollment = ids.load_enrollment()?;
        Ok(Self {
            control_addr: control_addr.to_owned(),
            targets: watch::channel(Targets::initial(control_addr)).1,
            node_id: enrollment.node_id,
            tls: tls::fixed(ids.load_tls()?),
            binary_version: crate::version::tag().to_owned(),
            data_dir: data_dir.to_owned(),
            heartbeat: HEARTBEAT,
            queue_limits: (super::queue::DEFAULT_BATCHES, super::queue::DEFAULT_ENTRIES),
            control_node_ids: enrollment.control_node_ids,
            opened: watch::Sender::new(0),
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("control answered {code:?}: {message}", code = .0.code(), message = .0.message())]
    Status(#[from] tonic::Status),
    #[error("the stream closed before the hello went out")]
    HelloNotSent,
    #[error("the send side of the stream closed")]
    SendClosed,
    #[error("the status queue ended")]
    QueueEnded,
}

/// Starts the client: it owns the executor's batch receiver and feeds
/// `desired` until the task is aborted. Heartbeats carry the latest of
/// `samples` ([`crate::metrics`]).
pub fn spawn(
    cfg: SyncConfig,
    desired: watch::Sender<Option<AssignmentSet>>,
    batches: mpsc::UnboundedReceiver<Vec<Observation>>,
    samples: watch::Receiver<InstanceSamples>,
) -> Result<tokio::task::JoinHandle<()>, TlsError> {
    // Checked once: a bad key or certificate is a startup error, not a retry.
    let client = Arc::new(tls::node_client(&cfg.tls.borrow())?);
    tls::server_name_of(&cfg.control_addr)?;
    let (max_batches, max_entries) = cfg.queue_limits;
    let queue = queue::spawn(queue::StatusQueue::new(max_batches, max_entries), batches);
    Ok(tokio::spawn(run(cfg, client, desired, queue, samples)))
}

async fn run(
    cfg: SyncConfig,
    client: Arc<ClientConfig>,
    desired: watch::Sender<Option<AssignmentSet>>,
    queue: QueueHandle,
    samples: watch::Receiver<InstanceSamples>,
) {
    let mut state = Session {
        cfg,
        desired,
        queue,
        samples,
        version: 0,
    };
    let mut cpu = CpuMeter::default();
    let mut backoff = Backoff::default();
    let mut client = client;
    let mut dialer = Dialer::new(state.cfg.targets.clone());
    loop {
        // A renewed identity is used from the next session on; one that
        // does not make a client leaves the last good one in use.
        if state.cfg.tls.has_changed().unwrap_or(false) {
            match tls::node_client(&state.cfg.tls.borrow_and_update()) {
                Ok(c) => client = Arc::new(c),
                Err(e) => {
                    tracing::error!(error = %e, "renewed identity unusable; keeping the previous one");
                }
            }
        }
        let started = Instant::now();
        let target = dialer.target();
        match state
            .run(&target, (*client).clone(), &mut cpu, &mut dialer)
            .await
        {
            Ok(Ended::Closed) => {
                tracing::info!(control = %target, "sync stream ended");
            }
            Ok(Ended::Renewed) => {
                tracing::info!(control = %target, "node identity renewed; reconnecting with it");
                continue;
            }
            Ok(Ended::LeaderMoved) => {
                tracing::info!(from = %target, "the control leader moved; following it");
                dialer.reached();
                continue;
            }
            Err(e) => {
                tracing::warn!(control = %target, error = %e, "sync session failed");
            }
        }
        let lasted = started.elapsed();
        if lasted >= crate::link::backoff::HEALTHY_SESSION {
            dialer.reached();
        } else {
            // Not the leader, or not there: the next try rotates.
            dialer.missed();
        }
        let wait = backoff.next_wait(lasted);
        tracing::info!(wait_ms = wait.as_millis(), "reconnecting to control");
        // A leader learned meanwhile is dialed at once.
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            () = dialer.moved_from(&target) => {
                tracing::info!("the control leader moved; reconnecting at once");
            }
        }
    }
}

/// What survives from one session to the next (S-9).
struct Session {
    cfg: SyncConfig,
    desired: watch::Sender<Option<AssignmentSet>>,
    queue: QueueHandle,
    samples: watch::Receiver<InstanceSamples>,
    /// Highest AssignmentSet version applied by this process.
    version: u64,
}

/// How a session that did not fail ended.
enum Ended {
    /// Control closed the stream.
    Closed,
    /// A new identity arrived: reconnect with it, without a back-off.
    Renewed,
    /// The peer set names another leader: reconnect to it, at once.
    LeaderMoved,
}

impl Session {
    async fn run(
        &mut self,
        target: &str,
        client: ClientConfig,
        cpu: &mut CpuMeter,
        dialer: &mut Dialer,
    ) -> Result<Ended, SessionError> {
        let channel = tls::connect(target, client).await?;
        let (out_tx, out_rx) = mpsc::channel::<AgentMessage>(OUTGOING);
        // Queued before the call starts: nothing can overtake the hello.
        out_tx
            .send(frame(Body::Hello(AgentHello {
                node_id: self.cfg.node_id.clone(),
                binary_version: self.cfg.binary_version.clone(),
                assignment_version: self.version,
            })))
            .await
            .map_err(|_| SessionError::HelloNotSent)?;
        self.queue.resync().await;
        let mut inbound = AgentSyncServiceClient::new(channel)
            .max_decoding_message_size(64 * 1024 * 1024)
            .sync(ReceiverStream::new(out_rx))
            .await?
            .into_inner();
        tracing::info!(control = %target, node_id = %self.cfg.node_id, "sync stream open");
        self.cfg.opened.send_modify(|n| *n += 1);

        let mut renewals = self.cfg.tls.clone();
        let (ack_tx, ack_rx) = mpsc::channel::<u64>(OUTGOING);
        let writer = writer(
            out_tx,
            ack_rx,
            self.queue.clone(),
            Heartbeats {
                every: self.cfg.heartbeat,
                data_dir: self.cfg.data_dir.clone(),
                samples: self.samples.clone(),
            },
            cpu,
        );
        let reader = async {
            while let Some(msg) = inbound.message().await? {
                match msg.body {
                    Some(ControlBody::Assignments(set)) => self.apply(set, &ack_tx).await,
                    Some(ControlBody::Activate(a)) => {
                        tracing::info!(environment = %a.environment_id, "activate hint from control ignored");
                    }
                    None => tracing::warn!("control sent a frame without a body"),
                }
            }
            Ok::<(), SessionError>(())
        };
        tokio::select! {
            r = writer => r.map(|()| Ended::Closed),
            r = reader => r.map(|()| Ended::Closed),
            () = tls::renewed(&mut renewals) => Ok(Ended::Renewed),
            () = dialer.moved_from(target) => Ok(Ended::LeaderMoved),
        }
    }

    /// S-6: record the version, hand the set over, ack best-effort.
    ///
    /// Control re-pushes the whole set on every cluster change, its own
    /// status commits included, so most pushes repeat the last one but for
    /// the echo of our reports. Such a repeat is stored without waking the
    /// executor for a pass that would change nothing (its 5 s tick still
    /// runs, on the stored set).
    async fn apply(&mut self, set: AssignmentSet, ack: &mpsc::Sender<u64>) {
        let version = set.version;
        self.version = self.version.max(version);
        // The latest set always wins, even with a lower version (S-11).
        let changed = self.desired.send_if_modified(|current| {
            let changed = !current
                .as_ref()
                .is_some_and(|cur| same_assignments(cur, &set));
            *current = Some(set);
            changed
        });
        if changed {
            let ids: HashSet<String> = self
                .desired
                .borrow()
                .iter()
                .flat_map(|s| &s.assignments)
                .filter_map(|a| a.meta.as_ref().map(|m| m.id.clone()))
                .collect();
            tracing::info!(version, assignments = ids.len(), "assignment set received");
            self.queue.retain(ids).await;
        } else {
            tracing::debug!(version, "assignment set unchanged");
        }
        if ack.try_send(version).is_err() {
            tracing::debug!(version, "ack dropped: outgoing queue full");
        }
    }
}

/// Whether two sets ask the executor for the same thing: the same runtime
/// payloads and the same assignments, leaving out the version and what
/// control echoes of our own reports (`observed`, `mesh_port_bindings`,
/// `meta.updated_at`).
pub fn same_assignments(a: &AssignmentSet, b: &AssignmentSet) -> bool {
    let same = |x: &Assignment, y: &Assignment| {
        x.meta.as_ref().map(|m| &m.id) == y.meta.as_ref().map(|m| &m.id)
            && x.node_id == y.node_id
            && x.project_id == y.project_id
            && x.app_id == y.app_id
            && x.environment_id == y.environment_id
            && x.release_id == y.release_id
            && x.deployment_id == y.deployment_id
            && x.desired == y.desired
            && x.config_hash == y.config_hash
            && x.job_id == y.job_id
    };
    a.assignments.len() == b.assignments.len()
        && a.assignments
            .iter()
            .zip(&b.assignments)
            .all(|(x, y)| same(x, y))
        && a.runtime == b.runtime
}

fn frame(body: Body) -> AgentMessage {
    AgentMessage { body: Some(body) }
}

/// What a heartbeat is built from.
struct Heartbeats {
    every: Duration,
    /// Its filesystem is the one reported.
    data_dir: PathBuf,
    samples: watch::Receiver<InstanceSamples>,
}

/// The single writer of a session: heartbeats (one right after the hello,
/// S-12, then every interval), status batches and acks.
async fn writer(
    out: mpsc::Sender<AgentMessage>,
    mut acks: mpsc::Receiver<u64>,
    queue: QueueHandle,
    beats: Heartbeats,
    cpu: &mut CpuMeter,
) -> Result<(), SessionError> {
    let mut tick = tokio::time::interval(beats.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Kept across iterations: dropping a take mid-flight could lose a batch.
    let mut take = Box::pin(next_batch(queue.clone()));
    loop {
        let body = tokio::select! {
            _ = tick.tick() => Body::Heartbeat(heartbeat(cpu, &beats)),
            Some(version) = acks.recv() => Body::Ack(AssignmentsAck { version }),
            batch = &mut take => {
                take = Box::pin(next_batch(queue.clone()));
                Body::Status(batch.ok_or(SessionError::QueueEnded)?)
            }
        };
        out.send(frame(body))
            .await
            .map_err(|_| SessionError::SendClosed)?;
    }
}

async fn next_batch(queue: QueueHandle) -> Option<StatusBatch> {
    queue.next_batch().await
}

fn heartbeat(cpu: &mut CpuMeter, beats: &Heartbeats) -> Heartbeat {
    let (memory_used_bytes, memory_total_bytes) = host::memory();
    let (disk_used_bytes, disk_total_bytes) = host::disk(&beats.data_dir);
    Heartbeat {
        time: Some(SystemTime::now().into()),
        cpu_percent: cpu.sample(),
        memory_used_bytes,
        memory_total_bytes,
        disk_used_bytes,
        disk_total_bytes,
        instances: (**beats.samples.borrow()).clone(),
        // This node runs no ingress proxy.
        proxy: std::collections::BTreeMap::new(),
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::proto::cluster::AssignmentRuntime;
    use crate::proto::v1::{AssignmentObserved, Meta};

    fn set(version: u64, hash: &str, observed: i32) -> AssignmentSet {
        AssignmentSet {
            version,
            assignments: vec![Assignment {
                meta: Some(Meta {
                    id: "a1".into(),
                    ..Meta::default()
                }),
                config_hash: hash.into(),
                observed: Some(AssignmentObserved {
                    state: observed,
                    ..AssignmentObserved::default()
                }),
                ..Assignment::default()
            }],
            runtime: std::collections::BTreeMap::from([(
                "a1".into(),
                AssignmentRuntime {
                    image_ref: "img".into(),
                    ..AssignmentRuntime::default()
                },
            )]),
        }
    }

    #[test]
    fn echoes_of_our_reports_and_versions_are_not_changes() {
        assert!(same_assignments(&set(1, "h1", 1), &set(7, "h1", 4)));
        assert!(!same_assignments(&set(1, "h1", 1), &set(1, "h2", 1)));
        let mut other_image = set(1, "h1", 1);
        other_image.runtime.get_mut("a1").unwrap().image_ref = "img2".into();
        assert!(!same_assignments(&set(1, "h1", 1), &other_image));
        let mut more = set(1, "h1", 1);
        more.assignments.push(Assignment::default());
        assert!(!same_assignments(&set(1, "h1", 1), &more));
    }
}
