//! The stale-synchronous clock table: pure logic, no clock of its own.
//!
//! Every worker has a clock (the number of steps it has finished). A worker at clock `c` may
//! go on while the slowest *live* worker is at `c - s` or later (`c - min_live <= s`);
//! `s = 0` is fully synchronous. A dead worker is dropped from the minimum, so the others
//! go on; it can rejoin, at its own clock or the current minimum, whichever is later.
//!
//! A dead worker's id is *vacant*: a replacement may [`ClockTable::claim`] it (and with it
//! the dead worker's data shard). Each claim raises the id's generation; a registration of
//! an older generation is refused, so the dead worker, should it come back (it was only
//! frozen), cannot hold the id beside its replacement. A worker that left is done: its id is
//! not vacant.

use std::collections::BTreeMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Live,
    /// Dropped as dead: the id is vacant.
    Dead,
    /// Said goodbye: finished, not vacant.
    Left,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    clock: u64,
    state: State,
    /// Raised by every claim of the id.
    generation: u64,
}

impl Entry {
    fn live(&self) -> bool {
        self.state == State::Live
    }
}

/// A registration refused because a replacement claimed the id since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superseded {
    /// The worker id.
    pub worker: u32,
    /// The generation that registered.
    pub generation: u64,
    /// The id's generation now.
    pub current: u64,
}

impl std::fmt::Display for Superseded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "worker id {} was taken over by a replacement (generation {}, this process holds \
             generation {}): it was dropped as dead; stop it, or start it with \
             worker_id=\"vacant\" to take a vacant id",
            self.worker, self.current, self.generation
        )
    }
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

    /// Registers (or re-registers) `worker` of `generation` and returns its clock: the later
    /// of `clock`, its previous clock when it is still live, and the slowest live worker's
    /// clock. Refused if the id was claimed by a later generation.
    pub fn register(
        &mut self,
        worker: u32,
        clock: u64,
        generation: u64,
    ) -> Result<u64, Superseded> {
        let floor = self.min_live().unwrap_or(clock);
        let old = self.workers.get(&worker).copied();
        if let Some(e) = old.filter(|e| e.generation > generation) {
            return Err(Superseded {
                worker,
                generation,
                current: e.generation,
            });
        }
        let prev = old.filter(Entry::live).map_or(0, |e| e.clock);
        let c = clock.max(floor).max(prev);
        self.workers.insert(
            worker,
            Entry {
                clock: c,
                state: State::Live,
                generation,
            },
        );
        Ok(c)
    }

    /// Takes a vacant id for a replacement: the lowest id whose worker was dropped as dead,
    /// else the lowest id below `expected` never registered. The id is registered live at
    /// the slowest live clock (or `clock`, when later) with the next generation. Returns
    /// (id, generation, clock), or `None` when no id is vacant.
    pub fn claim(&mut self, expected: u32, clock: u64) -> Option<(u32, u64, u64)> {
        let dead = self
            .workers
            .iter()
            .find(|(_, e)| e.state == State::Dead)
            .map(|(&w, _)| w);
        let w = dead.or_else(|| (0..expected).find(|w| !self.workers.contains_key(w)))?;
        let generation = self.workers.get(&w).map_or(0, |e| e.generation) + 1;
        let c = self.register(w, clock, generation).ok()?;
        Some((w, generation, c))
    }

    /// Moves a live worker's clock forward to `clock` (never backwards). Returns false if the
    /// worker is not live (unknown, or dropped as dead): it must register again.
    pub fn advance(&mut self, worker: u32, clock: u64) -> bool {
        match self.workers.get_mut(&worker) {
            Some(e) if e.live() => {
                e.clock = e.clock.max(clock);
                true
            }
            _ => false,
        }
    }

    /// Drops `worker` from the live set as dead: its id becomes vacant. Returns true if it
    /// was live.
    pub fn drop_worker(&mut self, worker: u32) -> bool {
        self.set_gone(worker, State::Dead)
    }

    /// Drops `worker` from the live set as finished (it said goodbye): its id is not vacant.
    /// Returns true if it was live.
    pub fn leave(&mut self, worker: u32) -> bool {
        self.set_gone(worker, State::Left)
    }

    fn set_gone(&mut self, worker: u32, state: State) -> bool {
        match self.workers.get_mut(&worker) {
            Some(e) if e.live() => {
                e.state = state;
                true
            }
            _ => false,
        }
    }

    /// The generation that holds `worker`'s id (0 until a replacement claims it).
    pub fn generation_of(&self, worker: u32) -> Option<u64> {
        self.workers.get(&worker).map(|e| e.generation)
    }

    /// The slowest live worker's clock, or `None` when no worker is live.
    pub fn min_live(&self) -> Option<u64> {
        self.workers
            .values()
            .filter(|e| e.live())
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
            .filter(|e| e.live())
            .map(|e| e.clock)
    }

    /// Whether `worker` is live.
    pub fn is_live(&self, worker: u32) -> bool {
        self.clock_of(worker).is_some()
    }

    /// Live workers.
    pub fn live(&self) -> usize {
        self.workers.values().filter(|e| e.live()).count()
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
            .map(|(&w, e)| (w, e.clock, e.live()))
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
            assert_eq!(t.register(w, 0, 0), Ok(0));
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
        t.register(7, 5, 0).expect("register");
        t.advance(7, 2);
        assert_eq!(t.clock_of(7), Some(5));
    }

    #[test]
    fn dead_worker_is_dropped_and_rejoins_at_the_minimum() {
        let mut t = ClockTable::new();
        for w in 0..3 {
            t.register(w, 0, 0).expect("register");
        }
        t.advance(0, 5);
        t.advance(1, 4);
        assert!(!t.may_proceed(5, 3), "worker 2 at 0 holds the others");
        assert!(t.drop_worker(2));
        assert!(!t.drop_worker(2));
        assert_eq!(t.min_live(), Some(4));
        assert!(t.may_proceed(5, 3));
        assert!(!t.advance(2, 1), "a dropped worker must register again");
        assert_eq!(t.register(2, 0, 0), Ok(4), "rejoins at the current minimum");
        assert_eq!(t.live(), 3);
        assert_eq!(t.known(), 3);
        // a rejoining worker that is ahead keeps its clock
        t.drop_worker(0);
        assert_eq!(t.register(0, 9, 0), Ok(9));
    }

    #[test]
    fn empty_table_lets_everyone_go() {
        let mut t = ClockTable::new();
        assert_eq!(t.min_live(), None);
        assert!(t.may_proceed(100, 0));
        t.register(1, 0, 0).expect("register");
        t.drop_worker(1);
        assert_eq!(t.min_live(), None);
    }

    #[test]
    fn a_replacement_claims_the_dead_id_and_fences_the_old_process() {
        let mut t = ClockTable::new();
        for w in 0..3 {
            t.register(w, 0, 0).expect("register");
        }
        assert_eq!(t.claim(3, 0), None, "nothing vacant while all are live");
        t.advance(0, 6);
        t.advance(1, 5);
        t.advance(2, 4);
        t.drop_worker(1);
        // worker 1's id and shard go to the replacement, at the slowest live clock
        assert_eq!(t.claim(3, 0), Some((1, 1, 4)));
        assert_eq!(t.claim(3, 0), None, "claimed once");
        // the old worker 1 (it was only frozen) comes back: refused, the replacement holds on
        let Err(e) = t.register(1, 5, 0) else {
            panic!("the old process must be refused")
        };
        assert_eq!((e.worker, e.generation, e.current), (1, 0, 1));
        assert!(e.to_string().contains("taken over"), "{e}");
        assert_eq!(t.clock_of(1), Some(4));
        // the replacement re-registers (a reconnect) with its generation
        assert_eq!(t.register(1, 4, 1), Ok(4));
        // a second death of the same id: the next replacement fences the first
        t.drop_worker(1);
        assert_eq!(t.claim(3, 0), Some((1, 2, 4)));
        assert!(t.register(1, 4, 1).is_err());
        assert_eq!(t.generation_of(1), Some(2));
    }

    #[test]
    fn claims_take_never_registered_ids_and_never_those_that_left() {
        let mut t = ClockTable::new();
        t.register(0, 3, 0).expect("register");
        t.register(2, 3, 0).expect("register");
        assert_eq!(t.claim(4, 0), Some((1, 1, 3)), "lowest never registered");
        t.leave(0);
        assert_eq!(
            t.claim(4, 0),
            Some((3, 1, 3)),
            "a worker that left is not vacant"
        );
        assert_eq!(t.claim(4, 0), None);
        // a dead id is taken before a never registered one
        t.drop_worker(2);
        assert_eq!(t.claim(5, 0), Some((2, 1, 3)));
        assert_eq!(t.claim(5, 0), Some((4, 1, 3)));
        // a replacement that comes later than the others' clock starts at its own
        t.drop_worker(4);
        assert_eq!(t.claim(5, 9), Some((4, 2, 9)));
    }
}
