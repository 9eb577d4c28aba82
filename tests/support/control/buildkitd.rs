//! What a test's buildkitd leaves, cleaned up.

use super::*;

/// Stops the agent's buildkitd (it outlives the agent by design; SIGTERM
/// first, so that it gives its CNI namespaces back) and removes the
/// worker's namespace and the `_history` one BuildKit keeps beside it.
pub struct BuildkitdCleanup {
    pub(super) pid_file: std::path::PathBuf,
    pub(super) socket: std::path::PathBuf,
    pub(super) namespaces: Vec<String>,
}

impl BuildkitdCleanup {
    pub async fn run(self) {
        if let Some(pid) = std::fs::read_to_string(&self.pid_file)
            .ok()
            .and_then(|t| t.trim().parse::<i32>().ok())
        {
            let pid = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            for _ in 0..100 {
                if nix::sys::signal::kill(pid, None).is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        for ns in &self.namespaces {
            if let Ok(ns) = ns.parse()
                && let Ok(ctd) = zattera_agent::runtime::Containerd::connect(&self.socket, ns).await
            {
                crate::support::purge_namespace(&ctd).await;
            }
        }
    }
}
