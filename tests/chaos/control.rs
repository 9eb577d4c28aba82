//! The chaos loop with the test control plane as the source: the agent is
//! joined and synced over mTLS, on a containerd of its own. Faults: the
//! agent SIGKILLed while a changed set arrives, control stopped and started
//! (the stream cut, the full set pushed again on the new session), sets
//! re-pushed with additions, removals and replacements, a task killed from
//! outside, containerd stopped and started. After each: the node invariants
//! of [`invariants::check_node`], and the control stream's own — the last
//! report of every wanted assignment is its current state, every removed
//! one is not heard of after its removal, and no assignment's reports go
//! back in time.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use containerd_client::services::v1::KillRequest;
use futures::FutureExt;
use zattera_agent::proto::cluster::AssignmentSet;
use zattera_agent::proto::cluster::agent_message::Body;
use zattera_agent::proto::v1::InstanceState;
use zattera_agent::runtime::Containerd;
use zattera_netns::NetNode;

use crate::control_plane::{ControlPlane, ControlledAgent, Record, assignment, set_of};
use crate::invariants::{self, Row, Watched, World};
use crate::model::Rng;
use crate::newest_first;
use crate::support::private::PrivateContainerd;
use crate::support::{self, Rig};

const SECRET: &str = "chaos-control";
const PREFIX: &str = "ztfc";
/// The two environments' subnets (control hands them out).
const ENVS: [(&str, u8); 2] = [("e1", 246), ("e2", 247)];
const SLEEPER: &str = "trap 'exit 0' TERM; while true; do sleep 1; done";
const COUNTER: &str = "count";
/// A removed assignment's stop (1 s grace) and the pass that reports it.
const REMOVAL_SLACK: Duration = Duration::from_secs(5);
const COUNTER_CMD: &str = "i=0; while true; do i=$((i+1)); echo $i; sleep 0.01; done";

#[derive(Debug, Clone)]
struct Want {
    env: usize,
    generation: u32,
}

/// What control wants on the node.
#[derive(Debug, Clone, Default)]
struct Plan {
    wanted: BTreeMap<String, Want>,
    /// Removed assignments, with when the set without them was pushed.
    gone: BTreeMap<String, SystemTime>,
    version: u64,
    next: u32,
}

impl Plan {
    fn initial(n: u32) -> Self {
        let mut p = Self::default();
        p.wanted.insert(
            COUNTER.into(),
            Want {
                env: 0,
                generation: 1,
            },
        );
        for i in 0..n {
            p.add(usize::from(i % 2 == 1));
        }
        p
    }

    fn add(&mut self, env: usize) {
        let id = format!("c{}", self.next);
        self.next += 1;
        self.wanted.insert(id, Want { env, generation: 1 });
    }

    /// The container id the agent must run for `id` (assignment id plus the
    /// config hash's prefix).
    fn container_of(&self, id: &str) -> Option<String> {
        self.wanted
            .get(id)
            .map(|w| format!("{id}-h{}", w.generation))
    }

    fn set(&mut self) -> AssignmentSet {
        self.version += 1;
        let items = self
            .wanted
            .iter()
            .map(|(id, w)| {
                let (env, slot) = ENVS[w.env];
                let cmd = if id == COUNTER { COUNTER_CMD } else { SLEEPER };
                let (mut a, mut rt) = assignment(id, env, slot, cmd);
                a.config_hash = format!("h{}", w.generation);
                if let Some(spec) = rt.spec.as_mut() {
                    spec.stop_grace = Some(prost_types::Duration {
                        seconds: 1,
                        nanos: 0,
                    });
                }
                (a, rt)
            })
            .collect();
        set_of(self.version, items)
    }

    /// One to three changes: replacements, additions, removals.
    fn change(&mut self, rng: &mut Rng) -> Vec<String> {
        let mut done = Vec::new();
        for _ in 0..=rng.below(3) {
            let editable: Vec<String> = self
                .wanted
                .keys()
                .filter(|k| *k != COUNTER)
                .cloned()
                .collect();
            match rng.below(3) {
                0 => {
                    if let Some(id) = rng.pick(&editable).cloned()
                        && let Some(w) = self.wanted.get_mut(&id)
                    {
                        w.generation += 1;
                        done.push(format!("replace {id}"));
                    }
                }
                1 if editable.len() < 26 => {
                    self.add(usize::try_from(rng.below(2)).unwrap_or(0));
                    done.push(format!("add c{}", self.next - 1));
                }
                _ if editable.len() > 8 => {
                    if let Some(id) = rng.pick(&editable).cloned() {
                        self.wanted.remove(&id);
                        self.gone.insert(id.clone(), SystemTime::now());
                        done.push(format!("remove {id}"));
                    }
                }
                _ => {}
            }
        }
        done
    }
}

struct ControlLab {
    containerd: PrivateContainerd,
    rig: Rig,
    ctd: Containerd,
    cp: ControlPlane,
    agent: ControlledAgent,
    net: NetNode,
    watched: Watched,
    _scratch: tempfile::TempDir,
}

impl ControlLab {
    fn rows(&self) -> Vec<Row> {
        let out = std::process::Command::new(support::agent::BIN)
            .arg("--run-dir")
            .arg(self.agent.dir.path().join("run"))
            .args(["status", "--json"])
            .output();
        out.ok()
            .and_then(|o| serde_json::from_slice(&o.stdout).ok())
            .map(|s| invariants::rows(&s))
            .unwrap_or_default()
    }

    fn world(&self) -> World<'_> {
        World::of(&self.ctd, &self.net, &self.watched, self.agent.data_dir())
    }

    async fn converge(&self, plan: &Plan, bound: Duration) -> Result<(), String> {
        crate::converge_rows(|| self.rows(), |rows| converged(plan, rows), bound).await
    }

    async fn settle(&self, plan: &Plan) -> Vec<String> {
        let deadline = Instant::now() + crate::SETTLE;
        loop {
            let rows = self.rows();
            let mut broken = invariants::check_node(&self.world(), &rows).await;
            if !converged(plan, &rows) {
                broken.push(format!(
                    "status rows are not the wanted set: {:?}",
                    rows.iter()
                        .map(|r| (&r.id, &r.container_id, &r.state))
                        .collect::<Vec<_>>()
                ));
            }
            broken.extend(self.cp.with(|r| stream(plan, r)));
            if broken.is_empty() || Instant::now() > deadline {
                return broken;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

fn converged(plan: &Plan, rows: &[Row]) -> bool {
    rows.len() == plan.wanted.len()
        && rows.iter().all(|r| {
            matches!(r.state.as_str(), "HEALTHY" | "RUNNING")
                && plan.container_of(&r.id).as_deref() == Some(r.container_id.as_str())
        })
}

/// The control stream's promises: the newest report of each wanted
/// assignment is its current container, up; a removed one is not
/// observed after its removal; reports of one assignment never go back in time, and a
/// container's restart count never goes down.
fn stream(plan: &Plan, record: &Record) -> Vec<String> {
    let mut v = Vec::new();
    let (healthy, running) = (InstanceState::Healthy as i32, InstanceState::Running as i32);
    for id in plan.wanted.keys() {
        match record.latest_of(id) {
            Some(o)
                if (o.state == healthy || o.state == running)
                    && Some(&o.container_id) == plan.container_of(id).as_ref() => {}
            other => v.push(format!(
                "stream: the newest report of {id} is {:?}, want {:?} up",
                other.map(|o| (o.state, o.container_id)),
                plan.container_of(id)
            )),
        }
    }
    // Removed from the set, an assignment is no longer control's to hear
    // about (E-15 sends STOPPED only while it is still listed): nothing
    // observed later than its removal, give or take the stop's grace.
    for (id, removed) in &plan.gone {
        let Some(o) = record.latest_of(id) else {
            continue;
        };
        let at = o
            .updated_at
            .as_ref()
            .and_then(|t| u64::try_from(t.seconds).ok())
            .map(|s| SystemTime::UNIX_EPOCH + Duration::from_secs(s));
        if at.is_some_and(|at| at > *removed + REMOVAL_SLACK) {
            v.push(format!(
                "stream: removed {id} still reported ({}, {}) {:?} after its removal",
                o.state,
                o.container_id,
                at.and_then(|at| at.duration_since(*removed).ok())
            ));
        }
    }
    let mut last: BTreeMap<&str, (i64, i32)> = BTreeMap::new();
    let mut restarts: BTreeMap<(&str, &str), u32> = BTreeMap::new();
    for (session, frame) in &record.frames {
        let Some(Body::Status(batch)) = &frame.body else {
            continue;
        };
        for (id, o) in &batch.observed {
            let at = o
                .updated_at
                .as_ref()
                .map_or((0, 0), |t| (t.seconds, t.nanos));
            if let Some(prev) = last.insert(id.as_str(), at)
                && at < prev
            {
                v.push(format!(
                    "stream: {id} reported at {at:?} after {prev:?} (session {session}): reordered"
                ));
            }
            if let Some(before) =
                restarts.insert((id.as_str(), o.container_id.as_str()), o.restarts)
                && o.restarts < before
            {
                v.push(format!(
                    "stream: {id} ({}) restarts went from {before} to {}",
                    o.container_id, o.restarts
                ));
            }
        }
    }
    v.sort();
    v.dedup();
    v
}

/// Printed with Debug after each fault: that is where the fields are read.
#[allow(dead_code)]
#[derive(Debug)]
enum Fault {
    KillAgent {
        changes: Vec<String>,
        after: Duration,
    },
    ControlRestart {
        down: Duration,
    },
    Repush(Vec<String>),
    KillTask,
    BounceContainerd {
        down: Duration,
    },
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_under_a_control_plane_lose_no_status_report() {
    let Some(rig) = support::rig() else { return };
    let sizes = crate::sizes();
    let faults: usize = std::env::var("ZATTERA_CHAOS_CONTROL_FAULTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(25);
    println!(
        "chaos under control: seed {} (replay with ZATTERA_CHAOS_SEED={}), {faults} faults",
        sizes.seed, sizes.seed
    );
    let mut rng = Rng::new(sizes.seed ^ 0xC0);
    let mut plan = Plan::initial(20);

    let scratch = tempfile::tempdir().unwrap();
    let ns = format!("zt-test-chaosc-{}", std::process::id());
    let (containerd, ctd) = PrivateContainerd::start().with_test_image(&rig, &ns).await;
    let rig = Rig {
        socket: containerd.socket.clone(),
        ..rig
    };
    let foreign = crate::start_foreign(&ctd, scratch.path()).await;
    let cp = ControlPlane::start(&[SECRET]).await;
    cp.push_set(plan.set());
    let agent = ControlledAgent::start(&cp, SECRET, &rig, &ns, PREFIX).await;
    let run_dir = agent.dir.path().join("run");
    let mut cfg = zattera_netns::NetConfig::for_namespace(&ns, &run_dir).unwrap();
    cfg.bridge_prefix = PREFIX.into();
    let table = cfg.nft_table.clone();
    let mut lab = ControlLab {
        containerd,
        rig,
        ctd,
        cp,
        agent,
        net: NetNode::new(cfg).unwrap(),
        watched: Watched {
            table,
            foreign,
            counter: (String::new(), 0),
        },
        _scratch: scratch,
    };

    let outcome = std::panic::AssertUnwindSafe(async {
        if let Err(last) = lab.converge(&plan, Duration::from_secs(180)).await {
            panic!(
                "the starting set did not converge: {last}\n{}",
                lab.agent.log()
            );
        }
        let cid = plan.container_of(COUNTER).unwrap();
        let pid = match zattera_agent::runtime::containers::task_state(&lab.ctd, &cid).await {
            Ok(zattera_agent::runtime::containers::TaskState::Running { pid }) => pid,
            other => panic!("counter task: {other:?}"),
        };
        lab.watched.counter = (cid, pid);
        let mut violations: Vec<String> = lab
            .settle(&plan)
            .await
            .into_iter()
            .map(|v| format!("at the start: {v}"))
            .collect();
        let mut converge_ms = Vec::new();
        for k in 0..faults {
            let fault = match rng.below(100) {
                0..=24 => Fault::KillAgent {
                    changes: plan.change(&mut rng),
                    after: Duration::from_millis(rng.below(1500)),
                },
                25..=44 => Fault::ControlRestart {
                    down: Duration::from_millis(rng.below(3000)),
                },
                45..=69 => Fault::Repush(plan.change(&mut rng)),
                70..=84 => Fault::KillTask,
                _ => Fault::BounceContainerd {
                    down: Duration::from_millis(500 + rng.below(2500)),
                },
            };
            match &fault {
                Fault::KillAgent { after, .. } => {
                    lab.cp.push_set(plan.set());
                    tokio::time::sleep(*after).await;
                    lab.agent.kill9_and_restart(&lab.cp, &lab.rig);
                }
                Fault::ControlRestart { down } => {
                    lab.cp.stop().await;
                    tokio::time::sleep(*down).await;
                    lab.cp.restart().await;
                }
                Fault::Repush(_) => lab.cp.push_set(plan.set()),
                Fault::KillTask => {
                    let mut ids: Vec<String> = plan
                        .wanted
                        .keys()
                        .filter(|k| *k != COUNTER)
                        .cloned()
                        .collect();
                    ids.sort();
                    if let Some(cid) = rng.pick(&ids).and_then(|id| plan.container_of(id)) {
                        let _ = lab
                            .ctd
                            .tasks()
                            .kill(lab.ctd.request(KillRequest {
                                container_id: cid,
                                exec_id: String::new(),
                                signal: 9,
                                all: true,
                            }))
                            .await;
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
                Fault::BounceContainerd { down } => {
                    lab.containerd.down();
                    tokio::time::sleep(*down).await;
                    lab.containerd.up();
                }
            }
            let ended = Instant::now();
            match lab.converge(&plan, crate::CONVERGE_BOUND).await {
                Ok(()) => converge_ms.push(
                    u64::try_from(ended.elapsed().as_millis())
                        .unwrap_or(0)
                        .saturating_sub(1000),
                ),
                Err(last) => {
                    violations.push(format!("fault {k} ({fault:?}): not converged: {last}"));
                }
            }
            let broken = lab.settle(&plan).await;
            println!("control fault {k}: {fault:?}: {} violations", broken.len());
            violations.extend(
                broken
                    .into_iter()
                    .map(|v| format!("after fault {k} ({fault:?}): {v}")),
            );
            if violations.len() > 30 {
                break;
            }
        }
        converge_ms.sort_unstable();
        let frames = lab.cp.with(|r| r.frames.len());
        println!(
            "chaos under control figures: {}",
            serde_json::json!({
                "seed": sizes.seed,
                "faults": faults,
                "violations": violations.len(),
                "converge_ms_p50": crate::percentile(&converge_ms, 0.5),
                "converge_ms_p99": crate::percentile(&converge_ms, 0.99),
                "frames": frames,
            })
        );
        violations
    })
    .catch_unwind()
    .await;
    let _ = lab.agent.child.kill();
    let _ = lab.agent.child.wait();
    support::purge_namespace(&lab.ctd).await;
    let violations = outcome.unwrap_or_else(|p| std::panic::resume_unwind(p));
    assert!(
        violations.is_empty(),
        "seed {}: {} violations under control:\n{}\nagent log (newest first):\n{}",
        sizes.seed,
        violations.len(),
        violations.join("\n"),
        newest_first(&lab.agent.log())
    );
}
