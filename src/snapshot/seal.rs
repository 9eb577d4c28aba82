//! Object sealing (SNAP-6): `nonce(12) ‖ AES-256-GCM(zstd(plaintext)) ‖
//! tag(16)`, keyed directly with the cluster data key, a fresh random nonce
//! per object, no associated data. AES-GCM is ring's (already ours through
//! rustls); zstd is the system's libzstd.

use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};

/// Bytes a sealed object carries beyond its ciphertext.
pub const OVERHEAD: usize = NONCE_LEN + 16;
/// What writers use ("about level 3"); readers take any valid frames.
pub const ZSTD_LEVEL: i32 = 3;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SealError {
    #[error("data key must be 32 bytes, got {0}")]
    KeyLength(usize),
    #[error("no randomness for a nonce")]
    Random,
    #[error("sealed object too short ({0} bytes)")]
    Short(usize),
    #[error("authentication failed (wrong data key, or the object was altered)")]
    Open,
    #[error("zstd: {0}")]
    Zstd(String),
    #[error("decompressed to more than the {0} bytes expected")]
    TooLong(usize),
}

/// The cluster data key. Debug never shows it.
pub struct DataKey {
    key: LessSafeKey,
    rng: SystemRandom,
}

impl std::fmt::Debug for DataKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DataKey(..)")
    }
}

impl DataKey {
    pub fn new(bytes: &[u8]) -> Result<Self, SealError> {
        if bytes.len() != 32 {
            return Err(SealError::KeyLength(bytes.len()));
        }
        let unbound =
            UnboundKey::new(&AES_256_GCM, bytes).map_err(|_| SealError::KeyLength(bytes.len()))?;
        Ok(Self {
            key: LessSafeKey::new(unbound),
            rng: SystemRandom::new(),
        })
    }

    /// Encrypts `plaintext` under a fresh random nonce.
    pub fn seal(&self, plaintext: &[u8]) -> Result<Vec<u8>, SealError> {
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).map_err(|_| SealError::Random)?;
        let mut out = Vec::with_capacity(plaintext.len() + OVERHEAD);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(plaintext);
        let mut body = out.split_off(NONCE_LEN);
        self.key
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut body)
            .map_err(|_| SealError::Random)?;
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Authenticates and decrypts a sealed object.
    pub fn open(&self, sealed: &[u8]) -> Result<Vec<u8>, SealError> {
        if sealed.len() < OVERHEAD {
            return Err(SealError::Short(sealed.len()));
        }
        let (nonce, body) = sealed.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealError::Open)?;
        let mut body = body.to_vec();
        let n = self
            .key
            .open_in_place(nonce, Aad::empty(), &mut body)
            .map_err(|_| SealError::Open)?
            .len();
        body.truncate(n);
        Ok(body)
    }

    /// `seal(zstd(plaintext))`: a chunk or manifest object.
    pub fn seal_object(&self, plaintext: &[u8]) -> Result<Vec<u8>, SealError> {
        let packed = zstd::bulk::compress(plaintext, ZSTD_LEVEL)
            .map_err(|e| SealError::Zstd(e.to_string()))?;
        self.seal(&packed)
    }

    /// Opens and decompresses an object of at most `limit` plaintext bytes.
    pub fn open_object(&self, sealed: &[u8], limit: usize) -> Result<Vec<u8>, SealError> {
        decompress(&self.open(sealed)?, limit)
    }
}

/// Any valid zstd frames (several, or without a content size), refusing
/// to grow past `limit`.
pub fn decompress(packed: &[u8], limit: usize) -> Result<Vec<u8>, SealError> {
    use std::io::Read;
    let decoder =
        zstd::stream::read::Decoder::new(packed).map_err(|e| SealError::Zstd(e.to_string()))?;
    let mut out = Vec::new();
    decoder
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| SealError::Zstd(e.to_string()))?;
    if out.len() > limit {
        return Err(SealError::TooLong(limit));
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    fn key(b: u8) -> DataKey {
        DataKey::new(&[b; 32]).unwrap()
    }

    #[test]
    fn seal_and_open_round_trip() {
        let k = key(1);
        let sealed = k.seal(b"hello chunk").unwrap();
        assert_eq!(sealed.len(), 11 + OVERHEAD);
        assert_eq!(k.open(&sealed).unwrap(), b"hello chunk");
        let text = vec![b'z'; 100_000];
        let obj = k.seal_object(&text).unwrap();
        assert!(obj.len() < 1000, "compressed first");
        assert_eq!(k.open_object(&obj, text.len()).unwrap(), text);
        assert_eq!(
            k.open_object(&obj, 99_999).unwrap_err(),
            SealError::TooLong(99_999)
        );
    }

    #[test]
    fn sealed_bytes_hide_the_plaintext_and_never_repeat() {
        let k = key(2);
        let plain = b"a secret line that must not show up in the object".repeat(4);
        let a = k.seal(&plain).unwrap();
        let b = k.seal(&plain).unwrap();
        assert_ne!(a, b, "fresh nonce each time");
        assert_ne!(a[..12], b[..12]);
        assert!(!a.windows(16).any(|w| plain.windows(16).any(|p| p == w)));
    }

    #[test]
    fn wrong_keys_and_altered_objects_fail() {
        let sealed = key(3).seal(b"data").unwrap();
        assert_eq!(key(4).open(&sealed).unwrap_err(), SealError::Open);
        let mut bent = sealed.clone();
        bent[14] ^= 1;
        assert_eq!(key(3).open(&bent).unwrap_err(), SealError::Open);
        assert_eq!(
            key(3).open(&sealed[..20]).unwrap_err(),
            SealError::Short(20)
        );
        assert_eq!(
            DataKey::new(&[0; 16]).unwrap_err().to_string(),
            "data key must be 32 bytes, got 16"
        );
    }

    #[test]
    fn readers_take_any_valid_frames() {
        // Two frames, the second without a content size (a streaming writer).
        let mut packed = zstd::bulk::compress(b"first ", 19).unwrap();
        let mut enc = zstd::stream::write::Encoder::new(Vec::new(), 1).unwrap();
        std::io::Write::write_all(&mut enc, b"second").unwrap();
        packed.extend(enc.finish().unwrap());
        assert_eq!(decompress(&packed, 100).unwrap(), b"first second");
    }
}
