//! Forward error correction for a bulk lane of QUIC datagrams.
//!
//! A payload is cut into blocks of `k` data shards, each the size of a datagram; Reed-Solomon
//! (`reed-solomon-simd`) adds `m` parity shards per block, and any `k` distinct shards rebuild
//! it. Each shard travels with a small header and a CRC32C ([`shard`]), so that a corrupted
//! shard is an erasure rather than silent damage. [`block`] codes one block, [`transfer`] a
//! whole payload with selective repair (NACKs), [`rounds`] the END/NACK/DONE exchange that
//! drives the repairs, and [`adaptive`] picks `m` from the measured
//! loss rate.

pub mod adaptive;
pub mod block;
pub mod rounds;
pub mod shard;
pub mod transfer;

pub use adaptive::{block_failure_probability, parity_for, AdaptiveParity, LossEstimator};
pub use block::{Added, BlockDecoder, BlockEncoder};
pub use rounds::{Control, RepairRequester, RepairSender, RequesterStep, RoundsEnd, SenderStep};
pub use shard::{Shard, ShardHeader};
pub use transfer::{Nack, Received, ReceiverStats, TransferPlan, TransferReceiver, TransferSender};
