//! Preflight: what the agent needs from the host, one check at a time, each
//! failure with its fix. `zattera-agent doctor` prints them all; `run` runs
//! the host checks at start ([`preflight`]) and refuses to start on the
//! first failure, naming it. containerd is the exception at start: `run`
//! waits for it (boot ordering, a containerd restart) instead of failing.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use crate::config::{Config, ConfigError};
use crate::runtime::{Containerd, Namespace};

/// The oldest containerd the agent works with (DESIGN decision 1).
pub const MIN_CONTAINERD: (u32, u32) = (1, 6);
/// Below this much free space under the data dir, nothing can be pulled.
const DISK_FAIL_BYTES: u64 = 256 << 20;
const DISK_WARN_BYTES: u64 = 2 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Pass,
    /// Works, but not as well as it could.
    Warn,
    /// The agent cannot run without it.
    Fail,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Verdict::Pass => "PASS",
            Verdict::Warn => "WARN",
            Verdict::Fail => "FAIL",
        }
    }
}

/// One line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub verdict: Verdict,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    fn pass(name: &'static str, detail: impl Into<String>) -> Self {
        Self {
            name,
            verdict: Verdict::Pass,
            detail: detail.into(),
            fix: None,
        }
    }

    fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            name,
            verdict: Verdict::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Self {
        Self {
            name,
            verdict: Verdict::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    /// `FAIL containerd: <detail> (fix: <fix>)`, one line.
    pub fn line(&self) -> String {
        let mut s = format!("{} {}: {}", self.verdict.label(), self.name, self.detail);
        if let Some(fix) = &self.fix {
            s.push_str(" (fix: ");
            s.push_str(fix);
            s.push(')');
        }
        s
    }
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub ok: bool,
    pub checks: Vec<Check>,
}

impl Report {
    fn new(checks: Vec<Check>) -> Self {
        Self {
            ok: checks.iter().all(|c| c.verdict != Verdict::Fail),
            checks,
        }
    }

    pub fn render(&self) -> String {
        let mut s: String = self.checks.iter().map(|c| c.line() + "\n").collect();
        let failed = self
            .checks
            .iter()
            .filter(|c| c.verdict == Verdict::Fail)
            .count();
        if failed > 0 {
            let _ = writeln!(s, "{failed} check(s) failed: the agent cannot run here yet");
        }
        s
    }
}

/// Every check, for `zattera-agent doctor`. `config` is what loading the
/// config file gave; without a usable config the defaults are checked.
pub async fn run(config: Result<Config, ConfigError>, config_origin: &str) -> Report {
    let mut checks = Vec::new();
    let config = match config {
        Ok(c) => {
            checks.push(Check::pass("config", format!("{config_origin} parses")));
            c
        }
        Err(e) => {
            checks.push(Check::fail(
                "config",
                e.to_string(),
                "correct the named key or file (keys are those of `zattera-agent run --help`)",
            ));
            // The rest is checked with the defaults.
            match crate::config::Settings::default().resolve() {
                Ok(c) => c,
                Err(_) => return Report::new(checks),
            }
        }
    };
    checks.push(containerd(&config.containerd_address, &config.namespace).await);
    checks.extend(host(&config));
    checks.push(wireguard(config.mesh.backend));
    checks.push(builder(&config.build));
    checks.push(build_platforms(Path::new("/proc/sys/fs/binfmt_misc")));
    checks.extend(node_api_callers(&config));
    Report::new(checks)
}

/// On a joined node: whether control can call the node API at all. `None`
/// on a node that never joined (standalone).
fn node_api_callers(config: &Config) -> Option<Check> {
    let e = crate::link::identity::IdentityDir::new(&config.data_dir)
        .load_enrollment()
        .ok()?;
    Some(
        match crate::node_api::refuses_everyone(
            &e.control_node_ids,
            &config.control_node_ids,
            e.mesh_enabled,
        ) {
            Some(why) => Check::warn(
                "node API",
                why,
                "control-node-ids = [\"<id>\"] in agent.toml (the ids of control's nodes)",
            ),
            None if e.mesh_enabled => Check::pass(
                "node API",
                "control-plane callers follow the mesh's peer sets",
            ),
            None => Check::pass(
                "node API",
                format!(
                    "control-plane callers: {}",
                    e.control_node_ids
                        .iter()
                        .chain(&config.control_node_ids)
                        .cloned()
                        .collect::<std::collections::BTreeSet<_>>()
                        .into_iter()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ),
        },
    )
}

/// The host checks `run` performs at start: the first failure stops it.
pub fn preflight(config: &Config) -> Result<(), Check> {
    match host(config)
        .into_iter()
        .find(|c| c.verdict == Verdict::Fail)
    {
        Some(failed) => Err(failed),
        None => Ok(()),
    }
}

fn host(config: &Config) -> Vec<Check> {
    vec![
        root(),
        runc(),
        oci_runtime(&config.oci_runtime),
        overlayfs(),
        cgroups(),
        nftables(),
        network_namespaces(),
        ip_forwarding(),
        disk(&config.data_dir),
        node_limits(
            config.subnet_pool,
            config.host_port_range,
            &NodeKernel::read(),
        ),
    ]
}

/// Instances one environment (a /24 with its gateway) holds.
const INSTANCES_PER_SUBNET: u64 = 253;

/// The kernel's tables that grow with the instances.
#[derive(Debug, Clone, Copy, Default)]
struct NodeKernel {
    /// `net.ipv4.neigh.default.gc_thresh3`: the hard cap on the host's
    /// neighbour (ARP) entries; the host has one for every instance it
    /// talks to (DNS answers, probes, the VIP proxies).
    neigh_max: Option<u64>,
    /// `net.netfilter.nf_conntrack_max`, once the module is loaded.
    conntrack_max: Option<u64>,
}

impl NodeKernel {
    fn read() -> Self {
        let num = |path: &str| {
            std::fs::read_to_string(path)
                .ok()
                .and_then(|t| t.trim().parse().ok())
        };
        Self {
            neigh_max: num("/proc/sys/net/ipv4/neigh/default/gc_thresh3"),
            conntrack_max: num("/proc/sys/net/netfilter/nf_conntrack_max"),
        }
    }
}

/// Where the node's limits are (issue 59.2): how many instances the
/// standalone subnet pool holds, how many host ports there are to publish,
/// the kernel tables that grow with the instances, and which of them binds
/// first. Said, not judged: a node runs fine below its limits.
fn node_limits(pool: (u8, u8), ports: zattera_netns::PortRange, kernel: &NodeKernel) -> Check {
    use std::fmt::Write as _;
    let environments = u64::from(pool.1.saturating_sub(pool.0)) + 1;
    let by_pool = environments * INSTANCES_PER_SUBNET;
    let host_ports = u64::from(ports.hi.saturating_sub(ports.lo)) + 1;
    let mut detail = format!(
        "standalone: {environments} environments × {INSTANCES_PER_SUBNET} = {by_pool} instances \
         (subnet-pool {}-{}); {host_ports} host ports to publish ({}-{})",
        pool.0, pool.1, ports.lo, ports.hi
    );
    if let Some(n) = kernel.conntrack_max {
        let _ = write!(detail, "; {n} tracked connections");
    }
    match kernel.neigh_max {
        Some(n) if n < by_pool => {
            let want = by_pool.min(16_384).saturating_mul(2).next_power_of_two();
            let _ = write!(
                detail,
                "; at most about {n} instances: the host keeps a neighbour entry for each one \
                 it talks to (DNS answers, probes, the VIP proxies), and past \
                 net.ipv4.neigh.default.gc_thresh3 = {n} it drops packets (\"neighbour table \
                 overflow\"); to go further: sysctl -w net.ipv4.neigh.default.gc_thresh3={want} \
                 net.ipv4.neigh.default.gc_thresh2={}",
                want / 2
            );
        }
        Some(n) => {
            let _ = write!(detail, "; neighbour table {n} entries");
        }
        None => {}
    }
    Check::pass("node limits", detail)
}

async fn containerd(address: &Path, namespace: &Namespace) -> Check {
    let fix = format!(
        "start containerd (`systemctl enable --now containerd`) or point containerd-address at its socket (now {})",
        address.display()
    );
    let connected = tokio::time::timeout(
        Duration::from_secs(5),
        Containerd::connect(address, namespace.clone()),
    )
    .await;
    let ctd = match connected {
        Ok(Ok(ctd)) => ctd,
        Ok(Err(e)) => return Check::fail("containerd", e.to_string(), fix),
        Err(_) => return Check::fail("containerd", "no answer within 5 s", fix),
    };
    match ctd.version().await {
        Ok(version) => match parse_version(&version) {
            Some(v) if v >= MIN_CONTAINERD => {
                let docker = ctd
                    .namespaces()
                    .list(tonic::Request::new(
                        containerd_client::services::v1::ListNamespacesRequest {
                            filter: String::new(),
                        },
                    ))
                    .await
                    .is_ok_and(|r| r.into_inner().namespaces.iter().any(|n| n.name == "moby"));
                let shared = if docker {
                    format!(
                        "; Docker runs on it too (its namespace moby is never touched: this agent works in {namespace})"
                    )
                } else {
                    String::new()
                };
                Check::pass(
                    "containerd",
                    format!(
                        "{version} at {}, {}{shared}",
                        address.display(),
                        containerd_package()
                    ),
                )
            }
            _ => Check::fail(
                "containerd",
                format!("version {version} at {}", address.display()),
                format!(
                    "install containerd {}.{} or newer",
                    MIN_CONTAINERD.0, MIN_CONTAINERD.1
                ),
            ),
        },
        Err(e) => Check::fail("containerd", e.to_string(), fix),
    }
}

/// Which package installed the containerd on PATH: Debian's `containerd`,
/// Docker's `containerd.io`, or the RPM that owns it.
fn containerd_package() -> String {
    let Some(binary) = crate::programs::on_path("containerd") else {
        return "containerd not on PATH".to_owned();
    };
    let owner = |program: &str, args: &[&str]| -> Option<String> {
        let out = std::process::Command::new(program)
            .args(args)
            .arg(&binary)
            .stderr(std::process::Stdio::null())
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let name = text.lines().next()?.split(':').next()?.trim().to_owned();
        (out.status.success() && !name.is_empty()).then_some(name)
    };
    match owner("dpkg-query", &["-S"]).or_else(|| owner("rpm", &["-qf", "--qf", "%{NAME}"])) {
        Some(package) => format!("from package {package} ({})", binary.display()),
        None => format!("{} (no package owns it)", binary.display()),
    }
}

/// `1.6.20~ds1` → (1, 6).
fn parse_version(text: &str) -> Option<(u32, u32)> {
    let text = text.trim_start_matches('v');
    let mut parts = text.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

fn root() -> Check {
    if nix::unistd::geteuid().is_root() {
        Check::pass("root", "running as root")
    } else {
        Check::fail(
            "root",
            "not running as root",
            "run the agent as root (it creates namespaces, bridges and nftables rules)",
        )
    }
}

/// The first line a program prints for `args`.
fn first_line(program: &Path, args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err.lines().next().unwrap_or("failed").to_owned());
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned())
}

fn runc() -> Check {
    let fix = "install runc (`apt install runc` / `dnf install runc`): containerd's runc shim runs it from PATH";
    let Some(path) = crate::programs::on_path("runc") else {
        return Check::fail("runc", "not found on PATH", fix);
    };
    match first_line(&path, &["--version"]) {
        Ok(v) => Check::pass("runc", format!("{v} ({})", path.display())),
        Err(e) => Check::fail("runc", format!("{} --version: {e}", path.display()), fix),
    }
}

/// Which runtime the node's containers run with (`oci-runtime`).
fn oci_runtime(runtime: &crate::runtime::oci_runtime::OciRuntime) -> Check {
    let Some(path) = runtime.binary() else {
        return Check::pass(
            "oci runtime",
            "runc (oci-runtime = crun or auto runs crun where the host's cgroups are v2 only)",
        );
    };
    match first_line(path, &["--version"]) {
        Ok(v) => Check::pass(
            "oci runtime",
            format!(
                "{} runs the containers: {v} ({})",
                runtime.name(),
                path.display()
            ),
        ),
        Err(e) => Check::fail(
            "oci runtime",
            format!("{} --version: {e}", path.display()),
            "install it, or set oci-runtime = runc",
        ),
    }
}

fn overlayfs() -> Check {
    let listed = std::fs::read_to_string("/proc/filesystems").is_ok_and(|t| {
        t.lines()
            .any(|l| l.split_whitespace().last() == Some("overlay"))
    });
    if listed {
        Check::pass("overlayfs", "overlay is in /proc/filesystems")
    } else {
        Check::fail(
            "overlayfs",
            "the kernel has no overlay filesystem loaded",
            "`modprobe overlay` (and add it to /etc/modules-load.d): containerd's overlayfs snapshotter needs it",
        )
    }
}

/// The controllers the agent's OCI specs use.
const CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

fn cgroups() -> Check {
    let root = Path::new("/sys/fs/cgroup");
    if let Ok(text) = std::fs::read_to_string(root.join("cgroup.controllers")) {
        let have: Vec<&str> = text.split_whitespace().collect();
        let missing: Vec<&str> = CONTROLLERS
            .iter()
            .copied()
            .filter(|c| !have.contains(c))
            .collect();
        return if missing.is_empty() {
            Check::pass(
                "cgroups",
                format!("cgroup v2 with {}", CONTROLLERS.join(", ")),
            )
        } else {
            Check::fail(
                "cgroups",
                format!("cgroup v2 without the {} controller(s)", missing.join(", ")),
                "enable them in the root cgroup (cgroup_enable= on the kernel command line)",
            )
        };
    }
    let missing: Vec<&str> = CONTROLLERS
        .iter()
        .copied()
        .filter(|c| !root.join(c).join("tasks").exists())
        .collect();
    if missing.is_empty() {
        Check::warn(
            "cgroups",
            format!(
                "cgroup v1 with {} (works; v2 gives PSI and better memory accounting)",
                CONTROLLERS.join(", ")
            ),
            "boot with systemd.unified_cgroup_hierarchy=1 for cgroup v2",
        )
    } else {
        Check::fail(
            "cgroups",
            format!("no cgroup v2, and cgroup v1 lacks {}", missing.join(", ")),
            "mount cgroup2 on /sys/fs/cgroup (systemd does this by default)",
        )
    }
}

fn nftables() -> Check {
    let fix =
        "install nftables (`apt install nftables` / `dnf install nftables`) and load nf_tables";
    let Some(nft) = crate::programs::on_path("nft") else {
        return Check::fail("nftables", "nft not found on PATH", fix);
    };
    let version = match first_line(&nft, &["--version"]) {
        Ok(v) => v,
        Err(e) => return Check::fail("nftables", format!("nft --version: {e}"), fix),
    };
    match first_line(&nft, &["list", "tables"]) {
        Ok(_) => Check::pass("nftables", version),
        Err(e) => Check::fail("nftables", format!("nft list tables: {e}"), fix),
    }
}

fn network_namespaces() -> Check {
    // unshare(2) moves only the calling thread, which then ends.
    let made = std::thread::spawn(|| nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET))
        .join()
        .map_err(|_| nix::errno::Errno::EINVAL)
        .and_then(|r| r);
    match made {
        Ok(()) => Check::pass("netns", "a network namespace can be created"),
        Err(e) => Check::fail(
            "netns",
            format!("cannot create a network namespace: {e}"),
            "run as root on a kernel with CONFIG_NET_NS, outside a container that forbids unshare",
        ),
    }
}

fn ip_forwarding() -> Check {
    let path = "/proc/sys/net/ipv4/ip_forward";
    match std::fs::read_to_string(path).map(|t| t.trim().to_owned()) {
        Ok(v) if v == "1" => Check::pass("forwarding", "net.ipv4.ip_forward = 1"),
        Ok(_) => {
            let writable = std::fs::OpenOptions::new().write(true).open(path).is_ok();
            if writable {
                Check::warn(
                    "forwarding",
                    "net.ipv4.ip_forward = 0 (the agent turns it on with its first network)",
                    "set net.ipv4.ip_forward = 1 in /etc/sysctl.d to make it explicit",
                )
            } else {
                Check::fail(
                    "forwarding",
                    "net.ipv4.ip_forward = 0 and cannot be changed",
                    "set net.ipv4.ip_forward = 1 (containers need it to reach anything)",
                )
            }
        }
        Err(e) => Check::fail("forwarding", format!("{path}: {e}"), "mount /proc"),
    }
}

/// What the mesh would run on; only a cluster with the mesh on needs it, so
/// at worst a warning.
fn wireguard(pref: zattera_mesh::BackendKind) -> Check {
    use zattera_mesh::BackendKind;
    let kernel = Path::new("/sys/module/wireguard").exists();
    let tun = Path::new("/dev/net/tun").exists();
    match (pref, kernel, tun) {
        (BackendKind::Auto | BackendKind::Kernel, true, _) => {
            Check::pass("wireguard", "the kernel has WireGuard (module loaded)")
        }
        (BackendKind::Auto | BackendKind::Userspace, _, true) => Check::pass(
            "wireguard",
            "userspace WireGuard over /dev/net/tun (no kernel module loaded; `modprobe wireguard` is faster)",
        ),
        (BackendKind::Kernel, false, _) => Check::warn(
            "wireguard",
            "mesh-backend is kernel, but the wireguard module is not loaded",
            "modprobe wireguard (Linux 5.6+), or set mesh-backend = \"auto\"",
        ),
        _ => Check::warn(
            "wireguard",
            "neither the wireguard module nor /dev/net/tun: a cluster with the mesh cannot be joined",
            "modprobe wireguard, or modprobe tun",
        ),
    }
}

/// Whether builds run here, and with what: a node with a builder joins
/// with `builder=true`, which is what a reference control plane places
/// builds by.
fn builder(build: &crate::image_build::settings::BuildSettings) -> Check {
    match crate::image_build::available_backend(build) {
        Ok(crate::image_build::Available::BuildKit) => Check::pass(
            "builder",
            format!(
                "BuildKit ({}); joins label this node builder=true",
                build.buildkitd.display()
            ),
        ),
        Ok(crate::image_build::Available::Buildah) => {
            Check::pass("builder", "buildah; joins label this node builder=true")
        }
        Err(why) => Check::warn(
            "builder",
            format!("{why}: this node is not labelled builder=true and gets no builds"),
            "install buildah or buildkitd (build-backend), or leave builds to other nodes",
        ),
    }
}

/// Which platforms builds on this node can target (BLD-7): its own, and
/// those qemu emulates through binfmt_misc. Only native is no fault.
fn build_platforms(binfmt_misc: &Path) -> Check {
    let platforms = crate::image_build::strategy::serveable_platforms(binfmt_misc);
    let detail = if platforms.len() == 1 {
        format!(
            "{} only (others need an emulator: apt install qemu-user-static, which registers its binfmt handlers)",
            platforms[0]
        )
    } else {
        platforms.join(", ")
    };
    Check::pass("build platforms", detail)
}

fn disk(data_dir: &Path) -> Check {
    // The data dir may not exist yet: its nearest existing ancestor is where
    // it will live.
    let mut at = data_dir;
    while !at.exists() {
        match at.parent() {
            Some(p) => at = p,
            None => break,
        }
    }
    let stat = match nix::sys::statvfs::statvfs(at) {
        Ok(s) => s,
        Err(e) => {
            return Check::fail(
                "disk",
                format!("{}: {e}", data_dir.display()),
                "make data-dir a readable directory",
            );
        }
    };
    let block = stat.fragment_size();
    let free = stat.blocks_available() * block;
    let total = stat.blocks() * block;
    let detail = format!(
        "{} free of {} under {}",
        human(free),
        human(total),
        data_dir.display()
    );
    let fix = format!(
        "free space on the filesystem of {} (images, logs and volumes live there)",
        data_dir.display()
    );
    if free < DISK_FAIL_BYTES {
        Check::fail("disk", detail, fix)
    } else if free < DISK_WARN_BYTES {
        Check::warn("disk", detail, fix)
    } else {
        Check::pass("disk", detail)
    }
}

fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024 * 10 && unit < UNITS.len() - 1 {
        value /= 1024;
        unit += 1;
    }
    format!("{value} {}", UNITS[unit])
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn the_node_limits_name_the_pool_the_ports_and_a_small_neighbour_table() {
        let ports = zattera_netns::PortRange {
            lo: 30000,
            hi: 32767,
        };
        let roomy = NodeKernel {
            neigh_max: Some(8192),
            conntrack_max: Some(262_144),
        };
        let c = node_limits((150, 153), ports, &roomy);
        assert!(
            c.detail.contains("4 environments × 253 = 1012 instances")
                && c.detail.contains("2768 host ports")
                && c.detail.contains("262144 tracked connections")
                && c.detail.contains("neighbour table 8192 entries"),
            "{}",
            c.line()
        );
        // Debian's default gc_thresh3 (1024) binds before five environments.
        let debian = NodeKernel {
            neigh_max: Some(1024),
            conntrack_max: None,
        };
        let c = node_limits((150, 154), ports, &debian);
        assert_eq!(c.verdict, Verdict::Pass, "said, not judged");
        assert!(
            c.detail.contains("at most about 1024 instances")
                && c.detail.contains("gc_thresh3=4096"),
            "{}",
            c.line()
        );
        assert!(
            !node_limits((150, 150), ports, &debian)
                .detail
                .contains("at most")
        );
    }

    #[test]
    fn versions_parse_as_containerd_prints_them() {
        assert_eq!(parse_version("1.6.20~ds1"), Some((1, 6)));
        assert_eq!(parse_version("v2.0.4"), Some((2, 0)));
        assert_eq!(parse_version("1.7.24-1"), Some((1, 7)));
        assert_eq!(parse_version("junk"), None);
        assert!(parse_version("1.5.9").unwrap() < MIN_CONTAINERD);
        assert!(parse_version("2.0.0").unwrap() >= MIN_CONTAINERD);
    }

    #[test]
    fn lines_name_the_check_and_the_fix() {
        let c = Check::fail("disk", "1 MiB free", "free space");
        assert_eq!(c.line(), "FAIL disk: 1 MiB free (fix: free space)");
        assert_eq!(Check::pass("root", "ok").line(), "PASS root: ok");
        let r = Report::new(vec![c, Check::pass("root", "ok")]);
        assert!(!r.ok);
        assert!(r.render().contains("1 check(s) failed"));
    }

    #[test]
    fn sizes_read_well() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(300 << 20), "300 MiB");
        assert_eq!(human(20 << 30), "20 GiB");
    }
}
