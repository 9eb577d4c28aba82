//! The BuildKit backend: a buildkitd the agent supervises on the host
//! with the containerd worker in a namespace of its own, `<ns>-build`
//! (BLD-6's containerd equivalent; 45.2: a build never sees the images
//! tenants pulled into the agent's namespace, and BuildKit's fallback to
//! its local store finds no image record, as each is removed once the
//! build hands it over). `RUN` steps join the build bridge through CNI
//! (45.1, [`crate::image_build::network::cni_config`]). Driven by a native client of its control API
//! (types from `bollard-buildkit-proto`): `Info` for the version pin,
//! `Solve` with the Dockerfile frontend (BLD-8) and the image exporter
//! (BLD-9), `Status` mapped to log lines (BLD-10), the exporter response's
//! digest (BLD-11). The session ([`session`]) sends the context through
//! `FileSync.DiffCopy` ([`filesync`]) and answers `Auth` with the build's
//! one credential. Dropping the solve call cancels it in the daemon
//! (BLD-12).

pub mod filesync;
pub mod session;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use bollard_buildkit_proto::moby::buildkit::v1::control_client::ControlClient;
use bollard_buildkit_proto::moby::buildkit::v1::{
    CacheOptions, Exporter, InfoRequest, SolveRequest, StatusRequest, StatusResponse,
};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use crate::image_build::network::StepNetwork;
use crate::image_build::progress::{SolveStatus, Vertex, status_lines};
use crate::image_build::{Backend, BuildError, BuildSpec, Built, Events, Output, Phase, say};
use crate::runtime::{Containerd, ImageRef};

/// The release buildkitd must report.
pub const DEFAULT_BUILDKIT_VERSION: &str = "v0.18.2";
/// BLD-6's readiness deadline.
const READY_DEADLINE: Duration = Duration::from_secs(90);
/// How long a replaced daemon gets to close its network namespaces.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Worker GC budget (BLD-6: BuildKit's default is left to chance).
const KEEP_STORAGE_MB: u64 = 10 * 1024;
/// Network namespaces BuildKit keeps ready on the build bridge (each holds
/// an address while idle): as many as builds may run at once by default.
const CNI_POOL: u32 = 2;
/// Where Debian's containernetworking-plugins and upstream's tarball put
/// the CNI plugins.
const CNI_PLUGIN_DIRS: [&str; 2] = ["/usr/lib/cni", "/opt/cni/bin"];

/// The containerd namespace BuildKit's worker uses for the agent's
/// namespace `ns`.
pub fn worker_namespace(ns: &str) -> String {
    format!("{ns}-build")
}

/// How buildkitd's `RUN` steps reach the network: a daemon-wide choice.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DaemonNetwork {
    /// On the build bridge through CNI: the config file and plugin dir.
    Cni {
        config: PathBuf,
        plugins: PathBuf,
    },
    Host,
}

#[derive(Debug)]
pub struct BuildKit {
    pub buildkitd: PathBuf,
    pub version: String,
    pub containerd_address: PathBuf,
    /// The agent's namespace, where a loaded image goes.
    pub namespace: String,
    /// The worker's namespace ([`worker_namespace`]).
    pub worker_namespace: String,
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
        Self {
            buildkitd,
            version: DEFAULT_BUILDKIT_VERSION.to_owned(),
            containerd_address: containerd_address.to_path_buf(),
            namespace: namespace.to_owned(),
            worker_namespace: worker_namespace(namespace),
            root: data_dir.join("buildkit"),
            socket: run_dir.join("buildkit/buildkitd.sock"),
            daemon: Mutex::new(None),
        }
    }

    fn addr(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// `buildkitd.toml`: the worker, its network, GC budget and registry
    /// trust.
    fn config_text(&self, trusted: &[(String, PathBuf)], network: &DaemonNetwork) -> String {
        let mut text = format!(
            "root = {root:?}\n\n[grpc]\n  address = [{addr:?}]\n  uid = 0\n  gid = 0\n\n\
             [worker.oci]\n  enabled = false\n\n[worker.containerd]\n  enabled = true\n  \
             address = {ctd:?}\n  namespace = {ns:?}\n  gc = true\n  gckeepstorage = \"{keep}MB\"\n",
            root = self.root.display().to_string(),
            addr = self.addr(),
            ctd = self.containerd_address.display().to_string(),
            ns = self.worker_namespace,
            keep = KEEP_STORAGE_MB,
        );
        match network {
            DaemonNetwork::Cni { config, plugins } => {
                let _ = write!(
                    text,
                    "  networkMode = \"cni\"\n  cniConfigPath = {:?}\n  cniBinaryPath = {:?}\n  cniPoolSize = {CNI_POOL}\n",
                    config.display().to_string(),
                    plugins.display().to_string(),
                );
            }
            DaemonNetwork::Host => text.push_str("  networkMode = \"host\"\n"),
        }
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

    /// A client of the daemon's control API on its socket (dialled lazily).
    fn control(&self) -> ControlClient<Channel> {
        let path = self.socket.clone();
        let channel = Endpoint::from_static("http://buildkitd.invalid")
            .connect_timeout(Duration::from_secs(5))
            .connect_with_connector_lazy(tower::service_fn(move |_| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }));
        ControlClient::new(channel)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20)
    }

    /// The version the daemon at the socket reports (`Info`), if it answers.
    async fn running_version(&self) -> Option<String> {
        if !self.socket.exists() {
            return None;
        }
        let mut control = self.control();
        let info = tokio::time::timeout(Duration::from_secs(5), control.info(InfoRequest {}))
            .await
            .ok()?
            .ok()?
            .into_inner();
        info.buildkit_version.map(|v| v.version)
    }

    /// Makes sure the pinned daemon answers with a config that trusts
    /// `trust` (the cluster registry and its CA): starts a stopped one,
    /// replaces one of another version or config, waits up to 90 s with
    /// log lines.
    #[allow(clippy::disallowed_methods)] // buildkitd's configuration, written again at every start
    async fn ensure_daemon(
        &self,
        events: &Events,
        trust: &[(&str, &[u8])],
        steps: &StepNetwork,
    ) -> Result<(), BuildError> {
        let provision = |e: std::io::Error| BuildError::Provision(e.to_string());
        let mut daemon = self.daemon.lock().await;
        let network = self.daemon_network(steps)?;
        let mut trusted = Vec::new();
        for (host, ca) in trust {
            let dir = self.root.join("ca");
            std::fs::create_dir_all(&dir).map_err(provision)?;
            let file = dir.join(format!("{}.crt", host.replace([':', '/'], "_")));
            std::fs::write(&file, ca).map_err(provision)?;
            trusted.push(((*host).to_owned(), file));
        }
        let config = self.root.join("buildkitd.toml");
        let text = self.config_text(&trusted, &network);
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
            .arg(&self.worker_namespace)
            .arg("--root")
            .arg(&self.root)
            .arg("--addr")
            .arg(self.addr())
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(provision)?)
            .stderr(log)
            // Its own process group and no kill on drop: the daemon
            // outlives this process and the next agent adopts it.
            .process_group(0)
            .spawn()
            .map_err(|e| BuildError::Provision(format!("{}: {e}", self.buildkitd.display())))?;
        if let Some(pid) = child.id() {
            let _ = std::fs::write(self.pid_file(), pid.to_string());
        }
        *daemon = Some(child);
        self.wait_ready(events).await
    }

    /// The daemon's network for steps that go to `steps`; the CNI config
    /// is written (a changed one changes buildkitd.toml's text too, as its
    /// path holds the bridge's name).
    #[allow(clippy::disallowed_methods)] // buildkitd's configuration, written again at every start
    fn daemon_network(&self, steps: &StepNetwork) -> Result<DaemonNetwork, BuildError> {
        match steps {
            StepNetwork::Host => Ok(DaemonNetwork::Host),
            StepNetwork::Bridge { name, subnet } => {
                let plugins = CNI_PLUGIN_DIRS
                    .iter()
                    .map(PathBuf::from)
                    .find(|d| d.join("bridge").is_file() && d.join("host-local").is_file())
                    .ok_or_else(|| {
                        BuildError::Network(format!(
                            "BuildKit's build network needs the CNI bridge and host-local plugins \
                             (in {}): apt install containernetworking-plugins, or set \
                             build-network = \"host\"",
                            CNI_PLUGIN_DIRS.join(" or ")
                        ))
                    })?;
                let dir = self.root.join("cni");
                std::fs::create_dir_all(&dir)
                    .map_err(|e| BuildError::Provision(format!("{}: {e}", dir.display())))?;
                let config = dir.join(format!("{name}-{}.conf", subnet.slot()));
                let text =
                    crate::image_build::network::cni_config(name, *subnet, &dir.join("ipam"));
                if std::fs::read_to_string(&config).ok().as_deref() != Some(text.as_str()) {
                    std::fs::write(&config, text)
                        .map_err(|e| BuildError::Provision(format!("{}: {e}", config.display())))?;
                }
                Ok(DaemonNetwork::Cni { config, plugins })
            }
            StepNetwork::None => Err(BuildError::Network(
                "build-network = \"none\" is not available with BuildKit (its steps take the \
                 build bridge or, by the operator's choice, the host's network)"
                    .into(),
            )),
            StepNetwork::Namespace { .. } => Err(BuildError::Network(
                "BuildKit attaches its steps itself: it takes the build bridge, not a namespace"
                    .into(),
            )),
        }
    }

    /// The built image leaves the worker's namespace: a loaded one is
    /// copied into the agent's, and the record goes either way, so that
    /// BuildKit's fallback to its local store never finds one tenant's
    /// image for another's `FROM`.
    async fn hand_over(&self, output: &Output) -> Result<(), BuildError> {
        let handover = |e: String| BuildError::Solve(format!("hand the image over: {e}"));
        let worker_ns = self
            .worker_namespace
            .parse()
            .map_err(|e: crate::runtime::InvalidName| handover(e.to_string()))?;
        let worker = Containerd::connect(&self.containerd_address, worker_ns)
            .await
            .map_err(|e| handover(e.to_string()))?;
        let name = match output {
            Output::Push { reference } => reference,
            Output::Load { name } => name,
        };
        let loaded = async {
            if let Output::Load { .. } = output {
                let agent_ns = self
                    .namespace
                    .parse()
                    .map_err(|e: crate::runtime::InvalidName| e.to_string())?;
                let agent = Containerd::connect(&self.containerd_address, agent_ns)
                    .await
                    .map_err(|e| e.to_string())?;
                let image: ImageRef = name.parse().map_err(|e| format!("{name}: {e}"))?;
                crate::runtime::transfer::copy_image(&worker, &agent, &image)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Ok::<(), String>(())
        }
        .await;
        // BuildKit records the name as given.
        if let Err(e) = crate::runtime::images::delete_image(&worker, name).await {
            tracing::warn!(image = %name, error = %e, "build image record left in the worker's namespace");
        }
        loaded.map_err(handover)
    }

    /// Where the daemon's pid is kept: a later agent replaces a daemon it
    /// did not start (after a restart) by it.
    pub fn pid_file(&self) -> PathBuf {
        self.socket.with_file_name("buildkitd.pid")
    }

    /// Stops the daemon (the child this agent holds, else the recorded
    /// pid): SIGTERM first, so that it gives its CNI namespaces and their
    /// addresses back, SIGKILL after [`STOP_GRACE`].
    async fn stop_daemon(&self, mut child: Option<tokio::process::Child>) {
        let recorded = || {
            std::fs::read_to_string(self.pid_file())
                .ok()
                .and_then(|t| t.trim().parse::<u32>().ok())
        };
        let pid = child
            .as_ref()
            .and_then(tokio::process::Child::id)
            .or_else(recorded)
            .and_then(|p| i32::try_from(p).ok())
            .map(nix::unistd::Pid::from_raw);
        if let Some(pid) = pid {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let deadline = tokio::time::Instant::now() + STOP_GRACE;
            let mut gone = false;
            while !gone && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                // A child of this agent stays a zombie until waited for.
                gone = match child.as_mut() {
                    Some(c) => c.try_wait().ok().flatten().is_some(),
                    None => nix::sys::signal::kill(pid, None).is_err(),
                };
            }
            if !gone {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
        if let Some(mut child) = child {
            let _ = child.wait().await;
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

/// A session or solve id as BuildKit's clients make them (25 of a-z0-9).
fn random_id() -> String {
    const ALPHABET: &[u8; 36] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    (0..25)
        .map(|_| char::from(ALPHABET[rand::random_range(0..ALPHABET.len())]))
        .collect()
}

/// The lines of one `Status` update.
fn update_lines(update: &StatusResponse) -> Vec<String> {
    status_lines(&SolveStatus {
        vertexes: update
            .vertexes
            .iter()
            .map(|v| Vertex {
                name: v.name.clone(),
                cached: v.cached,
                completed: v.completed.is_some(),
            })
            .collect(),
        logs: update.logs.iter().map(|l| l.msg.clone()).collect(),
    })
}

/// The Solve of `spec` on session `session` (BLD-8, BLD-9).
fn solve_request(spec: &BuildSpec, reference: &str, session: &str) -> SolveRequest {
    let mut frontend_attrs = HashMap::from([
        ("filename".to_owned(), spec.dockerfile.display().to_string()),
        ("platform".to_owned(), spec.platforms.join(",")),
    ]);
    for (k, v) in &spec.build_args {
        frontend_attrs.insert(format!("build-arg:{k}"), v.clone());
    }
    // Either way the image runs from the agent's namespace: pushed, it is
    // pulled there by digest; loaded, it is copied there and unpacked
    // ([`crate::runtime::transfer::copy_image`]). Unpacking it in the
    // worker's as well would apply every layer twice.
    let (name, push) = match &spec.output {
        Output::Push { reference } => (reference.as_str(), "true"),
        Output::Load { name } => (name.as_str(), "false"),
    };
    let attrs = [("name", name), ("push", push), ("unpack", "false")];
    SolveRequest {
        r#ref: reference.to_owned(),
        session: session.to_owned(),
        frontend: "dockerfile.v0".into(),
        frontend_attrs,
        // Always set: v0.18.2 dereferences it unchecked (a nil pointer
        // there takes the whole daemon down).
        cache: Some(CacheOptions::default()),
        exporters: vec![Exporter {
            r#type: "image".into(),
            attrs: attrs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }],
        ..SolveRequest::default()
    }
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
        self.ensure_daemon(events, &trust, &spec.network).await?;
        let control = self.control();
        // Both local names the frontend asks for are the context (BLD-8),
        // so `.dockerignore` is the frontend's to apply.
        let dirs = HashMap::from([
            ("context".to_owned(), spec.context.clone()),
            ("dockerfile".to_owned(), spec.context.clone()),
        ]);
        let session = session::open(&control, dirs, spec.registries.clone())
            .map_err(|e| BuildError::Solve(format!("session: {}", e.message())))?;
        let reference = random_id();
        let mut solving = control.clone();
        let request = solve_request(spec, &reference, &session.id);
        let solve = async move { solving.solve(request).await };
        tokio::pin!(solve);
        let mut status_client = control.clone();
        let status_ref = reference.clone();
        let (lines_tx, mut lines_rx) = tokio::sync::mpsc::channel::<String>(128);
        let status_task = tokio::spawn(async move {
            // The solve registers its ref as it starts: retry briefly.
            for _ in 0..50 {
                let stream = status_client
                    .status(StatusRequest {
                        r#ref: status_ref.clone(),
                    })
                    .await;
                if let Ok(stream) = stream {
                    let mut stream = stream.into_inner();
                    while let Ok(Some(update)) = stream.message().await {
                        for line in update_lines(&update) {
                            if lines_tx.send(line).await.is_err() {
                                return;
                            }
                        }
                    }
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        let mut lines_open = true;
        let answer = loop {
            tokio::select! {
                line = lines_rx.recv(), if lines_open => match line {
                    Some(line) => say(events, Phase::Build, line).await,
                    None => lines_open = false,
                },
                r = &mut solve => break r,
                () = cancel.cancelled() => {
                    // Dropping the call cancels the solve in the daemon.
                    status_task.abort();
                    drop(session);
                    return Err(BuildError::Canceled);
                }
            }
        };
        // The last status lines come after the solve answers.
        if let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(5), status_task).await {}
        while let Ok(line) = lines_rx.try_recv() {
            say(events, Phase::Build, line).await;
        }
        drop(session);
        let response = answer
            .map_err(|e| BuildError::Solve(e.message().to_owned()))?
            .into_inner();
        let digest = ["containerimage.digest", "containerimage.config.digest"]
            .iter()
            .find_map(|k| response.exporter_response.get(*k))
            .cloned()
            .unwrap_or_default();
        self.hand_over(&spec.output).await?;
        Ok(Built { digest })
    }

    fn attaches_steps_itself(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::disallowed_methods)]
    use super::*;
    use bollard_buildkit_proto::moby::buildkit::v1::{Vertex as BkVertex, VertexLog};

    #[test]
    fn status_updates_follow_the_reference_mapping() {
        let done = Some(bollard_buildkit_proto::google::protobuf::Timestamp::default());
        let update = StatusResponse {
            vertexes: vec![
                BkVertex {
                    name: "[1/2] FROM alpine".into(),
                    completed: done,
                    ..BkVertex::default()
                },
                BkVertex {
                    name: "[2/2] RUN build".into(),
                    cached: true,
                    ..BkVertex::default()
                },
                BkVertex {
                    completed: done,
                    ..BkVertex::default()
                },
            ],
            logs: vec![
                VertexLog {
                    msg: b"compiling...\nlinking...\n".to_vec(),
                    ..VertexLog::default()
                },
                VertexLog::default(),
            ],
            ..StatusResponse::default()
        };
        assert_eq!(
            update_lines(&update),
            [
                "[1/2] FROM alpine",
                "CACHED [2/2] RUN build",
                "compiling...",
                "linking..."
            ]
        );
    }

    #[test]
    fn the_solve_names_the_frontend_the_platforms_and_the_exporter() {
        let spec = BuildSpec {
            id: "b".into(),
            project: "p".into(),
            context: PathBuf::from("/ctx"),
            dockerfile: PathBuf::from(".nixpacks/Dockerfile"),
            platforms: vec!["linux/amd64".into(), "linux/arm64".into()],
            build_args: [("V".to_owned(), "1".to_owned())].into_iter().collect(),
            output: Output::Push {
                reference: "10.90.0.1:5000/p/a:b".into(),
            },
            registries: Vec::new(),
            scratch: PathBuf::from("/s"),
            network: crate::image_build::network::StepNetwork::Host,
        };
        let req = solve_request(&spec, "r1", "s1");
        assert_eq!(req.frontend, "dockerfile.v0");
        assert_eq!(req.frontend_attrs["filename"], ".nixpacks/Dockerfile");
        assert_eq!(req.frontend_attrs["platform"], "linux/amd64,linux/arm64");
        assert_eq!(req.frontend_attrs["build-arg:V"], "1");
        assert_eq!(req.session, "s1");
        let ex = &req.exporters[0];
        assert_eq!(ex.r#type, "image");
        assert_eq!(ex.attrs["push"], "true");
        assert_eq!(ex.attrs["unpack"], "false");
        assert_eq!(ex.attrs["name"], "10.90.0.1:5000/p/a:b");
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
        let network = DaemonNetwork::Cni {
            config: PathBuf::from("/var/lib/zattera/buildkit/cni/ztb-254.conf"),
            plugins: PathBuf::from("/usr/lib/cni"),
        };
        let text = bk.config_text(&trusted, &network);
        let parsed: toml::Value = toml::from_str(&text).unwrap();
        let worker = &parsed["worker"]["containerd"];
        assert_eq!(worker["namespace"].as_str(), Some("zattera-build"));
        assert_eq!(worker["networkMode"].as_str(), Some("cni"));
        assert_eq!(
            worker["cniConfigPath"].as_str(),
            Some("/var/lib/zattera/buildkit/cni/ztb-254.conf")
        );
        assert_eq!(worker["cniBinaryPath"].as_str(), Some("/usr/lib/cni"));
        let host: toml::Value =
            toml::from_str(&bk.config_text(&trusted, &DaemonNetwork::Host)).unwrap();
        assert_eq!(
            host["worker"]["containerd"]["networkMode"].as_str(),
            Some("host")
        );
        assert_eq!(parsed["worker"]["oci"]["enabled"].as_bool(), Some(false));
        assert_eq!(
            parsed["registry"]["10.90.0.1:5000"]["ca"][0].as_str(),
            Some("/var/lib/zattera/ca/ca.crt")
        );
        assert_eq!(
            parsed["registry"]["10.90.0.1:5000"]["http"].as_bool(),
            Some(false)
        );
    }
}
