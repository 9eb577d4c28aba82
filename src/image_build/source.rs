//! Fetching a build's source (BLD-2): the tarball from control's blob
//! endpoint over mTLS, checked against the digest its URL names, or a git
//! ref cloned shallowly over HTTPS.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use sha2::{Digest as _, Sha256};

use super::unpack::Limits;
use crate::link::tls::NodeTls;

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
    let mut config = crate::link::tls::node_client(tls).map_err(|e| e.to_string())?;
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

/// `git`, reading no configuration but what it is given (45.6): not the
/// system's, not root's global file, no credential helper of the host's,
/// with `home` (the build's scratch) as its home.
fn git_command(home: &Path) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new("git");
    cmd.env("GIT_TERMINAL_PROMPT", "0")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("HOME", home)
        .env("XDG_CONFIG_HOME", home)
        .env_remove("GIT_ASKPASS")
        .env_remove("SSH_ASKPASS")
        // Not inside a repository whose config git would read.
        .current_dir(home)
        .kill_on_drop(true);
    cmd
}

/// `text` with every occurrence of `token` masked; an empty token masks
/// nothing (replacing "" would put the mask between every character).
fn hide_token(text: &str, token: &str) -> String {
    if token.is_empty() {
        text.to_owned()
    } else {
        text.replace(token, "***")
    }
}

/// Clones `src` into `dir` (which must not exist), removes `.git`, and
/// makes what is left like an unpacked tarball ([`tidy_clone`]).
pub async fn fetch_git(src: &GitSource, dir: &Path, limits: &Limits) -> Result<(), String> {
    if !src.url.starts_with("https://") {
        return Err(format!(
            "{}: only https:// git sources are cloned",
            crate::redact::url(&src.url)
        ));
    }
    let home = dir.parent().unwrap_or(dir);
    for step in git_steps(src, dir) {
        let mut cmd = git_command(home);
        cmd.args(&step);
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
                hide_token(text.trim(), &src.token)
            ));
        }
    }
    let _ = std::fs::remove_dir_all(dir.join(".git"));
    let (dir, limits) = (dir.to_owned(), *limits);
    tokio::task::spawn_blocking(move || tidy_clone(&dir, &limits))
        .await
        .map_err(|e| format!("git source: {e}"))?
}

/// A clone made like an unpacked tarball (BLD-3): every symlink (a
/// `Dockerfile -> /etc/shadow` that buildah's `--file` would follow as
/// root) and anything else not a file or a directory is removed, and the
/// tarball's caps on files and bytes apply.
fn tidy_clone(dir: &Path, limits: &Limits) -> Result<(), String> {
    let (mut entries, mut bytes) = (0u64, 0u64);
    let mut todo = vec![dir.to_path_buf()];
    while let Some(at) = todo.pop() {
        let list =
            std::fs::read_dir(&at).map_err(|e| format!("git source: {}: {e}", at.display()))?;
        for entry in list {
            let entry = entry.map_err(|e| format!("git source: {}: {e}", at.display()))?;
            let path = entry.path();
            let kind = entry
                .file_type()
                .map_err(|e| format!("git source: {}: {e}", path.display()))?;
            entries += 1;
            if kind.is_dir() {
                todo.push(path);
            } else if kind.is_file() {
                bytes += entry.metadata().map_or(0, |m| m.len());
            } else {
                std::fs::remove_file(&path)
                    .map_err(|e| format!("git source: {}: {e}", path.display()))?;
            }
            if entries > limits.max_entries || bytes > limits.max_bytes {
                return Err(format!(
                    "git source: larger than the build context cap ({} files, {} bytes)",
                    limits.max_entries, limits.max_bytes
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::disallowed_methods)]
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
    fn a_clone_keeps_no_link_and_stays_under_the_caps() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = dir.path().join("ctx");
        std::fs::create_dir_all(ctx.join("sub")).unwrap();
        std::fs::write(ctx.join("app.txt"), "app").unwrap();
        std::fs::write(ctx.join("sub/more.txt"), "more").unwrap();
        std::os::unix::fs::symlink("/etc/shadow", ctx.join("Dockerfile")).unwrap();
        std::os::unix::fs::symlink("app.txt", ctx.join("sub/inside")).unwrap();
        nix::unistd::mkfifo(
            &ctx.join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .unwrap();
        tidy_clone(&ctx, &Limits::default()).unwrap();
        for gone in ["Dockerfile", "sub/inside", "fifo"] {
            assert!(ctx.join(gone).symlink_metadata().is_err(), "{gone} is left");
        }
        assert_eq!(
            std::fs::read_to_string(ctx.join("sub/more.txt")).unwrap(),
            "more"
        );
        let tight = Limits {
            max_entries: 2,
            ..Limits::default()
        };
        let err = tidy_clone(&ctx, &tight).unwrap_err();
        assert!(err.contains("larger than the build context cap"), "{err}");
    }

    /// git reads no configuration of the host's: only the command line.
    #[test]
    fn a_git_error_hides_the_token_and_only_the_token() {
        assert_eq!(hide_token("fatal: bad ghp_x", "ghp_x"), "fatal: bad ***");
        assert_eq!(hide_token("fatal: no access", ""), "fatal: no access");
    }

    #[tokio::test]
    async fn git_reads_no_host_configuration() {
        let home = tempfile::tempdir().unwrap();
        std::fs::write(
            home.path().join(".gitconfig"),
            "[credential]\n\thelper = store\n",
        )
        .unwrap();
        let out = git_command(home.path())
            .args(["config", "--list", "--show-origin"])
            .output()
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.lines().all(|l| l.starts_with("command line:")),
            "{text}"
        );
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
