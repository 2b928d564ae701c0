//! The coordinator's state machine, sans IO: [`Coordinator`] takes the members' messages and
//! `now`, and answers with what each member should know; [`Coordinator::poll_timeout`] says
//! when it next needs [`Coordinator::handle_timeout`]. The QUIC driver is in
//! [`super::server`]; the tests drive it with a simulated clock.
//!
//! An epoch changes when a member of it dies (silent for `dead_after`, or its process exited
//! and the kernel closed its tether; see [`Coordinator::died`]) or reports that the
//! epoch broke under it (a collective failed: a peer left or died), and when newcomers
//! wait: then every
//! member is told, in its next heartbeat answer, to finish its step (`change_at`) and report.
//! The new epoch forms once every live member of the old one has reported (or after
//! `change_limit`, without those that did not), with at least `min_members`.

use super::change::EpochChange;
use super::{Epoch, Member, MemberId, Step, NO_STATE};
use crate::error::{Error, Result};
use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

/// Epochs before the current one that the coordinator keeps to tell members of a new one
/// as a change ([`super::change`]): a member is at most a few epochs behind, or it was
/// expelled and holds none.
pub const RECENT_EPOCHS: usize = 4;

/// The coordinator's settings.
#[derive(Debug, Clone, Copy)]
pub struct CoordinatorConfig {
    /// No epoch forms with fewer members (training waits for more).
    pub min_members: usize,
    /// A member silent this long is dead: three heartbeats (they come every 0.1 s), chosen by
    /// `benches/bench_heartbeat.py` (no false expulsion under load at 0.1 s; 0.26-0.31 s from
    /// a freeze to the survivors' next step).
    pub dead_after: Duration,
    /// Before the first epoch: how long after the last arrival to wait for more.
    pub join_window: Duration,
    /// A live member of the old epoch that has not reported this long after the change
    /// began is left out of the new one (it is stuck; it rejoins as a newcomer later).
    pub change_limit: Duration,
    /// After the coordinator starts, how long it waits before it forms a first epoch of
    /// its own: members of a job that is already running (under a coordinator that
    /// restarted) tell it their epoch within this time, and it carries that on rather than
    /// starting a second group beside it.
    pub rebuild_window: Duration,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            min_members: 1,
            dead_after: Duration::from_millis(300),
            join_window: Duration::from_millis(200),
            change_limit: Duration::from_secs(60),
            rebuild_window: Duration::from_secs(2),
        }
    }
}

/// What a heartbeat's answer tells a member. A member running in epoch `w` aborts what is
/// in flight when [`Beat::ends`]`(w)`: its group will not complete another collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    /// The newest epoch the coordinator formed (0: none yet).
    pub latest: u64,
    /// The latest epoch is ending (a member died, left or reported).
    pub ending: bool,
    /// Newcomers wait: members of the latest epoch report after committing this step.
    pub change_at: Option<Step>,
    /// Whether the member belongs to the latest epoch; `false` for one that was declared
    /// dead (frozen, cut off) and must rejoin as a newcomer.
    pub member: bool,
}

impl Beat {
    /// Whether a member running in epoch `w` must abort.
    pub fn ends(&self, w: u64) -> bool {
        w < self.latest || (w == self.latest && (self.ending || !self.member))
    }
}

/// Where the rank 0 of an epoch listens, as far as the coordinator knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Master {
    /// Rank 0 published this address.
    At(String),
    /// Not yet published.
    Pending,
    /// A newer epoch formed: this one will never run.
    Superseded,
}

/// A member's answer to "is my epoch ready?".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness<'a> {
    /// The epoch it waits for, with it as a member.
    Formed(&'a Epoch),
    /// Still forming.
    Waiting,
    /// The coordinator has no report from it (it was declared dead while waiting): report
    /// again.
    Unknown,
}

#[derive(Debug, Clone, Copy)]
struct Report {
    /// Its step if it continues from the current epoch, [`NO_STATE`] for a newcomer.
    step: Step,
    continuing: bool,
    /// Arrival order, which is the newcomers' rank order.
    order: u64,
}

#[derive(Debug, Clone, Copy)]
struct Known {
    last_seen: Instant,
    step: Step,
    report: Option<Report>,
}

/// The coordinator's state.
pub struct Coordinator {
    cfg: CoordinatorConfig,
    incarnation: u64,
    spec: Option<String>,
    current: Option<Epoch>,
    /// The last [`RECENT_EPOCHS`] epochs before the current one, oldest first.
    recent: VecDeque<Epoch>,
    /// The current epoch as the change from each of `recent`, made once when it formed: every
    /// member that holds one of them is told that change.
    changes: Vec<EpochChange>,
    known: HashMap<MemberId, Known>,
    /// Members of the current epoch that died, left or were expelled: not waited for.
    gone: HashSet<MemberId>,
    /// When the current epoch began to end.
    changing: Option<Instant>,
    change_at: Option<Step>,
    master: Option<String>,
    next_order: u64,
    last_report: Option<Instant>,
    /// The highest epoch number ever seen (views of a previous coordinator included).
    high_water: u64,
    /// The first input's time: the rebuild window counts from it.
    started: Option<Instant>,
    /// Each member of the current epoch's rank (a heartbeat's answer is looked up, not
    /// searched for: a coordinator of thousands answers tens of thousands a second).
    ranks: HashMap<MemberId, usize>,
    /// Bumped whenever an answer to a waiting member could change (see [`Coordinator::revision`]).
    revision: u64,
}

impl Coordinator {
    /// A coordinator with no members; `incarnation` should be random.
    pub fn new(cfg: CoordinatorConfig, incarnation: u64) -> Coordinator {
        Coordinator {
            cfg: CoordinatorConfig {
                min_members: cfg.min_members.max(1),
                ..cfg
            },
            incarnation,
            spec: None,
            current: None,
            recent: VecDeque::new(),
            changes: Vec::new(),
            known: HashMap::new(),
            gone: HashSet::new(),
            changing: None,
            change_at: None,
            master: None,
            next_order: 0,
            last_report: None,
            high_water: 0,
            started: None,
            ranks: HashMap::new(),
            revision: 0,
        }
    }

    /// The settings it runs with.
    pub fn config(&self) -> &CoordinatorConfig {
        &self.cfg
    }

    /// The latest epoch, if one formed.
    pub fn current(&self) -> Option<&Epoch> {
        self.current.as_ref()
    }

    /// Members it believes alive.
    pub fn live_members(&self) -> usize {
        self.known.len()
    }

    /// A member introduces itself (on every new connection): `spec` describes its training
    /// state (names, dtypes, shapes), which must be the job's; `view` is the epoch it is in,
    /// from which a restarted coordinator rebuilds its own.
    pub fn register(
        &mut self,
        now: Instant,
        id: MemberId,
        spec: &str,
        view: Option<Epoch>,
    ) -> Result<()> {
        match &self.spec {
            Some(job) if job != spec => return Err(spec_mismatch(job, spec)),
            Some(_) => {}
            None => self.spec = Some(spec.to_string()),
        }
        if let Some(view) = view {
            self.high_water = self.high_water.max(view.number);
            let newer = self
                .current
                .as_ref()
                .is_none_or(|c| view.number > c.number && view.incarnation != self.incarnation);
            if newer && view.rank_of(id).is_some() {
                // A coordinator that restarted: the members' epoch is the current one, and
                // each of its members gets `dead_after` to show up.
                for m in &view.members {
                    self.known.entry(m.id).or_insert(Known {
                        last_seen: now,
                        step: m.step,
                        report: None,
                    });
                }
                self.set_current(view);
                self.gone.clear();
                self.changing = None;
                self.change_at = None;
                self.master = None;
            }
        }
        self.touch(now, id, None);
        Ok(())
    }

    fn touch(&mut self, now: Instant, id: MemberId, step: Option<Step>) {
        self.started.get_or_insert(now);
        let k = self.known.entry(id).or_insert(Known {
            last_seen: now,
            step: NO_STATE,
            report: None,
        });
        k.last_seen = now;
        if let Some(s) = step {
            k.step = s;
        }
    }

    fn is_member(&self, id: MemberId) -> bool {
        !self.gone.contains(&id) && self.ranks.contains_key(&id)
    }

    fn begin_change(&mut self, now: Instant) {
        if self.current.is_some() && self.changing.is_none() {
            self.changing = Some(now);
            self.revision += 1;
        }
    }

    /// Makes `epoch` the current one.
    fn set_current(&mut self, epoch: Epoch) {
        self.ranks = epoch
            .members
            .iter()
            .enumerate()
            .map(|(r, m)| (m.id, r))
            .collect();
        if let Some(old) = self.current.replace(epoch) {
            if self.recent.len() == RECENT_EPOCHS {
                self.recent.pop_front();
            }
            self.recent.push_back(old);
        }
        self.changes = match &self.current {
            Some(c) => self
                .recent
                .iter()
                .filter_map(|base| EpochChange::between(base, c))
                .collect(),
            None => Vec::new(),
        };
        self.revision += 1;
    }

    /// The current epoch as the change from epoch `number` of `incarnation`, if that is one
    /// of the few before it.
    pub fn change_from(&self, number: u64, incarnation: u64) -> Option<&EpochChange> {
        self.changes
            .iter()
            .find(|c| c.base == number && c.incarnation == incarnation)
    }

    /// A member is no longer known (left, died, silent): its waits are answered anew.
    fn forget(&mut self, id: MemberId) -> bool {
        let known = self.known.remove(&id).is_some();
        if known {
            self.revision += 1;
        }
        known
    }

    /// A number that changes whenever the answer to a waiting member's question
    /// ([`Coordinator::readiness`], [`Coordinator::master`], [`Coordinator::beat_of`]'s
    /// verdict on an epoch) may have changed, and only rarely otherwise: heartbeats and
    /// reports that change nothing for the others leave it alone. Whoever holds questions
    /// asks them again only when it moved.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// A heartbeat: the member is alive, with `step` committed.
    pub fn heartbeat(&mut self, now: Instant, id: MemberId, step: Step) -> Beat {
        self.touch(now, id, Some(step));
        self.beat_of(id)
    }

    /// What a heartbeat of `id` would be answered now (for a member waiting to hear that
    /// its epoch ends).
    pub fn beat_of(&self, id: MemberId) -> Beat {
        let member = self.is_member(id);
        Beat {
            latest: self.current.as_ref().map_or(0, |c| c.number),
            ending: self.changing.is_some(),
            change_at: if member { self.change_at } else { None },
            member,
        }
    }

    /// The member waits for an epoch newer than `seen`, with `step` committed. A member of
    /// the current epoch that reports has left it (its collective failed, or it reached
    /// `change_at`); anyone else is a newcomer and will have to heal.
    pub fn report(&mut self, now: Instant, id: MemberId, seen: u64, step: Step) {
        self.touch(now, id, None);
        let latest = self.current.as_ref().map_or(0, |c| c.number);
        let continuing = self.is_member(id) && seen == latest;
        let order = match self.known.get(&id).and_then(|k| k.report) {
            Some(r) => r.order,
            None => {
                self.next_order += 1;
                self.next_order
            }
        };
        if let Some(k) = self.known.get_mut(&id) {
            k.report = Some(Report {
                step: if continuing { step } else { NO_STATE },
                continuing,
                order,
            });
        }
        self.last_report = Some(now);
        if continuing {
            self.begin_change(now);
        } else if self.current.is_some() && self.changing.is_none() && self.change_at.is_none() {
            // Admission at the next step boundary of the current members.
            let best = self
                .current
                .iter()
                .flat_map(|c| c.members.iter())
                .filter_map(|m| self.known.get(&m.id).map(|k| k.step.max(m.step)))
                .max()
                .unwrap_or(NO_STATE);
            self.change_at = Some(best.max(0) + 1);
            self.revision += 1;
        }
        self.try_form(now);
    }

    /// Whether the epoch `id` waits for (newer than `seen`) has formed.
    pub fn readiness(&self, id: MemberId, seen: u64) -> Readiness<'_> {
        match &self.current {
            Some(c) if c.number > seen && self.is_member(id) => Readiness::Formed(c),
            _ if self.known.get(&id).is_some_and(|k| k.report.is_some()) => Readiness::Waiting,
            _ => Readiness::Unknown,
        }
    }

    /// The member leaves the job for good. Its epoch is not ended here: the member closed
    /// its group gracefully, so the others complete what it took part in (its last step,
    /// typically) and learn that it left from their next collective, which fails at once;
    /// then they report, and the next epoch forms without it.
    pub fn leave(&mut self, now: Instant, id: MemberId) {
        self.forget(id);
        if self.is_member(id) {
            self.gone.insert(id);
            self.revision += 1;
        }
        self.try_form(now);
    }

    /// The member's process is gone: the platform said so (its tether, a TCP connection
    /// the kernel closes when the process exits, was closed) before the heartbeats could.
    /// As a death by silence, only sooner. Ignored for a member that left.
    pub fn died(&mut self, now: Instant, id: MemberId) {
        if !self.forget(id) {
            return;
        }
        if self.is_member(id) {
            self.gone.insert(id);
            self.revision += 1;
            self.begin_change(now);
        }
        self.try_form(now);
    }

    /// Rank 0 of `epoch` listens at `addr`. Ignored unless it is rank 0 of the current epoch.
    pub fn publish_master(&mut self, id: MemberId, epoch: u64, addr: String) -> bool {
        let ok = self
            .current
            .as_ref()
            .is_some_and(|c| c.number == epoch && c.members.first().is_some_and(|m| m.id == id));
        if ok {
            self.master = Some(addr);
            self.revision += 1;
        }
        ok
    }

    /// Where rank 0 of `epoch` listens.
    pub fn master(&self, epoch: u64) -> Master {
        match &self.current {
            Some(c) if c.number == epoch => match &self.master {
                Some(a) => Master::At(a.clone()),
                None => Master::Pending,
            },
            Some(c) if c.number > epoch => Master::Superseded,
            _ => Master::Pending,
        }
    }

    /// When [`Coordinator::handle_timeout`] should next run.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let deaths = self
            .known
            .values()
            .map(|k| k.last_seen + self.cfg.dead_after);
        let window = match (&self.current, self.last_report, self.started) {
            (None, Some(t), Some(s)) => {
                Some((t + self.cfg.join_window).max(s + self.cfg.rebuild_window))
            }
            _ => None,
        };
        let limit = self.changing.map(|t| t + self.cfg.change_limit);
        deaths.chain(window).chain(limit).min()
    }

    /// Declares the silent dead and forms an epoch if it can.
    pub fn handle_timeout(&mut self, now: Instant) {
        let dead: Vec<MemberId> = self
            .known
            .iter()
            .filter(|(_, k)| now.saturating_duration_since(k.last_seen) >= self.cfg.dead_after)
            .map(|(&id, _)| id)
            .collect();
        for id in dead {
            self.forget(id);
            if self.is_member(id) {
                self.gone.insert(id);
                self.revision += 1;
                self.begin_change(now);
            }
        }
        self.try_form(now);
    }

    fn try_form(&mut self, now: Instant) {
        let ready: Vec<(MemberId, Report)> = self
            .known
            .iter()
            .filter_map(|(&id, k)| k.report.map(|r| (id, r)))
            .collect();
        if ready.len() < self.cfg.min_members {
            return;
        }
        let continuing: Vec<Member> = match &self.current {
            None => {
                let rebuilt = self
                    .started
                    .is_some_and(|t| now.saturating_duration_since(t) >= self.cfg.rebuild_window);
                let settled = rebuilt
                    && self
                        .last_report
                        .is_some_and(|t| now.saturating_duration_since(t) >= self.cfg.join_window);
                if !settled {
                    return;
                }
                Vec::new()
            }
            Some(cur) => {
                let Some(since) = self.changing else { return };
                let waiting = cur.members.iter().any(|m| {
                    !self.gone.contains(&m.id)
                        && self
                            .known
                            .get(&m.id)
                            .is_some_and(|k| !k.report.is_some_and(|r| r.continuing))
                });
                if waiting && now.saturating_duration_since(since) < self.cfg.change_limit {
                    return;
                }
                cur.members
                    .iter()
                    .filter_map(|m| {
                        let r = self.known.get(&m.id)?.report?;
                        r.continuing.then_some(Member {
                            id: m.id,
                            step: r.step,
                        })
                    })
                    .collect()
            }
        };
        let mut newcomers: Vec<(u64, MemberId)> = ready
            .iter()
            .filter(|(_, r)| !r.continuing)
            .map(|&(id, r)| (r.order, id))
            .collect();
        newcomers.sort_unstable();
        let mut members = continuing;
        members.extend(
            newcomers
                .into_iter()
                .map(|(_, id)| Member { id, step: NO_STATE }),
        );
        let number = self
            .current
            .as_ref()
            .map_or(0, |c| c.number)
            .max(self.high_water)
            + 1;
        self.high_water = number;
        for m in &members {
            if let Some(k) = self.known.get_mut(&m.id) {
                k.report = None;
                k.step = m.step;
            }
        }
        self.set_current(Epoch {
            number,
            incarnation: self.incarnation,
            members,
        });
        self.gone.clear();
        self.changing = None;
        self.change_at = None;
        self.master = None;
        self.last_report = None;
    }
}

fn spec_mismatch(job: &str, newcomer: &str) -> Error {
    let a: Vec<&str> = job.split(';').collect();
    let b: Vec<&str> = newcomer.split(';').collect();
    let first = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i));
    let detail = match first {
        Some(i) => format!(
            "the job has {}, this process has {}",
            a.get(i)
                .map_or("nothing more".to_string(), |s| format!("'{s}'")),
            b.get(i)
                .map_or("nothing more".to_string(), |s| format!("'{s}'"))
        ),
        None => "they differ".to_string(),
    };
    Error::SpecMismatch(format!(
        "refused at admission: this process's training state is not the job's ({detail}); start it with the same model, optimizer and Model-Spec as the running members"
    ))
}
