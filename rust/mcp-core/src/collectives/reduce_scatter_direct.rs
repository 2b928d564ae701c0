//! Reduce-scatter among the ranks of one host by reading each other's inputs directly
//! ([`PeerTensors`]): rank `r` reduces block `r` of every peer's input into its output, a
//! cache-sized piece at a time (one kernel copy and the reduction per byte). Small frames
//! agree on the reads (steps 0 and 1) and say "I have read yours" (step 2), so that no rank
//! returns while a peer still reads its input. Where any rank cannot read, every rank runs
//! the ring reduce-scatter in the same operation.

use super::peer_tensors::{PeerTensors, FALLBACK_PART};
use super::{reduce_scatter_ring, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce::finish_avg;
use crate::transport::Transport;

/// Step of "I have read yours".
const READ: u32 = 2;

/// Reduces `input` (`W` blocks of `out.len()` bytes) across every rank of the transport and
/// leaves block `rank` of the result in `out`, reading the peers' inputs directly where the
/// kernel allows it. `input` is left as it was.
pub async fn reduce_scatter_direct<T: Transport>(
    ctx: &OpCtx<'_, T>,
    out: RawBuf,
    input: RawBuf,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    let (w, r) = (ctx.world(), ctx.rank());
    if ctx.sub.is_some() {
        return Err(Error::InvalidArgument(
            "the direct reduce-scatter runs among every rank of the transport only".into(),
        ));
    }
    let n = out.len();
    if w == 1 || n == 0 || input.len() != n * w {
        return reduce_scatter_ring(ctx, out, input, dtype, op).await;
    }
    let Some(tensors) = PeerTensors::agree(ctx, input, dtype.size()).await? else {
        let all: Vec<usize> = (0..w).collect();
        let ring = ctx.part(&all, FALLBACK_PART, false)?;
        return reduce_scatter_ring(&ring, out, input, dtype, op).await;
    };
    let mine = r * n..(r + 1) * n;
    if out.address() != input.address() + mine.start as u64 {
        // SAFETY: the output is ours alone and not our input's block r (checked); our input
        // is only read, by us and by the peers.
        unsafe { out.slice_mut(0..n) }.copy_from_slice(unsafe { input.slice(mine.clone()) });
    }
    // SAFETY: the output is ours alone; if it is our input's block r, peers read only the
    // other blocks of our input.
    let dst = unsafe { out.slice_mut(0..n) };
    // SAFETY: the peers' inputs are final for the whole operation.
    unsafe { tensors.reduce_from_all(ctx, mine, dst, dtype, op)? };
    if op == ReduceOp::Avg {
        finish_avg(dtype, dst, w)?;
    }
    tensors.all_read(ctx, READ).await
}
