//! Checking the peer's certificate: pinned fingerprints or a CA, for both roles, and
//! the client's TLS settings.

use std::fmt;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, OtherError, SignatureScheme,
};
use vsan_core::{Error, ErrorKind, Result};

use super::{ALPN, Fingerprint, QuicConfig};

/// Checks a peer's certificate, as server or as client: the CA chain when configured,
/// then the pinned fingerprints when configured; and the handshake signatures.
#[derive(Debug)]
pub(super) struct PeerVerifier {
    pinned: Vec<Fingerprint>,
    server_ca: Option<Arc<WebPkiServerVerifier>>,
    client_ca: Option<Arc<dyn ClientCertVerifier>>,
    algorithms: WebPkiSupportedAlgorithms,
}

/// A certificate whose fingerprint is not pinned.
pub(super) struct NotPinned {
    got: Fingerprint,
    pinned: Vec<Fingerprint>,
}

// rustls shows a `CertificateError::Other` with `Debug`: make that the message.
impl fmt::Debug for NotPinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for NotPinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "peer certificate {} is not ", self.got)?;
        match self.pinned.as_slice() {
            [one] => write!(f, "the pinned {one}"),
            many => {
                f.write_str("one of the pinned ")?;
                for (i, fp) in many.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{fp}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for NotPinned {}

impl PeerVerifier {
    pub(super) fn new(config: &QuicConfig, provider: &Arc<CryptoProvider>) -> Result<PeerVerifier> {
        let (server_ca, client_ca) = match &config.peer_ca {
            None => (None, None),
            Some(ca) => {
                let roots = ca.root_store()?;
                let server = WebPkiServerVerifier::builder_with_provider(
                    Arc::clone(&roots),
                    Arc::clone(provider),
                )
                .build()
                .map_err(|e| Error::with_source(ErrorKind::InvalidArgument, "quic: peer CA", e))?;
                let client =
                    WebPkiClientVerifier::builder_with_provider(roots, Arc::clone(provider))
                        .build()
                        .map_err(|e| {
                            Error::with_source(ErrorKind::InvalidArgument, "quic: peer CA", e)
                        })?;
                (Some(server), Some(client))
            }
        };
        Ok(PeerVerifier {
            pinned: config.pinned_peers.clone(),
            server_ca,
            client_ca,
            algorithms: provider.signature_verification_algorithms,
        })
    }

    fn check_pin(&self, end_entity: &CertificateDer<'_>) -> std::result::Result<(), rustls::Error> {
        if self.pinned.is_empty() {
            return Ok(());
        }
        let got = Fingerprint::of_certificate(end_entity);
        if self.pinned.contains(&got) {
            return Ok(());
        }
        Err(rustls::Error::InvalidCertificate(CertificateError::Other(
            OtherError(Arc::new(NotPinned {
                got,
                pinned: self.pinned.clone(),
            })),
        )))
    }
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        if let Some(ca) = &self.server_ca {
            ca.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)?;
        }
        self.check_pin(end_entity)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

impl ClientCertVerifier for PeerVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        match &self.client_ca {
            Some(ca) => ca.root_hint_subjects(),
            None => &[],
        }
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> std::result::Result<ClientCertVerified, rustls::Error> {
        if let Some(ca) = &self.client_ca {
            ca.verify_client_cert(end_entity, intermediates, now)?;
        }
        self.check_pin(end_entity)?;
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

pub(super) fn tls_error(what: &str, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::with_source(ErrorKind::InvalidArgument, format!("quic: {what}"), e)
}

/// The rustls client settings (TLS 1.3, ALPN, client certificate, no resumption).
pub(super) fn client_tls(
    config: &QuicConfig,
    provider: &Arc<CryptoProvider>,
    verifier: Arc<PeerVerifier>,
) -> Result<rustls::ClientConfig> {
    let (chain, key) = config.identity.chain_and_key();
    let mut tls = rustls::ClientConfig::builder_with_provider(Arc::clone(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| tls_error("TLS client settings", e))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_auth_cert(chain, key)
        .map_err(|e| tls_error("TLS client certificate", e))?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    // Every link proves its certificates afresh.
    tls.resumption = rustls::client::Resumption::disabled();
    Ok(tls)
}
