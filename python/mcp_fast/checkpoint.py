"""Differential checkpoints: each save stores only what changed since the previous one.

:class:`DeltaCheckpointer` writes one file per step into a directory. Every tensor is coded
by the Rust delta codec (:mod:`mcp_fast.delta`) against the same tensor at the previously
saved step; every ``full_every``-th save (and the first save of a new checkpointer) stores
everything in full, so loading a step decodes at most ``full_every`` files.

Layout of the directory::

    MANIFEST.json                 the committed steps, written last and atomically
    step-000000000042.mcdc        one file per step (see below)

A step file is ``b"MCDCKPT1"``, the tensors' blobs one after another, then an index (JSON:
step, base step, kind, the skeleton of the saved object, and for every tensor its path,
offset, length, dtype, shape and content hash), the index's length and CRC-32, and
``b"MCDCEND1"``. Every blob carries CRC-32C checksums and the xxh3-64 hash of the tensor it
rebuilds, checked on every load.

Crash safety: a step file is written to a temporary name, fsync'ed, renamed and its directory
fsync'ed; only then is the manifest rewritten the same way. A process killed at any moment
leaves either the old manifest (the new step does not exist) or the new one (the step is
complete); stray temporary files are ignored and removed by :meth:`DeltaCheckpointer.prune`.

Memory: the checkpointer keeps a copy of the previously saved tensors (the reference the next
delta is computed against); saving and loading stream tensor by tensor otherwise.
"""

from __future__ import annotations

import base64
import collections
import json
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from mcp_fast import _core
from mcp_fast.delta import DeltaCodecError, _is_torch, _torch, to_bytes_view
from mcp_fast.errors import MCPError

__all__ = ["CheckpointError", "DeltaCheckpointer", "StepInfo", "TensorRecord", "VerifyResult"]

MAGIC = b"MCDCKPT1"
END_MAGIC = b"MCDCEND1"
MANIFEST = "MANIFEST.json"
FORMAT = "mcp-ckpt/1"
_TRAILER = struct.Struct("<II8s")  # index length, index CRC-32, END_MAGIC


class CheckpointError(MCPError):
    """A checkpoint cannot be read or written.

    The message names the file and the step. Attributes:
        path: the file concerned (a step file or the manifest), or ``None``.
        step: the step concerned, or ``None``.
    """

    def __init__(self, message: str, path: Path | str | None = None, step: int | None = None):
        super().__init__(message)
        self.path = Path(path) if path is not None else None
        self.step = step


@dataclass(frozen=True)
class TensorRecord:
    """One stored tensor of a step."""

    path: str
    """Where the tensor sits in the saved object (keys joined by ``/``)."""
    offset: int
    """Byte offset of its blob in the step file."""
    length: int
    """Length of its blob."""
    dtype: str
    """Dtype name (``float32``, ``bfloat16``...)."""
    shape: tuple[int, ...]
    """Shape."""
    mode: str
    """``full``, ``delta``, ``unchanged`` or ``lossy``."""
    nbytes: int
    """Size of the tensor itself."""
    hash: int
    """xxh3-64 of the rebuilt tensor."""


@dataclass(frozen=True)
class StepInfo:
    """A committed step, as listed in the manifest."""

    step: int
    file: str
    kind: str
    """``full`` or ``delta``."""
    base: int | None
    """The step the deltas are against (``None`` for a full step)."""
    stored_bytes: int
    raw_bytes: int
    tensors: int


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one step."""

    step: int
    ok: bool
    error: str | None = None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# ---------------------------------------------------------------------------- skeleton


class _Flattener:
    """Turns a nested object into a JSON skeleton, yielding its tensors with their paths."""

    def __init__(self) -> None:
        self.leaves: list[tuple[str, Any]] = []
        self._paths: set[str] = set()

    def _leaf(self, path: str, value: Any) -> int:
        unique, n = path, 1
        while unique in self._paths:
            n += 1
            unique = f"{path}#{n}"
        self._paths.add(unique)
        self.leaves.append((unique, value))
        return len(self.leaves) - 1

    @staticmethod
    def _key_name(key: Any) -> str:
        return key if type(key) is str else f"<{type(key).__name__}:{key!r}>"

    def node(self, x: Any, path: str) -> Any:
        t = type(x)
        if x is None:
            return ["n"]
        if t is bool:
            return ["b", x]
        if t is int:
            return ["i", str(x)]
        if t is float:
            return ["f", struct.pack("<d", x).hex()]
        if t is complex:
            return ["c", struct.pack("<dd", x.real, x.imag).hex()]
        if t is str:
            return ["s", x]
        if t is bytes:
            return ["y", base64.b64encode(x).decode()]
        if t is list or t is tuple:
            items = [self.node(v, f"{path}/{i}") for i, v in enumerate(x)]
            return ["l" if t is list else "t", items]
        if t is dict or t is collections.OrderedDict:
            items = [
                [self.node(k, f"{path}/<key>"), self.node(v, f"{path}/{self._key_name(k)}")]
                for k, v in x.items()
            ]
            if t is dict:
                return ["d", items]
            meta = getattr(x, "_metadata", None)
            return ["o", items, None if meta is None else self.node(meta, f"{path}/<meta>")]
        if _is_torch(x):
            torch = _torch()
            if isinstance(x, torch.nn.Parameter):
                return ["P", self._leaf(path, x), bool(x.requires_grad)]
            if t is not torch.Tensor:
                raise TypeError(f"{path or '/'}: tensor subclass {t.__name__} is not supported")
            return ["T", self._leaf(path, x)]
        if t is np.ndarray:
            return ["A", self._leaf(path, x)]
        if isinstance(x, np.generic):
            return ["G", self._leaf(path, x)]
        raise TypeError(f"{path or '/'}: cannot checkpoint a {t.__module__}.{t.__qualname__}")


def _rebuild(node: Any, tensors: list[Any]) -> Any:
    tag = node[0]
    if tag == "n":
        return None
    if tag == "b":
        return bool(node[1])
    if tag == "i":
        return int(node[1])
    if tag == "f":
        return struct.unpack("<d", bytes.fromhex(node[1]))[0]
    if tag == "c":
        re, im = struct.unpack("<dd", bytes.fromhex(node[1]))
        return complex(re, im)
    if tag == "s":
        return str(node[1])
    if tag == "y":
        return base64.b64decode(node[1])
    if tag == "l":
        return [_rebuild(v, tensors) for v in node[1]]
    if tag == "t":
        return tuple(_rebuild(v, tensors) for v in node[1])
    if tag == "d":
        return {_rebuild(k, tensors): _rebuild(v, tensors) for k, v in node[1]}
    if tag == "o":
        od = collections.OrderedDict(
            (_rebuild(k, tensors), _rebuild(v, tensors)) for k, v in node[1]
        )
        if node[2] is not None:
            od._metadata = _rebuild(node[2], tensors)  # type: ignore[attr-defined]
        return od
    if tag == "T":
        return tensors[node[1]]
    if tag == "P":
        return _torch().nn.Parameter(tensors[node[1]], requires_grad=bool(node[2]))
    if tag in ("A", "G"):
        return tensors[node[1]]
    raise ValueError(f"unknown skeleton tag {tag!r}")


def _tensor_kind(node: Any) -> str:
    return "torch" if node[0] in ("T", "P") else "numpy"


def _walk_leaf_kinds(node: Any, out: dict[int, str]) -> None:
    tag = node[0]
    if tag in ("T", "P", "A", "G"):
        out[node[1]] = {"T": "torch", "P": "torch", "A": "numpy", "G": "scalar"}[tag]
    elif tag in ("l", "t"):
        for v in node[1]:
            _walk_leaf_kinds(v, out)
    elif tag in ("d", "o"):
        for k, v in node[1]:
            _walk_leaf_kinds(k, out)
            _walk_leaf_kinds(v, out)
        if tag == "o" and node[2] is not None:
            _walk_leaf_kinds(node[2], out)


def _materialize(buf: np.ndarray, dtype: str, shape: tuple[int, ...], kind: str) -> Any:
    """A tensor/array over the decoded bytes ``buf`` (no copy)."""
    if kind == "torch":
        torch = _torch()
        return torch.from_numpy(buf).view(getattr(torch, dtype)).reshape(shape)
    arr = buf.view(np.dtype(dtype)).reshape(shape)
    return arr[()] if kind == "scalar" else arr


# ---------------------------------------------------------------------------- step files


@dataclass
class _StepFile:
    path: Path
    step: int
    base: int | None
    kind: str
    skeleton: Any
    records: list[TensorRecord]
    file: BinaryIO

    def error(self, what: str) -> CheckpointError:
        return CheckpointError(f"step {self.step}: {self.path}: {what}", self.path, self.step)

    def read_blob(self, rec: TensorRecord) -> bytes:
        self.file.seek(rec.offset)
        blob = self.file.read(rec.length)
        if len(blob) != rec.length:
            raise self.error(f"tensor {rec.path!r} is truncated")
        return blob


def _open_step(path: Path, step: int) -> _StepFile:
    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"step {step}: {path}: {what}", path, step)

    try:
        f = open(path, "rb")
    except OSError as e:
        raise fail(f"cannot open: {e.strerror}") from e
    try:
        size = os.fstat(f.fileno()).st_size
        if size < len(MAGIC) + _TRAILER.size or f.read(len(MAGIC)) != MAGIC:
            raise fail("not a checkpoint step file (truncated or bad magic)")
        f.seek(size - _TRAILER.size)
        index_len, index_crc, end = _TRAILER.unpack(f.read(_TRAILER.size))
        if end != END_MAGIC or index_len > size - len(MAGIC) - _TRAILER.size:
            raise fail("truncated: the index at the end of the file is missing")
        f.seek(size - _TRAILER.size - index_len)
        raw = f.read(index_len)
        if zlib.crc32(raw) != index_crc:
            raise fail("index checksum mismatch (corrupt file)")
        index = json.loads(raw)
        if index.get("step") != step:
            raise fail(f"file holds step {index.get('step')}, the manifest says {step}")
        records = [
            TensorRecord(
                r["path"],
                r["offset"],
                r["length"],
                r["dtype"],
                tuple(r["shape"]),
                r["mode"],
                r["nbytes"],
                r["hash"],
            )
            for r in index["tensors"]
        ]
        for r in records:
            if r.offset < len(MAGIC) or r.offset + r.length > size - _TRAILER.size - index_len:
                raise fail(f"tensor {r.path!r} lies outside the file")
    except CheckpointError:
        f.close()
        raise
    except (ValueError, KeyError, TypeError, struct.error) as e:
        f.close()
        raise fail(f"unreadable index: {e}") from e
    return _StepFile(path, step, index["base"], index["kind"], index["skeleton"], records, f)


# ---------------------------------------------------------------------------- checkpointer


class DeltaCheckpointer:
    """Saves nested training state as a chain of delta-coded checkpoints.

    Args:
        directory: where the checkpoint files live (created if missing).
        full_every: store a full checkpoint every this many saves (1 = always full).
        level: zstd level of the byte planes (full snapshots, non-float tensors).
        max_abs_error: if set, float tensors are stored with quantised (lossy) deltas within
            this absolute error; ``None`` (the default) is lossless.
        threads: codec threads, 0 for all cores.

    ``state`` may nest dicts (``OrderedDict`` included, keeping ``state_dict()``'s
    ``_metadata``), lists and tuples of torch tensors (CUDA ones are stored and loaded back
    on the CPU), ``nn.Parameter``, numpy arrays and scalars, ``int``, ``float``, ``complex``,
    ``bool``, ``str``, ``bytes`` and ``None``; :meth:`load` returns the same types, dtypes,
    shapes and bits. Objects referenced twice are stored (and loaded) as two copies.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        full_every: int = 10,
        *,
        level: int = 1,
        max_abs_error: float | None = None,
        threads: int = 0,
    ) -> None:
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.directory = Path(directory)
        self.full_every = full_every
        self.level = level
        self.max_abs_error = max_abs_error
        self.threads = threads
        self.directory.mkdir(parents=True, exist_ok=True)
        self._cache: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
        self._cache_step: int | None = None
        self._since_full = 0

    # -- manifest
    def _manifest_path(self) -> Path:
        return self.directory / MANIFEST

    def _read_manifest(self) -> list[StepInfo]:
        path = self._manifest_path()
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return []
        try:
            doc = json.loads(raw)
            body = json.dumps(doc["steps"], sort_keys=True).encode()
            if doc.get("format") != FORMAT or zlib.crc32(body) != doc["checksum"]:
                raise ValueError("checksum or format mismatch")
            return [StepInfo(**s) for s in doc["steps"]]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: corrupt manifest: {e}", path) from e

    def _write_manifest(self, steps: list[StepInfo]) -> None:
        body = [s.__dict__ for s in steps]
        checksum = zlib.crc32(json.dumps(body, sort_keys=True).encode())
        doc = {"format": FORMAT, "steps": body, "checksum": checksum}
        _atomic_write(self._manifest_path(), json.dumps(doc, indent=1).encode())

    def steps(self) -> list[int]:
        """The committed steps, oldest first."""
        return [s.step for s in self._read_manifest()]

    def info(self) -> list[StepInfo]:
        """What the manifest says about every committed step, oldest first."""
        return self._read_manifest()

    # -- save
    def save(self, state: Any, step: int) -> StepInfo:
        """Stores ``state`` as ``step`` (which must be larger than every committed step).

        Returns the manifest entry of the new step. The step is visible to :meth:`load` only
        once this returns; a crash before leaves the previous steps untouched.
        """
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        committed = self._read_manifest()
        if committed and step <= committed[-1].step:
            raise ValueError(f"step {step} is not after the last saved step {committed[-1].step}")
        flat = _Flattener()
        skeleton = flat.node(state, "")
        last = committed[-1].step if committed else None
        full = (
            self._cache_step is None
            or self._cache_step != last
            or self._since_full + 1 >= self.full_every
        )
        name = f"step-{step:012d}.mcdc"
        final = self.directory / name
        tmp = self.directory / f".tmp-{name}-{os.getpid()}"
        records: list[dict[str, Any]] = []
        raw_bytes = 0
        new_cache: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC)
                offset = len(MAGIC)
                for path, value in flat.leaves:
                    view, dtype, shape = to_bytes_view(value)
                    prev = None if full else self._cache.get(path)
                    prev_view = prev[2] if prev is not None and prev[:2] == (dtype, shape) else None
                    blob = _core.delta_encode(
                        view,
                        dtype,
                        list(shape),
                        prev_view,
                        level=self.level,
                        threads=self.threads,
                        max_abs_error=self.max_abs_error,
                    )
                    hdr = _core.delta_info(blob)
                    if hdr["mode"] == "lossy":
                        ref = np.empty_like(view)  # what a decoder will hold
                        _core.delta_decode_into(blob, prev_view, ref, threads=self.threads)
                    else:
                        ref = view.copy()
                    new_cache[path] = (dtype, shape, ref)
                    self._cache.pop(path, None)  # bound memory: old reference no longer needed
                    f.write(blob)
                    records.append(
                        {
                            "path": path,
                            "offset": offset,
                            "length": len(blob),
                            "dtype": dtype,
                            "shape": list(shape),
                            "mode": hdr["mode"],
                            "nbytes": hdr["nbytes"],
                            "hash": hdr["hash"],
                        }
                    )
                    offset += len(blob)
                    raw_bytes += hdr["nbytes"]
                index = {
                    "step": step,
                    "base": None if full else last,
                    "kind": "full" if full else "delta",
                    "skeleton": skeleton,
                    "tensors": records,
                }
                raw_index = json.dumps(index, separators=(",", ":")).encode()
                f.write(raw_index)
                f.write(_TRAILER.pack(len(raw_index), zlib.crc32(raw_index), END_MAGIC))
                f.flush()
                os.fsync(f.fileno())
                stored = f.tell()
            os.replace(tmp, final)
            _fsync_dir(self.directory)
            entry = StepInfo(
                step=step,
                file=name,
                kind="full" if full else "delta",
                base=None if full else last,
                stored_bytes=stored,
                raw_bytes=raw_bytes,
                tensors=len(records),
            )
            self._write_manifest([*committed, entry])
        except BaseException:
            # The reference tensors are now partly gone: the next save must be full.
            self._cache, self._cache_step = {}, None
            tmp.unlink(missing_ok=True)
            raise
        self._cache, self._cache_step = new_cache, step
        self._since_full = 0 if full else self._since_full + 1
        return entry

    # -- load
    def _chain(self, steps: list[StepInfo], step: int) -> list[StepInfo]:
        by_step = {s.step: s for s in steps}
        if step not in by_step:
            raise CheckpointError(
                f"step {step}: no such step in {self._manifest_path()}",
                self._manifest_path(),
                step,
            )
        chain = [by_step[step]]
        while chain[-1].base is not None:
            base = chain[-1].base
            if base not in by_step:
                s = chain[-1]
                raise CheckpointError(
                    f"step {s.step}: {self.directory / s.file}: its base step {base} is missing",
                    self.directory / s.file,
                    s.step,
                )
            chain.append(by_step[base])
        return chain[::-1]

    def _apply(self, sf: _StepFile, values: dict[str, np.ndarray]) -> None:
        """Decodes every tensor of ``sf`` against ``values`` (the base step's), in place."""
        seen = set()
        for rec in sf.records:
            blob = sf.read_blob(rec)
            prev = values.get(rec.path)
            out = np.empty(rec.nbytes, np.uint8)
            try:
                hdr = _core.delta_info(blob)
                if hdr["hash"] != rec.hash or hdr["dtype"] != rec.dtype:
                    raise sf.error(f"tensor {rec.path!r} does not match the index")
                _core.delta_decode_into(blob, prev, out, threads=self.threads)
            except DeltaCodecError as e:
                raise sf.error(f"tensor {rec.path!r}: {e}") from e
            except ValueError as e:
                raise sf.error(f"tensor {rec.path!r}: {e}") from e
            values[rec.path] = out
            seen.add(rec.path)
        for path in [p for p in values if p not in seen]:
            del values[path]

    def _walk(
        self, chain: list[StepInfo], values: dict[str, np.ndarray] | None = None
    ) -> Iterator[tuple[_StepFile, dict[str, np.ndarray]]]:
        values = {} if values is None else values
        for s in chain:
            sf = _open_step(self.directory / s.file, s.step)
            try:
                if s.kind != sf.kind or s.base != sf.base:
                    raise sf.error("file and manifest disagree on the base step")
                if sf.kind == "full":
                    values.clear()
                self._apply(sf, values)
                yield sf, values
            finally:
                sf.file.close()

    def load(self, step: int | None = None) -> Any:
        """Returns the state saved at ``step`` (default: the latest step).

        Raises:
            CheckpointError: no such step, or a file of its chain is missing, truncated or
                corrupt (the message names the file and the step).
        """
        steps = self._read_manifest()
        if not steps:
            raise CheckpointError(f"{self._manifest_path()}: no checkpoint saved yet")
        target = steps[-1].step if step is None else step
        result: Any = None
        for sf, values in self._walk(self._chain(steps, target)):
            if sf.step == target:
                kinds: dict[int, str] = {}
                _walk_leaf_kinds(sf.skeleton, kinds)
                tensors = [
                    _materialize(values[r.path], r.dtype, r.shape, kinds.get(i, "numpy"))
                    for i, r in enumerate(sf.records)
                ]
                result = _rebuild(sf.skeleton, tensors)
        return result

    def verify(self, progress: Callable[[VerifyResult], None] | None = None) -> list[VerifyResult]:
        """Decodes every committed step once, in order, checking every checksum and content
        hash. Returns one result per step, oldest first; a step whose base is damaged fails
        too. ``progress``, if given, is called with each step's result as soon as it is known
        (``mcp-ckpt verify`` draws its progress bar with it)."""
        steps = self._read_manifest()
        results: list[VerifyResult] = []
        values: dict[str, np.ndarray] = {}
        good: int | None = None  # the last step decoded successfully, whose values we hold
        for s in steps:
            try:
                if s.base is not None and s.base != good:
                    path = self.directory / s.file
                    raise CheckpointError(
                        f"step {s.step}: {path}: its base step {s.base} is missing or damaged",
                        path,
                        s.step,
                    )
                for _ in self._walk([s], values):
                    pass
                good = s.step
                results.append(VerifyResult(s.step, True))
            except CheckpointError as e:
                values, good = {}, None
                results.append(VerifyResult(s.step, False, str(e)))
            if progress is not None:
                progress(results[-1])
        return results

    def prune(self, keep: int) -> list[int]:
        """Keeps the newest ``keep`` steps (and the older steps their deltas need), deletes
        the others and stray temporary files. Returns the deleted steps."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        steps = self._read_manifest()
        needed: set[int] = set()
        for s in steps[-keep:]:
            needed.update(c.step for c in self._chain(steps, s.step))
        kept = [s for s in steps if s.step in needed]
        removed = [s for s in steps if s.step not in needed]
        if removed:
            self._write_manifest(kept)
        for s in removed:
            (self.directory / s.file).unlink(missing_ok=True)
        for stray in self.directory.glob(".tmp-*"):
            stray.unlink(missing_ok=True)
        return [s.step for s in removed]

    def records(self, step: int) -> list[TensorRecord]:
        """The tensors stored for ``step`` (paths, modes, sizes), without decoding them."""
        steps = self._read_manifest()
        s = self._chain(steps, step)[-1]
        sf = _open_step(self.directory / s.file, s.step)
        sf.file.close()
        return sf.records
