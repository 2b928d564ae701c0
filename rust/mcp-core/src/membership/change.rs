//! An epoch told as its change from one the member already holds.
//!
//! When an epoch forms, every survivor must learn it. Sent whole, that is 16 bytes per
//! member to each member: quadratic in the job's size (2 GB from the coordinator when one
//! node of an 8,000-rank job fails). Members carried from one epoch to the next keep their
//! relative order and newcomers come after them, so the next epoch is the one before without
//! the members that left, plus the ones that came; and the members of a running job mostly
//! share one step count. [`EpochChange`] says just that: a few bytes per member that left or
//! came, and the steps run-length coded.

use super::{Epoch, Member, MemberId, Step};
use crate::error::{Error, Result};

/// Epoch `number` as the change from epoch `base` (of the same coordinator incarnation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochChange {
    /// The number of the epoch it changes, which the receiver holds.
    pub base: u64,
    /// The new epoch's number.
    pub number: u64,
    /// The incarnation of the coordinator that formed both.
    pub incarnation: u64,
    /// The ranks in `base` of the members that are not in the new epoch, ascending.
    pub left: Vec<u32>,
    /// The members that came, in their rank order after the carried ones.
    pub came: Vec<MemberId>,
    /// Every member's step in the new epoch's rank order, as runs of (step, count).
    pub steps: Vec<(Step, u32)>,
}

impl EpochChange {
    /// The change from `base` to `next`, or `None` where `next` is not a later epoch of
    /// the same incarnation.
    pub fn between(base: &Epoch, next: &Epoch) -> Option<EpochChange> {
        if base.incarnation != next.incarnation || next.number <= base.number {
            return None;
        }
        let mut left = Vec::new();
        let mut kept = 0usize;
        for (r, m) in base.members.iter().enumerate() {
            if next.members.get(kept).is_some_and(|n| n.id == m.id) {
                kept += 1;
            } else {
                left.push(u32::try_from(r).ok()?);
            }
        }
        // Any epoch is so encoded (a carried member out of order reads as one that left and
        // came); it is short when the coordinator keeps the order, as it does.
        let came: Vec<MemberId> = next.members[kept..].iter().map(|m| m.id).collect();
        let mut steps: Vec<(Step, u32)> = Vec::new();
        for m in &next.members {
            match steps.last_mut() {
                Some((s, n)) if *s == m.step => *n += 1,
                _ => steps.push((m.step, 1)),
            }
        }
        Some(EpochChange {
            base: base.number,
            number: next.number,
            incarnation: next.incarnation,
            left,
            came,
            steps,
        })
    }

    /// The new epoch, from `base` (which must be the epoch it changes).
    pub fn apply(&self, base: &Epoch) -> Result<Epoch> {
        if base.number != self.base || base.incarnation != self.incarnation {
            return Err(Error::Protocol(format!(
                "the coordinator sent the change from epoch {} (incarnation {:#x}), and this \
                 member holds epoch {} (incarnation {:#x})",
                self.base, self.incarnation, base.number, base.incarnation
            )));
        }
        let bad = |why: &str| Error::Protocol(format!("epoch change {}: {why}", self.number));
        let mut ids = Vec::with_capacity(base.members.len() + self.came.len());
        let mut left = self.left.iter().peekable();
        for (r, m) in base.members.iter().enumerate() {
            if left.next_if(|&&l| l as usize == r).is_none() {
                ids.push(m.id);
            }
        }
        if left.next().is_some() {
            return Err(bad(
                "the ranks that left are not ascending ranks of the epoch it changes",
            ));
        }
        ids.extend_from_slice(&self.came);
        let runs: u64 = self.steps.iter().map(|&(_, n)| u64::from(n)).sum();
        if runs != ids.len() as u64 {
            return Err(bad(&format!("{runs} steps for {} members", ids.len())));
        }
        let steps = self
            .steps
            .iter()
            .flat_map(|&(s, n)| std::iter::repeat_n(s, n as usize));
        Ok(Epoch {
            number: self.number,
            incarnation: self.incarnation,
            members: ids
                .into_iter()
                .zip(steps)
                .map(|(id, step)| Member { id, step })
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::NO_STATE;

    fn epoch(number: u64, members: &[(MemberId, Step)]) -> Epoch {
        Epoch {
            number,
            incarnation: 7,
            members: members
                .iter()
                .map(|&(id, step)| Member { id, step })
                .collect(),
        }
    }

    #[test]
    fn a_change_rebuilds_the_next_epoch() {
        let a = epoch(3, &[(10, 5), (11, 5), (12, 5), (13, 5), (14, 5)]);
        let b = epoch(
            4,
            &[(10, 9), (12, 9), (14, 9), (20, NO_STATE), (21, NO_STATE)],
        );
        let c = EpochChange::between(&a, &b).expect("a change");
        assert_eq!(c.left, vec![1, 3]);
        assert_eq!(c.came, vec![20, 21]);
        assert_eq!(c.steps, vec![(9, 3), (NO_STATE, 2)]);
        assert_eq!(c.apply(&a).expect("applies"), b);
        // Everyone left, or nobody did.
        let all_new = epoch(5, &[(30, 0)]);
        let c = EpochChange::between(&a, &all_new).expect("a change");
        assert_eq!(c.left, vec![0, 1, 2, 3, 4]);
        assert_eq!(c.apply(&a).expect("applies"), all_new);
        let same = epoch(6, &a.members.iter().map(|m| (m.id, 6)).collect::<Vec<_>>());
        assert_eq!(
            EpochChange::between(&a, &same).expect("a change").left,
            vec![]
        );
    }

    #[test]
    fn only_a_later_epoch_of_the_incarnation_is_a_change() {
        let a = epoch(3, &[(10, 5), (11, 5), (12, 5)]);
        // Carried members out of order still round-trip (as left and came again).
        let b = epoch(4, &[(11, 5), (10, 5)]);
        let c = EpochChange::between(&a, &b).expect("a change");
        assert_eq!(c.apply(&a).expect("applies"), b);
        // Another incarnation, or not a newer epoch.
        let mut other = epoch(4, &[(10, 5)]);
        other.incarnation = 8;
        assert!(EpochChange::between(&a, &other).is_none());
        assert!(EpochChange::between(&a, &epoch(3, &[(10, 5)])).is_none());
    }

    #[test]
    fn a_change_from_another_epoch_or_inconsistent_is_refused() {
        let a = epoch(3, &[(10, 5), (11, 5), (12, 5)]);
        let b = epoch(4, &[(10, 5), (12, 5)]);
        let c = EpochChange::between(&a, &b).expect("a change");
        assert!(matches!(c.apply(&b), Err(Error::Protocol(_))));
        let mut wrong = c.clone();
        wrong.steps = vec![(5, 3)];
        assert!(matches!(wrong.apply(&a), Err(Error::Protocol(_))));
        let mut wrong = c.clone();
        wrong.left = vec![1, 1];
        assert!(matches!(wrong.apply(&a), Err(Error::Protocol(_))));
        let mut wrong = c;
        wrong.left = vec![9];
        assert!(matches!(wrong.apply(&a), Err(Error::Protocol(_))));
    }
}
