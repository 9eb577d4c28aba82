//! The BuildKit backend: a buildkitd the agent supervises on the host
//! with the containerd worker in the agent's own namespace (BLD-6's
//! containerd equivalent), driven through `buildctl` of the same pinned
//! release (BLD-8 option b): `--progress rawjson` lines are mapped to log
//! lines (BLD-10), the metadata file gives the digest (BLD-11), and killing
//! `buildctl` cancels its session and so the solve (BLD-12).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use super::child::{merged_lines, stop};
use super::progress::{SolveStatus, Vertex, status_lines};
use super::{Backend, BuildError, BuildSpec, Built, Events, Output, Phase, RegistryFiles, say};

/// The release buildkitd and buildctl must report.
pub const DEFAULT_BUILDKIT_VERSION: &str = "v0.18.2";
/// BLD-6's readiness deadline.
const READY_DEADLINE: Duration = Duration::from_secs(90);
/// Worker GC budget (BLD-6: BuildKit's default is left to chance).
const KEEP_STORAGE_MB: u64 = 10 * 1024;

#[derive(Debug)]
pub struct BuildKit {
    pub buildkitd: PathBuf,
    pub buildctl: PathBuf,
    pub version: String,
    pub containerd_address: PathBuf,
    pub namespace: String,
    /// `<data-dir>/buildkit`: the daemon's root and its config.
    pub root: PathBuf,
    /// `<run-dir>/buildkit/buildkitd.sock`, root-only.
    pub socket: PathBuf,
    daemon: Mutex<Option<tokio::process::Child>>,
}

impl BuildKit {
    pub fn new(
        buildkitd: PathBuf,
        containerd_address: &Path,
        namespace: &str,
        data_dir: &Path,
        run_dir: &Path,
    ) -> Self {
        let buildctl = buildkitd.with_file_name("buildctl");
        Self {
            buildkitd,
            buildctl,
            version: DEFAULT_BUILDKIT_VERSION.to_owned(),
            containerd_address: containerd_address.to_path_buf(),
            namespace: namespace.to_owned(),
            root: data_dir.join("buildkit"),
            socket: run_dir.join("buildkit/buildkitd.sock"),
            daemon: Mutex::new(None),
        }
    }

    fn addr(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// `buildkitd.toml`: the worker, GC budget and registry trust.
    pub fn config_text(&self, trusted: &[(String, PathBuf)]) -> String {
        let mut text = format!(
            "root = {root:?}\n\n[grpc]\n  address = [{addr:?}]\n  uid = 0\n  gid = 0\n\n\
             [worker.oci]\n  enabled = false\n\n[worker.containerd]\n  enabled = true\n  \
             address = {ctd:?}\n  namespace = {ns:?}\n  gc = true\n  gckeepstorage = \"{keep}MB\"\n",
            root = self.root.display().to_string(),
            addr = self.addr(),
            ctd = self.containerd_address.display().to_string(),
            ns = self.namespace,
            keep = KEEP_STORAGE_MB,
        );
        for (host, ca) in trusted {
            let _ = write!(
                text,
                // `http = false`: a loopback registry is TLS too (BuildKit
                // would otherwise speak plain HTTP to it).
                "\n[registry.{host:?}]\n  http = false\n  ca = [{:?}]\n",
                ca.display().to_string()
            );
        }
        text
    }

    /// The version the daemon at the socket reports, if it answers.
    async fn running_version(&self) -> Option<String> {
        let out = tokio::process::Command::new(&self.buildctl)
            .args(["--addr", &self.addr(), "debug", "info"])
            .kill_on_drop(true)
            .output();
        let out = tokio::time::timeout(Duration::from_secs(5), out)
            .await
            .ok()?
            .ok()?;
        if !out.status.success() {
            return None;
        }
        // "BuildKit: github.com/moby/buildkit v0.18.2 <commit>"
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .find(|w| w.starts_with('v') && w[1..].starts_with(|c: char| c.is_ascii_digit()))
            .map(str::to_owned)
    }

    /// Makes sure the pinned daemon answers with a config that trusts
    /// `trust` (the cluster registry and its CA): starts a stopped one,
    /// replaces one of another version or config, waits up to 90 s with
    /// log lines.
    async fn ensure_daemon(
        &self,
        events: &Events,
        trust: &[(&str, &[u8])],
    ) -> Result<(), BuildError> {
        let provision = |e: std::io::Error| BuildError::Provision(e.to_string());
        let mut daemon = self.daemon.lock().await;
        let mut trusted = Vec::new();
        for (host, ca) in trust {
            let dir = self.root.join("ca");
            std::fs::create_dir_all(&dir).map_err(provision)?;
            let file = dir.join(format!("{}.crt", host.replace([':', '/'], "_")));
            std::fs::write(&file, ca).map_err(provision)?;
            trusted.push(((*host).to_owned(), file));
        }
        let config = self.root.join("buildkitd.toml");
        let text = self.config_text(&trusted);
        let same_config = std::fs::read_to_string(&config).is_ok_and(|old| old == text);
        match self.running_version().await {
            Some(v) if v == self.version && same_config => return Ok(()),
            Some(v) if v == self.version => {
                say(
                    events,
                    Phase::Build,
                    "buildkitd configuration changed: restarting it",
                )
                .await;
                self.stop_daemon(daemon.take()).await;
            }
            Some(v) => {
                say(
                    events,
                    Phase::Build,
                    format!(
                        "buildkitd reports {v}, not the pinned {}: replacing it",
                        self.version
                    ),
                )
                .await;
                self.stop_daemon(daemon.take()).await;
            }
            None => {}
        }
        if let Some(child) = daemon.as_mut()
            && child.try_wait().ok().flatten().is_none()
        {
            return self.wait_ready(events).await;
        }
        say(
            events,
            Phase::Build,
            "provisioning build environment (starting buildkitd)…",
        )
        .await;
        std::fs::create_dir_all(&self.root).map_err(provision)?;
        if let Some(dir) = self.socket.parent() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(provision)?;
        }
        std::fs::write(&config, &text).map_err(provision)?;
        let log = std::fs::File::create(self.root.join("buildkitd.log")).map_err(provision)?;
        let child = tokio::process::Command::new(&self.buildkitd)
            .arg("--config")
            .arg(&config)
            .args(["--oci-worker=false", "--containerd-worker=true"])
            .arg("--containerd-worker-addr")
            .arg(&self.containerd_address)
            .arg("--containerd-worker-namespace")
            .arg(&self.namespace)
            .arg("--root")
            .arg(&self.root)
            .arg("--addr")
            .arg(self.addr())
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(provision)?)
            .stderr(log)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| BuildError::Provision(format!("{}: {e}", self.buildkitd.display())))?;
        if let Some(pid) = child.id() {
            let _ = std::fs::write(self.pid_file(), pid.to_string());
        }
        *daemon = Some(child);
        self.wait_ready(events).await
    }

    /// Where the daemon's pid is kept: a later agent replaces a daemon it
    /// did not start (after a restart) by it.
    pub fn pid_file(&self) -> PathBuf {
        self.socket.with_file_name("buildkitd.pid")
    }

    /// Stops the daemon: the child this agent holds, else the recorded pid.
    async fn stop_daemon(&self, child: Option<tokio::process::Child>) {
        if let Some(mut child) = child {
            let _ = child.kill().await;
        } else if let Some(pid) = std::fs::read_to_string(self.pid_file())
            .ok()
            .and_then(|t| t.trim().parse::<i32>().ok())
        {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(self.pid_file());
    }

    async fn wait_ready(&self, events: &Events) -> Result<(), BuildError> {
        let deadline = tokio::time::Instant::now() + READY_DEADLINE;
        let mut backoff = Duration::from_millis(200);
        loop {
            match self.running_version().await {
                Some(v) if v == self.version => return Ok(()),
                Some(v) => {
                    return Err(BuildError::Provision(format!(
                        "{} reports {v}, not the pinned {}",
                        self.buildkitd.display(),
                        self.version
                    )));
                }
                None => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(BuildError::Provision(
                    "buildkitd did not become ready within 1m30s".into(),
                ));
            }
            say(
                events,
                Phase::Build,
                "waiting for buildkitd to become ready…",
            )
            .await;
            tokio::time::sleep(backoff).await;
            if backoff < Duration::from_secs(2) {
                backoff *= 2;
            }
        }
    }
}

/// One `--progress rawjson` line (Go's `client.SolveStatus`).
#[derive(Debug, Deserialize, Default)]
struct RawStatus {
    #[serde(default)]
    vertexes: Vec<RawVertex>,
    #[serde(default)]
    logs: Vec<RawLog>,
}

#[derive(Debug, Deserialize)]
struct RawVertex {
    #[serde(default)]
    name: String,
    #[serde(default)]
    cached: bool,
    #[serde(default)]
    completed: Option<String>,
}

#[derive(Debug, Deserialize)]
struct RawLog {
    /// base64, as Go marshals `[]byte`.
    #[serde(default)]
    data: String,
}

/// The lines of one rawjson status line.
fn rawjson_lines(line: &str) -> Vec<String> {
    use base64::Engine as _;
    let Ok(raw) = serde_json::from_str::<RawStatus>(line) else {
        return Vec::new();
    };
    let status = SolveStatus {
        vertexes: raw
            .vertexes
            .into_iter()
            .map(|v| Vertex {
                name: v.name,
                cached: v.cached,
                completed: v.completed.is_some(),
            })
            .collect(),
        logs: raw
            .logs
            .into_iter()
            .filter_map(|l| {
                base64::engine::general_purpose::STANDARD
                    .decode(l.data)
                    .ok()
            })
            .collect(),
    };
    status_lines(&status)
}

#[tonic::async_trait]
impl Backend for BuildKit {
    fn name(&self) -> &'static str {
        "buildkit"
    }

    async fn build(
        &self,
        spec: &BuildSpec,
        events: &Events,
        cancel: &CancellationToken,
    ) -> Result<Built, BuildError> {
        let trust: Vec<(&str, &[u8])> = spec
            .registries
            .iter()
            .filter_map(|r| r.ca_pem.as_deref().map(|ca| (r.host.as_str(), ca)))
            .collect();
        self.ensure_daemon(events, &trust).await?;
        let files =
            RegistryFiles::write(&spec.scratch, &spec.registries).map_err(BuildError::Scratch)?;
        let meta = spec.scratch.join("metadata.json");
        let mut cmd = tokio::process::Command::new(&self.buildctl);
        cmd.args([
            "--addr",
            &self.addr(),
            "build",
            "--frontend",
            "dockerfile.v0",
        ])
        .arg("--local")
        .arg(format!("context={}", spec.context.display()))
        .arg("--local")
        .arg(format!("dockerfile={}", spec.context.display()))
        .arg("--opt")
        .arg(format!("filename={}", spec.dockerfile.display()))
        .arg("--opt")
        .arg(format!("platform={}", spec.platforms.join(",")));
        for (k, v) in &spec.build_args {
            cmd.arg("--opt").arg(format!("build-arg:{k}={v}"));
        }
        cmd.env("DOCKER_CONFIG", &files.dir);
        let output = match &spec.output {
            Output::Push { reference } => {
                format!("type=image,name={reference},push=true,unpack=true")
            }
            Output::Load { name } => format!("type=image,name={name},push=false,unpack=true"),
        };
        cmd.arg("--output")
            .arg(output)
            .arg("--metadata-file")
            .arg(&meta)
            .args(["--progress", "rawjson"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| BuildError::Solve(format!("{}: {e}", self.buildctl.display())))?;
        // rawjson goes to stderr; stdout stays quiet with a metadata file.
        let mut rx = merged_lines(&mut child);
        let mut last_error = String::new();
        let mut open = true;
        let status = loop {
            tokio::select! {
                line = rx.recv(), if open => match line {
                    Some(line) if line.starts_with('{') => {
                        for l in rawjson_lines(&line) {
                            say(events, Phase::Build, l).await;
                        }
                    }
                    Some(line) => {
                        if !line.trim().is_empty() {
                            line.trim().trim_start_matches("error: ").clone_into(&mut last_error);
                        }
                    }
                    None => open = false,
                },
                status = child.wait(), if !open => break status,
                () = cancel.cancelled() => {
                    // SIGINT: buildctl cancels its session, so the solve.
                    stop(&mut child, nix::sys::signal::Signal::SIGINT, Duration::from_secs(15)).await;
                    return Err(BuildError::Canceled);
                }
            }
        };
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => return Err(BuildError::Solve(format!("{last_error} ({s})"))),
            Err(e) => return Err(BuildError::Solve(e.to_string())),
        }
        let text = std::fs::read_to_string(&meta)
            .map_err(|e| BuildError::Solve(format!("no metadata from buildctl: {e}")))?;
        let meta: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| BuildError::Solve(e.to_string()))?;
        let digest = ["containerimage.digest", "containerimage.config.digest"]
            .iter()
            .find_map(|k| meta.get(*k).and_then(|v| v.as_str()))
            .unwrap_or_default()
            .to_owned();
        Ok(Built { digest })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn rawjson_lines_follow_the_reference_mapping() {
        let line = r#"{"vertexes":[{"digest":"sha256:1","name":"[1/2] FROM alpine","completed":"2026-01-01T00:00:00Z"},{"digest":"sha256:2","name":"[2/2] RUN build","cached":true},{"digest":"sha256:3","name":"","completed":"2026-01-01T00:00:00Z"}],"statuses":[{"id":"layer","current":5}],"logs":[{"vertex":"sha256:2","stream":1,"data":"Y29tcGlsaW5nLi4uCmxpbmtpbmcuLi4K"},{"vertex":"sha256:2","stream":1,"data":""}],"warnings":[]}"#;
        assert_eq!(
            rawjson_lines(line),
            [
                "[1/2] FROM alpine",
                "CACHED [2/2] RUN build",
                "compiling...",
                "linking..."
            ]
        );
        assert!(rawjson_lines("not json").is_empty());
    }

    #[test]
    fn the_daemon_config_pins_the_worker_and_trusts_the_cluster_registry() {
        let bk = BuildKit::new(
            PathBuf::from("/usr/bin/buildkitd"),
            Path::new("/run/containerd/containerd.sock"),
            "zattera",
            Path::new("/var/lib/zattera"),
            Path::new("/run/zattera"),
        );
        let trusted = [(
            "10.90.0.1:5000".into(),
            PathBuf::from("/var/lib/zattera/ca/ca.crt"),
        )];
        let text = bk.config_text(&trusted);
        let parsed: toml::Value = toml::from_str(&text).unwrap();
        assert_eq!(
            parsed["worker"]["containerd"]["namespace"].as_str(),
            Some("zattera")
        );
        assert_eq!(parsed["worker"]["oci"]["enabled"].as_bool(), Some(false));
        assert_eq!(
            parsed["registry"]["10.90.0.1:5000"]["ca"][0].as_str(),
            Some("/var/lib/zattera/ca/ca.crt")
        );
        assert_eq!(bk.buildctl, Path::new("/usr/bin/buildctl"));
    }
}
