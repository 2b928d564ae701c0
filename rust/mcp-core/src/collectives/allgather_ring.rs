//! Ring all-gather: each rank's block travels `W-1` hops around the ring, chunk by chunk.

use super::{chunks, segments, OpCtx};
use crate::buffer::RawBuf;
use crate::error::{Error, Result};
use crate::transport::Transport;

/// Gathers every rank's `input` into `out` (`W` blocks of `input.len()` bytes, rank order).
///
/// `input` may be `out`'s own block (in place): it is then not copied.
pub async fn allgather_ring<T: Transport>(
    ctx: &OpCtx<'_, T>,
    out: RawBuf,
    input: RawBuf,
    elem: usize,
) -> Result<()> {
    let (w, r) = (ctx.world(), ctx.rank());
    let n = input.len();
    if out.len() != n * w {
        return Err(Error::InvalidArgument(format!(
            "all_gather output has {} bytes, expected world_size ({w}) x {n}",
            out.len()
        )));
    }
    let blocks = segments(out.len() / elem, w, elem);
    {
        // SAFETY: `out` and `input` are different allocations, or `input` is exactly block r.
        let dst = unsafe { out.slice_mut(blocks[r].clone()) };
        let src = unsafe { input.slice(0..n) };
        if dst.as_ptr() != src.as_ptr() {
            dst.copy_from_slice(src);
        }
    }
    if w == 1 {
        return Ok(());
    }
    let block_chunks: Vec<_> = blocks
        .iter()
        .map(|b| chunks(b.clone(), elem, ctx.chunk_bytes))
        .collect();
    let (right, left) = ((r + 1) % w, (r + w - 1) % w);
    let own = &block_chunks[r];
    for (j, c) in own.iter().enumerate() {
        if ctx.coded() {
            // Keep in `out` what the peers will decode, so every rank gathers the same bits.
            // SAFETY: block r is never written by the hops below; one view at a time.
            let enc = ctx.settle(unsafe { out.slice_mut(c.clone()) })?;
            ctx.send(right, 0, j, own.len(), &enc).await?;
        } else {
            // SAFETY: block r is never written by the hops below.
            ctx.send(right, 0, j, own.len(), unsafe { out.slice(c.clone()) })
                .await?;
        }
    }
    for h in 0..w - 1 {
        let s = (r + w - h - 1) % w;
        let cs = &block_chunks[s];
        for (j, c) in cs.iter().enumerate() {
            let data = ctx.recv(left, h as u32, j, c.len()).await?;
            // SAFETY: the only view of this chunk.
            ctx.store(&data, unsafe { out.slice_mut(c.clone()) })?;
            if h + 1 < w - 1 {
                // SAFETY: the mutable view above has ended.
                let raw = unsafe { out.slice(c.clone()) };
                ctx.forward(right, h as u32 + 1, j, cs.len(), &data, raw)
                    .await?;
            }
        }
    }
    Ok(())
}
