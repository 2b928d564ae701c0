//! What one server holds: its pieces of the parameters with their optimizer state, the
//! gradients pushed for clocks not yet complete, and the clock table. Pure logic.
//!
//! Gradients are aggregated per clock: a push from worker `w` at clock `c` is kept aside,
//! and once every live worker has finished clock `c` (the slowest live clock is above `c`)
//! the server averages the gradients of that clock, piece by piece, summing them in worker
//! order, and applies one optimizer step. So the updates are deterministic whatever the
//! order pushes arrive in, and with `s = 0` training is exactly a single process that
//! averages the workers' gradients each step.

use super::optim::{OptState, Optimizer};
use super::ssp::ClockTable;
use crate::error::{Error, Result};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

/// A piece's identity on a server: tensor name and first element.
pub type PieceId = (String, u64);

/// One piece of one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// The parameters.
    pub params: Vec<f32>,
    /// The optimizer's state for them.
    pub state: OptState,
    /// Optimizer steps applied.
    pub updates: u64,
}

#[derive(Debug, Default)]
struct Pending {
    /// Per piece, per worker (summed in worker order at apply time).
    grads: HashMap<PieceId, BTreeMap<u32, Vec<f32>>>,
}

/// How many pushes are remembered by (worker, request id), so that one sent again (its
/// reply was lost or damaged) is not added twice, even after its clock was applied.
const SEEN_PUSHES: usize = 1 << 16;

/// How the gradients of one clock are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aggregate {
    /// Their mean over the workers that pushed the piece.
    Mean,
    /// Their sum.
    Sum,
}

/// Counters of a store.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Pushes taken.
    pub pushes: u64,
    /// Pushes ignored as duplicates.
    pub duplicate_pushes: u64,
    /// Pulls served.
    pub pulls: u64,
    /// Clocks applied.
    pub clocks_applied: u64,
}

/// A server's state.
#[derive(Debug)]
pub struct Store {
    optimizer: Optimizer,
    aggregate: Aggregate,
    staleness: u64,
    pieces: HashMap<PieceId, Piece>,
    pending: BTreeMap<u64, Pending>,
    /// Every clock below this one has been applied.
    applied: u64,
    clocks: ClockTable,
    stats: StoreStats,
    /// (worker, request id) of the pushes taken lately, oldest first.
    seen: HashSet<(u32, u64)>,
    seen_order: VecDeque<(u32, u64)>,
}

impl Store {
    /// An empty store.
    pub fn new(optimizer: Optimizer, aggregate: Aggregate, staleness: u64) -> Store {
        Store {
            optimizer,
            aggregate,
            staleness,
            pieces: HashMap::new(),
            pending: BTreeMap::new(),
            applied: 0,
            clocks: ClockTable::new(),
            stats: StoreStats::default(),
            seen: HashSet::new(),
            seen_order: VecDeque::new(),
        }
    }

    /// The staleness bound.
    pub fn staleness(&self) -> u64 {
        self.staleness
    }

    /// The clock table.
    pub fn clocks(&self) -> &ClockTable {
        &self.clocks
    }

    /// Every clock below this one has been applied.
    pub fn applied_through(&self) -> u64 {
        self.applied
    }

    /// Counters.
    pub fn stats(&self) -> StoreStats {
        self.stats
    }

    /// Creates a piece with initial values unless it exists; returns whether it was created.
    pub fn init(&mut self, key: &str, offset: u64, values: Vec<f32>) -> bool {
        let id = (key.to_string(), offset);
        if self.pieces.contains_key(&id) {
            return false;
        }
        let state = self.optimizer.new_state(values.len());
        self.pieces.insert(
            id,
            Piece {
                params: values,
                state,
                updates: 0,
            },
        );
        true
    }

    /// Takes a push of `grad` for a piece at `clock` (clocks already applied fold into the
    /// oldest open one). A push with a (worker, request) pair already taken is ignored, also
    /// once its clock was applied.
    pub fn push(
        &mut self,
        worker: u32,
        request: u64,
        clock: u64,
        key: &str,
        offset: u64,
        grad: Vec<f32>,
    ) -> Result<()> {
        let id = (key.to_string(), offset);
        let piece = self.pieces.get(&id).ok_or_else(|| unknown(key, offset))?;
        if piece.params.len() != grad.len() {
            return Err(Error::SpecMismatch(format!(
                "push of {} elements to {key:?}[{offset}..] which holds {}",
                grad.len(),
                piece.params.len()
            )));
        }
        if !self.seen.insert((worker, request)) {
            self.stats.duplicate_pushes += 1;
            return Ok(());
        }
        self.seen_order.push_back((worker, request));
        if self.seen_order.len() > SEEN_PUSHES {
            if let Some(old) = self.seen_order.pop_front() {
                self.seen.remove(&old);
            }
        }
        let clock = clock.max(self.applied);
        let pending = self.pending.entry(clock).or_default();
        self.stats.pushes += 1;
        match pending.grads.entry(id).or_default().entry(worker) {
            std::collections::btree_map::Entry::Vacant(v) => {
                v.insert(grad);
            }
            std::collections::btree_map::Entry::Occupied(mut o) => {
                o.get_mut()
                    .iter_mut()
                    .zip(&grad)
                    .for_each(|(a, b)| *a += *b);
            }
        }
        Ok(())
    }

    /// The parameters of a piece.
    pub fn pull(&mut self, key: &str, offset: u64) -> Result<&[f32]> {
        self.stats.pulls += 1;
        self.pieces
            .get(&(key.to_string(), offset))
            .map(|p| p.params.as_slice())
            .ok_or_else(|| unknown(key, offset))
    }

    /// Registers a worker of `generation` (see [`ClockTable::register`]) and applies what
    /// that completes. A superseded generation is [`Error::Superseded`].
    pub fn register(&mut self, worker: u32, clock: u64, generation: u64) -> Result<u64> {
        let c = self
            .clocks
            .register(worker, clock.max(self.applied), generation)
            .map_err(|e| Error::Superseded(e.to_string()))?;
        self.settle()?;
        Ok(c)
    }

    /// Takes a vacant worker id for a replacement (see [`ClockTable::claim`]): (id,
    /// generation, clock), or `None` when every id below `expected` is live or finished.
    pub fn claim(&mut self, expected: u32) -> Result<Option<(u32, u64, u64)>> {
        let got = self.clocks.claim(expected, self.applied);
        self.settle()?;
        Ok(got)
    }

    /// Moves a worker's clock and applies what that completes. False if it is not live.
    pub fn advance(&mut self, worker: u32, clock: u64) -> Result<bool> {
        if !self.clocks.advance(worker, clock) {
            return Ok(false);
        }
        self.settle()?;
        Ok(true)
    }

    /// Drops a dead worker from the minimum (its id becomes vacant) and applies what that
    /// completes.
    pub fn drop_worker(&mut self, worker: u32) -> Result<bool> {
        let was = self.clocks.drop_worker(worker);
        self.settle()?;
        Ok(was)
    }

    /// Drops a worker that finished from the minimum (its id is not vacant) and applies what
    /// that completes.
    pub fn leave(&mut self, worker: u32) -> Result<bool> {
        let was = self.clocks.leave(worker);
        self.settle()?;
        Ok(was)
    }

    /// Whether a worker at `clock` may go on under bound `s` (the server's when `None`).
    pub fn may_proceed(&mut self, clock: u64, s: Option<u64>) -> bool {
        let s = s.unwrap_or(self.staleness);
        self.clocks.may_proceed(clock, s)
    }

    /// Applies every clock below the slowest live worker's (every pending clock when no
    /// worker is live). Returns how many clocks were applied.
    fn settle(&mut self) -> Result<usize> {
        let upto = self.clocks.min_live();
        let mut n = 0;
        while let Some((&c, _)) = self.pending.first_key_value() {
            if upto.is_some_and(|m| c >= m) {
                break;
            }
            let Some((c, pending)) = self.pending.pop_first() else {
                break;
            };
            self.apply(pending)?;
            self.applied = self.applied.max(c + 1);
            self.stats.clocks_applied += 1;
            n += 1;
        }
        if let Some(m) = upto {
            self.applied = self.applied.max(m);
        }
        Ok(n)
    }

    fn apply(&mut self, pending: Pending) -> Result<()> {
        // Pieces in a fixed order, so that a failure (none expected) is reproducible.
        let mut grads: Vec<_> = pending.grads.into_iter().collect();
        grads.sort_by(|a, b| a.0.cmp(&b.0));
        for (id, by_worker) in grads {
            let Some(piece) = self.pieces.get_mut(&id) else {
                continue;
            };
            let count = by_worker.len();
            let mut it = by_worker.into_values();
            let Some(mut sum) = it.next() else { continue };
            for g in it {
                crate::reduce::add_f32(&mut sum, &g);
            }
            if self.aggregate == Aggregate::Mean && count > 1 {
                let n = count as f32;
                sum.iter_mut().for_each(|x| *x /= n);
            }
            self.optimizer
                .apply(&mut piece.state, &mut piece.params, &sum)?;
            piece.updates += 1;
        }
        Ok(())
    }

    /// Every piece with its state, in (name, offset) order: what a checkpoint saves.
    pub fn snapshot(&self) -> Vec<(PieceId, Piece)> {
        let mut v: Vec<_> = self
            .pieces
            .iter()
            .map(|(k, p)| (k.clone(), p.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Replaces the pieces by those of a checkpoint taken when every clock below `applied`
    /// had been applied. Pending gradients are gone; the clock table holds `workers` (those
    /// live at the checkpoint) at clock `applied` until they register again, so that the
    /// staleness bound still counts them while they reconnect.
    pub fn restore(
        &mut self,
        applied: u64,
        pieces: Vec<(PieceId, Piece)>,
        workers: &[u32],
    ) -> Result<()> {
        for (id, p) in &pieces {
            let fresh = self.optimizer.new_state(p.params.len());
            if std::mem::discriminant(&fresh) != std::mem::discriminant(&p.state) {
                return Err(Error::InvalidArgument(format!(
                    "checkpointed state of {:?}[{}..] is for another optimizer",
                    id.0, id.1
                )));
            }
        }
        self.pieces = pieces.into_iter().collect();
        self.pending.clear();
        self.applied = applied;
        self.clocks = ClockTable::new();
        for &w in workers {
            // A fresh table has no generations to supersede.
            let _ = self.clocks.register(w, applied, 0);
        }
        Ok(())
    }

    /// Number of pieces held.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    /// True when no piece is held.
    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }
}

fn unknown(key: &str, offset: u64) -> Error {
    Error::InvalidArgument(format!(
        "this server holds no piece {key:?}[{offset}..]; was it initialised (worker.init) on this server set?"
    ))
}

#[cfg(test)]
mod tests {
    use super::super::sgd::SgdConfig;
    use super::*;

    fn sgd(lr: f32, momentum: f32) -> Optimizer {
        Optimizer::Sgd(SgdConfig {
            lr,
            momentum,
            weight_decay: 0.0,
            nesterov: false,
        })
    }

    #[test]
    fn a_clock_is_applied_once_every_live_worker_finished_it() {
        let mut s = Store::new(sgd(0.5, 0.0), Aggregate::Mean, 0);
        assert!(s.init("w", 0, vec![1.0, 1.0]));
        assert!(!s.init("w", 0, vec![9.0, 9.0]), "first init wins");
        s.register(0, 0, 0).expect("reg");
        s.register(1, 0, 0).expect("reg");
        s.push(0, 1, 0, "w", 0, vec![2.0, 0.0]).expect("push");
        s.push(1, 1, 0, "w", 0, vec![0.0, 4.0]).expect("push");
        s.push(1, 1, 0, "w", 0, vec![0.0, 4.0])
            .expect("retried push");
        assert_eq!(s.stats().duplicate_pushes, 1);
        s.advance(0, 1).expect("adv");
        assert_eq!(
            s.pull("w", 0).expect("pull"),
            &[1.0, 1.0],
            "worker 1 not done"
        );
        assert!(!s.may_proceed(1, None));
        s.advance(1, 1).expect("adv");
        // mean gradient (1, 2), lr 0.5
        assert_eq!(s.pull("w", 0).expect("pull"), &[0.5, 0.0]);
        assert_eq!(s.applied_through(), 1);
        assert!(s.may_proceed(1, None));
    }

    #[test]
    fn a_push_sent_again_after_its_clock_was_applied_is_not_added_twice() {
        let mut s = Store::new(sgd(1.0, 0.0), Aggregate::Sum, 0);
        s.init("w", 0, vec![0.0]);
        s.register(0, 0, 0).expect("reg");
        s.push(0, 7 << 16, 0, "w", 0, vec![1.0]).expect("push");
        s.advance(0, 1).expect("adv");
        assert_eq!(s.pull("w", 0).expect("pull"), &[-1.0]);
        // its reply was damaged: the same request comes again, clock 0 is long applied
        s.push(0, 7 << 16, 0, "w", 0, vec![1.0]).expect("again");
        s.advance(0, 2).expect("adv");
        assert_eq!(s.pull("w", 0).expect("pull"), &[-1.0], "applied once");
        assert_eq!(s.stats().duplicate_pushes, 1);
    }

    #[test]
    fn a_dead_worker_releases_the_clock_and_late_pushes_fold_forward() {
        let mut s = Store::new(sgd(1.0, 0.0), Aggregate::Sum, 3);
        s.init("w", 0, vec![0.0]);
        for w in 0..3 {
            s.register(w, 0, 0).expect("reg");
        }
        s.push(0, 1, 0, "w", 0, vec![1.0]).expect("push");
        s.push(1, 1, 0, "w", 0, vec![1.0]).expect("push");
        s.advance(0, 1).expect("adv");
        s.advance(1, 1).expect("adv");
        assert_eq!(s.pull("w", 0).expect("pull"), &[0.0]);
        assert!(s.drop_worker(2).expect("drop"));
        assert_eq!(s.pull("w", 0).expect("pull"), &[-2.0]);
        // worker 2 comes back late and pushes for clock 0: it folds into clock 1
        assert_eq!(s.register(2, 0, 0).expect("reg"), 1);
        s.push(2, 7, 0, "w", 0, vec![5.0]).expect("push");
        for w in 0..3 {
            s.advance(w, 2).expect("adv");
        }
        assert_eq!(s.pull("w", 0).expect("pull"), &[-7.0]);
    }

    #[test]
    fn errors_are_typed() {
        let mut s = Store::new(sgd(1.0, 0.0), Aggregate::Mean, 0);
        s.init("w", 0, vec![0.0; 4]);
        assert!(matches!(
            s.push(0, 1, 0, "w", 0, vec![0.0; 3]),
            Err(Error::SpecMismatch(_))
        ));
        assert!(matches!(
            s.push(0, 1, 0, "nope", 0, vec![0.0]),
            Err(Error::InvalidArgument(_))
        ));
        assert!(!s.advance(9, 1).expect("adv"), "unknown worker");
    }

    #[test]
    fn snapshot_and_restore_round_trip() {
        let mut s = Store::new(sgd(0.1, 0.9), Aggregate::Mean, 0);
        s.init("a", 0, vec![1.0, 2.0]);
        s.register(0, 0, 0).expect("reg");
        s.push(0, 1, 0, "a", 0, vec![1.0, 1.0]).expect("push");
        s.advance(0, 1).expect("adv");
        let snap = s.snapshot();
        let mut t = Store::new(sgd(0.1, 0.9), Aggregate::Mean, 0);
        t.restore(s.applied_through(), snap.clone(), &[0, 3])
            .expect("restore");
        assert_eq!(t.snapshot(), snap);
        assert_eq!(t.applied_through(), 1);
        assert_eq!(t.clocks().entries(), vec![(0, 1, true), (3, 1, true)]);
        let mut u = Store::new(Optimizer::Adam(Default::default()), Aggregate::Mean, 0);
        assert!(u.restore(1, snap, &[]).is_err());
    }
}
