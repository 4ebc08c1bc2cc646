//! Protocols that export a [`BlockDevice`](crate::BlockDevice) to clients outside the
//! process.

pub mod iscsi;
pub mod nbd;
#[cfg(target_os = "linux")]
pub mod vhost_user;

/// Whether a Unix socket can be bound at `path`: nothing there, or a stale socket (one
/// nobody answers on). A file that is not a socket (a disk image given by mistake, say)
/// is never replaced (`AlreadyExists`), nor a socket another server still listens on
/// (`AddrInUse`). The one rule of every export's socket path.
pub fn check_socket_path(path: &std::path::Path) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(Error::new(
            ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        ));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(Error::new(
            ErrorKind::AddrInUse,
            format!("another server listens on {}", path.display()),
        ));
    }
    Ok(())
}

/// Make `path` free for a new socket: [`check_socket_path`], then the stale socket
/// there (if any) removed.
pub fn claim_socket_path(path: &std::path::Path) -> std::io::Result<()> {
    check_socket_path(path)?;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}
