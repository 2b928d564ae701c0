//! All-gather among the ranks of one host by reading each other's inputs directly
//! ([`PeerTensors`]): every block is copied once, by the kernel, from its rank's input into
//! each other rank's output. Small frames agree on the reads (steps 0 and 1) and say "I have
//! read yours" (step 2), so that no rank returns while a peer still reads its input. Where
//! any rank cannot read, every rank runs the ring all-gather in the same operation.

use super::peer_tensors::{PeerTensors, FALLBACK_PART};
use super::{allgather_ring, segments, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::transport::Transport;

/// Step of "I have read yours".
const READ: u32 = 2;

/// Gathers every rank's `input` into `out` (`W` blocks, rank order) among every rank of the
/// transport, reading the peers' inputs directly where the kernel allows it.
///
/// `input` may be `out`'s own block (in place): it is then not copied.
pub async fn allgather_direct<T: Transport>(
    ctx: &OpCtx<'_, T>,
    out: RawBuf,
    input: RawBuf,
    dtype: DType,
) -> Result<()> {
    let (w, r, elem) = (ctx.world(), ctx.rank(), dtype.size());
    if ctx.sub.is_some() {
        return Err(Error::InvalidArgument(
            "the direct all-gather runs among every rank of the transport only".into(),
        ));
    }
    if w == 1 || input.is_empty() || out.len() != input.len() * w {
        return allgather_ring(ctx, out, input, elem).await;
    }
    let Some(tensors) = PeerTensors::agree(ctx, input, dtype.size()).await? else {
        let all: Vec<usize> = (0..w).collect();
        return allgather_ring(&ctx.part(&all, FALLBACK_PART, false)?, out, input, elem).await;
    };
    let blocks = segments(out.len() / elem, w, elem);
    {
        // SAFETY: `out` and `input` are different allocations, or `input` is exactly block r;
        // peers read only our input.
        let dst = unsafe { out.slice_mut(blocks[r].clone()) };
        let src = unsafe { input.slice(0..input.len()) };
        if dst.as_ptr() != src.as_ptr() {
            dst.copy_from_slice(src);
        }
    }
    let peers: Vec<usize> = (0..w).filter(|&p| p != r).collect();
    for &p in &peers {
        // SAFETY: block p of our output is ours alone (peers read only our input, which is
        // block r at most); p's input is final for the whole operation.
        unsafe { tensors.read(ctx, p, 0, out.slice_mut(blocks[p].clone()))? };
    }
    tensors.all_read(ctx, READ).await
}
