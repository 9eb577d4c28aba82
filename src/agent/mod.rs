//! `zattera-agent run`: wires the parts together and runs until SIGTERM.
//!
//! containerd connection (lazy: nothing waits for it but what needs it) →
//! networking (`zattera-netns`) → DNS (`zattera-dns`) → the control plane's
//! side ([`control`]) → executor → admin socket → the assignment source.
//! The executor adopts and restarts what exists before any source speaks.
//! Stopping the agent leaves every container running: they belong to
//! containerd's shims, and their logs to the log shims. Every task belongs
//! to a group ([`tasks`]), and the groups stop in order.

mod control;
mod start;
mod stop;
mod tasks;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use zattera_netns::{NetConfig, NetNode};

use self::control::ControlLink;
use self::tasks::Tasks;
use crate::admin;
use crate::config::{Config, NodeAddresses};
use crate::executor::{Executor, ExecutorConfig, ExecutorHandle};
use crate::runtime::Containerd;

/// The instances' samples, as the sampler publishes them.
type Samples = watch::Receiver<crate::metrics::InstanceSamples>;

/// How long each group of tasks may take to stop.
const STOP_WITHIN: Duration = Duration::from_secs(5);

/// Runs the agent with `config`. `agent_binary` is this very binary: the
/// userspace mesh device and the self-upgrade run it, and the runc shims
/// start the log shim found beside it (or it, when there is none).
pub async fn run(mut config: Config, agent_binary: PathBuf) -> Result<()> {
    let start::Prepared {
        lock: _lock,
        join_addr,
        control_problem,
        unclean_stop,
    } = start::prepare(&mut config).await?;
    let shutdown = stop::shutdown_signal();
    tokio::pin!(shutdown);
    let mut node = Node::new(config, agent_binary)?;
    if let Some(last) = unclean_stop {
        node.start_notices.send_modify(|n| {
            n.push(format!(
                "the last run ({last}) ended without a clean stop (a power cut, a SIGKILL or a crash); recovered at this start"
            ));
        });
    }
    let control = match control_problem {
        None => {
            ControlLink::prepare(
                &node.config,
                join_addr.as_deref(),
                &node.agent_binary,
                &mut node.feeds,
            )
            .await
        }
        Some(problem) => Err(problem),
    };
    let control = match control {
        Ok(control) => control,
        // Under control, the containers come first: they run, and are
        // restarted after a reboot, while the link is retried (58.9).
        Err(problem) => {
            return node
                .without_control_link(problem, join_addr, shutdown)
                .await;
        }
    };
    let addresses = node
        .config
        .node_addresses(control.as_ref().and_then(|c| c.mesh_ip))?;
    let handle = node.start_executor(control.as_ref(), &addresses);
    // Kept for the host's shutdown, whichever source owns `handle`.
    let halt = handle.clone();
    node.start_admin(control.as_ref(), &handle, None)?;
    tracing::info!(
        namespace = %node.config.namespace,
        run_dir = %node.config.run_dir.display(),
        data_dir = %node.config.data_dir.display(),
        oci_runtime = node.config.oci_runtime.name(),
        "agent running"
    );
    let status = handle.status.clone();
    let (samples, stats) = match control {
        Some(control) => node.follow_control(control, handle, &addresses).await?,
        None => (node.feed_standalone(handle), None),
    };
    node.serve_metrics(status, samples).await;
    notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status("running"),
    ]);
    shutdown.await;
    notify(&[sd_notify::NotifyState::Stopping]);
    node.stop(&halt, stats).await;
    Ok(())
}

/// What the wiring's steps share.
struct Node {
    config: Config,
    agent_binary: PathBuf,
    ctd: Containerd,
    /// True once containerd answered: what needs it waits for it (W-2).
    engine_up: watch::Receiver<bool>,
    engine_notices: watch::Receiver<Vec<String>>,
    net: Arc<NetNode>,
    dns: Arc<zattera_dns::DnsServer>,
    metrics: Arc<crate::telemetry::AgentMetrics>,
    cgroup_parent: String,
    /// What feeds the node: the sync stream and what follows control, or
    /// the manifests. Stopped first.
    feeds: Tasks,
    /// The VIP proxy: told through `vip_shutdown`, so that it gives its
    /// listeners and addresses back (V-2).
    vips: Tasks,
    vip_shutdown: CancellationToken,
    /// Everything else, stopped last.
    core: Tasks,
    /// A self-upgrade on trial or rolled back, for `status` (cleared by the
    /// first sync session).
    upgrade_notices: watch::Sender<Vec<String>>,
    /// What this start found (an unclean stop of the last run).
    start_notices: watch::Sender<Vec<String>>,
}

/// The stats store behind `Stats`, and its files (control only).
type StatsOnClose = Option<crate::metrics::persist::StoreFile>;

impl Node {
    /// containerd (lazily), networking, DNS and metrics. The sync stream,
    /// heartbeats, the mesh and the admin socket start whether containerd
    /// answers or not; `status` says what waits for it.
    fn new(config: Config, agent_binary: PathBuf) -> Result<Self> {
        let ctd = Containerd::lazy(&config.containerd_address, config.namespace.clone());
        let (notices, engine_notices) = watch::channel(Vec::new());
        let (engine_up, engine_watch) = spawn_engine_watch(ctd.clone(), notices);
        let mut core = Tasks::new();
        core.adopt("containerd watch", engine_watch);
        let mut net_cfg = NetConfig::for_namespace(config.namespace.as_str(), &config.run_dir)?;
        net_cfg.default_subnet = config.default_subnet;
        net_cfg.build_subnet = Some(config.build.subnet);
        net_cfg.egress_deny.clone_from(&config.egress_deny);
        if let Some(prefix) = &config.bridge_prefix {
            prefix.clone_into(&mut net_cfg.bridge_prefix);
            net_cfg.validate()?;
        }
        let net = Arc::new(NetNode::new(net_cfg).context("networking")?);
        warn_if_ports_overlap_kernel(config.host_port_range);
        let dns = zattera_dns::DnsServer::new(zattera_dns::Config::default()).context("DNS")?;
        Ok(Self {
            cgroup_parent: format!("/zattera/{}", config.namespace),
            config,
            upgrade_notices: watch::Sender::new(
                crate::upgrade::rollback::Records::beside(&agent_binary).notices(),
            ),
            agent_binary,
            ctd,
            engine_up,
            engine_notices,
            net,
            dns: Arc::new(dns),
            metrics: crate::telemetry::AgentMetrics::new(),
            feeds: Tasks::new(),
            vips: Tasks::new(),
            vip_shutdown: CancellationToken::new(),
            core,
            start_notices: watch::Sender::new(Vec::new()),
        })
    }

    /// The executor and the log janitor, once containerd answers. Under
    /// control the node is who its enrollment says, and the executor's
    /// reports flow to the sync stream.
    fn start_executor(
        &mut self,
        control: Option<&ControlLink>,
        addresses: &NodeAddresses,
    ) -> ExecutorHandle {
        let config = &self.config;
        let source = match (&config.control, &config.manifests) {
            (Some(addr), _) => format!("control {addr}"),
            (None, Some(dir)) => format!("manifests {}", dir.display()),
            (None, None) => "none (no --manifests and no --control)".to_owned(),
        };
        let exec_cfg = ExecutorConfig {
            node_id: control.map_or_else(
                || config.node_id.clone().unwrap_or_default(),
                |c| c.sync.node_id.clone(),
            ),
            host_ip: addresses.host_ip,
            data_dir: config.data_dir.clone(),
            run_dir: config.run_dir.clone(),
            logger_binary: crate::logs::shim::binary_for(&self.agent_binary),
            cgroup_parent: self.cgroup_parent.clone(),
            parallelism: crate::config::PARALLELISM,
            host_port_range: config.host_port_range,
            pids_limit: config.pids_limit,
            shim_group_size: config.shim_group_size,
            oci_runtime: config.oci_runtime.clone(),
            pull_timeout: config.pull_timeout,
            standalone: control.is_none(),
            source,
            cluster_registry: control.map(|c| c.registry.clone()),
            default_subnet: config.default_subnet,
            log_retention: config.log_retention,
            docker_volumes: config.docker_volumes_dir.clone(),
            metrics: Arc::clone(&self.metrics),
        };
        let (executor, handle) = Executor::new(
            exec_cfg,
            self.ctd.clone(),
            Some(Arc::clone(&self.net)),
            Some(Arc::clone(&self.dns)),
            control.map(|c| c.batches.clone()),
        );
        self.core
            .spawn("executor", after(self.engine_up.clone(), executor.run()));
        let metrics = Arc::clone(&self.metrics);
        let janitor = crate::logs::janitor::run(
            self.ctd.clone(),
            config.data_dir.join("logs"),
            config.log_retention,
            crate::logs::janitor::EVERY,
            move |bytes| metrics.gc_run("log", bytes),
        );
        self.core
            .spawn("log janitor", after(self.engine_up.clone(), janitor));
        handle
    }

    /// A node that joined but cannot follow control now (its enrollment
    /// unreadable, a join or the mesh failing): the executor adopts its
    /// containers and restarts the ones a reboot stopped, `status` says why
    /// control is not followed, and the link is tried again with a growing
    /// delay. Once it can be made, the agent stops as at any restart and
    /// runs again in place (exec): adopting changes no container.
    async fn without_control_link(
        mut self,
        problem: anyhow::Error,
        join_addr: Option<String>,
        shutdown: std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> Result<()> {
        let mut shutdown = shutdown;
        let addresses = self.config.node_addresses(None)?;
        let handle = self.start_executor(None, &addresses);
        let halt = handle.clone();
        let say = |attempt: u32, problem: &anyhow::Error, delay: Duration| {
            format!(
                "not following the control plane: {problem:#} (attempt {attempt}; next in {} s); containers are kept and restarted without it",
                delay.as_secs()
            )
        };
        let mut delay = CONTROL_RETRY_FIRST;
        tracing::error!("{}", say(1, &problem, delay));
        let (notice, notices) = watch::channel(vec![say(1, &problem, delay)]);
        self.start_admin(None, &handle, Some(notices))?;
        self.feeds.spawn("no source", async move {
            let _keep = handle;
            std::future::pending::<()>().await;
        });
        notify(&[
            sd_notify::NotifyState::Ready,
            sd_notify::NotifyState::Status("running without the control plane"),
        ]);
        for attempt in 2u32.. {
            tokio::select! {
                () = &mut shutdown => {
                    notify(&[sd_notify::NotifyState::Stopping]);
                    self.stop(&halt, None).await;
                    return Ok(());
                }
                () = tokio::time::sleep(delay) => {}
            }
            let mut scratch = Tasks::new();
            match control_link_can_be_made(
                &self.config,
                join_addr.as_deref(),
                &self.agent_binary,
                &mut scratch,
            )
            .await
            {
                Ok(()) => {
                    scratch.stop(STOP_WITHIN).await;
                    let binary = self.agent_binary.clone();
                    self.stop(&halt, None).await;
                    let args: Vec<String> = std::env::args().collect();
                    crate::upgrade::exec_self(
                        &binary,
                        &args,
                        "the control link can be made now: running again to follow control",
                    );
                    anyhow::bail!("could not run again to follow the control plane");
                }
                Err(problem) => {
                    scratch.stop(STOP_WITHIN).await;
                    delay = (delay * 2).min(CONTROL_RETRY_MAX);
                    let text = say(attempt, &problem, delay);
                    tracing::warn!("{text}");
                    notice.send_replace(vec![text]);
                }
            }
        }
        Ok(())
    }

    /// Image garbage collection, and the admin socket that `status`,
    /// `logs`, `top` and the rest of the local CLI ask (with `extra`
    /// notices).
    fn start_admin(
        &mut self,
        control: Option<&ControlLink>,
        handle: &ExecutorHandle,
        extra: Option<watch::Receiver<Vec<String>>>,
    ) -> Result<()> {
        let config = &self.config;
        let listener = admin::bind(&config.run_dir).with_context(|| {
            format!(
                "admin socket {}",
                admin::socket_path(&config.run_dir).display()
            )
        })?;
        let (disk_notices, disk_notices_rx) = watch::channel(Vec::new());
        let gc = crate::image_gc::ImageGc {
            ctd: self.ctd.clone(),
            policy: config.image_gc.policy.clone(),
            every: config.image_gc.every,
            record: crate::image_gc::ImageGc::record_path(&config.data_dir),
            notices: disk_notices,
            metrics: Arc::clone(&self.metrics),
        };
        self.core
            .spawn("image gc", after(self.engine_up.clone(), gc.run()));
        let mut notices = vec![self.engine_notices.clone()];
        notices.extend(control.map(|c| c.renewal_notices.clone()));
        notices.push(disk_notices_rx);
        notices.extend(control.map(|c| c.api_notices.clone()));
        notices.extend(extra);
        notices.push(self.upgrade_notices.subscribe());
        notices.push(self.start_notices.subscribe());
        let admin = admin::Admin {
            status: handle.status.clone(),
            notices,
            node: Some(admin::ops::Node {
                ctd: self.ctd.clone(),
                data_dir: config.data_dir.clone(),
                cgroup_parent: self.cgroup_parent.clone(),
                run_dir: config.run_dir.clone(),
            }),
        };
        self.core
            .spawn("admin socket", admin::serve(listener, admin));
        Ok(())
    }

    /// Under control: the samples and their store (kept on disk across
    /// restarts and upgrades, TS-8), the node API and the route watch, the
    /// VIP proxy, DNS answering the routes' VIPs, and the sync stream.
    async fn follow_control(
        &mut self,
        control: ControlLink,
        handle: ExecutorHandle,
        addresses: &NodeAddresses,
    ) -> Result<(Samples, StatsOnClose)> {
        let config = &self.config;
        let ControlLink {
            sync,
            batches_rx,
            registry,
            controls,
            ..
        } = control;
        let stats = crate::metrics::persist::StoreFile::open(&config.data_dir);
        self.core.spawn("stats checkpoints", stats.clone().run());
        let stats_on_close = Some(stats.clone());
        let (samples, sampler) = crate::metrics::Sampler {
            ctd: self.ctd.clone(),
            cgroup_parent: self.cgroup_parent.clone(),
            status: handle.status.clone(),
            every: crate::metrics::SAMPLE_EVERY,
            store: Some(crate::metrics::StoreFeed {
                store: stats.clone(),
                node_id: sync.node_id.clone(),
                data_dir: config.data_dir.clone(),
            }),
        }
        .spawn();
        self.core.adopt("sampler", sampler);
        let build_net = crate::image_build::network::BuildNet::new(
            Arc::clone(&self.net),
            config.build.subnet,
            &self.dns.upstreams(),
        );
        let node = crate::node_api::NodeContext {
            ctd: self.ctd.clone(),
            desired: handle.desired.subscribe(),
            targets: crate::node_api::proxy::Targets {
                host_ips: vec![std::net::IpAddr::V4(addresses.host_ip)],
                status: handle.status.clone(),
            },
            data_dir: config.data_dir.clone(),
            run_dir: config.run_dir.clone(),
            node_id: sync.node_id.clone(),
            stats: Some(Arc::clone(&stats.store)),
            upgrade: crate::upgrade::UpgradeConfig {
                base_url: config.upgrade_base_url.clone(),
                // Resolved at start: once an upgrade renames a new file
                // over it, the running image's path reads "(deleted)".
                binary: self.agent_binary.clone(),
                args: std::env::args().collect(),
                busy: Arc::default(),
                stats: stats_on_close.clone(),
            },
            builder: builder(
                config,
                &self.ctd,
                sync.tls.clone(),
                Some(registry),
                build_net,
            ),
        };
        let doors = crate::node_api::spawn_servers(
            &addresses.node_api,
            sync.tls.clone(),
            node,
            controls,
            Arc::clone(&self.metrics),
        )
        .await;
        let services = crate::control::services::spawn(&sync);
        for (name, task) in doors.into_iter().chain(services.tasks) {
            self.feeds.adopt(name, task);
        }
        let proxy = crate::control::vip::run(
            Arc::clone(&self.net),
            services.routes.clone(),
            handle.networks.clone(),
            self.metrics.vip_connections.clone(),
            self.vip_shutdown.clone(),
        );
        self.vips.spawn("VIP proxy", proxy);
        // Internal names answer the service VIPs of the latest route
        // snapshot (persisted, so served while control is away).
        let names = crate::control::routes::feed_dns(services.routes, Arc::clone(&self.dns));
        self.feeds.spawn("DNS from routes", names);
        self.feeds.spawn(
            "upgrade confirmation",
            crate::upgrade::rollback::confirm_on_first_session(
                crate::upgrade::rollback::Records::beside(&self.agent_binary),
                sync.opened.subscribe(),
                self.upgrade_notices.clone(),
            ),
        );
        let addr = sync.control_addr.clone();
        let stream =
            crate::control::sync::spawn(sync, handle.desired.clone(), batches_rx, samples.clone())
                .with_context(|| format!("--control {addr}: the node identity"))?;
        self.feeds.adopt("sync stream", stream);
        Ok((samples, stats_on_close))
    }

    /// Standalone: the manifest directory feeds the executor, or nothing
    /// does and what exists is kept as it is.
    fn feed_standalone(&mut self, handle: ExecutorHandle) -> Samples {
        // Internal names answer the healthy local instances.
        let names =
            crate::source::local_names::feed_dns(handle.status.clone(), Arc::clone(&self.dns));
        self.feeds.spawn("DNS from local status", names);
        if let Some(dir) = &self.config.manifests {
            let feed = crate::source::feed::feed_from_manifests(
                dir.clone(),
                self.config.data_dir.join("standalone"),
                self.config.subnet_pool,
                handle,
            );
            self.feeds.spawn("manifests", feed);
        } else {
            tracing::warn!(
                "no --manifests and no --control: nothing to run; existing containers are kept as they are"
            );
            self.feeds.spawn("no source", async move {
                let _keep = handle;
                std::future::pending::<()>().await;
            });
        }
        crate::metrics::none()
    }

    /// `/metrics`, when configured. Standalone has no sampler of its own:
    /// one starts for the per-instance figures.
    async fn serve_metrics(
        &mut self,
        status: watch::Receiver<Arc<crate::status::StatusSnapshot>>,
        mut samples: Samples,
    ) {
        let Some(addr) = self.config.metrics_listen else {
            return;
        };
        if self.config.control.is_none() {
            let (standalone, sampler) = crate::metrics::Sampler {
                ctd: self.ctd.clone(),
                cgroup_parent: self.cgroup_parent.clone(),
                status: status.clone(),
                every: crate::metrics::SAMPLE_EVERY,
                store: None,
            }
            .spawn();
            self.core.adopt("sampler", sampler);
            samples = standalone;
        }
        let sources = crate::telemetry::collect::Sources {
            status,
            dns: Some(Arc::clone(&self.dns)),
            samples,
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            cgroup_parent: self.cgroup_parent.clone(),
            log_dir: self.config.data_dir.join("logs"),
        };
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => {
                tracing::info!(%addr, "metrics at /metrics");
                let registry = Arc::new(crate::telemetry::registry(&self.metrics, sources));
                self.core
                    .spawn("metrics", crate::telemetry::serve::run(listener, registry));
            }
            Err(e) => {
                tracing::error!(%addr, "metrics-listen: cannot listen: {e}; no metrics served");
            }
        }
    }

    /// The groups in order: the feeds, then the VIP proxy, then (when the
    /// host goes down) every instance with its grace, then the rest.
    async fn stop(self, halt: &ExecutorHandle, stats: StatsOnClose) {
        self.feeds.stop(STOP_WITHIN).await;
        self.vip_shutdown.cancel();
        self.vips.drain(STOP_WITHIN).await;
        // An executor still waiting for containerd has nothing to stop, and
        // would never answer a halt.
        if *self.engine_up.borrow()
            && stop::host_is_going_down(&self.config.host_shutdown_check).await
        {
            notify(&[sd_notify::NotifyState::Status(
                "host shutting down: stopping instances",
            )]);
            // An instance's grace may be longer than the unit's
            // TimeoutStopSec: systemd is asked to wait for this halt.
            let stopped = halt
                .halt(|bound| {
                    let usec = u32::try_from(bound.as_micros()).unwrap_or(u32::MAX);
                    notify(&[sd_notify::NotifyState::ExtendTimeoutUsec(usec)]);
                })
                .await
                .unwrap_or(0);
            tracing::info!(
                stopped,
                "the host is going down: instances stopped, containers kept for the next boot"
            );
        } else {
            tracing::info!("stopping; containers keep running");
        }
        self.core.stop(STOP_WITHIN).await;
        if let Some(stats) = &stats {
            stats.checkpoint_now().await;
        }
        let _ = std::fs::remove_file(admin::socket_path(&self.config.run_dir));
        if let Err(e) = crate::durable::remove(&start::running_marker(&self.config.data_dir)) {
            tracing::warn!(error = %e, "the run marker was not removed: the next start will report an unclean stop");
        }
    }
}

/// The first wait before the control link is tried again, and the longest.
const CONTROL_RETRY_FIRST: Duration = Duration::from_secs(5);
const CONTROL_RETRY_MAX: Duration = Duration::from_secs(60);

/// Makes the control link as a start would (a kept join token's join, the
/// enrollment, the mesh), its tasks in `scratch`.
async fn control_link_can_be_made(
    config: &Config,
    join_addr: Option<&str>,
    binary: &std::path::Path,
    scratch: &mut Tasks,
) -> Result<()> {
    let mut config = config.clone();
    if let Some(token) = &config.join_token {
        start::enroll_if_new(&config, join_addr, token).await?;
    }
    config.control = start::sync_target(&config)?;
    ControlLink::prepare(&config, join_addr, binary, scratch).await?;
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

/// The node's builder for RunBuild, or why it has none.
fn builder(
    config: &Config,
    ctd: &Containerd,
    tls: crate::link::tls::CurrentTls,
    registry: Option<crate::runtime::pull::ClusterRegistryWatch>,
    sandbox: crate::image_build::network::BuildNet,
) -> Result<crate::node_api::build::Builder, crate::image_build::NoBuilder> {
    let backend = crate::image_build::choose_backend(&crate::image_build::Host {
        settings: &config.build,
        ctd: Some(ctd.clone()),
        containerd_address: &config.containerd_address,
        namespace: config.namespace.as_str(),
        data_dir: &config.data_dir,
        run_dir: &config.run_dir,
        oci_runtime: &config.oci_runtime,
    });
    match &backend {
        Ok(b) => tracing::info!(backend = b.name(), "builds enabled"),
        Err(why) => tracing::info!(%why, "no builds on this node"),
    }
    let mut pipeline = crate::image_build::PipelineConfig::new(&config.data_dir);
    pipeline.node_tls = Some(tls);
    pipeline.cluster_registry = registry;
    pipeline.custom_frontends = config.build.custom_frontends;
    pipeline.planner.binary.clone_from(&config.build.nixpacks);
    pipeline.network = config.build.network;
    pipeline.sandbox = Some(Arc::new(sandbox));
    if config.build.network == crate::image_build::buildah::BuildNetwork::None
        && backend.as_ref().is_ok_and(|b| b.attaches_steps_itself())
    {
        tracing::warn!(
            "build-network = none is not available with BuildKit: its builds will fail until build-network is private or host"
        );
    }
    Ok(crate::node_api::build::Builder {
        pipeline: crate::image_build::Pipeline {
            config: pipeline,
            backend: backend?,
        },
        builds: Arc::new(crate::image_build::Builds::with_limit(
            config.build.max_builds,
        )),
    })
}
