//! Elastic membership in the simulator: the coordinator's [`Service`] on one simulated rank,
//! a [`MemberSession`] on every other, and every request and reply a frame over the
//! simulated network, so that the protocol's messages take their links' time, queue behind
//! each other, and stop with the rank that sends them.
//!
//! A member registers, reports for the first epoch, heartbeats when its session says so and
//! keeps a watch on its epoch at the coordinator (answered as soon as the epoch ends);
//! what happens in each epoch is the plan's: some members die (their process stops, and the
//! coordinator finds them by their silence), and the survivors report for the next epoch
//! when their collective fails, or, when they are not in one, when their session says the
//! epoch ended. In an epoch where nobody dies the job ends: every member leaves, and the
//! coordinator stops once all have.

use super::{simulate, SimConfig, SimReport, SimTransport};
use crate::error::{Error, Result};
use crate::membership::coordinator::{Coordinator, CoordinatorConfig};
use crate::membership::service::{Answer, Service, Ticket};
use crate::membership::session::{MemberSession, SessionEvent};
use crate::membership::wire::{Reply, Request};
use crate::membership::{Epoch, MemberId};
use crate::transport::{SeqSpace, Transport};
use crate::wire::{FrameKind, Header};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The id of the member on simulated rank `rank`.
pub fn member_id(rank: usize) -> MemberId {
    1000 + rank as MemberId
}

/// The training state every simulated member declares.
const SPEC: &str = "w:f32[8]";

/// How long a member's report may be held by the coordinator.
const REPORT_WAIT_MS: u32 = 2000;

/// What happens in one epoch.
#[derive(Debug, Clone, Default)]
pub struct EpochPlan {
    /// Members (by their rank in the simulation) that die in this epoch, and how long after
    /// the epoch formed (as they heard it).
    pub deaths: Vec<(usize, Duration)>,
    /// With deaths: how long after the epoch formed the survivors' collective fails, and
    /// they report; `None` when they are not in a collective then (computing, as between
    /// DiLoCo's outer steps): they report when their session says the epoch ended. Without
    /// deaths the epoch is the job's last: every member leaves.
    pub fails_after: Option<Duration>,
}

/// A simulated elastic job: members on ranks `0..world - 1`, the coordinator on the last.
#[derive(Debug, Clone)]
pub struct ElasticPlan {
    /// The coordinator's settings.
    pub coordinator: CoordinatorConfig,
    /// The members' heartbeat interval.
    pub heartbeat: Duration,
    /// The epochs, in order; the job ends with the first one without deaths.
    pub epochs: Vec<EpochPlan>,
    /// Longest virtual time the coordinator serves (a guard: the test fails if reached).
    pub limit: Duration,
}

/// What one member lived through.
#[derive(Debug, Clone, Default)]
pub struct MemberLife {
    /// The epochs the coordinator formed with it, in order.
    pub epochs: Vec<Epoch>,
    /// When it heard of each (virtual time).
    pub formed_at: Vec<Duration>,
    /// The epochs whose end its session announced, in order.
    pub ended: Vec<u64>,
    /// Whether it died as planned (else it left at the end).
    pub died: bool,
    /// What stopped it otherwise.
    pub error: Option<Error>,
}

/// What the coordinator saw.
#[derive(Debug, Clone, Default)]
pub struct CoordinatorLog {
    /// Every epoch it formed, with the virtual time it formed at.
    pub epochs: Vec<(Duration, Epoch)>,
    /// Requests answered.
    pub requests: u64,
    /// Members that left.
    pub left: usize,
    /// Whether it stopped at the plan's limit rather than after the last member left.
    pub hit_limit: bool,
}

/// The outcome of [`simulate_elastic`].
#[derive(Debug)]
pub struct ElasticRun {
    /// Each member's life, by rank.
    pub members: Vec<MemberLife>,
    /// The coordinator's side.
    pub coordinator: CoordinatorLog,
    /// What the network saw.
    pub report: SimReport,
}

/// A membership message's frame: point-to-point, numbered by the member's request count
/// (the reply carries its request's number back).
fn header(src: usize, seq: u64, payload: &[u8]) -> Header {
    Header::bytes(FrameKind::Send, src, seq, 0, payload)
}

fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Sleeps until `at` (if any) or until `arrival` (created before the mailbox was last
/// emptied, so that nothing filed since is missed) fires.
async fn wait(arrival: tokio::sync::futures::Notified<'_>, at: Option<Instant>) {
    match at {
        Some(at) => {
            tokio::select! {
                _ = arrival => {}
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(at)) => {}
            }
        }
        None => arrival.await,
    }
}

/// Runs `plan` on `cfg` (whose world is the members plus the coordinator, at `scale` 1) and
/// returns what every member and the coordinator saw.
pub fn simulate_elastic(cfg: &SimConfig, plan: &ElasticPlan) -> Result<ElasticRun> {
    if cfg.world < 2 {
        return Err(Error::InvalidArgument(
            "an elastic simulation needs a member and the coordinator".into(),
        ));
    }
    if cfg.scale != 1.0 {
        // The protocol's messages are point-to-point frames, which `scale` would inflate.
        return Err(Error::InvalidArgument(format!(
            "an elastic simulation sends real messages: scale must be 1, got {}",
            cfg.scale
        )));
    }
    let coordinator_rank = cfg.world - 1;
    let leavers = coordinator_rank - plan.epochs.iter().map(|e| e.deaths.len()).sum::<usize>();
    let (out, report) = simulate(cfg, |t| {
        let plan = plan.clone();
        async move {
            if t.rank() == coordinator_rank {
                Err(serve(&t, &plan, leavers).await)
            } else {
                Ok(member(&t, coordinator_rank, &plan).await)
            }
        }
    })?;
    let mut members = Vec::with_capacity(coordinator_rank);
    let mut coordinator = None;
    for r in out {
        match r {
            Ok(life) => members.push(life),
            Err(log) => coordinator = Some(log?),
        }
    }
    let coordinator = coordinator
        .ok_or_else(|| Error::Protocol("the simulated coordinator did not run".into()))?;
    Ok(ElasticRun {
        members,
        coordinator,
        report,
    })
}

/// The coordinator: answers every request as a frame until every surviving member left.
async fn serve(t: &SimTransport, plan: &ElasticPlan, leavers: usize) -> Result<CoordinatorLog> {
    let t0 = now();
    let limit = t0 + plan.limit;
    let mut svc = Service::new(Coordinator::new(plan.coordinator, 1));
    let mut log = CoordinatorLog::default();
    let mut arrival = t.mailbox().arrival();
    while log.left < leavers {
        let at = svc.poll_timeout().map_or(limit, |a| a.min(limit));
        wait(arrival, Some(at)).await;
        arrival = t.mailbox().arrival();
        let now = now();
        if now >= limit {
            log.hit_limit = true;
            break;
        }
        svc.handle_timeout(now);
        let mut replies = Vec::new();
        for (key, frame) in t.mailbox().take_arrived(SeqSpace::P2p, None) {
            let req = Request::decode(&frame?.payload.to_vec())?;
            let ticket = ((key.src as u64) << 32) | (key.seq & 0xffff_ffff);
            if matches!(req, Request::Leave { .. }) {
                log.left += 1;
            }
            match svc.on_request(now, ticket, req) {
                Answer::Reply(r) => replies.push((ticket, r)),
                Answer::Registered(_) => replies.push((
                    ticket,
                    Reply::Welcome {
                        token: [0; 16],
                        tether: false,
                    },
                )),
                Answer::Held => {}
            }
        }
        replies.extend(svc.poll_answers(now));
        for (ticket, reply) in replies {
            answer(t, ticket, &reply).await?;
            log.requests += 1;
        }
        if let Some(e) = svc.coordinator().current() {
            if log
                .epochs
                .last()
                .is_none_or(|(_, last)| last.number != e.number)
            {
                log.epochs.push((now - t0, e.clone()));
            }
        }
    }
    for (ticket, reply) in svc.release_all() {
        answer(t, ticket, &reply).await?;
    }
    Ok(log)
}

/// Sends `reply` to the request named `ticket` (its member's rank, its number).
async fn answer(t: &SimTransport, ticket: Ticket, reply: &Reply) -> Result<()> {
    let (dst, seq) = ((ticket >> 32) as usize, ticket & 0xffff_ffff);
    let bytes = reply.encode();
    t.send_frame(dst, &header(t.rank(), seq, &bytes), &bytes)
        .await
}

/// What a member's request in flight was.
#[derive(Debug, Clone, Copy)]
enum Asked {
    Register,
    Report,
    Heartbeat { sent: Instant },
    Watch,
    Leave,
}

/// A member: its session, driven over frames to the coordinator, through the plan's epochs.
async fn member(t: &SimTransport, coordinator: usize, plan: &ElasticPlan) -> MemberLife {
    let mut life = MemberLife::default();
    if let Err(e) = member_life(t, coordinator, plan, &mut life).await {
        life.error = Some(e);
    }
    life
}

/// A member's requests in flight, numbered.
struct Asking<'a> {
    t: &'a SimTransport,
    coordinator: usize,
    seq: u64,
    asked: HashMap<u64, Asked>,
}

impl Asking<'_> {
    async fn ask(&mut self, req: &Request, what: Asked) -> Result<()> {
        self.seq += 1;
        self.asked.insert(self.seq, what);
        let bytes = req.encode();
        let h = header(self.t.rank(), self.seq, &bytes);
        self.t.send_frame(self.coordinator, &h, &bytes).await
    }
}

/// The watch a member keeps on `epoch` while it runs there: answered as soon as the
/// coordinator ends it (as `membership/client.rs` keeps one).
fn watch(s: &MemberSession, epoch: u64) -> Request {
    Request::Watch {
        id: s.id(),
        epoch,
        wait_ms: REPORT_WAIT_MS,
    }
}

/// The report for the epoch after the last one `life` ran in.
fn report(s: &MemberSession, life: &MemberLife) -> Request {
    let seen = life.epochs.last().map_or(0, |e| e.number);
    s.report(seen, Duration::from_millis(u64::from(REPORT_WAIT_MS)))
}

async fn member_life(
    t: &SimTransport,
    coordinator: usize,
    plan: &ElasticPlan,
    life: &mut MemberLife,
) -> Result<()> {
    let t0 = now();
    let me = t.rank();
    let mut s = MemberSession::new(member_id(me), SPEC.into(), plan.heartbeat, t0)?;
    let mut q = Asking {
        t,
        coordinator,
        seq: 0,
        asked: HashMap::new(),
    };
    let mut arrival = t.mailbox().arrival();
    q.ask(&s.register(), Asked::Register).await?;
    let mut die_at: Option<Instant> = None;
    let mut report_at: Option<Instant> = None;
    // Whether this member reported the end of the epoch it runs in.
    let mut reported = true;
    loop {
        let heartbeat_late = q.asked.values().find_map(|a| match a {
            Asked::Heartbeat { sent } => Some(*sent + s.answer_limit()),
            _ => None,
        });
        let at = [s.poll_timeout(), die_at, report_at, heartbeat_late]
            .into_iter()
            .flatten()
            .min();
        wait(arrival, at).await;
        arrival = t.mailbox().arrival();
        let now = now();
        if die_at.is_some_and(|d| now >= d) {
            life.died = true;
            return Ok(());
        }
        let ended_before = life.ended.len();
        let late: Vec<u64> = q
            .asked
            .iter()
            .filter(
                |(_, a)| matches!(a, Asked::Heartbeat { sent } if now >= *sent + s.answer_limit()),
            )
            .map(|(k, _)| *k)
            .collect();
        for k in late {
            q.asked.remove(&k);
            let silence = Error::Timeout {
                what: "the coordinator's answer to a heartbeat".into(),
                after: s.answer_limit(),
            };
            note(life, s.on_heartbeat_answer(now, Err(silence)));
        }
        if let Some(hb) = s.poll_heartbeat(now) {
            q.ask(&hb, Asked::Heartbeat { sent: now }).await?;
        }
        for (key, frame) in t.mailbox().take_arrived(SeqSpace::P2p, None) {
            let reply = Reply::decode(&frame?.payload.to_vec())?;
            let Some(what) = q.asked.remove(&key.seq) else {
                continue; // the answer to a heartbeat already given up on
            };
            match (what, reply) {
                (Asked::Register, reply) => {
                    s.on_registered(&reply)?;
                    q.ask(&report(&s, life), Asked::Report).await?;
                }
                (Asked::Heartbeat { .. }, reply) => {
                    note(life, s.on_heartbeat_answer(now, Ok(reply)))
                }
                (Asked::Watch, Reply::Beat(b)) => {
                    note(life, s.on_beat(b));
                    // Still running in the watched epoch: keep a watch at the coordinator.
                    if let Some(epoch) = s.watched() {
                        q.ask(&watch(&s, epoch), Asked::Watch).await?;
                    }
                }
                (Asked::Watch, other) => {
                    return Err(Error::Protocol(format!(
                        "the coordinator answered a watch with {other:?}"
                    )))
                }
                (Asked::Leave, _) => return Ok(()),
                (Asked::Report, reply) => {
                    let Some(e) = s.on_report_answer(reply)? else {
                        q.ask(&report(&s, life), Asked::Report).await?;
                        continue;
                    };
                    let k = life.epochs.len();
                    s.set_step(k as i64);
                    life.formed_at.push(now - t0);
                    life.epochs.push(e.clone());
                    note(life, s.watch(e.number));
                    let Some(p) = plan.epochs.get(k) else {
                        return Err(Error::Protocol(format!(
                            "epoch {} formed beyond the plan's {} epochs",
                            e.number,
                            plan.epochs.len()
                        )));
                    };
                    if let Some((_, after)) = p.deaths.iter().find(|(r, _)| *r == me) {
                        die_at = Some(now + *after);
                    } else if p.deaths.is_empty() {
                        s.unwatch();
                        q.ask(&Request::Leave { id: s.id() }, Asked::Leave).await?;
                    } else {
                        reported = false;
                        report_at = p.fails_after.map(|after| now + after);
                        if s.watched() == Some(e.number) {
                            q.ask(&watch(&s, e.number), Asked::Watch).await?;
                        }
                    }
                }
            }
        }
        // The collective failed, or the session says the epoch is over: report once.
        let told = life.ended.len() > ended_before;
        if !reported && (told || report_at.is_some_and(|r| now >= r)) {
            reported = true;
            report_at = None;
            q.ask(&report(&s, life), Asked::Report).await?;
        }
    }
}

/// Records what the session said.
fn note(life: &mut MemberLife, events: impl IntoIterator<Item = SessionEvent>) {
    for e in events {
        if let SessionEvent::EpochEnded(n) = e {
            life.ended.push(n);
        }
    }
}
