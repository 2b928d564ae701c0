//! Hierarchical all-reduce: reduce-scatter inside each host, all-reduce of each shard between
//! hosts by the local rank that owns it, all-gather inside each host.
//!
//! The buffer is cut into `m` shards, `m` the fewest ranks any host has. On host `h` (`L_h`
//! ranks), local rank `i < m` owns shard `i`; on a larger host the other ranks own nothing
//! (they still take part in the intra-host ring, which moves their data). Then local rank
//! `i` of every host all-reduces shard `i` with its counterparts around a ring of the `H`
//! hosts, all `m` rings at once, so every owner drives its share of the network. Each host
//! sends `2(H-1)/H` of the buffer to other hosts (the flat ring: up to `2(W-1)/W` per
//! host-crossing link, once per host boundary on the ring). Codecs apply to the inter-host
//! ring only; its owners encode each finished piece once and keep what they sent, and the
//! intra-host all-gather copies bits, so every rank ends with identical bits.

use super::ring_parts::{allgather_parts, reduce_scatter_parts};
use super::{segments_of, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::reduce::finish_avg;
use crate::topology::Topology;
use crate::transport::Transport;

/// All-reduces `buf` (elements of `dtype`) in place, host by host, over `topo`.
pub async fn allreduce_hierarchical<T: Transport>(
    ctx: &OpCtx<'_, T>,
    topo: &Topology,
    buf: RawBuf,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    topo.check_world(ctx.world())?;
    let me = ctx.rank();
    let elem = dtype.size();
    // An average is a sum until the end, divided once by the whole world.
    let part_op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    let (host, local) = (topo.host_of(me), topo.local_rank(me));
    let host_ranks = topo.ranks_of(host);
    let m = topo.min_local();
    let shards = segments_of(0..buf.len(), m, elem);
    let intra: Vec<Vec<_>> = (0..host_ranks.len())
        .map(|i| shards.get(i).cloned().into_iter().collect())
        .collect();

    let inside = ctx.part(host_ranks, 0, true)?;
    reduce_scatter_parts(&inside, buf, &intra, dtype, part_op).await?;
    if local < m {
        let peers = topo.counterparts(local);
        let pieces: Vec<Vec<_>> = segments_of(shards[local].clone(), peers.len(), elem)
            .into_iter()
            .map(|p| vec![p])
            .collect();
        reduce_scatter_parts(&ctx.part(&peers, 1, false)?, buf, &pieces, dtype, part_op).await?;
        allgather_parts(&ctx.part(&peers, 2, false)?, buf, &pieces, elem).await?;
    }
    allgather_parts(&ctx.part(host_ranks, 3, true)?, buf, &intra, elem).await?;

    if op == ReduceOp::Avg {
        // SAFETY: every network view of the buffer has ended.
        finish_avg(dtype, unsafe { buf.slice_mut(0..buf.len()) }, topo.world())?;
    }
    Ok(())
}
