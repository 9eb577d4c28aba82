//! The Tier A snapshot engine (dataplane.md §8): encrypted, deduplicated,
//! point-in-time snapshots of a volume in S3, readable by the reference
//! agent and able to read its snapshots.
//!
//! | module | job |
//! |---|---|
//! | [`tar`] | the deterministic PAX tar of a live volume (SNAP-3) |
//! | [`chunker`] | FastCDC as fastcdc-go v0.2.0 cuts it (SNAP-4) |
//! | [`seal`] | zstd, then AES-256-GCM with a random nonce (SNAP-6) |
//! | [`store`] | the S3 object store (SNAP-5, SNAP-11) |
//! | [`restore`] | staging, beneath-only creation, the atomic swap (SNAP-10) |
//! | [`hooks`] | pre-hooks and "who mounts this volume" through containerd |
//! | [`error`] | the one error type |
//!
//! A snapshot streams: one blocking thread walks the volume, writes the tar
//! into the chunker and hands each chunk to a bounded channel; up to
//! [`UPLOADS`] chunks at a time are hashed, checked with HEAD and, when
//! new, sealed and PUT, while the manifest keeps tar order. The manifest is
//! PUT last (SNAP-5). A restore fetches the manifest, prefetches up to
//! [`PREFETCH`] chunks (each opened, decompressed and checked against its
//! SHA-256) and feeds them in order to the extractor thread.
//!
//! Memory, whatever the volume size: at most `(QUEUE + UPLOADS)` chunks of
//! at most 4 MiB in flight, each with its sealed copy (about 64 MiB worst
//! case, about 16 MiB with typical 1 MiB chunks), the chunker's 8 MiB
//! buffer, plus the manifest itself (about 80 bytes per chunk, so about
//! 80 KiB per GiB of volume) and the set of hashes seen in this snapshot.

pub mod chunker;
pub mod error;
pub mod hooks;
pub mod restore;
pub mod seal;
pub mod store;
pub mod tar;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

pub use error::SnapshotError;
pub use seal::DataKey;
pub use store::{S3Config, Store};

/// Chunks uploaded at once (SNAP-11: a small bound).
pub const UPLOADS: usize = 6;
/// Chunks cut and waiting for an upload slot.
pub const QUEUE: usize = 4;
/// Chunks fetched ahead of the extractor during a restore.
pub const PREFETCH: usize = 4;

/// One chunk in a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    pub hash: String,
    pub size: u64,
}

/// The largest chunk a manifest may name: 16 times this release's
/// maximum (4 MiB), room for other chunking parameters. A chunk is opened
/// in memory, [`PREFETCH`] at a time, so a manifest that declares a 64 GiB
/// chunk must not be believed (45.3).
pub const MAX_CHUNK: u64 = 64 << 20;

/// The largest sealed manifest read (its plaintext is capped the same).
const MAX_MANIFEST: u64 = 256 << 20;

/// The most a sealed chunk of `size` plaintext bytes can take: zstd's
/// bound for incompressible input, plus the seal.
fn sealed_bound(size: u64) -> u64 {
    size + size / 128 + (64 << 10) + seal::OVERHEAD as u64
}

/// The manifest (SNAP-7). Unknown fields are ignored; `chunks` may be null.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub version: u32,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub chunks: Vec<ChunkRef>,
    #[serde(default)]
    pub tar_bytes: u64,
    #[serde(default)]
    pub created_at_unix: i64,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<ChunkRef>, D::Error> {
    Ok(Option::<Vec<ChunkRef>>::deserialize(d)?.unwrap_or_default())
}

pub fn chunk_key(hash: &str) -> String {
    format!("chunks/{hash}")
}

pub fn manifest_key(id: &str) -> String {
    format!("manifests/{id}")
}

/// What the engine reports while it works.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A chunk was done: `new` when it was stored (not deduplicated).
    /// `stored_bytes` is the cumulative plaintext of stored chunks.
    Chunk {
        new: bool,
        stored_bytes: u64,
        tar_bytes: u64,
    },
    /// A warning about the live volume (a skipped or changed file).
    Warning(String),
    /// Restore: plaintext bytes fetched and checked so far.
    Downloaded { bytes: u64, total: u64 },
}

pub type ProgressFn = Arc<dyn Fn(Event) + Send + Sync>;

/// A finished snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotOutcome {
    pub manifest_key: String,
    pub tar_bytes: u64,
    /// Plaintext bytes of newly stored chunks (what this snapshot added).
    pub new_bytes: u64,
    pub chunks: usize,
    pub new_chunks: usize,
    pub warnings: u64,
    /// Nothing changed since the last snapshot of this root to this
    /// target: its chunk list was reused without reading a file.
    pub reused: bool,
}

/// A finished restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreOutcome {
    pub tar_bytes: u64,
    pub entries: u64,
}

/// The snapshot store and key of one request.
#[derive(Debug, Clone)]
pub struct Engine {
    store: Store,
    key: Arc<DataKey>,
    params: chunker::Params,
    /// Where the last full walk of each root is remembered (see [`CacheEntry`]).
    cache_dir: Option<PathBuf>,
    /// Target and key, so a cache entry never crosses buckets or keys.
    identity: String,
}

/// Changes this close to a full walk's start might not show in ctime yet
/// (file times come from a coarse clock): such a walk is not remembered.
const RACY_NS: i64 = 2_000_000_000;

/// The last full snapshot of a root: if a metadata scan of the root gives
/// the same fingerprint (every header, inode and nanosecond time equal),
/// the deterministic tar, and so the chunk list, is the same.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct CacheEntry {
    fingerprint: String,
    manifest_id: String,
    tar_bytes: u64,
    chunks: Vec<ChunkRef>,
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

/// A snapshot ID is one object name segment.
fn check_id(id: &str) -> Result<(), SnapshotError> {
    if id.is_empty() || id.len() > 200 || id.contains(['/', '\0']) || id == "." || id == ".." {
        return Err(SnapshotError::BadRequest(format!(
            "snapshot id {id:?} is not a plain name"
        )));
    }
    Ok(())
}

impl Engine {
    pub fn new(target: &S3Config, data_key: &[u8]) -> Result<Self, SnapshotError> {
        let key = DataKey::new(data_key).map_err(SnapshotError::Key)?;
        let store = Store::new(target)?;
        let mut check = Sha256::new();
        check.update(b"zattera snapshot cache key check\0");
        check.update(data_key);
        let identity = format!(
            "{}\0{}",
            store.location(),
            hex::encode(&check.finalize()[..8])
        );
        Ok(Self {
            store,
            key: Arc::new(key),
            params: chunker::default_params(),
            cache_dir: None,
            identity,
        })
    }

    /// Remember full walks under `dir`, so an unchanged root is snapshot
    /// from its metadata alone.
    #[must_use]
    pub fn with_cache(mut self, dir: PathBuf) -> Self {
        self.cache_dir = Some(dir);
        self
    }

    fn cache_path(&self, root: &Path) -> Option<PathBuf> {
        use std::os::unix::ffi::OsStrExt;
        let dir = self.cache_dir.as_ref()?;
        let mut h = Sha256::new();
        h.update(self.identity.as_bytes());
        h.update([0]);
        h.update(root.as_os_str().as_bytes());
        Some(dir.join(format!("{}.json", hex::encode(&h.finalize()[..16]))))
    }

    fn save_cache(&self, root: &Path, entry: Option<&CacheEntry>) {
        let Some(path) = self.cache_path(root) else {
            return;
        };
        let Some(entry) = entry else {
            let _ = std::fs::remove_file(&path);
            return;
        };
        let written = (|| {
            std::fs::create_dir_all(path.parent().unwrap_or(Path::new(".")))?;
            crate::durable::write(&path, &serde_json::to_vec(entry)?, 0o600)
        })();
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "snapshot cache not written");
        }
    }

    /// The unchanged case: same fingerprint as the last full walk, and its
    /// manifest (so its chunks) still in the bucket.
    async fn unchanged(
        &self,
        root: &Path,
        id: &str,
        created_at_unix: i64,
    ) -> Result<Option<SnapshotOutcome>, SnapshotError> {
        let Some(path) = self.cache_path(root) else {
            return Ok(None);
        };
        let Ok(text) = tokio::fs::read(&path).await else {
            return Ok(None);
        };
        let Ok(mut entry) = serde_json::from_slice::<CacheEntry>(&text) else {
            return Ok(None);
        };
        let scan_root = root.to_owned();
        let scan = tokio::task::spawn_blocking(move || tar::scan_tree(&scan_root, &mut |_| {}))
            .await
            .map_err(|e| SnapshotError::Internal(e.to_string()))?;
        let Ok(scan) = scan else { return Ok(None) };
        if scan.warnings > 0
            || hex::encode(scan.fingerprint) != entry.fingerprint
            || scan.bytes != entry.tar_bytes
        {
            return Ok(None);
        }
        if !self.store.has(&manifest_key(&entry.manifest_id)).await? {
            return Ok(None);
        }
        let manifest = Manifest {
            version: 1,
            chunks: entry.chunks.clone(),
            tar_bytes: entry.tar_bytes,
            created_at_unix,
        };
        self.put_manifest(id, &manifest).await?;
        entry.manifest_id = id.to_owned();
        self.save_cache(root, Some(&entry));
        Ok(Some(SnapshotOutcome {
            manifest_key: id.to_owned(),
            tar_bytes: entry.tar_bytes,
            new_bytes: 0,
            chunks: entry.chunks.len(),
            new_chunks: 0,
            warnings: 0,
            reused: true,
        }))
    }

    async fn put_manifest(&self, id: &str, manifest: &Manifest) -> Result<(), SnapshotError> {
        let json =
            serde_json::to_vec(manifest).map_err(|e| SnapshotError::Internal(e.to_string()))?;
        let key = Arc::clone(&self.key);
        let sealed = tokio::task::spawn_blocking(move || key.seal_object(&json))
            .await
            .map_err(|e| SnapshotError::Internal(e.to_string()))?
            .map_err(|e| SnapshotError::Internal(e.to_string()))?;
        self.store.put(&manifest_key(id), Bytes::from(sealed)).await
    }

    /// Other chunk sizes (tests).
    #[must_use]
    pub fn with_params(mut self, params: chunker::Params) -> Self {
        self.params = params;
        self
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Snapshots the tree under `root` as snapshot `id`.
    pub async fn snapshot(
        &self,
        root: &Path,
        id: &str,
        created_at_unix: i64,
        progress: ProgressFn,
    ) -> Result<SnapshotOutcome, SnapshotError> {
        check_id(id)?;
        let started_ns = now_ns();
        if let Some(out) = self.unchanged(root, id, created_at_unix).await? {
            return Ok(out);
        }
        let (tx, rx) = mpsc::channel::<Bytes>(QUEUE);
        let walk_root = root.to_owned();
        let params = self.params;
        let warn_progress = Arc::clone(&progress);
        let walker = tokio::task::spawn_blocking(move || {
            let mut chunker = chunker::Chunker::new(params, |chunk: Bytes| {
                tx.blocking_send(chunk).map_err(|_| {
                    std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the upload stopped")
                })
            });
            let mut warn = |w: String| {
                tracing::warn!(warning = %w, "snapshot");
                warn_progress(Event::Warning(w));
            };
            let summary = tar::write_tree(&walk_root, &mut chunker, &mut warn)?;
            chunker.finish().map_err(SnapshotError::Sink)?;
            Ok::<_, SnapshotError>(summary)
        });

        let seen: Arc<Mutex<HashSet<[u8; 32]>>> = Arc::default();
        let mut uploads = tokio_stream::wrappers::ReceiverStream::new(rx)
            .map(|chunk| self.upload_one(chunk, Arc::clone(&seen)))
            .buffered(UPLOADS);
        let mut chunks = Vec::new();
        let (mut tar_bytes, mut new_bytes, mut new_chunks) = (0u64, 0u64, 0usize);
        let mut failed = None;
        while let Some(done) = uploads.next().await {
            match done {
                Ok((hash, size, new)) => {
                    tar_bytes += size;
                    if new {
                        new_bytes += size;
                        new_chunks += 1;
                    }
                    chunks.push(ChunkRef { hash, size });
                    progress(Event::Chunk {
                        new,
                        stored_bytes: new_bytes,
                        tar_bytes,
                    });
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        // Closing the channel stops the walker at its next chunk.
        drop(uploads);
        let walked = walker
            .await
            .map_err(|e| SnapshotError::Internal(format!("the volume walk: {e}")))?;
        if let Some(e) = failed {
            return Err(e);
        }
        let summary = walked?;
        if summary.bytes != tar_bytes {
            return Err(SnapshotError::Internal(format!(
                "tar of {} bytes, chunks of {tar_bytes}",
                summary.bytes
            )));
        }
        let manifest = Manifest {
            version: 1,
            chunks,
            tar_bytes,
            created_at_unix,
        };
        self.put_manifest(id, &manifest).await?;
        let remember =
            summary.warnings == 0 && summary.newest_ctime_ns < started_ns.saturating_sub(RACY_NS);
        let entry = remember.then(|| CacheEntry {
            fingerprint: hex::encode(summary.fingerprint),
            manifest_id: id.to_owned(),
            tar_bytes,
            chunks: manifest.chunks.clone(),
        });
        self.save_cache(root, entry.as_ref());
        Ok(SnapshotOutcome {
            manifest_key: id.to_owned(),
            tar_bytes,
            new_bytes,
            chunks: manifest.chunks.len(),
            new_chunks,
            warnings: summary.warnings,
            reused: false,
        })
    }

    /// Hash, HEAD, and when new seal and PUT one chunk: `(hash, size, new)`.
    async fn upload_one(
        &self,
        chunk: Bytes,
        seen: Arc<Mutex<HashSet<[u8; 32]>>>,
    ) -> Result<(String, u64, bool), SnapshotError> {
        let size = chunk.len() as u64;
        let for_hash = chunk.clone();
        let digest: [u8; 32] =
            tokio::task::spawn_blocking(move || Sha256::digest(&for_hash).into())
                .await
                .map_err(|e| SnapshotError::Internal(e.to_string()))?;
        let hash = hex::encode(digest);
        // A chunk repeated within this snapshot is stored once.
        let first = seen
            .lock()
            .map_err(|_| SnapshotError::Internal("hash set".into()))?
            .insert(digest);
        if !first {
            return Ok((hash, size, false));
        }
        let key = chunk_key(&hash);
        if self.store.has(&key).await? {
            return Ok((hash, size, false));
        }
        let data_key = Arc::clone(&self.key);
        let sealed = tokio::task::spawn_blocking(move || data_key.seal_object(&chunk))
            .await
            .map_err(|e| SnapshotError::Internal(e.to_string()))?
            .map_err(|e| SnapshotError::Internal(e.to_string()))?;
        self.store.put(&key, Bytes::from(sealed)).await?;
        Ok((hash, size, true))
    }

    /// Fetches and opens manifest `id`.
    pub async fn manifest(&self, id: &str) -> Result<Manifest, SnapshotError> {
        check_id(id)?;
        let key = manifest_key(id);
        let sealed = self
            .store
            .get(&key, MAX_MANIFEST)
            .await?
            .ok_or_else(|| SnapshotError::NoManifest(id.to_owned()))?;
        let data_key = Arc::clone(&self.key);
        let full = self.store.full_key(&key);
        let json = tokio::task::spawn_blocking(move || data_key.open_object(&sealed, 256 << 20))
            .await
            .map_err(|e| SnapshotError::Internal(e.to_string()))?
            .map_err(|source| SnapshotError::Open {
                what: "manifest",
                key: full.clone(),
                source,
            })?;
        let m: Manifest = serde_json::from_slice(&json).map_err(|e| SnapshotError::Manifest {
            key: full.clone(),
            message: e.to_string(),
        })?;
        if m.version != 1 {
            return Err(SnapshotError::Manifest {
                key: full,
                message: format!("version {} is not 1", m.version),
            });
        }
        if let Some(c) = m.chunks.iter().find(|c| c.size > MAX_CHUNK) {
            return Err(SnapshotError::Manifest {
                key: full,
                message: format!(
                    "chunk {} declares {} bytes, more than the {MAX_CHUNK} a chunk may have",
                    c.hash, c.size
                ),
            });
        }
        Ok(m)
    }

    /// Restores snapshot `id` so that `target` becomes exactly its tree.
    pub async fn restore(
        &self,
        id: &str,
        target: &Path,
        progress: ProgressFn,
    ) -> Result<RestoreOutcome, SnapshotError> {
        let manifest = self.manifest(id).await?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Feed>(1);
        let target_owned = target.to_owned();
        let staging_id = format!("{}-{}", std::process::id(), random_suffix());
        let warn_progress = Arc::clone(&progress);
        let extractor = tokio::task::spawn_blocking(move || {
            let staging = restore::Staging::create(&target_owned, &staging_id)?;
            let mut reader = FeedReader {
                rx,
                current: Bytes::new(),
                ended: false,
            };
            let mut warn = |w: String| {
                tracing::warn!(warning = %w, "restore");
                warn_progress(Event::Warning(w));
            };
            let done = restore::extract(&mut reader, staging.dir()?, &mut warn)?;
            // Every chunk must arrive and check out before the swap, the
            // tar's trailing blocks included.
            std::io::copy(&mut reader, &mut std::io::sink())
                .map_err(|e| SnapshotError::Restore(e.to_string()))?;
            staging.commit()?;
            Ok::<_, SnapshotError>(done)
        });

        let total = manifest.tar_bytes;
        let mut fetched = futures::stream::iter(manifest.chunks.iter().cloned())
            .map(|c| self.fetch_one(c))
            .buffered(PREFETCH);
        let mut bytes = 0u64;
        let mut failed = None;
        while let Some(chunk) = fetched.next().await {
            match chunk {
                Ok(data) => {
                    bytes += data.len() as u64;
                    progress(Event::Downloaded { bytes, total });
                    if send_feed(&tx, Feed::Data(data)).await.is_err() {
                        break; // the extractor stopped: its error tells why
                    }
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        drop(fetched);
        if failed.is_none() && bytes != total {
            failed = Some(SnapshotError::Manifest {
                key: self.store.full_key(&manifest_key(id)),
                message: format!("chunks add up to {bytes} bytes, tar_bytes says {total}"),
            });
        }
        if let Some(e) = &failed {
            let _ = send_feed(&tx, Feed::Failed(e.to_string())).await;
        } else {
            let _ = send_feed(&tx, Feed::End).await;
        }
        drop(tx);
        let extracted = extractor
            .await
            .map_err(|e| SnapshotError::Internal(format!("extractor: {e}")))?;
        if let Some(e) = failed {
            return Err(e);
        }
        let done = extracted?;
        Ok(RestoreOutcome {
            tar_bytes: total,
            entries: done.entries,
        })
    }

    /// GET, open, decompress and check one chunk.
    async fn fetch_one(&self, c: ChunkRef) -> Result<Bytes, SnapshotError> {
        let key = chunk_key(&c.hash);
        let full = self.store.full_key(&key);
        let sealed = self
            .store
            .get(&key, sealed_bound(c.size.min(MAX_CHUNK)))
            .await?
            .ok_or_else(|| SnapshotError::S3 {
                op: "GET",
                key: full.clone(),
                message: "chunk missing".into(),
                unreachable: false,
            })?;
        let data_key = Arc::clone(&self.key);
        tokio::task::spawn_blocking(move || {
            let limit = usize::try_from(c.size).unwrap_or(usize::MAX);
            let plain = match data_key.open_object(&sealed, limit) {
                Ok(p) => p,
                // Longer than the manifest says: another chunk's object.
                Err(seal::SealError::TooLong(_)) => {
                    return Err(SnapshotError::HashMismatch { hash: c.hash });
                }
                Err(source) => {
                    return Err(SnapshotError::Open {
                        what: "chunk",
                        key: full,
                        source,
                    });
                }
            };
            let digest = hex::encode(Sha256::digest(&plain));
            if digest != c.hash || plain.len() as u64 != c.size {
                return Err(SnapshotError::HashMismatch { hash: c.hash });
            }
            Ok(Bytes::from(plain))
        })
        .await
        .map_err(|e| SnapshotError::Internal(e.to_string()))?
    }

    /// The snapshots under the prefix: `(id, sealed size, last modified)`.
    pub async fn list(&self) -> Result<Vec<store::Listed>, SnapshotError> {
        let mut out = self.store.list("manifests/").await?;
        for l in &mut out {
            if let Some(id) = l.key.strip_prefix("manifests/") {
                l.key = id.to_owned();
            }
        }
        Ok(out)
    }
}

fn random_suffix() -> String {
    let mut b = [0u8; 6];
    let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut b);
    hex::encode(b)
}

/// What the fetcher hands the extractor.
enum Feed {
    Data(Bytes),
    End,
    Failed(String),
}

async fn send_feed(tx: &std::sync::mpsc::SyncSender<Feed>, item: Feed) -> Result<(), ()> {
    let tx = tx.clone();
    tokio::task::spawn_blocking(move || tx.send(item).map_err(|_| ()))
        .await
        .map_err(|_| ())?
}

/// The verified chunks as one tar stream; only an explicit end is EOF, so
/// a fetcher that went away fails the extraction instead of ending it.
struct FeedReader {
    rx: std::sync::mpsc::Receiver<Feed>,
    current: Bytes,
    ended: bool,
}

impl std::io::Read for FeedReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            if self.ended {
                return Ok(0);
            }
            match self.rx.recv() {
                Ok(Feed::Data(d)) => self.current = d,
                Ok(Feed::End) => self.ended = true,
                Ok(Feed::Failed(e)) => return Err(std::io::Error::other(e)),
                Err(_) => return Err(std::io::Error::other("the chunk fetcher stopped")),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// One snapshot or restore per volume at a time (SNAP-9).
#[derive(Debug)]
pub struct VolumeLock {
    path: PathBuf,
}

fn busy_set() -> &'static Mutex<HashSet<PathBuf>> {
    static BUSY: std::sync::OnceLock<Mutex<HashSet<PathBuf>>> = std::sync::OnceLock::new();
    BUSY.get_or_init(Mutex::default)
}

impl VolumeLock {
    /// Takes the lock of the volume at `path`, or says it is busy.
    pub fn acquire(path: &Path, shown: &str) -> Result<Self, SnapshotError> {
        let mut busy = busy_set()
            .lock()
            .map_err(|_| SnapshotError::Internal("volume locks".into()))?;
        if !busy.insert(path.to_owned()) {
            return Err(SnapshotError::Busy(shown.to_owned()));
        }
        Ok(Self {
            path: path.to_owned(),
        })
    }
}

impl Drop for VolumeLock {
    fn drop(&mut self) {
        if let Ok(mut busy) = busy_set().lock() {
            busy.remove(&self.path);
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn manifests_read_like_the_reference_writes_them() {
        let m = Manifest {
            version: 1,
            chunks: vec![ChunkRef {
                hash: "ab".into(),
                size: 3,
            }],
            tar_bytes: 3,
            created_at_unix: 1_700_000_000,
        };
        assert_eq!(
            serde_json::to_string(&m).unwrap(),
            r#"{"version":1,"chunks":[{"hash":"ab","size":3}],"tar_bytes":3,"created_at_unix":1700000000}"#
        );
        let null: Manifest = serde_json::from_str(
            r#"{"version":1,"chunks":null,"tar_bytes":0,"created_at_unix":5,"extra":true}"#,
        )
        .unwrap();
        assert!(null.chunks.is_empty());
    }

    #[test]
    fn one_operation_per_volume() {
        let a = VolumeLock::acquire(Path::new("/v/a"), "a").unwrap();
        assert!(matches!(
            VolumeLock::acquire(Path::new("/v/a"), "a"),
            Err(SnapshotError::Busy(_))
        ));
        let _b = VolumeLock::acquire(Path::new("/v/b"), "b").unwrap();
        drop(a);
        VolumeLock::acquire(Path::new("/v/a"), "a").unwrap();
    }

    #[test]
    fn ids_are_plain_names() {
        for bad in ["", "a/b", "..", "x\0"] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
        check_id("01JSNAP").unwrap();
    }
}
