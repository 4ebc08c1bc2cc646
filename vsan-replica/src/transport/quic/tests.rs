//! What needs a hand-driven peer: garbage and bad frames on an authenticated
//! stream, a client without a certificate, a client that never opens the stream.

use std::future::Future;

use bytes::Bytes;
use quinn::{Connection, ConnectionError, RecvStream, SendStream};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::errors::peer_text;
use super::*;
use crate::wire::WritePayload;

const WAIT: Duration = Duration::from_secs(10);

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no result within {WAIT:?}"),
    }
}

/// (client, server) transports that pin each other.
fn pinned_pair(server_config: impl FnOnce(&mut QuicConfig)) -> (QuicTransport, QuicTransport) {
    let a = Identity::generate("node1").unwrap();
    let b = Identity::generate("node2").unwrap();
    let client = QuicTransport::new(QuicConfig::pinned(a.clone(), [b.fingerprint()])).unwrap();
    let mut config = QuicConfig::pinned(b, [a.fingerprint()]);
    server_config(&mut config);
    (client, QuicTransport::new(config).unwrap())
}

/// A connection made with `client` settings and driven by hand, up to the TLS
/// handshake.
async fn raw_connection(
    client: quinn::ClientConfig,
    addr: &str,
) -> std::result::Result<(Endpoint, Connection), ConnectionError> {
    let remote: SocketAddr = addr.parse().unwrap();
    let endpoint = Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    let conn = endpoint
        .connect_with(client, remote, PINNED_SERVER_NAME)
        .unwrap()
        .await?;
    Ok((endpoint, conn))
}

/// A raw stream that the listener has taken as a link: (endpoint, connection,
/// send, recv) of the raw side, and the link.
async fn raw_peer() -> (Endpoint, Connection, SendStream, RecvStream, Link) {
    let (client, server) = pinned_pair(|_| {});
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let raw = async {
        let (endpoint, conn) = raw_connection(client.inner.client.clone(), &addr)
            .await
            .unwrap();
        let (mut send, mut recv) = conn.open_bi().await.unwrap();
        send.write_all(&PREAMBLE_DIAL).await.unwrap();
        let mut got = [0u8; 8];
        recv.read_exact(&mut got).await.unwrap();
        assert_eq!(got, PREAMBLE_ACCEPT);
        (endpoint, conn, send, recv)
    };
    let ((endpoint, conn, send, recv), link) = within("raw connect", async {
        tokio::join!(raw, listener.accept())
    })
    .await;
    (endpoint, conn, send, recv, link.unwrap())
}

fn block(seed: u64) -> Bytes {
    let mut v = Vec::with_capacity(4096);
    for i in 0..512u64 {
        v.extend_from_slice(&(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i).to_le_bytes());
    }
    Bytes::from(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_garbage_on_the_stream_is_a_protocol_error_and_ends_the_link() {
    let mut rng = SmallRng::seed_from_u64(1);
    for _ in 0..10 {
        let (_endpoint, conn, mut send, _recv, mut link) = raw_peer().await;
        let garbage: Vec<u8> = (0..rng.random_range(20..4096))
            .map(|_| rng.random())
            .collect();
        send.write_all(&garbage).await.unwrap();
        let err = within("recv", link.recv()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
        assert!(err.to_string().contains("bad frame"), "{err}");
        assert_eq!(
            within("recv", link.recv()).await.unwrap_err().kind(),
            ErrorKind::Protocol
        );
        let sent = within("send", link.send(Message::Ping { id: 1 })).await;
        assert_eq!(sent.unwrap_err().kind(), ErrorKind::Protocol);
        // The peer hears why.
        let closed = within("peer sees the close", conn.closed()).await;
        let err = connection_error(&closed, "raw");
        assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_with_a_bad_crc_is_a_protocol_error() {
    let (_endpoint, _conn, mut send, _recv, mut link) = raw_peer().await;
    let mut good = BytesMut::new();
    wire::encode_into(&Message::Ping { id: 1 }, &mut good).unwrap();
    let mut bad = BytesMut::new();
    let write = Message::Write {
        id: 2,
        offset: 0,
        payload: WritePayload::Data(block(2)),
        fua: false,
    };
    wire::encode_into(&write, &mut bad).unwrap();
    let last = bad.len() - 1;
    bad[last] ^= 1;
    send.write_all(&good).await.unwrap();
    send.write_all(&bad).await.unwrap();
    assert_eq!(
        within("recv", link.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    let err = within("recv", link.recv()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol);
    assert!(err.to_string().contains("crc mismatch"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_ends_the_stream_mid_frame_is_an_error_not_a_hang() {
    let mut whole = BytesMut::new();
    let reply = Message::ReadReply {
        id: 1,
        status: crate::wire::Status::Ok,
        data: block(1),
    };
    wire::encode_into(&reply, &mut whole).unwrap();
    for cut in [1, wire::HEADER_LEN, wire::HEADER_LEN + 3, whole.len() - 1] {
        let (_endpoint, _conn, mut send, _recv, mut link) = raw_peer().await;
        send.write_all(&whole[..cut]).await.unwrap();
        send.finish().unwrap();
        let err = within("recv", link.recv()).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Closed, "cut at {cut}: {err}");
        assert!(err.to_string().contains("middle of a frame"), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recv_is_cancel_safe() {
    let (_endpoint, _conn, mut send, _recv, mut link) = raw_peer().await;
    let msgs: Vec<Message> = (0..40u64)
        .map(|id| match id % 3 {
            0 => Message::Ping { id },
            1 => Message::Write {
                id,
                offset: id * 4096,
                payload: WritePayload::Data(block(id)),
                fua: false,
            },
            _ => Message::Flush { id },
        })
        .collect();
    let mut stream = BytesMut::new();
    for m in &msgs {
        wire::encode_into(m, &mut stream).unwrap();
    }
    let writer = tokio::spawn(async move {
        for chunk in stream.chunks(97) {
            send.write_all(chunk).await.unwrap();
            tokio::task::yield_now().await;
        }
        send
    });
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + WAIT;
    while got.len() < msgs.len() {
        assert!(
            std::time::Instant::now() < deadline,
            "messages did not arrive"
        );
        if let Ok(msg) = tokio::time::timeout(Duration::from_micros(50), link.recv()).await {
            got.push(msg.unwrap());
        }
    }
    assert_eq!(got, msgs);
    within("writer", writer).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_certificate_is_refused_and_the_listener_keeps_accepting() {
    let (client, server) = pinned_pair(|_| {});
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    // The client's own checks, but no certificate to show.
    let verifier = Arc::new(PeerVerifier::new(client.config(), &crypto_provider()).unwrap());
    let mut tls = rustls::ClientConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let anonymous = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).unwrap()));
    let raw = async {
        let (_endpoint, conn) = raw_connection(anonymous, &addr).await?;
        // The server's refusal comes after the client's side of the handshake.
        conn.closed().await;
        Err::<(), _>(conn.close_reason().unwrap())
    };
    let (raw, accepted) = within("handshake", async { tokio::join!(raw, listener.accept()) }).await;
    let client_err = connection_error(&raw.unwrap_err(), "raw client");
    assert_eq!(client_err.kind(), ErrorKind::Protocol, "{client_err}");
    assert!(
        client_err
            .to_string()
            .contains("the peer refused this node's certificate"),
        "{client_err}"
    );
    let server_err = accepted.unwrap_err();
    assert_eq!(server_err.kind(), ErrorKind::Protocol, "{server_err}");
    assert!(
        server_err.to_string().contains("no certificates"),
        "{server_err}"
    );
    // A good client still gets in.
    let (a, b) = within("good client", async {
        tokio::join!(client.connect(&addr), listener.accept())
    })
    .await;
    let (a, mut b) = (a.unwrap(), b.unwrap());
    within("send", a.send(Message::Ping { id: 7 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 7 }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_offering_another_protocol_is_refused() {
    let (client, server) = pinned_pair(|_| {});
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let verifier = Arc::new(PeerVerifier::new(client.config(), &crypto_provider()).unwrap());
    let mut tls = client_tls(client.config(), &crypto_provider(), verifier).unwrap();
    tls.alpn_protocols = vec![b"h3".to_vec()];
    let other = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).unwrap()));
    let (raw, accepted) = within("handshake", async {
        tokio::join!(raw_connection(other, &addr), listener.accept())
    })
    .await;
    assert!(raw.is_err());
    let err = accepted.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_opens_the_stream_times_out_and_others_get_in() {
    let (client, server) = pinned_pair(|c| c.handshake_timeout = Duration::from_millis(300));
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let (_endpoint, _silent) = within(
        "raw connect",
        raw_connection(client.inner.client.clone(), &addr),
    )
    .await
    .unwrap();
    // A good client is not held up by the silent one.
    let (a, b) = within("good client", async {
        tokio::join!(client.connect(&addr), listener.accept())
    })
    .await;
    let (a, mut b) = (a.unwrap(), b.unwrap());
    within("send", a.send(Message::Ping { id: 1 }))
        .await
        .unwrap();
    assert_eq!(
        within("recv", b.recv()).await.unwrap(),
        Message::Ping { id: 1 }
    );
    let err = within("accept", listener.accept()).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_without_the_preamble_is_refused() {
    let (client, server) = pinned_pair(|_| {});
    let listener = server.listen("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr();
    let raw = async {
        let (endpoint, conn) = raw_connection(client.inner.client.clone(), &addr)
            .await
            .unwrap();
        let (mut send, recv) = conn.open_bi().await.unwrap();
        send.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
        (endpoint, conn, send, recv)
    };
    let (_raw, accepted) =
        within("handshake", async { tokio::join!(raw, listener.accept()) }).await;
    let err = accepted.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Protocol, "{err}");
    assert!(err.to_string().contains("does not speak"), "{err}");
}

#[test]
fn peer_text_is_bounded_and_escaped() {
    assert_eq!(peer_text(b"a\nb"), "a\\nb");
    assert!(peer_text(&[b'x'; 5000]).chars().count() <= 401);
    assert_eq!(peer_text(&[0xff]), "\u{fffd}");
}
