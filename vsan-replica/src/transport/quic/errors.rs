//! quinn's and rustls's errors in the link's words: which [`ErrorKind`] a failure is,
//! and what a peer's close reason or TLS alert says, bounded and escaped.

use quinn::{ConnectionError, ReadError, ReadExactError, WriteError};
use rustls::AlertDescription;
use vsan_core::{Error, ErrorKind};

use super::{CODE_ABANDONED, CODE_BAD_FRAME, CODE_DONE};

/// Text the peer sent (a close reason), safe to put in a message.
pub(super) fn peer_text(reason: &[u8]) -> String {
    const MAX: usize = 400;
    let text = String::from_utf8_lossy(reason);
    let mut out: String = text
        .chars()
        .take(MAX)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().count() > MAX {
        out.push('…');
    }
    out
}

/// A TLS failure as rustls words it (this side's, or the peer's in its close reason),
/// without the wrapping rustls puts around a verifier's own message, and with a hint
/// for the common CA failure.
pub(super) fn tidy_tls_reason(reason: &str) -> String {
    const WRAP: &str = "Other(OtherError(";
    let mut text = match reason.find(WRAP) {
        Some(at) if reason.ends_with("))") => {
            format!(
                "{}{}",
                &reason[..at],
                &reason[at + WRAP.len()..reason.len() - 2]
            )
        }
        _ => reason.to_string(),
    };
    if text.ends_with("UnknownIssuer") {
        text.push_str(" (the certificate is not signed by a CA the checking side trusts)");
    }
    text
}

/// The TLS alert in a QUIC crypto error code (0x100..0x1ff).
pub(super) fn tls_alert(code: u64) -> Option<u8> {
    (0x100..0x200)
        .contains(&code)
        .then_some((code & 0xff) as u8)
}

/// Whether a TLS alert says the sender did not accept the certificate it was shown.
pub(super) fn refuses_certificate(alert: AlertDescription) -> bool {
    matches!(
        alert,
        AlertDescription::BadCertificate
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnknownCA
            | AlertDescription::AccessDenied
            | AlertDescription::CertificateRequired
            | AlertDescription::DecryptError
    )
}

/// A connection's end, as the link's error; `what` says what was being done.
pub(super) fn connection_error(e: &ConnectionError, what: &str) -> Error {
    match e {
        ConnectionError::VersionMismatch => Error::new(
            ErrorKind::Protocol,
            format!("{what}: the peer speaks no QUIC version this node does"),
        ),
        ConnectionError::TransportError(te) => match tls_alert(u64::from(te.code)) {
            Some(_) => Error::new(
                ErrorKind::Protocol,
                format!(
                    "{what}: TLS handshake failed: {}",
                    tidy_tls_reason(&te.reason)
                ),
            ),
            None => Error::new(
                ErrorKind::Protocol,
                format!("{what}: the peer broke the QUIC protocol: {te}"),
            ),
        },
        ConnectionError::ConnectionClosed(close) => {
            let said = if close.reason.is_empty() {
                String::new()
            } else {
                format!(
                    "; the peer says: {}",
                    tidy_tls_reason(&peer_text(&close.reason))
                )
            };
            match tls_alert(u64::from(close.error_code)) {
                Some(alert) => {
                    let alert = AlertDescription::from(alert);
                    let text = if refuses_certificate(alert) {
                        "the peer refused this node's certificate"
                    } else {
                        "the peer refused the TLS handshake"
                    };
                    Error::new(
                        ErrorKind::Protocol,
                        format!("{what}: {text} (TLS alert {alert:?}){said}"),
                    )
                }
                None => Error::new(
                    ErrorKind::Protocol,
                    format!(
                        "{what}: the peer's QUIC stack closed the connection: {}{said}",
                        close.error_code
                    ),
                ),
            }
        }
        ConnectionError::ApplicationClosed(close) => {
            let code = close.error_code.into_inner();
            if code == u64::from(CODE_BAD_FRAME) {
                Error::new(
                    ErrorKind::Protocol,
                    format!(
                        "{what}: the peer closed the link: it received bytes it refuses ({})",
                        peer_text(&close.reason)
                    ),
                )
            } else if code == u64::from(CODE_DONE) {
                Error::new(ErrorKind::Closed, format!("{what}: peer closed the link"))
            } else {
                Error::new(
                    ErrorKind::Closed,
                    format!(
                        "{what}: peer closed the link (code {code}: {})",
                        peer_text(&close.reason)
                    ),
                )
            }
        }
        ConnectionError::Reset => Error::new(
            ErrorKind::Closed,
            format!("{what}: the peer reset the connection (it restarted or dropped it)"),
        ),
        ConnectionError::TimedOut => Error::new(
            ErrorKind::Timeout,
            format!("{what}: nothing heard from the peer within the idle timeout"),
        ),
        ConnectionError::LocallyClosed => Error::new(
            ErrorKind::Closed,
            format!("{what}: link closed by this side"),
        ),
        ConnectionError::CidsExhausted => Error::new(
            ErrorKind::Io,
            format!("{what}: no QUIC connection ids left"),
        ),
    }
}

pub(super) fn write_error(e: &WriteError, what: &str) -> Error {
    match e {
        WriteError::ConnectionLost(e) => connection_error(e, what),
        WriteError::Stopped(code) => Error::new(
            ErrorKind::Closed,
            format!("{what}: the peer stopped reading the link (code {code})"),
        ),
        WriteError::ClosedStream => Error::new(
            ErrorKind::Closed,
            format!("{what}: the link's stream is closed"),
        ),
        WriteError::ZeroRttRejected => {
            Error::new(ErrorKind::Protocol, format!("{what}: early data rejected"))
        }
    }
}

pub(super) fn read_error(e: &ReadError, what: &str) -> Error {
    match e {
        ReadError::ConnectionLost(e) => connection_error(e, what),
        ReadError::Reset(code) if code.into_inner() == u64::from(CODE_ABANDONED) => Error::new(
            ErrorKind::Closed,
            format!("{what}: the peer gave up sending (its close timed out)"),
        ),
        ReadError::Reset(code) => Error::new(
            ErrorKind::Closed,
            format!("{what}: the peer abandoned the link (stream reset, code {code})"),
        ),
        ReadError::ClosedStream => Error::new(
            ErrorKind::Closed,
            format!("{what}: the link's stream is closed"),
        ),
        ReadError::IllegalOrderedRead | ReadError::ZeroRttRejected => {
            Error::new(ErrorKind::Protocol, format!("{what}: {e}"))
        }
    }
}

pub(super) fn read_exact_error(e: &ReadExactError, what: &str) -> Error {
    match e {
        ReadExactError::ReadError(e) => read_error(e, what),
        ReadExactError::FinishedEarly(_) => Error::new(
            ErrorKind::Protocol,
            format!("{what}: the peer ended the stream during link setup"),
        ),
    }
}
