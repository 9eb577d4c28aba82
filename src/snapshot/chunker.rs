//! Content-defined chunking (SNAP-4): FastCDC exactly as `jotfs/fastcdc-go`
//! v0.2.0 cuts it (no seed, normalisation level 2), so unchanged data cuts
//! at the same boundaries as the reference's and dedups against its chunks.
//! The well-known Rust crates use other gear tables or masks.

use bytes::{Buf, Bytes, BytesMut};

/// Chunk-size parameters, and the masks they give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    pub min: usize,
    pub avg: usize,
    pub max: usize,
    mask_s: u64,
    mask_l: u64,
}

impl Params {
    /// The reference's defaults around an average: min `min(256 KiB,
    /// A/4 + 1)`, max `max(4 MiB, 4A)`.
    pub fn for_average(avg: usize) -> Self {
        Self::with(
            (256 * 1024).min(avg / 4 + 1),
            avg,
            (4 * 1024 * 1024).max(4 * avg),
        )
    }

    /// Explicit sizes (tests), used as given.
    pub fn with(min: usize, avg: usize, max: usize) -> Self {
        // bits = round(log2(avg)), as Go's math.Round(math.Log2(..)).
        #[allow(
            clippy::cast_precision_loss,
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss
        )]
        let bits = (avg.max(1) as f64).log2().round() as u32;
        Self {
            min,
            avg,
            max,
            mask_s: (1u64 << (bits + 2)) - 1,
            mask_l: (1u64 << bits.saturating_sub(2)) - 1,
        }
    }
}

/// The release's parameters: a 1 MiB average, 256 KiB min, 4 MiB max.
pub fn default_params() -> Params {
    Params::for_average(1024 * 1024)
}

/// The length of the next chunk of `data` (the rest of the stream, or at
/// least `max` bytes of it).
pub fn cut(p: &Params, data: &[u8]) -> usize {
    if data.len() <= p.min {
        return data.len();
    }
    let n = data.len().min(p.max);
    let normal = n.min(p.avg);
    let mut fp: u64 = 0;
    let mut i = p.min;
    // The bytes before `min` are not hashed.
    while i < normal {
        fp = (fp << 1).wrapping_add(GEAR[usize::from(data[i])]);
        if fp & p.mask_s == 0 {
            return i + 1;
        }
        i += 1;
    }
    while i < n {
        fp = (fp << 1).wrapping_add(GEAR[usize::from(data[i])]);
        if fp & p.mask_l == 0 {
            return i + 1;
        }
        i += 1;
    }
    n
}

/// Cuts a byte stream written into it into chunks, each handed to `emit`.
/// It cuts only with at least `max` bytes buffered (or at the end), so the
/// boundaries do not depend on how the stream was written. Holds at most
/// `max` plus one write of buffered data.
pub struct Chunker<F: FnMut(Bytes) -> std::io::Result<()>> {
    params: Params,
    buf: BytesMut,
    emit: F,
    total: u64,
}

impl<F: FnMut(Bytes) -> std::io::Result<()>> std::fmt::Debug for Chunker<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chunker")
            .field("params", &self.params)
            .field("buffered", &self.buf.len())
            .field("total", &self.total)
            .finish_non_exhaustive()
    }
}

impl<F: FnMut(Bytes) -> std::io::Result<()>> Chunker<F> {
    pub fn new(params: Params, emit: F) -> Self {
        Self {
            params,
            buf: BytesMut::with_capacity(2 * params.max),
            emit,
            total: 0,
        }
    }

    /// Bytes written so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    fn cut_one(&mut self) -> std::io::Result<()> {
        let n = cut(&self.params, &self.buf);
        // A copy, so the buffer stays one allocation that is reused.
        let chunk = Bytes::copy_from_slice(&self.buf[..n]);
        self.buf.advance(n);
        (self.emit)(chunk)
    }

    /// Emits what is left; returns the stream's length.
    pub fn finish(mut self) -> std::io::Result<u64> {
        while !self.buf.is_empty() {
            self.cut_one()?;
        }
        Ok(self.total)
    }
}

impl<F: FnMut(Bytes) -> std::io::Result<()>> std::io::Write for Chunker<F> {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let room = (2 * self.params.max).saturating_sub(self.buf.len()).max(1);
        let take = data.len().min(room);
        self.buf.extend_from_slice(&data[..take]);
        self.total += take as u64;
        while self.buf.len() >= self.params.max {
            self.cut_one()?;
        }
        Ok(take)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The gear table of fastcdc-go v0.2.0 (`table` in fastcdc.go), unchanged.
pub(crate) const GEAR: [u64; 256] = [
    0xe80e_8d55_0324_74b3,
    0x11b2_5b61_f592_4e15,
    0x03aa_5bd8_2a9e_b669,
    0xc45a_153e_f107_a38c,
    0xeac8_74b8_6f0f_57b9,
    0xa5cc_edec_95ec_79c7,
    0xe15a_3320_ad42_ac0a,
    0x5ed3_583f_a63c_ec15,
    0xcd49_7bf6_24a4_451d,
    0xf9ad_e5b0_5968_3605,
    0x7739_40c0_3fb1_1ca1,
    0xa36b_16e4_a6ae_15b2,
    0x67af_d1ad_b5a8_9eac,
    0xc44c_75ee_32f0_038e,
    0x2101_790f_365c_0967,
    0x7641_5c64_a222_fc4a,
    0x5799_2924_9a1e_577a,
    0xe476_2fc4_1fdb_f750,
    0xea52_198e_57df_cdcc,
    0xe253_5aaf_e30b_4281,
    0xcb1a_1bd6_c77c_9056,
    0x5a1a_a9bf_c461_2a62,
    0x15a7_28ae_f894_3eb5,
    0x2f8f_0973_8a8e_c8d9,
    0x200f_3dec_9fac_8074,
    0x0fa9_a7b1_e0d3_18df,
    0x06c0_804f_fd0d_8e3a,
    0x630c_bc41_2669_dd25,
    0x10e3_4f85_f4b1_0285,
    0x2a6f_e816_4b9b_6410,
    0xcacb_57d8_57d5_5810,
    0x77f8_a3a3_6ff1_1b46,
    0x66af_517e_0dc3_003e,
    0x76c0_73c7_89b4_009a,
    0x8532_30db_b529_f22a,
    0x1e9e_9c09_a1f7_7e56,
    0x1e87_1223_802e_e65d,
    0x37fe_4588_718f_f813,
    0x1008_8539_f30d_b464,
    0x366f_7470_b80b_72d1,
    0x33f2_634d_9a6b_31db,
    0xd439_1775_1d69_ea18,
    0xa0f4_92bc_1aa7_b8de,
    0x3f94_e5a8_054e_dd20,
    0xedfd_6e25_eb8b_1dbf,
    0x7595_17a5_4f19_6a56,
    0xe81d_5006_ec7b_6b17,
    0x8dd8_385f_a894_a6b7,
    0x45f4_d546_7b0d_6f91,
    0xa1f8_9469_9de2_2bc8,
    0x3382_9d09_ef93_e0fe,
    0x3e29_e250_caed_603c,
    0xf738_2cba_7f63_a45e,
    0x970f_9541_2bb5_69d1,
    0xc7fc_ea45_6d35_6b4b,
    0x7230_4251_3f3e_7a57,
    0x17ae_7688_de35_96f1,
    0x27ac_1fcd_7cd2_3c1a,
    0xf429_beeb_78b3_f71f,
    0xd078_0692_fb93_a3f9,
    0x9f50_7e28_a7c9_842f,
    0x5600_1ad5_36e4_33ae,
    0x7e1d_d1ec_f58b_e306,
    0x15fe_e353_aa23_3fc6,
    0xb033_a073_0b76_38e8,
    0xeb59_3ad6_bd24_06d1,
    0x7c86_5025_74d0_f133,
    0xce3b_008d_4ccb_4be7,
    0xf856_6e3d_3835_94c8,
    0xb2c2_61e9_b7af_4429,
    0xf685_e7e2_5379_9dbb,
    0x05d3_3ed6_0a49_4cbc,
    0xeaf8_8d55_a4cb_0d1a,
    0x3ee9_368a_9024_15a1,
    0x8980_fe6a_8493_a9a4,
    0x358e_d008_cb44_8631,
    0xd0cb_7e37_b468_24b8,
    0xe9bc_375c_0bc9_4f84,
    0xea0b_f1d8_e6b5_5bb3,
    0xb66a_60d0_f9f6_f297,
    0x66db_2cc4_807b_3758,
    0x7e4e_014a_fbca_8b4d,
    0xa568_6a49_38b0_c730,
    0xa5f0_d735_3d62_3316,
    0x26e3_8c34_9242_d5e8,
    0xeeef_a80a_2985_8e30,
    0x8915_cb91_2aa6_7386,
    0x4b95_7a47_bfc4_20d4,
    0xbb53_d051_a895_f7e1,
    0x09f5_e323_5f69_11ce,
    0x416b_98e6_95cf_b7ce,
    0x97a0_8183_344c_5c86,
    0xbf68_e079_1839_a861,
    0xea05_dde5_9ed3_ed56,
    0x0ca7_3228_0bed_a160,
    0xac74_8ed6_2fe7_f4e2,
    0xc686_da07_5cf6_e151,
    0xe1ba_5658_f4af_05c8,
    0xe9ff_09fb_eb67_cc35,
    0xafae_a947_0323_b28d,
    0x0291_e8db_5bb0_ac2a,
    0x3420_72a9_bbee_77ae,
    0x0314_7eed_6b3d_0a9c,
    0x2137_9d4d_e31d_badb,
    0x2388_d965_226f_b986,
    0x52c9_6988_bfeb_abfa,
    0xa6fc_2989_6595_bc2d,
    0x38fa_4af7_0aa4_6b8b,
    0xa688_dd13_9394_21ee,
    0x99d5_275d_9b14_15da,
    0x453d_31bb_4fe7_3631,
    0xde51_debc_1fbe_3356,
    0x75a3_c847_a06c_622f,
    0xe80e_3275_5d27_2579,
    0x5444_0522_50d8_ec0d,
    0x8f17_dfda_1958_0a3b,
    0xf6b3_e936_3a18_5e42,
    0x7a42_adec_6868_732f,
    0x32cb_6a07_6292_03a2,
    0x1eca_8957_defe_56d9,
    0x9fa8_5e4b_c78f_f9ed,
    0x20ff_0722_4a49_9ca7,
    0x3fa6_295f_f968_2c70,
    0xe3d5_b1e3_ce99_3eff,
    0xa341_2093_62e0_b79a,
    0x64bd_9eae_5712_ffe8,
    0xceeb_b537_babb_d12a,
    0x5586_ef40_4315_954f,
    0x46c3_085c_938a_b51a,
    0xa82c_cb91_9990_7cee,
    0x8c51_b669_0a35_23c8,
    0xc4db_d4c9_ae51_8332,
    0x9798_98db_b23d_b7b2,
    0x1b5b_585e_6f67_2a9d,
    0xce28_4da7_c490_3810,
    0x8411_66e8_bb5f_1c4f,
    0xb7d8_84a3_fcec_a7d0,
    0xa764_68f5_a457_2374,
    0xc10c_45f4_9ee9_513d,
    0x68f9_a566_3c19_08c9,
    0x0095_a134_76a6_339d,
    0xd1d7_516f_fbe9_c679,
    0xfd94_ab0c_9726_f938,
    0x6274_68bb_db27_c959,
    0xedc3_f898_8e4a_8c9a,
    0x58ef_d33f_0dfa_a499,
    0x21e3_7d7e_2ef4_ac8b,
    0x297f_9ab5_5862_59c6,
    0xda3b_a4dc_6cb9_617d,
    0xae11_d8d9_de22_84d2,
    0xcfee_d88c_b372_9865,
    0xefc2_f9e4_f03e_2633,
    0x8226_393e_8f08_55a4,
    0xd6e2_5fd7_acf3_a767,
    0x4357_84c3_bfd6_d14a,
    0xf971_42e6_343f_e757,
    0xd73b_9fe8_2635_2f85,
    0x6c3a_c444_b5b2_bd76,
    0xd8e8_8f3e_9fd4_a3fd,
    0x31e5_0875_c36f_3460,
    0xa824_f1bf_88cf_4d44,
    0x54a4_d2c8_f5f2_5899,
    0xbff2_5463_7ce3_b1e6,
    0xa02c_fe92_561b_3caa,
    0x7bed_b4ed_ee9f_0af7,
    0x879c_0620_ac49_a102,
    0xa12c_4ccd_23b3_32e7,
    0x09a5_ff47_bf94_ed1e,
    0x7b62_f43c_d304_6fa0,
    0xaa3a_f047_6b9c_2fb9,
    0x22e5_5301_abeb_ba8e,
    0x3a60_35c4_2747_bd58,
    0x1705_3731_06c8_ec07,
    0xb1f6_60de_828d_0628,
    0x065f_e82d_89ca_563d,
    0xf555_c2d8_074d_516d,
    0x6bb6_c186_b423_ee99,
    0x54a8_07be_6f31_20a8,
    0x8a3c_7fe2_f888_60b8,
    0xbeff_c344_f511_8e81,
    0xd686_e80b_7d1b_d268,
    0x661a_ef4e_f5e5_e88b,
    0x5bf2_56c6_54cd_1dda,
    0x9adb_1ab8_5d76_40f4,
    0x6844_9238_9208_33a2,
    0x8432_79f4_cebc_b044,
    0xc871_0cde_fa93_f7bb,
    0x2369_4329_4538_f3e6,
    0x80d7_d136_c486_d0b4,
    0x6165_3956_b288_51d3,
    0x3f84_3be9_a9a9_56b5,
    0xf73c_fbbf_1379_87e5,
    0xcf0c_b6de_e8ce_ac2c,
    0x50c4_01f5_2f18_5cae,
    0xbdbe_89ce_735c_4c1c,
    0xeef3_ade9_c057_0bc7,
    0xbe8b_066f_8f64_cbf6,
    0x5238_d613_1705_dcb9,
    0x2021_9086_c950_e9f6,
    0x6344_68d9_ed74_de02,
    0x0aba_4b3d_705c_7fa5,
    0x3374_416f_725a_6672,
    0xe737_8bdf_7beb_3bc6,
    0x0f7b_6a1b_1cee_565b,
    0x234e_4c41_b0c3_3e64,
    0x4efa_9a0c_3f21_fe28,
    0x1167_fc55_1643_e514,
    0x9f81_a69d_3eb0_1fa4,
    0xdb75_c22b_1230_6ed0,
    0xe250_55d7_38fc_9686,
    0x9f9f_167a_3f85_07bb,
    0x195f_8336_d3fb_e4d3,
    0x8442_b6fe_ffdc_b6f6,
    0x1e07_ed24_746f_fde9,
    0x140e_3146_2d55_5266,
    0x8bd0_ce51_5ae1_406e,
    0x2c0b_e004_2b55_84b3,
    0x35a2_3d0e_15d4_5a60,
    0xc14f_1ba1_47d9_bc83,
    0xbbf1_6869_1264_b23f,
    0xad2c_c7b5_7e58_9ade,
    0x9501_9631_54c7_815c,
    0x9664_afa6_b8d6_7d47,
    0x7f9e_5101_fea0_a81c,
    0x45ec_ffb6_10d2_5bfd,
    0x3157_f7ae_cf9b_6ab3,
    0xc43c_a6f8_8d87_501d,
    0x9576_ff83_8dee_38dc,
    0x93f2_1afe_0ce1_c7d7,
    0xceac_699d_f343_d8f9,
    0x2fec_49e2_9f03_398d,
    0x8805_ccd5_7302_81ed,
    0xf9fc_16fc_750a_8e59,
    0x3530_8cc7_71ad_f736,
    0x4a57_b7c9_ee2b_7def,
    0x03a4_c6cd_c937_a02a,
    0x6c9a_8a26_9fc8_c4fc,
    0x4681_dece_c7a0_3f43,
    0x342e_ecde_d135_3ef9,
    0x8be0_552d_8413_a867,
    0xc7b4_ac51_beda_8be8,
    0xebcc_64fb_7198_42c0,
    0xde8e_4c7f_b6d4_0c1c,
    0xcc82_63b6_2f97_38b1,
    0xd3cf_c0f8_6511_929a,
    0x4660_24ce_8bb2_26ea,
    0x459f_f690_253a_3c18,
    0x98b2_7e9d_9128_4c9c,
    0x75c3_ae8a_a3af_373d,
    0xfbf8_f8e7_9a86_6ffc,
    0x3232_7f59_d066_2799,
    0x8228_b57e_729e_9830,
    0x065c_eb7a_1838_1b58,
    0xd217_7671_a31d_c5ff,
    0x90cd_801f_2f87_01f9,
    0x9d71_4428_471c_65fe,
];

#[cfg(test)]
#[allow(clippy::disallowed_methods)]
mod tests {
    use super::*;
    use std::io::Write;

    /// SplitMix64 bytes: the same generator as tests/data/fastcdc/gen.go.
    pub(crate) fn splitmix_bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut state = seed;
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            out.extend_from_slice(&z.to_le_bytes());
        }
        out.truncate(len);
        out
    }

    fn lengths(p: Params, data: &[u8], write_size: usize) -> Vec<usize> {
        let mut out = Vec::new();
        let mut c = Chunker::new(p, |b: Bytes| {
            out.push(b.len());
            Ok(())
        });
        for part in data.chunks(write_size) {
            c.write_all(part).unwrap();
        }
        c.finish().unwrap();
        out
    }

    #[test]
    fn parameters_follow_the_reference() {
        let d = default_params();
        assert_eq!((d.min, d.avg, d.max), (256 * 1024, 1 << 20, 4 << 20));
        assert_eq!(d.mask_s, (1 << 22) - 1);
        assert_eq!(d.mask_l, (1 << 18) - 1);
        let minio = Params::for_average(8 * 1024);
        assert_eq!((minio.min, minio.max), (2049, 4 << 20));
    }

    /// Boundaries computed by fastcdc-go v0.2.0 itself (tests/data/fastcdc).
    #[test]
    fn boundaries_match_fastcdc_go() {
        let golden = include_str!("../../tests/data/fastcdc/golden.txt");
        let mut checked = 0;
        for line in golden
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            let mut f = line.split_whitespace();
            let mut num = || f.next().unwrap().parse::<usize>().unwrap();
            let (seed, len, min, avg, max) = (num(), num(), num(), num(), num());
            let want: Vec<usize> = f.map(|x| x.parse().unwrap()).collect();
            let data = splitmix_bytes(seed as u64, len);
            let p = Params::with(min, avg, max);
            for write_size in [1 << 20, 4093, 7 * max] {
                assert_eq!(lengths(p, &data, write_size), want, "{line:.40}");
            }
            checked += 1;
        }
        assert!(checked >= 3);
    }

    #[test]
    fn unchanged_data_gives_the_same_chunks() {
        let data = splitmix_bytes(7, 3 << 20);
        let p = Params::with(1024, 4096, 16384);
        assert_eq!(lengths(p, &data, 65536), lengths(p, &data, 1000));
    }

    /// SNAP-4: one flipped byte in a 512 KiB file, 4 KiB average: 1 or 2
    /// new chunks.
    #[test]
    fn one_flipped_byte_changes_one_or_two_chunks() {
        use std::collections::HashSet;
        let p = Params::with(1024, 4096, 16384);
        let chunks = |data: &[u8]| -> Vec<Vec<u8>> {
            let mut out = Vec::new();
            let mut c = Chunker::new(p, |b: Bytes| {
                out.push(b.to_vec());
                Ok(())
            });
            c.write_all(data).unwrap();
            c.finish().unwrap();
            out
        };
        for (seed, at) in [(1u64, 100_000usize), (2, 7), (3, 524_000), (4, 262_144)] {
            let data = splitmix_bytes(seed, 512 * 1024);
            let before: HashSet<Vec<u8>> = chunks(&data).into_iter().collect();
            let mut flipped = data.clone();
            flipped[at] ^= 0x5a;
            let new = chunks(&flipped)
                .into_iter()
                .filter(|c| !before.contains(c))
                .count();
            assert!(
                (1..=2).contains(&new),
                "seed {seed} at {at}: {new} new chunks"
            );
        }
    }
}
