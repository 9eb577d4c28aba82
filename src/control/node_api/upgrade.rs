//! `UpgradeBinary`: replace the agent binary and restart into it.
//!
//! Only URLs under the configured `upgrade-base-url` are fetched (`*` = any
//! URL), and no redirect may lead outside it; at most 512 MiB are read,
//! hashed as they arrive, into a file beside the binary; a SHA-256 mismatch
//! installs nothing. A version older than the running one is refused unless
//! its label says it is a rollback (`1.2.0+rollback`); one upgrade runs at a
//! time. The running binary is kept as `<binary>.prev` (UPG-5), the new file
//! is renamed over the binary (atomic on one filesystem) and the directory
//! synced, the reply goes out, and about 500 ms later the agent re-executes
//! itself with the same arguments: the same pid, so a supervisor sees no
//! exit, and the containers, which belong to containerd's shims, keep
//! running and are adopted by the new process.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
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
    /// Held for the whole of one upgrade.
    pub busy: Arc<tokio::sync::Mutex<()>>,
    /// The stats store, flushed before the restart (UPG-7).
    pub stats: Option<crate::metrics::persist::StoreFile>,
}

/// The build-metadata suffix that marks a requested version as a rollback.
const ROLLBACK: [&str; 2] = ["+rollback", "+downgrade"];

/// `v1.2.3-rc1+meta` → ((1, 2, 3), Some("rc1")); `None` when not a version.
fn parse_version(label: &str) -> Option<((u64, u64, u64), Option<String>)> {
    let core = label.trim().trim_start_matches('v');
    let core = core.split('+').next().unwrap_or(core);
    let (numbers, pre) = match core.split_once('-') {
        Some((n, p)) => (n, Some(p.to_owned())),
        None => (core, None),
    };
    let mut it = numbers.split('.').map(str::parse::<u64>);
    let v = (
        it.next()?.ok()?,
        it.next()?.ok()?,
        it.next().unwrap_or(Ok(0)).ok()?,
    );
    Some((v, pre))
}

/// Why `requested` may not replace `running`, if it may not: an older
/// version needs the rollback mark, an unordered label is refused.
fn version_refusal(running: &str, requested: &str) -> Option<String> {
    if ROLLBACK.iter().any(|r| requested.ends_with(r)) {
        return None;
    }
    let (Some(have), Some(want)) = (parse_version(running), parse_version(requested)) else {
        return Some(format!(
            "version {requested:?} cannot be ordered against the running {running}; give a version (1.2.3)"
        ));
    };
    // A pre-release sorts before its release.
    let key = |(v, pre): &((u64, u64, u64), Option<String>)| (*v, pre.is_none(), pre.clone());
    (key(&want) < key(&have)).then(|| {
        format!(
            "version {requested} is older than the running {running}; mark a rollback as {requested}+rollback"
        )
    })
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
            crate::redact::url(&req.url)
        )));
    }
    let running = env!("CARGO_PKG_VERSION");
    if let Some(why) = version_refusal(running, &req.version) {
        return Err(Status::failed_precondition(format!("UpgradeBinary: {why}")));
    }
    let Ok(_one_at_a_time) = cfg.busy.try_lock() else {
        return Err(Status::aborted(
            "UpgradeBinary: another upgrade is in progress on this node",
        ));
    };
    tracing::info!(version = %req.version, url = %crate::redact::url(&req.url), "downloading an agent upgrade");
    let staged = staging_path(&cfg.binary);
    let result = download(base, &req.url, &staged, &want).await;
    if let Err(e) = result {
        let _ = std::fs::remove_file(&staged);
        return Err(e);
    }
    if let Err(e) = install(&staged, &cfg.binary) {
        let _ = std::fs::remove_file(&staged);
        return Err(Status::internal(format!(
            "UpgradeBinary: installing the new binary: {e}"
        )));
    }
    tracing::info!(version = %req.version, binary = %cfg.binary.display(), "agent upgrade installed");
    let (binary, args, stats) = (cfg.binary.clone(), cfg.args.clone(), cfg.stats.clone());
    tokio::spawn(async move {
        tokio::time::sleep(RESTART_AFTER).await;
        if let Some((store, path)) = &stats {
            crate::metrics::persist::flush_now(store, path).await;
        }
        restart(&binary, &args);
    });
    Ok(AgentUpgradeResponse {
        previous_version: env!("CARGO_PKG_VERSION").to_owned(),
        staged_version: req.version,
    })
}

/// Keeps the running binary as `<binary>.prev` (a copy: the binary stays in
/// place if anything below fails), renames the staged file over it, and
/// syncs the directory so the swap survives a power cut.
fn install(staged: &Path, binary: &Path) -> std::io::Result<()> {
    let mut prev = binary.as_os_str().to_owned();
    prev.push(".prev");
    if binary.exists() {
        std::fs::copy(binary, &prev)?;
    }
    std::fs::rename(staged, binary)?;
    if let Some(dir) = binary.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
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
async fn download(base: &str, url: &str, path: &Path, want: &str) -> Result<(), Status> {
    let shown = crate::redact::url(url);
    let unavailable = |e: &dyn std::fmt::Display| {
        // reqwest's own errors quote the whole URL: the redacted one replaces it.
        let text = e.to_string().replace(url, &shown);
        Status::unavailable(format!("UpgradeBinary: downloading {shown}: {text}"))
    };
    // A redirect is followed only while it stays under the base URL.
    let base_owned = base.to_owned();
    let redirects = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= 10 {
            attempt.error("too many redirects")
        } else if allowed(&base_owned, attempt.url().as_str()) {
            attempt.follow()
        } else {
            let to = attempt.url().to_string();
            attempt.error(format!("redirected to {to}, outside the upgrade base URL"))
        }
    });
    // A stalled server fails the call instead of holding it forever.
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .read_timeout(Duration::from_secs(60))
        .redirect(redirects)
        .build()
        .map_err(|e| unavailable(&e))?;
    let mut resp = client.get(url).send().await.map_err(|e| unavailable(&e))?;
    if !resp.status().is_success() {
        return Err(unavailable(&resp.status()));
    }
    if resp.content_length().is_some_and(|n| n > MAX_DOWNLOAD) {
        return Err(too_big(&shown));
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
            return Err(too_big(&shown));
        }
        hasher.update(&chunk);
        file.write_all(&chunk).map_err(internal)?;
    }
    let got = hex::encode(hasher.finalize());
    if got != want {
        return Err(Status::data_loss(format!(
            "UpgradeBinary: {shown} has sha256 {got}, not {want}; nothing installed"
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
    fn older_versions_need_the_rollback_mark() {
        assert_eq!(version_refusal("0.2.0", "0.2.1"), None);
        assert_eq!(version_refusal("0.2.0", "v0.3.0"), None);
        assert_eq!(version_refusal("0.2.0", "0.2.0"), None, "a reinstall");
        assert!(
            version_refusal("0.2.0", "0.1.9")
                .unwrap()
                .contains("+rollback")
        );
        assert_eq!(version_refusal("0.2.0", "0.1.9+rollback"), None);
        assert!(
            version_refusal("0.2.0", "0.2.0-rc1").is_some(),
            "a pre-release is older"
        );
        assert!(version_refusal("0.2.0", "nightly").is_some());
    }

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
