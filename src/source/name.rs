//! DNS-safe names for projects, apps, environments, ports and volumes.
//!
//! Every name a manifest declares ends up in a DNS name
//! (`<app>.<env>.<project>.internal`), a containerd id (the assignment id
//! `<project>-<app>-<env>-<index>`) or a volume directory, so one rule serves
//! them all: an RFC 1123 label (lowercase letters, digits and `-`, 1 to 63
//! characters, not starting or ending with `-`), and additionally no `--`,
//! because containerd ids allow only single separators between alphanumerics.

use std::fmt;

/// Longest DNS label.
pub const MAX_NAME_LEN: usize = 63;

/// A validated DNS-safe label.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(transparent)]
pub struct Name(String);

/// Why a string is not a [`Name`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid name {value:?}: {reason}")]
pub struct NameError {
    pub value: String,
    pub reason: &'static str,
}

impl Name {
    pub fn new(value: &str) -> Result<Self, NameError> {
        let fail = |reason| {
            Err(NameError {
                value: value.to_owned(),
                reason,
            })
        };
        if value.is_empty() {
            return fail("must not be empty");
        }
        if value.len() > MAX_NAME_LEN {
            return fail("longer than 63 characters");
        }
        if !value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return fail("only lowercase letters, digits and '-' are allowed");
        }
        if value.starts_with('-') || value.ends_with('-') {
            return fail("must not start or end with '-'");
        }
        if value.contains("--") {
            return fail("must not contain \"--\" (it would not be a valid containerd id)");
        }
        Ok(Self(value.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for Name {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Name {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::str::FromStr for Name {
    type Err = NameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl<'de> serde::Deserialize<'de> for Name {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::new(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn accepts_dns_labels() {
        for ok in ["a", "web", "web-2", "0", "9lives", &"a".repeat(63)] {
            assert_eq!(Name::new(ok).unwrap().as_str(), ok);
        }
    }

    #[test]
    fn rejects_everything_else_with_a_reason() {
        let cases = [
            ("", "empty"),
            (&"a".repeat(64) as &str, "63"),
            ("Web", "lowercase"),
            ("web_app", "lowercase"),
            ("web.app", "lowercase"),
            ("wéb", "lowercase"),
            ("-web", "start or end"),
            ("web-", "start or end"),
            ("we--b", "--"),
        ];
        for (bad, why) in cases {
            let err = Name::new(bad).unwrap_err();
            assert!(err.to_string().contains(why), "{bad:?}: {err}");
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
    }
}
