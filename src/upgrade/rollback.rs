//! The way back from a self-upgrade (58.6). A new binary may answer
//! `version --json` and still fail in `run` (a config it refuses, a crash
//! at start): systemd restarts it every 2 s for ever, and control can no
//! longer reach the node to send another. So before the swap the running
//! binary is kept as `<binary>.prev` (a hard link: no copy, and the old
//! inode stays whole) and a pending record is written beside it. Every
//! `run` counts itself in the record before anything else (before the
//! config is read: a config the new binary refuses is a failure like any
//! other); after [`MAX_STARTS`] starts that never reached a sync session,
//! `.prev` is renamed back over the binary and run. The first sync session
//! confirms the upgrade: the record and `.prev` go.
//!
//! The records live beside the binary, where the swap happens (one
//! directory, one filesystem: the renames are atomic and one directory
//! sync makes them durable), not in the data dir, which only the config
//! names.

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Starts of the new binary that may fail before it is swapped back.
pub const MAX_STARTS: u32 = 3;

/// An upgrade not confirmed yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pending {
    /// The version that was running, kept as `.prev`.
    pub from: String,
    /// The version installed.
    pub to: String,
    /// Starts of `to` so far.
    pub starts: u32,
}

/// An upgrade undone, kept for `status` until the next confirmation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolledBack {
    pub from: String,
    pub to: String,
    pub starts: u32,
}

impl std::fmt::Display for RolledBack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the upgrade to {} was rolled back to {}: it started {} times without reaching the control plane",
            self.to, self.from, self.starts
        )
    }
}

/// What a start found.
#[derive(Debug, PartialEq, Eq)]
pub enum AtStart {
    /// No upgrade pending.
    Settled,
    /// This is start `starts` of an upgrade not confirmed yet.
    OnTrial(Pending),
    /// The previous binary is back in place: run it instead.
    SwappedBack(RolledBack),
}

/// `<binary>.prev`, `<binary>.upgrade.json` and
/// `<binary>.rolled-back.json`.
#[derive(Debug, Clone)]
pub struct Records {
    binary: PathBuf,
}

impl Records {
    pub fn beside(binary: &Path) -> Self {
        Self {
            binary: binary.to_owned(),
        }
    }

    fn with_suffix(&self, suffix: &str) -> PathBuf {
        let mut p = self.binary.as_os_str().to_owned();
        p.push(suffix);
        PathBuf::from(p)
    }

    pub fn previous(&self) -> PathBuf {
        self.with_suffix(".prev")
    }

    fn pending(&self) -> PathBuf {
        self.with_suffix(".upgrade.json")
    }

    fn rolled_back(&self) -> PathBuf {
        self.with_suffix(".rolled-back.json")
    }

    /// Before the swap: the running binary kept as `.prev`, and the
    /// record of the trial, both durable.
    pub fn keep_previous(&self, from: &str, to: &str) -> io::Result<()> {
        let prev = self.previous();
        match std::fs::remove_file(&prev) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        if let Err(e) = std::fs::hard_link(&self.binary, &prev) {
            // A filesystem without hard links: a synced copy.
            tracing::debug!(error = %e, "no hard link for the previous binary; copying it");
            std::fs::copy(&self.binary, &prev)?;
            std::fs::File::open(&prev)?.sync_all()?;
        }
        let record = Pending {
            from: from.to_owned(),
            to: to.to_owned(),
            starts: 0,
        };
        crate::durable::write(&self.pending(), &to_json(&record)?, 0o600)?;
        crate::durable::remove(&self.rolled_back())
    }

    /// Counts this start of a pending upgrade, and swaps the previous
    /// binary back once [`MAX_STARTS`] starts have failed to confirm it.
    pub fn at_start(&self) -> io::Result<AtStart> {
        let Some(mut pending) = read_json::<Pending>(&self.pending())? else {
            return Ok(AtStart::Settled);
        };
        if pending.starts < MAX_STARTS {
            pending.starts += 1;
            crate::durable::write(&self.pending(), &to_json(&pending)?, 0o600)?;
            return Ok(AtStart::OnTrial(pending));
        }
        let prev = self.previous();
        if !prev.exists() {
            // Nothing to go back to: the trial ends here, as it is.
            tracing::error!(
                from = %pending.from, to = %pending.to,
                "the upgrade never reached the control plane, and {} is gone: nothing to roll back to",
                prev.display()
            );
            crate::durable::remove(&self.pending())?;
            return Ok(AtStart::Settled);
        }
        let undone = RolledBack {
            from: pending.from,
            to: pending.to,
            starts: pending.starts,
        };
        crate::durable::write(&self.rolled_back(), &to_json(&undone)?, 0o600)?;
        crate::durable::rename(&prev, &self.binary)?;
        crate::durable::remove(&self.pending())?;
        Ok(AtStart::SwappedBack(undone))
    }

    /// A roll-back this binary came back from, for `status`.
    pub fn rolled_back_record(&self) -> Option<RolledBack> {
        read_json(&self.rolled_back()).ok().flatten()
    }

    /// What `status` says about the upgrades of this binary: a trial under
    /// way, or a roll-back.
    pub fn notices(&self) -> Vec<String> {
        let trial = read_json::<Pending>(&self.pending()).ok().flatten().map(|p| {
            format!(
                "the upgrade to {} (from {}) is on trial, start {} of {MAX_STARTS}: the first sync session confirms it, and {} runs again if none comes",
                p.to, p.from, p.starts, p.from
            )
        });
        let undone = self.rolled_back_record().map(|r| r.to_string());
        trial.into_iter().chain(undone).collect()
    }

    /// The first sync session: a pending upgrade holds (its record and
    /// `.prev` go). A roll-back's record stays until the next upgrade:
    /// `status` keeps saying why this node runs the older version.
    pub fn confirm(&self) -> io::Result<Option<Pending>> {
        let pending = read_json::<Pending>(&self.pending()).ok().flatten();
        crate::durable::remove(&self.pending())?;
        if pending.is_some() {
            crate::durable::remove(&self.previous())?;
        }
        Ok(pending)
    }
}

/// The first step of `zattera-agent run`, before the config is read: a
/// trial counts this start, and one that never reached the control plane
/// in [`MAX_STARTS`] starts is swapped back and run instead (with this
/// process's arguments). Errors only when that exec failed.
pub fn trial_at_start() -> io::Result<()> {
    let me = std::env::current_exe()?;
    match Records::beside(&me).at_start() {
        Ok(AtStart::Settled) => Ok(()),
        Ok(AtStart::OnTrial(p)) => {
            tracing::info!(
                from = %p.from, to = %p.to, start = p.starts, of = MAX_STARTS,
                "an upgrade on trial: the first sync session confirms it"
            );
            Ok(())
        }
        Ok(AtStart::SwappedBack(undone)) => {
            tracing::error!("{undone}; running {} again", undone.from);
            let args: Vec<String> = std::env::args().collect();
            super::exec_self(&me, &args, "running the previous binary");
            Err(io::Error::other(format!(
                "{undone}, and the previous binary could not be run"
            )))
        }
        Err(e) => {
            tracing::warn!(error = %e, "the upgrade records beside {} could not be read or written", me.display());
            Ok(())
        }
    }
}

/// Confirms a trial once `opened` counts a session (the sync stream's
/// count), and clears the upgrade's notices.
pub async fn confirm_on_first_session(
    records: Records,
    mut opened: tokio::sync::watch::Receiver<u64>,
    notices: tokio::sync::watch::Sender<Vec<String>>,
) {
    if opened.wait_for(|n| *n > 0).await.is_err() {
        return;
    }
    match records.confirm() {
        Ok(Some(p)) => {
            tracing::info!(from = %p.from, to = %p.to, "upgrade confirmed: the new binary reached the control plane");
        }
        Ok(None) => {}
        Err(e) => tracing::warn!(error = %e, "the upgrade's records could not be cleared"),
    }
    notices.send_replace(records.notices());
}

fn to_json<T: Serialize>(value: &T) -> io::Result<Vec<u8>> {
    let mut bytes = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
    bytes.push(b'\n');
    Ok(bytes)
}

/// `None` when the file is absent; an unreadable one is set aside (and
/// read as absent: a trial is not worth an agent that cannot start).
fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> io::Result<Option<T>> {
    match std::fs::read(path) {
        Ok(bytes) => match serde_json::from_slice(&bytes) {
            Ok(v) => Ok(Some(v)),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "unreadable upgrade record set aside");
                crate::durable::set_aside(path)?;
                Ok(None)
            }
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn binary(dir: &Path, content: &str) -> PathBuf {
        let b = dir.join("zattera-agent");
        std::fs::write(&b, content).unwrap();
        b
    }

    #[test]
    fn a_new_binary_that_never_reaches_control_is_swapped_back_after_three_starts() {
        let dir = tempfile::tempdir().unwrap();
        let bin = binary(dir.path(), "old");
        let r = Records::beside(&bin);
        r.keep_previous("v1", "v2").unwrap();
        // The swap, as install does it.
        std::fs::write(dir.path().join("staged"), "new").unwrap();
        std::fs::rename(dir.path().join("staged"), &bin).unwrap();
        assert_eq!(std::fs::read_to_string(r.previous()).unwrap(), "old");

        for n in 1..=MAX_STARTS {
            match r.at_start().unwrap() {
                AtStart::OnTrial(p) => assert_eq!(p.starts, n),
                other => panic!("start {n}: {other:?}"),
            }
        }
        let AtStart::SwappedBack(undone) = r.at_start().unwrap() else {
            panic!("not swapped back")
        };
        assert_eq!(undone.from, "v1");
        assert_eq!(std::fs::read_to_string(&bin).unwrap(), "old");
        assert!(!r.previous().exists());
        assert_eq!(r.at_start().unwrap(), AtStart::Settled);
        assert!(
            r.rolled_back_record()
                .unwrap()
                .to_string()
                .contains("rolled back to v1: it started 3 times")
        );
        r.confirm().unwrap();
        assert!(
            r.rolled_back_record().is_some(),
            "said until the next upgrade"
        );
        r.keep_previous("v1", "v3").unwrap();
        assert!(r.rolled_back_record().is_none());
    }

    #[test]
    fn the_first_session_confirms_the_upgrade() {
        let dir = tempfile::tempdir().unwrap();
        let bin = binary(dir.path(), "old");
        let r = Records::beside(&bin);
        r.keep_previous("v1", "v2").unwrap();
        assert!(matches!(r.at_start().unwrap(), AtStart::OnTrial(_)));
        let confirmed = r.confirm().unwrap().unwrap();
        assert_eq!(confirmed.to, "v2");
        assert!(!r.previous().exists());
        for _ in 0..=MAX_STARTS {
            assert_eq!(r.at_start().unwrap(), AtStart::Settled);
        }
    }

    #[test]
    fn a_torn_record_is_set_aside_and_the_binary_runs() {
        let dir = tempfile::tempdir().unwrap();
        let bin = binary(dir.path(), "new");
        let r = Records::beside(&bin);
        std::fs::write(r.pending(), "").unwrap();
        assert_eq!(r.at_start().unwrap(), AtStart::Settled);
        assert!(!r.pending().exists());
        assert_eq!(std::fs::read_to_string(&bin).unwrap(), "new");
    }
}
