//! How the agent learns it must stop, and whether the host goes down
//! with it.

/// Whether SIGTERM came because the host is shutting down (or rebooting)
/// rather than because the agent alone is stopped or restarted: the check
/// command (systemd's `is-system-running`) prints `stopping`. Any failure
/// means "no": leaving instances running is the safe side.
pub(super) async fn host_is_going_down(check: &[String]) -> bool {
    let Some((program, args)) = check.split_first() else {
        return false;
    };
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(3),
        tokio::process::Command::new(program)
            .args(args)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await;
    match out {
        Ok(Ok(out)) => String::from_utf8_lossy(&out.stdout).trim() == "stopping",
        Ok(Err(e)) => {
            tracing::debug!(command = %program, error = %e, "host shutdown check did not run");
            false
        }
        Err(_) => false,
    }
}

pub(super) async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
