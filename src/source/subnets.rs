//! Local subnet allocation for standalone mode: which `10.201.X.0/24` each
//! (project, environment) gets, kept in a small JSON file (DESIGN.md
//! decision 5: "in standalone from the lowest free slot").
//!
//! Without a control plane nobody else remembers which subnet an environment
//! had, and a subnet that moved on restart would change every config hash and
//! replace every container. So the book is persisted (the agent keeps it at
//! `<data_dir>/standalone/subnets.json`), written atomically (temporary file,
//! fsync, rename, fsync of the directory). A new pair takes the lowest free
//! slot (`zattera_netns::next_free_subnet`); a pair no longer used is freed.
//! A file that cannot be read or is corrupt is reported and rebuilt; its valid
//! entries are kept.
//!
//! Format: `{"subnets": {"<project>/<env>": "10.201.X.0/24", ...}}`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use zattera_netns::{Subnet, SubnetError, next_free_subnet};

use super::name::Name;

/// The scope a subnet belongs to: one (project, environment).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EnvKey {
    pub project: Name,
    pub env: Name,
}

impl fmt::Display for EnvKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.project, self.env)
    }
}

impl std::str::FromStr for EnvKey {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (project, env) = s
            .split_once('/')
            .ok_or_else(|| format!("key {s:?} is not <project>/<env>"))?;
        Ok(Self {
            project: Name::new(project).map_err(|e| e.to_string())?,
            env: Name::new(env).map_err(|e| e.to_string())?,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BookError {
    #[error("{}: cannot read the subnet book: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{}: corrupt subnet book ({reason}); rebuilding it", path.display())]
    Corrupt { path: PathBuf, reason: String },
    #[error("{}: cannot write the subnet book: {source}", path.display())]
    Write { path: PathBuf, source: io::Error },
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct OnDisk {
    subnets: BTreeMap<String, String>,
}

/// The persisted map (project, env) → subnet.
#[derive(Debug)]
pub struct SubnetBook {
    path: PathBuf,
    entries: BTreeMap<EnvKey, Subnet>,
    /// In memory differs from the file.
    dirty: bool,
}

impl SubnetBook {
    /// Reads the book at `path`. A missing file is an empty book; an
    /// unreadable or corrupt one is returned empty (or with its valid
    /// entries) together with what was wrong, and is rewritten on the next
    /// [`save`](Self::save).
    pub fn open(path: impl Into<PathBuf>) -> (Self, Vec<BookError>) {
        let path = path.into();
        let mut book = Self {
            path,
            entries: BTreeMap::new(),
            dirty: false,
        };
        let text = match fs::read_to_string(&book.path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return (book, Vec::new()),
            Err(source) => {
                book.dirty = true;
                let path = book.path.clone();
                return (book, vec![BookError::Read { path, source }]);
            }
        };
        let errors = book.load(&text);
        (book, errors)
    }

    fn load(&mut self, text: &str) -> Vec<BookError> {
        let corrupt = |reason: String| BookError::Corrupt {
            path: self.path.clone(),
            reason,
        };
        let on_disk: OnDisk = match serde_json::from_str(text) {
            Ok(d) => d,
            Err(e) => {
                self.dirty = true;
                return vec![corrupt(e.to_string())];
            }
        };
        let mut errors = Vec::new();
        let mut taken: BTreeMap<Subnet, EnvKey> = BTreeMap::new();
        for (key, cidr) in on_disk.subnets {
            let entry = key
                .parse::<EnvKey>()
                .and_then(|k| Ok((k, cidr.parse::<Subnet>().map_err(|e| e.to_string())?)));
            match entry {
                Ok((k, subnet)) => {
                    if let Some(owner) = taken.get(&subnet) {
                        errors.push(corrupt(format!(
                            "{subnet} is given to both {owner} and {k}; dropping {k}"
                        )));
                    } else {
                        taken.insert(subnet, k.clone());
                        self.entries.insert(k, subnet);
                    }
                }
                Err(reason) => errors.push(corrupt(format!("entry {key:?}: {reason}"))),
            }
        }
        if !errors.is_empty() {
            self.dirty = true;
        }
        errors
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn get(&self, key: &EnvKey) -> Option<Subnet> {
        self.entries.get(key).copied()
    }

    pub fn entries(&self) -> &BTreeMap<EnvKey, Subnet> {
        &self.entries
    }

    /// Makes the book hold exactly `wanted`: frees the pairs not in it, then
    /// gives each new pair (in order) the lowest slot that is neither in the
    /// book nor in `reserved` (subnets used on this host by someone else, for
    /// example another agent running side by side). Pairs already in the book
    /// keep their subnet. Returns the pairs that got no subnet because the
    /// pool is exhausted.
    pub fn sync(
        &mut self,
        wanted: &BTreeSet<EnvKey>,
        reserved: &BTreeSet<Subnet>,
    ) -> Vec<(EnvKey, SubnetError)> {
        let before = self.entries.len();
        self.entries.retain(|k, _| wanted.contains(k));
        if self.entries.len() != before {
            self.dirty = true;
        }
        let mut failed = Vec::new();
        for key in wanted {
            if self.entries.contains_key(key) {
                continue;
            }
            let used: Vec<String> = self
                .entries
                .values()
                .chain(reserved)
                .map(ToString::to_string)
                .collect();
            match next_free_subnet(used.iter().map(String::as_str)) {
                Ok(subnet) => {
                    self.entries.insert(key.clone(), subnet);
                    self.dirty = true;
                }
                Err(e) => failed.push((key.clone(), e)),
            }
        }
        failed
    }

    /// Writes the book if it changed since it was read or last written.
    /// Returns whether it wrote.
    pub fn save(&mut self) -> Result<bool, BookError> {
        if !self.dirty {
            return Ok(false);
        }
        let on_disk = OnDisk {
            subnets: self
                .entries
                .iter()
                .map(|(k, s)| (k.to_string(), s.to_string()))
                .collect(),
        };
        let mut bytes = serde_json::to_vec_pretty(&on_disk).map_err(|e| BookError::Write {
            path: self.path.clone(),
            source: io::Error::other(e),
        })?;
        bytes.push(b'\n');
        write_atomically(&self.path, &bytes).map_err(|source| BookError::Write {
            path: self.path.clone(),
            source,
        })?;
        self.dirty = false;
        Ok(true)
    }
}

/// Temporary file in the same directory, fsync, rename over `path`, fsync
/// the directory: after a crash the file is either the old or the new one.
pub(super) fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    crate::durable::write(path, bytes, 0o600)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn key(project: &str, env: &str) -> EnvKey {
        EnvKey {
            project: Name::new(project).unwrap(),
            env: Name::new(env).unwrap(),
        }
    }

    fn slots(book: &SubnetBook) -> Vec<(String, u8)> {
        book.entries()
            .iter()
            .map(|(k, s)| (k.to_string(), s.slot()))
            .collect()
    }

    #[test]
    fn allocates_lowest_free_frees_unused_and_persists() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("standalone/subnets.json");
        let (mut book, errors) = SubnetBook::open(&path);
        assert!(errors.is_empty());
        assert!(!book.save().unwrap(), "nothing to write yet");
        assert!(!path.exists());

        let wanted = BTreeSet::from([
            key("demo", "production"),
            key("demo", "staging"),
            key("a", "x"),
        ]);
        assert!(book.sync(&wanted, &BTreeSet::new()).is_empty());
        assert_eq!(
            slots(&book),
            [
                ("a/x".into(), 0),
                ("demo/production".into(), 1),
                ("demo/staging".into(), 2)
            ]
        );
        assert!(book.save().unwrap());
        assert!(!book.save().unwrap(), "unchanged: no rewrite");

        // Freeing a/x leaves a hole that the next new pair takes; the others stay.
        let wanted = BTreeSet::from([
            key("demo", "production"),
            key("demo", "staging"),
            key("z", "new"),
        ]);
        assert!(book.sync(&wanted, &BTreeSet::new()).is_empty());
        assert_eq!(
            slots(&book),
            [
                ("demo/production".into(), 1),
                ("demo/staging".into(), 2),
                ("z/new".into(), 0)
            ]
        );
        assert!(book.save().unwrap());

        // A restart reads the same book back.
        let (again, errors) = SubnetBook::open(&path);
        assert!(errors.is_empty());
        assert_eq!(slots(&again), slots(&book));
        assert_eq!(
            again.get(&key("demo", "staging")).unwrap().to_string(),
            "10.201.2.0/24"
        );
        let text = fs::read_to_string(&path).unwrap();
        assert!(
            text.contains("\"demo/staging\": \"10.201.2.0/24\""),
            "{text}"
        );
        assert!(!dir.path().join("standalone/subnets.json.tmp").exists());
    }

    #[test]
    fn reserved_subnets_are_skipped_for_new_pairs_only() {
        let dir = tempfile::tempdir().unwrap();
        let (mut book, _) = SubnetBook::open(dir.path().join("subnets.json"));
        let none = BTreeSet::new();
        assert!(
            book.sync(&BTreeSet::from([key("a", "x")]), &none)
                .is_empty()
        );
        let reserved = BTreeSet::from([Subnet::from_slot(0), Subnet::from_slot(1)]);
        let wanted = BTreeSet::from([key("a", "x"), key("b", "y")]);
        assert!(book.sync(&wanted, &reserved).is_empty());
        assert_eq!(slots(&book), [("a/x".into(), 0), ("b/y".into(), 2)]);
    }

    #[test]
    fn corrupt_file_is_reported_and_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("subnets.json");
        fs::write(&path, "{ not json").unwrap();
        let (mut book, errors) = SubnetBook::open(&path);
        assert_eq!(errors.len(), 1);
        let msg = errors[0].to_string();
        assert!(msg.contains("subnets.json: corrupt subnet book"), "{msg}");
        assert!(book.entries().is_empty());
        assert!(
            book.sync(&BTreeSet::from([key("demo", "prod")]), &BTreeSet::new())
                .is_empty()
        );
        assert!(book.save().unwrap());
        let (book, errors) = SubnetBook::open(&path);
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(slots(&book), [("demo/prod".into(), 0)]);
    }

    #[test]
    fn bad_entries_are_dropped_and_good_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("subnets.json");
        fs::write(
            &path,
            r#"{"subnets": {"demo/prod": "10.201.5.0/24", "demo/dup": "10.201.5.0/24",
                "nokey": "10.201.6.0/24", "demo/far": "192.168.0.0/24", "Demo/x": "10.201.7.0/24"}}"#,
        )
        .unwrap();
        let (mut book, errors) = SubnetBook::open(&path);
        assert_eq!(errors.len(), 4, "{errors:?}");
        assert_eq!(slots(&book), [("demo/dup".into(), 5)]);
        // Rewritten even though nothing new was allocated.
        assert!(book.save().unwrap());
        let (_, errors) = SubnetBook::open(&path);
        assert!(errors.is_empty());
    }

    #[test]
    fn exhausted_pool_is_reported_per_pair() {
        let dir = tempfile::tempdir().unwrap();
        let (mut book, _) = SubnetBook::open(dir.path().join("subnets.json"));
        let wanted: BTreeSet<EnvKey> = (0..257).map(|i| key("p", &format!("e{i:03}"))).collect();
        let failed = book.sync(&wanted, &BTreeSet::new());
        assert_eq!(book.entries().len(), 256);
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].0, key("p", "e256"));
        assert_eq!(failed[0].1, SubnetError::Exhausted);
    }

    #[test]
    fn unwritable_location_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("file");
        fs::write(&blocker, "").unwrap();
        let (mut book, _) = SubnetBook::open(blocker.join("subnets.json"));
        book.sync(&BTreeSet::from([key("a", "b")]), &BTreeSet::new());
        let err = book.save().unwrap_err();
        assert!(matches!(err, BookError::Write { .. }), "{err}");
        assert!(err.to_string().contains("cannot write the subnet book"));
    }
}
