//! Where received frames wait for the operation that wants them.
//!
//! Frames arrive on many streams in any order; each is filed under its [`MsgKey`] until an
//! operation asks for that key. Failures are filed too: a lost peer fails every wait on it,
//! an aborted operation fails every wait on its sequence number, so nothing waits forever.

use crate::error::{Error, Result};
use crate::wire::{FrameKind, Header};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;
use tokio::sync::oneshot;

/// A received message: its header and payload (CRC already verified).
#[derive(Debug)]
pub struct Frame {
    /// The decoded header.
    pub header: Header,
    /// The payload bytes.
    pub payload: super::Payload,
}

/// Which sequence space a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SeqSpace {
    /// Rendezvous and connection management.
    Control,
    /// Collectives: sequence numbers are per group, in call order.
    Collective,
    /// Point-to-point: sequence numbers are per (sender, receiver) pair.
    P2p,
}

impl SeqSpace {
    /// The sequence space of a frame kind.
    pub fn of(kind: FrameKind) -> SeqSpace {
        match kind {
            FrameKind::Hello | FrameKind::Table | FrameKind::Goodbye | FrameKind::Progress => {
                SeqSpace::Control
            }
            FrameKind::Send => SeqSpace::P2p,
            _ => SeqSpace::Collective,
        }
    }

    fn code(self) -> u8 {
        match self {
            SeqSpace::Control => 0,
            SeqSpace::Collective => 1,
            SeqSpace::P2p => 2,
        }
    }

    fn from_code(c: u8) -> Option<SeqSpace> {
        [SeqSpace::Control, SeqSpace::Collective, SeqSpace::P2p]
            .into_iter()
            .find(|l| l.code() == c)
    }
}

/// Identifies one message of one operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MsgKey {
    /// The sending rank.
    pub src: usize,
    /// The sequence space.
    pub space: SeqSpace,
    /// The operation's sequence number.
    pub seq: u64,
    /// The algorithm step.
    pub step: u32,
    /// The chunk within the step.
    pub chunk: u32,
}

impl MsgKey {
    /// The key a received header is filed under.
    pub fn of(h: &Header) -> MsgKey {
        MsgKey {
            src: h.src as usize,
            space: SeqSpace::of(h.kind),
            seq: h.seq,
            step: h.step,
            chunk: h.chunk,
        }
    }
}

enum Slot {
    Ready(Result<Frame>),
    Waiting(oneshot::Sender<Result<Frame>>),
}

#[derive(Default)]
struct Inner {
    slots: HashMap<MsgKey, Slot>,
    lost_peers: HashMap<usize, Error>,
    /// The lost peers that said goodbye (closed their group) rather than died or fell silent.
    left: HashSet<usize>,
    aborted: HashMap<(SeqSpace, u64), Error>,
    aborted_order: VecDeque<(SeqSpace, u64)>,
    remote_aborts: VecDeque<(SeqSpace, u64, Error)>,
    /// Set when a member was lost: no collective can complete without it.
    revoked: Option<Error>,
    closed: Option<Error>,
    /// Keys of the frames filed lately, oldest first: a copy of one of them (sent again
    /// because its acknowledgement was lost with a broken connection) is dropped.
    filed: HashSet<MsgKey>,
    filed_order: VecDeque<MsgKey>,
    duplicates: u64,
}

/// How many aborted operations are remembered (so late frames of them are dropped).
const ABORT_MEMORY: usize = 4096;

/// How many filed frames are remembered to drop copies of them: more than the frames in
/// flight to one process when a connection breaks (QUIC's windows over the chunk size).
const FILED_MEMORY: usize = 8192;

/// Received frames, filed by key, and the failures that end waits.
#[derive(Default)]
pub struct Mailbox {
    inner: Mutex<Inner>,
    aborts: tokio::sync::Notify,
    arrivals: tokio::sync::Notify,
}

impl Mailbox {
    /// An empty mailbox.
    pub fn new() -> Mailbox {
        Mailbox::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data (every update is one insert
        // or remove), so recover from poisoning rather than propagate it.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Files a received frame (or a receive error for its key) and wakes its waiter. Returns
    /// false for a copy of a frame filed before, which is dropped.
    pub fn deliver(&self, key: MsgKey, item: Result<Frame>) -> bool {
        let mut inner = self.lock();
        if inner.aborted.contains_key(&(key.space, key.seq)) {
            return true;
        }
        if item.is_ok() {
            if !inner.filed.insert(key) {
                inner.duplicates += 1;
                return false;
            }
            inner.filed_order.push_back(key);
            if inner.filed_order.len() > FILED_MEMORY {
                if let Some(old) = inner.filed_order.pop_front() {
                    inner.filed.remove(&old);
                }
            }
        }
        match inner.slots.remove(&key) {
            Some(Slot::Waiting(tx)) => {
                if let Err(Ok(frame)) = tx.send(item) {
                    // The waiter gave up (timeout); keep nothing.
                    drop(frame);
                }
            }
            Some(Slot::Ready(old)) => {
                // A duplicate key: keep the first, the sender is confused.
                inner.slots.insert(key, Slot::Ready(old));
            }
            None => {
                inner.slots.insert(key, Slot::Ready(item));
                drop(inner);
                self.arrivals.notify_waiters();
            }
        }
        true
    }

    /// Copies of frames already filed that were dropped (resent across a reconnection).
    pub fn duplicates(&self) -> u64 {
        self.lock().duplicates
    }

    /// The first of `keys` whose frame has arrived (not yet taken).
    pub fn first_arrived(&self, keys: &[MsgKey]) -> Option<MsgKey> {
        let inner = self.lock();
        keys.iter()
            .find(|k| matches!(inner.slots.get(k), Some(Slot::Ready(_))))
            .copied()
    }

    /// Takes every frame of `space` (and sequence `seq`, if given) that has arrived, from any
    /// source, and that nobody waits for, in order of source and sequence. Costs the frames
    /// filed and not yet taken, not the sources that might send (rank 0 of a large job
    /// gathers Hellos in O(W)).
    pub fn take_arrived(&self, space: SeqSpace, seq: Option<u64>) -> Vec<(MsgKey, Result<Frame>)> {
        let mut inner = self.lock();
        let mut keys: Vec<MsgKey> = inner
            .slots
            .iter()
            .filter(|(k, slot)| {
                k.space == space && seq.is_none_or(|s| k.seq == s) && matches!(slot, Slot::Ready(_))
            })
            .map(|(k, _)| *k)
            .collect();
        keys.sort_unstable_by_key(|k| (k.src, k.seq, k.step, k.chunk));
        keys.into_iter()
            .filter_map(|k| match inner.slots.remove(&k) {
                Some(Slot::Ready(item)) => Some((k, item)),
                _ => None,
            })
            .collect()
    }

    /// Resolves when a frame arrives that nobody was waiting for (for a receive from any
    /// source). Create the future before checking [`Mailbox::first_arrived`], then await it.
    pub fn arrival(&self) -> tokio::sync::futures::Notified<'_> {
        self.arrivals.notified()
    }

    /// Files a verified frame: an abort fails its operation, a goodbye fails waits on its
    /// sender, anything else goes to its key. Returns false for a copy of a frame filed
    /// before, which is dropped.
    pub fn dispatch(&self, frame: Frame) -> bool {
        let src = frame.header.src as usize;
        match frame.header.kind {
            FrameKind::Abort => {
                let (space, err) = decode_abort(src, &frame.payload.to_vec());
                if self.abort(space, frame.header.seq, err.clone()) {
                    let mut inner = self.lock();
                    inner
                        .remote_aborts
                        .push_back((space, frame.header.seq, err));
                    while inner.remote_aborts.len() > ABORT_MEMORY {
                        inner.remote_aborts.pop_front();
                    }
                }
            }
            FrameKind::Goodbye => self.said_goodbye(src),
            _ => return self.deliver(MsgKey::of(&frame.header), Ok(frame)),
        }
        true
    }

    /// Waits for the frame filed under `key`.
    pub async fn recv(&self, key: MsgKey) -> Result<Frame> {
        let rx = {
            let mut inner = self.lock();
            if let Some(e) = &inner.closed {
                return Err(e.clone());
            }
            if let Some(e) = inner.aborted.get(&(key.space, key.seq)) {
                return Err(e.clone());
            }
            match inner.slots.remove(&key) {
                Some(Slot::Ready(item)) => return item,
                Some(Slot::Waiting(_)) | None => {}
            }
            if let Some(e) = inner.lost_peers.get(&key.src) {
                return Err(e.clone());
            }
            if key.space == SeqSpace::Collective {
                if let Some(e) = &inner.revoked {
                    return Err(e.clone());
                }
            }
            let (tx, rx) = oneshot::channel();
            inner.slots.insert(key, Slot::Waiting(tx));
            rx
        };
        match rx.await {
            Ok(item) => item,
            Err(_) => Err(Error::Closed("the mailbox was dropped".into())),
        }
    }

    /// A member was lost (killed, silent, stalled, untrustworthy): fails every current and
    /// future wait on it with `err`, and every current and future wait of a collective, which
    /// cannot complete without it (as MPI's revoke does), so that every survivor learns of
    /// the loss from its own detector, whoever it is waiting for. Point-to-point with the
    /// others goes on.
    pub fn fail_peer(&self, peer: usize, err: Error) {
        self.fail(peer, err, true);
    }

    /// A member closed its group after delivering everything: fails every current and future
    /// wait on it with `err`; collectives among the others may still finish what they need.
    pub fn peer_left(&self, peer: usize, err: Error) {
        self.fail(peer, err, false);
    }

    /// `peer` said goodbye: [`Mailbox::peer_left`] with the error that says so.
    pub fn said_goodbye(&self, peer: usize) {
        self.peer_left(
            peer,
            Error::PeerLost {
                rank: peer,
                op: "any operation".into(),
                reason: "it closed its group".into(),
            },
        );
    }

    fn fail(&self, peer: usize, err: Error, revoke: bool) {
        let mut guard = self.lock();
        let inner = &mut *guard;
        if let Entry::Vacant(e) = inner.lost_peers.entry(peer) {
            e.insert(err.clone());
            if !revoke {
                inner.left.insert(peer);
            }
        }
        if revoke && inner.revoked.is_none() {
            inner.revoked = Some(err.clone());
        }
        // Frames that already arrived stay: the operation may still consume them.
        let keys: Vec<MsgKey> = inner
            .slots
            .iter()
            .filter(|(k, s)| {
                (k.src == peer || (revoke && k.space == SeqSpace::Collective))
                    && matches!(s, Slot::Waiting(_))
            })
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            if let Some(Slot::Waiting(tx)) = inner.slots.remove(&k) {
                let _ = tx.send(Err(err.clone()));
            }
        }
    }

    /// The error a lost peer was failed with, if it was.
    pub fn peer_error(&self, peer: usize) -> Option<Error> {
        self.lock().lost_peers.get(&peer).cloned()
    }

    /// The error `peer` was failed with if it is gone (lost or left), for sends and dials to
    /// give up on it. A stalled peer is not gone: it is alive, connected, and still hears of
    /// the aborts it caused.
    pub fn gone_error(&self, peer: usize) -> Option<Error> {
        self.peer_error(peer)
            .filter(|e| !matches!(e, Error::PeerStalled { .. }))
    }

    /// Fails every current and future wait of operation `seq` in `space` with `err`, and drops
    /// what was filed for it. Returns false if it was already aborted.
    pub fn abort(&self, space: SeqSpace, seq: u64, err: Error) -> bool {
        let mut inner = self.lock();
        if inner.aborted.contains_key(&(space, seq)) {
            return false;
        }
        inner.aborted.insert((space, seq), err.clone());
        inner.aborted_order.push_back((space, seq));
        while inner.aborted_order.len() > ABORT_MEMORY {
            if let Some(old) = inner.aborted_order.pop_front() {
                inner.aborted.remove(&old);
            }
        }
        let keys: Vec<MsgKey> = inner
            .slots
            .keys()
            .filter(|k| k.space == space && k.seq == seq)
            .copied()
            .collect();
        for k in keys {
            if let Some(Slot::Waiting(tx)) = inner.slots.remove(&k) {
                let _ = tx.send(Err(err.clone()));
            }
        }
        drop(inner);
        self.aborts.notify_waiters();
        true
    }

    /// Resolves with the error once operation `seq` in `space` is aborted (by us or a peer),
    /// so that a send blocked on a slow or absent peer stops too.
    pub async fn aborted(&self, space: SeqSpace, seq: u64) -> Error {
        loop {
            let notified = self.aborts.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let inner = self.lock();
                if let Some(e) = inner.aborted.get(&(space, seq)).or(inner.closed.as_ref()) {
                    return e.clone();
                }
            }
            notified.await;
        }
    }

    /// Takes the abort a peer sent for operation `seq`, if any (an operation that succeeded
    /// here, such as a broadcast root's, may still have failed elsewhere).
    pub fn take_remote_abort(&self, space: SeqSpace, seq: u64) -> Option<Error> {
        let mut inner = self.lock();
        let at = inner
            .remote_aborts
            .iter()
            .position(|(l, s, _)| *l == space && *s == seq)?;
        inner.remote_aborts.remove(at).map(|(_, _, e)| e)
    }

    /// Takes the oldest abort a peer sent for an operation numbered below `seq`.
    pub fn take_earlier_remote_abort(&self, space: SeqSpace, seq: u64) -> Option<(u64, Error)> {
        let mut inner = self.lock();
        let at = inner
            .remote_aborts
            .iter()
            .position(|(l, s, _)| *l == space && *s < seq)?;
        inner.remote_aborts.remove(at).map(|(_, s, e)| (s, e))
    }

    /// The header of any frame filed for operation `seq` in `space` (to explain a timeout:
    /// a peer that sent something else under this number ran another operation).
    pub fn peek_header(&self, space: SeqSpace, seq: u64) -> Option<Header> {
        let inner = self.lock();
        inner.slots.iter().find_map(|(k, s)| match s {
            Slot::Ready(Ok(f)) if k.space == space && k.seq == seq => Some(f.header.clone()),
            _ => None,
        })
    }

    /// True when `peer` closed its group (said goodbye) before anything else failed it: it
    /// left on purpose, and a failure that names it may be an echo of what made it leave.
    pub fn has_left(&self, peer: usize) -> bool {
        self.lock().left.contains(&peer)
    }

    /// Drops whatever is still filed for operation `seq` (after it finished or failed).
    pub fn purge(&self, space: SeqSpace, seq: u64) {
        let mut inner = self.lock();
        inner
            .slots
            .retain(|k, _| !(k.space == space && k.seq == seq));
    }

    /// Fails every wait, now and later, with `err`.
    pub fn close(&self, err: Error) {
        let mut inner = self.lock();
        inner.closed.get_or_insert(err.clone());
        for (_, slot) in inner.slots.drain() {
            if let Slot::Waiting(tx) = slot {
                let _ = tx.send(Err(err.clone()));
            }
        }
        drop(inner);
        // Sends blocked on a peer stop too.
        self.aborts.notify_waiters();
        self.arrivals.notify_waiters();
    }

    /// Number of filed frames and waiters (for tests and leak checks).
    pub fn pending(&self) -> usize {
        self.lock().slots.len()
    }
}

/// Encodes why an operation failed, for an [`FrameKind::Abort`] frame.
pub fn encode_abort(space: SeqSpace, err: &Error) -> Vec<u8> {
    let (code, rank, text) = match err {
        Error::SpecMismatch(m) => (1u8, u32::MAX, m.clone()),
        Error::PeerLost { rank, op, reason } => (2, *rank as u32, format!("{op}\u{1f}{reason}")),
        Error::Timeout { what, after } => (
            3,
            (after.as_millis().min(u32::MAX as u128)) as u32,
            what.clone(),
        ),
        Error::InvalidArgument(m) => (4, u32::MAX, m.clone()),
        Error::Protocol(m) => (5, u32::MAX, m.clone()),
        Error::PeerStalled { rank, op, reason } => (7, *rank as u32, format!("{op}\u{1f}{reason}")),
        other => (6, u32::MAX, other.to_string()),
    };
    let mut out = vec![space.code(), code];
    out.extend_from_slice(&rank.to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    out
}

/// Decodes an abort payload from rank `src`; never panics.
pub fn decode_abort(src: usize, payload: &[u8]) -> (SeqSpace, Error) {
    if payload.len() < 6 {
        return (
            SeqSpace::Collective,
            Error::Protocol(format!("rank {src} aborted with an unreadable reason")),
        );
    }
    let space = SeqSpace::from_code(payload[0]).unwrap_or(SeqSpace::Collective);
    let rank = u32::from_le_bytes([payload[2], payload[3], payload[4], payload[5]]);
    let text = String::from_utf8_lossy(&payload[6..]).into_owned();
    let err = match payload[1] {
        1 => Error::SpecMismatch(text),
        2 => {
            let (op, reason) = text.split_once('\u{1f}').unwrap_or(("", &text));
            Error::PeerLost {
                rank: rank as usize,
                op: op.to_string(),
                reason: format!("{reason} (reported by rank {src})"),
            }
        }
        3 => Error::Timeout {
            what: format!("rank {src} timed out: {text}"),
            after: std::time::Duration::from_millis(rank as u64),
        },
        4 => Error::InvalidArgument(format!("rank {src}: {text}")),
        5 => Error::Protocol(format!("rank {src}: {text}")),
        7 => {
            let (op, reason) = text.split_once('\u{1f}').unwrap_or(("", &text));
            Error::PeerStalled {
                rank: rank as usize,
                op: op.to_string(),
                reason: format!("{reason} (reported by rank {src})"),
            }
        }
        _ => Error::Io(format!("rank {src} failed: {text}")),
    };
    (space, err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::{DType, ReduceOp};
    use crate::wire::ModelSpec;

    fn frame(src: u32, seq: u64, chunk: u32) -> (MsgKey, Frame) {
        let header = Header {
            kind: FrameKind::AllReduce,
            minor: 0,
            seq,
            step: 0,
            chunk,
            chunk_count: 2,
            src,
            aux: 0,
            spec: ModelSpec::flat(DType::F32, ReduceOp::Sum, 1),
            payload_len: 0,
            payload_crc: 0,
        };
        (
            MsgKey::of(&header),
            Frame {
                header,
                payload: vec![].into(),
            },
        )
    }

    #[tokio::test]
    async fn out_of_order_delivery_is_matched_by_key() {
        let mb = Mailbox::new();
        let (k1, f1) = frame(1, 5, 1);
        let (k0, f0) = frame(1, 5, 0);
        mb.deliver(k1, Ok(f1));
        let waiter = mb.recv(k0);
        mb.deliver(k0, Ok(f0));
        assert_eq!(waiter.await.expect("chunk 0").header.chunk, 0);
        assert_eq!(mb.recv(k1).await.expect("chunk 1").header.chunk, 1);
        assert_eq!(mb.pending(), 0);
    }

    #[tokio::test]
    async fn take_arrived_takes_every_ready_frame_of_one_sequence_and_nothing_else() {
        let mb = std::sync::Arc::new(Mailbox::new());
        for (src, seq, chunk) in [(3, 5, 0), (1, 5, 1), (1, 5, 0), (2, 6, 0)] {
            let (k, f) = frame(src, seq, chunk);
            mb.deliver(k, Ok(f));
        }
        // Someone waits for (4, 5, 0): a waiting slot is not a frame to take.
        let (k4, f4) = frame(4, 5, 0);
        let mb2 = mb.clone();
        let waiter = tokio::spawn(async move { mb2.recv(k4).await });
        tokio::task::yield_now().await;
        assert_eq!(mb.pending(), 5);
        let got: Vec<(u32, u32)> = mb
            .take_arrived(SeqSpace::Collective, Some(5))
            .into_iter()
            .map(|(k, f)| {
                let f = f.expect("a frame");
                assert_eq!(MsgKey::of(&f.header), k);
                (f.header.src, f.header.chunk)
            })
            .collect();
        assert_eq!(got, vec![(1, 0), (1, 1), (3, 0)]);
        assert!(mb.take_arrived(SeqSpace::Collective, Some(5)).is_empty());
        assert!(mb.take_arrived(SeqSpace::P2p, None).is_empty());
        mb.deliver(k4, Ok(f4));
        let got = waiter.await.expect("join").expect("the waiter's frame");
        assert_eq!(got.header.src, 4);
        assert_eq!(mb.take_arrived(SeqSpace::Collective, None).len(), 1);
        assert_eq!(mb.pending(), 0);
    }

    #[tokio::test]
    async fn lost_peer_fails_waits() {
        let mb = std::sync::Arc::new(Mailbox::new());
        let (k, _) = frame(3, 1, 0);
        let mb2 = mb.clone();
        let w = tokio::spawn(async move { mb2.recv(k).await });
        tokio::task::yield_now().await;
        let err = Error::PeerLost {
            rank: 3,
            op: "x".into(),
            reason: "gone".into(),
        };
        mb.fail_peer(3, err.clone());
        assert_eq!(w.await.expect("join").err(), Some(err.clone()));
        assert_eq!(mb.recv(k).await.err(), Some(err));
    }

    #[tokio::test]
    async fn a_lost_member_fails_every_collective_wait_whoever_it_is_on() {
        let mb = std::sync::Arc::new(Mailbox::new());
        // This rank waits for rank 0 in a collective; rank 2 is the one lost.
        let (on_0, _) = frame(0, 7, 0);
        let mb2 = mb.clone();
        let w = tokio::spawn(async move { mb2.recv(on_0).await });
        tokio::task::yield_now().await;
        let lost = Error::PeerLost {
            rank: 2,
            op: "x".into(),
            reason: "silent".into(),
        };
        mb.fail_peer(2, lost.clone());
        assert_eq!(w.await.expect("join").err(), Some(lost.clone()));
        // And every later collective, which could not complete without it.
        let (later, _) = frame(0, 8, 0);
        assert_eq!(mb.recv(later).await.err(), Some(lost));
        // Point-to-point with the others goes on.
        let p2p = MsgKey {
            space: SeqSpace::P2p,
            ..later
        };
        let (_, mut f) = frame(0, 8, 0);
        f.header.kind = FrameKind::Send;
        mb.deliver(p2p, Ok(f));
        assert!(mb.recv(p2p).await.is_ok());
    }

    #[tokio::test]
    async fn a_member_that_left_fails_only_the_waits_on_it() {
        let mb = std::sync::Arc::new(Mailbox::new());
        let (on_0, f0) = frame(0, 7, 0);
        let mb2 = mb.clone();
        let w = tokio::spawn(async move { mb2.recv(on_0).await });
        tokio::task::yield_now().await;
        mb.peer_left(
            2,
            Error::PeerLost {
                rank: 2,
                op: "x".into(),
                reason: "it closed its group".into(),
            },
        );
        // The collective may still get what it needs from rank 0.
        mb.deliver(on_0, Ok(f0));
        assert!(w.await.expect("join").is_ok());
        let (on_2, _) = frame(2, 7, 1);
        assert!(matches!(mb.recv(on_2).await, Err(Error::PeerLost { .. })));
    }

    #[tokio::test]
    async fn frames_that_arrived_before_a_peer_left_are_still_delivered() {
        let mb = Mailbox::new();
        let (k, f) = frame(2, 4, 0);
        mb.deliver(k, Ok(f));
        mb.fail_peer(
            2,
            Error::PeerLost {
                rank: 2,
                op: "x".into(),
                reason: "closed".into(),
            },
        );
        assert!(
            mb.recv(k).await.is_ok(),
            "a frame received before the goodbye was dropped"
        );
        let (k1, _) = frame(2, 4, 1);
        assert!(matches!(mb.recv(k1).await, Err(Error::PeerLost { .. })));
    }

    #[tokio::test]
    async fn abort_fails_the_operation_and_drops_late_frames() {
        let mb = Mailbox::new();
        let (k, f) = frame(1, 9, 0);
        assert!(mb.abort(SeqSpace::Collective, 9, Error::SpecMismatch("m".into())));
        assert!(!mb.abort(SeqSpace::Collective, 9, Error::SpecMismatch("m".into())));
        mb.deliver(k, Ok(f));
        assert_eq!(mb.pending(), 0);
        assert!(matches!(mb.recv(k).await, Err(Error::SpecMismatch(_))));
    }

    #[test]
    fn abort_reasons_round_trip() {
        let errs = [
            Error::SpecMismatch("shapes differ".into()),
            Error::PeerLost {
                rank: 2,
                op: "all_reduce".into(),
                reason: "killed".into(),
            },
            Error::InvalidArgument("bad".into()),
        ];
        for e in errs {
            let (space, back) = decode_abort(1, &encode_abort(SeqSpace::P2p, &e));
            assert_eq!(space, SeqSpace::P2p);
            assert_eq!(std::mem::discriminant(&back), std::mem::discriminant(&e));
        }
        let _ = decode_abort(0, &[1, 2, 3]);
        let _ = decode_abort(0, &[9, 9, 0, 0, 0, 0, 0xff, 0xfe]);
    }
}
