//! The agent's modules stay on the floors `src/lib.rs` draws (DESIGN's
//! layers): a module imports only from its own floor or the floors below,
//! the modules form no cycle (a topological sort of the whole graph), and
//! inside any folder module (and in the workspace's other crates) no two
//! children import each other.
//!
//! The graph is read from the source with `syn`, not by matching text:
//! every path in code outside unit tests (`use` trees with their groups,
//! `crate::`, `super::` and `self::` paths in types and expressions, and
//! `zattera_agent::` from the binaries) is an edge, resolved against the
//! module the file is. `cargo test --test layers -- --nocapture` prints it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::disallowed_methods)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// The floors of `src/lib.rs`, lowest first. A module may import from its
/// own floor and the floors below; `cli` and `bin` are the binaries.
const FLOORS: &[(&str, &[&str])] = &[
    (
        "shared words",
        &[
            "proto",
            "status",
            "labels",
            "link",
            "beneath",
            "programs",
            "redact",
            "version",
            "durable",
            "layout",
            "addr_scope",
        ],
    ),
    (
        "operations",
        &[
            "runtime",
            "logs",
            "volumes",
            "upgrade",
            "image_build",
            "snapshot",
            "mesh",
            "health",
            "metrics",
            "telemetry",
            "image_gc",
        ],
    ),
    (
        "executor and sources",
        &["executor", "source", "control", "config"],
    ),
    ("doors", &["node_api", "admin", "doctor"]),
    ("wiring", &["agent", "cli", "bin"]),
];

/// Imports that run against the floors today, each with the issue that
/// moves it. Empty is the goal; an entry no longer needed fails the test.
const KNOWN_UPWARD: &[(&str, &str, &str)] = &[];

/// A module's path from the crate root: `["executor", "worker"]`.
type ModPath = Vec<String>;

/// One source file: the module it is, and where it lives.
struct SourceFile {
    path: PathBuf,
    module: ModPath,
}

/// Every file of the agent crate and its binaries. `src/main.rs` and
/// `src/cli/` are the module `cli`, `src/bin/*` the module `bin`.
fn agent_files() -> Vec<SourceFile> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = Vec::new();
    for path in rust_files(&src) {
        let rel = path.strip_prefix(&src).unwrap();
        let mut module: ModPath = rel
            .with_extension("")
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if module.last().is_some_and(|l| l == "mod") {
            module.pop();
        }
        match module.first().map(String::as_str) {
            Some("lib") => module.clear(),
            Some("main") => module = vec!["cli".into()],
            Some("bin") => module.truncate(1),
            _ => {}
        }
        out.push(SourceFile { path, module });
    }
    out
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// Whether an item is compiled only for unit tests.
fn test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Meta>()
                .is_ok_and(|m| m.path().is_ident("test"))
    })
}

/// The absolute module paths a file names, outside unit tests.
struct Imports<'a> {
    /// The module of the code being read (grows inside inline modules).
    here: ModPath,
    /// The crate root's name for the agent library from this file:
    /// `crate` inside the library, `zattera_agent` in the binaries (whose
    /// own `crate::cli::..` lands on the module `cli` too).
    library_root: &'a str,
    found: BTreeSet<ModPath>,
}

impl Imports<'_> {
    fn resolve(&self, segments: &[String]) -> Option<ModPath> {
        let (first, rest) = segments.split_first()?;
        let mut base: ModPath = match first.as_str() {
            "crate" => Vec::new(),
            root if root == self.library_root => Vec::new(),
            "self" => self.here.clone(),
            "super" => {
                let mut up = self.here.clone();
                up.pop()?;
                let mut rest = rest;
                while rest.first().is_some_and(|s| s == "super") {
                    up.pop()?;
                    rest = &rest[1..];
                }
                up.extend(rest.iter().cloned());
                return Some(up);
            }
            _ => return None,
        };
        base.extend(rest.iter().cloned());
        Some(base)
    }

    fn add(&mut self, segments: &[String]) {
        if let Some(p) = self.resolve(segments) {
            self.found.insert(p);
        }
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) => {
                prefix.push(n.ident.to_string());
                self.add(prefix);
                prefix.pop();
            }
            syn::UseTree::Rename(r) => {
                prefix.push(r.ident.to_string());
                self.add(prefix);
                prefix.pop();
            }
            syn::UseTree::Glob(_) => self.add(prefix),
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }
}

impl<'ast> Visit<'ast> for Imports<'_> {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if test_only(&m.attrs) {
            return;
        }
        if m.content.is_some() {
            self.here.push(m.ident.to_string());
            syn::visit::visit_item_mod(self, m);
            self.here.pop();
        }
    }
    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if !test_only(&f.attrs) {
            syn::visit::visit_item_fn(self, f);
        }
    }
    fn visit_item_impl(&mut self, i: &'ast syn::ItemImpl) {
        if !test_only(&i.attrs) {
            syn::visit::visit_item_impl(self, i);
        }
    }
    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        if !test_only(&u.attrs) {
            self.use_tree(&mut Vec::new(), &u.tree);
        }
    }
    fn visit_path(&mut self, p: &'ast syn::Path) {
        let segments: Vec<String> = p.segments.iter().map(|s| s.ident.to_string()).collect();
        self.add(&segments);
        syn::visit::visit_path(self, p);
    }
}

/// What each module (as a path) names, by absolute module path.
fn imports_of(file: &SourceFile) -> BTreeSet<ModPath> {
    let text = std::fs::read_to_string(&file.path).unwrap();
    let ast = syn::parse_file(&text)
        .unwrap_or_else(|e| panic!("{} does not parse: {e}", file.path.display()));
    let binary = file
        .module
        .first()
        .is_some_and(|m| m == "cli" || m == "bin");
    let mut v = Imports {
        here: file.module.clone(),
        library_root: if binary { "zattera_agent" } else { "crate" },
        found: BTreeSet::new(),
    };
    v.visit_file(&ast);
    v.found
}

/// Edges between the children of the module at `parent`: child `a` names
/// something under child `b`. Children are the files and folders right
/// below it (`mod.rs` is the parent itself, which shares types both ways).
fn child_edges(
    files: &[(ModPath, BTreeSet<ModPath>)],
    parent: &[String],
) -> BTreeMap<String, BTreeSet<String>> {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, names) in files {
        let Some(from) = module.strip_prefix(parent).and_then(|rest| rest.first()) else {
            continue;
        };
        for name in names {
            if let Some(to) = name.strip_prefix(parent).and_then(|rest| rest.first())
                && to != from
            {
                edges.entry(from.clone()).or_default().insert(to.clone());
            }
        }
    }
    edges
}

fn mutual(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<(String, String)> {
    edges
        .iter()
        .flat_map(|(a, to)| to.iter().map(move |b| (a.clone(), b.clone())))
        .filter(|(a, b)| a < b && edges.get(b).is_some_and(|back| back.contains(a)))
        .collect()
}

fn floor_of(module: &str) -> Option<usize> {
    FLOORS.iter().position(|(_, ms)| ms.contains(&module))
}

/// The modules of the graph in an order where every import points back,
/// or the modules left in cycles.
fn topological(edges: &BTreeMap<String, BTreeSet<String>>) -> Result<Vec<String>, Vec<String>> {
    let mut nodes: BTreeSet<String> = edges.keys().cloned().collect();
    nodes.extend(edges.values().flatten().cloned());
    let mut order = Vec::new();
    let mut placed = BTreeSet::new();
    loop {
        let ready: Vec<String> = nodes
            .iter()
            .filter(|n| !placed.contains(*n))
            .filter(|n| {
                edges
                    .get(*n)
                    .is_none_or(|to| to.iter().all(|t| placed.contains(t)))
            })
            .cloned()
            .collect();
        if ready.is_empty() {
            break;
        }
        for n in ready {
            placed.insert(n.clone());
            order.push(n);
        }
    }
    let left: Vec<String> = nodes.into_iter().filter(|n| !placed.contains(n)).collect();
    if left.is_empty() {
        Ok(order)
    } else {
        Err(left)
    }
}

fn graph() -> Vec<(ModPath, BTreeSet<ModPath>)> {
    agent_files()
        .iter()
        .map(|f| (f.module.clone(), imports_of(f)))
        .collect()
}

#[test]
fn every_module_imports_only_its_floor_and_below_with_no_cycle() {
    let files = graph();
    let top = child_edges(&files, &[]);
    for (from, to) in &top {
        println!(
            "{from} -> {}",
            to.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    let modules: BTreeSet<&String> = files.iter().filter_map(|(m, _)| m.first()).collect();
    let unplaced: Vec<_> = modules.iter().filter(|m| floor_of(m).is_none()).collect();
    assert!(unplaced.is_empty(), "modules on no floor: {unplaced:?}");

    let mut upward = Vec::new();
    for (from, to) in &top {
        for t in to {
            let (Some(f), Some(g)) = (floor_of(from), floor_of(t)) else {
                continue;
            };
            if g > f && !KNOWN_UPWARD.iter().any(|(a, b, _)| a == from && b == t) {
                upward.push(format!("{from} ({}) -> {t} ({})", FLOORS[f].0, FLOORS[g].0));
            }
        }
    }
    assert!(upward.is_empty(), "imports against the floors: {upward:#?}");
    let stale: Vec<_> = KNOWN_UPWARD
        .iter()
        .filter(|(a, b, _)| !top.get(*a).is_some_and(|to| to.contains(*b)))
        .collect();
    assert!(
        stale.is_empty(),
        "known exceptions that are gone: {stale:?}"
    );
    if let Err(cycle) = topological(&top) {
        panic!("modules in an import cycle: {cycle:?}");
    }
}

#[test]
fn no_two_children_of_a_module_import_each_other() {
    let files = graph();
    let parents: BTreeSet<ModPath> = files
        .iter()
        .flat_map(|(m, _)| (1..m.len()).map(move |n| m[..n].to_vec()))
        .collect();
    let mut circles = Vec::new();
    for parent in &parents {
        for (a, b) in mutual(&child_edges(&files, parent)) {
            circles.push(format!("{}: {a} <-> {b}", parent.join("::")));
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for krate in ["dns", "netns", "mesh"] {
        let src = root.join(krate).join("src");
        let files: Vec<(ModPath, BTreeSet<ModPath>)> = rust_files(&src)
            .into_iter()
            .map(|path| {
                let mut module: ModPath = path
                    .strip_prefix(&src)
                    .unwrap()
                    .with_extension("")
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .collect();
                if module
                    .last()
                    .is_some_and(|l| l == "mod" || l == "lib" || l == "main")
                {
                    module.pop();
                }
                let f = SourceFile { path, module };
                let names = imports_of(&f);
                (f.module, names)
            })
            .collect();
        let parents: BTreeSet<ModPath> = std::iter::once(Vec::new())
            .chain(
                files
                    .iter()
                    .flat_map(|(m, _)| (1..m.len()).map(move |n| m[..n].to_vec())),
            )
            .collect();
        for parent in &parents {
            for (a, b) in mutual(&child_edges(&files, parent)) {
                circles.push(format!("{krate}: {}: {a} <-> {b}", parent.join("::")));
            }
        }
    }
    assert!(
        circles.is_empty(),
        "children that import each other: {circles:#?}"
    );
}

/// The reader sees what text matching missed: grouped imports, `self::`,
/// nested `super::`, and paths in expressions; unit tests are left out.
#[test]
fn the_reader_resolves_groups_super_and_expressions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("worker.rs");
    std::fs::write(
        &path,
        "use super::{board::Board, pass};\nuse crate::{status::State, labels};\n\
         fn f() { let _ = crate::runtime::containers::list; super::super::x::y(); }\n\
         #[cfg(test)]\nmod tests { use crate::agent::Agent; }\n",
    )
    .unwrap();
    let names = imports_of(&SourceFile {
        path,
        module: vec!["executor".into(), "worker".into()],
    });
    let names: Vec<String> = names.iter().map(|n| n.join("::")).collect();
    for want in [
        "executor::board::Board",
        "executor::pass",
        "status::State",
        "labels",
        "runtime::containers::list",
    ] {
        assert!(names.iter().any(|n| n == want), "{want} not in {names:?}");
    }
    assert!(!names.iter().any(|n| n.starts_with("agent")), "{names:?}");
}

/// `src/lib.rs`'s opening comment shows the same floors as [`FLOORS`].
#[test]
fn the_crate_comment_shows_the_floor_table() {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let shown: Vec<(String, Vec<String>)> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//! | "))
        .filter(|l| !l.starts_with("floor") && !l.starts_with("---"))
        .map(|row| {
            let (floor, modules) = row.split_once(" | ").unwrap();
            let modules = modules
                .split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_owned)
                .collect();
            (floor.trim().to_owned(), modules)
        })
        .collect();
    let want: Vec<(String, Vec<String>)> = FLOORS
        .iter()
        .map(|(f, ms)| {
            (
                (*f).to_owned(),
                ms.iter().map(|m| (*m).to_owned()).collect(),
            )
        })
        .collect();
    assert_eq!(shown, want, "src/lib.rs's floor table differs from FLOORS");
}
