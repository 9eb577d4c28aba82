//! The standalone assignment source: a directory of manifest files in, a full
//! `AssignmentSet` out, exactly the type a control plane sends.
//!
//! Rules (DESIGN.md "Standalone manifests"):
//! * Only regular `*.toml` files whose name does not start with `.` count.
//! * A file that does not read or parse is reported, and the last version of
//!   it that was accepted stays in the set, so its running instances are left
//!   alone. A deleted file's instances leave the set.
//! * Two files may not define the same (project, app), request the same host
//!   port, or produce the same assignment id. What is already in the set
//!   wins: the files of the last set keep their claims (an edit that takes
//!   another file's claim is refused, the file's accepted version stays), and
//!   files new to the set are considered after them, the older first (by
//!   modification time, then by name). The loser is the error, naming both
//!   files, and nothing of it runs; once the winner goes, it is considered
//!   again. Which files made the set, and the text of each as accepted, is
//!   kept in `accepted.json` (written durably), so a restart keeps the same
//!   winners (and their running containers), and a file torn or emptied by a
//!   power cut falls back to the version accepted before it, as it would
//!   while the agent runs.
//! * Each (project, environment) in use gets a subnet from the
//!   [`SubnetBook`]; pairs no longer used are freed.
//! * `version` grows by one whenever the set differs from the previous load
//!   (it starts over with the process; the executor keys on ids and hashes).
//!
//! `load` never fails: every problem is a [`FileError`] next to the best set
//! that can be built. Logging them is the caller's job (they repeat on every
//! load while the file stays broken).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};

use zattera_netns::Subnet;

use std::time::SystemTime;

use super::assign::{Instance, env_instances};
use super::claims::Claims;
use super::keypath::render_key;
use super::manifest::{self, AppManifest};
use super::subnets::{BookError, EnvKey, SubnetBook, write_atomically};
use crate::proto::cluster::{AssignmentRuntime, AssignmentSet};
use crate::proto::v1::Assignment;

/// One problem found while loading: a manifest, the directory or the subnet
/// book. `message` is complete and names the file (and the key, for
/// manifests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileError {
    pub file: PathBuf,
    pub message: String,
}

/// The result of one [`StandaloneSource::load`].
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    pub set: AssignmentSet,
    pub errors: Vec<FileError>,
}

/// A manifest directory, with the last accepted parse of each file.
#[derive(Debug)]
pub struct StandaloneSource {
    dir: PathBuf,
    book: SubnetBook,
    /// Problems found opening the book, reported by the next load.
    book_errors: Vec<BookError>,
    /// File name → the last version of it that made it into the set, with
    /// its text (what `accepted.json` keeps).
    accepted: BTreeMap<OsString, Accepted>,
    /// The names of the files in the last set, kept across restarts.
    standing: Standing,
    /// Subnets that new environments must not take (see [`Self::reserve_subnets`]).
    reserved: BTreeSet<Subnet>,
    version: u64,
    last: Option<(Vec<Assignment>, BTreeMap<String, AssignmentRuntime>)>,
}

impl StandaloneSource {
    /// A source for `dir`, keeping its state in `state_dir` (the agent
    /// passes `<data_dir>/standalone`): the subnet book `subnets.json` and
    /// `accepted.json`. Nothing is read from `dir` until [`load`](Self::load).
    pub fn new(dir: impl Into<PathBuf>, state_dir: impl AsRef<Path>) -> Self {
        let state_dir = state_dir.as_ref();
        let (book, book_errors) = SubnetBook::open(state_dir.join("subnets.json"));
        let dir = dir.into();
        let standing = Standing::open(state_dir.join("accepted.json"));
        let accepted = standing.parse_texts(&dir);
        Self {
            dir,
            book,
            book_errors,
            accepted,
            standing,
            reserved: BTreeSet::new(),
            version: 0,
            last: None,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Subnets in use on this host by someone else (for example the bridges
    /// of another agent running side by side): environments that need a new
    /// subnet skip them from the next load on. Environments that already have
    /// a subnet keep it.
    pub fn reserve_subnets(&mut self, subnets: impl IntoIterator<Item = Subnet>) {
        self.reserved = subnets.into_iter().collect();
    }

    /// Reads the directory and returns the full desired set, with every
    /// problem found.
    pub fn load(&mut self) -> Loaded {
        let mut errors: Vec<FileError> = self
            .book_errors
            .drain(..)
            .map(|e| book_error(self.book.path(), &e))
            .collect();
        if let Some(message) = self.standing.opened.take() {
            errors.push(FileError {
                file: self.standing.path.clone(),
                message: format!("{}: {message}", self.standing.path.display()),
            });
        }

        let files = match list_manifests(&self.dir) {
            Ok(files) => Some(files),
            Err(e) => {
                errors.push(FileError {
                    file: self.dir.clone(),
                    message: format!(
                        "{}: cannot read the manifest directory: {e}; keeping what was loaded",
                        self.dir.display()
                    ),
                });
                None
            }
        };

        let mut chosen: Vec<(PathBuf, AppManifest)> = Vec::new();
        match files {
            // The directory is unreadable: keep what was accepted (it all
            // fitted together).
            None => {
                for (name, a) in &self.accepted {
                    chosen.push((self.dir.join(name), a.manifest.clone()));
                }
            }
            Some(files) => {
                let candidates = self.in_order(files);
                // The files of the last set hold their claims while their
                // edits and the newcomers are checked.
                let mut claims = Claims::default();
                for c in &candidates {
                    if let Some(prev) = self.accepted.get(&c.name) {
                        claims.register(&prev.manifest, &c.path);
                    }
                }
                let mut accepted = BTreeMap::new();
                // Edits refused for a claim another file held, with their
                // errors: one may fit once a later file let the claim go.
                let mut refused = Vec::new();
                for c in candidates {
                    let pick = match c.fresh {
                        Ok(a) => match claims.check(&a.manifest, &c.path) {
                            Ok(()) => Some(a),
                            Err(message) => {
                                refused.push((c.name.clone(), c.path.clone(), a));
                                errors.push(FileError {
                                    file: c.path.clone(),
                                    message,
                                });
                                self.accepted.get(&c.name).cloned()
                            }
                        },
                        Err(message) => {
                            errors.push(FileError {
                                file: c.path.clone(),
                                message,
                            });
                            self.accepted.get(&c.name).cloned()
                        }
                    };
                    match pick {
                        Some(a) => {
                            claims.register(&a.manifest, &c.path);
                            accepted.insert(c.name, (c.path, a));
                        }
                        None => claims.release(&c.path),
                    }
                }
                // A file has one error per load: the refusal of its edit.
                let mut resolved = BTreeSet::new();
                while let Some(i) = refused
                    .iter()
                    .position(|(_, path, a)| claims.check(&a.manifest, path).is_ok())
                {
                    let (name, path, a) = refused.remove(i);
                    claims.register(&a.manifest, &path);
                    resolved.insert(path.clone());
                    accepted.insert(name, (path, a));
                }
                errors.retain(|e| !resolved.contains(&e.file));
                chosen = accepted
                    .values()
                    .map(|(path, a)| (path.clone(), a.manifest.clone()))
                    .collect();
                self.accepted = accepted.into_iter().map(|(n, (_, a))| (n, a)).collect();
                if let Err(e) = self.standing.save(&self.accepted) {
                    errors.push(FileError {
                        file: self.standing.path.clone(),
                        message: format!("{}: cannot save: {e}", self.standing.path.display()),
                    });
                }
            }
        }
        let set = self.build(&chosen, &mut errors);
        Loaded { set, errors }
    }

    /// Reads every file, and orders them for the claims: the files of the
    /// last set first (by name), then the newcomers, the older first (by
    /// modification time, then by name).
    fn in_order(&self, files: Vec<(OsString, PathBuf)>) -> Vec<Candidate> {
        let mut candidates: Vec<Candidate> = files
            .into_iter()
            .map(|(name, path)| {
                let fresh = fs::read_to_string(&path)
                    .map_err(|e| format!("{}: cannot read: {e}", path.display()))
                    .and_then(|text| Accepted::parse(text, &path));
                let modified = fs::metadata(&path).and_then(|m| m.modified()).ok();
                let standing = self.standing.names.contains(&name);
                Candidate {
                    name,
                    path,
                    rank: (!standing, if standing { None } else { modified }),
                    fresh,
                }
            })
            .collect();
        candidates.sort_by(|a, b| a.rank.cmp(&b.rank).then_with(|| a.name.cmp(&b.name)));
        candidates
    }

    /// Subnets, then instances, then the set with its version.
    fn build(
        &mut self,
        chosen: &[(PathBuf, AppManifest)],
        errors: &mut Vec<FileError>,
    ) -> AssignmentSet {
        let wanted: BTreeSet<EnvKey> = chosen
            .iter()
            .flat_map(|(_, m)| {
                m.envs
                    .iter()
                    .filter(|(_, spec)| spec.replicas > 0)
                    .map(|(env, _)| EnvKey {
                        project: m.project.clone(),
                        env: env.clone(),
                    })
            })
            .collect();
        for (key, e) in self.book.sync(&wanted, &self.reserved) {
            for (path, m) in chosen.iter().filter(|(_, m)| m.project == key.project) {
                if m.envs.contains_key(&key.env) {
                    errors.push(FileError {
                        file: path.clone(),
                        message: format!(
                            "{}: env.{}: no subnet for {key}: {e}",
                            path.display(),
                            render_key(key.env.as_str())
                        ),
                    });
                }
            }
        }
        if let Err(e) = self.book.save() {
            errors.push(book_error(self.book.path(), &e));
        }

        let mut instances: Vec<Instance> = Vec::new();
        for (_, m) in chosen {
            for (env, spec) in &m.envs {
                let key = EnvKey {
                    project: m.project.clone(),
                    env: env.clone(),
                };
                if let Some(subnet) = self.book.get(&key) {
                    instances.extend(env_instances(m, env, spec, subnet));
                }
            }
        }
        instances.sort_by(|a, b| a.id().cmp(b.id()));
        let runtime: BTreeMap<String, AssignmentRuntime> = instances
            .iter()
            .map(|i| (i.id().to_owned(), i.runtime.clone()))
            .collect();
        let assignments: Vec<Assignment> = instances.into_iter().map(|i| i.assignment).collect();

        let changed = self
            .last
            .as_ref()
            .is_none_or(|(a, r)| *a != assignments || *r != runtime);
        if changed {
            self.version += 1;
            self.last = Some((assignments.clone(), runtime.clone()));
        }
        AssignmentSet {
            version: self.version,
            assignments,
            runtime,
        }
    }
}

fn book_error(path: &Path, e: &BookError) -> FileError {
    FileError {
        file: path.to_owned(),
        message: e.to_string(),
    }
}

/// The manifest files of `dir`, by name.
fn list_manifests(dir: &Path) -> std::io::Result<Vec<(OsString, PathBuf)>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let path = entry.path();
        // `*.toml` exactly (case matters, as in a shell glob); hidden files never.
        let counts = name.to_str().is_some_and(|n| !n.starts_with('.'))
            && path.extension().is_some_and(|e| e == "toml");
        if counts && !path.is_dir() {
            files.push((name, path));
        }
    }
    files.sort();
    Ok(files)
}

/// One manifest file, read, with its place in the order of claims.
struct Candidate {
    name: OsString,
    path: PathBuf,
    /// Standing files first (`false`), then newcomers by modification time.
    rank: (bool, Option<SystemTime>),
    fresh: Result<Accepted, String>,
}

/// A manifest as parsed, with the text it was parsed from.
#[derive(Debug, Clone)]
struct Accepted {
    manifest: AppManifest,
    text: String,
}

impl Accepted {
    fn parse(text: String, path: &Path) -> Result<Self, String> {
        let manifest = manifest::parse(&text, path).map_err(|e| e.to_string())?;
        Ok(Self { manifest, text })
    }
}

/// The files that made the last set, on disk so that a restarted agent
/// gives the same files the same claims and the same fallbacks.
#[derive(Debug)]
struct Standing {
    path: PathBuf,
    names: BTreeSet<OsString>,
    /// The accepted text of each file, as last saved.
    texts: BTreeMap<String, String>,
    /// Why the file could not be read at start (reported once).
    opened: Option<String>,
}

#[derive(serde::Serialize, serde::Deserialize, PartialEq)]
struct StandingOnDisk {
    files: Vec<String>,
    /// File name → the text accepted. Absent in the files of older agents,
    /// which kept only the names.
    #[serde(default)]
    texts: BTreeMap<String, String>,
}

impl Standing {
    fn open(path: PathBuf) -> Self {
        let read = match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice::<StandingOnDisk>(&bytes)
                .map_err(|e| format!("not the list of accepted manifests ({e}); starting afresh")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(StandingOnDisk {
                files: Vec::new(),
                texts: BTreeMap::new(),
            }),
            Err(e) => Err(format!("cannot read ({e}); starting afresh")),
        };
        let (on_disk, opened) = match read {
            Ok(d) => (d, None),
            Err(e) => (
                StandingOnDisk {
                    files: Vec::new(),
                    texts: BTreeMap::new(),
                },
                Some(e),
            ),
        };
        Self {
            path,
            names: on_disk.files.into_iter().map(OsString::from).collect(),
            texts: on_disk.texts,
            opened,
        }
    }

    /// The saved texts, parsed again: the fallback of each standing file
    /// until its file on disk parses. A saved text that no longer parses
    /// (a newer agent's manifest) is left out; its file is read as usual.
    fn parse_texts(&self, dir: &Path) -> BTreeMap<OsString, Accepted> {
        self.texts
            .iter()
            .filter(|(name, _)| self.names.contains(std::ffi::OsStr::new(name)))
            .filter_map(|(name, text)| {
                let a = Accepted::parse(text.clone(), &dir.join(name)).ok()?;
                Some((OsString::from(name), a))
            })
            .collect()
    }

    /// Records the last set's files and their texts (written only on a
    /// change, durably: it is the fallback after a power cut).
    fn save(&mut self, accepted: &BTreeMap<OsString, Accepted>) -> std::io::Result<()> {
        let on_disk = StandingOnDisk {
            files: accepted
                .keys()
                .filter_map(|n| n.to_str().map(str::to_owned))
                .collect(),
            texts: accepted
                .iter()
                .filter_map(|(n, a)| Some((n.to_str()?.to_owned(), a.text.clone())))
                .collect(),
        };
        let names: BTreeSet<OsString> = accepted.keys().cloned().collect();
        if names == self.names && on_disk.texts == self.texts && self.path.exists() {
            return Ok(());
        }
        let mut bytes = serde_json::to_vec_pretty(&on_disk).map_err(std::io::Error::other)?;
        bytes.push(b'\n');
        write_atomically(&self.path, &bytes)?;
        self.names = names;
        self.texts = on_disk.texts;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    struct Fixture {
        _tmp: tempfile::TempDir,
        dir: PathBuf,
        book: PathBuf,
    }

    impl Fixture {
        fn new() -> Self {
            let tmp = tempfile::tempdir().unwrap();
            let dir = tmp.path().join("manifests");
            fs::create_dir(&dir).unwrap();
            let book = tmp.path().join("data/standalone/subnets.json");
            Self {
                _tmp: tmp,
                dir,
                book,
            }
        }

        fn write(&self, name: &str, text: &str) {
            fs::write(self.dir.join(name), text).unwrap();
        }

        fn source(&self) -> StandaloneSource {
            StandaloneSource::new(&self.dir, self.book.parent().unwrap())
        }
    }

    fn app(project: &str, name: &str, env: &str, replicas: u32, extra: &str) -> String {
        format!(
            "[app]\nname = \"{name}\"\nproject = \"{project}\"\n[build]\ntype = \"image\"\n\
             image = \"busybox\"\n[env.{env}]\nreplicas = {replicas}\n{extra}"
        )
    }

    /// id → config hash.
    fn hashes(set: &AssignmentSet) -> BTreeMap<String, String> {
        set.assignments
            .iter()
            .map(|a| (a.meta.as_ref().unwrap().id.clone(), a.config_hash.clone()))
            .collect()
    }

    fn ids(set: &AssignmentSet) -> Vec<String> {
        hashes(set).into_keys().collect()
    }

    fn clean(loaded: Loaded) -> AssignmentSet {
        assert!(loaded.errors.is_empty(), "{:?}", loaded.errors);
        loaded.set
    }

    #[test]
    fn a_directory_becomes_a_full_set() {
        let f = Fixture::new();
        f.write("web.toml", &app("demo", "web", "production", 2, ""));
        f.write("api.toml", &app("demo", "api", "production", 1, ""));
        f.write("other.toml", &app("other", "db", "production", 1, ""));
        // None of these count.
        f.write(".hidden.toml", "garbage");
        f.write("notes.txt", "garbage");
        f.write("web.toml~", "garbage");
        fs::create_dir(f.dir.join("dir.toml")).unwrap();

        let set = clean(f.source().load());
        assert_eq!(
            ids(&set),
            [
                "demo-api-production-0",
                "demo-web-production-0",
                "demo-web-production-1",
                "other-db-production-0"
            ]
        );
        assert_eq!(set.version, 1);
        assert_eq!(set.runtime.len(), 4);
        let subnet = |id: &str| set.runtime[id].subnet_cidr.clone();
        // One subnet per (project, env), shared by its apps; lowest free first.
        assert_eq!(subnet("demo-api-production-0"), "10.201.0.0/24");
        assert_eq!(subnet("demo-web-production-1"), "10.201.0.0/24");
        assert_eq!(subnet("other-db-production-0"), "10.201.1.0/24");
        // Sorted by id, every assignment has its runtime.
        for a in &set.assignments {
            assert!(set.runtime.contains_key(&a.meta.as_ref().unwrap().id));
        }
    }

    #[test]
    fn editing_one_app_changes_only_its_hashes() {
        let f = Fixture::new();
        f.write("web.toml", &app("demo", "web", "production", 2, ""));
        f.write("api.toml", &app("demo", "api", "production", 1, ""));
        let mut source = f.source();
        let first = clean(source.load());

        let again = clean(source.load());
        assert_eq!(
            again, first,
            "an unchanged directory gives the same set and version"
        );

        f.write(
            "api.toml",
            &app("demo", "api", "production", 1, "command = \"sleep 1\"\n"),
        );
        let second = clean(source.load());
        assert_eq!(second.version, first.version + 1);
        let (before, after) = (hashes(&first), hashes(&second));
        assert_eq!(
            before["demo-web-production-0"],
            after["demo-web-production-0"]
        );
        assert_eq!(
            before["demo-web-production-1"],
            after["demo-web-production-1"]
        );
        assert_ne!(
            before["demo-api-production-0"],
            after["demo-api-production-0"]
        );
    }

    #[test]
    fn a_broken_file_keeps_its_previous_assignments() {
        let f = Fixture::new();
        f.write("web.toml", &app("demo", "web", "production", 2, ""));
        f.write("api.toml", &app("demo", "api", "production", 1, ""));
        let mut source = f.source();
        let good = clean(source.load());

        f.write(
            "web.toml",
            &app("demo", "web", "production", 2, "replicaz = 3\n"),
        );
        let loaded = source.load();
        assert_eq!(loaded.errors.len(), 1, "{:?}", loaded.errors);
        let e = &loaded.errors[0];
        assert_eq!(e.file, f.dir.join("web.toml"));
        assert!(
            e.message
                .contains("web.toml: env.production.replicaz: unknown key"),
            "{}",
            e.message
        );
        assert_eq!(
            loaded.set, good,
            "nothing of the broken file's instances moves"
        );

        // Still broken on the next load: still kept.
        f.write("web.toml", "[app");
        let loaded = source.load();
        assert_eq!(loaded.errors.len(), 1);
        assert!(
            loaded.errors[0].message.contains("line 1, column"),
            "{:?}",
            loaded.errors
        );
        assert_eq!(loaded.set, good);

        // Fixed with a change: the change applies.
        f.write("web.toml", &app("demo", "web", "production", 1, ""));
        let fixed = clean(source.load());
        assert_eq!(
            ids(&fixed),
            ["demo-api-production-0", "demo-web-production-0"]
        );
    }

    #[test]
    fn a_file_broken_from_the_start_contributes_nothing() {
        let f = Fixture::new();
        f.write(
            "web.toml",
            &app("demo", "web", "production", 1, "oops = 1\n"),
        );
        f.write("api.toml", &app("demo", "api", "production", 1, ""));
        let loaded = f.source().load();
        assert_eq!(loaded.errors.len(), 1);
        assert_eq!(ids(&loaded.set), ["demo-api-production-0"]);
    }

    #[test]
    fn a_deleted_file_drops_its_assignments_and_frees_its_subnet() {
        let f = Fixture::new();
        f.write("web.toml", &app("demo", "web", "production", 1, ""));
        f.write("db.toml", &app("demo", "db", "staging", 1, ""));
        let mut source = f.source();
        let before = clean(source.load());
        assert_eq!(
            before.runtime["demo-db-staging-0"].subnet_cidr,
            "10.201.1.0/24"
        );

        fs::remove_file(f.dir.join("db.toml")).unwrap();
        let after = clean(source.load());
        assert_eq!(ids(&after), ["demo-web-production-0"]);
        assert_eq!(after.version, before.version + 1);
        let book = fs::read_to_string(&f.book).unwrap();
        assert!(!book.contains("demo/staging"), "{book}");
        assert!(book.contains("demo/production"), "{book}");

        // A deleted broken file does not linger either.
        f.write("web.toml", "broken");
        assert_eq!(source.load().errors.len(), 1);
        fs::remove_file(f.dir.join("web.toml")).unwrap();
        let empty = clean(source.load());
        assert!(empty.assignments.is_empty() && empty.runtime.is_empty());
    }

    #[test]
    fn the_same_app_twice_is_an_error_of_the_later_file() {
        let f = Fixture::new();
        f.write("a.toml", &app("demo", "web", "production", 1, ""));
        f.write("b.toml", &app("demo", "api", "production", 1, ""));
        let mut source = f.source();
        clean(source.load());

        // b.toml now claims a.toml's app: b's previous version keeps running.
        f.write("b.toml", &app("demo", "web", "staging", 1, ""));
        let loaded = source.load();
        assert_eq!(loaded.errors.len(), 1, "{:?}", loaded.errors);
        let msg = &loaded.errors[0].message;
        assert_eq!(loaded.errors[0].file, f.dir.join("b.toml"));
        assert!(
            msg.contains("b.toml: app.name: app \"web\" of project \"demo\" is already defined in"),
            "{msg}"
        );
        assert!(msg.contains("a.toml"), "{msg}");
        assert_eq!(
            ids(&loaded.set),
            ["demo-api-production-0", "demo-web-production-0"]
        );

        // A newcomer that collides from the start brings nothing.
        f.write("c.toml", &app("demo", "web", "production", 3, ""));
        let loaded = source.load();
        assert_eq!(loaded.errors.len(), 2);
        assert!(
            loaded.errors[1].message.contains("c.toml: app.name"),
            "{:?}",
            loaded.errors
        );
        assert_eq!(
            ids(&loaded.set),
            ["demo-api-production-0", "demo-web-production-0"]
        );
    }

    #[test]
    fn host_ports_and_ids_may_not_collide_across_files() {
        let f = Fixture::new();
        let port = |hp| {
            format!(
                "[[env.production.ports]]\nname = \"http\"\ncontainer_port = 80\nhost_port = {hp}\n"
            )
        };
        f.write("a.toml", &app("demo", "web", "production", 1, &port(8080)));
        f.write("b.toml", &app("demo", "api", "production", 1, &port(8080)));
        let loaded = f.source().load();
        assert_eq!(loaded.errors.len(), 1);
        let msg = &loaded.errors[0].message;
        assert!(
            msg.contains("b.toml: env.production.ports[0].host_port: host port 8080/tcp is already requested by")
                && msg.contains("a.toml (env.production.ports[0].host_port)"),
            "{msg}"
        );
        assert_eq!(ids(&loaded.set), ["demo-web-production-0"]);
        assert_eq!(loaded.set.assignments[0].mesh_port_bindings["http"], 8080);

        let f = Fixture::new();
        f.write("a.toml", &app("a-b", "c", "x", 1, ""));
        f.write("b.toml", &app("a", "b-c", "x", 1, ""));
        let loaded = f.source().load();
        assert_eq!(loaded.errors.len(), 1);
        assert!(
            loaded.errors[0]
                .message
                .contains("b.toml: env.x: assignment id \"a-b-c-x-0\" is also produced by"),
            "{:?}",
            loaded.errors
        );
        assert_eq!(ids(&loaded.set), ["a-b-c-x-0"]);
        assert_eq!(loaded.set.assignments[0].project_id, "a-b");
    }

    #[test]
    fn subnets_and_hashes_survive_a_restart() {
        let f = Fixture::new();
        f.write("a.toml", &app("one", "web", "production", 1, ""));
        f.write("b.toml", &app("two", "web", "production", 1, ""));
        let first = clean(f.source().load());
        // Remove the first project's file: a restarted agent keeps two's subnet.
        fs::remove_file(f.dir.join("a.toml")).unwrap();
        let restarted = clean(f.source().load());
        assert_eq!(
            restarted.runtime["two-web-production-0"].subnet_cidr,
            "10.201.1.0/24"
        );
        assert_eq!(
            hashes(&restarted)["two-web-production-0"],
            hashes(&first)["two-web-production-0"]
        );
    }

    /// 58.7: a power cut tears or empties a manifest the agent had accepted;
    /// the restarted agent keeps the app (its instances, its subnet) from
    /// the text it accepted, and reports the file.
    #[test]
    fn a_file_torn_by_a_power_cut_keeps_its_accepted_version_after_a_restart() {
        let f = Fixture::new();
        f.write("a.toml", &app("one", "web", "production", 2, ""));
        f.write("b.toml", &app("two", "web", "production", 1, ""));
        let first = clean(f.source().load());
        let accepted = fs::read_to_string(f.book.with_file_name("accepted.json")).unwrap();
        assert!(accepted.contains("replicas = 2"), "{accepted}");

        f.write("a.toml", "");
        f.write("b.toml", "[app]\nproject = \"two\"\nna");
        let loaded = f.source().load();
        assert_eq!(loaded.errors.len(), 2, "{:?}", loaded.errors);
        assert_eq!(ids(&loaded.set), ids(&first));
        assert_eq!(hashes(&loaded.set), hashes(&first));
        assert_eq!(
            loaded.set.runtime["one-web-production-1"].subnet_cidr,
            first.runtime["one-web-production-1"].subnet_cidr
        );

        // Once the files are written again, they are what runs.
        f.write("a.toml", &app("one", "web", "production", 1, ""));
        f.write("b.toml", &app("two", "web", "production", 1, ""));
        let mut source = f.source();
        let fixed = clean(source.load());
        assert_eq!(
            ids(&fixed),
            ["one-web-production-0", "two-web-production-0"]
        );
        // And a deleted file is gone for good, its fallback with it.
        fs::remove_file(f.dir.join("a.toml")).unwrap();
        clean(source.load());
        f.write("a.toml", "");
        let loaded = f.source().load();
        assert_eq!(ids(&loaded.set), ["two-web-production-0"]);
    }

    #[test]
    fn a_corrupt_subnet_book_is_reported_and_rebuilt() {
        let f = Fixture::new();
        fs::create_dir_all(f.book.parent().unwrap()).unwrap();
        fs::write(&f.book, "[1, 2").unwrap();
        f.write("a.toml", &app("demo", "web", "production", 1, ""));
        let mut source = f.source();
        let loaded = source.load();
        assert_eq!(loaded.errors.len(), 1);
        assert_eq!(loaded.errors[0].file, f.book);
        assert!(loaded.errors[0].message.contains("corrupt subnet book"));
        assert_eq!(
            loaded.set.runtime["demo-web-production-0"].subnet_cidr,
            "10.201.0.0/24"
        );
        // Reported once; the rebuilt book reads back cleanly.
        clean(source.load());
        let text = fs::read_to_string(&f.book).unwrap();
        assert!(
            text.contains("\"demo/production\": \"10.201.0.0/24\""),
            "{text}"
        );
    }

    #[test]
    fn reserved_subnets_are_not_handed_out() {
        let f = Fixture::new();
        f.write("a.toml", &app("demo", "web", "production", 1, ""));
        let mut source = f.source();
        source.reserve_subnets([Subnet::from_slot(0)]);
        let set = clean(source.load());
        assert_eq!(
            set.runtime["demo-web-production-0"].subnet_cidr,
            "10.201.1.0/24"
        );
    }

    #[test]
    fn an_unreadable_directory_keeps_everything() {
        let f = Fixture::new();
        f.write("a.toml", &app("demo", "web", "production", 1, ""));
        let mut source = f.source();
        let good = clean(source.load());
        fs::remove_dir_all(&f.dir).unwrap();
        let loaded = source.load();
        assert_eq!(loaded.errors.len(), 1);
        assert_eq!(loaded.errors[0].file, f.dir);
        assert!(
            loaded.errors[0]
                .message
                .contains("cannot read the manifest directory")
        );
        assert_eq!(loaded.set, good);
    }

    #[test]
    fn zero_replicas_means_no_instances_and_no_subnet() {
        let f = Fixture::new();
        f.write("a.toml", &app("demo", "web", "production", 0, ""));
        let set = clean(f.source().load());
        assert!(set.assignments.is_empty());
        let text = fs::read_to_string(&f.book).unwrap_or_default();
        assert!(!text.contains("demo/production"), "{text}");
    }

    fn http_port(hp: u16) -> String {
        format!(
            "[[env.production.ports]]\nname = \"http\"\ncontainer_port = 80\nhost_port = {hp}\n"
        )
    }

    /// Sets `name`'s modification time `secs` seconds into the past.
    fn age(f: &Fixture, name: &str, secs: u64) {
        let file = fs::File::options()
            .write(true)
            .open(f.dir.join(name))
            .unwrap();
        let when = SystemTime::now() - std::time::Duration::from_secs(secs);
        file.set_modified(when).unwrap();
    }

    #[test]
    fn a_newcomer_never_takes_a_claim_from_the_set() {
        for conflicting in [
            app("demo", "other", "production", 1, &http_port(18098)),
            app("demo", "web", "production", 1, ""),
        ] {
            let f = Fixture::new();
            f.write(
                "web.toml",
                &app("demo", "web", "production", 2, &http_port(18098)),
            );
            let mut source = f.source();
            let before = clean(source.load());

            // Sorted first, and even older: what runs still wins.
            f.write("bad.toml", &conflicting);
            age(&f, "bad.toml", 3600);
            let loaded = source.load();
            assert_eq!(loaded.errors.len(), 1, "{:?}", loaded.errors);
            let e = &loaded.errors[0];
            assert_eq!(e.file, f.dir.join("bad.toml"));
            assert!(
                e.message.contains("bad.toml") && e.message.contains("web.toml"),
                "both files are named: {}",
                e.message
            );
            assert_eq!(hashes(&loaded.set), hashes(&before));

            // The winner goes: the other file is considered again.
            fs::remove_file(f.dir.join("web.toml")).unwrap();
            let set = clean(source.load());
            assert_eq!(set.assignments.len(), 1);
            assert!(ids(&set)[0].starts_with("demo-"), "{:?}", ids(&set));
            assert_ne!(hashes(&set), hashes(&before));
        }
    }

    #[test]
    fn an_edit_cannot_take_a_claim_of_another_file_in_the_set() {
        let f = Fixture::new();
        f.write(
            "b.toml",
            &app("demo", "web", "production", 1, &http_port(8080)),
        );
        f.write("a.toml", &app("demo", "api", "production", 1, ""));
        let mut source = f.source();
        let before = clean(source.load());
        // a.toml sorts first, but b.toml holds the port.
        f.write(
            "a.toml",
            &app("demo", "api", "production", 1, &http_port(8080)),
        );
        let loaded = source.load();
        assert_eq!(loaded.errors.len(), 1, "{:?}", loaded.errors);
        assert_eq!(loaded.errors[0].file, f.dir.join("a.toml"));
        assert!(
            loaded.errors[0].message.contains("b.toml"),
            "{:?}",
            loaded.errors
        );
        assert_eq!(
            hashes(&loaded.set),
            hashes(&before),
            "a.toml's accepted version stays"
        );
        // b.toml lets the port go: a.toml's edit is taken in the same load.
        f.write(
            "b.toml",
            &app("demo", "web", "production", 1, &http_port(8081)),
        );
        let set = clean(source.load());
        let ports: BTreeMap<String, u32> = set
            .assignments
            .iter()
            .map(|a| (a.app_id.clone(), a.mesh_port_bindings["http"]))
            .collect();
        assert_eq!(
            ports.values().copied().collect::<BTreeSet<_>>(),
            BTreeSet::from([8080, 8081])
        );
    }

    #[test]
    fn between_newcomers_the_older_file_wins_and_a_restart_keeps_the_winner() {
        let f = Fixture::new();
        f.write(
            "a.toml",
            &app("demo", "api", "production", 1, &http_port(9000)),
        );
        f.write(
            "z.toml",
            &app("demo", "web", "production", 1, &http_port(9000)),
        );
        age(&f, "z.toml", 3600);
        let mut source = f.source();
        let loaded = source.load();
        assert_eq!(loaded.errors.len(), 1, "{:?}", loaded.errors);
        assert_eq!(loaded.errors[0].file, f.dir.join("a.toml"));
        assert_eq!(ids(&loaded.set), ["demo-web-production-0"]);

        // A restart after a.toml became the older one keeps z.toml.
        age(&f, "a.toml", 7200);
        drop(source);
        let loaded = f.source().load();
        assert_eq!(loaded.errors.len(), 1, "{:?}", loaded.errors);
        assert_eq!(loaded.errors[0].file, f.dir.join("a.toml"));
        assert_eq!(ids(&loaded.set), ["demo-web-production-0"]);
    }

    #[test]
    fn a_corrupt_list_of_accepted_files_is_reported_once() {
        let f = Fixture::new();
        f.write("a.toml", &app("demo", "web", "production", 1, ""));
        let state = f.book.parent().unwrap();
        fs::create_dir_all(state).unwrap();
        fs::write(state.join("accepted.json"), "{nope").unwrap();
        let mut source = f.source();
        let loaded = source.load();
        assert_eq!(loaded.errors.len(), 1, "{:?}", loaded.errors);
        assert!(
            loaded.errors[0].message.contains("accepted.json"),
            "{:?}",
            loaded.errors
        );
        assert_eq!(ids(&loaded.set), ["demo-web-production-0"]);
        clean(source.load());
        let text = fs::read_to_string(state.join("accepted.json")).unwrap();
        assert!(text.contains("a.toml"), "{text}");
    }
}
