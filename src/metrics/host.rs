//! Host samples for join capacity and heartbeats (runtime.md S-4): CPU from
//! `/proc/stat`, memory from `/proc/meminfo`, disk from the data dir's
//! filesystem. A probe that fails contributes 0; it never fails the caller.

use std::path::Path;

/// Aggregate CPU use between calls; owned by the one task that samples.
#[derive(Debug, Default)]
pub struct CpuMeter {
    last: Option<(u64, u64)>,
}

impl CpuMeter {
    /// Percent of all CPUs busy (0-100) since the previous call; the first
    /// call measures since boot. Never blocks.
    pub fn sample(&mut self) -> f64 {
        let Some((busy, total)) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| parse_stat(&s))
        else {
            return 0.0;
        };
        let (busy0, total0) = self.last.replace((busy, total)).unwrap_or((0, 0));
        let (db, dt) = (busy.saturating_sub(busy0), total.saturating_sub(total0));
        if dt == 0 {
            return 0.0;
        }
        #[allow(clippy::cast_precision_loss)]
        let pct = db as f64 * 100.0 / dt as f64;
        pct.clamp(0.0, 100.0)
    }
}

/// (busy, total) jiffies from the aggregate `cpu` line.
fn parse_stat(text: &str) -> Option<(u64, u64)> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal (guest is inside user).
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    Some((total.saturating_sub(idle), total))
}

/// (used, total) memory in bytes; used = total - free - buffers - cache.
pub fn memory() -> (u64, u64) {
    std::fs::read_to_string("/proc/meminfo").map_or((0, 0), |s| parse_meminfo(&s))
}

fn parse_meminfo(text: &str) -> (u64, u64) {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    let total = field("MemTotal");
    let free = field("MemFree") + field("Buffers") + field("Cached") + field("SReclaimable");
    (total.saturating_sub(free), total)
}

/// (used, total) bytes of the filesystem holding `path`.
pub fn disk(path: &Path) -> (u64, u64) {
    let Ok(st) = nix::sys::statvfs::statvfs(path) else {
        return (0, 0);
    };
    let frag = st.fragment_size();
    let total = st.blocks().saturating_mul(frag);
    let free = st.blocks_free().saturating_mul(frag);
    (total.saturating_sub(free), total)
}

/// Cumulative (received, sent) bytes over every host interface, loopback
/// included (M-2), from `/proc/net/dev`.
pub fn net_totals() -> (u64, u64) {
    std::fs::read_to_string("/proc/net/dev").map_or((0, 0), |s| parse_net_dev(&s))
}

fn parse_net_dev(text: &str) -> (u64, u64) {
    text.lines()
        .skip(2)
        .filter_map(|l| l.split_once(':'))
        .map(|(_, counters)| {
            let f: Vec<u64> = counters
                .split_whitespace()
                .map(|v| v.parse().unwrap_or(0))
                .collect();
            (
                f.first().copied().unwrap_or(0),
                f.get(8).copied().unwrap_or(0),
            )
        })
        .fold((0, 0), |(r, t), (a, b)| (r + a, t + b))
}

/// Logical CPUs x 1000, as join capacity wants it.
pub fn cpu_millis() -> u32 {
    let n = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    u32::try_from(n * 1000).unwrap_or(u32::MAX)
}

/// Bytes to MiB, saturating.
pub fn mib(bytes: u64) -> u32 {
    u32::try_from(bytes / (1024 * 1024)).unwrap_or(u32::MAX)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_stat_and_meminfo() {
        let stat = "cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n";
        assert_eq!(parse_stat(stat), Some((150, 1000)));
        let mem = "MemTotal:       1000 kB\nMemFree:         100 kB\nBuffers:          50 kB\nCached:          200 kB\nSReclaimable:     50 kB\n";
        assert_eq!(parse_meminfo(mem), (600 * 1024, 1000 * 1024));
        let dev = "Inter-|   Receive\n face |bytes\n    lo: 100 1 0 0 0 0 0 0 100 1 0 0 0 0 0 0\n  eth0: 5 1 0 0 0 0 0 0 7 1 0 0 0 0 0 0\n";
        assert_eq!(parse_net_dev(dev), (105, 107));
    }

    #[test]
    fn live_samples_are_in_range() {
        let mut cpu = CpuMeter::default();
        let first = cpu.sample();
        assert!((0.0..=100.0).contains(&first));
        let (used, total) = memory();
        assert!(total > 0 && used <= total);
        let (used, total) = disk(Path::new("/"));
        assert!(total > 0 && used <= total);
    }
}
