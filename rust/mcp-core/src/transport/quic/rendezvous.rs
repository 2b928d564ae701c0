//! Meeting the other ranks: every rank dials rank 0 and says hello with its address; rank 0
//! answers each with the table of all addresses. Also the bootstrap exchange that hands a
//! generated secret to the other ranks when the job was started without one.

use super::{close_code, endpoint, tls, QuicConfig, QuicTransport};
use crate::backoff::Backoff;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::transport::{MsgKey, SeqSpace, Transport};
use crate::wire::{FrameKind, Header, ModelSpec, PROTOCOL_MINOR};
use quinn::crypto::rustls::QuicClientConfig;
use quinn::{Connection, Endpoint, VarInt};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

fn control_header(t: &QuicTransport, kind: FrameKind, payload: &[u8]) -> Header {
    Header {
        kind,
        minor: PROTOCOL_MINOR,
        seq: 0,
        step: 0,
        chunk: 0,
        chunk_count: 1,
        src: t.rank as u32,
        aux: t.world as u32,
        spec: ModelSpec::flat(DType::U8, ReduceOp::None, payload.len()),
        payload_len: payload.len() as u64,
        payload_crc: crc32c::crc32c(payload),
    }
}

/// The Goodbye a closing process sends to each connected peer.
pub(super) fn goodbye_header(t: &QuicTransport, payload: &[u8]) -> Header {
    control_header(t, FrameKind::Goodbye, payload)
}

/// A progress report's header.
pub(super) fn progress_header(t: &QuicTransport, payload: &[u8]) -> Header {
    control_header(t, FrameKind::Progress, payload)
}

/// The Hello a dialer sends first: its rank (as `src`), world size (as `aux`), and as payload
/// its rank-table entry (see [`Entry`]).
pub(super) fn hello_frame(t: &QuicTransport) -> Result<(Header, Vec<u8>)> {
    let entry = Entry {
        addr: t.local_addr()?,
        host: t.host_id.clone(),
        pid: std::process::id(),
        shm: t.shm_wanted(),
        model: t.cfg.model_decl.clone(),
    };
    let payload = entry.to_line().into_bytes();
    Ok((control_header(t, FrameKind::Hello, &payload), payload))
}

/// One rank's line of the rendezvous table: `<addr> <host id> <pid> <shm 0|1> <model>`, the
/// model as the hex of its declaration's canonical text, `-` for none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Entry {
    /// Where the rank's endpoint listens.
    pub(super) addr: SocketAddr,
    /// Its host identity (see `transport::host`).
    pub(super) host: String,
    /// Its process id (checked against the credentials of its shared-memory socket).
    pub(super) pid: u32,
    /// Whether it takes shared memory with the ranks of its host.
    pub(super) shm: bool,
    /// The model it declares (canonical text), if any.
    pub(super) model: Option<String>,
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
    pub(super) fn to_line(&self) -> String {
        format!(
            "{} {} {} {} {}",
            self.addr,
            self.host,
            self.pid,
            u8::from(self.shm),
            self.model.as_deref().map_or_else(|| "-".to_string(), hex)
        )
    }

    pub(super) fn parse(rank: usize, line: &str) -> Result<Entry> {
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

fn control_key(src: usize) -> MsgKey {
    MsgKey {
        src,
        space: SeqSpace::Control,
        seq: 0,
        step: 0,
        chunk: 0,
    }
}

fn missing_timeout(missing: &[usize], t: &QuicTransport) -> Error {
    Error::Timeout {
        what: format!(
            "rendezvous at {}: ranks {missing:?} of {} never arrived (check WORLD_SIZE, MASTER_ADDR/MASTER_PORT and that every rank was started)",
            t.cfg.master, t.world
        ),
        after: t.cfg.connect_timeout,
    }
}

/// Runs the rendezvous; afterwards every rank's address is known.
pub(super) async fn run(t: &Arc<QuicTransport>, deadline: Instant) -> Result<()> {
    let deadline_tokio = tokio::time::Instant::from_std(deadline);
    if t.rank == 0 {
        let own = hello_frame(t)?.1;
        let mut addrs = vec![String::from_utf8_lossy(&own).into_owned()];
        for r in 1..t.world {
            let frame =
                match tokio::time::timeout_at(deadline_tokio, t.mailbox.recv(control_key(r))).await
                {
                    Ok(f) => f?,
                    Err(_) => return Err(missing_timeout(&(r..t.world).collect::<Vec<_>>(), t)),
                };
            if frame.header.aux as usize != t.world {
                let reason = format!(
                    "rank {r} was started with world_size {} but rank 0 with {}",
                    frame.header.aux, t.world
                );
                if let Some(c) = t.peers[r].conn.borrow().as_ref() {
                    c.close(VarInt::from_u32(close_code::REFUSED), reason.as_bytes());
                }
                return Err(Error::InvalidArgument(reason));
            }
            addrs.push(String::from_utf8_lossy(&frame.payload.to_vec()).into_owned());
        }
        let table = addrs.join("\n").into_bytes();
        let header = control_header(t, FrameKind::Table, &table);
        for r in 1..t.world {
            t.send_frame(r, &header, &table).await?;
        }
        store_table(t, &addrs)
    } else {
        {
            let mut a = t.addrs.lock().unwrap_or_else(|p| p.into_inner());
            a[0] = Some(t.cfg.master);
        }
        t.dial_with_backoff(0, t.cfg.master, deadline, false)
            .await?;
        let frame =
            match tokio::time::timeout_at(deadline_tokio, t.mailbox.recv(control_key(0))).await {
                Ok(f) => f?,
                Err(_) => {
                    return Err(Error::Timeout {
                        what: format!(
                            "rendezvous: rank 0 at {} did not send the address table",
                            t.cfg.master
                        ),
                        after: t.cfg.connect_timeout,
                    })
                }
            };
        let text = String::from_utf8_lossy(&frame.payload.to_vec()).into_owned();
        let addrs: Vec<String> = text.lines().map(str::to_string).collect();
        if addrs.len() != t.world {
            return Err(Error::Protocol(format!(
                "rank 0 sent {} addresses for a world of {}",
                addrs.len(),
                t.world
            )));
        }
        store_table(t, &addrs)
    }
}

fn store_table(t: &QuicTransport, lines: &[String]) -> Result<()> {
    let entries = lines
        .iter()
        .enumerate()
        .map(|(r, l)| Entry::parse(r, l))
        .collect::<Result<Vec<Entry>>>()?;
    let models: Vec<Option<String>> = entries.iter().map(|e| e.model.clone()).collect();
    crate::model_decl::check_same(&models)?;
    *t.addrs.lock().unwrap_or_else(|p| p.into_inner()) =
        entries.iter().map(|e| Some(e.addr)).collect();
    t.set_topology(&entries);
    Ok(())
}

/// Rank 0's side of the bootstrap: hands the generated secret to whoever asks while the
/// rendezvous is open.
pub(super) async fn serve_secret(me: Weak<QuicTransport>, conn: Connection) {
    let Some(t) = me.upgrade() else { return };
    if !t.bootstrap_open.load(Ordering::Acquire) {
        conn.close(
            VarInt::from_u32(close_code::REFUSED),
            b"the rendezvous is over",
        );
        return;
    }
    let secret = t.secret.clone();
    drop(t);
    if let Ok(mut s) = conn.open_uni().await {
        if s.write_all(&secret).await.is_ok() && s.finish().is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(5), s.stopped()).await;
        }
    }
    conn.close(VarInt::from_u32(close_code::BOOTSTRAP_DONE), b"done");
}

/// Asks rank 0 for the generated job secret, retrying until `deadline`.
pub(super) async fn fetch_secret(cfg: &QuicConfig, deadline: Instant) -> Result<Vec<u8>> {
    let local = SocketAddr::new(endpoint::local_ip_towards(cfg.master)?, 0);
    let ep = Endpoint::client(local)?;
    let tls = tls::bootstrap_client_config()?;
    let quic =
        QuicClientConfig::try_from(tls).map_err(|e| Error::Io(format!("bootstrap config: {e}")))?;
    let client = quinn::ClientConfig::new(Arc::new(quic));
    let mut backoff = Backoff::default();
    let res = loop {
        let attempt = async {
            let conn = ep
                .connect_with(client.clone(), cfg.master, tls::SERVER_NAME)
                .map_err(|e| Error::Io(e.to_string()))?
                .await
                .map_err(|e| Error::Io(e.to_string()))?;
            let mut s = conn
                .accept_uni()
                .await
                .map_err(|e| Error::Io(e.to_string()))?;
            let secret = s
                .read_to_end(1024)
                .await
                .map_err(|e| Error::Io(e.to_string()))?;
            conn.close(VarInt::from_u32(close_code::BOOTSTRAP_DONE), b"thanks");
            Ok::<Vec<u8>, Error>(secret)
        };
        match tokio::time::timeout(Duration::from_secs(2), attempt).await {
            Ok(Ok(secret)) if !secret.is_empty() => break Ok(secret),
            Ok(Ok(_)) | Ok(Err(_)) | Err(_) => {
                let wait = backoff.next_delay();
                if Instant::now() + wait >= deadline {
                    break Err(Error::Timeout {
                        what: format!(
                            "fetching the job secret from rank 0 at {}; start rank 0, or give every rank the same MCP_SECRET",
                            cfg.master
                        ),
                        after: cfg.connect_timeout,
                    });
                }
                tokio::time::sleep(wait).await;
            }
        }
    };
    ep.close(VarInt::from_u32(close_code::BOOTSTRAP_DONE), b"");
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_round_trip_and_bad_ones_are_protocol_errors() {
        let e = Entry {
            addr: "10.0.0.2:4000".parse().expect("addr"),
            host: "node/netns:4026531840/boot:abc".into(),
            pid: 4242,
            shm: true,
            model: None,
        };
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
}
