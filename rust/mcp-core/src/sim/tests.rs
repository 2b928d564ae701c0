//! The simulator runs the real collectives: a thousand ranks bit-exact, seeded replay,
//! failures in virtual time, and the link model's timings checked against its formula.

use super::*;
use crate::buffer::RawBuf;
use crate::dtype::{DType, ReduceOp};
use crate::group::{Algorithm, Group, GroupConfig, Tensor};
use crate::transport::Transport;
use crate::wire::{Codec, HEADER_FIXED};

fn group_cfg() -> GroupConfig {
    GroupConfig {
        timeout: Duration::from_secs(60),
        chunk_bytes: 1 << 20,
        small_bytes: 0,
    }
}

fn value(rank: usize, i: usize) -> f32 {
    ((i * 31 + rank * 17) % 9) as f32 - 4.0
}

/// One rank's outcome and final buffer.
type RankResult = (crate::Result<()>, Vec<f32>);

/// Every rank's result of one all-reduce of `n` small integers (exact in any order).
fn all_reduce(cfg: &SimConfig, algorithm: Algorithm, n: usize) -> (Vec<RankResult>, SimReport) {
    let (out, report) = simulate(cfg, |t| async move {
        let r = t.rank();
        let g = Group::new(t, group_cfg());
        let mut v: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
        let shape = [n as u64];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut v);
        // SAFETY: `v` outlives the operation, which is awaited before `v` is read.
        let buf = unsafe { RawBuf::from_slice(bytes) };
        let tensor = Tensor {
            buf,
            dtype: DType::F32,
            shape: &shape,
            codec: Codec::None,
        };
        let res = match g.all_reduce(tensor, ReduceOp::Sum, algorithm) {
            Ok(op) => op.await,
            Err(e) => Err(e),
        };
        (res, v)
    })
    .expect("simulation runs");
    (out, report)
}

fn expected(world: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (0..world).map(|r| value(r, i)).sum())
        .collect()
}

fn datacentre(world: usize) -> SimConfig {
    let topo = Topology {
        ranks_per_host: 8,
        intra: LinkSpec::new(Duration::from_micros(4), 100e9),
        inter: LinkSpec::new(Duration::from_micros(20), 12.5e9),
    };
    SimConfig::new(world, topo)
}

#[test]
fn a_thousand_ranks_all_reduce_bit_exact_with_every_algorithm() {
    let (w, n) = (1000, 1000);
    let want = expected(w, n);
    for algorithm in [
        Algorithm::Ring,
        Algorithm::Tree,
        Algorithm::RecursiveDoubling,
    ] {
        let mut cfg = datacentre(w);
        cfg.scale = 1e5; // 4 KB stands for 400 MB per rank
        let (out, report) = all_reduce(&cfg, algorithm, n);
        for (r, (res, v)) in out.iter().enumerate() {
            assert_eq!(res, &Ok(()), "{algorithm:?} rank {r}");
            assert_eq!(v, &want, "{algorithm:?} rank {r}");
        }
        assert!(report.frames > 0 && report.elapsed > Duration::ZERO);
    }
}

#[test]
fn one_seed_replays_a_lossy_run_exactly_and_another_seed_does_not() {
    let run = |seed| {
        let mut cfg = datacentre(64);
        cfg.topology.inter = cfg
            .topology
            .inter
            .with_loss(0.05)
            .with_jitter(Duration::from_micros(30));
        cfg.seed = seed;
        cfg.scale = 1e4;
        cfg.trace = true;
        let (out, report) = all_reduce(&cfg, Algorithm::Ring, 256);
        let want = expected(64, 256);
        for (res, v) in &out {
            assert_eq!(res, &Ok(()));
            assert_eq!(v, &want);
        }
        report
    };
    let (a, b, c) = (run(11), run(11), run(12));
    assert!(!a.trace.is_empty());
    assert_eq!(a, b, "the same seed must give the same trace and timings");
    assert_ne!(a.trace, c.trace, "another seed must draw other losses");
}

#[test]
fn a_rank_failing_mid_operation_fails_every_survivor_with_peer_lost_naming_it() {
    let w = 1000;
    let dead = 500;
    let mut cfg = datacentre(w);
    cfg.scale = 1e6; // 4 KB stands for 4 GB: the operation takes seconds of virtual time
    cfg.heartbeat = Duration::from_millis(500);
    // Before it has sent anything: no survivor can finish without it.
    let at = Duration::from_millis(1);
    cfg.faults = vec![Fault::Rank { rank: dead, at }];
    let (out, report) = all_reduce(&cfg, Algorithm::Tree, 1000);
    for (r, (res, _)) in out.iter().enumerate() {
        if r == dead {
            assert!(matches!(res, Err(Error::Closed(_))), "rank {r}: {res:?}");
            continue;
        }
        match res {
            Err(Error::PeerLost { rank, .. }) => assert_eq!(*rank, dead, "rank {r}"),
            other => panic!("rank {r}: expected PeerLost naming {dead}, got {other:?}"),
        }
    }
    // Bounded by detection (2.25 heartbeats and a check), far inside the 60 s deadline.
    let bound = at + cfg.heartbeat * 3 + Duration::from_secs(1);
    assert!(report.elapsed < bound, "took {:?}", report.elapsed);
}

/// The survivors' detector is the transport's [`crate::health::PeerMonitor`]: a rank that
/// dies after its keep-alive at 1.2 s (every 0.2 s from the connection at 0) is declared
/// lost at the first check (every 50 ms) past its limit, 2 x 0.2 s + max(50 ms, 1.3 x RTT) =
/// 0.45 s after that keep-alive's arrival: at 1.70 s, with the detector's reason.
#[test]
fn a_dead_rank_is_found_by_the_transports_detector_at_its_limit() {
    let mut cfg = SimConfig::new(
        2,
        Topology::flat(LinkSpec::new(Duration::from_millis(2), 1e9)),
    );
    cfg.heartbeat = Duration::from_millis(200);
    cfg.faults = vec![Fault::Rank {
        rank: 1,
        at: Duration::from_millis(1300),
    }];
    let (out, report) = simulate(&cfg, |t| async move {
        let g = Group::new(t.clone(), group_cfg());
        if t.rank() == 1 {
            // Alive and connected until it dies; its operation never comes.
            tokio::time::sleep(Duration::from_secs(10)).await;
            return Ok(());
        }
        match g.barrier() {
            Ok(op) => op.await,
            Err(e) => Err(e),
        }
    })
    .expect("simulation runs");
    match &out[0] {
        Err(Error::PeerLost {
            rank: 1, reason, ..
        }) => {
            assert!(reason.contains("heartbeat every 0.20 s"), "{reason}");
            assert!(reason.contains("limit 0.45 s"), "{reason}");
        }
        other => panic!("rank 0: {other:?}"),
    }
    // The last keep-alive left at 1.2 s and arrived 1 ms later; the check at 1.70 s is the
    // first past 1.201 + 0.45 s.
    let found = report.finished[0];
    assert!(
        found >= Duration::from_millis(1700) && found < Duration::from_millis(1702),
        "declared lost at {found:?}"
    );
}

#[test]
fn a_cut_link_fails_both_ends_and_a_silent_rank_times_out_in_virtual_time() {
    let mut cfg = SimConfig::new(
        2,
        Topology::flat(LinkSpec::new(Duration::from_millis(1), 1e9)),
    );
    cfg.scale = 1e6;
    cfg.heartbeat = Duration::from_millis(200);
    cfg.faults = vec![Fault::Link {
        a: 0,
        b: 1,
        at: Duration::from_millis(10),
    }];
    let (out, _) = all_reduce(&cfg, Algorithm::Ring, 1000);
    for (r, (res, _)) in out.iter().enumerate() {
        match res {
            Err(Error::PeerLost { rank, .. }) => assert_eq!(*rank, 1 - r),
            other => panic!("rank {r}: {other:?}"),
        }
    }

    // Rank 1 never calls: rank 0 waits out its 60 s deadline, in virtual time only.
    let cfg = SimConfig::new(
        2,
        Topology::flat(LinkSpec::new(Duration::from_millis(1), 1e9)),
    );
    let (out, report) = simulate(&cfg, |t| async move {
        if t.rank() == 1 {
            return Ok(());
        }
        let g = Group::new(t, group_cfg());
        match g.barrier() {
            Ok(op) => op.await,
            Err(e) => Err(e),
        }
    })
    .expect("simulation runs");
    assert!(matches!(out[0], Err(Error::Timeout { .. })), "{:?}", out[0]);
    assert!(report.finished[0] >= Duration::from_secs(60));
    assert!(report.finished[0] < Duration::from_secs(61));
}

#[test]
fn a_frame_arrives_when_the_link_model_says_and_a_shared_card_serialises_frames() {
    // Two hosts of two ranks; ranks 0 and 1 each send one frame to the other host at once.
    let inter = LinkSpec::new(Duration::from_millis(2), 1e9);
    let topo = Topology {
        ranks_per_host: 2,
        intra: LinkSpec::new(Duration::from_micros(2), 1e11),
        inter,
    };
    let mut cfg = SimConfig::new(4, topo);
    cfg.scale = 1000.0;
    cfg.trace = true;
    let n = 1000usize; // 4,000 bytes, timed as 4 MB
    let (out, report) = simulate(&cfg, |t| async move {
        let r = t.rank();
        let g = Group::new(t, group_cfg());
        let mut v = vec![r as f32; n];
        let shape = [n as u64];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut v);
        // SAFETY: `v` outlives the awaited operation.
        let buf = unsafe { RawBuf::from_slice(bytes) };
        let tensor = Tensor {
            buf,
            dtype: DType::F32,
            shape: &shape,
            codec: Codec::None,
        };
        let op = if r < 2 {
            g.send(tensor, r + 2, 0)
        } else {
            g.recv(tensor, r - 2, 0)
        };
        let res = match op {
            Ok(op) => op.await,
            Err(e) => Err(e),
        };
        (res, v)
    })
    .expect("simulation runs");
    for (r, (res, v)) in out.iter().enumerate() {
        assert_eq!(res, &Ok(()));
        assert_eq!(v, &vec![(r % 2) as f32; n], "rank {r}");
    }
    let bytes = (HEADER_FIXED + 8) as f64 + 4000.0 * 1000.0;
    let tx = inter.serialise_ns(bytes);
    let lat = inter.latency.as_nanos() as u64;
    let mut arrivals: Vec<u64> = report.trace.iter().map(|e| e.arrive_ns).collect();
    arrivals.sort_unstable();
    assert_eq!(arrivals, vec![tx + lat, 2 * tx + lat]);
    assert_eq!(report.finished[2].as_nanos() as u64, tx + lat);
    assert_eq!(report.finished[3].as_nanos() as u64, 2 * tx + lat);
    assert_eq!(report.wire_bytes[0], bytes);
}

#[test]
fn bad_configurations_are_refused_before_anything_runs() {
    let ok = SimConfig::new(
        4,
        Topology::flat(LinkSpec::new(Duration::from_millis(1), 1e9)),
    );
    let run = |cfg: SimConfig| simulate(&cfg, |_| async {}).map(|_| ());
    assert!(run(ok.clone()).is_ok());
    assert!(matches!(
        run(SimConfig {
            world: 0,
            ..ok.clone()
        }),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        run(SimConfig {
            scale: 0.5,
            ..ok.clone()
        }),
        Err(Error::InvalidArgument(_))
    ));
    let mut bad = ok.clone();
    bad.faults = vec![Fault::Rank {
        rank: 4,
        at: Duration::ZERO,
    }];
    assert!(matches!(run(bad), Err(Error::InvalidArgument(_))));
    let mut bad = ok;
    bad.topology.inter = bad.topology.inter.with_loss(1.0);
    assert!(matches!(run(bad), Err(Error::InvalidArgument(_))));
}

/// Times one all-reduce of `bytes` with `codec` on `cfg` (10-minute virtual deadline); the
/// test fails if it cannot run.
fn timed(cfg: &SimConfig, algorithm: Algorithm, bytes: f64, codec: Codec) -> AllReduceTiming {
    time_all_reduce(cfg, algorithm, bytes, codec, Duration::from_secs(600)).expect("timed")
}

#[test]
fn a_timed_all_reduce_follows_the_ring_formula_and_checks_its_result() {
    // 8 ranks, one per host, 1 GB/s, 1 ms RTT: a ring moves 2(W-1)/W of the buffer per rank
    // in 2(W-1) steps. Each segment travels in two chunks, so a chunk is forwarded while the
    // next is on the wire: the link never idles and latency is paid once, not per step.
    let link = LinkSpec::new(Duration::from_millis(1), 1e9);
    let cfg = SimConfig::new(8, Topology::flat(link));
    let bytes = 64e6;
    let t = timed(&cfg, Algorithm::Ring, bytes, Codec::None);
    assert_eq!(t.ok_ranks, 8);
    assert!(t.exact && t.first_error.is_none());
    let formula = 14.0 * (bytes / 8.0 / 1e9) + link.latency.as_secs_f64();
    let got = t.elapsed.as_secs_f64();
    // Headers and rounding only: within 0.1 %.
    assert!((got - formula).abs() < formula * 1e-3, "{got} vs {formula}");
    assert!((t.mean_rank_bytes - bytes * 14.0 / 8.0).abs() < bytes * 1e-3);

    // fp16 halves the bytes; every rank still ends with the same bits.
    let half = timed(&cfg, Algorithm::Ring, bytes, Codec::Fp16);
    assert!(half.exact && half.ok_ranks == 8);
    let ratio = half.mean_rank_bytes / t.mean_rank_bytes;
    assert!((ratio - 0.5).abs() < 0.01, "ratio {ratio}");

    // int8 on whole blocks: a quarter of the bytes plus one scale per block.
    let int8 = Codec::Int8 { block: 256 };
    let q = timed(&cfg, Algorithm::Ring, bytes, int8);
    assert!(q.exact && q.ok_ranks == 8);
    let ratio = q.mean_rank_bytes / t.mean_rank_bytes;
    assert!(ratio > 0.25 && ratio < 0.27, "int8 ratio {ratio}");

    assert!(matches!(
        time_all_reduce(
            &cfg,
            Algorithm::Ring,
            2.0,
            Codec::None,
            Duration::from_secs(1)
        ),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn a_simulated_all_reduce_cuts_its_frames_as_a_real_group_does_up_to_the_pipeline_limit() {
    // Two ranks, one ring: each sends its half of the buffer in step one and the other half
    // in step two, in chunks of a real group's 1 MiB. Up to 16 MiB that is exactly the real
    // count of frames (each pays the per-frame overhead); beyond, the buffer is cut into
    // PIPELINE_CHUNKS chunks, whatever its size.
    let cfg = SimConfig::new(
        2,
        Topology::flat(LinkSpec::new(Duration::from_micros(30), 1e9)),
    );
    let mib = f64::from(1u32 << 20);
    for (bytes, frames_per_rank_step) in [
        (256.0 * 1024.0, 1),
        (mib, 1),
        (4.0 * mib, 2),
        (16.0 * mib, 8),
        (64.0 * mib, PIPELINE_CHUNKS as u64 / 2),
        (1024.0 * mib, PIPELINE_CHUNKS as u64 / 2),
    ] {
        let t = timed(&cfg, Algorithm::Ring, bytes, Codec::None);
        assert!(t.exact && t.ok_ranks == 2, "{t:?}");
        assert_eq!(t.frames, 2 * 2 * frames_per_rank_step, "{bytes} bytes");
    }
}

#[test]
fn a_frames_software_overhead_delays_its_arrival_and_a_pipeline_pays_it_once() {
    // One step of recursive doubling between two ranks: every frame arrives `overhead`
    // later, so the whole operation ends exactly `overhead` later.
    let link = LinkSpec::new(Duration::from_micros(28), 400e6);
    let o = Duration::from_micros(155);
    let time = |link: LinkSpec, world: usize, algorithm: Algorithm, bytes: f64| {
        timed(
            &SimConfig::new(world, Topology::flat(link)),
            algorithm,
            bytes,
            Codec::None,
        )
    };
    let rd = Algorithm::RecursiveDoubling;
    let (plain, slow) = (
        time(link, 2, rd, 4096.0),
        time(link.with_overhead(o), 2, rd, 4096.0),
    );
    assert!(plain.exact && slow.exact);
    assert_eq!(slow.elapsed, plain.elapsed + o);
    assert_eq!(
        LinkSpec::new(Duration::from_millis(1), 1e9).overhead,
        Duration::ZERO
    );

    // A pipelined ring (8 ranks, 1 GB/s, 1 ms RTT, 64 MB): the overhead is latency, paid
    // once while the link never idles: 2(W-1) segment times + latency + overhead.
    let link = LinkSpec::new(Duration::from_millis(1), 1e9).with_overhead(o);
    let bytes = 64e6;
    let t = time(link, 8, Algorithm::Ring, bytes);
    let formula = 14.0 * (bytes / 8.0 / 1e9) + link.latency.as_secs_f64() + o.as_secs_f64();
    let got = t.elapsed.as_secs_f64();
    assert!((got - formula).abs() < formula * 1e-3, "{got} vs {formula}");
}

#[test]
fn frames_cost_their_ends_processor_time_on_the_cores_they_share() {
    // A ring all-reduce of S bytes between two ranks over a link far faster than their
    // processing, c ns per wire byte at each end: each of the two steps sends S/2 each way,
    // that is 2 x 2 x c x S/2 of processor time per step. On four free cores it takes
    // c x S/2 per step; on two cores (both ranks on one machine, as two network namespaces
    // on one box are) the opposite frames take turns: twice that; with one two-core
    // machine per rank, again c x S/2.
    let c = 0.9;
    let bytes = 64e6;
    let link = LinkSpec::new(Duration::from_micros(20), 1e13).with_cpu(c, c);
    let time = |cpu: Option<Cpus>| {
        let mut cfg = SimConfig::new(2, Topology::flat(link));
        cfg.cpu = cpu;
        let t = timed(&cfg, Algorithm::Ring, bytes, Codec::None);
        assert!(t.exact);
        t.elapsed.as_secs_f64()
    };
    let step = c * 1e-9 * bytes / 2.0;
    let cores = |cores, ranks_per_machine| {
        Some(Cpus {
            cores,
            ranks_per_machine,
        })
    };
    let (free, shared, apart) = (time(cores(4, 2)), time(cores(2, 2)), time(cores(2, 1)));
    for (got, want) in [
        (free, 2.0 * step),
        (shared, 4.0 * step),
        (apart, 2.0 * step),
    ] {
        assert!(
            (got - want).abs() < want * 0.02,
            "{got} s, expected {want} s"
        );
    }
    // Under loss the sender builds and seals every lost packet again, the receiver works on
    // what arrives: with one machine per rank, a step takes the sender's c x S/2 / (1 - p)
    // (loss recovery's own delay left out here: no resend timeout).
    let lossy = LinkSpec {
        rto: Duration::ZERO,
        ..link.with_loss(0.2)
    };
    let mut cfg = SimConfig::new(2, Topology::flat(lossy));
    cfg.cpu = cores(2, 1);
    let t = timed(&cfg, Algorithm::Ring, bytes, Codec::None);
    assert!(t.exact);
    let (got, want) = (t.elapsed.as_secs_f64(), 2.0 * step / 0.8);
    assert!(
        (got - want).abs() < want * 0.02,
        "{got} s, expected {want} s"
    );
    // Without a CPU model the same frames cost nothing but the (fast) link.
    assert!(time(None) < step / 10.0);
    // A one-core machine does both ends' work of a frame to itself.
    let one = time(cores(1, 2));
    assert!((one - 8.0 * step).abs() < 8.0 * step * 0.02, "{one}");
    // Nonsense is refused before anything runs.
    let mut cfg = SimConfig::new(2, Topology::flat(link));
    cfg.cpu = cores(0, 2);
    assert!(matches!(cfg.validate(), Err(Error::InvalidArgument(_))));
}

#[test]
fn auto_runs_what_a_real_group_picks_for_the_full_size() {
    let link = LinkSpec::new(Duration::from_micros(28), 400e6);
    let two_by_two = SimConfig::new(
        4,
        Topology {
            ranks_per_host: 2,
            intra: LinkSpec::new(Duration::from_micros(4), 2.5e9),
            inter: link,
        },
    );
    let flat = SimConfig::new(4, Topology::flat(link));
    let small = GroupConfig::default().small_bytes as f64;
    assert_eq!(
        resolve_auto(&flat, Algorithm::Auto, small),
        Algorithm::RecursiveDoubling
    );
    assert_eq!(
        resolve_auto(&flat, Algorithm::Auto, small + 4.0),
        Algorithm::Ring
    );
    assert_eq!(
        resolve_auto(&two_by_two, Algorithm::Auto, small + 4.0),
        Algorithm::Hierarchical
    );
    assert_eq!(
        resolve_auto(&two_by_two, Algorithm::Tree, 4.0),
        Algorithm::Tree
    );
    for (cfg, bytes, want) in [
        (&two_by_two, 4096.0, Algorithm::RecursiveDoubling),
        (&two_by_two, 16e6, Algorithm::Hierarchical),
        (&flat, 16e6, Algorithm::Ring),
    ] {
        let t = time_all_reduce(
            cfg,
            Algorithm::Auto,
            bytes,
            Codec::None,
            Duration::from_secs(60),
        )
        .expect("timed");
        assert_eq!(t.algorithm, want);
        assert!(
            t.exact && t.ok_ranks == 4 && t.first_error.is_none(),
            "{t:?}"
        );
    }
}

/// Three epochs of training on 1,000 members, 5 % of them dying at seeded virtual times.
/// First each epoch's all-reduce runs in the simulator over the epoch's members: the deaths
/// fail every survivor's operation with `PeerLost`, and the last epoch's is exact. Then the
/// membership protocol runs over the simulated network, every request and reply a frame:
/// the coordinator's service on its own rank, each member's session on its rank, the dying
/// members falling silent when the plan says and the survivors reporting when their
/// all-reduce failed. Every survivor is handed the same epochs, each the survivors of the one
/// before in the same order; every survivor's session says each of its epochs ended, once;
/// each change takes no longer than the coordinator's silence limit after the survivors
/// reported, plus a few heartbeats.
#[test]
fn a_thousand_members_agree_on_every_epoch_while_five_percent_die() {
    use crate::membership::coordinator::CoordinatorConfig;
    use crate::membership::{Epoch, MemberId};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    let coordinator = CoordinatorConfig {
        min_members: 1,
        dead_after: Duration::from_millis(300),
        join_window: Duration::from_millis(200),
        change_limit: Duration::from_secs(60),
        rebuild_window: Duration::from_millis(100),
    };
    let beat = Duration::from_millis(100);
    let mut net = datacentre(1001);
    net.seed = 9;
    let plan = |epochs: Vec<EpochPlan>| ElasticPlan {
        coordinator,
        heartbeat: beat,
        epochs,
        limit: Duration::from_secs(120),
    };
    // The job forms: its first epoch has every member, in the order their reports reached
    // the coordinator over the network (the same in every run of this seed). A job that
    // ends there: everyone leaves.
    let formed = simulate_elastic(&net, &plan(vec![EpochPlan::default()])).expect("runs");
    assert_eq!(formed.coordinator.left, 1000);
    assert_eq!(formed.coordinator.epochs.len(), 1);
    let first = &formed.coordinator.epochs[0].1;
    for (r, life) in formed.members.iter().enumerate() {
        assert_eq!(life.epochs, vec![first.clone()], "member {r}");
        assert!(life.ended.is_empty() && !life.died && life.error.is_none());
    }
    // Members by their rank in the membership simulation; an epoch's rank r is members[r].
    let mut members: Vec<usize> = first
        .members
        .iter()
        .map(|m| (m.id - 1000) as usize)
        .collect();
    let mut sorted = members.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
    let mut rng = StdRng::seed_from_u64(5);
    let mut lists = vec![members.clone()];
    let mut epochs = Vec::new();
    for (e, deaths) in [17usize, 17, 16, 0].into_iter().enumerate() {
        let w = members.len();
        let mut dying: Vec<usize> = Vec::new();
        while dying.len() < deaths {
            let r = rng.random_range(0..w);
            if !dying.contains(&r) {
                dying.push(r);
            }
        }
        let death_times: Vec<Duration> = dying
            .iter()
            .map(|_| Duration::from_micros(rng.random_range(0..1000)))
            .collect();
        let mut cfg = datacentre(w);
        cfg.scale = 1e6;
        cfg.seed = e as u64;
        cfg.heartbeat = beat;
        cfg.faults = dying
            .iter()
            .zip(&death_times)
            .map(|(&rank, &at)| Fault::Rank { rank, at })
            .collect();
        let (out, report) = all_reduce(&cfg, Algorithm::Tree, 64);
        let want = expected(w, 64);
        for (r, (res, v)) in out.iter().enumerate() {
            match res {
                Err(Error::Closed(_)) if dying.contains(&r) => {}
                Err(Error::PeerLost { rank, .. }) if !dying.contains(&r) => {
                    assert!(dying.contains(rank), "epoch {e} rank {r} blames {rank}")
                }
                Ok(()) if deaths == 0 => assert_eq!(v, &want, "epoch {e} rank {r}"),
                other => panic!("epoch {e} rank {r}: {other:?}"),
            }
        }
        // In the second epoch the deaths come while the members compute (no collective
        // notices them): the survivors hear of them from their sessions.
        epochs.push(EpochPlan {
            deaths: dying
                .iter()
                .zip(&death_times)
                .map(|(&r, &at)| (members[r], at))
                .collect(),
            fails_after: (e != 1).then_some(report.elapsed),
        });
        if deaths == 0 {
            break;
        }
        members = members
            .iter()
            .enumerate()
            .filter(|(r, _)| !dying.contains(r))
            .map(|(_, &m)| m)
            .collect();
        lists.push(members.clone());
    }
    assert_eq!(members.len(), 950);

    // Its messages are real bytes: a scaled network is refused.
    let mut scaled = net.clone();
    scaled.scale = 10.0;
    assert!(matches!(
        simulate_elastic(&scaled, &plan(vec![EpochPlan::default()])),
        Err(Error::InvalidArgument(_))
    ));
    // The same job through the planned failures.
    let run = simulate_elastic(&net, &plan(epochs.clone())).expect("simulation runs");
    let log = &run.coordinator;
    assert!(
        !log.hit_limit,
        "the coordinator waited for leavers until its limit"
    );
    assert_eq!(log.left, 950);
    let formed: Vec<&Epoch> = log.epochs.iter().map(|(_, e)| e).collect();
    assert_eq!(formed.len(), lists.len());
    for (e, (epoch, list)) in formed.iter().zip(&lists).enumerate() {
        let ids: Vec<MemberId> = list.iter().map(|&r| member_id(r)).collect();
        let got: Vec<MemberId> = epoch.members.iter().map(|m| m.id).collect();
        assert_eq!(got, ids, "epoch {e}: the survivors, in order");
        assert_eq!(epoch.number, formed[0].number + e as u64);
    }
    for (r, life) in run.members.iter().enumerate() {
        assert!(life.error.is_none(), "member {r}: {:?}", life.error);
        let lived = lists.iter().filter(|l| l.contains(&r)).count();
        let mine: Vec<&Epoch> = life.epochs.iter().collect();
        assert_eq!(
            mine,
            formed[..lived],
            "member {r} was handed the coordinator's epochs"
        );
        if lived == lists.len() {
            assert!(!life.died, "member {r}");
            // Its session announced the end of the epoch where nothing else told it, and
            // never one twice.
            assert!(
                life.ended.contains(&formed[1].number),
                "member {r}: {:?}",
                life.ended
            );
            let mut once = life.ended.clone();
            once.dedup();
            assert_eq!(once, life.ended, "member {r}");
        } else {
            assert!(life.died, "member {r} was to die in epoch {}", lived - 1);
        }
    }
    // The first epoch reaches every member whole; the later ones as the change from the
    // epoch each survivor holds, so that the coordinator sends bytes linear in the job's
    // size per change, not the whole member list to each member.
    let whole = |e: &Epoch| (16 * e.members.len() + 64) as f64 * e.members.len() as f64;
    let first = whole(formed[0]);
    let later: f64 = formed[1..].iter().map(|e| whole(e)).sum();
    let sent = run.report.wire_bytes.last().copied().unwrap_or(f64::MAX);
    // (18.2 MB in all here, against 61 MB with every epoch sent whole.)
    assert!(
        sent > first && sent - first < later / 10.0,
        "the coordinator sent {sent} bytes; the first epoch whole to every member is {first}, \
         the later ones whole {later}"
    );
    // Each change: the survivors report when their all-reduce failed; the dead are found
    // after the silence limit; the epoch forms at the next timer, and its answer reaches
    // every survivor within a few heartbeats.
    let starts: Vec<Duration> = log.epochs.iter().map(|(t, _)| *t).collect();
    for e in 0..lists.len() - 1 {
        let last_death = epochs[e]
            .deaths
            .iter()
            .map(|(_, at)| *at)
            .max()
            .unwrap_or_default();
        let fails = epochs[e].fails_after.unwrap_or_default();
        let bound = fails.max(last_death + coordinator.dead_after) + beat * 3;
        let took = starts[e + 1] - starts[e];
        assert!(
            took <= bound,
            "epoch {e}: the change took {took:?}, more than {bound:?}"
        );
        assert!(
            took >= fails.max(coordinator.dead_after),
            "epoch {e}: {took:?}"
        );
    }
}

/// A thousand ranks meet through the rendezvous's own state machine and driver: every rank
/// gets the same table, naming every rank as it announced itself, and the last table
/// arrives when rank 0's card has sent the 992 copies bound for other hosts one after the
/// other (the table is real bytes, never scaled).
#[test]
fn a_thousand_ranks_meet_and_rank_0s_card_paces_the_tables() {
    use crate::transport::meeting::control_header;
    let w = 1000;
    let cfg = datacentre(w);
    let (out, report) = simulate(&cfg, |t| async move {
        let table = t.meet(Duration::from_secs(10)).await;
        let own: Vec<_> = (0..t.world_size()).map(|r| t.entry_of(r)).collect();
        (table, own)
    })
    .expect("simulation runs");
    let first = out[0].0.as_ref().expect("rank 0 met everyone").clone();
    for (r, (table, own)) in out.iter().enumerate() {
        let table = table.as_ref().unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(table, &first, "rank {r}");
        assert_eq!(table.entries(), own.as_slice(), "rank {r}");
    }
    assert!(first.entries()[999]
        .to_line()
        .starts_with("10.0.0.124:29507 sim-host-124 1999 1"));
    let bytes = first.encode();
    let wire = (control_header(0, w, FrameKind::Table, &bytes).encoded_len() + bytes.len()) as f64;
    let inter = cfg.topology.inter;
    let paced = Duration::from_secs_f64(992.0 * wire / inter.bandwidth);
    assert!(paced > Duration::from_millis(2), "{paced:?}");
    // The Hellos take a latency and a few bytes each; then the card sends the tables.
    let least = paced + inter.latency;
    assert!(
        report.elapsed >= least && report.elapsed <= least + Duration::from_micros(50),
        "{:?} against {least:?}",
        report.elapsed
    );
}

/// A rank that was never started: rank 0 fails the rendezvous at its deadline naming exactly
/// that rank, and the others, who never get a table, fail at the same virtual instant.
#[test]
fn a_rank_that_never_comes_is_named_at_the_rendezvous_deadline() {
    let timeout = Duration::from_secs(2);
    let (out, report) = simulate(&datacentre(40), |t| async move {
        if t.rank() == 7 {
            return None;
        }
        Some(t.meet(timeout).await)
    })
    .expect("simulation runs");
    for (r, res) in out.iter().enumerate() {
        match (r, res) {
            (7, None) => {}
            (0, Some(Err(Error::Timeout { what, after }))) => {
                assert!(what.contains("ranks [7] of 40 never arrived"), "{what}");
                assert_eq!(*after, timeout);
            }
            (_, Some(Err(Error::Timeout { what, .. }))) => {
                assert!(
                    what.contains("did not send the address table"),
                    "rank {r}: {what}"
                )
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(
        report.elapsed >= timeout && report.elapsed <= timeout + Duration::from_millis(2),
        "{:?}",
        report.elapsed
    );
}

#[test]
fn the_ranks_of_a_host_read_each_other_directly_when_told_and_each_copy_costs_its_reader() {
    // Two hosts of two ranks, a hierarchical all-reduce of S bytes. Without direct reads the
    // host's data moves as frames: each rank sends S/2 to its local peer in the
    // reduce-scatter, S/2 to the other host (its shard's ring of two hosts), S/2 to its peer
    // in the all-gather. With them, a rank sends only the S/2 to the other host and a few
    // one-byte signals.
    let bytes = 64e6;
    let fast = LinkSpec::new(Duration::from_micros(20), 1e13);
    let topo = Topology {
        ranks_per_host: 2,
        intra: fast,
        inter: fast,
    };
    let run = |direct: bool| {
        let mut cfg = SimConfig::new(4, topo);
        cfg.direct_reads = direct;
        let t = timed(&cfg, Algorithm::Hierarchical, bytes, Codec::None);
        assert!(t.exact && t.ok_ranks == 4, "{t:?}");
        t
    };
    let (rings, direct) = (run(false), run(true));
    let within = |got: f64, want: f64| (got - want).abs() < want * 0.01;
    assert!(within(rings.mean_rank_bytes, 1.5 * bytes), "{rings:?}");
    // (The 9-byte address and 1-byte signals are scaled like every payload, 62,500 times
    // here: 2.3 % more.)
    let signals = direct.mean_rank_bytes - bytes / 2.0;
    assert!(signals > 0.0 && signals < bytes * 0.015, "{direct:?}");
    assert!(within(direct.host_card_bytes, rings.host_card_bytes));
    // Each rank copies S, one copy after another: its shard of its peer's tensor, then the
    // peer's finished shard. One host of two ranks at c per byte: S x c on two cores, where
    // the two ranks copy side by side; twice that on one core; nothing without a CPU model.
    let c = 1.0;
    let copy = bytes * c * 1e-9;
    let one_host = |cores: usize| {
        let mut cfg = SimConfig::new(2, topo);
        cfg.topology.intra = fast.with_cpu(0.0, c);
        cfg.direct_reads = true;
        cfg.cpu = (cores > 0).then_some(Cpus {
            cores,
            ranks_per_machine: 2,
        });
        let t = timed(&cfg, Algorithm::Hierarchical, bytes, Codec::None);
        assert!(t.exact && t.ok_ranks == 2, "{t:?}");
        t.elapsed.as_secs_f64()
    };
    // (The scaled address and signals cost their receivers about 1 % more.)
    for (cores, want) in [(2, copy), (1, 2.0 * copy)] {
        let got = one_host(cores);
        assert!(
            got >= want && got < want * 1.03,
            "{cores} cores: {got} s, not {want} s"
        );
    }
    assert!(one_host(0) < copy / 100.0);
}
