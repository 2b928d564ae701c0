//! Elastic membership: a job whose members may die, freeze or arrive at any step.
//!
//! A job runs each collective over an agreed member set, its *epoch*. One small process that
//! is not a training rank, the coordinator (`mcp-coordinator`), has the last word on every
//! epoch: members report to it, it announces epoch `e + 1` to all of them, and because it is
//! the only one that announces, every survivor gets the same member set even while more
//! members die during the change. Two halves of a partition cannot both commit: a member
//! commits only steps whose collectives ran over the coordinator's latest epoch, and only
//! the coordinator forms epochs. While the coordinator is down, the members of the current
//! epoch keep training; only changes wait, and a restarted coordinator rebuilds its state
//! from what the members tell it.
//!
//! - [`coordinator`]: the coordinator's state machine, sans IO (inputs and `now` in, the
//!   announcements out, timers as data).
//! - [`wire`]: the messages between members and the coordinator.
//! - [`change`]: an epoch told as its change from one the member holds, so that telling
//!   every member of a new epoch costs the coordinator bytes linear in the job's size.
//! - [`service`]: the coordinator's answers to those messages, sans IO: long polls held as
//!   data until the coordinator can answer or their wait is over.
//! - [`server`]: the coordinator's QUIC endpoint (the job's mutual TLS), a driver of the
//!   service.
//! - [`session`]: a member's side, sans IO: registration, the heartbeat timer, reconnection,
//!   what the answers mean for its epoch.
//! - [`client`]: the session's QUIC driver, and waiting for an epoch.

pub mod change;
pub mod client;
pub mod coordinator;
pub mod server;
pub mod service;
pub mod session;
pub mod wire;

#[cfg(test)]
mod tests;

/// A member's identity, chosen at random by the process when it starts; a process that
/// restarts (or was expelled) comes back under a new one.
pub type MemberId = u64;

/// What a member has of the training state: the number of steps it committed, or
/// [`NO_STATE`] for a newcomer that must heal from a live member before it can step.
pub type Step = i64;

/// The step of a member that has no state of its own (a newcomer, or one that was expelled).
pub const NO_STATE: Step = -1;

/// One member of an epoch: who, and how many steps it had committed when the epoch formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// The member's id.
    pub id: MemberId,
    /// Steps it had committed, or [`NO_STATE`].
    pub step: Step,
}

/// An agreed member set. The rank of a member is its index in `members`; members carried
/// over from the previous epoch keep their relative order (so rank 0 stays rank 0 while it
/// lives), newcomers come after them in the order they arrived.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Epoch {
    /// Epoch number, increasing over the job's life.
    pub number: u64,
    /// A random number of the coordinator that formed the epoch: a restarted coordinator
    /// has a new one, so an epoch number it reuses never names the same group twice.
    pub incarnation: u64,
    /// The members, in rank order.
    pub members: Vec<Member>,
}

impl Epoch {
    /// The rank of `id` in this epoch.
    pub fn rank_of(&self, id: MemberId) -> Option<usize> {
        self.members.iter().position(|m| m.id == id)
    }

    /// The heal plan every member computes alike: the rank whose state the others take (the
    /// lowest rank among those with the most steps; rank 0 when nobody has state) and the
    /// ranks that must take it (everyone behind it, and everyone without state).
    pub fn heal_plan(&self) -> (usize, Vec<usize>) {
        let best = self
            .members
            .iter()
            .map(|m| m.step)
            .max()
            .unwrap_or(NO_STATE);
        let source = if best == NO_STATE {
            0
        } else {
            self.members
                .iter()
                .position(|m| m.step == best)
                .unwrap_or(0)
        };
        let takers = self
            .members
            .iter()
            .enumerate()
            .filter(|&(r, m)| r != source && (m.step != best || m.step == NO_STATE))
            .map(|(r, _)| r)
            .collect();
        (source, takers)
    }

    /// The step every member has once healed: the most any member committed (0 for a job
    /// that has not stepped yet).
    pub fn step_after_heal(&self) -> Step {
        self.members
            .iter()
            .map(|m| m.step)
            .max()
            .unwrap_or(NO_STATE)
            .max(0)
    }

    /// The secret of this epoch's data group: derived from the job secret, the
    /// coordinator's incarnation and the epoch number, so that a member left behind in an
    /// older epoch (frozen, cut off) can never talk its way into the new group.
    pub fn group_secret(&self, job_secret: &[u8]) -> Vec<u8> {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(b"mcp-fast epoch group secret\0");
        ctx.update(job_secret);
        ctx.update(&self.incarnation.to_le_bytes());
        ctx.update(&self.number.to_le_bytes());
        ctx.finish().as_ref().to_vec()
    }
}
