//! Before the agent wires anything: the enrollment (a kept join token
//! joins first), where the sync stream goes, the private directories, the
//! namespace lock, and the preflight checks.

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::config::Config;

/// What [`prepare`] settled.
pub(super) struct Prepared {
    /// The namespace lock, held for the agent's life.
    pub lock: nix::fcntl::Flock<std::fs::File>,
    /// The address joins go to.
    pub join_addr: Option<String>,
    /// Why a node that joined cannot follow its control plane yet (its
    /// enrollment unreadable): the data plane comes up without it (58.9).
    pub control_problem: Option<anyhow::Error>,
    /// The last run ended without a clean stop (a power cut, a SIGKILL, a
    /// crash): what its marker said.
    pub unclean_stop: Option<String>,
}

/// Readies the host for the agent with `config`, and settles where the
/// sync stream goes (`config.control`).
pub(super) async fn prepare(config: &mut Config) -> Result<Prepared> {
    // `--control` is where joins go; the sync stream may go elsewhere.
    let join_addr = config.control.clone();
    take_over_a_reference_enrollment(config);
    let mut control_problem = None;
    if let Some(token) = &config.join_token
        && let Err(e) = enroll_if_new(config, join_addr.as_deref(), token).await
    {
        // A node that had joined (its record torn) has containers to keep
        // running while control is away; a new one has nothing yet.
        if !crate::link::identity::IdentityDir::new(&config.data_dir)
            .state_path()
            .exists()
        {
            return Err(e);
        }
        control_problem = Some(e);
    }
    if control_problem.is_none() {
        match sync_target(config) {
            Ok(target) => config.control = target,
            Err(e) => control_problem = Some(e),
        }
    }
    // Keys, logs, volumes, namespace files and the admin socket live under
    // these: no other host user may even look inside.
    for dir in [&config.data_dir, &config.run_dir] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .with_context(|| format!("making {} private", dir.display()))?;
    }
    // Two agents on one namespace would remove each other's containers.
    let lock = lock_namespace(config.namespace.as_str())?;
    let unclean_stop = mark_running(&config.data_dir);
    if let Err(failed) = crate::doctor::preflight(config) {
        anyhow::bail!(
            "preflight: {} (`zattera-agent doctor` runs every check)",
            failed.line()
        );
    }
    Ok(Prepared {
        lock,
        join_addr,
        control_problem,
        unclean_stop,
    })
}

/// A data dir moved from the reference agent: its enrollment becomes this
/// agent's ([`crate::control::moved`]); one that cannot be used is left
/// as it is, and a kept join token joins again as the same node.
fn take_over_a_reference_enrollment(config: &Config) {
    use crate::control::moved::{Moved, adopt};
    match adopt(&config.data_dir, config.control.as_deref()) {
        Moved::Adopted { node_id } => tracing::info!(
            %node_id,
            "took over the enrollment the reference agent left in {}: this node keeps its identity, record and mesh key",
            config.data_dir.join("node").display()
        ),
        Moved::Unusable { why } => tracing::warn!(
            "the reference agent's enrollment in {} cannot be used ({why}); join again (a kept join-token resumes the same node)",
            config.data_dir.join("node").display()
        ),
        Moved::Nothing => {}
    }
}

/// With a kept join token and no enrollment yet, `run --control ADDR`
/// enrolls first (what `join` would do); an enrolled node re-joins in the
/// background instead ([`crate::control::renew`]), so a control plane that
/// is away does not delay the start.
pub(super) async fn enroll_if_new(
    config: &Config,
    join_addr: Option<&str>,
    token: &str,
) -> Result<()> {
    let ids = crate::link::identity::IdentityDir::new(&config.data_dir);
    if ids.load_enrollment().is_ok() {
        return Ok(());
    }
    let Some(addr) = join_addr else {
        anyhow::bail!(
            "join-token is set but this node has not joined and no --control names where to join"
        );
    };
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("creating {}", config.data_dir.display()))?;
    let joined = crate::control::join::join(&crate::control::join::JoinOptions::for_this_node(
        addr.to_owned(),
        token.to_owned(),
        config,
    ))
    .await
    .with_context(|| format!("joining {addr} with the configured join-token"))?;
    tracing::info!(node_id = %joined.node_id, control = %addr, "joined");
    Ok(())
}

/// Where the sync stream goes (wire.md 1.2): the `control_grpc_addr` the
/// join stored, whether `--control` (the join address) is given or not; a
/// node that joined runs under control with a bare `run`, unless it is
/// pointed at manifests. `None`: standalone (or nothing to run).
pub(super) fn sync_target(config: &Config) -> Result<Option<String>> {
    let ids = crate::link::identity::IdentityDir::new(&config.data_dir);
    let enrolled = ids.state_path().exists();
    if !enrolled && config.control.is_none() {
        return Ok(None);
    }
    if config.control.is_none() && config.manifests.is_some() {
        tracing::info!("this node has joined a control plane, but --manifests runs it standalone");
        return Ok(None);
    }
    let enrollment = match ids.load_enrollment() {
        Ok(e) => e,
        Err(e) => {
            let given = config.control.as_deref().unwrap_or("ADDR");
            return Err(anyhow::anyhow!(e).context(format!(
                "this node has no usable enrollment; run `zattera-agent join --control {given} --token TOKEN` first"
            )));
        }
    };
    let target = if enrollment.control_addr.is_empty() {
        config.control.clone()
    } else {
        Some(enrollment.control_addr.clone())
    };
    if let (Some(given), Some(target)) = (&config.control, &target)
        && given != target
    {
        tracing::info!(join = %given, sync = %target, "syncing with the address the join returned");
    }
    Ok(target)
}

/// `<data_dir>/running`: written at start, removed at a clean stop.
pub(super) fn running_marker(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("running")
}

/// Writes the marker of this run; what the last run's said when it did
/// not stop cleanly. An exec in place (an upgrade, the control link made)
/// keeps the pid and is no unclean stop. The recovery the marker stands
/// for runs at every start anyway (a pending copy-up redone, torn log
/// tails sealed, the stats log's torn tail cut, an upgrade's trial
/// counted): the marker says that it had work to do.
fn mark_running(data_dir: &std::path::Path) -> Option<String> {
    let path = running_marker(data_dir);
    let me = std::process::id();
    let previous = std::fs::read_to_string(&path)
        .ok()
        .filter(|text| !text.starts_with(&format!("pid {me} ")));
    let text = format!(
        "pid {me} since {}\n",
        humantime::format_rfc3339_seconds(std::time::SystemTime::now())
    );
    if let Err(e) = crate::durable::write(&path, text.as_bytes(), 0o600) {
        tracing::warn!(path = %path.display(), error = %e, "the run marker was not written");
    }
    let previous = previous?;
    let said = previous.trim().to_owned();
    tracing::warn!(last_run = %said, "the last run did not stop cleanly (a power cut, a SIGKILL or a crash); recovering");
    Some(said)
}

/// Holds `<LOCK_DIR>/<namespace>.lock` for the agent's life: a second agent
/// on the same containerd namespace refuses to start, whatever its run dir.
/// Not in `/run/lock`, which every local user may write: one could create
/// and hold the lock there and keep the agent from ever starting. The
/// directory is root's alone, and is checked to be.
fn lock_namespace(namespace: &str) -> Result<nix::fcntl::Flock<std::fs::File>> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
    let dir = PathBuf::from(LOCK_DIR);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(&dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    let meta =
        std::fs::symlink_metadata(&dir).with_context(|| format!("reading {}", dir.display()))?;
    if !meta.is_dir() || meta.uid() != nix::unistd::geteuid().as_raw() || meta.mode() & 0o022 != 0 {
        anyhow::bail!(
            "{} is not a directory of this user's that others cannot write (owner {}, mode {:o}); remove it",
            dir.display(),
            meta.uid(),
            meta.mode() & 0o7777
        );
    }
    let path = dir.join(format!("{namespace}.lock"));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| {
        anyhow::anyhow!(
            "another zattera-agent already runs on containerd namespace {namespace:?} (lock {}: {errno}); \
             agents side by side need different --namespace values",
            path.display()
        )
    })
}

/// Where the namespace locks live: root's alone (see [`lock_namespace`]).
const LOCK_DIR: &str = "/run/zattera-agent.locks";
