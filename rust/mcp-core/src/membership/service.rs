//! The coordinator's side of the membership protocol, sans IO: [`Service`] takes each
//! member's [`Request`] and `now`, and answers it at once or holds it (a long poll: a report
//! waiting for the next epoch, a question for an epoch's rank 0 not yet published, a watch
//! on an epoch) until the [`Coordinator`] can answer or the wait is over. Held requests are
//! named by a ticket of the driver's choosing; their answers come out of
//! [`Service::poll_answers`]. [`Service::poll_timeout`] says when time next matters.
//!
//! The QUIC server ([`super::server`]) and the simulator drive the same code: one stream per
//! request there, one frame each way here.

use super::coordinator::{Coordinator, Master, Readiness};
use super::wire::{Reply, Request};
use super::MemberId;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::time::{Duration, Instant};

/// Longest a long poll is held, whatever the member asked for.
pub const MAX_WAIT: Duration = Duration::from_secs(5);

/// Names a held request; chosen by the driver, unique among those it has not been answered.
pub type Ticket = u64;

/// What to do with a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// Send this reply.
    Reply(Reply),
    /// The member is registered: answer with the driver's welcome (its tether token).
    Registered(MemberId),
    /// Held: the reply comes from [`Service::poll_answers`] under the request's ticket.
    Held,
}

/// What a held request waits for.
#[derive(Debug, Clone, Copy)]
enum Poll {
    /// The epoch after `seen`, with `id` in it; the member holds epoch `holds` (number,
    /// incarnation).
    Epoch {
        id: MemberId,
        seen: u64,
        holds: Option<(u64, u64)>,
    },
    /// Rank 0's address of `epoch`.
    Master { epoch: u64 },
    /// The end of `epoch`, which `id` runs in.
    End { id: MemberId, epoch: u64 },
}

/// The coordinator with its held requests. They are asked again only when the
/// coordinator's [`Coordinator::revision`] moved, and expire in deadline order, so that a
/// coordinator holding a watch and a report for each of thousands of members does not
/// search them all at every heartbeat.
pub struct Service {
    coordinator: Coordinator,
    /// By ticket (an order that does not depend on the process: the simulator replays).
    held: BTreeMap<Ticket, Poll>,
    /// When each held request's wait ends (entries of requests answered since are skipped).
    expiries: BinaryHeap<Reverse<(Instant, Ticket)>>,
    /// The coordinator's revision when the held requests were last asked again.
    asked_at: u64,
}

impl Service {
    /// Serves members with `coordinator`.
    pub fn new(coordinator: Coordinator) -> Service {
        Service {
            asked_at: coordinator.revision(),
            coordinator,
            held: BTreeMap::new(),
            expiries: BinaryHeap::new(),
        }
    }

    /// The state machine behind it.
    pub fn coordinator(&self) -> &Coordinator {
        &self.coordinator
    }

    /// The state machine, for inputs that are not requests (a tether closed).
    pub fn coordinator_mut(&mut self) -> &mut Coordinator {
        &mut self.coordinator
    }

    /// Requests held now.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Takes `req`, named `ticket` in case it is held.
    pub fn on_request(&mut self, now: Instant, ticket: Ticket, req: Request) -> Answer {
        let c = &mut self.coordinator;
        let (poll, wait_ms) = match req {
            Request::Register { id, spec, view } => {
                return match c.register(now, id, &spec, view) {
                    Ok(()) => Answer::Registered(id),
                    Err(e) => Answer::Reply(Reply::Refused(e.to_string())),
                }
            }
            Request::Heartbeat { id, step } => {
                return Answer::Reply(Reply::Beat(c.heartbeat(now, id, step)))
            }
            Request::Report {
                id,
                seen,
                step,
                wait_ms,
                holds,
            } => {
                c.report(now, id, seen, step);
                (Poll::Epoch { id, seen, holds }, wait_ms)
            }
            Request::PublishMaster { id, epoch, addr } => {
                let ok = c.publish_master(id, epoch, addr);
                return Answer::Reply(if ok { Reply::Ok } else { Reply::Superseded });
            }
            Request::Master { epoch, wait_ms } => (Poll::Master { epoch }, wait_ms),
            Request::Watch { id, epoch, wait_ms } => (Poll::End { id, epoch }, wait_ms),
            Request::Leave { id } => {
                c.leave(now, id);
                return Answer::Reply(Reply::Ok);
            }
        };
        if let Some(reply) = self.ready(poll) {
            return Answer::Reply(reply);
        }
        let wait = Duration::from_millis(u64::from(wait_ms)).min(MAX_WAIT);
        self.held.insert(ticket, poll);
        self.expiries.push(Reverse((now + wait, ticket)));
        Answer::Held
    }

    /// The answer to `poll` if it has one now.
    fn ready(&self, poll: Poll) -> Option<Reply> {
        let c = &self.coordinator;
        match poll {
            Poll::Epoch { id, seen, holds } => match c.readiness(id, seen) {
                Readiness::Formed(e) => Some(
                    match holds.and_then(|(number, inc)| c.change_from(number, inc)) {
                        Some(change) => Reply::Changed(change.clone()),
                        None => Reply::Formed(e.clone()),
                    },
                ),
                Readiness::Waiting => None,
                Readiness::Unknown => Some(Reply::Unknown),
            },
            Poll::Master { epoch } => match c.master(epoch) {
                Master::At(a) => Some(Reply::MasterAt(a)),
                Master::Superseded => Some(Reply::Superseded),
                Master::Pending => None,
            },
            Poll::End { id, epoch } => {
                let b = c.beat_of(id);
                b.ends(epoch).then_some(Reply::Beat(b))
            }
        }
    }

    /// What a held request is answered when its wait is over.
    fn expired(&self, poll: Poll) -> Reply {
        match poll {
            Poll::Epoch { .. } | Poll::Master { .. } => Reply::Waiting,
            Poll::End { id, .. } => Reply::Beat(self.coordinator.beat_of(id)),
        }
    }

    /// The held requests that can be answered at `now` (the coordinator changed, or their
    /// wait is over), with their answers; call after every input and timeout.
    pub fn poll_answers(&mut self, now: Instant) -> Vec<(Ticket, Reply)> {
        let mut out = Vec::new();
        if self.coordinator.revision() != self.asked_at {
            self.asked_at = self.coordinator.revision();
            let ready: Vec<(Ticket, Reply)> = self
                .held
                .iter()
                .filter_map(|(&t, &poll)| self.ready(poll).map(|r| (t, r)))
                .collect();
            for (t, r) in ready {
                self.held.remove(&t);
                out.push((t, r));
            }
        }
        while let Some(&Reverse((until, ticket))) = self.expiries.peek() {
            if until > now {
                break;
            }
            self.expiries.pop();
            if let Some(poll) = self.held.remove(&ticket) {
                out.push((ticket, self.expired(poll)));
            }
        }
        out
    }

    /// Every held request answered as if its wait were over (the driver is closing).
    pub fn release_all(&mut self) -> Vec<(Ticket, Reply)> {
        let held = std::mem::take(&mut self.held);
        self.expiries.clear();
        held.into_iter()
            .map(|(t, poll)| (t, self.expired(poll)))
            .collect()
    }

    /// Forgets a held request whose member went away (its connection closed).
    pub fn forget(&mut self, ticket: Ticket) {
        self.held.remove(&ticket);
    }

    /// When [`Service::handle_timeout`] and [`Service::poll_answers`] are next needed.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let held = self.expiries.peek().map(|Reverse((until, _))| *until);
        match (self.coordinator.poll_timeout(), held) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Time has passed: the coordinator's timers (deaths, epochs forming).
    pub fn handle_timeout(&mut self, now: Instant) {
        self.coordinator.handle_timeout(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::coordinator::CoordinatorConfig;
    use crate::membership::Epoch;

    fn cfg() -> CoordinatorConfig {
        CoordinatorConfig {
            min_members: 2,
            dead_after: Duration::from_millis(300),
            join_window: Duration::from_millis(200),
            change_limit: Duration::from_secs(60),
            rebuild_window: Duration::from_millis(100),
        }
    }

    fn register(s: &mut Service, now: Instant, id: MemberId) {
        let req = Request::Register {
            id,
            spec: "w:f32[4]".into(),
            view: None,
        };
        assert_eq!(s.on_request(now, 0, req), Answer::Registered(id));
    }

    fn report(id: MemberId, seen: u64, wait_ms: u32) -> Request {
        Request::Report {
            id,
            seen,
            step: -1,
            wait_ms,
            holds: None,
        }
    }

    /// Two members: the first report is held until the epoch forms on the coordinator's
    /// timer, then both get the same epoch; a watch on it is held until a member dies.
    #[test]
    fn reports_are_held_until_the_epoch_forms_and_watches_until_it_ends() {
        let t0 = Instant::now();
        let mut s = Service::new(Coordinator::new(cfg(), 7));
        register(&mut s, t0, 1);
        assert_eq!(s.on_request(t0, 10, report(1, 0, 5000)), Answer::Held);
        let t = t0 + Duration::from_millis(10);
        register(&mut s, t, 2);
        assert_eq!(s.on_request(t, 11, report(2, 0, 5000)), Answer::Held);
        assert!(s.poll_answers(t).is_empty(), "the join window is open");
        let due = s.poll_timeout().expect("a timer");
        assert!(due <= t0 + Duration::from_secs(1));
        let mut now = t;
        let mut answers = Vec::new();
        while answers.len() < 2 && now < t0 + Duration::from_secs(2) {
            now += Duration::from_millis(50);
            for id in [1, 2] {
                let hb = Request::Heartbeat { id, step: -1 };
                assert!(matches!(
                    s.on_request(now, 0, hb),
                    Answer::Reply(Reply::Beat(_))
                ));
            }
            s.handle_timeout(now);
            answers.extend(s.poll_answers(now));
        }
        answers.sort_by_key(|a| a.0);
        let epochs: Vec<Epoch> = answers
            .into_iter()
            .map(|(_, r)| match r {
                Reply::Formed(e) => e,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(epochs.len(), 2);
        assert_eq!(epochs[0], epochs[1]);
        let e = epochs[0].number;
        assert_eq!(s.held(), 0);
        let watch = Request::Watch {
            id: 1,
            epoch: e,
            wait_ms: 5000,
        };
        assert_eq!(s.on_request(now, 12, watch), Answer::Held);
        // Member 2 falls silent; member 1 keeps beating: its watch ends when 2 is dead.
        let died_by = now + Duration::from_millis(400);
        let mut ended = None;
        while ended.is_none() && now < died_by + Duration::from_millis(200) {
            now += Duration::from_millis(50);
            let hb = Request::Heartbeat { id: 1, step: 0 };
            s.on_request(now, 0, hb);
            s.handle_timeout(now);
            ended = s.poll_answers(now).pop();
        }
        match ended {
            Some((12, Reply::Beat(b))) => assert!(b.ends(e), "{b:?}"),
            other => panic!("{other:?}"),
        }
        assert!(
            now <= died_by + Duration::from_millis(100),
            "{:?}",
            now - t0
        );
        // The next epoch: member 1, which holds the first, is told the change from it;
        // newcomer 3, which holds none, the whole epoch; both are the same epoch.
        let holds = Request::Report {
            id: 1,
            seen: e,
            step: 0,
            wait_ms: 5000,
            holds: Some((e, 7)),
        };
        assert_eq!(
            s.on_request(now, 13, holds),
            Answer::Held,
            "too few members"
        );
        register(&mut s, now, 3);
        let mut answers = Vec::new();
        match s.on_request(now, 14, report(3, 0, 5000)) {
            Answer::Reply(r) => answers.push((14, r)),
            other => assert_eq!(other, Answer::Held),
        }
        let until = now + Duration::from_secs(2);
        while answers.len() < 2 && now < until {
            now += Duration::from_millis(50);
            for id in [1, 3] {
                s.on_request(now, 0, Request::Heartbeat { id, step: 0 });
            }
            s.handle_timeout(now);
            answers.extend(s.poll_answers(now));
        }
        answers.sort_by_key(|a| a.0);
        let [(13, Reply::Changed(change)), (14, Reply::Formed(next))] = &answers[..] else {
            panic!("{answers:?}");
        };
        assert_eq!(
            (change.left.as_slice(), change.came.as_slice()),
            (&[1][..], &[3][..])
        );
        assert_eq!(&change.apply(&epochs[0]).expect("applies"), next);
        assert_eq!(s.coordinator().change_from(e, 7), Some(change));
        assert_eq!(s.coordinator().change_from(e, 8), None);
        assert_eq!(s.coordinator().change_from(next.number, 7), None);
    }

    /// A long poll that nothing answers ends after its wait (at most MAX_WAIT) with the
    /// "ask again" answer; closing answers the rest alike; a forgotten one is never answered.
    #[test]
    fn held_requests_end_after_their_wait_on_close_or_when_forgotten() {
        let t0 = Instant::now();
        let mut s = Service::new(Coordinator::new(cfg(), 7));
        let master = |epoch, wait_ms| Request::Master { epoch, wait_ms };
        assert_eq!(s.on_request(t0, 1, master(3, 200)), Answer::Held);
        assert_eq!(s.on_request(t0, 2, master(3, 60_000)), Answer::Held);
        assert_eq!(s.on_request(t0, 3, master(3, 60_000)), Answer::Held);
        assert_eq!(s.poll_timeout(), Some(t0 + Duration::from_millis(200)));
        assert!(s.poll_answers(t0 + Duration::from_millis(199)).is_empty());
        assert_eq!(
            s.poll_answers(t0 + Duration::from_millis(200)),
            vec![(1, Reply::Waiting)]
        );
        s.forget(3);
        // Capped at MAX_WAIT whatever was asked.
        assert_eq!(s.poll_timeout(), Some(t0 + MAX_WAIT));
        assert_eq!(s.release_all(), vec![(2, Reply::Waiting)]);
        assert_eq!(s.held(), 0);
        // A bad spec is refused at once.
        register(&mut s, t0, 1);
        let other = Request::Register {
            id: 2,
            spec: "w:f32[5]".into(),
            view: None,
        };
        assert!(matches!(
            s.on_request(t0, 0, other),
            Answer::Reply(Reply::Refused(_))
        ));
    }
}
