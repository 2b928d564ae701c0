//! Timing one all-reduce of any size: the real algorithm on a small real buffer whose
//! frames stand for the full-size ones.
//!
//! Every rank holds `n` real `f32` elements (small integers, whose sum is exact in any order)
//! and the network's `scale` makes them weigh `bytes` on the wire; with a codec the real
//! encoded frames are scaled, so each codec's measured byte ratio is what the timing uses.
//! Frames are cut at a real group's grain (its default `chunk_bytes`, 1 MiB of the full-size
//! buffer), but a buffer into no more than [`PIPELINE_CHUNKS`] chunks: larger buffers are
//! pipelined at a coarser grain than a real run's (documented in `docs/simulator.md`).
//!
//! [`Algorithm::Auto`] is resolved as a real group resolves it, on the full size: recursive
//! doubling up to the default `small_bytes` (64 KiB), hierarchical when there is more than
//! one host and more than one rank on a host, the ring otherwise ([`resolve_auto`]).

use super::{simulate, SimConfig};
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::group::{Algorithm, Group, GroupConfig, Tensor};
use crate::topology::Topology as HostTopology;
use crate::transport::Transport;
use crate::wire::Codec;
use std::time::Duration;

/// Most chunks a whole-buffer step (tree, recursive doubling) is cut into for pipelining;
/// a buffer of fewer real chunks is cut as a real group cuts it.
pub const PIPELINE_CHUNKS: usize = 16;

/// What one simulated all-reduce took and moved.
#[derive(Debug, Clone, PartialEq)]
pub struct AllReduceTiming {
    /// The algorithm that ran ([`Algorithm::Auto`] resolved).
    pub algorithm: Algorithm,
    /// Virtual time until the last rank finished (successfully or not).
    pub elapsed: Duration,
    /// Wire bytes the busiest rank sent (scaled, headers included).
    pub max_rank_bytes: f64,
    /// Wire bytes a rank sent on average.
    pub mean_rank_bytes: f64,
    /// Wire bytes a host's card sent on average (to other hosts).
    pub host_card_bytes: f64,
    /// Frames on the network.
    pub frames: u64,
    /// Ranks whose operation succeeded.
    pub ok_ranks: usize,
    /// The first error a rank saw, if any did.
    pub first_error: Option<Error>,
    /// Without a codec: whether every successful rank holds the exact sum. With one: whether
    /// every successful rank holds the same bits.
    pub exact: bool,
}

/// The algorithm a real group's [`Algorithm::Auto`] picks for `bytes` per rank on `cfg`'s
/// hosts, with the default [`GroupConfig::small_bytes`]; any other algorithm is returned as is.
///
/// On one host a real group reads its peers' tensors directly ([`Algorithm::Direct`]); here
/// the ring over the intra-host links stands for it, so that a one-host simulation times its
/// links whether or not [`super::SimConfig::direct_reads`] is on.
pub fn resolve_auto(cfg: &SimConfig, algorithm: Algorithm, bytes: f64) -> Algorithm {
    let rph = cfg.topology.ranks_per_host.max(1);
    let hosts = cfg.world.div_ceil(rph);
    match algorithm {
        Algorithm::Auto if bytes <= GroupConfig::default().small_bytes as f64 => {
            Algorithm::RecursiveDoubling
        }
        Algorithm::Auto if hosts > 1 && rph > 1 => Algorithm::Hierarchical,
        Algorithm::Auto => Algorithm::Ring,
        a => a,
    }
}

fn value(rank: usize, i: usize) -> f32 {
    ((i * 7 + rank * 13) % 5) as f32 - 2.0
}

/// Times an all-reduce of `bytes` per rank (as `f32` gradients) with `algorithm` and
/// `codec` on `cfg`'s network (its `scale` is set here). [`Algorithm::Auto`] runs what a
/// real group would pick for the full size ([`resolve_auto`]); a hierarchical all-reduce
/// sees `cfg`'s hosts (`ranks_per_host` consecutive ranks each) as its group's topology.
pub fn time_all_reduce(
    cfg: &SimConfig,
    algorithm: Algorithm,
    bytes: f64,
    codec: Codec,
    timeout: Duration,
) -> Result<AllReduceTiming> {
    if !(bytes.is_finite() && bytes >= 4.0) {
        return Err(Error::InvalidArgument(format!(
            "an all-reduce needs at least one 4-byte element, got {bytes} bytes"
        )));
    }
    codec.check(DType::F32)?;
    let w = cfg.world;
    let algorithm = resolve_auto(cfg, algorithm, bytes);
    // Only the hierarchical algorithm reads the group's topology; the others keep the
    // default one (each rank would otherwise hold a copy of a table of the whole world).
    let hosts = match algorithm {
        Algorithm::Hierarchical => {
            let rph = cfg.topology.ranks_per_host.max(1);
            Some(HostTopology::from_host_of_rank(
                (0..w).map(|r| r / rph).collect(),
            )?)
        }
        _ => None,
    };
    // At least one element per ring segment, and a whole int8 block: on shorter frames the
    // block's scale would weigh more than it does on full-size ones.
    let min_segment = match codec {
        Codec::Int8 { block } => block as usize,
        _ => 1,
    };
    let n = ((bytes / 4.0).floor() as usize).clamp(1, (w * min_segment).max(256));
    let mut cfg = cfg.clone();
    cfg.scale = (bytes / (4.0 * n as f64)).max(1.0);
    // A real group's chunk of the full-size buffer, in the elements that stand for it: a
    // small buffer is as few frames as a real run sends (one, up to 1 MiB), and so pays the
    // per-frame overhead as often.
    let real_chunk = GroupConfig::default().chunk_bytes as f64 / (4.0 * cfg.scale);
    let chunk_elems = (real_chunk.ceil() as usize).max(n.div_ceil(PIPELINE_CHUNKS));
    let group_cfg = GroupConfig {
        timeout,
        chunk_bytes: chunk_elems.max(1) * 4,
        small_bytes: 0,
    };
    let (out, report) = simulate(&cfg, move |t| {
        let group_cfg = group_cfg.clone();
        let hosts = hosts.clone();
        async move {
            let r = t.rank();
            let g = Group::new(t, group_cfg);
            if let Some(topo) = hosts {
                if let Err(e) = g.set_topology(topo) {
                    return (Err(e), Vec::new());
                }
            }
            let mut v: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
            let shape = [n as u64];
            let raw: &mut [u8] = bytemuck::cast_slice_mut(&mut v);
            // SAFETY: `v` outlives the operation, which is awaited before `v` is read.
            let buf = unsafe { RawBuf::from_slice(raw) };
            let tensor = Tensor {
                buf,
                dtype: DType::F32,
                shape: &shape,
                codec,
            };
            let res = match g.all_reduce(tensor, ReduceOp::Sum, algorithm) {
                Ok(op) => op.await,
                Err(e) => Err(e),
            };
            (res, v)
        }
    })?;
    let want: Vec<f32> = (0..n).map(|i| (0..w).map(|r| value(r, i)).sum()).collect();
    let mut ok_ranks = 0;
    let mut first_error = None;
    let mut exact = true;
    let mut first_ok: Option<&Vec<f32>> = None;
    for (res, v) in &out {
        match res {
            Ok(()) => {
                ok_ranks += 1;
                let reference = if codec == Codec::None {
                    &want
                } else {
                    first_ok.get_or_insert(v)
                };
                exact &= v == reference;
            }
            Err(e) => {
                first_error.get_or_insert_with(|| e.clone());
            }
        }
    }
    let total: f64 = report.wire_bytes.iter().sum();
    Ok(AllReduceTiming {
        algorithm,
        elapsed: report.elapsed,
        max_rank_bytes: report.wire_bytes.iter().copied().fold(0.0, f64::max),
        mean_rank_bytes: total / w as f64,
        host_card_bytes: report.inter_host_bytes / w.div_ceil(cfg.topology.ranks_per_host) as f64,
        frames: report.frames,
        ok_ranks,
        first_error,
        exact,
    })
}
