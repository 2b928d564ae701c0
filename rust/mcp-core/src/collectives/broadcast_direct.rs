//! Broadcast among the ranks of one host by reading the root's tensor directly
//! ([`PeerTensors`]): one kernel copy per rank, no hops. Small frames agree on the reads
//! (steps 0 and 1) and tell the root "I have read it" (step 2), so that it does not return
//! while a rank still reads. Where any rank cannot read, every rank runs the binomial tree in
//! the same operation.

use super::peer_tensors::{PeerTensors, FALLBACK_PART};
use super::{broadcast_binomial, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::transport::Transport;

/// Step of "I have read it".
const READ: u32 = 2;

/// Broadcasts `buf` from `root` among every rank of the transport, in place, reading the
/// root's tensor directly where the kernel allows it.
pub async fn broadcast_direct<T: Transport>(
    ctx: &OpCtx<'_, T>,
    buf: RawBuf,
    dtype: DType,
    root: usize,
) -> Result<()> {
    let (w, r, elem) = (ctx.world(), ctx.rank(), dtype.size());
    if ctx.sub.is_some() {
        return Err(Error::InvalidArgument(
            "the direct broadcast runs among every rank of the transport only".into(),
        ));
    }
    if w == 1 || buf.is_empty() {
        return broadcast_binomial(ctx, buf, elem, root).await;
    }
    let Some(tensors) = PeerTensors::agree(ctx, buf, dtype.size()).await? else {
        let all: Vec<usize> = (0..w).collect();
        return broadcast_binomial(&ctx.part(&all, FALLBACK_PART, false)?, buf, elem, root).await;
    };
    if r == root {
        for p in (0..w).filter(|&p| p != r) {
            ctx.recv(p, READ, 0, 1).await?;
        }
    } else {
        // SAFETY: our buffer is ours alone (only the root's is read); the root's is final
        // until we say we have read it.
        unsafe { tensors.read(ctx, root, 0, buf.slice_mut(0..buf.len()))? };
        ctx.send(root, READ, 0, 1, &[1]).await?;
    }
    Ok(())
}
