//! Which images garbage collection may remove, and in what order: pure
//! logic over what was listed, so every rule has a unit test.
//!
//! An image is a candidate when the agent made it, no container of the
//! namespace uses it, no pin matches it, and it was not used (or pulled)
//! within `min_age`. Candidates older than `max_age` go whatever the disk
//! says (kubelet's `ImageMaximumGCAge`); the others go oldest use first only
//! while the image filesystem is over its high mark, until it is under the
//! low mark.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use crate::runtime::images::ImageRecord;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcPolicy {
    /// Unused this long, an image goes even without disk pressure; `None`:
    /// only disk pressure removes images.
    pub max_age: Option<Duration>,
    /// Never removed when used or pulled this recently (a pull whose
    /// container is not created yet).
    pub min_age: Duration,
    /// Percent of the image filesystem in use that starts a collection.
    pub high_percent: u8,
    /// ... and where it stops.
    pub low_percent: u8,
    pub pinned: Vec<Pin>,
}

impl Default for GcPolicy {
    fn default() -> Self {
        Self {
            max_age: None,
            min_age: Duration::from_secs(120),
            high_percent: 85,
            low_percent: 80,
            pinned: Vec::new(),
        }
    }
}

/// A pinned image name: exact, or a prefix ending in `*`
/// (`registry.example/base/*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pin(String);

impl Pin {
    pub fn new(pattern: &str) -> Self {
        Self(pattern.trim().to_owned())
    }

    pub fn matches(&self, name: &str) -> bool {
        match self.0.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => self.0 == name,
        }
    }
}

/// Why an image is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Age,
    DiskPressure,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Age => "unused past the maximum age",
            Self::DiskPressure => "disk pressure",
        })
    }
}

/// The candidates of one pass: those past `max_age` (any order) and the
/// rest, oldest last use first, for disk pressure.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Candidates {
    pub expired: Vec<String>,
    pub by_age: Vec<String>,
}

/// `last_used`: when a container of the namespace last used each image
/// (the collector's own record); an image never seen in use counts from
/// its record's last update.
pub fn candidates(
    images: &[ImageRecord],
    in_use: &BTreeSet<String>,
    last_used: &BTreeMap<String, SystemTime>,
    policy: &GcPolicy,
    now: SystemTime,
) -> Candidates {
    let mut unused: Vec<(SystemTime, &str)> = images
        .iter()
        .filter(|i| i.owned && !in_use.contains(&i.name))
        .filter(|i| !policy.pinned.iter().any(|p| p.matches(&i.name)))
        .map(|i| {
            let used = last_used.get(&i.name).copied().unwrap_or(i.updated);
            (used.max(i.updated), i.name.as_str())
        })
        .filter(|(used, _)| idle(now, *used) >= policy.min_age)
        .collect();
    unused.sort();
    let mut out = Candidates::default();
    for (used, name) in unused {
        if policy.max_age.is_some_and(|max| idle(now, used) > max) {
            out.expired.push(name.to_owned());
        } else {
            out.by_age.push(name.to_owned());
        }
    }
    out
}

fn idle(now: SystemTime, since: SystemTime) -> Duration {
    now.duration_since(since).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    fn image(name: &str, owned: bool, age: Duration, now: SystemTime) -> ImageRecord {
        ImageRecord {
            name: name.into(),
            owned,
            updated: now - age,
        }
    }

    #[test]
    fn only_owned_unused_unpinned_idle_images_are_candidates_oldest_first() {
        let now = SystemTime::now();
        let images = [
            image("new", true, 10 * MIN, now),
            image("old", true, 60 * MIN, now),
            image("used", true, 90 * MIN, now),
            image("foreign", false, 90 * MIN, now),
            image("base/a", true, 90 * MIN, now),
            image("just-pulled", true, MIN, now),
            image("once-used", true, 90 * MIN, now),
        ];
        let in_use = BTreeSet::from(["used".to_owned()]);
        // Used 5 minutes ago: newer than "new" by its use, not its pull.
        let last_used = BTreeMap::from([("once-used".to_owned(), now - 5 * MIN)]);
        let policy = GcPolicy {
            pinned: vec![Pin::new("base/*")],
            ..GcPolicy::default()
        };
        let c = candidates(&images, &in_use, &last_used, &policy, now);
        assert!(c.expired.is_empty());
        assert_eq!(c.by_age, ["old", "new", "once-used"]);
    }

    #[test]
    fn past_the_maximum_age_an_image_expires() {
        let now = SystemTime::now();
        let images = [
            image("ancient", true, 200 * MIN, now),
            image("recent", true, 10 * MIN, now),
        ];
        let policy = GcPolicy {
            max_age: Some(100 * MIN),
            ..GcPolicy::default()
        };
        let c = candidates(&images, &BTreeSet::new(), &BTreeMap::new(), &policy, now);
        assert_eq!(c.expired, ["ancient"]);
        assert_eq!(c.by_age, ["recent"]);
    }

    #[test]
    fn pins_are_exact_or_prefixes() {
        assert!(Pin::new("docker.io/library/busybox:1").matches("docker.io/library/busybox:1"));
        assert!(!Pin::new("docker.io/library/busybox:1").matches("docker.io/library/busybox:12"));
        assert!(Pin::new("registry.example/base/*").matches("registry.example/base/x:1"));
        assert!(!Pin::new("registry.example/base/*").matches("registry.example/other:1"));
    }
}
