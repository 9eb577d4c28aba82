//! Image archives on disk: OCI image layouts (`index.json` + `blobs/`) and
//! `docker save` tarballs (`manifest.json`, legacy or current).
//!
//! Opening an archive reads only the tar headers; blobs are streamed from
//! their offsets later, so a large archive is never held in memory.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use oci_spec::image::{ImageConfiguration, ImageIndex, ImageManifest};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncSeekExt};

use super::content::MAX_METADATA_BLOB;
use super::descriptor::{Descriptor, media, select_manifest};
use super::digest::Digest;
use super::error::RuntimeError;
use super::reference::ImageRef;

const ANNOTATION_CONTAINERD_NAME: &str = "io.containerd.image.name";
const ANNOTATION_OCI_REF_NAME: &str = "org.opencontainers.image.ref.name";

/// Where a blob's bytes come from.
#[derive(Debug, Clone)]
pub enum BlobSource {
    /// A file inside the archive, by its normalised path.
    Entry(String),
    /// Bytes made during import (the manifest of a legacy docker archive).
    Inline(Vec<u8>),
}

#[derive(Debug, Clone)]
pub struct Blob {
    pub desc: Descriptor,
    pub source: BlobSource,
    /// GC references to children, so the image keeps them alive.
    pub labels: HashMap<String, String>,
}

/// One image found in an archive, with everything needed to store and unpack it.
#[derive(Debug, Clone)]
pub struct PlannedImage {
    pub names: Vec<ImageRef>,
    /// What the image record points at (an index or a manifest).
    pub target: Descriptor,
    /// Children before parents, so a parent is committed with its GC labels
    /// only after what they point at exists.
    pub blobs: Vec<Blob>,
    pub config: Digest,
    pub layers: Vec<Descriptor>,
    pub diff_ids: Vec<Digest>,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    offset: u64,
    size: u64,
}

#[derive(Debug)]
pub struct ImageArchive {
    path: PathBuf,
    entries: HashMap<String, Entry>,
    links: HashMap<String, String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerManifestEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

impl ImageArchive {
    /// Indexes the tar's entries. Blocking: call from `spawn_blocking`.
    pub fn open(path: &Path) -> Result<Self, RuntimeError> {
        let fail = |reason: String| RuntimeError::Archive {
            path: path.to_path_buf(),
            reason,
        };
        let mut file = File::open(path).map_err(|e| fail(e.to_string()))?;
        let mut magic = [0u8; 2];
        if file.read(&mut magic).map_err(|e| fail(e.to_string()))? == 2 && magic == [0x1f, 0x8b] {
            return Err(fail("gzip-compressed; decompress it first (gunzip)".into()));
        }
        file.seek(SeekFrom::Start(0))
            .map_err(|e| fail(e.to_string()))?;

        let mut archive = tar::Archive::new(file);
        let mut entries = HashMap::new();
        let mut links = HashMap::new();
        let iter = archive
            .entries_with_seek()
            .map_err(|e| fail(format!("not a tar archive: {e}")))?;
        for entry in iter {
            let entry = entry.map_err(|e| fail(format!("corrupt tar: {e}")))?;
            let name = normalise(
                &entry
                    .path()
                    .map_err(|e| fail(e.to_string()))?
                    .to_string_lossy(),
            );
            let kind = entry.header().entry_type();
            if kind.is_file() {
                entries.insert(
                    name,
                    Entry {
                        offset: entry.raw_file_position(),
                        size: entry.size(),
                    },
                );
            } else if (kind.is_symlink() || kind.is_hard_link())
                && let Some(target) = entry.link_name().map_err(|e| fail(e.to_string()))?
            {
                let target = target.to_string_lossy();
                let resolved = if kind.is_symlink() && !target.starts_with('/') {
                    let dir = name.rsplit_once('/').map_or("", |(d, _)| d);
                    normalise(&format!("{dir}/{target}"))
                } else {
                    normalise(&target)
                };
                links.insert(name, resolved);
            }
        }
        if entries.is_empty() {
            return Err(fail("empty or not a tar archive".into()));
        }
        Ok(Self {
            path: path.to_path_buf(),
            entries,
            links,
        })
    }

    fn fail(&self, reason: impl Into<String>) -> RuntimeError {
        RuntimeError::Archive {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }

    fn entry(&self, name: &str) -> Option<(String, Entry)> {
        let mut name = normalise(name);
        for _ in 0..8 {
            if let Some(e) = self.entries.get(&name) {
                return Some((name, *e));
            }
            name.clone_from(self.links.get(&name)?);
        }
        None
    }

    fn read_small(&self, name: &str) -> Result<Vec<u8>, RuntimeError> {
        let (_, entry) = self
            .entry(name)
            .ok_or_else(|| self.fail(format!("{name} is missing")))?;
        if entry.size > MAX_METADATA_BLOB {
            return Err(self.fail(format!(
                "{name} is {} bytes, too large for metadata",
                entry.size
            )));
        }
        let mut file = File::open(&self.path).map_err(|e| self.fail(e.to_string()))?;
        file.seek(SeekFrom::Start(entry.offset))
            .map_err(|e| self.fail(e.to_string()))?;
        let mut data = Vec::new();
        file.take(entry.size)
            .read_to_end(&mut data)
            .map_err(|e| self.fail(format!("reading {name}: {e}")))?;
        Ok(data)
    }

    fn read_blob(&self, desc: &Descriptor) -> Result<Vec<u8>, RuntimeError> {
        let data = self.read_small(&blob_path(&desc.digest))?;
        if Digest::of(&data) != desc.digest {
            return Err(self.fail(format!("blob {} does not match its digest", desc.digest)));
        }
        Ok(data)
    }

    /// Hashes an entry without loading it whole (legacy docker layers).
    fn digest_entry(&self, name: &str) -> Result<(Digest, u64), RuntimeError> {
        let (_, entry) = self
            .entry(name)
            .ok_or_else(|| self.fail(format!("{name} is missing")))?;
        let mut file = File::open(&self.path).map_err(|e| self.fail(e.to_string()))?;
        file.seek(SeekFrom::Start(entry.offset))
            .map_err(|e| self.fail(e.to_string()))?;
        let mut hasher = Sha256::new();
        let copied = std::io::copy(&mut file.take(entry.size), &mut hasher)
            .map_err(|e| self.fail(format!("reading {name}: {e}")))?;
        if copied != entry.size {
            return Err(self.fail(format!("{name} is truncated")));
        }
        Ok((Digest::from_hasher(hasher), entry.size))
    }

    /// Streams a blob's bytes.
    pub async fn open_blob(
        &self,
        source: &BlobSource,
    ) -> Result<Box<dyn AsyncRead + Unpin + Send>, RuntimeError> {
        match source {
            BlobSource::Inline(bytes) => Ok(Box::new(std::io::Cursor::new(bytes.clone()))),
            BlobSource::Entry(name) => {
                let (_, entry) = self
                    .entry(name)
                    .ok_or_else(|| self.fail(format!("{name} is missing")))?;
                let mut file = tokio::fs::File::open(&self.path)
                    .await
                    .map_err(|e| self.fail(e.to_string()))?;
                file.seek(SeekFrom::Start(entry.offset))
                    .await
                    .map_err(|e| self.fail(e.to_string()))?;
                Ok(Box::new(file.take(entry.size)))
            }
        }
    }

    /// Works out which images the archive holds and what to store for each.
    /// `name` renames the archive's single image. Blocking: reads metadata.
    pub fn plan(&self, name: Option<&ImageRef>) -> Result<Vec<PlannedImage>, RuntimeError> {
        let plans = if self.entry("index.json").is_some() {
            self.plan_oci_layout(name)?
        } else if self.entry("manifest.json").is_some() {
            self.plan_docker_save(name)?
        } else {
            return Err(self.fail(
                "neither an OCI image layout (index.json) nor a docker save archive (manifest.json)",
            ));
        };
        if plans.is_empty() {
            return Err(self.fail("holds no images"));
        }
        Ok(plans)
    }

    fn plan_oci_layout(
        &self,
        rename: Option<&ImageRef>,
    ) -> Result<Vec<PlannedImage>, RuntimeError> {
        let index = ImageIndex::from_reader(&self.read_small("index.json")?[..])
            .map_err(|e| self.fail(format!("index.json: {e}")))?;
        let docker_tags = self.docker_repo_tags();
        if rename.is_some() && index.manifests().len() != 1 {
            return Err(self.fail(format!(
                "--name needs an archive with one image, this one has {}",
                index.manifests().len()
            )));
        }
        let mut plans = Vec::new();
        for top in index.manifests() {
            let target = Descriptor::from_oci(top)?;
            let annotations = top.annotations().clone().unwrap_or_default();
            let mut blobs = Vec::new();

            // Resolve an index entry down to this platform's manifest.
            let manifest_desc = if media::is_index(&target.media_type) {
                let nested = ImageIndex::from_reader(&self.read_blob(&target)?[..])
                    .map_err(|e| self.fail(format!("index {}: {e}", target.digest)))?;
                let chosen = select_manifest(&nested).ok_or_else(|| {
                    self.fail(format!(
                        "index {} has no manifest for linux/{}",
                        target.digest,
                        super::descriptor::host_architecture()
                    ))
                })?;
                let chosen = Descriptor::from_oci(chosen)?;
                let mut labels = HashMap::new();
                for (i, m) in nested.manifests().iter().enumerate() {
                    let d = Descriptor::from_oci(m)?;
                    if self.entry(&blob_path(&d.digest)).is_some() {
                        labels.insert(
                            format!("containerd.io/gc.ref.content.m.{i}"),
                            d.digest.to_string(),
                        );
                    }
                }
                blobs.push(Blob {
                    desc: target.clone(),
                    source: BlobSource::Entry(blob_path(&target.digest)),
                    labels,
                });
                chosen
            } else if media::is_manifest(&target.media_type) {
                target.clone()
            } else {
                return Err(self.fail(format!(
                    "index.json entry {} has unsupported media type {}",
                    target.digest, target.media_type
                )));
            };

            let manifest = ImageManifest::from_reader(&self.read_blob(&manifest_desc)?[..])
                .map_err(|e| self.fail(format!("manifest {}: {e}", manifest_desc.digest)))?;
            let (config_desc, layers) = Descriptor::parts_of(&manifest)?;
            let diff_ids = self.diff_ids(&config_desc)?;
            for layer in &layers {
                if self.entry(&blob_path(&layer.digest)).is_none() {
                    return Err(self.fail(format!("layer {} is missing", layer.digest)));
                }
            }
            blobs.splice(
                0..0,
                child_blobs(&manifest_desc, &config_desc, &layers, |d| {
                    BlobSource::Entry(blob_path(&d.digest))
                }),
            );

            let names = if let Some(r) = rename {
                vec![r.clone()]
            } else {
                let by_annotation = annotations.get(ANNOTATION_CONTAINERD_NAME).or_else(|| {
                    annotations
                        .get(ANNOTATION_OCI_REF_NAME)
                        .filter(|n| n.contains('/'))
                });
                match by_annotation {
                    Some(n) => vec![self.parse_name(n)?],
                    None => docker_tags
                        .get(config_desc.digest.hex())
                        .map(|tags| tags.iter().map(|t| self.parse_name(t)).collect())
                        .transpose()?
                        .unwrap_or_default(),
                }
            };
            if names.is_empty() {
                return Err(self.fail(format!(
                    "image {} has no name in the archive; give one with --name",
                    target.digest
                )));
            }
            plans.push(PlannedImage {
                names,
                target,
                blobs,
                config: config_desc.digest,
                layers,
                diff_ids,
            });
        }
        Ok(plans)
    }

    fn plan_docker_save(
        &self,
        rename: Option<&ImageRef>,
    ) -> Result<Vec<PlannedImage>, RuntimeError> {
        let entries: Vec<DockerManifestEntry> =
            serde_json::from_slice(&self.read_small("manifest.json")?)
                .map_err(|e| self.fail(format!("manifest.json: {e}")))?;
        if rename.is_some() && entries.len() != 1 {
            return Err(self.fail(format!(
                "--name needs an archive with one image, this one has {}",
                entries.len()
            )));
        }
        let mut plans = Vec::new();
        for entry in entries {
            let config_bytes = self.read_small(&entry.config)?;
            let config_desc = Descriptor {
                media_type: media::DOCKER_CONFIG.into(),
                digest: Digest::of(&config_bytes),
                size: config_bytes.len() as u64,
            };
            let mut layers = Vec::new();
            let mut sources = HashMap::new();
            for path in &entry.layers {
                let (digest, size) = self.digest_entry(path)?;
                let media_type = if self.starts_with_gzip_magic(path)? {
                    format!("{}.gzip", media::DOCKER_LAYER_TAR)
                } else {
                    media::DOCKER_LAYER_TAR.to_owned()
                };
                sources.insert(digest.clone(), path.clone());
                layers.push(Descriptor {
                    media_type,
                    digest,
                    size,
                });
            }
            let manifest = serde_json::json!({
                "schemaVersion": 2,
                "mediaType": media::DOCKER_MANIFEST,
                "config": descriptor_json(&config_desc),
                "layers": layers.iter().map(descriptor_json).collect::<Vec<_>>(),
            });
            let manifest_bytes = serde_json::to_vec(&manifest)
                .map_err(|e| self.fail(format!("encoding manifest: {e}")))?;
            let manifest_desc = Descriptor {
                media_type: media::DOCKER_MANIFEST.into(),
                digest: Digest::of(&manifest_bytes),
                size: manifest_bytes.len() as u64,
            };
            let diff_ids = parse_diff_ids(&config_bytes)
                .map_err(|e| self.fail(format!("{}: {e}", entry.config)))?;
            let config_path = entry.config.clone();
            let mut blobs = child_blobs(&manifest_desc, &config_desc, &layers, |d| {
                if d.digest == config_desc.digest {
                    BlobSource::Entry(config_path.clone())
                } else {
                    BlobSource::Entry(sources.get(&d.digest).cloned().unwrap_or_default())
                }
            });
            if let Some(last) = blobs.last_mut() {
                last.source = BlobSource::Inline(manifest_bytes);
            }
            let names = match rename {
                Some(r) => vec![r.clone()],
                None => entry
                    .repo_tags
                    .unwrap_or_default()
                    .iter()
                    .map(|t| self.parse_name(t))
                    .collect::<Result<Vec<_>, _>>()?,
            };
            if names.is_empty() {
                return Err(self.fail(format!(
                    "image with config {} has no RepoTags; give a name with --name",
                    config_desc.digest
                )));
            }
            plans.push(PlannedImage {
                names,
                target: manifest_desc,
                blobs,
                config: config_desc.digest,
                layers,
                diff_ids,
            });
        }
        Ok(plans)
    }

    /// RepoTags of a `docker save` manifest.json, keyed by config digest hex,
    /// for naming images of a docker archive that is also an OCI layout.
    fn docker_repo_tags(&self) -> HashMap<String, Vec<String>> {
        let Ok(bytes) = self.read_small("manifest.json") else {
            return HashMap::new();
        };
        let entries: Vec<DockerManifestEntry> = serde_json::from_slice(&bytes).unwrap_or_default();
        entries
            .into_iter()
            .map(|e| {
                let hex = e
                    .config
                    .rsplit('/')
                    .next()
                    .unwrap_or_default()
                    .trim_end_matches(".json")
                    .to_owned();
                (hex, e.repo_tags.unwrap_or_default())
            })
            .collect()
    }

    fn diff_ids(&self, config: &Descriptor) -> Result<Vec<Digest>, RuntimeError> {
        parse_diff_ids(&self.read_blob(config)?)
            .map_err(|e| self.fail(format!("config {}: {e}", config.digest)))
    }

    fn starts_with_gzip_magic(&self, name: &str) -> Result<bool, RuntimeError> {
        let (_, entry) = self
            .entry(name)
            .ok_or_else(|| self.fail(format!("{name} is missing")))?;
        let mut file = File::open(&self.path).map_err(|e| self.fail(e.to_string()))?;
        file.seek(SeekFrom::Start(entry.offset))
            .map_err(|e| self.fail(e.to_string()))?;
        let mut magic = [0u8; 2];
        let n = file
            .take(2)
            .read(&mut magic)
            .map_err(|e| self.fail(e.to_string()))?;
        Ok(n == 2 && magic == [0x1f, 0x8b])
    }

    fn parse_name(&self, name: &str) -> Result<ImageRef, RuntimeError> {
        name.parse()
            .map_err(|e: super::reference::InvalidReference| self.fail(e.to_string()))
    }
}

/// Layers, config, then the manifest labelled with GC references to them.
fn child_blobs(
    manifest: &Descriptor,
    config: &Descriptor,
    layers: &[Descriptor],
    source: impl Fn(&Descriptor) -> BlobSource,
) -> Vec<Blob> {
    let mut blobs: Vec<Blob> = layers
        .iter()
        .map(|l| Blob {
            desc: l.clone(),
            source: source(l),
            labels: HashMap::new(),
        })
        .collect();
    blobs.push(Blob {
        desc: config.clone(),
        source: source(config),
        labels: HashMap::new(),
    });
    blobs.push(Blob {
        desc: manifest.clone(),
        source: source(manifest),
        labels: super::content::manifest_gc_labels(config, layers),
    });
    blobs
}

/// The uncompressed layer digests (`rootfs.diff_ids`) of an image config.
pub(super) fn parse_diff_ids(config: &[u8]) -> Result<Vec<Digest>, String> {
    let config = ImageConfiguration::from_reader(config).map_err(|e| e.to_string())?;
    super::unpack::diff_ids(&config).map_err(|e| e.to_string())
}

fn descriptor_json(d: &Descriptor) -> serde_json::Value {
    serde_json::json!({"mediaType": d.media_type, "digest": d.digest.to_string(), "size": d.size})
}

fn blob_path(digest: &Digest) -> String {
    format!("blobs/sha256/{}", digest.hex())
}

/// `./a/../b//c` → `b/c`: tar writers disagree on leading `./`.
fn normalise(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for part in path.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    parts.join("/")
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn normalises_tar_paths() {
        assert_eq!(normalise("./index.json"), "index.json");
        assert_eq!(normalise("a/./b/../c//d"), "a/c/d");
        assert_eq!(normalise("/abs"), "abs");
    }

    #[test]
    fn gzip_archives_and_garbage_are_refused_with_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let gz = dir.path().join("x.tar.gz");
        std::fs::write(&gz, [0x1f, 0x8b, 0, 0]).unwrap();
        let e = ImageArchive::open(&gz).unwrap_err().to_string();
        assert!(e.contains("x.tar.gz") && e.contains("gzip"), "{e}");

        let junk = dir.path().join("junk.tar");
        std::fs::write(&junk, b"definitely not a tar file").unwrap();
        let e = ImageArchive::open(&junk).unwrap_err().to_string();
        assert!(e.contains("junk.tar"), "{e}");
    }

    #[test]
    fn a_tar_without_image_metadata_is_explained() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plain.tar");
        let mut builder = tar::Builder::new(File::create(&path).unwrap());
        let mut header = tar::Header::new_gnu();
        header.set_size(2);
        header.set_cksum();
        builder
            .append_data(&mut header, "hello.txt", &b"hi"[..])
            .unwrap();
        builder.finish().unwrap();
        drop(builder);
        let archive = ImageArchive::open(&path).unwrap();
        let e = archive.plan(None).unwrap_err().to_string();
        assert!(
            e.contains("index.json") && e.contains("manifest.json"),
            "{e}"
        );
    }
}
