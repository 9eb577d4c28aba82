//! The agent's modules stay in floors (issue 46): no two top modules of
//! `src/` import each other, and the floors below the services import none
//! of them. Read from the source: every `crate::<module>` path outside unit
//! tests is an edge. `cargo test --test layers -- --nocapture` prints them.

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
            let text = std::fs::read_to_string(&path).unwrap();
            // Unit tests may reach anywhere.
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            for (at, _) in code.match_indices("crate::") {
                let name: String = code[at + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
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
