//! Keeping the node identity valid (wire.md 1.2). There is no renewal RPC:
//! a certificate lasts a year and is replaced by joining again. With a kept
//! join token the node re-joins when a third of its certificate's life is
//! left (not at every start, as the reference does: its server rewrites the
//! node record on every join); without one it warns from 30 days before
//! the end. A renewal is stored as one change ([`IdentityDir::store`]), then
//! handed to everything that presents the identity (the sync stream, the
//! route watch, the node API) and to the puller (the registry password is
//! minted anew on every join).

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use super::join::{self, JoinError, JoinOptions};
use crate::link::identity::IdentityDir;
use crate::link::registry::ClusterRegistry;
use crate::link::tls::{self, NodeTls};

/// Without a token, warnings start this long before the certificate ends.
pub const WARN_BEFORE: Duration = Duration::from_secs(30 * 86_400);
/// Waits between failed renewals: doubling from the first to the last.
const RETRY: (Duration, Duration) = (Duration::from_secs(15), Duration::from_secs(15 * 60));
/// Longest sleep between looks at the certificate (clocks jump).
const LOOK_EVERY: Duration = Duration::from_secs(86_400);

/// When a certificate valid over `[not_before, not_after]` is renewed:
/// with a third of its life left.
pub fn renew_at(not_before: SystemTime, not_after: SystemTime) -> SystemTime {
    let life = not_after.duration_since(not_before).unwrap_or_default();
    not_after.checked_sub(life / 3).unwrap_or(not_before)
}

/// What the node says about a certificate ending at `not_after`, at `now`:
/// nothing while more than [`WARN_BEFORE`] is left, or while a kept token
/// renews it before it ends.
pub fn expiry_notice(not_after: SystemTime, now: SystemTime, renewing: bool) -> Option<String> {
    let at = humantime::format_rfc3339_seconds(not_after);
    match not_after.duration_since(now) {
        Err(_) => Some(format!(
            "the node certificate expired at {at}: control refuses this node until it joins again (`zattera-agent join`, or set join-token)"
        )),
        Ok(left) if left < WARN_BEFORE && !renewing => Some(format!(
            "the node certificate expires in {} days (at {at}): run `zattera-agent join` again, or set join-token to renew it by itself",
            left.as_secs() / 86_400
        )),
        Ok(_) => None,
    }
}

/// Where a renewed identity goes (the token stays out of `Debug`).
#[derive(Debug)]
pub struct Renewer {
    /// The join to repeat; `None`: no token is kept, so only warn.
    pub join: Option<JoinOptions>,
    pub tls: watch::Sender<Arc<NodeTls>>,
    pub registry: watch::Sender<Option<Arc<ClusterRegistry>>>,
    /// What `status` shows about the identity.
    pub notices: watch::Sender<Vec<String>>,
}

impl Renewer {
    /// Joins again and hands the new identity over.
    async fn renew(&self, opts: &JoinOptions) -> Result<(), JoinError> {
        let enrollment = join::join(opts).await?;
        let tls = IdentityDir::new(&opts.data_dir).load_tls()?;
        // The new credential; the other control nodes' addresses stay.
        self.registry.send_modify(|current| {
            let also_at = current
                .as_ref()
                .map(|c| c.also_at.clone())
                .unwrap_or_default();
            *current = enrollment.cluster_registry(&tls).map(|mut r| {
                r.also_at = also_at;
                Arc::new(r)
            });
        });
        self.tls.send_replace(Arc::new(tls));
        Ok(())
    }

    /// Runs until the task is dropped: a renewal whenever a third of the
    /// certificate's life is left, never merely because the agent started:
    /// each join makes the reference rewrite the node record, dropping the
    /// labels an operator set and undoing a cordon.
    pub async fn run(self) {
        let mut retry = RETRY.0;
        loop {
            let cert = self.tls.borrow().cert_pem.clone();
            let Some((not_before, not_after)) = tls::validity_of(&cert) else {
                tracing::error!("the node certificate cannot be read; it is not renewed");
                return;
            };
            let now = SystemTime::now();
            let notice = expiry_notice(not_after, now, self.join.is_some());
            if let Some(n) = &notice {
                tracing::warn!("{n}");
            }
            self.notices.send_replace(notice.into_iter().collect());
            let Some(opts) = &self.join else {
                let warn_from = not_after.checked_sub(WARN_BEFORE).unwrap_or(not_before);
                let wait = warn_from.duration_since(now).unwrap_or(LOOK_EVERY);
                tokio::time::sleep(wait.min(LOOK_EVERY)).await;
                continue;
            };
            let at = renew_at(not_before, not_after);
            if let Ok(wait) = at.duration_since(now) {
                tokio::time::sleep(wait.min(LOOK_EVERY)).await;
                continue;
            }
            match self.renew(opts).await {
                Ok(()) => {
                    retry = RETRY.0;
                    let until = tls::validity_of(&self.tls.borrow().cert_pem)
                        .map(|(_, end)| humantime::format_rfc3339_seconds(end).to_string());
                    tracing::info!(control = %opts.control, valid_until = ?until, "node identity renewed");
                    // Never a join storm, whatever lifetimes control hands out.
                    tokio::time::sleep(RETRY.0).await;
                }
                Err(e) => {
                    tracing::warn!(control = %opts.control, error = %e, retry_in = ?retry, "node identity renewal failed");
                    tokio::time::sleep(retry).await;
                    retry = (retry * 2).min(RETRY.1);
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn renewal_is_due_with_a_third_of_the_life_left() {
        let start = SystemTime::UNIX_EPOCH + 1000 * DAY;
        assert_eq!(
            renew_at(start, start + 365 * DAY),
            start + 365 * DAY - DAY * 365 / 3
        );
        assert_eq!(
            renew_at(start, start + Duration::from_secs(90)),
            start + Duration::from_secs(60)
        );
        // A certificate that ends before it starts is due at once.
        assert_eq!(renew_at(start, start - DAY), start - DAY);
    }

    #[test]
    fn warnings_start_30_days_out_unless_a_token_renews() {
        let now = SystemTime::UNIX_EPOCH + 1000 * DAY;
        assert_eq!(expiry_notice(now + 31 * DAY, now, false), None);
        let soon = expiry_notice(now + 10 * DAY, now, false).unwrap();
        assert!(soon.contains("expires in 10 days"), "{soon}");
        assert_eq!(expiry_notice(now + 10 * DAY, now, true), None);
        let gone = expiry_notice(now - DAY, now, true).unwrap();
        assert!(gone.contains("expired"), "{gone}");
    }
}
