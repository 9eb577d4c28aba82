//! containerd restarting under the agent: calls fail with a clear error while
//! it is down, the same connection works again once it is back, and nothing
//! is duplicated. Uses a private containerd so the shared rig is untouched.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use containerd_client::services::v1::ListImagesRequest;
use support::{TEST_IMAGE, rig};
use zattera_agent::runtime::{Containerd, import_archive};

/// A containerd of our own: root in a tempdir, state and socket under /run.
struct PrivateContainerd {
    config: PathBuf,
    socket: PathBuf,
    state: PathBuf,
    child: Option<Child>,
    _root: tempfile::TempDir,
}

impl PrivateContainerd {
    fn start() -> Self {
        let root = tempfile::tempdir().unwrap();
        let state = PathBuf::from(format!("/run/zt-ctd-{}", std::process::id()));
        let socket = state.join("c.sock");
        let config = root.path().join("config.toml");
        std::fs::write(
            &config,
            format!(
                "version = 2\nroot = \"{}\"\nstate = \"{}\"\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n\
                 [grpc]\n  address = \"{}\"\n[ttrpc]\n  address = \"{}.ttrpc\"\n",
                root.path().join("root").display(),
                state.display(),
                socket.display(),
                socket.display()
            ),
        )
        .unwrap();
        let mut this = Self {
            config,
            socket,
            state,
            child: None,
            _root: root,
        };
        this.up();
        this
    }

    fn up(&mut self) {
        let child = Command::new("containerd")
            .arg("--config")
            .arg(&self.config)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("containerd");
        self.child = Some(child);
        for _ in 0..100 {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("private containerd did not come up");
    }

    fn down(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap()),
                nix::sys::signal::Signal::SIGTERM,
            );
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateContainerd {
    fn drop(&mut self) {
        self.down();
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

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
    let mut private = PrivateContainerd::start();
    let ctd = Containerd::connect(&private.socket, "zt-resilience".parse().unwrap())
        .await
        .unwrap();
    import_archive(&ctd, &rig.oci_archive(), None)
        .await
        .expect("import");
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
