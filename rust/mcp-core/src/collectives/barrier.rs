//! Dissemination barrier: in round k every rank signals rank `r + 2^k` and waits for rank
//! `r - 2^k`; after `ceil(log2 W)` rounds every rank has heard, transitively, from all.

use super::OpCtx;
use crate::error::Result;
use crate::transport::Transport;

/// Returns once every rank has entered the barrier.
pub async fn barrier_dissemination<T: Transport>(ctx: &OpCtx<'_, T>) -> Result<()> {
    let (w, r) = (ctx.world(), ctx.rank());
    let mut dist = 1usize;
    let mut round = 0u32;
    while dist < w {
        ctx.send((r + dist) % w, round, 0, 1, &[]).await?;
        ctx.recv((r + w - dist) % w, round, 0, 0).await?;
        dist <<= 1;
        round += 1;
    }
    Ok(())
}
