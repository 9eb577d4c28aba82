//! `zattera-agent run`: wires the parts together and runs until SIGTERM.
//!
//! containerd connection (lazy: nothing waits for it but what needs it) →
//! networking (`zattera-netns`) → DNS (`zattera-dns`) → executor → admin
//! socket → the assignment source. The executor adopts and restarts what
//! exists before any source speaks.
//! Stopping the agent leaves every container running: they belong to
//! containerd's shims, and their logs to the log shims.

mod tasks;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use zattera_netns::{NetConfig, NetNode};

use self::tasks::Tasks;
use crate::admin;
use crate::config::Config;
use crate::executor::{Executor, ExecutorConfig};
use crate::runtime::Containerd;

/// How long each group of tasks may take to stop.
const STOP_WITHIN: Duration = Duration::from_secs(5);

/// Runs the agent with `config`. `logger_binary` is the executable the runc
/// shims start as container loggers (normally this very binary).
pub async fn run(mut config: Config, logger_binary: PathBuf) -> Result<()> {
    // `--control` is where joins go; the sync stream may go elsewhere.
    let join_addr = config.control.clone();
    if let Some(token) = &config.join_token {
        enroll_if_new(&config, join_addr.as_deref(), token).await?;
    }
    config.control = sync_target(&config)?;
    // Keys, logs, volumes, namespace files and the admin socket live under
    // these: no other host user may even look inside.
    for dir in [&config.data_dir, &config.run_dir] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .with_context(|| format!("making {} private", dir.display()))?;
    }
    // Two agents on one namespace would remove each other's containers.
    let _lock = lock_namespace(config.namespace.as_str())?;
    if let Err(failed) = crate::doctor::preflight(&config) {
        anyhow::bail!(
            "preflight: {} (`zattera-agent doctor` runs every check)",
            failed.line()
        );
    }
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    // The sync stream, heartbeats, the mesh and the admin socket start
    // whether containerd answers or not (W-2); what needs containerd waits
    // for `engine_up`, and `status` says what it waits for.
    let ctd = Containerd::lazy(&config.containerd_address, config.namespace.clone());
    let (engine_notices, engine_notices_rx) = tokio::sync::watch::channel(Vec::new());
    let (engine_up, engine_watch) = spawn_engine_watch(ctd.clone(), engine_notices);

    let mut net_cfg = NetConfig::for_namespace(config.namespace.as_str(), &config.run_dir)?;
    net_cfg.default_subnet = config.default_subnet;
    net_cfg.build_subnet = Some(config.build.subnet);
    if let Some(prefix) = &config.bridge_prefix {
        prefix.clone_into(&mut net_cfg.bridge_prefix);
        net_cfg.validate()?;
    }
    let net = Arc::new(NetNode::new(net_cfg).context("networking")?);
    warn_if_ports_overlap_kernel(config.host_port_range);
    let dns = Arc::new(zattera_dns::DnsServer::new(zattera_dns::Config::default()).context("DNS")?);
    let metrics = crate::telemetry::AgentMetrics::new();

    // With a control plane the node is who its enrollment says; the
    // executor's reports flow to the sync stream.
    let mut control = match &config.control {
        Some(addr) => {
            let sync = crate::control::sync::SyncConfig::load(addr, &config.data_dir)
                .with_context(|| format!("--control {addr}: this node has no usable enrollment; run `zattera-agent join --control {addr} --token TOKEN` first"))?;
            if let Some(id) = config.node_id.as_ref().filter(|id| **id != sync.node_id) {
                anyhow::bail!("--node-id {id}: this node enrolled as {}", sync.node_id);
            }
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            Some((sync, tx, rx))
        }
        None => None,
    };
    // Under control, pulls from the cluster registry send the node's
    // credential and trust the cluster CA; a renewal replaces them and the
    // identity every connection presents.
    let (notices_tx, notices_rx) = tokio::sync::watch::channel(Vec::new());
    let (api_notices, api_notices_rx) = tokio::sync::watch::channel(Vec::new());
    // Who may call the node API: the join's control peers and the
    // configured ids, then (with the mesh) whatever each peer set says.
    let (controls_tx, controls) = tokio::sync::watch::channel(
        control
            .as_ref()
            .map(|(sync, _, _)| sync.control_node_ids.clone())
            .unwrap_or_default()
            .into_iter()
            .chain(config.control_node_ids.iter().cloned())
            .collect::<std::collections::BTreeSet<String>>(),
    );
    let mut renewer = None;
    let mut mesh_ip = None;
    // The tasks, in the groups they stop in: first what feeds the node
    // (the sync stream and what follows control, or the manifests), then
    // the VIP proxy (it gives its addresses back), then the rest.
    let mut feeds = Tasks::new();
    let mut vips = Tasks::new();
    let mut core = Tasks::new();
    core.adopt("containerd watch", engine_watch);
    let cluster_registry = match &mut control {
        Some((sync, _, _)) => {
            let enrollment = crate::link::identity::IdentityDir::new(&config.data_dir)
                .load_enrollment()
                .context("the node enrollment")?;
            if let Some(why) = crate::node_api::refuses_everyone(
                &enrollment.control_node_ids,
                &config.control_node_ids,
                enrollment.mesh_enabled,
            ) {
                tracing::warn!("{why}");
                api_notices.send_replace(vec![why]);
            }
            // The mesh is up (from the last peer set) before anything binds
            // on its address or dials control through it.
            let feed = crate::mesh::watch::ControlFeed {
                tx: controls_tx,
                configured: config.control_node_ids.iter().cloned().collect(),
            };
            let link = crate::mesh::start::Link {
                node_id: sync.node_id.clone(),
                control_addr: sync.control_addr.clone(),
                tls: sync.tls.clone(),
            };
            if let Some(mesh) =
                crate::mesh::start::start(&config, &enrollment, link, &logger_binary, feed).await?
            {
                sync.targets = mesh.targets;
                mesh_ip = Some(mesh.mesh_ip);
                feeds.adopt("mesh", mesh.task);
            }
            let tls = Arc::clone(&sync.tls.borrow());
            let registry = enrollment.cluster_registry(&tls).map(Arc::new);
            let (registry_tx, registry_rx) = tokio::sync::watch::channel(registry);
            let (tls_tx, tls_rx) = tokio::sync::watch::channel(tls);
            sync.tls = tls_rx;
            renewer = Some(crate::control::renew::Renewer {
                join: config.join_token.as_ref().map(|token| {
                    crate::control::join::JoinOptions::for_this_node(
                        join_addr
                            .clone()
                            .unwrap_or_else(|| enrollment.control_addr.clone()),
                        token.clone(),
                        &config,
                    )
                }),
                tls: tls_tx,
                registry: registry_tx,
                notices: notices_tx,
            });
            Some(registry_rx)
        }
        None => None,
    };
    let addresses = config.node_addresses(mesh_ip)?;
    let host_ip = addresses.host_ip;
    let standalone = config.control.is_none();
    let source = match (&config.control, &config.manifests) {
        (Some(addr), _) => format!("control {addr}"),
        (None, Some(dir)) => format!("manifests {}", dir.display()),
        (None, None) => "none (no --manifests and no --control)".to_owned(),
    };
    let cgroup_parent = format!("/zattera/{}", config.namespace);
    let exec_cfg = ExecutorConfig {
        node_id: control.as_ref().map_or_else(
            || config.node_id.clone().unwrap_or_default(),
            |(sync, _, _)| sync.node_id.clone(),
        ),
        host_ip,
        data_dir: config.data_dir.clone(),
        run_dir: config.run_dir.clone(),
        logger_binary: logger_binary.clone(),
        cgroup_parent: cgroup_parent.clone(),
        parallelism: crate::config::PARALLELISM,
        host_port_range: config.host_port_range,
        pids_limit: config.pids_limit,
        pull_timeout: config.pull_timeout,
        standalone,
        source,
        cluster_registry: cluster_registry.clone(),
        default_subnet: config.default_subnet,
        log_retention: config.log_retention,
        metrics: Arc::clone(&metrics),
    };
    let batches = control.as_ref().map(|(_, tx, _)| tx.clone());
    let (executor, handle) = Executor::new(
        exec_cfg,
        ctd.clone(),
        Some(Arc::clone(&net)),
        Some(Arc::clone(&dns)),
        batches,
    );
    core.spawn("executor", after(engine_up.clone(), executor.run()));
    core.spawn(
        "log janitor",
        after(
            engine_up.clone(),
            crate::logs::janitor::run(
                ctd.clone(),
                config.data_dir.join("logs"),
                config.log_retention,
                crate::logs::janitor::EVERY,
                {
                    let metrics = Arc::clone(&metrics);
                    move |bytes| metrics.gc_run("log", bytes)
                },
            ),
        ),
    );
    // Kept for the host's shutdown, whichever source owns `handle`.
    let halt = handle.clone();

    let listener = admin::bind(&config.run_dir).with_context(|| {
        format!(
            "admin socket {}",
            admin::socket_path(&config.run_dir).display()
        )
    })?;
    let (disk_notices, disk_notices_rx) = tokio::sync::watch::channel(Vec::new());
    core.spawn(
        "image gc",
        after(
            engine_up.clone(),
            crate::image_gc::ImageGc {
                ctd: ctd.clone(),
                policy: config.image_gc.policy.clone(),
                every: config.image_gc.every,
                record: crate::image_gc::ImageGc::record_path(&config.data_dir),
                notices: disk_notices,
                metrics: Arc::clone(&metrics),
            }
            .run(),
        ),
    );
    core.spawn(
        "admin socket",
        admin::serve(
            listener,
            admin::Admin {
                status: handle.status.clone(),
                notices: vec![
                    engine_notices_rx,
                    notices_rx,
                    disk_notices_rx,
                    api_notices_rx,
                ],
                node: Some(admin::ops::Node {
                    ctd: ctd.clone(),
                    data_dir: config.data_dir.clone(),
                    cgroup_parent: cgroup_parent.clone(),
                    run_dir: config.run_dir.clone(),
                }),
            },
        ),
    );
    if let Some(renewer) = renewer {
        feeds.spawn("identity renewal", renewer.run());
    }
    tracing::info!(
        namespace = %config.namespace,
        run_dir = %config.run_dir.display(),
        data_dir = %config.data_dir.display(),
        "agent running"
    );

    let mut stats_on_close = None;
    // The VIP proxy (with a control plane): its listeners and addresses go
    // when the agent stops (V-2).
    let vip_shutdown = tokio_util::sync::CancellationToken::new();
    let status_for_metrics = handle.status.clone();
    let mut samples_for_metrics = crate::metrics::none();
    match (&config.control, &config.manifests) {
        (Some(addr), _) => {
            let Some((sync, _, rx)) = control.take() else {
                anyhow::bail!("--control {addr}: the sync client was not prepared");
            };
            // The sampler feeds heartbeats and the store behind `Stats`,
            // kept on disk across restarts and upgrades (TS-8).
            let stats_path = crate::metrics::persist::path(&config.data_dir);
            let stats = Arc::new(std::sync::Mutex::new(crate::metrics::persist::load(
                &stats_path,
            )));
            core.spawn(
                "stats persistence",
                crate::metrics::persist::run(Arc::clone(&stats), stats_path.clone()),
            );
            stats_on_close = Some((Arc::clone(&stats), stats_path));
            let (samples, sampler) = crate::metrics::Sampler {
                ctd: ctd.clone(),
                cgroup_parent: cgroup_parent.clone(),
                status: handle.status.clone(),
                every: crate::metrics::SAMPLE_EVERY,
                store: Some(crate::metrics::StoreFeed {
                    store: Arc::clone(&stats),
                    node_id: sync.node_id.clone(),
                    data_dir: config.data_dir.clone(),
                }),
            }
            .spawn();
            core.adopt("sampler", sampler);
            samples_for_metrics = samples.clone();
            let node = crate::node_api::NodeContext {
                ctd: ctd.clone(),
                desired: handle.desired.subscribe(),
                targets: crate::node_api::proxy::Targets {
                    host_ips: vec![std::net::IpAddr::V4(host_ip)],
                    status: handle.status.clone(),
                },
                data_dir: config.data_dir.clone(),
                run_dir: config.run_dir.clone(),
                node_id: sync.node_id.clone(),
                stats: Some(stats),
                upgrade: crate::upgrade::UpgradeConfig {
                    base_url: config.upgrade_base_url.clone(),
                    // Resolved at start: once an upgrade renames a new file
                    // over it, the running image's path reads "(deleted)".
                    binary: logger_binary.clone(),
                    args: std::env::args().collect(),
                    busy: Arc::default(),
                    stats: stats_on_close.clone(),
                },
                builder: builder(
                    &config,
                    &ctd,
                    sync.tls.clone(),
                    cluster_registry.clone(),
                    crate::build::network::BuildNet::new(
                        Arc::clone(&net),
                        config.build.subnet,
                        &dns.upstreams(),
                    ),
                ),
            };
            // With a control plane, internal names answer the service VIPs
            // of the latest route snapshot (persisted, so served while
            // control is away).
            let services = crate::control::services::spawn(
                &sync,
                &addresses.node_api,
                node,
                controls.clone(),
                Arc::clone(&metrics),
            )
            .await;
            for (name, task) in services.tasks {
                feeds.adopt(name, task);
            }
            let routes = services.routes;
            // The proxy's own token lets it give its listeners and
            // addresses back (V-2) before the group aborts it.
            vips.spawn(
                "VIP proxy",
                crate::control::vip::run(
                    Arc::clone(&net),
                    routes.clone(),
                    handle.networks.clone(),
                    metrics.vip_connections.clone(),
                    vip_shutdown.clone(),
                ),
            );
            feeds.spawn(
                "DNS from routes",
                crate::control::routes::feed_dns(routes, Arc::clone(&dns)),
            );
            let stream = crate::control::sync::spawn(sync, handle.desired.clone(), rx, samples)
                .with_context(|| format!("--control {addr}: the node identity"))?;
            feeds.adopt("sync stream", stream);
        }
        (None, Some(dir)) => feeds.spawn(
            "manifests",
            crate::source::feed::feed_from_manifests(
                dir.clone(),
                config.data_dir.join("standalone"),
                config.subnet_pool,
                handle,
            ),
        ),
        (None, None) => {
            tracing::warn!(
                "no --manifests and no --control: nothing to run; existing containers are kept as they are"
            );
            feeds.spawn("no source", async move {
                let _keep = handle;
                std::future::pending::<()>().await;
            });
        }
    }

    if let Some(addr) = config.metrics_listen {
        if config.control.is_none() {
            // Standalone has no sampler of its own: start one for the
            // per-instance figures.
            let (samples, sampler) = crate::metrics::Sampler {
                ctd: ctd.clone(),
                cgroup_parent: cgroup_parent.clone(),
                status: status_for_metrics.clone(),
                every: crate::metrics::SAMPLE_EVERY,
                store: None,
            }
            .spawn();
            core.adopt("sampler", sampler);
            samples_for_metrics = samples;
        }
        let sources = crate::telemetry::collect::Sources {
            status: status_for_metrics,
            dns: Some(Arc::clone(&dns)),
            samples: samples_for_metrics,
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            cgroup_parent: cgroup_parent.clone(),
            log_dir: config.data_dir.join("logs"),
        };
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => {
                tracing::info!(%addr, "metrics at /metrics");
                let registry = Arc::new(crate::telemetry::registry(&metrics, sources));
                core.spawn("metrics", crate::telemetry::serve::run(listener, registry));
            }
            Err(e) => {
                tracing::error!(%addr, "metrics-listen: cannot listen: {e}; no metrics served");
            }
        }
    }

    notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status("running"),
    ]);
    shutdown.await;
    notify(&[sd_notify::NotifyState::Stopping]);
    feeds.stop(STOP_WITHIN).await;
    // Told through its own token, so that it gives its addresses back.
    vip_shutdown.cancel();
    vips.drain(STOP_WITHIN).await;
    // An executor still waiting for containerd has nothing to stop, and
    // would never answer a halt.
    if *engine_up.borrow() && host_is_going_down(&config.host_shutdown_check).await {
        notify(&[sd_notify::NotifyState::Status(
            "host shutting down: stopping instances",
        )]);
        let stopped = halt.halt().await.unwrap_or(0);
        tracing::info!(
            stopped,
            "the host is going down: instances stopped, containers kept for the next boot"
        );
    } else {
        tracing::info!("stopping; containers keep running");
    }
    core.stop(STOP_WITHIN).await;
    if let Some((stats, path)) = &stats_on_close {
        crate::metrics::persist::flush_now(stats, path).await;
    }
    let _ = std::fs::remove_file(admin::socket_path(&config.run_dir));
    Ok(())
}

/// Ports from the kernel's ephemeral range are still safe (each published
/// port is held by a socket), but the kernel then has fewer to hand out, and
/// while the agent is down nothing keeps them from being taken.
fn warn_if_ports_overlap_kernel(range: zattera_netns::PortRange) {
    if let Some(kernel) = zattera_netns::PortRange::kernel_ephemeral()
        && range.overlaps(kernel)
    {
        tracing::warn!(
            host_port_range = %range,
            ip_local_port_range = %kernel,
            "host-port-range overlaps the kernel's ephemeral port range; choose one outside it"
        );
    }
}

/// Watches for containerd to answer, as long as it takes (boot ordering, a
/// broken containerd; runtime.md W-2): each failed attempt is logged and
/// shown by `status`, and the delay doubles from 1 s to 10 s. The receiver
/// turns true once containerd answers, and stays true: the channel itself
/// reconnects after later restarts.
fn spawn_engine_watch(
    ctd: Containerd,
    notices: tokio::sync::watch::Sender<Vec<String>>,
) -> (
    tokio::sync::watch::Receiver<bool>,
    tokio::task::JoinHandle<()>,
) {
    let (up_tx, up_rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(async move {
        let mut delay = std::time::Duration::from_secs(1);
        for attempt in 1u32.. {
            match ctd.answers().await {
                Ok(()) => {
                    if attempt > 1 {
                        tracing::info!(attempt, "containerd is up");
                    }
                    notices.send_replace(Vec::new());
                    up_tx.send_replace(true);
                    return;
                }
                Err(e) => {
                    tracing::warn!(attempt, retry_in = ?delay, error = %e, "waiting for containerd");
                    let status = format!(
                        "waiting for containerd (attempt {attempt}): {e}; no instance starts or is adopted until it answers"
                    );
                    notify(&[sd_notify::NotifyState::Status(&status)]);
                    notices.send_replace(vec![status]);
                }
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(std::time::Duration::from_secs(10));
        }
    });
    (up_rx, task)
}

/// Runs `work` once `up` turns true.
async fn after<T>(mut up: tokio::sync::watch::Receiver<bool>, work: impl Future<Output = T>) {
    if up.wait_for(|up| *up).await.is_ok() {
        work.await;
    }
}

/// Tells systemd (Type=notify) about the agent's state; nothing without
/// `NOTIFY_SOCKET`.
fn notify(states: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::debug!(error = %e, "sd_notify");
    }
}

/// With a kept join token and no enrollment yet, `run --control ADDR`
/// enrolls first (what `join` would do); an enrolled node re-joins in the
/// background instead ([`crate::control::renew`]), so a control plane that
/// is away does not delay the start.
async fn enroll_if_new(config: &Config, join_addr: Option<&str>, token: &str) -> Result<()> {
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
fn sync_target(config: &Config) -> Result<Option<String>> {
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

/// Whether SIGTERM came because the host is shutting down (or rebooting)
/// rather than because the agent alone is stopped or restarted: the check
/// command (systemd's `is-system-running`) prints `stopping`. Any failure
/// means "no": leaving instances running is the safe side.
async fn host_is_going_down(check: &[String]) -> bool {
    let Some((program, args)) = check.split_first() else {
        return false;
    };
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(3),
        tokio::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await;
    match out {
        Ok(Ok(out)) => String::from_utf8_lossy(&out.stdout).trim() == "stopping",
        Ok(Err(e)) => {
            tracing::debug!(command = %program, error = %e, "host shutdown check did not run");
            false
        }
        Err(_) => false,
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// The node's builder for RunBuild, or why it has none.
fn builder(
    config: &Config,
    ctd: &Containerd,
    tls: crate::link::tls::CurrentTls,
    registry: Option<crate::runtime::pull::ClusterRegistryWatch>,
    sandbox: crate::build::network::BuildNet,
) -> Result<crate::node_api::build::Builder, String> {
    let backend = crate::build::choose_backend(&crate::build::Host {
        settings: &config.build,
        ctd: Some(ctd.clone()),
        containerd_address: &config.containerd_address,
        namespace: config.namespace.as_str(),
        data_dir: &config.data_dir,
        run_dir: &config.run_dir,
    });
    match &backend {
        Ok(b) => tracing::info!(backend = b.name(), "builds enabled"),
        Err(why) => tracing::info!(%why, "no builds on this node"),
    }
    let mut pipeline = crate::build::PipelineConfig::new(&config.data_dir);
    pipeline.node_tls = Some(tls);
    pipeline.cluster_registry = registry;
    pipeline.planner.binary.clone_from(&config.build.nixpacks);
    pipeline.network = config.build.network;
    pipeline.sandbox = Some(Arc::new(sandbox));
    if config.build.network == crate::build::buildah::BuildNetwork::None
        && backend.as_ref().is_ok_and(|b| b.attaches_steps_itself())
    {
        tracing::warn!(
            "build-network = none is not available with BuildKit: its builds will fail until build-network is private or host"
        );
    }
    Ok(crate::node_api::build::Builder {
        pipeline: crate::build::Pipeline {
            config: pipeline,
            backend: backend?,
        },
        builds: Arc::new(crate::build::Builds::with_limit(config.build.max_builds)),
    })
}
