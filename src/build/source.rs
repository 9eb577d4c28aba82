//! Fetching a build's source (BLD-2): the tarball from control's blob
//! endpoint over mTLS, checked against the digest its URL names, or a git
//! ref cloned shallowly over HTTPS.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use sha2::{Digest as _, Sha256};

use crate::control::tls::NodeTls;

/// The whole fetch, body included (BLD-2).
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(600);
/// A tarball larger than this is not read (the context cap is 512 MiB of
/// files; compressed it is smaller).
const MAX_TARBALL: u64 = 1 << 30;

/// The sha256 a blob URL names in its last segment (`…/blobs/sha256:<hex>`
/// or `…/blobs/<hex>`), if it names one.
pub fn digest_in_url(url: &str) -> Option<String> {
    let last = url.split(['?', '#']).next()?.rsplit('/').next()?;
    let hex = last.strip_prefix("sha256:").unwrap_or(last);
    (hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| hex.to_ascii_lowercase())
}

/// GETs `url` into `dest` with the node's identity and the cluster CA,
/// checking the digest the URL names. Errors are the text after "fetch
/// source: ".
pub async fn fetch_tarball(url: &str, tls: &NodeTls, dest: &Path) -> Result<u64, String> {
    let shown = crate::redact::url(url);
    if !url.starts_with("https://") {
        return Err(format!("{shown}: only https:// sources are fetched"));
    }
    let mut config = crate::control::tls::node_client(tls).map_err(|e| e.to_string())?;
    // reqwest speaks HTTP/1.1 here.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let client = reqwest::Client::builder()
        .use_preconfigured_tls(config)
        .connect_timeout(Duration::from_secs(10))
        .timeout(FETCH_TIMEOUT)
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .map_err(|e| e.to_string())?;
    let clean = |e: reqwest::Error| e.to_string().replace(url, &shown);
    let mut resp = client.get(url).send().await.map_err(clean)?;
    if resp.status() != reqwest::StatusCode::OK {
        return Err(format!("source fetch: HTTP {}", resp.status().as_u16()));
    }
    let mut file = std::fs::File::create(dest).map_err(|e| format!("{}: {e}", dest.display()))?;
    let mut hasher = Sha256::new();
    let mut total = 0u64;
    while let Some(chunk) = resp.chunk().await.map_err(clean)? {
        total += chunk.len() as u64;
        if total > MAX_TARBALL {
            return Err(format!("{shown}: larger than {MAX_TARBALL} bytes"));
        }
        hasher.update(&chunk);
        file.write_all(&chunk)
            .map_err(|e| format!("{}: {e}", dest.display()))?;
    }
    if let Some(want) = digest_in_url(url) {
        let got = hex::encode(hasher.finalize());
        if got != want {
            return Err(format!(
                "{shown}: the body has sha256:{got}, not the sha256:{want} its URL names"
            ));
        }
    }
    Ok(total)
}

/// A git source: HTTPS clone URL, optional token, a branch/tag or a SHA.
#[derive(Clone, PartialEq, Eq)]
pub struct GitSource {
    pub url: String,
    pub token: String,
    pub reference: String,
}

impl std::fmt::Debug for GitSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GitSource")
            .field("url", &crate::redact::url(&self.url))
            .field("reference", &self.reference)
            .finish_non_exhaustive()
    }
}

fn is_sha(reference: &str) -> bool {
    (7..=64).contains(&reference.len()) && reference.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The git invocations that fetch `src` into `dir`: a shallow clone of a
/// branch or tag, or an init plus a fetch of one SHA. The token goes in an
/// HTTP header given through the environment, never on a command line.
pub fn git_steps(src: &GitSource, dir: &Path) -> Vec<Vec<String>> {
    let dir = dir.display().to_string();
    let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
    if is_sha(&src.reference) {
        vec![
            s(&["init", "-q", &dir]),
            s(&[
                "-C",
                &dir,
                "fetch",
                "-q",
                "--depth",
                "1",
                &src.url,
                &src.reference,
            ]),
            s(&["-C", &dir, "checkout", "-q", "FETCH_HEAD"]),
        ]
    } else {
        let mut clone = s(&["clone", "-q", "--depth", "1"]);
        if !src.reference.is_empty() {
            clone.extend(s(&["--branch", &src.reference]));
        }
        clone.extend(s(&[&src.url, &dir]));
        vec![clone]
    }
}

/// Clones `src` into `dir` (which must not exist) and removes `.git`.
pub async fn fetch_git(src: &GitSource, dir: &Path) -> Result<(), String> {
    if !src.url.starts_with("https://") {
        return Err(format!(
            "{}: only https:// git sources are cloned",
            crate::redact::url(&src.url)
        ));
    }
    for step in git_steps(src, dir) {
        let mut cmd = tokio::process::Command::new("git");
        cmd.args(&step)
            .env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .kill_on_drop(true);
        if !src.token.is_empty() {
            use base64::Engine as _;
            let basic = base64::engine::general_purpose::STANDARD
                .encode(format!("x-access-token:{}", src.token));
            cmd.env("GIT_CONFIG_COUNT", "1")
                .env("GIT_CONFIG_KEY_0", "http.extraHeader")
                .env(
                    "GIT_CONFIG_VALUE_0",
                    format!("Authorization: Basic {basic}"),
                );
        }
        let out = tokio::time::timeout(FETCH_TIMEOUT, cmd.output())
            .await
            .map_err(|_| "git: timed out after 10m".to_owned())?
            .map_err(|e| format!("git: {e} (is git installed?)"))?;
        if !out.status.success() {
            let text = String::from_utf8_lossy(&out.stderr);
            return Err(format!(
                "git {}: {}",
                step.first().map_or("", String::as_str),
                text.trim().replace(&src.token, "***")
            ));
        }
    }
    let _ = std::fs::remove_dir_all(dir.join(".git"));
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_digest_comes_from_the_last_segment() {
        let hex = "a".repeat(64);
        assert_eq!(
            digest_in_url(&format!("https://c:8443/internal/blobs/sha256:{hex}")),
            Some(hex.clone())
        );
        assert_eq!(
            digest_in_url(&format!("https://c/internal/blobs/{hex}?x=1")),
            Some(hex)
        );
        assert_eq!(digest_in_url("https://c/internal/blobs/latest"), None);
    }

    #[test]
    fn git_fetches_a_sha_or_clones_a_branch_shallowly() {
        let dir = Path::new("/tmp/ctx");
        let branch = GitSource {
            url: "https://git.example/r.git".into(),
            token: "secret".into(),
            reference: "main".into(),
        };
        let steps = git_steps(&branch, dir);
        assert_eq!(steps.len(), 1);
        assert!(steps[0].windows(2).any(|w| w == ["--branch", "main"]));
        assert!(!steps.concat().iter().any(|a| a.contains("secret")));
        let sha = GitSource {
            reference: "0123456789abcdef0123456789abcdef01234567".into(),
            ..branch
        };
        let steps = git_steps(&sha, dir);
        assert_eq!(steps.len(), 3);
        assert!(steps[1].contains(&"fetch".to_owned()));
    }
}
