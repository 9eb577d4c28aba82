//! The buildah backend: `buildah bud` (Debian's and Fedora's own package,
//! so a stock host builds with no daemon), pushed with the node credential
//! and the cluster CA, or loaded into containerd through the agent's own
//! importer.
//!
//! Storage is the agent's own (`<data-dir>/buildah`), so nothing here ever
//! touches an operator's buildah or podman images, and each project has its
//! own ([`Store`]): images, layer cache, working containers and the
//! `RUN --mount=type=cache` directories, so that no tenant reads or
//! poisons another's. Each step runs in its
//! own process group; a cancel sends buildah SIGTERM (it stops its `RUN`
//! container and removes its working container), then SIGKILL after a
//! grace.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::child::{merged_lines, stop};
use super::progress::buildah_line;
use super::{Backend, BuildError, BuildSpec, Built, Events, Output, Phase, RegistryFiles, say};
use crate::runtime::Containerd;

/// How `RUN` steps reach the network (the `build-network` setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BuildNetwork {
    /// A namespace on the agent's build bridge ([`super::network`]).
    #[default]
    Private,
    /// None at all.
    None,
    /// The node's own network: every container, VIP and loopback service
    /// is in reach. Only as an operator's explicit choice.
    Host,
}

impl std::str::FromStr for BuildNetwork {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "private" => Ok(Self::Private),
            "host" => Ok(Self::Host),
            "none" => Ok(Self::None),
            other => Err(format!("{other:?} is not private, none or host")),
        }
    }
}

/// Grace between SIGTERM and SIGKILL on cancel.
const STOP_GRACE: Duration = Duration::from_secs(15);

#[derive(Debug, Clone)]
pub struct Buildah {
    pub binary: PathBuf,
    /// Where each project's [`Store`] is: `<root>/<key>/` and
    /// `<runroot>/<key>/`.
    pub root: PathBuf,
    pub runroot: PathBuf,
    /// What runs `RUN` steps: the node's runtime, never buildah's own
    /// choice (it takes crun wherever crun is installed, which fails on a
    /// host with hybrid cgroups).
    pub oci_runtime: crate::runtime::oci_runtime::OciRuntime,
    /// Where [`Output::Load`] images go.
    pub ctd: Option<Containerd>,
    /// Builds running now. Storage is the agent's alone, so while none
    /// runs, every working container in it is a leftover of a killed one.
    active: std::sync::Arc<tokio::sync::Mutex<usize>>,
}

impl Buildah {
    pub fn new(data_dir: &Path, run_dir: &Path, ctd: Option<Containerd>) -> Self {
        Self {
            binary: PathBuf::from("buildah"),
            root: data_dir.join("buildah/projects"),
            runroot: run_dir.join("buildah"),
            oci_runtime: crate::runtime::oci_runtime::OciRuntime::Runc,
            ctd,
            active: std::sync::Arc::default(),
        }
    }

    /// The state of `project`'s builds.
    pub fn store(&self, project: &str) -> Store {
        let key = project_key(project);
        let dir = self.root.join(&key);
        Store {
            storage: dir.join("storage"),
            runroot: self.runroot.join(&key),
            tmp: dir.join("tmp"),
        }
    }

    fn command(&self, store: &Store) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.binary);
        cmd.arg("--root")
            .arg(&store.storage)
            .arg("--runroot")
            .arg(&store.runroot)
            .args(["--storage-driver", "overlay"])
            // buildah keeps `RUN --mount=type=cache` directories under
            // TMPDIR (`buildah-cache-<uid>`), by their id alone.
            .env("TMPDIR", &store.tmp)
            // The operator's registries.conf may carry unqualified-search
            // registries; builds name their images in full.
            .env("BUILDAH_ISOLATION", "oci")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        cmd
    }

    /// Runs one buildah step, its output as lines; `Err` is the text of
    /// its last lines.
    async fn step(
        &self,
        mut cmd: tokio::process::Command,
        events: &Events,
        cancel: &CancellationToken,
    ) -> Result<(), StepError> {
        let mut child = cmd
            .spawn()
            .map_err(|e| StepError::Failed(format!("{}: {e}", self.binary.display())))?;
        let mut rx = merged_lines(&mut child);
        let mut last = std::collections::VecDeque::with_capacity(4);
        let mut open = true;
        let status = loop {
            tokio::select! {
                line = rx.recv(), if open => match line {
                    Some(line) => {
                        if let Some(line) = buildah_line(&line) {
                            if last.len() == 3 {
                                last.pop_front();
                            }
                            last.push_back(line.to_owned());
                            say(events, Phase::Build, line).await;
                        }
                    }
                    None => open = false,
                },
                status = child.wait(), if !open => break status,
                () = cancel.cancelled() => {
                    // buildah stops its RUN container and removes its
                    // working container on SIGTERM.
                    stop(&mut child, nix::sys::signal::Signal::SIGTERM, STOP_GRACE).await;
                    return Err(StepError::Canceled);
                }
            }
        };
        match status {
            Ok(s) if s.success() => Ok(()),
            Ok(s) => {
                let tail: Vec<String> = last.into_iter().collect();
                let text = tail
                    .iter()
                    .rev()
                    .find(|l| l.starts_with("Error:") || l.starts_with("error"))
                    .cloned()
                    .unwrap_or_else(|| tail.join("; "));
                Err(StepError::Failed(format!(
                    "{} ({s})",
                    text.trim_start_matches("Error: ")
                )))
            }
            Err(e) => Err(StepError::Failed(e.to_string())),
        }
    }

    /// Removes every working container when no other build runs (one
    /// cancelled with `--layers` can leave its `RUN` container behind),
    /// then adds `delta` to the builds running, all under the one lock.
    async fn sweep_if_alone(&self, store: &Store, running_here: usize, delta: isize) {
        let mut active = self.active.lock().await;
        if *active == running_here {
            let mut cmd = self.command(store);
            cmd.args(["rm", "--all"]);
            let _ = cmd.output().await;
        }
        *active = active.saturating_add_signed(delta);
    }

    /// Keeps a built image as layer cache for the next builds: named in
    /// [`CACHE_REPO`], its build tag removed (only a name goes, since it
    /// has another), and the oldest beyond [`CACHED_BUILDS`] removed with
    /// the intermediate images no other cached build shares. `rmi` of a
    /// build's only name would delete its intermediate images, and every
    /// later build of the same steps would run them all again.
    async fn keep_as_cache(&self, store: &Store, tag: &str, build_id: &str) {
        let cached = format!("{CACHE_REPO}:{}", cache_name(build_id));
        let mut cmd = self.command(store);
        cmd.args(["tag", tag, &cached]);
        if !cmd.output().await.is_ok_and(|o| o.status.success()) {
            self.remove_local(store, tag, false).await;
            return;
        }
        self.remove_local(store, tag, false).await;
        let mut list = self.command(store);
        list.args(["images", "--json", "--filter"])
            .arg(format!("reference={CACHE_REPO}"));
        let Ok(out) = list.output().await else { return };
        for old in beyond_cache(&out.stdout, CACHED_BUILDS) {
            self.remove_local(store, &old, false).await;
        }
    }

    async fn remove_local(&self, store: &Store, tag: &str, manifest: bool) {
        let mut cmd = self.command(store);
        if manifest {
            cmd.args(["manifest", "rm", tag]);
        } else {
            cmd.args(["rmi", "-f", tag]);
        }
        let _ = cmd.output().await;
    }
}

enum StepError {
    Failed(String),
    Canceled,
}

/// One project's builder state ([`Buildah::store`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Store {
    /// containers/storage: images, layer cache, working containers.
    pub storage: PathBuf,
    pub runroot: PathBuf,
    /// The TMPDIR buildah runs with, its cache mounts beneath.
    pub tmp: PathBuf,
}

impl Store {
    fn make(&self) -> std::io::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        for dir in [&self.storage, &self.runroot, &self.tmp] {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
        }
        Ok(())
    }
}

/// A directory name for `project`: the id itself when it is a plain name,
/// else a digest of it (no id can name another's directory, or climb out).
fn project_key(project: &str) -> String {
    let plain = !project.is_empty()
        && project.len() <= 64
        && !project.starts_with('.')
        && project
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
    if project.is_empty() {
        "_local".to_owned()
    } else if plain {
        format!("p-{project}")
    } else {
        use sha2::Digest as _;
        format!(
            "h-{}",
            &hex::encode(sha2::Sha256::digest(project.as_bytes()))[..32]
        )
    }
}

/// Where built images stay as layer cache ([`Buildah::keep_as_cache`]).
const CACHE_REPO: &str = "localhost/zattera-build-cache/image";
/// Built images kept as cache: what a node's recent builds reuse.
const CACHED_BUILDS: usize = 16;

/// A tag for build `id` (tags allow `[A-Za-z0-9_.-]`, up to 128).
fn cache_name(id: &str) -> String {
    let clean: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(120)
        .collect();
    format!("b{clean}")
}

/// The names of the cached images beyond the newest `keep`, from
/// `buildah images --json` (each entry: `names`, `created` in unix seconds).
fn beyond_cache(json: &[u8], keep: usize) -> Vec<String> {
    #[derive(serde::Deserialize)]
    struct Entry {
        #[serde(default)]
        names: Option<Vec<String>>,
        #[serde(default)]
        created: i64,
    }
    let Ok(mut entries) = serde_json::from_slice::<Vec<Entry>>(json) else {
        return Vec::new();
    };
    entries.sort_by_key(|e| std::cmp::Reverse(e.created));
    entries
        .into_iter()
        .skip(keep)
        .flat_map(|e| e.names.unwrap_or_default())
        .filter(|n| n.starts_with(CACHE_REPO))
        .collect()
}

/// A name in buildah's storage for build `id`.
fn local_tag(id: &str) -> String {
    let clean: String = id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    format!("localhost/zattera-build/{}:latest", clean.trim_matches('-'))
}

#[tonic::async_trait]
impl Backend for Buildah {
    fn name(&self) -> &'static str {
        "buildah"
    }

    async fn build(
        &self,
        spec: &BuildSpec,
        events: &Events,
        cancel: &CancellationToken,
    ) -> Result<Built, BuildError> {
        let store = self.store(&spec.project);
        store.make().map_err(BuildError::Scratch)?;
        self.sweep_if_alone(&store, 0, 1).await;
        let result = self.build_counted(&store, spec, events, cancel).await;
        let alone = if matches!(result, Err(BuildError::Canceled)) {
            1
        } else {
            usize::MAX
        };
        self.sweep_if_alone(&store, alone, -1).await;
        result
    }
}

impl Buildah {
    async fn build_counted(
        &self,
        store: &Store,
        spec: &BuildSpec,
        events: &Events,
        cancel: &CancellationToken,
    ) -> Result<Built, BuildError> {
        let files =
            RegistryFiles::write(&spec.scratch, &spec.registries).map_err(BuildError::Scratch)?;
        let tag = local_tag(&spec.id);
        let several = spec.platforms.len() > 1;
        let mut bud = self.command(store);
        bud.arg("bud")
            .args(["--isolation", "oci"])
            .arg("--runtime")
            .arg(
                self.oci_runtime
                    .binary()
                    .unwrap_or_else(|| Path::new("runc")),
            )
            .args(spec.network.buildah_args())
            .arg("--layers")
            .arg("--file")
            .arg(spec.context.join(&spec.dockerfile))
            .arg("--platform")
            .arg(spec.platforms.join(","));
        for (k, v) in &spec.build_args {
            bud.arg("--build-arg").arg(format!("{k}={v}"));
        }
        bud.arg("--authfile")
            .arg(&files.authfile)
            .arg("--cert-dir")
            .arg(&files.certs);
        bud.arg(if several { "--manifest" } else { "--tag" })
            .arg(&tag);
        bud.arg(&spec.context);
        let result = self.step(bud, events, cancel).await;
        if let Err(e) = result {
            self.remove_local(store, &tag, several).await;
            return Err(match e {
                StepError::Canceled => BuildError::Canceled,
                StepError::Failed(text) => BuildError::Solve(text),
            });
        }
        let outcome = self
            .export(store, spec, &tag, several, &files, events, cancel)
            .await;
        if outcome.is_ok() && !several {
            self.keep_as_cache(store, &tag, &spec.id).await;
        } else {
            self.remove_local(store, &tag, several).await;
        }
        outcome
    }
}

impl Buildah {
    #[allow(clippy::too_many_arguments)]
    async fn export(
        &self,
        store: &Store,
        spec: &BuildSpec,
        tag: &str,
        several: bool,
        files: &RegistryFiles,
        events: &Events,
        cancel: &CancellationToken,
    ) -> Result<Built, BuildError> {
        let mut push = self.command(store);
        if several {
            push.args(["manifest", "push", "--all"]);
        } else {
            push.arg("push");
        }
        match &spec.output {
            Output::Push { reference } => {
                let digestfile = spec.scratch.join("digest");
                push.arg("--digestfile")
                    .arg(&digestfile)
                    .arg("--authfile")
                    .arg(&files.authfile)
                    .arg("--cert-dir")
                    .arg(&files.certs);
                push.arg(tag).arg(format!("docker://{reference}"));
                say(events, Phase::Build, format!("pushing {reference}")).await;
                self.step(push, events, cancel).await.map_err(|e| match e {
                    StepError::Canceled => BuildError::Canceled,
                    StepError::Failed(text) => BuildError::Push(text),
                })?;
                let digest = std::fs::read_to_string(&digestfile)
                    .map_err(|e| BuildError::Push(format!("no digest written: {e}")))?;
                Ok(Built {
                    digest: digest.trim().to_owned(),
                })
            }
            Output::Load { name } => {
                let ctd = self.ctd.as_ref().ok_or_else(|| {
                    BuildError::Load("this node has no containerd to load into".into())
                })?;
                let archive = spec.scratch.join("image.tar");
                // Uncompressed: the archive is read once, here, and
                // compressing it would be most of the export's time.
                if !several {
                    push.arg("--disable-compression");
                }
                push.arg(tag)
                    .arg(format!("oci-archive:{}:{name}", archive.display()));
                self.step(push, events, cancel).await.map_err(|e| match e {
                    StepError::Canceled => BuildError::Canceled,
                    StepError::Failed(text) => BuildError::Load(text),
                })?;
                let image: crate::runtime::ImageRef = name
                    .parse()
                    .map_err(|e| BuildError::Load(format!("{name}: {e}")))?;
                let imported = crate::runtime::images::import_archive(ctd, &archive, Some(image))
                    .await
                    .map_err(|e| BuildError::Load(e.to_string()))?;
                let first = imported
                    .first()
                    .ok_or_else(|| BuildError::Load("the archive held no image".into()))?;
                say(
                    events,
                    Phase::Build,
                    format!("loaded {name} into containerd"),
                )
                .await;
                Ok(Built {
                    digest: first.target.digest.to_string(),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::disallowed_methods)]
    use super::*;

    #[test]
    fn each_project_has_a_store_of_its_own_that_no_id_can_leave() {
        let b = Buildah::new(Path::new("/d"), Path::new("/r"), None);
        let a = b.store("proj-a");
        assert_eq!(a.storage, Path::new("/d/buildah/projects/p-proj-a/storage"));
        assert_eq!(a.tmp, Path::new("/d/buildah/projects/p-proj-a/tmp"));
        assert_eq!(a.runroot, Path::new("/r/buildah/p-proj-a"));
        assert_ne!(b.store("proj-b"), a);
        assert_eq!(
            b.store("").storage,
            Path::new("/d/buildah/projects/_local/storage")
        );
        for hostile in ["../proj-a", "..", "a/b", ".hidden", &"x".repeat(65)] {
            let s = b.store(hostile);
            let key = s
                .storage
                .parent()
                .unwrap()
                .file_name()
                .unwrap()
                .to_str()
                .unwrap();
            assert!(
                key.starts_with("h-") && key.len() == 34,
                "{hostile:?} -> {key}"
            );
            assert_eq!(
                s.storage.parent().unwrap().parent().unwrap(),
                Path::new("/d/buildah/projects")
            );
        }
    }

    #[test]
    fn the_oldest_cached_builds_beyond_the_budget_are_named_for_removal() {
        let json = format!(
            r#"[{{"id": "a", "names": ["{CACHE_REPO}:b1"], "created": 100}},
                {{"id": "b", "names": ["{CACHE_REPO}:b3", "{CACHE_REPO}:b3x"], "created": 300}},
                {{"id": "c", "names": null, "created": 50}},
                {{"id": "d", "names": ["{CACHE_REPO}:b2", "docker.io/other:1"], "created": 200}}]"#
        );
        assert!(beyond_cache(json.as_bytes(), 4).is_empty());
        assert_eq!(
            beyond_cache(json.as_bytes(), 1),
            vec![format!("{CACHE_REPO}:b2"), format!("{CACHE_REPO}:b1")],
            "newest first kept; names outside the cache repository are never removed"
        );
        assert!(beyond_cache(b"not json", 0).is_empty());
    }

    #[test]
    fn a_cache_tag_is_a_valid_tag_for_any_build_id() {
        assert_eq!(cache_name("bld-01"), "bbld-01");
        assert_eq!(cache_name("a/b:c@d"), "ba_b_c_d");
        assert_eq!(cache_name(&"x".repeat(300)).len(), 121);
    }

    #[test]
    fn local_tags_are_valid_lowercase_names() {
        assert_eq!(
            local_tag("Bld_01/x"),
            "localhost/zattera-build/bld_01-x:latest"
        );
    }
}
