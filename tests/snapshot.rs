//! Volume snapshots and restores (dataplane.md §8) against a real S3
//! server (the rig's moto on loopback), real containerd for pre-hooks and
//! the in-use check, and the node API over mTLS as control calls it.
//!
//! Without the rig (containerd, test images, the S3 server) each test skips
//! with a message; under `CI=true` that is a failure. Every test has its own
//! containerd namespace, bucket and directories.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

#[path = "support/control/mod.rs"]
mod control_plane;
mod support;

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use control_plane::{AbortOnDrop, ControlPlane, node_api_client, node_context, serve_node_api};
use sha2::Digest;
use tokio::sync::watch;
use zattera_agent::control::join::{JoinOptions, join};
use zattera_agent::link::identity::IdentityDir;
use zattera_agent::proto::cluster::agent_local_service_client::AgentLocalServiceClient;
use zattera_agent::proto::cluster::{
    AgentRestoreVolumeRequest, AgentSnapshotVolumeRequest, S3Target, VolumeOpProgress,
};
use zattera_agent::proto::v1::{Meta, Volume, VolumeSnapshot};
use zattera_agent::runtime::Containerd;
use zattera_agent::snapshot::{Engine, S3Config, chunker};
use zattera_agent::volumes;

const SECRET: &str = "join-secret";
const ENV: &str = "01JSNAPSHOTENVIRONMENT";
const KEY: [u8; 32] = [0x42; 32];
const WAIT: Duration = Duration::from_secs(120);

/// The rig's S3 server, or `None` (a message; a failure under CI).
fn s3_endpoint() -> Option<String> {
    let endpoint =
        std::env::var("ZATTERA_TEST_S3").unwrap_or_else(|_| "http://127.0.0.1:9555".into());
    let addr = endpoint.trim_start_matches("http://").to_owned();
    if std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(1)).is_ok()
    {
        return Some(endpoint);
    }
    zattera_testkit::missing(&format!(
        "an S3 server at {endpoint} (run `sudo scripts/rig.sh` first)"
    ));
    None
}

fn python() -> PathBuf {
    PathBuf::from(
        std::env::var("ZATTERA_TEST_S3_PYTHON")
            .unwrap_or_else(|_| "/var/lib/zattera-rig/s3-venv/bin/python".into()),
    )
}

fn config(endpoint: &str, bucket: &str) -> S3Config {
    S3Config {
        endpoint: endpoint.into(),
        bucket: bucket.into(),
        prefix: "snaps".into(),
        region: String::new(),
        access_key: "test".into(),
        secret_key: "test-secret".into(),
    }
}

fn target(endpoint: &str, bucket: &str, key: &[u8]) -> S3Target {
    let c = config(endpoint, bucket);
    S3Target {
        endpoint: c.endpoint,
        bucket: c.bucket,
        prefix: c.prefix,
        region: c.region,
        access_key: c.access_key,
        secret_key: c.secret_key,
        data_key: key.to_vec(),
    }
}

/// A fresh bucket for this test.
async fn bucket(endpoint: &str, tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let name = format!(
        "zt-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    );
    Engine::new(&config(endpoint, &name), &KEY)
        .unwrap()
        .store()
        .create_bucket()
        .await
        .unwrap();
    name
}

/// The rig's S3 endpoint and a fresh bucket `tag` in it; `None` (the test
/// skips) without S3, see [`s3_endpoint`].
async fn s3_bucket(tag: &str) -> Option<(String, String)> {
    let endpoint = s3_endpoint()?;
    let bucket = bucket(&endpoint, tag).await;
    Some((endpoint, bucket))
}

/// A node API served for a joined node identity, with containerd.
struct Node {
    _cp: ControlPlane,
    data: tempfile::TempDir,
    api: AgentLocalServiceClient<tonic::transport::Channel>,
    _server: AbortOnDrop,
}

impl Node {
    async fn start(ctd: &Containerd) -> Self {
        let cp = ControlPlane::start(&[SECRET]).await;
        let data = tempfile::tempdir().unwrap();
        let joined = join(&JoinOptions {
            control: cp.address(),
            token: cp.ca.token(SECRET),
            data_dir: data.path().to_owned(),
            node_name: "snapshot-node".into(),
            binary_version: "9.9.9-test".into(),
            mesh: zattera_agent::control::join::MeshJoin::default(),
            control_node_ids: Vec::new(),
            labels: std::collections::BTreeMap::new(),
        })
        .await
        .expect("join");
        let node_tls = IdentityDir::new(data.path()).load_tls().unwrap();
        let (_tx, desired) = watch::channel(None);
        let ctx = node_context(ctd, data.path(), &joined.node_id, desired);
        let (addr, server) = serve_node_api(&node_tls, Some(ctx)).await;
        let control = cp.ca.node_identity(control_plane::CONTROL_NODE_ID, false);
        let api = node_api_client(&addr, &joined.node_id, cp.ca.client_tls(control)).await;
        Self {
            _cp: cp,
            data,
            api,
            _server: server,
        }
    }

    fn volume_root(&self, name: &str) -> PathBuf {
        volumes::volume_root(self.data.path(), &volumes::local_name(ENV, name).unwrap())
    }

    async fn snapshot(
        &mut self,
        volume: &str,
        id: &str,
        s3: S3Target,
        hook: (&str, &str),
    ) -> (Vec<VolumeOpProgress>, Option<tonic::Status>) {
        let req = AgentSnapshotVolumeRequest {
            volume: Some(volume_of(volume)),
            snapshot: Some(VolumeSnapshot {
                meta: Some(Meta {
                    id: id.into(),
                    created_at: Some(prost_types::Timestamp {
                        seconds: 1_750_000_000,
                        nanos: 0,
                    }),
                    updated_at: None,
                }),
                ..VolumeSnapshot::default()
            }),
            pre_hook_container_id: hook.0.into(),
            pre_hook_command: hook.1.into(),
            s3: Some(s3),
        };
        let stream = self.api.snapshot_volume(req).await;
        drain(stream).await
    }

    async fn restore(
        &mut self,
        volume: &str,
        id: &str,
        s3: S3Target,
    ) -> (Vec<VolumeOpProgress>, Option<tonic::Status>) {
        let stream = self
            .api
            .restore_volume(AgentRestoreVolumeRequest {
                volume: Some(volume_of(volume)),
                manifest_key: id.into(),
                s3: Some(s3),
            })
            .await;
        drain(stream).await
    }
}

fn volume_of(name: &str) -> Volume {
    Volume {
        environment_id: ENV.into(),
        name: name.into(),
        ..Volume::default()
    }
}

/// Every frame of a progress stream, and the status it ended with (if not OK).
async fn drain(
    stream: Result<tonic::Response<tonic::Streaming<VolumeOpProgress>>, tonic::Status>,
) -> (Vec<VolumeOpProgress>, Option<tonic::Status>) {
    let mut stream = match stream {
        Ok(s) => s.into_inner(),
        Err(s) => return (Vec::new(), Some(s)),
    };
    let mut frames = Vec::new();
    loop {
        match tokio::time::timeout(WAIT, stream.message())
            .await
            .expect("progress stalled")
        {
            Ok(Some(f)) => frames.push(f),
            Ok(None) => return (frames, None),
            Err(s) => return (frames, Some(s)),
        }
    }
}

fn phases(frames: &[VolumeOpProgress]) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    for f in frames {
        if out.last() != Some(&f.phase.as_str()) {
            out.push(&f.phase);
        }
    }
    out
}

/// Flips the byte at `at` of `file`, keeping its size and mtime; returns
/// the new content.
fn flip_byte_keeping_mtime(file: &Path, at: usize) -> Vec<u8> {
    let mtime = std::fs::metadata(file).unwrap().modified().unwrap();
    let mut data = std::fs::read(file).unwrap();
    data[at] ^= 0xff;
    std::fs::write(file, &data).unwrap();
    std::fs::File::options()
        .write(true)
        .open(file)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    data
}

/// The two trees hold the same entries, read with `lstat` and `read`
/// only (never with the snapshot code under test): type, mode, owner,
/// modification time (directories included), size and content digest,
/// link target, device numbers, and which paths share an inode.
fn assert_same_tree(a: &Path, b: &Path) {
    let (la, lb) = (tree_listing(a), tree_listing(b));
    let only_a: Vec<_> = la.iter().filter(|l| !lb.contains(l)).collect();
    let only_b: Vec<_> = lb.iter().filter(|l| !la.contains(l)).collect();
    assert!(
        only_a.is_empty() && only_b.is_empty(),
        "trees differ:\n  only in {}: {only_a:#?}\n  only in {}: {only_b:#?}",
        a.display(),
        b.display()
    );
}

/// One line per entry below `root`, sorted by path (see [`assert_same_tree`]).
fn tree_listing(root: &Path) -> Vec<String> {
    use std::os::unix::fs::FileTypeExt;
    let mut paths = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let path = e.unwrap().path();
            if std::fs::symlink_metadata(&path).unwrap().is_dir() {
                dirs.push(path.clone());
            }
            paths.push(path);
        }
    }
    paths.sort();
    let mut first_of_inode: BTreeMap<u64, String> = BTreeMap::new();
    let mut out = Vec::new();
    for path in paths {
        let rel = path
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let m = std::fs::symlink_metadata(&path).unwrap();
        let ft = m.file_type();
        let what = if ft.is_symlink() {
            format!("link -> {}", std::fs::read_link(&path).unwrap().display())
        } else if ft.is_dir() {
            "dir".to_owned()
        } else if ft.is_file() {
            let same = if m.nlink() > 1 {
                first_of_inode
                    .entry(m.ino())
                    .or_insert_with(|| rel.clone())
                    .clone()
            } else {
                rel.clone()
            };
            let digest = sha2::Sha256::digest(std::fs::read(&path).unwrap());
            format!("file {} {digest:x} inode-of {same}", m.len())
        } else if ft.is_fifo() {
            "fifo".to_owned()
        } else if ft.is_char_device() || ft.is_block_device() {
            let kind = if ft.is_char_device() { "char" } else { "block" };
            let dev = m.rdev();
            format!(
                "{kind} {}:{}",
                rustix::fs::major(dev),
                rustix::fs::minor(dev)
            )
        } else {
            "socket".to_owned()
        };
        // A symlink's own mode and time are not kept by any tar reader.
        let meta = if ft.is_symlink() {
            format!("{}:{}", m.uid(), m.gid())
        } else {
            format!(
                "{:o} {}:{} {}",
                m.mode() & 0o7777,
                m.uid(),
                m.gid(),
                m.mtime()
            )
        };
        out.push(format!("{rel} {what} {meta}"));
    }
    out
}

fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n + 32);
    let mut block = sha2::Sha256::digest(seed.to_le_bytes());
    while out.len() < n {
        out.extend_from_slice(&block);
        block = sha2::Sha256::digest(block);
    }
    out.truncate(n);
    out
}

fn mknod(path: &Path, kind: rustix::fs::FileType, mode: u32, dev: (u32, u32)) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        path,
        kind,
        rustix::fs::Mode::from_raw_mode(mode),
        rustix::fs::makedev(dev.0, dev.1),
    )
    .unwrap();
}

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A tree with every entry type, long and non-ASCII names, setuid and
/// setgid files, a sticky directory, foreign owners, and hard links.
fn rich_tree(root: &Path) {
    let long = root.join(format!(
        "long/{}/{}/{}",
        "x".repeat(90),
        "y".repeat(90),
        "z".repeat(90)
    ));
    std::fs::create_dir_all(&long).unwrap();
    std::fs::write(long.join(format!("{}.txt", "n".repeat(200))), "deep").unwrap();
    std::fs::create_dir_all(root.join("a/b")).unwrap();
    std::fs::write(root.join("a.txt"), "sorted before a/").unwrap();
    std::fs::write(root.join("a/b/c"), random_bytes(1, 300 * 1024)).unwrap();
    std::fs::write(root.join("big.bin"), random_bytes(2, 3 << 20)).unwrap();
    std::fs::write(root.join("empty"), "").unwrap();
    std::fs::write(root.join("héllo wörld ✓.txt"), "unicode").unwrap();
    std::fs::write(root.join("suid"), "#!/bin/sh\n").unwrap();
    chmod(&root.join("suid"), 0o4755);
    std::fs::write(root.join("sgid"), "x").unwrap();
    chmod(&root.join("sgid"), 0o2750);
    std::fs::create_dir(root.join("tmp")).unwrap();
    chmod(&root.join("tmp"), 0o1777);
    std::fs::write(root.join("owned"), "by someone else").unwrap();
    std::os::unix::fs::chown(root.join("owned"), Some(1234), Some(5678)).unwrap();
    chmod(&root.join("owned"), 0o640);
    std::os::unix::fs::symlink("a.txt", root.join("rel-link")).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", root.join("abs-link")).unwrap();
    std::os::unix::fs::symlink("nowhere", root.join("dangling")).unwrap();
    std::fs::write(root.join("hard1"), "linked twice").unwrap();
    std::fs::hard_link(root.join("hard1"), root.join("a/hard2")).unwrap();
    mknod(
        &root.join("fifo"),
        rustix::fs::FileType::Fifo,
        0o644,
        (0, 0),
    );
    mknod(
        &root.join("null"),
        rustix::fs::FileType::CharacterDevice,
        0o666,
        (1, 3),
    );
    mknod(
        &root.join("blk"),
        rustix::fs::FileType::BlockDevice,
        0o600,
        (7, 200),
    );
}

/// Snapshot a rich live tree through the node API (a socket, a file that
/// grows while read), restore it into a fresh volume: the trees' tars are equal.
#[tokio::test]
async fn a_snapshot_restores_every_entry_exactly_through_the_node_api() {
    let Some(rig) = support::rig() else { return };
    let Some((endpoint, bucket)) = s3_bucket("rich").await else {
        return;
    };
    support::with_namespace(&rig, "snap-rich", |ctd, _rig| async move {
        let mut node = Node::start(&ctd).await;
        let src = node.volume_root("source");
        std::fs::create_dir_all(&src).unwrap();
        rich_tree(&src);
        let _socket = std::os::unix::net::UnixListener::bind(src.join("app.sock")).unwrap();
        std::fs::write(src.join("grow.log"), random_bytes(3, 4 << 20)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let grower = {
            let (stop, path) = (Arc::clone(&stop), src.join("grow.log"));
            std::thread::spawn(move || {
                let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    f.write_all(&[b'+'; 4096]).unwrap();
                    std::thread::sleep(Duration::from_micros(200));
                }
            })
        };

        let s3 = target(&endpoint, &bucket, &KEY);
        let (frames, status) = node
            .snapshot("source", "snap-1", s3.clone(), ("", ""))
            .await;
        stop.store(true, Ordering::Relaxed);
        grower.join().unwrap();
        assert!(status.is_none(), "{status:?} {frames:?}");
        assert_eq!(phases(&frames), ["upload", "done"], "{frames:?}");
        assert_eq!(frames[0].bytes_done, 0, "upload starts at 0");
        let done = frames.last().unwrap();
        assert_eq!(done.manifest_key, "snap-1");
        assert!(done.bytes_total > 7 << 20, "{done:?}");
        assert!(done.bytes_done > 0 && done.bytes_done <= done.bytes_total);
        // Per-chunk frames count newly stored plaintext, never the tar size.
        let counts: Vec<u64> = frames.iter().map(|f| f.bytes_done).collect();
        assert!(counts.windows(2).all(|w| w[0] <= w[1]), "{counts:?}");
        assert_eq!(frames[frames.len() - 2].bytes_done, done.bytes_done);

        let (frames, status) = node.restore("copy", "snap-1", s3.clone()).await;
        assert!(status.is_none(), "{status:?} {frames:?}");
        assert_eq!(phases(&frames), ["download", "done"]);
        let dst = node.volume_root("copy");

        // The growing file holds exactly what its header said: a prefix.
        let grown = std::fs::read(src.join("grow.log")).unwrap();
        let copy = std::fs::read(dst.join("grow.log")).unwrap();
        assert!(copy.len() >= 4 << 20 && grown.starts_with(&copy));
        std::fs::remove_file(dst.join("grow.log")).unwrap();
        std::fs::remove_file(src.join("grow.log")).unwrap();
        assert!(!dst.join("app.sock").exists(), "sockets are skipped");
        std::fs::remove_file(src.join("app.sock")).unwrap();
        assert_same_tree(&src, &dst);
        let ino = |p: &str| std::fs::metadata(dst.join(p)).unwrap().ino();
        assert_eq!(ino("hard1"), ino("a/hard2"), "hard links stay links");
        assert_eq!(
            std::fs::metadata(dst.join("suid")).unwrap().mode() & 0o7777,
            0o4755
        );
    })
    .await;
}

/// SNAP-5 and SNAP-4 against the real store: an unchanged re-snapshot adds
/// exactly one object (its manifest); one flipped byte in a 512 KiB file,
/// with 4 KiB average chunks, adds 1 or 2 chunks.
#[tokio::test]
async fn dedup_adds_only_what_changed() {
    let Some((endpoint, bucket)) = s3_bucket("dedup").await else {
        return;
    };
    let engine = Engine::new(&config(&endpoint, &bucket), &KEY)
        .unwrap()
        .with_params(chunker::Params::with(1024, 4096, 16384));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data.bin");
    std::fs::write(&file, random_bytes(9, 512 * 1024)).unwrap();
    let none: zattera_agent::snapshot::ProgressFn = Arc::new(|_| {});
    let count = || async { engine.store().list("").await.unwrap().len() };

    let first = engine
        .snapshot(dir.path(), "one", 1, Arc::clone(&none))
        .await
        .unwrap();
    assert_eq!(first.new_chunks, first.chunks);
    let before = count().await;
    assert_eq!(before, first.chunks + 1);
    let again = engine
        .snapshot(dir.path(), "two", 2, Arc::clone(&none))
        .await
        .unwrap();
    assert_eq!((again.new_chunks, again.new_bytes), (0, 0));
    assert_eq!(count().await, before + 1, "only the manifest");

    // Same size and mtime second: only the content differs.
    flip_byte_keeping_mtime(&file, 200_000);
    let flipped = engine.snapshot(dir.path(), "three", 3, none).await.unwrap();
    assert!(
        (1..=2).contains(&flipped.new_chunks),
        "{} new chunks",
        flipped.new_chunks
    );
    assert_eq!(count().await, before + 2 + flipped.new_chunks);
}

/// A workload plants links where the snapshot has files and directories:
/// the restore writes nothing outside the volume and the result is the
/// snapshot exactly, nothing merged.
#[tokio::test]
async fn a_restore_never_follows_planted_links() {
    let Some((endpoint, bucket)) = s3_bucket("plant").await else {
        return;
    };
    let engine = Engine::new(&config(&endpoint, &bucket), &KEY).unwrap();
    let none: zattera_agent::snapshot::ProgressFn = Arc::new(|_| {});
    let base = tempfile::tempdir().unwrap();
    let outside = base.path().join("etc");
    std::fs::create_dir(&outside).unwrap();
    std::fs::write(outside.join("passwd"), "host file").unwrap();
    let vol = base.path().join("volumes/v/_data");
    std::fs::create_dir_all(vol.join("conf.d")).unwrap();
    std::fs::write(vol.join("x"), "snapshot x").unwrap();
    std::fs::write(vol.join("conf.d/app.conf"), "snapshot conf").unwrap();
    let reference = base.path().join("reference");
    std::fs::create_dir(&reference).unwrap();
    engine
        .snapshot(&vol, "before", 1, Arc::clone(&none))
        .await
        .unwrap();
    engine
        .restore("before", &reference, Arc::clone(&none))
        .await
        .unwrap();

    // The workload's plants.
    std::fs::remove_file(vol.join("x")).unwrap();
    std::os::unix::fs::symlink(outside.join("passwd"), vol.join("x")).unwrap();
    std::fs::remove_dir_all(vol.join("conf.d")).unwrap();
    std::os::unix::fs::symlink(&outside, vol.join("conf.d")).unwrap();
    std::fs::write(vol.join("planted"), "not in the snapshot").unwrap();

    engine.restore("before", &vol, none).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(outside.join("passwd")).unwrap(),
        "host file"
    );
    let outside_names: Vec<_> = std::fs::read_dir(&outside)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(outside_names, ["passwd"]);
    assert!(!vol.join("planted").exists(), "a restore is not a merge");
    assert!(!vol.join("x").is_symlink() && !vol.join("conf.d").is_symlink());
    assert_same_tree(&reference, &vol);
}

/// Swapped chunks, a corrupted chunk and a wrong data key all fail the
/// restore and leave the volume as it was.
#[tokio::test]
async fn bad_objects_and_wrong_keys_fail_and_leave_the_volume() {
    let Some((endpoint, bucket)) = s3_bucket("tamper").await else {
        return;
    };
    let cfg = config(&endpoint, &bucket);
    let engine = Engine::new(&cfg, &KEY)
        .unwrap()
        .with_params(chunker::Params::with(1024, 4096, 16384));
    let none: zattera_agent::snapshot::ProgressFn = Arc::new(|_| {});
    let src = tempfile::tempdir().unwrap();
    std::fs::write(src.path().join("f"), random_bytes(4, 64 * 1024)).unwrap();
    engine
        .snapshot(src.path(), "s", 1, Arc::clone(&none))
        .await
        .unwrap();
    let manifest = engine.manifest("s").await.unwrap();
    assert!(manifest.chunks.len() >= 3);

    let base = tempfile::tempdir().unwrap();
    let vol = base.path().join("_data");
    std::fs::create_dir(&vol).unwrap();
    std::fs::write(vol.join("precious"), "keep me").unwrap();
    let untouched = |what: &str| {
        let names: Vec<_> = std::fs::read_dir(base.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names, ["_data"], "{what}: staging left behind");
        assert_eq!(
            std::fs::read_to_string(vol.join("precious")).unwrap(),
            "keep me",
            "{what}"
        );
        assert_eq!(std::fs::read_dir(&vol).unwrap().count(), 1, "{what}");
    };

    let wrong = Engine::new(&cfg, &[7u8; 32]).unwrap();
    let err = wrong
        .restore("s", &vol, Arc::clone(&none))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("authentication failed"), "{err}");
    untouched("wrong key");

    // Two valid objects swapped: each opens, neither matches its hash.
    let store = engine.store();
    let (a, b) = (&manifest.chunks[0].hash, &manifest.chunks[1].hash);
    let key = |h: &str| format!("chunks/{h}");
    let obj_a = store.get(&key(a), 1 << 30).await.unwrap().unwrap();
    let obj_b = store.get(&key(b), 1 << 30).await.unwrap().unwrap();
    store.put(&key(a), obj_b.clone()).await.unwrap();
    store.put(&key(b), obj_a.clone()).await.unwrap();
    let err = engine
        .restore("s", &vol, Arc::clone(&none))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("does not match its hash"), "{err}");
    untouched("swapped chunks");
    store.put(&key(b), obj_b).await.unwrap();

    // A flipped byte: GCM refuses it.
    let mut bent = obj_a.to_vec();
    let mid = bent.len() / 2;
    bent[mid] ^= 1;
    store.put(&key(a), bent.into()).await.unwrap();
    let err = engine.restore("s", &vol, none).await.unwrap_err();
    assert!(err.to_string().contains("authentication failed"), "{err}");
    untouched("corrupted chunk");
}

/// Issue 45.3, attack: a manifest that declares a 64 GiB chunk was believed,
/// and each chunk is opened in memory, four at a time. It is refused at
/// once, naming the chunk, and the volume is left as it was.
#[tokio::test]
async fn a_manifest_declaring_a_huge_chunk_is_refused() {
    let Some((endpoint, bucket)) = s3_bucket("hugechunk").await else {
        return;
    };
    let cfg = config(&endpoint, &bucket);
    let engine = Engine::new(&cfg, &KEY).unwrap();
    let forged = format!(
        r#"{{"version":1,"chunks":[{{"hash":"{}","size":{}}}],"tar_bytes":1}}"#,
        "ab".repeat(32),
        64u64 << 30
    );
    let sealed = zattera_agent::snapshot::DataKey::new(&KEY)
        .unwrap()
        .seal_object(forged.as_bytes())
        .unwrap();
    engine
        .store()
        .put(
            &zattera_agent::snapshot::manifest_key("forged"),
            sealed.into(),
        )
        .await
        .unwrap();
    let vol = tempfile::tempdir().unwrap();
    let none: zattera_agent::snapshot::ProgressFn = Arc::new(|_| {});
    let err = engine
        .restore("forged", vol.path(), none)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("declares 68719476736 bytes"), "{err}");
    assert_eq!(std::fs::read_dir(vol.path()).unwrap().count(), 0);
}

/// Pre-hooks run in the running container that mounts the volume (control
/// names none) and their dump is in the snapshot; a failing hook aborts
/// it; a restore under that running container is refused.
#[tokio::test]
async fn pre_hooks_run_in_the_volumes_container_and_restores_wait_for_it_to_stop() {
    let Some(rig) = support::rig() else { return };
    let Some((endpoint, bucket)) = s3_bucket("hook").await else {
        return;
    };
    support::with_namespace(&rig, "snap-hook", |ctd, rig| async move {
        let mut node = Node::start(&ctd).await;
        let s3 = target(&endpoint, &bucket, &KEY);
        let root = node.volume_root("db");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("table"), "rows").unwrap();
        start_container(&ctd, &rig, "db-1", &root, &node.data.path().join("logs")).await;

        let (frames, status) = node
            .snapshot(
                "db",
                "hooked",
                s3.clone(),
                ("", "echo dumped-by-hook > /data/dump.sql"),
            )
            .await;
        assert!(status.is_none(), "{status:?} {frames:?}");
        assert_eq!(phases(&frames), ["hooks", "upload", "done"]);
        let check = tempfile::tempdir().unwrap();
        let out = check.path().join("restored");
        Engine::new(&config(&endpoint, &bucket), &KEY)
            .unwrap()
            .restore("hooked", &out, Arc::new(|_| {}))
            .await
            .unwrap();
        assert_eq!(
            std::fs::read_to_string(out.join("dump.sql")).unwrap(),
            "dumped-by-hook\n"
        );

        let (frames, status) = node
            .snapshot("db", "failing", s3.clone(), ("db-1", "exit 3"))
            .await;
        let status = status.expect("a failing hook fails the snapshot");
        assert_eq!(phases(&frames), ["hooks", "error"]);
        assert_eq!(frames.last().unwrap().error, "pre-hook exited 3");
        assert_ne!(status.code(), tonic::Code::Ok);

        let (frames, status) = node.restore("db", "hooked", s3.clone()).await;
        let status = status.expect("refused");
        assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
        assert_eq!(phases(&frames), ["error"]);
        assert!(frames[0].error.contains("db-1"), "{frames:?}");
        assert_eq!(std::fs::read_to_string(root.join("table")).unwrap(), "rows");

        zattera_agent::runtime::containers::stop(&ctd, "db-1", 9, Duration::from_secs(5))
            .await
            .unwrap();
        let (frames, status) = node.restore("db", "hooked", s3).await;
        assert!(status.is_none(), "{status:?} {frames:?}");
        assert_eq!(
            std::fs::read_to_string(root.join("dump.sql")).unwrap(),
            "dumped-by-hook\n"
        );
    })
    .await;
}

/// A managed container running `sleep` with `root` mounted at /data.
async fn start_container(ctd: &Containerd, rig: &support::Rig, id: &str, root: &Path, logs: &Path) {
    use zattera_agent::runtime::spec::{self, BindMount, ContainerSpec};
    use zattera_agent::runtime::{ImageRef, get_local, import_archive};
    import_archive(ctd, &rig.oci_archive(), None).await.unwrap();
    let name: ImageRef = support::TEST_IMAGE.parse().unwrap();
    let image = get_local(ctd, &name).await.unwrap().unwrap();
    let cfg = image.config.config().clone().unwrap_or_default();
    let c = ContainerSpec {
        hostname: id.into(),
        args: spec::process_args(&[], &[], "sleep 600", true),
        env: spec::process_env(id, &cfg.env().clone().unwrap_or_default(), []).unwrap(),
        cwd: "/".into(),
        mounts: vec![BindMount {
            source: root.to_owned(),
            destination: "/data".into(),
            readonly: false,
        }],
        cgroups_path: format!("/zattera-test/{}/{id}", ctd.namespace()).into(),
        ..ContainerSpec::default()
    };
    let labels = [
        ("dev.zattera/managed", "true"),
        ("dev.zattera/role", "service"),
        ("dev.zattera/assignment-id", id),
    ];
    std::fs::create_dir_all(logs).unwrap();
    let log = logs.join(format!("{id}.log"));
    support::create_and_start(ctd, id, &name, image.chain_id, &labels, &c, &log).await;
}

/// A TCP relay to the S3 server that can be cut: `down` closes every
/// connection and refuses new ones (connection reset).
struct Relay {
    addr: String,
    down: Arc<AtomicBool>,
    uploaded: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relay {
    async fn start(upstream: &str, cut_after: u64) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = format!("http://{}", listener.local_addr().unwrap());
        let down = Arc::new(AtomicBool::new(false));
        let uploaded = Arc::new(AtomicU64::new(0));
        let upstream = upstream.trim_start_matches("http://").to_owned();
        let (d, u) = (Arc::clone(&down), Arc::clone(&uploaded));
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if d.load(Ordering::Relaxed) {
                    drop(client);
                    continue;
                }
                let (d, u, upstream) = (Arc::clone(&d), Arc::clone(&u), upstream.clone());
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = async {
                        use tokio::io::{AsyncReadExt, AsyncWriteExt};
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = cr.read(&mut buf).await.unwrap_or(0);
                            let total = u.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
                            if total > cut_after {
                                d.store(true, Ordering::Relaxed);
                            }
                            if n == 0 || d.load(Ordering::Relaxed) {
                                return;
                            }
                            if sw.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    };
                    let downl = async {
                        use tokio::io::{AsyncReadExt, AsyncWriteExt};
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = sr.read(&mut buf).await.unwrap_or(0);
                            if n == 0 || d.load(Ordering::Relaxed) {
                                return;
                            }
                            if cw.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    };
                    // Either side ending (or the cut) drops both connections.
                    tokio::select! { () = up => {}, () = downl => {} }
                });
            }
        });
        Self {
            addr,
            down,
            uploaded,
            task,
        }
    }
}

/// S3 goes away mid-snapshot: one `error` frame, a non-OK status, no
/// manifest. Back again: the next snapshot works.
#[tokio::test]
async fn s3_down_mid_snapshot_fails_cleanly_and_the_next_one_works() {
    let Some(rig) = support::rig() else { return };
    let Some((endpoint, bucket)) = s3_bucket("down").await else {
        return;
    };
    support::with_namespace(&rig, "snap-down", |ctd, _rig| async move {
        let mut node = Node::start(&ctd).await;
        let root = node.volume_root("big");
        std::fs::create_dir_all(&root).unwrap();
        for i in 0..6 {
            std::fs::write(root.join(format!("f{i}")), random_bytes(100 + i, 4 << 20)).unwrap();
        }
        // Down after about 8 MiB of a 24 MiB upload.
        let relay = Relay::start(&endpoint, 8 << 20).await;
        let (frames, status) = node
            .snapshot("big", "cut", target(&relay.addr, &bucket, &KEY), ("", ""))
            .await;
        let status = status.expect("the snapshot fails");
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(relay.down.load(Ordering::Relaxed));
        assert!(relay.uploaded.load(Ordering::Relaxed) > 8 << 20);
        let errors: Vec<_> = frames.iter().filter(|f| f.phase == "error").collect();
        assert_eq!(errors.len(), 1, "{frames:?}");
        assert_eq!(frames.last().unwrap().phase, "error");
        assert!(!errors[0].error.is_empty());
        let engine = Engine::new(&config(&endpoint, &bucket), &KEY).unwrap();
        assert!(engine.list().await.unwrap().is_empty(), "no manifest");

        relay.down.store(false, Ordering::Relaxed);
        relay.uploaded.store(0, Ordering::Relaxed);
        let relay_back = Relay::start(&endpoint, u64::MAX).await;
        let (frames, status) = node
            .snapshot(
                "big",
                "after",
                target(&relay_back.addr, &bucket, &KEY),
                ("", ""),
            )
            .await;
        assert!(status.is_none(), "{status:?}");
        assert_eq!(frames.last().unwrap().phase, "done");
        let ids: Vec<String> = engine
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|l| l.key)
            .collect();
        assert_eq!(ids, ["after"]);
    })
    .await;
}

fn python_env(cmd: &mut std::process::Command, endpoint: &str, bucket: &str) {
    let c = config(endpoint, bucket);
    cmd.env("S3_ENDPOINT", &c.endpoint)
        .env("S3_BUCKET", &c.bucket)
        .env("S3_PREFIX", &c.prefix)
        .env("S3_ACCESS_KEY", &c.access_key)
        .env("S3_SECRET_KEY", &c.secret_key)
        .env("DATA_KEY_HEX", hex::encode(KEY))
        .env("CHUNK_AVG", "65536");
}

fn run_python(args: &[&str], endpoint: &str, bucket: &str) -> String {
    let mut cmd = std::process::Command::new(python());
    cmd.arg(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/snapshot_ref.py"
    ))
    .args(args);
    python_env(&mut cmd, endpoint, bucket);
    let out = cmd.output().expect("run tests/snapshot_ref.py");
    assert!(
        out.status.success(),
        "snapshot_ref.py {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Tier A both ways: a snapshot written by an independent implementation
/// of §8 (tests/snapshot_ref.py: its own FastCDC, Python's tarfile,
/// cryptography's AES-GCM) restores through the node API, and this agent's
/// snapshot opens with it.
#[tokio::test]
async fn snapshots_cross_between_this_agent_and_an_independent_writer() {
    let Some(rig) = support::rig() else { return };
    let Some((endpoint, bucket)) = s3_bucket("compat").await else {
        return;
    };
    assert!(python().exists(), "the rig's S3 venv is missing");
    support::with_namespace(&rig, "snap-compat", |ctd, _rig| async move {
        let mut node = Node::start(&ctd).await;
        let s3 = target(&endpoint, &bucket, &KEY);
        // The independent FastCDC agrees with fastcdc-go's boundaries.
        let golden = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/fastcdc/golden.txt");
        assert!(run_python(&["golden", golden], &endpoint, &bucket).contains("checked 3"));

        let src = node.volume_root("src");
        std::fs::create_dir_all(&src).unwrap();
        rich_tree(&src);
        std::fs::remove_file(src.join("big.bin")).unwrap(); // pure Python chunks slowly

        let printed = run_python(
            &["write", src.to_str().unwrap(), "ref-1"],
            &endpoint,
            &bucket,
        );
        let manifest: serde_json::Value = serde_json::from_str(printed.trim()).unwrap();
        assert!(manifest["chunks"].as_array().unwrap().len() > 1);
        let (frames, status) = node.restore("from-ref", "ref-1", s3.clone()).await;
        assert!(status.is_none(), "{status:?} {frames:?}");
        assert_same_tree(&src, &node.volume_root("from-ref"));

        let (frames, status) = node.snapshot("src", "ours-1", s3, ("", "")).await;
        assert!(status.is_none(), "{status:?} {frames:?}");
        let out = tempfile::tempdir().unwrap();
        let dest = out.path().join("by-python");
        run_python(
            &["read", "ours-1", dest.to_str().unwrap()],
            &endpoint,
            &bucket,
        );
        assert_same_tree(&src, &dest);
    })
    .await;
}

/// The operators' CLI: `volume snapshot`, `ls` and `restore` against the
/// same server, with the target from a file, no control plane.
#[tokio::test]
async fn the_cli_saves_and_brings_back_a_directory() {
    let Some(endpoint) = s3_endpoint() else {
        return;
    };
    let bucket = format!("zt-cli-{}", std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir(&src).unwrap();
    rich_tree(&src);
    std::fs::write(dir.path().join("key"), hex::encode(KEY)).unwrap();
    let target = dir.path().join("target.toml");
    std::fs::write(
        &target,
        format!(
            "endpoint = {endpoint:?}\nbucket = {bucket:?}\nprefix = \"dr\"\naccess_key = \"a\"\n\
             secret_key = \"s\"\ndata_key_file = {:?}\n",
            dir.path().join("key")
        ),
    )
    .unwrap();
    let cli = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_zattera-agent"))
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .args(args)
            .arg("--target")
            .arg(&target)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let src_arg = src.to_str().unwrap();
    let said = cli(&[
        "volume",
        "snapshot",
        "--path",
        src_arg,
        "--id",
        "dr-1",
        "--create-bucket",
    ]);
    assert!(said.starts_with("snapshot dr-1:"), "{said}");
    assert!(cli(&["volume", "ls"]).contains("dr-1"));
    let dst = dir.path().join("restored");
    let dst_arg = dst.to_str().unwrap();
    cli(&[
        "volume",
        "restore",
        "--path",
        dst_arg,
        "--snapshot",
        "dr-1",
        "--force",
    ]);
    assert_same_tree(&src, &dst);
}

/// An unchanged root is snapshot from its metadata: the last full walk's
/// chunk list is reused when a scan finds every header, inode and
/// nanosecond time equal, and the walk is old enough for ctime to be
/// trusted. Any change, a same-size rewrite included, reads everything again.
#[tokio::test]
async fn an_unchanged_root_reuses_its_last_walk_and_a_change_does_not() {
    let Some((endpoint, bucket)) = s3_bucket("reuse").await else {
        return;
    };
    let cache = tempfile::tempdir().unwrap();
    let engine = Engine::new(&config(&endpoint, &bucket), &KEY)
        .unwrap()
        .with_params(chunker::Params::with(1024, 4096, 16384))
        .with_cache(cache.path().to_owned());
    let none: zattera_agent::snapshot::ProgressFn = Arc::new(|_| {});
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("vol");
    std::fs::create_dir(&root).unwrap();
    rich_tree(&root);
    std::fs::remove_file(root.join("big.bin")).unwrap(); // small chunks: keep it quick
    let snap = |id: &'static str| {
        let (engine, root, none) = (&engine, &root, Arc::clone(&none));
        async move { engine.snapshot(root, id, 1, none).await.unwrap() }
    };
    // Just written: its ctimes are too fresh to be trusted, so this walk
    // is not remembered.
    assert!(!snap("fresh").await.reused);
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let full = snap("full").await;
    assert!(!full.reused);
    let objects = engine.store().list("").await.unwrap().len();
    let again = snap("again").await;
    assert!(again.reused, "{again:?}");
    assert_eq!(
        (again.tar_bytes, again.chunks),
        (full.tar_bytes, full.chunks)
    );
    assert_eq!(engine.store().list("").await.unwrap().len(), objects + 1);
    let out = dir.path().join("out");
    engine
        .restore("again", &out, Arc::clone(&none))
        .await
        .unwrap();
    assert_same_tree(&root, &out);

    // A same-size rewrite keeping the mtime: only ctime tells.
    let file = root.join("a/b/c");
    let data = flip_byte_keeping_mtime(&file, 1000);
    let changed = snap("changed").await;
    assert!(!changed.reused && changed.new_chunks > 0, "{changed:?}");
    let out2 = dir.path().join("out2");
    engine.restore("changed", &out2, none).await.unwrap();
    assert_eq!(std::fs::read(out2.join("a/b/c")).unwrap(), data);
}
