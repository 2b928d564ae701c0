//! Hierarchical broadcast: the root sends to one leader per host (a binomial tree over the
//! hosts), then every leader broadcasts inside its host. The tensor crosses into each other
//! host once, instead of once per rank there. Codecs apply to the inter-host tree only: the
//! root keeps the decoding of what it sent and the leaders copy what they decoded, so every
//! rank ends with identical bits.

use super::broadcast::broadcast_steps;
use super::OpCtx;
use crate::buffer::RawBuf;
use crate::error::Result;
use crate::topology::Topology;
use crate::transport::Transport;

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
    if me == leader {
        let between = ctx.part(&leaders, 0, false)?;
        broadcast_steps(&between, buf, elem, topo.host_of(root), 0).await?;
    }
    let host_ranks = topo.ranks_of(host);
    let inside = ctx.part(host_ranks, 1, true)?;
    let from = topo.local_rank(leader);
    broadcast_steps(&inside, buf, elem, from, 0).await
}
