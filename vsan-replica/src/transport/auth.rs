//! Optional peer authentication for byte-stream transports: an HMAC-SHA256 challenge
//! over a shared secret, before the link carries its first message.
//!
//! The exchange is described under "Authentication" in [`super::tcp`].
//!
//! Both sides send before they read, so the exchange takes one round trip. Each side
//! answers the other's fresh random challenge, so a recorded exchange cannot be
//! replayed; the role byte keeps one side's answer from being reflected back as the
//! other's. A side with a different secret fails its check, so a mismatch is refused on
//! both sides. This authenticates the peer when the link opens; it neither encrypts nor
//! protects the stream afterwards (QUIC with mutual TLS does, for untrusted networks).

use bytes::BytesMut;
use hmac::{Hmac, KeyInit, Mac};
use rand::RngCore;
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use vsan_core::{Error, ErrorKind, Result};

use super::tcp::SharedSecret;
use crate::wire::{self, AuthFrame, Frame, WireError};

const NONCE_LEN: usize = 32;
const LABEL: &[u8] = b"vsan-replica auth v1";

/// Which end of the connection this side is; part of what each side signs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The side that dialled.
    Connector,
    /// The side that accepted.
    Acceptor,
}

impl Role {
    fn byte(self) -> u8 {
        match self {
            Role::Connector => b'C',
            Role::Acceptor => b'A',
        }
    }

    fn other(self) -> Role {
        match self {
            Role::Connector => Role::Acceptor,
            Role::Acceptor => Role::Connector,
        }
    }
}

/// Runs the exchange on `stream`. Returns the bytes read past the peer's last
/// authentication frame (the peer may already have sent its first message), which
/// belong to the link's receive buffer.
pub(crate) async fn authenticate<S>(
    stream: &mut S,
    secret: &SharedSecret,
    role: Role,
    peer: &str,
) -> Result<BytesMut>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut mine = [0u8; NONCE_LEN];
    rand::rng().fill_bytes(&mut mine);
    write_frame(stream, wire::encode_auth_challenge(&mine)?, peer).await?;

    let mut buf = BytesMut::with_capacity(512);
    let theirs = match read_frame(stream, &mut buf, peer).await? {
        AuthFrame::Challenge(nonce) if nonce.len() == NONCE_LEN => nonce,
        AuthFrame::Challenge(_) => return Err(refused(peer, "challenge of the wrong length")),
        AuthFrame::Response(_) => return Err(refused(peer, "answer before any challenge")),
    };
    if theirs.as_slice() == mine.as_slice() {
        return Err(refused(peer, "our own challenge reflected back"));
    }
    let answer = mac(secret, role, &theirs, &mine)?.finalize().into_bytes();
    write_frame(stream, wire::encode_auth_response(&answer)?, peer).await?;

    let AuthFrame::Response(their_answer) = read_frame(stream, &mut buf, peer).await? else {
        return Err(refused(peer, "a second challenge instead of an answer"));
    };
    mac(secret, role.other(), &mine, &theirs)?
        .verify_slice(&their_answer)
        .map_err(|_| refused(peer, "wrong answer: the shared secrets differ"))?;
    Ok(buf)
}

/// The MAC `role` sends in answer to `challenge`, with its own nonce `own`.
fn mac(secret: &SharedSecret, role: Role, challenge: &[u8], own: &[u8]) -> Result<Hmac<Sha256>> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).map_err(|_| {
        Error::new(
            ErrorKind::InvalidArgument,
            "shared secret: unusable as an HMAC key",
        )
    })?;
    mac.update(LABEL);
    mac.update(&[role.byte()]);
    mac.update(challenge);
    mac.update(own);
    Ok(mac)
}

fn refused(peer: &str, why: &str) -> Error {
    Error::new(
        ErrorKind::Protocol,
        format!("{peer}: peer authentication failed: {why}"),
    )
}

async fn write_frame<S: AsyncWrite + Unpin>(
    stream: &mut S,
    frame: Frame,
    peer: &str,
) -> Result<()> {
    let (head, data) = frame.into_parts();
    let context = || format!("{peer}: send authentication");
    stream
        .write_all(&head)
        .await
        .map_err(|e| Error::io(context(), e))?;
    stream
        .write_all(&data)
        .await
        .map_err(|e| Error::io(context(), e))?;
    stream.flush().await.map_err(|e| Error::io(context(), e))
}

async fn read_frame<S: AsyncRead + Unpin>(
    stream: &mut S,
    buf: &mut BytesMut,
    peer: &str,
) -> Result<AuthFrame> {
    loop {
        match wire::decode_auth(buf) {
            Ok(Some(frame)) => return Ok(frame),
            Ok(None) => {}
            Err(WireError::UnexpectedKind(kind)) => {
                return Err(refused(
                    peer,
                    &format!("it sent {kind:?} without authenticating (is its shared secret set?)"),
                ));
            }
            Err(e) => {
                return Err(Error::with_source(
                    ErrorKind::Protocol,
                    format!("{peer}: peer authentication failed"),
                    e,
                ));
            }
        }
        let n = stream
            .read_buf(buf)
            .await
            .map_err(|e| Error::io(format!("{peer}: receive authentication"), e))?;
        if n == 0 {
            return Err(Error::new(
                ErrorKind::Closed,
                format!(
                    "{peer}: peer closed the link during authentication (does it use the same shared secret?)"
                ),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::duplex;

    fn secret(s: &[u8]) -> SharedSecret {
        SharedSecret::new(s).unwrap()
    }

    #[tokio::test]
    async fn same_secret_passes_and_different_secrets_fail_on_both_sides() {
        let (k, k1, k2) = (secret(b"k"), secret(b"k1"), secret(b"k2"));
        let (mut a, mut b) = duplex(4096);
        let (ra, rb) = tokio::join!(
            authenticate(&mut a, &k, Role::Connector, "b"),
            authenticate(&mut b, &k, Role::Acceptor, "a"),
        );
        assert!(ra.unwrap().is_empty() && rb.unwrap().is_empty());

        let (mut a, mut b) = duplex(4096);
        let (ra, rb) = tokio::join!(
            authenticate(&mut a, &k1, Role::Connector, "b"),
            authenticate(&mut b, &k2, Role::Acceptor, "a"),
        );
        for err in [ra.unwrap_err(), rb.unwrap_err()] {
            assert_eq!(err.kind(), ErrorKind::Protocol);
            assert!(err.to_string().contains("secrets differ"), "{err}");
        }
    }

    /// A hand-driven peer: reads our challenge, then sends its own challenge, a correct
    /// answer and `extra` bytes in one write.
    async fn scripted_peer(
        peer: &mut tokio::io::DuplexStream,
        key: &SharedSecret,
        own_nonce: Option<[u8; NONCE_LEN]>,
        extra: &[u8],
    ) {
        let mut buf = BytesMut::new();
        let Ok(AuthFrame::Challenge(theirs)) = read_frame(peer, &mut buf, "us").await else {
            panic!("no challenge");
        };
        // None: reflect the challenge back as our own.
        let mine = own_nonce.unwrap_or_else(|| theirs.clone().try_into().unwrap());
        let answer = mac(key, Role::Acceptor, &theirs, &mine)
            .unwrap()
            .finalize()
            .into_bytes();
        let mut out = BytesMut::new();
        for frame in [
            wire::encode_auth_challenge(&mine).unwrap(),
            wire::encode_auth_response(&answer).unwrap(),
        ] {
            out.extend_from_slice(frame.head());
        }
        out.extend_from_slice(extra);
        peer.write_all(&out).await.unwrap();
    }

    #[tokio::test]
    async fn bytes_behind_the_handshake_are_handed_to_the_link() {
        let key = secret(b"k");
        let (mut us, mut peer) = duplex(4096);
        let (ours, ()) = tokio::join!(
            authenticate(&mut us, &key, Role::Connector, "peer"),
            scripted_peer(&mut peer, &key, Some([9; NONCE_LEN]), b"first message"),
        );
        assert_eq!(&ours.unwrap()[..], b"first message");
    }

    #[tokio::test]
    async fn a_reflected_challenge_is_refused() {
        let key = secret(b"k");
        let (mut us, mut peer) = duplex(4096);
        let (ours, ()) = tokio::join!(
            authenticate(&mut us, &key, Role::Connector, "peer"),
            scripted_peer(&mut peer, &key, None, b""),
        );
        let err = ours.unwrap_err();
        assert!(err.to_string().contains("reflected"), "{err}");
    }

    #[test]
    fn each_role_signs_differently() {
        let key = secret(b"k");
        let c = mac(&key, Role::Connector, &[1; 32], &[2; 32]).unwrap();
        let a = mac(&key, Role::Acceptor, &[1; 32], &[2; 32]).unwrap();
        assert_ne!(c.finalize().into_bytes(), a.finalize().into_bytes());
    }
}
