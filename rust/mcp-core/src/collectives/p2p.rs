//! Point-to-point send and receive, in chunks, matched by per-pair sequence number and tag.

use super::{chunks, OpCtx};
use crate::buffer::RawBuf;
use crate::error::Result;
use crate::transport::Transport;

/// Sends `buf` to `peer`.
pub async fn send<T: Transport>(
    ctx: &OpCtx<'_, T>,
    buf: RawBuf,
    elem: usize,
    peer: usize,
) -> Result<()> {
    let cs = chunks(0..buf.len(), elem, ctx.chunk_bytes);
    for (j, c) in cs.iter().enumerate() {
        // SAFETY: a send only reads its buffer.
        let raw = unsafe { buf.slice(c.clone()) };
        ctx.send_data(peer, 0, j, cs.len(), raw).await?;
    }
    Ok(())
}

/// Receives into `buf` from `peer`.
pub async fn recv<T: Transport>(
    ctx: &OpCtx<'_, T>,
    buf: RawBuf,
    elem: usize,
    peer: usize,
) -> Result<()> {
    let cs = chunks(0..buf.len(), elem, ctx.chunk_bytes);
    for (j, c) in cs.iter().enumerate() {
        let data = ctx.recv(peer, 0, j, c.len()).await?;
        // SAFETY: the only view of this chunk.
        ctx.store(&data, unsafe { buf.slice_mut(c.clone()) })?;
    }
    Ok(())
}
