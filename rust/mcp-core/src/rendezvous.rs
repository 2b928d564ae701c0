//! Meeting the other ranks of a fixed-size job, as a state machine without I/O.
//!
//! Every rank sends rank 0 a Hello carrying its [`Entry`] (where it listens, its host, its
//! process, whether it takes shared memory, the model it declares); rank 0 collects them in
//! [`Gathering`], in whatever order they come, and once every rank has spoken sends each the
//! [`Table`] of all entries. A rank that starts with another world size fails the job at
//! once, naming both sizes; ranks that never come fail it at the deadline, naming exactly
//! those that are missing.
//!
//! The QUIC transport and the simulator drive the same machine
//! ([`crate::transport::meeting`]): inputs and `now` in, verdicts out, the deadline as data.

use crate::error::{Error, Result};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// One rank's line of the rendezvous table: `<addr> <host id> <pid> <shm 0|1> <model>`, the
/// model as the hex of its declaration's canonical text, `-` for none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Where the rank's endpoint listens.
    pub addr: SocketAddr,
    /// Its host identity (see [`crate::transport::host`]).
    pub host: String,
    /// Its process id (checked against the credentials of its shared-memory socket).
    pub pid: u32,
    /// Whether it takes shared memory with the ranks of its host.
    pub shm: bool,
    /// The model it declares (canonical text), if any.
    pub model: Option<String>,
}

/// The longest declaration the table carries, in bytes of canonical text.
const MAX_MODEL_TEXT: usize = crate::model_decl::MAX_TEXT;

fn hex(text: &str) -> String {
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

fn unhex(h: &str) -> Option<String> {
    if !h.len().is_multiple_of(2) || h.len() > 2 * MAX_MODEL_TEXT {
        return None;
    }
    let bytes = (0..h.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(h.get(i..i + 2)?, 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}

impl Entry {
    /// The entry as one line of text (no newline).
    pub fn to_line(&self) -> String {
        format!(
            "{} {} {} {} {}",
            self.addr,
            self.host,
            self.pid,
            u8::from(self.shm),
            self.model.as_deref().map_or_else(|| "-".to_string(), hex)
        )
    }

    /// Reads rank `rank`'s line; anything malformed is a protocol error naming the rank.
    pub fn parse(rank: usize, line: &str) -> Result<Entry> {
        let bad = || {
            Error::Protocol(format!(
                "rank {rank}'s rendezvous entry {line:?} is not `<address> <host id> <pid> <shm> <model>`"
            ))
        };
        let mut f = line.split(' ');
        let (Some(a), Some(h), Some(p), Some(s), Some(m), None) =
            (f.next(), f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            return Err(bad());
        };
        let addr: SocketAddr = a.parse().map_err(|_| {
            Error::Protocol(format!(
                "rank {rank}'s address {a:?} is not a socket address"
            ))
        })?;
        crate::transport::host::check_host_id(h).map_err(|_| bad())?;
        Ok(Entry {
            addr,
            host: h.to_string(),
            pid: p.parse().map_err(|_| bad())?,
            shm: match s {
                "0" => false,
                "1" => true,
                _ => return Err(bad()),
            },
            model: match m {
                "-" => None,
                h => Some(unhex(h).ok_or_else(bad)?),
            },
        })
    }
}

/// Every rank's entry, in rank order: what rank 0 sends each rank when all have met.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    entries: Vec<Entry>,
}

impl Table {
    /// A table of `entries` (rank order). Ranks that declare different models are refused
    /// with `SpecMismatch`, naming both declarations.
    pub fn new(entries: Vec<Entry>) -> Result<Table> {
        let models: Vec<Option<String>> = entries.iter().map(|e| e.model.clone()).collect();
        crate::model_decl::check_same(&models)?;
        Ok(Table { entries })
    }

    /// The entries, in rank order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The table's wire form: one line per rank, joined by newlines.
    pub fn encode(&self) -> Vec<u8> {
        let lines: Vec<String> = self.entries.iter().map(Entry::to_line).collect();
        lines.join("\n").into_bytes()
    }

    /// Reads a table sent by rank 0 for a world of `world` ranks.
    pub fn decode(bytes: &[u8], world: usize) -> Result<Table> {
        let text = std::str::from_utf8(bytes).map_err(|_| {
            Error::Protocol("rank 0 sent an address table that is not UTF-8".into())
        })?;
        let lines: Vec<&str> = text.split('\n').collect();
        if lines.len() != world {
            return Err(Error::Protocol(format!(
                "rank 0 sent {} addresses for a world of {world}",
                lines.len()
            )));
        }
        let entries = lines
            .iter()
            .enumerate()
            .map(|(r, l)| Entry::parse(r, l))
            .collect::<Result<Vec<Entry>>>()?;
        Table::new(entries)
    }
}

/// What a Hello did to the rendezvous.
#[derive(Debug, Clone, PartialEq)]
pub enum Heard {
    /// The rank is entered; others are still missing.
    Waiting,
    /// The rank was the last one: every rank has spoken, send each the table.
    Complete(Table),
    /// A second Hello of a rank already entered, with the same entry (a resend after a
    /// reconnection): nothing changes.
    Repeated,
    /// The Hello cannot belong to this job; the rendezvous has failed with this error
    /// (the driver tells the sender why before it fails).
    Refused(Error),
    /// Every rank has spoken but the table cannot stand (ranks declare different models):
    /// the rendezvous has failed for every rank alike.
    Failed(Error),
}

/// Rank 0's side of the rendezvous: the entries heard so far and the deadline.
#[derive(Debug)]
pub struct Gathering {
    world: usize,
    entries: Vec<Option<Entry>>,
    heard: usize,
    deadline: Instant,
    timeout: Duration,
    /// Where the other ranks were told to meet (for the timeout's message).
    master: String,
    failed: Option<Error>,
}

impl Gathering {
    /// A rendezvous of `world` ranks, rank 0's own entry `own`, given up at `deadline`
    /// (`timeout` after it started, for the error's message); `master` is the address the
    /// others dial (named in errors).
    pub fn new(
        world: usize,
        own: Entry,
        deadline: Instant,
        timeout: Duration,
        master: &str,
    ) -> Result<Gathering> {
        if world == 0 {
            return Err(Error::InvalidArgument(
                "a rendezvous needs at least one rank".into(),
            ));
        }
        let mut entries = vec![None; world];
        entries[0] = Some(own);
        Ok(Gathering {
            world,
            entries,
            heard: 1,
            deadline,
            timeout,
            master: master.to_string(),
            failed: None,
        })
    }

    /// The table at once when rank 0 is alone.
    pub fn table_if_complete(&self) -> Result<Option<Table>> {
        if self.heard < self.world {
            return Ok(None);
        }
        let entries = self.entries.iter().flatten().cloned().collect();
        Table::new(entries).map(Some)
    }

    /// The Hello of `rank`, which says it was started with `world` ranks, with its entry
    /// `line`.
    pub fn on_hello(&mut self, rank: usize, world: usize, line: &str) -> Heard {
        if let Some(e) = &self.failed {
            return Heard::Failed(e.clone());
        }
        if world != self.world {
            return self.fail(Error::InvalidArgument(format!(
                "rank {rank} was started with world_size {world} but rank 0 with {}",
                self.world
            )));
        }
        if rank == 0 || rank >= self.world {
            return self.fail(Error::InvalidArgument(format!(
                "a process claims rank {rank} in a world of {} ranks (ranks 1 to {} dial rank 0)",
                self.world,
                self.world - 1
            )));
        }
        let entry = match Entry::parse(rank, line) {
            Ok(e) => e,
            Err(e) => return self.fail(e),
        };
        match &self.entries[rank] {
            Some(old) if *old == entry => return Heard::Repeated,
            Some(old) => {
                return self.fail(Error::InvalidArgument(format!(
                    "two processes claim rank {rank}: {} (pid {}) and {} (pid {}); give each process its own RANK",
                    old.addr, old.pid, entry.addr, entry.pid
                )))
            }
            None => {}
        }
        self.entries[rank] = Some(entry);
        self.heard += 1;
        match self.table_if_complete() {
            Ok(Some(t)) => Heard::Complete(t),
            Ok(None) => Heard::Waiting,
            Err(e) => {
                self.failed = Some(e.clone());
                Heard::Failed(e)
            }
        }
    }

    fn fail(&mut self, e: Error) -> Heard {
        self.failed = Some(e.clone());
        Heard::Refused(e)
    }

    /// The ranks not heard from yet.
    pub fn missing(&self) -> Vec<usize> {
        (0..self.world)
            .filter(|&r| self.entries[r].is_none())
            .collect()
    }

    /// When the rendezvous is given up.
    pub fn poll_timeout(&self) -> Instant {
        self.deadline
    }

    /// Time has passed: past the deadline with ranks missing, the error that names them.
    pub fn handle_timeout(&mut self, now: Instant) -> Option<Error> {
        let missing = self.missing();
        if now < self.deadline || missing.is_empty() {
            return None;
        }
        let e = Error::Timeout {
            what: format!(
                "rendezvous at {}: ranks {missing:?} of {} never arrived (check WORLD_SIZE, MASTER_ADDR/MASTER_PORT and that every rank was started)",
                self.master, self.world
            ),
            after: self.timeout,
        };
        self.failed = Some(e.clone());
        Some(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(i: u16) -> Entry {
        Entry {
            addr: SocketAddr::from(([10, 0, 0, 2], 4000 + i)),
            host: "node/netns:4026531840/boot:abc".into(),
            pid: 4242 + u32::from(i),
            shm: i.is_multiple_of(2),
            model: None,
        }
    }

    #[test]
    fn entries_round_trip_and_bad_ones_are_protocol_errors() {
        let e = entry(0);
        assert_eq!(Entry::parse(3, &e.to_line()).expect("parse"), e);
        let m = Entry {
            model: Some("arch \"GPT-3\", precision bfloat16, input [x:int32[b, s]]".into()),
            ..e.clone()
        };
        assert_eq!(Entry::parse(3, &m.to_line()).expect("parse"), m);
        for bad in [
            "",
            "10.0.0.2:4000",
            "10.0.0.2:4000 h 12 1",
            "10.0.0.2:4000 h 12 1 - extra",
            "nonsense h 12 1 -",
            "10.0.0.2:4000 h pid 1 -",
            "10.0.0.2:4000 h 12 2 -",
            "10.0.0.2:4000  12 1 -",
            "10.0.0.2:4000 h 12 1 abc",
            "10.0.0.2:4000 h 12 1 zz",
            "10.0.0.2:4000 h 12 1 ff",
        ] {
            assert!(
                matches!(Entry::parse(1, bad), Err(Error::Protocol(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn hellos_in_any_order_complete_the_table_once() {
        let t0 = Instant::now();
        let mut g = Gathering::new(
            4,
            entry(0),
            t0 + Duration::from_secs(5),
            Duration::from_secs(5),
            "m:1",
        )
        .expect("gathering");
        assert_eq!(g.table_if_complete().expect("no error"), None);
        assert_eq!(g.on_hello(3, 4, &entry(3).to_line()), Heard::Waiting);
        assert_eq!(g.on_hello(1, 4, &entry(1).to_line()), Heard::Waiting);
        assert_eq!(g.on_hello(3, 4, &entry(3).to_line()), Heard::Repeated);
        assert_eq!(g.missing(), vec![2]);
        let Heard::Complete(t) = g.on_hello(2, 4, &entry(2).to_line()) else {
            panic!("not complete")
        };
        assert_eq!(t.entries(), &[entry(0), entry(1), entry(2), entry(3)]);
        assert_eq!(Table::decode(&t.encode(), 4).expect("decodes"), t);
        assert_eq!(g.handle_timeout(t0 + Duration::from_secs(60)), None);

        let alone = Gathering::new(1, entry(0), t0, Duration::from_secs(5), "m:1").expect("one");
        assert_eq!(
            alone
                .table_if_complete()
                .expect("no error")
                .map(|t| t.entries().len()),
            Some(1)
        );
    }

    #[test]
    fn the_timeout_names_exactly_the_ranks_that_never_came() {
        let t0 = Instant::now();
        let limit = Duration::from_secs(5);
        let mut g =
            Gathering::new(5, entry(0), t0 + limit, limit, "10.0.0.1:29500").expect("gathering");
        assert_eq!(g.on_hello(2, 5, &entry(2).to_line()), Heard::Waiting);
        assert_eq!(g.on_hello(4, 5, &entry(4).to_line()), Heard::Waiting);
        assert_eq!(g.poll_timeout(), t0 + limit);
        assert_eq!(
            g.handle_timeout(t0 + limit - Duration::from_millis(1)),
            None
        );
        match g.handle_timeout(t0 + limit) {
            Some(Error::Timeout { what, after }) => {
                assert!(what.contains("ranks [1, 3] of 5 never arrived"), "{what}");
                assert!(what.contains("10.0.0.1:29500"), "{what}");
                assert_eq!(after, limit);
            }
            other => panic!("{other:?}"),
        }
        // A late Hello cannot revive a rendezvous that has failed.
        assert!(matches!(
            g.on_hello(1, 5, &entry(1).to_line()),
            Heard::Failed(Error::Timeout { .. })
        ));
    }

    #[test]
    fn hellos_that_cannot_belong_to_the_job_fail_it() {
        let t0 = Instant::now();
        let new = || {
            Gathering::new(
                3,
                entry(0),
                t0 + Duration::from_secs(5),
                Duration::from_secs(5),
                "m:1",
            )
            .expect("g")
        };
        let refused = |h: Heard| match h {
            Heard::Refused(e) => e.to_string(),
            other => panic!("{other:?}"),
        };
        let msg = refused(new().on_hello(1, 4, &entry(1).to_line()));
        assert!(msg.contains("world_size 4 but rank 0 with 3"), "{msg}");
        let msg = refused(new().on_hello(3, 3, &entry(1).to_line()));
        assert!(msg.contains("claims rank 3"), "{msg}");
        let msg = refused(new().on_hello(0, 3, &entry(1).to_line()));
        assert!(msg.contains("claims rank 0"), "{msg}");
        assert!(matches!(
            new().on_hello(1, 3, "nonsense"),
            Heard::Refused(Error::Protocol(_))
        ));
        let mut g = new();
        assert_eq!(g.on_hello(1, 3, &entry(1).to_line()), Heard::Waiting);
        let msg = refused(g.on_hello(1, 3, &entry(2).to_line()));
        assert!(msg.contains("two processes claim rank 1"), "{msg}");
        // Failed for good: the next rank's Hello gets the same error.
        match g.on_hello(2, 3, &entry(2).to_line()) {
            Heard::Failed(e) => assert_eq!(e.to_string(), msg),
            other => panic!("{other:?}"),
        }

        // Declarations that differ fail the table for every rank (no one Hello is to blame),
        // naming both.
        let mut g = new();
        let declared = Entry {
            model: Some("arch \"a\", precision float32".into()),
            ..entry(1)
        };
        assert_eq!(g.on_hello(1, 3, &declared.to_line()), Heard::Waiting);
        assert!(matches!(
            g.on_hello(2, 3, &entry(2).to_line()),
            Heard::Failed(Error::SpecMismatch(_))
        ));
    }

    #[test]
    fn a_table_of_another_size_or_shape_is_refused() {
        let t = Table::new(vec![entry(0), entry(1)]).expect("table");
        assert!(matches!(
            Table::decode(&t.encode(), 3),
            Err(Error::Protocol(_))
        ));
        assert!(matches!(
            Table::decode(b"\xff\xfe", 1),
            Err(Error::Protocol(_))
        ));
        assert!(matches!(
            Table::decode(b"10.0.0.2:4000 h 12 1 -\nbad", 2),
            Err(Error::Protocol(_))
        ));
    }
}
