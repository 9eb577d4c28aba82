//! Health probing (runtime.md §10): one monitor task per live assignment,
//! probing from the host to the instance IP (HTTP, TCP) or inside the
//! container (exec), and reporting only changes to the executor.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::proto::v1::{HealthCheckType, ServiceSpec};
use crate::runtime::Containerd;
use crate::runtime::exec::{ExecRequest, exec};
use crate::status::State;

pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
pub const DEFAULT_GRACE: Duration = Duration::from_secs(60);
pub const DEFAULT_THRESHOLD: u32 = 3;
pub const DEFAULT_HTTP_PATH: &str = "/healthz";

/// What to probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// No health check: HEALTHY at once (H-2).
    None,
    Http {
        addr: SocketAddr,
        path: String,
    },
    Tcp {
        addr: SocketAddr,
    },
    Exec {
        container_id: String,
        command: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    pub interval: Duration,
    pub timeout: Duration,
    pub grace: Duration,
    pub threshold: u32,
}

/// A state change, for the executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthUpdate {
    pub assignment_id: String,
    pub container_id: String,
    pub state: State,
}

fn duration_or(d: Option<&prost_types::Duration>, default: Duration) -> Duration {
    d.and_then(|d| Duration::try_from(*d).ok())
        .filter(|d| !d.is_zero())
        .unwrap_or(default)
}

/// The probe and timing for an instance (H-3 to H-5); `None` when the
/// target cannot be resolved yet (no IP or no port): retried next reconcile.
pub fn resolve(
    spec: Option<&ServiceSpec>,
    ip: Option<Ipv4Addr>,
    container_id: &str,
) -> Option<(Probe, Timing)> {
    let Some(check) = spec.and_then(|s| s.healthcheck.as_ref()) else {
        return Some((Probe::None, default_timing()));
    };
    let timing = Timing {
        interval: duration_or(check.interval.as_ref(), DEFAULT_INTERVAL),
        timeout: duration_or(check.timeout.as_ref(), DEFAULT_TIMEOUT),
        grace: duration_or(check.grace_period.as_ref(), DEFAULT_GRACE),
        threshold: if check.unhealthy_threshold == 0 {
            DEFAULT_THRESHOLD
        } else {
            check.unhealthy_threshold
        },
    };
    let ports = spec.map(|s| s.ports.as_slice()).unwrap_or_default();
    let kind = match HealthCheckType::try_from(check.r#type).unwrap_or(HealthCheckType::Unspecified)
    {
        HealthCheckType::Unspecified if ports.is_empty() => HealthCheckType::Tcp,
        HealthCheckType::Unspecified => HealthCheckType::Http,
        other => other,
    };
    if kind == HealthCheckType::Exec {
        return Some((
            Probe::Exec {
                container_id: container_id.to_owned(),
                command: check.command.clone(),
            },
            timing,
        ));
    }
    let port = if check.port > 0 {
        check.port
    } else {
        ports.first().map_or(0, |p| p.container_port)
    };
    let port = u16::try_from(port).ok().filter(|p| *p > 0)?;
    let addr = SocketAddr::new(ip?.into(), port);
    let probe = if kind == HealthCheckType::Http {
        let path = if check.path.is_empty() {
            DEFAULT_HTTP_PATH.to_owned()
        } else {
            check.path.clone()
        };
        let path = if path.starts_with('/') {
            path
        } else {
            format!("/{path}")
        };
        Probe::Http { addr, path }
    } else {
        Probe::Tcp { addr }
    };
    Some((probe, timing))
}

fn default_timing() -> Timing {
    Timing {
        interval: DEFAULT_INTERVAL,
        timeout: DEFAULT_TIMEOUT,
        grace: DEFAULT_GRACE,
        threshold: DEFAULT_THRESHOLD,
    }
}

/// The H-10 state machine, apart from any I/O.
#[derive(Debug, Clone)]
pub struct Verdicts {
    state: State,
    fails: u32,
    passed_once: bool,
    threshold: u32,
    grace: Duration,
}

impl Verdicts {
    pub fn new(timing: Timing) -> Self {
        Self {
            state: State::Running,
            fails: 0,
            passed_once: false,
            threshold: timing.threshold,
            grace: timing.grace,
        }
    }

    /// Feeds one probe result; returns the new state when it changed.
    pub fn record(&mut self, passed: bool, elapsed: Duration) -> Option<State> {
        if passed {
            self.fails = 0;
            self.passed_once = true;
            if self.state != State::Healthy {
                self.state = State::Healthy;
                return Some(State::Healthy);
            }
            return None;
        }
        self.fails += 1;
        let flip = (self.state == State::Healthy && self.fails >= self.threshold)
            || (self.state != State::Unhealthy
                && !self.passed_once
                && elapsed >= self.grace
                && self.fails >= self.threshold);
        if flip {
            self.state = State::Unhealthy;
            return Some(State::Unhealthy);
        }
        None
    }
}

/// A running monitor; dropping it stops the probing.
#[derive(Debug)]
pub struct Monitor {
    pub probe: Probe,
    pub container_id: String,
    task: JoinHandle<()>,
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What exec probes need.
#[derive(Debug, Clone)]
pub struct ExecContext {
    pub ctd: Containerd,
    pub fifo_dir: PathBuf,
}

/// Starts probing; changes go to `updates`.
pub fn spawn(
    assignment_id: String,
    container_id: String,
    probe: Probe,
    timing: Timing,
    exec_ctx: ExecContext,
    updates: mpsc::Sender<HealthUpdate>,
) -> Monitor {
    let task_probe = probe.clone();
    let task_container = container_id.clone();
    let task = tokio::spawn(async move {
        let send = |state| {
            updates.try_send(HealthUpdate {
                assignment_id: assignment_id.clone(),
                container_id: task_container.clone(),
                state,
            })
        };
        if task_probe == Probe::None {
            let _ = send(State::Healthy);
            return;
        }
        let started = Instant::now();
        let mut verdicts = Verdicts::new(timing);
        let http = reqwest::Client::builder()
            .no_proxy()
            .redirect(same_instance_redirects(&task_probe))
            .timeout(timing.timeout)
            .build();
        loop {
            tokio::time::sleep(timing.interval).await;
            // Each kind bounds itself: an exec probe must run to its own
            // timeout, which kills the process and removes its FIFOs;
            // dropping it half-way would leak both (and two threads). The
            // outer bound only catches a stuck containerd.
            let passed = tokio::time::timeout(
                timing.timeout + EXEC_CLEANUP_GRACE,
                run_probe(&task_probe, http.as_ref().ok(), &exec_ctx, timing.timeout),
            )
            .await
            .unwrap_or(false);
            if let Some(state) = verdicts.record(passed, started.elapsed()) {
                tracing::info!(assignment = %assignment_id, state = state.name(), "health changed");
                let _ = send(state);
            }
        }
    });
    Monitor {
        probe,
        container_id,
        task,
    }
}

/// Time an exec probe gets past its timeout to kill and clean up.
const EXEC_CLEANUP_GRACE: Duration = Duration::from_secs(15);

/// Redirects are followed only to the instance itself: the probe runs in the
/// host's network namespace, and a container must not point it anywhere else
/// (the host's own services, another instance, the internet).
fn same_instance_redirects(probe: &Probe) -> reqwest::redirect::Policy {
    let Probe::Http { addr, .. } = probe else {
        return reqwest::redirect::Policy::none();
    };
    let instance = *addr;
    reqwest::redirect::Policy::custom(move |attempt| {
        let url = attempt.url();
        let same = url.scheme() == "http"
            && url
                .host_str()
                .and_then(|h| h.parse::<std::net::IpAddr>().ok())
                == Some(instance.ip())
            && url.port_or_known_default() == Some(instance.port());
        if attempt.previous().len() >= 10 || !same {
            attempt.stop()
        } else {
            attempt.follow()
        }
    })
}

async fn run_probe(
    probe: &Probe,
    http: Option<&reqwest::Client>,
    exec_ctx: &ExecContext,
    timeout: Duration,
) -> bool {
    match probe {
        Probe::None => true,
        Probe::Tcp { addr } => tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr))
            .await
            .is_ok_and(|r| r.is_ok()),
        Probe::Http { addr, path } => {
            let Some(client) = http else { return false };
            client
                .get(format!("http://{addr}{path}"))
                .send()
                .await
                .is_ok_and(|r| (200..400).contains(&r.status().as_u16()))
        }
        Probe::Exec {
            container_id,
            command,
        } => {
            if command.trim().is_empty() {
                return true;
            }
            let req = ExecRequest {
                args: vec!["/bin/sh".into(), "-c".into(), command.clone()],
                timeout,
                ..ExecRequest::default()
            };
            exec(&exec_ctx.ctd, container_id, &exec_ctx.fifo_dir, &req)
                .await
                .is_ok_and(|o| !o.timed_out && o.exit_code == 0)
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use crate::proto::v1::{HealthCheck, PortSpec};

    fn timing(grace: u64, threshold: u32) -> Timing {
        Timing {
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            grace: Duration::from_secs(grace),
            threshold,
        }
    }

    #[test]
    fn passes_and_failures_follow_h10() {
        let mut v = Verdicts::new(timing(60, 3));
        let t = Duration::from_secs;
        assert_eq!(v.record(false, t(1)), None, "failures in grace do not flip");
        assert_eq!(v.record(false, t(2)), None);
        assert_eq!(v.record(false, t(3)), None, "still inside grace");
        assert_eq!(
            v.record(false, t(61)),
            Some(State::Unhealthy),
            "first failure after grace flips"
        );
        assert_eq!(v.record(false, t(62)), None, "only changes are emitted");
        assert_eq!(v.record(true, t(63)), Some(State::Healthy));
        assert_eq!(v.record(true, t(64)), None);
        assert_eq!(v.record(false, t(65)), None);
        assert_eq!(v.record(false, t(66)), None);
        assert_eq!(
            v.record(false, t(67)),
            Some(State::Unhealthy),
            "threshold after a pass"
        );
    }

    fn spec(check: Option<HealthCheck>, ports: &[u32]) -> ServiceSpec {
        ServiceSpec {
            healthcheck: check,
            ports: ports
                .iter()
                .map(|p| PortSpec {
                    name: format!("p{p}"),
                    container_port: *p,
                    ..PortSpec::default()
                })
                .collect(),
            ..ServiceSpec::default()
        }
    }

    #[test]
    fn resolves_probe_targets_like_h4_h5() {
        let ip = Some(Ipv4Addr::new(10, 201, 0, 2));
        assert_eq!(
            resolve(Some(&spec(None, &[80])), ip, "c").unwrap().0,
            Probe::None
        );
        let http = HealthCheck {
            r#type: HealthCheckType::Http as i32,
            path: "ready".into(),
            ..HealthCheck::default()
        };
        let (probe, t) = resolve(Some(&spec(Some(http), &[8080])), ip, "c").unwrap();
        assert_eq!(
            probe,
            Probe::Http {
                addr: "10.201.0.2:8080".parse().unwrap(),
                path: "/ready".into()
            }
        );
        assert_eq!(t, default_timing());
        let unspecified = HealthCheck::default();
        assert!(matches!(
            resolve(Some(&spec(Some(unspecified.clone()), &[80])), ip, "c")
                .unwrap()
                .0,
            Probe::Http { .. }
        ));
        assert!(
            resolve(Some(&spec(Some(unspecified.clone()), &[])), ip, "c").is_none(),
            "TCP with no port never resolves"
        );
        assert!(
            resolve(Some(&spec(Some(unspecified), &[80])), None, "c").is_none(),
            "no IP yet"
        );
        let exec = HealthCheck {
            r#type: HealthCheckType::Exec as i32,
            command: "true".into(),
            ..HealthCheck::default()
        };
        assert!(matches!(
            resolve(Some(&spec(Some(exec), &[])), None, "c").unwrap().0,
            Probe::Exec { .. }
        ));
    }
}
