//! Doorbells: a Unix socket pair per sleeper, rung with one non-blocking byte.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;

use socket2::SockRef;

use super::MAX_BELL_READS;

/// A doorbell: (the end this side waits on, the end to hand to the peer).
pub(super) fn doorbell() -> io::Result<(OwnedFd, OwnedFd)> {
    let (wait, ring) = std::os::unix::net::UnixStream::pair()?;
    wait.set_nonblocking(true)?;
    ring.set_nonblocking(true)?;
    Ok((OwnedFd::from(wait), OwnedFd::from(ring)))
}

/// Wakes the side waiting on the other end of `bell`. Never blocks; errors are ignored
/// (a full bell already has a wake-up pending; a closed one belongs to a peer that is
/// gone, which the control socket reports).
pub(super) fn ring_bell(bell: &OwnedFd) {
    let _ = SockRef::from(bell).send_with_flags(&[1], libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
}

/// What draining a doorbell found.
pub(super) enum Bell {
    /// Read everything there was (maybe nothing).
    Drained,
    /// More may be there; the peer keeps ringing.
    More,
    /// The peer closed its end.
    Hangup,
}

pub(super) fn drain_bell(bell: &OwnedFd) -> io::Result<Bell> {
    let mut buf = [MaybeUninit::<u8>::uninit(); 64];
    for _ in 0..MAX_BELL_READS {
        match SockRef::from(bell).recv_with_flags(&mut buf, libc::MSG_DONTWAIT) {
            Ok(0) => return Ok(Bell::Hangup),
            // A short read took all there was; no need for a second call to see EAGAIN
            // (a byte that arrives after it is a new readiness event, which
            // `clear_ready` leaves alone).
            Ok(n) if n < buf.len() => return Ok(Bell::Drained),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Bell::Drained),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(Bell::More)
}

/// The doorbells of one side.
pub(super) struct Bells {
    /// Ours: the peer rings it after writing into the ring we read.
    pub(super) data_wait: OwnedFd,
    /// Ours: the peer rings it after freeing room in the ring we write.
    pub(super) room_wait: OwnedFd,
    /// The peer's data bell: we ring it after writing into the ring it reads.
    pub(super) peer_data: OwnedFd,
    /// The peer's room bell: we ring it after freeing room in the ring it writes.
    pub(super) peer_room: OwnedFd,
}
