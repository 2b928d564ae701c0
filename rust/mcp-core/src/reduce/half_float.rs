//! Kernels for f16 and bf16: widen a block to f32, reduce there, round back to nearest even.

use super::native::apply;
use crate::dtype::ReduceOp;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

const BLOCK: usize = 1024;

fn blocks<H: Copy>(
    dst: &mut [H],
    src: Option<&[H]>,
    widen: impl Fn(&[H], &mut [f32]),
    narrow: impl Fn(&[f32], &mut [H]),
    f: impl Fn(&mut [f32], &[f32]),
) {
    let mut a = [0f32; BLOCK];
    let mut b = [0f32; BLOCK];
    for (i, d) in dst.chunks_mut(BLOCK).enumerate() {
        let n = d.len();
        widen(d, &mut a[..n]);
        if let Some(src) = src {
            widen(&src[i * BLOCK..i * BLOCK + n], &mut b[..n]);
        }
        f(&mut a[..n], &b[..n]);
        narrow(&a[..n], d);
    }
}

fn widen_f16(h: &[f16], f: &mut [f32]) {
    h.convert_to_f32_slice(f)
}
fn narrow_f16(f: &[f32], h: &mut [f16]) {
    h.convert_from_f32_slice(f)
}
fn widen_bf16(h: &[bf16], f: &mut [f32]) {
    for (x, y) in h.iter().zip(f.iter_mut()) {
        *y = f32::from_bits((x.to_bits() as u32) << 16);
    }
}
fn narrow_bf16(f: &[f32], h: &mut [bf16]) {
    for (x, y) in f.iter().zip(h.iter_mut()) {
        *y = bf16::from_f32(*x);
    }
}

/// `dst = op(dst, src)` for f16, accumulating in f32.
pub(crate) fn apply_f16(op: ReduceOp, dst: &mut [f16], src: &[f16]) {
    let n = dst.len().min(src.len());
    blocks(
        &mut dst[..n],
        Some(&src[..n]),
        widen_f16,
        narrow_f16,
        |a, b| apply(op, a, b),
    );
}

/// `dst = op(dst, src)` for bf16, accumulating in f32.
pub(crate) fn apply_bf16(op: ReduceOp, dst: &mut [bf16], src: &[bf16]) {
    let n = dst.len().min(src.len());
    blocks(
        &mut dst[..n],
        Some(&src[..n]),
        widen_bf16,
        narrow_bf16,
        |a, b| apply(op, a, b),
    );
}

/// `buf /= n` for f16.
pub(crate) fn divide_f16(buf: &mut [f16], n: f32) {
    blocks(buf, None, widen_f16, narrow_f16, |a, _| {
        super::native::divide(a, n)
    });
}

/// `buf /= n` for bf16.
pub(crate) fn divide_bf16(buf: &mut [bf16], n: f32) {
    blocks(buf, None, widen_bf16, narrow_bf16, |a, _| {
        super::native::divide(a, n)
    });
}
