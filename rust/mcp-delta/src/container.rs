//! The blob format of one encoded tensor, and the chunked, parallel encoder and decoder.
//!
//! ```text
//! header   magic "MCDT" | version u8 | mode u8 | dtype u8 | ndim u8
//!          nbytes u64 | chunk_bytes u32 | n_chunks u32 | content hash u64 (xxh3-64 of the
//!          tensor a decoder rebuilds) | max_abs_error f64 | ndim × dim u64
//!          | n_chunks × coded chunk length u32 | crc32c of all the above u32
//! chunk    transform u8 | lane width u8 | n_planes u8 | [scale factor α f32, only for the
//!          scaled float transform] | body | crc32c of the chunk's preceding bytes u32
//! body     n_planes > 0: n_planes × (method u8, length u32) | the planes' payloads
//!          n_planes = 0 (float residuals, `magnitude`): rANS frequency table | rANS stream
//!          length u32 | rANS stream | raw low bits
//! ```
//! All integers are little-endian. Chunk `i` covers bytes `[i·chunk_bytes, (i+1)·chunk_bytes)`
//! of the tensor; chunks are coded independently, in parallel, with bounded scratch memory.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Mutex};

use super::byteplane::{self, Transform};
use super::dtype::{DType, ElementDiff};
use super::error::{DeltaError, Result};
use super::lossy;
use super::magnitude;
use super::planes::{Method, PlaneDecoder, PlaneEncoder};
use super::predict;

const MAGIC: &[u8; 4] = b"MCDT";
const VERSION: u8 = 1;
const FIXED_HEADER: usize = 40;
const MAX_NDIM: usize = 64;

/// Default size of an independently coded chunk.
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;

/// What a blob holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// The whole tensor, byte planes coded without a previous tensor.
    Full = 0,
    /// A lossless delta against the previous tensor.
    Delta = 1,
    /// The tensor equals the previous one: no chunks.
    Unchanged = 2,
    /// A quantised delta within `max_abs_error` of the tensor.
    Lossy = 3,
}

impl Mode {
    fn from_code(c: u8) -> Option<Mode> {
        match c {
            0 => Some(Mode::Full),
            1 => Some(Mode::Delta),
            2 => Some(Mode::Unchanged),
            3 => Some(Mode::Lossy),
            _ => None,
        }
    }

    /// Lower-case name (`"full"`, `"delta"`, `"unchanged"`, `"lossy"`).
    pub fn name(self) -> &'static str {
        match self {
            Mode::Full => "full",
            Mode::Delta => "delta",
            Mode::Unchanged => "unchanged",
            Mode::Lossy => "lossy",
        }
    }

    /// Whether decoding needs the previous tensor.
    pub fn needs_prev(self) -> bool {
        !matches!(self, Mode::Full)
    }
}

/// Options of [`encode`].
#[derive(Debug, Clone)]
pub struct EncodeOptions {
    /// zstd level of byte planes (1–22; 1–3 are fast and nearly as good on deltas): full
    /// snapshots, non-float tensors, and float chunks under 64 KiB where byte planes come
    /// out smaller than the rANS coding of float deltas.
    pub level: i32,
    /// Bytes of tensor per independently coded chunk (rounded down to a multiple of 16).
    pub chunk_bytes: usize,
    /// Worker threads; 0 means all available cores.
    pub threads: usize,
    /// Enables the lossy mode for float dtypes: every rebuilt element is within this
    /// absolute error of the tensor. `None` (the default) is lossless.
    pub max_abs_error: Option<f64>,
}

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions {
            level: 1,
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            threads: 0,
            max_abs_error: None,
        }
    }
}

/// The parsed header of a blob.
#[derive(Debug, Clone, PartialEq)]
pub struct BlobInfo {
    /// What the blob holds.
    pub mode: Mode,
    /// Element type.
    pub dtype: DType,
    /// Shape of the tensor.
    pub shape: Vec<u64>,
    /// Size of the tensor in bytes.
    pub nbytes: u64,
    /// xxh3-64 of the tensor a decoder rebuilds.
    pub hash: u64,
    /// Bytes of tensor per chunk.
    pub chunk_bytes: u32,
    /// The lossy mode's error bound (0 otherwise).
    pub max_abs_error: f64,
    /// Length of the header in bytes.
    pub header_len: usize,
    /// Coded length of each chunk.
    pub chunk_lens: Vec<u32>,
}

impl BlobInfo {
    /// Total length of the blob.
    pub fn blob_len(&self) -> usize {
        self.header_len + self.chunk_lens.iter().map(|&l| l as usize).sum::<usize>()
    }
}

/// An encoded tensor: a header and the coded chunks, kept apart so that the caller can copy
/// them once into their final place (a file, a Python `bytes`).
#[derive(Debug, Clone)]
pub struct Encoded {
    header: Vec<u8>,
    chunks: Vec<Vec<u8>>,
    mode: Mode,
}

impl Encoded {
    /// Total length of the blob.
    pub fn len(&self) -> usize {
        self.header.len() + self.chunks.iter().map(Vec::len).sum::<usize>()
    }

    /// Whether the blob is empty (never: a header is always there).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What the blob holds.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The pieces of the blob, in order.
    pub fn parts(&self) -> impl Iterator<Item = &[u8]> {
        std::iter::once(self.header.as_slice()).chain(self.chunks.iter().map(Vec::as_slice))
    }

    /// Copies the blob into `out`, which must be exactly [`Encoded::len`] bytes.
    pub fn write_to(&self, out: &mut [u8]) -> Result<()> {
        if out.len() != self.len() {
            return Err(DeltaError::InvalidArgument(
                "output of the wrong length".into(),
            ));
        }
        let mut at = 0;
        for p in self.parts() {
            out[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        Ok(())
    }

    /// The blob as one vector.
    pub fn into_vec(self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len());
        for p in self.parts() {
            v.extend_from_slice(p);
        }
        v
    }
}

/// xxh3-64 of a tensor's bytes: the content hash stored in every blob.
pub fn content_hash(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

fn threads(requested: usize) -> usize {
    if requested > 0 {
        requested
    } else {
        std::thread::available_parallelism().map_or(1, usize::from)
    }
}

/// Runs `f` over `work` on up to `threads` scoped threads, each with its own state from
/// `init`; each thread takes the next item when it is done with one, so that chunks that
/// code slower do not leave a core idle.
fn run_parallel<W: Send, S>(
    work: Vec<W>,
    threads: usize,
    init: impl Fn() -> Result<S> + Sync,
    f: impl Fn(&mut S, W) -> Result<()> + Sync,
) -> Result<()> {
    let t = threads.min(work.len()).max(1);
    if t == 1 {
        let mut s = init()?;
        return work.into_iter().try_for_each(|w| f(&mut s, w));
    }
    let queue = Mutex::new(work.into_iter());
    let failed = AtomicBool::new(false);
    let results: Vec<Result<()>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..t)
            .map(|_| {
                let (init, f, failed, queue) = (&init, &f, &failed, &queue);
                scope.spawn(move || -> Result<()> {
                    let mut s = init()?;
                    loop {
                        if failed.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        // A poisoned lock means another worker panicked; that is reported
                        // through its join below.
                        let Some(w) = queue.lock().ok().and_then(|mut q| q.next()) else {
                            return Ok(());
                        };
                        if let Err(e) = f(&mut s, w) {
                            failed.store(true, Ordering::Relaxed);
                            return Err(e);
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(DeltaError::InvalidArgument(
                        "a codec worker thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    results.into_iter().collect()
}

/// Hashes chunks as the decoding threads finish them, in tensor order: the content hash of
/// a tensor is one sequential pass, which this overlaps with decoding instead of adding
/// after it. Returns `None` when a chunk never arrives (a worker failed).
fn hash_in_order(chunks: usize, rx: mpsc::Receiver<(usize, &[u8])>) -> Option<u64> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut pending = std::collections::BTreeMap::new();
    let mut next = 0;
    while next < chunks {
        let (i, c) = rx.recv().ok()?;
        pending.insert(i, c);
        while let Some(c) = pending.remove(&next) {
            h.update(c);
            next += 1;
        }
    }
    Some(h.digest())
}

fn lossless_transform(dtype: DType) -> Transform {
    match dtype.element_diff() {
        ElementDiff::Bits => Transform::Xor,
        ElementDiff::Int => Transform::IntSub,
        ElementDiff::Float => Transform::FloatSub,
    }
}

fn tensor_len(dtype: DType, shape: &[u64]) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size() as u64, |acc, &d| acc.checked_mul(d))
}

/// Per-thread scratch of the chunk encoder.
#[derive(Default)]
struct Scratch {
    planes: Vec<u8>,
    quant: Vec<u8>,
    mag: magnitude::Scratch,
}

/// Per-thread scratch of the chunk decoder.
#[derive(Default)]
struct DecodeScratch {
    planes: Vec<u8>,
    mag: magnitude::Scratch,
}

/// Scratch buffers kept between calls. The workers are new threads on every call, and a
/// fresh buffer costs a page fault per 4 KiB the first time it is written: for a chunk of
/// 1 MiB that is several percent of its coding time.
struct Pool<T>(Mutex<Vec<T>>);

/// Buffers kept per pool entry at most; larger ones (huge chunks) are freed.
const POOLED_BYTES: usize = 16 << 20;
/// Entries kept per pool at most.
const POOLED_ENTRIES: usize = 16;

static ENCODE_SCRATCH: Pool<Scratch> = Pool(Mutex::new(Vec::new()));
static DECODE_SCRATCH: Pool<DecodeScratch> = Pool(Mutex::new(Vec::new()));

/// Something that can say how much memory it holds on to.
trait Held {
    fn held_bytes(&self) -> usize;
}

impl Held for Scratch {
    fn held_bytes(&self) -> usize {
        self.planes.capacity() + self.quant.capacity() + self.mag.capacity_bytes()
    }
}

impl Held for DecodeScratch {
    fn held_bytes(&self) -> usize {
        self.planes.capacity() + self.mag.capacity_bytes()
    }
}

/// A value taken from a [`Pool`], given back when dropped.
struct Pooled<T: Held + Default + 'static>(T, &'static Pool<T>);

impl<T: Held + Default + 'static> Pool<T> {
    fn take(&'static self) -> Pooled<T> {
        let v = self.0.lock().ok().and_then(|mut v| v.pop());
        Pooled(v.unwrap_or_default(), self)
    }
}

impl<T: Held + Default + 'static> Drop for Pooled<T> {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.held_bytes() <= POOLED_BYTES {
            if let Ok(mut pool) = self.1 .0.lock() {
                if pool.len() < POOLED_ENTRIES {
                    pool.push(v);
                }
            }
        }
    }
}

impl<T: Held + Default + 'static> std::ops::Deref for Pooled<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: Held + Default + 'static> std::ops::DerefMut for Pooled<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

#[allow(clippy::too_many_arguments)]
fn encode_chunk(
    enc: &mut PlaneEncoder,
    sc: &mut Scratch,
    dtype: DType,
    mode: Mode,
    prev: &[u8],
    cur: &[u8],
    max_abs_error: f64,
    recon: &mut [u8],
) -> Vec<u8> {
    let (mut tr, mut width) = match mode {
        Mode::Full => (Transform::Raw, dtype.lane_width()),
        _ => (lossless_transform(dtype), dtype.lane_width()),
    };
    let mut lanes: &[u8] = cur;
    if mode == Mode::Lossy {
        sc.quant.resize(cur.len() / dtype.size() * 4, 0);
        if lossy::quantize(dtype, prev, cur, max_abs_error, &mut sc.quant, recon) {
            tr = Transform::Quant;
            width = 4;
            lanes = &sc.quant;
        } else {
            recon.copy_from_slice(cur);
        }
    }
    let p = if matches!(tr, Transform::Raw | Transform::Quant) {
        &[][..]
    } else {
        prev
    };
    let alpha = match (tr, predict::Format::of(dtype)) {
        (Transform::FloatSub, Some(f)) => predict::estimate(f, prev, cur),
        _ => None,
    };
    if alpha.is_some() {
        tr = Transform::ScaledFloatSub;
    }
    let mut mag = None;
    if matches!(tr, Transform::FloatSub | Transform::ScaledFloatSub) && magnitude::supports(width) {
        // Magnitude coding, marked by a plane count of 0.
        let mut out = chunk_head(cur.len() / 2, tr, width, 0, alpha);
        magnitude::encode(width, alpha, prev, cur, &mut sc.mag, &mut out);
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        // Byte planes are tried too where they can win: on small chunks, where the symbol
        // table weighs more than the planes' few bytes, and where the residuals are as wide
        // as the lanes (unrelated tensors).
        if out.len() < cur.len() && cur.len() >= SMALL_CHUNK {
            return out;
        }
        mag = Some(out);
    }
    let planes = encode_planes(enc, &mut sc.planes, tr, width, alpha, p, lanes);
    match mag {
        Some(m) if m.len() <= planes.len() => m,
        _ => planes,
    }
}

/// A chunk's first bytes: transform, lane width, plane count (0: magnitude-coded) and the
/// scale factor of the scaled transform, in a buffer of `capacity`.
fn chunk_head(
    capacity: usize,
    tr: Transform,
    width: usize,
    n_planes: usize,
    alpha: Option<f32>,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(capacity);
    out.extend_from_slice(&[tr as u8, width as u8, n_planes as u8]);
    if let Some(a) = alpha {
        out.extend_from_slice(&a.to_le_bytes());
    }
    out
}

/// Below this many bytes a chunk is coded both ways and the smaller kept.
const SMALL_CHUNK: usize = 64 << 10;

/// Codes `lanes` transformed by `tr` as byte planes: the chunk's header, plane table,
/// planes and checksum.
fn encode_planes(
    enc: &mut PlaneEncoder,
    planes: &mut Vec<u8>,
    tr: Transform,
    width: usize,
    alpha: Option<f32>,
    prev: &[u8],
    lanes: &[u8],
) -> Vec<u8> {
    planes.resize(lanes.len(), 0);
    byteplane::split(tr, width, alpha.unwrap_or(1.0), prev, lanes, planes);
    let n = lanes.len() / width;
    let mut out = chunk_head(7 + 5 * width, tr, width, width, alpha);
    let table = out.len();
    out.resize(table + 5 * width, 0);
    let mut lens = Vec::with_capacity(width);
    for k in 0..width {
        let before = out.len();
        let m = enc.encode(&planes[k * n..(k + 1) * n], &mut out);
        lens.push((m, (out.len() - before) as u32));
    }
    for (k, (m, l)) in lens.into_iter().enumerate() {
        out[table + 5 * k] = m as u8;
        out[table + 5 * k + 1..table + 5 * k + 5].copy_from_slice(&l.to_le_bytes());
    }
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Encodes `cur` (the bytes of a C-contiguous tensor of `dtype` and `shape`) against `prev`
/// (the same tensor at the previous checkpoint, or `None` for a full encoding).
///
/// The mode is chosen here: [`Mode::Full`] without `prev`, [`Mode::Unchanged`] when the
/// bytes are equal, [`Mode::Lossy`] when `opts.max_abs_error` is set and the dtype is a
/// float, else [`Mode::Delta`]. A tensor whose shape or dtype changed must be encoded with
/// `prev = None`.
pub fn encode(
    dtype: DType,
    shape: &[u64],
    prev: Option<&[u8]>,
    cur: &[u8],
    opts: &EncodeOptions,
) -> Result<Encoded> {
    if shape.len() > MAX_NDIM {
        return Err(DeltaError::InvalidArgument(format!(
            "more than {MAX_NDIM} dimensions"
        )));
    }
    if tensor_len(dtype, shape) != Some(cur.len() as u64) {
        return Err(DeltaError::InvalidArgument(format!(
            "{} bytes do not hold a {} tensor of shape {shape:?}",
            cur.len(),
            dtype.name()
        )));
    }
    if let Some(p) = prev {
        if p.len() != cur.len() {
            return Err(DeltaError::PrevMismatch(format!(
                "previous tensor has {} bytes, current {}",
                p.len(),
                cur.len()
            )));
        }
    }
    let max_abs_error = match opts.max_abs_error {
        Some(e) if !(e.is_finite() && e > 0.0) => {
            return Err(DeltaError::InvalidArgument(format!(
                "max_abs_error must be finite and > 0, got {e}"
            )))
        }
        Some(e) => e,
        None => 0.0,
    };
    if !(1..=22).contains(&opts.level) {
        return Err(DeltaError::InvalidArgument(format!(
            "zstd level {} not in 1..=22",
            opts.level
        )));
    }
    let chunk_bytes = (opts.chunk_bytes.clamp(16, 1 << 30) / 16) * 16;
    let mode = match prev {
        None => Mode::Full,
        Some(p) if p == cur => Mode::Unchanged,
        Some(_) if opts.max_abs_error.is_some() && dtype.is_float() => Mode::Lossy,
        Some(_) => Mode::Delta,
    };
    let prev = prev.unwrap_or(&[]);
    let n_chunks = if mode == Mode::Unchanged {
        0
    } else {
        cur.len().div_ceil(chunk_bytes)
    };
    let mut chunks: Vec<Vec<u8>> = vec![Vec::new(); n_chunks];
    let mut hash: Option<u64> = None;
    let mut recon = if mode == Mode::Lossy {
        vec![0u8; cur.len()]
    } else {
        Vec::new()
    };
    {
        let work: Vec<_> = chunks
            .iter_mut()
            .enumerate()
            .zip(
                recon
                    .chunks_mut(chunk_bytes)
                    .map(Some)
                    .chain(std::iter::repeat_with(|| None)),
            )
            .map(|((i, slot), r)| (i, slot, r))
            .collect();
        let t = threads(opts.threads);
        let code = || {
            run_parallel(
                work,
                t,
                || Ok((PlaneEncoder::new(opts.level)?, ENCODE_SCRATCH.take())),
                |(enc, sc), (i, slot, r)| {
                    let lo = i * chunk_bytes;
                    let hi = (lo + chunk_bytes).min(cur.len());
                    let p = prev.get(lo..hi).unwrap_or(&[]);
                    *slot = encode_chunk(
                        enc,
                        sc,
                        dtype,
                        mode,
                        p,
                        &cur[lo..hi],
                        max_abs_error,
                        r.unwrap_or(&mut []),
                    );
                    Ok(())
                },
            )
        };
        if mode != Mode::Lossy && t > 1 && n_chunks > 1 {
            // The content hash of the input is one sequential pass: overlap it with coding.
            let (res, h) = std::thread::scope(|scope| {
                let hasher = scope.spawn(|| content_hash(cur));
                (code(), hasher.join())
            });
            res?;
            hash = h.ok();
        } else {
            code()?;
        }
    }
    let hash = hash.unwrap_or_else(|| content_hash(if mode == Mode::Lossy { &recon } else { cur }));
    drop(recon);
    let mut h = Vec::with_capacity(FIXED_HEADER + 8 * shape.len() + 4 * n_chunks + 4);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&[VERSION, mode as u8, dtype.code(), shape.len() as u8]);
    h.extend_from_slice(&(cur.len() as u64).to_le_bytes());
    h.extend_from_slice(&(chunk_bytes as u32).to_le_bytes());
    h.extend_from_slice(&(n_chunks as u32).to_le_bytes());
    h.extend_from_slice(&hash.to_le_bytes());
    h.extend_from_slice(&max_abs_error.to_le_bytes());
    for d in shape {
        h.extend_from_slice(&d.to_le_bytes());
    }
    for c in &chunks {
        let l = u32::try_from(c.len())
            .map_err(|_| DeltaError::InvalidArgument("chunk does not fit 4 GiB".into()))?;
        h.extend_from_slice(&l.to_le_bytes());
    }
    let crc = crc32c::crc32c(&h);
    h.extend_from_slice(&crc.to_le_bytes());
    Ok(Encoded {
        header: h,
        chunks,
        mode,
    })
}

/// A little-endian reader that reports truncation instead of panicking.
struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let s = self
            .at
            .checked_add(n)
            .and_then(|end| self.buf.get(self.at..end))
            .ok_or_else(|| DeltaError::Truncated(format!("{what} at byte {}", self.at)))?;
        self.at += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.arr::<1>(what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
}

/// Parses and checks the header of `blob` (magic, version, checksum, and that the chunk
/// lengths add up to the blob's length).
pub fn read_info(blob: &[u8]) -> Result<BlobInfo> {
    let mut r = Reader { buf: blob, at: 0 };
    if r.take(4, "magic")? != MAGIC {
        return Err(DeltaError::BadMagic(
            "the blob does not start with MCDT".into(),
        ));
    }
    let version = r.u8("version")?;
    if version != VERSION {
        return Err(DeltaError::BadMagic(format!(
            "version {version}, this codec reads {VERSION}"
        )));
    }
    let mode_code = r.u8("mode")?;
    let dtype_code = r.u8("dtype")?;
    let ndim = usize::from(r.u8("ndim")?);
    let nbytes = r.u64("nbytes")?;
    let chunk_bytes = r.u32("chunk size")?;
    let n_chunks = r.u32("chunk count")? as usize;
    let hash = r.u64("hash")?;
    let max_abs_error = f64::from_le_bytes(r.arr("error bound")?);
    // Bound the tables by the blob's length before allocating them.
    let table = 8 * ndim + 4 * n_chunks;
    if blob.len() < FIXED_HEADER + table + 4 {
        return Err(DeltaError::Truncated(format!(
            "header announces {ndim} dims and {n_chunks} chunks, blob has {} bytes",
            blob.len()
        )));
    }
    let shape = (0..ndim)
        .map(|_| r.u64("shape"))
        .collect::<Result<Vec<u64>>>()?;
    let chunk_lens = (0..n_chunks)
        .map(|_| r.u32("chunk table"))
        .collect::<Result<Vec<u32>>>()?;
    let header_end = r.at;
    let crc = r.u32("header checksum")?;
    if crc32c::crc32c(&blob[..header_end]) != crc {
        return Err(DeltaError::Corrupt("header checksum mismatch".into()));
    }
    let mode = Mode::from_code(mode_code)
        .ok_or_else(|| DeltaError::Corrupt(format!("unknown mode {mode_code}")))?;
    let dtype = DType::from_code(dtype_code)
        .ok_or_else(|| DeltaError::Corrupt(format!("unknown dtype code {dtype_code}")))?;
    if ndim > MAX_NDIM || tensor_len(dtype, &shape) != Some(nbytes) {
        return Err(DeltaError::Corrupt(format!(
            "shape {shape:?} does not match {nbytes} bytes"
        )));
    }
    if chunk_bytes == 0 || chunk_bytes % 16 != 0 {
        return Err(DeltaError::Corrupt(format!("chunk size {chunk_bytes}")));
    }
    let expect_chunks = if mode == Mode::Unchanged {
        0
    } else {
        nbytes.div_ceil(u64::from(chunk_bytes))
    };
    if n_chunks as u64 != expect_chunks {
        return Err(DeltaError::Corrupt(format!(
            "{n_chunks} chunks for {nbytes} bytes in chunks of {chunk_bytes}"
        )));
    }
    if mode == Mode::Lossy && !(max_abs_error.is_finite() && max_abs_error > 0.0) {
        return Err(DeltaError::Corrupt(format!(
            "lossy blob with error bound {max_abs_error}"
        )));
    }
    let info = BlobInfo {
        mode,
        dtype,
        shape,
        nbytes,
        hash,
        chunk_bytes,
        max_abs_error,
        header_len: r.at,
        chunk_lens,
    };
    let total = info.blob_len();
    if total > blob.len() {
        return Err(DeltaError::Truncated(format!(
            "blob has {} bytes, its header announces {total}",
            blob.len()
        )));
    }
    if total < blob.len() {
        return Err(DeltaError::Corrupt(format!(
            "{} trailing bytes after the last chunk",
            blob.len() - total
        )));
    }
    Ok(info)
}

#[allow(clippy::too_many_arguments)]
fn decode_chunk(
    dec: &mut PlaneDecoder,
    sc: &mut DecodeScratch,
    info: &BlobInfo,
    index: usize,
    chunk: &[u8],
    prev: &[u8],
    out: &mut [u8],
) -> Result<()> {
    let corrupt = |what: String| DeltaError::Corrupt(format!("chunk {index}: {what}"));
    let body_len = chunk
        .len()
        .checked_sub(4)
        .ok_or_else(|| corrupt("shorter than 4".into()))?;
    let (body, crc) = chunk.split_at(body_len);
    let mut crc_bytes = [0u8; 4];
    crc_bytes.copy_from_slice(crc);
    if crc32c::crc32c(body) != u32::from_le_bytes(crc_bytes) {
        return Err(corrupt("checksum mismatch".into()));
    }
    let mut r = Reader { buf: body, at: 0 };
    let tr_code = r.u8("transform")?;
    let width = usize::from(r.u8("width")?);
    let n_planes = usize::from(r.u8("plane count")?);
    let tr = Transform::from_code(tr_code)
        .ok_or_else(|| corrupt(format!("unknown transform {tr_code}")))?;
    let dtype = info.dtype;
    let lossless = lossless_transform(dtype);
    let expect_width = if tr == Transform::Quant {
        4
    } else {
        dtype.lane_width()
    };
    let format = predict::Format::of(dtype);
    let scaled = tr == Transform::ScaledFloatSub && format.is_some();
    let allowed = match info.mode {
        Mode::Full => tr == Transform::Raw,
        Mode::Delta => tr == lossless || scaled,
        Mode::Lossy => tr == lossless || scaled || (tr == Transform::Quant && dtype.is_float()),
        Mode::Unchanged => false,
    };
    let magnitude_coded = n_planes == 0
        && matches!(tr, Transform::FloatSub | Transform::ScaledFloatSub)
        && magnitude::supports(width);
    if !allowed || width != expect_width || !(n_planes == width || magnitude_coded) {
        return Err(corrupt(format!(
            "transform {tr:?} of width {width} with {n_planes} planes in a {} {} blob",
            info.mode.name(),
            dtype.name()
        )));
    }
    let alpha = if tr == Transform::ScaledFloatSub {
        let a = f32::from_bits(r.u32("scale factor")?);
        if !predict::valid_alpha(a) {
            return Err(corrupt(format!("scale factor {a} out of range")));
        }
        Some(a)
    } else {
        None
    };
    if magnitude_coded {
        return magnitude::decode(width, alpha, prev, &body[r.at..], &mut sc.mag, out)
            .map_err(|e| corrupt(format!("magnitude coding: {e}")));
    }
    let lanes_len = if tr == Transform::Quant {
        out.len() / dtype.size() * 4
    } else {
        out.len()
    };
    let n = lanes_len / width;
    let planes = &mut sc.planes;
    planes.resize(lanes_len, 0);
    let mut table = Vec::with_capacity(n_planes);
    for _ in 0..n_planes {
        let m = r.u8("plane method")?;
        let m = Method::from_code(m).ok_or_else(|| corrupt(format!("unknown method {m}")))?;
        table.push((m, r.u32("plane length")? as usize));
    }
    for (k, (m, len)) in table.into_iter().enumerate() {
        let payload = r.take(len, "plane payload")?;
        dec.decode(m, payload, &mut planes[k * n..(k + 1) * n])
            .map_err(|e| corrupt(format!("plane {k}: {e}")))?;
    }
    if r.at != body.len() {
        return Err(corrupt(format!(
            "{} bytes after the planes",
            body.len() - r.at
        )));
    }
    match tr {
        Transform::Quant => {
            let mut q = std::mem::take(planes);
            let mut lanes = vec![0u8; lanes_len];
            byteplane::merge(Transform::Raw, 4, 1.0, &[], &q, &mut lanes);
            let res = lossy::dequantize(dtype, prev, &lanes, info.max_abs_error, out);
            q.clear();
            *planes = q;
            res
        }
        Transform::Raw => {
            byteplane::merge(tr, width, 1.0, &[], planes, out);
            Ok(())
        }
        _ => {
            byteplane::merge(tr, width, alpha.unwrap_or(1.0), prev, planes, out);
            Ok(())
        }
    }
}

/// Decodes `blob` into `out` (exactly the tensor's byte length), using `prev` (the tensor the
/// blob was encoded against) when the blob is not a full one. Checks every checksum and the
/// content hash of the result; never panics on any input.
pub fn decode_into(
    blob: &[u8],
    prev: Option<&[u8]>,
    out: &mut [u8],
    threads_requested: usize,
) -> Result<BlobInfo> {
    let info = read_info(blob)?;
    if out.len() as u64 != info.nbytes {
        return Err(DeltaError::InvalidArgument(format!(
            "output has {} bytes, the tensor {}",
            out.len(),
            info.nbytes
        )));
    }
    let prev: &[u8] = if info.mode.needs_prev() {
        match prev {
            Some(p) if p.len() == out.len() => p,
            Some(p) => {
                return Err(DeltaError::PrevMismatch(format!(
                    "previous tensor has {} bytes, this {} blob needs {}",
                    p.len(),
                    info.mode.name(),
                    out.len()
                )))
            }
            None => {
                return Err(DeltaError::PrevMismatch(format!(
                    "a {} blob needs the previous tensor",
                    info.mode.name()
                )))
            }
        }
    } else {
        &[]
    };
    if info.mode == Mode::Unchanged {
        out.copy_from_slice(prev);
    } else {
        let cb = info.chunk_bytes as usize;
        let mut at = info.header_len;
        let mut work = Vec::with_capacity(info.chunk_lens.len());
        for (i, (o, &len)) in out.chunks_mut(cb).zip(info.chunk_lens.iter()).enumerate() {
            let c = &blob[at..at + len as usize];
            at += len as usize;
            let p = prev.get(i * cb..i * cb + o.len()).unwrap_or(&[]);
            work.push((i, c, p, o));
        }
        let t = threads(threads_requested);
        let n_chunks = work.len();
        let init = || Ok((PlaneDecoder::new()?, DECODE_SCRATCH.take()));
        if t > 1 && n_chunks > 1 {
            // The hash runs on its own thread, chunk by chunk as they are done.
            let (tx, rx) = mpsc::channel::<(usize, &[u8])>();
            let (res, hash) = std::thread::scope(|scope| {
                let hasher = scope.spawn(move || hash_in_order(n_chunks, rx));
                let res = run_parallel(work, t, init, |(dec, sc), (i, c, p, o)| {
                    decode_chunk(dec, sc, &info, i, c, p, o)?;
                    // The receiver is gone only if the hasher panicked; its join reports it.
                    let _ = tx.send((i, &*o));
                    Ok(())
                });
                drop(tx);
                (res, hasher.join().ok().flatten())
            });
            res?;
            return check_hash(info, hash);
        }
        run_parallel(work, t, init, |(dec, sc), (i, c, p, o)| {
            decode_chunk(dec, sc, &info, i, c, p, o)
        })?;
    }
    check_hash(info, Some(content_hash(out)))
}

/// The blob's info if `actual` is its content hash.
fn check_hash(info: BlobInfo, actual: Option<u64>) -> Result<BlobInfo> {
    match actual {
        Some(a) if a == info.hash => Ok(info),
        Some(a) => Err(DeltaError::HashMismatch {
            expected: info.hash,
            actual: a,
        }),
        None => Err(DeltaError::InvalidArgument(
            "the content hash thread stopped".into(),
        )),
    }
}

/// Decodes `blob` into a new vector; see [`decode_into`].
pub fn decode(blob: &[u8], prev: Option<&[u8]>, threads: usize) -> Result<(BlobInfo, Vec<u8>)> {
    let info = read_info(blob)?;
    if let (true, Some(p)) = (info.mode.needs_prev(), prev) {
        if p.len() as u64 != info.nbytes {
            return Err(DeltaError::PrevMismatch(format!(
                "previous tensor has {} bytes, the blob's tensor {}",
                p.len(),
                info.nbytes
            )));
        }
    }
    let len = usize::try_from(info.nbytes)
        .map_err(|_| DeltaError::Corrupt("tensor larger than memory".into()))?;
    // The chunk table has been checked against the blob: a tensor cannot be much larger
    // than its blob unless its planes are constant, so refuse absurd sizes before allocating.
    if prev.is_none() && len / 8 > blob.len().saturating_mul(1 << 14) {
        return Err(DeltaError::Corrupt(format!(
            "{len} bytes from a {}-byte blob",
            blob.len()
        )));
    }
    let mut out = vec![0u8; len];
    let info = decode_into(blob, prev, &mut out, threads)?;
    Ok((info, out))
}
