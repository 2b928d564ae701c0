//! A member's session with the coordinator, sans IO: what it registers with, when its next
//! heartbeat is due, when the connection must be made anew, and what the coordinator's
//! answers mean for the epoch the member runs in.
//!
//! [`MemberSession`] takes the answers and `now` and returns requests and [`SessionEvent`]s;
//! its next deadline comes from [`MemberSession::poll_timeout`]. [`super::client`] drives it
//! over QUIC; the simulator's membership tests drive it on the virtual clock, beside the
//! coordinator's own state machine.

use super::coordinator::Beat;
use super::wire::{Reply, Request};
use super::{Epoch, MemberId, Step, NO_STATE};
use crate::error::{Error, Result};
use std::time::{Duration, Instant};

/// Heartbeats in a row without an answer after which the connection is made anew: a
/// coordinator that restarted does not know the old connection (and cannot reset it), and a
/// new one registers this member again.
pub const SILENT_BEATS: u32 = 3;

/// What the driver must act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionEvent {
    /// The watched epoch is over: abort what runs in it (its group will not complete another
    /// collective).
    EpochEnded(u64),
    /// [`SILENT_BEATS`] heartbeats went unanswered: close the connection and open a new one
    /// (which starts with [`MemberSession::register`]).
    Reconnect,
}

/// A member's side of the membership protocol.
#[derive(Debug)]
pub struct MemberSession {
    id: MemberId,
    spec: String,
    interval: Duration,
    step: Step,
    /// The epoch this member runs in (sent with every registration, from which a restarted
    /// coordinator rebuilds its state).
    view: Option<Epoch>,
    /// The coordinator's last word.
    beat: Option<Beat>,
    /// The epoch whose end the driver waits to hear of.
    watched: Option<u64>,
    /// When the next heartbeat is due; `None` while one awaits its answer.
    next_beat: Option<Instant>,
    /// When the heartbeat in flight was sent.
    sent_at: Option<Instant>,
    silent: u32,
    answered: u64,
}

impl MemberSession {
    /// The session of member `id` whose training state is `spec`, heartbeating every
    /// `interval` from `now`.
    pub fn new(id: MemberId, spec: String, interval: Duration, now: Instant) -> Result<Self> {
        if interval.is_zero() {
            return Err(Error::InvalidArgument("heartbeat must be positive".into()));
        }
        Ok(MemberSession {
            id,
            spec,
            interval,
            step: NO_STATE,
            view: None,
            beat: None,
            watched: None,
            next_beat: Some(now),
            sent_at: None,
            silent: 0,
            answered: 0,
        })
    }

    /// This member's id.
    pub fn id(&self) -> MemberId {
        self.id
    }

    /// The heartbeat interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The first request on every new connection.
    pub fn register(&self) -> Request {
        Request::Register {
            id: self.id,
            spec: self.spec.clone(),
            view: self.view.clone(),
        }
    }

    /// What the coordinator answered the registration: a refusal (another job's training
    /// state) is `SpecMismatch`, anything but a welcome a protocol error.
    pub fn on_registered(&self, reply: &Reply) -> Result<()> {
        match reply {
            Reply::Welcome { .. } => Ok(()),
            Reply::Refused(why) => Err(Error::SpecMismatch(why.clone())),
            other => Err(Error::Protocol(format!(
                "the coordinator answered register with {other:?}"
            ))),
        }
    }

    /// Records the steps committed (sent with every heartbeat).
    pub fn set_step(&mut self, step: Step) {
        self.step = step;
    }

    /// The steps committed.
    pub fn step(&self) -> Step {
        self.step
    }

    /// The heartbeat due at `now`, if one is. The driver sends it and hands the outcome to
    /// [`MemberSession::on_heartbeat_answer`], giving up on the answer after
    /// [`MemberSession::answer_limit`].
    pub fn poll_heartbeat(&mut self, now: Instant) -> Option<Request> {
        match self.next_beat {
            Some(t) if t <= now => {
                self.next_beat = None;
                self.sent_at = Some(now);
                Some(Request::Heartbeat {
                    id: self.id,
                    step: self.step,
                })
            }
            _ => None,
        }
    }

    /// How long a heartbeat's answer may take before it counts as silence: two intervals.
    pub fn answer_limit(&self) -> Duration {
        self.interval * 2
    }

    /// The answer to the heartbeat in flight (an error: none came). The next heartbeat is
    /// due one interval after this one was sent.
    pub fn on_heartbeat_answer(
        &mut self,
        now: Instant,
        answer: Result<Reply>,
    ) -> Vec<SessionEvent> {
        let sent = self.sent_at.take().unwrap_or(now);
        self.next_beat = Some((sent + self.interval).max(now));
        let mut events = Vec::new();
        match answer {
            Ok(Reply::Beat(b)) => {
                self.silent = 0;
                self.answered += 1;
                events.extend(self.on_beat(b));
            }
            Ok(_) => self.silent = 0,
            Err(_) => {
                self.silent += 1;
                if self.silent >= SILENT_BEATS {
                    self.silent = 0;
                    events.push(SessionEvent::Reconnect);
                }
            }
        }
        events
    }

    /// The coordinator's word on the epochs (a heartbeat's answer, or a watch's).
    pub fn on_beat(&mut self, b: Beat) -> Option<SessionEvent> {
        self.beat = Some(b);
        match self.watched {
            Some(w) if b.ends(w) => {
                self.watched = None;
                Some(SessionEvent::EpochEnded(w))
            }
            _ => None,
        }
    }

    /// The last word from the coordinator.
    pub fn beat(&self) -> Option<Beat> {
        self.beat
    }

    /// Heartbeats answered.
    pub fn answered(&self) -> u64 {
        self.answered
    }

    /// Watches `epoch`: its end comes as [`SessionEvent::EpochEnded`]. Returns the event at
    /// once when the coordinator already said so.
    pub fn watch(&mut self, epoch: u64) -> Option<SessionEvent> {
        if self.beat.is_some_and(|b| b.ends(epoch)) {
            self.watched = None;
            return Some(SessionEvent::EpochEnded(epoch));
        }
        self.watched = Some(epoch);
        None
    }

    /// The epoch watched, if any.
    pub fn watched(&self) -> Option<u64> {
        self.watched
    }

    /// Stops watching.
    pub fn unwatch(&mut self) {
        self.watched = None;
    }

    /// The report of a member that waits for an epoch newer than `seen` (with the steps
    /// it committed), which the coordinator may hold for up to `wait`. It names the epoch
    /// the member holds, so that the answer may be the change from it.
    pub fn report(&self, seen: u64, wait: Duration) -> Request {
        Request::Report {
            id: self.id,
            seen,
            step: self.step,
            wait_ms: wait.as_millis().min(u128::from(u32::MAX)) as u32,
            holds: self.view.as_ref().map(|e| (e.number, e.incarnation)),
        }
    }

    /// What the coordinator answered a report: the epoch it formed with this member in it
    /// (the member runs there now), or `None` to report again (the epoch is still forming,
    /// or a coordinator that lost the report takes it anew). A refusal (another job's
    /// training state) is `SpecMismatch`, anything else a protocol error.
    pub fn on_report_answer(&mut self, reply: Reply) -> Result<Option<Epoch>> {
        match reply {
            Reply::Formed(e) => {
                self.on_formed(e.clone());
                Ok(Some(e))
            }
            Reply::Changed(change) => {
                let Some(base) = &self.view else {
                    return Err(Error::Protocol(format!(
                        "the coordinator sent epoch {} as a change, and this member holds none",
                        change.number
                    )));
                };
                let e = change.apply(base)?;
                self.on_formed(e.clone());
                Ok(Some(e))
            }
            Reply::Waiting | Reply::Unknown => Ok(None),
            Reply::Refused(why) => Err(Error::SpecMismatch(why)),
            other => Err(Error::Protocol(format!(
                "the coordinator answered a report with {other:?}"
            ))),
        }
    }

    /// The coordinator formed `epoch` with this member in it: it runs there now.
    pub fn on_formed(&mut self, epoch: Epoch) {
        self.view = Some(epoch);
    }

    /// Forgets the epoch this member ran in (it was expelled: it rejoins as new).
    pub fn forget_view(&mut self) {
        self.view = None;
    }

    /// When the next heartbeat is due (`None` while one awaits its answer).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_beat
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::change::EpochChange;
    use crate::membership::Member;

    const BEAT: Duration = Duration::from_millis(100);

    fn beat(latest: u64, ending: bool, member: bool) -> Beat {
        Beat {
            latest,
            ending,
            change_at: None,
            member,
        }
    }

    #[test]
    fn heartbeats_come_every_interval_with_the_step_and_wait_for_their_answer() {
        let t0 = Instant::now();
        let mut s = MemberSession::new(7, "w:f32[8]".into(), BEAT, t0).expect("session");
        assert_eq!(s.poll_timeout(), Some(t0));
        s.set_step(41);
        assert_eq!(
            s.poll_heartbeat(t0),
            Some(Request::Heartbeat { id: 7, step: 41 })
        );
        // One at a time: nothing more is due while it is in flight.
        assert_eq!(s.poll_timeout(), None);
        assert_eq!(s.poll_heartbeat(t0 + BEAT * 5), None);
        let ev = s.on_heartbeat_answer(t0 + BEAT / 4, Ok(Reply::Beat(beat(1, false, true))));
        assert!(ev.is_empty());
        assert_eq!(s.answered(), 1);
        assert_eq!(
            s.poll_timeout(),
            Some(t0 + BEAT),
            "an interval after it was sent"
        );
        assert_eq!(s.poll_heartbeat(t0 + BEAT - Duration::from_millis(1)), None);
        assert!(s.poll_heartbeat(t0 + BEAT).is_some());
        // An answer later than the interval: the next is due at once.
        let late = t0 + BEAT * 4;
        s.on_heartbeat_answer(late, Err(Error::Closed("x".into())));
        assert_eq!(s.poll_timeout(), Some(late));
        assert_eq!(s.answer_limit(), BEAT * 2);
        assert!(MemberSession::new(7, String::new(), Duration::ZERO, t0).is_err());
    }

    #[test]
    fn three_silent_heartbeats_in_a_row_make_the_connection_anew() {
        let t0 = Instant::now();
        let mut s = MemberSession::new(7, "s".into(), BEAT, t0).expect("session");
        let mut t = t0;
        let beat_once = |s: &mut MemberSession, t: &mut Instant, answer: Result<Reply>| {
            assert!(s.poll_heartbeat(*t).is_some());
            *t += BEAT;
            s.on_heartbeat_answer(*t, answer)
        };
        let lost = || Err(Error::Closed("no answer".into()));
        assert!(beat_once(&mut s, &mut t, lost()).is_empty());
        assert!(beat_once(&mut s, &mut t, lost()).is_empty());
        // An answer in between starts the count again.
        assert!(beat_once(&mut s, &mut t, Ok(Reply::Beat(beat(0, false, false)))).is_empty());
        assert!(beat_once(&mut s, &mut t, lost()).is_empty());
        assert!(beat_once(&mut s, &mut t, lost()).is_empty());
        assert_eq!(
            beat_once(&mut s, &mut t, lost()),
            vec![SessionEvent::Reconnect]
        );
        assert!(beat_once(&mut s, &mut t, lost()).is_empty(), "counted anew");
    }

    #[test]
    fn the_watched_epoch_ends_once_when_the_coordinator_says_so() {
        let t0 = Instant::now();
        let mut s = MemberSession::new(7, "s".into(), BEAT, t0).expect("session");
        assert_eq!(s.watch(3), None);
        assert_eq!(s.on_beat(beat(3, false, true)), None);
        assert_eq!(
            s.on_beat(beat(3, true, true)),
            Some(SessionEvent::EpochEnded(3))
        );
        assert_eq!(s.watched(), None);
        assert_eq!(s.on_beat(beat(4, false, true)), None, "told once");
        // Already over when watched: at once.
        assert_eq!(s.watch(3), Some(SessionEvent::EpochEnded(3)));
        // Expelled from the current epoch.
        assert_eq!(s.watch(4), None);
        assert!(s.poll_heartbeat(t0).is_some());
        assert_eq!(
            s.on_heartbeat_answer(t0, Ok(Reply::Beat(beat(4, false, false)))),
            vec![SessionEvent::EpochEnded(4)]
        );
        s.watch(5);
        s.unwatch();
        assert_eq!(s.on_beat(beat(6, false, true)), None);
    }

    #[test]
    fn registration_carries_the_view_and_a_refusal_is_a_spec_mismatch() {
        let t0 = Instant::now();
        let mut s = MemberSession::new(7, "w:f32[8]".into(), BEAT, t0).expect("session");
        let e = Epoch {
            number: 2,
            incarnation: 9,
            members: vec![Member { id: 7, step: 10 }],
        };
        assert_eq!(
            s.register(),
            Request::Register {
                id: 7,
                spec: "w:f32[8]".into(),
                view: None
            }
        );
        s.on_formed(e.clone());
        assert!(matches!(s.register(), Request::Register { view: Some(v), .. } if v == e));
        s.forget_view();
        assert!(matches!(s.register(), Request::Register { view: None, .. }));
        assert!(s
            .on_registered(&Reply::Welcome {
                token: [0; 16],
                tether: false
            })
            .is_ok());
        assert!(matches!(
            s.on_registered(&Reply::Refused("other spec".into())),
            Err(Error::SpecMismatch(m)) if m == "other spec"
        ));
        assert!(matches!(
            s.on_registered(&Reply::Ok),
            Err(Error::Protocol(_))
        ));
    }

    #[test]
    fn a_report_is_asked_again_until_the_epoch_forms_and_then_the_member_runs_there() {
        let t0 = Instant::now();
        let mut s = MemberSession::new(7, "s".into(), BEAT, t0).expect("session");
        s.set_step(12);
        let req = s.report(3, Duration::from_millis(1500));
        let want = Request::Report {
            id: 7,
            seen: 3,
            step: 12,
            wait_ms: 1500,
            holds: None,
        };
        assert_eq!(req, want);
        let next = Epoch {
            number: 5,
            incarnation: 9,
            members: vec![Member { id: 7, step: 12 }, Member { id: 8, step: -1 }],
        };
        let change = EpochChange {
            base: 4,
            number: 5,
            incarnation: 9,
            left: vec![],
            came: vec![8],
            steps: vec![(12, 1), (-1, 1)],
        };
        assert!(
            matches!(
                s.on_report_answer(Reply::Changed(change.clone())),
                Err(Error::Protocol(_))
            ),
            "a change and no epoch to apply it to"
        );
        assert!(matches!(s.on_report_answer(Reply::Waiting), Ok(None)));
        assert!(matches!(s.on_report_answer(Reply::Unknown), Ok(None)));
        let e = Epoch {
            number: 4,
            incarnation: 9,
            members: vec![Member { id: 7, step: 12 }],
        };
        assert_eq!(
            s.on_report_answer(Reply::Formed(e.clone())).ok(),
            Some(Some(e.clone()))
        );
        assert!(matches!(s.register(), Request::Register { view: Some(v), .. } if v == e));
        // Now it holds epoch 4: the next may come as the change from it.
        assert!(matches!(
            s.report(4, Duration::from_millis(1500)),
            Request::Report {
                holds: Some((4, 9)),
                ..
            }
        ));
        assert_eq!(
            s.on_report_answer(Reply::Changed(change.clone())).ok(),
            Some(Some(next.clone()))
        );
        assert_eq!(s.view.as_ref(), Some(&next));
        // A change from an epoch it does not hold is a protocol error.
        assert!(matches!(
            s.on_report_answer(Reply::Changed(change)),
            Err(Error::Protocol(_))
        ));
        assert!(matches!(
            s.on_report_answer(Reply::Refused("other spec".into())),
            Err(Error::SpecMismatch(_))
        ));
        assert!(matches!(
            s.on_report_answer(Reply::MasterAt("a:1".into())),
            Err(Error::Protocol(_))
        ));
    }
}
