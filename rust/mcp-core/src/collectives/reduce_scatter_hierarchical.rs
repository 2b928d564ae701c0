//! Hierarchical reduce-scatter: reduce-scatter inside each host, reduce-scatter between
//! hosts, then each result block is handed to its rank inside its host.
//!
//! With `m` the fewest ranks any host has, each host's ranks fall into `m` groups
//! ([`Topology::group`]). The intra-host reduce-scatter leaves with local rank `i < m` its
//! host's partial sums of the blocks of group `i` of every host; local rank `i` of every host
//! then reduce-scatters those among its counterparts (each host keeps the totals of its own
//! group `i`), and sends each finished block to its rank. With equal hosts each host sends
//! `(H-1)/H` of the input to other hosts. Codecs apply to the inter-host part only; each
//! block ends on one rank, so there is nothing for ranks to disagree about.

use super::ring_parts::reduce_scatter_parts;
use super::{chunks, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce::finish_avg;
use crate::topology::Topology;
use crate::transport::Transport;
use std::ops::Range;

/// Reduces `input` (`W` blocks) across ranks and leaves block `rank` of the result in `out`,
/// host by host, over `topo`. `input` is left as it was.
pub async fn reduce_scatter_hierarchical<T: Transport>(
    ctx: &OpCtx<'_, T>,
    topo: &Topology,
    out: RawBuf,
    input: RawBuf,
    dtype: DType,
    op: ReduceOp,
) -> Result<()> {
    topo.check_world(ctx.world())?;
    let (w, me, n, elem) = (ctx.world(), ctx.rank(), out.len(), dtype.size());
    if input.len() != n * w {
        return Err(Error::InvalidArgument(format!(
            "reduce_scatter input has {} bytes, expected world_size ({w}) x {n}",
            input.len()
        )));
    }
    let part_op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    // SAFETY: the input is only read.
    let mut scratch = unsafe { input.slice(0..input.len()) }.to_vec();
    // SAFETY: `scratch` outlives every use of this handle below and nothing else touches it.
    let work = unsafe { RawBuf::from_slice(&mut scratch) };
    let block = |q: usize| q * n..(q + 1) * n;
    let group_blocks = |h: usize, i: usize| -> Vec<Range<usize>> {
        let rs = topo.ranks_of(h);
        topo.group(h, i).map(|l| block(rs[l])).collect()
    };
    let (host, local, m) = (topo.host_of(me), topo.local_rank(me), topo.min_local());
    let host_ranks = topo.ranks_of(host);

    let intra: Vec<Vec<_>> = (0..host_ranks.len())
        .map(|i| {
            if i >= m {
                return Vec::new();
            }
            (0..topo.hosts()).flat_map(|h| group_blocks(h, i)).collect()
        })
        .collect();
    let inside = ctx.part(host_ranks, 0, true)?;
    reduce_scatter_parts(&inside, work, &intra, dtype, part_op).await?;
    if local < m {
        let peers = topo.counterparts(local);
        let parts: Vec<Vec<_>> = (0..topo.hosts()).map(|h| group_blocks(h, local)).collect();
        reduce_scatter_parts(&ctx.part(&peers, 1, false)?, work, &parts, dtype, part_op).await?;
    }

    // Hand each finished block of this owner's group to its rank.
    let deliver = ctx.part(host_ranks, 2, true)?;
    let owner_of = |l: usize| (0..m).find(|&i| topo.group(host, i).contains(&l));
    if local < m {
        for l in topo.group(host, local).filter(|&l| l != local) {
            let cs = chunks(block(host_ranks[l]), elem, ctx.chunk_bytes);
            for (j, c) in cs.iter().enumerate() {
                // SAFETY: `work` is only read from here on.
                deliver
                    .send(l, 0, j, cs.len(), unsafe { work.slice(c.clone()) })
                    .await?;
            }
        }
    }
    let mine = block(me);
    match owner_of(local) {
        Some(o) if o != local => {
            let cs = chunks(mine.clone(), elem, ctx.chunk_bytes);
            for (j, c) in cs.iter().enumerate() {
                let data = deliver.recv(o, 0, j, c.len()).await?;
                let at = c.start - mine.start;
                // SAFETY: `out` is written only here, each chunk once.
                data.copy_to(unsafe { out.slice_mut(at..at + c.len()) })?;
            }
        }
        _ => {
            // SAFETY: `out` is written only here.
            unsafe { out.slice_mut(0..n) }.copy_from_slice(&scratch[mine]);
        }
    }
    if op == ReduceOp::Avg {
        // SAFETY: no other view is alive.
        finish_avg(dtype, unsafe { out.slice_mut(0..n) }, w)?;
    }
    Ok(())
}
