//! The faults, drawn from the seeded generator, and how each is inflicted
//! on the real agent, containerd and kernel.

use std::fmt;
use std::process::Command;
use std::time::{Duration, Instant};

use containerd_client::services::v1::KillRequest;

use crate::Lab;
use crate::invariants::{self, Row};
use crate::model::{COUNTER, Desired, ENVS, Rng, TOO_BIG, too_big_manifest};

/// One manifest change.
#[derive(Debug, Clone)]
pub enum Edit {
    Replicas {
        app: String,
        to: u32,
    },
    /// A new generation: every instance of the app is replaced.
    Replace {
        app: String,
    },
    Add {
        env: &'static str,
        replicas: u32,
        publish: bool,
    },
    Delete {
        app: String,
    },
}

#[derive(Debug, Clone)]
pub enum Fault {
    /// A burst of edits, then SIGKILL of the agent `after` into the pass
    /// they start (pulls, bring-ups, teardowns, firewall writes), and a
    /// restart.
    KillAgent { edits: Vec<Edit>, after: Duration },
    /// containerd stopped for `down`, then started again, under the agent.
    BounceContainerd { down: Duration },
    /// Manifest edits, additions and deletions, written back to back.
    Burst(Vec<Edit>),
    /// SIGKILL to every process of an instance, from outside.
    KillTask,
    /// An instance's network namespace file unmounted and removed.
    RemoveNetns,
    /// An instance's host veth deleted.
    DeleteVeth,
    /// An app whose image does not fit the content store: its pull fails,
    /// the others keep running, and it is deleted again.
    DiskFull,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::KillAgent { edits, after } => {
                write!(f, "kill the agent {} ms into {edits:?}", after.as_millis())
            }
            Self::BounceContainerd { down } => {
                write!(f, "containerd down for {} ms", down.as_millis())
            }
            Self::Burst(edits) => write!(f, "edits {edits:?}"),
            Self::KillTask => f.write_str("kill a task from outside"),
            Self::RemoveNetns => f.write_str("remove a netns file"),
            Self::DeleteVeth => f.write_str("delete a veth"),
            Self::DiskFull => f.write_str("a pull into a full disk"),
        }
    }
}

impl Fault {
    /// A short name, for counting faults by kind.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::KillAgent { .. } => "agent SIGKILL",
            Self::BounceContainerd { .. } => "containerd restart",
            Self::Burst(_) => "manifest burst",
            Self::KillTask => "task killed",
            Self::RemoveNetns => "netns file removed",
            Self::DeleteVeth => "veth deleted",
            Self::DiskFull => "pull into a full disk",
        }
    }
}

/// The most apps the loop grows to, and the fewest it shrinks to.
const MAX_APPS: usize = 9;
const MIN_APPS: usize = 4;

fn edits(rng: &mut Rng, desired: &Desired) -> Vec<Edit> {
    let mut model = desired.clone();
    let mut out = Vec::new();
    for _ in 0..=rng.below(3) {
        let editable = model.editable();
        let edit = match rng.below(4) {
            0 => rng.pick(&editable).map(|app| Edit::Replicas {
                app: app.clone(),
                to: u32::try_from(rng.below(5)).unwrap_or(1),
            }),
            1 => rng
                .pick(&editable)
                .map(|app| Edit::Replace { app: app.clone() }),
            2 if editable.len() < MAX_APPS => Some(Edit::Add {
                env: ENVS[usize::try_from(rng.below(2)).unwrap_or(0)],
                replicas: 1 + u32::try_from(rng.below(3)).unwrap_or(0),
                publish: rng.below(2) == 0,
            }),
            _ if editable.len() > MIN_APPS => rng
                .pick(&editable)
                .map(|app| Edit::Delete { app: app.clone() }),
            _ => None,
        };
        if let Some(e) = edit {
            apply_to(&mut model, &e);
            out.push(e);
        }
    }
    out
}

/// Changes the model only; [`write`] puts it on disk.
fn apply_to(desired: &mut Desired, edit: &Edit) -> Option<String> {
    match edit {
        Edit::Replicas { app, to } => {
            desired.apps.get_mut(app)?.replicas = *to;
            Some(app.clone())
        }
        Edit::Replace { app } => {
            desired.apps.get_mut(app)?.generation += 1;
            Some(app.clone())
        }
        Edit::Add {
            env,
            replicas,
            publish,
        } => Some(desired.add(env, *replicas, *publish)),
        Edit::Delete { app } => {
            desired.apps.remove(app)?;
            desired.gone.push(app.clone());
            Some(app.clone())
        }
    }
}

pub fn choose(rng: &mut Rng, desired: &Desired) -> Fault {
    match rng.below(100) {
        0..=24 => Fault::KillAgent {
            edits: edits(rng, desired),
            after: Duration::from_millis(rng.below(1500)),
        },
        25..=34 => Fault::BounceContainerd {
            down: Duration::from_millis(500 + rng.below(3000)),
        },
        35..=59 => Fault::Burst(edits(rng, desired)),
        60..=71 => Fault::KillTask,
        72..=81 => Fault::RemoveNetns,
        82..=91 => Fault::DeleteVeth,
        _ => Fault::DiskFull,
    }
}

/// Writes the edits' apps (or removes their files) in the lab's manifest
/// directory, one after another.
fn write(lab: &Lab, desired: &mut Desired, edits: &[Edit]) {
    let rows = lab.rows();
    for e in edits {
        if let Edit::Replace { app } = e {
            desired.stale.extend(
                rows.iter()
                    .filter(|r| r.app == *app)
                    .map(|r| r.container_id.clone()),
            );
        }
        let Some(app) = apply_to(desired, e) else {
            continue;
        };
        match desired.apps.get(&app) {
            Some(a) => lab
                .agent
                .write_manifest(&format!("{app}.toml"), &a.manifest(&app)),
            None => {
                let _ = std::fs::remove_file(lab.agent.manifests().join(format!("{app}.toml")));
            }
        }
    }
}

/// An instance a fault may hit (never the counter), chosen by the seed.
fn victim(rng: &mut Rng, rows: &[Row]) -> Option<Row> {
    let mut candidates: Vec<&Row> = rows.iter().filter(|r| r.app != COUNTER).collect();
    candidates.sort_by(|a, b| a.id.cmp(&b.id));
    rng.pick(&candidates).map(|r| (*r).clone())
}

impl Fault {
    /// Inflicts the fault. An `Err` is a broken promise seen while doing it
    /// (the full-disk pull not failing as it should).
    pub async fn inflict(
        &self,
        lab: &mut Lab,
        desired: &mut Desired,
        rng: &mut Rng,
    ) -> Result<(), String> {
        match self {
            Self::KillAgent { edits, after } => {
                write(lab, desired, edits);
                tokio::time::sleep(*after).await;
                lab.agent.kill9();
                lab.agent.start();
            }
            Self::BounceContainerd { down } => {
                lab.containerd.down();
                tokio::time::sleep(*down).await;
                lab.containerd.up();
            }
            Self::Burst(edits) => write(lab, desired, edits),
            Self::KillTask => {
                if let Some(row) = victim(rng, &lab.rows()) {
                    let _ = lab
                        .ctd
                        .tasks()
                        .kill(lab.ctd.request(KillRequest {
                            container_id: row.container_id.clone(),
                            exec_id: String::new(),
                            signal: 9,
                            all: true,
                        }))
                        .await;
                    // Converge is timed from when the agent has seen it.
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while Instant::now() < deadline {
                        let now = lab.rows().into_iter().find(|r| r.id == row.id);
                        if now.is_none_or(|r| r.restarts > row.restarts || r.state != row.state) {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            Self::RemoveNetns => {
                if let Some(row) = victim(rng, &lab.rows()) {
                    let path = lab.agent.run_dir().join("netns").join(&row.container_id);
                    let _ = Command::new("umount").arg(&path).output();
                    let _ = std::fs::remove_file(&path);
                }
            }
            Self::DeleteVeth => {
                if let Some(row) = victim(rng, &lab.rows())
                    && let Some(veth) = lab.host_veth_of(&row.container_id).await
                {
                    let _ = Command::new("ip").args(["link", "del", &veth]).output();
                }
            }
            Self::DiskFull => return lab.disk_full().await,
        }
        Ok(())
    }
}

impl Lab {
    async fn disk_full(&mut self) -> Result<(), String> {
        let file = format!("{TOO_BIG}.toml");
        self.agent
            .write_manifest(&file, &too_big_manifest(&self.big_image));
        let deadline = Instant::now() + Duration::from_secs(60);
        let outcome = loop {
            let rows = self.rows();
            let row = rows.iter().find(|r| r.app == TOO_BIG).cloned();
            if let Some(r) = &row
                && r.state == "FAILED"
            {
                break if r.message.contains("no space left") {
                    Ok(())
                } else {
                    Err(format!(
                        "{TOO_BIG}: FAILED without naming the full disk: {}",
                        r.message
                    ))
                };
            }
            if Instant::now() > deadline {
                break Err(format!("{TOO_BIG}: not FAILED within 60 s; last {row:?}"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let _ = std::fs::remove_file(self.agent.manifests().join(&file));
        outcome
    }

    /// The host end of a container's veth, from the kernel.
    async fn host_veth_of(&self, container_id: &str) -> Option<String> {
        let inv = zattera_netns::inventory::read(&self.net).await.ok()?;
        let index = inv
            .netns
            .iter()
            .find(|n| n.container_id == container_id)?
            .host_ifindex?;
        inv.veths
            .into_iter()
            .find(|v| v.index == index)
            .map(|v| v.name)
    }

    pub fn rows(&self) -> Vec<Row> {
        self.agent
            .status()
            .map(|s| invariants::rows(&s))
            .unwrap_or_default()
    }
}
