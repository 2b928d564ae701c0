//! Tree all-reduce: reduce up a binomial tree to rank 0, then broadcast back down it.
//!
//! `2 log2 W` message latencies, each rank sending the whole buffer at most `log2 W` times:
//! for small buffers on many ranks, or when a ring's `2(W-1)` hops cost too much latency.

use super::{broadcast::broadcast_steps, chunks, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::finish_avg;
use crate::transport::Transport;

/// All-reduces `buf` in place with a binomial tree rooted at rank 0.
pub async fn allreduce_tree<T: Transport>(
    ctx: &OpCtx<'_, T>,
    buf: RawBuf,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (w, r) = (ctx.world(), ctx.rank());
    let elem = dtype.size();
    let cs = chunks(0..buf.len(), elem, ctx.chunk_bytes);
    let mut mask = 1usize;
    let mut level = 0u32;
    while mask < w {
        if r & mask != 0 {
            for (j, c) in cs.iter().enumerate() {
                // SAFETY: this rank is done writing its buffer until the broadcast phase.
                let raw = unsafe { buf.slice(c.clone()) };
                ctx.send_data(r - mask, level, j, cs.len(), raw).await?;
            }
            break;
        }
        if r + mask < w {
            for (j, c) in cs.iter().enumerate() {
                let data = ctx.recv(r + mask, level, j, c.len()).await?;
                // SAFETY: the only view of this chunk.
                ctx.accumulate(&data, op, unsafe { buf.slice_mut(c.clone()) })?;
            }
        }
        mask <<= 1;
        level += 1;
    }
    if r == 0 && op == ReduceOp::Avg {
        // SAFETY: no other view is alive.
        finish_avg(dtype, unsafe { buf.slice_mut(0..buf.len()) }, w)?;
    }
    broadcast_steps(ctx, buf, elem, 0, 64).await
}
