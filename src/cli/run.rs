//! `zattera-agent run`.

use anyhow::{Context, Result};
use clap::Args;
use std::path::PathBuf;
use zattera_agent::config::{Config, Settings};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Directory of standalone manifests (one TOML file per app).
    #[arg(long, value_name = "DIR")]
    manifests: Option<PathBuf>,
    /// Control-plane address; without it the agent runs standalone.
    #[arg(long, value_name = "ADDR")]
    control: Option<String>,
    /// Host address published ports bind to [default: 127.0.0.1]
    #[arg(long, value_name = "IP")]
    host_ip: Option<std::net::IpAddr>,
    /// This node's id.
    #[arg(long, value_name = "ID")]
    node_id: Option<String>,
    /// Prefix of the bridges and veths this agent creates [default: ztbr]
    #[arg(long, value_name = "PREFIX")]
    bridge_prefix: Option<String>,
    /// Subnet slots for standalone networks, FIRST-LAST of 10.201.X.0/24 [default: 0-255]
    #[arg(long, value_name = "FIRST-LAST")]
    subnet_pool: Option<String>,
    /// Address of the node API served to the control plane (mTLS) [default: 0.0.0.0:8444]
    #[arg(long, value_name = "ADDR")]
    node_api_listen: Option<std::net::SocketAddr>,
    /// URL prefix self-upgrades may come from (`*` = any); none: upgrades refused
    #[arg(long, value_name = "URL")]
    upgrade_base_url: Option<String>,
    /// Ephemeral host ports for published ports [default: 30000-32767]
    #[arg(long, value_name = "LO-HI")]
    host_port_range: Option<String>,
    /// Processes per container, 0 = unlimited [default: 4096]
    #[arg(long, value_name = "N")]
    pids_limit: Option<u32>,
    /// Containers of one environment that share a runc shim; 1 = a shim
    /// per container [default: 8]
    #[arg(long, value_name = "N")]
    shim_group_size: Option<u32>,
    /// The OCI runtime containers run with: runc, crun, auto (crun when
    /// installed) or an absolute path [default: runc]
    #[arg(long, value_name = "RUNTIME")]
    oci_runtime: Option<String>,
    /// Longest an image pull may take [default: 10m]
    #[arg(long, value_name = "DURATION")]
    pull_timeout: Option<String>,
    /// Join token kept for renewing the node identity (a join when a third
    /// of the certificate's life is left, never at every start)
    #[arg(
        long,
        value_name = "TOKEN",
        env = "ZATTERA_JOIN_TOKEN",
        hide_env_values = true
    )]
    join_token: Option<String>,
    /// Network of assignments pushed without a subnet, a.b.c.0/24 or none
    /// [default: 10.202.0.0/24]
    #[arg(long, value_name = "CIDR")]
    default_subnet: Option<String>,
    /// Command that prints `stopping` while the host shuts down: SIGTERM then
    /// stops every instance with its grace instead of leaving them running;
    /// `none` never [default: systemctl is-system-running]
    #[arg(long, value_name = "COMMAND")]
    host_shutdown_check: Option<String>,
    /// How long container output is kept, as 7days or 36h [default: 7days]
    #[arg(long, value_name = "DURATION")]
    log_retention: Option<String>,
    /// Compressed container output kept per instance, in MiB [default: 100]
    #[arg(long, value_name = "MIB")]
    log_max_stream_mb: Option<u64>,
    /// Image filesystem use that starts image GC, percent [default: 85]
    #[arg(long, value_name = "PERCENT")]
    image_gc_high_percent: Option<u8>,
    /// Image filesystem use where image GC stops, percent [default: 80]
    #[arg(long, value_name = "PERCENT")]
    image_gc_low_percent: Option<u8>,
    /// Unused this long, an image is removed even without disk pressure [default: off]
    #[arg(long, value_name = "DURATION|off")]
    image_gc_max_age: Option<String>,
    /// An image used or pulled this recently is never removed [default: 2m]
    #[arg(long, value_name = "DURATION")]
    image_gc_min_age: Option<String>,
    /// An image image GC never removes (a name, or a prefix ending in *); repeatable
    #[arg(long = "image-gc-pin", value_name = "IMAGE")]
    image_gc_pinned: Vec<String>,
    /// Time between image GC passes [default: 5m]
    #[arg(long, value_name = "DURATION")]
    image_gc_interval: Option<String>,
    /// Serve Prometheus metrics at /metrics here: HOST:PORT, or PORT for loopback [default: off]
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<String>,
    /// The WireGuard mesh interface [default: zt0]
    #[arg(long, value_name = "NAME")]
    mesh_interface: Option<String>,
    /// UDP port of the node's WireGuard [default: 51820]
    #[arg(long, value_name = "PORT")]
    mesh_listen_port: Option<u16>,
    /// IP:PORT where other nodes reach this node's WireGuard, sent in the join; repeatable; `auto`: the default route's address, if globally routable [default: none, peers go through the hub]
    #[arg(long = "mesh-endpoint", value_name = "IP:PORT")]
    mesh_endpoints: Vec<String>,
    /// auto, kernel or userspace [default: auto: the kernel's WireGuard where it has one]
    #[arg(long, value_name = "KIND")]
    mesh_backend: Option<String>,
    /// What builds images for RunBuild: auto, buildkit, buildah or off [default: auto: BuildKit if installed, else buildah]
    #[arg(long, value_name = "KIND")]
    build_backend: Option<String>,
    /// The buildkitd binary the agent runs for BuildKit builds [default: /usr/bin/buildkitd]
    #[arg(long, value_name = "PATH")]
    buildkitd_binary: Option<PathBuf>,
    /// The nixpacks planner [default: /usr/lib/zattera/nixpacks]
    #[arg(long, value_name = "PATH")]
    nixpacks_binary: Option<PathBuf>,
    /// Where build steps' traffic goes: private, none or host [default: private]
    #[arg(long, value_name = "KIND")]
    build_network: Option<String>,
    /// The private build network's bridge, a.b.c.0/24 [default: 10.202.254.0/24]
    #[arg(long, value_name = "CIDR")]
    build_subnet: Option<String>,
    /// Builds running at once; more wait in a bounded queue [default: 2]
    #[arg(long, value_name = "N")]
    max_builds: Option<usize>,
    /// Where Docker kept the reference agent's volumes, taken over at their first use [default: /var/lib/docker/volumes]
    #[arg(long, value_name = "DIR")]
    docker_volumes_dir: Option<PathBuf>,
    /// An IPv4 range no container or build step may reach (underlay, VPC); repeatable. The mesh and 169.254.0.0/16 are never reachable
    #[arg(long = "egress-deny", value_name = "CIDR")]
    egress_deny: Vec<String>,
}

impl RunArgs {
    /// `base` (the global flags) with this command's flags.
    pub fn settings(&self, base: Settings) -> Settings {
        Settings {
            manifests: self.manifests.clone(),
            control: self.control.clone(),
            host_ip: self.host_ip,
            node_id: self.node_id.clone(),
            bridge_prefix: self.bridge_prefix.clone(),
            subnet_pool: self.subnet_pool.clone(),
            node_api_listen: self.node_api_listen,
            upgrade_base_url: self.upgrade_base_url.clone(),
            host_port_range: self.host_port_range.clone(),
            pids_limit: self.pids_limit,
            shim_group_size: self.shim_group_size,
            oci_runtime: self.oci_runtime.clone(),
            pull_timeout: self.pull_timeout.clone(),
            join_token: self.join_token.clone(),
            default_subnet: self.default_subnet.clone(),
            host_shutdown_check: self.host_shutdown_check.clone(),
            log_retention: self.log_retention.clone(),
            log_max_stream_mb: self.log_max_stream_mb,
            image_gc_high_percent: self.image_gc_high_percent,
            image_gc_low_percent: self.image_gc_low_percent,
            image_gc_max_age: self.image_gc_max_age.clone(),
            image_gc_min_age: self.image_gc_min_age.clone(),
            image_gc_pinned: (!self.image_gc_pinned.is_empty())
                .then(|| self.image_gc_pinned.clone()),
            image_gc_interval: self.image_gc_interval.clone(),
            metrics_listen: self.metrics_listen.clone(),
            mesh_interface: self.mesh_interface.clone(),
            mesh_listen_port: self.mesh_listen_port,
            mesh_endpoints: (!self.mesh_endpoints.is_empty()).then(|| self.mesh_endpoints.clone()),
            mesh_backend: self.mesh_backend.clone(),
            build_backend: self.build_backend.clone(),
            buildkitd_binary: self.buildkitd_binary.clone(),
            nixpacks_binary: self.nixpacks_binary.clone(),
            build_network: self.build_network.clone(),
            build_subnet: self.build_subnet.clone(),
            max_builds: self.max_builds,
            docker_volumes_dir: self.docker_volumes_dir.clone(),
            egress_deny: (!self.egress_deny.is_empty()).then(|| self.egress_deny.clone()),
            ..base
        }
    }
}

pub async fn run(config: Config) -> Result<()> {
    let me = std::env::current_exe().context("locating this binary for the log shim")?;
    zattera_agent::agent::run(config, me).await
}
