//! Element transforms fused with the byte-plane split.
//!
//! A chunk of `n` lanes of `W` bytes is turned into `W` planes of `n` bytes: plane `k` holds
//! byte `k` (little-endian) of every transformed lane. For the delta of two consecutive
//! checkpoints the high planes are mostly zero and the low planes noisy, so coding each plane
//! separately compresses far better than coding the interleaved bytes.
//!
//! The work is done in blocks of [`BLOCK`] lanes through a small scratch buffer of words: one
//! loop computes the transformed words (XOR, wrapping difference, ...) and one loop per plane
//! extracts a byte of each word. Each of those loops is a plain loop over slices that LLVM
//! vectorises (SSE2 by default, AVX2 when the crate is built for it).

use super::predict::Scaled;

/// Lanes per block (fits the scratch words and the planes' slices in L1/L2).
const BLOCK: usize = 4096;

/// How each lane is compared with the lane at the same index in the previous tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Transform {
    /// No previous tensor: the lanes themselves.
    Raw = 0,
    /// XOR of the bit patterns.
    Xor = 1,
    /// Wrapping integer difference, zigzag-coded (small changes of either sign give small
    /// codes).
    IntSub = 2,
    /// Difference of the order-preserving integer keys of IEEE floats, zigzag-coded: the
    /// signed distance in units in the last place. Unlike XOR it has no carry noise when a
    /// value crosses a power of two.
    FloatSub = 3,
    /// Quantised lossy delta (see `lossy`): the lanes are zigzag-coded `i32` bin indices.
    Quant = 4,
    /// [`Transform::FloatSub`] against `α · prev` instead of `prev` (see `predict`), the
    /// prediction computed lane by lane in the same pass.
    ScaledFloatSub = 5,
}

impl Transform {
    /// The transform stored under `code` in a chunk.
    pub fn from_code(code: u8) -> Option<Transform> {
        match code {
            0 => Some(Transform::Raw),
            1 => Some(Transform::Xor),
            2 => Some(Transform::IntSub),
            3 => Some(Transform::FloatSub),
            4 => Some(Transform::Quant),
            5 => Some(Transform::ScaledFloatSub),
            _ => None,
        }
    }
}

/// An unsigned machine word used as a lane.
pub(crate) trait Word: Copy + Default + Send + Sync {
    /// Bytes per word.
    const W: usize;
    /// Bits per word.
    const BITS: u32;
    /// The word zero-extended.
    fn to_u64(self) -> u64;
    /// The low bits of `v`.
    fn from_u64(v: u64) -> Self;
    /// Reads a little-endian word from exactly `W` bytes.
    fn load(b: &[u8]) -> Self;
    /// Writes the word little-endian into exactly `W` bytes.
    fn store(self, b: &mut [u8]);
    /// Byte `k` (little-endian) of the word.
    fn byte(self, k: usize) -> u8;
    /// The word with byte `k` or-ed in.
    fn or_byte(self, b: u8, k: usize) -> Self;
    /// XOR.
    fn xor(self, o: Self) -> Self;
    /// Wrapping difference `self - o`, zigzag-coded.
    fn sub_zz(self, o: Self) -> Self;
    /// Inverse of [`Word::sub_zz`]: `o + unzigzag(self)`.
    fn add_unzz(self, o: Self) -> Self;
    /// Order-preserving key of an IEEE float's bits.
    fn key(self) -> Self;
    /// Inverse of [`Word::key`].
    fn unkey(self) -> Self;
}

macro_rules! word {
    ($t:ty, $s:ty) => {
        impl Word for $t {
            const W: usize = std::mem::size_of::<$t>();
            const BITS: u32 = <$t>::BITS;
            #[inline(always)]
            fn to_u64(self) -> u64 {
                self as u64
            }
            #[inline(always)]
            fn from_u64(v: u64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn load(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_le_bytes(a)
            }
            #[inline(always)]
            fn store(self, b: &mut [u8]) {
                b.copy_from_slice(&self.to_le_bytes());
            }
            #[inline(always)]
            fn byte(self, k: usize) -> u8 {
                (self >> (8 * k)) as u8
            }
            #[inline(always)]
            fn or_byte(self, b: u8, k: usize) -> Self {
                self | (<$t>::from(b) << (8 * k))
            }
            #[inline(always)]
            fn xor(self, o: Self) -> Self {
                self ^ o
            }
            #[inline(always)]
            fn sub_zz(self, o: Self) -> Self {
                let d = self.wrapping_sub(o) as $s;
                ((d << 1) ^ (d >> (<$t>::BITS - 1))) as $t
            }
            #[inline(always)]
            fn add_unzz(self, o: Self) -> Self {
                let d = (self >> 1) ^ (0 as $t).wrapping_sub(self & 1);
                o.wrapping_add(d)
            }
            #[inline(always)]
            fn key(self) -> Self {
                const SIGN: $t = 1 << (<$t>::BITS - 1);
                self ^ ((((self as $s) >> (<$t>::BITS - 1)) as $t) | SIGN)
            }
            #[inline(always)]
            fn unkey(self) -> Self {
                const SIGN: $t = 1 << (<$t>::BITS - 1);
                self ^ (((((!self) as $s) >> (<$t>::BITS - 1)) as $t) | SIGN)
            }
        }
    };
}
word!(u8, i8);
word!(u16, i16);
word!(u32, i32);
word!(u64, i64);

#[inline(always)]
fn split_with<T: Word>(
    prev: &[u8],
    cur: &[u8],
    planes: &mut [u8],
    words: &mut [T],
    f: impl Fn(T, T) -> T,
) {
    let n = cur.len() / T::W;
    let mut start = 0;
    while start < n {
        let len = BLOCK.min(n - start);
        let ws = &mut words[..len];
        let c = &cur[start * T::W..(start + len) * T::W];
        if prev.is_empty() {
            for (w, c) in ws.iter_mut().zip(c.chunks_exact(T::W)) {
                *w = f(T::load(c), T::default());
            }
        } else {
            let p = &prev[start * T::W..(start + len) * T::W];
            for ((w, c), p) in ws
                .iter_mut()
                .zip(c.chunks_exact(T::W))
                .zip(p.chunks_exact(T::W))
            {
                *w = f(T::load(c), T::load(p));
            }
        }
        for k in 0..T::W {
            let plane = &mut planes[k * n + start..k * n + start + len];
            for (o, w) in plane.iter_mut().zip(ws.iter()) {
                *o = w.byte(k);
            }
        }
        start += len;
    }
}

#[inline(always)]
fn merge_with<T: Word>(
    prev: &[u8],
    planes: &[u8],
    out: &mut [u8],
    words: &mut [T],
    f: impl Fn(T, T) -> T,
) {
    let n = out.len() / T::W;
    let mut start = 0;
    while start < n {
        let len = BLOCK.min(n - start);
        let ws = &mut words[..len];
        ws.fill(T::default());
        for k in 0..T::W {
            let plane = &planes[k * n + start..k * n + start + len];
            for (w, b) in ws.iter_mut().zip(plane.iter()) {
                *w = w.or_byte(*b, k);
            }
        }
        let o = &mut out[start * T::W..(start + len) * T::W];
        if prev.is_empty() {
            for (w, o) in ws.iter().zip(o.chunks_exact_mut(T::W)) {
                f(*w, T::default()).store(o);
            }
        } else {
            let p = &prev[start * T::W..(start + len) * T::W];
            for ((w, o), p) in ws
                .iter()
                .zip(o.chunks_exact_mut(T::W))
                .zip(p.chunks_exact(T::W))
            {
                f(*w, T::load(p)).store(o);
            }
        }
        start += len;
    }
}

fn split_t<T: Word + Scaled>(
    tr: Transform,
    alpha: f32,
    prev: &[u8],
    cur: &[u8],
    planes: &mut [u8],
) {
    let mut words = vec![T::default(); BLOCK.min(cur.len() / T::W)];
    match tr {
        Transform::Raw | Transform::Quant => split_with(&[], cur, planes, &mut words, |c, _| c),
        Transform::Xor => split_with(prev, cur, planes, &mut words, |c, p| c.xor(p)),
        Transform::IntSub => split_with(prev, cur, planes, &mut words, |c, p| c.sub_zz(p)),
        Transform::FloatSub => split_with(prev, cur, planes, &mut words, |c, p| {
            c.key().sub_zz(p.key())
        }),
        Transform::ScaledFloatSub => split_with(prev, cur, planes, &mut words, |c, p| {
            c.key().sub_zz(p.scaled(alpha).key())
        }),
    }
}

fn merge_t<T: Word + Scaled>(
    tr: Transform,
    alpha: f32,
    prev: &[u8],
    planes: &[u8],
    out: &mut [u8],
) {
    let mut words = vec![T::default(); BLOCK.min(out.len() / T::W)];
    match tr {
        Transform::Raw | Transform::Quant => merge_with(&[], planes, out, &mut words, |d, _| d),
        Transform::Xor => merge_with(prev, planes, out, &mut words, |d, p| d.xor(p)),
        Transform::IntSub => merge_with(prev, planes, out, &mut words, |d, p| d.add_unzz(p)),
        Transform::FloatSub => merge_with(prev, planes, out, &mut words, |d, p| {
            d.add_unzz(p.key()).unkey()
        }),
        Transform::ScaledFloatSub => merge_with(prev, planes, out, &mut words, |d, p| {
            d.add_unzz(p.scaled(alpha).key()).unkey()
        }),
    }
}

/// Transforms `cur` against `prev` (empty for [`Transform::Raw`]) lane by lane and writes
/// the `width` byte planes into `planes` (`planes.len() == cur.len()`); `alpha` is the
/// factor of [`Transform::ScaledFloatSub`] (ignored by the others).
///
/// The caller guarantees `width` ∈ {1, 2, 4, 8}, `cur.len()` a multiple of `width`,
/// `planes.len() == cur.len()` and `prev` empty or as long as `cur`.
pub(crate) fn split(
    tr: Transform,
    width: usize,
    alpha: f32,
    prev: &[u8],
    cur: &[u8],
    planes: &mut [u8],
) {
    debug_assert_eq!(planes.len(), cur.len());
    debug_assert!(prev.is_empty() || prev.len() == cur.len());
    match width {
        1 => split_t::<u8>(tr, alpha, prev, cur, planes),
        2 => split_t::<u16>(tr, alpha, prev, cur, planes),
        4 => split_t::<u32>(tr, alpha, prev, cur, planes),
        _ => split_t::<u64>(tr, alpha, prev, cur, planes),
    }
}

/// Inverse of [`split`]: rebuilds the lanes from the planes and `prev` into `out`.
pub(crate) fn merge(
    tr: Transform,
    width: usize,
    alpha: f32,
    prev: &[u8],
    planes: &[u8],
    out: &mut [u8],
) {
    debug_assert_eq!(planes.len(), out.len());
    match width {
        1 => merge_t::<u8>(tr, alpha, prev, planes, out),
        2 => merge_t::<u16>(tr, alpha, prev, planes, out),
        4 => merge_t::<u32>(tr, alpha, prev, planes, out),
        _ => merge_t::<u64>(tr, alpha, prev, planes, out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> u8 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 56) as u8
    }

    #[test]
    fn split_merge_round_trip_every_width_and_transform() {
        let mut s = 7u64;
        for width in [1usize, 2, 4, 8] {
            for n in [0usize, 1, 3, BLOCK - 1, BLOCK + 5, 3 * BLOCK] {
                let prev: Vec<u8> = (0..n * width).map(|_| lcg(&mut s)).collect();
                let cur: Vec<u8> = (0..n * width).map(|_| lcg(&mut s)).collect();
                for tr in [
                    Transform::Raw,
                    Transform::Xor,
                    Transform::IntSub,
                    Transform::FloatSub,
                    Transform::ScaledFloatSub,
                ] {
                    let p: &[u8] = if tr == Transform::Raw { &[] } else { &prev };
                    let mut planes = vec![0u8; cur.len()];
                    split(tr, width, 0.9, p, &cur, &mut planes);
                    let mut out = vec![0u8; cur.len()];
                    merge(tr, width, 0.9, p, &planes, &mut out);
                    assert_eq!(out, cur, "width {width} n {n} {tr:?}");
                }
            }
        }
    }

    #[test]
    fn planes_hold_the_bytes_of_each_lane() {
        let cur = [0x11u8, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88];
        let mut planes = [0u8; 8];
        split(Transform::Raw, 4, 1.0, &[], &cur, &mut planes);
        assert_eq!(planes, [0x11, 0x55, 0x22, 0x66, 0x33, 0x77, 0x44, 0x88]);
    }

    #[test]
    fn float_sub_is_the_ulp_distance() {
        let a = 1.0f32.to_bits();
        let b = f32::from_bits(a - 1).to_bits(); // next float below 1.0
        let d = b.key().sub_zz(a.key());
        assert_eq!(d, 1, "-1 ulp zigzags to 1");
        // crossing zero: -0.0 and +0.0 are one key apart
        let d = 0.0f32.to_bits().key().sub_zz((-0.0f32).to_bits().key());
        assert_eq!(d, 2);
        for x in [0u32, 1, 0x7f80_0000, 0xffff_ffff, 0x8000_0000, 0x7fc0_0001] {
            assert_eq!(x.key().unkey(), x);
        }
        let keys: Vec<u32> = [-2.0f32, -1.0, -0.0, 0.0, 1e-45, 1.0, f32::INFINITY]
            .iter()
            .map(|x| x.to_bits().key())
            .collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]));
    }
}
