//! Mutual TLS from a shared job secret.
//!
//! Every process derives the same certificate-authority key from the secret (HKDF-SHA256 into
//! an Ed25519 seed), signs a fresh leaf certificate with it, and trusts only leaves signed by
//! that key. A process without the secret cannot make a leaf we accept, nor accept ours: it is
//! refused at the handshake. The protocol version travels in ALPN (`mcp/<major>.<minor>`:
//! both are pinned), with a version-neutral fallback `mcp` so that two versions can still
//! meet and name each other.
//!
//! Reconnections resume the TLS session (a ticket from the previous connection, kept in
//! memory by this process) and may send their first frames as 0-RTT data. The server keeps
//! its sessions in memory (stateful resumption) and takes a ticket out when it is used, so a
//! ticket serves once: a replayed first flight finds no session and gets a full handshake,
//! which a third party without the job secret cannot complete. A resumed session carries the
//! client certificate of the handshake that made it, so the server knows who speaks.

use crate::error::{Error, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PKCS_ED25519,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::sync::Arc;

/// The server name every peer certificate carries and every client asks for.
pub const SERVER_NAME: &str = "peer.mcp-fast.invalid";

/// The server name a rank asks for when it dials rank `rank`: matched by the certificates'
/// wildcard name, and the key of the session tickets kept for that peer (one name for all
/// would resume a session with the wrong peer, which refuses it).
pub fn server_name_of(rank: usize) -> String {
    format!("r{rank}.{SERVER_NAME}")
}
/// ALPN offered when versions differ, so the handshake completes and the peers can say which
/// versions they speak.
pub const ALPN_FALLBACK: &[u8] = b"mcp";
/// ALPN of the bootstrap exchange that hands a generated secret to the other ranks.
pub const ALPN_BOOTSTRAP: &[u8] = b"mcp-bootstrap";

/// The ALPN string of a protocol version.
pub fn alpn_for(major: u8, minor: u8) -> Vec<u8> {
    format!("mcp/{major}.{minor}").into_bytes()
}

/// ring's provider with AES-128-GCM preferred: every packet is sealed and opened, and at
/// ten rounds instead of fourteen AES-128 costs less per byte than AES-256 (ring's default
/// first choice) while remaining QUIC's mandatory suite.
fn provider() -> Arc<CryptoProvider> {
    use rustls::crypto::ring::cipher_suite;
    let mut p = rustls::crypto::ring::default_provider();
    p.cipher_suites = vec![
        cipher_suite::TLS13_AES_128_GCM_SHA256,
        cipher_suite::TLS13_AES_256_GCM_SHA384,
        cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
    ];
    Arc::new(p)
}

fn tls_err(e: impl std::fmt::Display) -> Error {
    Error::Io(format!("TLS configuration failed: {e}"))
}

/// The certificates of one process: the job CA (derived from the secret) and its own leaf.
pub struct Identity {
    ca_der: CertificateDer<'static>,
    leaf_der: CertificateDer<'static>,
    leaf_key: PrivatePkcs8KeyDer<'static>,
}

impl Identity {
    /// Derives the job CA from `secret` and signs a fresh leaf with it.
    pub fn from_secret(secret: &[u8]) -> Result<Identity> {
        if secret.is_empty() {
            return Err(Error::InvalidArgument(
                "the job secret must not be empty".into(),
            ));
        }
        let seed = derive_seed(secret);
        // PKCS#8 v1 wrapping of an Ed25519 seed (RFC 8410).
        let mut pkcs8 = vec![
            0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22,
            0x04, 0x20,
        ];
        pkcs8.extend_from_slice(&seed);
        let ca_key =
            KeyPair::from_pkcs8_der_and_sign_algo(&PrivatePkcs8KeyDer::from(pkcs8), &PKCS_ED25519)
                .map_err(tls_err)?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "mcp_fast job CA");
        ca.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca_der = ca.self_signed(&ca_key).map_err(tls_err)?.der().clone();
        let issuer = Issuer::new(ca, ca_key);

        let leaf_key = KeyPair::generate().map_err(tls_err)?;
        let mut leaf =
            CertificateParams::new(vec![SERVER_NAME.to_string(), format!("*.{SERVER_NAME}")])
                .map_err(tls_err)?;
        leaf.distinguished_name
            .push(DnType::CommonName, "mcp_fast rank");
        leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        leaf.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let leaf_der = leaf
            .signed_by(&leaf_key, &issuer)
            .map_err(tls_err)?
            .der()
            .clone();
        Ok(Identity {
            ca_der,
            leaf_der,
            leaf_key: PrivatePkcs8KeyDer::from(leaf_key.serialize_der()),
        })
    }

    fn roots(&self) -> Result<RootCertStore> {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca_der.clone()).map_err(tls_err)?;
        Ok(roots)
    }

    /// The server side: requires a client certificate from the job CA on data connections
    /// (checked after the handshake, since the bootstrap ALPN comes without one).
    pub fn server_config(&self, alpns: Vec<Vec<u8>>) -> Result<rustls::ServerConfig> {
        let p = provider();
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(self.roots()?), p.clone())
                .allow_unauthenticated()
                .build()
                .map_err(tls_err)?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(p)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(
                vec![self.leaf_der.clone()],
                PrivateKeyDer::Pkcs8(self.leaf_key.clone_key()),
            )
            .map_err(tls_err)?;
        cfg.alpn_protocols = alpns;
        // QUIC's only allowed non-zero value: accept 0-RTT data from resumed sessions.
        cfg.max_early_data_size = u32::MAX;
        Ok(cfg)
    }

    /// The client side: trusts only the job CA and presents our leaf.
    pub fn client_config(&self, alpns: Vec<Vec<u8>>) -> Result<rustls::ClientConfig> {
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls_err)?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(
                vec![self.leaf_der.clone()],
                PrivateKeyDer::Pkcs8(self.leaf_key.clone_key()),
            )
            .map_err(tls_err)?;
        cfg.alpn_protocols = alpns;
        // Session tickets are kept in memory (rustls's default cache); a reconnection uses one.
        cfg.enable_early_data = true;
        Ok(cfg)
    }
}

/// HKDF-SHA256(secret) into the 32-byte Ed25519 seed of the job CA.
fn derive_seed(secret: &[u8]) -> [u8; 32] {
    let salt = ring::hkdf::Salt::new(ring::hkdf::HKDF_SHA256, b"mcp_fast job CA v1");
    let prk = salt.extract(secret);
    let mut seed = [0u8; 32];
    struct Len32;
    impl ring::hkdf::KeyType for Len32 {
        fn len(&self) -> usize {
            32
        }
    }
    let info: &[&[u8]] = &[b"ed25519 seed"];
    if let Ok(okm) = prk.expand(info, Len32) {
        // 32 bytes is far below HKDF's limit, so fill cannot fail.
        let _ = okm.fill(&mut seed);
    }
    seed
}

/// A client config for the bootstrap exchange only: it does not check the server (it cannot:
/// fetching the secret is what it is for). See the README for what that trusts.
pub fn bootstrap_client_config() -> Result<rustls::ClientConfig> {
    let p = provider();
    let mut cfg = rustls::ClientConfig::builder_with_provider(p.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(tls_err)?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer(p)))
        .with_no_client_auth();
    cfg.alpn_protocols = vec![ALPN_BOOTSTRAP.to_vec()];
    Ok(cfg)
}

#[derive(Debug)]
struct AnyServer(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_secret_gives_the_same_ca_key() {
        assert_eq!(derive_seed(b"abc"), derive_seed(b"abc"));
        assert_ne!(derive_seed(b"abc"), derive_seed(b"abd"));
        let a = Identity::from_secret(b"s3cret").expect("identity");
        let b = Identity::from_secret(b"s3cret").expect("identity");
        assert_ne!(a.leaf_der, b.leaf_der, "leaves are fresh per process");
        assert!(Identity::from_secret(b"").is_err());
    }
}
