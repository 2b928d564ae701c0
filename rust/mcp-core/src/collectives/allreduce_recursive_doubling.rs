//! Recursive-doubling all-reduce: `log2 W` rounds, in each of which every rank exchanges its
//! whole buffer with the rank whose index differs in one bit. The least latency for small
//! buffers. A world that is not a power of two first folds its extra ranks into partners
//! and hands them the result at the end. Every rank combines the same two operands in each
//! round (the ops are commutative), so all ranks end with identical bits.

use super::{chunks, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce::finish_avg;
use crate::transport::Transport;
use std::ops::Range;

const FOLD_STEP: u32 = 0;
const RESULT_STEP: u32 = 63;

/// Sends `buf`'s chunks to `peer`. With a codec, first replaces them by their decoding
/// (`settle`), so that both partners of a round add exactly the same two operands.
async fn send_all<T: Transport>(
    ctx: &OpCtx<'_, T>,
    peer: usize,
    step: u32,
    buf: RawBuf,
    cs: &[Range<usize>],
) -> Result<()> {
    for (j, c) in cs.iter().enumerate() {
        if ctx.coded() {
            // SAFETY: the caller holds no other view while sending.
            let enc = ctx.settle(unsafe { buf.slice_mut(c.clone()) })?;
            ctx.send(peer, step, j, cs.len(), &enc).await?;
        } else {
            // SAFETY: the caller holds no mutable view while sending.
            ctx.send(peer, step, j, cs.len(), unsafe { buf.slice(c.clone()) })
                .await?;
        }
    }
    Ok(())
}

/// All-reduces `buf` in place by recursive doubling.
pub async fn allreduce_recursive_doubling<T: Transport>(
    ctx: &OpCtx<'_, T>,
    buf: RawBuf,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (w, r) = (ctx.world(), ctx.rank());
    let cs = chunks(0..buf.len(), dtype.size(), ctx.chunk_bytes);
    let p = if w == 0 {
        1
    } else {
        1usize << (usize::BITS - 1 - w.leading_zeros())
    };
    let rem = w - p;
    let recv_reduce = |peer: usize, step: u32| {
        let cs = &cs;
        async move {
            for (j, c) in cs.iter().enumerate() {
                let data = ctx.recv(peer, step, j, c.len()).await?;
                // SAFETY: the only view of this chunk.
                ctx.accumulate(&data, op, unsafe { buf.slice_mut(c.clone()) })?;
            }
            Ok::<(), Error>(())
        }
    };
    // Fold: among the first 2*rem ranks, even ones hand their data to the next odd one.
    let newrank = if r < 2 * rem {
        if r % 2 == 0 {
            for (j, c) in cs.iter().enumerate() {
                // SAFETY: a send only reads the buffer.
                let raw = unsafe { buf.slice(c.clone()) };
                ctx.send_data(r + 1, FOLD_STEP, j, cs.len(), raw).await?;
            }
            for (j, c) in cs.iter().enumerate() {
                let data = ctx.recv(r + 1, RESULT_STEP, j, c.len()).await?;
                // SAFETY: the only view of this chunk.
                ctx.store(&data, unsafe { buf.slice_mut(c.clone()) })?;
            }
            return Ok(());
        }
        recv_reduce(r - 1, FOLD_STEP).await?;
        r / 2
    } else {
        r - rem
    };
    // Rounds are numbered from 0 like every algorithm's first step, so that a peer running a
    // different collective under the same sequence number is caught by the spec check at once
    // (the fold frames use step 0 too, but between a different pair of ranks).
    let mut mask = 1usize;
    let mut round = 0u32;
    while mask < p {
        let partner_new = newrank ^ mask;
        let partner = if partner_new < rem {
            partner_new * 2 + 1
        } else {
            partner_new + rem
        };
        send_all(ctx, partner, round, buf, &cs).await?;
        recv_reduce(partner, round).await?;
        mask <<= 1;
        round += 1;
    }
    if op == ReduceOp::Avg {
        // SAFETY: no other view is alive.
        finish_avg(dtype, unsafe { buf.slice_mut(0..buf.len()) }, w)?;
    }
    if ctx.coded() {
        // Every rank holds the same sum; all keep its decoding, which is what a folded
        // partner receives below.
        for c in &cs {
            // SAFETY: no other view is alive.
            ctx.settle(unsafe { buf.slice_mut(c.clone()) })?;
        }
    }
    if r < 2 * rem {
        for (j, c) in cs.iter().enumerate() {
            // SAFETY: a send only reads the buffer.
            let raw = unsafe { buf.slice(c.clone()) };
            ctx.send_data(r - 1, RESULT_STEP, j, cs.len(), raw).await?;
        }
    }
    Ok(())
}
