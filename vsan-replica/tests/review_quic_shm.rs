//! Adversarial review of the QUIC and shm transports: reproductions of suspected bugs
//! and checks of what was found correct.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::timeout;
use vsan_core::ErrorKind;
use vsan_replica::protocol::Message;
use vsan_replica::transport::quic::{Identity, QuicConfig, QuicTransport};
use vsan_replica::transport::{Link, Listener, Transport};

const WAIT: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no result within {WAIT:?}"),
    }
}

fn pinned_transports() -> (QuicTransport, QuicTransport) {
    let (a, b) = (
        Identity::generate("node1").unwrap(),
        Identity::generate("node2").unwrap(),
    );
    (
        QuicTransport::new(QuicConfig::pinned(a.clone(), [b.fingerprint()])).unwrap(),
        QuicTransport::new(QuicConfig::pinned(b, [a.fingerprint()])).unwrap(),
    )
}

async fn pair_on(client: &QuicTransport, listener: &dyn Listener) -> (Link, Link) {
    let addr = listener.local_addr();
    let (a, b) = within("connect", async {
        tokio::join!(client.connect(&addr), listener.accept())
    })
    .await;
    (a.unwrap(), b.unwrap())
}

/// A `send` that races `close` on another task must either fail (`Closed`) or be
/// delivered before the peer's `Closed`: `Ok` means "accepted and will be sent in order
/// unless the link fails", and `close` returning `Ok` says the link did not fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quic_a_send_racing_close_is_delivered_or_refused_never_silently_dropped() {
    let (client, server) = pinned_transports();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    for trial in 0..300u64 {
        let (a, mut b) = pair_on(&client, &*listener).await;
        let a = Arc::new(a);
        let sender = tokio::spawn({
            let a = Arc::clone(&a);
            async move {
                let mut accepted = Vec::new();
                for id in 0u64.. {
                    match a.send(Message::Ping { id }).await {
                        Ok(()) => accepted.push(id),
                        Err(e) => {
                            assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
                            break;
                        }
                    }
                    if id % 16 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                accepted
            }
        });
        // Let the sender get going, then close under it.
        let spin = std::time::Instant::now();
        while spin.elapsed() < Duration::from_micros(50 + (trial * 37) % 400) {
            std::hint::spin_loop();
        }
        within("close", a.close()).await.unwrap();
        let accepted = within("sender", sender).await.unwrap();
        let mut got = Vec::new();
        loop {
            match within("recv", b.recv()).await {
                Ok(Message::Ping { id }) => got.push(id),
                Ok(other) => panic!("{other:?}"),
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
                    break;
                }
            }
        }
        assert_eq!(
            got.len(),
            accepted.len(),
            "trial {trial}: send returned Ok for {} messages but the peer got {} before \
             Closed (last accepted {:?}, last received {:?}); queue_depth after close: {:?}",
            accepted.len(),
            got.len(),
            accepted.last(),
            got.last(),
            a.queue_depth()
        );
        assert_eq!(got, accepted);
    }
}

/// The same race on shm, for comparison (passes: `enqueue_many` checks `closing` and
/// queues under one lock).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shm_a_send_racing_close_is_delivered_or_refused_never_silently_dropped() {
    use vsan_replica::transport::loopback::shm::ShmTransport;
    let dir = tempfile::tempdir().unwrap();
    let addr = dir.path().join("race.sock").to_str().unwrap().to_string();
    let t = ShmTransport::new();
    let listener = t.listen(&addr).await.unwrap();
    for trial in 0..300u64 {
        let (a, b) = within("connect", async {
            tokio::join!(t.connect(&addr), listener.accept())
        })
        .await;
        let (a, mut b) = (Arc::new(a.unwrap()), b.unwrap());
        let sender = tokio::spawn({
            let a = Arc::clone(&a);
            async move {
                let mut accepted = Vec::new();
                for id in 0u64.. {
                    match a.send(Message::Ping { id }).await {
                        Ok(()) => accepted.push(id),
                        Err(e) => {
                            assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
                            break;
                        }
                    }
                    if id % 16 == 0 {
                        tokio::task::yield_now().await;
                    }
                }
                accepted
            }
        });
        let spin = std::time::Instant::now();
        while spin.elapsed() < Duration::from_micros(50 + (trial * 37) % 400) {
            std::hint::spin_loop();
        }
        within("close", a.close()).await.unwrap();
        let accepted = within("sender", sender).await.unwrap();
        let mut got = Vec::new();
        loop {
            match within("recv", b.recv()).await {
                Ok(Message::Ping { id }) => got.push(id),
                Ok(other) => panic!("{other:?}"),
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::Closed, "{e}");
                    break;
                }
            }
        }
        assert_eq!(got, accepted, "trial {trial}");
    }
}

// ----- QUIC authentication, driven by a hand-made peer -----

mod raw {
    use std::net::SocketAddr;
    use std::sync::Arc;

    use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::pki_types::{
        CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime,
    };
    use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
    use rustls::sign::CertifiedKey;
    use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

    pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// A certified key that pairs `cert` with an unrelated private key (what someone
    /// who copied a pinned certificate, but not its key, can present).
    pub fn stolen_cert_own_key(cert: &[u8]) -> Arc<CertifiedKey> {
        let key = rcgen::KeyPair::generate().unwrap();
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        let signer = provider().key_provider.load_private_key(der).unwrap();
        Arc::new(CertifiedKey::new(
            vec![CertificateDer::from(cert.to_vec())],
            signer,
        ))
    }

    /// Believes everything: the hand-made side checks nothing.
    #[derive(Debug)]
    pub struct Gullible;

    impl ServerCertVerifier for Gullible {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }
        fn verify_tls13_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            provider()
                .signature_verification_algorithms
                .supported_schemes()
        }
    }

    impl ClientCertVerifier for Gullible {
        fn offer_client_auth(&self) -> bool {
            true
        }
        fn root_hint_subjects(&self) -> &[DistinguishedName] {
            &[]
        }
        fn verify_client_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: UnixTime,
        ) -> Result<ClientCertVerified, rustls::Error> {
            Ok(ClientCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }
        fn verify_tls13_signature(
            &self,
            _: &[u8],
            _: &CertificateDer<'_>,
            _: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Ok(HandshakeSignatureValid::assertion())
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            provider()
                .signature_verification_algorithms
                .supported_schemes()
        }
    }

    #[derive(Debug)]
    pub struct Fixed(pub Arc<CertifiedKey>);

    impl rustls::client::ResolvesClientCert for Fixed {
        fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
            Some(Arc::clone(&self.0))
        }
        fn has_certs(&self) -> bool {
            true
        }
    }

    impl rustls::server::ResolvesServerCert for Fixed {
        fn resolve(&self, _: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
            Some(Arc::clone(&self.0))
        }
    }

    /// A client presenting `key` (or nothing), offering `alpn`, that then does the link
    /// preamble; Ok when it got the acceptor's preamble back.
    pub async fn client(
        addr: &str,
        key: Option<Arc<CertifiedKey>>,
        alpn: Vec<Vec<u8>>,
    ) -> Result<(), String> {
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Gullible));
        let mut tls = match key {
            Some(k) => builder.with_client_cert_resolver(Arc::new(Fixed(k))),
            None => builder.with_no_client_auth(),
        };
        tls.alpn_protocols = alpn;
        let cfg = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).unwrap()));
        let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        let remote: SocketAddr = addr.parse().unwrap();
        let conn = endpoint
            .connect_with(cfg, remote, "vsan-peer")
            .unwrap()
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
        send.write_all(b"vsanQ1d\n")
            .await
            .map_err(|e| e.to_string())?;
        let mut got = [0u8; 8];
        recv.read_exact(&mut got).await.map_err(|e| e.to_string())?;
        if &got == b"vsanQ1a\n" {
            Ok(())
        } else {
            Err(format!("preamble {got:?}"))
        }
    }

    /// A server presenting `key`, requiring any client certificate, with `alpn`;
    /// returns its address and the endpoint (keep it alive).
    pub fn server(key: Arc<CertifiedKey>, alpn: Vec<Vec<u8>>) -> (String, quinn::Endpoint) {
        let mut tls = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_client_cert_verifier(Arc::new(Gullible))
            .with_cert_resolver(Arc::new(Fixed(key)));
        tls.alpn_protocols = alpn;
        let cfg =
            quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(tls).unwrap()));
        let endpoint = quinn::Endpoint::server(cfg, "127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = endpoint.local_addr().unwrap().to_string();
        let ep = endpoint.clone();
        tokio::spawn(async move {
            while let Some(incoming) = ep.accept().await {
                tokio::spawn(async move {
                    let Ok(conn) = incoming.await else { return };
                    let Ok((mut send, mut recv)) = conn.accept_bi().await else {
                        return;
                    };
                    let mut got = [0u8; 8];
                    if recv.read_exact(&mut got).await.is_ok() {
                        let _ = send.write_all(b"vsanQ1a\n").await;
                        conn.closed().await;
                    }
                });
            }
        });
        (addr, endpoint)
    }

    pub fn certified(identity_cert: &[u8], key: &rcgen::KeyPair) -> Arc<CertifiedKey> {
        let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        Arc::new(CertifiedKey::new(
            vec![CertificateDer::from(identity_cert.to_vec())],
            provider().key_provider.load_private_key(der).unwrap(),
        ))
    }
}

const ALPN: &[u8] = b"vsan-replica/1";

/// A client that copied the pinned certificate but signs with another key is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_a_client_with_the_pinned_certificate_but_not_its_key_is_refused() {
    let (client, server) = pinned_transports();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let stolen = raw::stolen_cert_own_key(client.config().identity.certificate_der());
    let (raw, accepted) = within("handshake", async {
        tokio::join!(
            raw::client(&addr, Some(stolen), vec![ALPN.to_vec()]),
            listener.accept()
        )
    })
    .await;
    let err = accepted.unwrap_err();
    eprintln!("acceptor: {err}\nraw client: {raw:?}");
    assert_eq!(err.kind(), ErrorKind::Protocol);
    assert!(raw.is_err());
}

/// A client with the right certificate and key but no ALPN (or another) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_a_client_without_alpn_is_refused() {
    // A client identity whose key the test holds, pinned by the server.
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["node1".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let fp = vsan_replica::transport::quic::Fingerprint::of_certificate(cert.der());
    let server = QuicTransport::new(QuicConfig::pinned(
        Identity::generate("node2").unwrap(),
        [fp],
    ))
    .unwrap();
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    for alpn in [vec![], vec![b"h3".to_vec()]] {
        let (raw, accepted) = within("handshake", async {
            tokio::join!(
                raw::client(&addr, Some(raw::certified(cert.der(), &key)), alpn.clone()),
                listener.accept()
            )
        })
        .await;
        let err = accepted.unwrap_err();
        eprintln!("alpn {alpn:?}: acceptor: {err}\nraw client: {raw:?}");
        assert_eq!(err.kind(), ErrorKind::Protocol);
        assert!(raw.is_err());
    }
    // The same certificate and key with the right ALPN get in (the control).
    let (raw, accepted) = within("handshake", async {
        tokio::join!(
            raw::client(
                &addr,
                Some(raw::certified(cert.der(), &key)),
                vec![ALPN.to_vec()]
            ),
            listener.accept()
        )
    })
    .await;
    raw.unwrap();
    accepted.unwrap();
}

/// A server that copied the pinned certificate but not its key is refused by the
/// dialer; one that selects no ALPN too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_a_server_with_the_pinned_certificate_but_not_its_key_or_no_alpn_is_refused() {
    let (client, server) = pinned_transports();
    let stolen = raw::stolen_cert_own_key(server.config().identity.certificate_der());
    let (addr, _ep) = raw::server(stolen, vec![ALPN.to_vec()]);
    let err = within("connect", client.connect(&addr)).await.unwrap_err();
    eprintln!("stolen cert: {err}");
    assert_eq!(err.kind(), ErrorKind::Protocol);
    // Right cert and key, no ALPN selected.
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["node2".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let fp = vsan_replica::transport::quic::Fingerprint::of_certificate(cert.der());
    let client =
        QuicTransport::new(QuicConfig::pinned(client.config().identity.clone(), [fp])).unwrap();
    let (addr, _ep2) = raw::server(raw::certified(cert.der(), &key), vec![]);
    let err = within("connect", client.connect(&addr)).await.unwrap_err();
    eprintln!("no alpn: {err}");
    assert_eq!(err.kind(), ErrorKind::Protocol);
    let (addr, _ep3) = raw::server(raw::certified(cert.der(), &key), vec![ALPN.to_vec()]);
    within("connect", client.connect(&addr)).await.unwrap();
}

/// With a CA, an expired client or server certificate from that CA is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quic_expired_certificates_from_the_ca_are_refused_both_ways() {
    use vsan_replica::transport::quic::CaCertificates;
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "review CA");
    let ca_pem = ca_params.self_signed(&ca_key).unwrap().pem();
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let leaf = |expired: bool| {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        if expired {
            p.not_before = rcgen::date_time_ymd(2001, 1, 1);
            p.not_after = rcgen::date_time_ymd(2002, 1, 1);
        }
        let cert = p.signed_by(&key, &issuer).unwrap();
        Identity::from_pem(cert.pem().as_bytes(), key.serialize_pem().as_bytes()).unwrap()
    };
    let ca = CaCertificates::from_pem(ca_pem.as_bytes()).unwrap();
    let t = |id| QuicTransport::new(QuicConfig::with_ca(id, ca.clone())).unwrap();
    for (client_expired, server_expired) in [(true, false), (false, true), (false, false)] {
        let server = t(leaf(server_expired));
        let client = t(leaf(client_expired));
        let listener = server.listen("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr();
        let (x, y) = within("handshake", async {
            tokio::join!(client.connect(&addr), listener.accept())
        })
        .await;
        if client_expired || server_expired {
            let (x, y) = (x.unwrap_err(), y.unwrap_err());
            eprintln!("client expired {client_expired}: dialer: {x}\nacceptor: {y}");
            assert_eq!(x.kind(), ErrorKind::Protocol);
            assert_eq!(y.kind(), ErrorKind::Protocol);
        } else {
            x.unwrap();
            y.unwrap();
        }
    }
}
