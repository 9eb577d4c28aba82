//! Per-container resource samples, read from the container's cgroup (v1 or
//! v2) and its network namespace (M-7). CPU is a rate, so it takes two
//! samples: [`cpu_percent`] gives percent of one core between them.
//!
//! Reading the cgroup files directly works on every containerd version and
//! cgroup layout, without decoding containerd's version-specific metrics types.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Instant;

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub at: Instant,
    /// Total CPU time used, in nanoseconds.
    pub cpu_ns: u64,
    /// Memory in use, page cache that can be reclaimed excluded (as `docker stats`).
    pub memory_bytes: u64,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
}

/// CPU use between two samples, in percent of one core (200 = two cores busy).
pub fn cpu_percent(prev: &Sample, cur: &Sample) -> f64 {
    let wall = cur.at.saturating_duration_since(prev.at).as_nanos();
    if wall == 0 {
        return 0.0;
    }
    #[allow(clippy::cast_precision_loss)]
    let percent = cur.cpu_ns.saturating_sub(prev.cpu_ns) as f64 * 100.0 / wall as f64;
    percent
}

/// Samples the container whose cgroup is `cgroups_path` (as in its spec) and
/// whose init process is `pid`.
pub fn sample(cgroups_path: &Path, pid: u32) -> io::Result<Sample> {
    let relative = cgroups_path.strip_prefix("/").unwrap_or(cgroups_path);
    let root = Path::new(CGROUP_ROOT);
    let (cpu_ns, memory_bytes) = if root.join("cgroup.controllers").exists() {
        let dir = root.join(relative);
        let cpu_us = stat_value(&read(&dir.join("cpu.stat"))?, "usage_usec").unwrap_or(0);
        let current = parse_u64(&read(&dir.join("memory.current"))?);
        let inactive = stat_value(&read(&dir.join("memory.stat"))?, "inactive_file").unwrap_or(0);
        (cpu_us * 1000, current.saturating_sub(inactive))
    } else {
        let cpu = parse_u64(&read(
            &v1_dir(root, "cpuacct", relative).join("cpuacct.usage"),
        )?);
        let mem_dir = v1_dir(root, "memory", relative);
        let usage = parse_u64(&read(&mem_dir.join("memory.usage_in_bytes"))?);
        let inactive =
            stat_value(&read(&mem_dir.join("memory.stat"))?, "total_inactive_file").unwrap_or(0);
        (cpu, usage.saturating_sub(inactive))
    };
    let (rx_bytes, tx_bytes) = net_dev_totals(&read(Path::new(&format!("/proc/{pid}/net/dev")))?);
    Ok(Sample {
        at: Instant::now(),
        cpu_ns,
        memory_bytes,
        rx_bytes,
        tx_bytes,
    })
}

/// cgroup v1 mounts controllers separately, sometimes co-mounted (`cpu,cpuacct`).
fn v1_dir(root: &Path, controller: &str, relative: &Path) -> PathBuf {
    let direct = root.join(controller);
    if direct.exists() {
        return direct.join(relative);
    }
    let comounted = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.split(',').any(|c| c == controller))
        });
    comounted.unwrap_or(direct).join(relative)
}

fn read(path: &Path) -> io::Result<String> {
    std::fs::read_to_string(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

fn parse_u64(s: &str) -> u64 {
    s.trim().parse().unwrap_or(0)
}

/// The value of `key` in a `key value` per line file (cpu.stat, memory.stat).
fn stat_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| parse_u64(v))
    })
}

/// Received and transmitted bytes over every interface but `lo`.
fn net_dev_totals(text: &str) -> (u64, u64) {
    let mut rx = 0;
    let mut tx = 0;
    for line in text.lines().skip(2) {
        let Some((name, counters)) = line.split_once(':') else {
            continue;
        };
        if name.trim() == "lo" {
            continue;
        }
        let fields: Vec<u64> = counters.split_whitespace().map(parse_u64).collect();
        if fields.len() >= 9 {
            rx += fields[0];
            tx += fields[8];
        }
    }
    (rx, tx)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn cpu_percent_is_per_core() {
        let t = Instant::now();
        let a = Sample {
            at: t,
            cpu_ns: 0,
            memory_bytes: 0,
            rx_bytes: 0,
            tx_bytes: 0,
        };
        let b = Sample {
            at: t + Duration::from_secs(1),
            cpu_ns: 1_500_000_000,
            ..a
        };
        assert!((cpu_percent(&a, &b) - 150.0).abs() < 1e-9);
        assert!(cpu_percent(&a, &a).abs() < f64::EPSILON);
    }

    #[test]
    fn parses_net_dev_without_loopback() {
        let text = "Inter-|   Receive                                                |  Transmit\n \
face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    \
lo:     100       1    0    0    0     0          0         0      100       1    0    0    0     0       0          0\n  \
eth0:    2048      10    0    0    0     0          0         0     1024       8    0    0    0     0       0          0\n";
        assert_eq!(net_dev_totals(text), (2048, 1024));
    }

    #[test]
    fn reads_stat_files() {
        let stat = "usage_usec 1234\nuser_usec 1000\n";
        assert_eq!(stat_value(stat, "usage_usec"), Some(1234));
        assert_eq!(stat_value(stat, "missing"), None);
    }
}
