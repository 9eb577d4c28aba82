//! The OCI runtime spec of a container (runtime.md C-3 to C-6, C-11, C-15).
//!
//! containerd adds no defaults server-side (the Go client's defaults are
//! client code), so the spec written here is complete: Docker's default
//! capabilities, masked and read-only paths, a deny-all device cgroup
//! (runc adds its standard devices), and limits from the assignment. Beyond
//! Docker's defaults: `no_new_privileges`, a cgroup namespace on every host,
//! a pids limit, and the seccomp allow-list of [`super::seccomp`].

use std::path::PathBuf;
use std::str::FromStr;

use oci_spec::OciSpecError;
use oci_spec::runtime::{
    Capabilities, Capability, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder,
    LinuxDeviceCgroupBuilder, LinuxMemoryBuilder, LinuxNamespace, LinuxNamespaceBuilder,
    LinuxNamespaceType, LinuxPidsBuilder, LinuxResourcesBuilder, Mount, MountBuilder,
    PosixRlimitBuilder, PosixRlimitType, ProcessBuilder, RootBuilder, Spec, UserBuilder,
};

/// `PATH` when neither the image nor the assignment sets one (Docker's value).
pub const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The `type_url` containerd expects for a runtime spec `Any` (JSON value).
pub const SPEC_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Spec";
/// The same for an exec'd process.
pub const PROCESS_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Process";
/// Open files per container (a decision: Docker inherits the daemon's
/// limit). Capped by this host's hard limit, which runc cannot exceed.
const NOFILE_MAX: u64 = 1_048_576;
const CFS_PERIOD_US: u64 = 100_000;

/// Docker's default capability set (C-15).
const DEFAULT_CAPABILITIES: [Capability; 14] = [
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fsetid,
    Capability::Fowner,
    Capability::Mknod,
    Capability::NetRaw,
    Capability::Setgid,
    Capability::Setuid,
    Capability::Setfcap,
    Capability::Setpcap,
    Capability::NetBindService,
    Capability::SysChroot,
    Capability::Kill,
    Capability::AuditWrite,
];

/// A host path bind-mounted into the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindMount {
    pub source: PathBuf,
    pub destination: String,
    pub readonly: bool,
}

/// Numeric identity of the container's process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessUser {
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
}

/// containerd's runc shim serves every container whose spec carries the
/// same value here from one process.
pub const RUNC_GROUP_ANNOTATION: &str = "io.containerd.runc.v2.group";

/// Everything that shapes one container's spec, already resolved.
#[derive(Debug, Clone, Default)]
pub struct ContainerSpec {
    pub hostname: String,
    pub args: Vec<String>,
    /// Final `KEY=value` list (see [`process_env`]).
    pub env: Vec<String>,
    pub cwd: String,
    pub user: ProcessUser,
    pub mounts: Vec<BindMount>,
    /// 1000 = one core; 0 = unlimited.
    pub cpu_millis: u32,
    /// 0 = unlimited.
    pub memory_mb: u32,
    /// 0 = unlimited.
    pub pids_limit: i64,
    /// The network namespace to join; `None` gives a private, empty one.
    pub netns: Option<PathBuf>,
    /// cgroupfs path, e.g. `/zattera/<namespace>/<id>`.
    pub cgroups_path: PathBuf,
    /// The image's OCI architecture (`amd64`, `386`, ...): which syscall
    /// ABIs the seccomp filter lets through (see [`super::seccomp`]).
    pub image_architecture: String,
    /// The host runs cgroup v2: the OOM killer then ends the whole
    /// container (`memory.oom.group`), not only the process it picked.
    pub cgroup_v2: bool,
    /// The runc shim group the task joins (one shim serves them all);
    /// `None`: a shim of its own.
    pub shim_group: Option<String>,
    /// The image's filesystem is mounted read-only (Docker's `--read-only`):
    /// only volumes and the files over `/etc` can be written.
    pub read_only_rootfs: bool,
}

/// Whether this host mounts the unified (v2) cgroup hierarchy.
pub fn host_has_cgroup_v2() -> bool {
    std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
}

/// The process argv from the image's ENTRYPOINT and CMD and the assignment's
/// shell-form command (C-3): services keep the entrypoint, jobs replace it.
pub fn process_args(
    entrypoint: &[String],
    cmd: &[String],
    command: &str,
    is_job: bool,
) -> Vec<String> {
    let command = command.trim();
    let shell = || vec!["/bin/sh".to_owned(), "-c".to_owned(), command.to_owned()];
    if command.is_empty() {
        entrypoint.iter().chain(cmd).cloned().collect()
    } else if is_job {
        shell()
    } else {
        entrypoint.iter().cloned().chain(shell()).collect()
    }
}

/// The process environment (C-4): defaults (PATH, HOSTNAME), then the image's
/// `Env`, then the assignment's, a later key replacing an earlier one. The
/// assignment's entries are sorted so that the spec is reproducible.
pub fn process_env<'a>(
    hostname: &str,
    image_env: &[String],
    assignment_env: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Result<Vec<String>, String> {
    if image_env.len() > MAX_IMAGE_ENV {
        return Err(format!(
            "the image config has {} Env entries; at most {MAX_IMAGE_ENV} are taken",
            image_env.len()
        ));
    }
    let mut assignment: Vec<String> = assignment_env
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    assignment.sort();
    // Merged through an index of keys: a later entry replaces an earlier
    // one in its place, in time linear in the entries.
    let mut out: Vec<String> = Vec::new();
    let mut at: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let defaults = [DEFAULT_PATH.to_owned(), format!("HOSTNAME={hostname}")];
    for entry in defaults
        .into_iter()
        .chain(image_env.iter().cloned())
        .chain(assignment)
    {
        let key = entry.split('=').next().unwrap_or_default().to_owned();
        if let Some(&i) = at.get(&key) {
            out[i] = entry;
        } else {
            at.insert(key, out.len());
            out.push(entry);
        }
    }
    Ok(out)
}

/// The most `Env` entries an image config may bring (a hostile one brought
/// hundreds of thousands, which the merge held a worker thread for).
pub const MAX_IMAGE_ENV: usize = 4096;

/// Parses an image `StopSignal` (`SIGQUIT`, `QUIT` or `3`); SIGTERM by default.
pub fn stop_signal(image_stop_signal: Option<&str>) -> Result<u32, String> {
    let Some(raw) = image_stop_signal.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(15);
    };
    if let Ok(n) = raw.parse::<u32>() {
        return Ok(n);
    }
    let name = raw.to_ascii_uppercase();
    let name = if name.starts_with("SIG") {
        name
    } else {
        format!("SIG{name}")
    };
    nix::sys::signal::Signal::from_str(&name)
        .map(|s| u32::try_from(s as i32).unwrap_or(15))
        .map_err(|_| format!("unknown stop signal {raw:?}"))
}

fn nofile_limit() -> u64 {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map_or(NOFILE_MAX, |(_, hard)| hard.min(NOFILE_MAX))
}

/// Builds the complete runtime spec.
pub fn build(c: &ContainerSpec) -> Result<Spec, OciSpecError> {
    let caps: Capabilities = DEFAULT_CAPABILITIES.into_iter().collect();
    let capabilities = LinuxCapabilitiesBuilder::default()
        .bounding(caps.clone())
        .effective(caps.clone())
        .permitted(caps)
        .build()?;
    let process = ProcessBuilder::default()
        .terminal(false)
        .args(c.args.clone())
        .env(c.env.clone())
        .cwd(if c.cwd.is_empty() {
            "/".to_owned()
        } else {
            c.cwd.clone()
        })
        .user(
            UserBuilder::default()
                .uid(c.user.uid)
                .gid(c.user.gid)
                .additional_gids(c.user.additional_gids.clone())
                .build()?,
        )
        .capabilities(capabilities)
        .rlimits(vec![
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitNofile)
                .soft(nofile_limit())
                .hard(nofile_limit())
                .build()?,
        ])
        // setuid binaries cannot raise privileges inside the container.
        .no_new_privileges(true)
        .build()?;

    let mut resources = LinuxResourcesBuilder::default().devices(vec![
        LinuxDeviceCgroupBuilder::default()
            .allow(false)
            .access("rwm")
            .build()?,
    ]);
    if c.cpu_millis > 0 {
        let quota = i64::from(c.cpu_millis) * 100;
        resources = resources.cpu(
            LinuxCpuBuilder::default()
                .quota(quota)
                .period(CFS_PERIOD_US)
                .build()?,
        );
    }
    if c.memory_mb > 0 {
        let limit = i64::from(c.memory_mb) * 1_048_576;
        // swap = 2 × limit, as Docker does when swap is left unset (C-6).
        resources = resources.memory(
            LinuxMemoryBuilder::default()
                .limit(limit)
                .swap(limit * 2)
                .build()?,
        );
    }
    if c.pids_limit > 0 {
        resources = resources.pids(LinuxPidsBuilder::default().limit(c.pids_limit).build()?);
    }
    // On cgroup v2 the kernel kills only the process it picked: a child
    // over the limit would die and leave a half-working container that
    // reads RUNNING. As kubelet does, the whole container goes, and is
    // reported and restarted like a main process killed for memory. (runc
    // refuses unified keys on cgroup v1.)
    if c.cgroup_v2 {
        resources = resources.unified(std::collections::HashMap::from([(
            "memory.oom.group".to_owned(),
            "1".to_owned(),
        )]));
    }

    let namespaces: Vec<LinuxNamespace> = [
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Network,
        LinuxNamespaceType::Cgroup,
    ]
    .into_iter()
    .map(|typ| {
        let mut ns = LinuxNamespaceBuilder::default().typ(typ);
        if typ == LinuxNamespaceType::Network
            && let Some(path) = &c.netns
        {
            ns = ns.path(path.clone());
        }
        ns.build()
    })
    .collect::<Result<_, _>>()?;

    let default_linux = oci_spec::runtime::Linux::default();
    let linux = LinuxBuilder::default()
        .resources(resources.build()?)
        .namespaces(namespaces)
        .cgroups_path(c.cgroups_path.clone())
        .masked_paths(default_linux.masked_paths().clone().unwrap_or_default())
        .readonly_paths(default_linux.readonly_paths().clone().unwrap_or_default())
        .seccomp(super::seccomp::default_profile(&c.image_architecture)?)
        .build()?;

    let mut mounts = default_mounts()?;
    for m in &c.mounts {
        let mode = if m.readonly { "ro" } else { "rw" };
        mounts.push(
            MountBuilder::default()
                .destination(m.destination.clone())
                .typ("bind")
                .source(m.source.clone())
                .options(vec!["rbind".to_owned(), mode.to_owned()])
                .build()?,
        );
    }

    let mut spec = Spec::default();
    spec.set_hostname(Some(c.hostname.clone()));
    spec.set_process(Some(process));
    spec.set_root(Some(
        RootBuilder::default()
            .path("rootfs")
            .readonly(c.read_only_rootfs)
            .build()?,
    ));
    spec.set_mounts(Some(mounts));
    spec.set_linux(Some(linux));
    if let Some(group) = &c.shim_group {
        spec.set_annotations(Some(
            [(RUNC_GROUP_ANNOTATION.to_owned(), group.clone())].into(),
        ));
    }
    Ok(spec)
}

/// The kernel filesystems every container gets, plus a 64 MiB `/dev/shm` (C-15).
fn default_mounts() -> Result<Vec<Mount>, OciSpecError> {
    let m = |dest: &str, typ: &str, source: &str, options: &[&str]| {
        MountBuilder::default()
            .destination(dest)
            .typ(typ)
            .source(source)
            .options(options.iter().map(|o| (*o).to_owned()).collect::<Vec<_>>())
            .build()
    };
    Ok(vec![
        m("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])?,
        m(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?,
        m(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
            ],
        )?,
        m(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        )?,
        m(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        )?,
        m(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", "ro"],
        )?,
        m(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", "ro"],
        )?,
    ])
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| (*x).to_owned()).collect()
    }

    #[test]
    fn command_merge_follows_docker() {
        let ep = s(&["/entry"]);
        let cmd = s(&["serve", "--port", "80"]);
        assert_eq!(
            process_args(&ep, &cmd, "  ", false),
            s(&["/entry", "serve", "--port", "80"])
        );
        assert_eq!(
            process_args(&ep, &cmd, " echo hi ", false),
            s(&["/entry", "/bin/sh", "-c", "echo hi"])
        );
        assert_eq!(
            process_args(&ep, &cmd, "echo hi", true),
            s(&["/bin/sh", "-c", "echo hi"])
        );
        assert_eq!(process_args(&[], &cmd, "", false), cmd);
    }

    #[test]
    fn env_layers_defaults_image_then_assignment() {
        let image = s(&["PATH=/image/bin", "LANG=C", "HOSTNAME=ignored"]);
        let env = process_env(
            "abc123",
            &image,
            [("ZED", "1"), ("LANG", "en"), ("APP", "x")],
        )
        .unwrap();
        assert_eq!(
            env,
            s(&[
                "PATH=/image/bin",
                "HOSTNAME=ignored",
                "LANG=en",
                "APP=x",
                "ZED=1"
            ])
        );
        let env = process_env("h", &[], []).unwrap();
        assert_eq!(env, s(&[DEFAULT_PATH, "HOSTNAME=h"]));
    }

    /// Issue 56.4: a config of many distinct keys is refused at once, and
    /// one at the cap merges in linear time (a quadratic merge of 4,096
    /// entries is some 8 million comparisons; of a 16 MiB config's, hours).
    #[test]
    fn a_hostile_image_env_is_capped_and_merged_in_linear_time() {
        let many: Vec<String> = (0..=MAX_IMAGE_ENV).map(|i| format!("K{i}=v")).collect();
        let err = process_env("h", &many, []).unwrap_err();
        assert!(err.contains("Env entries"), "{err}");
        let at_cap = &many[..MAX_IMAGE_ENV];
        let started = std::time::Instant::now();
        for _ in 0..20 {
            assert_eq!(
                process_env("h", at_cap, []).unwrap().len(),
                MAX_IMAGE_ENV + 2
            );
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    #[test]
    fn stop_signals_parse() {
        assert_eq!(stop_signal(None), Ok(15));
        assert_eq!(stop_signal(Some("")), Ok(15));
        assert_eq!(stop_signal(Some("SIGQUIT")), Ok(3));
        assert_eq!(stop_signal(Some("int")), Ok(2));
        assert_eq!(stop_signal(Some("9")), Ok(9));
        assert!(stop_signal(Some("SIGNOPE")).is_err());
    }

    #[test]
    fn spec_carries_limits_netns_and_mounts() {
        let c = ContainerSpec {
            hostname: "h1".into(),
            args: s(&["sh"]),
            env: s(&[DEFAULT_PATH]),
            cpu_millis: 1500,
            memory_mb: 256,
            netns: Some("/run/zattera/netns/x".into()),
            cgroups_path: "/zattera/ns/x".into(),
            shim_group: Some("zt-a.0".into()),
            mounts: vec![BindMount {
                source: "/var/lib/zattera/volumes/v/_data".into(),
                destination: "/data".into(),
                readonly: false,
            }],
            ..ContainerSpec::default()
        };
        let spec = build(&c).unwrap();
        let json = serde_json::to_value(&spec).unwrap();
        let res = &json["linux"]["resources"];
        assert_eq!(res["cpu"]["quota"], 150_000);
        assert_eq!(res["cpu"]["period"], 100_000);
        assert_eq!(res["memory"]["limit"], 268_435_456);
        assert_eq!(res["memory"]["swap"], 536_870_912);
        let net = json["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["type"] == "network")
            .unwrap();
        assert_eq!(net["path"], "/run/zattera/netns/x");
        assert_eq!(json["hostname"], "h1");
        assert_eq!(json["annotations"]["io.containerd.runc.v2.group"], "zt-a.0");
        assert_eq!(json["process"]["terminal"], false);
        assert_eq!(json["root"]["path"], "rootfs");
        assert!(
            json["process"]["capabilities"]["bounding"]
                .as_array()
                .unwrap()
                .contains(&serde_json::json!("CAP_NET_BIND_SERVICE"))
        );
        assert!(
            json["mounts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["destination"] == "/data"
                    && m["options"] == serde_json::json!(["rbind", "rw"]))
        );
    }

    #[test]
    fn unlimited_means_no_cgroup_limits() {
        let spec = build(&ContainerSpec {
            args: s(&["sh"]),
            ..ContainerSpec::default()
        })
        .unwrap();
        let json = serde_json::to_value(&spec).unwrap();
        assert!(json["linux"]["resources"]["cpu"].is_null());
        assert!(json["linux"]["resources"]["memory"].is_null());
        assert!(json["linux"]["resources"]["pids"].is_null());
        assert!(json["linux"]["resources"]["unified"].is_null());
    }

    #[test]
    fn on_cgroup_v2_the_oom_killer_takes_the_whole_container() {
        let spec = build(&ContainerSpec {
            args: s(&["sh"]),
            memory_mb: 16,
            cgroup_v2: true,
            ..ContainerSpec::default()
        })
        .unwrap();
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(
            json["linux"]["resources"]["unified"]["memory.oom.group"],
            "1"
        );
    }
}
