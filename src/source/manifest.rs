//! One standalone manifest file (DESIGN.md "Standalone manifests"): strict
//! TOML in, a validated [`AppManifest`] out.
//!
//! Parsing has two layers. serde (with `deny_unknown_fields` everywhere and
//! validating newtypes for names, ports, durations and commands) rejects
//! unknown keys, wrong types and bad values; `toml` reports where, as a byte
//! span, which `super::keypath` turns into the dotted key path. Checks that
//! span several keys (duplicate port names, host ports, volume paths,
//! health-check keys that do not fit its type) run afterwards on the typed
//! value, where the key path is known. Either way the error names the file
//! and the key: `web.toml: env.production.ports[0]: missing key container_port`.
//!
//! Defaults are filled in here, so the rest of the agent sees explicit values:
//! project `default`, replicas 1, stop grace 10 s (runtime.md C-14), health
//! check interval 10 s, timeout 5 s, grace 60 s, threshold 3, HTTP path
//! `/healthz` (H-3, H-6). An omitted port protocol is `http`, which is what
//! the wire's `PROTOCOL_UNSPECIFIED` means (wire.md, Protocol) and is
//! published as TCP (C-7). An omitted health-check type stays `None` here and
//! is resolved per environment (H-4: HTTP when the environment has a port,
//! TCP otherwise).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde::de::Error as _;

use super::keypath::{key_path_at, line_column, render_key};
use super::name::Name;
use crate::runtime::ImageRef;

/// Project of a manifest that names none.
pub const DEFAULT_PROJECT: &str = "default";
/// Replicas of an environment that says nothing (DESIGN.md).
pub const DEFAULT_REPLICAS: u32 = 1;
/// Most replicas one environment may ask for: the host addresses of its /24.
pub const MAX_REPLICAS: u32 = 253;
/// Stop grace when none is given (runtime.md C-14).
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);
/// Health-check defaults (runtime.md H-3, H-6).
pub const DEFAULT_HEALTH_INTERVAL: Duration = Duration::from_secs(10);
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(5);
pub const DEFAULT_HEALTH_GRACE: Duration = Duration::from_secs(60);
pub const DEFAULT_UNHEALTHY_THRESHOLD: u32 = 3;
pub const DEFAULT_HEALTH_PATH: &str = "/healthz";
/// Longest duration any manifest key accepts.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// One app, as a manifest file declares it, with every default filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AppManifest {
    pub project: Name,
    pub app: Name,
    /// The image reference as written (validated, not normalised).
    pub image: String,
    pub healthcheck: Option<HealthCheckSpec>,
    /// At least one environment.
    pub envs: BTreeMap<Name, EnvSpec>,
}

/// One `[env.<name>]` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvSpec {
    pub replicas: u32,
    /// Shell form (run as `/bin/sh -c`), trimmed; `None` keeps the image's.
    pub command: Option<String>,
    pub stop_grace: Duration,
    pub resources: Resources,
    /// Unique names; fixed host ports unique across the manifest.
    pub ports: Vec<PortDecl>,
    pub variables: BTreeMap<String, String>,
    /// Unique names and mount paths.
    pub volumes: Vec<VolumeDecl>,
    /// The image's filesystem read-only (only volumes are written).
    pub read_only_rootfs: bool,
}

/// Limits; 0 means unlimited (runtime.md C-6), or for `pids` the node's
/// default (`pids-limit`), which a manifest can lower but not raise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resources {
    pub cpu_millis: u32,
    pub memory_mb: u32,
    pub pids: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortDecl {
    pub name: Name,
    pub container_port: u16,
    pub protocol: PortProtocol,
    /// A fixed host port to publish on; `None` lets the executor pick one.
    pub host_port: Option<u16>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PortProtocol {
    Http,
    Tcp,
    Udp,
}

impl PortProtocol {
    /// The transport the port is published on (runtime.md C-7).
    pub fn transport(self) -> &'static str {
        match self {
            Self::Udp => "udp",
            Self::Http | Self::Tcp => "tcp",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeDecl {
    pub name: Name,
    pub mount_path: String,
}

/// `[deploy.healthcheck]`, defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheckSpec {
    /// `None`: HTTP if the environment has a port, TCP otherwise (H-4).
    pub kind: Option<HealthKind>,
    /// Starts with `/`; used by HTTP checks.
    pub path: String,
    /// `None`: the first container port (H-5).
    pub port: Option<u16>,
    /// Exec checks only, where it is required.
    pub command: Option<String>,
    pub interval: Duration,
    pub timeout: Duration,
    pub grace_period: Duration,
    pub unhealthy_threshold: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HealthKind {
    Http,
    Tcp,
    Exec,
}

/// Where in the file an error is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// The file as a whole (for example a missing top-level table).
    Document,
    /// A dotted key path such as `env.production.ports[0]`.
    Key(String),
    /// A TOML syntax error, where no key path exists yet.
    Position { line: usize, column: usize },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Document => Ok(()),
            Self::Key(k) => write!(f, "{k}: "),
            Self::Position { line, column } => write!(f, "line {line}, column {column}: "),
        }
    }
}

/// A manifest that cannot be used; the message names the file and the key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {location}{message}", file.display())]
pub struct ManifestError {
    pub file: PathBuf,
    pub location: Location,
    pub message: String,
}

impl ManifestError {
    fn at(file: &Path, key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            file: file.to_owned(),
            location: Location::Key(key.into()),
            message: message.into(),
        }
    }
}

/// Parses and validates one manifest. `file` is only used in messages.
pub fn parse(text: &str, file: &Path) -> Result<AppManifest, ManifestError> {
    let raw: RawManifest = toml::from_str(text).map_err(|e| toml_error(text, file, &e))?;
    validate(raw, file)
}

fn toml_error(text: &str, file: &Path, e: &toml::de::Error) -> ManifestError {
    let message = polish(e.message());
    let location = match e.span() {
        None => Location::Document,
        Some(span) if toml::de::DeTable::parse(text).is_err() => {
            let (line, column) = line_column(text, span.start);
            Location::Position { line, column }
        }
        Some(span) => key_path_at(text, &span).map_or(Location::Document, Location::Key),
    };
    ManifestError {
        file: file.to_owned(),
        location,
        message,
    }
}

/// serde speaks of fields and Rust integer types; users wrote keys and numbers.
fn polish(message: &str) -> String {
    if let Some(key) = message
        .strip_prefix("missing field `")
        .and_then(|r| r.strip_suffix('`'))
    {
        return format!("missing key {key}");
    }
    if let Some(rest) = message.strip_prefix("unknown field ") {
        return format!("unknown key {rest}");
    }
    message
        .replace(
            "expected u32",
            "expected a whole number from 0 to 4294967295",
        )
        .replace("expected i64", "expected an integer")
}

// ---- serde layer -----------------------------------------------------------

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    app: RawApp,
    build: RawBuild,
    #[serde(default)]
    deploy: RawDeploy,
    #[serde(default)]
    env: BTreeMap<Name, RawEnv>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawApp {
    name: Name,
    project: Option<Name>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBuild {
    #[serde(rename = "type")]
    #[allow(dead_code)] // its only value is checked while deserializing
    kind: ImageBuild,
    image: ImageText,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDeploy {
    healthcheck: Option<RawHealth>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHealth {
    #[serde(rename = "type")]
    kind: Option<HealthKind>,
    path: Option<HealthPath>,
    port: Option<PortNumber>,
    command: Option<ShellCommand>,
    interval: Option<HumanDuration>,
    timeout: Option<HumanDuration>,
    grace_period: Option<HumanDuration>,
    unhealthy_threshold: Option<Threshold>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEnv {
    replicas: Option<Replicas>,
    command: Option<ShellCommand>,
    stop_grace: Option<HumanDuration>,
    #[serde(default)]
    resources: RawResources,
    #[serde(default)]
    ports: Vec<RawPort>,
    #[serde(default)]
    variables: BTreeMap<VarName, String>,
    #[serde(default)]
    volumes: Vec<RawVolume>,
    #[serde(default)]
    read_only_rootfs: bool,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawResources {
    #[serde(default)]
    cpu_millis: u32,
    #[serde(default)]
    memory_mb: u32,
    #[serde(default)]
    pids: u32,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPort {
    name: Name,
    container_port: PortNumber,
    protocol: Option<PortProtocol>,
    host_port: Option<PortNumber>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawVolume {
    name: Name,
    mount_path: MountPath,
}

/// Implements `Deserialize` for a newtype by reading `$inner` and checking it.
macro_rules! checked {
    ($ty:ident($out:ty) from $inner:ty, $check:expr) => {
        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let check: fn($inner) -> Result<$out, String> = $check;
                check(<$inner>::deserialize(d)?)
                    .map($ty)
                    .map_err(D::Error::custom)
            }
        }
    };
}

/// `build.type`: only prebuilt images run standalone.
struct ImageBuild;

impl<'de> Deserialize<'de> for ImageBuild {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let kind = String::deserialize(d)?;
        if kind == "image" {
            Ok(Self)
        } else {
            Err(D::Error::custom(format!(
                "unsupported build type {kind:?}: standalone manifests run prebuilt images, \
                 use type = \"image\""
            )))
        }
    }
}

struct ImageText(String);
checked!(ImageText(String) from String, |s| {
    s.parse::<ImageRef>().map_err(|e| e.to_string())?;
    Ok(s)
});

struct PortNumber(u16);
checked!(PortNumber(u16) from i64, |n| {
    u16::try_from(n)
        .ok()
        .filter(|&p| p != 0)
        .ok_or_else(|| format!("expected a port number from 1 to 65535, got {n}"))
});

struct Replicas(u32);
checked!(Replicas(u32) from i64, |n| {
    u32::try_from(n)
        .ok()
        .filter(|&r| r <= MAX_REPLICAS)
        .ok_or_else(|| {
            format!(
                "expected 0 to {MAX_REPLICAS} replicas (the addresses of one environment \
                 subnet), got {n}"
            )
        })
});

struct Threshold(u32);
checked!(Threshold(u32) from i64, |n| {
    u32::try_from(n)
        .ok()
        .filter(|&t| (1..=1000).contains(&t))
        .ok_or_else(|| format!("expected a number of failures from 1 to 1000, got {n}"))
});

struct HumanDuration(Duration);
checked!(HumanDuration(Duration) from String, |s| {
    let d = humantime::parse_duration(&s)
        .map_err(|e| format!("invalid duration {s:?} ({e}); write it like \"5s\" or \"1m30s\""))?;
    if d.is_zero() {
        return Err(format!("duration {s:?} must be greater than zero"));
    }
    if d > MAX_DURATION {
        return Err(format!("duration {s:?} is longer than 24h"));
    }
    Ok(d)
});

struct ShellCommand(String);
checked!(ShellCommand(String) from String, |s| {
    let trimmed = s.trim();
    if trimmed.is_empty() {
        return Err("empty command (omit the key to keep the image's own)".to_owned());
    }
    if trimmed.contains('\0') {
        return Err("command contains a NUL character".to_owned());
    }
    Ok(trimmed.to_owned())
});

struct HealthPath(String);
checked!(HealthPath(String) from String, |s| {
    if s.is_empty() || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("invalid HTTP path {s:?}: it must be non-empty, without spaces"));
    }
    Ok(if s.starts_with('/') { s } else { format!("/{s}") })
});

#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct VarName(String);
checked!(VarName(String) from String, |s| {
    if s.is_empty() || s.contains(['=', '\0']) {
        return Err(format!(
            "invalid variable name {s:?}: it must be non-empty, without '=' or NUL"
        ));
    }
    Ok(s)
});

struct MountPath(String);
checked!(MountPath(String) from String, |s| {
    let ok = s.starts_with('/')
        && s != "/"
        && !s.contains('\0')
        && !s.split('/').any(|part| part == "..");
    if ok {
        Ok(s)
    } else {
        Err(format!(
            "invalid mount path {s:?}: it must be absolute, not \"/\", without \"..\""
        ))
    }
});

// ---- checks across keys ----------------------------------------------------

fn validate(raw: RawManifest, file: &Path) -> Result<AppManifest, ManifestError> {
    let project = match raw.app.project {
        Some(p) => p,
        None => Name::new(DEFAULT_PROJECT)
            .map_err(|e| ManifestError::at(file, "app.project", e.to_string()))?,
    };
    if raw.env.is_empty() {
        return Err(ManifestError {
            file: file.to_owned(),
            location: Location::Document,
            message: "no [env.<name>] section: declare at least one environment".to_owned(),
        });
    }
    let healthcheck = raw
        .deploy
        .healthcheck
        .map(|h| health(h, file))
        .transpose()?;

    let mut host_ports: BTreeMap<(&'static str, u16), String> = BTreeMap::new();
    let mut envs = BTreeMap::new();
    for (env_name, env) in raw.env {
        let at = format!("env.{}", render_key(env_name.as_str()));
        let ports = ports(env.ports, &at, &mut host_ports, file)?;
        let volumes = volumes(env.volumes, &at, file)?;
        let mut variables = BTreeMap::new();
        for (VarName(k), v) in env.variables {
            if v.contains('\0') {
                return Err(ManifestError::at(
                    file,
                    format!("{at}.variables.{}", render_key(&k)),
                    "value contains a NUL character",
                ));
            }
            variables.insert(k, v);
        }
        let spec = EnvSpec {
            replicas: env.replicas.map_or(DEFAULT_REPLICAS, |r| r.0),
            command: env.command.map(|c| c.0),
            stop_grace: env.stop_grace.map_or(DEFAULT_STOP_GRACE, |d| d.0),
            resources: Resources {
                cpu_millis: env.resources.cpu_millis,
                memory_mb: env.resources.memory_mb,
                pids: env.resources.pids,
            },
            ports,
            variables,
            volumes,
            read_only_rootfs: env.read_only_rootfs,
        };
        envs.insert(env_name, spec);
    }
    Ok(AppManifest {
        project,
        app: raw.app.name,
        image: raw.build.image.0,
        healthcheck,
        envs,
    })
}

fn ports(
    raw: Vec<RawPort>,
    at: &str,
    host_ports: &mut BTreeMap<(&'static str, u16), String>,
    file: &Path,
) -> Result<Vec<PortDecl>, ManifestError> {
    let mut names: BTreeMap<Name, usize> = BTreeMap::new();
    let mut out = Vec::with_capacity(raw.len());
    for (i, p) in raw.into_iter().enumerate() {
        let here = format!("{at}.ports[{i}]");
        if let Some(first) = names.insert(p.name.clone(), i) {
            return Err(ManifestError::at(
                file,
                format!("{here}.name"),
                format!(
                    "duplicate port name {:?} (already used by {at}.ports[{first}])",
                    p.name.as_str()
                ),
            ));
        }
        let protocol = p.protocol.unwrap_or(PortProtocol::Http);
        let host_port = p.host_port.map(|h| h.0);
        if let Some(h) = host_port {
            let key = format!("{here}.host_port");
            if let Some(other) = host_ports.insert((protocol.transport(), h), key.clone()) {
                return Err(ManifestError::at(
                    file,
                    key,
                    format!(
                        "host port {h}/{} is already requested by {other}",
                        protocol.transport()
                    ),
                ));
            }
        }
        out.push(PortDecl {
            name: p.name,
            container_port: p.container_port.0,
            protocol,
            host_port,
        });
    }
    Ok(out)
}

fn volumes(raw: Vec<RawVolume>, at: &str, file: &Path) -> Result<Vec<VolumeDecl>, ManifestError> {
    let mut names = BTreeMap::new();
    let mut paths = BTreeMap::new();
    let mut out = Vec::with_capacity(raw.len());
    for (i, v) in raw.into_iter().enumerate() {
        let here = format!("{at}.volumes[{i}]");
        if let Some(first) = names.insert(v.name.clone(), i) {
            return Err(ManifestError::at(
                file,
                format!("{here}.name"),
                format!(
                    "duplicate volume {:?} (already mounted by {at}.volumes[{first}])",
                    v.name.as_str()
                ),
            ));
        }
        let normal = v.mount_path.0.trim_end_matches('/').to_owned();
        if let Some(first) = paths.insert(normal, i) {
            return Err(ManifestError::at(
                file,
                format!("{here}.mount_path"),
                format!(
                    "mount path {:?} is already used by {at}.volumes[{first}]",
                    v.mount_path.0
                ),
            ));
        }
        out.push(VolumeDecl {
            name: v.name,
            mount_path: v.mount_path.0,
        });
    }
    Ok(out)
}

fn health(h: RawHealth, file: &Path) -> Result<HealthCheckSpec, ManifestError> {
    const AT: &str = "deploy.healthcheck";
    let exec = h.kind == Some(HealthKind::Exec);
    if exec && h.command.is_none() {
        return Err(ManifestError::at(
            file,
            AT,
            "missing key command (required by type = \"exec\")",
        ));
    }
    if !exec && h.command.is_some() {
        return Err(ManifestError::at(
            file,
            format!("{AT}.command"),
            "only exec checks run a command; set type = \"exec\" or remove it",
        ));
    }
    if matches!(h.kind, Some(HealthKind::Tcp | HealthKind::Exec)) && h.path.is_some() {
        return Err(ManifestError::at(
            file,
            format!("{AT}.path"),
            "only HTTP checks have a path",
        ));
    }
    if exec && h.port.is_some() {
        return Err(ManifestError::at(
            file,
            format!("{AT}.port"),
            "exec checks do not use a port",
        ));
    }
    Ok(HealthCheckSpec {
        kind: h.kind,
        path: h
            .path
            .map_or_else(|| DEFAULT_HEALTH_PATH.to_owned(), |p| p.0),
        port: h.port.map(|p| p.0),
        command: h.command.map(|c| c.0),
        interval: h.interval.map_or(DEFAULT_HEALTH_INTERVAL, |d| d.0),
        timeout: h.timeout.map_or(DEFAULT_HEALTH_TIMEOUT, |d| d.0),
        grace_period: h.grace_period.map_or(DEFAULT_HEALTH_GRACE, |d| d.0),
        unhealthy_threshold: h
            .unhealthy_threshold
            .map_or(DEFAULT_UNHEALTHY_THRESHOLD, |t| t.0),
    })
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    /// The example of DESIGN.md, verbatim.
    const DESIGN_EXAMPLE: &str = r#"
[app]
name = "web"            # DNS-safe, required
project = "demo"        # DNS-safe, default "default"

[build]
type = "image"
image = "docker.io/library/nginx:alpine"

[deploy.healthcheck]    # optional; same keys and defaults as the reference
type = "http"
path = "/"
interval = "5s"

[env.production]        # one section per environment
replicas = 2
command = "nginx -g 'daemon off;'"   # optional, shell form
stop_grace = "10s"
[env.production.resources]
cpu_millis = 500
memory_mb = 256
[[env.production.ports]]
name = "http"
container_port = 80
protocol = "http"
host_port = 8080        # optional; omitted = an ephemeral port, shown by status
[env.production.variables]
GREETING = "hello"
[[env.production.volumes]]
name = "data"
mount_path = "/data"
"#;

    const MINIMAL: &str = r#"
[app]
name = "web"
[build]
type = "image"
image = "busybox"
[env.production]
"#;

    fn parse_ok(text: &str) -> AppManifest {
        parse(text, Path::new("web.toml")).unwrap_or_else(|e| panic!("{e}"))
    }

    fn parse_err(text: &str) -> String {
        match parse(text, Path::new("web.toml")) {
            Ok(m) => panic!("accepted: {m:?}\n{text}"),
            Err(e) => e.to_string(),
        }
    }

    fn name(s: &str) -> Name {
        Name::new(s).unwrap()
    }

    #[test]
    fn design_example_parses_with_every_value() {
        let m = parse_ok(DESIGN_EXAMPLE);
        assert_eq!(m.project.as_str(), "demo");
        assert_eq!(m.app.as_str(), "web");
        assert_eq!(m.image, "docker.io/library/nginx:alpine");
        let h = m.healthcheck.unwrap();
        assert_eq!(h.kind, Some(HealthKind::Http));
        assert_eq!(h.path, "/");
        assert_eq!(h.interval, Duration::from_secs(5));
        assert_eq!(h.timeout, DEFAULT_HEALTH_TIMEOUT);
        assert_eq!(h.grace_period, Duration::from_secs(60));
        assert_eq!(h.unhealthy_threshold, 3);
        let env = &m.envs[&name("production")];
        assert_eq!(env.replicas, 2);
        assert_eq!(env.command.as_deref(), Some("nginx -g 'daemon off;'"));
        assert_eq!(env.stop_grace, Duration::from_secs(10));
        assert_eq!(
            env.resources,
            Resources {
                cpu_millis: 500,
                memory_mb: 256,
                pids: 0
            }
        );
        assert_eq!(
            env.ports,
            vec![PortDecl {
                name: name("http"),
                container_port: 80,
                protocol: PortProtocol::Http,
                host_port: Some(8080),
            }]
        );
        assert_eq!(env.variables["GREETING"], "hello");
        assert_eq!(
            env.volumes,
            vec![VolumeDecl {
                name: name("data"),
                mount_path: "/data".into()
            }]
        );
    }

    #[test]
    fn defaults_fill_what_is_omitted() {
        let m = parse_ok(&format!(
            "{MINIMAL}[[env.production.ports]]\nname = \"p\"\ncontainer_port = 53\n\
             [deploy.healthcheck]\nport = 53\n"
        ));
        assert_eq!(m.project.as_str(), "default");
        let env = &m.envs[&name("production")];
        assert_eq!(env.replicas, 1);
        assert_eq!(env.command, None);
        assert_eq!(env.stop_grace, Duration::from_secs(10));
        assert_eq!(env.resources, Resources::default());
        assert_eq!(env.ports[0].protocol, PortProtocol::Http);
        assert_eq!(env.ports[0].host_port, None);
        let h = m.healthcheck.unwrap();
        assert_eq!(h.kind, None);
        assert_eq!(h.path, "/healthz");
        assert_eq!(h.port, Some(53));
        assert_eq!(
            (h.interval, h.timeout, h.grace_period, h.unhealthy_threshold),
            (
                Duration::from_secs(10),
                Duration::from_secs(5),
                Duration::from_secs(60),
                3
            )
        );
        assert!(parse_ok(MINIMAL).healthcheck.is_none());
    }

    /// The example of a new ServiceSpec field (issue 55): the manifest key,
    /// carried into the spec the executor composes.
    #[test]
    fn read_only_rootfs_reaches_the_service_spec() {
        let m = parse_ok(&format!("{MINIMAL}read_only_rootfs = true\n"));
        let env = &m.envs[&name("production")];
        assert!(env.read_only_rootfs);
        assert!(crate::source::assign::service_spec(env, &m).read_only_rootfs);
        let plain = parse_ok(MINIMAL);
        assert!(!plain.envs[&name("production")].read_only_rootfs);
    }

    #[test]
    fn values_are_normalised() {
        let m = parse_ok(&format!(
            "{MINIMAL}command = \"  sleep 1  \"\nstop_grace = \"1m30s\"\n\
             [deploy.healthcheck]\npath = \"ready\"\n"
        ));
        let env = &m.envs[&name("production")];
        assert_eq!(env.command.as_deref(), Some("sleep 1"));
        assert_eq!(env.stop_grace, Duration::from_secs(90));
        assert_eq!(m.healthcheck.unwrap().path, "/ready");
    }

    #[test]
    fn port_without_container_port_names_file_and_key() {
        let text = format!("{MINIMAL}[[env.production.ports]]\nname = \"http\"\n");
        assert_eq!(
            parse_err(&text),
            "web.toml: env.production.ports[0]: missing key container_port"
        );
        // The second element of an array of tables is named by its index.
        let text = format!(
            "{MINIMAL}[[env.production.ports]]\nname = \"a\"\ncontainer_port = 1\n\
             [[env.production.ports]]\nname = \"b\"\n"
        );
        assert_eq!(
            parse_err(&text),
            "web.toml: env.production.ports[1]: missing key container_port"
        );
        let inline = format!("{MINIMAL}ports = [{{ name = \"a\" }}]\n");
        assert_eq!(
            parse_err(&inline),
            "web.toml: env.production.ports[0]: missing key container_port"
        );
    }

    #[test]
    fn unknown_keys_are_named_at_every_level() {
        let cases = [
            (
                format!("nope = 1\n{MINIMAL}"),
                "web.toml: nope: unknown key `nope`",
            ),
            (
                MINIMAL.replace("name = \"web\"", "name = \"web\"\nnmae = 1"),
                "web.toml: app.nmae: unknown key `nmae`, expected `name` or `project`",
            ),
            (
                MINIMAL.replace("type = \"image\"", "type = \"image\"\ndockerfile = \"x\""),
                "web.toml: build.dockerfile: unknown key",
            ),
            (
                format!("{MINIMAL}[deploy]\nstrategy = 1\n"),
                "web.toml: deploy.strategy: unknown key",
            ),
            (
                format!("{MINIMAL}[deploy.healthcheck]\nretries = 3\n"),
                "web.toml: deploy.healthcheck.retries: unknown key",
            ),
            (
                format!("{MINIMAL}replica = 2\n"),
                "web.toml: env.production.replica: unknown key",
            ),
            (
                format!("{MINIMAL}[env.production.resources]\ncpu = 1\n"),
                "web.toml: env.production.resources.cpu: unknown key",
            ),
            (
                format!(
                    "{MINIMAL}[[env.production.ports]]\nname = \"a\"\ncontainer_port = 1\nhostport = 2\n"
                ),
                "web.toml: env.production.ports[0].hostport: unknown key",
            ),
            (
                format!(
                    "{MINIMAL}[[env.production.volumes]]\nname = \"a\"\nmount_path = \"/a\"\nro = true\n"
                ),
                "web.toml: env.production.volumes[0].ro: unknown key",
            ),
        ];
        for (text, want) in cases {
            let got = parse_err(&text);
            assert!(got.starts_with(want), "want {want:?}\n got {got:?}");
        }
    }

    #[test]
    fn each_bad_value_names_its_key() {
        let m = MINIMAL;
        let port = |extra: &str| {
            format!("{m}[[env.production.ports]]\nname = \"http\"\ncontainer_port = 80\n{extra}")
        };
        let cases: Vec<(String, &str, &str)> = vec![
            // wrong types
            (
                format!("{m}replicas = \"2\"\n"),
                "env.production.replicas",
                "invalid type: string",
            ),
            (
                format!("{m}[env.production.variables]\nA = 1\n"),
                "env.production.variables.A",
                "invalid type: integer",
            ),
            (
                format!("{m}[env.production.resources]\nmemory_mb = -5\n"),
                "env.production.resources.memory_mb",
                "expected a whole number",
            ),
            (
                format!("{m}stop_grace = 10\n"),
                "env.production.stop_grace",
                "invalid type: integer",
            ),
            (
                format!("{m}ports = \"http\"\n"),
                "env.production.ports",
                "invalid type",
            ),
            // durations
            (
                format!("{m}stop_grace = \"5x\"\n"),
                "env.production.stop_grace",
                "invalid duration \"5x\"",
            ),
            (
                format!("{m}stop_grace = \"0s\"\n"),
                "env.production.stop_grace",
                "greater than zero",
            ),
            (
                format!("{m}[deploy.healthcheck]\ninterval = \"soon\"\n"),
                "deploy.healthcheck.interval",
                "invalid duration",
            ),
            (
                format!("{m}[deploy.healthcheck]\ntimeout = \"2d\"\n"),
                "deploy.healthcheck.timeout",
                "longer than 24h",
            ),
            // names
            (
                MINIMAL.replace("name = \"web\"", "name = \"Web\""),
                "app.name",
                "invalid name \"Web\"",
            ),
            (
                MINIMAL.replace("name = \"web\"", "name = \"web\"\nproject = \"my_project\""),
                "app.project",
                "invalid name",
            ),
            (
                MINIMAL.replace("[env.production]", "[env.Prod]"),
                "env.Prod",
                "invalid name \"Prod\"",
            ),
            (
                MINIMAL.replace("name = \"web\"", "name = \"a--b\""),
                "app.name",
                "\"--\"",
            ),
            (
                port("").replace("name = \"http\"", "name = \"-http\""),
                "env.production.ports[0].name",
                "invalid name",
            ),
            (
                format!("{m}[[env.production.volumes]]\nname = \"my_data\"\nmount_path = \"/d\"\n"),
                "env.production.volumes[0].name",
                "invalid name",
            ),
            (
                format!("{m}[env.production.variables]\n\"A=B\" = \"x\"\n"),
                "env.production.variables.\"A=B\"",
                "invalid variable name",
            ),
            // ports
            (
                port("[[env.production.ports]]\nname = \"http\"\ncontainer_port = 81\n"),
                "env.production.ports[1].name",
                "duplicate port name \"http\" (already used by env.production.ports[0])",
            ),
            (
                port("").replace("container_port = 80", "container_port = 0"),
                "env.production.ports[0].container_port",
                "port number from 1 to 65535, got 0",
            ),
            (
                port("").replace("container_port = 80", "container_port = 70000"),
                "env.production.ports[0].container_port",
                "got 70000",
            ),
            (
                port("host_port = -1\n"),
                "env.production.ports[0].host_port",
                "port number",
            ),
            (
                port("protocol = \"sctp\"\n"),
                "env.production.ports[0].protocol",
                "unknown variant `sctp`, expected one of `http`, `tcp`, `udp`",
            ),
            (
                port(
                    "host_port = 8080\n[env.staging]\n[[env.staging.ports]]\nname = \"http\"\ncontainer_port = 80\nhost_port = 8080\n",
                ),
                "env.staging.ports[0].host_port",
                "host port 8080/tcp is already requested by env.production.ports[0].host_port",
            ),
            // build
            (
                MINIMAL.replace("type = \"image\"", "type = \"dockerfile\""),
                "build.type",
                "unsupported build type \"dockerfile\"",
            ),
            (
                MINIMAL.replace("image = \"busybox\"", "image = \"Not An Image\""),
                "build.image",
                "invalid image reference",
            ),
            (
                MINIMAL.replace("image = \"busybox\"\n", ""),
                "build",
                "missing key image",
            ),
            // replicas, commands, volumes
            (
                format!("{m}replicas = 300\n"),
                "env.production.replicas",
                "0 to 253 replicas",
            ),
            (
                format!("{m}replicas = -1\n"),
                "env.production.replicas",
                "got -1",
            ),
            (
                format!("{m}command = \"   \"\n"),
                "env.production.command",
                "empty command",
            ),
            (
                format!("{m}[[env.production.volumes]]\nname = \"d\"\nmount_path = \"data\"\n"),
                "env.production.volumes[0].mount_path",
                "must be absolute",
            ),
            (
                format!(
                    "{m}[[env.production.volumes]]\nname = \"d\"\nmount_path = \"/a/../etc\"\n"
                ),
                "env.production.volumes[0].mount_path",
                "\"..\"",
            ),
            (
                format!(
                    "{m}[[env.production.volumes]]\nname = \"d\"\nmount_path = \"/d\"\n[[env.production.volumes]]\nname = \"d\"\nmount_path = \"/e\"\n"
                ),
                "env.production.volumes[1].name",
                "duplicate volume \"d\"",
            ),
            (
                format!(
                    "{m}[[env.production.volumes]]\nname = \"d\"\nmount_path = \"/d\"\n[[env.production.volumes]]\nname = \"e\"\nmount_path = \"/d/\"\n"
                ),
                "env.production.volumes[1].mount_path",
                "already used by env.production.volumes[0]",
            ),
            // health check
            (
                format!("{m}[deploy.healthcheck]\ntype = \"exec\"\n"),
                "deploy.healthcheck",
                "missing key command",
            ),
            (
                format!("{m}[deploy.healthcheck]\ncommand = \"true\"\n"),
                "deploy.healthcheck.command",
                "only exec checks",
            ),
            (
                format!("{m}[deploy.healthcheck]\ntype = \"tcp\"\npath = \"/x\"\n"),
                "deploy.healthcheck.path",
                "only HTTP checks",
            ),
            (
                format!(
                    "{m}[deploy.healthcheck]\ntype = \"exec\"\ncommand = \"true\"\nport = 80\n"
                ),
                "deploy.healthcheck.port",
                "do not use a port",
            ),
            (
                format!("{m}[deploy.healthcheck]\ntype = \"grpc\"\n"),
                "deploy.healthcheck.type",
                "unknown variant `grpc`",
            ),
            (
                format!("{m}[deploy.healthcheck]\nunhealthy_threshold = 0\n"),
                "deploy.healthcheck.unhealthy_threshold",
                "from 1 to 1000, got 0",
            ),
        ];
        for (text, key, what) in cases {
            let got = parse_err(&text);
            let prefix = format!("web.toml: {key}: ");
            assert!(
                got.starts_with(&prefix) && got.contains(what),
                "want {prefix:?} + {what:?}\n got {got:?}\n{text}"
            );
        }
    }

    #[test]
    fn whole_document_errors() {
        assert_eq!(
            parse_err("[build]\ntype = \"image\"\nimage = \"busybox\"\n[env.production]\n"),
            "web.toml: missing key app"
        );
        assert_eq!(
            parse_err("[app]\nname = \"web\"\n[build]\ntype = \"image\"\nimage = \"busybox\"\n"),
            "web.toml: no [env.<name>] section: declare at least one environment"
        );
        let syntax = parse_err("[app]\nname = \"web\"\n[env.production\n");
        assert!(syntax.starts_with("web.toml: line 3, column "), "{syntax}");
        let dup = parse_err(&format!("{MINIMAL}replicas = 1\nreplicas = 2\n"));
        assert!(dup.starts_with("web.toml: line 9, column 1: "), "{dup}");
    }

    #[test]
    fn host_ports_of_different_transports_do_not_clash() {
        let m = parse_ok(&format!(
            "{MINIMAL}[[env.production.ports]]\nname = \"dns\"\ncontainer_port = 53\nprotocol = \"udp\"\nhost_port = 5353\n\
             [[env.production.ports]]\nname = \"dnstcp\"\ncontainer_port = 53\nprotocol = \"tcp\"\nhost_port = 5353\n"
        ));
        let ports = &m.envs[&name("production")].ports;
        assert_eq!(ports[0].protocol.transport(), "udp");
        assert_eq!(ports[1].protocol.transport(), "tcp");
    }
}
