//! The binding's one tensor argument, built on the buffer protocol.
//!
//! `mcp_fast._buffers.view` describes a numpy array or CPU tensor as an object with `name`
//! (for messages), `data` (an object exporting the argument's memory through the buffer
//! protocol: the array itself, or a `uint8` numpy view of a tensor), `dtype` (the core's name
//! for its element type) and `shape`. [`TensorArg::extract`] takes the buffer from `data` and
//! checks what only the buffer knows (C-contiguous, writable where the operation writes,
//! little-endian); the dtype is parsed by the core, and the shape against the length by the
//! collective itself.
//!
//! The buffer stays exported while an operation uses it, so its owner cannot resize or free
//! the memory meanwhile. Releasing an export needs the GIL: an operation that finished on the
//! runtime hands its buffers to [`release_later`] and the next call into the binding from
//! Python (every extraction, `Work.wait`, `close`) releases them, so that no runtime thread
//! ever waits for the GIL.

use mcp_core::{DType, RawBuf};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::sync::Mutex;

/// Whether the operation writes into the argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Only read (a send, an all-gather's input).
    Read,
    /// Written in place (an all-reduce, a receive, an output).
    Write,
}

/// One exported tensor argument: its memory, element type and dimensions.
pub(crate) struct TensorArg {
    exported: PyUntypedBuffer,
    /// Its element type.
    pub(crate) dtype: DType,
    /// Its dimensions.
    pub(crate) shape: Vec<u64>,
    access: Access,
}

impl TensorArg {
    /// Exports the memory of `arg` (a `mcp_fast._buffers.Buffer`) for an operation that
    /// reads or writes it, after releasing what finished operations left.
    pub(crate) fn extract(arg: &Bound<'_, PyAny>, access: Access) -> PyResult<TensorArg> {
        release_pending(arg.py());
        let name: String = arg.getattr("name")?.extract()?;
        let dtype_name: String = arg.getattr("dtype")?.extract()?;
        let shape: Vec<u64> = arg.getattr("shape")?.extract()?;
        let dtype = DType::from_name(&dtype_name)
            .map_err(|e| PyTypeError::new_err(format!("{name}: {e}")))?;
        let exported = PyUntypedBuffer::get(&arg.getattr("data")?).map_err(|e| {
            PyTypeError::new_err(format!(
                "{name}: its memory cannot be exported through the buffer protocol: {e}"
            ))
        })?;
        if !exported.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{name}: the array is not C-contiguous; pass np.ascontiguousarray(a) (or \
                 t.contiguous()) and copy the result back if you need it in the original"
            )));
        }
        if access == Access::Write && exported.readonly() {
            return Err(PyValueError::new_err(format!(
                "{name}: the array is read-only; the operation writes into it"
            )));
        }
        let format = exported.format().to_bytes();
        if matches!(format.first(), Some(b'>' | b'!')) {
            return Err(PyTypeError::new_err(format!(
                "{name}: big-endian arrays are not supported; convert with .astype('<...')"
            )));
        }
        Ok(TensorArg {
            exported,
            dtype,
            shape,
            access,
        })
    }

    /// The argument's memory for the core.
    pub(crate) fn raw(&self) -> RawBuf {
        // SAFETY: the buffer is C-contiguous and `len_bytes` long, and it stays exported (its
        // owner can neither free nor resize it) for as long as `self` lives; callers keep
        // `self` until every operation given this RawBuf has completed. The core writes
        // through it only for arguments extracted with `Access::Write`, which the exporter
        // declared writable; `bytes_mut` is the only other way in and takes `&mut self`.
        unsafe { RawBuf::new(self.exported.buf_ptr().cast::<u8>(), self.len()) }
    }

    /// Its length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.exported.len_bytes()
    }

    /// Its bytes, to read during a call that holds `self`.
    pub(crate) fn bytes(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: as in `raw`; shared borrows of `self` only read. Like numpy's own loops we
        // do not guard against another Python thread writing the memory meanwhile.
        unsafe { std::slice::from_raw_parts(self.exported.buf_ptr().cast::<u8>(), self.len()) }
    }

    /// Its bytes, to write during a call that holds `self` (extracted with `Access::Write`).
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        debug_assert_eq!(self.access, Access::Write);
        if self.len() == 0 {
            return &mut [];
        }
        // SAFETY: as in `raw`, the exporter declared the buffer writable (checked in
        // `extract` for `Access::Write`), and `&mut self` makes this the only Rust view.
        unsafe { std::slice::from_raw_parts_mut(self.exported.buf_ptr().cast::<u8>(), self.len()) }
    }
}

/// Releases the buffers of an operation that finished on this thread, which holds the GIL.
pub(crate) fn release_now(py: Python<'_>, args: Vec<TensorArg>) {
    for arg in args {
        arg.exported.release(py);
    }
}

/// Buffers of finished operations, waiting for a thread with the GIL to release them.
static TO_RELEASE: Mutex<Vec<TensorArg>> = Mutex::new(Vec::new());

/// Hands `args` over for release by the next call from Python (any thread, no GIL needed).
pub(crate) fn release_later(args: Vec<TensorArg>) {
    if args.is_empty() {
        return;
    }
    TO_RELEASE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(args);
}

/// Releases the buffers that finished operations handed over; needs the GIL (`py`).
pub(crate) fn release_pending(py: Python<'_>) {
    let pending = std::mem::take(&mut *TO_RELEASE.lock().unwrap_or_else(|p| p.into_inner()));
    release_now(py, pending);
}
