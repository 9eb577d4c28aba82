//! Exec processes an earlier agent left (EX-6, step 10 of the spec's
//! containerd Exec): they belong to the shim and outlive the agent that
//! started them, so a killed or upgraded agent leaves its health probes and
//! `exec` sessions running in their containers, with nobody to read them.
//! At start, every process of the agent's own exec ids is killed and its
//! record deleted; anything else (another tool's exec) is left alone.

use std::path::Path;
use std::time::SystemTime;

use containerd_client::services::v1::{DeleteProcessRequest, KillRequest, ListPidsRequest};
use tonic::Code;

use super::connection::Containerd;

/// The exec ids this agent gives: health probes and the node API's
/// sessions ([`super::exec`], [`super::exec_session`]).
pub const PREFIXES: [&str; 2] = ["exec-", "session-"];

/// What runc's shim says of a process in `ListPids` (its `info`).
#[derive(Clone, PartialEq, prost::Message)]
struct ProcessDetails {
    #[prost(string, tag = "1")]
    exec_id: String,
}

/// Whether `exec_id` is one this agent gives, started before `before`
/// (its id carries its start time in ns): this agent's own probes, started
/// since, are never touched.
pub fn is_ours_before(exec_id: &str, before: SystemTime) -> bool {
    let limit = before
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    PREFIXES.iter().any(|p| {
        exec_id
            .strip_prefix(p)
            .filter(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|rest| rest.parse::<u128>().ok())
            .is_some_and(|started| started < limit)
    })
}

/// Opens, for reading, every FIFO of the exec processes started before
/// `before`, and keeps them open while held. An agent killed between an
/// exec's start and its readers' open leaves the shim blocked opening the
/// process's output for writing, and a blocked shim answers nothing more
/// for that container (its task reads time out). A reader lets the open
/// finish; the writes after it fail once the files are dropped.
pub fn open_fifos(fifo_dir: &Path, before: SystemTime) -> Vec<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(list) = std::fs::read_dir(fifo_dir) else {
        return Vec::new();
    };
    list.flatten()
        .filter(|entry| {
            entry
                .file_name()
                .to_str()
                .is_some_and(|n| is_ours_before(n, before))
        })
        .filter_map(|entry| std::fs::read_dir(entry.path()).ok())
        .flat_map(Iterator::flatten)
        .filter_map(|fifo| {
            std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(nix::libc::O_NONBLOCK)
                .open(fifo.path())
                .ok()
        })
        .collect()
}

/// Removes the FIFO directories (named by exec id) of exec processes
/// started before `before`.
pub fn remove_fifo_dirs(fifo_dir: &Path, before: SystemTime) {
    let Ok(list) = std::fs::read_dir(fifo_dir) else {
        return;
    };
    for entry in list.flatten() {
        let name = entry.file_name();
        if name.to_str().is_some_and(|n| is_ours_before(n, before)) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Kills and deletes every exec process of ours started before `before` in
/// `container_id`'s task; the exec ids it ended.
pub async fn end(ctd: &Containerd, container_id: &str, before: SystemTime) -> Vec<String> {
    let listed = match ctd
        .tasks()
        .list_pids(ctd.request(ListPidsRequest {
            container_id: container_id.to_owned(),
        }))
        .await
    {
        Ok(r) => r.into_inner().processes,
        Err(s) if s.code() == Code::NotFound => return Vec::new(),
        Err(s) => {
            tracing::debug!(container = container_id, error = %s.message(), "exec processes not listed");
            return Vec::new();
        }
    };
    let ours: Vec<String> = listed
        .iter()
        .filter_map(|p| p.info.as_ref())
        .filter_map(|info| <ProcessDetails as prost::Message>::decode(info.value.as_slice()).ok())
        .map(|d| d.exec_id)
        .filter(|id| is_ours_before(id, before))
        .collect();
    for exec_id in &ours {
        let _ = ctd
            .tasks()
            .kill(ctd.request(KillRequest {
                container_id: container_id.to_owned(),
                exec_id: exec_id.clone(),
                signal: 9,
                all: false,
            }))
            .await;
        // Deleted once it has exited (a moment after the SIGKILL).
        for _ in 0..20 {
            match ctd
                .tasks()
                .delete_process(ctd.request(DeleteProcessRequest {
                    container_id: container_id.to_owned(),
                    exec_id: exec_id.clone(),
                }))
                .await
            {
                Ok(_) => break,
                Err(s) if s.code() == Code::NotFound => break,
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
            }
        }
        tracing::info!(
            container = container_id,
            exec_id,
            "ended an exec process an earlier agent left"
        );
    }
    ours
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn only_the_agents_own_earlier_exec_ids_are_ended() {
        let start = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_733_400_000);
        assert!(is_ours_before("exec-1733399999000000000", start));
        assert!(is_ours_before("session-42", start));
        assert!(
            !is_ours_before("exec-1733400000000000001", start),
            "started since"
        );
        for other in [
            "exec-",
            "session-x",
            "ctr-exec-1",
            "exec-12a",
            "",
            "my-session-1",
        ] {
            assert!(!is_ours_before(other, start), "{other}");
        }
    }
}
