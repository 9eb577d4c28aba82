//! The agent's modules stay in floors (issue 46): no two top modules of
//! `src/` import each other, and the floors below the services import none
//! of them; inside a module (and in the workspace's other crates), no two
//! sibling files import each other either. Read from the source: every
//! `crate::<module>` (or `super::<file>`) path outside unit tests is an
//! edge. `cargo test --test layers -- --nocapture` prints the modules'.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Modules everyone may use, which use none of the agent's services.
const FLOORS: &[(&str, &[&str])] = &[
    ("status", &["proto"]),
    ("labels", &["proto", "runtime"]),
    ("programs", &[]),
    ("link", &["proto", "runtime"]),
];

/// The names that follow `prefix` in `code`.
fn names_after<'a>(code: &'a str, prefix: &'a str) -> impl Iterator<Item = String> + 'a {
    code.match_indices(prefix).map(move |(at, _)| {
        code[at + prefix.len()..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    })
}

/// Code outside unit tests (which may reach anywhere) and comments.
fn code_of(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let code = text.split("#[cfg(test)]\nmod ").next().unwrap_or_default();
    code.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Pairs of sibling files in `dir` (not `mod.rs`, `lib.rs`, `main.rs`: a
/// parent and its children share types both ways) that name each other
/// through one of `prefixes`.
fn mutual_files(dir: &Path, prefixes: &[String]) -> Vec<(String, String)> {
    let files: BTreeMap<String, String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .map(|p| {
            (
                p.file_stem().unwrap().to_string_lossy().into_owned(),
                code_of(&p),
            )
        })
        .filter(|(stem, _)| !["mod", "lib", "main"].contains(&stem.as_str()))
        .collect();
    let edges: BTreeMap<&String, BTreeSet<String>> = files
        .iter()
        .map(|(me, code)| {
            let to = prefixes
                .iter()
                .flat_map(|p| names_after(code, p).collect::<Vec<_>>())
                .filter(|n| n != me && files.contains_key(n))
                .collect();
            (me, to)
        })
        .collect();
    edges
        .iter()
        .flat_map(|(a, to)| to.iter().map(move |b| ((*a).clone(), b.clone())))
        .filter(|(a, b)| a < b && edges.get(b).is_some_and(|back| back.contains(a)))
        .collect()
}

fn edges() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(&src).unwrap();
            let mut parts = rel.components();
            let first = parts.next().unwrap().as_os_str().to_string_lossy();
            let me = if parts.next().is_some() {
                first.into_owned()
            } else {
                rel.file_stem().unwrap().to_string_lossy().into_owned()
            };
            for name in names_after(&code_of(&path), "crate::") {
                if !name.is_empty() && name != me {
                    edges.entry(me.clone()).or_default().insert(name);
                }
            }
        }
    }
    edges
}

#[test]
fn no_two_modules_import_each_other_and_floors_stay_low() {
    let edges = edges();
    for (from, to) in &edges {
        println!(
            "{from} -> {}",
            to.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    let mutual: Vec<_> = edges
        .iter()
        .flat_map(|(a, to)| to.iter().map(move |b| (a, b)))
        .filter(|(a, b)| a < b && edges.get(*b).is_some_and(|back| back.contains(*a)))
        .collect();
    assert!(
        mutual.is_empty(),
        "modules that import each other: {mutual:?}"
    );
    for (floor, allowed) in FLOORS {
        let above: Vec<_> = edges
            .get(*floor)
            .into_iter()
            .flatten()
            .filter(|m| !allowed.contains(&m.as_str()))
            .collect();
        assert!(
            above.is_empty(),
            "{floor} imports {above:?}, above its floor"
        );
    }
}

#[test]
fn no_two_files_of_a_module_import_each_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut circles = Vec::new();
    for krate in ["dns", "netns", "mesh"] {
        let dir = root.join(krate).join("src");
        for (a, b) in mutual_files(&dir, &["crate::".to_owned()]) {
            circles.push(format!("{krate}: {a} <-> {b}"));
        }
    }
    for entry in std::fs::read_dir(root.join("src")).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        let module = dir.file_name().unwrap().to_string_lossy().into_owned();
        let prefixes = ["super::".to_owned(), format!("crate::{module}::")];
        for (a, b) in mutual_files(&dir, &prefixes) {
            circles.push(format!("src/{module}: {a} <-> {b}"));
        }
    }
    assert!(
        circles.is_empty(),
        "files that import each other: {circles:#?}"
    );
}
