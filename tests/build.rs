//! Issue 15: builds on the node through the node API (RunBuild,
//! CancelBuild) against real buildah, a real registry (TLS from the
//! cluster CA, htpasswd auth) and real containerd; BuildKit where a
//! buildkitd is named by ZATTERA_TEST_BUILDKITD (skipped otherwise).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "support/control/mod.rs"]
mod control_plane;
mod support;

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::time::Duration;

use control_plane::blobs::{BlobServer, context};
use control_plane::{AgentFlags, ControlPlane, ControlledAgent, RegistryGrant, assignment, set_of};
use support::registry::Registry;
use support::{on_rig, rig, with_namespace};
use zattera_agent::proto::cluster::{
    BuildEvent, CancelBuildRequest, Endpoint, InternalPort, InternalService, RouteSnapshot,
    RunBuildRequest,
};
use zattera_agent::proto::v1::{BuildStatus, HealthCheck, HealthCheckType, InstanceState, Meta};

/// The package.json of the tests' smallest Node app.
const NODE_PACKAGE_JSON: &str =
    r#"{"name":"hello","version":"1.0.0","scripts":{"start":"node index.js"}}"#;
const SECRET: &str = "build-secret";
const CONTROL: &str = control_plane::CONTROL_NODE_ID;

fn seconds(s: i64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: s,
        nanos: 0,
    }
}

fn build_request(id: &str, url: &str, push: &str) -> RunBuildRequest {
    RunBuildRequest {
        build: Some(zattera_agent::proto::v1::Build {
            meta: Some(Meta {
                id: id.into(),
                ..Meta::default()
            }),
            ..Default::default()
        }),
        source_url: url.into(),
        push_image_ref: push.into(),
        ..Default::default()
    }
}

/// RunBuild `id` of a context that holds only `dockerfile`: its lines and
/// its terminal event.
async fn build_dockerfile(c: &Cluster, id: &str, dockerfile: &str) -> (Vec<String>, BuildEvent) {
    let url = c
        .blobs
        .put(context(&[("Dockerfile", dockerfile.as_bytes())]));
    run_build(&c.agent, &c.cp, build_request(id, &url, "")).await
}

/// Where an agent with `data_dir` keeps build scratch, as the README says:
/// `<data-dir>-build`, beside the data dir.
fn scratch_root(data_dir: &std::path::Path) -> std::path::PathBuf {
    let name = data_dir.file_name().unwrap().to_string_lossy().into_owned();
    data_dir.with_file_name(format!("{name}-build"))
}

/// The lines and the terminal event of a RunBuild.
async fn run_build(
    agent: &ControlledAgent,
    cp: &ControlPlane,
    req: RunBuildRequest,
) -> (Vec<String>, BuildEvent) {
    let mut api = agent.api_as(cp, CONTROL).await;
    let mut stream = api.run_build(req).await.unwrap().into_inner();
    let mut lines = Vec::new();
    let mut terminal = None;
    while let Some(event) = stream.message().await.unwrap() {
        if let Some(log) = &event.log {
            eprintln!("build | {}", log.line);
            lines.push(log.line.clone());
        }
        if event.status != 0 || !event.error.is_empty() {
            terminal = Some(event);
        }
    }
    let terminal = terminal.unwrap_or_else(|| {
        panic!(
            "no terminal event; lines {lines:?}\nagent log:\n{}",
            agent.log()
        )
    });
    (lines, terminal)
}

/// A cluster: control with its blob endpoint, the TLS + basic-auth
/// registry holding the base image, and a joined agent with `backend`.
struct Cluster {
    cp: ControlPlane,
    registry: Registry,
    blobs: BlobServer,
    base: String,
    agent: ControlledAgent,
}

async fn cluster(rig: &support::Rig, ns: &str, prefix: &str, backend: &[&str]) -> Cluster {
    let cp = ControlPlane::start(&[SECRET]).await;
    let (chain, key) = cp.ca.server_identity();
    let registry = Registry::start_with(Some(("node-builder", "build-pw")), Some((&chain, &key)));
    let base = registry.push(&rig.oci_archive(), None, "base/busybox:1");
    cp.set_registry(RegistryGrant {
        addr: registry.addr.to_string(),
        username: "node-builder".into(),
        password: "build-pw".into(),
    });
    let blobs = cp.serve_blobs().await;
    // Build bridges of agents running side by side need subnets apart.
    let build_subnet = format!(
        "10.202.{}.0/24",
        200 + u32::from(prefix.as_bytes()[prefix.len() - 1] - b'a')
    );
    let mut flags = backend.to_vec();
    flags.extend(["--build-subnet", build_subnet.as_str()]);
    let agent = ControlledAgent::start_with(
        &cp,
        SECRET,
        rig,
        ns,
        prefix,
        AgentFlags {
            run: &flags,
            ..AgentFlags::default()
        },
    )
    .await;
    Cluster {
        cp,
        registry,
        blobs,
        base,
        agent,
    }
}

fn app_context(base: &str, extra_run: &str) -> Vec<u8> {
    let dockerfile = format!(
        "FROM {base}\nCOPY index.html /www/index.html\n{extra_run}RUN echo built-by-zattera > /www/built.txt\n"
    );
    context(&[
        ("Dockerfile", dockerfile.as_bytes()),
        ("index.html", b"<h1>hello</h1>\n"),
    ])
}

/// Deploys `image` with a health check that needs the built layer, and
/// waits for HEALTHY.
async fn deploy_healthy(c: &Cluster, image: &str, slot: u8) {
    let (a, mut rt) = assignment("web", "env", slot, "sleep 3600");
    rt.image_ref = image.into();
    rt.spec.as_mut().unwrap().healthcheck = Some(HealthCheck {
        r#type: HealthCheckType::Exec as i32,
        command: "grep -q built-by-zattera /www/built.txt".into(),
        interval: Some(seconds(1)),
        timeout: Some(seconds(2)),
        grace_period: Some(seconds(0)),
        ..HealthCheck::default()
    });
    c.cp.push_set(set_of(1, vec![(a, rt)]));
    let healthy = InstanceState::Healthy as i32;
    let done = tokio::time::timeout(
        Duration::from_secs(120),
        c.cp.wait_for("web HEALTHY", Duration::from_secs(150), |r| {
            r.latest_of("web").filter(|o| o.state == healthy)
        }),
    )
    .await;
    assert!(
        done.is_ok(),
        "web: {:?}; agent log:\n{}",
        c.cp.with(|r| r.latest_of("web")),
        c.agent.log()
    );
}

/// buildah processes working on `storage` (this agent's own root).
fn buildah_processes(storage: &std::path::Path) -> Vec<String> {
    let needle = storage.display().to_string();
    support::processes()
        .into_iter()
        .filter(|p| p.argv.contains(&needle))
        .map(|p| p.argv.join(" "))
        .collect()
}

/// The buildah storage of builds that name no project.
fn local_storage(agent: &ControlledAgent) -> std::path::PathBuf {
    agent.data_dir().join("buildah/projects/_local/storage")
}

fn buildah_containers(agent: &ControlledAgent) -> String {
    let out = std::process::Command::new("buildah")
        .arg("--root")
        .arg(local_storage(agent))
        .arg("--runroot")
        .arg(agent.dir.path().join("run/buildah/_local"))
        .args(["--storage-driver", "overlay", "containers", "--quiet"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The whole flow with buildah: a tarball from control's blob endpoint
/// (mTLS), `FROM` the cluster registry, a `RUN` step, pushed there with the
/// node credential; the agent then deploys `repo@digest` and it is HEALTHY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tarball_build_is_pushed_and_deployed_healthy() {
    on_rig("build-push", |ctd, rig| async move {
        let c = buildah_cluster(&rig, &ctd, "ztga").await;
        let url = c.blobs.put(app_context(&c.base, ""));
        let repo = format!("{}/proj/app", c.registry.addr);
        let (lines, end) = run_build(
            &c.agent,
            &c.cp,
            build_request("Bld-1", &url, &format!("{repo}:bld-1")),
        )
        .await;
        assert_eq!(
            end.status,
            BuildStatus::Succeeded as i32,
            "{end:?}\n{lines:#?}\n{}",
            c.agent.log()
        );
        assert!(end.image_digest.starts_with("sha256:"), "{end:?}");
        assert!(
            c.blobs
                .served
                .lock()
                .unwrap()
                .iter()
                .any(|p| url.ends_with(p.as_str())),
            "the source came from the blob endpoint"
        );
        assert_eq!(
            end.platforms,
            vec![zattera_agent::image_build::strategy::native_platform()]
        );
        assert!(lines.iter().any(|l| l == "starting build"), "{lines:?}");
        assert!(
            lines
                .iter()
                .any(|l| l.contains("RUN echo built-by-zattera")),
            "{lines:?}"
        );
        assert!(
            !lines.iter().any(|l| l.starts_with("Copying blob")),
            "per-layer noise is dropped: {lines:?}"
        );
        let scratch: Vec<_> = std::fs::read_dir(scratch_root(&c.agent.data_dir()))
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("src-"))
            .collect();
        assert!(scratch.is_empty(), "the scratch directory is removed");
        deploy_healthy(&c, &format!("{repo}@{}", end.image_digest), 222).await;
    })
    .await;
}

/// With no push reference the image is loaded into this node's
/// containerd and runs; a silent 75 s `RUN` step brings a heartbeat line
/// (control gives a build up after 4 min without an event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_build_lands_in_containerd_runs_and_beats_while_silent() {
    on_rig("build-load", |ctd, rig| async move {
        let c = buildah_cluster(&rig, &ctd, "ztgb").await;
        let url = c.blobs.put(app_context(&c.base, "RUN sleep 75\n"));
        let (lines, end) = run_build(&c.agent, &c.cp, build_request("bld-2", &url, "")).await;
        assert_eq!(
            end.status,
            BuildStatus::Succeeded as i32,
            "{end:?}\n{lines:#?}"
        );
        assert!(
            lines.iter().any(|l| l.starts_with("still building… (1m")),
            "a heartbeat after 60 s of silence: {lines:?}"
        );
        let name = "zattera.local/builds/bld-2:latest";
        assert!(
            support::image_exists(&ctd, name).await,
            "{name} is in containerd"
        );
        deploy_healthy(&c, name, 223).await;
    })
    .await;
}

/// A second build of the same steps runs from buildah's layer cache: the
/// first one's image stays as cache after its export, where removing its
/// only name used to delete its intermediate images with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_of_the_same_steps_uses_the_layer_cache() {
    on_rig("build-cache", |ctd, rig| async move {
        let c = buildah_cluster(&rig, &ctd, "ztgq").await;
        let url = c.blobs.put(app_context(&c.base, ""));
        for (id, cached) in [("bld-c1", false), ("bld-c2", true)] {
            let (lines, end) = run_build(&c.agent, &c.cp, build_request(id, &url, "")).await;
            assert_eq!(
                end.status,
                BuildStatus::Succeeded as i32,
                "{end:?}\n{lines:#?}"
            );
            let hits = lines
                .iter()
                .filter(|l| l.starts_with("--> Using cache"))
                .count();
            // COPY and RUN: FROM is no step of its own.
            assert_eq!(hits, if cached { 2 } else { 0 }, "{id}: {lines:#?}");
        }
    })
    .await;
}

/// Attack (issue 56.3): tenant A fills a `RUN --mount=type=cache` of id
/// `shared` (Go, pip, cargo caches are mounted this way), and tenant B's
/// build mounts the same id. With one buildah state for the node, B read
/// A's file (and could have poisoned it); each project now has its own
/// storage and cache directories, so B finds the cache empty. A's second
/// build still finds its own file: the cache works within a project.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_cache_mount_is_never_shared_between_projects() {
    on_rig("build-cache-mount", |ctd, rig| async move {
        let c = buildah_cluster(&rig, &ctd, "ztgv").await;
        let dockerfile = |step: &str| {
            format!(
                "FROM {}\nRUN --mount=type=cache,id=shared,target=/cache {step}\n",
                c.base
            )
        };
        let write = c.blobs.put(context(&[(
            "Dockerfile",
            dockerfile("echo tenant-a-secret > /cache/s").as_bytes(),
        )]));
        let read = c.blobs.put(context(&[(
            "Dockerfile",
            dockerfile("echo \"cache holds: $(cat /cache/s 2>/dev/null || echo nothing)\"")
                .as_bytes(),
        )]));
        let in_project = |id: &str, url: &str, project: &str| {
            let mut req = build_request(id, url, "");
            req.build.as_mut().unwrap().project_id = project.into();
            req
        };
        let (lines, end) = run_build(&c.agent, &c.cp, in_project("bld-m1", &write, "proj-a")).await;
        assert_eq!(
            end.status,
            BuildStatus::Succeeded as i32,
            "{end:?}\n{lines:#?}"
        );
        let (lines, end) = run_build(&c.agent, &c.cp, in_project("bld-m2", &read, "proj-b")).await;
        assert_eq!(
            end.status,
            BuildStatus::Succeeded as i32,
            "{end:?}\n{lines:#?}"
        );
        assert!(
            lines.iter().any(|l| l.contains("cache holds: nothing")),
            "project B's build read project A's cache mount: {lines:#?}"
        );
        let (lines, end) = run_build(&c.agent, &c.cp, in_project("bld-m3", &read, "proj-a")).await;
        assert_eq!(
            end.status,
            BuildStatus::Succeeded as i32,
            "{end:?}\n{lines:#?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.contains("cache holds: tenant-a-secret")),
            "project A's own cache mount is kept: {lines:#?}"
        );
    })
    .await;
}

/// Attack (issue 56.6): the reference pushes project P's builds to
/// `<cluster registry>/<P's id>/<app>`, and the node's credential pulls
/// anything there. A tenant of project A names project B's image, in an
/// assignment or in a Dockerfile's `FROM`; before, the node pulled it
/// with its credential and ran it (or built on it). Now both fail naming
/// the project, and B's own assignment of the image still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_project_never_runs_or_builds_on_another_project_s_image() {
    const A: &str = "01HZXK5V9P7W3Q2R8T6Y4M1N0B";
    const B: &str = "01HZXK6A2B3C4D5E6F7G8H9J0K";
    on_rig("build-other-project", |ctd, rig| async move {
        let c = buildah_cluster(&rig, &ctd, "ztgw").await;
        let theirs = c.registry.push(
            &rig.oci_archive(),
            None,
            &format!("{}/app:1", B.to_ascii_lowercase()),
        );
        let deploy = |id: &str, project: &str, slot: u8| {
            let (mut a, mut rt) = assignment(id, "env", slot, "sleep 3600");
            a.project_id = project.into();
            rt.image_ref = theirs.clone();
            (a, rt)
        };
        c.cp.push_set(set_of(
            1,
            vec![deploy("stolen", A, 114), deploy("own", B, 115)],
        ));
        let failed = InstanceState::Failed as i32;
        let healthy = InstanceState::Healthy as i32;
        let done = tokio::time::timeout(
            Duration::from_secs(120),
            c.cp.wait_for(
                "stolen FAILED, own HEALTHY",
                Duration::from_secs(150),
                |r| {
                    let stolen = r.latest_of("stolen").filter(|o| o.state == failed)?;
                    r.latest_of("own").filter(|o| o.state == healthy)?;
                    Some(stolen)
                },
            ),
        )
        .await;
        let stolen = done.unwrap_or_else(|_| {
            panic!(
                "stolen: {:?}, own: {:?}; agent log:\n{}",
                c.cp.with(|r| r.latest_of("stolen")),
                c.cp.with(|r| r.latest_of("own")),
                c.agent.log()
            )
        });
        assert!(
            stolen
                .message
                .contains(&format!("holds project {B}'s images")),
            "{stolen:?}"
        );

        let url = c.blobs.put(context(&[(
            "Dockerfile",
            format!("FROM {theirs}\nRUN true\n").as_bytes(),
        )]));
        let mut req = build_request("bld-p1", &url, "");
        req.build.as_mut().unwrap().project_id = A.into();
        let (lines, end) = run_build(&c.agent, &c.cp, req).await;
        assert_eq!(
            end.status,
            BuildStatus::Failed as i32,
            "{end:?}\n{lines:#?}"
        );
        assert!(
            end.error.contains(&format!("holds project {B}'s images")),
            "{end:?}"
        );
    })
    .await;
}

/// Attack: a tenant's Dockerfile names an image on the node itself
/// (`FROM oci-archive:<a path on the node>`, here the rig's busybox
/// archive), which buildah would read as root. The build fails before
/// buildah runs, saying why; a registry base still builds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dockerfile_may_not_read_images_from_the_node() {
    on_rig("build-local-img", |ctd, rig| async move {
        let c = buildah_cluster(&rig, &ctd, "ztgr").await;
        let node_file = format!("oci-archive:{}", rig.oci_archive().display());
        for (id, dockerfile) in [
            ("bld-l1", format!("FROM {node_file}\nRUN true\n")),
            (
                "bld-l2",
                format!(
                    "ARG B={node_file}\nFROM {}\nCOPY --from=$B /bin/sh /sh\n",
                    c.base
                ),
            ),
            // 56.5: the file's own escape character continues the line.
            (
                "bld-l4",
                format!(
                    "# escape=`\nFROM {}\nCOPY `\n  --from={node_file} /bin/sh /sh\n",
                    c.base
                ),
            ),
            // 56.5: a trigger is the instruction it carries.
            (
                "bld-l5",
                format!(
                    "FROM {}\nONBUILD COPY --from={node_file} /bin/sh /sh\n",
                    c.base
                ),
            ),
        ] {
            let (lines, end) = build_dockerfile(&c, id, &dockerfile).await;
            assert_eq!(
                end.status,
                BuildStatus::Failed as i32,
                "{id}: {end:?}\n{lines:#?}"
            );
            assert!(
                end.error
                    .contains("reads the node's own files (oci-archive:)"),
                "{id}: {end:?}"
            );
            assert!(
                !lines.iter().any(|l| l.starts_with("STEP ")),
                "buildah never ran: {lines:?}"
            );
        }
        // 56.5: a custom frontend would parse the file its own way.
        let url = c.blobs.put(context(&[(
            "Dockerfile",
            format!("# syntax=docker.io/evil/frontend:1\nFROM {}\n", c.base).as_bytes(),
        )]));
        let (_, end) = run_build(&c.agent, &c.cp, build_request("bld-l6", &url, "")).await;
        assert!(end.error.contains("frontend"), "{end:?}");
        // 56.4: nine 300-byte lines that double each other asked for a
        // 64 GiB string, and the agent died: the build fails, the agent
        // stays and builds again.
        let mut bomb = format!("ARG A0={}\n", "x".repeat(300));
        for i in 1..40 {
            std::fmt::Write::write_fmt(
                &mut bomb,
                format_args!("ARG A{i}=${{A{}}}${{A{}}}\n", i - 1, i - 1),
            )
            .unwrap();
        }
        std::fmt::Write::write_fmt(&mut bomb, format_args!("FROM {}:$A39\n", c.base)).unwrap();
        let url = c.blobs.put(context(&[("Dockerfile", bomb.as_bytes())]));
        let (_, end) = run_build(&c.agent, &c.cp, build_request("bld-l7", &url, "")).await;
        assert_eq!(end.status, BuildStatus::Failed as i32, "{end:?}");
        assert!(end.error.contains("ARG values expand past"), "{end:?}");
        let url = c.blobs.put(app_context(&c.base, ""));
        let (lines, end) = run_build(&c.agent, &c.cp, build_request("bld-l3", &url, "")).await;
        assert_eq!(
            end.status,
            BuildStatus::Succeeded as i32,
            "{end:?}\n{lines:#?}"
        );
    })
    .await;
}

/// CancelBuild during a `RUN` step: CANCELED, and buildah and its
/// container are gone; an unknown id is `canceled: false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_build_stops_buildah_and_its_container() {
    on_rig("build-cancel", |ctd, rig| async move {
        let c = buildah_cluster(&rig, &ctd, "ztgc").await;
        let url = c
            .blobs
            .put(app_context(&c.base, "RUN echo sleeping && sleep 300\n"));
        let mut api = c.agent.api_as(&c.cp, CONTROL).await;
        let unknown = api
            .cancel_build(CancelBuildRequest {
                build_id: "nope".into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert!(!unknown.canceled);
        let mut stream = api
            .run_build(build_request("bld-3", &url, ""))
            .await
            .unwrap()
            .into_inner();
        let mut lines = Vec::new();
        let terminal = loop {
            let event = stream.message().await.unwrap().expect("a terminal event");
            if let Some(log) = &event.log {
                lines.push(log.line.clone());
                if log.line == "sleeping" {
                    let r = api
                        .cancel_build(CancelBuildRequest {
                            build_id: "bld-3".into(),
                        })
                        .await
                        .unwrap()
                        .into_inner();
                    assert!(r.canceled);
                }
            }
            if event.status != 0 {
                break event;
            }
        };
        assert_eq!(
            terminal.status,
            BuildStatus::Canceled as i32,
            "{terminal:?} {lines:?}"
        );
        let storage = local_storage(&c.agent);
        assert!(
            buildah_processes(&storage).is_empty(),
            "{:?}",
            buildah_processes(&storage)
        );
        assert!(
            !support::processes()
                .iter()
                .any(|p| p.argv.join(" ") == "sleep 300"),
            "the RUN step's process is gone"
        );
        assert_eq!(
            buildah_containers(&c.agent),
            "",
            "no working container is left"
        );
    })
    .await;
}

fn raw_tgz(name: &str, declared: u64, body: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut h = tar::Header::new_gnu();
    let bytes = name.as_bytes();
    h.as_old_mut().name[..bytes.len()].copy_from_slice(bytes);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_mode(0o644);
    h.set_size(declared);
    h.set_cksum();
    let mut raw = h.as_bytes().to_vec();
    raw.extend_from_slice(body);
    if declared == body.len() as u64 {
        raw.extend(std::iter::repeat_n(
            0u8,
            (512 - body.len() % 512) % 512 + 1024,
        ));
    }
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&raw).unwrap();
    gz.finish().unwrap()
}

/// Every bad source fails its build with its message, in-band, writing
/// nothing outside the scratch directory; the agent keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sources_fail_with_their_message_and_write_nothing_outside() {
    on_rig("build-bad", |ctd, rig| async move {
        let c = buildah_cluster(&rig, &ctd, "ztgd").await;
        let wrong = format!("/internal/blobs/sha256:{}", "0".repeat(64));
        // The context is unpacked into `<scratch root>/src-<id>/context`,
        // and `src-<id>` goes after the build: these names would land where
        // the check after the builds can still see them.
        let scratch = scratch_root(&c.agent.data_dir());
        let above = scratch.parent().unwrap().to_path_buf();
        std::fs::create_dir_all(above.join("etc")).unwrap();
        let landings = [
            scratch.join("escape.txt"),
            scratch.join("evil"),
            above.join("etc/shadow"),
        ];
        let cases: Vec<(String, &str)> = vec![
            (
                c.blobs.put(raw_tgz("../../escape.txt", 4, b"evil")),
                "unpack source: unsafe path in context: \"../../escape.txt\"",
            ),
            (
                c.blobs.put(raw_tgz("dir/../../../evil", 4, b"evil")),
                "unpack source: unsafe path in context: \"dir/../../../evil\"",
            ),
            (
                c.blobs.put(raw_tgz("../../../etc/shadow", 4, b"evil")),
                "unpack source: unsafe path in context: \"../../../etc/shadow\"",
            ),
            (
                c.blobs.put(raw_tgz("big", (512 << 20) + 1, b"tiny")),
                "unpack source: context exceeds 536870912 bytes",
            ),
            (
                c.blobs.put(raw_tgz("short", 100, b"0123456789")),
                "unpack source: ",
            ),
            (
                c.blobs.put(b"PK\x03\x04 not a gzip".to_vec()),
                "unpack source: gzip: ",
            ),
            (
                c.blobs
                    .put_at(&wrong, context(&[("Dockerfile", b"FROM x\n")])),
                "fetch source: ",
            ),
            (
                format!(
                    "https://127.0.0.1:{}/internal/blobs/missing",
                    c.blobs.addr.port()
                ),
                "fetch source: source fetch: HTTP 404",
            ),
        ];
        for (i, (url, want)) in cases.iter().enumerate() {
            let (_lines, end) =
                run_build(&c.agent, &c.cp, build_request(&format!("bad-{i}"), url, "")).await;
            assert_eq!(end.status, BuildStatus::Failed as i32, "case {i}: {end:?}");
            assert!(
                end.error.starts_with(want),
                "case {i}: {:?} does not start with {want:?}",
                end.error
            );
        }
        // BLD-7: a platform with no emulator here is named, with the
        // package that brings one (this rig registers no qemu handler).
        let mut req = build_request(
            "bad-platform",
            &c.blobs.put(context(&[("Dockerfile", b"FROM x\n")])),
            "",
        );
        req.build.as_mut().unwrap().platforms = vec!["linux/s390x".into()];
        let (_lines, end) = run_build(&c.agent, &c.cp, req).await;
        assert_eq!(end.status, BuildStatus::Failed as i32, "{end:?}");
        assert!(
            end.error.contains("linux/s390x") && end.error.contains("qemu-user-static"),
            "{}",
            end.error
        );
        for landing in &landings {
            assert!(!landing.exists(), "written outside: {}", landing.display());
        }
        let left: Vec<_> = std::fs::read_dir(scratch_root(&c.agent.data_dir()))
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("src-"))
            .map(|e| e.path())
            .collect();
        assert!(left.is_empty(), "scratch directories are removed: {left:?}");
    })
    .await;
}

/// A network namespace of the test's own, `<net>.2` behind a veth from the
/// host (`<net>.1`), serving `ok.txt` over HTTP on 8088: the "outside" a
/// build step may reach, or, in the mesh's CIDR, may not. Removed when
/// dropped.
struct Upstream {
    ns: String,
    httpd: std::process::Child,
    _www: tempfile::TempDir,
}

impl Upstream {
    fn start(name: &str, net: &str) -> Self {
        let ns = format!("{name}-up");
        let veth = format!("{name}up0");
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &ns])
            .output();
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &veth])
            .output();
        let run = |argv: &[&str]| {
            let out = std::process::Command::new(argv[0])
                .args(&argv[1..])
                .output()
                .unwrap();
            assert!(out.status.success(), "{argv:?}: {out:?}");
        };
        run(&["ip", "netns", "add", &ns]);
        run(&[
            "ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        let host = format!("{net}.1/24");
        let inside = format!("{net}.2/24");
        run(&["ip", "addr", "add", &host, "dev", &veth]);
        run(&["ip", "link", "set", &veth, "up"]);
        run(&["ip", "-n", &ns, "addr", "add", &inside, "dev", "eth0"]);
        run(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
        run(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        run(&[
            "ip",
            "-n",
            &ns,
            "route",
            "add",
            "default",
            "via",
            &format!("{net}.1"),
        ]);
        let www = tempfile::tempdir().unwrap();
        std::fs::write(www.path().join("ok.txt"), format!("{name}-ok\n")).unwrap();
        let httpd = std::process::Command::new("ip")
            .args([
                "netns", "exec", &ns, "busybox", "httpd", "-f", "-p", "8088", "-h",
            ])
            .arg(www.path())
            .spawn()
            .unwrap();
        Self {
            ns,
            httpd,
            _www: www,
        }
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.httpd.kill();
        let _ = self.httpd.wait();
        let _ = std::process::Command::new("ip")
            .args(["netns", "del", &self.ns])
            .output();
    }
}

/// 45.1: `RUN` steps run in a network of their own. From a step, another
/// tenant's unpublished port and the host's loopback listener are refused
/// (with the old default, the host's network, both answered), while a
/// server outside, on a network of the test's own, still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn build_steps_run_in_a_network_of_their_own() {
    on_rig("build-net", |ctd, rig| async move {
        let c = buildah_cluster(&rig, &ctd, "ztgn").await;
        steps_stay_in_their_network(&c, &ctd, &rig, "ztgn", 90, 124).await;
        // The build's namespace and veth are gone with it.
        let netns = c.agent.dir.path().join("run/netns");
        let left: Vec<_> = std::fs::read_dir(&netns)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(
            !left
                .iter()
                .any(|n| n.to_string_lossy().starts_with("zt-build-")),
            "{left:?}"
        );
    })
    .await;
}

/// 45.1 for BuildKit: its steps join the build bridge through CNI, under
/// the same guard. On the old code buildkitd ran them in the host's
/// network, where the other tenant's port and the loopback listener answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buildkit_steps_run_in_a_network_of_their_own() {
    let Some(bin) = buildkitd() else { return };
    on_rig("build-bkn", |ctd, rig| async move {
        let (c, cleanup) = buildkit_cluster(&rig, &ctd, "ztgo", &bin).await;
        let checked = tokio::spawn({
            let (ctd, rig) = (ctd.clone(), rig.clone());
            async move {
                let c = c;
                steps_stay_in_their_network(&c, &ctd, &rig, "ztgo", 91, 205).await;
                // The loaded image was copied out of BuildKit's namespace
                // into the agent's, unpacked, and its record there removed.
                let name = "zattera.local/builds/bld-net:latest".parse().unwrap();
                let local = zattera_agent::runtime::get_local(&ctd, &name)
                    .await
                    .unwrap();
                assert!(
                    local.is_some_and(|l| l.unpacked),
                    "the loaded image in the agent's namespace"
                );
                let worker = zattera_agent::runtime::Containerd::connect(
                    &rig.socket,
                    zattera_agent::image_build::buildkit::worker_namespace(
                        ctd.namespace().as_str(),
                    )
                    .parse()
                    .unwrap(),
                )
                .await
                .unwrap();
                assert!(
                    zattera_agent::runtime::images::list_images(&worker)
                        .await
                        .unwrap()
                        .is_empty(),
                    "no image record is left in BuildKit's namespace"
                );
                c
            }
        })
        .await;
        cleanup.run().await;
        drop(checked.unwrap());
    })
    .await;
}

/// Builds a step that tries another tenant's unpublished port, the host's
/// loopback and a server outside (`10.203.<upstream>.2`); only the outside
/// may answer.
async fn steps_stay_in_their_network(
    c: &Cluster,
    ctd: &zattera_agent::runtime::Containerd,
    rig: &support::Rig,
    prefix: &str,
    upstream: u8,
    victim_slot: u8,
) {
    {
        let _upstream = Upstream::start(prefix, &format!("10.203.{upstream}"));
        // A server in the mesh's CIDR (10.90.0.0/16): another node's mesh
        // address, as far as the build bridge's guard can tell.
        let mesh_net = format!("10.90.{}", 150 + upstream);
        let _mesh = Upstream::start(&format!("{prefix}m"), &mesh_net);
        zattera_agent::runtime::import_archive(ctd, &rig.oci_archive(), None)
            .await
            .unwrap();
        // Another tenant's service, on no published port.
        let (victim, rt) = assignment(
            "victim",
            "env-victim",
            victim_slot,
            "mkdir -p /w && echo victim-secret > /w/s.txt && exec httpd -f -p 8080 -h /w",
        );
        c.cp.push_set(set_of(1, vec![(victim, rt)]));
        let healthy = InstanceState::Healthy as i32;
        c.cp.wait_for("victim HEALTHY", Duration::from_secs(60), |r| {
            r.latest_of("victim").filter(|o| o.state == healthy)
        })
        .await;
        let status: serde_json::Value =
            serde_json::from_slice(&c.agent.cli(&["status", "--json"]).stdout).unwrap();
        let victim_ip = status["assignments"]
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["id"] == "victim")
            .and_then(|a| a["ip"].as_str())
            .unwrap()
            .to_owned();
        // The victim's service VIP (its scope's alone).
        let vip = format!("10.97.{}.7", 100 + upstream);
        c.cp.push_routes(RouteSnapshot {
            version: 1,
            internal_services: vec![InternalService {
                fqdn: "victim.env-victim.proj.internal.".into(),
                project_id: "proj".into(),
                environment_id: "env-victim".into(),
                vip: vip.clone(),
                ports: vec![InternalPort {
                    name: "http".into(),
                    port: 8080,
                    protocol: "tcp".into(),
                    endpoints: vec![Endpoint {
                        addr: format!("{victim_ip}:8080"),
                        healthy: true,
                        ..Endpoint::default()
                    }],
                }],
            }],
            ..RouteSnapshot::default()
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect_timeout(
            &format!("{vip}:8080").parse().unwrap(),
            Duration::from_millis(500),
        )
        .is_err()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the VIP {vip} never answered the host"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // A service on the host's loopback only.
        let lo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let lo_port = lo.local_addr().unwrap().port();
        std::thread::spawn(move || {
            use std::io::Write as _;
            for mut conn in lo.incoming().flatten() {
                let _ =
                    conn.write_all(b"HTTP/1.0 200 OK\r\nContent-Length: 15\r\n\r\nloopback-secret");
            }
        });
        // `host:port/path` each; busybox's wget crashes on this Debian
        // build, nc does not.
        let urls = [
            format!("{victim_ip}:8080/s.txt"),
            format!("127.0.0.1:{lo_port}/"),
            format!("{vip}:8080/s.txt"),
            format!("{mesh_net}.2:8088/ok.txt"),
            format!("10.203.{upstream}.2:8088/ok.txt"),
        ];
        let dockerfile = format!(
            "FROM {}\nRUN for u in {}; do h=${{u%%:*}}; r=${{u#*:}}; p=${{r%%/*}}; got=$(printf 'GET /%s HTTP/1.0\\r\\n\\r\\n' \"${{r#*/}}\" | nc -w 3 $h $p | tail -n 1); if [ -n \"$got\" ]; then echo \"GOT $u $got\"; else echo \"NOT $u\"; fi; done; echo {}\n",
            c.base,
            urls.join(" "),
            rand::random::<u64>()
        );
        let url = c
            .blobs
            .put(context(&[("Dockerfile", dockerfile.as_bytes())]));
        let (lines, end) = run_build(&c.agent, &c.cp, build_request("bld-net", &url, "")).await;
        assert_eq!(
            end.status,
            BuildStatus::Succeeded as i32,
            "{end:?}\n{lines:#?}"
        );
        let said =
            |prefix: &str, u: &str| lines.iter().any(|l| l.contains(&format!("{prefix} {u}")));
        assert!(said("NOT", &urls[0]), "another tenant's port: {lines:#?}");
        assert!(said("NOT", &urls[1]), "the host's loopback: {lines:#?}");
        assert!(said("NOT", &urls[2]), "another scope's VIP: {lines:#?}");
        assert!(said("NOT", &urls[3]), "the mesh's CIDR: {lines:#?}");
        assert!(
            said("GOT", &urls[4]) && lines.iter().any(|l| l.contains(&format!("{prefix}-ok"))),
            "the outside: {lines:#?}"
        );
        assert!(
            !lines
                .iter()
                .any(|l| l.contains("victim-secret") || l.contains("loopback-secret")),
            "{lines:#?}"
        );
    }
}

/// 45.4: the planner runs under the packaged layout: the data dir 0700 (as
/// the package makes /var/lib/zattera) and the unit's `UMask=0077`, through
/// `zattera-agent build` of an app with no Dockerfile. Planning must pass;
/// the build then stops at once for a platform with no emulator (nothing
/// is pulled). The old code put the scratch in the data dir and failed
/// planning with EACCES.
#[tokio::test]
async fn the_planner_runs_under_the_packaged_layout() {
    let Some(rig) = rig() else { return };
    let Ok(planner) = std::env::var("ZATTERA_TEST_NIXPACKS") else {
        zattera_testkit::missing("the nixpacks planner (ZATTERA_TEST_NIXPACKS)");
        return;
    };
    with_namespace(&rig, "build-plan", |ctd, rig| async move {
        let base = tempfile::tempdir().unwrap();
        std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let data = base.path().join("zattera");
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&data)
            .unwrap();
        let app = base.path().join("app");
        std::fs::create_dir(&app).unwrap();
        std::fs::write(app.join("package.json"), NODE_PACKAGE_JSON).unwrap();
        std::fs::write(app.join("index.js"), "console.log('hi')\n").unwrap();
        let config = base.path().join("agent.toml");
        std::fs::write(
            &config,
            format!("build-backend = \"buildah\"\nnixpacks-binary = \"{planner}\"\n"),
        )
        .unwrap();
        let out = std::process::Command::new("sh")
            .args(["-c", "umask 077; exec \"$0\" \"$@\""])
            .arg(support::agent::run_bin())
            .arg("--config")
            .arg(&config)
            .arg("--containerd-address")
            .arg(&rig.socket)
            .args(["--namespace", ctd.namespace().as_str()])
            .arg("--data-dir")
            .arg(&data)
            .arg("--run-dir")
            .arg(base.path().join("run"))
            .arg("build")
            .arg(&app)
            // No emulator for it here: the build stops right after
            // planning, before buildah would try to pull the plan's base.
            .args(["--platform", "linux/s390x"])
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(said.contains("planning with nixpacks"), "{said}");
        assert!(
            !said.contains("nixpacks plan:"),
            "the planner failed: {said}"
        );
        assert!(said.contains("starting build"), "{said}");
        assert!(said.contains("no emulator for linux/s390x"), "{said}");
        let root = scratch_root(&data);
        let mode = std::fs::metadata(&root).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o711, "{}", root.display());
        assert_eq!(
            std::fs::read_dir(&root).unwrap().count(),
            0,
            "scratch removed"
        );
        assert_eq!(
            std::fs::metadata(&data).unwrap().permissions().mode() & 0o777,
            0o700,
            "the data dir stays closed"
        );
    })
    .await;
}

/// The nixpacks planner (the pinned 1.41.0, built from its crate) writes
/// `.nixpacks/Dockerfile` for a Node app with no Dockerfile.
#[tokio::test]
async fn nixpacks_plans_a_node_app_without_a_dockerfile() {
    let binary = std::env::var("ZATTERA_TEST_NIXPACKS")
        .unwrap_or_else(|_| zattera_agent::image_build::plan::DEFAULT_NIXPACKS_BINARY.into());
    if !zattera_testkit::require(&if std::path::Path::new(&binary).exists() {
        vec![]
    } else {
        vec![format!(
            "the nixpacks planner at {binary} (ZATTERA_TEST_NIXPACKS)"
        )]
    }) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    let ctx = dir.path().join("context");
    std::fs::create_dir(&ctx).unwrap();
    std::fs::write(ctx.join("package.json"), NODE_PACKAGE_JSON).unwrap();
    std::fs::write(
        ctx.join("index.js"),
        "require('http').createServer((q,s)=>s.end('ok')).listen(process.env.PORT)\n",
    )
    .unwrap();
    assert_eq!(
        zattera_agent::image_build::strategy::Strategy::detect(&ctx),
        zattera_agent::image_build::strategy::Strategy::Nixpacks
    );
    let planner = zattera_agent::image_build::plan::Planner {
        binary: binary.into(),
        ..Default::default()
    };
    let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
    let hints = [("NIXPACKS_NODE_VERSION".to_owned(), "20".to_owned())]
        .into_iter()
        .collect();
    planner
        .plan(
            &ctx,
            &hints,
            &tx,
            &tokio_util::sync::CancellationToken::new(),
        )
        .await
        .unwrap();
    drop(tx);
    let mut lines = Vec::new();
    while let Some(e) = rx.recv().await {
        lines.push(e.line().unwrap_or_default().to_owned());
    }
    let dockerfile = std::fs::read_to_string(ctx.join(".nixpacks/Dockerfile")).unwrap();
    eprintln!("{dockerfile}");
    assert!(dockerfile.contains("FROM "), "{dockerfile}");
    assert!(
        dockerfile.contains("npm") || dockerfile.contains("node"),
        "the Node plan: {dockerfile}"
    );
    assert!(!lines.is_empty(), "the planner's output became plan lines");
    assert_eq!(
        std::fs::metadata(ctx.join(".nixpacks/Dockerfile"))
            .unwrap()
            .uid(),
        0,
        "the context is root's again"
    );
}

/// The buildkitd (v0.18.2, built from moby/buildkit's source) the BuildKit
/// tests use, from ZATTERA_TEST_BUILDKITD; `None` skips them.
fn buildkitd() -> Option<String> {
    let path = std::env::var("ZATTERA_TEST_BUILDKITD")
        .ok()
        .filter(|p| !p.is_empty());
    if path.is_none() {
        // No registry CI reaches offers a buildkitd (README, "What CI does
        // not run"), so this skip is accepted there and listed at the end.
        zattera_testkit::skip("ZATTERA_TEST_BUILDKITD names no buildkitd (buildctl beside it)");
    }
    path
}

/// [`cluster`] in `ctd`'s namespace, whose agent builds with buildah.
async fn buildah_cluster(
    rig: &support::Rig,
    ctd: &zattera_agent::runtime::Containerd,
    prefix: &str,
) -> Cluster {
    let backend = ["--build-backend", "buildah"];
    cluster(rig, ctd.namespace().as_str(), prefix, &backend).await
}

/// [`cluster`] in `ctd`'s namespace, whose agent builds with the buildkitd
/// at `bin`, and the clean-up of what that buildkitd leaves.
async fn buildkit_cluster(
    rig: &support::Rig,
    ctd: &zattera_agent::runtime::Containerd,
    prefix: &str,
    bin: &str,
) -> (Cluster, control_plane::BuildkitdCleanup) {
    let backend = ["--build-backend", "buildkit", "--buildkitd-binary", bin];
    let c = cluster(rig, ctd.namespace().as_str(), prefix, &backend).await;
    let cleanup = c.agent.buildkitd_cleanup(&rig.socket);
    (c, cleanup)
}

/// 56.2, in part: buildah fetches an `ADD <url>` itself, from the host's
/// network namespace. A listener on the host's loopback (as the agent's
/// metrics are) was read into the build by its address and by a name that
/// resolves to it; both are refused before buildah runs, and the listener
/// is never connected to. A step that asks for the host's network is
/// refused too (buildah 1.30 and later would honour it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_url_never_reaches_into_the_node() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    on_rig("build-add-url", |ctd, rig| async move {
        let c = buildah_cluster(&rig, &ctd, "ztgx").await;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let hits = Arc::new(AtomicUsize::new(0));
        let counted = hits.clone();
        let server = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let mut buf = vec![0u8; 4096];
                let _ = conn.read(&mut buf).await;
                let body = "zt_instances{project=\"other-tenant\"} 1\n";
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
            }
        });
        for (id, url) in [
            ("bld-a1", format!("http://127.0.0.1:{port}/metrics")),
            ("bld-a2", format!("http://localhost:{port}/metrics")),
        ] {
            let dockerfile = format!("FROM {}\nADD {url} /m\nRUN cat /m\n", c.base);
            let (lines, end) = build_dockerfile(&c, id, &dockerfile).await;
            assert_eq!(
                end.status,
                BuildStatus::Failed as i32,
                "{id}: {end:?}\n{lines:#?}"
            );
            assert!(
                end.error
                    .contains("a build fetches only from public addresses"),
                "{id}: {end:?}"
            );
        }
        // A git source, which the agent clones itself.
        let mut git = build_request("bld-a4", "", "");
        git.git = Some(zattera_agent::proto::cluster::GitSource {
            clone_url: format!("https://127.0.0.1:{port}/repo.git"),
            ..Default::default()
        });
        let (_, end) = run_build(&c.agent, &c.cp, git).await;
        assert!(
            end.error
                .contains("a build fetches only from public addresses"),
            "{end:?}"
        );
        assert_eq!(
            hits.load(Ordering::SeqCst),
            0,
            "the host's loopback listener was fetched"
        );
        let dockerfile = format!("FROM {}\nRUN --network=host true\n", c.base);
        let (_, end) = build_dockerfile(&c, "bld-a3", &dockerfile).await;
        assert!(end.error.contains("RUN --network=host"), "{end:?}");
        server.abort();
    })
    .await;
}

/// The same flow through a real buildkitd the agent starts itself
/// (containerd worker in the agent's namespace): pushed with the node
/// credential, deployed by digest, HEALTHY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buildkit_builds_pushes_and_the_image_deploys_healthy() {
    let Some(bin) = buildkitd() else { return };
    on_rig("build-bk", |ctd, rig| async move {
        let (c, cleanup) = buildkit_cluster(&rig, &ctd, "ztge", &bin).await;
        let url = c.blobs.put(app_context(&c.base, ""));
        let repo = format!("{}/proj/app", c.registry.addr);
        let (lines, end) = run_build(
            &c.agent,
            &c.cp,
            build_request("bk-1", &url, &format!("{repo}:bk-1")),
        )
        .await;
        let ok = end.status == BuildStatus::Succeeded as i32;
        if ok {
            deploy_healthy(&c, &format!("{repo}@{}", end.image_digest), 224).await;
        }
        cleanup.run().await;
        assert!(ok, "{end:?}\n{lines:#?}\n{}", c.agent.log());
        assert!(end.image_digest.starts_with("sha256:"), "{end:?}");
        assert!(lines.iter().any(|l| l == "starting build"), "{lines:?}");
        assert!(
            lines
                .iter()
                .any(|l| l.contains("RUN echo built-by-zattera")),
            "vertex names as lines: {lines:?}"
        );
    })
    .await;
}

/// BuildKit keeps the node's build contexts under one key and syncs the
/// next build's into that copy: a later build, say another tenant's, sees
/// exactly its own context and nothing a former one sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buildkit_a_build_sees_only_its_own_context() {
    let Some(bin) = buildkitd() else { return };
    on_rig("build-bkx", |ctd, rig| async move {
        let (c, cleanup) = buildkit_cluster(&rig, &ctd, "ztgs", &bin).await;
        let first = format!("FROM {}\nCOPY . /ctx\n", c.base);
        let second = format!(
            "FROM {}\nCOPY . /ctx\nRUN test -e /ctx/a.txt && test ! -e /ctx/secret.txt\n",
            c.base
        );
        let contexts = [
            context(&[
                ("Dockerfile", first.as_bytes()),
                ("a.txt", b"a\n"),
                ("secret.txt", b"tenant one\n"),
            ]),
            context(&[("Dockerfile", second.as_bytes()), ("a.txt", b"a\n")]),
        ];
        let mut ends = Vec::new();
        for (i, ctx) in contexts.into_iter().enumerate() {
            let url = c.blobs.put(ctx);
            ends.push(
                run_build(
                    &c.agent,
                    &c.cp,
                    build_request(&format!("bk-x{i}"), &url, ""),
                )
                .await,
            );
        }
        cleanup.run().await;
        for (lines, end) in ends {
            assert_eq!(
                end.status,
                BuildStatus::Succeeded as i32,
                "{end:?}\n{lines:#?}"
            );
        }
    })
    .await;
}

/// CancelBuild through BuildKit: killing buildctl cancels the solve; the
/// `RUN` process is gone and the terminal event is CANCELED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buildkit_cancel_stops_the_solve() {
    let Some(bin) = buildkitd() else { return };
    on_rig("build-bkc", |ctd, rig| async move {
        let (c, cleanup) = buildkit_cluster(&rig, &ctd, "ztgf", &bin).await;
        let url = c
            .blobs
            .put(app_context(&c.base, "RUN echo sleeping && sleep 301\n"));
        let mut api = c.agent.api_as(&c.cp, CONTROL).await;
        let mut stream = api
            .run_build(build_request("bk-2", &url, ""))
            .await
            .unwrap()
            .into_inner();
        let sleeping = || {
            support::processes()
                .iter()
                .any(|p| p.argv.join(" ") == "sleep 301")
        };
        // Cancels as soon as the RUN step's process runs.
        let mut canceller = api.clone();
        let asked = tokio::spawn(async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(120);
            while std::time::Instant::now() < deadline {
                if support::processes()
                    .iter()
                    .any(|p| p.argv.join(" ") == "sleep 301")
                {
                    return canceller
                        .cancel_build(CancelBuildRequest {
                            build_id: "bk-2".into(),
                        })
                        .await
                        .unwrap()
                        .into_inner()
                        .canceled;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            false
        });
        let mut lines = Vec::new();
        let terminal = loop {
            let event = stream.message().await.unwrap().expect("a terminal event");
            if let Some(log) = &event.log {
                lines.push(log.line.clone());
            }
            if event.status != 0 {
                break event;
            }
        };
        let asked = asked.await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while sleeping() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let still = sleeping();
        cleanup.run().await;
        assert!(asked, "the RUN step was seen running: {lines:?}");
        assert_eq!(
            terminal.status,
            BuildStatus::Canceled as i32,
            "{terminal:?} {lines:?}"
        );
        assert!(!still, "the RUN step's process is gone");
    })
    .await;
}

/// 45.2: a build cannot read an image another tenant pulled. The agent's
/// namespace holds `<private registry>/tenant-a/app:1` (pulled for one app
/// with credentials no build has); a build `FROM` it must fail with the
/// registry's refusal. On the old code BuildKit's worker lived in the
/// agent's namespace and, refused by the registry, fell back to that copy:
/// the build succeeded on the other tenant's files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buildkit_builds_never_read_images_another_tenant_pulled() {
    let Some(bin) = buildkitd() else { return };
    on_rig("build-bkp", |ctd, rig| async move {
        let (c, cleanup) = buildkit_cluster(&rig, &ctd, "ztgp", &bin).await;
        let private = Registry::start(Some(("tenant-a", "tenant-a-pw")));
        let image = format!("{}/tenant-a/app:1", private.addr);
        zattera_agent::runtime::import_archive(
            &ctd,
            &rig.oci_archive(),
            Some(image.parse().unwrap()),
        )
        .await
        .unwrap();
        let marker = rand::random::<u64>();
        let dockerfile = format!("FROM {image}\nRUN echo read-tenant-a-{marker}\n");
        let url = c
            .blobs
            .put(context(&[("Dockerfile", dockerfile.as_bytes())]));
        let (lines, end) = run_build(&c.agent, &c.cp, build_request("bld-priv", &url, "")).await;
        cleanup.run().await;
        assert_eq!(
            end.status,
            BuildStatus::Failed as i32,
            "{end:?}\n{lines:#?}"
        );
        assert!(
            !lines
                .iter()
                .any(|l| l.contains(&format!("read-tenant-a-{marker}"))),
            "a step ran on the other tenant's image: {lines:#?}"
        );
        let said = format!("{} {}", end.error, lines.join("\n")).to_lowercase();
        assert!(
            said.contains("401") || said.contains("unauthorized"),
            "the registry's refusal: {end:?}\n{lines:#?}"
        );
    })
    .await;
}

/// 57.5: the node joins with `builder=true` (buildah is installed) and its
/// platform, so control's dispatcher, which places builds by that label
/// only, picks it; cordoned, it is not picked. The build dispatched by
/// label runs to SUCCEEDED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_build_is_dispatched_to_this_node_by_its_builder_label() {
    on_rig("build-label", |ctd, rig| async move {
        let c = buildah_cluster(&rig, &ctd, "ztgt").await;
        let node = c.agent.node_id.clone();
        c.cp.wait_for("the session", Duration::from_secs(60), |r| {
            r.session_host_of(&node).map(|_| ())
        })
        .await;
        let record = c.cp.node_record(&node).unwrap();
        assert_eq!(
            record.labels.get("builder").map(String::as_str),
            Some("true"),
            "{record:?}"
        );
        assert_eq!(
            record.labels.get("zattera.dev/os-arch").map(String::as_str),
            Some(
                format!(
                    "linux/{}",
                    zattera_agent::runtime::descriptor::host_architecture()
                )
                .as_str()
            )
        );
        let candidates = [node.clone()];
        assert_eq!(
            control_plane::operations::pick_builder(&c.cp, &candidates).as_deref(),
            Some(node.as_str())
        );
        let mut api = c.agent.api_as(&c.cp, CONTROL).await;
        let events = control_plane::operations::dispatch_build(
            &mut api,
            build_request("by-label", &c.blobs.put(app_context(&c.base, "")), ""),
        )
        .await
        .unwrap();
        let end = events.last().unwrap();
        assert_eq!(end.status, BuildStatus::Succeeded as i32, "{end:?}");
        c.cp.set_schedulable(&node, false);
        assert_eq!(
            control_plane::operations::pick_builder(&c.cp, &candidates),
            None,
            "a cordoned builder"
        );
    })
    .await;
}

/// 57.8: past `max-builds` a build waits its turn with a "queued behind"
/// line instead of failing (control never retries a refused build), and
/// both succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builds_past_max_builds_wait_their_turn() {
    on_rig("build-queue", |ctd, rig| async move {
        let c = cluster(
            &rig,
            ctd.namespace().as_str(),
            "ztgu",
            &["--build-backend", "buildah", "--max-builds", "1"],
        )
        .await;
        // A first build that takes a while, so the second meets it running.
        let slow = c.blobs.put(app_context(&c.base, "RUN sleep 3\n"));
        let quick = c.blobs.put(app_context(&c.base, ""));
        let (first, second) = tokio::join!(
            run_build(&c.agent, &c.cp, build_request("q-first", &slow, "")),
            async {
                tokio::time::sleep(Duration::from_millis(800)).await;
                run_build(&c.agent, &c.cp, build_request("q-second", &quick, "")).await
            }
        );
        assert_eq!(
            first.1.status,
            BuildStatus::Succeeded as i32,
            "{:?}",
            first.1
        );
        assert_eq!(
            second.1.status,
            BuildStatus::Succeeded as i32,
            "{:?}",
            second.1
        );
        assert!(
            second
                .0
                .first()
                .is_some_and(|l| l.starts_with("queued behind 1 build(s)")),
            "{:?}",
            second.0
        );
        assert!(
            !first.0.iter().any(|l| l.starts_with("queued")),
            "{:?}",
            first.0
        );
    })
    .await;
}
