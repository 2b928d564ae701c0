//! The rendezvous in the simulator: the same state machine ([`crate::rendezvous`]) and
//! driver ([`crate::transport::meeting`]) as the QUIC transport, with each rank's Hello sent
//! to rank 0 as a frame (QUIC says it on the new connection) and a made-up entry per rank.

use super::net::SimTransport;
use crate::error::Result;
use crate::rendezvous::{Entry, Table};
use crate::transport::{meeting, Transport};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

/// Port of local rank 0 on every simulated host.
const BASE_PORT: u16 = 29500;

impl SimTransport {
    /// The entry of `rank`: host `h` of the topology is `10.a.b.c` with
    /// `h = a·2¹⁶ + b·2⁸ + c` and host id `sim-host-h`; local rank `l` listens on port
    /// 29500 + `l`; the pid is 1000 + rank; shared memory is taken when the host has more
    /// than one rank.
    pub fn entry_of(&self, rank: usize) -> Entry {
        let per_host = self.net.cfg.topology.ranks_per_host;
        let h = rank / per_host;
        let ip = Ipv4Addr::new(10, (h >> 16) as u8, (h >> 8) as u8, h as u8);
        let port = BASE_PORT.saturating_add((rank % per_host) as u16);
        Entry {
            addr: SocketAddr::from((ip, port)),
            host: format!("sim-host-{h}"),
            pid: 1000 + rank as u32,
            shm: per_host > 1,
            model: None,
        }
    }

    /// Meets the other ranks: rank 0 gathers every Hello and sends each rank the table; the
    /// others send their Hello and wait for the table, for at most `timeout` of virtual time.
    pub async fn meet(&self, timeout: Duration) -> Result<Arc<Table>> {
        let deadline = tokio::time::Instant::now().into_std() + timeout;
        let master = self.entry_of(0).addr.to_string();
        let own = self.entry_of(self.rank());
        if self.rank() == 0 {
            meeting::gather(self, own, deadline, timeout, &master, |_, _| {})
                .await
                .map(Arc::new)
        } else {
            let (header, payload) = meeting::hello_frame(self.rank(), self.world_size(), &own);
            self.send_frame(0, &header, &payload).await?;
            let decode = |bytes: &[u8]| self.decode_table(bytes);
            meeting::receive_table_with(self, deadline, timeout, &master, decode).await
        }
    }

    /// `bytes` as a table, decoded once for every rank that receives the same bytes.
    fn decode_table(&self, bytes: &[u8]) -> Result<Arc<Table>> {
        let mut last = self
            .net
            .last_table
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some((seen, table)) = last.as_ref() {
            if seen.as_slice() == bytes {
                return Ok(table.clone());
            }
        }
        let table = Arc::new(Table::decode(bytes, self.world_size())?);
        *last = Some((bytes.to_vec(), table.clone()));
        Ok(table)
    }
}

/// What one simulated rendezvous took.
#[derive(Debug, Clone, PartialEq)]
pub struct RendezvousTiming {
    /// Virtual time until the last rank had the table.
    pub elapsed: Duration,
    /// Bytes of the table (one copy).
    pub table_bytes: usize,
    /// Wire bytes rank 0 sent (every copy of the table, with headers).
    pub rank0_bytes: f64,
    /// Ranks that got the table.
    pub ok_ranks: usize,
    /// The first rank's error, if any failed.
    pub first_error: Option<crate::error::Error>,
}

/// Runs the rendezvous of `cfg.world` ranks (each gives up after `timeout`) and says how long
/// it took, and what rank 0 sent: the cost of forming (or re-forming) a job of that size.
pub fn time_rendezvous(cfg: &super::SimConfig, timeout: Duration) -> Result<RendezvousTiming> {
    // Rank 0 says how large the table is; encoding it again on every rank would cost more
    // real time than the rest of a large simulation.
    let (out, report) = super::simulate(cfg, |t| async move {
        let rank = t.rank();
        t.meet(timeout)
            .await
            .map(|table| (rank == 0).then(|| table.encode().len()))
    })?;
    let ok_ranks = out.iter().filter(|r| r.is_ok()).count();
    Ok(RendezvousTiming {
        elapsed: report.elapsed,
        table_bytes: out
            .first()
            .and_then(|r| r.as_ref().ok().copied().flatten())
            .unwrap_or(0),
        rank0_bytes: report.wire_bytes.first().copied().unwrap_or(0.0),
        ok_ranks,
        first_error: out.into_iter().find_map(|r| r.err()),
    })
}
