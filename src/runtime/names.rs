//! Validated containerd identifiers: namespaces and object ids.
//!
//! containerd accepts `[A-Za-z0-9]+` components joined by single `.`, `_` or
//! `-`, at most 76 characters, for namespaces, container ids and lease ids.
//! Checking that here turns a confusing gRPC `InvalidArgument` into an error
//! that names the value.

use std::fmt;
use std::str::FromStr;

const MAX_IDENTIFIER_LEN: usize = 76;

/// Checks a containerd identifier; returns what is wrong with it.
pub fn validate_identifier(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("must not be empty".into());
    }
    if s.len() > MAX_IDENTIFIER_LEN {
        return Err(format!(
            "{s:?} is {} characters long, at most {MAX_IDENTIFIER_LEN} allowed",
            s.len()
        ));
    }
    let mut prev_sep = true; // the first character must be alphanumeric
    for c in s.chars() {
        let sep = matches!(c, '.' | '_' | '-');
        if !(c.is_ascii_alphanumeric() || sep) || (sep && prev_sep) {
            return Err(format!(
                "{s:?} must be letters and digits joined by single '.', '_' or '-'"
            ));
        }
        prev_sep = sep;
    }
    if prev_sep {
        return Err(format!("{s:?} must not end with a separator"));
    }
    Ok(())
}

/// A containerd namespace, sent as the `containerd-namespace` header on every call.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Namespace(String);

impl Namespace {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for Namespace {
    type Err = InvalidName;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        validate_identifier(s).map_err(|reason| InvalidName {
            kind: "containerd namespace",
            reason,
        })?;
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid {kind}: {reason}")]
pub struct InvalidName {
    pub kind: &'static str,
    pub reason: String,
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn accepts_containerd_style_names() {
        for ok in ["zattera", "zt-test_1.a", "A1", &"a".repeat(76)] {
            assert!(validate_identifier(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn rejects_bad_names() {
        for bad in ["", "-a", "a-", "a--b", "a b", "a/b", &"a".repeat(77), "é"] {
            assert!(validate_identifier(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn namespace_error_names_the_value() {
        let e = "x y".parse::<Namespace>().unwrap_err().to_string();
        assert!(e.contains("namespace") && e.contains("x y"), "{e}");
    }
}
