//! How full the filesystem under containerd's content store is: what image
//! GC measures and what a pull must fit into.

use std::path::Path;

/// How full a filesystem is, as `df` counts it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    pub used_bytes: u64,
    pub available_bytes: u64,
}

impl Usage {
    pub fn of(path: &Path) -> std::io::Result<Self> {
        let st = nix::sys::statvfs::statvfs(path).map_err(std::io::Error::from)?;
        let frag = st.fragment_size();
        let used = (st.blocks() - st.blocks_free()).saturating_mul(frag);
        Ok(Self {
            used_bytes: used,
            available_bytes: st.blocks_available().saturating_mul(frag),
        })
    }

    // Far below 2^52 bytes, and a percentage needs no more precision.
    #[allow(clippy::cast_precision_loss)]
    pub fn percent(self) -> f64 {
        let total = self.used_bytes + self.available_bytes;
        if total == 0 {
            return 0.0;
        }
        self.used_bytes as f64 * 100.0 / total as f64
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;

    #[test]
    fn usage_counts_like_df() {
        let u = Usage {
            used_bytes: 30,
            available_bytes: 70,
        };
        assert!((u.percent() - 30.0).abs() < 1e-9);
        assert!(Usage::of(Path::new("/")).unwrap().percent() > 0.0);
    }
}
