//! The agent against a test control plane (tests/support/control/): join,
//! mTLS identity, and the AgentSync stream, first with a stand-in executor
//! (no root needed), then end to end with the real executor, containerd and
//! the busybox test image.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "support/control/mod.rs"]
mod control_plane;
#[path = "support/garbage.rs"]
mod garbage;
mod support;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use control_plane::{
    AbortOnDrop, AgentRun, ControlPlane, Record, Route, TestCa, node_api_client, node_context,
    serve, serve_file, serve_node_api,
};
use rustls::pki_types::ServerName;
use tokio::sync::{mpsc, watch};
use zattera_agent::control::join::{JoinError, JoinOptions, join};
use zattera_agent::control::routes::{self, RoutesConfig};
use zattera_agent::control::sync::{self, SyncConfig};
use zattera_agent::executor::{Executor, ExecutorConfig, ExecutorHandle};
use zattera_agent::link::identity::IdentityDir;
use zattera_agent::link::tls::{self, NodeTls};
use zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient;
use zattera_agent::proto::cluster::agent_message::Body;
use zattera_agent::proto::cluster::{
    AgentExecInput, AgentExecStart, AgentHello, AgentListFilesRequest, AgentReadFileRequest,
    AgentRemoveVolumeRequest, AgentTerminalSize, AgentTopRequest, AgentUpgradeRequest,
    AssignmentRuntime, AssignmentSet, Endpoint, InternalPort, InternalService, RouteSnapshot,
    TcpChunk,
};
use zattera_agent::proto::v1::{
    Assignment, AssignmentDesired, InstanceState, LogQuery, LogSelector, Meta, PortSpec, Protocol,
    ServiceSpec, VolumeLease, VolumeMount,
};
use zattera_agent::runtime::{Containerd, containers, import_archive};
use zattera_agent::status::StatusSnapshot;
use zattera_agent::status::{Observation, State};
use zattera_netns::{NetConfig, NetNode};

const SECRET: &str = "join-secret";
const WAIT: Duration = Duration::from_secs(20);

fn options(cp: &ControlPlane, token: String, data: &Path) -> JoinOptions {
    JoinOptions {
        control: cp.address(),
        token,
        data_dir: data.to_owned(),
        node_name: "test-node".into(),
        binary_version: "9.9.9-test".into(),
        mesh: zattera_agent::control::join::MeshJoin::default(),
        control_node_ids: Vec::new(),
        labels: std::collections::BTreeMap::new(),
    }
}

async fn joined(cp: &ControlPlane) -> (tempfile::TempDir, String) {
    let data = tempfile::tempdir().unwrap();
    let e = join(&options(cp, cp.ca.token(SECRET), data.path()))
        .await
        .expect("join");
    (data, e.node_id)
}

/// `Some` once a status frame of `session` reports assignment `id` HEALTHY.
fn healthy_in_session(r: &Record, session: usize, id: &str) -> Option<()> {
    let healthy = InstanceState::Healthy as i32;
    r.frames
        .iter()
        .any(|(s, f)| {
            *s == session
                && matches!(&f.body, Some(Body::Status(b))
                    if b.observed.get(id).is_some_and(|o| o.state == healthy))
        })
        .then_some(())
}

fn hello_of(r: &Record, session: usize) -> Option<AgentHello> {
    r.frames.iter().find_map(|(s, f)| match &f.body {
        Some(Body::Hello(h)) if *s == session => Some(h.clone()),
        _ => None,
    })
}

#[tokio::test]
async fn join_stores_the_identity_and_reenrolls_with_the_same_node() {
    let cp = ControlPlane::start(&[SECRET]).await;
    let data = tempfile::tempdir().unwrap();
    let first = join(&options(&cp, cp.ca.token(SECRET), data.path()))
        .await
        .unwrap();
    assert!(!first.node_id.is_empty());
    assert_eq!(first.control_addr, cp.address());
    assert_eq!(first.registry_addr, "127.0.0.1:5000");

    let ids = IdentityDir::new(data.path());
    let mode = std::fs::metadata(ids.key_path())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "node key mode");
    // The key is ECDSA P-256 and matches the certificate control signed.
    let key_pem = std::fs::read_to_string(ids.key_path()).unwrap();
    let key = rcgen::KeyPair::from_pem(&key_pem).unwrap();
    assert_eq!(key.algorithm(), &rcgen::PKCS_ECDSA_P256_SHA256);
    let stored = ids.load_tls().unwrap();
    let cert = tls::certs_from_pem("node cert", &stored.cert_pem).unwrap();
    assert_eq!(tls::node_id_of(&cert[0]).as_deref(), Some(&*first.node_id));
    assert_eq!(stored.ca_pem, cp.ca.pem.as_bytes());
    assert_eq!(ids.load_enrollment().unwrap(), first);

    let req = cp.with(|r| r.joins[0].clone());
    assert_eq!(req.token_secret, SECRET, "only the secret travels");
    assert!(req.existing_node_id.is_empty());
    assert!(
        String::from_utf8(req.csr_pem)
            .unwrap()
            .contains("BEGIN CERTIFICATE REQUEST")
    );
    assert!(req.capacity.unwrap().cpu_millis >= 1000);
    assert!(req.capacity_disk_mb > 0);
    assert_eq!(req.binary_version, "9.9.9-test");

    // Joining again resumes the record and replaces the key.
    let again = join(&options(&cp, cp.ca.token(SECRET), data.path()))
        .await
        .unwrap();
    assert_eq!(again.node_id, first.node_id);
    let req = cp.with(|r| r.joins[1].clone());
    assert_eq!(req.existing_node_id, first.node_id);
    assert_ne!(std::fs::read_to_string(ids.key_path()).unwrap(), key_pem);
}

/// 44.10: a node moved from the reference agent joins as the node it was:
/// the id in the reference's `<data-dir>/node-id` goes as
/// `existing_node_id`, so control resumes its record and its assignments.
#[tokio::test]
async fn a_join_after_the_reference_agent_resumes_its_node_id() {
    let cp = ControlPlane::start(&[SECRET]).await;
    let data = tempfile::tempdir().unwrap();
    std::fs::write(data.path().join("node-id"), "01JREFERENCENODE0000000001\n").unwrap();
    join(&options(&cp, cp.ca.token(SECRET), data.path()))
        .await
        .unwrap();
    let req = cp.with(|r| r.joins[0].clone());
    assert_eq!(req.existing_node_id, "01JREFERENCENODE0000000001");
    // Not an id: ignored, a first join.
    let other = tempfile::tempdir().unwrap();
    std::fs::write(other.path().join("node-id"), "../../etc\n").unwrap();
    join(&options(&cp, cp.ca.token(SECRET), other.path()))
        .await
        .unwrap();
    assert!(cp.with(|r| r.joins[1].existing_node_id.is_empty()));
}

#[tokio::test]
async fn join_failures_are_typed() {
    let cp = ControlPlane::start(&[SECRET]).await;
    let data = tempfile::tempdir().unwrap();
    let err = join(&options(&cp, cp.ca.token("wrong"), data.path()))
        .await
        .unwrap_err();
    assert!(matches!(err, JoinError::TokenRefused { .. }), "{err}");
    let other = TestCa::new("another-ca");
    let err = join(&options(&cp, other.token(SECRET), data.path()))
        .await
        .unwrap_err();
    assert!(matches!(err, JoinError::PinMismatch { .. }), "{err}");
    let mut gone = options(&cp, cp.ca.token(SECRET), data.path());
    gone.control = free_port_addr().await;
    let err = join(&gone).await.unwrap_err();
    assert!(matches!(err, JoinError::Unreachable { .. }), "{err}");
    // Nothing was stored by the failures.
    assert!(!IdentityDir::new(data.path()).key_path().exists());
}

/// A loopback address nothing listens on.
async fn free_port_addr() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    addr
}

/// Runs `zattera-agent join` and returns (success, stdout, stderr).
fn cli_join(data: &Path, control: &str, token: &str) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_zattera-agent"))
        .args(["--config", "/dev/null", "--data-dir"])
        .arg(data)
        .args(["join", "--control", control, "--token", token])
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Joins `data` with the CLI (off the runtime); returns the node id.
async fn cli_joined(data: &Path, addr: String, token: String) -> String {
    let d = data.to_owned();
    let (ok, _, stderr) = tokio::task::spawn_blocking(move || cli_join(&d, &addr, &token))
        .await
        .unwrap();
    assert!(ok, "join: {stderr}");
    IdentityDir::new(data).load_enrollment().unwrap().node_id
}

#[tokio::test]
async fn join_cli_reports_each_failure_in_one_clear_line() {
    let cp = ControlPlane::start(&[SECRET]).await;
    let data = tempfile::tempdir().unwrap();
    let addr = cp.address();
    let unreachable = free_port_addr().await;
    let other = TestCa::new("another-ca");
    let cases = [
        (
            addr.clone(),
            cp.ca.token("wrong-secret"),
            "refused the join token",
        ),
        (addr.clone(), other.token(SECRET), "failed the CA pin"),
        (unreachable, cp.ca.token(SECRET), "is unreachable"),
        (
            addr.clone(),
            "not-a-token".to_owned(),
            "join token is malformed",
        ),
    ];
    for (control, token, expect) in cases {
        let d = data.path().to_owned();
        let (ok, _, stderr) = tokio::task::spawn_blocking(move || cli_join(&d, &control, &token))
            .await
            .unwrap();
        assert!(!ok, "{expect}: exit status");
        assert_eq!(
            stderr.lines().count(),
            1,
            "{expect}: one line, got {stderr:?}"
        );
        assert!(stderr.contains(expect), "{expect}: {stderr:?}");
        assert!(!stderr.contains(SECRET), "the secret is never printed");
    }
    let d = data.path().to_owned();
    let token = cp.ca.token(SECRET);
    let addr = cp.address();
    let (ok, stdout, stderr) = tokio::task::spawn_blocking(move || cli_join(&d, &addr, &token))
        .await
        .unwrap();
    assert!(ok, "join: {stderr}");
    assert!(stdout.starts_with("joined as node "), "{stdout}");
    assert!(IdentityDir::new(data.path()).load_enrollment().is_ok());
}

/// The sync config of a joined node, with a quick heartbeat.
fn sync_config(cp: &ControlPlane, data: &Path) -> SyncConfig {
    let mut cfg = SyncConfig::load(&cp.address(), data).unwrap();
    cfg.heartbeat = Duration::from_millis(300);
    cfg
}

fn one(id: &str, version: u64, desired: AssignmentDesired) -> AssignmentSet {
    let a = Assignment {
        meta: Some(Meta {
            id: id.into(),
            ..Meta::default()
        }),
        project_id: "proj".into(),
        app_id: "app".into(),
        environment_id: "env".into(),
        desired: desired as i32,
        config_hash: "h1".into(),
        release_id: "r1".into(),
        ..Assignment::default()
    };
    let rt = AssignmentRuntime {
        image_ref: support::TEST_IMAGE.into(),
        spec: Some(ServiceSpec {
            command: "sleep 3600".into(),
            ..ServiceSpec::default()
        }),
        env: BTreeMap::new(),
        subnet_cidr: "10.201.181.0/24".into(),
        volume_lease: None,
    };
    AssignmentSet {
        version,
        assignments: vec![a],
        runtime: BTreeMap::from([(id.to_owned(), rt)]),
    }
}

/// Waits until `rx` holds a value whose version is `version`.
async fn wait_version<T>(
    rx: &mut watch::Receiver<Option<T>>,
    version: u64,
    version_of: impl Fn(&T) -> u64,
    what: &str,
) {
    tokio::time::timeout(WAIT, async {
        loop {
            if rx.borrow_and_update().as_ref().map(&version_of) == Some(version) {
                return;
            }
            rx.changed().await.unwrap();
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} {version} never arrived"));
}

/// Waits until the desired watch holds a set with `version`.
async fn desired_version(rx: &mut watch::Receiver<Option<AssignmentSet>>, version: u64) {
    wait_version(rx, version, |s| s.version, "set version").await;
}

/// 57.11: the first heartbeat goes right after the hello, not one interval
/// later (the reference's first waits 10 s, so control sees no liveness
/// before that), and its proxy map is empty: this node runs no ingress
/// proxy.
#[tokio::test]
async fn the_first_heartbeat_follows_the_hello_with_an_empty_proxy_map() {
    let cp = ControlPlane::start(&[SECRET]).await;
    let (data, _node_id) = joined(&cp).await;
    let mut cfg = sync_config(&cp, data.path());
    cfg.heartbeat = Duration::from_secs(3600);
    let (desired_tx, _) = watch::channel(None);
    let (_, batches_rx) = mpsc::unbounded_channel();
    let _task = AbortOnDrop(
        sync::spawn(cfg, desired_tx, batches_rx, zattera_agent::metrics::none()).unwrap(),
    );
    let (first, second) = cp
        .wait_for("two frames", WAIT, |r| {
            let mut of_session = r
                .frames
                .iter()
                .filter(|(s, _)| *s == 0)
                .map(|(_, f)| f.clone());
            Some((of_session.next()?, of_session.next()?))
        })
        .await;
    assert!(matches!(first.body, Some(Body::Hello(_))), "{first:?}");
    match second.body {
        Some(Body::Heartbeat(hb)) => {
            assert!(hb.proxy.is_empty(), "{hb:?}");
            assert!(hb.memory_total_bytes > 0, "{hb:?}");
        }
        other => panic!("the frame after the hello: {other:?}"),
    }
}

#[tokio::test]
async fn sync_protocol_statuses_acks_and_reconnect() {
    let mut cp = ControlPlane::start(&[SECRET]).await;
    let (data, node_id) = joined(&cp).await;
    let (desired_tx, mut desired_rx) = watch::channel(None);
    let (batches, batches_rx) = mpsc::unbounded_channel();
    let task = sync::spawn(
        sync_config(&cp, data.path()),
        desired_tx,
        batches_rx,
        zattera_agent::metrics::none(),
    )
    .unwrap();
    let _abort = AbortOnDrop(task);

    // Hello first, with the certificate's node id and version 0.
    let hello = cp.wait_for("a hello", WAIT, |r| hello_of(r, 0)).await;
    assert_eq!(hello.node_id, node_id);
    assert_eq!(hello.assignment_version, 0);
    assert_eq!(hello.binary_version, env!("CARGO_PKG_VERSION"));
    let hb = cp
        .wait_for("a heartbeat", WAIT, |r| {
            r.frames.iter().find_map(|(_, f)| match &f.body {
                Some(Body::Heartbeat(h)) => Some(h.clone()),
                _ => None,
            })
        })
        .await;
    assert!(hb.memory_total_bytes > 0 && hb.memory_used_bytes <= hb.memory_total_bytes);
    assert!(hb.disk_total_bytes > 0 && hb.time.is_some());
    assert!((0.0..=100.0).contains(&hb.cpu_percent));

    // A set reaches the executor and is acked.
    cp.push_set(one("a1", 7, AssignmentDesired::Run));
    desired_version(&mut desired_rx, 7).await;
    cp.wait_for("ack 7", WAIT, |r| {
        r.frames
            .iter()
            .any(|(_, f)| matches!(&f.body, Some(Body::Ack(a)) if a.version == 7))
            .then_some(())
    })
    .await;

    // Reports flow in order.
    for state in [State::Pulling, State::Starting, State::Running] {
        batches
            .send(vec![Observation::new("a1", state).container("c1")])
            .unwrap();
    }
    let running = InstanceState::Running as i32;
    cp.wait_for("RUNNING", WAIT, |r| {
        (r.states_of("a1").last() == Some(&running)).then_some(())
    })
    .await;
    let seen = cp.with(|r| r.states_of("a1"));
    assert!(seen.is_sorted(), "states out of order: {seen:?}");

    // A lower version still wins: control's counter is not monotonic.
    let mut lower = one("a1", 3, AssignmentDesired::Run);
    lower.assignments[0].config_hash = "h2".into();
    cp.push_set(lower.clone());
    desired_version(&mut desired_rx, 3).await;
    // A repeat that differs only by version and control's echo of our
    // reports is stored and acked, without waking the executor.
    let mut repeat = lower;
    repeat.version = 9;
    repeat.assignments[0].observed = Some(zattera_agent::proto::v1::AssignmentObserved {
        state: running,
        ..Default::default()
    });
    cp.push_set(repeat);
    cp.wait_for("ack 9", WAIT, |r| {
        r.frames
            .iter()
            .any(|(_, f)| matches!(&f.body, Some(Body::Ack(a)) if a.version == 9))
            .then_some(())
    })
    .await;
    assert!(
        !desired_rx.has_changed().unwrap(),
        "a repeat woke the executor"
    );
    assert_eq!(desired_rx.borrow().as_ref().map(|s| s.version), Some(9));

    // Control goes away; a report made meanwhile waits in the queue.
    cp.stop().await;
    batches
        .send(vec![Observation::new("a1", State::Healthy).container("c1")])
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    cp.restart().await;
    let hello = cp
        .wait_for("a second session", Duration::from_secs(40), |r| {
            hello_of(r, 1)
        })
        .await;
    assert_eq!(hello.assignment_version, 9, "the highest version received");
    cp.wait_for("HEALTHY after the reconnect", WAIT, |r| {
        healthy_in_session(r, 1, "a1")
    })
    .await;
    // Every session starts with its hello.
    cp.with(|r| {
        for s in 0..r.sessions.len() {
            let first = r.frames.iter().find(|(fs, _)| *fs == s).unwrap();
            assert!(matches!(first.1.body, Some(Body::Hello(_))), "session {s}");
        }
    });
}

/// Starts a sync client with `tls` as node `node_id`; returns its task.
fn start_sync(cp: &ControlPlane, data: &Path, node_id: &str, tls: NodeTls) -> AbortOnDrop {
    let mut cfg = sync_config(cp, data);
    cfg.node_id = node_id.into();
    cfg.tls = tls::fixed(tls);
    let (desired_tx, _) = watch::channel(None);
    let (_, batches_rx) = mpsc::unbounded_channel();
    AbortOnDrop(sync::spawn(cfg, desired_tx, batches_rx, zattera_agent::metrics::none()).unwrap())
}

#[tokio::test]
async fn mtls_refuses_foreign_cas_expired_certificates_and_wrong_hellos() {
    let cp = ControlPlane::start(&[SECRET]).await;
    let (data, node_id) = joined(&cp).await;
    let good = IdentityDir::new(data.path()).load_tls().unwrap();
    let other = TestCa::new("another-ca");

    // The agent does not trust a control plane of another CA.
    let mut foreign_server = good.clone();
    foreign_server.ca_pem = other.pem.clone().into_bytes();
    let err = one_session(&cp, &node_id, &foreign_server)
        .await
        .unwrap_err();
    assert!(
        err.contains("invalid peer certificate: UnknownIssuer"),
        "{err}"
    );
    // Control does not accept a node certificate of another CA, nor an
    // expired one of its own: the handshake ends with its alert.
    let foreign_node = cp.ca.node_tls(other.node_identity(&node_id, false));
    let err = one_session(&cp, &node_id, &foreign_node).await.unwrap_err();
    assert!(err.contains("received fatal alert: UnknownCA"), "{err}");
    let expired = cp.ca.node_tls(cp.ca.node_identity(&node_id, true));
    let err = one_session(&cp, &node_id, &expired).await.unwrap_err();
    assert!(
        err.contains("received fatal alert: CertificateExpired"),
        "{err}"
    );
    // A hello naming another node than the certificate is refused.
    let err = one_session(&cp, "someone-else", &good).await.unwrap_err();
    assert!(err.contains("hello names node someone-else"), "{err}");
    assert!(
        cp.with(|r| r.sessions.is_empty()),
        "a session was accepted: {:?}",
        cp.with(|r| r.sessions.clone())
    );
    // The same control plane accepts the real identity at once.
    let _t5 = start_sync(&cp, data.path(), &node_id, good);
    cp.wait_for("the good session", WAIT, |r| hello_of(r, 0))
        .await;
}

/// One sync session as the agent opens one (its TLS client, a hello), up to
/// control's first frame; the whole error chain when it fails.
async fn one_session(cp: &ControlPlane, node_id: &str, node: &NodeTls) -> Result<(), String> {
    use tokio_stream::StreamExt;
    use zattera_agent::proto::cluster::AgentMessage;
    use zattera_agent::proto::cluster::agent_sync_service_client::AgentSyncServiceClient;
    let chain = |e: &dyn std::error::Error| {
        let mut text = e.to_string();
        let mut next = e.source();
        while let Some(cause) = next {
            text = format!("{text}: {cause}");
            next = cause.source();
        }
        text
    };
    let client = tls::node_client(node).map_err(|e| chain(&e))?;
    let channel = tls::connect(&cp.address(), client)
        .await
        .map_err(|e| chain(&e))?;
    let hello = AgentMessage {
        body: Some(Body::Hello(AgentHello {
            node_id: node_id.into(),
            ..AgentHello::default()
        })),
    };
    let mut inbound = AgentSyncServiceClient::new(channel)
        .sync(tokio_stream::iter([hello]).chain(tokio_stream::pending()))
        .await
        .map_err(|e| chain(&e))?
        .into_inner();
    tokio::time::timeout(WAIT, inbound.message())
        .await
        .map_err(|_| "no frame from control".to_owned())?
        .map_err(|e| chain(&e))?
        .map(|_| ())
        .ok_or_else(|| "control closed the stream".to_owned())
}

/// One test's node: the real executor (networking, DNS) fed by the sync
/// client, with its kernel objects removed even when the test fails.
struct Node {
    handle: ExecutorHandle,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    net: Arc<NetNode>,
    _cleanup: support::NetCleanup,
    _dirs: tempfile::TempDir,
}

impl Drop for Node {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Node {
    /// A new control plane and a node joined to it, started and heard
    /// from (its hello); the data directory lives as long as the node.
    async fn start_joined(
        ctd: &Containerd,
        prefix: &str,
    ) -> (ControlPlane, tempfile::TempDir, Self) {
        let cp = ControlPlane::start(&[SECRET]).await;
        let (data, node_id) = joined(&cp).await;
        let node = Self::start(ctd, prefix, &cp, data.path(), &node_id);
        cp.wait_for("the hello", WAIT, |r| hello_of(r, 0)).await;
        (cp, data, node)
    }

    fn start(
        ctd: &Containerd,
        prefix: &str,
        cp: &ControlPlane,
        data: &Path,
        node_id: &str,
    ) -> Self {
        let dirs = tempfile::tempdir().unwrap();
        let run_dir = dirs.path().join("run");
        let (net, dns, cleanup) = support::test_network(ctd, prefix, &run_dir);
        let cfg = ExecutorConfig {
            standalone: false,
            source: format!("control {}", cp.address()),
            ..support::executor_config(ctd, node_id, data, run_dir)
        };
        let (batches_tx, batches_rx) = mpsc::unbounded_channel();
        let (exec, handle) = Executor::new(
            cfg,
            ctd.clone(),
            Some(Arc::clone(&net)),
            Some(Arc::new(dns)),
            Some(batches_tx),
        );
        let exec_task = tokio::spawn(exec.run());
        let (samples, sampler_task) = zattera_agent::metrics::Sampler {
            ctd: ctd.clone(),
            cgroup_parent: format!("/zattera-test/{}", ctd.namespace()),
            status: handle.status.clone(),
            every: Duration::from_millis(300),
            store: None,
        }
        .spawn();
        let sync_task = sync::spawn(
            sync_config(cp, data),
            handle.desired.clone(),
            batches_rx,
            samples,
        )
        .unwrap();
        Self {
            handle,
            tasks: vec![exec_task, sampler_task, sync_task],
            net,
            _cleanup: cleanup,
            _dirs: dirs,
        }
    }

    async fn wait_status(&mut self, what: &str, pred: impl Fn(&StatusSnapshot) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let snap = self.handle.status.borrow_and_update().clone();
            if pred(&snap) {
                return;
            }
            if tokio::time::timeout_at(deadline, self.handle.status.changed())
                .await
                .is_err()
            {
                panic!("timed out waiting for {what}; last status: {snap:#?}");
            }
        }
    }
}

fn rank(state: i32) -> usize {
    [
        InstanceState::Pulling,
        InstanceState::Starting,
        InstanceState::Running,
        InstanceState::Healthy,
    ]
    .iter()
    .position(|s| *s as i32 == state)
    .unwrap_or_else(|| panic!("unexpected state {state} before HEALTHY"))
}

#[tokio::test]
async fn join_then_sync_runs_busybox_to_healthy_and_removes_it() {
    support::on_rig("ctl-e2e", |ctd, rig| async move {
        import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .expect("import the test image");
        let (mut cp, _data, mut node) = Node::start_joined(&ctd, "ztcp").await;

        cp.push_set(one("a1", 1, AssignmentDesired::Run));
        let healthy = InstanceState::Healthy as i32;
        cp.wait_for("HEALTHY at control", Duration::from_secs(60), |r| {
            r.states_of("a1").contains(&healthy).then_some(())
        })
        .await;
        let seen = cp.with(|r| r.states_of("a1"));
        let ranks: Vec<usize> = seen
            .iter()
            .take_while(|s| **s != healthy)
            .map(|s| rank(*s))
            .collect();
        assert!(ranks.is_sorted(), "reports out of order: {seen:?}");
        assert_eq!(
            seen.first(),
            Some(&(InstanceState::Pulling as i32)),
            "{seen:?}"
        );
        assert!(
            seen.contains(&(InstanceState::Starting as i32)),
            "STARTING missing: {seen:?}"
        );
        let report = cp.with(|r| {
            r.frames
                .iter()
                .rev()
                .find_map(|(_, f)| match &f.body {
                    Some(Body::Status(b)) => b.observed.get("a1").cloned(),
                    _ => None,
                })
                .unwrap()
        });
        assert!(!report.container_id.is_empty(), "{report:?}");
        assert!(report.updated_at.is_some());
        node.wait_status("a1 healthy locally", |s| {
            s.assignments
                .iter()
                .any(|a| a.id == "a1" && a.state == State::Healthy)
        })
        .await;
        // Heartbeats carry the instance's resource sample (M-6).
        let sample = cp
            .wait_for("a heartbeat sample of a1", WAIT, |r| {
                r.frames.iter().rev().find_map(|(_, f)| match &f.body {
                    Some(Body::Heartbeat(h)) => h.instances.get("a1").copied(),
                    _ => None,
                })
            })
            .await;
        assert!(sample.memory_bytes > 0, "{sample:?}");
        assert!(sample.cpu_percent >= 0.0, "{sample:?}");

        // Control restarts mid-stream: the agent comes back and resends
        // the latest report, so control's view heals.
        cp.stop().await;
        cp.restart().await;
        cp.wait_for(
            "HEALTHY again after reconnecting",
            Duration::from_secs(40),
            |r| healthy_in_session(r, 1, "a1"),
        )
        .await;

        // STOP: the container goes and STOPPED is reported.
        cp.push_set(one("a1", 2, AssignmentDesired::Stop));
        let stopped = InstanceState::Stopped as i32;
        cp.wait_for("STOPPED at control", Duration::from_secs(60), |r| {
            (r.states_of("a1").last() == Some(&stopped)).then_some(())
        })
        .await;
        // An empty set: nothing is left.
        cp.push_set(AssignmentSet {
            version: 3,
            ..AssignmentSet::default()
        });
        node.wait_status("everything removed", |s| s.assignments.is_empty())
            .await;
        let left = containers::list(&ctd, &[]).await.unwrap();
        assert!(left.is_empty(), "containers left: {left:?}");
        let _ = node.net.remove_rules().await;
    })
    .await;
}

/// Bad input through the stream: a lease naming another node, a payload
/// without an image, and then a malformed frame from control. Each is
/// reported, and the healthy instance is never touched.
#[tokio::test]
async fn bad_input_through_the_stream_disturbs_nothing() {
    support::on_rig_with_image("ctl-bad", |ctd, _rig| async move {
        let (mut cp, _data, mut node) = Node::start_joined(&ctd, "ztcb").await;

        let mut set = one("good", 1, AssignmentDesired::Run);
        set.runtime.get_mut("good").unwrap().subnet_cidr = "10.201.184.0/24".into();
        let mut add = |id: &str, edit: &dyn Fn(&mut AssignmentRuntime)| {
            let mut extra = one(id, 1, AssignmentDesired::Run);
            let mut rt = extra.runtime.remove(id).unwrap();
            rt.subnet_cidr = "10.201.184.0/24".into();
            edit(&mut rt);
            set.assignments.push(extra.assignments.remove(0));
            set.runtime.insert(id.into(), rt);
        };
        add("leased-elsewhere", &|rt| {
            let spec = rt.spec.as_mut().unwrap();
            spec.stateful = true;
            spec.volumes = vec![VolumeMount {
                volume_name: "data".into(),
                mount_path: "/data".into(),
            }];
            rt.volume_lease = Some(VolumeLease {
                node_id: "some-other-node".into(),
                assignment_id: "leased-elsewhere".into(),
                expires_at: None,
            });
        });
        add("no-image", &|rt| rt.image_ref.clear());
        cp.push_set(set);

        let healthy = InstanceState::Healthy as i32;
        cp.wait_for("HEALTHY good", Duration::from_secs(60), |r| {
            r.states_of("good").contains(&healthy).then_some(())
        })
        .await;
        let pending = cp
            .wait_for("PENDING for the foreign lease", WAIT, |r| {
                r.latest_of("leased-elsewhere")
                    .filter(|o| o.state == InstanceState::Pending as i32)
            })
            .await;
        assert!(
            pending.message.contains("leased to another node (some-other-node)"),
            "{pending:?}"
        );
        assert!(pending.container_id.is_empty(), "{pending:?}");
        let failed = cp
            .wait_for("FAILED for the missing image", WAIT, |r| {
                r.latest_of("no-image")
                    .filter(|o| o.state == InstanceState::Failed as i32)
            })
            .await;
        assert!(!failed.message.is_empty(), "{failed:?}");
        let good = cp.with(|r| r.latest_of("good")).unwrap();
        let pid_of = |cid: String| {
            let ctd = ctd.clone();
            async move {
                match containers::task_state(&ctd, &cid).await.unwrap() {
                    containers::TaskState::Running { pid } => pid,
                    other => panic!("good is not running: {other:?}"),
                }
            }
        };
        let pid = pid_of(good.container_id.clone()).await;
        // Only the good instance has a container.
        let listed = containers::list(&ctd, &[]).await.unwrap();
        assert_eq!(listed.len(), 1, "{listed:?}");

        // A control node that answers with a frame that does not decode.
        cp.stop().await;
        let evil = garbage::GarbageControl::start(cp.addr, &cp.ca).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
        while evil.counts().1 == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the agent never reached the malformed control node"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The agent drops that session and dials again: a second hello.
        while evil.counts().0 < 2 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the agent did not reconnect after the malformed frame: {:?}",
                evil.counts()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        evil.stop().await;
        cp.restart().await;
        let sessions = cp.with(|r| r.sessions.len());
        cp.wait_for("a session after the malformed one", Duration::from_secs(60), |r| {
            (r.frames.iter().any(|(s, f)| {
                *s == sessions
                    && matches!(&f.body, Some(Body::Status(b)) if b.observed.get("good").is_some_and(|o| o.state == healthy))
            }))
            .then_some(())
        })
        .await;
        // The same container, the same process: nothing was restarted.
        assert_eq!(
            cp.with(|r| r.latest_of("good")).unwrap().container_id,
            good.container_id
        );
        assert_eq!(pid_of(good.container_id.clone()).await, pid);
        node.wait_status("good still healthy", |s| {
            s.assignments
                .iter()
                .any(|a| a.id == "good" && a.state == State::Healthy)
        })
        .await;
        cp.push_set(AssignmentSet {
            version: 9,
            ..AssignmentSet::default()
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !containers::list(&ctd, &[]).await.unwrap().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "containers left");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let _ = node.net.remove_rules().await;
    })
    .await;
}

fn snapshot(version: u64, vip: &str) -> RouteSnapshot {
    RouteSnapshot {
        version,
        internal_services: vec![InternalService {
            fqdn: "web.prod.shop.internal.".into(),
            project_id: "p1".into(),
            environment_id: "e1".into(),
            vip: vip.into(),
            ports: vec![],
        }],
        ..RouteSnapshot::default()
    }
}

async fn snapshot_version(rx: &mut watch::Receiver<Option<Arc<RouteSnapshot>>>, version: u64) {
    wait_version(rx, version, |s| s.version, "route snapshot").await;
}

#[tokio::test]
async fn route_snapshots_are_persisted_and_served_while_control_is_away() {
    let mut cp = ControlPlane::start(&[SECRET]).await;
    let (data, node_id) = joined(&cp).await;
    let cfg = RoutesConfig {
        control_addr: cp.address(),
        targets: tokio::sync::watch::channel(zattera_agent::link::target::Targets::initial(
            &cp.address(),
        ))
        .1,
        node_id: node_id.clone(),
        tls: tls::fixed(IdentityDir::new(data.path()).load_tls().unwrap()),
        state_file: data.path().join("node/routes.pb"),
    };
    cp.push_routes(snapshot(5, "10.97.0.5"));
    let (tx, mut rx) = watch::channel(None);
    let client = AbortOnDrop(routes::spawn(cfg.clone(), tx).unwrap());
    snapshot_version(&mut rx, 5).await;
    let snap = rx.borrow().clone().unwrap();
    assert_eq!(routes::name_table(&snap).len(), 1);
    let first = cp.with(|r| r.route_watches[0].clone());
    assert_eq!((first.node_id.as_str(), first.have_version), (&*node_id, 0));
    cp.push_routes(snapshot(6, "10.97.0.6"));
    snapshot_version(&mut rx, 6).await;

    // Agent restarted while control is down: the persisted snapshot is
    // served at once.
    drop(client);
    cp.stop().await;
    let (tx, mut rx) = watch::channel(None);
    let _client = AbortOnDrop(routes::spawn(cfg, tx).unwrap());
    snapshot_version(&mut rx, 6).await;
    assert_eq!(
        rx.borrow().as_ref().unwrap().internal_services[0].vip,
        "10.97.0.6"
    );
    // Back online, it tells control what it has.
    cp.restart().await;
    cp.wait_for(
        "a watch with have_version 6",
        Duration::from_secs(40),
        |r| {
            r.route_watches
                .iter()
                .skip(1)
                .any(|w| w.have_version == 6)
                .then_some(())
        },
    )
    .await;
    cp.push_routes(snapshot(7, "10.97.0.7"));
    snapshot_version(&mut rx, 7).await;
}

/// Calls `Top` on the node API; `Err(None)` when no call got through.
async fn call_top(
    addr: &str,
    name: &ServerName<'static>,
    cfg: rustls::ClientConfig,
) -> Result<(), Option<(tonic::Code, String)>> {
    let channel = tls::connect_as(addr, name.clone(), cfg)
        .await
        .map_err(|_| None)?;
    AgentLocalServiceClient::new(channel)
        .top(AgentTopRequest {
            container_id: "c1".into(),
        })
        .await
        .map(|_| ())
        .map_err(|s| Some((s.code(), s.message().to_owned())))
}

fn client_with(ca: &TestCa, identity: Option<(String, String)>) -> rustls::ClientConfig {
    if let Some(identity) = identity {
        return ca.client_tls(identity);
    }
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from(ca.der.clone()))
        .unwrap();
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    cfg
}

#[tokio::test]
async fn node_api_answers_only_cluster_nodes_and_names_missing_capabilities() {
    let cp = ControlPlane::start(&[SECRET]).await;
    let (data, node_id) = joined(&cp).await;
    let node = IdentityDir::new(data.path()).load_tls().unwrap();
    let (addr, _server) = serve_node_api(&node, None).await;
    // Without the mesh the node certificate has no IP SAN: verify it by
    // its DNS SAN.
    let name = ServerName::try_from(format!("node-{node_id}")).unwrap();

    // A control node's certificate: the call reaches the service, which
    // declines naming the capability.
    let control = client_with(&cp.ca, Some(cp.ca.node_identity("control-1", false)));
    let err = call_top(&addr, &name, control).await.unwrap_err().unwrap();
    assert_eq!(err.0, tonic::Code::Unimplemented, "{err:?}");
    assert!(err.1.contains("Top"), "{err:?}");

    // No client certificate, another CA's, an expired one: refused in the
    // handshake. A cluster certificate without a node identity: refused
    // per call.
    let other = TestCa::new("another-ca");
    let refused = [
        ("no certificate", client_with(&cp.ca, None)),
        (
            "another CA",
            client_with(&cp.ca, Some(other.node_identity("control-1", false))),
        ),
        (
            "expired",
            client_with(&cp.ca, Some(cp.ca.node_identity("control-1", true))),
        ),
    ];
    for (what, cfg) in refused {
        match call_top(&addr, &name, cfg).await {
            Err(None) => {}
            Err(Some((code, msg))) => assert!(
                !matches!(
                    code,
                    tonic::Code::Unimplemented | tonic::Code::PermissionDenied
                ),
                "{what}: the call reached the service: {code:?} {msg}"
            ),
            Ok(()) => panic!("{what}: accepted"),
        }
    }
    let (chain, key) = cp.ca.server_identity();
    let err = call_top(&addr, &name, client_with(&cp.ca, Some((chain, key))))
        .await
        .unwrap_err()
        .unwrap();
    assert_eq!(err.0, tonic::Code::PermissionDenied, "{err:?}");
}

/// Runs one Exec session: `first`, then `more` frames, then a half-close.
/// Returns stdout, stderr and the exit code of the final frame.
async fn run_exec(
    api: &mut AgentLocalServiceClient<tonic::transport::Channel>,
    first: AgentExecInput,
    more: &[AgentExecInput],
) -> (String, String, Option<i32>) {
    let frames: Vec<AgentExecInput> = std::iter::once(first).chain(more.iter().cloned()).collect();
    let mut out = tokio::time::timeout(WAIT, api.exec(tokio_stream::iter(frames)))
        .await
        .expect("Exec did not answer")
        .unwrap()
        .into_inner();
    let (mut stdout, mut stderr, mut code) = (Vec::new(), Vec::new(), None);
    while let Some(frame) = tokio::time::timeout(WAIT, out.message())
        .await
        .expect("Exec output stalled")
        .unwrap()
    {
        stdout.extend(frame.stdout);
        stderr.extend(frame.stderr);
        if frame.exited {
            code = Some(frame.exit_code);
        }
    }
    (
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
        code,
    )
}

/// The volume browser: listing, reading and removing stay inside the
/// volume, and errors never show host paths.
#[tokio::test]
async fn node_api_volume_files_stay_inside_the_volume() {
    support::on_rig("ctl-vol", |ctd, _rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let (data, node_id) = joined(&cp).await;
        let node_tls = IdentityDir::new(data.path()).load_tls().unwrap();
        let root = data.path().join("volumes/zt-01JENVIR-data/_data");
        std::fs::create_dir_all(root.join("sub/deeper")).unwrap();
        std::fs::write(root.join("b.txt"), "bee").unwrap();
        std::fs::write(root.join("a.bin"), vec![7u8; 200_000]).unwrap();
        std::fs::write(data.path().join("host-secret"), "do not show").unwrap();
        std::os::unix::fs::symlink(data.path().join("host-secret"), root.join("leak")).unwrap();
        // 56.10: a link to a host path that does not exist.
        std::os::unix::fs::symlink(data.path().join("no-such-file"), root.join("gone")).unwrap();
        let (_tx, desired) = watch::channel(None);
        let ctx = node_context(&ctd, data.path(), &node_id, desired);
        let (addr, _server) = serve_node_api(&node_tls, Some(ctx)).await;
        let control = client_with(&cp.ca, Some(cp.ca.node_identity("control-1", false)));
        let mut api = node_api_client(&addr, &node_id, control).await;
        let list = |path: &str| AgentListFilesRequest {
            environment_id: "01JENVIRONMENT".into(),
            volume_name: "data".into(),
            path: path.into(),
        };
        let listing = api.list_volume_files(list("/")).await.unwrap().into_inner();
        let names: Vec<&str> = listing.files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            ["sub", "a.bin", "b.txt", "gone", "leak"],
            "directories first"
        );
        assert!(!listing.truncated);
        assert_eq!(listing.files[0].mode, "drwxr-xr-x");
        assert_eq!(listing.files[1].size_bytes, 200_000);
        assert!(listing.files[4].mode.starts_with('L'));
        let deeper = api
            .list_volume_files(list("sub/../sub"))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(deeper.files.len(), 1);

        let read = |path: &str| AgentReadFileRequest {
            environment_id: "01JENVIRONMENT".into(),
            volume_name: "data".into(),
            path: path.into(),
        };
        let mut chunks = api
            .read_volume_file(read("/a.bin"))
            .await
            .unwrap()
            .into_inner();
        let mut bytes = Vec::new();
        let mut frames = 0;
        while let Some(c) = chunks.message().await.unwrap() {
            assert!(c.data.len() <= 64 * 1024);
            bytes.extend(c.data);
            frames += 1;
        }
        assert_eq!((bytes.len(), frames), (200_000, 4));

        // Escapes and bad input, each with its code and no host path.
        let host = data.path().display().to_string();
        let leak = api.read_volume_file(read("leak")).await.unwrap_err();
        assert_eq!(leak.code(), tonic::Code::InvalidArgument, "{leak:?}");
        // 56.10: no oracle for host paths. A link out of the volume answers
        // the same whether its target exists or not (the reference says
        // NOT_FOUND for a missing one), for a read and for a listing.
        let gone = api.read_volume_file(read("gone")).await.unwrap_err();
        assert_eq!(
            (gone.code(), gone.message().replace("gone", "leak")),
            (leak.code(), leak.message().to_owned()),
            "a missing host path answers otherwise than an existing one"
        );
        for link in ["leak", "gone"] {
            let listed = api.list_volume_files(list(link)).await.unwrap_err();
            assert_eq!(
                listed.code(),
                tonic::Code::InvalidArgument,
                "{link}: {listed:?}"
            );
        }
        let climbed = api
            .read_volume_file(read("../../../host-secret"))
            .await
            .unwrap_err();
        assert_eq!(
            climbed.code(),
            tonic::Code::NotFound,
            "`..` stops at the root: {climbed:?}"
        );
        let dir = api.read_volume_file(read("sub")).await.unwrap_err();
        assert_eq!(dir.code(), tonic::Code::InvalidArgument);
        let mut bad_name = list("/");
        bad_name.volume_name = "../zt-01JENVIR-data".into();
        let bad = api.list_volume_files(bad_name).await.unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
        let mut other = list("/");
        other.volume_name = "nothing".into();
        let missing = api.list_volume_files(other).await.unwrap_err();
        assert_eq!(missing.code(), tonic::Code::NotFound);
        for e in [&leak, &climbed, &dir, &bad, &missing] {
            assert!(!e.message().contains(&host), "host path in {e:?}");
        }

        // RemoveVolume deletes the volume, the host file the link named stays.
        api.remove_volume(AgentRemoveVolumeRequest {
            environment_id: "01JENVIRONMENT".into(),
            volume_name: "data".into(),
        })
        .await
        .unwrap();
        assert!(!data.path().join("volumes/zt-01JENVIR-data").exists());
        assert!(data.path().join("host-secret").exists());
        // Removing it again is fine.
        api.remove_volume(AgentRemoveVolumeRequest {
            environment_id: "01JENVIRONMENT".into(),
            volume_name: "data".into(),
        })
        .await
        .unwrap();
    })
    .await;
}

/// The agent binary, killed (and its cgroup parents removed) on drop.
struct AgentBin {
    child: std::process::Child,
    cgroup: String,
}

impl Drop for AgentBin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The binary parents containers under /zattera/<namespace>.
        for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
            let _ = std::fs::remove_dir(Path::new(root).join(&self.cgroup));
        }
        if let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") {
            for h in hierarchies.flatten() {
                let _ = std::fs::remove_dir(h.path().join(&self.cgroup));
            }
        }
    }
}

#[tokio::test]
async fn the_binary_joins_and_runs_under_control() {
    support::on_rig_with_image("ctl-bin", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let run_dir = dir.path().join("run");
        let (token, addr) = (cp.ca.token(SECRET), cp.address());
        let node_id = cli_joined(&data, addr, token).await;

        let net_cfg = NetConfig::for_namespace(ctd.namespace().as_str(), &run_dir).unwrap();
        let _cleanup = support::NetCleanup {
            prefix: "ztcq".into(),
            table: net_cfg.nft_table.clone(),
            run_dir: run_dir.clone(),
        };
        let api_addr = free_port_addr().await;
        let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
        let child = cp
            .agent_command(&AgentRun {
                binary: Path::new(&support::agent::run_bin()),
                socket: &rig.socket,
                namespace: ctd.namespace().as_str(),
                run_dir: &run_dir,
                data_dir: &data,
                bridge_prefix: "ztcq",
                api_addr: &api_addr,
            })
            .env("RUST_LOG", "info")
            .stderr(log)
            .spawn()
            .unwrap();
        let _agent = AgentBin {
            child,
            cgroup: format!("zattera/{}", ctd.namespace()),
        };
        let log_path = dir.path().join("agent.log");
        let dump = move || std::fs::read_to_string(&log_path).unwrap_or_default();

        let hello = tokio::time::timeout(
            Duration::from_secs(30),
            cp.wait_for("the binary's hello", Duration::from_secs(30), |r| {
                hello_of(r, 0)
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("no hello; agent log:\n{}", dump()));
        assert_eq!(hello.node_id, node_id);

        // A web instance and a client of another app in an environment of
        // the same name (control gives every app its own environment ids,
        // hence its own subnet and bridge, N-7); strangers in another
        // environment and in another project.
        let mut set = one("b1", 1, AssignmentDesired::Run);
        set.assignments[0].environment_id = "env-web".into();
        {
            let rt = set.runtime.get_mut("b1").unwrap();
            rt.subnet_cidr = "10.201.182.0/24".into();
            rt.env.insert("ZATTERA_ENV".into(), "env".into());
            let spec = rt.spec.as_mut().unwrap();
            spec.command = "httpd -f -p 80 -h /var/www".into();
            spec.ports = vec![PortSpec {
                name: "http".into(),
                container_port: 80,
                protocol: Protocol::Http as i32,
                public_l4_port: 0,
            }];
        }
        for (id, project, env, env_name, slot) in [
            ("c1", "proj", "env-client", "env", 186),
            ("x1", "proj", "env2", "env2", 183),
            ("x2", "other", "env-other", "env", 187),
        ] {
            let mut other = one(id, 1, AssignmentDesired::Run);
            let mut a = other.assignments.remove(0);
            a.project_id = project.into();
            a.app_id = format!("app-{id}");
            a.environment_id = env.into();
            let mut rt = other.runtime.remove(id).unwrap();
            rt.subnet_cidr = format!("10.201.{slot}.0/24");
            rt.env.insert("ZATTERA_ENV".into(), env_name.into());
            // Output for QueryLogs: two lines, then one a second.
            rt.spec.as_mut().unwrap().command =
                "echo hello-from-c1; echo oops-from-c1 >&2; while true; do echo tick; sleep 1; done"
                    .into();
            set.assignments.push(a);
            set.runtime.insert(id.into(), rt);
        }
        cp.push_set(set);
        let healthy = InstanceState::Healthy as i32;
        for id in ["b1", "c1", "x1", "x2"] {
            cp.wait_for(
                &format!("HEALTHY {id} from the binary"),
                Duration::from_secs(60),
                |r| r.states_of(id).contains(&healthy).then_some(()),
            )
            .await;
        }
        let seen = cp.with(|r| r.states_of("b1"));
        assert_eq!(
            seen.first(),
            Some(&(InstanceState::Pulling as i32)),
            "{seen:?}"
        );
        let observed = |id: &str| cp.with(|r| r.latest_of(id)).unwrap();
        let host_port = *observed("b1")
            .mesh_port_bindings
            .get("http")
            .unwrap_or_else(|| panic!("no http binding: {:?}", observed("b1")));

        // Route snapshots are persisted under the data dir.
        cp.push_routes(snapshot(3, "10.97.0.3"));
        let routes_file = IdentityDir::new(&data).dir().join("routes.pb");
        let deadline = tokio::time::Instant::now() + WAIT;
        while routes::load(&routes_file).ok().flatten().map(|s| s.version) != Some(3) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "routes never persisted; agent log:\n{}",
                dump()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        // The web service's VIP, with web's published port as its endpoint
        // (V-4: even a local instance is reached through its host port).
        let mut vip_snapshot = snapshot(4, "10.97.0.9");
        {
            let svc = &mut vip_snapshot.internal_services[0];
            svc.fqdn = "svc.env.proj.internal.".into();
            svc.project_id = "proj".into();
            svc.environment_id = "env-web".into();
            svc.ports = vec![InternalPort {
                name: "http".into(),
                port: 80,
                protocol: "tcp".into(),
                endpoints: vec![Endpoint {
                    assignment_id: "b1".into(),
                    node_id: node_id.clone(),
                    addr: format!("127.0.0.1:{host_port}"),
                    healthy: true,
                    local_hint_node_id_matches: true,
                }],
            }];
        }
        cp.push_routes(vip_snapshot);
        // DNS on the client's gateway answers the service VIP (scope:
        // project id and environment name, D-7).
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let out = std::process::Command::new("dig")
                .args([
                    "+short",
                    "+time=1",
                    "+tries=1",
                    "@10.201.186.1",
                    "svc.internal",
                ])
                .output()
                .unwrap();
            if String::from_utf8_lossy(&out.stdout).trim() == "10.97.0.9" {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "svc.internal never answered the VIP: {}; agent log:\n{}",
                String::from_utf8_lossy(&out.stdout),
                dump()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        // From inside the client: name → VIP → proxy → web's published port.
        let fifo = dir.path().join("fifos");
        let get = |target: &str| zattera_agent::runtime::exec::ExecRequest {
            args: vec![
                "sh".into(),
                "-c".into(),
                format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {target} 80"),
            ],
            timeout: Duration::from_secs(10),
            ..Default::default()
        };
        let client = observed("c1").container_id;
        // Inside the container, the name answers the VIP.
        let lookup = zattera_agent::runtime::exec::exec(
            &ctd,
            &client,
            &fifo,
            &zattera_agent::runtime::exec::ExecRequest {
                args: vec!["nslookup".into(), "svc.internal".into()],
                timeout: Duration::from_secs(10),
                ..Default::default()
            },
        )
        .await
        .unwrap();
        let answer = String::from_utf8_lossy(&lookup.stdout);
        assert!(
            lookup.exit_code == 0 && answer.contains("Address: 10.97.0.9"),
            "nslookup svc.internal in the client: {lookup:?} {answer}"
        );
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let out =
                zattera_agent::runtime::exec::exec(&ctd, &client, &fifo, &get("svc.internal"))
                    .await
                    .unwrap();
            if String::from_utf8_lossy(&out.stdout).ends_with("hello from zattera\n") {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "svc.internal:80 never served the client: {out:?}; agent log:\n{}",
                dump()
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        // Another environment's container, and another project's in an
        // environment of the same name, are refused at the VIP (V-6's
        // deviation: nftables scopes VIPs to the bridges of their scope).
        for id in ["x1", "x2"] {
            let stranger = observed(id).container_id;
            let out = zattera_agent::runtime::exec::exec(&ctd, &stranger, &fifo, &get("10.97.0.9"))
                .await
                .unwrap();
            assert!(
                out.stdout.is_empty() && out.exit_code != 0,
                "{id} reached the VIP: {out:?}"
            );
        }
        let table = std::process::Command::new("nft")
            .args(["list", "set", "inet", &net_cfg.nft_table, "vip_access"])
            .output()
            .unwrap();
        let table = String::from_utf8_lossy(&table.stdout);
        assert!(
            table.contains("\"ztcq182\" . 10.97.0.9")
                && table.contains("\"ztcq186\" . 10.97.0.9")
                && !table.contains("ztcq183")
                && !table.contains("ztcq187"),
            "{table}"
        );

        // The node API serves a control node on the configured address.
        let control = || client_with(&cp.ca, Some(cp.ca.node_identity("control-1", false)));
        let mut api = node_api_client(&api_addr, &node_id, control()).await;
        // Top: web's processes, ps -ef style.
        let web = observed("b1").container_id;
        let top = api
            .top(AgentTopRequest {
                container_id: web.clone(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            top.titles.last().map(String::as_str),
            Some("CMD"),
            "{top:?}"
        );
        assert!(
            top.processes.iter().any(|p| p
                .fields
                .last()
                .is_some_and(|c| c.contains("httpd -f -p 80"))),
            "{top:?}"
        );
        // TOP-2: UID is the host's user name (the container runs as root).
        assert!(
            top.processes.iter().all(|p| p.fields[0] == "root"),
            "{top:?}"
        );
        let empty = api
            .top(AgentTopRequest {
                container_id: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(empty.code(), tonic::Code::InvalidArgument);

        // Stats: the node's series from the sampler's first sample.
        let stats = api
            .stats(zattera_agent::proto::v1::StatsQuery::default())
            .await
            .unwrap()
            .into_inner();
        let metrics: Vec<&str> = stats.series.iter().map(|s| s.metric.as_str()).collect();
        for m in [
            "cpu_percent",
            "disk_total_bytes",
            "memory_total_bytes",
            "net_rx_bytes",
        ] {
            assert!(metrics.contains(&m), "{m} missing: {metrics:?}");
        }
        assert!(metrics.is_sorted(), "{metrics:?}");
        let memory = stats
            .series
            .iter()
            .find(|s| s.metric == "memory_total_bytes")
            .unwrap();
        assert_eq!(memory.labels.get("node"), Some(&node_id));
        assert!(memory.points[0].value > 0.0);

        // QueryLogs: the client's history, both streams, in order.
        let query = |limit: u32, follow: bool| LogQuery {
            selector: Some(LogSelector {
                instance_id: "c1".into(),
                ..LogSelector::default()
            }),
            limit,
            follow,
            ..LogQuery::default()
        };
        let mut history = api.query_logs(query(0, false)).await.unwrap().into_inner();
        let mut lines = Vec::new();
        while let Some(l) = history.message().await.unwrap() {
            lines.push(l);
        }
        assert!(lines.len() >= 2, "{lines:?}");
        // The two streams are captured apart, so only each one's own order
        // is certain: stdout starts with the greeting.
        let stdout: Vec<&str> = lines
            .iter()
            .filter(|l| l.source == zattera_agent::proto::v1::LogSource::Stdout as i32)
            .map(|l| l.line.as_str())
            .collect();
        assert_eq!(stdout.first(), Some(&"hello-from-c1"), "{lines:?}");
        assert!(lines.iter().all(|l| l.instance_id == "c1"));
        assert!(
            lines.iter().any(|l| l.line == "oops-from-c1"
                && l.source == zattera_agent::proto::v1::LogSource::Stderr as i32),
            "{lines:?}"
        );
        // With follow, new lines keep coming after the newest one.
        let mut follow = api.query_logs(query(1, true)).await.unwrap().into_inner();
        let first = follow.message().await.unwrap().unwrap();
        let at =
            |l: &zattera_agent::proto::v1::LogLine| l.time.as_ref().map(|t| (t.seconds, t.nanos));
        let next = tokio::time::timeout(WAIT, async {
            loop {
                let l = follow.message().await.unwrap().unwrap();
                if at(&l) > at(&first) {
                    return l;
                }
            }
        })
        .await
        .expect("no new line while following");
        assert_eq!(next.line, "tick");
        drop(follow);
        // Another instance's selector: nothing, at once.
        let mut none = api
            .query_logs(LogQuery {
                selector: Some(LogSelector {
                    instance_id: "nobody".into(),
                    ..LogSelector::default()
                }),
                ..LogQuery::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert!(none.message().await.unwrap().is_none());
        // An empty selector, as the reference answers it (57.9): every
        // instance of the current set, the newest `limit` lines of all, in
        // time order.
        let unfiltered = |limit: u32| {
            let mut api = api.clone();
            async move {
                let mut all = api
                    .query_logs(LogQuery {
                        limit,
                        ..LogQuery::default()
                    })
                    .await
                    .unwrap()
                    .into_inner();
                let mut lines = Vec::new();
                while let Some(l) = all.message().await.unwrap() {
                    lines.push(l);
                }
                lines
            }
        };
        let newest = unfiltered(3).await;
        assert_eq!(newest.len(), 3, "{newest:?}");
        assert!(newest.is_sorted_by_key(at), "{newest:?}");
        let every = unfiltered(1000).await;
        let instances: std::collections::BTreeSet<&str> =
            every.iter().map(|l| l.instance_id.as_str()).collect();
        for id in ["c1", "x1", "x2"] {
            assert!(instances.contains(id), "{id} missing: {instances:?}");
        }
        assert!(
            instances
                .iter()
                .all(|i| ["b1", "c1", "x1", "x2"].contains(i)),
            "{instances:?}"
        );

        // Exec: stdin in the first frame, both streams, the exit code.
        let start = |cmd: &[&str], tty: bool| AgentExecStart {
            container_id: client.clone(),
            command: cmd.iter().map(|s| (*s).to_owned()).collect(),
            tty,
            initial_size: tty.then_some(AgentTerminalSize {
                cols: 100,
                rows: 40,
            }),
        };
        let got = run_exec(
            &mut api,
            AgentExecInput {
                start: Some(start(
                    &["sh", "-c", "read x; echo got-$x; echo err >&2; exit 3"],
                    false,
                )),
                stdin: b"hello\n".to_vec(),
                resize: None,
            },
            &[],
        )
        .await;
        assert_eq!(
            got,
            ("got-hello\n".into(), "err\n".into(), Some(3)),
            "{got:?}"
        );
        // Later stdin frames, then a half-close: the process sees EOF and ends.
        let later = AgentExecInput {
            stdin: b"abc".to_vec(),
            ..AgentExecInput::default()
        };
        let got = run_exec(
            &mut api,
            AgentExecInput {
                start: Some(start(&["cat"], false)),
                ..AgentExecInput::default()
            },
            &[later],
        )
        .await;
        assert_eq!(got, ("abc".into(), String::new(), Some(0)), "{got:?}");
        // A terminal of the asked size.
        let got = run_exec(
            &mut api,
            AgentExecInput {
                start: Some(start(&["stty", "size"], true)),
                ..AgentExecInput::default()
            },
            &[],
        )
        .await;
        assert_eq!(got.0.trim(), "40 100", "{got:?}");
        assert_eq!(got.2, Some(0));
        // A resize in a later frame reaches the terminal before the stdin
        // of the same frame (57.11).
        let resize = AgentExecInput {
            resize: Some(AgentTerminalSize {
                cols: 120,
                rows: 30,
            }),
            stdin: b"go\n".to_vec(),
            ..AgentExecInput::default()
        };
        let got = run_exec(
            &mut api,
            AgentExecInput {
                start: Some(start(&["sh", "-c", "read x; stty size"], true)),
                ..AgentExecInput::default()
            },
            &[resize],
        )
        .await;
        assert_eq!(got.0.trim().lines().last(), Some("30 120"), "{got:?}");
        assert_eq!(got.2, Some(0));
        // A runtime failure is reported in the last frame, and the call is OK.
        let mut gone = start(&["true"], false);
        gone.container_id = "no-such-container".into();
        let got = run_exec(
            &mut api,
            AgentExecInput {
                start: Some(gone),
                ..AgentExecInput::default()
            },
            &[],
        )
        .await;
        assert_eq!(got.2, Some(-1), "EX-5: {got:?}");
        assert!(got.1.contains("no-such-container"), "{got:?}");
        let mut no_id = start(&["true"], false);
        no_id.container_id.clear();
        let err = api
            .exec(tokio_stream::iter(vec![AgentExecInput {
                start: Some(no_id),
                ..AgentExecInput::default()
            }]))
            .await
            .map(|_| ())
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");

        // ProxyTCP: control's port-forward leg to web's published port.
        let (tx, rx) = mpsc::channel(4);
        tx.send(TcpChunk {
            dial_addr: format!("127.0.0.1:{host_port}"),
            data: b"GET / HTTP/1.0\r\n\r\n".to_vec(),
        })
        .await
        .unwrap();
        let mut back = api
            .proxy_tcp(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut body = Vec::new();
        while let Some(chunk) = back.message().await.unwrap() {
            body.extend(chunk.data);
        }
        drop(tx);
        assert!(
            String::from_utf8_lossy(&body).ends_with("hello from zattera\n"),
            "{}",
            String::from_utf8_lossy(&body)
        );
        // Never a dial to another machine (TEST-NET-1: refused before dialing).
        let (tx, rx) = mpsc::channel(1);
        tx.send(TcpChunk {
            dial_addr: "192.0.2.1:80".into(),
            data: Vec::new(),
        })
        .await
        .unwrap();
        let refused = match api
            .proxy_tcp(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
        {
            Err(s) => s,
            Ok(r) => r.into_inner().message().await.unwrap_err(),
        };
        assert_eq!(refused.code(), tonic::Code::PermissionDenied, "{refused:?}");

        // An empty set removes everything.
        cp.push_set(AssignmentSet {
            version: 2,
            ..AssignmentSet::default()
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let left = containers::list(&ctd, &[]).await.unwrap();
            if left.is_empty() {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "containers left: {left:?}; agent log:\n{}",
                dump()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
}

/// UpgradeBinary end to end: refusals install nothing; a good download
/// replaces the binary, the agent re-executes itself (same pid), reconnects,
/// and its container keeps running untouched.
#[tokio::test]
async fn the_binary_upgrades_itself_and_keeps_its_containers() {
    use sha2::Digest;
    use std::io::Write;
    support::on_rig_with_image("ctl-upg", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let dir = tempfile::tempdir().unwrap();
        let (data, run_dir) = (dir.path().join("data"), dir.path().join("run"));
        let (token, addr) = (cp.ca.token(SECRET), cp.address());
        let node_id = cli_joined(&data, addr, token).await;
        // The agent runs from a copy: the upgrade replaces that file only.
        let binary = dir.path().join("bin/zattera-agent");
        std::fs::create_dir_all(binary.parent().unwrap()).unwrap();
        std::fs::copy(env!("CARGO_BIN_EXE_zattera-agent"), &binary).unwrap();
        // An ELF runs the same with bytes appended: the marker shows which
        // file is installed. Files, not memory: a debug build is ~300 MB.
        let upgraded = dir.path().join("upgraded");
        std::fs::copy(&binary, &upgraded).unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&upgraded)
            .unwrap()
            .write_all(b"\nzattera-upgrade-marker\n")
            .unwrap();
        let file_digest = |p: &Path| {
            let mut h = sha2::Sha256::new();
            std::io::copy(&mut std::fs::File::open(p).unwrap(), &mut h).unwrap();
            hex::encode(h.finalize())
        };
        let original = file_digest(&binary);
        let digest = file_digest(&upgraded);
        // What is not an agent: a script, and a program that is not this one.
        let script = dir.path().join("script");
        std::fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
        let other = dir.path().join("other");
        std::fs::copy("/bin/true", &other).unwrap();
        // The release on a CDN (another origin) that the base redirects to.
        let (cdn, _cdn) = serve_file("/cdn/zattera-agent", upgraded.clone()).await;
        let (http, _http) = serve(
            [
                ("/releases/zattera-agent", Route::File(upgraded.clone())),
                ("/elsewhere/zattera-agent", Route::File(upgraded.clone())),
                ("/releases/script", Route::File(script.clone())),
                ("/releases/other", Route::File(other.clone())),
                (
                    "/releases/via-cdn",
                    Route::Redirect(format!("http://{cdn}/cdn/zattera-agent")),
                ),
            ]
            .into_iter()
            .map(|(p, r)| (p.to_owned(), r))
            .collect(),
        )
        .await;

        let net_cfg = NetConfig::for_namespace(ctd.namespace().as_str(), &run_dir).unwrap();
        let _cleanup = support::NetCleanup {
            prefix: "ztcu".into(),
            table: net_cfg.nft_table.clone(),
            run_dir: run_dir.clone(),
        };
        let api_addr = free_port_addr().await;
        let log_path = dir.path().join("agent.log");
        let child = cp
            .agent_command(&AgentRun {
                binary: &binary,
                socket: &rig.socket,
                namespace: ctd.namespace().as_str(),
                run_dir: &run_dir,
                data_dir: &data,
                bridge_prefix: "ztcu",
                api_addr: &api_addr,
            })
            .args(["--upgrade-base-url", &format!("http://{http}/releases/")])
            .env("RUST_LOG", "info")
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .unwrap();
        let agent_pid = child.id();
        let _agent = AgentBin {
            child,
            cgroup: format!("zattera/{}", ctd.namespace()),
        };
        let dump = move || std::fs::read_to_string(&log_path).unwrap_or_default();
        cp.wait_for("the hello", Duration::from_secs(30), |r| hello_of(r, 0))
            .await;
        let mut set = one("u1", 1, AssignmentDesired::Run);
        set.runtime.get_mut("u1").unwrap().subnet_cidr = "10.201.185.0/24".into();
        cp.push_set(set);
        let healthy = InstanceState::Healthy as i32;
        cp.wait_for("HEALTHY u1", Duration::from_secs(60), |r| {
            r.states_of("u1").contains(&healthy).then_some(())
        })
        .await;
        let cid = cp.with(|r| r.latest_of("u1")).unwrap().container_id;
        let task_pid = || {
            let ctd = ctd.clone();
            let cid = cid.clone();
            async move {
                match containers::task_state(&ctd, &cid).await.unwrap() {
                    containers::TaskState::Running { pid } => pid,
                    other => panic!("u1 is not running: {other:?}"),
                }
            }
        };
        let before = task_pid().await;

        let control = client_with(&cp.ca, Some(cp.ca.node_identity("control-1", false)));
        let mut api = node_api_client(&api_addr, &node_id, control).await;
        let request = |url: String, sha256: &str| AgentUpgradeRequest {
            version: "9.9.9".into(),
            url,
            sha256: sha256.into(),
        };
        let good_url = format!("http://{http}/releases/zattera-agent");
        let refusals = [
            // Neither a version nor a URL.
            (
                AgentUpgradeRequest {
                    version: String::new(),
                    url: String::new(),
                    sha256: digest.clone(),
                },
                tonic::Code::InvalidArgument,
            ),
            // A version alone: this node's channel, which has none of it.
            (request(String::new(), &digest), tonic::Code::NotFound),
            // A URL outside the base is never fetched: this node looks for
            // its own build of the version in its channel, which has none.
            (
                request(format!("http://{http}/elsewhere/zattera-agent"), &digest),
                tonic::Code::NotFound,
            ),
            (
                request(good_url.clone(), &"0".repeat(64)),
                tonic::Code::DataLoss,
            ),
            // 44.6: compared parsed and normalised, not as strings.
            (
                request(
                    format!("http://{http}/releases/../elsewhere/zattera-agent"),
                    &digest,
                ),
                tonic::Code::NotFound,
            ),
            (
                request(
                    format!("http://{http}/releases/%2e%2e/elsewhere/zattera-agent"),
                    &digest,
                ),
                tonic::Code::NotFound,
            ),
            // 44.6: the staged file must be this agent.
            (
                request(
                    format!("http://{http}/releases/script"),
                    &file_digest(&script),
                ),
                tonic::Code::FailedPrecondition,
            ),
            (
                request(
                    format!("http://{http}/releases/other"),
                    &file_digest(&other),
                ),
                tonic::Code::FailedPrecondition,
            ),
        ];
        for (req, code) in refusals {
            let err = api.upgrade_binary(req).await.unwrap_err();
            assert_eq!(err.code(), code, "{err:?}");
            assert_eq!(
                file_digest(&binary),
                original,
                "{err:?} installed something"
            );
        }

        // A downgrade (control's rollback), redirected to another origin:
        // installs.
        let sessions = cp.with(|r| r.sessions.len());
        let mut rollback = request(
            format!("http://{http}/releases/via-cdn"),
            &digest.to_uppercase(),
        );
        rollback.version = "0.0.1".into();
        let reply = api
            .upgrade_binary(rollback)
            .await
            .unwrap_or_else(|e| panic!("upgrade: {e:?}; agent log:\n{}", dump()))
            .into_inner();
        assert_eq!(reply.staged_version, "0.0.1");
        assert_eq!(reply.previous_version, env!("CARGO_PKG_VERSION"));
        assert_eq!(file_digest(&binary), digest);
        // The same process re-executes the new file and says hello again.
        cp.wait_for("a hello after the restart", Duration::from_secs(40), |r| {
            hello_of(r, sessions)
        })
        .await;
        let exe = std::fs::read_link(format!("/proc/{agent_pid}/exe")).unwrap();
        assert_eq!(exe, binary, "the agent runs the installed file");
        cp.wait_for(
            "HEALTHY u1 after the restart",
            Duration::from_secs(40),
            |r| {
                r.frames
                    .iter()
                    .any(|(s, f)| {
                        *s >= sessions
                            && matches!(&f.body, Some(Body::Status(b))
                            if b.observed.get("u1").is_some_and(|o| o.state == healthy))
                    })
                    .then_some(())
            },
        )
        .await;
        assert_eq!(task_pid().await, before, "the container was restarted");
        assert_eq!(cp.with(|r| r.latest_of("u1")).unwrap().container_id, cid);

        cp.push_set(AssignmentSet {
            version: 5,
            ..AssignmentSet::default()
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !containers::list(&ctd, &[]).await.unwrap().is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "containers left; agent log:\n{}",
                dump()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
}

/// An OOM kill under a control plane reaches it on the sync stream as
/// FAILED "out of memory (limit N MiB)", the restart counted (17.3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oom_kill_reaches_control_as_failed_out_of_memory() {
    support::on_rig_with_image("ctl-oom", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let agent = control_plane::ControlledAgent::start(
            &cp,
            SECRET,
            &rig,
            ctd.namespace().as_str(),
            "ztlf",
        )
        .await;
        // dd is PID 1 and asks for a 64 MiB buffer under 16.
        let (a, mut rt) = control_plane::assignment(
            "oom1",
            "env",
            235,
            "exec dd if=/dev/zero of=/dev/null bs=64M count=1",
        );
        rt.spec.as_mut().unwrap().resources = Some(zattera_agent::proto::v1::ResourceLimits {
            memory_mb: 16,
            ..Default::default()
        });
        cp.push_set(control_plane::set_of(1, vec![(a, rt)]));
        let failed = InstanceState::Failed as i32;
        let oom = |restarts: u32| {
            move |r: &Record| {
                r.latest_of("oom1").filter(|o| {
                    o.state == failed
                        && o.message == "out of memory (limit 16 MiB)"
                        && o.restarts >= restarts
                })
            }
        };
        cp.wait_for(
            "FAILED out of memory on the stream",
            Duration::from_secs(60),
            oom(0),
        )
        .await;
        let again = cp
            .wait_for(
                "out of memory again, counted",
                Duration::from_secs(60),
                oom(1),
            )
            .await;
        assert!(
            again.restarts >= 1,
            "{again:?}; agent log:\n{}",
            agent.log()
        );
    })
    .await;
}

/// Stats on `agent`'s node API as `caller`: Ok, or the refusal's code.
async fn stats(
    agent: &control_plane::ControlledAgent,
    cp: &ControlPlane,
    caller: &str,
) -> Result<(), tonic::Code> {
    agent
        .api_as(cp, caller)
        .await
        .stats(zattera_agent::proto::v1::StatsQuery::default())
        .await
        .map(|_| ())
        .map_err(|e| e.code())
}

/// Issue 44.2: a cluster without the mesh sends no peer set (as the
/// reference's control plane), and its API certificates carry no node id,
/// so nothing names control's nodes. The node API then refuses everyone:
/// `join`, `doctor`, `status` and the log say so and name the key. A control
/// node named at `join --control-node-id` may call; a worker may not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_meshless_cluster_names_its_control_nodes_at_join() {
    let Some(rig) = support::rig() else { return };
    let cp = ControlPlane::start(&[SECRET]).await;
    cp.without_initial_peers();
    let cp = &cp;
    let text = |o: std::process::Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    support::with_namespace(&rig, "ctl-meshless", |ctd, rig| async move {
        let unnamed = control_plane::ControlledAgent::start(
            cp,
            SECRET,
            &rig,
            ctd.namespace().as_str(),
            "ztln",
        )
        .await;
        let doctor = text(unnamed.cli(&["doctor"]));
        assert!(
            doctor.contains("node API")
                && doctor.contains("refuses every caller")
                && doctor.contains("control-node-ids"),
            "{doctor}"
        );
        let deadline = std::time::Instant::now() + WAIT;
        let mut status = String::new();
        while std::time::Instant::now() < deadline && !status.contains("refuses every caller") {
            status = text(unnamed.cli(&["status"]));
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(
            status.contains("refuses every caller") && status.contains("control-node-ids"),
            "{status}"
        );
        assert_eq!(
            stats(&unnamed, cp, control_plane::CONTROL_NODE_ID).await,
            Err(tonic::Code::PermissionDenied)
        );
        assert!(
            unnamed.log().contains("refuses every caller"),
            "{}",
            unnamed.log()
        );
    })
    .await;
    support::with_namespace(&rig, "ctl-meshless-named", |ctd, rig| async move {
        let named = control_plane::ControlledAgent::start_with(
            cp,
            SECRET,
            &rig,
            ctd.namespace().as_str(),
            "ztlo",
            control_plane::AgentFlags {
                join: &["--control-node-id", "ctl-x"],
                ..control_plane::AgentFlags::default()
            },
        )
        .await;
        let doctor = text(named.cli(&["doctor"]));
        assert!(doctor.contains("control-plane callers: ctl-x"), "{doctor}");
        assert_eq!(stats(&named, cp, "ctl-x").await, Ok(()));
        let worker = named.node_id.clone();
        assert_eq!(
            stats(&named, cp, &worker).await,
            Err(tonic::Code::PermissionDenied)
        );
        let status = text(named.cli(&["status"]));
        assert!(!status.contains("refuses every caller"), "{status}");
    })
    .await;
}
