//! WAN emulation between two TUN devices: a path with one-way delay, jitter, random loss and
//! a rate cap, per direction, for any IP traffic (TCP and UDP alike).
//!
//! [`link`] is the sans-IO scheduler of one direction (packets and `now` in, packets and the
//! next deadline out); [`forward`] moves packets between two TUN file descriptors through two
//! such links until told to stop. `mcp-chaos --hosts 2` builds the namespaces and TUNs.

pub mod forward;
pub mod link;

pub use forward::{forward, seconds, ForwardStats};
pub use link::{Link, LinkParams, LinkStats, Verdict};
