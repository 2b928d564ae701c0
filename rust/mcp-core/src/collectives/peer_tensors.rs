//! The tensors of the other ranks of this host, read where they lie
//! ([`peer_memory`]: one kernel copy per byte), for the algorithms that move data inside a
//! host without frames.
//!
//! [`PeerTensors::agree`] exchanges the tensors' addresses among the members of a context and
//! every member's verdict on whether it can read all the others (a probe read of each): every
//! member gets the same answer, so all read directly or none does, and those that do not fall
//! back together, in the same operation. Once the members have agreed to read each other,
//! each remembers it (by the peers' ranks and pids); each address then carries whether its
//! sender remembers this very set, and when every member does, the probes and verdicts are
//! skipped: one round of small frames less per operation, decided alike by every member.

use super::OpCtx;
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce::reduce_into;
use crate::transport::peer_memory::{self, PeerReadError};
use crate::transport::Transport;
use std::cell::RefCell;
use std::ops::Range;

/// Bytes of a peer's tensor read and reduced at once: fits in L2 beside the destination.
const PIECE: usize = 512 << 10;

/// Step of the address exchange, within the part the caller gives.
const ADDRESS: u32 = 0;
/// Step of the verdicts.
const VERDICT: u32 = 1;
/// The part of an operation that runs its ring or tree instead, when some member cannot
/// read the others.
pub(super) const FALLBACK_PART: u32 = 1;

/// Where each member's tensor lies: (pid, address), by member index (ours unused).
pub(super) struct PeerTensors {
    at: Vec<(u32, u64)>,
    me: usize,
    elem: usize,
}

thread_local! {
    /// Where the pieces of the peers' tensors land before they are reduced: kept per thread
    /// between operations, since a fresh half-megabyte allocation per operation costs a page
    /// fault per page (about a third of a 128 KiB direct all-reduce's time).
    static SCRATCH: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

impl PeerTensors {
    /// Exchanges addresses and verdicts among the members of `ctx` (steps 0 and 1 of its
    /// part) for `buf` of `elem`-byte elements. `Some` when every member can read every
    /// other's `buf`; `None`, on every member alike, when any cannot.
    pub(super) async fn agree<T: Transport>(
        ctx: &OpCtx<'_, T>,
        buf: RawBuf,
        elem: usize,
    ) -> Result<Option<PeerTensors>> {
        let (w, me) = (ctx.world(), ctx.rank());
        let peers: Vec<usize> = (0..w).filter(|&p| p != me).collect();
        // The peers this rank would read, by (rank, pid); `None` when it would not read one.
        let readable: Option<Vec<(usize, u32)>> = peers
            .iter()
            .map(|&p| {
                let rank = ctx.address(p, 0).0;
                ctx.t
                    .local_pid(rank)
                    .filter(|_| ctx.t.reads_peer_memory(rank))
                    .map(|pid| (rank, pid))
            })
            .collect();
        let known = readable
            .as_deref()
            .is_some_and(|r| ctx.t.direct_reads_known(r));
        let mut hello = buf.address().to_le_bytes().to_vec();
        hello.push(u8::from(known));
        for &p in &peers {
            ctx.send(p, ADDRESS, 0, 1, &hello).await?;
        }
        let mut at = vec![(0u32, 0u64); w];
        let mut all_known = known;
        for &p in &peers {
            let m = ctx.recv(p, ADDRESS, 0, 9).await?.to_vec();
            let (addr, flag) = match m.as_slice() {
                [a @ .., f] if a.len() == 8 => (a, *f),
                _ => {
                    return Err(Error::Protocol(format!(
                        "rank {p} sent a {}-byte address",
                        m.len()
                    )))
                }
            };
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(addr);
            at[p].1 = u64::from_le_bytes(bytes);
            all_known &= flag == 1;
        }
        if let (true, Some(readable)) = (all_known, &readable) {
            // Every member agreed on these same processes before: no probe, no verdicts.
            for (&p, &(_, pid)) in peers.iter().zip(readable) {
                at[p].0 = pid;
            }
            ctx.t.direct_reads_agreed(true);
            return Ok(Some(PeerTensors {
                at,
                me,
                elem: elem.max(1),
            }));
        }
        let mut ok = readable.is_some();
        if let Some(readable) = &readable {
            for (&p, &(_, pid)) in peers.iter().zip(readable) {
                at[p].0 = pid;
                // One element tells whether the kernel lets us read this peer at all.
                let mut probe = vec![0u8; elem.min(buf.len())];
                match peer_memory::read(pid, at[p].1, &mut probe) {
                    Ok(()) => {}
                    Err(PeerReadError::Refused { .. }) => {
                        ok = false;
                        break;
                    }
                    Err(e) => return Err(read_error(ctx, p, e)),
                }
            }
        }
        for &p in &peers {
            ctx.send(p, VERDICT, 0, 1, &[u8::from(ok)]).await?;
        }
        for &p in &peers {
            ok &= ctx.recv(p, VERDICT, 0, 1).await?.to_vec() == [1];
        }
        ctx.t.direct_reads_agreed(ok);
        if let (true, Some(readable)) = (ok, &readable) {
            ctx.t.remember_direct_reads(readable);
        }
        Ok(ok.then(|| PeerTensors {
            at,
            me,
            elem: elem.max(1),
        }))
    }

    /// `dst = op(dst, every other member's bytes at [src])`, a cache-sized piece at a time,
    /// the members in index order.
    ///
    /// # Safety
    /// Every other member's `[src]` must be final (not written) until this returns.
    pub(super) unsafe fn reduce_from_all<T: Transport>(
        &self,
        ctx: &OpCtx<'_, T>,
        src: Range<usize>,
        dst: &mut [u8],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if dst.len() != src.len() {
            return Err(Error::InvalidArgument(format!(
                "a direct reduce of {} bytes into {}",
                src.len(),
                dst.len()
            )));
        }
        let piece = (PIECE / self.elem).max(1) * self.elem;
        let words = piece.min(dst.len()).div_ceil(8);
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => {
                if scratch.len() < words {
                    scratch.resize(words, 0);
                }
                // SAFETY: this function's contract is the helper's.
                unsafe { self.reduce_through(ctx, src, dst, dtype, op, piece, &mut scratch) }
            }
            // Re-entered (the reduction does not nest; kept total): allocate.
            Err(_) => {
                let mut fresh = vec![0u64; words];
                // SAFETY: this function's contract is the helper's.
                unsafe { self.reduce_through(ctx, src, dst, dtype, op, piece, &mut fresh) }
            }
        })
    }

    /// [`Self::reduce_from_all`] through `words` of scratch.
    ///
    /// # Safety
    /// As for [`Self::reduce_from_all`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn reduce_through<T: Transport>(
        &self,
        ctx: &OpCtx<'_, T>,
        src: Range<usize>,
        dst: &mut [u8],
        dtype: DType,
        op: ReduceOp,
        piece: usize,
        words: &mut [u64],
    ) -> Result<()> {
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(words);
        for (i, d) in dst.chunks_mut(piece).enumerate() {
            let from = src.start + i * piece;
            for p in 0..self.at.len() {
                if p == self.me {
                    continue;
                }
                let s = &mut scratch[..d.len()];
                // SAFETY: by this function's contract.
                unsafe { self.read(ctx, p, from, s)? };
                reduce_into(dtype, op, d, s)?;
            }
        }
        Ok(())
    }

    /// Tells every other member that this one has finished reading it (step `step`) and
    /// waits until each has said the same: no member hands its tensor back to its caller
    /// while another may still read it.
    pub(super) async fn all_read<T: Transport>(&self, ctx: &OpCtx<'_, T>, step: u32) -> Result<()> {
        let peers = || (0..self.at.len()).filter(|&p| p != self.me);
        for p in peers() {
            ctx.send(p, step, 0, 1, &[1]).await?;
        }
        for p in peers() {
            ctx.recv(p, step, 0, 1).await?;
        }
        Ok(())
    }

    /// Copies the bytes at offset `offset` of member `p`'s tensor into `dst`.
    ///
    /// # Safety
    /// Member `p`'s `[offset, offset + dst.len())` must be final until this returns.
    pub(super) unsafe fn read<T: Transport>(
        &self,
        ctx: &OpCtx<'_, T>,
        p: usize,
        offset: usize,
        dst: &mut [u8],
    ) -> Result<()> {
        let (pid, addr) = self.at[p];
        peer_memory::read(pid, addr + offset as u64, dst).map_err(|e| read_error(ctx, p, e))?;
        ctx.t.read_from_peer(dst.len());
        Ok(())
    }
}

/// The error a failed read of member `peer`'s tensor becomes.
fn read_error<T: Transport>(ctx: &OpCtx<'_, T>, peer: usize, e: PeerReadError) -> Error {
    let op = format!("{} #{}", ctx.kind.op_name(), ctx.seq);
    let rank = ctx.address(peer, 0).0;
    match e {
        PeerReadError::Gone { .. } => Error::PeerLost {
            rank,
            op,
            reason: format!("{e} (its process exited while we read its tensor)"),
        },
        _ => Error::Protocol(format!(
            "{op}: reading rank {rank}'s tensor directly failed: {e}"
        )),
    }
}
