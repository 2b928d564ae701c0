//! mcp-core: the engine of mcp_fast, a communication layer for training neural networks
//! across slow, lossy or untrusted networks. It speaks MCP (Model Control Protocol) over QUIC
//! with mutual TLS, and runs collectives (all-reduce, broadcast, all-gather, reduce-scatter,
//! barrier, send/recv) on caller-owned buffers in place.
//!
//! The algorithms are written against the [`transport::Transport`] trait and run unchanged on
//! QUIC ([`transport::quic`]) and in memory ([`transport::mem`]), where `cargo test` checks
//! them with seeded faults. There is no Python here; `rust/mcp-py` binds it. The checkpoint
//! delta encoder and the entropy coders the lossless codec uses are the crate `mcp-delta`.

pub mod backoff;
pub mod buffer;
pub mod codec;
pub mod collectives;
pub mod config;
pub mod dtype;
pub mod error;
pub mod fec;
pub mod group;
pub mod health;
pub mod membership;
pub mod model_decl;
pub mod netem;
pub mod ps;
pub mod reduce;
pub mod rendezvous;
pub mod sim;
pub mod topology;
pub mod transport;
pub mod wire;

pub use buffer::RawBuf;
pub use dtype::{DType, ReduceOp};
pub use error::{Error, Result};
pub use group::{Algorithm, Group, GroupConfig, OpFuture, Tensor, WeakGroup};
pub use topology::Topology;
