//! WireGuard keys: Curve25519, base64 on the wire and in files (as `wg`
//! prints them), hex on the UAPI socket.

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;

use crate::error::{Error, Result};

/// A peer's public key.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PublicKey(pub [u8; 32]);

/// The node's private key; never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct PrivateKey([u8; 32]);

impl PublicKey {
    pub fn from_base64(text: &str) -> Result<Self> {
        decode(text).map(Self)
    }
    pub fn to_base64(&self) -> String {
        STANDARD.encode(self.0)
    }
    pub(crate) fn from_hex(text: &str) -> Result<Self> {
        from_hex(text).map(Self)
    }
    pub(crate) fn to_hex(self) -> String {
        to_hex(&self.0)
    }
}

impl std::fmt::Display for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_base64())
    }
}

impl std::fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

impl PrivateKey {
    /// A fresh key from the kernel's random source.
    pub fn generate() -> Result<Self> {
        let mut bytes = [0u8; 32];
        getrandom::getrandom(&mut bytes).map_err(|e| Error::Key(format!("no randomness: {e}")))?;
        // Clamped as the curve wants it (and as `wg genkey` writes it).
        bytes[0] &= 0b1111_1000;
        bytes[31] &= 0b0111_1111;
        bytes[31] |= 0b0100_0000;
        Ok(Self(bytes))
    }
    pub fn from_base64(text: &str) -> Result<Self> {
        decode(text.trim()).map(Self)
    }
    pub fn to_base64(&self) -> String {
        STANDARD.encode(self.0)
    }
    pub fn public(&self) -> PublicKey {
        let secret = x25519_dalek::StaticSecret::from(self.0);
        PublicKey(x25519_dalek::PublicKey::from(&secret).to_bytes())
    }
    pub(crate) fn from_hex(text: &str) -> Result<Self> {
        from_hex(text).map(Self)
    }
    pub(crate) fn bytes(&self) -> [u8; 32] {
        self.0
    }
    pub(crate) fn to_hex(&self) -> String {
        to_hex(&self.0)
    }
}

impl std::fmt::Debug for PrivateKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PrivateKey(public {})", self.public())
    }
}

fn decode(text: &str) -> Result<[u8; 32]> {
    let bytes = STANDARD
        .decode(text)
        .map_err(|e| Error::Key(format!("{text:?} is not base64: {e}")))?;
    bytes
        .try_into()
        .map_err(|b: Vec<u8>| Error::Key(format!("a key is 32 bytes, not {}", b.len())))
}

fn to_hex(bytes: &[u8; 32]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn from_hex(text: &str) -> Result<[u8; 32]> {
    let bad = || Error::Key(format!("{text:?} is not a 64-digit hex key"));
    if text.len() != 64 {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2).ok_or_else(bad)?, 16)
            .map_err(|_| bad())?;
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_derive_the_known_public_key() {
        // RFC 7748 §6.1, Alice.
        let private = PrivateKey(
            from_hex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a").unwrap(),
        );
        assert_eq!(
            private.public().to_hex(),
            "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"
        );
        let fresh = PrivateKey::generate().unwrap();
        assert_eq!(PrivateKey::from_base64(&fresh.to_base64()).unwrap(), fresh);
        let public = fresh.public();
        assert_eq!(PublicKey::from_base64(&public.to_base64()).unwrap(), public);
        assert_eq!(PublicKey::from_hex(&public.to_hex()).unwrap(), public);
        assert!(PublicKey::from_base64("c2hvcnQ=").is_err());
        assert!(PublicKey::from_hex("zz").is_err());
        assert!(!format!("{fresh:?}").contains(&fresh.to_base64()));
    }
}
