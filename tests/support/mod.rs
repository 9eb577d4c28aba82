//! Test support: connects integration tests to the rig's containerd
//! (scripts/rig.sh) and gives each test its own containerd namespace, purged
//! afterwards even when the test fails.
//!
//! Without the rig a test skips (recorded, see `zattera_testkit`), except
//! under CI, where a missing rig is a failure: CI must never pass by testing
//! nothing.

#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods
)]

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use containerd_client::services::v1::snapshots::{ListSnapshotsRequest, RemoveSnapshotRequest};
use containerd_client::services::v1::{
    DeleteContainerRequest, DeleteContentRequest, DeleteImageRequest, DeleteNamespaceRequest,
    DeleteRequest, DeleteTaskRequest, KillRequest, ListContainersRequest, ListContentRequest,
    ListImagesRequest, ListRequest,
};
use futures::{FutureExt, StreamExt};

pub mod agent;
pub mod private;
pub mod registry;
use zattera_agent::runtime::{Containerd, Namespace, import_archive};

pub const DEFAULT_SOCKET: &str = "/run/zattera-rig/containerd/containerd.sock";
pub const DEFAULT_IMAGES: &str = "/var/lib/zattera-rig/images";
/// The name scripts/mkimage.py gives the test image.
pub const TEST_IMAGE: &str = "docker.io/zattera/busybox:test";

#[derive(Debug, Clone)]
pub struct Rig {
    pub socket: PathBuf,
    pub images: PathBuf,
}

impl Rig {
    pub fn oci_archive(&self) -> PathBuf {
        self.images.join("busybox-oci.tar")
    }
    pub fn docker_archive(&self) -> PathBuf {
        self.images.join("busybox-docker.tar")
    }

    /// Writes `dir/big.tar`, an image of two incompressible 12 MiB layers
    /// made from the test image (bench/runtime/mkbig.py), and returns it.
    pub fn big_archive(&self, dir: &std::path::Path) -> PathBuf {
        let big = dir.join("big.tar");
        let made = std::process::Command::new("python3")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/bench/runtime/mkbig.py"
            ))
            .arg(self.oci_archive())
            .arg(&big)
            .args(["2", "12"])
            .output()
            .unwrap();
        assert!(made.status.success(), "mkbig: {made:?}");
        big
    }
}

/// The rig, or `None` (with a message) when it is not set up outside CI.
pub fn rig() -> Option<Rig> {
    let socket = PathBuf::from(
        std::env::var("ZATTERA_TEST_CONTAINERD").unwrap_or_else(|_| DEFAULT_SOCKET.into()),
    );
    let images = PathBuf::from(
        std::env::var("ZATTERA_TEST_IMAGES").unwrap_or_else(|_| DEFAULT_IMAGES.into()),
    );
    let mut missing = Vec::new();
    if !zattera_testkit::is_root() {
        missing.push("root".to_owned());
    }
    if !socket.exists() {
        missing.push(format!("containerd socket {}", socket.display()));
    }
    if !images.join("busybox-oci.tar").exists() {
        missing.push(format!("test images in {}", images.display()));
    }
    if !missing.is_empty() {
        missing.push("(run `sudo scripts/rig.sh` first)".to_owned());
    }
    zattera_testkit::require(&missing).then_some(Rig { socket, images })
}

/// A containerd namespace unique to this test process and call.
pub fn unique_namespace(test: &str) -> Namespace {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = format!("zt-test-{test}-{}-{n}", std::process::id());
    name.parse().expect("test namespace name is valid")
}

/// Runs `body` with a connection to a fresh namespace, then purges the
/// namespace whether the body passed or panicked.
pub async fn with_namespace<F, Fut>(rig: &Rig, test: &str, body: F)
where
    F: FnOnce(Containerd, Rig) -> Fut,
    Fut: Future<Output = ()>,
{
    let ns = unique_namespace(test);
    let ctd = Containerd::connect(&rig.socket, ns.clone())
        .await
        .expect("connect to the rig's containerd");
    let outcome = std::panic::AssertUnwindSafe(body(ctd.clone(), rig.clone()))
        .catch_unwind()
        .await;
    purge_namespace(&ctd).await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// The prologue of a test on the rig: skips without it (see [`rig`]),
/// else runs `body` in a fresh namespace (see [`with_namespace`]).
pub async fn on_rig<F, Fut>(test: &str, body: F)
where
    F: FnOnce(Containerd, Rig) -> Fut,
    Fut: Future<Output = ()>,
{
    let Some(rig) = rig() else { return };
    with_namespace(&rig, test, body).await;
}

/// [`on_rig`] with the test image ([`TEST_IMAGE`]) imported first.
pub async fn on_rig_with_image<F, Fut>(test: &str, body: F)
where
    F: FnOnce(Containerd, Rig) -> Fut,
    Fut: Future<Output = ()>,
{
    on_rig(test, |ctd, rig| async move {
        import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .unwrap();
        body(ctd, rig).await;
    })
    .await;
}

/// Deletes everything in the connection's namespace, then the namespace.
pub async fn purge_namespace(ctd: &Containerd) {
    let containers = ctd
        .containers()
        .list(ctd.request(ListContainersRequest { filters: vec![] }))
        .await
        .map(|r| r.into_inner().containers)
        .unwrap_or_default();
    for c in containers {
        kill_all(ctd, &c.id).await;
        // A loaded machine can take seconds to reap a killed task. Deleting
        // the container record while its task still exists would strand the
        // task's runc shim and log shim (nothing would ever delete them).
        // "Not stopped yet" comes as FailedPrecondition or, from the shim,
        // Unknown "cannot delete a running process": retry both, killing
        // again every second.
        let mut task_gone = false;
        for attempt in 0..300 {
            let deleted = ctd
                .tasks()
                .delete(ctd.request(DeleteTaskRequest {
                    container_id: c.id.clone(),
                }))
                .await;
            match deleted {
                Ok(_) => {
                    task_gone = true;
                    break;
                }
                Err(s) if s.code() == tonic::Code::NotFound => {
                    task_gone = true;
                    break;
                }
                Err(s) if attempt == 299 => {
                    eprintln!("warning: task {} not deleted: {}", c.id, s.message());
                }
                Err(_) => {
                    if attempt % 10 == 9 {
                        kill_all(ctd, &c.id).await;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
            }
        }
        if !task_gone {
            eprintln!("warning: container {} kept: its task is still there", c.id);
            continue;
        }
        let _ = ctd
            .containers()
            .delete(ctd.request(DeleteContainerRequest { id: c.id }))
            .await;
    }
    let images = ctd
        .images()
        .list(ctd.request(ListImagesRequest { filters: vec![] }))
        .await
        .map(|r| r.into_inner().images)
        .unwrap_or_default();
    for image in images {
        let _ = ctd
            .images()
            .delete(ctd.request(DeleteImageRequest {
                name: image.name,
                sync: false,
                target: None,
            }))
            .await;
    }
    let leases = ctd
        .leases()
        .list(ctd.request(ListRequest { filters: vec![] }))
        .await
        .map(|r| r.into_inner().leases)
        .unwrap_or_default();
    for lease in leases {
        let _ = ctd
            .leases()
            .delete(ctd.request(DeleteRequest {
                id: lease.id,
                sync: false,
            }))
            .await;
    }
    // Children before parents: repeat until nothing more can go.
    for _ in 0..16 {
        let snapshots = list_snapshots(ctd).await;
        if snapshots.is_empty() {
            break;
        }
        for key in snapshots {
            let _ = ctd
                .snapshots()
                .remove(ctd.request(RemoveSnapshotRequest {
                    snapshotter: "overlayfs".into(),
                    key,
                }))
                .await;
        }
    }
    let content = ctd
        .content()
        .list(ctd.request(ListContentRequest { filters: vec![] }))
        .await;
    if let Ok(stream) = content {
        let infos: Vec<_> = stream.into_inner().collect().await;
        for info in infos.into_iter().flatten().flat_map(|r| r.info) {
            let _ = ctd
                .content()
                .delete(ctd.request(DeleteContentRequest {
                    digest: info.digest,
                }))
                .await;
        }
    }
    // Deletion races containerd's GC of what was just removed: retry briefly.
    let mut last = None;
    for _ in 0..20 {
        let deleted = ctd
            .namespaces()
            .delete(tonic::Request::new(DeleteNamespaceRequest {
                name: ctd.namespace().to_string(),
            }))
            .await;
        match deleted {
            Ok(_) => {
                last = None;
                break;
            }
            Err(s) if s.code() == tonic::Code::NotFound => {
                last = None;
                break;
            }
            Err(s) => last = Some(s),
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    if let Some(s) = last {
        eprintln!(
            "warning: namespace {} not removed: {}",
            ctd.namespace(),
            s.message()
        );
    }
    remove_test_cgroups(ctd.namespace().as_str());
}

/// SIGKILL to every process of a task; errors (no task) are fine here.
async fn kill_all(ctd: &Containerd, id: &str) {
    let _ = ctd
        .tasks()
        .kill(ctd.request(KillRequest {
            container_id: id.to_owned(),
            exec_id: String::new(),
            signal: 9,
            all: true,
        }))
        .await;
}

/// Tests put containers under `/zattera-test/<namespace>/<id>` (executor
/// tests) or `/zattera/<namespace>/<id>` (the agent binary) in every cgroup
/// hierarchy; runc removes the leaves, this removes the parents.
fn remove_test_cgroups(namespace: &str) {
    let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") else {
        return;
    };
    let roots: Vec<PathBuf> = std::iter::once(PathBuf::from("/sys/fs/cgroup"))
        .chain(hierarchies.flatten().map(|h| h.path()))
        .collect();
    let mut dirs = Vec::new();
    for root in roots {
        for parent in ["zattera-test", "zattera"] {
            dirs.push(root.join(parent).join(namespace));
        }
    }
    for dir in dirs {
        if let Ok(children) = std::fs::read_dir(&dir) {
            for child in children.flatten() {
                if child.path().is_dir() {
                    let _ = std::fs::remove_dir(child.path());
                }
            }
        }
        let _ = std::fs::remove_dir(&dir);
    }
}

/// The names of the namespace's overlayfs snapshots. An error of
/// containerd's (the call or any batch of its stream) fails the test: an
/// empty list must mean "none", never "no answer".
pub async fn list_snapshots(ctd: &Containerd) -> Vec<String> {
    let stream = ctd
        .snapshots()
        .list(ctd.request(ListSnapshotsRequest {
            snapshotter: "overlayfs".into(),
            filters: vec![],
        }))
        .await
        .unwrap_or_else(|s| panic!("containerd did not list the snapshots: {s}"));
    let batches: Vec<_> = stream.into_inner().collect().await;
    batches
        .into_iter()
        .map(|b| b.unwrap_or_else(|s| panic!("a batch of the snapshot list failed: {s}")))
        .flat_map(|r| r.info)
        .map(|i| i.name)
        .collect()
}

/// Removes a test's kernel objects, even after a failure: mounts under
/// `dir` (network namespace files), its nft table and every interface whose
/// name starts with `prefix`.
pub fn remove_host_objects(prefix: &str, table: &str, dir: &std::path::Path) {
    use std::process::Command;
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let dir = dir.to_string_lossy();
    let mut ours: Vec<&str> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter(|m| m.starts_with(&*dir))
        .collect();
    ours.sort_unstable_by_key(|m| std::cmp::Reverse(m.len()));
    for m in ours {
        let _ = Command::new("umount").args(["-l", m]).status();
    }
    let _ = Command::new("nft")
        .args(["delete", "table", "inet", table])
        .output();
    if let Ok(links) = std::fs::read_dir("/sys/class/net") {
        for l in links.flatten() {
            let name = l.file_name().to_string_lossy().into_owned();
            if name.starts_with(prefix) {
                let _ = Command::new("ip").args(["link", "del", &name]).output();
            }
        }
    }
}

/// Removes a test's kernel objects when dropped (see [`remove_host_objects`]).
#[derive(Debug)]
pub struct NetCleanup {
    pub prefix: String,
    pub table: String,
    pub run_dir: PathBuf,
}

impl Drop for NetCleanup {
    fn drop(&mut self) {
        remove_host_objects(&self.prefix, &self.table, &self.run_dir);
    }
}

/// Whether the namespace has an image record of this name: NotFound is
/// "no"; any other error of containerd's fails the test.
pub async fn image_exists(ctd: &Containerd, name: &str) -> bool {
    match ctd
        .images()
        .get(ctd.request(containerd_client::services::v1::GetImageRequest { name: name.into() }))
        .await
    {
        Ok(_) => true,
        Err(s) if s.code() == tonic::Code::NotFound => false,
        Err(s) => panic!("containerd did not answer for image {name}: {s}"),
    }
}

/// A standalone executor's config for node `node_id` in `ctd`'s namespace,
/// with its state in `data_dir` and `run_dir` and test-sized defaults.
pub fn executor_config(
    ctd: &Containerd,
    node_id: &str,
    data_dir: &std::path::Path,
    run_dir: PathBuf,
) -> zattera_agent::executor::ExecutorConfig {
    zattera_agent::executor::ExecutorConfig {
        node_id: node_id.into(),
        host_ip: std::net::Ipv4Addr::LOCALHOST,
        data_dir: data_dir.to_owned(),
        run_dir,
        logger_binary: PathBuf::from(env!("CARGO_BIN_EXE_zattera-agent")),
        cgroup_parent: format!("/zattera-test/{}", ctd.namespace()),
        parallelism: 4,
        host_port_range: zattera_netns::PortRange::DEFAULT,
        pids_limit: zattera_agent::config::DEFAULT_PIDS_LIMIT,
        shim_group_size: zattera_agent::config::DEFAULT_SHIM_GROUP_SIZE,
        oci_runtime: zattera_agent::runtime::oci_runtime::OciRuntime::Runc,
        pull_timeout: zattera_agent::config::DEFAULT_PULL_TIMEOUT,
        standalone: true,
        source: "test".into(),
        cluster_registry: None,
        default_subnet: None,
        log_retention: zattera_agent::logs::Retention::default(),
        docker_volumes: data_dir.join("no-docker-volumes"),
        metrics: std::sync::Arc::default(),
    }
}

/// Creates container `id` of image `name` (unpacked at `chain_id`) with
/// `spec` and `labels`, and starts it logging to `log`.
pub async fn create_and_start(
    ctd: &Containerd,
    id: &str,
    name: &zattera_agent::runtime::ImageRef,
    chain_id: zattera_agent::runtime::Digest,
    labels: &[(&str, &str)],
    spec: &zattera_agent::runtime::spec::ContainerSpec,
    log: &std::path::Path,
) {
    use zattera_agent::runtime::containers::{self, NewContainer};
    let labels = labels
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    containers::create(
        ctd,
        &NewContainer {
            id: id.into(),
            image: name.to_string(),
            chain_id,
            labels,
            spec: zattera_agent::runtime::spec::build(spec).unwrap(),
            runtime: zattera_agent::runtime::oci_runtime::OciRuntime::Runc,
        },
    )
    .await
    .expect("create container");
    let uri = zattera_agent::logs::shim::log_uri(
        std::path::Path::new(env!("CARGO_BIN_EXE_zattera-agent")),
        log,
        zattera_agent::logs::Retention::default(),
    );
    containers::start(ctd, id, &uri).await.expect("start task");
}

/// `ctr task exec --detach` of `sleep 1000` as `exec_id` in `container`:
/// an exec process the agent did not start (or one an earlier agent left).
pub fn ctr_exec_sleep(rig: &Rig, ctd: &Containerd, container: &str, exec_id: &str) {
    let out = std::process::Command::new("ctr")
        .arg("--address")
        .arg(&rig.socket)
        .args(["-n", ctd.namespace().as_str(), "task", "exec", "--detach"])
        .args(["--exec-id", exec_id, container, "sleep", "1000"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ctr task exec: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The process's peak resident memory so far, in bytes (nextest runs each
/// test in a process of its own).
pub fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

/// How many leases the namespace holds (every operation must release its own).
pub async fn lease_count(ctd: &Containerd) -> usize {
    ctd.leases()
        .list(ctd.request(ListRequest { filters: vec![] }))
        .await
        .expect("list leases")
        .into_inner()
        .leases
        .len()
}

/// A test's own network stack for an executor: networking with its bridge
/// prefix (and the namespace's nft table) under `run_dir`, a DNS server,
/// and the guard that removes what they create.
pub fn test_network(
    ctd: &Containerd,
    prefix: &str,
    run_dir: &std::path::Path,
) -> (
    std::sync::Arc<zattera_netns::NetNode>,
    zattera_dns::DnsServer,
    NetCleanup,
) {
    let mut cfg =
        zattera_netns::NetConfig::for_namespace(ctd.namespace().as_str(), run_dir).unwrap();
    cfg.bridge_prefix = prefix.into();
    let cleanup = NetCleanup {
        prefix: prefix.into(),
        table: cfg.nft_table.clone(),
        run_dir: run_dir.to_path_buf(),
    };
    let net = std::sync::Arc::new(zattera_netns::NetNode::new(cfg).unwrap());
    let dns = zattera_dns::DnsServer::new(zattera_dns::Config::default()).unwrap();
    (net, dns, cleanup)
}

/// A process as /proc shows it.
#[derive(Debug, Clone)]
pub struct Process {
    pub pid: i32,
    pub ppid: i32,
    pub argv: Vec<String>,
}

impl Process {
    /// The value after `flag` in argv (`-namespace ns`).
    pub fn flag(&self, flag: &str) -> Option<&str> {
        self.argv
            .windows(2)
            .find(|w| w[0] == flag)
            .map(|w| w[1].as_str())
    }

    pub fn is_runc_shim(&self) -> bool {
        self.argv
            .first()
            .is_some_and(|a| a.ends_with("containerd-shim-runc-v2"))
    }
}

/// Every process of the machine, read from /proc (those that vanish
/// meanwhile are left out).
pub fn processes() -> Vec<Process> {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    procs
        .flatten()
        .filter_map(|p| {
            let pid = p.file_name().to_string_lossy().parse::<i32>().ok()?;
            // After the ")" that closes the command name: the state, then
            // the parent pid.
            let stat = std::fs::read_to_string(p.path().join("stat")).ok()?;
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())?;
            let raw = std::fs::read(p.path().join("cmdline")).ok()?;
            let argv = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            Some(Process { pid, ppid, argv })
        })
        .collect()
}

/// A benchmark's start: the rig and a two-thread runtime, or `None`
/// (said on stdout) when there is no rig.
pub fn bench_rig(bench: &str) -> Option<(Rig, tokio::runtime::Runtime)> {
    let Some(rig) = rig() else {
        println!("{bench} bench: skipped (no rig)");
        return None;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    Some((rig, rt))
}

/// The number in environment variable `name`, else `default`.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
