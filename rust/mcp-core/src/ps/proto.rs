//! The parameter-server protocol: requests and replies, one pair per bidirectional QUIC
//! stream. Pure encoding, no I/O.
//!
//! Each message is one MCP frame ([`crate::wire::Header`], kind `PsRequest` or `PsReply`):
//! `seq` is the request id, `src` the worker, `aux` the operation code, `chunk` the length
//! of the metadata, the Model-Spec says how the data section is encoded (f32, codec,
//! `[elements]`). The payload is the metadata (below) followed by the data section; its
//! CRC32C covers both, so a flipped bit anywhere is caught.
//!
//! ```text
//! Register  clock generation           -> Clock       (generation: 0, or the claim's)
//! Claim     wait_ms                    -> Claimed worker generation clock
//!                                         (a replacement takes a vacant id; waits for one)
//! Init      key offset   + f32 data    -> Ok
//! Push      clock key offset + data    -> Ok          (data coded with the frame's codec)
//! Pull      key offset len             -> Data applied + f32 data
//! Advance   clock staleness wait_ms    -> Clock       (waits until the SSP bound holds)
//! Step      clock staleness wait_ms n_push (key offset numel bytes)* n_pull (key offset len)*
//!           + the pushes' data         -> Clock + the pulled pieces' f32 data, in order
//!                                         (push, advance and pull in one round trip)
//! Leave                                -> Ok
//! Stats                                -> Stats
//! any                                  -> Error code message
//! ```
//! Integers are little-endian u64; a key is a u16 length and UTF-8 bytes.

use crate::error::{Error, Result};
use std::time::Duration;

/// Longest key.
pub const MAX_KEY: usize = 4096;
/// Longest metadata section.
pub const MAX_META: usize = 64 << 10;

/// What a worker asks a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// Join (or rejoin) at `clock`; waits until the expected workers have joined.
    Register {
        /// The worker's clock.
        clock: u64,
        /// The id's generation this worker holds: 0, or what its [`Request::Claim`] got.
        generation: u64,
    },
    /// A replacement asks for a vacant worker id (one whose worker died, or one never
    /// registered); the server registers it there and answers [`Reply::Claimed`]. Waits up
    /// to `wait` for an id to fall vacant.
    Claim {
        /// How long the server may hold the request before answering `Timeout`.
        wait: Duration,
    },
    /// Create a piece with the data section's values, unless it exists.
    Init {
        /// Tensor name.
        key: String,
        /// First element of the piece.
        offset: u64,
    },
    /// The data section is this worker's gradient of the piece for `clock`.
    Push {
        /// The clock the gradient belongs to.
        clock: u64,
        /// Tensor name.
        key: String,
        /// First element of the piece.
        offset: u64,
    },
    /// Read a piece.
    Pull {
        /// Tensor name.
        key: String,
        /// First element of the piece.
        offset: u64,
        /// Elements expected.
        len: u64,
    },
    /// The worker finished every clock below `clock`; reply once it may go on.
    Advance {
        /// The worker's new clock.
        clock: u64,
        /// Staleness bound for this wait (`Some(0)` for a barrier), else the server's.
        staleness: Option<u64>,
        /// How long the server may hold the request before answering `Timeout`.
        wait: Duration,
    },
    /// Push, advance and pull in one round trip: the data section holds the pushes' data
    /// one after another; the reply's holds the pulled pieces' parameters in order.
    Step {
        /// The worker's new clock (the pushes are for `clock - 1`).
        clock: u64,
        /// Staleness bound for this wait, else the server's.
        staleness: Option<u64>,
        /// How long the server may hold the request.
        wait: Duration,
        /// (key, offset, elements, encoded bytes) of each push.
        pushes: Vec<(String, u64, u64, u64)>,
        /// (key, offset, elements) of each piece to pull once the wait is over.
        pulls: Vec<(String, u64, u64)>,
    },
    /// The worker leaves: drop it from the minimum now.
    Leave,
    /// The server's counters.
    Stats,
}

/// Operation codes.
mod op {
    pub const REGISTER: u32 = 1;
    pub const INIT: u32 = 2;
    pub const PUSH: u32 = 3;
    pub const PULL: u32 = 4;
    pub const ADVANCE: u32 = 5;
    pub const LEAVE: u32 = 6;
    pub const STATS: u32 = 7;
    pub const STEP: u32 = 8;
    pub const CLAIM: u32 = 9;
    pub const R_OK: u32 = 64;
    pub const R_CLOCK: u32 = 65;
    pub const R_DATA: u32 = 66;
    pub const R_STATS: u32 = 67;
    pub const R_ERROR: u32 = 68;
    pub const R_CLAIMED: u32 = 69;
}

/// Why a server refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ErrorCode {
    /// Bad argument (unknown key, wrong length).
    InvalidArgument = 1,
    /// The data does not fit the piece.
    SpecMismatch = 2,
    /// The SSP condition did not hold in time.
    Timeout = 3,
    /// The worker is not live here (never registered, or dropped as dead): register again.
    NotLive = 4,
    /// The request was not valid protocol.
    Protocol = 5,
    /// The server is shutting down.
    Closed = 6,
    /// Anything else.
    Other = 7,
    /// A replacement holds the worker's id now.
    Superseded = 8,
    /// The request failed its checksum: send it again.
    Damaged = 9,
}

impl ErrorCode {
    fn from_code(c: u8) -> ErrorCode {
        use ErrorCode::*;
        [
            InvalidArgument,
            SpecMismatch,
            Timeout,
            NotLive,
            Protocol,
            Closed,
            Superseded,
            Damaged,
        ]
        .into_iter()
        .find(|k| *k as u8 == c)
        .unwrap_or(Other)
    }

    /// The code of a core error.
    pub fn of(e: &Error) -> ErrorCode {
        match e {
            Error::InvalidArgument(_) | Error::WrongDType(_) | Error::UnknownName(_) => {
                ErrorCode::InvalidArgument
            }
            Error::SpecMismatch(_) => ErrorCode::SpecMismatch,
            Error::Timeout { .. } => ErrorCode::Timeout,
            Error::Protocol(_) => ErrorCode::Protocol,
            Error::Closed(_) => ErrorCode::Closed,
            Error::Superseded(_) => ErrorCode::Superseded,
            Error::Damaged(_) => ErrorCode::Damaged,
            _ => ErrorCode::Other,
        }
    }
}

/// What a server answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Done.
    Ok,
    /// The worker's clock here, the slowest live clock and the applied clock.
    Clock {
        /// The worker's clock as the server has it.
        clock: u64,
        /// The slowest live worker's clock (`None`: none live).
        min: Option<u64>,
        /// Every clock below this one has been applied.
        applied: u64,
    },
    /// A piece's parameters follow in the data section.
    Data {
        /// Every clock below this one had been applied when they were read.
        applied: u64,
    },
    /// Counters by name.
    Stats(Vec<(String, u64)>),
    /// The vacant id a [`Request::Claim`] took, registered live.
    Claimed {
        /// The worker id (and with it the data shard) the replacement takes over.
        worker: u32,
        /// Its generation: registrations of older ones are refused from now on.
        generation: u64,
        /// The clock it starts at.
        clock: u64,
    },
    /// Refused.
    Error {
        /// Why.
        code: ErrorCode,
        /// What the server said.
        message: String,
    },
}

impl Reply {
    /// The core error a refusal means.
    pub fn into_error(code: ErrorCode, message: String, server: &str) -> Error {
        let m = format!("parameter server {server}: {message}");
        match code {
            ErrorCode::InvalidArgument => Error::InvalidArgument(m),
            ErrorCode::SpecMismatch => Error::SpecMismatch(m),
            ErrorCode::Timeout => Error::Timeout {
                what: m,
                after: Duration::ZERO,
            },
            ErrorCode::Protocol => Error::Protocol(m),
            ErrorCode::Closed => Error::Closed(m),
            ErrorCode::Superseded => Error::Superseded(m),
            ErrorCode::Damaged => Error::Damaged(m),
            ErrorCode::NotLive | ErrorCode::Other => Error::Io(m),
        }
    }
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// The `clock staleness wait_ms` fields of Advance and Step (no bound: `u64::MAX`).
fn put_clock_wait(out: &mut Vec<u8>, clock: u64, staleness: Option<u64>, wait: Duration) {
    put_u64(out, clock);
    put_u64(out, staleness.unwrap_or(u64::MAX));
    put_u64(out, wait.as_millis().min(u64::MAX as u128) as u64);
}

fn put_key(out: &mut Vec<u8>, k: &str) -> Result<()> {
    if k.len() > MAX_KEY {
        return Err(Error::InvalidArgument(format!(
            "tensor names are at most {MAX_KEY} bytes, got {}",
            k.len()
        )));
    }
    out.extend_from_slice(&(k.len() as u16).to_le_bytes());
    out.extend_from_slice(k.as_bytes());
    Ok(())
}

/// Reads metadata fields, failing (never panicking) on short or bad input.
struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(Error::Protocol("parameter-server message truncated".into()));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }

    fn u64(&mut self) -> Result<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }

    /// Inverse of [`put_clock_wait`].
    fn clock_wait(&mut self) -> Result<(u64, Option<u64>, Duration)> {
        let clock = self.u64()?;
        let staleness = Some(self.u64()?).filter(|&s| s != u64::MAX);
        Ok((clock, staleness, Duration::from_millis(self.u64()?)))
    }

    fn u16(&mut self) -> Result<u16> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(a))
    }

    fn string(&mut self) -> Result<String> {
        let n = self.u16()? as usize;
        let s = self.take(n)?;
        String::from_utf8(s.to_vec())
            .map_err(|_| Error::Protocol("a key is not valid UTF-8".into()))
    }

    fn end(&self) -> Result<()> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(Error::Protocol(format!(
                "{} unexpected bytes after a parameter-server message",
                self.b.len()
            )))
        }
    }
}

impl Request {
    /// The operation code (the header's `aux`).
    pub fn op(&self) -> u32 {
        match self {
            Request::Register { .. } => op::REGISTER,
            Request::Claim { .. } => op::CLAIM,
            Request::Init { .. } => op::INIT,
            Request::Push { .. } => op::PUSH,
            Request::Pull { .. } => op::PULL,
            Request::Advance { .. } => op::ADVANCE,
            Request::Step { .. } => op::STEP,
            Request::Leave => op::LEAVE,
            Request::Stats => op::STATS,
        }
    }

    /// A short name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Register { .. } => "register",
            Request::Claim { .. } => "claim",
            Request::Init { .. } => "init",
            Request::Push { .. } => "push",
            Request::Pull { .. } => "pull",
            Request::Advance { .. } => "advance",
            Request::Step { .. } => "step",
            Request::Leave => "leave",
            Request::Stats => "stats",
        }
    }

    /// Appends the metadata.
    pub fn encode_meta(&self, out: &mut Vec<u8>) -> Result<()> {
        match self {
            Request::Register { clock, generation } => {
                put_u64(out, *clock);
                put_u64(out, *generation);
            }
            Request::Claim { wait } => {
                put_u64(out, wait.as_millis().min(u64::MAX as u128) as u64);
            }
            Request::Init { key, offset } => {
                put_key(out, key)?;
                put_u64(out, *offset);
            }
            Request::Push { clock, key, offset } => {
                put_u64(out, *clock);
                put_key(out, key)?;
                put_u64(out, *offset);
            }
            Request::Pull { key, offset, len } => {
                put_key(out, key)?;
                put_u64(out, *offset);
                put_u64(out, *len);
            }
            Request::Advance {
                clock,
                staleness,
                wait,
            } => {
                put_clock_wait(out, *clock, *staleness, *wait);
            }
            Request::Step {
                clock,
                staleness,
                wait,
                pushes,
                pulls,
            } => {
                put_clock_wait(out, *clock, *staleness, *wait);
                put_u64(out, pushes.len() as u64);
                for (k, off, n, b) in pushes {
                    put_key(out, k)?;
                    put_u64(out, *off);
                    put_u64(out, *n);
                    put_u64(out, *b);
                }
                put_u64(out, pulls.len() as u64);
                for (k, off, n) in pulls {
                    put_key(out, k)?;
                    put_u64(out, *off);
                    put_u64(out, *n);
                }
                if out.len() > MAX_META {
                    return Err(Error::InvalidArgument(format!(
                        "a step request of {} pieces needs {} bytes of metadata, more than {MAX_META}",
                        pushes.len() + pulls.len(),
                        out.len()
                    )));
                }
            }
            Request::Leave | Request::Stats => {}
        }
        Ok(())
    }

    /// Decodes the metadata of operation `op`.
    pub fn decode(op: u32, meta: &[u8]) -> Result<Request> {
        let mut r = Reader { b: meta };
        let req = match op {
            op::REGISTER => Request::Register {
                clock: r.u64()?,
                generation: r.u64()?,
            },
            op::CLAIM => Request::Claim {
                wait: Duration::from_millis(r.u64()?),
            },
            op::INIT => Request::Init {
                key: r.string()?,
                offset: r.u64()?,
            },
            op::PUSH => Request::Push {
                clock: r.u64()?,
                key: r.string()?,
                offset: r.u64()?,
            },
            op::PULL => Request::Pull {
                key: r.string()?,
                offset: r.u64()?,
                len: r.u64()?,
            },
            op::ADVANCE => {
                let (clock, staleness, wait) = r.clock_wait()?;
                Request::Advance {
                    clock,
                    staleness,
                    wait,
                }
            }
            op::STEP => {
                let (clock, staleness, wait) = r.clock_wait()?;
                let n = r.u64()?;
                // every entry takes at least 26 bytes: bound the count by what is there
                if n > (meta.len() / 26) as u64 {
                    return Err(Error::Protocol(format!("step announces {n} pushes")));
                }
                let mut pushes = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    pushes.push((r.string()?, r.u64()?, r.u64()?, r.u64()?));
                }
                let n = r.u64()?;
                if n > (meta.len() / 18) as u64 {
                    return Err(Error::Protocol(format!("step announces {n} pulls")));
                }
                let mut pulls = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    pulls.push((r.string()?, r.u64()?, r.u64()?));
                }
                Request::Step {
                    clock,
                    staleness,
                    wait,
                    pushes,
                    pulls,
                }
            }
            op::LEAVE => Request::Leave,
            op::STATS => Request::Stats,
            other => {
                return Err(Error::Protocol(format!(
                    "unknown parameter-server operation {other}"
                )))
            }
        };
        r.end()?;
        Ok(req)
    }
}

impl Reply {
    /// The operation code (the header's `aux`).
    pub fn op(&self) -> u32 {
        match self {
            Reply::Ok => op::R_OK,
            Reply::Clock { .. } => op::R_CLOCK,
            Reply::Data { .. } => op::R_DATA,
            Reply::Stats(_) => op::R_STATS,
            Reply::Claimed { .. } => op::R_CLAIMED,
            Reply::Error { .. } => op::R_ERROR,
        }
    }

    /// Appends the metadata.
    pub fn encode_meta(&self, out: &mut Vec<u8>) -> Result<()> {
        match self {
            Reply::Ok => {}
            Reply::Clock {
                clock,
                min,
                applied,
            } => {
                put_u64(out, *clock);
                put_u64(out, min.unwrap_or(u64::MAX));
                put_u64(out, *applied);
            }
            Reply::Data { applied } => put_u64(out, *applied),
            Reply::Claimed {
                worker,
                generation,
                clock,
            } => {
                put_u64(out, u64::from(*worker));
                put_u64(out, *generation);
                put_u64(out, *clock);
            }
            Reply::Stats(kv) => {
                out.extend_from_slice(&(kv.len().min(u16::MAX as usize) as u16).to_le_bytes());
                for (k, v) in kv.iter().take(u16::MAX as usize) {
                    put_key(out, k)?;
                    put_u64(out, *v);
                }
            }
            Reply::Error { code, message } => {
                out.push(*code as u8);
                let mut m = message.as_str();
                while m.len() > MAX_KEY {
                    // cut at a character boundary
                    let mut cut = MAX_KEY;
                    while !m.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    m = &m[..cut];
                }
                put_key(out, m)?;
            }
        }
        Ok(())
    }

    /// Decodes the metadata of reply code `op`.
    pub fn decode(op: u32, meta: &[u8]) -> Result<Reply> {
        let mut r = Reader { b: meta };
        let rep = match op {
            op::R_OK => Reply::Ok,
            op::R_CLOCK => Reply::Clock {
                clock: r.u64()?,
                min: Some(r.u64()?).filter(|&m| m != u64::MAX),
                applied: r.u64()?,
            },
            op::R_DATA => Reply::Data { applied: r.u64()? },
            op::R_CLAIMED => Reply::Claimed {
                worker: u32::try_from(r.u64()?)
                    .map_err(|_| Error::Protocol("claimed worker id out of range".into()))?,
                generation: r.u64()?,
                clock: r.u64()?,
            },
            op::R_STATS => {
                let n = r.u16()? as usize;
                let mut kv = Vec::with_capacity(n);
                for _ in 0..n {
                    kv.push((r.string()?, r.u64()?));
                }
                Reply::Stats(kv)
            }
            op::R_ERROR => {
                let code = ErrorCode::from_code(r.take(1)?[0]);
                Reply::Error {
                    code,
                    message: r.string()?,
                }
            }
            other => {
                return Err(Error::Protocol(format!(
                    "unknown parameter-server reply {other}"
                )))
            }
        };
        r.end()?;
        Ok(rep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn requests() -> Vec<Request> {
        vec![
            Request::Register {
                clock: 7,
                generation: 2,
            },
            Request::Claim {
                wait: Duration::from_millis(2500),
            },
            Request::Init {
                key: "layer.0.weight".into(),
                offset: 4096,
            },
            Request::Push {
                clock: 3,
                key: "b".into(),
                offset: 0,
            },
            Request::Pull {
                key: "ü".into(),
                offset: 1,
                len: 2,
            },
            Request::Advance {
                clock: 9,
                staleness: Some(0),
                wait: Duration::from_millis(1500),
            },
            Request::Advance {
                clock: 9,
                staleness: None,
                wait: Duration::from_millis(1),
            },
            Request::Step {
                clock: 4,
                staleness: None,
                wait: Duration::from_millis(9),
                pushes: vec![("a".into(), 0, 10, 40), ("b".into(), 16, 3, 12)],
                pulls: vec![("a".into(), 0, 10)],
            },
            Request::Leave,
            Request::Stats,
        ]
    }

    #[test]
    fn requests_round_trip() {
        for r in requests() {
            let mut m = Vec::new();
            r.encode_meta(&mut m).expect("encode");
            assert_eq!(Request::decode(r.op(), &m).expect("decode"), r);
            if !m.is_empty() {
                assert!(Request::decode(r.op(), &m[..m.len() - 1]).is_err());
            }
        }
    }

    #[test]
    fn replies_round_trip() {
        for r in [
            Reply::Ok,
            Reply::Clock {
                clock: 4,
                min: None,
                applied: 2,
            },
            Reply::Clock {
                clock: 4,
                min: Some(3),
                applied: 2,
            },
            Reply::Data { applied: 11 },
            Reply::Stats(vec![("pushes".into(), 5), ("pulls".into(), 6)]),
            Reply::Error {
                code: ErrorCode::NotLive,
                message: "register again".into(),
            },
            Reply::Claimed {
                worker: 3,
                generation: 1,
                clock: 17,
            },
            Reply::Error {
                code: ErrorCode::Superseded,
                message: "taken over".into(),
            },
        ] {
            let mut m = Vec::new();
            r.encode_meta(&mut m).expect("encode");
            assert_eq!(Reply::decode(r.op(), &m).expect("decode"), r);
        }
    }

    #[test]
    fn long_keys_are_refused() {
        let r = Request::Pull {
            key: "k".repeat(MAX_KEY + 1),
            offset: 0,
            len: 0,
        };
        assert!(matches!(
            r.encode_meta(&mut Vec::new()),
            Err(Error::InvalidArgument(_))
        ));
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(op in 0u32..80, bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Request::decode(op, &bytes);
            let _ = Reply::decode(op, &bytes);
        }
    }
}
