"""A blockwise 4-bit quantiser for float32 tensors, packed two values to a byte.

Each block of ``block`` elements (default 64) keeps one float32 scale, ``absmax / 7``, and
every element becomes the nearest of the 15 levels ``-7..7`` times that scale, stored as
``level + 8`` in a nibble (element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the
high one). A packed tensor is ``[scales as bytes | nibbles]``: ``4 * ceil(n / block) +
ceil(n / 2)`` bytes for ``n`` elements, 0.5625 bytes per element at block 64 (int8's 1.0156
at block 256, float32's 4).

The error of one element is at most half a level, ``absmax_of_its_block / 14``. Decoding is
deterministic: every member that decodes the same bytes gets the same bits.
"""

from __future__ import annotations

import torch

__all__ = ["decode_int4", "encode_int4", "int4_nbytes", "int4_round_trip"]

_LEVELS = 7


def int4_nbytes(n: int, block: int = 64) -> int:
    """Bytes of the packed form of ``n`` elements."""
    return 4 * (-(-n // block)) + (-(-n // 2))


def encode_int4(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Packs the float32 tensor ``x`` (any shape, read flat) into a uint8 tensor of
    :func:`int4_nbytes` bytes."""
    if x.dtype != torch.float32:
        raise TypeError(f"encode_int4 takes float32, got {x.dtype}")
    if block < 2 or block % 2:
        raise ValueError(f"block must be an even number >= 2, got {block}")
    flat = x.detach().reshape(-1)
    n = flat.numel()
    nb = -(-n // block)
    padded = torch.zeros(nb * block, dtype=torch.float32)
    padded[:n] = flat
    blocks = padded.view(nb, block)
    scale = blocks.abs().amax(dim=1) / _LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp_(-_LEVELS, _LEVELS).to(torch.int16) + 8
    q = q.reshape(-1)[: n + (n % 2)].to(torch.uint8)
    if q.numel() % 2:
        q = torch.cat([q, torch.full((1,), 8, dtype=torch.uint8)])
    packed = q[0::2] | (q[1::2] << 4)
    return torch.cat([scale.view(torch.uint8), packed])


def decode_int4(buf: torch.Tensor, n: int, block: int = 64) -> torch.Tensor:
    """The ``n`` float32 values packed in ``buf`` by :func:`encode_int4`."""
    if buf.dtype != torch.uint8 or buf.numel() != int4_nbytes(n, block):
        raise ValueError(
            f"a packed 4-bit tensor of {n} elements (block {block}) has "
            f"{int4_nbytes(n, block)} uint8 bytes, got {buf.numel()} of {buf.dtype}"
        )
    nb = -(-n // block)
    scale = buf[: 4 * nb].clone().view(torch.float32)
    packed = buf[4 * nb :]
    q = torch.empty(packed.numel() * 2, dtype=torch.int16)
    q[0::2] = (packed & 15).to(torch.int16)
    q[1::2] = (packed >> 4).to(torch.int16)
    levels = (q[:n] - 8).to(torch.float32)
    pad = torch.zeros(nb * block, dtype=torch.float32)
    pad[:n] = levels
    return (pad.view(nb, block) * scale[:, None]).reshape(-1)[:n]


def int4_round_trip(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """What a peer decodes after ``x`` was sent as 4-bit (a new flat float32 tensor)."""
    return decode_int4(encode_int4(x, block), x.numel(), block)
