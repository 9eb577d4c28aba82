//! A server stream kept open on the control leader: the loop that route
//! snapshots and peer sets share. Each session dials the [`Dialer`]'s
//! target with the current identity; a failed or ended one waits the sync
//! stream's back-off (S-8) unless the leader moves meanwhile, which is
//! followed at once, as is a renewed identity.

use std::time::Instant;

use rustls::ClientConfig;

use super::backoff::{Backoff, HEALTHY_SESSION};
use super::target::Dialer;
use super::tls::{self, CurrentTls};

/// Runs `session(target, client)` for ever; `what` names it in logs.
pub async fn keep_open<F, Fut, E>(
    what: &'static str,
    mut tls: CurrentTls,
    mut dialer: Dialer,
    mut session: F,
) where
    F: FnMut(String, ClientConfig) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let mut client = match tls::node_client(&tls.borrow_and_update()) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(what, error = %e, "the node identity makes no TLS client");
            return;
        }
    };
    let mut backoff = Backoff::default();
    loop {
        let target = dialer.target();
        let started = Instant::now();
        tokio::select! {
            r = session(target.clone(), client.clone()) => {
                if let Err(e) = r {
                    tracing::warn!(what, control = %target, error = %e, "stream failed");
                }
                let lasted = started.elapsed();
                if lasted >= HEALTHY_SESSION {
                    dialer.reached();
                } else {
                    dialer.missed();
                }
                let wait = backoff.next_wait(lasted);
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = dialer.moved_from(&target) => {}
                }
            }
            () = tls::renewed(&mut tls) => {
                match tls::node_client(&tls.borrow_and_update()) {
                    Ok(c) => client = c,
                    Err(e) => tracing::error!(what, error = %e, "renewed identity unusable; keeping the previous one"),
                }
            }
            () = dialer.moved_from(&target) => {
                tracing::info!(what, from = %target, "the control leader moved; following it");
                dialer.reached();
            }
        }
    }
}
