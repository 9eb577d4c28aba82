//! A containerd of the test's own (root in a tempdir, state and socket
//! under /run), for tests that restart containerd: the shared rig must never
//! be restarted under the other tests.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A containerd of our own: root in a tempdir, state and socket under /run.
static STARTED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

#[derive(Debug)]
pub struct PrivateContainerd {
    config: PathBuf,
    pub socket: PathBuf,
    state: PathBuf,
    child: Option<Child>,
    /// A small tmpfs under the content store, unmounted on drop.
    content_tmpfs: Option<PathBuf>,
    _root: tempfile::TempDir,
}

impl PrivateContainerd {
    /// One whose content store is a tmpfs of `mib` MiB: a disk that fills.
    pub fn start_with_content_limit(mib: u32) -> Self {
        Self::start_inner(Some(mib))
    }

    pub fn start() -> Self {
        Self::start_inner(None)
    }

    /// Connects to namespace `ns` here and imports the rig's test image
    /// into it.
    pub async fn with_test_image(
        self,
        rig: &super::Rig,
        ns: &str,
    ) -> (Self, zattera_agent::runtime::Containerd) {
        let ctd = zattera_agent::runtime::Containerd::connect(&self.socket, ns.parse().unwrap())
            .await
            .unwrap();
        zattera_agent::runtime::import_archive(&ctd, &rig.oci_archive(), None)
            .await
            .expect("import the test image");
        (self, ctd)
    }

    fn start_inner(content_mib: Option<u32>) -> Self {
        let root = tempfile::tempdir().unwrap();
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let state = PathBuf::from(format!("/run/zt-ctd-{}-{n}", std::process::id()));
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
        let content_tmpfs = content_mib.map(|mib| {
            let dir = root.path().join("root/io.containerd.content.v1.content");
            std::fs::create_dir_all(&dir).unwrap();
            nix::mount::mount(
                Some("tmpfs"),
                &dir,
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some(format!("size={mib}m,mode=0700").as_str()),
            )
            .expect("mount the content store tmpfs");
            dir
        });
        let mut this = Self {
            config,
            socket,
            state,
            child: None,
            content_tmpfs,
            _root: root,
        };
        this.up();
        this
    }

    pub fn up(&mut self) {
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

    pub fn down(&mut self) {
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
        // Shims outlive containerd by design; with this containerd gone for
        // good, any left (a task a failed test never deleted) and the rootfs
        // mounts they hold would stay forever.
        kill_shims_of(&self.socket);
        let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let state = self.state.to_string_lossy().into_owned();
        let mut ours: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .filter(|m| m.starts_with(&state))
            .collect();
        ours.sort_unstable_by_key(|m| std::cmp::Reverse(m.len()));
        for m in ours {
            let _ = nix::mount::umount2(m, nix::mount::MntFlags::MNT_DETACH);
        }
        if let Some(dir) = &self.content_tmpfs {
            let _ = nix::mount::umount2(dir, nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir_all(&self.state);
    }
}

/// SIGKILLs every runc shim serving containerd at `socket`, and every
/// process under it first (tasks and log shims: the shim is their
/// subreaper, so they are its descendants).
fn kill_shims_of(socket: &std::path::Path) {
    let want = socket.to_string_lossy().into_owned();
    let all = super::processes();
    let parent_of: std::collections::HashMap<i32, i32> =
        all.iter().map(|p| (p.pid, p.ppid)).collect();
    let shims: Vec<i32> = all
        .iter()
        .filter(|p| p.is_runc_shim() && p.flag("-address") == Some(want.as_str()))
        .map(|p| p.pid)
        .collect();
    let kill = |pid: i32| {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    };
    for shim in shims {
        let descends = |mut pid: i32| {
            while let Some(&ppid) = parent_of.get(&pid) {
                if ppid == shim {
                    return true;
                }
                if ppid <= 1 {
                    return false;
                }
                pid = ppid;
            }
            false
        };
        for pid in parent_of.keys().copied().filter(|p| descends(*p)) {
            kill(pid);
        }
        kill(shim);
    }
}
