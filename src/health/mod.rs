//! Health probing (runtime.md §10): one monitor task per live assignment,
//! probing from the host to the instance IP (HTTP, TCP) or inside the
//! container (exec), fast until the first pass ([`schedule`]), and
//! reporting only changes to the executor.

mod schedule;

use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::proto::v1::{HealthCheckType, ServiceSpec};
use crate::runtime::Containerd;
use crate::runtime::exec::{ExecRequest, exec};
use crate::status::State;

pub use schedule::{STARTUP_FIRST, STARTUP_LONGEST, STARTUP_LONGEST_EXEC, Schedule};

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
        let http = reqwest::Client::builder()
            .no_proxy()
            .redirect(same_instance_redirects(&task_probe))
            .timeout(timing.timeout)
            .build();
        let probe_once = || {
            // Each kind bounds itself: an exec probe must run to its own
            // timeout, which kills the process and removes its FIFOs;
            // dropping it half-way would leak both (and two threads). The
            // outer bound only catches a stuck containerd.
            let bounded = tokio::time::timeout(
                timing.timeout + EXEC_CLEANUP_GRACE,
                run_probe(&task_probe, http.as_ref().ok(), &exec_ctx, timing.timeout),
            );
            async move { bounded.await.unwrap_or(false) }
        };
        let longest = match task_probe {
            Probe::Exec { .. } => STARTUP_LONGEST_EXEC,
            _ => STARTUP_LONGEST,
        };
        probe_loop(timing, longest, probe_once, |state| {
            tracing::info!(assignment = %assignment_id, state = state.name(), "health changed");
            let _ = send(state);
        })
        .await;
    });
    Monitor {
        probe,
        container_id,
        task,
    }
}

/// Probes on the [`Schedule`] for ever, one probe at a time, and hands
/// every change of state to `changed`. Apart from what a probe is, so that
/// its rules can be tested in paused time.
async fn probe_loop<P, F>(
    timing: Timing,
    longest: Duration,
    mut probe: P,
    mut changed: impl FnMut(State),
) where
    P: FnMut() -> F,
    F: Future<Output = bool>,
{
    let started = tokio::time::Instant::now();
    let mut schedule = Schedule::new(&timing, longest);
    let mut verdicts = Verdicts::new(timing);
    loop {
        tokio::time::sleep(schedule.next_wait(started.elapsed())).await;
        let began = started.elapsed();
        let passed = probe().await;
        if !schedule.counts(passed, began) {
            continue;
        }
        if let Some(state) = verdicts.record(passed, started.elapsed()) {
            changed(state);
        }
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

    type Log<T> = std::sync::Arc<std::sync::Mutex<Vec<T>>>;

    /// Runs `probe_loop` for `run` of paused time with a probe that takes
    /// 40 ms and passes from `answers_at` on; returns each probe's (began,
    /// ended) and each change with its moment.
    async fn run_loop(
        timing: Timing,
        answers_at: Option<Duration>,
        run: Duration,
    ) -> (Vec<(Duration, Duration)>, Vec<(Duration, State)>) {
        let t0 = tokio::time::Instant::now();
        let calls: Log<(Duration, Duration)> = Log::default();
        let changes: Log<(Duration, State)> = Log::default();
        let in_flight = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let c = calls.clone();
        let probe = move || {
            let c = c.clone();
            let in_flight = in_flight.clone();
            async move {
                assert!(
                    !in_flight.swap(true, std::sync::atomic::Ordering::SeqCst),
                    "two probes at once"
                );
                let began = t0.elapsed();
                tokio::time::sleep(Duration::from_millis(40)).await;
                c.lock().unwrap().push((began, t0.elapsed()));
                in_flight.store(false, std::sync::atomic::Ordering::SeqCst);
                answers_at.is_some_and(|at| began >= at)
            }
        };
        let ch = changes.clone();
        let task = tokio::spawn(probe_loop(timing, STARTUP_LONGEST, probe, move |state| {
            ch.lock().unwrap().push((t0.elapsed(), state));
        }));
        tokio::time::sleep(run).await;
        task.abort();
        let calls = calls.lock().unwrap().clone();
        let changes = changes.lock().unwrap().clone();
        (calls, changes)
    }

    #[tokio::test(start_paused = true)]
    async fn probes_are_fast_until_the_first_pass_then_at_the_interval() {
        let t = Timing {
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
            grace: Duration::from_secs(60),
            threshold: 3,
        };
        let ready = Duration::from_millis(1_300);
        let (calls, changes) = run_loop(t, Some(ready), Duration::from_secs(35)).await;
        // HEALTHY within one startup step of the app's readiness, where the
        // interval schedule said it at 10 s; the startup failures (more
        // than the threshold) never made it UNHEALTHY.
        assert_eq!(changes.len(), 1, "{changes:?}");
        let (at, state) = changes[0];
        assert_eq!(state, State::Healthy);
        assert!(
            at <= ready + STARTUP_LONGEST + Duration::from_millis(40),
            "{at:?}"
        );
        let before: Vec<_> = calls.iter().filter(|(b, _)| *b < ready).collect();
        assert!(before.len() > 3, "{calls:?}");
        assert!(calls[0].0 <= STARTUP_FIRST, "{calls:?}");
        for pair in calls.windows(2) {
            let ((_, ended), (next, _)) = (pair[0], pair[1]);
            assert!(next >= ended, "overlap: {calls:?}");
            let wait = next.saturating_sub(ended);
            if ended < at {
                assert!(wait <= STARTUP_LONGEST, "{wait:?} in the startup phase");
            } else {
                assert_eq!(wait, t.interval, "after the first pass: {calls:?}");
            }
        }
        assert_eq!(
            calls.iter().filter(|(b, _)| *b > at).count(),
            3,
            "{calls:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn startup_failures_never_count_toward_the_threshold() {
        let t = Timing {
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            grace: Duration::from_secs(2),
            threshold: 3,
        };
        let (calls, changes) = run_loop(t, None, Duration::from_secs(6)).await;
        assert!(
            calls.iter().filter(|(b, _)| *b < t.grace).count() > 5,
            "{calls:?}"
        );
        // Three failures at the interval after the grace period, not the
        // first failure after it (which the startup phase's many would have
        // made the third).
        assert_eq!(changes.len(), 1, "{changes:?}");
        let (at, state) = changes[0];
        assert_eq!(state, State::Unhealthy);
        assert!(
            at >= t.grace + 2 * t.interval && at < t.grace + 3 * t.interval,
            "{at:?}"
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
