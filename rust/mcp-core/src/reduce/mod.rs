//! Element-wise reduction kernels: `dst = op(dst, src)` for every dtype and op.
//!
//! Kernels are plain loops that LLVM vectorises; on x86-64 the same loops are compiled a
//! second time with AVX2 enabled and chosen at run time, so one wheel runs everywhere and
//! uses the wide registers where they exist.

mod half_float;
mod native;

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use ::half::{bf16, f16};
use bytemuck::Pod;

/// Combines `src` into `dst` element-wise: `dst[i] = op(dst[i], src[i])`.
///
/// `Avg` accumulates like `Sum`; call [`finish_avg`] once all contributions are in.
/// Both slices hold elements of `dtype` in native byte order; they may be unaligned.
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) -> Result<()> {
    if dst.len() != src.len() || !dst.len().is_multiple_of(dtype.size()) {
        return Err(Error::InvalidArgument(format!(
            "reduce of {} bytes into {} bytes of {dtype}",
            src.len(),
            dst.len()
        )));
    }
    let op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    if op == ReduceOp::None {
        dst.copy_from_slice(src);
        return Ok(());
    }
    op.check(dtype)?;
    match dtype {
        DType::F32 => typed::<f32>(dst, src, |d, s| native::apply(op, d, s)),
        DType::F64 => typed::<f64>(dst, src, |d, s| native::apply(op, d, s)),
        DType::I32 => typed::<i32>(dst, src, |d, s| native::apply(op, d, s)),
        DType::I64 => typed::<i64>(dst, src, |d, s| native::apply(op, d, s)),
        DType::U8 => typed::<u8>(dst, src, |d, s| native::apply(op, d, s)),
        DType::I8 => typed::<i8>(dst, src, |d, s| native::apply(op, d, s)),
        DType::I16 => typed::<i16>(dst, src, |d, s| native::apply(op, d, s)),
        DType::U16 => typed::<u16>(dst, src, |d, s| native::apply(op, d, s)),
        DType::U32 => typed::<u32>(dst, src, |d, s| native::apply(op, d, s)),
        DType::U64 => typed::<u64>(dst, src, |d, s| native::apply(op, d, s)),
        DType::Bool => native::apply_bool(op, dst, src),
        // A complex sum is the sum of the real and imaginary parts (op.check allows no other).
        DType::C64 => typed::<f32>(dst, src, |d, s| native::apply(op, d, s)),
        DType::C128 => typed::<f64>(dst, src, |d, s| native::apply(op, d, s)),
        DType::F16 => typed::<f16>(dst, src, |d, s| half_float::apply_f16(op, d, s)),
        DType::BF16 => typed::<bf16>(dst, src, |d, s| half_float::apply_bf16(op, d, s)),
        DType::F8E4M3 | DType::F8E5M2 | DType::F8E4M3Uz | DType::F8E5M2Uz => {
            unreachable!("op.check refuses to reduce 8-bit floats")
        }
    }
    Ok(())
}

/// Divides every element by `n`, finishing an `Avg` reduction (floating dtypes only).
pub fn finish_avg(dtype: DType, buf: &mut [u8], n: usize) -> Result<()> {
    match dtype {
        DType::F32 | DType::C64 => typed_unary::<f32>(buf, |b| native::divide(b, n as f32)),
        DType::F64 | DType::C128 => typed_unary::<f64>(buf, |b| native::divide(b, n as f64)),
        DType::F16 => typed_unary::<f16>(buf, |b| half_float::divide_f16(b, n as f32)),
        DType::BF16 => typed_unary::<bf16>(buf, |b| half_float::divide_bf16(b, n as f32)),
        _ => return ReduceOp::Avg.check(dtype),
    }
    Ok(())
}

/// Views both byte slices as `T` and runs `f`, copying through aligned scratch when the bytes
/// are not aligned for `T`. A received payload comes in the pieces QUIC delivered, at any
/// offset, so an unaligned source is the common case: it goes through a per-thread scratch
/// buffer (one copy that stays in cache, no allocation). An unaligned destination is rare.
fn typed<T: Pod>(dst: &mut [u8], src: &[u8], f: impl Fn(&mut [T], &[T])) {
    match (
        bytemuck::try_cast_slice_mut::<u8, T>(dst),
        bytemuck::try_cast_slice::<u8, T>(src),
    ) {
        (Ok(d), Ok(s)) => f(d, s),
        (Ok(d), Err(_)) => with_aligned::<T>(src, |s| f(d, s)),
        (Err(_), _) => {
            let mut d = aligned_copy::<T>(dst);
            match bytemuck::try_cast_slice::<u8, T>(src) {
                Ok(s) => f(&mut d, s),
                Err(_) => f(&mut d, &aligned_copy::<T>(src)),
            }
            dst.copy_from_slice(bytemuck::cast_slice(&d));
        }
    }
}

fn typed_unary<T: Pod>(buf: &mut [u8], f: impl Fn(&mut [T])) {
    match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
        Ok(b) => f(b),
        Err(_) => {
            let mut b = aligned_copy::<T>(buf);
            f(&mut b);
            buf.copy_from_slice(bytemuck::cast_slice(&b));
        }
    }
}

/// Largest source the per-thread scratch keeps between calls (bigger ones allocate).
const SCRATCH_WORDS: usize = (256 << 10) / 8;

thread_local! {
    static SCRATCH: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on `bytes` copied into 8-byte-aligned scratch, viewed as `T` (every dtype's
/// alignment divides 8).
fn with_aligned<T: Pod>(bytes: &[u8], f: impl FnOnce(&[T])) {
    let words = bytes.len().div_ceil(8);
    if words > SCRATCH_WORDS {
        return f(&aligned_copy::<T>(bytes));
    }
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => {
            if scratch.len() < words {
                scratch.resize(words, 0);
            }
            let raw = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut scratch)[..bytes.len()];
            raw.copy_from_slice(bytes);
            f(bytemuck::cast_slice::<u8, T>(raw))
        }
        // Re-entered (cannot happen with the kernels above, which do not nest): allocate.
        Err(_) => f(&aligned_copy::<T>(bytes)),
    })
}

fn aligned_copy<T: Pod>(bytes: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
    v
}

/// `dst[i] += src[i]` on f32 with the widest SIMD the CPU offers (the parameter server sums
/// gradients with it).
pub(crate) fn add_f32(dst: &mut [f32], src: &[f32]) {
    native::apply(ReduceOp::Sum, dst, src)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T: Pod>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    #[test]
    fn narrow_and_unsigned_integers_wrap_like_torch() {
        let mut d = bytes(&[127i8, -128, 5]);
        reduce_into(DType::I8, ReduceOp::Sum, &mut d, &bytes(&[1i8, -1, -7])).expect("i8");
        assert_eq!(d, bytes(&[-128i8, 127, -2]));
        let mut d = bytes(&[300i16, -2]);
        reduce_into(DType::I16, ReduceOp::Prod, &mut d, &bytes(&[300i16, 7])).expect("i16");
        assert_eq!(d, bytes(&[300i16.wrapping_mul(300), -14]));
        let mut d = bytes(&[u16::MAX, 3]);
        reduce_into(DType::U16, ReduceOp::Sum, &mut d, &bytes(&[1u16, 4])).expect("u16");
        assert_eq!(d, bytes(&[0u16, 7]));
        let mut d = bytes(&[7u32, u32::MAX]);
        reduce_into(DType::U32, ReduceOp::Min, &mut d, &bytes(&[9u32, 1])).expect("u32");
        assert_eq!(d, bytes(&[7u32, 1]));
        let mut d = bytes(&[1u64 << 63, 2]);
        reduce_into(DType::U64, ReduceOp::Max, &mut d, &bytes(&[1u64, 3])).expect("u64");
        assert_eq!(d, bytes(&[1u64 << 63, 3]));
    }

    #[test]
    fn bools_sum_and_max_as_or_prod_and_min_as_and() {
        let (a, b) = ([0u8, 0, 1, 1], [0u8, 1, 0, 2]);
        for (op, want) in [
            (ReduceOp::Sum, [0u8, 1, 1, 1]),
            (ReduceOp::Max, [0, 1, 1, 1]),
            (ReduceOp::Prod, [0, 0, 0, 1]),
            (ReduceOp::Min, [0, 0, 0, 1]),
        ] {
            let mut d = a.to_vec();
            reduce_into(DType::Bool, op, &mut d, &b).expect("bool");
            assert_eq!(d, want, "{op}");
        }
        assert!(ReduceOp::Avg.check(DType::Bool).is_err());
    }

    #[test]
    fn bitwise_ops_reduce_every_integer_type_bit_by_bit() {
        fn case<T: Pod + PartialEq + std::fmt::Debug>(
            dtype: DType,
            a: &[T],
            b: &[T],
            want: [Vec<T>; 3],
        ) {
            for (op, want) in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor]
                .into_iter()
                .zip(want)
            {
                let mut d = bytes(a);
                reduce_into(dtype, op, &mut d, &bytes(b)).expect("bitwise");
                assert_eq!(d, bytes(&want), "{dtype} {op}");
            }
        }
        let (a, b) = ([0b1100u8, 0xff, 0], [0b1010u8, 0x0f, 0]);
        case(
            DType::U8,
            &a,
            &b,
            [
                vec![0b1000, 0x0f, 0],
                vec![0b1110, 0xff, 0],
                vec![0b0110, 0xf0, 0],
            ],
        );
        case(
            DType::I8,
            &[-1i8, 12],
            &[5i8, -16],
            [vec![5, 0], vec![-1, -4], vec![-6, -4]],
        );
        case(
            DType::I16,
            &[-256i16],
            &[0x7f0fi16],
            [vec![0x7f00], vec![-241], vec![-32753]],
        );
        case(
            DType::U16,
            &[0xf0f0u16],
            &[0xff00u16],
            [vec![0xf000], vec![0xfff0], vec![0x0ff0]],
        );
        let (x, y) = (0xdead_beefu32, 0x0f0f_f0f0u32);
        case(
            DType::U32,
            &[x],
            &[y],
            [vec![x & y], vec![x | y], vec![x ^ y]],
        );
        case(
            DType::I32,
            &[x as i32],
            &[y as i32],
            [
                vec![(x & y) as i32],
                vec![(x | y) as i32],
                vec![(x ^ y) as i32],
            ],
        );
        let (x, y) = (u64::MAX - 5, 1u64 << 40 | 6);
        case(
            DType::U64,
            &[x],
            &[y],
            [vec![x & y], vec![x | y], vec![x ^ y]],
        );
        case(
            DType::I64,
            &[x as i64],
            &[y as i64],
            [
                vec![(x & y) as i64],
                vec![(x | y) as i64],
                vec![(x ^ y) as i64],
            ],
        );
        // Bools as torch's Gloo takes them: logical and, or, xor, results 0 or 1.
        case(
            DType::Bool,
            &[0u8, 0, 1, 1],
            &[0u8, 1, 0, 2],
            [vec![0, 0, 0, 1], vec![0, 1, 1, 1], vec![0, 1, 1, 0]],
        );
    }

    #[test]
    fn bitwise_ops_refuse_floating_and_complex_types() {
        for dtype in [
            DType::F32,
            DType::F64,
            DType::F16,
            DType::BF16,
            DType::C64,
            DType::C128,
        ] {
            for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
                let n = dtype.size();
                match reduce_into(dtype, op, &mut vec![0u8; n], &vec![0u8; n]) {
                    Err(Error::InvalidArgument(m)) => assert!(m.contains("bitwise"), "{m}"),
                    other => panic!("{dtype} {op}: {other:?}"),
                }
            }
        }
        assert_eq!(ReduceOp::from_name("BXOR").expect("name"), ReduceOp::BXor);
        for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
            assert_eq!(ReduceOp::from_code(op as u8), Some(op));
            assert_eq!(ReduceOp::from_name(op.name()).expect("name"), op);
        }
    }

    #[test]
    fn complex_sums_and_averages_part_by_part_and_nothing_else() {
        let mut d = bytes(&[1.0f32, -2.0, 0.5, 4.0]);
        reduce_into(
            DType::C64,
            ReduceOp::Sum,
            &mut d,
            &bytes(&[3.0f32, 1.0, 0.5, -4.0]),
        )
        .expect("c64");
        assert_eq!(d, bytes(&[4.0f32, -1.0, 1.0, 0.0]));
        finish_avg(DType::C64, &mut d, 2).expect("avg");
        assert_eq!(d, bytes(&[2.0f32, -0.5, 0.5, 0.0]));
        let mut d = bytes(&[1.0f64, 2.0]);
        reduce_into(DType::C128, ReduceOp::Sum, &mut d, &bytes(&[0.25f64, -2.0])).expect("c128");
        assert_eq!(d, bytes(&[1.25f64, 0.0]));
        for op in [ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod] {
            let err = reduce_into(DType::C64, op, &mut [0u8; 8], &[0; 8]);
            assert!(matches!(err, Err(Error::InvalidArgument(_))), "{op}");
        }
    }

    #[test]
    fn eight_bit_floats_are_moved_never_reduced() {
        for dtype in [
            DType::F8E4M3,
            DType::F8E5M2,
            DType::F8E4M3Uz,
            DType::F8E5M2Uz,
        ] {
            let err = reduce_into(dtype, ReduceOp::Sum, &mut [1u8; 4], &[2u8; 4]);
            assert!(matches!(err, Err(Error::InvalidArgument(_))), "{dtype}");
            let mut d = [1u8; 4];
            reduce_into(dtype, ReduceOp::None, &mut d, &[9u8; 4]).expect("moved");
            assert_eq!(d, [9u8; 4]);
        }
    }

    #[test]
    fn every_dtype_name_and_code_round_trips() {
        for d in DType::ALL {
            assert_eq!(DType::from_name(d.name()).expect("name"), d);
            assert_eq!(DType::from_code(d as u8), Some(d));
        }
    }

    #[test]
    fn f32_ops_match_scalar_reference() {
        let a: Vec<f32> = (0..1003).map(|i| i as f32 * 0.5 - 100.0).collect();
        let b: Vec<f32> = (0..1003).map(|i| (i as f32).sin() * 300.0).collect();
        for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max, ReduceOp::Prod] {
            let mut d = bytes(&a);
            reduce_into(DType::F32, op, &mut d, &bytes(&b)).expect("reduce");
            let got: &[f32] = bytemuck::cast_slice(&d);
            for i in 0..a.len() {
                let want = match op {
                    ReduceOp::Sum => a[i] + b[i],
                    ReduceOp::Min => a[i].min(b[i]),
                    ReduceOp::Max => a[i].max(b[i]),
                    _ => a[i] * b[i],
                };
                assert_eq!(got[i].to_bits(), want.to_bits(), "{op} at {i}");
            }
        }
    }

    #[test]
    fn nan_propagates_through_min_and_max() {
        for op in [ReduceOp::Min, ReduceOp::Max] {
            let mut d = bytes(&[f32::NAN, 1.0, 2.0]);
            reduce_into(DType::F32, op, &mut d, &bytes(&[0.0f32, f32::NAN, 3.0])).expect("reduce");
            let got: &[f32] = bytemuck::cast_slice(&d);
            assert!(got[0].is_nan() && got[1].is_nan(), "{op}: {got:?}");
        }
    }

    #[test]
    fn integers_wrap() {
        let mut d = bytes(&[i32::MAX, 3, -7]);
        reduce_into(DType::I32, ReduceOp::Sum, &mut d, &bytes(&[1i32, 4, 7])).expect("reduce");
        assert_eq!(bytemuck::cast_slice::<u8, i32>(&d), &[i32::MIN, 7, 0]);
        let mut d = vec![200u8, 3];
        reduce_into(DType::U8, ReduceOp::Prod, &mut d, &[2, 5]).expect("reduce");
        assert_eq!(d, vec![144, 15]);
    }

    #[test]
    fn half_types_round_to_nearest_even() {
        let a: Vec<f16> = (0..777).map(|i| f16::from_f32(i as f32 * 0.37)).collect();
        let b: Vec<f16> = (0..777)
            .map(|i| f16::from_f32(1.0 / (i as f32 + 1.0)))
            .collect();
        let mut d = bytes(&a);
        reduce_into(DType::F16, ReduceOp::Sum, &mut d, &bytes(&b)).expect("reduce");
        let got: &[f16] = bytemuck::cast_slice(&d);
        for i in 0..a.len() {
            assert_eq!(got[i], f16::from_f32(a[i].to_f32() + b[i].to_f32()));
        }
        let a: Vec<bf16> = (0..777).map(|i| bf16::from_f32(i as f32 * 0.37)).collect();
        let b: Vec<bf16> = (0..777)
            .map(|i| bf16::from_f32(-(i as f32) * 1.1))
            .collect();
        for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Max] {
            let mut d = bytes(&a);
            reduce_into(DType::BF16, op, &mut d, &bytes(&b)).expect("reduce");
            let got: &[bf16] = bytemuck::cast_slice(&d);
            for i in 0..a.len() {
                let (x, y) = (a[i].to_f32(), b[i].to_f32());
                let want = match op {
                    ReduceOp::Sum => x + y,
                    ReduceOp::Prod => x * y,
                    _ => x.max(y),
                };
                assert_eq!(got[i], bf16::from_f32(want), "{op} at {i}");
            }
        }
    }

    #[test]
    fn unaligned_inputs_give_the_same_result() {
        let a: Vec<f64> = (0..100).map(|i| i as f64).collect();
        let mut backing = vec![0u8; 801];
        backing[1..].copy_from_slice(&bytes(&a));
        let mut dst = bytes(&a);
        reduce_into(DType::F64, ReduceOp::Sum, &mut dst, &backing[1..]).expect("reduce");
        let mut dst2 = vec![0u8; 801];
        dst2[1..].copy_from_slice(&bytes(&a));
        reduce_into(DType::F64, ReduceOp::Sum, &mut dst2[1..], &bytes(&a)).expect("reduce");
        assert_eq!(dst, dst2[1..].to_vec());
        assert_eq!(bytemuck::cast_slice::<u8, f64>(&dst)[99], 198.0);
    }

    #[test]
    fn avg_divides_and_rejects_integers() {
        let mut d = bytes(&[3.0f32, 6.0]);
        finish_avg(DType::F32, &mut d, 3).expect("avg");
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&d), &[1.0, 2.0]);
        assert!(finish_avg(DType::I64, &mut [0u8; 8], 2).is_err());
    }

    #[test]
    fn length_mismatch_is_an_error() {
        assert!(reduce_into(DType::F32, ReduceOp::Sum, &mut [0u8; 8], &[0u8; 4]).is_err());
        assert!(reduce_into(DType::F32, ReduceOp::Sum, &mut [0u8; 6], &[0u8; 6]).is_err());
    }
}
