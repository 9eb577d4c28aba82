//! Agent configuration: `/etc/zattera/agent.toml` plus command-line flags.
//!
//! The file uses the same keys as the flags (`containerd-address = "..."`;
//! the snake_case spelling is accepted too). Flags win over the file, the file
//! wins over the defaults. An unknown key is an error that names the key and
//! the file, so a typo never silently falls back to a default.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::image_build::settings::{BuildBackendKind, BuildSettings};
pub use crate::mesh::settings::MeshSettings;
use crate::runtime::Namespace;

/// Where the config file is looked for when `--config` is not given.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/zattera/agent.toml";
pub const DEFAULT_DATA_DIR: &str = "/var/lib/zattera";
pub const DEFAULT_RUN_DIR: &str = "/run/zattera";
pub const DEFAULT_CONTAINERD_ADDRESS: &str = "/run/containerd/containerd.sock";
pub const DEFAULT_NAMESPACE: &str = "zattera";
/// Processes per container unless configured (`pids-limit`): contains a
/// fork bomb, and far above what a service needs.
pub const DEFAULT_PIDS_LIMIT: u32 = 4096;
/// Containers of one environment per runc shim unless configured
/// (`shim-group-size`); bench/density and bench/results/2026-12-06.md say
/// why this many.
pub const DEFAULT_SHIM_GROUP_SIZE: usize = 8;
/// The OCI runtime when the config names none.
pub const DEFAULT_OCI_RUNTIME: &str = "runc";
pub const DEFAULT_HOST_IP: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
/// The node API (`AgentLocalService`) on every address, port 8444 (wire.md §0.4).
pub const DEFAULT_NODE_API_LISTEN: SocketAddr =
    SocketAddr::new(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 8444);

/// Every key the config file (and the command line) may set. All optional:
/// this is one layer of settings, merged with [`Settings::overlay`].
#[derive(Debug, Default, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Settings {
    /// Directory of standalone manifests.
    pub manifests: Option<PathBuf>,
    /// Control-plane address (`host:port`); absent means standalone.
    pub control: Option<String>,
    #[serde(alias = "containerd_address")]
    pub containerd_address: Option<PathBuf>,
    pub namespace: Option<String>,
    #[serde(alias = "data_dir")]
    pub data_dir: Option<PathBuf>,
    #[serde(alias = "run_dir")]
    pub run_dir: Option<PathBuf>,
    #[serde(alias = "host_ip")]
    pub host_ip: Option<IpAddr>,
    #[serde(alias = "node_id")]
    pub node_id: Option<String>,
    /// Prefix of the bridges and veths this agent creates (2 to 8 letters).
    #[serde(alias = "bridge_prefix")]
    pub bridge_prefix: Option<String>,
    /// Standalone subnet slots, `FIRST-LAST` of 10.201.X.0/24 (default 0-255).
    #[serde(alias = "subnet_pool")]
    pub subnet_pool: Option<String>,
    /// Where the node API listens when a control plane is used.
    #[serde(alias = "node_api_listen")]
    pub node_api_listen: Option<SocketAddr>,
    /// URL prefix the node API's UpgradeBinary may download from (`*` = any).
    #[serde(alias = "upgrade_base_url")]
    pub upgrade_base_url: Option<String>,
    /// Ephemeral host ports for published ports, `LO-HI` (default 30000-32767).
    #[serde(alias = "host_port_range")]
    pub host_port_range: Option<String>,
    /// Processes per container (default 4096; 0 = unlimited).
    #[serde(alias = "pids_limit")]
    pub pids_limit: Option<u32>,
    /// Containers of one environment per runc shim (default
    /// [`DEFAULT_SHIM_GROUP_SIZE`]; 1 = a shim each).
    #[serde(alias = "shim_group_size")]
    pub shim_group_size: Option<u32>,
    /// The OCI runtime containers run with: `runc` (default), `crun`,
    /// `auto` (crun when installed) or an absolute path.
    #[serde(alias = "oci_runtime")]
    pub oci_runtime: Option<String>,
    /// Longest an image pull may take, as `90s`, `10m` (default 10m).
    #[serde(alias = "pull_timeout")]
    pub pull_timeout: Option<String>,
    /// Node ids allowed to call the node API besides the control peers the
    /// join named.
    #[serde(alias = "control_node_ids")]
    pub control_node_ids: Option<Vec<String>>,
    /// A join token kept to renew the node identity: the node joins again
    /// when its certificate has a third of its life left (and enrolls with
    /// it at the first start), never at every start.
    #[serde(alias = "join_token")]
    pub join_token: Option<String>,
    /// The node-local network of assignments pushed without a subnet,
    /// `a.b.c.0/24` outside 10.201/16, 10.90/16 and 10.97/16, or `none`
    /// (default 10.202.0.0/24).
    #[serde(alias = "default_subnet")]
    pub default_subnet: Option<String>,
    /// The command whose output says the host is going down (`stopping`):
    /// then SIGTERM stops every instance with its grace; otherwise the
    /// agent exits and they keep running. `none`: never (default
    /// `systemctl is-system-running`).
    #[serde(alias = "host_shutdown_check")]
    pub host_shutdown_check: Option<String>,
    /// How long container output is kept, as `7days`, `36h` (default 7 days).
    #[serde(alias = "log_retention")]
    pub log_retention: Option<String>,
    /// Whether a tenant's Dockerfile may name a `# syntax=` frontend, which
    /// parses the file its own way past the image check (default false).
    #[serde(alias = "build_custom_frontends")]
    pub build_custom_frontends: Option<bool>,
    /// Where Docker kept the reference agent's volumes, taken over at their
    /// first use here (default /var/lib/docker/volumes).
    #[serde(alias = "docker_volumes_dir")]
    pub docker_volumes_dir: Option<PathBuf>,
    /// IPv4 ranges no container or build step may reach (the node's
    /// underlay, a VPC), besides the mesh and link-local, which none ever
    /// reaches.
    #[serde(alias = "egress_deny")]
    pub egress_deny: Option<Vec<String>>,
    /// Compressed container output kept per instance, in MiB (default 100).
    #[serde(alias = "log_max_stream_mb")]
    pub log_max_stream_mb: Option<u64>,
    /// Percent of the image filesystem in use that starts image GC (85).
    #[serde(alias = "image_gc_high_percent")]
    pub image_gc_high_percent: Option<u8>,
    /// Where image GC stops (80).
    #[serde(alias = "image_gc_low_percent")]
    pub image_gc_low_percent: Option<u8>,
    /// Unused this long, an image is removed without disk pressure; `off`
    /// (the default): only disk pressure removes images.
    #[serde(alias = "image_gc_max_age")]
    pub image_gc_max_age: Option<String>,
    /// An image used or pulled this recently is kept (2m).
    #[serde(alias = "image_gc_min_age")]
    pub image_gc_min_age: Option<String>,
    /// Images never removed: names, or prefixes ending in `*`.
    #[serde(alias = "image_gc_pinned")]
    pub image_gc_pinned: Option<Vec<String>>,
    /// Time between image GC passes (5m).
    #[serde(alias = "image_gc_interval")]
    pub image_gc_interval: Option<String>,
    /// Where `/metrics` is served (Prometheus text format): `HOST:PORT`,
    /// or `PORT` for loopback; absent (the default): not served.
    #[serde(alias = "metrics_listen")]
    pub metrics_listen: Option<String>,
    /// The WireGuard mesh interface (default zt0).
    #[serde(alias = "mesh_interface")]
    pub mesh_interface: Option<String>,
    /// UDP port WireGuard listens on (default 51820).
    #[serde(alias = "mesh_listen_port")]
    pub mesh_listen_port: Option<u16>,
    /// `host:port` endpoints other nodes reach this one's WireGuard at, sent
    /// in the join. Default: none, as the reference advertises only what is
    /// configured (peers then reach this node through the hub); `auto`: the
    /// default route's address at the port, when it is globally routable.
    #[serde(alias = "mesh_endpoints")]
    pub mesh_endpoints: Option<Vec<String>>,
    /// `auto` (kernel WireGuard when the kernel has it, else userspace),
    /// `kernel` or `userspace`.
    #[serde(alias = "mesh_backend")]
    pub mesh_backend: Option<String>,
    /// What builds images for RunBuild: `auto` (BuildKit when its daemon
    /// is installed, else buildah when it is, else none), `buildkit`,
    /// `buildah` or `off`.
    #[serde(alias = "build_backend")]
    pub build_backend: Option<String>,
    /// The buildkitd binary the agent runs (default /usr/bin/buildkitd).
    #[serde(alias = "buildkitd_binary")]
    pub buildkitd_binary: Option<PathBuf>,
    /// The BuildKit release the daemon must report (default v0.18.2).
    #[serde(alias = "buildkit_version")]
    pub buildkit_version: Option<String>,
    /// The nixpacks planner (default /usr/lib/zattera/nixpacks).
    #[serde(alias = "nixpacks_binary")]
    pub nixpacks_binary: Option<PathBuf>,
    /// The network of `RUN` steps: `private` (the default: a bridge of the
    /// agent's own, guarded as containers are, and no route into the mesh),
    /// `none`, or `host` (the node's own network: an operator's choice).
    #[serde(alias = "build_network")]
    pub build_network: Option<String>,
    /// The /24 of the private build network (default 10.202.254.0/24).
    #[serde(alias = "build_subnet")]
    pub build_subnet: Option<String>,
    /// Builds this node runs at once; more are refused with
    /// RESOURCE_EXHAUSTED (default 2).
    #[serde(alias = "max_builds")]
    pub max_builds: Option<usize>,
}

impl Settings {
    /// Parses one config file's text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: origin.to_path_buf(),
            message: e.to_string().trim_end().to_owned(),
        })
    }

    /// Reads the config file. An explicitly named file must exist; the default
    /// one may be absent (a node configured only by flags).
    pub fn load(explicit: Option<&Path>) -> Result<Self, ConfigError> {
        let path = explicit.unwrap_or(Path::new(DEFAULT_CONFIG_PATH));
        match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(&text, path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && explicit.is_none() => {
                Ok(Self::default())
            }
            Err(e) => Err(ConfigError::Read {
                path: path.to_path_buf(),
                source: e,
            }),
        }
    }

    /// `self` with every key that `top` sets replaced by `top`'s value.
    #[must_use]
    pub fn overlay(self, top: Settings) -> Settings {
        Settings {
            manifests: top.manifests.or(self.manifests),
            control: top.control.or(self.control),
            containerd_address: top.containerd_address.or(self.containerd_address),
            namespace: top.namespace.or(self.namespace),
            data_dir: top.data_dir.or(self.data_dir),
            run_dir: top.run_dir.or(self.run_dir),
            host_ip: top.host_ip.or(self.host_ip),
            node_id: top.node_id.or(self.node_id),
            bridge_prefix: top.bridge_prefix.or(self.bridge_prefix),
            subnet_pool: top.subnet_pool.or(self.subnet_pool),
            node_api_listen: top.node_api_listen.or(self.node_api_listen),
            upgrade_base_url: top.upgrade_base_url.or(self.upgrade_base_url),
            host_port_range: top.host_port_range.or(self.host_port_range),
            pids_limit: top.pids_limit.or(self.pids_limit),
            shim_group_size: top.shim_group_size.or(self.shim_group_size),
            oci_runtime: top.oci_runtime.or(self.oci_runtime),
            pull_timeout: top.pull_timeout.or(self.pull_timeout),
            control_node_ids: top.control_node_ids.or(self.control_node_ids),
            join_token: top.join_token.or(self.join_token),
            default_subnet: top.default_subnet.or(self.default_subnet),
            host_shutdown_check: top.host_shutdown_check.or(self.host_shutdown_check),
            log_retention: top.log_retention.or(self.log_retention),
            docker_volumes_dir: top.docker_volumes_dir.or(self.docker_volumes_dir),
            build_custom_frontends: top.build_custom_frontends.or(self.build_custom_frontends),
            egress_deny: top.egress_deny.or(self.egress_deny),
            log_max_stream_mb: top.log_max_stream_mb.or(self.log_max_stream_mb),
            image_gc_high_percent: top.image_gc_high_percent.or(self.image_gc_high_percent),
            image_gc_low_percent: top.image_gc_low_percent.or(self.image_gc_low_percent),
            image_gc_max_age: top.image_gc_max_age.or(self.image_gc_max_age),
            image_gc_min_age: top.image_gc_min_age.or(self.image_gc_min_age),
            image_gc_pinned: top.image_gc_pinned.or(self.image_gc_pinned),
            image_gc_interval: top.image_gc_interval.or(self.image_gc_interval),
            metrics_listen: top.metrics_listen.or(self.metrics_listen),
            mesh_interface: top.mesh_interface.or(self.mesh_interface),
            mesh_listen_port: top.mesh_listen_port.or(self.mesh_listen_port),
            mesh_endpoints: top.mesh_endpoints.or(self.mesh_endpoints),
            mesh_backend: top.mesh_backend.or(self.mesh_backend),
            build_backend: top.build_backend.or(self.build_backend),
            buildkitd_binary: top.buildkitd_binary.or(self.buildkitd_binary),
            buildkit_version: top.buildkit_version.or(self.buildkit_version),
            nixpacks_binary: top.nixpacks_binary.or(self.nixpacks_binary),
            build_network: top.build_network.or(self.build_network),
            build_subnet: top.build_subnet.or(self.build_subnet),
            max_builds: top.max_builds.or(self.max_builds),
        }
    }

    /// Fills in defaults and validates.
    pub fn resolve(self) -> Result<Config, ConfigError> {
        let namespace = self
            .namespace
            .as_deref()
            .unwrap_or(DEFAULT_NAMESPACE)
            .parse::<Namespace>()
            .map_err(|e| ConfigError::Invalid {
                key: "namespace",
                message: e.to_string(),
            })?;
        let subnet_pool = match self.subnet_pool.as_deref() {
            None => (0, 255),
            Some(text) => parse_pool(text).ok_or_else(|| ConfigError::Invalid {
                key: "subnet-pool",
                message: format!("{text:?} is not FIRST-LAST with 0 <= FIRST <= LAST <= 255"),
            })?,
        };
        let host_port_range = match self.host_port_range.as_deref() {
            None => zattera_netns::PortRange::DEFAULT,
            Some(text) => text
                .parse()
                .map_err(|e: zattera_netns::Error| ConfigError::Invalid {
                    key: "host-port-range",
                    message: e.to_string(),
                })?,
        };
        let pull_timeout = match self.pull_timeout.as_deref() {
            None => DEFAULT_PULL_TIMEOUT,
            Some(text) => humantime::parse_duration(text)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| ConfigError::Invalid {
                    key: "pull-timeout",
                    message: format!("{text:?} is not a duration such as 90s or 10m"),
                })?,
        };
        let default_subnet = match self.default_subnet.as_deref().map(str::trim) {
            None => Some(parse_default_subnet(DEFAULT_SUBNET)?),
            Some("none") => None,
            Some(text) => Some(parse_default_subnet(text)?),
        };
        let host_shutdown_check = match self.host_shutdown_check.as_deref().map(str::trim) {
            None => DEFAULT_HOST_SHUTDOWN_CHECK
                .split_whitespace()
                .map(str::to_owned)
                .collect(),
            Some("none" | "") => Vec::new(),
            Some(cmd) => cmd.split_whitespace().map(str::to_owned).collect(),
        };
        let log_max_age = match self.log_retention.as_deref() {
            None => crate::logs::retention::DEFAULT_MAX_AGE,
            Some(text) => humantime::parse_duration(text)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| ConfigError::Invalid {
                    key: "log-retention",
                    message: format!("{text:?} is not a duration such as 7days or 36h"),
                })?,
        };
        let log_max_stream_bytes = match self.log_max_stream_mb {
            None => crate::logs::retention::DEFAULT_MAX_STREAM_BYTES,
            Some(0) => {
                return Err(ConfigError::Invalid {
                    key: "log-max-stream-mb",
                    message: "0 would keep no history; give at least 1".into(),
                });
            }
            Some(mb) => mb.saturating_mul(1024 * 1024),
        };
        let image_gc = self.image_gc()?;
        let mesh = self.mesh()?;
        let build = self.build()?;
        let metrics_listen = match self.metrics_listen.as_deref().map(str::trim) {
            None | Some("" | "off") => None,
            Some(text) => Some(crate::telemetry::serve::parse_listen(text).ok_or_else(|| {
                ConfigError::Invalid {
                    key: "metrics-listen",
                    message: format!("{text:?} is not HOST:PORT or PORT"),
                }
            })?),
        };
        Ok(Config {
            mesh,
            build,
            image_gc,
            metrics_listen,
            log_retention: crate::logs::Retention {
                max_age: log_max_age,
                max_stream_bytes: log_max_stream_bytes,
            },
            default_subnet,
            host_shutdown_check,
            host_port_range,
            pull_timeout,
            docker_volumes_dir: self
                .docker_volumes_dir
                .unwrap_or_else(|| PathBuf::from(crate::volumes::adopt::DEFAULT_DOCKER_VOLUMES)),
            egress_deny: self
                .egress_deny
                .iter()
                .flatten()
                .map(|c| {
                    c.parse()
                        .map_err(|e: zattera_netns::Error| ConfigError::Invalid {
                            key: "egress-deny",
                            message: e.to_string(),
                        })
                })
                .collect::<Result<_, _>>()?,
            pids_limit: self.pids_limit.unwrap_or(DEFAULT_PIDS_LIMIT),
            shim_group_size: self
                .shim_group_size
                .map_or(DEFAULT_SHIM_GROUP_SIZE, |n| n.max(1) as usize),
            oci_runtime: crate::runtime::oci_runtime::OciRuntime::resolve(
                self.oci_runtime.as_deref().unwrap_or(DEFAULT_OCI_RUNTIME),
                &crate::runtime::oci_runtime::Host::this_one(),
            )
            .map_err(|message| ConfigError::Invalid {
                key: "oci-runtime",
                message,
            })?,
            control_node_ids: self.control_node_ids.unwrap_or_default(),
            join_token: self.join_token.filter(|t| !t.trim().is_empty()),
            bridge_prefix: self.bridge_prefix,
            subnet_pool,
            manifests: self.manifests,
            control: self.control.filter(|c| !c.is_empty()),
            containerd_address: self
                .containerd_address
                .unwrap_or_else(|| DEFAULT_CONTAINERD_ADDRESS.into()),
            namespace,
            data_dir: self.data_dir.unwrap_or_else(|| DEFAULT_DATA_DIR.into()),
            run_dir: self.run_dir.unwrap_or_else(|| DEFAULT_RUN_DIR.into()),
            host_ip: self.host_ip.unwrap_or(DEFAULT_HOST_IP),
            node_id: self.node_id.filter(|n| !n.is_empty()),
            node_api_listen: self.node_api_listen.unwrap_or(DEFAULT_NODE_API_LISTEN),
            upgrade_base_url: self.upgrade_base_url.filter(|u| !u.is_empty()),
        })
    }
}

impl Settings {
    fn build(&self) -> Result<BuildSettings, ConfigError> {
        let defaults = BuildSettings::default();
        let backend = match self.build_backend.as_deref().map(str::trim) {
            None | Some("auto") => BuildBackendKind::Auto,
            Some("buildkit") => BuildBackendKind::BuildKit,
            Some("buildah") => BuildBackendKind::Buildah,
            Some("off" | "none") => BuildBackendKind::Off,
            Some(other) => {
                return Err(ConfigError::Invalid {
                    key: "build-backend",
                    message: format!("{other:?} is not auto, buildkit, buildah or off"),
                });
            }
        };
        let network = match self.build_network.as_deref() {
            None => defaults.network,
            Some(text) => text
                .trim()
                .parse()
                .map_err(|message| ConfigError::Invalid {
                    key: "build-network",
                    message,
                })?,
        };
        let subnet = match self.build_subnet.as_deref() {
            None => defaults.subnet,
            Some(text) => {
                zattera_netns::Subnet::any_24(text.trim()).map_err(|e| ConfigError::Invalid {
                    key: "build-subnet",
                    message: e.to_string(),
                })?
            }
        };
        Ok(BuildSettings {
            backend,
            subnet,
            buildkitd: self.buildkitd_binary.clone().unwrap_or(defaults.buildkitd),
            buildkit_version: self
                .buildkit_version
                .clone()
                .unwrap_or(defaults.buildkit_version),
            nixpacks: self.nixpacks_binary.clone().unwrap_or(defaults.nixpacks),
            network,
            max_builds: match self.max_builds {
                Some(0) => {
                    return Err(ConfigError::Invalid {
                        key: "max-builds",
                        message: "0 would refuse every build; use build-backend = \"off\"".into(),
                    });
                }
                Some(n) => n,
                None => defaults.max_builds,
            },
            custom_frontends: self.build_custom_frontends.unwrap_or(false),
        })
    }

    fn mesh(&self) -> Result<MeshSettings, ConfigError> {
        let defaults = MeshSettings::default();
        let interface = self.mesh_interface.clone().unwrap_or(defaults.interface);
        if interface.is_empty()
            || interface.len() > 15
            || !interface
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(ConfigError::Invalid {
                key: "mesh-interface",
                message: format!(
                    "{interface:?} is not an interface name (1-15 of a-z, 0-9, - and _)"
                ),
            });
        }
        let autodetect = self
            .mesh_endpoints
            .iter()
            .flatten()
            .any(|e| e.trim() == "auto");
        let endpoints = self
            .mesh_endpoints
            .iter()
            .flatten()
            .filter(|e| e.trim() != "auto")
            .map(|e| {
                e.trim()
                    .parse::<SocketAddr>()
                    .map_err(|_| ConfigError::Invalid {
                        key: "mesh-endpoints",
                        message: format!("{e:?} is not IP:PORT (or auto)"),
                    })
            })
            .collect::<Result<_, _>>()?;
        let backend = match self.mesh_backend.as_deref() {
            None => defaults.backend,
            Some(text) => {
                text.trim()
                    .parse()
                    .map_err(|e: zattera_mesh::Error| ConfigError::Invalid {
                        key: "mesh-backend",
                        message: e.to_string(),
                    })?
            }
        };
        Ok(MeshSettings {
            interface,
            listen_port: self.mesh_listen_port.unwrap_or(defaults.listen_port),
            endpoints,
            autodetect_endpoint: autodetect,
            backend,
        })
    }

    fn image_gc(&self) -> Result<ImageGcConfig, ConfigError> {
        use crate::image_gc::{DEFAULT_EVERY, GcPolicy, Pin};
        let defaults = GcPolicy::default();
        let duration = |key: &'static str, text: &str| {
            humantime::parse_duration(text.trim()).map_err(|_| ConfigError::Invalid {
                key,
                message: format!("{text:?} is not a duration such as 90s, 10m or 7days"),
            })
        };
        let high = self.image_gc_high_percent.unwrap_or(defaults.high_percent);
        let low = self.image_gc_low_percent.unwrap_or(defaults.low_percent);
        if !(1..=100).contains(&high) || low >= high {
            return Err(ConfigError::Invalid {
                key: "image-gc-low-percent",
                message: format!(
                    "the low mark ({low}%) must be under the high mark ({high}%), at most 100%"
                ),
            });
        }
        let max_age = match self.image_gc_max_age.as_deref().map(str::trim) {
            None | Some("off" | "") => None,
            Some(text) => Some(duration("image-gc-max-age", text)?),
        };
        let min_age = match self.image_gc_min_age.as_deref() {
            None => defaults.min_age,
            Some(text) => duration("image-gc-min-age", text)?,
        };
        let every = match self.image_gc_interval.as_deref() {
            None => DEFAULT_EVERY,
            Some(text) => Some(duration("image-gc-interval", text)?)
                .filter(|d| !d.is_zero())
                .ok_or_else(|| ConfigError::Invalid {
                    key: "image-gc-interval",
                    message: "must be more than 0".into(),
                })?,
        };
        Ok(ImageGcConfig {
            policy: GcPolicy {
                max_age,
                min_age,
                high_percent: high,
                low_percent: low,
                pinned: self
                    .image_gc_pinned
                    .iter()
                    .flatten()
                    .map(|p| Pin::new(p))
                    .collect(),
            },
            every,
        })
    }
}

/// The resolved configuration the agent runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub manifests: Option<PathBuf>,
    pub control: Option<String>,
    pub containerd_address: PathBuf,
    pub namespace: Namespace,
    pub data_dir: PathBuf,
    pub run_dir: PathBuf,
    pub host_ip: IpAddr,
    pub node_id: Option<String>,
    pub bridge_prefix: Option<String>,
    /// Inclusive range of subnet slots standalone networks are taken from.
    pub subnet_pool: (u8, u8),
    pub node_api_listen: SocketAddr,
    pub upgrade_base_url: Option<String>,
    pub host_port_range: zattera_netns::PortRange,
    pub pids_limit: u32,
    /// Containers of one environment per runc shim; 1: a shim each.
    pub shim_group_size: usize,
    pub oci_runtime: crate::runtime::oci_runtime::OciRuntime,
    pub pull_timeout: std::time::Duration,
    pub control_node_ids: Vec<String>,
    pub join_token: Option<String>,
    pub default_subnet: Option<zattera_netns::Subnet>,
    /// argv of the host-shutdown check; empty: never.
    pub host_shutdown_check: Vec<String>,
    pub log_retention: crate::logs::Retention,
    /// Where the reference agent's Docker volumes are (adopted at first use).
    pub docker_volumes_dir: PathBuf,
    /// Ranges no bridge reaches, besides the mesh and link-local.
    pub egress_deny: Vec<zattera_netns::firewall::Cidr>,
    pub image_gc: ImageGcConfig,
    /// Where `/metrics` is served; `None`: nowhere.
    pub metrics_listen: Option<SocketAddr>,
    pub mesh: MeshSettings,
    pub build: BuildSettings,
}

/// Bring-ups and removals that run at once, and so the shim groups that
/// fill side by side. A bring-up mostly waits on containerd, its shim and
/// runc, and a shared shim serves its tasks one at a time: on two cores
/// the converge of 50 took 1,176 ms at 4 (the cores 73 % busy), 990 ms at
/// 8 (92 %) and 1,097 ms at 12 (bench/results/2026-12-06-final.md).
pub const PARALLELISM: usize = 8;

/// Where the node is reached, once its mesh address (if any) is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAddresses {
    /// Where published host ports are bound.
    pub host_ip: std::net::Ipv4Addr,
    /// Where the node API listens.
    pub node_api: Vec<SocketAddr>,
}

impl Config {
    /// With the mesh, published ports go on the mesh IP where other nodes
    /// dial them (W-3), unless `host-ip` says otherwise; the node API
    /// listens on the mesh IP and loopback, never on every address
    /// (AGENT-1), unless `node-api-listen` says otherwise.
    pub fn node_addresses(
        &self,
        mesh_ip: Option<std::net::Ipv4Addr>,
    ) -> Result<NodeAddresses, ConfigError> {
        let host_ip = match (mesh_ip, self.host_ip) {
            (Some(ip), DEFAULT_HOST_IP) | (_, IpAddr::V4(ip)) => ip,
            (_, IpAddr::V6(ip)) => {
                return Err(ConfigError::Invalid {
                    key: "host-ip",
                    message: format!("{ip}: only IPv4 host addresses are supported"),
                });
            }
        };
        let node_api = match mesh_ip {
            Some(ip) if self.node_api_listen == DEFAULT_NODE_API_LISTEN => {
                let port = self.node_api_listen.port();
                vec![
                    SocketAddr::from((ip, port)),
                    SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port)),
                ]
            }
            _ => vec![self.node_api_listen],
        };
        Ok(NodeAddresses { host_ip, node_api })
    }
}

/// Image garbage collection, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageGcConfig {
    pub policy: crate::image_gc::GcPolicy,
    pub every: std::time::Duration,
}

/// systemd's own answer: `stopping` while the host shuts down or reboots,
/// `running` (or `degraded`) while a unit is merely restarted.
pub const DEFAULT_HOST_SHUTDOWN_CHECK: &str = "systemctl is-system-running";

/// The default network's subnet (X-26): next to the environment pool, and
/// outside every zattera range.
pub const DEFAULT_SUBNET: &str = "10.202.0.0/24";

/// A `/24` that no zattera range overlaps (10.90/16 mesh, 10.97/16 VIPs,
/// 10.201/16 environments).
fn parse_default_subnet(text: &str) -> Result<zattera_netns::Subnet, ConfigError> {
    let invalid = |message: String| ConfigError::Invalid {
        key: "default-subnet",
        message,
    };
    let subnet = zattera_netns::Subnet::any_24(text).map_err(|e| invalid(e.to_string()))?;
    let o = subnet.network().octets();
    if o[0] == 10 && [90, 97, 201].contains(&o[1]) {
        return Err(invalid(format!(
            "{text:?} lies in a zattera range (10.90/16, 10.97/16, 10.201/16)"
        )));
    }
    Ok(subnet)
}

/// A pull that has not finished by then is FAILED (and retried): a registry
/// that drips bytes must not hold an instance in PULLING for ever.
pub const DEFAULT_PULL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

fn parse_pool(text: &str) -> Option<(u8, u8)> {
    let (a, b) = text.split_once('-')?;
    let (a, b) = (a.trim().parse::<u8>().ok()?, b.trim().parse::<u8>().ok()?);
    (a <= b).then_some((a, b))
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config {}: {message}", path.display())]
    Parse { path: PathBuf, message: String },
    #[error("config key `{key}`: {message}")]
    Invalid { key: &'static str, message: String },
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Settings, ConfigError> {
        Settings::parse(text, Path::new("/etc/zattera/agent.toml"))
    }

    #[test]
    fn the_mesh_address_is_where_ports_and_the_node_api_go_unless_configured() {
        let resolved = |text: &str| parse(text).unwrap().resolve().unwrap();
        let mesh = Some(std::net::Ipv4Addr::new(10, 90, 0, 7));
        let port = DEFAULT_NODE_API_LISTEN.port();

        let a = resolved("").node_addresses(mesh).unwrap();
        assert_eq!(a.host_ip.to_string(), "10.90.0.7");
        assert_eq!(
            a.node_api,
            vec![
                SocketAddr::from(([10, 90, 0, 7], port)),
                SocketAddr::from(([127, 0, 0, 1], port)),
            ],
            "the mesh IP and loopback, never every address"
        );
        // Without the mesh: the defaults as they are.
        let a = resolved("").node_addresses(None).unwrap();
        assert_eq!(IpAddr::V4(a.host_ip), DEFAULT_HOST_IP);
        assert_eq!(a.node_api, vec![DEFAULT_NODE_API_LISTEN]);
        // What the operator set wins.
        let a = resolved("host-ip = \"192.0.2.7\"\nnode-api-listen = \"0.0.0.0:9555\"")
            .node_addresses(mesh)
            .unwrap();
        assert_eq!(a.host_ip.to_string(), "192.0.2.7");
        assert_eq!(a.node_api, vec![SocketAddr::from(([0, 0, 0, 0], 9555))]);
        let e = resolved("host-ip = \"::1\"")
            .node_addresses(None)
            .unwrap_err();
        assert!(e.to_string().contains("only IPv4"), "{e}");
    }

    #[test]
    fn the_default_subnet_stays_out_of_zattera_ranges() {
        let c = |text: &str| {
            parse(&format!("default-subnet = {text:?}"))
                .unwrap()
                .resolve()
                .map(|c| c.default_subnet.map(|s| s.to_string()))
        };
        assert_eq!(
            parse("")
                .unwrap()
                .resolve()
                .unwrap()
                .default_subnet
                .unwrap()
                .to_string(),
            DEFAULT_SUBNET
        );
        assert_eq!(
            c("172.30.9.0/24").unwrap().as_deref(),
            Some("172.30.9.0/24")
        );
        assert_eq!(c("none").unwrap(), None);
        for bad in ["10.201.3.0/24", "10.97.0.0/24", "10.202.0.0/16", "nope"] {
            let e = c(bad).unwrap_err().to_string();
            assert!(e.contains("default-subnet"), "{bad}: {e}");
        }
    }

    #[test]
    fn reads_every_key_in_flag_spelling() {
        let s = parse(
            r#"
            manifests = "/srv/manifests"
            control = "10.0.0.1:8443"
            containerd-address = "/run/c.sock"
            namespace = "edge"
            data-dir = "/d"
            run-dir = "/r"
            host-ip = "192.0.2.7"
            node-id = "n1"
            node-api-listen = "127.0.0.1:9444"
            host-port-range = "40000-40999"
            "#,
        )
        .unwrap();
        let c = s.resolve().unwrap();
        assert_eq!(c.manifests.as_deref(), Some(Path::new("/srv/manifests")));
        assert_eq!(c.control.as_deref(), Some("10.0.0.1:8443"));
        assert_eq!(c.containerd_address, Path::new("/run/c.sock"));
        assert_eq!(c.namespace.as_str(), "edge");
        assert_eq!(c.data_dir, Path::new("/d"));
        assert_eq!(c.run_dir, Path::new("/r"));
        assert_eq!(c.host_ip.to_string(), "192.0.2.7");
        assert_eq!(c.node_id.as_deref(), Some("n1"));
        assert_eq!(c.node_api_listen.to_string(), "127.0.0.1:9444");
        assert_eq!(c.host_port_range.to_string(), "40000-40999");
        assert!(
            parse("host-port-range = \"9-1\"")
                .unwrap()
                .resolve()
                .unwrap_err()
                .to_string()
                .contains("host-port-range")
        );
        assert_eq!(
            Settings::default().resolve().unwrap().node_api_listen,
            DEFAULT_NODE_API_LISTEN
        );
        assert!(parse("node-api-listen = \"8444\"").is_err());
    }

    #[test]
    fn subnet_pool_parses_and_rejects() {
        let s = parse("subnet-pool = \"200-209\"").unwrap();
        assert_eq!(s.resolve().unwrap().subnet_pool, (200, 209));
        assert_eq!(Settings::default().resolve().unwrap().subnet_pool, (0, 255));
        for bad in ["9-1", "x", "1-300"] {
            let s = Settings {
                subnet_pool: Some(bad.into()),
                ..Settings::default()
            };
            assert!(
                s.resolve().unwrap_err().to_string().contains("subnet-pool"),
                "{bad}"
            );
        }
    }

    #[test]
    fn snake_case_spelling_is_accepted() {
        let s = parse("data_dir = \"/x\"\nrun_dir = \"/y\"").unwrap();
        assert_eq!(s.data_dir.as_deref(), Some(Path::new("/x")));
        assert_eq!(s.run_dir.as_deref(), Some(Path::new("/y")));
    }

    #[test]
    fn defaults_match_the_design() {
        let c = Settings::default().resolve().unwrap();
        assert_eq!(c.containerd_address, Path::new(DEFAULT_CONTAINERD_ADDRESS));
        assert_eq!(c.namespace.as_str(), "zattera");
        assert_eq!(c.data_dir, Path::new("/var/lib/zattera"));
        assert_eq!(c.run_dir, Path::new("/run/zattera"));
        assert_eq!(c.host_ip, DEFAULT_HOST_IP);
        assert!(c.control.is_none() && c.manifests.is_none() && c.node_id.is_none());
    }

    #[test]
    fn unknown_key_names_key_and_file() {
        let err = parse("namespace = \"a\"\ndata-dri = \"/x\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("/etc/zattera/agent.toml"), "{err}");
        assert!(err.contains("data-dri"), "{err}");
    }

    #[test]
    fn wrong_type_names_the_key() {
        let err = parse("host-ip = \"not-an-ip\"").unwrap_err().to_string();
        assert!(err.contains("host-ip"), "{err}");
    }

    #[test]
    fn flags_win_over_file() {
        let file = parse("namespace = \"file\"\ndata-dir = \"/file\"").unwrap();
        let flags = Settings {
            namespace: Some("flag".into()),
            ..Settings::default()
        };
        let c = file.overlay(flags).resolve().unwrap();
        assert_eq!(c.namespace.as_str(), "flag");
        assert_eq!(c.data_dir, Path::new("/file"));
    }

    #[test]
    fn bad_namespace_is_rejected_with_the_key() {
        let s = Settings {
            namespace: Some("bad ns".into()),
            ..Settings::default()
        };
        let err = s.resolve().unwrap_err().to_string();
        assert!(err.contains("namespace"), "{err}");
    }

    #[test]
    fn explicit_missing_file_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.toml");
        let err = Settings::load(Some(&missing)).unwrap_err().to_string();
        assert!(err.contains("nope.toml"), "{err}");
    }
}
