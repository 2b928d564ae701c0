//! The messages between members and the coordinator: one request and one reply per QUIC
//! bidirectional stream, each framed as `"MCPM"`, a u32 body length, the body and its CRC32C
//! (all little-endian). Decoding checks every length against what is there.

use super::change::EpochChange;
use super::coordinator::Beat;
use super::{Epoch, Member, MemberId, Step};
use crate::error::{Error, Result};

/// Magic of a membership message.
pub const MAGIC: &[u8; 4] = b"MCPM";
/// Largest body accepted (a spec of a very large model, or an epoch of a million members).
pub const MAX_BODY: usize = 64 << 20;

/// A member's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// First message on every connection: who, its training state's spec, its epoch.
    Register {
        /// The member.
        id: MemberId,
        /// Names, dtypes and shapes of its state, `;`-separated.
        spec: String,
        /// The epoch it runs in, if any.
        view: Option<Epoch>,
    },
    /// Alive, with `step` committed.
    Heartbeat {
        /// The member.
        id: MemberId,
        /// Steps committed.
        step: Step,
    },
    /// Waits (up to `wait_ms`) for an epoch newer than `seen`.
    Report {
        /// The member.
        id: MemberId,
        /// The newest epoch it knows.
        seen: u64,
        /// Steps committed ([`super::NO_STATE`] for none).
        step: Step,
        /// How long the coordinator may hold the answer.
        wait_ms: u32,
        /// The epoch whose members it holds (number, incarnation): the answer may be the
        /// change from it.
        holds: Option<(u64, u64)>,
    },
    /// Rank 0 of `epoch` listens at `addr`.
    PublishMaster {
        /// The member.
        id: MemberId,
        /// The epoch.
        epoch: u64,
        /// `host:port`.
        addr: String,
    },
    /// Where rank 0 of `epoch` listens (waits up to `wait_ms`).
    Master {
        /// The epoch.
        epoch: u64,
        /// How long the coordinator may hold the answer.
        wait_ms: u32,
    },
    /// Answered (with a [`Reply::Beat`]) as soon as `epoch` ends, or after `wait_ms`: the
    /// member hears of a death without waiting for its next heartbeat.
    Watch {
        /// The member.
        id: MemberId,
        /// The epoch it runs in.
        epoch: u64,
        /// How long the coordinator may hold the answer.
        wait_ms: u32,
    },
    /// The member leaves the job.
    Leave {
        /// The member.
        id: MemberId,
    },
}

/// The coordinator's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Done.
    Ok,
    /// Refused, with the reason (a spec that is not the job's).
    Refused(String),
    /// The answer to a heartbeat.
    Beat(Beat),
    /// The epoch the member waited for.
    Formed(Epoch),
    /// The epoch the member waited for, as the change from the one it holds.
    Changed(EpochChange),
    /// Not yet: ask again.
    Waiting,
    /// The coordinator lost the member's report: register and report again.
    Unknown,
    /// Rank 0's address.
    MasterAt(String),
    /// The epoch asked about was superseded.
    Superseded,
    /// Registered. The member connects over TCP to the coordinator's port and sends
    /// `token`: while that connection stays open the process lives (the kernel closes it
    /// when the process exits, however it exits).
    Welcome {
        /// Names this registration on the tether.
        token: [u8; 16],
        /// Whether the coordinator listens for tethers.
        tether: bool,
    },
}

struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.extend_from_slice(s.as_bytes());
    }
    fn epoch(&mut self, e: &Epoch) {
        self.u64(e.number);
        self.u64(e.incarnation);
        self.u32(e.members.len() as u32);
        for m in &e.members {
            self.u64(m.id);
            self.i64(m.step);
        }
    }
}

struct R<'a>(&'a [u8]);

fn short(what: &str) -> Error {
    Error::Protocol(format!("membership message ends inside its {what}"))
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(short(what));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn i64(&mut self, what: &str) -> Result<i64> {
        Ok(self.u64(what)? as i64)
    }
    fn str(&mut self, what: &str) -> Result<String> {
        let n = self.u32(what)? as usize;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec())
            .map_err(|_| Error::Protocol(format!("membership message: {what} is not UTF-8")))
    }
    fn epoch(&mut self) -> Result<Epoch> {
        let number = self.u64("epoch")?;
        let incarnation = self.u64("epoch")?;
        let n = self.u32("epoch")? as usize;
        if n > self.0.len() / 16 {
            return Err(short("member list"));
        }
        let mut members = Vec::with_capacity(n);
        for _ in 0..n {
            members.push(Member {
                id: self.u64("member list")?,
                step: self.i64("member list")?,
            });
        }
        Ok(Epoch {
            number,
            incarnation,
            members,
        })
    }
    /// A count of items of `size` bytes each that the rest of the message can hold.
    fn count(&mut self, size: usize, what: &str) -> Result<usize> {
        let n = self.u32(what)? as usize;
        if n > self.0.len() / size {
            return Err(short(what));
        }
        Ok(n)
    }
    fn change(&mut self) -> Result<EpochChange> {
        let base = self.u64("epoch change")?;
        let number = self.u64("epoch change")?;
        let incarnation = self.u64("epoch change")?;
        let n = self.count(4, "ranks that left")?;
        let left = (0..n)
            .map(|_| self.u32("ranks that left"))
            .collect::<Result<_>>()?;
        let n = self.count(8, "members that came")?;
        let came = (0..n)
            .map(|_| self.u64("members that came"))
            .collect::<Result<_>>()?;
        let n = self.count(12, "steps")?;
        let steps = (0..n)
            .map(|_| Ok((self.i64("steps")?, self.u32("steps")?)))
            .collect::<Result<_>>()?;
        Ok(EpochChange {
            base,
            number,
            incarnation,
            left,
            came,
            steps,
        })
    }
    fn end(&self) -> Result<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Error::Protocol(format!(
                "membership message has {} bytes past its end",
                self.0.len()
            )))
        }
    }
}

fn frame(body: W) -> Vec<u8> {
    let body = body.0;
    let mut out = Vec::with_capacity(body.len() + 12);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
    out
}

/// The body of a framed message, checked.
fn unframe(buf: &[u8]) -> Result<&[u8]> {
    if buf.len() < 12 || &buf[..4] != MAGIC {
        return Err(Error::Protocol(
            "not a membership message (is this address an mcp-coordinator?)".into(),
        ));
    }
    let n = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
    if n > MAX_BODY || buf.len() != n + 12 {
        return Err(Error::Protocol(format!(
            "membership message announces {n} bytes and has {}",
            buf.len().saturating_sub(12)
        )));
    }
    let body = &buf[8..8 + n];
    let crc = u32::from_le_bytes([buf[8 + n], buf[9 + n], buf[10 + n], buf[11 + n]]);
    if crc32c::crc32c(body) != crc {
        return Err(Error::Protocol(
            "membership message failed its checksum".into(),
        ));
    }
    Ok(body)
}

impl Request {
    /// The framed bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(Vec::new());
        match self {
            Request::Register { id, spec, view } => {
                w.u8(1);
                w.u64(*id);
                w.str(spec);
                match view {
                    Some(e) => {
                        w.u8(1);
                        w.epoch(e);
                    }
                    None => w.u8(0),
                }
            }
            Request::Heartbeat { id, step } => {
                w.u8(2);
                w.u64(*id);
                w.i64(*step);
            }
            Request::Report {
                id,
                seen,
                step,
                wait_ms,
                holds,
            } => {
                w.u8(3);
                w.u64(*id);
                w.u64(*seen);
                w.i64(*step);
                w.u32(*wait_ms);
                match holds {
                    Some((number, incarnation)) => {
                        w.u8(1);
                        w.u64(*number);
                        w.u64(*incarnation);
                    }
                    None => w.u8(0),
                }
            }
            Request::PublishMaster { id, epoch, addr } => {
                w.u8(4);
                w.u64(*id);
                w.u64(*epoch);
                w.str(addr);
            }
            Request::Master { epoch, wait_ms } => {
                w.u8(5);
                w.u64(*epoch);
                w.u32(*wait_ms);
            }
            Request::Leave { id } => {
                w.u8(6);
                w.u64(*id);
            }
            Request::Watch { id, epoch, wait_ms } => {
                w.u8(7);
                w.u64(*id);
                w.u64(*epoch);
                w.u32(*wait_ms);
            }
        }
        frame(w)
    }

    /// Parses framed bytes.
    pub fn decode(buf: &[u8]) -> Result<Request> {
        let mut r = R(unframe(buf)?);
        let req = match r.u8("kind")? {
            1 => Request::Register {
                id: r.u64("id")?,
                spec: r.str("spec")?,
                view: match r.u8("view")? {
                    0 => None,
                    _ => Some(r.epoch()?),
                },
            },
            2 => Request::Heartbeat {
                id: r.u64("id")?,
                step: r.i64("step")?,
            },
            3 => Request::Report {
                id: r.u64("id")?,
                seen: r.u64("epoch")?,
                step: r.i64("step")?,
                wait_ms: r.u32("wait")?,
                holds: match r.u8("held epoch")? {
                    0 => None,
                    _ => Some((r.u64("held epoch")?, r.u64("held epoch")?)),
                },
            },
            4 => Request::PublishMaster {
                id: r.u64("id")?,
                epoch: r.u64("epoch")?,
                addr: r.str("address")?,
            },
            5 => Request::Master {
                epoch: r.u64("epoch")?,
                wait_ms: r.u32("wait")?,
            },
            6 => Request::Leave { id: r.u64("id")? },
            7 => Request::Watch {
                id: r.u64("id")?,
                epoch: r.u64("epoch")?,
                wait_ms: r.u32("wait")?,
            },
            k => {
                return Err(Error::Protocol(format!(
                    "unknown membership request kind {k}"
                )))
            }
        };
        r.end()?;
        Ok(req)
    }
}

impl Reply {
    /// The framed bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(Vec::new());
        match self {
            Reply::Ok => w.u8(1),
            Reply::Refused(why) => {
                w.u8(2);
                w.str(why);
            }
            Reply::Beat(b) => {
                w.u8(3);
                w.u64(b.latest);
                w.u8(u8::from(b.ending) | (u8::from(b.member) << 1));
                w.i64(b.change_at.unwrap_or(i64::MIN));
            }
            Reply::Formed(e) => {
                w.u8(4);
                w.epoch(e);
            }
            Reply::Changed(c) => {
                w.u8(10);
                w.u64(c.base);
                w.u64(c.number);
                w.u64(c.incarnation);
                w.u32(c.left.len() as u32);
                for &r in &c.left {
                    w.u32(r);
                }
                w.u32(c.came.len() as u32);
                for &id in &c.came {
                    w.u64(id);
                }
                w.u32(c.steps.len() as u32);
                for &(step, n) in &c.steps {
                    w.i64(step);
                    w.u32(n);
                }
            }
            Reply::Waiting => w.u8(5),
            Reply::Unknown => w.u8(6),
            Reply::MasterAt(a) => {
                w.u8(7);
                w.str(a);
            }
            Reply::Superseded => w.u8(8),
            Reply::Welcome { token, tether } => {
                w.u8(9);
                w.0.extend_from_slice(token);
                w.u8(u8::from(*tether));
            }
        }
        frame(w)
    }

    /// Parses framed bytes.
    pub fn decode(buf: &[u8]) -> Result<Reply> {
        let mut r = R(unframe(buf)?);
        let rep = match r.u8("kind")? {
            1 => Reply::Ok,
            2 => Reply::Refused(r.str("reason")?),
            3 => {
                let latest = r.u64("beat")?;
                let flags = r.u8("beat")?;
                let at = r.i64("beat")?;
                Reply::Beat(Beat {
                    latest,
                    ending: flags & 1 != 0,
                    member: flags & 2 != 0,
                    change_at: (at != i64::MIN).then_some(at),
                })
            }
            4 => Reply::Formed(r.epoch()?),
            10 => Reply::Changed(r.change()?),
            5 => Reply::Waiting,
            6 => Reply::Unknown,
            7 => Reply::MasterAt(r.str("address")?),
            8 => Reply::Superseded,
            9 => {
                let mut token = [0u8; 16];
                token.copy_from_slice(r.take(16, "token")?);
                Reply::Welcome {
                    token,
                    tether: r.u8("welcome")? != 0,
                }
            }
            k => {
                return Err(Error::Protocol(format!(
                    "unknown membership reply kind {k}"
                )))
            }
        };
        r.end()?;
        Ok(rep)
    }
}
