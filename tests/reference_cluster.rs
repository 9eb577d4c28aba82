//! Issue 57: a node the reference cluster can operate. The real agent
//! binary under the test control plane, which plays the reference's own
//! operations as its code does them (support/control/operations.rs and the
//! node records of support/control/plane.rs): labels that a join rewrites,
//! a control-role grant, the endpoints a join advertises, the upgrade
//! rollout of `zt cluster upgrade`, and a node moved from the reference
//! agent with its enrollment and its Docker volumes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/control/mod.rs"]
mod control_plane;
mod support;

use std::time::Duration;

use control_plane::{AgentFlags, ControlPlane, ControlledAgent};
use support::on_rig_with_image;
use zattera_agent::control::join::{JoinError, JoinOptions, MeshJoin, join};
use zattera_agent::link::identity::IdentityDir;
use zattera_agent::proto::v1::NodeRole;

const SECRET: &str = "reference-secret";
const WAIT: Duration = Duration::from_secs(60);

fn options(cp: &ControlPlane, data: &std::path::Path, mesh: MeshJoin) -> JoinOptions {
    JoinOptions {
        control: cp.address(),
        token: cp.ca.token(SECRET),
        data_dir: data.to_owned(),
        node_name: "ref-node".into(),
        binary_version: "9.9.9-test".into(),
        mesh,
        control_node_ids: Vec::new(),
        labels: std::collections::BTreeMap::new(),
    }
}

/// 57.4: a label set with `zt nodes label` and a cordon, between two starts
/// of an agent that keeps its join token, survive the restart: the agent
/// does not join again (each join makes the reference rewrite the record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_and_a_cordon_set_between_two_starts_survive() {
    on_rig_with_image("ref-label", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let token = cp.ca.token(SECRET);
        let run = ["--join-token", token.as_str()];
        let mut agent = ControlledAgent::start_with(
            &cp,
            SECRET,
            &rig,
            ctd.namespace().as_str(),
            "ztra",
            AgentFlags {
                run: &run,
                ..AgentFlags::default()
            },
        )
        .await;
        let node = agent.node_id.clone();
        cp.wait_for("the first session", WAIT, |r| {
            (r.sessions_of(&node) == 1).then_some(())
        })
        .await;
        let joins = cp.with(|r| r.joins.len());
        assert_eq!(joins, 1, "the join itself");
        cp.label_node(&node, "zone", "a");
        cp.set_schedulable(&node, false);

        agent.kill9_and_restart(&cp, &rig);
        cp.wait_for("a session after the restart", WAIT, |r| {
            (r.sessions_of(&node) == 2).then_some(())
        })
        .await;
        // A renewal that would be due is not: a year-long certificate.
        assert_eq!(
            cp.with(|r| r.joins.len()),
            joins,
            "the restart joined again"
        );
        let record = cp.node_record(&node).unwrap();
        assert_eq!(
            record.labels.get("zone").map(String::as_str),
            Some("a"),
            "{record:?}"
        );
        assert!(!record.schedulable, "the cordon was undone: {record:?}");
    })
    .await;
}

/// 57.6: a control-role token: the join is refused with a message that
/// says to use a worker token, and nothing of it is kept.
#[tokio::test]
async fn a_control_role_grant_is_refused_and_nothing_is_kept() {
    let cp = ControlPlane::start(&[SECRET]).await;
    cp.grant_roles(&[NodeRole::Control, NodeRole::Worker]);
    let data = tempfile::tempdir().unwrap();
    let err = join(&options(&cp, data.path(), MeshJoin::default()))
        .await
        .unwrap_err();
    assert!(matches!(err, JoinError::ControlRole { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("CONTROL")
            && text.contains("worker token")
            && text.contains("nothing of this join was kept"),
        "{text}"
    );
    let ids = IdentityDir::new(data.path());
    assert!(ids.load_enrollment().is_err(), "an enrollment was stored");
    for file in [
        ids.cert_path(),
        ids.key_path(),
        ids.ca_path(),
        ids.state_path(),
    ] {
        assert!(!file.exists(), "{} kept", file.display());
    }
    // The same token's worker grant joins.
    cp.grant_roles(&[NodeRole::Worker]);
    join(&options(&cp, data.path(), MeshJoin::default()))
        .await
        .unwrap();
    assert!(ids.load_enrollment().is_ok());
}

/// 57.10: by default a join advertises only configured endpoints (none),
/// as the reference does; `auto` is an opt-in, and configured ones go as
/// they are.
#[tokio::test]
async fn a_join_advertises_only_configured_endpoints() {
    let cp = ControlPlane::start(&[SECRET]).await;
    let configured: std::net::SocketAddr = "203.0.113.7:51820".parse().unwrap();
    for (mesh, want) in [
        (MeshJoin::default(), vec![]),
        (
            MeshJoin {
                endpoints: vec![configured],
                ..MeshJoin::default()
            },
            vec![configured.to_string()],
        ),
    ] {
        let data = tempfile::tempdir().unwrap();
        join(&options(&cp, data.path(), mesh)).await.unwrap();
        let sent = cp.with(|r| r.joins.last().unwrap().public_endpoints.clone());
        assert_eq!(sent, want);
    }
}

/// 57.3: `zt cluster upgrade v9.9.9` as the reference runs it, over two
/// nodes: each is cordoned, sent UpgradeNode naming the reference's own
/// asset (no agent for this node), installs this agent's own build of
/// v9.9.9 from its channel, says v9.9.9 in its next hello, and is
/// uncordoned. A version the channel lacks leaves the node running, and
/// the rollout stops with that node cordoned, as the reference's does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reference_rollout_upgrades_two_nodes_and_uncordons_them() {
    use control_plane::operations::upgrade_rollout;
    support::on_rig("ref-upgrade-a", |ctd_a, rig| async move {
        support::with_namespace(&rig, "ref-upgrade-b", |ctd_b, rig| async move {
            let cp = ControlPlane::start(&[SECRET]).await;
            let built = support::agent::run_bin();
            let bins = tempfile::tempdir().unwrap();
            // Each agent runs from a copy: an upgrade replaces that file.
            let copy = |name: &str| {
                let p = bins.path().join(name).join("zattera-agent");
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::fs::copy(&built, &p).unwrap();
                p
            };
            let (bin_a, bin_b) = (copy("a"), copy("b"));
            let channel =
                control_plane::ReleaseChannel::serve(std::path::Path::new(&built), &["v9.9.9"]).await;
            let run = ["--upgrade-base-url", channel.base.as_str()];
            let start = |ns: String, prefix: &'static str, binary: std::path::PathBuf| {
                let (cp, rig) = (&cp, &rig);
                async move {
                    ControlledAgent::start_with(
                        cp,
                        SECRET,
                        rig,
                        &ns,
                        prefix,
                        AgentFlags {
                            run: &run,
                            binary: Some(&binary),
                            ..AgentFlags::default()
                        },
                    )
                    .await
                }
            };
            let a = start(ctd_a.namespace().to_string(), "ztrb", bin_a.clone()).await;
            let b = start(ctd_b.namespace().to_string(), "ztrc", bin_b.clone()).await;
            for node in [&a.node_id, &b.node_id] {
                cp.wait_for("a session", WAIT, |r| r.session_host_of(node).map(|_| ()))
                    .await;
            }
            let was = cp.node_record(&a.node_id).unwrap().binary_version;
            assert_eq!(was, zattera_agent::version::tag());
            let mut nodes = vec![
                (a.node_id.clone(), a.api_as(&cp, control_plane::CONTROL_NODE_ID).await),
                (b.node_id.clone(), b.api_as(&cp, control_plane::CONTROL_NODE_ID).await),
            ];
            // What the reference's release resolver hands control.
            let reference_asset =
                "https://github.com/zattera-dev/zattera/releases/download/v9.9.9/zattera-linux-amd64";
            upgrade_rollout(&cp, &mut nodes, "v9.9.9", reference_asset, &"ab".repeat(32), Duration::from_secs(120))
                .await
                .unwrap_or_else(|e| panic!("{e}\nA:\n{}\nB:\n{}", a.log(), b.log()));
            let (_, asset, digest) = &channel.assets[0];
            for (agent, bin) in [(&a, &bin_a), (&b, &bin_b)] {
                let record = cp.node_record(&agent.node_id).unwrap();
                assert_eq!(record.binary_version, "v9.9.9", "{record:?}");
                assert!(record.schedulable, "left cordoned: {record:?}");
                assert_eq!(file_sha256(bin), *digest, "{} is not the channel's v9.9.9", bin.display());
                assert!(asset.exists());
            }

            // A version the channel does not publish: the node says why and
            // keeps running; the rollout stops there, the node cordoned.
            let mut first = vec![(a.node_id.clone(), a.api_as(&cp, control_plane::CONTROL_NODE_ID).await)];
            let refused = first[0]
                .1
                .upgrade_binary(zattera_agent::proto::cluster::AgentUpgradeRequest {
                    version: "v9.9.10".into(),
                    url: reference_asset.replace("v9.9.9", "v9.9.10"),
                    sha256: "ab".repeat(32),
                })
                .await
                .unwrap_err();
            assert_eq!(refused.code(), tonic::Code::NotFound, "{refused:?}");
            assert!(
                refused.message().contains("has no zattera-agent-linux-")
                    && refused.message().contains("v9.9.10")
                    && refused.message().contains("stays"),
                "{refused:?}"
            );
            let err = upgrade_rollout(&cp, &mut first, "v9.9.10", reference_asset, &"ab".repeat(32), Duration::from_secs(6))
                .await
                .unwrap_err();
            assert!(err.contains("did not report v9.9.10") && err.contains("left cordoned"), "{err}");
            let record = cp.node_record(&a.node_id).unwrap();
            assert!(!record.schedulable && record.binary_version == "v9.9.9", "{record:?}");
        })
        .await;
    })
    .await;
}

fn file_sha256(path: &std::path::Path) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut std::fs::File::open(path).unwrap(), &mut h).unwrap();
    hex::encode(h.finalize())
}

/// A data dir as a joined reference worker leaves it: `node/id`,
/// `node/mesh.json`, `node/node.crt`, `node/node.key` (SEC1, as Go's
/// `x509.MarshalECPrivateKey` writes it), `node/ca.crt` and `wg.key`.
fn reference_worker_dir(cp: &ControlPlane, data: &std::path::Path, node_id: &str, cert_for: &str) {
    let node = data.join("node");
    std::fs::create_dir_all(&node).unwrap();
    let (cert, key) = cp.ca.node_identity(cert_for, false);
    let pk8 = node.join("pk8.pem");
    std::fs::write(&pk8, key).unwrap();
    let sec1 = std::process::Command::new("openssl")
        .args(["ec", "-in"])
        .arg(&pk8)
        .arg("-out")
        .arg(node.join("node.key"))
        .output()
        .unwrap();
    assert!(sec1.status.success(), "openssl ec: {sec1:?}");
    std::fs::remove_file(&pk8).unwrap();
    assert!(
        std::fs::read_to_string(node.join("node.key"))
            .unwrap()
            .contains("BEGIN EC PRIVATE KEY")
    );
    std::fs::write(node.join("node.crt"), cert).unwrap();
    std::fs::write(node.join("ca.crt"), &cp.ca.pem).unwrap();
    std::fs::write(node.join("id"), node_id).unwrap();
    let mesh = serde_json::json!({
        "node_id": node_id,
        "mesh_ip": "",
        "control_grpc_addr": "127.0.0.1:8443",
        "registry_addr": "127.0.0.1:5000",
        "registry_username": format!("node-{node_id}"),
        "registry_password": "reference-registry-pw",
        "mesh_enabled": false,
    });
    std::fs::write(
        node.join("mesh.json"),
        serde_json::to_string_pretty(&mesh).unwrap(),
    )
    .unwrap();
    std::fs::write(
        data.join("wg.key"),
        "kBZ9iJqS8QDIB2zDdIqGk3aSvEF9mX8ZSbF6DV0h1lk=\n",
    )
    .unwrap();
}

/// 57.1: moving a reference worker keeps its enrollment. The agent finds
/// the reference's identity and no token: it takes the identity over (the
/// same node id in its hello, no join, its WireGuard key kept); a set of
/// files whose certificate names another node is not taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_reference_worker_keeps_its_identity_without_a_token() {
    on_rig_with_image("ref-move", |ctd, rig| async move {
        let cp = ControlPlane::start(&[SECRET]).await;
        let node_id = "01JREFERENCEWORKER00000001";
        let dir = tempfile::tempdir().unwrap();
        let (data, run_dir) = (dir.path().join("data"), dir.path().join("run"));
        reference_worker_dir(&cp, &data, node_id, node_id);
        let net_cfg =
            zattera_netns::NetConfig::for_namespace(ctd.namespace().as_str(), &run_dir).unwrap();
        let _cleanup = support::NetCleanup {
            prefix: "ztrd".into(),
            table: net_cfg.nft_table.clone(),
            run_dir: run_dir.clone(),
        };
        let bin = support::agent::run_bin();
        let api_addr = control_plane::free_loopback_addr().await;
        let log = dir.path().join("agent.log");
        let child = cp
            .agent_command(&control_plane::AgentRun {
                binary: std::path::Path::new(&bin),
                socket: &rig.socket,
                namespace: ctd.namespace().as_str(),
                run_dir: &run_dir,
                data_dir: &data,
                bridge_prefix: "ztrd",
                api_addr: &api_addr,
            })
            .env("RUST_LOG", "info")
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let _agent = support::agent::KillOnDrop(child);
        cp.wait_for("the moved node's hello", WAIT, |r| {
            r.session_host_of(node_id).map(|_| ())
        })
        .await;
        assert!(cp.with(|r| r.joins.is_empty()), "the move needed a join");
        let enrollment = IdentityDir::new(&data).load_enrollment().unwrap();
        assert_eq!(enrollment.node_id, node_id);
        assert_eq!(enrollment.registry_password, "reference-registry-pw");
        assert_eq!(
            std::fs::read_to_string(zattera_agent::mesh::key_path(&data))
                .unwrap()
                .trim(),
            "kBZ9iJqS8QDIB2zDdIqGk3aSvEF9mX8ZSbF6DV0h1lk="
        );
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(text.contains("took over the enrollment"), "{text}");

        // Files whose certificate is another node's: not taken, said why.
        let other = tempfile::tempdir().unwrap();
        reference_worker_dir(&cp, other.path(), node_id, "01JSOMEONEELSE000000000001");
        match zattera_agent::control::moved::adopt(other.path(), None) {
            zattera_agent::control::moved::Moved::Unusable { why } => {
                assert!(why.contains("names node"), "{why}");
            }
            moved => panic!("{moved:?}"),
        }
        assert!(!IdentityDir::new(other.path()).state_path().exists());
    })
    .await;
}
