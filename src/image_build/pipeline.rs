//! One build from source to image (BLD-1): fetch, unpack into a scratch
//! directory that is always removed, choose the strategy, plan, check the
//! emulators, build under the 30 min bound.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::plan::Planner;
use super::progress::{HEARTBEAT_AFTER, relay_with_heartbeat};
use super::source::{self, GitSource};
use super::strategy::{self, Strategy};
use super::unpack::{self, Limits};
use super::{Backend, BuildError, BuildSpec, Events, Output, Phase, RegistryAuth, say};
use crate::link::tls::CurrentTls;
use crate::runtime::pull::{ClusterRegistryWatch, Credentials};

/// BLD-8: emulators, provisioning and the solve, not the plan.
pub const BUILD_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// Where a build's source comes from.
#[derive(Debug, Clone)]
pub enum Source {
    /// A gzip-compressed tar at control's blob endpoint (BLD-2).
    Tarball {
        url: String,
    },
    Git(GitSource),
    /// A local directory (the `build` command): built in place with its
    /// Dockerfile, copied into the scratch for a nixpacks plan.
    Dir(PathBuf),
}

/// A build as asked for, by the node API or the CLI.
#[derive(Clone)]
pub struct BuildRequest {
    pub id: String,
    /// The project the build is for (`Build.project_id`; empty for a
    /// local build): the builder state it may read and write.
    pub project: String,
    pub source: Source,
    pub platforms: Vec<String>,
    /// Pushed there; `None`: loaded into containerd as `load_name`.
    pub push_ref: Option<String>,
    pub load_name: String,
    pub build_args: BTreeMap<String, String>,
    /// NIXPACKS_* hints for the planner.
    pub build_env: BTreeMap<String, String>,
    /// A push credential the request itself carries (control sends none).
    pub registry_credential: Option<(String, String)>,
}

impl std::fmt::Debug for BuildRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuildRequest")
            .field("id", &self.id)
            .field("project", &self.project)
            .field("source", &self.source)
            .field("platforms", &self.platforms)
            .field("push_ref", &self.push_ref)
            .finish_non_exhaustive()
    }
}

/// What a finished build reports (BLD-11).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub digest: String,
    pub platforms: Vec<String>,
}

/// What every build of this node shares.
#[derive(Debug, Clone)]
pub struct PipelineConfig {
    pub data_dir: PathBuf,
    /// Where scratch directories go ([`scratch_root`]).
    pub scratch_root: PathBuf,
    /// The node identity for source fetches; `None` without a control plane.
    pub node_tls: Option<CurrentTls>,
    pub cluster_registry: Option<ClusterRegistryWatch>,
    pub planner: Planner,
    pub binfmt_misc: PathBuf,
    pub limits: Limits,
    pub timeout: Duration,
    pub heartbeat: Duration,
    /// The `build-network` setting.
    pub network: super::buildah::BuildNetwork,
    /// The build bridge, for a private network; without it (a local
    /// `zattera-agent build`, the operator's own) steps use the host's.
    pub sandbox: Option<Arc<super::network::BuildNet>>,
    /// Whether a tenant's Dockerfile may name a `# syntax=` frontend.
    pub custom_frontends: bool,
}

impl PipelineConfig {
    pub fn new(data_dir: &Path) -> Self {
        Self {
            data_dir: data_dir.to_path_buf(),
            scratch_root: scratch_root(data_dir),
            node_tls: None,
            cluster_registry: None,
            planner: Planner::default(),
            binfmt_misc: PathBuf::from("/proc/sys/fs/binfmt_misc"),
            limits: Limits::default(),
            timeout: BUILD_TIMEOUT,
            heartbeat: HEARTBEAT_AFTER,
            network: super::buildah::BuildNetwork::default(),
            sandbox: None,
            custom_frontends: false,
        }
    }
}

/// The build pipeline with its backend.
#[derive(Debug, Clone)]
pub struct Pipeline {
    pub config: PipelineConfig,
    pub backend: Arc<dyn Backend>,
}

/// Where builds' scratch directories go: beside the data dir, never in it
/// (`<data-dir>-build`, so /var/lib/zattera-build on a packaged node). The
/// data dir is 0700 (keys, volumes), and the unprivileged nixpacks planner
/// must reach its context (45.4); this root is root's and 0711, so other
/// users may pass through it but not list it.
pub fn scratch_root(data_dir: &Path) -> PathBuf {
    let name = data_dir
        .file_name()
        .map_or_else(|| "zattera".into(), |n| n.to_string_lossy().into_owned());
    data_dir.with_file_name(format!("{name}-build"))
}

/// The scratch directory `<scratch root>/src-*`, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn create(root: &Path, id: &str) -> std::io::Result<Self> {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        let tag: String = id
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .take(24)
            .collect();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o711)
            .create(root)?;
        let meta = std::fs::symlink_metadata(root)?;
        if !meta.is_dir() || meta.uid() != rustix::process::geteuid().as_raw() {
            return Err(std::io::Error::other(format!(
                "{}: not a directory of this user's; remove it",
                root.display()
            )));
        }
        // Modes are set, not asked for: the unit's UMask=0077 would make
        // them 0700, and the planner could not pass.
        std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o711))?;
        let dir = root.join(format!("src-{tag}-{:08x}", rand::random::<u32>()));
        std::fs::DirBuilder::new().mode(0o711).create(&dir)?;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))?;
        Ok(Self(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            tracing::warn!(dir = %self.0.display(), error = %e, "build scratch not removed");
        }
    }
}

impl Pipeline {
    /// Runs `req`, reporting to `events`; the outcome or the failure.
    pub async fn run(
        &self,
        req: BuildRequest,
        events: Events,
        cancel: CancellationToken,
    ) -> Result<Outcome, BuildError> {
        let (inner, relayed) = mpsc::channel(128);
        let relay = tokio::spawn(relay_with_heartbeat(
            relayed,
            events.clone(),
            self.config.heartbeat,
        ));
        let result = {
            let stages = self.stages(&req, &inner, &cancel);
            tokio::pin!(stages);
            tokio::select! {
                r = &mut stages => r,
                // A caller that stops reading cancels the build (BLD-10);
                // the backend stops its work before the stages end.
                () = events.closed() => {
                    cancel.cancel();
                    stages.await
                }
            }
        };
        drop(inner);
        let _ = relay.await;
        result
    }

    async fn stages(
        &self,
        req: &BuildRequest,
        events: &Events,
        cancel: &CancellationToken,
    ) -> Result<Outcome, BuildError> {
        let scratch =
            Scratch::create(&self.config.scratch_root, &req.id).map_err(BuildError::Scratch)?;
        let context = match &req.source {
            // A local directory with its Dockerfile is built where it is:
            // nothing writes into it, and copying it would cost more than
            // a cached build. A nixpacks plan writes, so it gets a copy.
            Source::Dir(dir) if Strategy::detect(dir) == Strategy::Dockerfile => dir
                .canonicalize()
                .map_err(|e| BuildError::Source(format!("{}: {e}", dir.display())))?,
            _ => {
                let context = scratch.0.join("context");
                self.fetch(req, &scratch.0, &context, events).await?;
                context
            }
        };
        let strategy = Strategy::detect(&context);
        if strategy == Strategy::Nixpacks {
            say(events, Phase::Plan, "no Dockerfile: planning with nixpacks").await;
            self.config
                .planner
                .plan(&context, &req.build_env, events, cancel)
                .await?;
        }
        // A local directory is the operator's own; any other source is a
        // tenant's, whose images must come from registries.
        if !matches!(req.source, Source::Dir(_)) {
            let dockerfile = super::bases::read_dockerfile(&context.join(strategy.dockerfile()))
                .map_err(BuildError::Source)?;
            let cluster = self.cluster_registry();
            // Another project's image in the cluster registry (56.6).
            let foreign = |image: &str| {
                let reference: crate::runtime::ImageRef = image.parse().ok()?;
                cluster
                    .as_ref()?
                    .refuses(reference.domain(), reference.path(), &req.project)
            };
            let fetched = super::bases::check_with(
                &dockerfile,
                &req.build_args,
                self.config.custom_frontends,
                &foreign,
            )
            .map_err(|refused| match refused {
                super::bases::Refused::LocalImage { image, transport } => {
                    BuildError::LocalImage { image, transport }
                }
                other => BuildError::Refused(other.to_string()),
            })?;
            for url in fetched {
                if let Some(why) = super::fetches::refuses(&url).await {
                    return Err(BuildError::Refused(format!(
                        "ADD {why} (put the file in the build context)"
                    )));
                }
            }
        }
        let mut bridge = None;
        let lease = match (self.config.network, &self.config.sandbox) {
            (super::buildah::BuildNetwork::Private, Some(sandbox))
                if self.backend.attaches_steps_itself() =>
            {
                bridge = Some(sandbox.bridge().await.map_err(BuildError::Network)?);
                None
            }
            (super::buildah::BuildNetwork::Private, Some(sandbox)) => {
                Some(sandbox.enter(&req.id).await.map_err(BuildError::Network)?)
            }
            _ => None,
        };
        let network = match (&lease, bridge, self.config.network) {
            (Some(lease), _, _) => lease.network.clone(),
            (None, Some(bridge), _) => bridge,
            (None, None, super::buildah::BuildNetwork::None) => super::network::StepNetwork::None,
            (None, None, _) => super::network::StepNetwork::Host,
        };
        let result = self
            .solve(
                req,
                context,
                strategy,
                scratch.0.clone(),
                network,
                events,
                cancel,
            )
            .await;
        if let Some(lease) = lease {
            lease.leave().await;
        }
        result
    }

    #[allow(clippy::too_many_arguments)]
    async fn solve(
        &self,
        req: &BuildRequest,
        context: PathBuf,
        strategy: Strategy,
        scratch: PathBuf,
        network: super::network::StepNetwork,
        events: &Events,
        cancel: &CancellationToken,
    ) -> Result<Outcome, BuildError> {
        let platforms = strategy::resolve_platforms(&req.platforms);
        let platforms = &platforms;
        let spec = BuildSpec {
            id: req.id.clone(),
            project: req.project.clone(),
            context: context.clone(),
            dockerfile: strategy.dockerfile(),
            platforms: platforms.clone(),
            build_args: req.build_args.clone(),
            output: match &req.push_ref {
                Some(reference) => Output::Push {
                    reference: reference.clone(),
                },
                None => Output::Load {
                    name: req.load_name.clone(),
                },
            },
            registries: self.registries(req),
            scratch,
            network,
        };
        let spec = &spec;
        let build = async {
            say(events, Phase::Build, "starting build").await;
            let native = strategy::native_platform();
            let needed = strategy::needing_emulation(platforms, &native);
            if let Some(platform) = strategy::missing_emulator(&needed, &self.config.binfmt_misc) {
                return Err(BuildError::NoEmulator {
                    platform: platform.to_owned(),
                    native,
                });
            }
            self.backend.build(spec, events, cancel).await
        };
        tokio::pin!(build);
        let built = tokio::select! {
            r = &mut build => r,
            () = tokio::time::sleep(self.config.timeout) => {
                // The backend stops its work on cancel: wait for that.
                cancel.cancel();
                let _ = build.await;
                return Err(BuildError::TimedOut(self.config.timeout));
            }
        }?;
        Ok(Outcome {
            digest: built.digest,
            platforms: platforms.clone(),
        })
    }

    async fn fetch(
        &self,
        req: &BuildRequest,
        scratch: &Path,
        context: &Path,
        events: &Events,
    ) -> Result<(), BuildError> {
        match &req.source {
            Source::Tarball { url } => {
                let tls = self
                    .config
                    .node_tls
                    .as_ref()
                    .map(|t| t.borrow().clone())
                    .ok_or_else(|| {
                        BuildError::Source("this node has no cluster identity to fetch with".into())
                    })?;
                let tarball = scratch.join("source.tar.gz");
                say(
                    events,
                    Phase::Source,
                    format!("fetching {}", crate::redact::url(url)),
                )
                .await;
                let bytes = source::fetch_tarball(url, &tls, &tarball)
                    .await
                    .map_err(BuildError::Source)?;
                std::fs::create_dir(context).map_err(BuildError::Scratch)?;
                let (dest, limits) = (context.to_path_buf(), self.config.limits);
                let unpacked = tokio::task::spawn_blocking(move || {
                    let file = std::fs::File::open(&tarball)?;
                    let r = unpack::unpack(std::io::BufReader::new(file), &dest, limits);
                    let _ = std::fs::remove_file(&tarball);
                    Ok::<_, std::io::Error>(r)
                })
                .await
                .map_err(|e| BuildError::Scratch(std::io::Error::other(e)))?
                .map_err(BuildError::Scratch)??;
                say(
                    events,
                    Phase::Source,
                    format!("source: {bytes} bytes, {} files", unpacked.files),
                )
                .await;
            }
            Source::Git(git) => {
                // The agent clones from the host's network namespace: the
                // same rule as a Dockerfile's ADD (56.2).
                if let Some(why) = super::fetches::refuses(&git.url).await {
                    return Err(BuildError::Source(format!("git source {why}")));
                }
                say(
                    events,
                    Phase::Source,
                    format!("cloning {}", crate::redact::url(&git.url)),
                )
                .await;
                source::fetch_git(git, context, &self.config.limits)
                    .await
                    .map_err(BuildError::Source)?;
            }
            Source::Dir(dir) => {
                let (from, to) = (dir.clone(), context.to_path_buf());
                tokio::task::spawn_blocking(move || copy_tree(&from, &to))
                    .await
                    .map_err(|e| BuildError::Scratch(std::io::Error::other(e)))?
                    .map_err(|e| BuildError::Source(format!("{}: {e}", dir.display())))?;
            }
        }
        Ok(())
    }

    /// The cluster registry as it is now, if the node has one.
    fn cluster_registry(&self) -> Option<std::sync::Arc<crate::link::registry::ClusterRegistry>> {
        self.config
            .cluster_registry
            .as_ref()
            .and_then(|w| w.borrow().clone())
    }

    /// The node's credential and CA for the cluster registry; for the
    /// push reference's registry, the request's credential when it carries
    /// one and that registry is another.
    fn registries(&self, req: &BuildRequest) -> Vec<RegistryAuth> {
        let mut out = Vec::new();
        let cluster = self.cluster_registry();
        if let Some(reg) = &cluster {
            let (username, password) = match &reg.credentials {
                Credentials::Basic { username, password } => (username.clone(), password.clone()),
                Credentials::Anonymous => (String::new(), String::new()),
            };
            for host in reg.hosts() {
                out.push(RegistryAuth {
                    host: host.to_owned(),
                    username: username.clone(),
                    password: password.clone(),
                    ca_pem: Some(reg.ca_pem.clone()),
                });
            }
        }
        if let (Some(reference), Some((username, password))) =
            (&req.push_ref, &req.registry_credential)
        {
            let host = reference.split('/').next().unwrap_or_default().to_owned();
            if cluster.as_ref().is_none_or(|c| !c.serves(&host)) {
                out.push(RegistryAuth {
                    host,
                    username: username.clone(),
                    password: password.clone(),
                    ca_pem: None,
                });
            }
        }
        out
    }
}

/// Copies a local context: directories and regular files only, as an
/// unpacked tarball would hold.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        let target = to.join(entry.file_name());
        if kind.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}
