//! Content descriptors, media types and platform selection: the parts of the
//! OCI image spec (and Docker's schema 2) the runtime reasons about.

use oci_spec::image::{Descriptor as OciDescriptor, ImageIndex, ImageManifest};

use super::digest::Digest;
use super::error::RuntimeError;

pub mod media {
    pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
    pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
    pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
    pub const DOCKER_MANIFEST_LIST: &str =
        "application/vnd.docker.distribution.manifest.list.v2+json";
    pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
    pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
    pub const DOCKER_LAYER_TAR: &str = "application/vnd.docker.image.rootfs.diff.tar";

    pub fn is_index(media_type: &str) -> bool {
        media_type == OCI_INDEX || media_type == DOCKER_MANIFEST_LIST
    }

    pub fn is_manifest(media_type: &str) -> bool {
        media_type == OCI_MANIFEST || media_type == DOCKER_MANIFEST
    }
}

/// What one blob is: media type, digest and size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub media_type: String,
    pub digest: Digest,
    pub size: u64,
}

impl Descriptor {
    /// A manifest's config and layers, in order.
    pub fn parts_of(manifest: &ImageManifest) -> Result<(Self, Vec<Self>), RuntimeError> {
        let config = Self::from_oci(manifest.config())?;
        let layers = manifest
            .layers()
            .iter()
            .map(Self::from_oci)
            .collect::<Result<Vec<_>, _>>()?;
        Ok((config, layers))
    }

    pub fn from_oci(d: &OciDescriptor) -> Result<Self, RuntimeError> {
        let digest = d
            .digest()
            .to_string()
            .parse::<Digest>()
            .map_err(|e| RuntimeError::Invalid(e.to_string()))?;
        Ok(Self {
            media_type: d.media_type().to_string(),
            digest,
            size: d.size(),
        })
    }

    pub fn to_containerd(&self) -> containerd_client::types::Descriptor {
        containerd_client::types::Descriptor {
            media_type: self.media_type.clone(),
            digest: self.digest.to_string(),
            size: i64::try_from(self.size).unwrap_or(i64::MAX),
            annotations: std::collections::HashMap::new(),
        }
    }
}

/// This host's platform in OCI terms (`linux`, GOARCH names).
pub fn host_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// Picks the manifest for `linux/<host arch>` from an index. Entries without
/// a platform are taken only when nothing matches explicitly.
pub fn select_manifest(index: &ImageIndex) -> Option<&OciDescriptor> {
    let arch = host_architecture();
    let manifests = index
        .manifests()
        .iter()
        .filter(|d| media::is_manifest(d.media_type().as_ref()));
    let mut untagged = None;
    for d in manifests {
        match d.platform() {
            Some(p) if p.os().to_string() == "linux" && p.architecture().to_string() == arch => {
                return Some(d);
            }
            Some(_) => {}
            None => {
                untagged.get_or_insert(d);
            }
        }
    }
    untagged
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn index(json: &str) -> ImageIndex {
        ImageIndex::from_reader(json.as_bytes()).unwrap()
    }

    fn entry(arch: &str, n: char) -> String {
        format!(
            r#"{{"mediaType":"{}","digest":"sha256:{}","size":1,"platform":{{"os":"linux","architecture":"{arch}"}}}}"#,
            media::OCI_MANIFEST,
            n.to_string().repeat(64)
        )
    }

    #[test]
    fn picks_this_hosts_platform() {
        let other = if host_architecture() == "amd64" {
            "arm64"
        } else {
            "amd64"
        };
        let json = format!(
            r#"{{"schemaVersion":2,"manifests":[{},{}]}}"#,
            entry(other, 'a'),
            entry(host_architecture(), 'b')
        );
        let idx = index(&json);
        let d = select_manifest(&idx).unwrap();
        assert!(d.digest().to_string().ends_with(&"b".repeat(64)));
    }

    #[test]
    fn no_matching_platform_is_none() {
        let json = format!(
            r#"{{"schemaVersion":2,"manifests":[{}]}}"#,
            entry("s390x", 'a')
        );
        assert!(select_manifest(&index(&json)).is_none());
    }
}
