//! The standalone assignment source: a directory of manifest files in, a full
//! `AssignmentSet` out, exactly the type a control plane sends.
//!
//! Rules (DESIGN.md "Standalone manifests"):
//! * Only regular `*.toml` files whose name does not start with `.` count;
//!   they are read in file-name order.
//! * A file that does not read or parse is reported, and the last version of
//!   it that was accepted stays in the set, so its running instances are left
//!   alone. A deleted file's instances leave the set.
//! * Two files may not define the same (project, app), request the same host
//!   port, or produce the same assignment id: the later file (by name) is the
//!   error, naming both files, and keeps its last accepted version if that one
//!   does not collide.
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

use super::assign::{Instance, assignment_id, env_instances};
use super::keypath::render_key;
use super::manifest::{self, AppManifest};
use super::subnets::{BookError, EnvKey, SubnetBook};
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
    /// File name → the last version of it that made it into the set.
    accepted: BTreeMap<OsString, AppManifest>,
    /// Subnets that new environments must not take (see [`Self::reserve_subnets`]).
    reserved: BTreeSet<Subnet>,
    version: u64,
    last: Option<(Vec<Assignment>, BTreeMap<String, AssignmentRuntime>)>,
}

impl StandaloneSource {
    /// A source for `dir`, allocating subnets in the book at `subnet_book`
    /// (the agent passes `<data_dir>/standalone/subnets.json`). Nothing is
    /// read from `dir` until [`load`](Self::load).
    pub fn new(dir: impl Into<PathBuf>, subnet_book: impl Into<PathBuf>) -> Self {
        let (book, book_errors) = SubnetBook::open(subnet_book);
        Self {
            dir: dir.into(),
            book,
            book_errors,
            accepted: BTreeMap::new(),
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

        let mut claims = Claims::default();
        let mut chosen: Vec<(PathBuf, AppManifest)> = Vec::new();
        match files {
            // The directory is unreadable: keep every file's accepted version.
            None => {
                for (name, m) in &self.accepted {
                    let path = self.dir.join(name);
                    if claims.check(m, &path).is_ok() {
                        claims.register(m, &path);
                        chosen.push((path, m.clone()));
                    }
                }
            }
            Some(files) => {
                let mut accepted = BTreeMap::new();
                for (name, path) in files {
                    let fresh = fs::read_to_string(&path)
                        .map_err(|e| format!("{}: cannot read: {e}", path.display()))
                        .and_then(|text| manifest::parse(&text, &path).map_err(|e| e.to_string()));
                    let previous = self.accepted.get(&name);
                    let mut fresh_error = None;
                    let mut pick = None;
                    match fresh {
                        Ok(m) => match claims.check(&m, &path) {
                            Ok(()) => pick = Some(m),
                            Err(conflict) => fresh_error = Some(conflict),
                        },
                        Err(message) => fresh_error = Some(message),
                    }
                    if let Some(message) = fresh_error {
                        errors.push(FileError {
                            file: path.clone(),
                            message,
                        });
                        if let Some(prev) = previous {
                            match claims.check(prev, &path) {
                                Ok(()) => pick = Some(prev.clone()),
                                Err(conflict) => errors.push(FileError {
                                    file: path.clone(),
                                    message: format!(
                                        "{conflict} (in its last accepted version, so nothing \
                                         from this file runs)"
                                    ),
                                }),
                            }
                        }
                    }
                    if let Some(m) = pick {
                        claims.register(&m, &path);
                        accepted.insert(name, m.clone());
                        chosen.push((path, m));
                    } else if let Some(prev) = previous {
                        // Still the last accepted version, should the conflict go away.
                        accepted.insert(name, prev.clone());
                    }
                }
                self.accepted = accepted;
            }
        }

        let set = self.build(&chosen, &mut errors);
        Loaded { set, errors }
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

/// What the files accepted so far have claimed: apps, assignment ids and
/// fixed host ports, each with the file that claimed it.
#[derive(Default)]
struct Claims {
    apps: BTreeMap<(String, String), PathBuf>,
    ids: BTreeMap<String, PathBuf>,
    host_ports: BTreeMap<(&'static str, u16), (PathBuf, String)>,
}

impl Claims {
    /// Whether `m` from `file` fits with the files accepted so far; if not,
    /// the message names both files.
    fn check(&self, m: &AppManifest, file: &Path) -> Result<(), String> {
        let here = file.display();
        let app = (m.project.to_string(), m.app.to_string());
        if let Some(other) = self.apps.get(&app) {
            return Err(format!(
                "{here}: app.name: app {:?} of project {:?} is already defined in {}",
                app.1,
                app.0,
                other.display()
            ));
        }
        for (env, spec) in &m.envs {
            let at = format!("env.{}", render_key(env.as_str()));
            for index in 0..spec.replicas {
                let id = assignment_id(&m.project, &m.app, env, index);
                if let Some(other) = self.ids.get(&id) {
                    return Err(format!(
                        "{here}: {at}: assignment id {id:?} is also produced by {} \
                         (project, app and environment names joined by '-' collide); rename one",
                        other.display()
                    ));
                }
            }
            if spec.replicas == 0 {
                continue;
            }
            for (i, p) in spec.ports.iter().enumerate() {
                let Some(h) = p.host_port else { continue };
                if let Some((other, key)) = self.host_ports.get(&(p.protocol.transport(), h)) {
                    return Err(format!(
                        "{here}: {at}.ports[{i}].host_port: host port {h}/{} is already requested by {} ({key})",
                        p.protocol.transport(),
                        other.display()
                    ));
                }
            }
        }
        Ok(())
    }

    fn register(&mut self, m: &AppManifest, file: &Path) {
        self.apps
            .insert((m.project.to_string(), m.app.to_string()), file.to_owned());
        for (env, spec) in &m.envs {
            let at = format!("env.{}", render_key(env.as_str()));
            for index in 0..spec.replicas {
                self.ids.insert(
                    assignment_id(&m.project, &m.app, env, index),
                    file.to_owned(),
                );
            }
            if spec.replicas == 0 {
                continue;
            }
            for (i, p) in spec.ports.iter().enumerate() {
                if let Some(h) = p.host_port {
                    self.host_ports.insert(
                        (p.protocol.transport(), h),
                        (file.to_owned(), format!("{at}.ports[{i}].host_port")),
                    );
                }
            }
        }
    }
}

#[cfg(test)]
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
            StandaloneSource::new(&self.dir, &self.book)
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
}
