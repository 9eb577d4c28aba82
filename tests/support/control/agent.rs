//! The agent binary under the test control plane.

use super::*;

/// `zattera-agent join` (the binary under test) into `data`; panics with
/// its stderr when it fails.
pub fn join_cli(data: &std::path::Path, control: &str, token: &str, extra: &[&str]) {
    let join = std::process::Command::new(crate::support::agent::run_bin())
        .args(["--config", "/dev/null", "--data-dir"])
        .arg(data)
        .args(["join", "--control", control, "--token", token])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        join.status.success(),
        "join: {}",
        String::from_utf8_lossy(&join.stderr)
    );
}

/// A new control plane accepting `secret` and an agent joined to it, run
/// in `ctd`'s namespace with bridge prefix `prefix` and extra `run` flags.
pub async fn controlled_agent(
    secret: &str,
    rig: &crate::support::Rig,
    ctd: &zattera_agent::runtime::Containerd,
    prefix: &str,
    run: &[&str],
) -> (ControlPlane, ControlledAgent) {
    let cp = ControlPlane::start(&[secret]).await;
    let flags = AgentFlags {
        run,
        ..AgentFlags::default()
    };
    let ns = ctd.namespace().as_str();
    let agent = ControlledAgent::start_with(&cp, secret, rig, ns, prefix, flags).await;
    (cp, agent)
}

/// What [`ControlledAgent::start_with`] adds to a plain join and run.
#[derive(Default)]
pub struct AgentFlags<'a> {
    /// Extra `join` flags.
    pub join: &'a [&'a str],
    /// Extra `run` flags.
    pub run: &'a [&'a str],
    /// Run with (data dir, node id) between the join and the agent's start.
    pub prepare: Option<Prepare<'a>>,
    /// Run this binary instead of the one cargo built (a copy an upgrade
    /// may replace).
    pub binary: Option<&'a std::path::Path>,
}

/// A step run on a joined node's (data dir, node id) before it starts.
pub type Prepare<'a> = Box<dyn FnOnce(&std::path::Path, &str) + 'a>;

/// The real agent binary joined to a test control plane and running under
/// it, with its node API on a loopback port. Killed, and its cgroup parent
/// removed, when dropped.
pub struct ControlledAgent {
    pub child: std::process::Child,
    /// Before `dir`: its netns pins are unmounted before the dir goes.
    net: crate::support::NetCleanup,
    pub dir: tempfile::TempDir,
    pub node_id: String,
    pub api_addr: String,
    pub namespace: String,
    /// What it runs, and the extra `run` flags (again at a restart).
    binary: std::path::PathBuf,
    run_args: Vec<String>,
}

impl ControlledAgent {
    /// Joins with token `secret` (one `cp` accepts) and starts the agent.
    pub async fn start(
        cp: &ControlPlane,
        secret: &str,
        rig: &crate::support::Rig,
        namespace: &str,
        prefix: &str,
    ) -> Self {
        Self::start_with(cp, secret, rig, namespace, prefix, AgentFlags::default()).await
    }

    /// [`Self::start`] with `flags`.
    pub async fn start_with(
        cp: &ControlPlane,
        secret: &str,
        rig: &crate::support::Rig,
        namespace: &str,
        prefix: &str,
        flags: AgentFlags<'_>,
    ) -> Self {
        let AgentFlags {
            join,
            run,
            prepare,
            binary,
        } = flags;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let run_dir = dir.path().join("run");
        let bin = binary.map_or_else(
            || std::path::PathBuf::from(crate::support::agent::run_bin()),
            std::path::Path::to_path_buf,
        );
        join_cli(&data, &cp.address(), &cp.ca.token(secret), join);
        let node_id = zattera_agent::link::identity::IdentityDir::new(&data)
            .load_enrollment()
            .unwrap()
            .node_id;
        if let Some(prepare) = prepare {
            prepare(&data, &node_id);
        }
        let net_cfg = zattera_netns::NetConfig::for_namespace(namespace, &run_dir).unwrap();
        let net = crate::support::NetCleanup {
            prefix: prefix.into(),
            table: net_cfg.nft_table.clone(),
            run_dir: run_dir.clone(),
        };
        let api_addr = free_loopback_addr().await;
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let child = cp
            .agent_command(&AgentRun {
                binary: &bin,
                socket: &rig.socket,
                namespace,
                run_dir: &run_dir,
                data_dir: &data,
                bridge_prefix: prefix,
                api_addr: &api_addr,
            })
            .args(run)
            .env("RUST_LOG", "info")
            .stderr(log)
            .spawn()
            .unwrap();
        Self {
            child,
            dir,
            node_id,
            api_addr,
            namespace: namespace.into(),
            net,
            binary: bin,
            run_args: run.iter().map(|a| (*a).to_owned()).collect(),
        }
    }

    pub fn data_dir(&self) -> std::path::PathBuf {
        self.dir.path().join("data")
    }

    /// The agent binary with this agent's directories, running `args`.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        std::process::Command::new(crate::support::agent::run_bin())
            .args(["--config", "/dev/null", "--data-dir"])
            .arg(self.data_dir())
            .arg("--run-dir")
            .arg(self.dir.path().join("run"))
            .args(args)
            .output()
            .unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }

    /// What stops this agent's buildkitd and removes its namespaces.
    pub fn buildkitd_cleanup(&self, socket: &std::path::Path) -> BuildkitdCleanup {
        let worker = zattera_agent::image_build::buildkit::worker_namespace(&self.namespace);
        BuildkitdCleanup {
            pid_file: self.dir.path().join("run/buildkit/buildkitd.pid"),
            socket: socket.to_owned(),
            namespaces: vec![
                format!("{worker}_history"),
                worker,
                format!("{}_history", self.namespace),
            ],
        }
    }

    /// SIGKILLs the agent and starts it again on the same dirs and address.
    pub fn kill9_and_restart(&mut self, cp: &ControlPlane, rig: &crate::support::Rig) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let log = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.path().join("agent.log"))
            .unwrap();
        self.child = cp
            .agent_command(&AgentRun {
                binary: &self.binary,
                socket: &rig.socket,
                namespace: &self.namespace,
                run_dir: &self.dir.path().join("run"),
                data_dir: &self.data_dir(),
                bridge_prefix: &self.net.prefix,
                api_addr: &self.api_addr,
            })
            .args(&self.run_args)
            .env("RUST_LOG", "info")
            .stderr(log)
            .spawn()
            .unwrap();
    }

    /// Polls `status --json` until `done` holds (90 s).
    pub fn wait_for(
        &self,
        what: &str,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        let mut last = None;
        while std::time::Instant::now() < deadline {
            let out = std::process::Command::new(crate::support::agent::BIN)
                .arg("--run-dir")
                .arg(self.dir.path().join("run"))
                .args(["status", "--json"])
                .output()
                .unwrap();
            if let Ok(s) = serde_json::from_slice::<serde_json::Value>(&out.stdout) {
                if done(&s) {
                    return s;
                }
                last = Some(s);
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        panic!(
            "not {what} within 90 s; last status {last:#?}\nagent log:\n{}",
            self.log()
        );
    }

    /// A node API client presenting a certificate for `caller`.
    pub async fn api_as(
        &self,
        cp: &ControlPlane,
        caller: &str,
    ) -> zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient<
        tonic::transport::Channel,
    > {
        let cfg = cp.ca.client_tls(cp.ca.node_identity(caller, false));
        let name =
            rustls::pki_types::ServerName::try_from(format!("node-{}", self.node_id)).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match tls::connect_as(&self.api_addr, name.clone(), cfg.clone()).await {
                Ok(channel) => {
                    return zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient::new(channel);
                }
                Err(e) if std::time::Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!(
                    "node API at {}: {e}; agent log:\n{}",
                    self.api_addr,
                    self.log()
                ),
            }
        }
    }
}

impl Drop for ControlledAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
