//! Programs the node runs, found the way a shell finds them: a floor below
//! the build backends' choice and the doctor's checks, which both ask.

use std::path::PathBuf;

/// The first `name` on PATH.
pub(crate) fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}
