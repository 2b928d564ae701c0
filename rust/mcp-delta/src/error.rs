//! The error type of the delta codec.

/// Why encoding or decoding a tensor delta failed.
///
/// Every decoder error comes from the bytes it was given (or from the previous tensor that
/// was paired with them); none of them is a bug of the codec, and none of them panics.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum DeltaError {
    /// The caller passed arguments that cannot describe a tensor (sizes that disagree,
    /// an unsupported option).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The blob ends before the structure it announces is complete.
    #[error("truncated blob: {0}")]
    Truncated(String),
    /// The blob does not start with the codec's magic bytes or has an unknown version.
    #[error("not a delta blob: {0}")]
    BadMagic(String),
    /// The blob's structure is inconsistent (a field out of range, lengths that disagree,
    /// trailing bytes) or a checksum over part of it does not match.
    #[error("corrupt blob: {0}")]
    Corrupt(String),
    /// The blob is a delta but no previous tensor (or one of the wrong size) was given.
    #[error("previous tensor mismatch: {0}")]
    PrevMismatch(String),
    /// The tensor rebuilt from the blob does not have the content hash recorded at encode
    /// time: the blob or the previous tensor is not the one it was made from.
    #[error("content hash mismatch: expected {expected:016x}, got {actual:016x}")]
    HashMismatch {
        /// Hash recorded in the blob.
        expected: u64,
        /// Hash of the reconstructed bytes.
        actual: u64,
    },
    /// The zstd library reported an error while compressing.
    #[error("zstd: {0}")]
    Zstd(String),
}

/// Result alias of the delta codec.
pub type Result<T> = std::result::Result<T, DeltaError>;
