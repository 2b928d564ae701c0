//! MCP (Model Control Protocol) core: transport, collectives and codecs for distributed training.

pub mod delta;
