//! All-reduce among the ranks of one host by reading each other's tensors directly
//! (cross-memory attach, [`peer_memory`]): no ring, no frames for the data.
//!
//! Rank `r` owns segment `r`. It reads segment `r` of every peer, a cache-sized piece at a
//! time, into scratch and reduces it into its own tensor (reduce-scatter: one kernel copy and
//! the reduction); then it reads every other segment, finished, straight from its owner's
//! tensor into its own (all-gather: one kernel copy). A ring over shared memory makes four
//! copies of each byte and two checksum passes; this makes two copies.
//!
//! Small frames order the reads: an address exchange (step 0), every rank's verdict on
//! whether it can read all its peers (step 1), "my segment is final" (step 2), and "I have
//! read yours" (step 3), so that
//! - nobody reads a segment before its owner has finished it,
//! - nobody overwrites segment `p` of its tensor before owner `p` has read it (the owner
//!   says its segment is final only after reading everybody's), and
//! - nobody returns, handing its tensor back to the caller, while a peer still reads it.
//!
//! When any rank cannot read any peer (the kernel refuses it, shared memory is off, the peer
//! is on another host), every rank learns it at step 1 and all run the ring all-reduce
//! instead, in the same operation. Codecs do not apply: the bytes never leave the host.

use super::peer_tensors::{PeerTensors, FALLBACK_PART};
use super::{allreduce_ring, segments, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce::finish_avg;
use crate::transport::Transport;

/// Step of "my segment is final" (steps 0 and 1 agree on the reads: [`PeerTensors::agree`]).
const FINAL: u32 = 2;
/// Step of "I have read yours".
const READ: u32 = 3;

/// All-reduces `buf` in place among every rank of the transport, reading the peers' tensors
/// directly where the kernel allows it, and with the ring algorithm where it does not.
pub async fn allreduce_direct<T: Transport>(
    ctx: &OpCtx<'_, T>,
    buf: RawBuf,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    if ctx.sub.is_some() {
        return Err(Error::InvalidArgument(
            "the direct all-reduce runs among every rank of the transport only".into(),
        ));
    }
    let (w, r) = (ctx.world(), ctx.rank());
    if w == 1 || buf.is_empty() {
        if op == ReduceOp::Avg {
            // SAFETY: nobody else sees the buffer.
            finish_avg(dtype, unsafe { buf.slice_mut(0..buf.len()) }, w)?;
        }
        return Ok(());
    }
    let Some(tensors) = PeerTensors::agree(ctx, buf, dtype.size()).await? else {
        let all: Vec<usize> = (0..w).collect();
        let ring = ctx.part(&all, FALLBACK_PART, false)?;
        return allreduce_ring(&ring, buf, dtype, op).await;
    };
    let peers: Vec<usize> = (0..w).filter(|&p| p != r).collect();
    let elem = dtype.size();
    let segs = segments(buf.len() / elem, w, elem);
    let mine = segs[r].clone();
    // SAFETY: segment r of our tensor is ours alone until we say it is final, and the peers'
    // segments r are their inputs, untouched until we say so (they write segment r of their
    // tensors only after our FINAL).
    unsafe { tensors.reduce_from_all(ctx, mine.clone(), buf.slice_mut(mine.clone()), dtype, op)? };
    if op == ReduceOp::Avg {
        // SAFETY: as above; the peers copy segment r only once it is final.
        finish_avg(dtype, unsafe { buf.slice_mut(mine) }, w)?;
    }
    for &p in &peers {
        ctx.send(p, FINAL, 0, 1, &[1]).await?;
    }
    for &p in &peers {
        ctx.recv(p, FINAL, 0, 1).await?;
        // SAFETY: owner p has read segment p of every tensor (it says so by FINAL), so this
        // range of ours is read by nobody now and we are its only writer; p's segment p is
        // final.
        unsafe { tensors.read(ctx, p, segs[p].start, buf.slice_mut(segs[p].clone()))? };
    }
    tensors.all_read(ctx, READ).await
}
