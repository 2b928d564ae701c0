//! What travels on the wire: the frame header and the Model-Spec it carries.

mod frame;
mod spec;

pub use frame::{
    header_intact, verify_payload, FrameKind, Header, HEADER_FIXED, HEADER_MAX, MAGIC,
    PROTOCOL_MAJOR, PROTOCOL_MINOR,
};
pub use spec::{Codec, ModelSpec, MAX_DIMS};
