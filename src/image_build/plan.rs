//! The nixpacks planner (BLD-5): for a context without a Dockerfile, the
//! pinned nixpacks CLI writes `.nixpacks/Dockerfile`.
//!
//! The planner is a binary built from the `nixpacks` crate at the pinned
//! version and shipped with the agent (nothing is downloaded at build
//! time). It runs on the host, not in a container: as an unprivileged user
//! that owns the context for the run, with a clean environment, in its own
//! process group, killed at the deadline. Its output (stdout and stderr
//! merged) becomes `plan` lines.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use super::child::{kill_group, merged_lines};
use tokio_util::sync::CancellationToken;

use super::{BuildError, Events, Phase, say};

/// The planner release the spec pins.
pub const NIXPACKS_VERSION: &str = "1.41.0";
/// Where packages install the planner.
pub const DEFAULT_NIXPACKS_BINARY: &str = "/usr/lib/zattera/nixpacks";
/// BLD-5's deadline.
pub const PLAN_DEADLINE: Duration = Duration::from_secs(120);

/// How the planner is run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planner {
    pub binary: PathBuf,
    /// The user (uid = gid) it runs as; it owns the context while it runs.
    pub uid: u32,
    pub deadline: Duration,
}

impl Default for Planner {
    fn default() -> Self {
        Self {
            binary: PathBuf::from(DEFAULT_NIXPACKS_BINARY),
            uid: 65534,
            deadline: PLAN_DEADLINE,
        }
    }
}

impl Planner {
    /// Plans `context` with `hints` (the request's `build_env`, NIXPACKS_*
    /// settings, given to the planner as `--env`).
    pub async fn plan(
        &self,
        context: &Path,
        hints: &BTreeMap<String, String>,
        events: &Events,
        cancel: &CancellationToken,
    ) -> Result<(), BuildError> {
        if !self.binary.exists() {
            return Err(BuildError::Plan(format!(
                "the nixpacks planner is not installed at {} (nixpacks-binary); the packages ship it, \
                 or build it with `cargo install nixpacks --version {NIXPACKS_VERSION} --locked`",
                self.binary.display()
            )));
        }
        let _ = std::fs::remove_dir_all(context.join(".nixpacks"));
        chown_tree(context, self.uid)
            .map_err(|e| BuildError::Plan(format!("context owner: {e}")))?;
        let result = self.run(context, hints, events, cancel).await;
        // The backend reads the context as root; the owner goes back.
        let _ = chown_tree(context, 0);
        result?;
        let dockerfile = context.join(".nixpacks/Dockerfile");
        if !dockerfile.is_file() {
            return Err(BuildError::Plan(
                "nixpacks produced no Dockerfile in .nixpacks".into(),
            ));
        }
        Ok(())
    }

    async fn run(
        &self,
        context: &Path,
        hints: &BTreeMap<String, String>,
        events: &Events,
        cancel: &CancellationToken,
    ) -> Result<(), BuildError> {
        let mut cmd = tokio::process::Command::new(&self.binary);
        cmd.arg("build")
            .arg(context)
            .arg("--out")
            .arg(context)
            .args(["--name", "ignored"]);
        for (k, v) in hints {
            cmd.arg("--env").arg(format!("{k}={v}"));
        }
        cmd.env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", context)
            .env("NO_COLOR", "1")
            .current_dir(context)
            .uid(self.uid)
            .gid(self.uid)
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| BuildError::Plan(format!("{}: {e}", self.binary.display())))?;
        let pgid = child.id();
        let mut rx = merged_lines(&mut child);
        let deadline = tokio::time::sleep(self.deadline);
        tokio::pin!(deadline);
        let mut output_open = true;
        let status = loop {
            tokio::select! {
                line = rx.recv(), if output_open => match line {
                    Some(line) => {
                        let line = line.trim_end();
                        if !line.is_empty() {
                            say(events, Phase::Plan, line).await;
                        }
                    }
                    None => output_open = false,
                },
                status = child.wait(), if !output_open => break status,
                () = &mut deadline => {
                    kill_group(pgid);
                    let _ = child.wait().await;
                    return Err(BuildError::Plan("timed out waiting for exit".into()));
                }
                () = cancel.cancelled() => {
                    kill_group(pgid);
                    let _ = child.wait().await;
                    return Err(BuildError::Canceled);
                }
            }
        };
        let status = status.map_err(|e| BuildError::Plan(e.to_string()))?;
        match status.code() {
            Some(0) => Ok(()),
            Some(code) => Err(BuildError::Plan(format!("exited with code {code}"))),
            None => Err(BuildError::Plan(format!("{status}"))),
        }
    }
}

/// Gives `dir` and everything under it to `uid`, through directory
/// handles: each entry is changed relative to its parent's open handle and
/// never followed, and a directory is entered only as what it was when
/// opened (`O_NOFOLLOW`), so nothing swapped in by a name race is touched.
fn chown_tree(dir: &Path, uid: u32) -> std::io::Result<()> {
    use rustix::fs::{AtFlags, Mode, OFlags};
    let open = |at: &dyn rustix::fd::AsFd, name: &std::ffi::OsStr| {
        rustix::fs::openat(
            at,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
    };
    let owner = Some(rustix::fs::Uid::from_raw(uid));
    let group = Some(rustix::fs::Gid::from_raw(uid));
    let root = open(&rustix::fs::CWD, dir.as_os_str())?;
    rustix::fs::fchown(&root, owner, group)?;
    let mut stack = vec![root];
    while let Some(fd) = stack.pop() {
        for entry in rustix::fs::Dir::read_from(&fd)? {
            let entry = entry?;
            let name = std::os::unix::ffi::OsStrExt::from_bytes(entry.file_name().to_bytes());
            if name == "." || name == ".." {
                continue;
            }
            rustix::fs::chownat(&fd, name, owner, group, AtFlags::SYMLINK_NOFOLLOW)?;
            if entry.file_type() == rustix::fs::FileType::Directory {
                stack.push(open(&fd, name)?);
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
    fn the_owner_changes_inside_the_tree_only() {
        use std::os::unix::fs::MetadataExt;
        if !zattera_testkit::require_root() {
            return; // chown needs root
        }
        let tmp = tempfile::tempdir().unwrap();
        let (ctx, outside) = (tmp.path().join("ctx"), tmp.path().join("outside"));
        std::fs::create_dir_all(ctx.join("a/b")).unwrap();
        std::fs::write(ctx.join("a/b/f"), b"x").unwrap();
        std::fs::write(&outside, b"host file").unwrap();
        std::os::unix::fs::symlink(&outside, ctx.join("a/link")).unwrap();
        std::os::unix::fs::symlink(tmp.path(), ctx.join("dirlink")).unwrap();
        chown_tree(&ctx, 65534).unwrap();
        for p in ["a", "a/b", "a/b/f"] {
            assert_eq!(std::fs::metadata(ctx.join(p)).unwrap().uid(), 65534, "{p}");
        }
        assert_eq!(
            std::fs::symlink_metadata(ctx.join("a/link")).unwrap().uid(),
            65534
        );
        assert_eq!(
            std::fs::metadata(&outside).unwrap().uid(),
            0,
            "never followed"
        );
        assert_eq!(
            std::fs::metadata(tmp.path()).unwrap().uid(),
            0,
            "never entered"
        );
        chown_tree(&ctx, 0).unwrap();
        assert_eq!(std::fs::metadata(ctx.join("a/b/f")).unwrap().uid(), 0);
    }

    #[tokio::test]
    async fn a_missing_planner_names_the_key_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let planner = Planner {
            binary: dir.path().join("absent"),
            ..Planner::default()
        };
        let (tx, _rx) = tokio::sync::mpsc::channel(8);
        let e = planner
            .plan(dir.path(), &BTreeMap::new(), &tx, &CancellationToken::new())
            .await
            .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("nixpacks-binary") && text.contains("1.41.0"),
            "{text}"
        );
    }
}
