//! Ring all-reduce: reduce-scatter then all-gather around the ring, chunk-pipelined.
//!
//! The buffer is cut into `W` segments. Each rank first sends its own segment to the right;
//! then, for `2(W-1)` hops, it receives a segment's chunk from the left, reduces it into its
//! buffer (first `W-1` hops) or stores it (last `W-1`), and forwards that chunk to the right at
//! once. Each rank sends and receives `2(W-1)/W` of the buffer: bandwidth-optimal.

use super::{chunks, segments, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::finish_avg;
use crate::transport::Transport;

/// All-reduces `buf` (elements of `dtype`) in place with the ring algorithm.
pub async fn allreduce_ring<T: Transport>(
    ctx: &OpCtx<'_, T>,
    buf: RawBuf,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (w, r) = (ctx.world(), ctx.rank());
    let elem = dtype.size();
    if w > 1 {
        let segs = segments(buf.len() / elem, w, elem);
        let seg_chunks: Vec<_> = segs
            .iter()
            .map(|s| chunks(s.clone(), elem, ctx.chunk_bytes))
            .collect();
        let (right, left) = ((r + 1) % w, (r + w - 1) % w);
        let own = &seg_chunks[r];
        for (j, c) in own.iter().enumerate() {
            // SAFETY: nothing writes segment r until hop W-1, which runs after this loop.
            ctx.send(right, 0, j, own.len(), unsafe { buf.slice(c.clone()) })
                .await?;
        }
        let hops = 2 * (w - 1);
        for h in 0..hops {
            let s = (r + 2 * w - h - 1) % w;
            let cs = &seg_chunks[s];
            for (j, c) in cs.iter().enumerate() {
                let data = ctx.recv(left, h as u32, j, c.len()).await?;
                {
                    // SAFETY: one view of this chunk at a time; the send above has returned.
                    let dst = unsafe { buf.slice_mut(c.clone()) };
                    if h < w - 1 {
                        data.reduce_into(dtype, op, dst)?;
                    } else {
                        data.copy_to(dst)?;
                    }
                }
                if h + 1 < hops {
                    // SAFETY: the mutable view above has ended.
                    ctx.send(right, h as u32 + 1, j, cs.len(), unsafe {
                        buf.slice(c.clone())
                    })
                    .await?;
                }
            }
        }
    }
    if op == ReduceOp::Avg {
        // SAFETY: every network view of the buffer has ended.
        finish_avg(dtype, unsafe { buf.slice_mut(0..buf.len()) }, w)?;
    }
    Ok(())
}
