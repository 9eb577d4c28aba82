//! `UpgradeBinary`: replace the agent binary and restart into it (UPG-1 to
//! UPG-7).
//!
//! What is installed for version V is this agent's own build of V. A
//! request whose URL lies under the configured `upgrade-base-url` is fetched
//! as it is (with its SHA-256); any other URL (a reference control plane
//! names its own `zattera-<os>-<arch>` asset, which is no agent for this
//! node) is replaced by this agent's asset of V in its own release channel,
//! laid out as the reference's: `<base>/download/<V>/zattera-agent-linux-
//! <arch>`, its SHA-256 from `<base>/download/<V>/sha256sums.txt`. A
//! channel without V is an error that says so; the node keeps running.
//! `*` as the base fetches any URL (and has no channel). URLs are compared
//! parsed and normalised (scheme, host, port, and the path under the base's,
//! after `..` and `%2e%2e` resolve), never as strings: nothing outside the
//! base is ever fetched.
//! Redirects are followed (release assets redirect to a CDN; the SHA-256
//! protects the content), but never from https to http, and never into
//! the node's own networks ([`download`]).
//! The whole download is bounded (10 min, 512 MiB), hashed as it arrives,
//! into a file beside the binary; a SHA-256 mismatch installs nothing.
//! Older versions install too: control rolls back that way, and the wire
//! cannot say "downgrade"; one is logged as such. Beyond the reference, the
//! staged file must be a zattera-agent for this machine (an ELF for this
//! architecture whose `version --json`, run as nobody, says so) before anything is
//! swapped: a reference release (the Go `zattera`) or a script is refused,
//! naming what it is. One upgrade runs at a time. The running binary is
//! kept as `<binary>.prev` (UPG-5; a hard link, and the way back of
//! [`rollback`]), the new file is renamed over the binary
//! (atomic on one filesystem) and the directory synced, the reply goes out,
//! and about 500 ms later the agent flushes its metrics store and
//! re-executes itself with the same arguments: the same pid, so systemd sees
//! no exit, and the containers, which belong to containerd's shims, keep
//! running and are adopted by the new process.

mod download;
pub mod rollback;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::proto::cluster::{AgentUpgradeRequest, AgentUpgradeResponse};

/// Why an upgrade did not happen; the running agent stays in every case.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    /// The request is malformed (no URL or digest, a bad digest).
    #[error("UpgradeBinary: {0}")]
    Invalid(String),
    /// `upgrade-base-url` is not set.
    #[error("UpgradeBinary: this node has no upgrade-base-url configured")]
    NotConfigured,
    /// The release channel has no build of this version for this machine.
    #[error(
        "UpgradeBinary: this node's release channel {base} has no {asset} of version {version} ({why}); the running agent ({running}) stays: publish it there (upgrade-base-url)"
    )]
    NotInChannel {
        base: String,
        version: String,
        asset: String,
        why: String,
        running: String,
    },
    #[error("UpgradeBinary: another upgrade is in progress on this node")]
    Busy,
    /// The download failed (connection, status, redirect).
    #[error("UpgradeBinary: downloading {url}: {reason}")]
    Download { url: String, reason: String },
    #[error("UpgradeBinary: {url} is larger than {MAX_DOWNLOAD} bytes")]
    TooLarge { url: String },
    #[error("UpgradeBinary: {url} has sha256 {got}, not {want}; nothing installed")]
    DigestMismatch {
        url: String,
        got: String,
        want: String,
    },
    /// The staged file is no zattera-agent for this machine.
    #[error(
        "UpgradeBinary: {url} is not a zattera-agent for this machine: {why}; the running agent stays"
    )]
    NotAnAgent { url: String, why: String },
    /// Staging or installing on this node failed.
    #[error("UpgradeBinary: {0}")]
    Local(String),
}

pub const MAX_DOWNLOAD: u64 = 512 * 1024 * 1024;
/// The whole download, redirects and body included (the spec's bound).
const DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(600);
const RESTART_AFTER: Duration = Duration::from_millis(500);
/// The unprivileged user a staged file is first run as.
const NOBODY: u32 = 65534;

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

/// Whether `requested` is older than `running` (a rollback); `false` when
/// either cannot be ordered.
fn is_downgrade(running: &str, requested: &str) -> bool {
    let (Some(have), Some(want)) = (parse_version(running), parse_version(requested)) else {
        return false;
    };
    // A pre-release sorts before its release.
    let key = |(v, pre): &((u64, u64, u64), Option<String>)| (*v, pre.is_none(), pre.clone());
    key(&want) < key(&have)
}

/// Whether `url` lies under `base`, both parsed and normalised: the same
/// scheme, host and port, and a path that is the base's or below it (at a
/// segment boundary, so `/agent` does not admit `/agent-evil`), after `..`
/// and `%2e%2e` have resolved as the HTTP client will resolve them.
pub fn allowed(base: &str, url: &str) -> bool {
    if base == "*" {
        return true;
    }
    let (Ok(base), Ok(url)) = (reqwest::Url::parse(base), reqwest::Url::parse(url)) else {
        return false;
    };
    if base.scheme() != url.scheme()
        || base.host_str() != url.host_str()
        || base.port_or_known_default() != url.port_or_known_default()
        || !url.username().is_empty()
        || url.password().is_some()
    {
        return false;
    }
    let (under, path) = (base.path(), url.path());
    path == under
        || path
            .strip_prefix(under)
            .is_some_and(|rest| under.ends_with('/') || rest.starts_with('/'))
}

/// Why the staged file is not a zattera-agent for this machine, if it is
/// not: it must be an ELF executable for this architecture, and answer
/// `version --json` (or, an older release, `version`) as one.
async fn not_an_agent(staged: &Path) -> Option<String> {
    let mut head = [0u8; 20];
    let read = std::fs::File::open(staged).and_then(|mut f| {
        use std::io::Read;
        f.read(&mut head)
    });
    let Ok(n) = read else {
        return Some("it cannot be read".to_owned());
    };
    if let Some(kind) = elf_mismatch(&head[..n]) {
        return Some(kind);
    }
    // The file is run before it is accepted, so as nobody (56.10): as
    // root, any program with the right digest would have the node before
    // it was refused. It is handed over as the child's stdin and run as
    // /proc/self/fd/0, so no directory on its path needs to let nobody in.
    let answer = |args: &'static [&'static str]| async move {
        let file = std::fs::File::open(staged).ok()?;
        let out = tokio::time::timeout(
            Duration::from_secs(10),
            tokio::process::Command::new("/proc/self/fd/0")
                .args(args)
                .env_clear()
                .current_dir("/")
                .uid(NOBODY)
                .gid(NOBODY)
                .stdin(file)
                .kill_on_drop(true)
                .output(),
        )
        .await;
        match out {
            Ok(Ok(o)) if o.status.success() => {
                Some(String::from_utf8_lossy(&o.stdout).into_owned())
            }
            _ => None,
        }
    };
    if let Some(json) = answer(&["version", "--json"]).await {
        let name = serde_json::from_str::<serde_json::Value>(&json)
            .ok()
            .and_then(|v| v["name"].as_str().map(str::to_owned));
        if name.as_deref() == Some("zattera-agent") {
            return None;
        }
    }
    if answer(&["version"])
        .await
        .is_some_and(|text| text.starts_with("zattera-agent "))
    {
        return None;
    }
    Some(
        "it does not answer `version --json` as zattera-agent does (a reference `zattera` release, or another program)"
            .to_owned(),
    )
}

/// What `head` (a file's first bytes) is, if not an ELF executable for this
/// machine's architecture.
fn elf_mismatch(head: &[u8]) -> Option<String> {
    if head.starts_with(b"#!") {
        return Some("it is a script, not an executable".to_owned());
    }
    if head.len() < 20 || !head.starts_with(b"\x7fELF") {
        return Some("it is not an ELF executable".to_owned());
    }
    // e_machine, little endian on every architecture this agent runs on.
    let machine = u16::from_le_bytes([head[18], head[19]]);
    let want = match std::env::consts::ARCH {
        "x86_64" => 62,
        "aarch64" => 183,
        _ => return None,
    };
    (head[4] != 2 || head[5] != 1 || machine != want).then(|| {
        format!(
            "it is an ELF for another machine (class {}, machine {machine}), not {}",
            head[4],
            std::env::consts::ARCH
        )
    })
}

/// This agent's asset name in a release channel, for this machine.
pub fn asset_name() -> String {
    format!(
        "zattera-agent-linux-{}",
        crate::runtime::descriptor::host_architecture()
    )
}

/// The SHA-256 of `asset` in a `sha256sums.txt` (`<hex>  <name>` lines, a
/// leading `*` on the name for binary mode).
fn digest_in(sums: &str, asset: &str) -> Option<String> {
    sums.lines().find_map(|line| {
        let (hex, name) = line.trim().split_once(char::is_whitespace)?;
        let name = name.trim_start().trim_start_matches('*');
        (name == asset && hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| hex.to_ascii_lowercase())
    })
}

/// What to fetch for `req`: its own URL and digest when the URL lies under
/// `base`, else this agent's asset of `req.version` from the channel.
async fn source_of(
    base: &str,
    req: &AgentUpgradeRequest,
) -> Result<(String, String), UpgradeError> {
    if !req.url.is_empty() && allowed(base, &req.url) {
        if req.sha256.is_empty() {
            return Err(UpgradeError::Invalid("a sha256 is required".into()));
        }
        return Ok((req.url.clone(), req.sha256.to_ascii_lowercase()));
    }
    let version = req.version.trim();
    if !crate::version::valid_tag(version) || version.contains('/') {
        return Err(UpgradeError::Invalid(format!(
            "version {:?} is not a release tag",
            req.version
        )));
    }
    let asset = asset_name();
    let dir = format!("{}/download/{version}", base.trim_end_matches('/'));
    let missing = |why: String| UpgradeError::NotInChannel {
        base: base.to_owned(),
        version: version.to_owned(),
        asset: asset.clone(),
        why,
        running: crate::version::tag().to_owned(),
    };
    let sums_url = format!("{dir}/sha256sums.txt");
    let sums = fetch_small(&sums_url)
        .await
        .map_err(|e| missing(format!("{}: {e}", crate::redact::url(&sums_url))))?;
    let digest = digest_in(&sums, &asset)
        .ok_or_else(|| missing(format!("sha256sums.txt names no {asset}")))?;
    if !req.url.is_empty() {
        tracing::info!(
            control_named = %crate::redact::url(&req.url),
            "control named another release's asset; this node installs its own build of {version}"
        );
    }
    Ok((format!("{dir}/{asset}"), digest))
}

/// A checksums file: at most 1 MiB, within a minute.
async fn fetch_small(url: &str) -> Result<String, String> {
    const MAX: usize = 1 << 20;
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(60))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| e.to_string())?;
    let mut resp = client.get(url).send().await.map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("HTTP {}", resp.status().as_u16()));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
        body.extend_from_slice(&chunk);
        if body.len() > MAX {
            return Err("larger than 1 MiB".into());
        }
    }
    String::from_utf8(body).map_err(|_| "not text".to_owned())
}

pub async fn upgrade(
    cfg: &UpgradeConfig,
    req: AgentUpgradeRequest,
) -> Result<AgentUpgradeResponse, UpgradeError> {
    if req.url.is_empty() && req.version.is_empty() {
        return Err(UpgradeError::Invalid(
            "a version (or a url under upgrade-base-url) is required".into(),
        ));
    }
    let Some(base) = cfg.base_url.as_deref() else {
        return Err(UpgradeError::NotConfigured);
    };
    let (url, want) = source_of(base, &req).await?;
    if want.len() != 64 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(UpgradeError::Invalid(format!(
            "sha256 {want:?} is not 64 hex digits"
        )));
    }
    let running = crate::version::tag();
    if is_downgrade(running, &req.version) {
        tracing::info!(from = running, to = %req.version, "a downgrade (control's rollback)");
    }
    let Ok(_one_at_a_time) = cfg.busy.try_lock() else {
        return Err(UpgradeError::Busy);
    };
    tracing::info!(version = %req.version, url = %crate::redact::url(&url), "downloading an agent upgrade");
    let staged = staging_path(&cfg.binary);
    let result = download::download(&url, &staged, &want).await;
    if let Err(e) = result {
        let _ = std::fs::remove_file(&staged);
        return Err(e);
    }
    if let Some(why) = not_an_agent(&staged).await {
        let _ = std::fs::remove_file(&staged);
        return Err(UpgradeError::NotAnAgent {
            url: crate::redact::url(&url),
            why,
        });
    }
    if let Err(e) = install(&staged, &cfg.binary, &req.version) {
        let _ = std::fs::remove_file(&staged);
        return Err(UpgradeError::Local(format!(
            "installing the new binary: {e}"
        )));
    }
    tracing::info!(version = %req.version, binary = %cfg.binary.display(), "agent upgrade installed");
    let (binary, args, stats) = (cfg.binary.clone(), cfg.args.clone(), cfg.stats.clone());
    tokio::spawn(async move {
        tokio::time::sleep(RESTART_AFTER).await;
        if let Some(stats) = &stats {
            stats.checkpoint_now().await;
        }
        exec_self(&binary, &args, "restarting into the upgraded agent");
    });
    Ok(AgentUpgradeResponse {
        previous_version: crate::version::tag().to_owned(),
        staged_version: req.version,
    })
}

/// Keeps the running binary as `<binary>.prev` with the record of the
/// trial ([`rollback`]: a binary that never reaches control is swapped
/// back), renames the staged file over it, and syncs the directory so the
/// swap survives a power cut.
fn install(staged: &Path, binary: &Path, to: &str) -> std::io::Result<()> {
    if binary.exists() {
        rollback::Records::beside(binary).keep_previous(crate::version::tag(), to)?;
    }
    crate::durable::rename(staged, binary)
}

fn staging_path(binary: &Path) -> PathBuf {
    let name = binary.file_name().map_or_else(
        || "zattera-agent".into(),
        |n| n.to_string_lossy().into_owned(),
    );
    binary.with_file_name(format!(".{name}.upgrade-{}", std::process::id()))
}

/// Replaces this process with `binary args…`, saying `why`. Every
/// descriptor the agent opened is close-on-exec, so the new process binds
/// its sockets and takes its lock again. Returns only when the exec failed.
pub fn exec_self(binary: &Path, args: &[String], why: &str) {
    use std::ffi::CString;
    tracing::info!(binary = %binary.display(), "{why}");
    let Ok(path) = CString::new(binary.as_os_str().as_encoded_bytes()) else {
        tracing::error!("restart: the binary path holds a NUL byte");
        return;
    };
    let argv: Vec<CString> = args
        .iter()
        .filter_map(|a| CString::new(a.as_bytes()).ok())
        .collect();
    // execv returns only on failure.
    let Err(e) = nix::unistd::execv(&path, &argv);
    tracing::error!(error = %e, "restart failed; the agent keeps running as it is");
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn older_versions_are_downgrades_and_install() {
        assert!(!is_downgrade("0.2.0", "0.2.1"));
        assert!(!is_downgrade("0.2.0", "v0.3.0"));
        assert!(!is_downgrade("0.2.0", "0.2.0"), "a reinstall");
        assert!(is_downgrade("0.2.0", "0.1.9"));
        assert!(is_downgrade("0.2.0", "0.1.9+rollback"));
        assert!(is_downgrade("0.2.0", "0.2.0-rc1"), "a pre-release is older");
        assert!(
            !is_downgrade("0.2.0", "nightly"),
            "unordered: not called one"
        );
    }

    #[test]
    fn only_an_elf_for_this_machine_is_an_agent() {
        let this = std::fs::read("/proc/self/exe").unwrap();
        assert_eq!(elf_mismatch(&this[..20]), None);
        assert!(
            elf_mismatch(b"#!/bin/sh\nrm -rf /\n")
                .unwrap()
                .contains("script")
        );
        assert!(
            elf_mismatch(b"<html>not found</html>")
                .unwrap()
                .contains("not an ELF")
        );
        let mut other = this[..20].to_vec();
        other[18..20].copy_from_slice(&183u16.to_le_bytes());
        if std::env::consts::ARCH == "x86_64" {
            assert!(elf_mismatch(&other).unwrap().contains("another machine"));
        }
    }

    /// 56.10: the staged file is tried as nobody, never as root. The
    /// program answers as the agent does (so it ran) and tries to leave a
    /// file in a directory only root may write: run as root, it did.
    #[tokio::test]
    async fn a_staged_file_is_tried_as_nobody_never_as_root() {
        if !zattera_testkit::require_root() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap(); // 0700, root's
        let (src, staged, mark) = (
            tmp.path().join("staged.c"),
            tmp.path().join("staged"),
            tmp.path().join("written-as-root"),
        );
        let program = r#"
#include <stdio.h>
#include <unistd.h>
int main(void) {
    FILE *f = fopen("MARK", "w");
    if (f) { fprintf(f, "%d\n", (int)getuid()); fclose(f); }
    puts("{\"name\":\"zattera-agent\"}");
    return 0;
}
"#;
        let program = program.replace("MARK", &mark.display().to_string());
        std::fs::write(&src, program).unwrap();
        let built = std::process::Command::new("gcc")
            .arg("-o")
            .arg(&staged)
            .arg(&src)
            .status();
        if !built.is_ok_and(|s| s.success()) {
            zattera_testkit::missing("gcc");
            return;
        }
        assert_eq!(
            not_an_agent(&staged).await,
            None,
            "it answered as the agent"
        );
        assert!(
            !mark.exists(),
            "the staged program wrote as uid {}",
            std::fs::read_to_string(&mark).unwrap_or_default().trim()
        );
    }

    #[tokio::test]
    async fn a_program_that_is_not_the_agent_is_refused() {
        let why = not_an_agent(Path::new("/bin/true")).await.unwrap();
        assert!(why.contains("version --json"), "{why}");
    }

    #[test]
    fn a_channel_names_its_assets_digest_as_sha256sum_writes_it() {
        let hex = "ab".repeat(32);
        let sums = format!(
            "{}  zattera-linux-amd64\n{hex} *zattera-agent-linux-amd64\nnot a line\n",
            "cd".repeat(32)
        );
        assert_eq!(digest_in(&sums, "zattera-agent-linux-amd64"), Some(hex));
        assert_eq!(digest_in(&sums, "zattera-agent-linux-arm64"), None);
        assert_eq!(
            digest_in(
                "short  zattera-agent-linux-amd64",
                "zattera-agent-linux-amd64"
            ),
            None
        );
        assert!(asset_name().starts_with("zattera-agent-linux-"));
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
        // Compared parsed and normalised: what the client would fetch.
        for escape in [
            "https://r.example/agent/../elsewhere/x",
            "https://r.example/agent/%2e%2e/elsewhere/x",
            "https://r.example/agent/%2E%2E/%2e%2e/x",
            "https://r.example:8443/agent/x",
            "https://user@r.example/agent/x",
        ] {
            assert!(!allowed("https://r.example/agent/", escape), "{escape}");
        }
        assert!(allowed(
            "https://r.example/agent/",
            "https://r.example/agent/./1.2/../1.3/zattera-agent"
        ));
        assert!(allowed(
            "https://r.example:443/agent/",
            "https://r.example/agent/x"
        ));
    }
}
