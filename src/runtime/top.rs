//! `Top`: the processes of one container, as `ps -ef` columns (what the
//! reference's Docker `top` answers).
//!
//! containerd's `Tasks.ListPids` names the processes (host pids, the task's
//! whole cgroup); each row is then read from `/proc`. User ids stay numeric:
//! names would need the container's own `/etc/passwd`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::services::v1::ListPidsRequest;
use tonic::Code;

use super::Containerd;
use crate::proto::cluster::{AgentTopProcess, AgentTopResponse};

/// Why a container's processes could not be listed.
#[derive(Debug, thiserror::Error)]
pub enum TopError {
    #[error("top: container_id is empty")]
    NoContainer,
    #[error("top: container {0} has no running task")]
    NoTask(String),
    #[error("top {container}: {message}")]
    Runtime { container: String, message: String },
}

pub const TITLES: [&str; 8] = ["UID", "PID", "PPID", "C", "STIME", "TTY", "TIME", "CMD"];

/// `/proc` reports times in USER_HZ, which is 100 on every Linux.
const USER_HZ: u64 = 100;

pub async fn top(ctd: &Containerd, container_id: &str) -> Result<AgentTopResponse, TopError> {
    if container_id.is_empty() {
        return Err(TopError::NoContainer);
    }
    let listed = ctd
        .tasks()
        .list_pids(ctd.request(ListPidsRequest {
            container_id: container_id.to_owned(),
        }))
        .await
        .map_err(|s| match s.code() {
            Code::NotFound => TopError::NoTask(container_id.to_owned()),
            _ => TopError::Runtime {
                container: container_id.to_owned(),
                message: s.message().to_owned(),
            },
        })?
        .into_inner();
    let boot = boot_time();
    let now = SystemTime::now();
    let mut pids: Vec<u32> = listed.processes.iter().map(|p| p.pid).collect();
    pids.sort_unstable();
    let processes = pids
        .into_iter()
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            row(pid, &stat, &status, &cmdline, boot, now)
        })
        .map(|mut fields| {
            // TOP-2: the host's name for the uid, as `ps -ef` prints it.
            if let Some(uid) = fields.first_mut() {
                *uid = user_name(uid);
            }
            AgentTopProcess { fields }
        })
        .collect();
    Ok(AgentTopResponse {
        titles: TITLES.iter().map(|t| (*t).to_owned()).collect(),
        processes,
    })
}

/// The host's name for `uid` (a number), or the number when it has none.
pub fn user_name(uid: &str) -> String {
    uid.parse::<u32>()
        .ok()
        .and_then(|n| {
            nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(n))
                .ok()
                .flatten()
        })
        .map_or_else(|| uid.to_owned(), |u| u.name)
}

/// One `ps -ef` row from a process's `/proc` files; `None` when `stat` is
/// unreadable (the process went away mid-listing).
pub fn row(
    pid: u32,
    stat: &str,
    status: &str,
    cmdline: &[u8],
    boot: SystemTime,
    now: SystemTime,
) -> Option<Vec<String>> {
    // The command name may hold spaces and parens: split after the last ')'.
    let (head, rest) = stat.rsplit_once(')')?;
    let comm = head.split_once('(')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // After the comm: state is index 0, so field N of stat(5) is N - 3.
    let ppid = num(1);
    let tty = num(4);
    let cpu_ticks = num(11) + num(12);
    let started = boot + Duration::from_millis(num(19) * 1000 / USER_HZ);
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .unwrap_or("?");
    let alive = now.duration_since(started).unwrap_or_default().as_millis();
    let cpu_ms = u128::from(cpu_ticks) * 1000 / u128::from(USER_HZ);
    let c = (cpu_ms * 100).checked_div(alive).unwrap_or(0);
    let cmd = if cmdline.is_empty() {
        format!("[{comm}]")
    } else {
        String::from_utf8_lossy(cmdline.strip_suffix(b"\0").unwrap_or(cmdline)).replace('\0', " ")
    };
    Some(vec![
        uid.to_owned(),
        pid.to_string(),
        ppid.to_string(),
        c.to_string(),
        clock(started),
        if tty == 0 {
            "?".into()
        } else {
            format!("tty{tty}")
        },
        cpu_time(cpu_ticks / USER_HZ),
        cmd,
    ])
}

/// `HH:MM` (UTC) of a start time.
fn clock(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    format!("{:02}:{:02}", secs / 3600 % 24, secs / 60 % 60)
}

/// `ps`'s cumulative CPU time, `[DD-]HH:MM:SS`.
fn cpu_time(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    if d > 0 {
        format!("{d}-{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h:02}:{m:02}:{s:02}")
    }
}

fn boot_time() -> SystemTime {
    let btime = std::fs::read_to_string("/proc/stat")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("btime "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    UNIX_EPOCH + Duration::from_secs(btime)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn a_row_reads_like_ps_ef() {
        let boot = UNIX_EPOCH + Duration::from_secs(1_000_000);
        // starttime 500 ticks = 5 s after boot; 150 + 50 ticks of CPU.
        let stat = "4242 (my (odd) cmd) S 4200 4242 4242 0 -1 4194560 100 0 0 0 150 50 0 0 20 0 1 0 500 1000 100";
        let status = "Name:\tsh\nUid:\t1000\t1000\t1000\t1000\n";
        let now = boot + Duration::from_secs(25);
        let r = row(4242, stat, status, b"sleep\x00100\x00", boot, now).unwrap();
        assert_eq!(r[0], "1000");
        assert_eq!(r[1], "4242");
        assert_eq!(r[2], "4200");
        // 2 s of CPU over 20 s alive.
        assert_eq!(r[3], "10");
        assert_eq!(r[5], "?");
        assert_eq!(r[6], "00:00:02");
        assert_eq!(r[7], "sleep 100");
        let kernel = row(7, stat, status, b"", boot, now).unwrap();
        assert_eq!(kernel[7], "[my (odd) cmd]");
        assert!(row(1, "garbage", "", b"", boot, now).is_none());
        assert_eq!(user_name("0"), "root");
        assert_eq!(
            user_name("3999999999"),
            "3999999999",
            "no such user: the number"
        );
        assert_eq!(cpu_time(90_061), "1-01:01:01");
    }
}
