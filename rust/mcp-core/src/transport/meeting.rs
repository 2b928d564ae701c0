//! The rendezvous over any [`Transport`]: the thin driver of
//! [`crate::rendezvous::Gathering`], shared by the QUIC transport and the simulator.
//!
//! Rank 0 files every Hello that arrives, in whatever order, until the table is complete or
//! the deadline passes, then sends the table to every rank; the other ranks wait for it. How
//! a Hello reaches rank 0 is the transport's own business (QUIC says it on every new
//! connection; the simulator sends it as a frame).

use super::{MsgKey, SeqSpace, Transport};
use crate::error::{Error, Result};
use crate::rendezvous::{Entry, Gathering, Heard, Table};
use crate::wire::{FrameKind, Header};
use std::time::{Duration, Instant};

/// The header of a control frame (Hello, Table, Goodbye, Progress) from `rank` of a world of
/// `world` (carried in `aux`: a rank started with another world size is refused).
pub fn control_header(rank: usize, world: usize, kind: FrameKind, payload: &[u8]) -> Header {
    Header::bytes(kind, rank, 0, world as u32, payload)
}

/// The Hello of `rank` in a world of `world`: its entry as payload.
pub fn hello_frame(rank: usize, world: usize, entry: &Entry) -> (Header, Vec<u8>) {
    let payload = entry.to_line().into_bytes();
    (
        control_header(rank, world, FrameKind::Hello, &payload),
        payload,
    )
}

fn control_key(src: usize) -> MsgKey {
    MsgKey {
        src,
        space: SeqSpace::Control,
        seq: 0,
        step: 0,
        chunk: 0,
    }
}

/// The transport's clock (virtual under the simulator's paused runtime).
fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// Rank 0's side: gathers every rank's Hello until `deadline` (`timeout` after the start,
/// named in the error) and sends each the table. A Hello that fails the rendezvous is
/// passed to `refuse` with the error before it is returned, so that the transport can tell
/// that rank why. `master` is the address the others were told to dial.
pub async fn gather<T: Transport>(
    t: &T,
    own: Entry,
    deadline: Instant,
    timeout: Duration,
    master: &str,
    refuse: impl FnOnce(usize, &Error),
) -> Result<Table> {
    let world = t.world_size();
    let mut g = Gathering::new(world, own, deadline, timeout, master)?;
    let table = match g.table_if_complete()? {
        Some(table) => table,
        None => 'gathering: loop {
            let arrival = t.mailbox().arrival();
            for (key, frame) in t.mailbox().take_arrived(SeqSpace::Control, Some(0)) {
                let frame = frame?;
                if frame.header.kind != FrameKind::Hello {
                    continue;
                }
                let line = String::from_utf8_lossy(&frame.payload.to_vec()).into_owned();
                match g.on_hello(key.src, frame.header.aux as usize, &line) {
                    Heard::Waiting | Heard::Repeated => {}
                    Heard::Complete(table) => break 'gathering table,
                    Heard::Refused(e) => {
                        refuse(key.src, &e);
                        return Err(e);
                    }
                    Heard::Failed(e) => return Err(e),
                }
            }
            tokio::select! {
                _ = arrival => {}
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(g.poll_timeout())) => {
                    if let Some(e) = g.handle_timeout(now()) {
                        return Err(e);
                    }
                }
            }
        },
    };
    let bytes = table.encode();
    let header = control_header(0, world, FrameKind::Table, &bytes);
    for r in 1..world {
        t.send_frame(r, &header, &bytes).await?;
    }
    Ok(table)
}

/// A rank other than 0: waits until `deadline` (`timeout` after the start) for rank 0's
/// table. `master` is rank 0's address, named in the error.
pub async fn receive_table<T: Transport>(
    t: &T,
    deadline: Instant,
    timeout: Duration,
    master: &str,
) -> Result<Table> {
    let world = t.world_size();
    receive_table_with(t, deadline, timeout, master, |bytes| {
        Table::decode(bytes, world)
    })
    .await
}

/// [`receive_table`] with the table's bytes turned into `R` by `decode` (the simulator
/// decodes the one table that every simulated rank receives once).
pub async fn receive_table_with<T: Transport, R>(
    t: &T,
    deadline: Instant,
    timeout: Duration,
    master: &str,
    decode: impl FnOnce(&[u8]) -> Result<R>,
) -> Result<R> {
    let at = tokio::time::Instant::from_std(deadline);
    match tokio::time::timeout_at(at, t.mailbox().recv(control_key(0))).await {
        Ok(frame) => decode(&frame?.payload.to_vec()),
        Err(_) => Err(Error::Timeout {
            what: format!("rendezvous: rank 0 at {master} did not send the address table"),
            after: timeout,
        }),
    }
}
