//! A cheap estimate of a plane's order-0 entropy, and the choice of coder it implies.

/// Below this sampled entropy (bits per byte) a plane is mostly one value (the unchanged
/// elements of a delta, the zeros of a sparse tensor): zstd's runs and matches beat any
/// order-0 coder there (Huffman spends at least one bit per byte).
pub const ZSTD_ENTROPY: f64 = 2.0;
/// Above this sampled entropy a plane (noisy low mantissa bytes) is stored raw untried when
/// the ratio comes first; a caller for which speed comes first (the wire codec: 7.5) passes
/// a lower bound to [`choose`].
pub const RAW_ENTROPY: f64 = 7.9;
/// Planes shorter than this are stored raw: no coder pays for its header there.
const MIN_CODED: usize = 64;

/// How a plane should be coded, by [`choose`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// zstd (mostly one value: runs).
    Zstd,
    /// Canonical Huffman (order-0 redundancy only, as in exponent bytes).
    Huffman,
    /// The raw bytes (too short, or close to 8 bits of entropy).
    Raw,
}

/// The coder for `plane`, from its [`sampled_entropy`]: zstd below [`ZSTD_ENTROPY`], raw
/// above `raw_entropy` (e.g. [`RAW_ENTROPY`]), Huffman between. The caller still falls back
/// to raw when the coded form is not smaller.
pub fn choose(plane: &[u8], raw_entropy: f64) -> Choice {
    if plane.len() < MIN_CODED {
        return Choice::Raw;
    }
    let h = sampled_entropy(plane);
    if h < ZSTD_ENTROPY {
        Choice::Zstd
    } else if h < raw_entropy {
        Choice::Huffman
    } else {
        Choice::Raw
    }
}

/// Bytes sampled by [`sampled_entropy`]: enough for an estimate within a few hundredths of a
/// bit of 8 on random bytes, few enough to cost a small fraction of coding the plane.
const SAMPLE: usize = 8192;

/// Order-0 entropy in bits per byte estimated from a sample of at most [`SAMPLE`] bytes
/// spread evenly over `plane` (0 for an empty plane).
pub fn sampled_entropy(plane: &[u8]) -> f64 {
    sampled_entropy_with(plane, SAMPLE)
}

/// [`sampled_entropy`] from a sample of at most `sample` bytes (at least 1).
pub fn sampled_entropy_with(plane: &[u8], sample: usize) -> f64 {
    // Four tables, so that runs of one byte do not serialise the increments.
    let mut hist = [[0u32; 256]; 4];
    let step = (plane.len() / sample.max(1)).max(1);
    let mut total = 0u32;
    for (i, b) in plane.iter().step_by(step).enumerate() {
        hist[i & 3][usize::from(*b)] += 1;
        total += 1;
    }
    if total == 0 {
        return 0.0;
    }
    let t = f64::from(total);
    (0..256)
        .map(|s| hist.iter().map(|h| h[s]).sum::<u32>())
        .filter(|&c| c > 0)
        .map(|c| {
            let p = f64::from(c) / t;
            -p * p.log2()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds() {
        assert_eq!(sampled_entropy(&[]), 0.0);
        assert_eq!(sampled_entropy(&[5; 1000]), 0.0);
        // Exactly SAMPLE bytes: every one is counted.
        let all: Vec<u8> = (0..=255u8).cycle().take(SAMPLE).collect();
        assert!((sampled_entropy(&all) - 8.0).abs() < 1e-9);
        assert!((sampled_entropy(&[0, 1, 0, 1]) - 1.0).abs() < 1e-9);
    }

    #[test]
    fn choices() {
        assert_eq!(choose(&[0u8; 63], RAW_ENTROPY), Choice::Raw);
        assert_eq!(choose(&[0u8; 1000], RAW_ENTROPY), Choice::Zstd);
        let nibbles: Vec<u8> = (0..1600u32).map(|i| (i * 7 % 16) as u8).collect();
        assert_eq!(choose(&nibbles, RAW_ENTROPY), Choice::Huffman);
        let all: Vec<u8> = (0..=255u8).cycle().take(SAMPLE).collect();
        assert_eq!(choose(&all, RAW_ENTROPY), Choice::Raw);
        assert_eq!(choose(&nibbles, 3.0), Choice::Raw);
    }
}
