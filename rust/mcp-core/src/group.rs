//! A process group: the ranks of one job and the operations they run together.
//!
//! The group numbers each collective in call order (every rank must call the same
//! collectives in the same order, as in torch.distributed) and each send/recv per pair, checks
//! arguments before anything is sent, and turns a failure on one rank into an abort that every
//! other rank of the operation sees, so that no rank is left waiting.

use crate::buffer::RawBuf;
use crate::collectives::{self, p2p_seq, OpCtx};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::topology::Topology;
use crate::transport::{encode_abort, MsgKey, SeqSpace, Transport};
use crate::wire::{Codec, FrameKind, Header, ModelSpec, MAX_DIMS};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// Tunables of a group.
#[derive(Debug, Clone)]
pub struct GroupConfig {
    /// How long one operation may take before it fails with [`Error::Timeout`].
    pub timeout: Duration,
    /// Largest payload of one frame; larger buffers are cut into chunks and pipelined.
    pub chunk_bytes: usize,
    /// All-reduces of at most this many bytes use recursive doubling under `Auto`.
    pub small_bytes: usize,
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            timeout: Duration::from_secs(300),
            chunk_bytes: 1 << 20,
            small_bytes: 64 << 10,
        }
    }
}

/// Which all-reduce algorithm to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Recursive doubling for small buffers, ring for large ones.
    Auto,
    /// Ring: bandwidth-optimal.
    Ring,
    /// Binomial tree to rank 0 and back.
    Tree,
    /// Recursive doubling: latency-optimal.
    RecursiveDoubling,
    /// Reduce-scatter inside each host, all-reduce of each shard between hosts, all-gather
    /// inside each host (see [`Group::set_topology`]).
    Hierarchical,
    /// Ranks of one host read each other's tensors directly (cross-memory attach), falling
    /// back to the ring where the kernel does not allow it.
    Direct,
}

impl Algorithm {
    /// Parses `"auto"`, `"ring"`, `"tree"`, `"recursive_doubling"` (`"rd"`), `"hierarchical"`
    /// or `"direct"`.
    pub fn from_name(name: &str) -> Result<Algorithm> {
        match name {
            "auto" => Ok(Algorithm::Auto),
            "ring" => Ok(Algorithm::Ring),
            "tree" => Ok(Algorithm::Tree),
            "recursive_doubling" | "rd" => Ok(Algorithm::RecursiveDoubling),
            "hierarchical" => Ok(Algorithm::Hierarchical),
            "direct" => Ok(Algorithm::Direct),
            _ => Err(Error::InvalidArgument(format!(
                "unknown algorithm {name:?}; use auto, ring, tree, recursive_doubling, hierarchical or direct"
            ))),
        }
    }

    /// The name [`Algorithm::from_name`] reads (`"recursive_doubling"` for the latency one).
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Auto => "auto",
            Algorithm::Ring => "ring",
            Algorithm::Tree => "tree",
            Algorithm::RecursiveDoubling => "recursive_doubling",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::Direct => "direct",
        }
    }
}

/// The description of one tensor argument: where it is and what it holds.
#[derive(Debug, Clone, Copy)]
pub struct Tensor<'a> {
    /// Its memory.
    pub buf: RawBuf,
    /// Its element type.
    pub dtype: DType,
    /// Its dimensions.
    pub shape: &'a [u64],
    /// How it travels on the wire (every rank must agree; lossy codecs take float32).
    pub codec: Codec,
}

impl Tensor<'_> {
    fn check(&self, what: &str) -> Result<usize> {
        self.codec.check(self.dtype)?;
        if let Codec::Int8 { block } = self.codec {
            if !block.is_power_of_two() || block < 8 {
                return Err(Error::InvalidArgument(format!(
                    "{what}: int8 block size must be a power of two of at least 8, got {block}"
                )));
            }
        }
        if self.shape.len() > MAX_DIMS {
            return Err(Error::InvalidArgument(format!(
                "{what}: tensors of at most {MAX_DIMS} dimensions are supported, got {}",
                self.shape.len()
            )));
        }
        let numel = self
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d as usize));
        let bytes = numel.and_then(|n| n.checked_mul(self.dtype.size()));
        if bytes != Some(self.buf.len()) {
            return Err(Error::InvalidArgument(format!(
                "{what}: shape {:?} of {} needs {:?} bytes, the buffer has {}",
                self.shape,
                self.dtype,
                bytes,
                self.buf.len()
            )));
        }
        Ok(numel.unwrap_or(0))
    }

    fn spec(&self, op: ReduceOp) -> ModelSpec {
        ModelSpec {
            dtype: self.dtype,
            op,
            codec: self.codec,
            shape: self.shape.to_vec(),
        }
    }
}

struct Inner<T: Transport> {
    t: Arc<T>,
    cfg: GroupConfig,
    topology: RwLock<Arc<Topology>>,
    seq: AtomicU64,
    send_seq: Vec<AtomicU64>,
    recv_seq: Vec<AtomicU64>,
    closed: AtomicBool,
    /// Why the group was aborted, for the errors of later calls.
    aborted_because: std::sync::OnceLock<String>,
    aborts_in_flight: AtomicUsize,
}

/// The ranks of one job over one transport.
pub struct Group<T: Transport> {
    inner: Arc<Inner<T>>,
}

impl<T: Transport> Clone for Group<T> {
    fn clone(&self) -> Self {
        Group {
            inner: self.inner.clone(),
        }
    }
}

/// A handle on a group that does not keep it alive (see [`Group::downgrade`]).
pub struct WeakGroup<T: Transport> {
    inner: std::sync::Weak<Inner<T>>,
}

impl<T: Transport> WeakGroup<T> {
    /// The group, if anything else still holds it.
    pub fn upgrade(&self) -> Option<Group<T>> {
        self.inner.upgrade().map(|inner| Group { inner })
    }
}

/// A boxed operation, ready to be awaited or spawned.
pub type OpFuture = std::pin::Pin<Box<dyn Future<Output = Result<()>> + Send + 'static>>;

impl<T: Transport> Group<T> {
    /// A group over a connected transport.
    pub fn new(t: Arc<T>, cfg: GroupConfig) -> Group<T> {
        let w = t.world_size();
        Group {
            inner: Arc::new(Inner {
                topology: RwLock::new(Arc::new(Topology::single_host(w))),
                t,
                cfg,
                seq: AtomicU64::new(1),
                send_seq: (0..w).map(|_| AtomicU64::new(0)).collect(),
                recv_seq: (0..w).map(|_| AtomicU64::new(0)).collect(),
                closed: AtomicBool::new(false),
                aborted_because: std::sync::OnceLock::new(),
                aborts_in_flight: AtomicUsize::new(0),
            }),
        }
    }

    /// A handle that reaches this group while something else holds it.
    pub fn downgrade(&self) -> WeakGroup<T> {
        WeakGroup {
            inner: Arc::downgrade(&self.inner),
        }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.inner.t.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.inner.t.world_size()
    }

    /// The transport underneath.
    pub fn transport(&self) -> &Arc<T> {
        &self.inner.t
    }

    /// The group's configuration.
    pub fn config(&self) -> &GroupConfig {
        &self.inner.cfg
    }

    /// Tells the group which ranks share a host (every rank must give the same topology
    /// before its next collective). With more than one host and more than one rank on some
    /// host, all-reduces above `small_bytes` under [`Algorithm::Auto`], broadcasts,
    /// all-gathers and reduce-scatters run hierarchically. A topology that does not cover
    /// exactly this group's ranks is refused.
    pub fn set_topology(&self, topo: Topology) -> Result<()> {
        topo.check_world(self.world_size())?;
        *self
            .inner
            .topology
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Arc::new(topo);
        Ok(())
    }

    /// Which ranks share a host, as last set (one host for all, until told otherwise).
    pub fn topology(&self) -> Arc<Topology> {
        self.inner
            .topology
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether every peer runs on this host and offered shared memory (every rank gives the
    /// same answer): the direct all-reduce is then worth trying.
    fn all_local(&self) -> bool {
        let t = &self.inner.t;
        t.world_size() > 1 && (0..t.world_size()).all(|p| p == t.rank() || t.local_pid(p).is_some())
    }

    /// Whether an operation on `t` (its largest tensor) reads the peers' tensors directly:
    /// every peer is on this host, `t` is larger than the small-message limit and asks for
    /// no codec. Every rank gives the same answer.
    fn reads_directly(&self, t: &Tensor<'_>) -> bool {
        t.codec == Codec::None && t.buf.len() > self.inner.cfg.small_bytes && self.all_local()
    }

    /// The topology, when the hierarchical algorithms apply to it.
    fn hierarchy(&self) -> Option<Arc<Topology>> {
        let topo = self.topology();
        topo.is_hierarchical().then_some(topo)
    }

    fn open(&self) -> Result<()> {
        if self.inner.closed.load(Ordering::Acquire) {
            let why = self
                .inner
                .aborted_because
                .get()
                .map_or("the group was closed", |w| w);
            return Err(Error::Closed(format!("{why}; create a new one")));
        }
        Ok(())
    }

    /// A rank of the group other than this one (point-to-point partners).
    fn check_peer(&self, peer: usize, what: &str) -> Result<()> {
        self.check_rank(peer, what)?;
        if peer == self.rank() {
            return Err(Error::InvalidArgument(format!(
                "{what} is this rank ({peer}): point-to-point to self is not supported; copy the tensor instead"
            )));
        }
        Ok(())
    }

    fn check_rank(&self, peer: usize, what: &str) -> Result<()> {
        if peer >= self.world_size() {
            return Err(Error::InvalidArgument(format!(
                "{what} rank {peer} is out of range for world_size {}",
                self.world_size()
            )));
        }
        Ok(())
    }

    /// Wraps an algorithm: builds its context, and on failure aborts the operation on its peers.
    fn launch<F, Fut>(
        &self,
        kind: FrameKind,
        seq: u64,
        spec: ModelSpec,
        aux: u32,
        peers: Vec<usize>,
        body: F,
    ) -> OpFuture
    where
        F: FnOnce(Arc<Inner<T>>, OpCtxOwned) -> Fut + Send + 'static,
        Fut: Future<Output = Result<()>> + Send,
    {
        let inner = self.inner.clone();
        let space = SeqSpace::of(kind);
        let owned = OpCtxOwned {
            kind,
            seq,
            spec,
            aux,
            deadline: tokio::time::Instant::now() + inner.cfg.timeout,
            timeout: inner.cfg.timeout,
            chunk_bytes: inner.cfg.chunk_bytes,
        };
        if space == SeqSpace::Collective {
            if let Some((earlier, e)) = inner.t.mailbox().take_earlier_remote_abort(space, seq) {
                // An operation that completed here failed on another rank (a broadcast root
                // finishes before any receiver can object): report it now, not never.
                let e = e.earlier(earlier);
                return Box::pin(async move { Err(e) });
            }
        }
        if space == SeqSpace::Collective {
            inner.t.op_started(seq);
        }
        Box::pin(async move {
            let mut res = body(inner.clone(), owned).await;
            if space == SeqSpace::Collective {
                inner.t.op_finished(seq);
            }
            let mb = inner.t.mailbox();
            if let Some(remote) = mb.take_remote_abort(space, seq) {
                // A lost peer here may be one that reported the root cause and left: a send
                // to it fails naming it. Report the cause: whatever a peer reported when ours
                // is a loss, and even another loss when ours is a peer that said goodbye (it
                // left because of the failure it reported).
                let echo = match &res {
                    Err(Error::PeerLost { rank, .. }) => {
                        !matches!(remote, Error::PeerLost { .. }) || mb.has_left(*rank)
                    }
                    _ => false,
                };
                if res.is_ok() || echo {
                    res = Err(remote);
                }
            }
            if res.is_err() && space == SeqSpace::Collective {
                // A failure here may only be the echo of an earlier one elsewhere (a peer that
                // left after reporting it): report the root cause.
                if let Some((earlier, e)) = mb.take_earlier_remote_abort(space, seq) {
                    res = Err(e.earlier(earlier));
                }
            }
            if let Err(e) = &res {
                mb.abort(space, seq, e.clone());
                // Every rank that fails tells every peer, even when it learnt of the failure
                // from one: a peer that the first reporter could not reach still hears of it
                // (peers ignore repeats), so no rank waits for the timeout.
                if !matches!(e, Error::Closed(_)) {
                    let inner2 = inner.clone();
                    let err = e.clone();
                    inner.aborts_in_flight.fetch_add(1, Ordering::AcqRel);
                    tokio::spawn(async move {
                        send_aborts(inner2.t.clone(), space, seq, err, peers).await;
                        inner2.aborts_in_flight.fetch_sub(1, Ordering::AcqRel);
                    });
                }
            }
            mb.purge(space, seq);
            res
        })
    }

    /// All-reduces `t` in place.
    pub fn all_reduce(
        &self,
        t: Tensor<'_>,
        op: ReduceOp,
        algorithm: Algorithm,
    ) -> Result<OpFuture> {
        self.open()?;
        t.check("all_reduce")?;
        op.check(t.dtype)?;
        if op == ReduceOp::None {
            return Err(Error::InvalidArgument(
                "all_reduce needs a reduce op".into(),
            ));
        }
        let topo = self.topology();
        let algorithm = match algorithm {
            Algorithm::Auto if t.buf.len() <= self.inner.cfg.small_bytes => {
                Algorithm::RecursiveDoubling
            }
            Algorithm::Auto if topo.is_hierarchical() => Algorithm::Hierarchical,
            // A codec asked for on one host is honoured by the ring (direct reads move raw bytes).
            Algorithm::Auto if t.codec == Codec::None && self.all_local() => Algorithm::Direct,
            Algorithm::Auto => Algorithm::Ring,
            a => a,
        };
        let (buf, dtype) = (t.buf, t.dtype);
        let seq = self.inner.seq.fetch_add(1, Ordering::AcqRel);
        Ok(self.launch(
            FrameKind::AllReduce,
            seq,
            t.spec(op),
            algorithm as u32,
            self.all_peers(),
            move |inner, o| async move {
                let ctx = o.ctx(&*inner.t);
                match algorithm {
                    Algorithm::Tree => collectives::allreduce_tree(&ctx, buf, dtype, op).await,
                    Algorithm::RecursiveDoubling => {
                        collectives::allreduce_recursive_doubling(&ctx, buf, dtype, op).await
                    }
                    Algorithm::Hierarchical => {
                        collectives::allreduce_hierarchical(&ctx, &topo, buf, dtype, op).await
                    }
                    Algorithm::Direct => collectives::allreduce_direct(&ctx, buf, dtype, op).await,
                    _ => collectives::allreduce_ring(&ctx, buf, dtype, op).await,
                }
            },
        ))
    }

    /// Broadcasts `t` from rank `src` to every rank, in place.
    pub fn broadcast(&self, t: Tensor<'_>, src: usize) -> Result<OpFuture> {
        self.open()?;
        t.check("broadcast")?;
        self.check_rank(src, "broadcast source")?;
        let (buf, dtype, elem) = (t.buf, t.dtype, t.dtype.size());
        let hier = self.hierarchy();
        let direct = hier.is_none() && self.reads_directly(&t);
        let seq = self.inner.seq.fetch_add(1, Ordering::AcqRel);
        Ok(self.launch(
            FrameKind::Broadcast,
            seq,
            t.spec(ReduceOp::None),
            src as u32,
            self.all_peers(),
            move |inner, o| async move {
                let ctx = o.ctx(&*inner.t);
                match hier {
                    Some(topo) => {
                        collectives::broadcast_hierarchical(&ctx, &topo, buf, elem, src).await
                    }
                    None if direct => collectives::broadcast_direct(&ctx, buf, dtype, src).await,
                    None => collectives::broadcast_binomial(&ctx, buf, elem, src).await,
                }
            },
        ))
    }

    /// Gathers every rank's `input` into `out`, whose first dimension is the world size.
    pub fn all_gather(&self, out: Tensor<'_>, input: Tensor<'_>) -> Result<OpFuture> {
        self.open()?;
        input.check("all_gather input")?;
        out.check("all_gather output")?;
        if out.dtype != input.dtype || out.buf.len() != input.buf.len() * self.world_size() {
            return Err(Error::InvalidArgument(format!(
                "all_gather output must be {} of world_size ({}) x input shape {:?}; got {} {:?}",
                input.dtype,
                self.world_size(),
                input.shape,
                out.dtype,
                out.shape
            )));
        }
        let (o_buf, i_buf, dtype) = (out.buf, input.buf, input.dtype);
        let elem = dtype.size();
        let hier = self.hierarchy();
        let direct = hier.is_none() && self.reads_directly(&out);
        let seq = self.inner.seq.fetch_add(1, Ordering::AcqRel);
        Ok(self.launch(
            FrameKind::AllGather,
            seq,
            input.spec(ReduceOp::None),
            variant(hier.is_some(), direct),
            self.all_peers(),
            move |inner, o| async move {
                let ctx = o.ctx(&*inner.t);
                match hier {
                    Some(topo) => {
                        collectives::allgather_hierarchical(&ctx, &topo, o_buf, i_buf, elem).await
                    }
                    None if direct => {
                        collectives::allgather_direct(&ctx, o_buf, i_buf, dtype).await
                    }
                    None => collectives::allgather_ring(&ctx, o_buf, i_buf, elem).await,
                }
            },
        ))
    }

    /// Reduces `input` (world size times `out`'s elements) and leaves this rank's block in `out`.
    pub fn reduce_scatter(
        &self,
        out: Tensor<'_>,
        input: Tensor<'_>,
        op: ReduceOp,
    ) -> Result<OpFuture> {
        self.open()?;
        input.check("reduce_scatter input")?;
        out.check("reduce_scatter output")?;
        op.check(input.dtype)?;
        if op == ReduceOp::None {
            return Err(Error::InvalidArgument(
                "reduce_scatter needs a reduce op".into(),
            ));
        }
        if out.dtype != input.dtype || input.buf.len() != out.buf.len() * self.world_size() {
            return Err(Error::InvalidArgument(format!(
                "reduce_scatter input must be {} with world_size ({}) x the output's elements; got input {} {:?}, output {:?}",
                out.dtype,
                self.world_size(),
                input.dtype,
                input.shape,
                out.shape
            )));
        }
        let (o_buf, i_buf, dtype) = (out.buf, input.buf, input.dtype);
        let hier = self.hierarchy();
        let direct = hier.is_none() && self.reads_directly(&input);
        let seq = self.inner.seq.fetch_add(1, Ordering::AcqRel);
        Ok(self.launch(
            FrameKind::ReduceScatter,
            seq,
            out.spec(op),
            variant(hier.is_some(), direct),
            self.all_peers(),
            move |inner, o| async move {
                let ctx = o.ctx(&*inner.t);
                match hier {
                    Some(topo) => {
                        collectives::reduce_scatter_hierarchical(
                            &ctx, &topo, o_buf, i_buf, dtype, op,
                        )
                        .await
                    }
                    None if direct => {
                        collectives::reduce_scatter_direct(&ctx, o_buf, i_buf, dtype, op).await
                    }
                    None => collectives::reduce_scatter_ring(&ctx, o_buf, i_buf, dtype, op).await,
                }
            },
        ))
    }

    /// Returns once every rank has called it.
    pub fn barrier(&self) -> Result<OpFuture> {
        self.open()?;
        let seq = self.inner.seq.fetch_add(1, Ordering::AcqRel);
        let spec = ModelSpec::flat(DType::U8, ReduceOp::None, 0);
        Ok(
            self.launch(
                FrameKind::Barrier,
                seq,
                spec,
                0,
                self.all_peers(),
                move |inner, o| async move {
                    collectives::barrier_dissemination(&o.ctx(&*inner.t)).await
                },
            ),
        )
    }

    /// Sends `t` to rank `dst`; matched with the receiver's `recv` in order, per pair.
    pub fn send(&self, t: Tensor<'_>, dst: usize, tag: u32) -> Result<OpFuture> {
        self.open()?;
        t.check("send")?;
        self.check_peer(dst, "send destination")?;
        let (buf, elem) = (t.buf, t.dtype.size());
        let seq = p2p_seq(
            self.rank(),
            self.inner.send_seq[dst].fetch_add(1, Ordering::AcqRel),
        );
        Ok(
            self.launch(
                FrameKind::Send,
                seq,
                t.spec(ReduceOp::None),
                tag,
                vec![dst],
                move |inner, o| async move {
                    collectives::send(&o.ctx(&*inner.t), buf, elem, dst).await
                },
            ),
        )
    }

    /// Receives into `t` from rank `src`.
    pub fn recv(&self, t: Tensor<'_>, src: usize, tag: u32) -> Result<OpFuture> {
        self.open()?;
        t.check("recv")?;
        self.check_peer(src, "recv source")?;
        let (buf, elem) = (t.buf, t.dtype.size());
        let seq = p2p_seq(src, self.inner.recv_seq[src].fetch_add(1, Ordering::AcqRel));
        Ok(
            self.launch(
                FrameKind::Send,
                seq,
                t.spec(ReduceOp::None),
                tag,
                vec![src],
                move |inner, o| async move {
                    collectives::recv(&o.ctx(&*inner.t), buf, elem, src).await
                },
            ),
        )
    }

    /// Receives into `t` from whichever rank's next message arrives first; `source` is set to
    /// that rank before the data is read. Messages stay matched per sender, in order.
    pub fn recv_any(&self, t: Tensor<'_>, tag: u32, source: Arc<AtomicUsize>) -> Result<OpFuture> {
        self.open()?;
        t.check("recv")?;
        if self.world_size() < 2 {
            return Err(Error::InvalidArgument(
                "recv from any source needs another rank".into(),
            ));
        }
        let (buf, elem, spec) = (t.buf, t.dtype.size(), t.spec(ReduceOp::None));
        let g = self.clone();
        let deadline = tokio::time::Instant::now() + self.inner.cfg.timeout;
        Ok(Box::pin(async move {
            let me = g.rank();
            loop {
                let mb = g.inner.t.mailbox();
                let arrival = mb.arrival();
                tokio::pin!(arrival);
                arrival.as_mut().enable();
                let keys: Vec<MsgKey> = (0..g.world_size())
                    .filter(|&s| s != me)
                    .map(|s| MsgKey {
                        src: s,
                        space: SeqSpace::P2p,
                        seq: p2p_seq(s, g.inner.recv_seq[s].load(Ordering::Acquire)),
                        step: 0,
                        chunk: 0,
                    })
                    .collect();
                if let Some(k) = mb.first_arrived(&keys) {
                    let (_, n) = collectives::p2p_parts(k.seq);
                    let counter = &g.inner.recv_seq[k.src];
                    if counter
                        .compare_exchange(n, n + 1, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                    {
                        source.store(k.src, Ordering::Release);
                        let src = k.src;
                        let op = g.launch(
                            FrameKind::Send,
                            k.seq,
                            spec,
                            tag,
                            vec![src],
                            move |inner, o| async move {
                                collectives::recv(&o.ctx(&*inner.t), buf, elem, src).await
                            },
                        );
                        return op.await;
                    }
                    continue;
                }
                if tokio::time::timeout_at(deadline, arrival).await.is_err() {
                    return Err(Error::Timeout {
                        what: format!("recv from any source on rank {me}: no rank sent anything"),
                        after: g.inner.cfg.timeout,
                    });
                }
            }
        }))
    }

    /// Cancels everything in flight now: every pending and later operation of this group
    /// fails with `Closed` on this rank, and the connections are dropped at once, so that
    /// the peers see it leave. For when a job must stop without waiting for a collective
    /// that will not finish.
    pub fn abort(&self) {
        self.abort_because("the group was aborted");
    }

    /// [`Group::abort`], with the reason that its operations' errors and later calls give.
    pub fn abort_because(&self, why: &str) {
        let why = self.inner.aborted_because.get_or_init(|| why.to_owned());
        self.inner.closed.store(true, Ordering::Release);
        self.inner.t.mailbox().close(Error::Closed(why.clone()));
        self.inner.t.leave_now();
    }

    /// Marks the group closed (later calls fail), lets the aborts it owes its peers go out
    /// (so that they fail fast rather than time out), and tells the peers goodbye.
    pub async fn close(&self) {
        if !self.inner.closed.swap(true, Ordering::AcqRel) {
            let until = tokio::time::Instant::now() + ABORT_SEND_TIMEOUT;
            while self.inner.aborts_in_flight.load(Ordering::Acquire) > 0
                && tokio::time::Instant::now() < until
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            self.inner.t.goodbye().await;
        }
    }

    fn all_peers(&self) -> Vec<usize> {
        (0..self.world_size())
            .filter(|&p| p != self.rank())
            .collect()
    }
}

/// What an all-gather's or reduce-scatter's frames say about its algorithm (every rank must
/// run the same): 0 the ring, 1 hierarchical, 2 direct reads.
fn variant(hierarchical: bool, direct: bool) -> u32 {
    match (hierarchical, direct) {
        (true, _) => 1,
        (false, true) => 2,
        (false, false) => 0,
    }
}

/// The owned parts of an [`OpCtx`], moved into the operation's future.
pub struct OpCtxOwned {
    kind: FrameKind,
    seq: u64,
    spec: ModelSpec,
    aux: u32,
    deadline: tokio::time::Instant,
    timeout: Duration,
    chunk_bytes: usize,
}

impl OpCtxOwned {
    fn ctx<'a, T: Transport>(&self, t: &'a T) -> OpCtx<'a, T> {
        OpCtx {
            t,
            kind: self.kind,
            seq: self.seq,
            spec: self.spec.clone(),
            aux: self.aux,
            deadline: self.deadline,
            timeout: self.timeout,
            chunk_bytes: self.chunk_bytes,
            sub: None,
        }
    }
}

/// How long telling a peer of a failure may take (a dial under load can take seconds).
const ABORT_SEND_TIMEOUT: Duration = Duration::from_secs(10);

/// Tells `peers` that operation `seq` failed here, so that they stop waiting for it.
async fn send_aborts<T: Transport>(
    t: Arc<T>,
    space: SeqSpace,
    seq: u64,
    err: Error,
    peers: Vec<usize>,
) {
    let payload = encode_abort(space, &err);
    let header = Header::bytes(FrameKind::Abort, t.rank(), seq, 0, &payload);
    let (header, payload) = (Arc::new(header), Arc::new(payload));
    let mut tasks = Vec::new();
    // Not to a peer that is gone; a stalled one is alive and hears of what it caused.
    let reachable = |p: usize| t.mailbox().gone_error(p).is_none();
    for p in peers.into_iter().filter(|&p| reachable(p)) {
        let (t, header, payload) = (t.clone(), header.clone(), payload.clone());
        tasks.push(tokio::spawn(async move {
            let _ =
                tokio::time::timeout(Duration::from_secs(2), t.send_frame(p, &header, &payload))
                    .await;
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
}
