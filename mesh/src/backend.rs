//! The two ways to run WireGuard behind one narrow interface, and the
//! choice between them.

use std::path::PathBuf;

use crate::error::Result;
use crate::kernel::Kernel;
use crate::state::{Inspect, MeshState};
use crate::userspace::Userspace;

/// What a WireGuard implementation must do for the node.
pub trait WgBackend {
    fn kind(&self) -> BackendKind;
    /// Makes the device what `want` says: whole state, idempotent; peers
    /// that did not change are not touched.
    fn apply(&self, want: &MeshState) -> impl Future<Output = Result<()>> + Send;
    /// The live device, for adoption and inspection; `None` when absent.
    fn read(&self) -> impl Future<Output = Result<Option<Inspect>>> + Send;
    /// Removes the interface (and with it its addresses and routes).
    fn remove(&self) -> impl Future<Output = Result<bool>> + Send;
}

/// Which implementation; `auto` prefers the kernel's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    #[default]
    Auto,
    Kernel,
    Userspace,
}

impl std::str::FromStr for BackendKind {
    type Err = crate::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "kernel" => Ok(Self::Kernel),
            "userspace" => Ok(Self::Userspace),
            _ => Err(crate::Error::Invalid(format!(
                "mesh backend {s:?}: one of auto, kernel, userspace"
            ))),
        }
    }
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Kernel => "kernel",
            Self::Userspace => "userspace",
        })
    }
}

impl WgBackend for Kernel {
    fn kind(&self) -> BackendKind {
        BackendKind::Kernel
    }
    async fn apply(&self, want: &MeshState) -> Result<()> {
        Kernel::apply(self, want).await
    }
    async fn read(&self) -> Result<Option<Inspect>> {
        Kernel::read(self).await
    }
    async fn remove(&self) -> Result<bool> {
        Kernel::remove(self).await
    }
}

impl WgBackend for Userspace {
    fn kind(&self) -> BackendKind {
        BackendKind::Userspace
    }
    async fn apply(&self, want: &MeshState) -> Result<()> {
        Userspace::apply(self, want).await
    }
    async fn read(&self) -> Result<Option<Inspect>> {
        Userspace::read(self).await
    }
    async fn remove(&self) -> Result<bool> {
        Userspace::remove(self).await
    }
}

/// The chosen implementation.
#[derive(Debug, Clone)]
pub enum Backend {
    Kernel(Kernel),
    Userspace(Userspace),
}

impl Backend {
    /// Picks the backend for `interface`: the configured one, else a device
    /// that is already up (adoption), else the kernel's when it has
    /// WireGuard, else userspace. Logs the choice.
    pub async fn detect(
        pref: BackendKind,
        interface: &str,
        device_binary: PathBuf,
        device_log: PathBuf,
    ) -> Self {
        let userspace = || {
            Self::Userspace(Userspace {
                interface: interface.to_owned(),
                device_binary: device_binary.clone(),
                log: device_log.clone(),
            })
        };
        let kernel = || {
            Self::Kernel(Kernel {
                interface: interface.to_owned(),
            })
        };
        let (chosen, why) = match pref {
            BackendKind::Kernel => (kernel(), "configured"),
            BackendKind::Userspace => (userspace(), "configured"),
            BackendKind::Auto if crate::userspace::socket_exists(interface) => {
                (userspace(), "a userspace device is up")
            }
            BackendKind::Auto if Kernel::available(interface).await => {
                (kernel(), "the kernel has WireGuard")
            }
            BackendKind::Auto => (userspace(), "the kernel has no WireGuard"),
        };
        tracing::info!(interface, backend = %chosen.kind(), why, "mesh backend");
        chosen
    }

    pub fn kind(&self) -> BackendKind {
        match self {
            Self::Kernel(k) => k.kind(),
            Self::Userspace(u) => u.kind(),
        }
    }

    pub async fn apply(&self, want: &MeshState) -> Result<()> {
        match self {
            Self::Kernel(k) => k.apply(want).await,
            Self::Userspace(u) => u.apply(want).await,
        }
    }

    pub async fn read(&self) -> Result<Option<Inspect>> {
        match self {
            Self::Kernel(k) => k.read().await,
            Self::Userspace(u) => u.read().await,
        }
    }

    pub async fn remove(&self) -> Result<bool> {
        match self {
            Self::Kernel(k) => k.remove().await,
            Self::Userspace(u) => u.remove().await,
        }
    }
}

/// The live device named `interface`, whichever backend runs it (for
/// `zattera-netns mesh`, which has no configuration).
pub async fn inspect(interface: &str) -> Result<Option<Inspect>> {
    if crate::userspace::socket_exists(interface) {
        let u = Userspace {
            interface: interface.to_owned(),
            device_binary: PathBuf::new(),
            log: PathBuf::new(),
        };
        if let Some(i) = u.read().await? {
            return Ok(Some(i));
        }
    }
    Kernel {
        interface: interface.to_owned(),
    }
    .read()
    .await
}
