//! containerd restarting under the agent: calls fail with a clear error while
//! it is down, the same connection works again once it is back, and nothing
//! is duplicated. Uses a private containerd so the shared rig is untouched.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

mod support;

use std::time::Duration;

use containerd_client::services::v1::ListImagesRequest;
use support::private::PrivateContainerd;
use support::{TEST_IMAGE, rig};
use zattera_agent::runtime::{Containerd, import_archive};

async fn image_count(ctd: &Containerd) -> Result<usize, tonic::Status> {
    Ok(ctd
        .images()
        .list(ctd.request(ListImagesRequest { filters: vec![] }))
        .await?
        .into_inner()
        .images
        .len())
}

#[tokio::test]
async fn the_connection_survives_a_containerd_restart() {
    let Some(rig) = rig() else { return };
    let (mut private, ctd) = PrivateContainerd::start()
        .with_test_image(&rig, "zt-resilience")
        .await;
    assert_eq!(image_count(&ctd).await.unwrap(), 1);

    private.down();
    let err = import_archive(&ctd, &rig.oci_archive(), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("unavailable"),
        "a clear error while containerd is down: {err}"
    );

    private.up();
    let mut again = None;
    for _ in 0..50 {
        match import_archive(&ctd, &rig.oci_archive(), None).await {
            Ok(images) => {
                again = Some(images);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let again = again.expect("the same connection works once containerd is back");
    assert_eq!(again[0].names[0].to_string(), TEST_IMAGE);
    assert_eq!(again[0].blobs_written, 0, "content survived the restart");
    assert_eq!(
        image_count(&ctd).await.unwrap(),
        1,
        "no duplicate image records"
    );
}
