//! Hierarchical broadcast: the root sends to one leader per host (a binomial tree over the
//! hosts), then every leader broadcasts inside its host. The tensor crosses into each other
//! host once, instead of once per rank there. Codecs apply to the inter-host tree only: the
//! root keeps the decoding of what it sent and the leaders copy what they decoded, so every
//! rank ends with identical bits.
//!
//! Where the ranks of a host can read each other's tensors ([`PeerTensors`]) and the tensor
//! is larger than [`DIRECT_MIN`], each copies the leader's tensor once it has it (one kernel
//! copy, no tree inside the host); the host's ranks agree on that while the leaders talk.

use super::broadcast::broadcast_steps;
use super::peer_tensors::PeerTensors;
use super::OpCtx;
use crate::buffer::RawBuf;
use crate::error::Result;
use crate::topology::Topology;
use crate::transport::Transport;

/// Smallest tensor a host's ranks read from their leader directly: below, the rounds that
/// order the reads cost more than the tree's hops.
pub const DIRECT_MIN: usize = 64 << 10;

/// Broadcasts `buf` from `root` to every rank, in place, host by host, over `topo`.
pub async fn broadcast_hierarchical<T: Transport>(
    ctx: &OpCtx<'_, T>,
    topo: &Topology,
    buf: RawBuf,
    elem: usize,
    root: usize,
) -> Result<()> {
    topo.check_world(ctx.world())?;
    let me = ctx.rank();
    let leaders = topo.leaders(root);
    let host = topo.host_of(me);
    let leader = leaders[host];
    let host_ranks = topo.ranks_of(host);
    let from = topo.local_rank(leader);
    let direct = if host_ranks.len() > 1 && buf.len() > DIRECT_MIN {
        PeerTensors::agree(&ctx.part(host_ranks, 2, true)?, buf, elem).await?
    } else {
        None
    };
    if me == leader {
        let between = ctx.part(&leaders, 0, false)?;
        broadcast_steps(&between, buf, elem, topo.host_of(root), 0).await?;
    }
    let Some(tensors) = direct else {
        let inside = ctx.part(host_ranks, 1, true)?;
        return broadcast_steps(&inside, buf, elem, from, 0).await;
    };
    // Step 0: the leader has the tensor; step 1: a rank has read it.
    let signals = ctx.part(host_ranks, 3, true)?;
    let me_local = topo.local_rank(me);
    if me == leader {
        for i in (0..host_ranks.len()).filter(|&i| i != me_local) {
            signals.send(i, 0, 0, 1, &[1]).await?;
        }
        for i in (0..host_ranks.len()).filter(|&i| i != me_local) {
            signals.recv(i, 1, 0, 1).await?;
        }
    } else {
        signals.recv(from, 0, 0, 1).await?;
        // SAFETY: our tensor is ours alone (only the leader's is read); the leader's is final
        // until we say we have read it.
        unsafe { tensors.read(&signals, from, 0, buf.slice_mut(0..buf.len()))? };
        signals.send(from, 1, 0, 1, &[1]).await?;
    }
    Ok(())
}
