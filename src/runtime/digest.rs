//! Content digests (`sha256:<64 hex>`), the identity of every blob.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// The sha256 digest of `data`.
    pub fn of(data: &[u8]) -> Self {
        Self::from_hasher(Sha256::new_with_prefix(data))
    }

    pub fn from_hasher(hasher: Sha256) -> Self {
        Self(format!("sha256:{}", hex::encode(hasher.finalize())))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The hex part, as used in blob file names.
    pub fn hex(&self) -> &str {
        &self.0["sha256:".len()..]
    }
}

impl FromStr for Digest {
    type Err = InvalidDigest;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let hex = s
            .strip_prefix("sha256:")
            .ok_or_else(|| InvalidDigest(s.to_owned()))?;
        if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            return Err(InvalidDigest(s.to_owned()));
        }
        Ok(Self(s.to_owned()))
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid digest {0:?}: expected sha256:<64 lowercase hex digits>")]
pub struct InvalidDigest(pub String);

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn digest_of_empty_input() {
        assert_eq!(
            Digest::of(b"").as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn parses_and_rejects() {
        let d = Digest::of(b"x");
        assert_eq!(d.as_str().parse::<Digest>().unwrap(), d);
        assert_eq!(d.hex().len(), 64);
        for bad in [
            "",
            "sha256:",
            "md5:abc",
            "sha256:XYZ",
            &format!("sha256:{}", "A".repeat(64)),
        ] {
            assert!(bad.parse::<Digest>().is_err(), "{bad}");
        }
    }
}
