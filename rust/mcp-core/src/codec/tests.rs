//! Tests of the public codec API: dispatch, lengths, decode_reduce and hostile input.

use super::*;
use proptest::prelude::*;
use rand::{Rng, SeedableRng};

const KINDS: [CodecKind; 6] = [
    CodecKind::None,
    CodecKind::Fp16,
    CodecKind::Bf16,
    CodecKind::Int8 { block: 64 },
    CodecKind::Int8 { block: 5000 },
    CodecKind::Lossless,
];

/// Random element bytes for `dtype`: gradient-like floats (with zeros and a few specials for
/// the float types), arbitrary integers.
fn sample(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut v = Vec::with_capacity(n * dtype.size());
    for i in 0..n {
        let g = if i % 10 == 0 {
            0.0
        } else {
            (rng.random::<f32>() - 0.5) * 2e-3
        };
        match dtype {
            DType::F32 => v.extend_from_slice(&g.to_le_bytes()),
            DType::F64 => v.extend_from_slice(&f64::from(g).to_le_bytes()),
            DType::F16 => v.extend_from_slice(&half::f16::from_f32(g).to_le_bytes()),
            DType::BF16 => v.extend_from_slice(&half::bf16::from_f32(g).to_le_bytes()),
            _ => {
                for _ in 0..dtype.size().div_ceil(8) {
                    let r: u64 = rng.random();
                    v.extend_from_slice(&r.to_le_bytes()[..dtype.size().min(8)]);
                }
            }
        }
    }
    v
}

#[test]
fn codes_and_names_round_trip() {
    for kind in KINDS {
        assert_eq!(
            CodecKind::from_code(kind.to_code(), kind.block()),
            Some(kind)
        );
        assert_eq!(CodecKind::from_name(kind.name(), kind.block()), Ok(kind));
    }
    assert_eq!(CodecKind::from_code(3, 0), None);
    assert_eq!(CodecKind::from_code(5, 1), None);
    assert!(CodecKind::from_name("int8", 0).is_err());
    assert!(CodecKind::from_name("zip", 1).is_err());
    assert!(CodecKind::Fp16.is_lossy() && !CodecKind::Lossless.is_lossy());
    assert!(!CodecKind::None.is_lossy());
}

#[test]
fn unsupported_pairs_are_invalid_arguments() {
    let mut out = Vec::new();
    for (kind, dtype) in [
        (CodecKind::Fp16, DType::BF16),
        (CodecKind::Bf16, DType::F16),
        (CodecKind::Fp16, DType::I32),
        (CodecKind::Int8 { block: 8 }, DType::F64),
        (CodecKind::Int8 { block: 8 }, DType::U8),
        (CodecKind::Int8 { block: 0 }, DType::F32),
    ] {
        let e = encode(kind, dtype, &[0u8; 8], &mut out);
        assert!(
            matches!(e, Err(Error::InvalidArgument(_))),
            "{kind:?} {dtype}"
        );
        let e = decode(kind, dtype, &[0u8; 8], &mut [0u8; 8]);
        assert!(
            matches!(e, Err(Error::InvalidArgument(_))),
            "{kind:?} {dtype}"
        );
    }
    assert!(matches!(
        encode(CodecKind::None, DType::F32, &[0u8; 7], &mut out),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn every_supported_pair_round_trips_within_its_bound_and_length() {
    for kind in KINDS {
        for dtype in DType::ALL {
            if kind.check(dtype).is_err() {
                continue;
            }
            for n in [0usize, 1, 13, 4096, 4097, 70_000] {
                let src = sample(dtype, n, n as u64);
                let mut enc = vec![0xAA]; // encode appends
                encode(kind, dtype, &src, &mut enc).expect("encode");
                assert_eq!(enc[0], 0xAA);
                let enc = &enc[1..];
                assert!(
                    enc.len() <= max_encoded_len(kind, dtype, n),
                    "{kind:?} {dtype}"
                );
                // Decode into an unaligned buffer as well as an aligned one.
                let mut backing = vec![0u8; src.len() + 1];
                decode(kind, dtype, enc, &mut backing[1..]).expect("decode");
                let mut out = vec![0u64; src.len().div_ceil(8)];
                let out = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut out)[..src.len()];
                decode(kind, dtype, enc, out).expect("decode");
                assert_eq!(&backing[1..], &out[..]);
                let exact = !kind.is_lossy()
                    || (kind == CodecKind::Fp16 && dtype == DType::F16)
                    || (kind == CodecKind::Bf16 && dtype == DType::BF16);
                if exact {
                    assert_eq!(out, &src[..], "{kind:?} {dtype}");
                    continue;
                }
                let rel = match kind {
                    CodecKind::Fp16 => 2f64.powi(-11),
                    CodecKind::Bf16 => 2f64.powi(-8),
                    _ => 0.0,
                };
                let to_f64 = |b: &[u8]| -> Vec<f64> {
                    match dtype {
                        DType::F32 => pod_vec::<f32>(b).into_iter().map(f64::from).collect(),
                        _ => pod_vec::<f64>(b),
                    }
                };
                let (want, got) = (to_f64(&src), to_f64(out));
                let block = kind.block().max(1) as usize;
                for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                    let bound = if rel > 0.0 {
                        // fp16 subnormals: absolute half-ulp of 2^-24
                        (a.abs() * rel).max(2f64.powi(-25))
                    } else {
                        let blk = &want[i / block * block..((i / block + 1) * block).min(n)];
                        let max = blk.iter().fold(0f64, |m, v| m.max(v.abs()));
                        max / 127.0 * (0.5 + 1e-4)
                    };
                    assert!((a - b).abs() <= bound, "{kind:?} {dtype} i {i}: {a} -> {b}");
                }
            }
        }
    }
}

#[test]
fn decode_reduce_equals_decode_then_reduce_into() {
    for kind in KINDS {
        for dtype in DType::ALL {
            if kind.check(dtype).is_err() {
                continue;
            }
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Prod] {
                if op.check(dtype).is_err() {
                    continue;
                }
                for n in [0usize, 3, REDUCE_CHUNK, 3 * REDUCE_CHUNK + 17, 70_000] {
                    let src = sample(dtype, n, 1);
                    let acc = sample(dtype, n, 2);
                    let mut enc = Vec::new();
                    encode(kind, dtype, &src, &mut enc).expect("encode");
                    let mut dec = vec![0u8; src.len()];
                    decode(kind, dtype, &enc, &mut dec).expect("decode");
                    let mut want = acc.clone();
                    reduce_into(dtype, op, &mut want, &dec).expect("reduce");
                    let mut got = acc.clone();
                    decode_reduce(kind, dtype, op, &enc, &mut got).expect("decode_reduce");
                    assert_eq!(got, want, "{kind:?} {dtype} {op} n {n}");
                    // Unaligned destination too.
                    let mut backing = vec![0u8; acc.len() + 1];
                    backing[1..].copy_from_slice(&acc);
                    decode_reduce(kind, dtype, op, &enc, &mut backing[1..]).expect("dr");
                    assert_eq!(&backing[1..], &want[..], "{kind:?} {dtype} {op} unaligned");
                }
            }
        }
    }
}

#[test]
fn decode_reduce_refuses_avg_on_integers_and_bad_lengths_untouched() {
    let mut dst = vec![1u8; 16];
    assert!(decode_reduce(
        CodecKind::None,
        DType::I32,
        ReduceOp::Avg,
        &[0; 16],
        &mut dst
    )
    .is_err());
    let mut enc = Vec::new();
    encode(
        CodecKind::Int8 { block: 2 },
        DType::F32,
        &[0u8; 16],
        &mut enc,
    )
    .expect("encode");
    let r = decode_reduce(
        CodecKind::Int8 { block: 2 },
        DType::F32,
        ReduceOp::Sum,
        &enc[..enc.len() - 1],
        &mut dst,
    );
    assert!(matches!(r, Err(Error::Protocol(_))));
    assert_eq!(dst, vec![1u8; 16], "a refused payload must not touch dst");
}

fn all_pairs() -> Vec<(CodecKind, DType)> {
    let mut v = Vec::new();
    for kind in KINDS.into_iter().chain([CodecKind::Int8 { block: 1 }]) {
        for dtype in DType::ALL {
            if kind.check(dtype).is_ok() {
                v.push((kind, dtype));
            }
        }
    }
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn decoding_random_bytes_never_panics(
        data in proptest::collection::vec(any::<u8>(), 0..600),
        n in 0usize..200,
    ) {
        for (kind, dtype) in all_pairs() {
            let mut out = vec![0u8; n * dtype.size()];
            let _ = decode(kind, dtype, &data, &mut out);
            let _ = decode_reduce(kind, dtype, ReduceOp::Sum, &data, &mut out);
        }
    }

    #[test]
    fn decoding_truncated_or_edited_payloads_never_panics(
        n in 0usize..3000,
        cut in any::<prop::sample::Index>(),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
    ) {
        for (kind, dtype) in all_pairs() {
            let src = sample(dtype, n, n as u64);
            let mut enc = Vec::new();
            encode(kind, dtype, &src, &mut enc).expect("encode");
            let mut out = vec![0u8; src.len()];
            if !enc.is_empty() {
                for (at, b) in &edits {
                    let i = at.index(enc.len());
                    enc[i] ^= b;
                }
                let cut = cut.index(enc.len() + 1);
                let _ = decode(kind, dtype, &enc[..cut], &mut out);
                let _ = decode_reduce(kind, dtype, ReduceOp::Max, &enc[..cut], &mut out);
            }
            let _ = decode(kind, dtype, &enc, &mut out);
        }
    }
}
