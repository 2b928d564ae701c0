//! Round-trip and robustness tests of the whole codec.
#![allow(clippy::unwrap_used)]

use super::*;
use proptest::prelude::*;

fn lcg_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 56) as u8
        })
        .collect()
}

fn opts(chunk_bytes: usize, threads: usize) -> EncodeOptions {
    EncodeOptions {
        chunk_bytes,
        threads,
        ..EncodeOptions::default()
    }
}

fn round_trip(dtype: DType, prev: Option<&[u8]>, cur: &[u8], o: &EncodeOptions) -> Vec<u8> {
    let n = (cur.len() / dtype.size()) as u64;
    let enc = encode(dtype, &[n], prev, cur, o).unwrap();
    let blob = enc.into_vec();
    let (info, back) = decode(&blob, prev, 2).unwrap();
    assert_eq!(back, cur, "{dtype:?}");
    assert_eq!(info.shape, vec![n]);
    assert_eq!(info.dtype, dtype);
    assert_eq!(info.hash, content_hash(cur));
    blob
}

/// Special values of a float format as bit patterns: ±0, ±inf, NaNs with payloads, the
/// smallest and largest subnormals, the extremes.
fn specials(dtype: DType) -> Vec<u8> {
    let v: Vec<u64> = match dtype {
        DType::F32 | DType::C64 => vec![
            0,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0x7f80_0001,
            0xffc1_2345,
            1,
            0x007f_ffff,
            0x8000_0001,
            0x7f7f_ffff,
            0x3f80_0000,
        ],
        DType::F64 | DType::C128 => vec![
            0,
            1 << 63,
            0x7ff0_0000_0000_0000,
            0xfff0_0000_0000_0000,
            0x7ff8_0000_0000_0001,
            0x7ff0_0000_0000_0001,
            1,
            0x000f_ffff_ffff_ffff,
            0x8000_0000_0000_0001,
            0x7fef_ffff_ffff_ffff,
        ],
        DType::F16 => vec![
            0, 0x8000, 0x7c00, 0xfc00, 0x7e01, 0x7c01, 1, 0x03ff, 0x8001, 0x7bff,
        ],
        DType::BF16 => vec![
            0, 0x8000, 0x7f80, 0xff80, 0x7fc1, 0x7f81, 1, 0x007f, 0x8001, 0x7f7f,
        ],
        _ => vec![0, 1, u64::MAX, 1 << 7, 1 << 15, 1 << 31, 1 << 63, 0x55],
    };
    let w = dtype.lane_width();
    let mut out: Vec<u8> = v
        .iter()
        .flat_map(|x| x.to_le_bytes()[..w].to_vec())
        .collect();
    while !out.len().is_multiple_of(dtype.size()) {
        out.extend_from_slice(&v[0].to_le_bytes()[..w]);
    }
    out
}

#[test]
fn every_dtype_round_trips_bit_exactly_with_special_values() {
    for &dtype in DType::all() {
        let sp = specials(dtype);
        // previous: random; current: the specials tiled, with some random elements
        let n = 3000 * dtype.size();
        let prev = lcg_bytes(1, n);
        let mut cur: Vec<u8> = sp.iter().copied().cycle().take(n).collect();
        cur[..64].copy_from_slice(&lcg_bytes(2, 64));
        for o in [opts(1 << 20, 1), opts(256, 2)] {
            round_trip(dtype, None, &cur, &o);
            round_trip(dtype, Some(&prev), &cur, &o);
            round_trip(dtype, Some(&cur), &prev, &o);
            let same = round_trip(dtype, Some(&cur), &cur, &o);
            assert_eq!(read_info(&same).unwrap().mode, Mode::Unchanged);
        }
    }
}

#[test]
fn empty_and_odd_sized_tensors() {
    for &dtype in DType::all() {
        round_trip(dtype, None, &[], &opts(64, 2));
        round_trip(dtype, Some(&[]), &[], &opts(64, 2));
        let cur = lcg_bytes(3, dtype.size() * 7);
        let prev = lcg_bytes(4, dtype.size() * 7);
        round_trip(dtype, Some(&prev), &cur, &opts(16, 3));
    }
    // a scalar: shape []
    let cur = 2.5f32.to_le_bytes();
    let blob = encode(DType::F32, &[], None, &cur, &EncodeOptions::default()).unwrap();
    let (info, back) = decode(&blob.into_vec(), None, 1).unwrap();
    assert_eq!((info.shape.len(), back), (0, cur.to_vec()));
}

#[test]
fn output_does_not_depend_on_thread_count() {
    let prev = lcg_bytes(5, 1 << 16);
    let mut cur = prev.clone();
    for i in (0..cur.len()).step_by(4) {
        cur[i] ^= (i % 7) as u8;
    }
    let a = encode(DType::F32, &[1 << 14], Some(&prev), &cur, &opts(4096, 1)).unwrap();
    let b = encode(DType::F32, &[1 << 14], Some(&prev), &cur, &opts(4096, 4)).unwrap();
    assert_eq!(a.into_vec(), b.into_vec());
}

#[test]
fn every_thread_count_decodes_and_checks_the_hash_of_many_chunks() {
    // Many chunks on several threads: the hash is computed while they decode, in order.
    let prev: Vec<u8> = (0..1 << 15)
        .flat_map(|i| ((i as f32) * 0.01).sin().to_le_bytes())
        .collect();
    let cur: Vec<u8> = prev
        .chunks_exact(4)
        .flat_map(|b| (f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * 1.001).to_le_bytes())
        .collect();
    let blob = encode(DType::F32, &[1 << 15], Some(&prev), &cur, &opts(4096, 3))
        .unwrap()
        .into_vec();
    let mut wrong = prev.clone();
    wrong[70_001] ^= 1;
    for threads in [1, 2, 3, 8] {
        let (_, back) = decode(&blob, Some(&prev), threads).unwrap();
        assert_eq!(back, cur, "{threads} threads");
        assert!(
            matches!(
                decode(&blob, Some(&wrong), threads),
                Err(DeltaError::HashMismatch { .. })
            ),
            "{threads} threads"
        );
        // A damaged chunk stops the workers; the hash thread must not wait for it forever.
        let mut bad = blob.clone();
        let at = bad.len() / 2;
        bad[at] ^= 0x40;
        assert!(
            decode(&bad, Some(&prev), threads).is_err(),
            "{threads} threads"
        );
    }
}

#[test]
fn small_float_changes_compress() {
    // a float32 tensor nudged by about 1e-4 relative: the two high planes are nearly zero
    let prev: Vec<f32> = (0..1 << 16).map(|i| ((i as f32) * 0.001).sin()).collect();
    let cur: Vec<f32> = prev.iter().map(|x| x * (1.0 + 1e-4)).collect();
    let pb: Vec<u8> = prev.iter().flat_map(|x| x.to_le_bytes()).collect();
    let cb: Vec<u8> = cur.iter().flat_map(|x| x.to_le_bytes()).collect();
    let blob = round_trip(DType::F32, Some(&pb), &cb, &EncodeOptions::default());
    assert!(blob.len() * 2 < cb.len(), "{} of {}", blob.len(), cb.len());
}

#[test]
fn lossy_mode_bounds_the_error_and_falls_back_per_chunk() {
    let prev: Vec<f32> = (0..10_000).map(|i| ((i as f32) * 0.01).cos()).collect();
    let mut cur: Vec<f32> = prev.iter().map(|x| x + 3e-3).collect();
    cur[9_999] = f32::NAN; // forces the last chunk to be lossless
    let pb: Vec<u8> = prev.iter().flat_map(|x| x.to_le_bytes()).collect();
    let cb: Vec<u8> = cur.iter().flat_map(|x| x.to_le_bytes()).collect();
    let o = EncodeOptions {
        max_abs_error: Some(1e-3),
        chunk_bytes: 4096,
        ..opts(4096, 2)
    };
    let enc = encode(DType::F32, &[10_000], Some(&pb), &cb, &o).unwrap();
    assert_eq!(enc.mode(), Mode::Lossy);
    let blob = enc.into_vec();
    let (_, back) = decode(&blob, Some(&pb), 2).unwrap();
    for (i, (b, c)) in back.chunks_exact(4).zip(&cur).enumerate() {
        let b = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        if c.is_nan() {
            assert_eq!(b.to_bits(), c.to_bits());
        } else {
            assert!(
                (f64::from(b) - f64::from(*c)).abs() <= 1e-3,
                "{i}: {b} vs {c}"
            );
        }
    }
    // the NaN's chunk is exact
    assert_eq!(&back[36_864..], &cb[36_864..]);
    // integers ignore the lossy option
    let ints = lcg_bytes(9, 400);
    let prev_ints = lcg_bytes(10, 400);
    let enc = encode(DType::I32, &[100], Some(&prev_ints), &ints, &o).unwrap();
    assert_eq!(enc.mode(), Mode::Delta);
    // a bad bound is an argument error
    let bad = EncodeOptions {
        max_abs_error: Some(-1.0),
        ..EncodeOptions::default()
    };
    assert!(matches!(
        encode(DType::F32, &[100], Some(&prev_ints), &ints, &bad),
        Err(DeltaError::InvalidArgument(_))
    ));
}

#[test]
fn argument_errors() {
    let d = EncodeOptions::default();
    assert!(matches!(
        encode(DType::F32, &[3], None, &[0u8; 8], &d),
        Err(DeltaError::InvalidArgument(_))
    ));
    assert!(matches!(
        encode(DType::F32, &[2], Some(&[0u8; 4]), &[0u8; 8], &d),
        Err(DeltaError::PrevMismatch(_))
    ));
    let blob = encode(DType::F32, &[2], Some(&[1u8; 8]), &[0u8; 8], &d)
        .unwrap()
        .into_vec();
    assert!(matches!(
        decode(&blob, None, 1),
        Err(DeltaError::PrevMismatch(_))
    ));
    assert!(matches!(
        decode(&blob, Some(&[0u8; 4]), 1),
        Err(DeltaError::PrevMismatch(_))
    ));
    // the wrong previous tensor is caught by the content hash
    assert!(matches!(
        decode(&blob, Some(&[2u8; 8]), 1),
        Err(DeltaError::HashMismatch { .. })
    ));
}

fn sample_blob() -> (Vec<u8>, Vec<u8>) {
    let prev: Vec<f32> = (0..3000).map(|i| (i as f32 * 0.1).sin()).collect();
    let cur: Vec<f32> = prev.iter().map(|x| x * 1.001).collect();
    let pb: Vec<u8> = prev.iter().flat_map(|x| x.to_le_bytes()).collect();
    let cb: Vec<u8> = cur.iter().flat_map(|x| x.to_le_bytes()).collect();
    let blob = encode(DType::F32, &[3000], Some(&pb), &cb, &opts(4096, 1))
        .unwrap()
        .into_vec();
    (pb, blob)
}

#[test]
fn every_truncation_and_every_single_bit_flip_is_an_error() {
    let (prev, blob) = sample_blob();
    for len in 0..blob.len() {
        assert!(
            decode(&blob[..len], Some(&prev), 1).is_err(),
            "truncated to {len}"
        );
    }
    for i in 0..blob.len() {
        for bit in 0..8 {
            let mut b = blob.clone();
            b[i] ^= 1 << bit;
            assert!(decode(&b, Some(&prev), 1).is_err(), "bit {bit} of byte {i}");
        }
    }
    let mut longer = blob.clone();
    longer.push(0);
    assert!(matches!(
        decode(&longer, Some(&prev), 1),
        Err(DeltaError::Corrupt(_))
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn decoding_random_bytes_never_panics(data in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode(&data, None, 1);
        let _ = decode(&data, Some(&data), 2);
        let _ = read_info(&data);
    }

    #[test]
    fn decoding_mutated_blobs_never_panics(
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let (prev, mut blob) = sample_blob();
        for (at, v) in edits {
            let i = at % blob.len();
            blob[i] = v;
        }
        let _ = decode(&blob, Some(&prev), 2);
        let _ = decode(&blob[..cut % (blob.len() + 1)], Some(&prev), 1);
    }

    #[test]
    fn random_tensors_round_trip(
        dt in 0u8..15,
        n in 0usize..300,
        seed in any::<u64>(),
        chunk in 16usize..600,
    ) {
        let dtype = DType::from_code(dt).unwrap();
        let cur = lcg_bytes(seed, n * dtype.size());
        let mut prev = cur.clone();
        for i in (0..prev.len()).step_by(3) {
            prev[i] = prev[i].wrapping_add((seed % 5) as u8);
        }
        round_trip(dtype, Some(&prev), &cur, &opts(chunk, 2));
        round_trip(dtype, None, &cur, &opts(chunk, 1));
    }
}

/// The first chunk's transform code.
fn first_transform(blob: &[u8]) -> u8 {
    blob[read_info(blob).unwrap().header_len]
}

#[test]
fn a_common_decay_factor_is_predicted_exactly() {
    // cur = 0.9 · prev, computed in each format: coded against the scaled previous tensor,
    // every ulp distance is zero, except at the special values (kept as they are).
    let n = 20_000usize;
    let vals: Vec<f64> = (0..n)
        .map(|i| ((i * 7919 % 10_007) as f64 - 5003.0) * 1e-4)
        .collect();
    for dtype in [DType::F32, DType::C64, DType::BF16, DType::F64, DType::C128] {
        let (prev, cur): (Vec<u8>, Vec<u8>) = match dtype {
            DType::F32 | DType::C64 => (
                vals.iter()
                    .flat_map(|&v| (v as f32).to_le_bytes())
                    .collect(),
                vals.iter()
                    .flat_map(|&v| ((v as f32) * 0.9f32).to_le_bytes())
                    .collect(),
            ),
            DType::F64 | DType::C128 => (
                vals.iter().flat_map(|&v| v.to_le_bytes()).collect(),
                vals.iter()
                    .flat_map(|&v| (v * f64::from(0.9f32)).to_le_bytes())
                    .collect(),
            ),
            _ => {
                // bfloat16 by truncation of float32 values that are exact in bfloat16
                let bf = |x: f32| ((x.to_bits() >> 16) as u16).to_le_bytes();
                let p: Vec<f32> = vals
                    .iter()
                    .map(|&v| f32::from_bits((v as f32).to_bits() & 0xffff_0000))
                    .collect();
                (
                    p.iter().flat_map(|&x| bf(x)).collect(),
                    p.iter().flat_map(|&x| bf(x * 0.75)).collect(),
                )
            }
        };
        let len = cur.len() - cur.len() % dtype.size();
        let (mut prev, mut cur) = (prev[..len].to_vec(), cur[..len].to_vec());
        // Special values in both, and a few changed elements.
        let sp = specials(dtype);
        let m = sp.len().min(prev.len() / 2);
        prev[..m].copy_from_slice(&sp[..m]);
        cur[..m].copy_from_slice(&sp[..m]);
        cur[m] ^= 0x5a;
        let blob = round_trip(dtype, Some(&prev), &cur, &opts(1 << 20, 2));
        assert_eq!(first_transform(&blob), 5, "{dtype:?}: the scaled transform");
        assert!(
            blob.len() * 20 < cur.len(),
            "{dtype:?}: {} bytes of {}",
            blob.len(),
            cur.len()
        );
        // Against an unrelated tensor the factor is not used.
        let noise = lcg_bytes(9, cur.len());
        let blob = round_trip(dtype, Some(&noise), &cur, &opts(1 << 20, 1));
        assert_eq!(first_transform(&blob), 3, "{dtype:?}: plain ulp distance");
    }
}

#[test]
fn a_scale_factor_out_of_range_is_corrupt() {
    let (prev, blob) = sample_blob();
    let at = read_info(&blob).unwrap().header_len;
    assert_eq!(blob[at], 5);
    for bad in [0.0f32, f32::NAN, f32::INFINITY, 1e-20, 1e20] {
        let mut b = blob.clone();
        b[at + 3..at + 7].copy_from_slice(&bad.to_le_bytes());
        // Re-seal the chunk so that only the factor is wrong.
        let info = read_info(&b).unwrap();
        let end = at + info.chunk_lens[0] as usize;
        let crc = crc32c::crc32c(&b[at..end - 4]);
        b[end - 4..end].copy_from_slice(&crc.to_le_bytes());
        match decode(&b, Some(&prev), 1) {
            Err(DeltaError::Corrupt(m)) => assert!(m.contains("scale factor"), "{m}"),
            other => panic!("{bad}: {other:?}"),
        }
    }
}
