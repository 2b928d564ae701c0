//! Hierarchical all-reduce: reduce-scatter inside each host, all-reduce of each shard between
//! hosts by the local rank that owns it, all-gather inside each host; pipelined in stages so
//! that the three phases of different stages overlap.
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
//!
//! A large buffer goes through in stages (see [`stages`]): while the hosts exchange stage
//! `s`, the ranks of each host already reduce stage `s + 1` among themselves and gather stage
//! `s - 1`. Where the link between hosts is the bottleneck, the intra-host phases then hide
//! behind it instead of adding to it. Every stage is a separate part of the operation, with
//! its own steps, so the frames of different stages never share a key.
//!
//! Where the ranks of a host can read each other's tensors ([`PeerTensors`]), the intra-host
//! phases send no frames: owner `i` reduces shard `i` of the stage by reading it from its
//! local peers, and after the exchange between hosts they copy the finished shard from the
//! owner, once it says so (one small frame per stage and peer). The rings carry the data only
//! where the kernel refuses the reads.

use super::peer_tensors::PeerTensors;
use super::ring_parts::{allgather_parts, reduce_scatter_parts};
use super::{segments_of, OpCtx};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::reduce::finish_avg;
use crate::topology::Topology;
use crate::transport::Transport;
use std::ops::Range;
use tokio::sync::mpsc;

/// Frames (of the operation's `chunk_bytes`) that each shard owner moves per stage: enough
/// that a stage keeps the link busy, few enough that a 64 MiB buffer has several stages.
const STAGE_CHUNKS: usize = 4;
/// Most stages: each takes 4 parts of the operation's step space (256 parts in all).
pub const MAX_STAGES: usize = 60;
/// The part in which the ranks of a host agree on direct reads (after every stage's parts).
const AGREE_PART: u32 = 4 * MAX_STAGES as u32;
/// The part of "shard of stage `s` is final" signals (step `s`) and, last, "I have read
/// yours" (step `MAX_STAGES`).
const SIGNAL_PART: u32 = AGREE_PART + 1;

/// The byte ranges the pipeline moves one after the other: about `STAGE_CHUNKS` frames per
/// shard owner each, at most [`MAX_STAGES`], every one but the last a whole number of `unit`
/// elements (shards times hosts), so that each stage splits evenly wherever the whole
/// buffer does. One stage when there is nothing to overlap: a single host, or one rank per
/// host.
pub fn stages(topo: &Topology, len: usize, elem: usize, chunk_bytes: usize) -> Vec<Range<usize>> {
    let (m, hosts) = (topo.min_local().max(1), topo.hosts().max(1));
    let elems = len / elem;
    let unit = m * hosts;
    let target = chunk_bytes
        .max(elem)
        .saturating_mul(STAGE_CHUNKS)
        .saturating_mul(m);
    let wanted = len.div_ceil(target).clamp(1, MAX_STAGES);
    let per = elems / wanted / unit * unit;
    if hosts == 1 || topo.world() == hosts || wanted == 1 || per == 0 {
        return std::iter::once(0..len).collect();
    }
    let mut out: Vec<Range<usize>> = (0..wanted - 1)
        .map(|s| s * per * elem..(s + 1) * per * elem)
        .collect();
    out.push((wanted - 1) * per * elem..len);
    out
}

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
    let peers = topo.counterparts(local);
    let plan: Vec<Stage> = stages(topo, buf.len(), elem, ctx.chunk_bytes)
        .into_iter()
        .map(|range| Stage::new(range, m, host_ranks.len(), local, peers.len(), elem))
        .collect();

    // The ranks of this host read each other's tensors directly if they all can.
    let mut direct = None;
    if host_ranks.len() > 1 {
        let agree = ctx.part(host_ranks, AGREE_PART, true)?;
        direct = PeerTensors::agree(&agree, buf, dtype.size()).await?;
    }
    let signals = ctx.part(host_ranks, SIGNAL_PART, true)?;
    let locals: Vec<usize> = (0..host_ranks.len()).filter(|&i| i != local).collect();

    // Three loops, one per phase, each taking the stages in order; a stage passes from one
    // to the next through a channel as soon as its phase is done on this rank.
    let (scattered, mut to_exchange) = mpsc::unbounded_channel::<usize>();
    let (exchanged, mut to_gather) = mpsc::unbounded_channel::<usize>();
    let scatter = async {
        for (s, st) in plan.iter().enumerate() {
            if let Some(d) = &direct {
                if let Some(own) = st.intra[local].first() {
                    // SAFETY: our shard of this stage is ours alone until we say it is final;
                    // the peers' shards of it are their inputs, which they overwrite only
                    // after our signal.
                    unsafe {
                        let dst = buf.slice_mut(own.clone());
                        d.reduce_from_all(&signals, own.clone(), dst, dtype, part_op)?
                    };
                }
                // Let the exchange of the previous stage go on between the reductions.
                tokio::task::yield_now().await;
            } else {
                let inside = ctx.part(host_ranks, part(s, 0), true)?;
                reduce_scatter_parts(&inside, buf, &st.intra, dtype, part_op).await?;
            }
            // The receiver only goes when the operation is failing anyway.
            let _ = scattered.send(s);
        }
        drop(scattered);
        Ok::<(), Error>(())
    };
    let exchange = async {
        while let Some(s) = to_exchange.recv().await {
            if local < m {
                let pieces = &plan[s].pieces;
                let across = ctx.part(&peers, part(s, 1), false)?;
                reduce_scatter_parts(&across, buf, pieces, dtype, part_op).await?;
                let across = ctx.part(&peers, part(s, 2), false)?;
                allgather_parts(&across, buf, pieces, elem).await?;
            }
            let _ = exchanged.send(s);
        }
        drop(exchanged);
        Ok::<(), Error>(())
    };
    let gather = async {
        while let Some(s) = to_gather.recv().await {
            let Some(d) = &direct else {
                let inside = ctx.part(host_ranks, part(s, 3), true)?;
                allgather_parts(&inside, buf, &plan[s].intra, elem).await?;
                continue;
            };
            let intra = &plan[s].intra;
            if !intra[local].is_empty() {
                for &i in &locals {
                    signals.send(i, s as u32, 0, 1, &[1]).await?;
                }
            }
            for &i in &locals {
                let Some(shard) = intra[i].first() else {
                    continue;
                };
                signals.recv(i, s as u32, 0, 1).await?;
                // SAFETY: owner i has read this range of every tensor of the host and
                // finished it (its signal says so): nobody reads ours now, we alone write it.
                unsafe {
                    let dst = buf.slice_mut(shard.clone());
                    d.read(&signals, i, shard.start, dst)?
                };
            }
        }
        Ok::<(), Error>(())
    };
    tokio::try_join!(scatter, exchange, gather)?;
    if let Some(d) = &direct {
        // Nobody returns (handing its tensor back) while a local peer may still read it.
        d.all_read(&signals, MAX_STAGES as u32).await?;
    }

    if op == ReduceOp::Avg {
        // SAFETY: every network view of the buffer has ended.
        finish_avg(dtype, unsafe { buf.slice_mut(0..buf.len()) }, topo.world())?;
    }
    Ok(())
}

/// The part of the operation that phase `phase` (0-3) of stage `stage` runs as.
fn part(stage: usize, phase: u32) -> u32 {
    stage as u32 * 4 + phase
}

/// What one stage moves: each local rank's shard of it inside the host, and the pieces of
/// this rank's shard around the ring of hosts.
struct Stage {
    intra: Vec<Vec<Range<usize>>>,
    pieces: Vec<Vec<Range<usize>>>,
}

impl Stage {
    fn new(
        range: Range<usize>,
        m: usize,
        locals: usize,
        local: usize,
        hosts: usize,
        elem: usize,
    ) -> Stage {
        let shards = segments_of(range, m, elem);
        let intra = (0..locals)
            .map(|i| shards.get(i).cloned().into_iter().collect())
            .collect();
        let pieces = match shards.get(local) {
            Some(own) => segments_of(own.clone(), hosts, elem)
                .into_iter()
                .map(|p| vec![p])
                .collect(),
            None => Vec::new(),
        };
        Stage { intra, pieces }
    }
}
