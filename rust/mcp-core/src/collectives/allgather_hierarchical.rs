//! Hierarchical all-gather: gather inside each host, exchange between hosts, spread inside
//! each host.
//!
//! With `m` the fewest ranks any host has, each host's ranks fall into `m` groups (contiguous
//! local ranks, see [`Topology::group`]). After an intra-host all-gather every rank holds its
//! host's blocks; local rank `i < m` then all-gathers group `i` of every host with its
//! counterparts around a ring of the hosts (the `m` rings run at once), and a last intra-host
//! all-gather spreads what each owner received. With equal hosts each host sends `(H-1)/H`
//! of the output to other hosts (a flat ring: `(W-1)/W` per host-crossing link). With a codec the inter-host owners encode their host's blocks once and keep
//! the decoding, and the last step carries those blocks back to their host too, so that
//! every rank (the blocks' own ranks included) ends with identical bits.

use super::ring_parts::allgather_parts;
use super::OpCtx;
use crate::buffer::RawBuf;
use crate::error::{Error, Result};
use crate::topology::Topology;
use crate::transport::Transport;
use std::ops::Range;

/// Gathers every rank's `input` into `out` (`W` blocks of `input.len()` bytes, rank order),
/// host by host, over `topo`.
pub async fn allgather_hierarchical<T: Transport>(
    ctx: &OpCtx<'_, T>,
    topo: &Topology,
    out: RawBuf,
    input: RawBuf,
    elem: usize,
) -> Result<()> {
    topo.check_world(ctx.world())?;
    let (w, me, n) = (ctx.world(), ctx.rank(), input.len());
    if out.len() != n * w {
        return Err(Error::InvalidArgument(format!(
            "all_gather output has {} bytes, expected world_size ({w}) x {n}",
            out.len()
        )));
    }
    {
        // SAFETY: `out` and `input` are different allocations, or `input` is exactly block me.
        let dst = unsafe { out.slice_mut(me * n..(me + 1) * n) };
        let src = unsafe { input.slice(0..n) };
        if dst.as_ptr() != src.as_ptr() {
            dst.copy_from_slice(src);
        }
    }
    let block = |q: usize| q * n..(q + 1) * n;
    let group_blocks = |h: usize, i: usize| -> Vec<Range<usize>> {
        let rs = topo.ranks_of(h);
        topo.group(h, i).map(|l| block(rs[l])).collect()
    };
    let (host, local, m) = (topo.host_of(me), topo.local_rank(me), topo.min_local());
    let host_ranks = topo.ranks_of(host);

    let own: Vec<Vec<_>> = host_ranks.iter().map(|&q| vec![block(q)]).collect();
    allgather_parts(&ctx.part(host_ranks, 0, true)?, out, &own, elem).await?;
    if local < m {
        let peers = topo.counterparts(local);
        let parts: Vec<Vec<_>> = (0..topo.hosts()).map(|h| group_blocks(h, local)).collect();
        allgather_parts(&ctx.part(&peers, 1, false)?, out, &parts, elem).await?;
    }
    // Each owner spreads what it received: other hosts' blocks, and with a codec its own
    // host's blocks as well (their bits are now the decoded ones).
    let coded = ctx.coded() && topo.hosts() > 1;
    let spread: Vec<Vec<_>> = (0..host_ranks.len())
        .map(|i| {
            if i >= m {
                return Vec::new();
            }
            (0..topo.hosts())
                .filter(|&h| h != host || coded)
                .flat_map(|h| group_blocks(h, i))
                .collect()
        })
        .collect();
    allgather_parts(&ctx.part(host_ranks, 2, true)?, out, &spread, elem).await
}
