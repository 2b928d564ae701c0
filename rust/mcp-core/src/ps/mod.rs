//! The parameter server: servers hold the parameters, sharded by key (large tensors split
//! across servers), and apply the workers' gradients with an optimizer chosen at start-up;
//! workers push gradients, pull parameters and advance a stale-synchronous clock.
//!
//! One concept per file: the update rules ([`sgd`], [`adam`], [`optim`]), the SSP clock
//! table ([`ssp`]), the shard map ([`shard`]), a server's state ([`store`]) — all pure
//! logic, unit-tested here — and the protocol ([`proto`]) with its QUIC ends ([`server`],
//! [`client`]), over the same mutual TLS, socket settings and fault injector as the
//! collectives.

pub mod adam;
pub mod client;
mod net;
pub mod optim;
pub mod proto;
pub mod server;
pub mod sgd;
pub mod shard;
pub mod ssp;
pub mod store;

pub use client::{ClientConfig, ClockInfo, PsClient};
pub use optim::{OptState, Optimizer};
pub use server::{PsServer, ServerConfig};
pub use shard::{ServerList, ShardMap};
pub use ssp::ClockTable;
pub use store::{Aggregate, Store};
