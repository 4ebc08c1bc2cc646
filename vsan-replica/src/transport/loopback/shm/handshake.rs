//! Setting up a link: the hello and the reply over the Unix socket, with the memfd and
//! the doorbells passed as `SCM_RIGHTS`, and the acceptor's checks of all it is given.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use socket2::SockRef;
use tokio::io::Interest;
use tokio::net::UnixStream;
use vsan_core::{Error, ErrorKind, Result};

use super::doorbell::{Bells, doorbell};
use super::link::{Conn, Side, link_over};
use super::region::Region;
use super::{
    CMSG_WORDS, HANDSHAKE_MAGIC, HELLO_FDS, HELLO_LEN, MAX_FDS, REPLY_FDS, REPLY_LEN, REPLY_OK,
    REPLY_REASON_AT, REPLY_REFUSED, SHM_VERSION, ShmConfig, protocol,
};
use crate::transport::Link;

/// One `sendmsg` of `data` with `fds` attached (non-blocking).
pub(super) fn sendmsg_fds(
    sock: BorrowedFd<'_>,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    let fds = &fds[..fds.len().min(MAX_FDS)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr().cast_mut().cast(),
        iov_len: data.len(),
    };
    let mut control = [0u64; CMSG_WORDS];
    // SAFETY: msghdr is plain data; all zeroes is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let payload = (fds.len() * size_of::<RawFd>()) as u32;
        msg.msg_control = control.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE is plain arithmetic; the result fits `control` as
        // `fds.len() <= MAX_FDS`.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(payload) } as _;
        // SAFETY: `msg_control` points at `msg_controllen` writable, 8-aligned bytes, room
        // for one header and `payload` bytes of descriptors, so CMSG_FIRSTHDR is non-null
        // and the writes stay inside `control` (unaligned writes for the data).
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload) as _;
            let out = libc::CMSG_DATA(cmsg).cast::<RawFd>();
            for (i, fd) in fds.iter().enumerate() {
                out.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    // SAFETY: `msg` points at `iov` (over `data`) and `control`, both alive for the call.
    let sent = unsafe {
        libc::sendmsg(
            sock.as_raw_fd(),
            &msg,
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(sent as usize)
}

/// One `recvmsg` into `buf` (non-blocking); descriptors received are appended to `fds`.
/// Returns the bytes read and whether descriptors were cut off for lack of room.
pub(super) fn recvmsg_fds(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<(usize, bool)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; CMSG_WORDS];
    // SAFETY: msghdr is plain data; all zeroes is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = size_of_val(&control) as _;
    // SAFETY: `msg` points at `iov` (over `buf`, writable) and `control`, both alive for
    // the call and of the lengths given.
    let read = unsafe {
        libc::recvmsg(
            sock.as_raw_fd(),
            &mut msg,
            libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT,
        )
    };
    if read < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `msg` was filled in by recvmsg; CMSG_FIRSTHDR returns null or a header
    // inside `control`.
    let mut cmsg = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !cmsg.is_null() {
        // SAFETY: a non-null `cmsg` from CMSG_FIRSTHDR/CMSG_NXTHDR is a complete header
        // inside `control`.
        let (level, kind, len) = unsafe {
            (
                (*cmsg).cmsg_level,
                (*cmsg).cmsg_type,
                (*cmsg).cmsg_len as usize,
            )
        };
        if level == libc::SOL_SOCKET && kind == libc::SCM_RIGHTS {
            // SAFETY: plain arithmetic.
            let header = unsafe { libc::CMSG_LEN(0) } as usize;
            let count = len.saturating_sub(header) / size_of::<RawFd>();
            // SAFETY: the kernel wrote `count` descriptors after this header, inside
            // `control` (it cuts the message, and says so, when they do not fit).
            let data = unsafe { libc::CMSG_DATA(cmsg) }.cast::<RawFd>();
            for i in 0..count {
                // SAFETY: in bounds as above; CMSG_DATA need not be aligned for an int.
                let raw = unsafe { data.add(i).read_unaligned() };
                // SAFETY: the kernel just installed this descriptor for us; nothing else
                // owns it.
                fds.push(unsafe { OwnedFd::from_raw_fd(raw) });
            }
        }
        // SAFETY: `cmsg` is a header inside `msg`'s control buffer.
        cmsg = unsafe { libc::CMSG_NXTHDR(&msg, cmsg) };
    }
    Ok((read as usize, msg.msg_flags & libc::MSG_CTRUNC != 0))
}

/// Sends all of `data`, with `fds` attached to its first byte.
pub(super) async fn send_handshake(
    sock: &UnixStream,
    data: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    let mut done = 0;
    while done < data.len() {
        let attach = if done == 0 { fds } else { &[] };
        let sent = sock
            .async_io(Interest::WRITABLE, || {
                sendmsg_fds(sock.as_fd(), &data[done..], attach)
            })
            .await?;
        if sent == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        done += sent;
    }
    Ok(())
}

/// Reads exactly `len` bytes and the descriptors that come with them. `Ok(None)` when
/// the peer hangs up first.
pub(super) async fn recv_handshake(
    sock: &UnixStream,
    len: usize,
) -> io::Result<Option<(Vec<u8>, Vec<OwnedFd>, bool)>> {
    let mut buf = vec![0u8; len];
    let mut fds = Vec::new();
    let mut truncated = false;
    let mut got = 0;
    while got < len {
        let (n, cut) = sock
            .async_io(Interest::READABLE, || {
                recvmsg_fds(sock.as_fd(), &mut buf[got..], &mut fds)
            })
            .await?;
        truncated |= cut;
        if n == 0 {
            return Ok(None);
        }
        got += n;
        if fds.len() > MAX_FDS {
            truncated = true;
            break;
        }
    }
    Ok(Some((buf, fds, truncated)))
}

pub(super) fn hello() -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[0..8].copy_from_slice(&HANDSHAKE_MAGIC);
    h[8..12].copy_from_slice(&SHM_VERSION.to_ne_bytes());
    h
}

pub(super) fn reply(status: u32, reason: &str) -> [u8; REPLY_LEN] {
    let mut r = [0u8; REPLY_LEN];
    r[0..8].copy_from_slice(&HANDSHAKE_MAGIC);
    r[8..12].copy_from_slice(&SHM_VERSION.to_ne_bytes());
    r[12..16].copy_from_slice(&status.to_ne_bytes());
    let mut end = reason.len().min(REPLY_LEN - REPLY_REASON_AT);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    r[16..20].copy_from_slice(&(end as u32).to_ne_bytes());
    r[REPLY_REASON_AT..REPLY_REASON_AT + end].copy_from_slice(&reason.as_bytes()[..end]);
    r
}

pub(super) fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The connector's handshake over `stream`, handing over `region` (backed by `file`),
/// bounded by the handshake timeout.
pub(super) async fn connect_with(
    stream: UnixStream,
    region: Arc<Region>,
    file: File,
    config: &ShmConfig,
    peer: String,
) -> Result<Link> {
    let limit = config.handshake_timeout;
    match tokio::time::timeout(
        limit,
        connector_handshake(stream, region, file, config, &peer),
    )
    .await
    {
        Ok(link) => link,
        Err(_) => Err(Error::new(
            ErrorKind::Timeout,
            format!("{peer}: handshake not done within {limit:?}"),
        )),
    }
}

pub(super) async fn connector_handshake(
    stream: UnixStream,
    region: Arc<Region>,
    file: File,
    config: &ShmConfig,
    peer: &str,
) -> Result<Link> {
    let io_err = |e| Error::io(format!("{peer}: handshake"), e);
    let (data_wait, data_give) = doorbell().map_err(io_err)?;
    let (room_wait, room_give) = doorbell().map_err(io_err)?;
    send_handshake(
        &stream,
        &hello(),
        &[file.as_fd(), data_give.as_fd(), room_give.as_fd()],
    )
    .await
    .map_err(io_err)?;
    // The peer has its copies; ours would keep our own bells from seeing it hang up.
    drop((file, data_give, room_give));
    let Some((answer, fds, truncated)) =
        recv_handshake(&stream, REPLY_LEN).await.map_err(io_err)?
    else {
        return Err(protocol(
            peer,
            "the listener hung up during the handshake (not a vsan shm listener?)",
        ));
    };
    // Whatever is refused below goes to the reaper, not closed on this runtime thread.
    let mut fds = PeerFds(fds);
    if answer[0..8] != HANDSHAKE_MAGIC {
        return Err(protocol(
            peer,
            "the listener's reply is not a vsan shm reply",
        ));
    }
    let version = u32_at(&answer, 8);
    let status = u32_at(&answer, 12);
    if status == REPLY_REFUSED {
        let len = (u32_at(&answer, 16) as usize).min(REPLY_LEN - REPLY_REASON_AT);
        let reason = String::from_utf8_lossy(&answer[REPLY_REASON_AT..REPLY_REASON_AT + len]);
        return Err(protocol(
            peer,
            format!("the listener refused the link: {reason}"),
        ));
    }
    if version != SHM_VERSION || status != REPLY_OK {
        return Err(protocol(
            peer,
            format!("the listener answered version {version} status {status}"),
        ));
    }
    if truncated || fds.0.len() != REPLY_FDS || !fds.0.iter().all(is_unix_socket) {
        return Err(protocol(
            peer,
            format!(
                "the listener sent {} descriptors, expected {REPLY_FDS} Unix doorbell sockets",
                fds.0.len()
            ),
        ));
    }
    let [peer_data, peer_room]: [OwnedFd; REPLY_FDS] = std::mem::take(&mut fds.0)
        .try_into()
        .map_err(|_| protocol(peer, "doorbells missing"))?;
    let conn = Conn::new(
        stream,
        &region,
        Side::Connector,
        Bells {
            data_wait,
            room_wait,
            peer_data,
            peer_room,
        },
        config,
        peer.to_string(),
    )
    .map_err(io_err)?;
    Ok(link_over(conn, config))
}

pub(super) async fn accept_with(
    stream: UnixStream,
    config: &ShmConfig,
    peer: String,
) -> Result<Link> {
    let io_err = |e| Error::io(format!("{peer}: handshake"), e);
    let Some((hello, fds, truncated)) = recv_handshake(&stream, HELLO_LEN).await.map_err(io_err)?
    else {
        return Err(Error::new(
            ErrorKind::Closed,
            format!("{peer}: the peer hung up during the handshake"),
        ));
    };
    let mut fds = fds;
    let checked = check_hello(&hello, &mut fds, truncated);
    let (region, peer_data, peer_room) = match checked {
        Ok(parts) => parts,
        Err(reason) => {
            reap(std::mem::take(&mut fds));
            // Best effort: tell the peer why before hanging up.
            let _ = tokio::time::timeout(
                Duration::from_millis(100),
                send_handshake(&stream, &reply(REPLY_REFUSED, reason.context()), &[]),
            )
            .await;
            return Err(protocol(
                &peer,
                format!("refused the link: {}", reason.context()),
            ));
        }
    };
    let (data_wait, data_give) = doorbell().map_err(io_err)?;
    let (room_wait, room_give) = doorbell().map_err(io_err)?;
    send_handshake(
        &stream,
        &reply(REPLY_OK, ""),
        &[data_give.as_fd(), room_give.as_fd()],
    )
    .await
    .map_err(io_err)?;
    drop((data_give, room_give));
    let conn = Conn::new(
        stream,
        &Arc::new(region),
        Side::Acceptor,
        Bells {
            data_wait,
            room_wait,
            peer_data,
            peer_room,
        },
        config,
        peer.clone(),
    )
    .map_err(io_err)?;
    Ok(link_over(conn, config))
}

/// Checks the connector's hello and what came with it; the error is the reason to give.
pub(super) fn check_hello(
    hello: &[u8],
    fds: &mut Vec<OwnedFd>,
    truncated: bool,
) -> Result<(Region, OwnedFd, OwnedFd)> {
    if hello[0..8] != HANDSHAKE_MAGIC {
        return Err(refused("not a vsan shm hello"));
    }
    let version = u32_at(hello, 8);
    if version != SHM_VERSION {
        return Err(refused(format!(
            "handshake version {version}, this side speaks {SHM_VERSION}"
        )));
    }
    if truncated || fds.len() != HELLO_FDS {
        return Err(refused(format!(
            "{} descriptors came with the hello, expected {HELLO_FDS}",
            fds.len()
        )));
    }
    // Unix sockets only (their close never blocks; a TCP socket's may linger).
    if !is_unix_socket(&fds[1]) || !is_unix_socket(&fds[2]) {
        return Err(refused(
            "the doorbells are not sockets (of the Unix domain)",
        ));
    }
    let file = File::from(fds.remove(0));
    match Region::open(&file) {
        Ok(region) => {
            let room = fds.pop().unwrap();
            let data = fds.pop().unwrap();
            Ok((region, data, room))
        }
        Err(why) => {
            fds.insert(0, OwnedFd::from(file));
            Err(why)
        }
    }
}

/// Whether `fd` is a Unix domain socket (whose close never blocks).
pub(super) fn is_unix_socket(fd: &OwnedFd) -> bool {
    SockRef::from(fd)
        .domain()
        .is_ok_and(|d| d == socket2::Domain::UNIX)
}

/// Closes descriptors a peer handed over and this side did not take, on one reaper
/// thread instead of a runtime worker: closing an unknown descriptor may block (a TCP
/// socket's linger, a FUSE flush), and a stuck reaper stalls nothing but itself.
pub(super) fn reap(fds: Vec<OwnedFd>) {
    static REAPER: std::sync::OnceLock<
        Option<std::sync::Mutex<std::sync::mpsc::Sender<Vec<OwnedFd>>>>,
    > = std::sync::OnceLock::new();
    if fds.is_empty() {
        return;
    }
    let reaper = REAPER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<OwnedFd>>();
        std::thread::Builder::new()
            .name("vsan-shm-reaper".into())
            .spawn(move || {
                for fds in rx {
                    drop(fds);
                }
            })
            .ok()
            .map(|_| std::sync::Mutex::new(tx))
    });
    match reaper {
        Some(tx) => {
            if let Ok(tx) = tx.lock() {
                let _ = tx.send(fds);
            }
        }
        // No thread could be started: close them here rather than leak them.
        None => drop(fds),
    }
}

/// Descriptors from the peer that go to the reaper unless taken.
pub(super) struct PeerFds(Vec<OwnedFd>);

impl Drop for PeerFds {
    fn drop(&mut self) {
        reap(std::mem::take(&mut self.0));
    }
}

/// Why the acceptor refuses a hello: the peer broke the protocol. The text is the reason
/// the peer is told.
fn refused(why: impl Into<String>) -> Error {
    Error::new(ErrorKind::Protocol, why)
}
