//! WireGuard in userspace (boringtun's noise protocol around our own
//! batched device, [`crate::device`]) for kernels without the module.
//!
//! The device runs in its own process, `<agent> mesh-device IFNAME`, in its
//! own process group: like a containerd shim it outlives the agent, so a
//! restart or a SIGKILL of the agent leaves the mesh up and the next agent
//! adopts it through the UAPI socket. The agent configures it over that
//! socket only ([`crate::uapi`]); `remove` stops the process that answers
//! on it (found by the socket's peer credentials).

use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::state::{Inspect, MeshState};
use crate::{link, uapi};

/// The userspace backend for one interface.
#[derive(Debug, Clone)]
pub struct Userspace {
    pub interface: String,
    /// The executable whose `mesh-device` subcommand runs the device
    /// ([`run_device`]); normally the agent itself.
    pub device_binary: PathBuf,
    /// Where the device process writes its output.
    pub log: PathBuf,
}

impl Userspace {
    fn socket(&self) -> PathBuf {
        uapi::socket_path(&self.interface)
    }

    fn err(&self, what: impl Into<String>) -> Error {
        Error::Backend {
            interface: self.interface.clone(),
            backend: "userspace",
            what: what.into(),
        }
    }

    /// The live device, if one answers.
    pub async fn read(&self) -> Result<Option<Inspect>> {
        let path = self.socket();
        if !path.exists() {
            return Ok(None);
        }
        match uapi::get(&path).await {
            Ok(mut i) => {
                i.interface.clone_from(&self.interface);
                Ok(Some(i))
            }
            // A socket left by a device that died.
            Err(Error::Uapi { source, .. })
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Starts the device process unless one answers; adopts one that does.
    async fn ensure(&self) -> Result<Inspect> {
        if let Some(live) = self.read().await? {
            return Ok(live);
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| self.err(format!("device log {}: {e}", self.log.display())))?;
        let log2 = log
            .try_clone()
            .map_err(|e| self.err(format!("device log: {e}")))?;
        let mut cmd = tokio::process::Command::new(&self.device_binary);
        cmd.arg("mesh-device")
            .arg(&self.interface)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(log2)
            // Its own group: a signal to the agent's group leaves it up.
            .process_group(0)
            .kill_on_drop(false);
        let mut child = cmd
            .spawn()
            .map_err(|e| self.err(format!("starting {}: {e}", self.device_binary.display())))?;
        let pid = child.id();
        // Reaped when it ends, whoever ends it.
        tokio::spawn(async move {
            let _ = child.wait().await;
        });
        tracing::info!(interface = %self.interface, pid, "userspace WireGuard device started");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(live) = self.read().await? {
                return Ok(live);
            }
            if tokio::time::Instant::now() > deadline {
                return Err(self.err(format!(
                    "the device did not answer on {} within 10 s (see {})",
                    self.socket().display(),
                    self.log.display()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn apply(&self, want: &MeshState) -> Result<()> {
        let have = self.ensure().await?;
        if let Some(body) = uapi::set_body(want, &have) {
            uapi::set(&self.socket(), &body).await?;
        }
        let h = link::connect()?;
        link::configure(&h, want).await
    }

    /// Stops the device (its interface, addresses and routes go with it).
    pub async fn remove(&self) -> Result<bool> {
        let path = self.socket();
        let Ok(stream) = tokio::net::UnixStream::connect(&path).await else {
            let _ = std::fs::remove_file(&path);
            return Ok(false);
        };
        let pid = stream
            .peer_cred()
            .ok()
            .and_then(|c| c.pid())
            .ok_or_else(|| self.err("no peer process on the UAPI socket"))?;
        drop(stream);
        let pid = nix_pid(pid);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        for _ in 0..100 {
            if nix::sys::signal::kill(pid, None).is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = std::fs::remove_file(&path);
        Ok(true)
    }
}

fn nix_pid(pid: i32) -> nix::unistd::Pid {
    nix::unistd::Pid::from_raw(pid)
}

/// The body of `mesh-device IFNAME`: creates the tun and serves the UAPI
/// socket until the process is stopped or the interface is deleted
/// ([`crate::device`]).
#[cfg(feature = "userspace")]
pub fn run_device(interface: &str) -> Result<()> {
    crate::device::run(interface)
}

/// Without the feature there is no userspace device to run.
#[cfg(not(feature = "userspace"))]
pub fn run_device(interface: &str) -> Result<()> {
    Err(Error::Backend {
        interface: interface.to_owned(),
        backend: "userspace",
        what: "this build has no userspace WireGuard (feature `userspace`)".into(),
    })
}

/// Whether a userspace device for `interface` answers (for detection).
pub fn socket_exists(interface: &str) -> bool {
    uapi::socket_path(interface).exists()
}
