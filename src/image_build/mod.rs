//! Builds on the node (dataplane.md §9): a source tarball (or a git ref)
//! becomes an image that is pushed to the cluster registry or loaded into
//! this node's containerd.
//!
//! The pipeline ([`pipeline`]) fetches the source ([`source`]), unpacks it
//! ([`unpack`]), picks the strategy ([`strategy`]), runs the nixpacks planner
//! when there is no Dockerfile ([`plan`]), then hands a [`BuildSpec`] to a
//! [`Backend`]: BuildKit ([`buildkit`]) or buildah ([`buildah`]). Every
//! backend reports the same [`Event`]s; [`progress`] maps their output to
//! lines and adds the heartbeat. [`builds`] tracks the builds in flight for
//! cancellation.

pub mod bases;
pub mod buildah;
pub mod buildkit;
pub mod builds;
pub mod child;
pub mod fetches;
pub mod network;
pub mod pipeline;
pub mod plan;
pub mod progress;
pub mod settings;
pub mod source;
pub mod strategy;
pub mod unpack;

use std::collections::BTreeMap;
use std::path::PathBuf;

use tokio_util::sync::CancellationToken;

pub use builds::Builds;
pub use pipeline::{BuildRequest, Pipeline, PipelineConfig};

/// The step a line comes from. Dropped on the wire (BLD-10), kept for the
/// local CLI's display.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Source,
    Plan,
    Build,
}

/// What a build reports while it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Log { phase: Phase, line: String },
}

impl Event {
    pub fn log(phase: Phase, line: String) -> Self {
        Self::Log { phase, line }
    }

    pub fn line(&self) -> Option<&str> {
        match self {
            Self::Log { line, .. } => Some(line),
        }
    }
}

/// Where events go: a bounded channel (BLD-10: 128). A reader that went
/// away makes sends fail, which cancels the build.
pub type Events = tokio::sync::mpsc::Sender<Event>;

/// A registry and the one credential a build may use for it.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryAuth {
    /// `host[:port]`, as the push reference spells it.
    pub host: String,
    pub username: String,
    pub password: String,
    /// A CA to trust for this registry only (the cluster CA), PEM.
    pub ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for RegistryAuth {
    // The password stays out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryAuth")
            .field("host", &self.host)
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// Where the image goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Pushed to `reference` (BLD-9 production).
    Push { reference: String },
    /// Recorded in this node's containerd as `name` (BLD-9 dev).
    Load { name: String },
}

/// A context ready to build: what every backend is given.
#[derive(Debug, Clone)]
pub struct BuildSpec {
    pub id: String,
    /// Whose build it is: a backend keeps each project's state apart.
    pub project: String,
    pub context: PathBuf,
    /// Relative to `context`.
    pub dockerfile: PathBuf,
    pub platforms: Vec<String>,
    pub build_args: BTreeMap<String, String>,
    pub output: Output,
    /// The registries the build may pull from and push to with a
    /// credential or a CA of their own (the cluster registry), at most one
    /// credential each.
    pub registries: Vec<RegistryAuth>,
    /// A scratch directory of this build (removed with it) for the
    /// backend's own temporary files.
    pub scratch: PathBuf,
    /// Where `RUN` steps' traffic goes.
    pub network: network::StepNetwork,
}

/// What a successful build produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Built {
    /// The manifest (or index, for several platforms) digest.
    pub digest: String,
}

/// A build failure; its text is what users see in `Build.error`, with the
/// reference's step prefixes (BLD-11).
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("fetch source: {0}")]
    Source(String),
    /// The build's own network could not be made.
    #[error("build network: {0}")]
    Network(String),
    #[error("unpack source: {0}")]
    Unpack(#[from] unpack::UnpackError),
    #[error("builder: scratch dir: {0}")]
    Scratch(std::io::Error),
    #[error("nixpacks plan: {0}")]
    Plan(String),
    #[error(
        "builder: emulation: no emulator for {platform} (no enabled qemu handler in /proc/sys/fs/binfmt_misc); install qemu-user-static with binfmt support, or build for {native} only"
    )]
    NoEmulator { platform: String, native: String },
    #[error("builder: provision: {0}")]
    Provision(String),
    #[error("builder: solve: {0}")]
    Solve(String),
    /// A tenant's Dockerfile names an image on the node itself.
    #[error(
        "builder: image {image:?} reads the node's own files ({transport}:); builds take their images from registries"
    )]
    LocalImage {
        image: String,
        transport: &'static str,
    },
    /// A tenant's Dockerfile the check refuses (a custom frontend, ARG
    /// values past their bounds).
    #[error("builder: {0}")]
    Refused(String),
    #[error("builder: push: {0}")]
    Push(String),
    #[error("builder: load image: {0}")]
    Load(String),
    #[error("builder: solve: build timed out after {}", humantime::format_duration(*.0))]
    TimedOut(std::time::Duration),
    /// Cancelled: by CancelBuild (CANCELED) or the caller leaving.
    #[error("builder: solve: context canceled")]
    Canceled,
}

/// A way of building images: BuildKit or buildah.
#[tonic::async_trait]
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// `buildkit` or `buildah`, for logs and the CLI.
    fn name(&self) -> &'static str;

    /// Builds `spec`, reporting lines to `events`. When `cancel` fires, the
    /// backend stops its work (processes killed, containers removed)
    /// before it returns [`BuildError::Canceled`].
    async fn build(
        &self,
        spec: &BuildSpec,
        events: &Events,
        cancel: &CancellationToken,
    ) -> Result<Built, BuildError>;

    /// Whether the backend's daemon attaches `RUN` steps to the build
    /// bridge itself (BuildKit, through CNI) rather than joining a
    /// namespace the pipeline makes per build (buildah).
    fn attaches_steps_itself(&self) -> bool {
        false
    }
}

/// The files that give a backend its registries: `<dir>/config.json`
/// (Docker's format, read by buildah's `--authfile`), 0600, and
/// `<dir>/certs/*.crt`, the CAs.
#[derive(Debug, Clone)]
pub struct RegistryFiles {
    pub dir: PathBuf,
    pub authfile: PathBuf,
    pub certs: PathBuf,
}

impl RegistryFiles {
    #[allow(clippy::disallowed_methods)] // one build's scratch, removed with it
    pub fn write(scratch: &std::path::Path, registries: &[RegistryAuth]) -> std::io::Result<Self> {
        use base64::Engine as _;
        use std::io::Write as _;
        use std::os::unix::fs::OpenOptionsExt as _;
        let dir = scratch.join("registry");
        let certs = dir.join("certs");
        std::fs::create_dir_all(&certs)?;
        let mut auths = serde_json::Map::new();
        for (i, r) in registries.iter().enumerate() {
            // An anonymous registry gets no entry (an empty one would be sent).
            if !r.username.is_empty() {
                let token = base64::engine::general_purpose::STANDARD
                    .encode(format!("{}:{}", r.username, r.password));
                auths.insert(r.host.clone(), serde_json::json!({ "auth": token }));
            }
            if let Some(ca) = &r.ca_pem {
                std::fs::write(certs.join(format!("registry-{i}.crt")), ca)?;
            }
        }
        let authfile = dir.join("config.json");
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&authfile)?
            .write_all(serde_json::json!({ "auths": auths }).to_string().as_bytes())?;
        Ok(Self {
            dir,
            authfile,
            certs,
        })
    }
}

/// Sends a line; a reader that went away cancels the build.
pub(crate) async fn say(events: &Events, phase: Phase, line: impl Into<String>) {
    let _ = events.send(Event::log(phase, line.into())).await;
}

/// Whether `program` is installed: a file at its path, or a name on PATH.
fn installed(program: &std::path::Path) -> bool {
    if program.components().count() > 1 {
        return program.is_file();
    }
    program
        .to_str()
        .and_then(crate::programs::on_path)
        .is_some()
}

/// What [`choose_backend`] needs of the node.
#[derive(Debug, Clone)]
pub struct Host<'a> {
    pub settings: &'a settings::BuildSettings,
    pub ctd: Option<crate::runtime::Containerd>,
    pub containerd_address: &'a std::path::Path,
    pub namespace: &'a str,
    pub data_dir: &'a std::path::Path,
    pub run_dir: &'a std::path::Path,
    /// The node's OCI runtime, which buildah's `RUN` steps use too.
    pub oci_runtime: &'a crate::runtime::oci_runtime::OciRuntime,
}

/// A backend the settings name and this node has installed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Available {
    BuildKit,
    Buildah,
}

/// Why a node has no builder (RunBuild answers UNIMPLEMENTED with it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoBuilder {
    #[error("builds are off on this node (build-backend = \"off\")")]
    Off,
    #[error("build-backend is buildkit, but {} is not installed (buildkitd-binary)", .0.display())]
    NoBuildkitd(std::path::PathBuf),
    #[error("build-backend is buildah, but buildah is not installed (apt install buildah)")]
    NoBuildah,
    #[error("this node has no builder: neither buildkitd ({}) nor buildah is installed", .0.display())]
    Neither(std::path::PathBuf),
}

/// Which backend builds here, or why none does. What `doctor` reports and
/// what the join's `builder` label says.
pub fn available_backend(s: &settings::BuildSettings) -> Result<Available, NoBuilder> {
    use self::settings::BuildBackendKind as Kind;
    match s.backend {
        Kind::Off => Err(NoBuilder::Off),
        Kind::BuildKit | Kind::Auto if installed(&s.buildkitd) => Ok(Available::BuildKit),
        Kind::BuildKit => Err(NoBuilder::NoBuildkitd(s.buildkitd.clone())),
        Kind::Buildah | Kind::Auto if installed(std::path::Path::new("buildah")) => {
            Ok(Available::Buildah)
        }
        Kind::Buildah => Err(NoBuilder::NoBuildah),
        Kind::Auto => Err(NoBuilder::Neither(s.buildkitd.clone())),
    }
}

/// The configured backend; `Err` says why there is none (a node without a
/// builder answers UNIMPLEMENTED with it).
pub fn choose_backend(host: &Host<'_>) -> Result<std::sync::Arc<dyn Backend>, NoBuilder> {
    let s = host.settings;
    let buildkit = || {
        let mut bk = buildkit::BuildKit::new(
            s.buildkitd.clone(),
            host.containerd_address,
            host.namespace,
            host.data_dir,
            host.run_dir,
        );
        bk.version.clone_from(&s.buildkit_version);
        std::sync::Arc::new(bk) as std::sync::Arc<dyn Backend>
    };
    let buildah = || {
        let mut b = buildah::Buildah::new(host.data_dir, host.run_dir, host.ctd.clone());
        b.oci_runtime = host.oci_runtime.clone();
        std::sync::Arc::new(b) as std::sync::Arc<dyn Backend>
    };
    Ok(match available_backend(s)? {
        Available::BuildKit => buildkit(),
        Available::Buildah => buildah(),
    })
}
