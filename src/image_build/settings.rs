//! What the operator chose for builds, resolved from the config file and
//! flags: the backend, its binaries, the steps' network, the cap on builds
//! at once. The agent's config embeds it; nothing here reads the config.

use std::path::PathBuf;

/// Which backend builds images.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BuildBackendKind {
    Auto,
    BuildKit,
    Buildah,
    Off,
}

/// Builds (RunBuild, the `build` command), resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildSettings {
    pub backend: BuildBackendKind,
    pub buildkitd: PathBuf,
    pub buildkit_version: String,
    pub nixpacks: PathBuf,
    pub network: super::buildah::BuildNetwork,
    /// The bridge's /24 when `network` is private.
    pub subnet: zattera_netns::Subnet,
    /// Builds at once; more wait in a bounded queue.
    pub max_builds: usize,
    /// Whether a tenant's Dockerfile may name a `# syntax=` frontend (an
    /// image that parses the file its own way, past the image check).
    pub custom_frontends: bool,
}

impl Default for BuildSettings {
    fn default() -> Self {
        Self {
            backend: BuildBackendKind::Auto,
            buildkitd: PathBuf::from("/usr/bin/buildkitd"),
            buildkit_version: super::buildkit::DEFAULT_BUILDKIT_VERSION.into(),
            nixpacks: PathBuf::from(super::plan::DEFAULT_NIXPACKS_BINARY),
            network: super::buildah::BuildNetwork::Private,
            subnet: super::network::DEFAULT_SUBNET,
            max_builds: 2,
            custom_frontends: false,
        }
    }
}
