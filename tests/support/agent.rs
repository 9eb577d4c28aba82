//! The real `zattera-agent run` binary as a test runs it: its own containerd
//! namespace, bridge prefix, subnet pool, directories and, optionally, its
//! own network namespace (a host of its own: bridges, nft table, loopback and
//! port ranges that nothing else on the machine shares).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_zattera-agent");

/// The agent binary `run` starts: this build's, or `ZATTERA_TEST_AGENT_BIN`
/// (to check that a test fails against an older build).
pub fn run_bin() -> String {
    std::env::var("ZATTERA_TEST_AGENT_BIN").unwrap_or_else(|_| BIN.to_owned())
}

/// A network namespace made by a test, deleted when dropped.
#[derive(Debug)]
pub struct TestNetns {
    pub name: String,
}

impl TestNetns {
    /// `zt-<tag>-<pid>` with loopback up.
    pub fn new(tag: &str) -> Self {
        let name = format!("zt-{tag}-{}", std::process::id());
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        let ok = Command::new("ip")
            .args(["netns", "add", &name])
            .status()
            .unwrap()
            .success();
        assert!(ok, "ip netns add {name}");
        let netns = Self { name };
        netns.run(&["ip", "link", "set", "lo", "up"]);
        netns
    }

    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// `program` inside this network namespace only (not its mounts: the
    /// agent's namespace files must stay visible to containerd).
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", self.path().display()))
            .arg("--")
            .arg(program);
        cmd
    }

    /// Runs a command inside and asserts that it succeeds.
    pub fn run(&self, argv: &[&str]) -> String {
        let out = self.command(argv[0]).args(&argv[1..]).output().unwrap();
        assert!(
            out.status.success(),
            "{argv:?} in {}: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Writes `/proc/sys/<key>` (slashes) as seen inside.
    pub fn sysctl(&self, key: &str, value: &str) {
        self.run(&["sh", "-c", &format!("echo '{value}' > /proc/sys/{key}")]);
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// A running agent process and everything it owns on the host.
#[derive(Debug)]
pub struct AgentProc {
    pub child: Option<Child>,
    pub socket: PathBuf,
    pub ns: String,
    pub prefix: String,
    pub pool: String,
    pub dir: tempfile::TempDir,
    /// Extra `run` flags.
    pub run_args: Vec<String>,
    /// Run inside this network namespace (a path under /run/netns).
    pub netns: Option<PathBuf>,
    /// Extra environment of `run`.
    pub env: Vec<(String, String)>,
}

impl AgentProc {
    pub fn new(socket: &Path, ns: &str, prefix: &str, pool: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("manifests")).unwrap();
        Self {
            child: None,
            socket: socket.to_path_buf(),
            ns: ns.into(),
            prefix: prefix.into(),
            pool: pool.into(),
            dir,
            run_args: Vec::new(),
            netns: None,
            env: Vec::new(),
        }
    }

    pub fn run_dir(&self) -> PathBuf {
        self.dir.path().join("run")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn manifests(&self) -> PathBuf {
        self.dir.path().join("manifests")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn write_manifest(&self, name: &str, text: &str) {
        let tmp = self.manifests().join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, self.manifests().join(name)).unwrap();
    }

    /// `cmd` with this agent's containerd, namespace and run dir (the
    /// flags before a subcommand).
    fn node_flags<'c>(&self, cmd: &'c mut Command) -> &'c mut Command {
        cmd.arg("--containerd-address")
            .arg(&self.socket)
            .args(["--namespace", &self.ns, "--config", "/dev/null"])
            .arg("--run-dir")
            .arg(self.run_dir())
    }

    pub fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("agent.log"))
            .unwrap();
        let mut cmd = match &self.netns {
            Some(path) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net={}", path.display()))
                    .arg("--")
                    .arg(run_bin());
                c
            }
            None => Command::new(run_bin()),
        };
        let child = self
            .node_flags(&mut cmd)
            .arg("--data-dir")
            .arg(self.data_dir())
            .args([
                "run",
                "--bridge-prefix",
                &self.prefix,
                "--subnet-pool",
                &self.pool,
                "--manifests",
            ])
            .arg(self.manifests())
            .args(&self.run_args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    /// SIGTERM, then waits (30 s) for the agent to exit; its exit status.
    pub fn term(&mut self) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(c.id()).unwrap()),
            nix::sys::signal::Signal::SIGTERM,
        );
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = c.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = c.kill();
        let _ = c.wait();
        None
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn status(&self) -> Option<serde_json::Value> {
        let out = Command::new(BIN)
            .arg("--run-dir")
            .arg(self.run_dir())
            .args(["status", "--json"])
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    /// `status --json` with the agent's containerd settings, so that it can
    /// fall back to reading containerd when the agent is down.
    pub fn status_from_containerd(&self) -> serde_json::Value {
        let out = self
            .node_flags(&mut Command::new(BIN))
            .args(["status", "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Polls `status` until `done` holds (90 s), then returns that status.
    pub fn wait_for(
        &self,
        what: &str,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(90);
        let mut last = None;
        while Instant::now() < deadline {
            if let Some(s) = self.status() {
                if done(&s) {
                    return s;
                }
                last = Some(s);
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        let log = self.log();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        panic!(
            "not {what} within 90 s; last status {last:#?}\nagent log (newest first):\n{}",
            tail.join("\n")
        );
    }

    /// Waits until the agent has completed `n` more reconcile passes (a
    /// tick is 5 s): whatever it would do about the state before the call,
    /// it has had the chance to do by then.
    pub fn wait_passes(&self, n: u64) {
        let from = self
            .status()
            .map_or(0, |s| s["passes"].as_u64().unwrap_or(0));
        self.wait_for(&format!("{n} more passes after {from}"), |s| {
            s["passes"].as_u64().is_some_and(|p| p >= from + n)
        });
    }

    /// Waits until `n` assignments are all in `state`; returns id → container id.
    pub fn wait_all(&self, n: usize, state: &str) -> BTreeMap<String, String> {
        let s = self.wait_for(&format!("{n} × {state}"), |s| {
            let rows = s["assignments"].as_array().cloned().unwrap_or_default();
            rows.len() == n && rows.iter().all(|r| r["state"] == state)
        });
        rows_by_id(&s, "container_id")
    }
}

/// A standalone manifest: app `app` of project `p`, one `prod` instance of
/// the busybox test image running `command`.
pub fn app_manifest(app: &str, command: &str) -> String {
    format!(
        "[app]\nname = \"{app}\"\nproject = \"p\"\n[build]\ntype = \"image\"\nimage = \"{}\"\n\
         [env.prod]\ncommand = \"{command}\"\n",
        super::TEST_IMAGE
    )
}

/// The status row of `app`, first by id.
pub fn row<'a>(status: &'a serde_json::Value, app: &str) -> Option<&'a serde_json::Value> {
    status["assignments"]
        .as_array()?
        .iter()
        .find(|r| r["app"] == app)
}

/// id → the string field `field` of every status row.
pub fn rows_by_id(status: &serde_json::Value, field: &str) -> BTreeMap<String, String> {
    status["assignments"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap_or_default().to_owned(),
                r[field].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        self.kill9();
        let table = format!(
            "zattera_{}",
            self.ns.replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        );
        super::remove_host_objects(&self.prefix, &table, self.dir.path());
    }
}

/// A helper process killed (and reaped) when the test ends, pass or fail.
#[derive(Debug)]
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `pids.current` of a container's cgroup (v2, or v1's pids hierarchy),
/// under the agent binary's parent `/zattera/<namespace>`.
pub fn cgroup_pids(namespace: &str, container_id: &str) -> Option<u64> {
    [
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup",
        "/sys/fs/cgroup/unified",
    ]
    .iter()
    .map(|root| {
        Path::new(root)
            .join("zattera")
            .join(namespace)
            .join(container_id)
            .join("pids.current")
    })
    .find_map(|p| std::fs::read_to_string(p).ok())
    .and_then(|t| t.trim().parse().ok())
}

/// TCP sockets process `pid` holds open (an fd, not an orphan) to
/// `ip:port`, from its /proc view.
pub fn tcp_sockets_to(pid: u32, ip: &str, port: u16) -> usize {
    let Ok(addr) = ip.parse::<std::net::Ipv4Addr>() else {
        return 0;
    };
    // /proc/net/tcp prints the address as the raw little-endian word.
    let want = format!("{:08X}:{port:04X}", u32::from_le_bytes(addr.octets()));
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    let inodes: Vec<String> = table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            (cols.get(2) == Some(&want.as_str()) && cols.get(9) != Some(&"0"))
                .then(|| format!("socket:[{}]", cols[9]))
        })
        .collect();
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |fds| {
        fds.flatten()
            .filter(|fd| {
                std::fs::read_link(fd.path())
                    .is_ok_and(|t| inodes.iter().any(|i| *i == t.to_string_lossy()))
            })
            .count()
    })
}
