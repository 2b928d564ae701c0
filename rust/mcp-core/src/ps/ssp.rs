//! The stale-synchronous clock table: pure logic, no clock of its own.
//!
//! Every worker has a clock (the number of steps it has finished). A worker at clock `c` may
//! go on while the slowest *live* worker is at `c - s` or later (`c - min_live <= s`);
//! `s = 0` is fully synchronous. A dead worker is dropped from the minimum, so the others
//! go on; it can rejoin, at its own clock or the current minimum, whichever is later.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    clock: u64,
    live: bool,
}

/// Per-worker clocks and the live set.
#[derive(Debug, Clone, Default)]
pub struct ClockTable {
    workers: BTreeMap<u32, Entry>,
    /// Largest `clock - min_live` ever granted by [`ClockTable::may_proceed`] (instrumentation).
    max_granted_gap: u64,
}

impl ClockTable {
    /// An empty table.
    pub fn new() -> ClockTable {
        ClockTable::default()
    }

    /// Registers (or re-registers) `worker` and returns its clock: the later of `clock`, its
    /// previous clock when it is still live, and the slowest live worker's clock.
    pub fn register(&mut self, worker: u32, clock: u64) -> u64 {
        let floor = self.min_live().unwrap_or(clock);
        let prev = self
            .workers
            .get(&worker)
            .filter(|e| e.live)
            .map_or(0, |e| e.clock);
        let c = clock.max(floor).max(prev);
        self.workers.insert(
            worker,
            Entry {
                clock: c,
                live: true,
            },
        );
        c
    }

    /// Moves a live worker's clock forward to `clock` (never backwards). Returns false if the
    /// worker is not live (unknown, or dropped as dead): it must register again.
    pub fn advance(&mut self, worker: u32, clock: u64) -> bool {
        match self.workers.get_mut(&worker) {
            Some(e) if e.live => {
                e.clock = e.clock.max(clock);
                true
            }
            _ => false,
        }
    }

    /// Drops `worker` from the live set (it died or left). Returns true if it was live.
    pub fn drop_worker(&mut self, worker: u32) -> bool {
        match self.workers.get_mut(&worker) {
            Some(e) if e.live => {
                e.live = false;
                true
            }
            _ => false,
        }
    }

    /// The slowest live worker's clock, or `None` when no worker is live.
    pub fn min_live(&self) -> Option<u64> {
        self.workers
            .values()
            .filter(|e| e.live)
            .map(|e| e.clock)
            .min()
    }

    /// Whether a worker at `clock` may go on under staleness bound `s`; records the gap
    /// when it may.
    pub fn may_proceed(&mut self, clock: u64, s: u64) -> bool {
        match self.min_live() {
            None => true,
            Some(m) => {
                let gap = clock.saturating_sub(m);
                if gap <= s {
                    self.max_granted_gap = self.max_granted_gap.max(gap);
                    true
                } else {
                    false
                }
            }
        }
    }

    /// The clock of `worker`, if it is live.
    pub fn clock_of(&self, worker: u32) -> Option<u64> {
        self.workers
            .get(&worker)
            .filter(|e| e.live)
            .map(|e| e.clock)
    }

    /// Whether `worker` is live.
    pub fn is_live(&self, worker: u32) -> bool {
        self.clock_of(worker).is_some()
    }

    /// Live workers.
    pub fn live(&self) -> usize {
        self.workers.values().filter(|e| e.live).count()
    }

    /// Workers ever registered.
    pub fn known(&self) -> usize {
        self.workers.len()
    }

    /// The largest gap ever granted.
    pub fn max_granted_gap(&self) -> u64 {
        self.max_granted_gap
    }

    /// (worker, clock, live) for every worker ever registered, in worker order.
    pub fn entries(&self) -> Vec<(u32, u64, bool)> {
        self.workers
            .iter()
            .map(|(&w, e)| (w, e.clock, e.live))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staleness_bound() {
        let mut t = ClockTable::new();
        for w in 0..3 {
            assert_eq!(t.register(w, 0), 0);
        }
        assert!(t.advance(0, 3));
        assert!(t.advance(1, 1));
        // slowest is worker 2 at 0: clock 3 may go on with s = 3, clock 4 may not.
        assert!(t.may_proceed(3, 3));
        assert!(!t.may_proceed(4, 3));
        assert!(!t.may_proceed(1, 0));
        assert!(t.may_proceed(0, 0));
        assert_eq!(t.max_granted_gap(), 3);
        // fully synchronous: everyone must be at the same clock
        t.advance(2, 1);
        assert!(t.may_proceed(1, 0));
        assert_eq!(t.min_live(), Some(1));
    }

    #[test]
    fn clocks_never_go_back() {
        let mut t = ClockTable::new();
        t.register(7, 5);
        t.advance(7, 2);
        assert_eq!(t.clock_of(7), Some(5));
    }

    #[test]
    fn dead_worker_is_dropped_and_rejoins_at_the_minimum() {
        let mut t = ClockTable::new();
        for w in 0..3 {
            t.register(w, 0);
        }
        t.advance(0, 5);
        t.advance(1, 4);
        assert!(!t.may_proceed(5, 3), "worker 2 at 0 holds the others");
        assert!(t.drop_worker(2));
        assert!(!t.drop_worker(2));
        assert_eq!(t.min_live(), Some(4));
        assert!(t.may_proceed(5, 3));
        assert!(!t.advance(2, 1), "a dropped worker must register again");
        assert_eq!(t.register(2, 0), 4, "rejoins at the current minimum");
        assert_eq!(t.live(), 3);
        assert_eq!(t.known(), 3);
        // a rejoining worker that is ahead keeps its clock
        t.drop_worker(0);
        assert_eq!(t.register(0, 9), 9);
    }

    #[test]
    fn empty_table_lets_everyone_go() {
        let mut t = ClockTable::new();
        assert_eq!(t.min_live(), None);
        assert!(t.may_proceed(100, 0));
        t.register(1, 0);
        t.drop_worker(1);
        assert_eq!(t.min_live(), None);
    }
}
