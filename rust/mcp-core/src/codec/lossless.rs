//! Lossless coding: byte planes, then Huffman, zstd level 1 or raw per plane.
//!
//! The tensor is cut into chunks of [`CHUNK`] elements (the last may be shorter). Each
//! chunk's element bytes are transposed into `size` planes (all byte 0s, then all byte 1s,
//! ...: the sign/exponent bytes of floats become long runs of similar values) and each plane
//! is stored as
//!
//! ```text
//! [u32 LE header: bit 31 = zstd, bit 30 = Huffman, bits 0..30 = stored length] [stored bytes]
//! ```
//!
//! The coder is chosen by the plane's sampled entropy ([`mcp_delta::entropy::choose`]): zstd for
//! mostly-constant planes, canonical Huffman ([`mcp_delta::entropy::huffman`]) for the exponent
//! planes (order-0 redundancy only, several times faster than zstd), raw for the noisy
//! mantissa planes. A plane that its coder does not shrink is stored raw (its length must then
//! be the chunk's element count). Payloads without bit 30 (before Huffman) decode unchanged. Chunks bound the decoder's scratch (`CHUNK · size` bytes), so
//! `decode_reduce` never holds a full-size copy. The coding is bit-exact for every dtype:
//! only bytes are moved.

use crate::dtype::DType;
use crate::error::{Error, Result};
use mcp_delta::entropy::{choose, huffman, Choice};
use std::cell::RefCell;
use std::sync::atomic::{AtomicI32, Ordering};
use zstd::bulk::{Compressor, Decompressor};

/// Elements per independently coded chunk (256 KiB of f32).
pub(super) const CHUNK: usize = 65_536;
/// The zstd level in use, or [`NO_ENTROPY`]: process-wide, set by [`Compression::install`].
static LEVEL: AtomicI32 = AtomicI32::new(1);
/// [`LEVEL`] when planes are stored raw (no entropy stage).
const NO_ENTROPY: i32 = 0;
const ZSTD_FLAG: u32 = 1 << 31;
const HUFFMAN_FLAG: u32 = 1 << 30;
const LEN_MASK: u32 = HUFFMAN_FLAG - 1;
/// Planes above this sampled entropy (bits per byte) are sent raw: on gradients the three
/// low planes (7.6 bits: mantissa noise and 10 % zeros) would shrink by 4 % at a quarter of
/// the speed of a copy.
const RAW_ENTROPY: f64 = 7.5;

pub(super) fn max_encoded_len(dtype: DType, n: usize) -> usize {
    let size = dtype.size();
    // The Huffman coder briefly writes GAP bytes past its payload (word stores).
    n.saturating_mul(size)
        .saturating_add(n.div_ceil(CHUNK).saturating_mul(4 * size))
        .saturating_add(huffman::GAP)
}

/// The lossless codec's entropy stage, as the transport config's `compression` key names it.
///
/// Only the encoder uses it: every plane says how it is stored (raw, Huffman or zstd, and
/// zstd frames decode at any level), so ranks with different settings still decode each
/// other bit-exactly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Byte planes stored raw: no Huffman, no zstd.
    None,
    /// Huffman, zstd at this level (1 to 19) or raw per plane, by sampled entropy.
    Zstd(i32),
}

impl Compression {
    /// What [`Compression::parse`] accepts, for error messages.
    pub const ALLOWED: &'static str = "\"none\", \"zstd\" or \"zstd@L<level>\" with level 1 to 19";

    /// Parses `"none"`, `"zstd"` (level 1) or `"zstd@L<level>"` with level 1 to 19.
    pub fn parse(name: &str) -> Option<Compression> {
        match name {
            "none" => Some(Compression::None),
            "zstd" => Some(Compression::Zstd(1)),
            _ => {
                let level: i32 = name.strip_prefix("zstd@L")?.parse().ok()?;
                (1..=19)
                    .contains(&level)
                    .then_some(Compression::Zstd(level))
            }
        }
    }

    /// Makes this the entropy stage of every lossless encode in the process from now on.
    pub fn install(self) {
        let level = match self {
            Compression::None => NO_ENTROPY,
            Compression::Zstd(l) => l,
        };
        LEVEL.store(level, Ordering::Relaxed);
    }

    /// The entropy stage lossless encodes use now (default zstd level 1).
    pub fn current() -> Compression {
        match LEVEL.load(Ordering::Relaxed) {
            NO_ENTROPY => Compression::None,
            l => Compression::Zstd(l),
        }
    }
}

thread_local! {
    /// The compressor of this thread and the level it was made for.
    static COMPRESSOR: RefCell<Option<(i32, Compressor<'static>)>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<Decompressor<'static>>> = const { RefCell::new(None) };
}

fn zstd_err(e: std::io::Error) -> Error {
    Error::Io(format!("zstd: {e}"))
}

pub(super) fn encode(dtype: DType, src: &[u8], out: &mut Vec<u8>) -> Result<()> {
    encode_at(LEVEL.load(Ordering::Relaxed), dtype, src, out)
}

/// [`encode`] with zstd level `level` ([`NO_ENTROPY`]: every plane raw).
fn encode_at(level: i32, dtype: DType, src: &[u8], out: &mut Vec<u8>) -> Result<()> {
    let size = dtype.size();
    COMPRESSOR.with(|cell| {
        let mut cell = cell.borrow_mut();
        let z = match &mut *cell {
            Some((l, z)) if *l == level || level == NO_ENTROPY => z,
            slot => {
                let z = Compressor::new(level.max(1)).map_err(zstd_err)?;
                &mut slot.insert((level, z)).1
            }
        };
        let mut planes = vec![0u8; CHUNK.min(src.len() / size) * size];
        for chunk in src.chunks(CHUNK * size) {
            let m = chunk.len() / size;
            let planes = &mut planes[..chunk.len()];
            split(size, chunk, planes);
            for plane in planes.chunks_exact(m) {
                let head = out.len();
                out.extend_from_slice(&[0; 4]);
                let choice = if level == NO_ENTROPY {
                    Choice::Raw
                } else {
                    choose(plane, RAW_ENTROPY)
                };
                let header = match choice {
                    Choice::Huffman if huffman::encode_bounded(plane, m - 1, out) => {
                        HUFFMAN_FLAG | (out.len() - head - 4) as u32
                    }
                    Choice::Zstd => {
                        // Room for one byte less than raw: zstd fails when it cannot shrink
                        // the plane.
                        out.resize(head + 4 + m, 0);
                        match z.compress_to_buffer(plane, &mut out[head + 4..head + 3 + m]) {
                            Ok(len) => {
                                out.truncate(head + 4 + len);
                                ZSTD_FLAG | len as u32
                            }
                            Err(_) => {
                                out[head + 4..].copy_from_slice(plane);
                                m as u32
                            }
                        }
                    }
                    _ => {
                        out.extend_from_slice(plane);
                        m as u32
                    }
                };
                out[head..head + 4].copy_from_slice(&header.to_le_bytes());
            }
        }
        Ok(())
    })
}

/// Decodes chunk by chunk, calling `f(byte offset, decoded bytes)` for each (the bytes are in
/// the tensor's native layout).
pub(super) fn decode_chunks(
    dtype: DType,
    enc: &[u8],
    n: usize,
    mut f: impl FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let size = dtype.size();
    DECOMPRESSOR.with(|cell| {
        let mut cell = cell.borrow_mut();
        let z = match &mut *cell {
            Some(z) => z,
            none => none.insert(Decompressor::new().map_err(zstd_err)?),
        };
        let cap = CHUNK.min(n) * size;
        let mut planes = vec![0u8; cap];
        let mut elems = vec![0u8; cap];
        let mut rest = enc;
        let mut start = 0;
        while start < n {
            let m = CHUNK.min(n - start);
            let planes = &mut planes[..m * size];
            for plane in planes.chunks_exact_mut(m) {
                let (head, after) = rest.split_at_checked(4).ok_or_else(|| {
                    Error::Protocol(format!(
                        "lossless payload of {} bytes ends inside a plane header",
                        enc.len()
                    ))
                })?;
                let header = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
                let len = (header & LEN_MASK) as usize;
                let (body, after) = after.split_at_checked(len).ok_or_else(|| {
                    Error::Protocol(format!(
                        "lossless plane announces {len} bytes but only {} follow",
                        after.len()
                    ))
                })?;
                if header & HUFFMAN_FLAG != 0 {
                    if header & ZSTD_FLAG != 0 {
                        return Err(Error::Protocol(
                            "lossless plane flagged both zstd and Huffman".into(),
                        ));
                    }
                    huffman::decode(body, plane).map_err(|e| {
                        Error::Protocol(format!("lossless plane does not decode: {e}"))
                    })?;
                } else if header & ZSTD_FLAG == 0 {
                    if len != m {
                        return Err(Error::Protocol(format!(
                            "raw lossless plane of {len} bytes for a chunk of {m} elements"
                        )));
                    }
                    plane.copy_from_slice(body);
                } else {
                    let got = z.decompress_to_buffer(body, plane).map_err(|e| {
                        Error::Protocol(format!("lossless plane does not decompress: {e}"))
                    })?;
                    if got != m {
                        return Err(Error::Protocol(format!(
                            "lossless plane decompressed to {got} bytes for a chunk of {m} \
                             elements"
                        )));
                    }
                }
                rest = after;
            }
            let elems = &mut elems[..m * size];
            merge(size, planes, elems);
            f(start * size, elems)?;
            start += m;
        }
        if !rest.is_empty() {
            return Err(Error::Protocol(format!(
                "{} bytes left over after a lossless payload of {n} elements",
                rest.len()
            )));
        }
        Ok(())
    })
}

/// Byte-plane transpose: `planes[p * m + i] = elems[i * S + p]`.
fn split(size: usize, elems: &[u8], planes: &mut [u8]) {
    match size {
        2 => dispatch_split::<2>(elems, planes),
        4 => dispatch_split::<4>(elems, planes),
        8 => dispatch_split::<8>(elems, planes),
        _ => planes.copy_from_slice(elems),
    }
}

/// The inverse of [`split`].
fn merge(size: usize, planes: &[u8], elems: &mut [u8]) {
    match size {
        2 => dispatch_merge::<2>(planes, elems),
        4 => dispatch_merge::<4>(planes, elems),
        8 => dispatch_merge::<8>(planes, elems),
        _ => elems.copy_from_slice(planes),
    }
}

/// Elements per transposed tile: the inner loops have constant bounds, so LLVM unrolls them
/// into byte shuffles.
const TILE: usize = 32;

#[inline(always)]
fn split_portable<const S: usize>(elems: &[u8], planes: &mut [u8]) {
    let m = elems.len() / S;
    let full = m / TILE * TILE;
    for t in (0..full).step_by(TILE) {
        let tile = &elems[t * S..(t + TILE) * S];
        for p in 0..S {
            let d = &mut planes[p * m + t..p * m + t + TILE];
            for (j, b) in d.iter_mut().enumerate() {
                *b = tile[j * S + p];
            }
        }
    }
    for i in full..m {
        for p in 0..S {
            planes[p * m + i] = elems[i * S + p];
        }
    }
}

#[inline(always)]
fn merge_portable<const S: usize>(planes: &[u8], elems: &mut [u8]) {
    let m = elems.len() / S;
    let full = m / TILE * TILE;
    for t in (0..full).step_by(TILE) {
        let tile = &mut elems[t * S..(t + TILE) * S];
        for p in 0..S {
            let s = &planes[p * m + t..p * m + t + TILE];
            for (j, b) in s.iter().enumerate() {
                tile[j * S + p] = *b;
            }
        }
    }
    for i in full..m {
        for p in 0..S {
            elems[i * S + p] = planes[p * m + i];
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn split_avx2<const S: usize>(elems: &[u8], planes: &mut [u8]) {
    split_portable::<S>(elems, planes)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn merge_avx2<const S: usize>(planes: &[u8], elems: &mut [u8]) {
    merge_portable::<S>(planes, elems)
}

fn dispatch_split<const S: usize>(elems: &[u8], planes: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked on the line above.
        return unsafe { split_avx2::<S>(elems, planes) };
    }
    split_portable::<S>(elems, planes)
}

fn dispatch_merge<const S: usize>(planes: &[u8], elems: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked on the line above.
        return unsafe { merge_avx2::<S>(planes, elems) };
    }
    merge_portable::<S>(planes, elems)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn roundtrip(dtype: DType, src: &[u8]) -> Vec<u8> {
        let mut enc = Vec::new();
        encode(dtype, src, &mut enc).expect("encode");
        assert!(enc.len() <= max_encoded_len(dtype, src.len() / dtype.size()));
        let mut out = vec![0u8; src.len()];
        decode_chunks(dtype, &enc, src.len() / dtype.size(), |s, b| {
            out[s..s + b.len()].copy_from_slice(b);
            Ok(())
        })
        .expect("decode");
        assert_eq!(out, src, "{dtype}");
        enc
    }

    /// Mostly zeros with a few values: a plane the sampler gives to zstd.
    fn sparse(n: usize) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        (0..n)
            .map(|_| {
                if rng.random_bool(0.02) {
                    rng.random()
                } else {
                    0
                }
            })
            .collect()
    }

    fn decode_all(dtype: DType, enc: &[u8], n: usize) -> Vec<u8> {
        let mut out = vec![0u8; n * dtype.size()];
        decode_chunks(dtype, enc, n, |s, b| {
            out[s..s + b.len()].copy_from_slice(b);
            Ok(())
        })
        .expect("decode");
        out
    }

    #[test]
    fn the_configured_zstd_level_is_the_one_used() {
        let src = sparse(50_000);
        for level in [1, 3, 19] {
            let mut enc = Vec::new();
            encode_at(level, DType::U8, &src, &mut enc).expect("encode");
            let header = u32::from_le_bytes([enc[0], enc[1], enc[2], enc[3]]);
            assert_ne!(
                header & ZSTD_FLAG,
                0,
                "level {level}: plane not given to zstd"
            );
            let want = zstd::bulk::compress(&src, level).expect("zstd");
            assert_eq!(&enc[4..], &want[..], "level {level}");
            // The decoder needs no level: ranks configured differently still agree.
            assert_eq!(decode_all(DType::U8, &enc, src.len()), src);
        }
    }

    #[test]
    fn no_entropy_stage_stores_every_plane_raw() {
        let src: Vec<u8> = sparse(40_000);
        let mut enc = Vec::new();
        encode_at(NO_ENTROPY, DType::F32, &src, &mut enc).expect("encode");
        let n = src.len() / 4;
        assert_eq!(
            enc.len(),
            src.len() + 4 * 4,
            "4 raw planes with their headers"
        );
        for p in 0..4 {
            let h = &enc[p * (n + 4)..p * (n + 4) + 4];
            assert_eq!(u32::from_le_bytes([h[0], h[1], h[2], h[3]]), n as u32);
        }
        assert_eq!(decode_all(DType::F32, &enc, n), src);
        // And a default-level encoder's output decodes on the same decoder.
        let mut z = Vec::new();
        encode_at(1, DType::F32, &src, &mut z).expect("encode");
        assert!(z.len() < enc.len());
        assert_eq!(decode_all(DType::F32, &z, n), src);
    }

    #[test]
    fn split_and_merge_are_inverse_transposes() {
        for size in [1usize, 2, 4, 8] {
            for m in [0usize, 1, 31, 32, 33, 100] {
                let elems: Vec<u8> = (0..m * size).map(|i| (i * 7 + i / 3) as u8).collect();
                let mut planes = vec![0u8; elems.len()];
                split(size, &elems, &mut planes);
                for i in 0..m {
                    for p in 0..size {
                        assert_eq!(planes[p * m + i], elems[i * size + p]);
                    }
                }
                let mut back = vec![0u8; elems.len()];
                merge(size, &planes, &mut back);
                assert_eq!(back, elems);
            }
        }
    }

    #[test]
    fn bit_exact_for_every_dtype_and_special_values() {
        let specials: Vec<u32> = vec![
            0,
            0x8000_0000,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0000,
            0x7F80_0001,
            0xFFBF_1234,
            1,
            0x0000_7FFF,
            0x8000_0001,
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for dtype in DType::ALL {
            for n in [0usize, 1, 5, CHUNK - 1, CHUNK, CHUNK + 77, 3 * CHUNK + 5] {
                let mut src: Vec<u8> = Vec::with_capacity(n * dtype.size());
                for i in 0..n {
                    let v: u64 = if i % 3 == 0 {
                        // gradient-like: f32 normal-ish, or the special list
                        let s = specials[i % specials.len()];
                        u64::from(s) | (u64::from(s) << 32)
                    } else {
                        let f = (rng.random::<f32>() - 0.5) * 1e-3;
                        u64::from(f.to_bits()) | ((f64::from(f).to_bits() >> 32) << 32)
                    };
                    for _ in 0..dtype.size().div_ceil(8) {
                        src.extend_from_slice(&v.to_le_bytes()[..dtype.size().min(8)]);
                    }
                }
                roundtrip(dtype, &src);
            }
        }
    }

    #[test]
    fn compresses_planes_of_redundant_data_and_stores_random_ones_raw() {
        let zeros = vec![0u8; 4 * 10_000];
        assert!(roundtrip(DType::F32, &zeros).len() < 200);
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let noise: Vec<u8> = (0..4 * 10_000).map(|_| rng.random()).collect();
        let enc = roundtrip(DType::F32, &noise);
        assert_eq!(enc.len(), noise.len() + 4 * 4);
    }

    #[test]
    fn corrupt_payloads_are_protocol_errors() {
        let src: Vec<u8> = (0..1000u32)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        let mut enc = Vec::new();
        encode(DType::F32, &src, &mut enc).expect("encode");
        let run = |e: &[u8], n: usize| decode_chunks(DType::F32, e, n, |_, _| Ok(()));
        assert!(run(&enc, 1000).is_ok());
        assert!(matches!(run(&enc, 1001), Err(Error::Protocol(_))));
        assert!(matches!(run(&enc, 999), Err(Error::Protocol(_))));
        assert!(matches!(
            run(&enc[..enc.len() - 1], 1000),
            Err(Error::Protocol(_))
        ));
        // A flipped header bit changes a length: caught. (A flipped data byte may decode to
        // other data of the right length: integrity is the transport's CRC's job.)
        let mut bad = enc.clone();
        bad[1] ^= 0x40;
        assert!(matches!(run(&bad, 1000), Err(Error::Protocol(_))));
    }
}
