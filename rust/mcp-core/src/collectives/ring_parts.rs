//! The two halves of the ring, in place, over parts of a buffer that each member owns: the
//! building block of the hierarchical collectives, whose shards are not the `W` equal
//! segments of the flat ring (a member may own several ranges, or none).
//!
//! Member `i` owns the ranges `parts[i]`. A reduce-scatter leaves the reduction of member
//! `i`'s ranges in member `i`'s buffer; an all-gather copies every member's ranges into every
//! member's buffer. Each member's ranges travel as one sequence of chunks, so a member that
//! owns nothing still exchanges one empty frame per step (and a size disagreement is caught).

use super::{chunks, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::transport::Transport;
use std::ops::Range;

/// The chunks of one member's ranges, in order; one empty chunk when they hold nothing.
fn pieces(ranges: &[Range<usize>], elem: usize, chunk_bytes: usize) -> Vec<Range<usize>> {
    let out: Vec<_> = ranges
        .iter()
        .filter(|r| !r.is_empty())
        .flat_map(|r| chunks(r.clone(), elem, chunk_bytes))
        .collect();
    if out.is_empty() {
        return std::iter::once(0..0).collect();
    }
    out
}

/// Reduces every member's buffer into member `i`'s ranges `parts[i]`, in place (the other
/// ranges are left holding partial results). `op` is applied as given: an average is the
/// caller's to finish.
pub(crate) async fn reduce_scatter_parts<T: Transport>(
    ctx: &OpCtx<'_, T>,
    buf: RawBuf,
    parts: &[Vec<Range<usize>>],
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (w, r) = (ctx.world(), ctx.rank());
    if w == 1 {
        return Ok(());
    }
    let elem = dtype.size();
    let ps: Vec<_> = parts
        .iter()
        .map(|p| pieces(p, elem, ctx.chunk_bytes))
        .collect();
    let (right, left) = ((r + 1) % w, (r + w - 1) % w);
    let first = &ps[(r + w - 1) % w];
    for (j, c) in first.iter().enumerate() {
        // SAFETY: this member's part r-1 is never written below (hops write r-2 .. r).
        ctx.send_data(right, 0, j, first.len(), unsafe { buf.slice(c.clone()) })
            .await?;
    }
    for h in 0..w - 1 {
        let cs = &ps[(r + 2 * w - h - 2) % w];
        for (j, c) in cs.iter().enumerate() {
            let data = ctx.recv(left, h as u32, j, c.len()).await?;
            // SAFETY: the only view of this chunk.
            ctx.accumulate(&data, op, unsafe { buf.slice_mut(c.clone()) })?;
            if h + 1 < w - 1 {
                // SAFETY: the mutable view above has ended.
                let partial = unsafe { buf.slice(c.clone()) };
                ctx.send_data(right, h as u32 + 1, j, cs.len(), partial)
                    .await?;
            }
        }
    }
    Ok(())
}

/// Copies every member's ranges `parts[i]` into every member's buffer, in place. With a
/// codec, each owner encodes its ranges once and keeps their decoding, and the hops pass the
/// encoded bytes on untouched: every member ends with the same bits.
pub(crate) async fn allgather_parts<T: Transport>(
    ctx: &OpCtx<'_, T>,
    buf: RawBuf,
    parts: &[Vec<Range<usize>>],
    elem: usize,
) -> Result<()> {
    let (w, r) = (ctx.world(), ctx.rank());
    if w == 1 {
        return Ok(());
    }
    let ps: Vec<_> = parts
        .iter()
        .map(|p| pieces(p, elem, ctx.chunk_bytes))
        .collect();
    let (right, left) = ((r + 1) % w, (r + w - 1) % w);
    let own = &ps[r];
    for (j, c) in own.iter().enumerate() {
        if ctx.coded() {
            // SAFETY: part r is never written by the hops below; one view at a time.
            let enc = ctx.settle(unsafe { buf.slice_mut(c.clone()) })?;
            ctx.send(right, 0, j, own.len(), &enc).await?;
        } else {
            // SAFETY: part r is never written by the hops below.
            ctx.send(right, 0, j, own.len(), unsafe { buf.slice(c.clone()) })
                .await?;
        }
    }
    for h in 0..w - 1 {
        let cs = &ps[(r + w - h - 1) % w];
        for (j, c) in cs.iter().enumerate() {
            let data = ctx.recv(left, h as u32, j, c.len()).await?;
            // SAFETY: the only view of this chunk.
            ctx.store(&data, unsafe { buf.slice_mut(c.clone()) })?;
            if h + 1 < w - 1 {
                // SAFETY: the mutable view above has ended.
                let raw = unsafe { buf.slice(c.clone()) };
                ctx.forward(right, h as u32 + 1, j, cs.len(), &data, raw)
                    .await?;
            }
        }
    }
    Ok(())
}
