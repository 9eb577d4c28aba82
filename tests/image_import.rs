//! `image import` against the rig's real containerd: both archive formats,
//! idempotence, a corrupted blob, and that `ctr run` starts what we unpacked.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::io::{Read, Seek, SeekFrom, Write};
use std::process::Command;

use support::{Rig, TEST_IMAGE, list_snapshots, on_rig, rig, with_namespace};
use zattera_agent::runtime::unpack::snapshot_exists;
use zattera_agent::runtime::{Containerd, ImageRef, import_archive};

/// `ctr run --rm` of the image: proves the rootfs is unpacked and usable.
fn ctr_run(socket: &std::path::Path, ns: &str, image: &str, args: &[&str]) -> String {
    let id = format!("ctr-run-{}", std::process::id());
    let out = Command::new("ctr")
        .arg("--address")
        .arg(socket)
        .args(["-n", ns, "run", "--rm", image, &id])
        .args(args)
        .output()
        .expect("run ctr");
    assert!(
        out.status.success(),
        "ctr run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Asserts that the test image in `ctd` is unpacked at `chain_id`, that
/// the `op` lease is released, and that it runs (ctr prints its page).
async fn assert_unpacked_and_runs(ctd: &Containerd, rig: &Rig, chain_id: &str, op: &str) {
    assert!(snapshot_exists(ctd, chain_id).await.unwrap());
    assert_eq!(
        support::lease_count(ctd).await,
        0,
        "the {op} lease is released"
    );
    let out = ctr_run(
        &rig.socket,
        ctd.namespace().as_str(),
        TEST_IMAGE,
        &["cat", "/var/www/index.html"],
    );
    assert_eq!(out, "hello from zattera\n");
}

#[tokio::test]
async fn oci_archive_imports_unpacks_and_runs() {
    on_rig("oci", |ctd, rig| async move {
        let imported = import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .expect("import");
        assert_eq!(imported.len(), 1);
        let image = &imported[0];
        assert_eq!(image.names[0].to_string(), TEST_IMAGE);
        assert_eq!(image.blobs_written, 3, "manifest, config and one layer");
        assert!(support::image_exists(&ctd, TEST_IMAGE).await);
        assert_unpacked_and_runs(&ctd, &rig, image.chain_id.as_str(), "import").await;
    })
    .await;
}

#[tokio::test]
async fn docker_save_archive_imports_under_a_new_name() {
    on_rig("docker", |ctd, rig| async move {
        let name: ImageRef = "localhost:5000/team/bb:v1".parse().unwrap();
        let imported = import_archive(&ctd, &rig.docker_archive(), Some(name.clone()))
            .await
            .expect("import");
        assert_eq!(imported[0].names, vec![name.clone()]);
        assert!(support::image_exists(&ctd, &name.to_string()).await);
        assert!(
            !support::image_exists(&ctd, TEST_IMAGE).await,
            "--name replaces the archive's name"
        );
        let out = ctr_run(
            &rig.socket,
            ctd.namespace().as_str(),
            &name.to_string(),
            &["sh", "-c", "echo $((6*7))"],
        );
        assert_eq!(out, "42\n");
    })
    .await;
}

#[tokio::test]
async fn importing_twice_writes_nothing_new() {
    on_rig("twice", |ctd, rig| async move {
        let first = import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .expect("first import");
        let snapshots_before = list_snapshots(&ctd).await;
        let second = import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .expect("second import");
        assert_eq!(second[0].blobs_written, 0);
        assert_eq!(second[0].chain_id, first[0].chain_id);
        assert_eq!(
            list_snapshots(&ctd).await,
            snapshots_before,
            "no new snapshots"
        );
        // The docker form of the same image shares its unpacked layer.
        let docker = import_archive(
            &ctd,
            &rig.docker_archive(),
            Some("localhost/other:1".parse().unwrap()),
        )
        .await
        .expect("docker import");
        assert_eq!(docker[0].chain_id, first[0].chain_id);
        assert_eq!(list_snapshots(&ctd).await, snapshots_before);
    })
    .await;
}

/// Flips one byte inside the layer blob of a copy of the OCI archive.
fn corrupt_copy(src: &std::path::Path, dir: &std::path::Path) -> std::path::PathBuf {
    let dst = dir.join("corrupt.tar");
    std::fs::copy(src, &dst).unwrap();
    let mut archive = tar::Archive::new(std::fs::File::open(&dst).unwrap());
    let (offset, size) = archive
        .entries_with_seek()
        .unwrap()
        .map(Result::unwrap)
        .filter(|e| e.path().unwrap().starts_with("blobs/sha256"))
        .map(|e| (e.raw_file_position(), e.size()))
        .max_by_key(|(_, size)| *size)
        .expect("a layer blob");
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&dst)
        .unwrap();
    let at = offset + size / 2;
    let mut byte = [0u8];
    file.seek(SeekFrom::Start(at)).unwrap();
    file.read_exact(&mut byte).unwrap();
    file.seek(SeekFrom::Start(at)).unwrap();
    file.write_all(&[byte[0] ^ 0xff]).unwrap();
    dst
}

#[tokio::test]
async fn corrupted_blob_is_refused_and_leaves_no_image() {
    let Some(rig) = rig() else { return };
    let dir = tempfile::tempdir().unwrap();
    let corrupt = corrupt_copy(&rig.oci_archive(), dir.path());
    with_namespace(&rig, "corrupt", |ctd, _rig| async move {
        let err = import_archive(&ctd, &corrupt, None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("sha256:"), "error names the blob: {err}");
        assert!(
            !support::image_exists(&ctd, TEST_IMAGE).await,
            "no image record for a bad archive"
        );
        assert!(list_snapshots(&ctd).await.is_empty(), "nothing unpacked");
        assert_eq!(
            support::lease_count(&ctd).await,
            0,
            "the lease is released on failure"
        );
    })
    .await;
}

#[tokio::test]
async fn archive_that_is_not_an_image_names_the_file() {
    let Some(rig) = rig() else { return };
    let dir = tempfile::tempdir().unwrap();
    let bogus = dir.path().join("bogus.tar");
    std::fs::write(&bogus, vec![0u8; 4096]).unwrap();
    with_namespace(&rig, "bogus", |ctd, _rig| async move {
        let err = import_archive(&ctd, &bogus, None)
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("bogus.tar"), "{err}");
    })
    .await;
}

/// An image copied from one of the agent's namespaces into another (a
/// BuildKit build loaded into the agent's): complete, unpacked, held by its
/// record alone, and runnable there; a missing one is an error naming it.
#[tokio::test]
async fn an_image_copied_between_namespaces_is_complete_and_runs() {
    on_rig("copy-from", |from, rig| async move {
        with_namespace(&rig, "copy-to", |to, rig| async move {
            import_archive(&from, &rig.oci_archive(), None)
                .await
                .expect("import");
            let name: ImageRef = TEST_IMAGE.parse().unwrap();
            let copied = zattera_agent::runtime::transfer::copy_image(&from, &to, &name)
                .await
                .expect("copy");
            assert_eq!(copied.names, vec![name.clone()]);
            assert_unpacked_and_runs(&to, &rig, copied.chain_id.as_str(), "copy").await;
            let missing: ImageRef = "zattera.local/none:1".parse().unwrap();
            let err = zattera_agent::runtime::transfer::copy_image(&from, &to, &missing)
                .await
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("zattera.local/none:1") && err.contains("no such image"),
                "{err}"
            );
        })
        .await;
    })
    .await;
}
