//! Canonical Huffman coding of bytes, code lengths limited to [`MAX_BITS`], in four streams.
//!
//! The input of `n` bytes is cut into four parts (`q = n / 4` bytes each, the last one takes
//! the remainder), each coded into its own bit stream with one code shared by all four, so
//! the decoder advances four independent bit readers at once (instruction-level
//! parallelism) and decodes a symbol with a single lookup in a table of `2^MAX_BITS` entries.
//!
//! ```text
//! 128 bytes   code length of every byte value s (0 = absent, else 1..=11): the low nibble
//!             of byte s/2 for even s, the high nibble for odd s
//! 3 × u32 LE  byte lengths of streams 0, 1 and 2 (stream 3 is the rest of the payload)
//! 4 streams   the codes of each part, least significant bit first; streams 0, 1 and 2
//!             are each followed by GAP (8) bytes of zeros (room for the encoder's word
//!             stores, so that it writes the streams in place)
//! ```
//!
//! The decoded length is not stored: both callers know it. Decoding any bytes at all either
//! fills the output or returns a [`HuffmanError`]; it never panics or reads out of bounds.
//!
//! ```
//! use mcp_delta::entropy::huffman;
//! let data = b"abracadabra, abracadabra, abracadabra".repeat(10);
//! let mut coded = Vec::new();
//! assert!(huffman::encode(&data, &mut coded));
//! assert!(coded.len() < data.len());
//! let mut back = vec![0u8; data.len()];
//! huffman::decode(&coded, &mut back)?;
//! assert_eq!(back, data);
//! # Ok::<(), huffman::HuffmanError>(())
//! ```

/// The longest code, in bits: the decoding table (`2^MAX_BITS` × 2 bytes) stays in L1, and
/// five codes fit the 57 bits a bit-reader refill guarantees.
pub const MAX_BITS: u32 = 11;
/// Bytes of header before the streams.
pub const HEADER_LEN: usize = LENGTHS_LEN + 12;
/// Zero bytes after each of streams 0, 1 and 2: room for the encoder's word stores, so that
/// it writes the streams in place without moving them afterwards.
pub const GAP: usize = 8;

const LENGTHS_LEN: usize = 128;
const TABLE: usize = 1 << MAX_BITS;
/// Symbols coded (or decoded) per stream between two flushes (refills) of the bit buffer.
const BATCH: usize = 5;
/// Decoding-table entry of a bit pattern that starts no code (incomplete code): length 0.
const INVALID: u16 = 0;

/// Why a Huffman payload does not decode.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum HuffmanError {
    /// The payload is shorter than the header.
    #[error("huffman payload of {0} bytes is shorter than its {HEADER_LEN}-byte header")]
    Truncated(usize),
    /// The header's code lengths are out of range or do not form a prefix code.
    #[error("huffman code lengths: {0}")]
    BadLengths(String),
    /// The stream lengths announce more bytes than the payload holds.
    #[error("huffman stream lengths {0:?} exceed the {1} bytes after the header")]
    BadStreams([u32; 3], usize),
    /// A stream holds a bit pattern that is no code, or its length is not that of its codes.
    #[error("huffman stream {0} does not decode to its part of the output")]
    BadStream(usize),
}

/// Inputs above this are refused: their streams' lengths would not fit the header's u32.
const MAX_INPUT: usize = 1 << 33;

/// Codes `src` and appends the payload to `out`; returns `false` (and appends nothing) only
/// for inputs over 8 GiB, whose streams' lengths do not fit the header.
pub fn encode(src: &[u8], out: &mut Vec<u8>) -> bool {
    encode_bounded(src, usize::MAX, out)
}

/// Codes `src` and appends the payload to `out` if it takes at most `max_len` bytes; returns
/// whether it did (if not, `out` is left as it was; inputs over 8 GiB are always refused).
/// The size is computed exactly from the histograms before any bit is written, so a refusal
/// costs only the histograms.
pub fn encode_bounded(src: &[u8], max_len: usize, out: &mut Vec<u8>) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("bmi2") {
        // SAFETY: the CPU supports BMI2, checked on the line above.
        return unsafe { encode_bmi2(src, max_len, out) };
    }
    encode_portable(src, max_len, out)
}

/// [`encode_portable`] compiled with BMI2: a shift by a variable count (`shlx`) is one
/// micro-op instead of three, and the coder does one per symbol (measured: +30 %).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "bmi2")]
unsafe fn encode_bmi2(src: &[u8], max_len: usize, out: &mut Vec<u8>) -> bool {
    encode_portable(src, max_len, out)
}

#[inline(always)]
fn encode_portable(src: &[u8], max_len: usize, out: &mut Vec<u8>) -> bool {
    if src.len() > MAX_INPUT {
        return false;
    }
    let q = src.len() / 4;
    let (p0, rest) = src.split_at(q);
    let (p1, rest) = rest.split_at(q);
    let (p2, p3) = rest.split_at(q);
    let parts = [p0, p1, p2, p3];
    let hists = histograms(parts);
    let mut total = [0u64; 256];
    for h in &hists {
        for (t, &c) in total.iter_mut().zip(h) {
            *t += c;
        }
    }
    let lens = code_lengths(&total);
    let mut sizes = [0usize; 4];
    for (size, h) in sizes.iter_mut().zip(&hists) {
        let bits: u64 = h.iter().zip(&lens).map(|(&c, &l)| c * u64::from(l)).sum();
        *size = bits.div_ceil(8) as usize;
    }
    let len = HEADER_LEN + sizes.iter().sum::<usize>() + 3 * GAP;
    if len > max_len {
        return false;
    }
    let base = out.len();
    for pair in lens.chunks_exact(2) {
        out.push(pair[0] | (pair[1] << 4));
    }
    for s in &sizes[..3] {
        // Fits: a stream is at most 11/8 of a quarter of MAX_INPUT.
        out.extend_from_slice(&(*s as u32).to_le_bytes());
    }
    let codes = canonical_codes(&lens);
    let mut rev = [0u64; 256];
    for ((r, &c), &l) in rev.iter_mut().zip(&codes).zip(&lens) {
        *r = u64::from(reverse(c, l));
    }
    // The last stream's word stores need a gap too; it is cut off at the end.
    let streams = out.len();
    out.resize(base + len + GAP, 0);
    let buf = &mut out[streams..];
    let starts = [
        0,
        sizes[0] + GAP,
        sizes[0] + sizes[1] + 2 * GAP,
        sizes[0] + sizes[1] + sizes[2] + 3 * GAP,
    ];
    // Four locals, not an array, so that the bit buffers stay in registers.
    let (mut w0, mut w1, mut w2, mut w3) = (
        BitWriter::at(starts[0]),
        BitWriter::at(starts[1]),
        BitWriter::at(starts[2]),
        BitWriter::at(starts[3]),
    );
    for (((a, b), c), d) in p0
        .chunks_exact(BATCH)
        .zip(p1.chunks_exact(BATCH))
        .zip(p2.chunks_exact(BATCH))
        .zip(p3.chunks_exact(BATCH))
    {
        for j in 0..BATCH {
            w0.put(&rev, &lens, a[j]);
            w1.put(&rev, &lens, b[j]);
            w2.put(&rev, &lens, c[j]);
            w3.put(&rev, &lens, d[j]);
        }
        w0.flush(buf);
        w1.flush(buf);
        w2.flush(buf);
        w3.flush(buf);
    }
    let done = q / BATCH * BATCH;
    for (mut wk, part) in [w0, w1, w2, w3].into_iter().zip(parts) {
        for &s in &part[done..] {
            wk.put(&rev, &lens, s);
            wk.flush(buf);
        }
        wk.flush(buf);
    }
    out.truncate(base + len);
    true
}

/// Decodes `src` (a payload of [`encode`]) into exactly `out.len()` bytes.
///
/// A payload whose header is inconsistent, or whose streams do not decode to exactly their
/// length, is an error. (Like any entropy coder it cannot tell every edited code from a
/// valid one: integrity is the container's checksum's job.)
pub fn decode(src: &[u8], out: &mut [u8]) -> Result<(), HuffmanError> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("bmi2") {
        // SAFETY: the CPU supports BMI2, checked on the line above.
        return unsafe { decode_bmi2(src, out) };
    }
    decode_portable(src, out)
}

/// [`decode_portable`] compiled with BMI2 (one-micro-op variable shifts, `shrx`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "bmi2")]
unsafe fn decode_bmi2(src: &[u8], out: &mut [u8]) -> Result<(), HuffmanError> {
    decode_portable(src, out)
}

#[inline(always)]
fn decode_portable(src: &[u8], out: &mut [u8]) -> Result<(), HuffmanError> {
    let (head, data) = src
        .split_at_checked(HEADER_LEN)
        .ok_or(HuffmanError::Truncated(src.len()))?;
    let mut lens = [0u8; 256];
    for (pair, &b) in lens.chunks_exact_mut(2).zip(&head[..LENGTHS_LEN]) {
        pair[0] = b & 0xF;
        pair[1] = b >> 4;
    }
    let table = decoding_table(&lens)?;
    let mut sl = [0u32; 3];
    for (s, b) in sl.iter_mut().zip(head[LENGTHS_LEN..].chunks_exact(4)) {
        *s = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    let e0 = sl[0] as usize;
    let e1 = e0 + GAP + sl[1] as usize;
    let e2 = e1 + GAP + sl[2] as usize;
    if e2 + GAP > data.len() {
        return Err(HuffmanError::BadStreams(sl, data.len()));
    }
    let ends = [e0, e1, e2, data.len()];

    let q = out.len() / 4;
    let (o0, rest) = out.split_at_mut(q);
    let (o1, rest) = rest.split_at_mut(q);
    let (o2, o3) = rest.split_at_mut(q);
    // Four locals, not an array, so that the bit buffers stay in registers. A reader may
    // look past the end of its stream into the next one: only the bits of valid codes are
    // consumed, and the position check at the end catches the rest.
    let (mut r0, mut r1, mut r2, mut r3) = (
        BitReader::at(0),
        BitReader::at(e0 + GAP),
        BitReader::at(e1 + GAP),
        BitReader::at(e2 + GAP),
    );
    for (((a, b), c), d) in o0
        .chunks_exact_mut(BATCH)
        .zip(o1.chunks_exact_mut(BATCH))
        .zip(o2.chunks_exact_mut(BATCH))
        .zip(o3.chunks_exact_mut(BATCH))
    {
        r0.refill(data);
        r1.refill(data);
        r2.refill(data);
        r3.refill(data);
        for j in 0..BATCH {
            a[j] = r0.symbol(&table);
            b[j] = r1.symbol(&table);
            c[j] = r2.symbol(&table);
            d[j] = r3.symbol(&table);
        }
    }
    let done = q / BATCH * BATCH;
    let r = [r0, r1, r2, r3];
    for (k, ((mut rk, part), end)) in r.into_iter().zip([o0, o1, o2, o3]).zip(ends).enumerate() {
        for s in &mut part[done..] {
            rk.refill(data);
            *s = rk.symbol(&table);
        }
        if rk.bitpos.div_ceil(8) != end {
            return Err(HuffmanError::BadStream(k));
        }
    }
    Ok(())
}

/// Byte histograms of the four parts, each counted into two tables (even and odd
/// positions), the four parts in lockstep: eight independent tables, so that runs of one byte
/// do not serialise the increments (each would wait for the previous store).
fn histograms(parts: [&[u8]; 4]) -> [[u64; 256]; 4] {
    let mut wide = [[0u64; 256]; 4];
    let [p0, p1, p2, p3] = parts;
    // Blocks keep the u32 counters from overflowing.
    const BLOCK: usize = 1 << 30;
    for off in (0..p0.len().max(1)).step_by(BLOCK) {
        let end = p0.len().min(off + BLOCK);
        let mut h = [[0u32; 256]; 8];
        let [h0, h1, h2, h3, h4, h5, h6, h7] = &mut h;
        for (((a, b), c), d) in sub(p0, off, end)
            .chunks_exact(2)
            .zip(sub(p1, off, end).chunks_exact(2))
            .zip(sub(p2, off, end).chunks_exact(2))
            .zip(sub(p3, off, end).chunks_exact(2))
        {
            h0[usize::from(a[0])] += 1;
            h1[usize::from(a[1])] += 1;
            h2[usize::from(b[0])] += 1;
            h3[usize::from(b[1])] += 1;
            h4[usize::from(c[0])] += 1;
            h5[usize::from(c[1])] += 1;
            h6[usize::from(d[0])] += 1;
            h7[usize::from(d[1])] += 1;
        }
        for (w, pair) in wide.iter_mut().zip(h.chunks_exact(2)) {
            for (x, (&e, &o)) in w.iter_mut().zip(pair[0].iter().zip(&pair[1])) {
                *x += u64::from(e) + u64::from(o);
            }
        }
    }
    // What the pairs left: the last odd byte of each part, and the last part's extra bytes.
    let even = p0.len() / 2 * 2;
    for (w, p) in wide.iter_mut().zip(parts) {
        for &b in p.get(even..).unwrap_or_default() {
            w[usize::from(b)] += 1;
        }
    }
    wide
}

/// `p[from..to]`, or nothing where `p` is shorter.
fn sub(p: &[u8], from: usize, to: usize) -> &[u8] {
    p.get(from..to).unwrap_or_default()
}

/// Length-limited Huffman code lengths for `counts` (0 for absent symbols; a lone symbol gets
/// 1 bit): an unlimited Huffman tree (two-queue construction), then lengths above [`MAX_BITS`] are folded in with
/// miniz's Kraft repair, and the lengths handed out again by rank of count.
fn code_lengths(counts: &[u64; 256]) -> [u8; 256] {
    let mut lens = [0u8; 256];
    let mut syms: Vec<(u64, u8)> = (0..=255u8)
        .filter(|&s| counts[usize::from(s)] > 0)
        .map(|s| (counts[usize::from(s)], s))
        .collect();
    syms.sort_unstable();
    match syms.as_slice() {
        [] => return lens,
        [(_, s)] => {
            lens[usize::from(*s)] = 1;
            return lens;
        }
        _ => {}
    }
    let n = syms.len();
    let mut parent = vec![0usize; 2 * n - 1];
    // The two-queue construction: leaves come sorted, and the internal nodes are made in
    // increasing weight, so the two lightest nodes are always at the head of one queue.
    let mut weight: Vec<u64> = syms.iter().map(|&(c, _)| c).collect();
    weight.resize(2 * n - 1, 0);
    let (mut leaf, mut inner) = (0, n);
    for next in n..2 * n - 1 {
        for _ in 0..2 {
            let take_leaf = leaf < n && (inner >= next || weight[leaf] <= weight[inner]);
            let node = if take_leaf { &mut leaf } else { &mut inner };
            parent[*node] = next;
            weight[next] += weight[*node];
            *node += 1;
        }
    }
    let next = 2 * n - 1;
    // Parents are created after their children: one backward pass gives every depth.
    let mut depth = vec![0u32; next];
    for i in (0..next - 1).rev() {
        depth[i] = depth[parent[i]] + 1;
    }
    let max = MAX_BITS as usize;
    let mut per_len = [0u32; MAX_BITS as usize + 1];
    for &d in &depth[..n] {
        per_len[(d as usize).min(max)] += 1;
    }
    let mut kraft: u32 = (1..=max).map(|l| per_len[l] << (max - l)).sum();
    while kraft > 1 << max {
        // Drop one code from the longest length and split a shorter one in two: the code
        // count stays, the Kraft sum goes down by one unit.
        per_len[max] = per_len[max].saturating_sub(1);
        if let Some(l) = (1..max).rev().find(|&l| per_len[l] > 0) {
            per_len[l] -= 1;
            per_len[l + 1] += 2;
        }
        kraft -= 1;
    }
    // The rarest symbols get the longest codes.
    let mut rarest_first = syms.iter();
    for l in (1..=max).rev() {
        for _ in 0..per_len[l] {
            if let Some(&(_, s)) = rarest_first.next() {
                lens[usize::from(s)] = l as u8;
            }
        }
    }
    lens
}

/// Canonical codes (most significant bit first) of `lens`, which must satisfy Kraft.
fn canonical_codes(lens: &[u8; 256]) -> [u16; 256] {
    let mut per_len = [0u16; MAX_BITS as usize + 1];
    for &l in lens.iter().filter(|&&l| l > 0) {
        per_len[usize::from(l)] += 1;
    }
    let mut next = [0u16; MAX_BITS as usize + 1];
    let mut code = 0u16;
    for l in 1..=MAX_BITS as usize {
        code = (code + per_len[l - 1]) << 1;
        next[l] = code;
    }
    let mut codes = [0u16; 256];
    for (c, &l) in codes.iter_mut().zip(lens) {
        if l > 0 {
            *c = next[usize::from(l)];
            next[usize::from(l)] += 1;
        }
    }
    codes
}

/// The low `len` bits of `code`, reversed (the streams are read least significant bit first).
fn reverse(code: u16, len: u8) -> u16 {
    if len == 0 {
        0
    } else {
        code.reverse_bits() >> (16 - u32::from(len))
    }
}

/// The table indexed by the next [`MAX_BITS`] bits of a stream: symbol in the high byte, code
/// length in the low nibble, or [`INVALID`]. Checks that `lens` is a prefix code.
fn decoding_table(lens: &[u8; 256]) -> Result<[u16; TABLE], HuffmanError> {
    if let Some(l) = lens.iter().find(|&&l| u32::from(l) > MAX_BITS) {
        return Err(HuffmanError::BadLengths(format!(
            "length {l} over {MAX_BITS}"
        )));
    }
    let kraft: u32 = lens
        .iter()
        .filter(|&&l| l > 0)
        .map(|&l| 1u32 << (MAX_BITS - u32::from(l)))
        .sum();
    if kraft > 1 << MAX_BITS {
        return Err(HuffmanError::BadLengths("not a prefix code".into()));
    }
    let codes = canonical_codes(lens);
    let mut table = [INVALID; TABLE];
    for (s, (&c, &l)) in codes.iter().zip(lens).enumerate() {
        if l > 0 {
            let entry = ((s as u16) << 8) | u16::from(l);
            for e in table
                .iter_mut()
                .skip(usize::from(reverse(c, l)))
                .step_by(1 << l)
            {
                *e = entry;
            }
        }
    }
    Ok(table)
}

/// Appends codes to a 64-bit buffer and stores it a whole word at a time into its region of
/// a shared buffer.
struct BitWriter {
    /// Next byte to store.
    pos: usize,
    bits: u64,
    nbits: u32,
}

impl BitWriter {
    fn at(pos: usize) -> Self {
        BitWriter {
            pos,
            bits: 0,
            nbits: 0,
        }
    }

    /// Adds the code of `s`; at most [`BATCH`] between flushes (7 + 5 × 11 bits fit).
    #[inline(always)]
    fn put(&mut self, rev: &[u64; 256], lens: &[u8; 256], s: u8) {
        self.bits |= rev[usize::from(s)] << self.nbits;
        self.nbits += u32::from(lens[usize::from(s)]);
    }

    /// Stores the buffer and keeps the bits of the last partial byte.
    #[inline(always)]
    fn flush(&mut self, buf: &mut [u8]) {
        // Each stream's region is its exact size plus GAP: always in bounds.
        if let Some(d) = buf.get_mut(self.pos..self.pos + 8) {
            d.copy_from_slice(&self.bits.to_le_bytes());
        }
        let whole = self.nbits >> 3;
        self.pos += whole as usize;
        self.bits >>= whole * 8;
        self.nbits &= 7;
    }
}

/// Reads a stream through a 64-bit buffer reloaded from its bit position (at least 57 valid
/// bits after a refill); bytes past the end of the data read as zeros.
struct BitReader {
    /// Absolute bit position in the data of the next bit to consume.
    bitpos: usize,
    bits: u64,
}

impl BitReader {
    fn at(byte: usize) -> Self {
        BitReader {
            bitpos: byte * 8,
            bits: 0,
        }
    }

    #[inline(always)]
    fn refill(&mut self, data: &[u8]) {
        let at = self.bitpos >> 3;
        let word = match data.get(at..at + 8) {
            Some(s) => {
                let mut a = [0u8; 8];
                a.copy_from_slice(s);
                u64::from_le_bytes(a)
            }
            None => tail_word(data, at),
        };
        self.bits = word >> (self.bitpos & 7);
    }

    /// Decodes one symbol; at most [`BATCH`] between refills (5 × 11 ≤ 57 bits). A bit
    /// pattern that is no code reads as symbol 0 and consumes nothing: the stream then
    /// stops advancing and fails the position check.
    #[inline(always)]
    fn symbol(&mut self, table: &[u16; TABLE]) -> u8 {
        let e = table[(self.bits as usize) & (TABLE - 1)];
        let len = u32::from(e & 0xF);
        self.bits >>= len;
        self.bitpos += len as usize;
        (e >> 8) as u8
    }
}

/// The word at byte `at` near or past the end of `data`, zero-padded.
#[cold]
fn tail_word(data: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    if let Some(s) = data.get(at..) {
        let n = s.len().min(8);
        a[..n].copy_from_slice(&s[..n]);
    }
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};

    fn round_trip(data: &[u8]) -> usize {
        let mut coded = vec![0xAA]; // appends after what is there
        assert!(encode(data, &mut coded));
        let mut back = vec![0u8; data.len()];
        decode(&coded[1..], &mut back).expect("decode");
        assert_eq!(back, data);
        coded.len() - 1
    }

    #[test]
    fn edge_cases_round_trip() {
        let empty = HEADER_LEN + 3 * GAP;
        assert_eq!(round_trip(&[]), empty);
        for n in 1..40 {
            round_trip(&vec![9u8; n]);
            let v: Vec<u8> = (0..n).map(|i| (i * 37) as u8).collect();
            round_trip(&v);
        }
        // One symbol: one bit each.
        assert_eq!(round_trip(&[3u8; 8000]), empty + 1000);
        let all: Vec<u8> = (0..=255u8).cycle().take(256 * 100).collect();
        assert_eq!(round_trip(&all), empty + all.len());
    }

    #[test]
    fn skewed_data_compresses_near_its_entropy() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // Geometric-ish: entropy about 2 bits.
        let data: Vec<u8> = (0..200_000)
            .map(|_| (rng.random::<f32>().ln() * -1.5) as u8)
            .collect();
        let mut counts = [0u64; 256];
        for &d in &data {
            counts[usize::from(d)] += 1;
        }
        let h: f64 = counts
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / data.len() as f64;
                -p * p.log2()
            })
            .sum();
        let n = round_trip(&data);
        let bits = 8.0 * (n - HEADER_LEN - 3 * GAP) as f64 / data.len() as f64;
        assert!(bits < h + 0.1 && bits >= h - 0.01, "{bits} vs {h}");
    }

    #[test]
    fn lengths_are_limited_on_fibonacci_counts() {
        // Fibonacci counts give an unlimited tree as deep as the alphabet.
        let mut data = Vec::new();
        let (mut a, mut b) = (1usize, 1usize);
        for s in 0..25u8 {
            data.extend(std::iter::repeat_n(s, a));
            (a, b) = (b, a + b);
        }
        let mut counts = [0u64; 256];
        for &d in &data {
            counts[usize::from(d)] += 1;
        }
        let lens = code_lengths(&counts);
        assert_eq!(lens.iter().copied().max(), Some(MAX_BITS as u8));
        let kraft: u32 = lens
            .iter()
            .filter(|&&l| l > 0)
            .map(|&l| 1 << (MAX_BITS - u32::from(l)))
            .sum();
        assert_eq!(kraft, 1 << MAX_BITS);
        round_trip(&data);
    }

    #[test]
    fn bounded_refuses_without_touching_out() {
        let data: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
        let mut out = vec![1, 2];
        assert!(!encode_bounded(&data, data.len(), &mut out));
        assert_eq!(out, [1, 2]);
        assert!(encode_bounded(&[0u8; 4096], 1000, &mut out));
    }

    #[test]
    fn corrupt_payloads_are_errors() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 7 + i % 3) as u8).collect();
        let mut coded = Vec::new();
        assert!(encode(&data, &mut coded));
        let mut back = vec![0u8; data.len()];
        assert!(decode(&coded, &mut back).is_ok());
        assert_eq!(
            decode(&coded[..10], &mut back),
            Err(HuffmanError::Truncated(10))
        );
        assert!(decode(&coded[..coded.len() - 1], &mut back).is_err());
        let mut longer = coded.clone();
        longer.push(0);
        assert!(decode(&longer, &mut back).is_err());
        assert!(decode(&coded, &mut back[..9_000]).is_err());
        let mut bad = coded.clone();
        bad[0] = 0xFF; // length 15
        assert!(matches!(
            decode(&bad, &mut back),
            Err(HuffmanError::BadLengths(_))
        ));
        let mut bad = coded.clone();
        bad[LENGTHS_LEN + 3] = 0xFF; // stream 0 longer than the payload
        assert!(matches!(
            decode(&bad, &mut back),
            Err(HuffmanError::BadStreams(..))
        ));
    }

    proptest! {
        #[test]
        fn prop_round_trip(data in proptest::collection::vec(0u8..=255, 0..3000),
                           skew in 1u8..=255) {
            round_trip(&data);
            let squeezed: Vec<u8> = data.iter().map(|&b| b % skew).collect();
            round_trip(&squeezed);
        }

        #[test]
        fn prop_arbitrary_bytes_never_panic(data in proptest::collection::vec(0u8..=255, 0..600),
                                            n in 0usize..2000) {
            let mut out = vec![0u8; n];
            let _ = decode(&data, &mut out);
        }

        #[test]
        fn prop_mutated_payloads_never_panic(data in proptest::collection::vec(0u8..8, 0..2000),
                                             flips in proptest::collection::vec((0usize..4000, 0u8..=255), 1..8),
                                             extra in 0usize..3) {
            let mut coded = Vec::new();
            prop_assert!(encode(&data, &mut coded));
            for (at, x) in flips {
                let i = at % coded.len();
                coded[i] ^= x;
            }
            let mut out = vec![0u8; data.len() + extra];
            let _ = decode(&coded, &mut out);
        }
    }
}
