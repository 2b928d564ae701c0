//! Binomial-tree broadcast: the root sends to ranks `root + 2^k`, and every rank that has the
//! data forwards each chunk to its own subtree as soon as it arrives. `log2 W` latencies, and
//! chunks flow through the tree in a pipeline.

use super::{chunks, OpCtx};
use crate::buffer::RawBuf;
use crate::error::Result;
use crate::transport::Transport;

/// Broadcasts `buf` from `root` to every rank, in place.
pub async fn broadcast_binomial<T: Transport>(
    ctx: &OpCtx<'_, T>,
    buf: RawBuf,
    elem: usize,
    root: usize,
) -> Result<()> {
    broadcast_steps(ctx, buf, elem, root, 0).await
}

/// The broadcast, with its steps numbered from `step_base` (so that it can follow another
/// phase of the same operation).
pub(crate) async fn broadcast_steps<T: Transport>(
    ctx: &OpCtx<'_, T>,
    buf: RawBuf,
    elem: usize,
    root: usize,
    step_base: u32,
) -> Result<()> {
    let w = ctx.world();
    if w == 1 {
        return Ok(());
    }
    let vr = (ctx.rank() + w - root) % w;
    let cs = chunks(0..buf.len(), elem, ctx.chunk_bytes);
    // Find the parent (lowest set bit of vr) and the children (vr + 2^k below it).
    let mut mask = 1usize;
    let mut parent = None;
    while mask < w {
        if vr & mask != 0 {
            parent = Some((vr - mask + root) % w);
            break;
        }
        mask <<= 1;
    }
    let mut children = Vec::new();
    let mut m = mask >> 1;
    while m > 0 {
        if vr + m < w {
            children.push((vr + m + root) % w);
        }
        m >>= 1;
    }
    for (j, c) in cs.iter().enumerate() {
        // What goes to the children: the bytes as received (never re-encoded), or at the
        // root the encoding whose decoding it keeps, so every rank ends with the same bits.
        let wire: Option<Vec<u8>> = match parent {
            Some(p) => {
                let data = ctx.recv(p, step_base, j, c.len()).await?;
                // SAFETY: the only view of this chunk.
                ctx.store(&data, unsafe { buf.slice_mut(c.clone()) })?;
                ctx.coded().then(|| data.to_vec())
            }
            // SAFETY: the only view of this chunk.
            None if ctx.coded() => Some(ctx.settle(unsafe { buf.slice_mut(c.clone()) })?),
            None => None,
        };
        for &child in &children {
            // SAFETY: no mutable view of this chunk is alive.
            let raw = unsafe { buf.slice(c.clone()) };
            ctx.send(
                child,
                step_base,
                j,
                cs.len(),
                wire.as_deref().unwrap_or(raw),
            )
            .await?;
        }
    }
    Ok(())
}
