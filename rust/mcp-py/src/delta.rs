//! Python binding of the checkpoint delta codec (the crate `mcp-delta`).
//!
//! Tensors cross the boundary as C-contiguous byte buffers (a `uint8` view of a numpy array
//! or torch tensor) plus a dtype name and a shape; they are read and written in place and the
//! GIL is released while the codec runs. Decoding errors raise
//! `mcp_fast.delta.DeltaCodecError` (an `MCPError`); bad arguments raise `ValueError`.

use mcp_delta::{self as delta, DType, DeltaError, EncodeOptions};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyTuple};

/// Maps a codec error to the Python exception the API documents.
fn to_py(py: Python<'_>, e: DeltaError) -> PyErr {
    let kind = match &e {
        DeltaError::InvalidArgument(_) | DeltaError::PrevMismatch(_) => {
            return PyValueError::new_err(e.to_string());
        }
        DeltaError::Truncated(_) => "truncated",
        DeltaError::BadMagic(_) => "bad_magic",
        DeltaError::Corrupt(_) => "corrupt",
        DeltaError::HashMismatch { .. } => "hash_mismatch",
        DeltaError::Zstd(_) => "zstd",
    };
    let class = py
        .import("mcp_fast.delta")
        .and_then(|m| m.getattr("DeltaCodecError"));
    match class.and_then(|c| c.call1((e.to_string(), kind))) {
        Ok(exc) => PyErr::from_value(exc),
        Err(import_failed) => import_failed,
    }
}

/// A read-only view of a C-contiguous buffer of bytes.
fn read_view<'a>(buf: &'a PyBuffer<u8>, what: &str) -> PyResult<&'a [u8]> {
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{what} must be C-contiguous"
        )));
    }
    if buf.len_bytes() == 0 {
        return Ok(&[]);
    }
    // SAFETY: the buffer is C-contiguous, `len_bytes` long and stays alive (and exported,
    // so it cannot be resized) for as long as `buf` is borrowed. Like numpy's own C loops,
    // we do not guard against another Python thread writing to it meanwhile; such a race
    // only changes which bytes are encoded, and the content hash catches it on decode.
    Ok(unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) })
}

/// A writable view of a C-contiguous buffer of bytes.
#[allow(clippy::mut_from_ref)]
fn write_view<'a>(buf: &'a PyBuffer<u8>, what: &str) -> PyResult<&'a mut [u8]> {
    if buf.readonly() {
        return Err(PyValueError::new_err(format!("{what} must be writable")));
    }
    if !buf.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{what} must be C-contiguous"
        )));
    }
    if buf.len_bytes() == 0 {
        return Ok(&mut []);
    }
    // SAFETY: as in `read_view`, and the exporter said the buffer is writable. This is the
    // only Rust view of it while the call runs.
    Ok(unsafe { std::slice::from_raw_parts_mut(buf.buf_ptr() as *mut u8, buf.len_bytes()) })
}

fn get_buffer(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<PyBuffer<u8>> {
    PyBuffer::<u8>::get(obj).map_err(|e| {
        PyTypeError::new_err(format!(
            "{what} must be a buffer of bytes (uint8 view): {e}"
        ))
    })
}

/// Encodes `cur` (the bytes of a C-contiguous tensor) against `prev` (the same tensor at the
/// previous checkpoint, or None for a full encoding) and returns the blob.
#[pyfunction]
#[pyo3(signature = (cur, dtype, shape, prev=None, *, level=1, chunk_bytes=delta::DEFAULT_CHUNK_BYTES, threads=0, max_abs_error=None))]
#[allow(clippy::too_many_arguments)]
fn delta_encode<'py>(
    py: Python<'py>,
    cur: &Bound<'py, PyAny>,
    dtype: &str,
    shape: Vec<u64>,
    prev: Option<&Bound<'py, PyAny>>,
    level: i32,
    chunk_bytes: usize,
    threads: usize,
    max_abs_error: Option<f64>,
) -> PyResult<Bound<'py, PyBytes>> {
    let dtype = DType::from_name(dtype).map_err(|e| to_py(py, e))?;
    let cur_buf = get_buffer(cur, "cur")?;
    let prev_buf = prev.map(|p| get_buffer(p, "prev")).transpose()?;
    let cur_s = read_view(&cur_buf, "cur")?;
    let prev_s = prev_buf
        .as_ref()
        .map(|b| read_view(b, "prev"))
        .transpose()?;
    let opts = EncodeOptions {
        level,
        chunk_bytes,
        threads,
        max_abs_error,
    };
    let enc = py
        .detach(|| delta::encode(dtype, &shape, prev_s, cur_s, &opts))
        .map_err(|e| to_py(py, e))?;
    PyBytes::new_with(py, enc.len(), |out| {
        enc.write_to(out)
            .map_err(|e| PyValueError::new_err(e.to_string()))
    })
}

/// Decodes `blob` into `out` (a writable C-contiguous buffer of exactly the tensor's byte
/// length), using `prev` for a delta blob; checks every checksum and the content hash.
#[pyfunction]
#[pyo3(signature = (blob, prev, out, *, threads=0))]
fn delta_decode_into<'py>(
    py: Python<'py>,
    blob: &Bound<'py, PyAny>,
    prev: Option<&Bound<'py, PyAny>>,
    out: &Bound<'py, PyAny>,
    threads: usize,
) -> PyResult<()> {
    let blob_buf = get_buffer(blob, "blob")?;
    let prev_buf = prev.map(|p| get_buffer(p, "prev")).transpose()?;
    let out_buf = get_buffer(out, "out")?;
    let blob_s = read_view(&blob_buf, "blob")?;
    let prev_s = prev_buf
        .as_ref()
        .map(|b| read_view(b, "prev"))
        .transpose()?;
    let out_s = write_view(&out_buf, "out")?;
    let out_range = out_s.as_ptr_range();
    for other in [Some(blob_s), prev_s].into_iter().flatten() {
        let r = other.as_ptr_range();
        if !out_s.is_empty()
            && !other.is_empty()
            && r.start < out_range.end
            && out_range.start < r.end
        {
            return Err(PyValueError::new_err("out must not overlap blob or prev"));
        }
    }
    py.detach(|| delta::decode_into(blob_s, prev_s, out_s, threads))
        .map_err(|e| to_py(py, e))?;
    Ok(())
}

/// The header of `blob` as a dict: mode, dtype, shape, nbytes, hash, chunk_bytes,
/// n_chunks, max_abs_error (None unless lossy), blob_len.
#[pyfunction]
fn delta_info<'py>(py: Python<'py>, blob: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
    let blob_buf = get_buffer(blob, "blob")?;
    let info = delta::read_info(read_view(&blob_buf, "blob")?).map_err(|e| to_py(py, e))?;
    let d = PyDict::new(py);
    d.set_item("mode", info.mode.name())?;
    d.set_item("dtype", info.dtype.name())?;
    d.set_item("shape", PyTuple::new(py, &info.shape)?)?;
    d.set_item("nbytes", info.nbytes)?;
    d.set_item("hash", info.hash)?;
    d.set_item("chunk_bytes", info.chunk_bytes)?;
    d.set_item("n_chunks", info.chunk_lens.len())?;
    let lossy = info.mode == delta::Mode::Lossy;
    d.set_item("max_abs_error", lossy.then_some(info.max_abs_error))?;
    d.set_item("blob_len", info.blob_len())?;
    Ok(d)
}

/// xxh3-64 of a buffer: the content hash the codec stores and checks.
#[pyfunction]
fn delta_content_hash(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u64> {
    let buf = get_buffer(data, "data")?;
    let s = read_view(&buf, "data")?;
    Ok(py.detach(|| delta::content_hash(s)))
}

/// Adds the delta codec's functions to the `_core` module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(delta_encode, m)?)?;
    m.add_function(wrap_pyfunction!(delta_decode_into, m)?)?;
    m.add_function(wrap_pyfunction!(delta_info, m)?)?;
    m.add_function(wrap_pyfunction!(delta_content_hash, m)?)?;
    Ok(())
}
