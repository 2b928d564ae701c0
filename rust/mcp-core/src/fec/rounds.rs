//! The repair rounds of one FEC transfer, as two state machines without I/O.
//!
//! After the first pass of shards, the two sides talk over the transfer's reliable stream:
//! the sender writes `END`; a receiver that rebuilt everything answers `DONE`, one still
//! short of some blocks answers a short grace after `END` (shards sent just before it may
//! still be on their way) with the [`Nack`]s of those blocks; the sender sends the shards they
//! name and writes `END` again, for a bounded number of rounds.
//!
//! [`RepairSender`] and [`RepairRequester`] hold the decisions and the timers of that
//! exchange; they take messages and `now`, return what to do, and give their next deadline
//! from `poll_timeout`, as [`crate::health::PeerMonitor`] does. The QUIC transport's bulk lane
//! drives them with its stream and datagrams; [`Control`] is the messages' wire format.

use super::transfer::Nack;
use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// Largest body of a control message (a NACK list).
pub const MAX_CONTROL_BODY: usize = 4 << 20;
/// Bytes before a control message's body: its kind (u8) and the body's length (u32 LE).
pub const CONTROL_HEAD: usize = 5;

const KIND_END: u8 = 1;
const KIND_NACKS: u8 = 2;
const KIND_DONE: u8 = 3;

/// A message of the repair rounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Control {
    /// Sender: round `round`'s shards have left; answer `Done` or with NACKs.
    End {
        /// The round, from 0 (after the first pass).
        round: u32,
    },
    /// Receiver: the shards these blocks still need.
    Nacks(Vec<Nack>),
    /// Receiver: the payload is rebuilt.
    Done,
}

impl Control {
    /// The message as bytes: [`CONTROL_HEAD`] then the body. A NACK list is cut where it
    /// would pass [`MAX_CONTROL_BODY`]; the blocks left out are asked for in a later round.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let (kind, body) = match self {
            Control::End { round } => (KIND_END, round.to_le_bytes().to_vec()),
            Control::Nacks(nacks) => {
                let mut body = Vec::new();
                for n in nacks {
                    let before = body.len();
                    n.encode_into(&mut body)?;
                    if body.len() > MAX_CONTROL_BODY {
                        body.truncate(before);
                        break;
                    }
                }
                (KIND_NACKS, body)
            }
            Control::Done => (KIND_DONE, Vec::new()),
        };
        let mut m = Vec::with_capacity(CONTROL_HEAD + body.len());
        m.push(kind);
        m.extend_from_slice(&(body.len() as u32).to_le_bytes());
        m.extend_from_slice(&body);
        Ok(m)
    }

    /// The kind and body length in a message's first [`CONTROL_HEAD`] bytes; a body longer
    /// than [`MAX_CONTROL_BODY`] is an error (the peer is not speaking this protocol).
    pub fn read_head(head: [u8; CONTROL_HEAD]) -> Result<(u8, usize)> {
        let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
        if len > MAX_CONTROL_BODY {
            return Err(Error::Protocol(format!(
                "FEC lane: a control message of {len} bytes (at most {MAX_CONTROL_BODY})"
            )));
        }
        Ok((head[0], len))
    }

    /// The message of `kind` with `body`.
    pub fn decode(kind: u8, body: &[u8]) -> Result<Control> {
        match kind {
            KIND_END => {
                let b: [u8; 4] = body.try_into().map_err(|_| {
                    Error::Protocol(format!("FEC lane: END of {} bytes", body.len()))
                })?;
                Ok(Control::End {
                    round: u32::from_le_bytes(b),
                })
            }
            KIND_NACKS => {
                let mut nacks = Vec::new();
                let mut at = 0;
                while at < body.len() {
                    let (n, used) = Nack::decode(&body[at..])?;
                    nacks.push(n);
                    at += used;
                }
                Ok(Control::Nacks(nacks))
            }
            KIND_DONE if body.is_empty() => Ok(Control::Done),
            _ => Err(Error::Protocol(format!(
                "FEC lane: control message of kind {kind} with {} bytes",
                body.len()
            ))),
        }
    }
}

/// How a transfer's repair rounds ended, on the sender's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundsEnd {
    /// The receiver rebuilt the payload.
    Done,
    /// The receiver spoke out of turn (the stream's driver also ends here when the stream or
    /// the connection breaks).
    Broken,
    /// The repairs cannot finish the transfer: the round limit, or no answer within the idle
    /// timeout. The frame goes on a stream instead.
    Unfinished,
}

/// What the sender does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SenderStep {
    /// Write `END` of this round once the shards sent so far have left, then wait for the
    /// answer (until [`RepairSender::poll_timeout`]).
    SendEnd(u32),
    /// Send the shards these NACKs name, then call [`RepairSender::repairs_sent`].
    Repair(Vec<Nack>),
    /// The rounds are over.
    Finished(RoundsEnd),
}

/// The sender's side of the repair rounds.
#[derive(Debug)]
pub struct RepairSender {
    max_rounds: u32,
    idle: Duration,
    /// The next round's number: rounds whose `END` was written so far.
    round: u32,
    /// Since when an answer to the last `END` is awaited.
    waiting_since: Option<Instant>,
    ended: Option<RoundsEnd>,
}

impl RepairSender {
    /// Rounds for a transfer whose first pass has just been sent: at most `max_rounds` ENDs,
    /// each answered within `idle`.
    pub fn new(max_rounds: u32, idle: Duration) -> RepairSender {
        RepairSender {
            max_rounds,
            idle,
            round: 0,
            waiting_since: None,
            ended: None,
        }
    }

    /// The first step: `END` of round 0 (or the end, when no round is allowed).
    pub fn start(&mut self, now: Instant) -> SenderStep {
        self.next_round(now)
    }

    /// The shards of the last [`SenderStep::Repair`] have been sent.
    pub fn repairs_sent(&mut self, now: Instant) -> SenderStep {
        self.next_round(now)
    }

    fn next_round(&mut self, now: Instant) -> SenderStep {
        if let Some(e) = self.ended {
            return SenderStep::Finished(e);
        }
        if self.round >= self.max_rounds {
            return self.finish(RoundsEnd::Unfinished);
        }
        let r = self.round;
        self.round += 1;
        self.waiting_since = Some(now);
        SenderStep::SendEnd(r)
    }

    fn finish(&mut self, how: RoundsEnd) -> SenderStep {
        self.waiting_since = None;
        self.ended = Some(how);
        SenderStep::Finished(how)
    }

    /// A message from the receiver.
    pub fn on_message(&mut self, msg: Control) -> SenderStep {
        if let Some(e) = self.ended {
            return SenderStep::Finished(e);
        }
        if self.waiting_since.take().is_none() {
            return self.finish(RoundsEnd::Broken); // an answer nobody asked for
        }
        match msg {
            Control::Done => self.finish(RoundsEnd::Done),
            Control::Nacks(n) => SenderStep::Repair(n),
            Control::End { .. } => self.finish(RoundsEnd::Broken),
        }
    }

    /// When the wait for an answer ends, if one is awaited.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.waiting_since.map(|t| t + self.idle)
    }

    /// Time has passed: past [`RepairSender::poll_timeout`] the rounds end unfinished.
    pub fn handle_timeout(&mut self, now: Instant) -> Option<SenderStep> {
        match self.poll_timeout() {
            Some(t) if now >= t => Some(self.finish(RoundsEnd::Unfinished)),
            _ => None,
        }
    }

    /// `END`s written so far.
    pub fn rounds(&self) -> u32 {
        self.round
    }
}

/// What the receiver does when its timer fires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequesterStep {
    /// Send the NACKs of the blocks still short (the payload is not complete).
    SendNacks,
    /// Nothing arrived for the idle timeout: the transfer has stalled.
    Stalled(Duration),
}

/// The receiver's side of the repair rounds.
#[derive(Debug)]
pub struct RepairRequester {
    idle: Duration,
    last_progress: Instant,
    nack_at: Option<Instant>,
}

impl RepairRequester {
    /// A transfer announced at `now`, given up after `idle` without progress.
    pub fn new(now: Instant, idle: Duration) -> RepairRequester {
        RepairRequester {
            idle,
            last_progress: now,
            nack_at: None,
        }
    }

    /// A shard was filed.
    pub fn on_progress(&mut self, now: Instant) {
        self.last_progress = now;
    }

    /// The sender's `END` came; `rtt` is the path's smoothed round trip. The NACKs go after a
    /// grace of half a round trip (at least 1 ms) plus 1 ms, for the shards still in flight.
    pub fn on_end(&mut self, now: Instant, rtt: Duration) {
        let grace = (rtt / 2).max(Duration::from_millis(1)) + Duration::from_millis(1);
        self.nack_at = Some(now + grace);
        self.last_progress = now;
    }

    /// The next deadline: the NACKs after an `END`, else the stall limit.
    pub fn poll_timeout(&self) -> Instant {
        self.nack_at.unwrap_or(self.last_progress + self.idle)
    }

    /// Time has passed; the caller checks first whether the payload is complete.
    pub fn handle_timeout(&mut self, now: Instant) -> Option<RequesterStep> {
        if let Some(t) = self.nack_at {
            if now >= t {
                self.nack_at = None;
                return Some(RequesterStep::SendNacks);
            }
            return None;
        }
        (now >= self.last_progress + self.idle).then_some(RequesterStep::Stalled(self.idle))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDLE: Duration = Duration::from_secs(10);

    fn nack(block: u32) -> Nack {
        Nack {
            block,
            missing: vec![1, 3],
            more_parity: 0,
        }
    }

    #[test]
    fn messages_round_trip_and_bad_ones_are_errors() {
        for m in [
            Control::End { round: 7 },
            Control::Done,
            Control::Nacks(vec![nack(0), nack(9)]),
            Control::Nacks(vec![]),
        ] {
            let b = m.encode().expect("encodes");
            let (kind, len) = Control::read_head(b[..CONTROL_HEAD].try_into().expect("head"))
                .expect("head reads");
            assert_eq!(len, b.len() - CONTROL_HEAD);
            assert_eq!(
                Control::decode(kind, &b[CONTROL_HEAD..]).expect("decodes"),
                m
            );
        }
        assert!(Control::decode(KIND_END, &[1, 2]).is_err());
        assert!(Control::decode(KIND_DONE, &[0]).is_err());
        assert!(Control::decode(KIND_NACKS, &[1, 2, 3]).is_err());
        assert!(Control::decode(99, &[]).is_err());
        let huge = (MAX_CONTROL_BODY as u32 + 1).to_le_bytes();
        assert!(Control::read_head([KIND_NACKS, huge[0], huge[1], huge[2], huge[3]]).is_err());
    }

    #[test]
    fn a_nack_list_is_cut_at_the_body_limit() {
        let big = Nack {
            block: 0,
            missing: vec![0; 60_000],
            more_parity: 0,
        };
        let m = Control::Nacks(vec![big; 100]).encode().expect("encodes");
        assert!(m.len() - CONTROL_HEAD <= MAX_CONTROL_BODY);
        let (kind, _) =
            Control::read_head(m[..CONTROL_HEAD].try_into().expect("head")).expect("head reads");
        let Control::Nacks(back) = Control::decode(kind, &m[CONTROL_HEAD..]).expect("decodes")
        else {
            panic!("not NACKs")
        };
        assert!(!back.is_empty() && back.len() < 100, "{}", back.len());
    }

    #[test]
    fn the_sender_repairs_until_done() {
        let t0 = Instant::now();
        let mut s = RepairSender::new(4, IDLE);
        assert_eq!(s.start(t0), SenderStep::SendEnd(0));
        assert_eq!(s.poll_timeout(), Some(t0 + IDLE));
        assert_eq!(
            s.on_message(Control::Nacks(vec![nack(2)])),
            SenderStep::Repair(vec![nack(2)])
        );
        assert_eq!(
            s.poll_timeout(),
            None,
            "no answer is awaited while repairing"
        );
        let t1 = t0 + Duration::from_millis(5);
        assert_eq!(s.repairs_sent(t1), SenderStep::SendEnd(1));
        assert_eq!(s.handle_timeout(t1 + IDLE / 2), None);
        assert_eq!(
            s.on_message(Control::Done),
            SenderStep::Finished(RoundsEnd::Done)
        );
        assert_eq!(s.rounds(), 2);
        assert_eq!(s.poll_timeout(), None);
        // Once over, it stays over.
        assert_eq!(s.repairs_sent(t1), SenderStep::Finished(RoundsEnd::Done));
    }

    #[test]
    fn the_sender_stops_at_the_round_limit_and_at_the_idle_timeout() {
        let t0 = Instant::now();
        let mut s = RepairSender::new(2, IDLE);
        assert_eq!(s.start(t0), SenderStep::SendEnd(0));
        assert!(matches!(
            s.on_message(Control::Nacks(vec![])),
            SenderStep::Repair(_)
        ));
        assert_eq!(s.repairs_sent(t0), SenderStep::SendEnd(1));
        assert!(matches!(
            s.on_message(Control::Nacks(vec![])),
            SenderStep::Repair(_)
        ));
        assert_eq!(
            s.repairs_sent(t0),
            SenderStep::Finished(RoundsEnd::Unfinished)
        );

        let mut s = RepairSender::new(8, IDLE);
        assert_eq!(s.start(t0), SenderStep::SendEnd(0));
        assert_eq!(s.handle_timeout(t0 + IDLE - Duration::from_millis(1)), None);
        assert_eq!(
            s.handle_timeout(t0 + IDLE),
            Some(SenderStep::Finished(RoundsEnd::Unfinished))
        );

        assert_eq!(
            RepairSender::new(0, IDLE).start(t0),
            SenderStep::Finished(RoundsEnd::Unfinished)
        );
    }

    #[test]
    fn the_sender_calls_an_answer_out_of_turn_broken() {
        let t0 = Instant::now();
        let mut s = RepairSender::new(4, IDLE);
        assert_eq!(s.start(t0), SenderStep::SendEnd(0));
        assert_eq!(
            s.on_message(Control::End { round: 0 }),
            SenderStep::Finished(RoundsEnd::Broken)
        );
        let mut s = RepairSender::new(4, IDLE);
        assert_eq!(s.start(t0), SenderStep::SendEnd(0));
        assert!(matches!(
            s.on_message(Control::Nacks(vec![])),
            SenderStep::Repair(_)
        ));
        // A second answer before the next END.
        assert_eq!(
            s.on_message(Control::Done),
            SenderStep::Finished(RoundsEnd::Broken)
        );
    }

    #[test]
    fn the_receiver_nacks_a_grace_after_end_and_stalls_without_progress() {
        let t0 = Instant::now();
        let mut r = RepairRequester::new(t0, IDLE);
        assert_eq!(r.poll_timeout(), t0 + IDLE);
        assert_eq!(r.handle_timeout(t0 + Duration::from_secs(1)), None);
        let t1 = t0 + Duration::from_secs(2);
        r.on_progress(t1);
        assert_eq!(
            r.handle_timeout(t0 + IDLE),
            None,
            "progress moved the stall limit"
        );
        let rtt = Duration::from_millis(40);
        r.on_end(t1, rtt);
        let at = t1 + Duration::from_millis(21);
        assert_eq!(r.poll_timeout(), at);
        assert_eq!(r.handle_timeout(at - Duration::from_micros(1)), None);
        assert_eq!(r.handle_timeout(at), Some(RequesterStep::SendNacks));
        // One NACK list per END: then it waits for the next END, or stalls.
        assert_eq!(r.poll_timeout(), t1 + IDLE);
        assert_eq!(r.handle_timeout(at), None);
        assert_eq!(
            r.handle_timeout(t1 + IDLE),
            Some(RequesterStep::Stalled(IDLE))
        );
        // On a fast path the grace is still at least 2 ms.
        r.on_end(t1, Duration::from_micros(30));
        assert_eq!(r.poll_timeout(), t1 + Duration::from_millis(2));
    }
}
