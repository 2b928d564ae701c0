//! The bulk lane: a frame's payload as Reed-Solomon coded QUIC datagrams.
//!
//! A reliable stream loses time at every lost packet (a retransmission at least one round
//! trip later, a stalled window meanwhile); at 20 % random loss that is most of the time.
//! This lane sends the payload as datagram-sized shards in blocks of `k` data and `m` parity
//! shards ([`crate::fec`]), so that any `k` of a block's `k + m` shards rebuild it and a lost
//! datagram costs nothing but its share of the parity. Per frame:
//!
//! 1. The sender opens a bidirectional stream and writes [`BULK_MAGIC`], the
//!    [`TransferPlan`] and the frame header (reliable, ordered).
//! 2. It sends every block's shards as datagrams (`send_datagram_wait`: backpressure, never a
//!    dropped queue), with `m` from the path's measured loss ([`parity_for`]) so that repairs
//!    stay rare. The send completes here, as a stream send does once QUIC holds the bytes.
//! 3. Once its datagrams have left quinn's buffer it writes `END` on the stream. A receiver
//!    that rebuilt everything answers `DONE`; one still short of some blocks a short grace
//!    after `END` answers with NACKs, the sender sends the shards they name, and writes `END`
//!    again, a bounded number of rounds.
//!
//! The receiver reads datagrams on one task per connection, files each shard with its
//! transfer (a shard can come before its announcement: those wait in a bounded stash), and
//! delivers the rebuilt payload to the mailbox exactly as a stream frame would be, after the
//! frame CRC over the whole payload. Corrupted shards fail their own CRC32C and are erasures.
//! Everything is bounded: transfers per connection (QUIC's stream limit), payload bytes
//! in reception, the stash, the memory of finished transfer ids, repair rounds and waits.

use super::stream_lane::Sent;
use super::{QuicTransport, WriteFail, MAX_FRAME_PAYLOAD};
use crate::error::{Error, Result};
use crate::fec::rounds::CONTROL_HEAD;
use crate::fec::{
    parity_for, Control, LossEstimator, Received, RepairRequester, RepairSender, RequesterStep,
    RoundsEnd, SenderStep, TransferPlan, TransferReceiver, TransferSender,
};
use crate::transport::{Frame, MsgKey, Payload};
use crate::wire::{Header, HEADER_FIXED};
use bytes::Bytes;
use quinn::{Connection, RecvStream, SendStream};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Notify};

/// The first bytes of a bulk transfer's stream.
pub const BULK_MAGIC: [u8; 4] = *b"MCPB";

/// Most parity shards per block.
const MAX_PARITY: usize = 256;
/// Repair rounds before the sender withdraws a transfer (default of `repair_rounds`).
const MAX_ROUNDS: u32 = 64;
/// Datagrams of not yet announced transfers kept per connection.
const STASH_BYTES: usize = 32 << 20;
/// Transfers with stashed datagrams per connection.
const STASH_TRANSFERS: usize = 512;
/// Finished transfer ids remembered per connection (their late shards are dropped).
const DONE_MEMORY: usize = 8192;
/// Payload bytes in reception per connection.
const LIVE_BYTES: u64 = 4 << 30;

/// Stream reset code: the sender withdrew the transfer (the frame follows on a stream).
const CANCELLED: u32 = 0x4d42;
/// Stream reset code: the sender could not complete the transfer.
const FAILED: u32 = 0x4d43;

/// Which lane a frame takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LanePolicy {
    /// Reliable streams, and the FEC lane for large frames once loss is measured on a path
    /// with a long enough round trip.
    #[default]
    Auto,
    /// Reliable streams only.
    Stream,
    /// The FEC lane for every data frame with a payload.
    Fec,
}

impl LanePolicy {
    /// Parses `auto`, `stream` or `fec`.
    pub fn parse(s: &str) -> Option<LanePolicy> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(LanePolicy::Auto),
            "stream" => Some(LanePolicy::Stream),
            "fec" => Some(LanePolicy::Fec),
            _ => None,
        }
    }

    /// The name `parse` reads.
    pub fn name(self) -> &'static str {
        match self {
            LanePolicy::Auto => "auto",
            LanePolicy::Stream => "stream",
            LanePolicy::Fec => "fec",
        }
    }
}

/// Settings of the bulk lane.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BulkConfig {
    /// Which lane frames take.
    pub policy: LanePolicy,
    /// With [`LanePolicy::Auto`]: frames of at least this many payload bytes take the FEC
    /// lane once the measured packet loss exceeds `auto_loss`.
    pub threshold: usize,
    /// See `threshold`.
    pub auto_loss: f64,
    /// With [`LanePolicy::Auto`]: only paths whose smoothed RTT is at least this long take the
    /// FEC lane (below it, retransmitting the lost packets is cheaper than coding).
    pub auto_rtt: Duration,
    /// Data shards per block (fewer for a short payload).
    pub k: u16,
    /// Most payload bytes per shard (fewer when the path's datagrams are smaller).
    pub max_shard: usize,
    /// Target probability that a block cannot be rebuilt without a repair.
    pub target: f64,
    /// Repair rounds before the sender withdraws a transfer and sends the frame on a stream.
    pub repair_rounds: u32,
}

impl Default for BulkConfig {
    fn default() -> Self {
        BulkConfig {
            policy: LanePolicy::Auto,
            threshold: 256 << 10,
            auto_loss: 0.003,
            auto_rtt: Duration::from_millis(5),
            k: 128,
            // Fits the loopback MTU floor (see endpoint.rs) with QUIC's and our headers.
            max_shard: 15 << 10,
            target: 5e-3,
            repair_rounds: MAX_ROUNDS,
        }
    }
}

/// Fewest packets per loss sample.
const LOSS_SAMPLE: u64 = 64;
/// Packets the loss estimate averages over. The parity of every block is chosen from it, so
/// it must not swing with each lost packet: at 1 % loss a sample of 64 packets reads 0, 1.6 or
/// 3.1 %, and blocks coded while it read 0 then need repair rounds. About 1,500 packets (2 MB
/// at MTU 1500) hold 15 losses at 1 %.
const LOSS_HORIZON: f64 = 1500.0;

/// The sender's view of one peer's path: loss measured from QUIC's packet counters.
#[derive(Debug)]
pub(super) struct PathLoss {
    conn_id: usize,
    last: (u64, u64),
    est: LossEstimator,
    measured: bool,
    /// Datagrams handed to quinn on this connection.
    queued: u64,
}

impl Default for PathLoss {
    fn default() -> Self {
        PathLoss {
            conn_id: usize::MAX,
            last: (0, 0),
            est: LossEstimator::default(),
            measured: false,
            queued: 0,
        }
    }
}

impl PathLoss {
    fn for_conn(&mut self, conn: &Connection) {
        if self.conn_id != conn.stable_id() {
            *self = PathLoss {
                conn_id: conn.stable_id(),
                ..PathLoss::default()
            };
        }
    }

    /// Folds the packets sent and lost since the last look into the estimate.
    fn update(&mut self, conn: &Connection) -> f64 {
        self.for_conn(conn);
        let p = conn.stats().path;
        let sent = p.sent_packets.saturating_sub(self.last.0);
        let lost = p.lost_packets.saturating_sub(self.last.1);
        if sent >= LOSS_SAMPLE {
            if self.measured {
                self.est
                    .observe_over(sent.saturating_sub(lost), sent, LOSS_HORIZON);
            } else {
                // The first sample replaces the prior: a clean path is not taken for a lossy
                // one while the estimate decays from its starting guess.
                self.est = LossEstimator::new((lost.min(sent) as f64) / sent as f64, 0.3)
                    .unwrap_or_default();
            }
            self.last = (p.sent_packets, p.lost_packets);
            self.measured = true;
        }
        self.est.loss()
    }
}

impl QuicTransport {
    /// Whether a frame of `len` payload bytes to `peer` takes the FEC lane.
    pub(super) fn wants_bulk(
        &self,
        peer: usize,
        conn: &Connection,
        header: &Header,
        len: usize,
    ) -> bool {
        use crate::wire::FrameKind;
        let data = !matches!(
            header.kind,
            FrameKind::Hello
                | FrameKind::Table
                | FrameKind::Goodbye
                | FrameKind::Abort
                | FrameKind::Progress
        );
        if !data || len == 0 || conn.max_datagram_size().is_none() {
            return false;
        }
        let bulk = self.cfg.bulk;
        match bulk.policy {
            LanePolicy::Stream => false,
            LanePolicy::Fec => true,
            LanePolicy::Auto => {
                if len < bulk.threshold {
                    return false;
                }
                // On a short path a retransmission costs less than coding every byte: FEC
                // pays when the round trip is long enough (measured: see the README).
                if conn.rtt() < bulk.auto_rtt {
                    return false;
                }
                let Some(slot) = self.peers.get(peer) else {
                    return false;
                };
                let mut pl = slot.path.lock().unwrap_or_else(|p| p.into_inner());
                let p = pl.update(conn);
                pl.measured && p > bulk.auto_loss
            }
        }
    }

    /// The path's loss estimate for `peer` (for the parity count).
    fn path_loss(&self, peer: usize, conn: &Connection) -> f64 {
        self.peers
            .get(peer)
            .map(|s| {
                s.path
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .update(conn)
            })
            .unwrap_or(0.02)
    }

    /// Hands one shard to quinn (waiting for buffer space), corrupting it first when chaos
    /// says so (above QUIC: the shard CRC must catch it).
    async fn send_shard(
        &self,
        peer: usize,
        conn: &Connection,
        shard: Bytes,
    ) -> std::result::Result<(), WriteFail> {
        let shard = match self.corruption_bit(shard.len()) {
            Some(bit) => {
                let mut v = shard.to_vec();
                v[bit / 8] ^= 1 << (bit % 8);
                Bytes::from(v)
            }
            None => shard,
        };
        conn.send_datagram_wait(shard).await.map_err(|e| match e {
            quinn::SendDatagramError::ConnectionLost(c) => WriteFail::Conn(c),
            quinn::SendDatagramError::TooLarge => WriteFail::TooLarge,
            other => WriteFail::Core(Error::Io(format!("FEC lane datagram: {other}"))),
        })?;
        if let Some(slot) = self.peers.get(peer) {
            let mut pl = slot.path.lock().unwrap_or_else(|p| p.into_inner());
            pl.for_conn(conn);
            pl.queued += 1;
        }
        Ok(())
    }

    /// Datagrams queued on `conn` so far.
    fn queued_datagrams(&self, peer: usize, conn: &Connection) -> u64 {
        self.peers
            .get(peer)
            .map(|s| {
                let mut pl = s.path.lock().unwrap_or_else(|p| p.into_inner());
                pl.for_conn(conn);
                pl.queued
            })
            .unwrap_or(0)
    }

    /// Sends one frame over the FEC lane; returns once every first-pass shard is queued in
    /// QUIC. Repairs are served in the background from a copy of the payload.
    pub(super) async fn write_bulk(
        &self,
        peer: usize,
        conn: &Connection,
        header: &Header,
        payload: &[u8],
    ) -> std::result::Result<(), WriteFail> {
        let bulk = self.cfg.bulk;
        // Shards that still fit once the path's MTU falls to its floor: quinn drops queued
        // datagrams above a new limit, and its black-hole detector lowers the MTU under
        // random loss, which is when this lane runs.
        let floor = self.sock.floor_mtu(&self.cfg);
        let max_dg = match datagram_room_at_floor(floor, || {
            let mtu = conn.stats().path.current_mtu;
            let max = conn.max_datagram_size();
            (mtu, max, conn.stats().path.current_mtu)
        }) {
            Room::Fits(n) => n,
            Room::NoDatagrams => {
                return Err(WriteFail::Core(Error::Io(
                    "the peer takes no datagrams".into(),
                )))
            }
            // Discovery keeps moving the MTU: the stream lane carries this frame.
            Room::Unsettled => return Err(WriteFail::TooLarge),
        };
        let (k, dg) = block_shape(payload.len(), max_dg, bulk).map_err(WriteFail::Core)?;
        let tid = self.next_transfer.fetch_add(1, Ordering::Relaxed);
        let plan = TransferPlan::new(tid, payload.len() as u64, k, dg).map_err(WriteFail::Core)?;
        let loss = self.path_loss(peer, conn);
        let parity =
            |k: usize| parity_for(k, loss, bulk.target, 1, MAX_PARITY.min(4 * k).max(1)) as u16;
        let mut tx = TransferSender::new(
            plan,
            Bytes::copy_from_slice(payload),
            parity(usize::from(k)),
        )
        .map_err(WriteFail::Core)?;
        let (mut send, recv) = conn.open_bi().await.map_err(WriteFail::Conn)?;
        let mut announce =
            Vec::with_capacity(4 + crate::fec::transfer::PLAN_LEN + header.encoded_len());
        announce.extend_from_slice(&BULK_MAGIC);
        announce.extend_from_slice(&plan.to_bytes());
        header.encode(&mut announce).map_err(WriteFail::Core)?;
        send.write_all(&announce).await.map_err(WriteFail::Write)?;
        let mut b = 0u32;
        loop {
            if let Some((_, _, kb)) = plan.block_span(b) {
                tx.set_parity(parity(kb)).map_err(WriteFail::Core)?;
            }
            let Some((_, shards)) = tx.next_block().map_err(WriteFail::Core)? else {
                break;
            };
            for s in shards {
                if let Err(e) = self.send_shard(peer, conn, s).await {
                    if matches!(e, WriteFail::TooLarge) {
                        // The receiver drops the transfer without a word; the caller resends
                        // the frame on a stream.
                        let _ = send.reset(quinn::VarInt::from_u32(CANCELLED));
                    }
                    return Err(e);
                }
            }
            b += 1;
        }
        // quinn sends datagrams in the order they were queued: once it has sent this many
        // on the connection, this transfer's are on the wire.
        let mark = self.queued_datagrams(peer, conn);
        self.count_sent(peer, header.encoded_len() + payload.len());
        self.stats.bulk_frames_sent.fetch_add(1, Ordering::Relaxed);
        // Until the receiver says DONE, the transfer counts as unacknowledged (shutdown waits).
        self.unacked_streams.fetch_add(1, Ordering::AcqRel);
        let me = self.me.clone();
        let conn = conn.clone();
        let header = header.clone();
        tokio::spawn(async move {
            serve_repairs(&me, peer, &conn, tx, &header, (send, recv), mark).await;
            if let Some(t) = me.upgrade() {
                t.unacked_streams.fetch_sub(1, Ordering::AcqRel);
            }
        });
        Ok(())
    }
}

/// What [`datagram_room_at_floor`] found.
#[derive(Debug, PartialEq, Eq)]
enum Room {
    /// Datagrams of this many bytes fit at the floor MTU.
    Fits(usize),
    /// The connection takes no datagrams.
    NoDatagrams,
    /// The MTU changed between the reads every time.
    Unsettled,
}

/// The largest datagram that still fits once the path's MTU falls to `floor`: quinn's
/// `max_datagram_size` less what the current MTU is above the floor. `read` gives the MTU,
/// `max_datagram_size` and the MTU again; MTU discovery may raise the MTU between two reads,
/// and a difference taken across a change says nothing (on loopback it jumps from the
/// 16,000-byte floor to 65,000, which leaves no room at all), so reads that straddle a
/// change are taken again.
fn datagram_room_at_floor(floor: u16, mut read: impl FnMut() -> (u16, Option<usize>, u16)) -> Room {
    for _ in 0..8 {
        let (before, max, after) = read();
        let Some(max) = max else {
            return Room::NoDatagrams;
        };
        if before == after {
            return Room::Fits(max.saturating_sub(usize::from(before.saturating_sub(floor))));
        }
    }
    Room::Unsettled
}

/// The block shape for a payload of `len` bytes over datagrams of at most `max_dg` bytes:
/// data shards per block and the datagram size to plan for. The payload is split evenly, so
/// that no block is a small remainder (a small block needs proportionally more parity).
fn block_shape(len: usize, max_dg: usize, bulk: BulkConfig) -> Result<(u16, usize)> {
    use crate::fec::shard::HEADER_LEN;
    let max_sb = TransferPlan::shard_bytes_for(max_dg.min(bulk.max_shard + HEADER_LEN))?;
    let kmax = usize::from(bulk.k.max(1));
    let n = len.div_ceil(max_sb).max(1);
    let blocks = n.div_ceil(kmax);
    let k = n.div_ceil(blocks);
    let sb = len.div_ceil(blocks * k).div_ceil(64) * 64;
    let sb = sb.clamp(64.min(max_sb), max_sb);
    Ok((k as u16, sb + HEADER_LEN))
}

/// Waits (bounded) until quinn has put the first `mark` datagrams queued on `conn` on the
/// wire (those of one transfer and the transfers queued before it, not those queued since),
/// or has none left to send (it drops queued datagrams that no longer fit the path).
async fn drained(conn: &Connection, mark: u64) {
    let until = Instant::now() + Duration::from_secs(2);
    while conn.stats().frame_tx.datagram < mark
        && conn.datagram_send_buffer_space() < super::endpoint::DATAGRAM_SEND_BUFFER
        && conn.close_reason().is_none()
        && Instant::now() < until
    {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

async fn write_msg(send: &mut SendStream, msg: &Control) -> bool {
    match msg.encode() {
        Ok(m) => send.write_all(&m).await.is_ok(),
        Err(_) => false,
    }
}

/// What reading a control message gave.
enum Msg {
    /// A message.
    Got(Control),
    /// The peer reset the stream with this code.
    Reset(u64),
    /// The stream ended or failed otherwise.
    End,
}

fn reset_code(e: &quinn::ReadExactError) -> Option<u64> {
    match e {
        quinn::ReadExactError::ReadError(quinn::ReadError::Reset(code)) => Some(u64::from(*code)),
        _ => None,
    }
}

/// Reads one control message.
async fn read_msg(recv: &mut RecvStream) -> Msg {
    let mut head = [0u8; CONTROL_HEAD];
    if let Err(e) = recv.read_exact(&mut head).await {
        return reset_code(&e).map_or(Msg::End, Msg::Reset);
    }
    let Ok((kind, len)) = Control::read_head(head) else {
        return Msg::End;
    };
    let mut body = vec![0u8; len];
    if let Err(e) = recv.read_exact(&mut body).await {
        return reset_code(&e).map_or(Msg::End, Msg::Reset);
    }
    Control::decode(kind, &body).map_or(Msg::End, Msg::Got)
}

/// The sender's side after the first pass: END, then NACKs answered with repairs, until
/// DONE or the end of the stream. When the repairs cannot finish the transfer (the round
/// limit, a repair shard that no longer fits a datagram after the path's MTU fell, no answer
/// within the idle timeout) the transfer is withdrawn and the frame goes on the stream lane
/// instead, on the same connection: a lossy path slows the frame down, it never fails it.
async fn serve_repairs(
    me: &Weak<QuicTransport>,
    peer: usize,
    conn: &Connection,
    mut tx: TransferSender,
    header: &Header,
    (mut send, mut recv): (SendStream, RecvStream),
    mut mark: u64,
) {
    let (idle, rounds) = me
        .upgrade()
        .map(|t| (t.cfg.idle_timeout, t.cfg.bulk.repair_rounds))
        .unwrap_or((Duration::from_secs(30), MAX_ROUNDS));
    let mut rounds = RepairSender::new(rounds, idle);
    let mut step = rounds.start(Instant::now());
    let outcome = loop {
        step = match step {
            SenderStep::Finished(end) => break end,
            SenderStep::SendEnd(round) => {
                drained(conn, mark).await;
                if !write_msg(&mut send, &Control::End { round }).await {
                    break RoundsEnd::Broken;
                }
                let wait = rounds
                    .poll_timeout()
                    .map_or(idle, |t| t.saturating_duration_since(Instant::now()));
                match tokio::time::timeout(wait, read_msg(&mut recv)).await {
                    Ok(Msg::Got(msg)) => rounds.on_message(msg),
                    Ok(_) => break RoundsEnd::Broken,
                    Err(_) => rounds
                        .handle_timeout(Instant::now())
                        .unwrap_or(SenderStep::Finished(RoundsEnd::Unfinished)),
                }
            }
            SenderStep::Repair(nacks) => {
                let Some(t) = me.upgrade() else {
                    break RoundsEnd::Broken;
                };
                match send_repairs(&t, peer, conn, &mut tx, &nacks).await {
                    Ok(()) => {
                        mark = t.queued_datagrams(peer, conn);
                        rounds.repairs_sent(Instant::now())
                    }
                    Err(end) => break end,
                }
            }
        };
    };
    match outcome {
        RoundsEnd::Done => {
            let _ = send.finish();
        }
        // The connection broke before DONE: the receiver may not even have seen the
        // transfer, so the frame goes again on the next connection (a copy it filed already
        // is dropped). A stream the receiver reset on a live connection carried its verdict.
        RoundsEnd::Broken => {
            let _ = send.reset(quinn::VarInt::from_u32(FAILED));
            if conn.close_reason().is_some() {
                if let Some(t) = me.upgrade() {
                    t.resend_after_break(peer, conn, header, tx.payload()).await;
                }
            }
        }
        RoundsEnd::Unfinished => {
            let Some(t) = me.upgrade() else { return };
            if conn.close_reason().is_some() {
                let _ = send.reset(quinn::VarInt::from_u32(FAILED));
                return;
            }
            // The receiver drops the transfer on CANCELLED and waits for the frame on a
            // stream; one it rebuilt meanwhile is filed already and drops the copy.
            let _ = send.reset(quinn::VarInt::from_u32(CANCELLED));
            t.stats.bulk_fallbacks.fetch_add(1, Ordering::Relaxed);
            // A frame that neither lane can carry means the connection broke meanwhile: the
            // receiver's operation fails with it, naming this peer.
            let _ = t
                .write_checked(peer, conn, header, tx.payload(), Sent::Again)
                .await;
        }
    }
}

/// Sends the shards `nacks` name. A repair shard too large for the path's datagrams now
/// (its MTU fell) or a NACK the transfer cannot answer leaves the repairs unfinished.
async fn send_repairs(
    t: &QuicTransport,
    peer: usize,
    conn: &Connection,
    tx: &mut TransferSender,
    nacks: &[crate::fec::Nack],
) -> std::result::Result<(), RoundsEnd> {
    for nack in nacks {
        let shards = tx.repair(nack).map_err(|_| RoundsEnd::Unfinished)?;
        t.stats
            .repair_shards
            .fetch_add(shards.len() as u64, Ordering::Relaxed);
        for s in shards {
            match t.send_shard(peer, conn, s).await {
                Ok(()) => {}
                Err(WriteFail::TooLarge) => return Err(RoundsEnd::Unfinished),
                Err(_) => return Err(RoundsEnd::Broken),
            }
        }
    }
    Ok(())
}

/// One transfer in reception.
struct RxTransfer {
    rx: Mutex<Option<TransferReceiver>>,
    error: Mutex<Option<Error>>,
    notify: Notify,
}

impl RxTransfer {
    /// Files one datagram; wakes the transfer's task when it completes or fails.
    fn take(&self, d: &[u8]) {
        let mut g = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        let Some(rx) = g.as_mut() else { return };
        match rx.receive(d) {
            Ok(Received::BlockDone(_)) if rx.is_complete() => self.notify.notify_one(),
            Ok(_) => {}
            Err(e) => {
                *self.error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                self.notify.notify_one();
            }
        }
    }

    fn is_complete(&self) -> bool {
        self.rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|r| r.is_complete())
    }
}

#[derive(Default)]
struct RxInner {
    live: HashMap<u64, Arc<RxTransfer>>,
    live_bytes: u64,
    stash: HashMap<u64, Vec<Bytes>>,
    stash_order: VecDeque<u64>,
    stash_bytes: usize,
    done: HashSet<u64>,
    done_order: VecDeque<u64>,
}

impl RxInner {
    fn stash(&mut self, tid: u64, d: Bytes) {
        if d.len() > STASH_BYTES {
            return;
        }
        if !self.stash.contains_key(&tid) {
            self.stash_order.push_back(tid);
        }
        self.stash_bytes += d.len();
        self.stash.entry(tid).or_default().push(d);
        while (self.stash_bytes > STASH_BYTES || self.stash_order.len() > STASH_TRANSFERS)
            && !self.stash_order.is_empty()
        {
            if let Some(old) = self.stash_order.pop_front() {
                if let Some(v) = self.stash.remove(&old) {
                    self.stash_bytes -= v.iter().map(Bytes::len).sum::<usize>();
                }
            }
        }
    }

    fn unstash(&mut self, tid: u64) -> Vec<Bytes> {
        let v = self.stash.remove(&tid).unwrap_or_default();
        if !v.is_empty() {
            self.stash_order.retain(|&t| t != tid);
            self.stash_bytes -= v.iter().map(Bytes::len).sum::<usize>();
        }
        v
    }

    fn finish(&mut self, tid: u64, bytes: u64) {
        if self.live.remove(&tid).is_some() {
            self.live_bytes = self.live_bytes.saturating_sub(bytes);
        }
        if self.done.insert(tid) {
            self.done_order.push_back(tid);
        }
        while self.done_order.len() > DONE_MEMORY {
            if let Some(old) = self.done_order.pop_front() {
                self.done.remove(&old);
            }
        }
        self.unstash(tid);
    }
}

/// The receiving side of the FEC lane of one connection.
#[derive(Default)]
pub(super) struct BulkRx {
    inner: Mutex<RxInner>,
    /// Datagrams received on this connection (for tests and stats).
    pub datagrams: AtomicU64,
    /// Transfers in reception.
    pub active: AtomicUsize,
}

impl BulkRx {
    fn lock(&self) -> std::sync::MutexGuard<'_, RxInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Reads the datagrams of `conn` and files each shard with its transfer.
pub(super) async fn datagram_loop(conn: Connection, bulk: Arc<BulkRx>) {
    while let Ok(d) = conn.read_datagram().await {
        if d.is_empty() {
            continue; // a leaving peer asking for our close (see `ask_for_close`)
        }
        bulk.datagrams.fetch_add(1, Ordering::Relaxed);
        let Some(id) = d.get(..8) else { continue };
        let mut tid = [0u8; 8];
        tid.copy_from_slice(id);
        let tid = u64::from_le_bytes(tid);
        let t = {
            let mut g = bulk.lock();
            match g.live.get(&tid) {
                Some(t) => Some(t.clone()),
                None => {
                    if !g.done.contains(&tid) {
                        g.stash(tid, d.clone());
                    }
                    None
                }
            }
        };
        if let Some(t) = t {
            t.take(&d);
        }
    }
}

/// Whether a stream read failed because the sender withdrew the transfer (the frame follows
/// on a stream).
pub(super) fn withdrawn(e: &quinn::ReadExactError) -> bool {
    reset_code(e) == Some(u64::from(CANCELLED))
}

/// Reads a transfer's announcement after its magic; `None` when the sender withdrew it.
async fn read_announce(recv: &mut RecvStream) -> Result<Option<(TransferPlan, Header, usize)>> {
    let mut cancelled = false;
    let res = {
        let mut bad = |what: &str, e: quinn::ReadExactError| {
            cancelled |= reset_code(&e) == Some(u64::from(CANCELLED));
            Error::Protocol(format!("FEC lane: reading {what}: {e}"))
        };
        read_announce_inner(recv, &mut bad).await
    };
    match res {
        Ok(a) => Ok(Some(a)),
        Err(_) if cancelled => Ok(None),
        Err(e) => Err(e),
    }
}

async fn read_announce_inner(
    recv: &mut RecvStream,
    bad: &mut impl FnMut(&str, quinn::ReadExactError) -> Error,
) -> Result<(TransferPlan, Header, usize)> {
    let mut head = [0u8; crate::fec::transfer::PLAN_LEN];
    recv.read_exact(&mut head)
        .await
        .map_err(|e| bad("the announcement", e))?;
    let plan = TransferPlan::from_bytes(&head)?;
    let mut fixed = [0u8; HEADER_FIXED];
    recv.read_exact(&mut fixed)
        .await
        .map_err(|e| bad("a frame header", e))?;
    let shape_len = Header::shape_len(&fixed)?;
    let mut hbytes = fixed.to_vec();
    hbytes.resize(HEADER_FIXED + shape_len, 0);
    recv.read_exact(&mut hbytes[HEADER_FIXED..])
        .await
        .map_err(|e| bad("a frame shape", e))?;
    let header = Header::decode(&hbytes)?;
    if header.payload_len != plan.total_len || header.payload_len > MAX_FRAME_PAYLOAD {
        return Err(Error::Protocol(format!(
            "FEC lane: frame of {} bytes announced with a plan of {}",
            header.payload_len, plan.total_len
        )));
    }
    Ok((plan, header, hbytes.len()))
}

/// One transfer, from its announcement (after its magic) to the delivered frame.
pub(super) async fn receive_transfer(
    me: &Weak<QuicTransport>,
    conn: &Connection,
    bulk: &BulkRx,
    mut send: SendStream,
    mut recv: RecvStream,
    known: &Mutex<Option<usize>>,
    received: &AtomicU64,
) -> Result<()> {
    let Some((plan, header, hlen)) = read_announce(&mut recv).await? else {
        return Ok(()); // withdrawn before it began: the frame comes on a stream
    };
    let (world, idle) = match me.upgrade() {
        Some(t) => (t.world, t.cfg.idle_timeout),
        None => return Ok(()),
    };
    let src = header.src as usize;
    if src >= world {
        return Err(Error::Protocol(format!(
            "frame from rank {src} in a world of {world}"
        )));
    }
    {
        let mut k = known.lock().unwrap_or_else(|p| p.into_inner());
        if k.is_none() {
            *k = Some(src);
        }
    }
    let tid = plan.transfer_id;
    let transfer = Arc::new(RxTransfer {
        rx: Mutex::new(None),
        error: Mutex::new(None),
        notify: Notify::new(),
    });
    let early = {
        let mut g = bulk.lock();
        if g.live.contains_key(&tid) || g.done.contains(&tid) {
            return Err(Error::Protocol(format!(
                "FEC lane: transfer {tid} announced twice"
            )));
        }
        if g.live_bytes + plan.total_len > LIVE_BYTES {
            return Err(Error::Protocol(format!(
                "FEC lane: more than {LIVE_BYTES} bytes in reception"
            )));
        }
        g.live_bytes += plan.total_len;
        g.live.insert(tid, transfer.clone());
        g.unstash(tid)
    };
    bulk.active.fetch_add(1, Ordering::Relaxed);
    let res = run_transfer(conn, src, plan, &transfer, early, &mut send, recv, idle).await;
    bulk.active.fetch_sub(1, Ordering::Relaxed);
    bulk.lock().finish(tid, plan.total_len);
    let key = MsgKey::of(&header);
    let Some(t) = me.upgrade() else { return Ok(()) };
    let filed = match res {
        Ok(None) => return Ok(()), // withdrawn: the frame comes on a stream
        Ok(Some(bytes)) => {
            let _ = write_msg(&mut send, &Control::Done).await;
            let _ = send.finish();
            let payload = Payload::from(bytes);
            t.stats.frames_received.fetch_add(1, Ordering::Relaxed);
            t.stats.bulk_frames_received.fetch_add(1, Ordering::Relaxed);
            t.stats
                .bytes_received
                .fetch_add((hlen + payload.len()) as u64, Ordering::Relaxed);
            match payload.verify(&header) {
                Ok(()) => t.mailbox.dispatch(Frame { header, payload }),
                Err(e) => {
                    t.stats.corrupt_frames.fetch_add(1, Ordering::Relaxed);
                    t.mailbox.deliver(key, Err(e))
                }
            }
        }
        // Cut off with its connection: the connection's end decides (see `reconnect`).
        Err(_) if conn.close_reason().is_some() => return Ok(()),
        Err(e) => {
            let _ = send.reset(quinn::VarInt::from_u32(1));
            t.stats.corrupt_frames.fetch_add(1, Ordering::Relaxed);
            t.mailbox.deliver(key, Err(e))
        }
    };
    // A copy of a frame filed before (resent across a reconnection) was counted then.
    if filed {
        received.fetch_add(1, Ordering::AcqRel);
    }
    Ok(())
}

/// Collects the shards of one transfer, asking for repairs, until it is complete.
#[allow(clippy::too_many_arguments)]
async fn run_transfer(
    conn: &Connection,
    src: usize,
    plan: TransferPlan,
    transfer: &RxTransfer,
    early: Vec<Bytes>,
    send: &mut SendStream,
    mut recv: RecvStream,
    idle: Duration,
) -> Result<Option<Vec<u8>>> {
    *transfer.rx.lock().unwrap_or_else(|p| p.into_inner()) = Some(TransferReceiver::new(plan)?);
    for d in &early {
        transfer.take(d);
    }
    // Control messages from the sender, read by their own task (a read is not cancel-safe):
    // `Some(true)` an END, `Some(false)` the transfer withdrawn.
    let (msg_tx, mut msgs) = mpsc::channel::<bool>(8);
    let reader = tokio::spawn(async move {
        loop {
            let item = match read_msg(&mut recv).await {
                Msg::Got(Control::End { .. }) => true,
                Msg::Reset(code) if code == u64::from(CANCELLED) => false,
                _ => break,
            };
            if msg_tx.send(item).await.is_err() || !item {
                break;
            }
        }
    });
    let res = async {
        let mut rounds = RepairRequester::new(Instant::now(), idle);
        loop {
            if let Some(e) = transfer.error.lock().unwrap_or_else(|p| p.into_inner()).take() {
                return Err(e);
            }
            if transfer.is_complete() {
                break;
            }
            let wake = tokio::time::Instant::from_std(rounds.poll_timeout());
            tokio::select! {
                _ = transfer.notify.notified() => rounds.on_progress(Instant::now()),
                m = msgs.recv() => match m {
                    Some(false) => return Ok(None),
                    Some(true) => rounds.on_end(Instant::now(), conn.rtt()),
                    None => {
                        if transfer.is_complete() { break; }
                        if let Some(c) = conn.close_reason() {
                            return Err(super::map_conn_error(&c, src, &format!("rank {src}"), "receive"));
                        }
                        return Err(Error::Protocol(format!(
                            "FEC lane: the sender ended transfer {} before it was complete",
                            plan.transfer_id
                        )));
                    }
                },
                _ = tokio::time::sleep_until(wake) => match rounds.handle_timeout(Instant::now()) {
                    Some(RequesterStep::SendNacks) => {
                        let nacks = {
                            let g = transfer.rx.lock().unwrap_or_else(|p| p.into_inner());
                            let Some(rx) = g.as_ref() else { break };
                            if rx.is_complete() { break; }
                            let p = conn.stats().path;
                            let loss = (p.lost_packets as f64 / p.sent_packets.max(1) as f64).clamp(0.05, 0.5);
                            rx.nacks(loss, 1e-2)
                        };
                        if !write_msg(send, &Control::Nacks(nacks)).await {
                            return Err(Error::Protocol("FEC lane: the sender went away".into()));
                        }
                    }
                    Some(RequesterStep::Stalled(after)) => {
                        return Err(Error::Timeout {
                            what: format!("FEC lane transfer {} stalled", plan.transfer_id),
                            after,
                        });
                    }
                    None => {}
                },
            }
        }
        let rx = transfer
            .rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| Error::Protocol("FEC lane: transfer vanished".into()))?;
        rx.into_payload().map(Some)
    }
    .await;
    reader.abort();
    res
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fec::shard::HEADER_LEN;

    #[test]
    fn datagram_room_is_read_from_one_mtu() {
        // Steady: quinn's limit less what the MTU is above the floor.
        assert_eq!(
            datagram_room_at_floor(1200, || (9000, Some(8950), 9000)),
            Room::Fits(8950 - 7800)
        );
        // Loopback: the MTU starts at its 16,000-byte floor and discovery raises it to
        // 65,000 in one step (measured: ~80 ms into a connection), here between the reads
        // (the old arithmetic, 15,950 less 49,000, left no room); then it holds.
        let mut reads = [
            (16_000, Some(15_950), 65_000),
            (65_000, Some(64_950), 65_000),
        ]
        .into_iter();
        let room = datagram_room_at_floor(16_000, || reads.next().expect("a third read"));
        assert_eq!(room, Room::Fits(15_950));
        assert_eq!(
            datagram_room_at_floor(1200, || (1500, None, 1500)),
            Room::NoDatagrams
        );
        let mut mtu = 1200u16;
        let room = datagram_room_at_floor(1200, || {
            mtu += 100;
            (mtu - 100, Some(usize::from(mtu) - 50), mtu)
        });
        assert_eq!(room, Room::Unsettled);
    }

    #[test]
    fn blocks_split_the_payload_evenly() {
        let cfg = BulkConfig::default();
        for (len, max_dg, want_k) in [
            (1usize << 20, 65_000usize, 69u16),
            (1 << 20, 1200, 114),
            (10 << 20, 65_000, 114),
            (100, 65_000, 1),
            (1, 1200, 1),
        ] {
            let (k, dg) = block_shape(len, max_dg, cfg).expect("shape");
            let sb = dg - HEADER_LEN;
            assert_eq!(k, want_k, "len {len}, datagrams {max_dg}");
            assert!(dg <= max_dg && sb <= cfg.max_shard, "len {len}: shard {sb}");
            assert_eq!(sb % 64, 0);
            let plan = TransferPlan::new(1, len as u64, k, dg).expect("plan");
            assert_eq!(plan.shard_bytes as usize, sb);
            // Every block but the last is full, and the last is at least half of one.
            let last = plan.n_blocks() - 1;
            let (_, _, k_last) = plan.block_span(last).expect("span");
            assert!(
                2 * k_last + 2 >= usize::from(k),
                "len {len}: last block {k_last} of {k}"
            );
        }
        assert!(block_shape(1000, HEADER_LEN + 1, cfg).is_err());
    }

    #[test]
    fn the_configs_fec_group_size_is_the_block_size() {
        use crate::config::{ConfigValue, TransportSettings};
        let v = ConfigValue::Int(8);
        let s = TransportSettings::parse([("fec_group_size", &v)]).expect("config");
        let mut cfg = super::super::QuicConfig::new(0, 1, "127.0.0.1:1".parse().expect("addr"));
        s.apply(&mut cfg);
        // 1 MiB over 1,200-byte datagrams: blocks of 8 data shards (114 by default).
        let (k, dg) = block_shape(1 << 20, 1200, cfg.bulk).expect("shape");
        assert_eq!(k, 8);
        let plan = TransferPlan::new(1, 1 << 20, k, dg).expect("plan");
        let blocks = plan.n_blocks() as usize;
        assert!(blocks * 8 * (dg - HEADER_LEN) >= 1 << 20, "{blocks} blocks");
        assert!(
            (blocks - 1) * 8 * (dg - HEADER_LEN) < 1 << 20,
            "{blocks} blocks"
        );
        assert_eq!(
            block_shape(1 << 20, 1200, BulkConfig::default())
                .expect("shape")
                .0,
            114
        );
    }

    #[test]
    fn lane_names() {
        for l in [LanePolicy::Auto, LanePolicy::Stream, LanePolicy::Fec] {
            assert_eq!(LanePolicy::parse(l.name()), Some(l));
        }
        assert_eq!(LanePolicy::parse(" FEC "), Some(LanePolicy::Fec));
        assert_eq!(LanePolicy::parse("udp"), None);
    }

    #[test]
    fn the_stash_and_the_memory_of_finished_transfers_are_bounded() {
        let mut rx = RxInner::default();
        let d = Bytes::from(vec![0u8; 1 << 20]);
        for tid in 0..40u64 {
            rx.stash(tid, d.clone());
        }
        assert!(rx.stash_bytes <= STASH_BYTES);
        assert_eq!(rx.stash_bytes, 32 << 20);
        // The oldest went first.
        assert!(rx.unstash(0).is_empty());
        assert_eq!(rx.unstash(39).len(), 1);
        assert_eq!(rx.stash_bytes, 31 << 20);
        for tid in 0..(STASH_TRANSFERS as u64 + 10) {
            rx.stash(1000 + tid, Bytes::from_static(b"x"));
        }
        assert!(rx.stash_order.len() <= STASH_TRANSFERS);
        assert_eq!(rx.stash.len(), rx.stash_order.len());
        for tid in 0..(DONE_MEMORY as u64 + 100) {
            rx.finish(tid, 0);
        }
        assert_eq!(rx.done.len(), DONE_MEMORY);
        assert!(!rx.done.contains(&0) && rx.done.contains(&(DONE_MEMORY as u64 + 99)));
        // A finished transfer's stashed shards are dropped with it.
        rx.stash(5_000_000, Bytes::from_static(b"late"));
        rx.finish(5_000_000, 0);
        assert!(!rx.stash.contains_key(&5_000_000));
    }
}
