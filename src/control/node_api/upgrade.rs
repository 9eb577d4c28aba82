//! `UpgradeBinary`: replace the agent binary and restart into it.
//!
//! Only URLs under the configured `upgrade-base-url` are fetched (`*` = any
//! URL); at most 512 MiB are read, hashed as they arrive, into a file beside
//! the binary; a SHA-256 mismatch installs nothing. The new file is renamed
//! over the binary (atomic on one filesystem), the reply goes out, and about
//! 500 ms later the agent re-executes itself with the same arguments: the
//! same pid, so a supervisor sees no exit, and the containers, which belong
//! to containerd's shims, keep running and are adopted by the new process.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tonic::Status;

use crate::proto::cluster::{AgentUpgradeRequest, AgentUpgradeResponse};

pub const MAX_DOWNLOAD: u64 = 512 * 1024 * 1024;
const RESTART_AFTER: Duration = Duration::from_millis(500);

/// Where upgrades may come from, and what they replace.
#[derive(Debug, Clone)]
pub struct UpgradeConfig {
    /// `None`: not configured (FAILED_PRECONDITION); `*`: any URL.
    pub base_url: Option<String>,
    /// The running binary, as resolved at start (before any replacement).
    pub binary: PathBuf,
    /// The arguments to restart with (argv).
    pub args: Vec<String>,
}

/// Whether `url` lies under `base`: the same prefix, ending at a path or
/// query boundary, so `https://r.example/agent` does not admit
/// `https://r.example/agent-evil`.
pub fn allowed(base: &str, url: &str) -> bool {
    if base == "*" {
        return true;
    }
    let Some(rest) = url.strip_prefix(base) else {
        return false;
    };
    base.ends_with('/') || rest.is_empty() || rest.starts_with(['/', '?'])
}

pub async fn upgrade(
    cfg: &UpgradeConfig,
    req: AgentUpgradeRequest,
) -> Result<AgentUpgradeResponse, Status> {
    if req.url.is_empty() || req.sha256.is_empty() {
        return Err(Status::invalid_argument(
            "UpgradeBinary: url and sha256 are both required",
        ));
    }
    let want = req.sha256.to_ascii_lowercase();
    if want.len() != 64 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(Status::invalid_argument(format!(
            "UpgradeBinary: sha256 {:?} is not 64 hex digits",
            req.sha256
        )));
    }
    let Some(base) = cfg.base_url.as_deref() else {
        return Err(Status::failed_precondition(
            "UpgradeBinary: this node has no upgrade-base-url configured",
        ));
    };
    if !allowed(base, &req.url) {
        return Err(Status::permission_denied(format!(
            "UpgradeBinary: {} is not under the configured base URL {base}",
            req.url
        )));
    }
    tracing::info!(version = %req.version, url = %req.url, "downloading an agent upgrade");
    let staged = staging_path(&cfg.binary);
    let result = download(&req.url, &staged, &want).await;
    if let Err(e) = result {
        let _ = std::fs::remove_file(&staged);
        return Err(e);
    }
    if let Err(e) = std::fs::rename(&staged, &cfg.binary) {
        let _ = std::fs::remove_file(&staged);
        return Err(Status::internal(format!(
            "UpgradeBinary: installing the new binary: {e}"
        )));
    }
    tracing::info!(version = %req.version, binary = %cfg.binary.display(), "agent upgrade installed");
    let (binary, args) = (cfg.binary.clone(), cfg.args.clone());
    tokio::spawn(async move {
        tokio::time::sleep(RESTART_AFTER).await;
        restart(&binary, &args);
    });
    Ok(AgentUpgradeResponse {
        previous_version: env!("CARGO_PKG_VERSION").to_owned(),
        staged_version: req.version,
    })
}

fn staging_path(binary: &Path) -> PathBuf {
    let name = binary.file_name().map_or_else(
        || "zattera-agent".into(),
        |n| n.to_string_lossy().into_owned(),
    );
    binary.with_file_name(format!(".{name}.upgrade-{}", std::process::id()))
}

/// Streams `url` into `path`, checking size and digest; the file is
/// executable and synced when this returns Ok.
async fn download(url: &str, path: &Path, want: &str) -> Result<(), Status> {
    let unavailable = |e: &dyn std::fmt::Display| {
        Status::unavailable(format!("UpgradeBinary: downloading {url}: {e}"))
    };
    // A stalled server fails the call instead of holding it forever.
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .read_timeout(Duration::from_secs(60))
        .build()
        .map_err(|e| unavailable(&e))?;
    let mut resp = client.get(url).send().await.map_err(|e| unavailable(&e))?;
    if !resp.status().is_success() {
        return Err(unavailable(&resp.status()));
    }
    if resp.content_length().is_some_and(|n| n > MAX_DOWNLOAD) {
        return Err(too_big(url));
    }
    let internal = |e: std::io::Error| Status::internal(format!("UpgradeBinary: staging: {e}"));
    let mut file = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o755)
            .open(path)
            .map_err(internal)?
    };
    let mut hasher = Sha256::new();
    let mut total: u64 = 0;
    while let Some(chunk) = resp.chunk().await.map_err(|e| unavailable(&e))? {
        total += chunk.len() as u64;
        if total > MAX_DOWNLOAD {
            return Err(too_big(url));
        }
        hasher.update(&chunk);
        file.write_all(&chunk).map_err(internal)?;
    }
    let got = hex::encode(hasher.finalize());
    if got != want {
        return Err(Status::data_loss(format!(
            "UpgradeBinary: {url} has sha256 {got}, not {want}; nothing installed"
        )));
    }
    file.sync_all().map_err(internal)
}

fn too_big(url: &str) -> Status {
    Status::resource_exhausted(format!(
        "UpgradeBinary: {url} is larger than {MAX_DOWNLOAD} bytes"
    ))
}

/// Replaces this process with `binary args…`. Every descriptor the agent
/// opened is close-on-exec, so the new process binds its sockets and takes
/// its lock again.
fn restart(binary: &Path, args: &[String]) {
    use std::ffi::CString;
    tracing::info!(binary = %binary.display(), "restarting into the upgraded agent");
    let Ok(path) = CString::new(binary.as_os_str().as_encoded_bytes()) else {
        tracing::error!("upgrade restart: the binary path holds a NUL byte");
        return;
    };
    let argv: Vec<CString> = args
        .iter()
        .filter_map(|a| CString::new(a.as_bytes()).ok())
        .collect();
    // execv returns only on failure.
    let Err(e) = nix::unistd::execv(&path, &argv);
    tracing::error!(error = %e, "upgrade restart failed; the new binary runs at the next start");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_must_lie_under_the_base() {
        assert!(allowed("*", "http://anything/x"));
        assert!(allowed(
            "https://r.example/agent/",
            "https://r.example/agent/1.2/zattera-agent"
        ));
        assert!(allowed(
            "https://r.example/agent",
            "https://r.example/agent/1.2"
        ));
        assert!(allowed(
            "https://r.example/agent",
            "https://r.example/agent?v=2"
        ));
        assert!(!allowed(
            "https://r.example/agent",
            "https://r.example/agent-evil/x"
        ));
        assert!(!allowed(
            "https://r.example/agent/",
            "http://r.example/agent/x"
        ));
        assert!(!allowed(
            "https://r.example/agent/",
            "https://evil.example/agent/x"
        ));
    }
}
