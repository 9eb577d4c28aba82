//! Whether the kernel's OOM killer acted in a container, from its cgroup:
//! `memory.events` on cgroup v2, `memory.oom_control` on v1 (both count
//! `oom_kill`), with the memory limit that was hit. Read while the stopped
//! task still exists (its cgroup goes with the task's deletion), so the
//! answer does not depend on the order of containerd's OOM and exit events.

use std::path::Path;

/// What the cgroup says about OOM kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OomRecord {
    pub kills: u64,
    /// The memory limit in bytes; `None` when unlimited or unknown.
    pub limit_bytes: Option<u64>,
}

impl OomRecord {
    /// "out of memory (limit 16 MiB)", the message of a FAILED report.
    pub fn message(&self) -> String {
        match self.limit_bytes {
            Some(b) => format!("out of memory (limit {} MiB)", b / 1_048_576),
            None => "out of memory".to_owned(),
        }
    }
}

/// The record of the cgroup at `cgroups_path` (as in the OCI spec), under
/// the cgroup filesystem at `root` (normally `/sys/fs/cgroup`).
pub fn read(root: &Path, cgroups_path: &Path) -> Option<OomRecord> {
    let rel = cgroups_path.strip_prefix("/").unwrap_or(cgroups_path);
    let v2 = root.join(rel);
    if let Ok(events) = std::fs::read_to_string(v2.join("memory.events")) {
        let limit = std::fs::read_to_string(v2.join("memory.max")).ok();
        return Some(OomRecord {
            kills: counter(&events, "oom_kill")?,
            limit_bytes: limit.as_deref().and_then(parse_limit),
        });
    }
    let v1 = root.join("memory").join(rel);
    let control = std::fs::read_to_string(v1.join("memory.oom_control")).ok()?;
    let limit = std::fs::read_to_string(v1.join("memory.limit_in_bytes")).ok();
    Some(OomRecord {
        kills: counter(&control, "oom_kill")?,
        limit_bytes: limit.as_deref().and_then(parse_limit),
    })
}

fn counter(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// `max` (v2) and v1's "no limit" (a huge page-aligned number) are none.
fn parse_limit(text: &str) -> Option<u64> {
    let v: u64 = text.trim().parse().ok()?;
    (v < 1 << 62).then_some(v)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn reads_v1_and_v2_counters_and_limits() {
        let dir = tempfile::tempdir().unwrap();
        let v2 = dir.path().join("zattera/ns/c1");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(
            v2.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
        )
        .unwrap();
        std::fs::write(v2.join("memory.max"), "16777216\n").unwrap();
        let r = read(dir.path(), Path::new("/zattera/ns/c1")).unwrap();
        assert_eq!(
            r,
            OomRecord {
                kills: 1,
                limit_bytes: Some(16 << 20)
            }
        );
        assert_eq!(r.message(), "out of memory (limit 16 MiB)");

        let v1 = dir.path().join("memory/zattera/ns/c2");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(
            v1.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
        )
        .unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        let r = read(dir.path(), Path::new("/zattera/ns/c2")).unwrap();
        assert_eq!(
            r,
            OomRecord {
                kills: 0,
                limit_bytes: None
            }
        );
        assert_eq!(r.message(), "out of memory");

        assert_eq!(read(dir.path(), Path::new("/zattera/ns/none")), None);
    }
}
