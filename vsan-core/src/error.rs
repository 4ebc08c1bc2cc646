//! The one public error type: a matchable [`ErrorKind`], a human context, and an optional
//! source error.
//!
//! Every layer (devices, the NBD export, the mirror, the cache, the C ABI) reports failures
//! as [`Error`]. Callers branch on [`Error::kind`]; the context says what was being done
//! ("write 4096 bytes at 8192"), and the source keeps the underlying `io::Error` or module
//! error for logs. `ErrorKind` maps one-to-one to the C ABI's result codes, so its
//! discriminants are explicit and never reused.

use std::fmt;

/// What went wrong, in terms a caller can act on.
///
/// New kinds may be added; match with a wildcard arm.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ErrorKind {
    /// An argument is malformed: misaligned offset or length, zero length, a request larger
    /// than the device's maximum, an invalid configuration value.
    InvalidArgument = 1,
    /// The request reaches past the end of the device.
    OutOfRange = 2,
    /// The underlying storage failed the operation (EIO and friends).
    Io = 3,
    /// The operation is not supported by this device or in this state.
    NotSupported = 4,
    /// The device is read-only.
    ReadOnly = 5,
    /// The device or service has been shut down or powered off.
    Closed = 6,
    /// The operation did not complete in time.
    Timeout = 7,
    /// Stored data or metadata failed a consistency check (bad crc, bad magic).
    Corrupt = 8,
    /// A peer or client broke the protocol.
    Protocol = 9,
    /// The resource (address, image, export) is already in use.
    InUse = 10,
    /// Something named does not exist (export, disk, file).
    NotFound = 11,
    /// The backing store is out of space.
    NoSpace = 12,
    /// A mirrored disk lost its peer and does not hold quorum (itself plus the witness),
    /// so it may not serve this request without risking divergent or stale data.
    NoQuorum = 13,
    /// The request is well-formed but refused in the current state: a detach while the
    /// peer is away, a verify while a resync runs, a declaration for a replica proven
    /// current already. The message says which state refused it.
    WrongState = 14,
}

impl ErrorKind {
    /// A short lower-case description, stable enough for logs and the C ABI's strings.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid argument",
            ErrorKind::OutOfRange => "out of range",
            ErrorKind::Io => "I/O error",
            ErrorKind::NotSupported => "not supported",
            ErrorKind::ReadOnly => "read-only",
            ErrorKind::Closed => "closed",
            ErrorKind::Timeout => "timed out",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Protocol => "protocol error",
            ErrorKind::InUse => "in use",
            ErrorKind::NotFound => "not found",
            ErrorKind::NoSpace => "no space",
            ErrorKind::NoQuorum => "no quorum",
            ErrorKind::WrongState => "refused in the current state",
        }
    }

    /// The kind whose discriminant (`kind as u32`, as the wire and the C ABI carry it)
    /// is `code`; an unknown code (a newer peer's kind) is [`ErrorKind::Io`].
    pub fn from_code(code: u32) -> ErrorKind {
        const ALL: [ErrorKind; 14] = [
            ErrorKind::InvalidArgument,
            ErrorKind::OutOfRange,
            ErrorKind::Io,
            ErrorKind::NotSupported,
            ErrorKind::ReadOnly,
            ErrorKind::Closed,
            ErrorKind::Timeout,
            ErrorKind::Corrupt,
            ErrorKind::Protocol,
            ErrorKind::InUse,
            ErrorKind::NotFound,
            ErrorKind::NoSpace,
            ErrorKind::NoQuorum,
            ErrorKind::WrongState,
        ];
        ALL.into_iter()
            .find(|k| *k as u32 == code)
            .unwrap_or(ErrorKind::Io)
    }

    /// The kind an `io::Error` most naturally maps to.
    pub fn from_io(err: &std::io::Error) -> ErrorKind {
        use std::io::ErrorKind as K;
        match err.kind() {
            K::InvalidInput => ErrorKind::InvalidArgument,
            K::Unsupported => ErrorKind::NotSupported,
            K::ReadOnlyFilesystem => ErrorKind::ReadOnly,
            K::StorageFull => ErrorKind::NoSpace,
            K::TimedOut => ErrorKind::Timeout,
            K::AddrInUse => ErrorKind::InUse,
            K::NotFound => ErrorKind::NotFound,
            K::BrokenPipe | K::ConnectionReset | K::ConnectionAborted => ErrorKind::Closed,
            _ => ErrorKind::Io,
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The error every vsan operation returns.
pub struct Error {
    kind: ErrorKind,
    context: String,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error of `kind` with a context message.
    pub fn new(kind: ErrorKind, context: impl Into<String>) -> Error {
        Error {
            kind,
            context: context.into(),
            source: None,
        }
    }

    /// An error of `kind` with a context message and the error that caused it.
    pub fn with_source(
        kind: ErrorKind,
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Error {
        Error {
            kind,
            context: context.into(),
            source: Some(source.into()),
        }
    }

    /// An I/O error, its kind derived from the `io::Error`.
    pub fn io(context: impl Into<String>, err: std::io::Error) -> Error {
        Error::with_source(ErrorKind::from_io(&err), context, err)
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// What was being done when it went wrong.
    pub fn context(&self) -> &str {
        &self.context
    }

    /// The same error with more context put in front ("disk vol0: " + "write ...").
    pub fn context_prefix(mut self, prefix: impl fmt::Display) -> Error {
        self.context = format!("{prefix}: {}", self.context);
        self
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Error");
        d.field("kind", &self.kind).field("context", &self.context);
        if let Some(s) = &self.source {
            d.field("source", s);
        }
        d.finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.context, self.kind)?;
        if let Some(s) = &self.source {
            write!(f, ": {s}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|s| s as &(dyn std::error::Error + 'static))
    }
}

impl From<std::io::Error> for Error {
    fn from(err: std::io::Error) -> Error {
        Error::io("I/O", err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_has_context_kind_and_source() {
        let e = Error::io(
            "write 4096 bytes at 0",
            std::io::Error::other("disk on fire"),
        );
        assert_eq!(e.kind(), ErrorKind::Io);
        assert_eq!(
            e.to_string(),
            "write 4096 bytes at 0: I/O error: disk on fire"
        );
        let e = e.context_prefix("disk vol0");
        assert!(e.to_string().starts_with("disk vol0: write"));
    }

    #[test]
    fn discriminants_are_stable() {
        assert_eq!(ErrorKind::InvalidArgument as u32, 1);
        assert_eq!(ErrorKind::NoSpace as u32, 12);
        assert_eq!(ErrorKind::NoQuorum as u32, 13);
        assert_eq!(ErrorKind::WrongState as u32, 14);
    }
}
