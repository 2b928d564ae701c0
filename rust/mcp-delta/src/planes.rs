//! Entropy coding of one byte plane.
//!
//! Each plane is stored in the cheapest of three forms: a single repeated byte, zstd, or
//! the raw bytes when zstd would not shrink it. Planes whose sampled order-0 entropy is close
//! to 8 bits per byte (the noisy low bytes of a float delta) are stored raw without trying
//! zstd, which is what keeps encoding fast on them.

use super::error::{DeltaError, Result};

/// How one plane is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Method {
    /// The bytes as they are.
    Raw = 0,
    /// One byte, repeated over the whole plane.
    Const = 1,
    /// A zstd frame.
    Zstd = 2,
}

impl Method {
    /// The method stored under `code`.
    pub fn from_code(code: u8) -> Option<Method> {
        match code {
            0 => Some(Method::Raw),
            1 => Some(Method::Const),
            2 => Some(Method::Zstd),
            _ => None,
        }
    }
}

/// The delta coder samples up to 64 Ki bytes of a plane to estimate its entropy.
fn sampled_entropy(plane: &[u8]) -> f64 {
    crate::entropy::sampled_entropy_with(plane, 65_536)
}

/// Above this sampled entropy (bits per byte) a plane is stored raw without trying zstd.
const RAW_ENTROPY: f64 = 7.9;

/// Encodes planes; holds a zstd context and a scratch buffer for reuse across planes.
pub(crate) struct PlaneEncoder {
    zstd: zstd::bulk::Compressor<'static>,
    scratch: Vec<u8>,
}

impl PlaneEncoder {
    /// A coder at zstd `level`.
    pub(crate) fn new(level: i32) -> Result<Self> {
        let zstd =
            zstd::bulk::Compressor::new(level).map_err(|e| DeltaError::Zstd(e.to_string()))?;
        Ok(PlaneEncoder {
            zstd,
            scratch: Vec::new(),
        })
    }

    /// Appends the coded plane to `out` and returns how it was coded.
    pub(crate) fn encode(&mut self, plane: &[u8], out: &mut Vec<u8>) -> Method {
        let Some(&first) = plane.first() else {
            return Method::Raw;
        };
        if plane.iter().all(|&b| b == first) {
            out.push(first);
            return Method::Const;
        }
        if plane.len() >= 64 && sampled_entropy(plane) < RAW_ENTROPY {
            // A buffer one byte shorter than the plane: zstd fails when it cannot beat raw.
            self.scratch.resize(plane.len() - 1, 0);
            if let Ok(n) = self
                .zstd
                .compress_to_buffer(plane, self.scratch.as_mut_slice())
            {
                if let Some(coded) = self.scratch.get(..n) {
                    out.extend_from_slice(coded);
                    return Method::Zstd;
                }
            }
        }
        out.extend_from_slice(plane);
        Method::Raw
    }
}

/// Decodes planes; holds a zstd context for reuse.
pub(crate) struct PlaneDecoder {
    zstd: zstd::bulk::Decompressor<'static>,
}

impl PlaneDecoder {
    /// A new decoder.
    pub(crate) fn new() -> Result<Self> {
        let zstd = zstd::bulk::Decompressor::new().map_err(|e| DeltaError::Zstd(e.to_string()))?;
        Ok(PlaneDecoder { zstd })
    }

    /// Decodes `payload` coded with `method` into exactly `out.len()` bytes.
    pub(crate) fn decode(&mut self, method: Method, payload: &[u8], out: &mut [u8]) -> Result<()> {
        match method {
            Method::Raw => {
                if payload.len() != out.len() {
                    return Err(DeltaError::Corrupt(format!(
                        "raw plane of {} bytes, expected {}",
                        payload.len(),
                        out.len()
                    )));
                }
                out.copy_from_slice(payload);
            }
            Method::Const => match payload {
                [b] => out.fill(*b),
                _ => {
                    return Err(DeltaError::Corrupt(format!(
                        "constant plane of {} bytes, expected 1",
                        payload.len()
                    )))
                }
            },
            Method::Zstd => {
                let n = self
                    .zstd
                    .decompress_to_buffer(payload, out)
                    .map_err(|e| DeltaError::Corrupt(format!("zstd plane: {e}")))?;
                if n != out.len() {
                    return Err(DeltaError::Corrupt(format!(
                        "zstd plane decoded to {n} bytes, expected {}",
                        out.len()
                    )));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(plane: &[u8]) -> Method {
        let mut enc = PlaneEncoder::new(3).expect("zstd");
        let mut out = Vec::new();
        let m = enc.encode(plane, &mut out);
        let mut dec = PlaneDecoder::new().expect("zstd");
        let mut back = vec![0u8; plane.len()];
        dec.decode(m, &out, &mut back).expect("decode");
        assert_eq!(back, plane);
        m
    }

    #[test]
    fn picks_the_cheapest_method() {
        assert_eq!(round_trip(&[7u8; 1000]), Method::Const);
        let mut s = 1u32;
        let noise: Vec<u8> = (0..100_000)
            .map(|_| {
                s = s.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (s >> 23) as u8
            })
            .collect();
        assert_eq!(round_trip(&noise), Method::Raw);
        let sparse: Vec<u8> = noise.iter().map(|&b| if b < 16 { b } else { 0 }).collect();
        assert_eq!(round_trip(&sparse), Method::Zstd);
        assert_eq!(round_trip(&[]), Method::Raw);
        assert_eq!(round_trip(&[1, 2, 3]), Method::Raw);
    }

    #[test]
    fn rejects_wrong_sizes() {
        let mut dec = PlaneDecoder::new().expect("zstd");
        let mut out = [0u8; 4];
        assert!(dec.decode(Method::Raw, &[1, 2, 3], &mut out).is_err());
        assert!(dec.decode(Method::Const, &[], &mut out).is_err());
        assert!(dec.decode(Method::Zstd, &[1, 2, 3], &mut out).is_err());
        let small = zstd::bulk::compress(&[1u8, 2, 3], 1).expect("zstd");
        assert!(dec.decode(Method::Zstd, &small, &mut out).is_err());
    }
}
