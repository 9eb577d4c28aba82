//! Image garbage collection and disk pressure (issue 17.2), through the real
//! `zattera-agent run` binary against a private containerd whose content
//! store is a 64 MiB tmpfs: unused images go oldest first once the high
//! mark is crossed, images in use and pinned ones stay, the space comes
//! back (measured on the tmpfs), the running container is untouched, and a
//! store still over the mark is reported as disk pressure in `status`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use support::agent::AgentProc;
use support::{TEST_IMAGE, rig};
use zattera_agent::runtime::containers::{self, TaskState};
use zattera_agent::runtime::disk::Usage;
use zattera_agent::runtime::{Containerd, import_archive};

const PINNED: &str = "docker.io/zattera/gc-pinned";

/// An image of `layers` incompressible layers of `mib` MiB, named `name`.
async fn import_big(
    ctd: &Containerd,
    rig: &support::Rig,
    dir: &Path,
    name: &str,
    layers: u32,
    mib: u32,
) {
    let out: PathBuf = dir.join(format!("{}.tar", name.replace(['/', ':'], "_")));
    let made = std::process::Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/bench/runtime/mkbig.py"
        ))
        .arg(rig.oci_archive())
        .arg(&out)
        .args([layers.to_string(), mib.to_string()])
        .output()
        .unwrap();
    assert!(made.status.success(), "mkbig: {made:?}");
    import_archive(ctd, &out, Some(name.parse().unwrap()))
        .await
        .unwrap();
}

async fn task_pid(ctd: &Containerd, cid: &str) -> Option<u32> {
    match containers::task_state(ctd, cid).await.unwrap() {
        TaskState::Running { pid } => Some(pid),
        _ => None,
    }
}

#[tokio::test]
async fn unused_images_go_oldest_first_and_pressure_is_reported() {
    let Some(rig) = rig() else { return };
    let private = support::private::PrivateContainerd::start_with_content_limit(64);
    let ns = support::unique_namespace("image-gc");
    let ctd = Containerd::connect(&private.socket, ns.clone())
        .await
        .unwrap();
    import_archive(&ctd, &rig.oci_archive(), None)
        .await
        .unwrap();
    let root = ctd.content_root().await.unwrap();

    let mut agent = AgentProc::new(&private.socket, ns.as_str(), "ztlc", "232-232");
    agent.run_args = [
        "--image-gc-interval",
        "1s",
        "--image-gc-min-age",
        "0s",
        "--image-gc-high-percent",
        "45",
        "--image-gc-low-percent",
        "35",
        "--image-gc-pin",
        &format!("{PINNED}*"),
    ]
    .map(String::from)
    .to_vec();
    agent.write_manifest(
        "svc.toml",
        &support::agent::app_manifest("svc", "sleep 1000000"),
    );
    agent.start();
    let cid = agent.wait_all(1, "HEALTHY").into_values().next().unwrap();
    let pid = task_pid(&ctd, &cid).await;
    // Down while the images come in, so that no pass runs before the store
    // is measured full; the container keeps running and is adopted.
    agent.kill9();

    // Three unused images, a second apart, and a pinned one: about 37 of
    // 64 MiB, over the high mark once the last is in.
    let dir = tempfile::tempdir().unwrap();
    let olds = [
        "docker.io/zattera/gc-old:1",
        "docker.io/zattera/gc-old:2",
        "docker.io/zattera/gc-old:3",
    ];
    let before_any = Usage::of(&root).unwrap();
    for name in olds {
        import_big(&ctd, &rig, dir.path(), name, 1, 8).await;
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    import_big(&ctd, &rig, dir.path(), &format!("{PINNED}:1"), 1, 8).await;
    let full = Usage::of(&root).unwrap();
    let snapshots_full = support::list_snapshots(&ctd).await.len();
    assert!(full.percent() > 45.0, "only {:.0}% full", full.percent());
    agent.start();
    eprintln!(
        "content store: {:.0}% before the images, {:.0}% with them",
        before_any.percent(),
        full.percent()
    );

    let end = Instant::now() + Duration::from_secs(30);
    let after = loop {
        let u = Usage::of(&root).unwrap();
        if u.percent() < 45.0 {
            break u;
        }
        assert!(
            Instant::now() < end,
            "still {:.0}% full; agent log:\n{}",
            u.percent(),
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let exists = |name: String| {
        let ctd = ctd.clone();
        async move { support::image_exists(&ctd, &name).await }
    };
    let mut kept = Vec::new();
    for name in olds {
        kept.push(exists(name.to_owned()).await);
    }
    // Oldest first: what is gone is a prefix of the three, at least one.
    assert!(!kept[0], "the oldest unused image is kept: {kept:?}");
    assert!(
        kept.windows(2).all(|w| w[0] <= w[1]),
        "not oldest first: {kept:?}"
    );
    assert!(exists(format!("{PINNED}:1")).await, "the pinned image went");
    assert!(exists(TEST_IMAGE.to_owned()).await, "the image in use went");
    let removed = kept.iter().filter(|k| !**k).count();
    let freed = full.used_bytes.saturating_sub(after.used_bytes);
    eprintln!(
        "removed {removed} images, {} MiB freed, now {:.0}%",
        freed >> 20,
        after.percent()
    );
    assert!(
        freed >= (removed as u64 * 8) << 20,
        "only {freed} bytes came back for {removed} images"
    );
    // Their unpacked layers (two snapshots each) went with them.
    let snapshots = support::list_snapshots(&ctd).await.len();
    assert!(
        snapshots + 2 * removed <= snapshots_full,
        "{snapshots} snapshots left of {snapshots_full} after removing {removed} images"
    );
    assert!(
        after.percent() < 35.0 || kept.iter().all(|k| !*k),
        "stopped above the low mark"
    );
    assert_eq!(
        task_pid(&ctd, &cid).await,
        pid,
        "the running container was touched"
    );
    // The pass logs what it removed once it is done (after the last
    // measurement the loop above saw).
    let end = Instant::now() + Duration::from_secs(10);
    while !(agent.log().contains("image gc") && agent.log().contains("disk pressure")) {
        assert!(
            Instant::now() < end,
            "no image gc line; agent log:\n{}",
            agent.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A second pinned image the store cannot lose: over the mark with
    // nothing left to remove is disk pressure, in status.
    import_big(&ctd, &rig, dir.path(), &format!("{PINNED}:2"), 3, 8).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let notice = loop {
        let status = agent.status().unwrap_or_default();
        let notices: Vec<String> = status["notices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|n| n.as_str().map(str::to_owned))
            .collect();
        if let Some(n) = notices.into_iter().find(|n| n.contains("disk pressure")) {
            break n;
        }
        assert!(
            Instant::now() < deadline,
            "no disk pressure in status: {status}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(notice.contains(&root.display().to_string()), "{notice}");
    for name in olds {
        assert!(!exists(name.to_owned()).await, "{name} kept under pressure");
    }
    assert!(exists(format!("{PINNED}:1")).await && exists(format!("{PINNED}:2")).await);
    assert!(exists(TEST_IMAGE.to_owned()).await);
    assert_eq!(
        task_pid(&ctd, &cid).await,
        pid,
        "the running container was touched"
    );

    agent.kill9();
    support::purge_namespace(&ctd).await;
}
