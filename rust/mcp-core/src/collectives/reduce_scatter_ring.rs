//! Ring reduce-scatter: the first half of the ring all-reduce, reducing into the received
//! chunk rather than into the input, so the input is left as it was.

use super::{chunks, segments, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce::{finish_avg, reduce_into};
use crate::transport::Transport;

/// Reduces `input` (`W` blocks) across ranks and leaves block `rank` of the result in `out`.
pub async fn reduce_scatter_ring<T: Transport>(
    ctx: &OpCtx<'_, T>,
    out: RawBuf,
    input: RawBuf,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (w, r) = (ctx.world(), ctx.rank());
    let elem = dtype.size();
    if input.len() != out.len() * w {
        return Err(Error::InvalidArgument(format!(
            "reduce_scatter input has {} bytes, expected world_size ({w}) x {}",
            input.len(),
            out.len()
        )));
    }
    let blocks = segments(input.len() / elem, w, elem);
    if w == 1 {
        // SAFETY: distinct buffers, or the same memory copied onto itself via a temporary.
        let src = unsafe { input.slice(0..input.len()) }.to_vec();
        unsafe { out.slice_mut(0..out.len()) }.copy_from_slice(&src);
    } else {
        let block_chunks: Vec<_> = blocks
            .iter()
            .map(|b| chunks(b.clone(), elem, ctx.chunk_bytes))
            .collect();
        let (right, left) = ((r + 1) % w, (r + w - 1) % w);
        let first = (r + w - 1) % w;
        let cs = &block_chunks[first];
        for (j, c) in cs.iter().enumerate() {
            // SAFETY: the input is only read.
            let raw = unsafe { input.slice(c.clone()) };
            ctx.send_data(right, 0, j, cs.len(), raw).await?;
        }
        for h in 0..w - 1 {
            let s = (r + 2 * w - h - 2) % w;
            let cs = &block_chunks[s];
            for (j, c) in cs.iter().enumerate() {
                let payload = ctx.recv(left, h as u32, j, c.len()).await?;
                // The partial sum so far, decoded, plus this rank's input, in full precision.
                let mut data = vec![0u8; c.len()];
                ctx.store(&payload, &mut data)?;
                // SAFETY: the input is only read.
                reduce_into(dtype, op, &mut data, unsafe { input.slice(c.clone()) })?;
                if h + 1 < w - 1 {
                    ctx.send_data(right, h as u32 + 1, j, cs.len(), &data)
                        .await?;
                } else {
                    let at = c.start - blocks[r].start;
                    // SAFETY: `out` is written only here, each chunk once.
                    unsafe { out.slice_mut(at..at + c.len()) }.copy_from_slice(&data);
                }
            }
        }
    }
    if op == ReduceOp::Avg {
        // SAFETY: no other view is alive.
        finish_avg(dtype, unsafe { out.slice_mut(0..out.len()) }, w)?;
    }
    Ok(())
}
