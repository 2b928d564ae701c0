//! Ring all-reduce: reduce-scatter then all-gather around the ring, chunk-pipelined.
//!
//! The buffer is cut into `W` segments. Each rank first sends its own segment to the right;
//! then, for `2(W-1)` hops, it receives a segment's chunk from the left, reduces it into its
//! buffer (first `W-1` hops) or stores it (last `W-1`), and forwards that chunk to the right at
//! once. Each rank sends and receives `2(W-1)/W` of the buffer: bandwidth-optimal.
//!
//! With a codec, partial sums are re-encoded at every reduce hop (accumulating in the
//! buffer's precision); the owner of a finished segment encodes it once, keeps what it sent
//! (its decoding), and the all-gather hops pass those bytes on untouched: every rank ends
//! with identical bits.

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
            ctx.send_data(right, 0, j, own.len(), unsafe { buf.slice(c.clone()) })
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
                        ctx.accumulate(&data, op, dst)?;
                    } else {
                        ctx.store(&data, dst)?;
                    }
                }
                let next = h + 1;
                if next >= hops {
                    continue;
                }
                let step = next as u32;
                if next < w - 1 {
                    // A partial sum travels on to be reduced further.
                    // SAFETY: the mutable view above has ended.
                    ctx.send_data(right, step, j, cs.len(), unsafe { buf.slice(c.clone()) })
                        .await?;
                } else if next == w - 1 {
                    // This chunk is now final here: encode it once and keep what peers get.
                    let enc = if ctx.coded() {
                        // SAFETY: the only view of this chunk.
                        ctx.settle(unsafe { buf.slice_mut(c.clone()) })?
                    } else {
                        Vec::new()
                    };
                    // SAFETY: no mutable view is alive.
                    let raw = unsafe { buf.slice(c.clone()) };
                    ctx.send(
                        right,
                        step,
                        j,
                        cs.len(),
                        if ctx.coded() { &enc } else { raw },
                    )
                    .await?;
                } else {
                    // SAFETY: no mutable view is alive.
                    ctx.forward(right, step, j, cs.len(), &data, unsafe {
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
