//! The verbs backend (feature `rdma`): rdma-core's `libibverbs` and `librdmacm` through
//! the `rdma-sys` binding. Connections are set up with `rdma_cm` (address and route
//! resolution, connect and accept with a hello in the private data) on reliable
//! connected queue pairs; the data path is SEND/RECV from one registered buffer pool,
//! driven by [`Engine`](super::engine::Engine).
//!
//! Every failure before a connection is established is a reason to fall back to TCP
//! ([`Setup::Unavailable`]); after it is established (authentication) failures are
//! reported.

use std::ffi::CStr;
use std::fmt;
use std::io;
use std::mem;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::Arc;

use rdma_sys as ffi;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use vsan_core::{Error, ErrorKind, IoFuture, Result};

use super::engine::{Engine, PeerParams};
use super::link::{self, LinkParams};
use super::{Link, Listener, RdmaConfig, Setup};
use crate::transport::auth::Role;

mod verbs;

use verbs::{Conn, EventChannel, Fd, IdPtr, RealNotifier, RealVerbs};

/// Private data both sides send: magic, version, 3 zero bytes, receive buffers, buffer
/// size (big-endian).
const HELLO_MAGIC: &[u8; 4] = b"VSRD";
const HELLO_VERSION: u8 = 1;
const HELLO_LEN: usize = 16;
/// Marks a receive work request's id (send ids are plain buffer numbers).
const RECV_BIT: u64 = 1 << 63;
/// Completions taken per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;
/// Incoming connection requests queued by the `rdma_cm` listener.
const LISTEN_BACKLOG: c_int = 16;
/// Links accepted and not yet taken by `accept`.
const ACCEPT_BACKLOG: usize = 16;

/// An OS or verbs call that failed, with the OS's reason: [`Io`](ErrorKind::Io).
fn os_error(what: &str) -> Error {
    Error::new(
        ErrorKind::Io,
        format!("{what}: {}", io::Error::last_os_error()),
    )
}

/// `Ok` when at least one RDMA device is present; [`NotSupported`](ErrorKind::NotSupported)
/// when this machine has none.
fn probe() -> Result<()> {
    let mut count: c_int = 0;
    // SAFETY: `ibv_get_device_list` only writes the count through the valid pointer.
    let list = unsafe { ffi::ibv_get_device_list(&mut count) };
    if list.is_null() {
        return Err(os_error("no RDMA device: ibv_get_device_list"));
    }
    // SAFETY: `list` came from `ibv_get_device_list` and is freed once, here.
    unsafe { ffi::ibv_free_device_list(list) };
    if count <= 0 {
        return Err(Error::new(ErrorKind::NotSupported, "no RDMA device"));
    }
    Ok(())
}

fn set_nonblocking(fd: RawFd) -> Result<()> {
    // SAFETY: fcntl on a descriptor we own (it belongs to an rdma-core channel we hold);
    // it reads and sets flags, touching no memory.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(os_error("fcntl(O_NONBLOCK)"));
    }
    Ok(())
}

/// Watches an rdma-core descriptor for readability.
///
/// # Safety
///
/// `raw` must stay open, and refer to the same description, until the returned value is
/// dropped.
unsafe fn watch(raw: RawFd, what: &str) -> Result<AsyncFd<Fd>> {
    set_nonblocking(raw)?;
    // SAFETY: upheld by the caller.
    unsafe { AsyncFd::register_with_interest(Fd(raw), Interest::READABLE) }
        .map_err(|e| Error::new(ErrorKind::Io, format!("watch {what}: {e}")))
}

/// A C socket address for `addr`.
fn sockaddr(addr: SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: an all-zero sockaddr_storage is a valid (unspecified) address.
    let mut storage: libc::sockaddr_storage = unsafe { mem::zeroed() };
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { ptr::write((&raw mut storage).cast::<libc::sockaddr_in>(), sin) };
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo().to_be(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { ptr::write((&raw mut storage).cast::<libc::sockaddr_in6>(), sin6) };
        }
    }
    storage
}

fn hello(config: &RdmaConfig) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..4].copy_from_slice(HELLO_MAGIC);
    out[4] = HELLO_VERSION;
    out[8..12].copy_from_slice(&config.credits.to_be_bytes());
    // Checked against MAX_BUFFER_LEN (16 MiB).
    out[12..16].copy_from_slice(&(config.buffer_size as u32).to_be_bytes());
    out
}

/// The connection parameters both `rdma_connect` and `rdma_accept` take: `hello` as the
/// private data, the most retries. The result points into `hello`, which must outlive its
/// use.
fn conn_param(hello: &[u8; HELLO_LEN]) -> ffi::rdma_conn_param {
    // SAFETY: an all-zero connection parameter block is valid; fields set below.
    let mut param: ffi::rdma_conn_param = unsafe { mem::zeroed() };
    param.private_data = hello.as_ptr().cast::<c_void>();
    param.private_data_len = HELLO_LEN as u8;
    param.retry_count = 7;
    param.rnr_retry_count = 7;
    param
}

/// The peer's hello, checked; a peer that sent none, or one out of range, broke the
/// protocol ([`Protocol`](ErrorKind::Protocol)).
fn parse_hello(data: &[u8]) -> Result<PeerParams> {
    // The transport may pad private data; only the first bytes are ours.
    let Some(h) = data.get(..HELLO_LEN) else {
        return Err(Error::new(
            ErrorKind::Protocol,
            "the peer sent no vsan hello (is it a vsan node?)",
        ));
    };
    if &h[..4] != HELLO_MAGIC || h[4] != HELLO_VERSION || h[5..8] != [0, 0, 0] {
        return Err(Error::new(
            ErrorKind::Protocol,
            "the peer's rdma hello is not one this version speaks",
        ));
    }
    let params = PeerParams {
        credits: u32::from_be_bytes([h[8], h[9], h[10], h[11]]),
        buf_len: u32::from_be_bytes([h[12], h[13], h[14], h[15]]) as usize,
    };
    params.check()?;
    Ok(params)
}

fn event_name(kind: ffi::rdma_cm_event_type::Type) -> String {
    // SAFETY: `rdma_event_str` returns a pointer to a static NUL-terminated string.
    let name = unsafe { ffi::rdma_event_str(kind) };
    if name.is_null() {
        return format!("event {kind}");
    }
    // SAFETY: checked non-null above; the string is static.
    unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned()
}

fn link_params(config: &RdmaConfig, role: Role) -> LinkParams {
    LinkParams {
        transport: "rdma",
        send_queue_limit: config.tcp.send_queue_limit,
        close_timeout: config.tcp.close_timeout,
        secret: config.tcp.secret.clone(),
        handshake_timeout: config.tcp.handshake_timeout,
        role,
    }
}

fn millis(d: std::time::Duration) -> c_int {
    c_int::try_from(d.as_millis()).unwrap_or(c_int::MAX).max(1)
}

/// Sets up an RDMA connection to `target`: the connection with its receives posted and
/// the peer's announced parameters.
async fn dial(target: SocketAddr, config: &RdmaConfig) -> Result<(Conn, PeerParams)> {
    let events = EventChannel::new()?;
    let mut conn = {
        let mut id: *mut ffi::rdma_cm_id = ptr::null_mut();
        // SAFETY: valid channel; `id` receives a new id, owned by `conn` right after.
        let rc = unsafe {
            ffi::rdma_create_id(
                events.ch,
                &mut id,
                ptr::null_mut(),
                ffi::rdma_port_space::RDMA_PS_TCP,
            )
        };
        if rc != 0 {
            return Err(os_error("rdma_create_id"));
        }
        Conn::new(events, id, config)
    };
    let step = millis(config.resolve_timeout);
    {
        let mut dst = sockaddr(target);
        // SAFETY: valid id; `dst` is a valid address for the call's duration.
        let rc = unsafe {
            ffi::rdma_resolve_addr(
                conn.id,
                ptr::null_mut(),
                (&raw mut dst).cast::<libc::sockaddr>(),
                step,
            )
        };
        if rc != 0 {
            return Err(os_error(&format!(
                "rdma_cm address resolution for {target}"
            )));
        }
    }
    conn.events
        .expect(
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED,
            &format!("rdma_cm address resolution for {target}"),
        )
        .await?;
    // SAFETY: valid id with a resolved address.
    if unsafe { ffi::rdma_resolve_route(conn.id, step) } != 0 {
        return Err(os_error(&format!("rdma_cm route resolution to {target}")));
    }
    conn.events
        .expect(
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED,
            &format!("rdma_cm route resolution to {target}"),
        )
        .await?;
    conn.build()?;
    {
        let hello = hello(config);
        let mut param = conn_param(&hello);
        // SAFETY: valid id with a queue pair; `param` and the `hello` it points into
        // outlive the call, which copies the private data.
        if unsafe { ffi::rdma_connect(conn.id, &mut param) } != 0 {
            return Err(os_error(&format!("rdma_connect to {target}")));
        }
    }
    let event = conn
        .events
        .next()
        .await
        .map_err(|e| Error::new(ErrorKind::Io, format!("rdma_connect to {target}: {e}")))?;
    match event.kind {
        ffi::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED => {
            let params = parse_hello(&event.private)?;
            Ok((conn, params))
        }
        ffi::rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => Err(Error::new(
            ErrorKind::Io,
            format!(
                "{target} refused the rdma connection (no rdma listener there?): {}",
                event.describe()
            ),
        )),
        _ => Err(Error::new(
            ErrorKind::Io,
            format!("rdma_connect to {target} failed: {}", event.describe()),
        )),
    }
}

/// Connects over RDMA, or says why it cannot.
pub(super) async fn connect(addr: &str, config: &RdmaConfig) -> std::result::Result<Link, Setup> {
    probe().map_err(Setup::Unavailable)?;
    let target = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| {
            Setup::Unavailable(Error::new(
                ErrorKind::from_io(&e),
                format!("resolve {addr}: {e}"),
            ))
        })?
        .next()
        .ok_or_else(|| {
            Setup::Unavailable(Error::new(
                ErrorKind::NotFound,
                format!("resolve {addr}: no address"),
            ))
        })?;
    let limit = config.connect_timeout;
    let (conn, params) = match tokio::time::timeout(limit, dial(target, config)).await {
        Ok(Ok(done)) => done,
        Ok(Err(why)) => return Err(Setup::Unavailable(why)),
        Err(_) => {
            return Err(Setup::Unavailable(Error::new(
                ErrorKind::Timeout,
                format!("no rdma connection to {target} within {limit:?}"),
            )));
        }
    };
    start_link(
        conn,
        params,
        format!("rdma:{target}"),
        config,
        Role::Connector,
    )
    .await
    .map_err(Setup::Failed)
}

async fn start_link(
    conn: Conn,
    params: PeerParams,
    peer: String,
    config: &RdmaConfig,
    role: Role,
) -> Result<Link> {
    let conn = Arc::new(conn);
    let verbs = RealVerbs {
        conn: Arc::clone(&conn),
    };
    let engine = Engine::new_posted(verbs, params, peer)?;
    link::establish(engine, RealNotifier { conn }, link_params(config, role)).await
}

/// A listening `rdma_cm` id.
struct Listening {
    id: *mut ffi::rdma_cm_id,
    events: EventChannel,
}

// SAFETY: the id is used only through thread-safe librdmacm calls, by its one owner.
unsafe impl Send for Listening {}
// SAFETY: as above; shared access only waits on the event channel.
unsafe impl Sync for Listening {}

impl Drop for Listening {
    fn drop(&mut self) {
        // SAFETY: the listening id is valid and destroyed once, before its channel (a
        // field, dropped after this).
        unsafe { ffi::rdma_destroy_id(self.id) };
    }
}

/// Listens with `rdma_cm` on `addr` (the TCP listener's address), or says why not.
pub(super) async fn listen(addr: &str, config: &RdmaConfig) -> Result<Box<dyn Listener>> {
    probe()?;
    let local: SocketAddr = addr.parse().map_err(|e| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("rdma listen on {addr}: {e}"),
        )
    })?;
    let events = EventChannel::new()?;
    let mut id: *mut ffi::rdma_cm_id = ptr::null_mut();
    // SAFETY: valid channel; `id` receives a new id, owned by `listening` right after.
    if unsafe {
        ffi::rdma_create_id(
            events.ch,
            &mut id,
            ptr::null_mut(),
            ffi::rdma_port_space::RDMA_PS_TCP,
        )
    } != 0
    {
        return Err(os_error("rdma_create_id"));
    }
    let listening = Listening { id, events };
    let mut sa = sockaddr(local);
    // SAFETY: valid id; `sa` is a valid address for the call's duration.
    if unsafe { ffi::rdma_bind_addr(listening.id, (&raw mut sa).cast::<libc::sockaddr>()) } != 0 {
        return Err(os_error(&format!("rdma_bind_addr {local}")));
    }
    // SAFETY: valid bound id.
    if unsafe { ffi::rdma_listen(listening.id, LISTEN_BACKLOG) } != 0 {
        return Err(os_error(&format!("rdma_listen {local}")));
    }
    let (incoming_tx, incoming) = mpsc::channel(ACCEPT_BACKLOG);
    let task = tokio::spawn(accept_loop(listening, config.clone(), incoming_tx));
    Ok(Box::new(RdmaCmListener {
        local: local.to_string(),
        incoming: tokio::sync::Mutex::new(incoming),
        task,
    }))
}

async fn accept_loop(
    listening: Listening,
    config: RdmaConfig,
    incoming: mpsc::Sender<Result<Link>>,
) {
    let mut handshakes = JoinSet::new();
    loop {
        tokio::select! {
            event = listening.events.next() => match event {
                Ok(e) if e.kind == ffi::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST => {
                    // Taken off the listener's channel at once, so the listener can be
                    // dropped with no request id left on it.
                    match adopt(e.id, &e.private, &config) {
                        Ok((conn, params)) => {
                            let incoming = incoming.clone();
                            let config = config.clone();
                            handshakes.spawn(async move {
                                let link = accept_one(conn, params, &config).await;
                                let _ = incoming.send(link).await;
                            });
                        }
                        Err(err) => {
                            let _ = incoming.send(Err(err)).await;
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    let _ = incoming
                        .send(Err(Error::io("rdma listener: rdma_get_cm_event", e)))
                        .await;
                    return;
                }
            },
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => {}
            () = incoming.closed() => return,
        }
    }
}

fn reject(id: IdPtr) {
    // SAFETY: `id` is a connection request id we own and no longer use; rejecting and
    // destroying it releases it.
    unsafe {
        ffi::rdma_reject(id.0, ptr::null(), 0);
        ffi::rdma_destroy_id(id.0);
    }
}

/// Takes a connection request: checks the peer's hello and moves the request id to a
/// channel of its own, owned by the returned connection.
fn adopt(id: IdPtr, private: &[u8], config: &RdmaConfig) -> Result<(Conn, PeerParams)> {
    let params = match parse_hello(private) {
        Ok(p) => p,
        Err(why) => {
            reject(id);
            return Err(why.context_prefix("rdma accept"));
        }
    };
    let events = match EventChannel::new() {
        Ok(ch) => ch,
        Err(why) => {
            reject(id);
            return Err(why.context_prefix("rdma accept"));
        }
    };
    // SAFETY: moves our request id to its own channel (its request event was
    // acknowledged when it was read), so its events do not mix with the listener's.
    if unsafe { ffi::rdma_migrate_id(id.0, events.ch) } != 0 {
        let why = os_error("rdma_migrate_id");
        reject(id);
        return Err(why.context_prefix("rdma accept"));
    }
    Ok((Conn::new(events, id.0, config), params))
}

/// Accepts one connection request taken by [`adopt`].
async fn accept_one(mut conn: Conn, params: PeerParams, config: &RdmaConfig) -> Result<Link> {
    let peer = {
        // SAFETY: valid id; the destination address is plain data in its route.
        let storage = unsafe { (*conn.id).route.addr.dst_addr_union.dst_storage };
        peer_name(&storage)
    };
    // Whatever step failed, the accept reports an I/O failure (as it always has).
    let io = |why: Error| {
        Error::new(
            ErrorKind::Io,
            format!("rdma accept from {peer}: {}", why.context()),
        )
    };
    if let Err(why) = conn.build() {
        // SAFETY: valid request id, rejected once; `conn` destroys it.
        unsafe { ffi::rdma_reject(conn.id, ptr::null(), 0) };
        return Err(io(why));
    }
    {
        let hello = hello(config);
        let mut param = conn_param(&hello);
        // SAFETY: valid request id with a queue pair; `param` and the `hello` it points
        // into outlive the call, which copies the private data.
        if unsafe { ffi::rdma_accept(conn.id, &mut param) } != 0 {
            return Err(io(os_error("rdma_accept")));
        }
    }
    let established = tokio::time::timeout(
        config.connect_timeout,
        conn.events.expect(
            ffi::rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED,
            "rdma connection",
        ),
    )
    .await;
    match established {
        Ok(Ok(_)) => {}
        Ok(Err(why)) => return Err(io(why)),
        Err(_) => {
            return Err(Error::new(
                ErrorKind::Timeout,
                format!(
                    "rdma accept from {peer}: not established within {:?}",
                    config.connect_timeout
                ),
            ));
        }
    }
    start_link(conn, params, format!("rdma:{peer}"), config, Role::Acceptor).await
}

fn peer_name(storage: &libc::sockaddr_storage) -> String {
    match c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin =
                unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = std::net::Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            SocketAddr::from((ip, u16::from_be(sin.sin_port))).to_string()
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6 = unsafe {
                &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            SocketAddr::from((ip, u16::from_be(sin6.sin6_port))).to_string()
        }
        _ => "unknown".to_string(),
    }
}

/// The `rdma_cm` side of an [`RdmaTransport`](super::RdmaTransport) listener.
struct RdmaCmListener {
    local: String,
    incoming: tokio::sync::Mutex<mpsc::Receiver<Result<Link>>>,
    task: JoinHandle<()>,
}

impl fmt::Debug for RdmaCmListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RdmaCmListener")
            .field("local", &self.local)
            .finish_non_exhaustive()
    }
}

impl Listener for RdmaCmListener {
    fn accept(&self) -> IoFuture<'_, Link> {
        Box::pin(async move {
            match self.incoming.lock().await.recv().await {
                Some(link) => link,
                None => Err(Error::new(
                    ErrorKind::Closed,
                    format!("rdma listener {}: stopped", self.local),
                )),
            }
        })
    }

    fn local_addr(&self) -> String {
        self.local.clone()
    }
}

impl Drop for RdmaCmListener {
    fn drop(&mut self) {
        self.task.abort();
    }
}
