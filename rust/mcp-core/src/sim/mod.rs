//! A simulated network in virtual time: the real collectives, a thousand ranks, one thread.
//!
//! [`simulate`] runs one future per rank on a current-thread tokio runtime whose clock is
//! paused, over a [`SimTransport`] per rank. Frames are timed by a per-link model
//! ([`LinkSpec`]: latency, bandwidth with a FIFO queue, a fixed software overhead per frame,
//! loss as the recovery delay a reliable stream pays, jitter), with separate figures inside a host and between hosts
//! ([`Topology`]); ranks and links fail at given virtual times ([`Fault`]). Every link draws
//! from its own generator seeded from `(seed, src, dst)`, and events at one instant are
//! delivered in the order they were filed, so one seed replays a run exactly ([`TraceEvent`]).
//!
//! Payloads may stand for larger ones: with `scale = s`, a frame of `n` real bytes is timed
//! as `header + n * s` bytes, while its real bytes are still reduced and checked. A
//! 50B-parameter all-reduce is thus timed with a buffer of a few thousand elements.
//!
//! The processor time that moving a frame costs its two ends can be modelled too ([`Cpus`]:
//! cores per machine, shared by its ranks; a cost per wire byte per kind of link).
//!
//! Not modelled: the time ranks spend computing apart from moving frames (the codecs'
//! encoding, a step's own compute), send windows (a send returns at once; the queue still
//! orders the bytes), a receiving host's card (only the sender's card is shared between
//! hosts), and the FEC datagram lane (loss is paid as a stream pays it). `docs/simulator.md` says why and what that means for the figures.

mod allreduce;
mod link;
mod membership;
mod net;
mod rendezvous;

pub use allreduce::{resolve_auto, time_all_reduce, AllReduceTiming, PIPELINE_CHUNKS};
pub use link::LinkSpec;
pub use membership::{
    member_id, simulate_elastic, CoordinatorLog, ElasticPlan, ElasticRun, EpochPlan, MemberLife,
};
pub use net::SimTransport;
pub use rendezvous::{time_rendezvous, RendezvousTiming};

use crate::error::{Error, Result};
use crate::wire::FrameKind;
use net::{drive, SimNet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

/// How ranks sit on hosts, and the links inside and between them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Topology {
    /// Consecutive ranks per host (rank `r` is on host `r / ranks_per_host`).
    pub ranks_per_host: usize,
    /// A link between two ranks of one host (NVLink, PCIe, shared memory).
    pub intra: LinkSpec,
    /// A host's network card, shared by its ranks for everything they send to other hosts.
    pub inter: LinkSpec,
}

impl Topology {
    /// Every rank on its own host, all links alike.
    pub fn flat(link: LinkSpec) -> Topology {
        Topology {
            ranks_per_host: 1,
            intra: link,
            inter: link,
        }
    }
}

/// The processors that the ranks' communication runs on. When a simulation has them, every
/// data frame occupies a core of its sending machine for `bytes x cpu_tx` and one of its
/// receiving machine for `bytes x cpu_rx` ([`LinkSpec`]), from when it starts to leave; it
/// takes as long as the slowest of the link and its two ends, and starts only when the link
/// and a core at each end are free. Ranks on one machine share its cores, so four processes
/// on two cores move half as fast as two would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cpus {
    /// Cores per machine.
    pub cores: usize,
    /// Consecutive ranks per machine (rank `r` is on machine `r / ranks_per_machine`). A
    /// machine may hold several hosts, as two network namespaces on one box do.
    pub ranks_per_machine: usize,
}

/// Something that breaks at a virtual time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The rank dies: it stops sending and receiving; its own operations fail with
    /// `Closed`; the ranks connected to it declare it lost when their failure detectors
    /// find it silent (see [`SimConfig::heartbeat`]), and abort what they run with it.
    Rank {
        /// The rank.
        rank: usize,
        /// When, from the start of the run.
        at: Duration,
    },
    /// The link between two ranks stops carrying frames and keep-alives; both ends' failure
    /// detectors declare each other lost.
    Link {
        /// One end.
        a: usize,
        /// The other end.
        b: usize,
        /// When, from the start of the run.
        at: Duration,
    },
}

/// One simulation's world.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Number of ranks.
    pub world: usize,
    /// Hosts and links.
    pub topology: Topology,
    /// Seed of every link's generator.
    pub seed: u64,
    /// Wire bytes each real payload byte stands for (at least 1).
    pub scale: f64,
    /// What fails, and when.
    pub faults: Vec<Fault>,
    /// The keep-alive interval of every connection. The survivors' failure detectors are
    /// the transport's own ([`crate::health::PeerMonitor`]): a peer is lost at the first
    /// check (every interval / 4) past 2 intervals + max(interval / 4, 1.3 x RTT) of silence
    /// after its last keep-alive.
    pub heartbeat: Duration,
    /// Whether to record every frame in [`SimReport::trace`].
    pub trace: bool,
    /// The processors the ranks run on, or `None` for no CPU model (frames cost no
    /// processor time).
    pub cpu: Option<Cpus>,
    /// Whether the ranks of a host read each other's tensors directly where an algorithm
    /// does so (the hierarchical and direct collectives), as a real group's processes do
    /// where the kernel lets them (`process_vm_readv`; here every rank lives in one process).
    /// With a CPU model each read books its copy on the machine's cores at the intra-host
    /// links' receiving cost per byte; what moves between hosts still goes as frames. Off,
    /// those algorithms move the host's data as frames over the intra-host links instead.
    pub direct_reads: bool,
}

impl SimConfig {
    /// `world` ranks on `topology`, seed 0, no scaling, no faults, the transport's default
    /// 5 s heartbeat, no trace, no CPU model, no direct reads.
    pub fn new(world: usize, topology: Topology) -> SimConfig {
        SimConfig {
            world,
            topology,
            seed: 0,
            scale: 1.0,
            faults: Vec::new(),
            heartbeat: Duration::from_secs(5),
            trace: false,
            cpu: None,
            direct_reads: false,
        }
    }

    /// Checks every figure before anything runs.
    pub fn validate(&self) -> Result<()> {
        if self.world == 0 {
            return Err(Error::InvalidArgument(
                "a simulation needs at least one rank".into(),
            ));
        }
        if self.topology.ranks_per_host == 0 {
            return Err(Error::InvalidArgument(
                "ranks_per_host must be at least 1".into(),
            ));
        }
        self.topology.intra.validate("intra-host")?;
        self.topology.inter.validate("inter-host")?;
        if self.heartbeat < Duration::from_millis(1) {
            return Err(Error::InvalidArgument(format!(
                "the heartbeat interval must be at least 1 ms, got {:?}",
                self.heartbeat
            )));
        }
        if !(self.scale.is_finite() && self.scale >= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "scale must be a finite number of at least 1, got {}",
                self.scale
            )));
        }
        if let Some(c) = self.cpu {
            if c.cores == 0 || c.ranks_per_machine == 0 {
                return Err(Error::InvalidArgument(format!(
                    "a CPU model needs at least one core and one rank per machine, got {c:?}"
                )));
            }
        }
        for f in &self.faults {
            let bad = match *f {
                Fault::Rank { rank, .. } => rank >= self.world,
                Fault::Link { a, b, .. } => a >= self.world || b >= self.world || a == b,
            };
            if bad {
                return Err(Error::InvalidArgument(format!(
                    "fault {f:?} names a rank outside a world of {} (or a link to itself)",
                    self.world
                )));
            }
        }
        Ok(())
    }
}

/// One frame as the simulated network carried it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEvent {
    /// Virtual nanoseconds when it was sent.
    pub sent_ns: u64,
    /// Virtual nanoseconds when it arrives (whether or not its receiver is still alive).
    pub arrive_ns: u64,
    /// Sender.
    pub src: usize,
    /// Receiver.
    pub dst: usize,
    /// Its kind.
    pub kind: FrameKind,
    /// Its operation's sequence number.
    pub seq: u64,
    /// Its algorithm step.
    pub step: u32,
    /// Its chunk.
    pub chunk: u32,
    /// Bytes it was timed as (header plus scaled payload).
    pub wire_bytes: u64,
}

/// What a simulation measured.
#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    /// Virtual time when the last rank finished.
    pub elapsed: Duration,
    /// Virtual time when each rank finished.
    pub finished: Vec<Duration>,
    /// Frames sent.
    pub frames: u64,
    /// Wire bytes each rank sent (scaled).
    pub wire_bytes: Vec<f64>,
    /// Wire bytes that crossed from one host to another, all ranks together.
    pub inter_host_bytes: f64,
    /// Every frame, in the order sent (when [`SimConfig::trace`] is set).
    pub trace: Vec<TraceEvent>,
}

/// Runs `rank_main(transport)` for every rank of `cfg.world` in virtual time and returns
/// their results in rank order, with what the network saw.
pub fn simulate<F, Fut, R>(cfg: &SimConfig, mut rank_main: F) -> Result<(Vec<R>, SimReport)>
where
    F: FnMut(Arc<SimTransport>) -> Fut,
    Fut: Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    cfg.validate()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| Error::Io(format!("cannot start the simulation's runtime: {e}")))?;
    let cfg = cfg.clone();
    rt.block_on(async move {
        let net = SimNet::new(cfg.clone());
        let runnable = Arc::new(AtomicUsize::new(0));
        let driver = tokio::spawn(drive(net.clone(), runnable.clone()));
        let mut handles = Vec::with_capacity(cfg.world);
        for r in 0..cfg.world {
            let t = Arc::new(SimTransport::new(r, net.clone()));
            let fut = rank_main(t);
            let flag = Arc::new(TaskFlag {
                queued: AtomicBool::new(true),
                done: AtomicBool::new(false),
                runnable: runnable.clone(),
            });
            runnable.fetch_add(1, Ordering::AcqRel);
            let net = net.clone();
            handles.push(tokio::spawn(Tracked {
                fut: Box::pin(async move {
                    let out = fut.await;
                    net.finish(r);
                    out
                }),
                flag,
                waker: None,
            }));
        }
        let mut out = Vec::with_capacity(cfg.world);
        let mut failed = None;
        for (r, h) in handles.into_iter().enumerate() {
            match h.await {
                Ok(v) => out.push(v),
                Err(e) => {
                    failed.get_or_insert(Error::Io(format!("rank {r}'s task failed: {e}")));
                }
            }
        }
        driver.abort();
        match failed {
            Some(e) => Err(e),
            None => Ok((out, net.report())),
        }
    })
}

/// Whether one rank's task is woken and not yet polled.
struct TaskFlag {
    queued: AtomicBool,
    done: AtomicBool,
    runnable: Arc<AtomicUsize>,
}

impl TaskFlag {
    fn mark_queued(&self) {
        if !self.done.load(Ordering::Acquire) && !self.queued.swap(true, Ordering::AcqRel) {
            self.runnable.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn mark_polled(&self) {
        if self.queued.swap(false, Ordering::AcqRel) {
            self.runnable.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Wakes a rank's task and counts it as runnable, so the driver holds time still for it.
struct FlagWaker {
    inner: Waker,
    flag: Arc<TaskFlag>,
}

impl Wake for FlagWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.flag.mark_queued();
        self.inner.wake_by_ref();
    }
}

/// A rank's future, counted in `runnable` from its wake-up to its poll.
struct Tracked<R> {
    fut: Pin<Box<dyn Future<Output = R> + Send>>,
    flag: Arc<TaskFlag>,
    /// The runtime's waker of the last poll and our wrapper of it (rebuilt when it changes).
    waker: Option<(Waker, Waker)>,
}

impl<R> Future for Tracked<R> {
    type Output = R;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<R> {
        self.flag.mark_polled();
        let this = &mut *self;
        let waker = match &this.waker {
            Some((inner, ours)) if inner.will_wake(cx.waker()) => ours.clone(),
            _ => {
                let ours = Waker::from(Arc::new(FlagWaker {
                    inner: cx.waker().clone(),
                    flag: this.flag.clone(),
                }));
                this.waker = Some((cx.waker().clone(), ours.clone()));
                ours
            }
        };
        let res = this.fut.as_mut().poll(&mut Context::from_waker(&waker));
        if res.is_ready() {
            self.flag.done.store(true, Ordering::Release);
            self.flag.mark_polled();
        }
        res
    }
}

#[cfg(test)]
mod tests;
