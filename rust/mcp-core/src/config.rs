//! The transport configuration as the source documents write it:
//! `{"max_streams": 4096, "fec_group_size": 8, "compression": "zstd@L3",
//! "heartbeat_interval": 5000, "mtu": 1440}`.
//!
//! Every key is checked here, once; the binding only converts a dict (or a parsed JSON/TOML
//! file) to [`ConfigValue`]s. An unknown key or a bad value is a [`ConfigError`] that names
//! the key and what it allows.

use crate::codec::Compression;
use crate::transport::quic::QuicConfig;
use std::time::Duration;

/// The keys [`TransportSettings::set`] accepts.
pub const KEYS: &[&str] = &[
    "max_streams",
    "fec_group_size",
    "compression",
    "heartbeat_interval",
    "mtu",
];

/// Range of `max_streams` (QUIC stream limits per connection, each direction).
pub const MAX_STREAMS: (u32, u32) = (1, 1 << 20);
/// Range of `fec_group_size` (data shards per FEC block; the default is 128).
pub const FEC_GROUP_SIZE: (u16, u16) = (1, 1024);
/// Range of `heartbeat_interval` in milliseconds.
pub const HEARTBEAT_MS: (u64, u64) = (10, 3_600_000);
/// Range of `mtu` in bytes: QUIC needs 1,200; 65,000 is the loopback datagram we use.
pub const MTU: (u16, u16) = (1200, 65_000);

/// Range of `MCP_THREADS`, the runtime's worker threads per process.
pub const WORKER_THREADS: (usize, usize) = (1, 256);
/// Worker threads when `MCP_THREADS` is not set. One is better for a collective group of
/// ranks with two cores or fewer each (less processor time per small operation), two for a
/// parameter server, whose one process serves every worker (docs/benchmarks.md).
pub const DEFAULT_WORKER_THREADS: usize = 2;

/// The runtime's worker threads for `MCP_THREADS`'s value (`None`: not set).
pub fn worker_threads(value: Option<&str>) -> Result<usize, String> {
    let Some(v) = value else {
        return Ok(DEFAULT_WORKER_THREADS);
    };
    match v.trim().parse::<usize>() {
        Ok(n) if (WORKER_THREADS.0..=WORKER_THREADS.1).contains(&n) => Ok(n),
        _ => Err(format!(
            "MCP_THREADS={v:?} is not a thread count: set it to an integer from {} to {}, \
             or unset it for the default ({DEFAULT_WORKER_THREADS})",
            WORKER_THREADS.0, WORKER_THREADS.1
        )),
    }
}

/// One value of a configuration, as the binding hands it over.
#[derive(Debug, Clone, PartialEq)]
pub enum ConfigValue {
    /// An integer.
    Int(i64),
    /// A string.
    Str(String),
    /// Anything else, by its type's name (always refused, naming what was expected).
    Other(String),
}

impl std::fmt::Display for ConfigValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigValue::Int(v) => write!(f, "{v}"),
            ConfigValue::Str(s) => write!(f, "{s:?}"),
            ConfigValue::Other(t) => write!(f, "a value of type {t}"),
        }
    }
}

/// What is wrong with a configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A key this version does not know.
    #[error("unknown transport config key {key:?}; allowed keys: {}", KEYS.join(", "))]
    UnknownKey {
        /// The key as given.
        key: String,
    },
    /// A known key with a value outside what it allows.
    #[error("transport config {key}={value} is not allowed; {key} must be {allowed}")]
    BadValue {
        /// The key.
        key: &'static str,
        /// The value as given.
        value: String,
        /// What the key allows.
        allowed: String,
    },
}

impl From<ConfigError> for crate::error::Error {
    fn from(e: ConfigError) -> Self {
        crate::error::Error::InvalidArgument(e.to_string())
    }
}

/// A checked transport configuration; keys not given keep the transport's defaults.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TransportSettings {
    /// QUIC's concurrent bidirectional and unidirectional stream limits.
    pub max_streams: Option<u32>,
    /// The FEC lane's data shards per block ([`BulkConfig::k`](crate::transport::quic::BulkConfig)).
    pub fec_group_size: Option<u16>,
    /// The lossless codec's entropy stage and level.
    pub compression: Option<Compression>,
    /// The heartbeat interval.
    pub heartbeat_interval: Option<Duration>,
    /// A fixed datagram size for the QUIC path (no MTU discovery above it).
    pub mtu: Option<u16>,
}

fn int_in(
    key: &'static str,
    v: &ConfigValue,
    lo: u64,
    hi: u64,
    unit: &str,
) -> Result<u64, ConfigError> {
    match v {
        ConfigValue::Int(n) if *n >= 0 && (lo..=hi).contains(&(*n as u64)) => Ok(*n as u64),
        _ => Err(ConfigError::BadValue {
            key,
            value: v.to_string(),
            allowed: format!("an integer from {lo} to {hi}{unit}"),
        }),
    }
}

impl TransportSettings {
    /// Parses `pairs` (key, value); the first bad one is the error.
    pub fn parse<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a ConfigValue)>,
    ) -> Result<TransportSettings, ConfigError> {
        let mut s = TransportSettings::default();
        for (k, v) in pairs {
            s.set(k, v)?;
        }
        Ok(s)
    }

    /// Checks and records one key.
    pub fn set(&mut self, key: &str, value: &ConfigValue) -> Result<(), ConfigError> {
        match key {
            "max_streams" => {
                let (lo, hi) = MAX_STREAMS;
                self.max_streams =
                    Some(int_in("max_streams", value, lo.into(), hi.into(), "")? as u32);
            }
            "fec_group_size" => {
                let (lo, hi) = FEC_GROUP_SIZE;
                self.fec_group_size =
                    Some(int_in("fec_group_size", value, lo.into(), hi.into(), " shards")? as u16);
            }
            "heartbeat_interval" => {
                let (lo, hi) = HEARTBEAT_MS;
                let ms = int_in("heartbeat_interval", value, lo, hi, " milliseconds")?;
                self.heartbeat_interval = Some(Duration::from_millis(ms));
            }
            "mtu" => {
                let (lo, hi) = MTU;
                self.mtu = Some(int_in("mtu", value, lo.into(), hi.into(), " bytes")? as u16);
            }
            "compression" => {
                let bad = || ConfigError::BadValue {
                    key: "compression",
                    value: value.to_string(),
                    allowed: Compression::ALLOWED.into(),
                };
                let ConfigValue::Str(name) = value else {
                    return Err(bad());
                };
                self.compression = Some(Compression::parse(name).ok_or_else(bad)?);
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    key: key.to_string(),
                })
            }
        }
        Ok(())
    }

    /// Writes the keys given into `cfg` (the lossless level is process-wide: see
    /// [`Compression::install`]).
    pub fn apply(&self, cfg: &mut QuicConfig) {
        if let Some(n) = self.max_streams {
            cfg.max_streams = n;
        }
        if let Some(k) = self.fec_group_size {
            cfg.bulk.k = k;
        }
        if let Some(h) = self.heartbeat_interval {
            cfg.heartbeat = h;
        }
        if let Some(m) = self.mtu {
            cfg.mtu = Some(m);
        }
        if let Some(c) = self.compression {
            c.install();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int(n: i64) -> ConfigValue {
        ConfigValue::Int(n)
    }
    fn s(v: &str) -> ConfigValue {
        ConfigValue::Str(v.into())
    }

    #[test]
    fn the_documents_example_parses() {
        let (a, b, c, d, e) = (int(4096), int(8), s("zstd@L3"), int(5000), int(1440));
        let got = TransportSettings::parse([
            ("max_streams", &a),
            ("fec_group_size", &b),
            ("compression", &c),
            ("heartbeat_interval", &d),
            ("mtu", &e),
        ])
        .expect("the documents' example");
        assert_eq!(
            got,
            TransportSettings {
                max_streams: Some(4096),
                fec_group_size: Some(8),
                compression: Some(Compression::Zstd(3)),
                heartbeat_interval: Some(Duration::from_millis(5000)),
                mtu: Some(1440),
            }
        );
        let mut cfg = QuicConfig::new(0, 1, "127.0.0.1:1".parse().expect("addr"));
        TransportSettings {
            compression: None,
            ..got
        }
        .apply(&mut cfg);
        assert_eq!(cfg.max_streams, 4096);
        assert_eq!(cfg.bulk.k, 8);
        assert_eq!(cfg.heartbeat, Duration::from_secs(5));
        assert_eq!(cfg.mtu, Some(1440));
    }

    #[test]
    fn compression_names() {
        assert_eq!(Compression::parse("none"), Some(Compression::None));
        assert_eq!(Compression::parse("zstd"), Some(Compression::Zstd(1)));
        assert_eq!(Compression::parse("zstd@L19"), Some(Compression::Zstd(19)));
        for bad in ["zstd@L0", "zstd@L20", "zstd@3", "gzip", "zstd@L", ""] {
            assert_eq!(Compression::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn bad_keys_and_values_are_refused_by_name() {
        let cases: &[(&str, ConfigValue, &str)] = &[
            ("max_stream", int(1), "unknown transport config key \"max_stream\"; allowed keys: max_streams, fec_group_size, compression, heartbeat_interval, mtu"),
            ("max_streams", int(0), "max_streams=0 is not allowed; max_streams must be an integer from 1 to 1048576"),
            ("max_streams", s("4096"), "max_streams=\"4096\" is not allowed"),
            ("fec_group_size", int(2000), "fec_group_size must be an integer from 1 to 1024 shards"),
            ("heartbeat_interval", int(5), "heartbeat_interval must be an integer from 10 to 3600000 milliseconds"),
            ("heartbeat_interval", ConfigValue::Other("float".into()), "heartbeat_interval=a value of type float"),
            ("mtu", int(1000), "mtu must be an integer from 1200 to 65000 bytes"),
            ("mtu", int(-1), "mtu=-1"),
            ("compression", s("lz4"), "compression=\"lz4\" is not allowed; compression must be \"none\", \"zstd\" or \"zstd@L<level>\" with level 1 to 19"),
            ("compression", int(3), "compression=3"),
        ];
        for (k, v, want) in cases {
            let err = TransportSettings::parse([(*k, v)])
                .expect_err("refused")
                .to_string();
            assert!(err.contains(want), "{k}={v}: {err}");
        }
    }

    #[test]
    fn worker_threads_default_to_two_and_refuse_what_is_not_a_count() {
        assert_eq!(worker_threads(None), Ok(DEFAULT_WORKER_THREADS));
        assert_eq!(worker_threads(Some(" 1 ")), Ok(1));
        assert_eq!(worker_threads(Some("256")), Ok(256));
        for bad in ["0", "257", "-1", "many", ""] {
            let err = worker_threads(Some(bad)).expect_err(bad);
            assert!(
                err.contains(&format!("MCP_THREADS={bad:?} is not a thread count")),
                "{err}"
            );
        }
    }
}
