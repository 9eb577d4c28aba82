//! Issue 57: a node the reference cluster can operate. The real agent
//! binary under the test control plane, which plays the reference's own
//! operations as its code does them (support/control/operations.rs and the
//! node records of support/control/plane.rs): labels that a join rewrites,
//! a control-role grant, the endpoints a join advertises, the upgrade
//! rollout of `zt cluster upgrade`, and a node moved from the reference
//! agent with its enrollment and its Docker volumes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

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

/// Every entry below `root`: type, mode, owner, size and content digest,
/// link target, extended attributes, which paths share an inode.
fn tree(root: &std::path::Path) -> Vec<String> {
    use sha2::Digest;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let mut paths = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(p) = stack.pop() {
        if std::fs::symlink_metadata(&p).unwrap().is_dir() {
            stack.extend(std::fs::read_dir(&p).unwrap().map(|e| e.unwrap().path()));
        }
        paths.push(p);
    }
    paths.sort();
    let mut inodes = std::collections::BTreeMap::new();
    paths
        .iter()
        .map(|p| {
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            let m = std::fs::symlink_metadata(p).unwrap();
            let what = if m.file_type().is_symlink() {
                format!("-> {}", std::fs::read_link(p).unwrap().display())
            } else if m.is_file() {
                let first = inodes.entry(m.ino()).or_insert_with(|| rel.clone()).clone();
                let digest = sha2::Sha256::digest(std::fs::read(p).unwrap());
                format!("{} {digest:x} inode-of {first}", m.len())
            } else {
                "dir".into()
            };
            let mut names = vec![0u8; 4096];
            let n = rustix::fs::llistxattr(p, &mut names).unwrap_or(0);
            let xattr: Vec<String> = names[..n]
                .split(|b| *b == 0)
                .filter(|k| !k.is_empty())
                .map(|k| {
                    let key = std::ffi::OsStr::from_bytes(k);
                    let mut v = vec![0u8; 4096];
                    let len = rustix::fs::lgetxattr(p, key, &mut v).unwrap_or(0);
                    format!(
                        "{}={}",
                        key.to_string_lossy(),
                        String::from_utf8_lossy(&v[..len])
                    )
                })
                .collect();
            let mode = if m.file_type().is_symlink() {
                0
            } else {
                m.mode()
            };
            format!("{rel} {mode:o} {}:{} {what} {xattr:?}", m.uid(), m.gid())
        })
        .collect()
}

/// 57.2: moving keeps the volumes. The reference's Docker volume
/// `zt-<env8>-data` (here on another filesystem, a tmpfs, so it is copied
/// and verified, not renamed) becomes the volume at its first use: the
/// container sees the data, the image is not copied over it, and owners,
/// modes, links, hard links and extended attributes are as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_nodes_docker_volume_is_taken_over_with_nothing_lost() {
    use std::os::unix::fs::PermissionsExt;
    on_rig_with_image("ref-volume", |ctd, rig| async move {
        let docker = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=16m", "tmpfs"])
            .arg(docker.path())
            .status()
            .unwrap();
        assert!(mounted.success());
        let _unmount = Unmount(docker.path().to_owned());
        let env = "01JMOVEDENVIRONMENT0000001";
        let data = docker.path().join("zt-01JMOVED-data/_data");
        std::fs::create_dir_all(data.join("pg/base")).unwrap();
        std::fs::write(data.join("pg/base/16384"), b"rows\n".repeat(1000)).unwrap();
        std::fs::write(data.join("PG_VERSION"), b"16\n").unwrap();
        std::os::unix::fs::symlink("PG_VERSION", data.join("version-link")).unwrap();
        std::fs::hard_link(data.join("PG_VERSION"), data.join("hard")).unwrap();
        std::os::unix::fs::chown(data.join("pg"), Some(999), Some(999)).unwrap();
        std::fs::set_permissions(data.join("pg"), std::fs::Permissions::from_mode(0o700)).unwrap();
        rustix::fs::lsetxattr(
            data.join("PG_VERSION"),
            "user.zattera",
            b"kept",
            rustix::fs::XattrFlags::empty(),
        )
        .unwrap();
        let before = tree(&data);

        let volumes = format!("{}", docker.path().display());
        let run = ["--docker-volumes-dir", volumes.as_str()];
        let (cp, agent) = control_plane::controlled_agent(SECRET, &rig, &ctd, "ztre", &run).await;
        let (a, mut rt) = control_plane::assignment("db", env, 209, "sleep 3600");
        rt.spec.as_mut().unwrap().volumes = vec![zattera_agent::proto::v1::VolumeMount {
            volume_name: "data".into(),
            mount_path: "/var/lib/postgresql/data".into(),
        }];
        cp.push_set(control_plane::set_of(1, vec![(a, rt)]));
        let status = agent.wait_for("db HEALTHY", |s| {
            s["assignments"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|r| r["id"] == "db" && r["state"] == "HEALTHY")
        });
        let ours = agent.data_dir().join(format!("volumes/zt-{env}-data"));
        assert_eq!(
            tree(&ours.join("_data")),
            before,
            "the volume as the reference left it"
        );
        let record = std::fs::read_to_string(ours.join("adopted-from")).unwrap();
        assert!(
            record.contains("copied and verified") && record.contains("zt-01JMOVED-data"),
            "{record}"
        );
        assert_eq!(tree(&data), before, "the Docker copy is left as it was");
        let log = agent.log();
        assert!(log.contains("adopted from"), "{log}");
        // The container reads it; nothing of the image was copied over it.
        let cid = status["assignments"][0]["container_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let out = agent.cli(&[
            "exec",
            &cid,
            "--",
            "cat",
            "/var/lib/postgresql/data/PG_VERSION",
        ]);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "16\n", "{out:?}");
    })
    .await;
}

/// Unmounts a test's mount when dropped.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}
