//! How every test suite of the workspace skips, with one rule for CI.
//!
//! A test that cannot run here says why through this crate, never with a
//! bare `eprintln!` and `return`: libtest captures a passing test's output
//! and nextest hides it, so such a skip is invisible. Two kinds:
//!
//! - [`require`]: a prerequisite CI provides (root, the rig, a tool the rig
//!   installs). Missing under CI it is a failure, elsewhere a skip.
//! - [`skip`]: a test CI is known not to run (no buildkitd in any registry
//!   CI reaches). A skip everywhere, CI included.
//!
//! Both append a line to the file named by `ZATTERA_TEST_SKIPS` (when set):
//! `<test binary>\t<test>\t<reason>`. `scripts/test.sh` sets it, prints the
//! list at the end of the run and fails when a test the README cites as
//! evidence skipped without the README saying CI does not run it
//! (`scripts/skips.py`).

use std::io::Write;

/// The environment variable naming the skip record.
pub const SKIPS_ENV: &str = "ZATTERA_TEST_SKIPS";

/// Whether this is CI: `CI` set to anything but empty, `false` or `0`
/// (GitHub and GitLab set `true`, others `1`).
#[must_use]
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| ci_value(&v))
}

fn ci_value(v: &str) -> bool {
    !v.is_empty() && !v.eq_ignore_ascii_case("false") && v != "0"
}

/// Whether root runs this test.
#[must_use]
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0")
    })
}

/// `true` when nothing is `missing`. Otherwise a failure under CI (CI must
/// never pass by testing nothing) and a recorded skip elsewhere.
#[must_use]
pub fn require(missing: &[String]) -> bool {
    if missing.is_empty() {
        return true;
    }
    let reason = format!("needs {}", missing.join(", "));
    assert!(
        !in_ci(),
        "{}: {reason} (CI: failing instead of skipping)",
        test_name()
    );
    record(&reason);
    false
}

/// A prerequisite CI provides is missing: a failure under CI, a recorded
/// skip elsewhere. The caller returns right after.
pub fn missing(what: &str) {
    let _ = require(&[what.to_owned()]);
}

/// `true` when root runs this test (see [`require`]).
#[must_use]
pub fn require_root() -> bool {
    require(&if is_root() {
        Vec::new()
    } else {
        vec!["root".to_owned()]
    })
}

/// Records a skip CI accepts; the caller returns right after. Use it only
/// for what CI cannot provide, and say so in the README's list of what CI
/// does not run.
pub fn skip(reason: &str) {
    record(reason);
}

/// The running test's name: libtest and nextest name its thread after it.
#[must_use]
pub fn test_name() -> String {
    std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .unwrap_or("(unnamed thread)")
        .to_owned()
}

fn record(reason: &str) {
    let test = test_name();
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .map(|n| strip_hash(&n).to_owned())
        .unwrap_or_default();
    eprintln!("SKIPPED {test}: {reason}");
    let Some(path) = std::env::var_os(SKIPS_ENV) else {
        return;
    };
    let line = format!("{binary}\t{test}\t{}\n", reason.replace(['\t', '\n'], " "));
    // One write of one short line to an O_APPEND file: lines of tests
    // running side by side do not interleave.
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        let path = std::path::Path::new(&path).display();
        panic!("{test}: cannot record the skip in {path}: {e}");
    }
}

/// `build-1a2b3c4d5e6f7a8b` -> `build`: cargo's hash suffix of a test binary.
fn strip_hash(name: &str) -> &str {
    match name.rsplit_once('-') {
        Some((stem, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            stem
        }
        _ => name,
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn ci_is_any_value_but_empty_false_or_zero() {
        for v in ["true", "1", "yes", "TRUE"] {
            assert!(ci_value(v), "{v}");
        }
        for v in ["", "false", "False", "0"] {
            assert!(!ci_value(v), "{v}");
        }
    }

    #[test]
    fn the_hash_suffix_of_a_test_binary_goes() {
        assert_eq!(strip_hash("build-1a2b3c4d5e6f7a8b"), "build");
        assert_eq!(
            strip_hash("zattera_agent-0123456789abcdef"),
            "zattera_agent"
        );
        assert_eq!(strip_hash("vm-control"), "vm-control");
    }

    #[test]
    fn the_test_thread_is_named_after_the_test() {
        assert_eq!(
            test_name(),
            "tests::the_test_thread_is_named_after_the_test"
        );
    }
}
