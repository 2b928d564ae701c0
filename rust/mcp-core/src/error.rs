//! The one error type of the core. Every variant maps to one Python exception in the binding.

use std::time::Duration;

/// What can go wrong in an MCP operation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Ranks called the same operation with different kinds, dtypes, shapes, ops or roots.
    #[error("{0}")]
    SpecMismatch(String),
    /// A peer stopped answering: killed, frozen, its link cut, or it closed its group.
    #[error("peer rank {rank} lost during {op}: {reason}")]
    PeerLost {
        /// The rank that was lost.
        rank: usize,
        /// The operation that needed it.
        op: String,
        /// Why we believe it is lost.
        reason: String,
    },
    /// A peer answers heartbeats but has not started the operation the others wait in for
    /// longer than the progress watchdog's limit: its training loop is stuck.
    #[error("peer rank {rank} is stalled in {op}: {reason}")]
    PeerStalled {
        /// The stalled rank.
        rank: usize,
        /// Where it is stuck, as far as its reports tell.
        op: String,
        /// What the watchdog saw.
        reason: String,
    },
    /// An operation did not finish before its deadline.
    // "within the timeout of": the words that torch's own tests look for in a backend's
    // timeout (" Timed out ", " timeout "), as Gloo's and NCCL's messages have them.
    #[error("timed out (no progress within the timeout of {:.1} s): {what}", after.as_secs_f64())]
    Timeout {
        /// What we were waiting for.
        what: String,
        /// How long we waited.
        after: Duration,
    },
    /// The TLS handshake failed: the two sides do not hold the same job secret.
    #[error("authentication with {peer} failed: {detail}")]
    Authentication {
        /// The address or rank of the other side.
        peer: String,
        /// What the TLS layer reported.
        detail: String,
    },
    /// The peer speaks another major version of the protocol.
    #[error("protocol version mismatch with {peer}: this process speaks MCP {ours}, the peer speaks MCP {theirs}")]
    VersionMismatch {
        /// Our version.
        ours: String,
        /// Theirs.
        theirs: String,
        /// The address or rank of the peer.
        peer: String,
    },
    /// A caller passed something the operation cannot work with.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A caller passed a tensor of a dtype the operation does not take.
    #[error("{0}")]
    WrongDType(String),
    /// A caller named something (a tensor, a key) that was never registered.
    #[error("{0}")]
    UnknownName(String),
    /// A peer sent bytes that are not valid MCP (bad header, checksum failure, wrong length).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A socket or connection failed for a reason other than the above.
    #[error("I/O error: {0}")]
    Io(String),
    /// The group was closed or aborted.
    #[error("the group is closed: {0}")]
    Closed(String),
    /// A message failed its checksum: damaged above the transport (in memory, by a bad copy).
    /// Its sender may send it again; after too many tries it is a [`Error::Protocol`].
    #[error("damaged message: {0}")]
    Damaged(String),
    /// A replacement took this process's place (its worker id) while it was dropped as dead.
    #[error("superseded: {0}")]
    Superseded(String),
}

impl Error {
    /// The same error, reported for operation `seq`, which completed here but failed on
    /// another rank.
    pub fn earlier(self, seq: u64) -> Error {
        let note = |m: String| {
            format!("operation #{seq}, which completed on this rank, failed on another rank: {m}")
        };
        match self {
            Error::SpecMismatch(m) => Error::SpecMismatch(note(m)),
            Error::PeerLost { rank, op, reason } => Error::PeerLost {
                rank,
                op,
                reason: note(reason),
            },
            Error::PeerStalled { rank, op, reason } => Error::PeerStalled {
                rank,
                op,
                reason: note(reason),
            },
            Error::Timeout { what, after } => Error::Timeout {
                what: note(what),
                after,
            },
            Error::InvalidArgument(m) => Error::InvalidArgument(note(m)),
            Error::Protocol(m) => Error::Protocol(note(m)),
            Error::Io(m) => Error::Io(note(m)),
            other => other,
        }
    }
}

/// Shorthand used throughout the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}
