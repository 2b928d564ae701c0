//! Kernels for the types the CPU adds natively: f32, f64 and the integers.

use crate::dtype::ReduceOp;

/// An element type with the reduction operators.
pub(crate) trait Elem: Copy + bytemuck::Pod {
    fn add(a: Self, b: Self) -> Self;
    fn mul(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn and(a: Self, b: Self) -> Self;
    fn or(a: Self, b: Self) -> Self;
    fn xor(a: Self, b: Self) -> Self;
}

macro_rules! float_elem {
    ($t:ty) => {
        impl Elem for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a + b
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a * b
            }
            // NaN wins, as in torch.minimum/maximum; the selects vectorise.
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() {
                    a + b
                } else if b < a {
                    b
                } else {
                    a
                }
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() {
                    a + b
                } else if b > a {
                    b
                } else {
                    a
                }
            }
            // `ReduceOp::check` refuses the bitwise ops on floats; on the bits, should
            // anything call them, they are still well defined.
            #[inline(always)]
            fn and(a: Self, b: Self) -> Self {
                Self::from_bits(a.to_bits() & b.to_bits())
            }
            #[inline(always)]
            fn or(a: Self, b: Self) -> Self {
                Self::from_bits(a.to_bits() | b.to_bits())
            }
            #[inline(always)]
            fn xor(a: Self, b: Self) -> Self {
                Self::from_bits(a.to_bits() ^ b.to_bits())
            }
        }
    };
}

macro_rules! int_elem {
    ($t:ty) => {
        impl Elem for $t {
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self {
                a.wrapping_add(b)
            }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self {
                a.wrapping_mul(b)
            }
            #[inline(always)]
            fn min(a: Self, b: Self) -> Self {
                Ord::min(a, b)
            }
            #[inline(always)]
            fn max(a: Self, b: Self) -> Self {
                Ord::max(a, b)
            }
            #[inline(always)]
            fn and(a: Self, b: Self) -> Self {
                a & b
            }
            #[inline(always)]
            fn or(a: Self, b: Self) -> Self {
                a | b
            }
            #[inline(always)]
            fn xor(a: Self, b: Self) -> Self {
                a ^ b
            }
        }
    };
}

float_elem!(f32);
float_elem!(f64);
int_elem!(i32);
int_elem!(i64);
int_elem!(u8);
int_elem!(i8);
int_elem!(i16);
int_elem!(u16);
int_elem!(u32);
int_elem!(u64);

/// Booleans as bytes (any non-zero is true, results are 0 or 1): sum, max and bor are "or",
/// prod, min and band are "and", bxor is "xor", as torch's Gloo backend reduces them.
pub(crate) fn apply_bool(op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    let pairs = dst.iter_mut().zip(src);
    match op {
        ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Max | ReduceOp::BOr => {
            pairs.for_each(|(d, s)| *d = u8::from(*d != 0 || *s != 0))
        }
        ReduceOp::Prod | ReduceOp::Min | ReduceOp::BAnd => {
            pairs.for_each(|(d, s)| *d = u8::from(*d != 0 && *s != 0))
        }
        ReduceOp::BXor => pairs.for_each(|(d, s)| *d = u8::from((*d != 0) != (*s != 0))),
        ReduceOp::None => pairs.for_each(|(d, s)| *d = *s),
    }
}

#[inline(always)]
fn apply_portable<T: Elem>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    // One loop per op so that each vectorises without a call inside.
    let pairs = dst.iter_mut().zip(src);
    match op {
        ReduceOp::Sum | ReduceOp::Avg => pairs.for_each(|(d, s)| *d = T::add(*d, *s)),
        ReduceOp::Prod => pairs.for_each(|(d, s)| *d = T::mul(*d, *s)),
        ReduceOp::Min => pairs.for_each(|(d, s)| *d = T::min(*d, *s)),
        ReduceOp::Max => pairs.for_each(|(d, s)| *d = T::max(*d, *s)),
        ReduceOp::BAnd => pairs.for_each(|(d, s)| *d = T::and(*d, *s)),
        ReduceOp::BOr => pairs.for_each(|(d, s)| *d = T::or(*d, *s)),
        ReduceOp::BXor => pairs.for_each(|(d, s)| *d = T::xor(*d, *s)),
        ReduceOp::None => pairs.for_each(|(d, s)| *d = *s),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn apply_avx2<T: Elem>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    apply_portable(op, dst, src)
}

/// `dst[i] = op(dst[i], src[i])`, with the widest SIMD the CPU offers.
pub(crate) fn apply<T: Elem>(op: ReduceOp, dst: &mut [T], src: &[T]) {
    let n = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked on the line above.
        return unsafe { apply_avx2(op, dst, src) };
    }
    apply_portable(op, dst, src)
}

macro_rules! divide_fn {
    ($t:ty) => {
        impl Divide for $t {
            #[inline(always)]
            fn div(a: Self, n: Self) -> Self {
                a / n
            }
        }
    };
}

/// Floating types that `avg` can divide.
pub(crate) trait Divide: Copy {
    fn div(a: Self, n: Self) -> Self;
}
divide_fn!(f32);
divide_fn!(f64);

/// `buf[i] /= n`.
pub(crate) fn divide<T: Divide>(buf: &mut [T], n: T) {
    buf.iter_mut().for_each(|x| *x = T::div(*x, n));
}
