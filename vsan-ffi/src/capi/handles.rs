//! Handles: what a `vsan_node *` or `vsan_disk *` given to C stands for.
//!
//! A handle is a token, not an address: the library never dereferences what C passes
//! back. Each handle is a number (a counter that never repeats, shifted, with a tag for
//! its type) looked up in one registry, so a closed handle, a handle of the wrong type,
//! or a made-up pointer is found out ([`VSAN_ERR_BAD_HANDLE`]) instead of being read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, RwLock};
use vsan_core::Geometry;

use super::{Failure, VSAN_ERR_BAD_HANDLE, VSAN_ERR_CLOSED, VSAN_ERR_NULL_POINTER};
use crate::node::{Node, NodeDisk};

/// An open node, as C sees it (opaque: only pointers to it are handed out, and those are
/// tokens, never dereferenced).
#[derive(Debug)]
pub struct vsan_node {
    _private: [u8; 0],
}

/// An open disk of a node, as C sees it (opaque, like [`vsan_node`]).
#[derive(Debug)]
pub struct vsan_disk {
    _private: [u8; 0],
}

const TAG_BITS: u32 = 4;
const TAG_NODE: usize = 0x5;
const TAG_DISK: usize = 0xa;

enum Object {
    Node(Arc<NodeObj>),
    Disk(Arc<DiskObj>),
}

static REGISTRY: LazyLock<RwLock<HashMap<usize, Object>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn new_handle(tag: usize) -> usize {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed) as usize;
    (id << TAG_BITS) | tag
}

/// A node opened through the C ABI: the node, the runtime it runs on, and the count of
/// calls and asynchronous I/Os in flight (closing waits for them).
pub(crate) struct NodeObj {
    pub(crate) handle: tokio::runtime::Handle,
    pub(crate) runtime: Mutex<Option<tokio::runtime::Runtime>>,
    pub(crate) node: Mutex<Option<Node>>,
    closing: AtomicBool,
    /// Cleared (under the registry's lock) when the node's handle is closed: no disk
    /// handle may be registered for it after that.
    registered: AtomicBool,
    in_flight: AtomicUsize,
    idle_lock: Mutex<()>,
    idle: Condvar,
    disks: Mutex<Vec<usize>>,
}

/// A disk opened through the C ABI.
pub(crate) struct DiskObj {
    pub(crate) node: Arc<NodeObj>,
    pub(crate) disk: NodeDisk,
    pub(crate) geometry: Geometry,
}

/// One call or asynchronous I/O counted in flight on a node; dropping it ends it.
pub(crate) struct InFlight {
    node: Arc<NodeObj>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.node.in_flight.fetch_sub(1, Ordering::SeqCst) == 1
            && self.node.closing.load(Ordering::SeqCst)
        {
            let _g = self.node.idle_lock.lock();
            self.node.idle.notify_all();
        }
    }
}

impl NodeObj {
    pub(crate) fn new(runtime: tokio::runtime::Runtime, node: Node) -> NodeObj {
        NodeObj {
            handle: runtime.handle().clone(),
            runtime: Mutex::new(Some(runtime)),
            node: Mutex::new(Some(node)),
            closing: AtomicBool::new(false),
            registered: AtomicBool::new(true),
            in_flight: AtomicUsize::new(0),
            idle_lock: Mutex::new(()),
            idle: Condvar::new(),
            disks: Mutex::new(Vec::new()),
        }
    }

    /// Count a call or I/O in flight, unless the node is closing.
    pub(crate) fn enter(self: &Arc<Self>) -> Result<InFlight, Failure> {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let guard = InFlight {
            node: Arc::clone(self),
        };
        if self.closing.load(Ordering::SeqCst) {
            return Err((VSAN_ERR_CLOSED, "the node is closing".into()));
        }
        Ok(guard)
    }

    /// Refuse new calls and wait up to `limit` for those in flight. Returns how many are
    /// still in flight.
    pub(crate) fn close_and_wait(&self, limit: Duration) -> usize {
        self.closing.store(true, Ordering::SeqCst);
        let deadline = Instant::now() + limit;
        let mut g = self.idle_lock.lock();
        loop {
            let n = self.in_flight.load(Ordering::SeqCst);
            if n == 0 || self.idle.wait_until(&mut g, deadline).timed_out() {
                return self.in_flight.load(Ordering::SeqCst);
            }
        }
    }
}

/// Register an open node; returns its handle.
pub(crate) fn register_node(node: Arc<NodeObj>) -> *mut vsan_node {
    let h = new_handle(TAG_NODE);
    REGISTRY.write().insert(h, Object::Node(node));
    h as *mut vsan_node
}

/// Register an open disk (and note it on its node); returns its handle. Fails when the
/// node's handle was closed meanwhile (its disks' handles are gone with it).
pub(crate) fn register_disk(disk: Arc<DiskObj>) -> Result<*mut vsan_disk, Failure> {
    let h = new_handle(TAG_DISK);
    let node = Arc::clone(&disk.node);
    let mut reg = REGISTRY.write();
    if !node.registered.load(Ordering::SeqCst) {
        return Err((VSAN_ERR_CLOSED, "the node was closed".into()));
    }
    reg.insert(h, Object::Disk(disk));
    node.disks.lock().push(h);
    Ok(h as *mut vsan_disk)
}

fn bad(what: &str, h: usize) -> Failure {
    (
        VSAN_ERR_BAD_HANDLE,
        format!("{what} {h:#x} is closed or was never opened by this library"),
    )
}

/// The node a handle stands for.
pub(crate) fn node(h: *const vsan_node) -> Result<Arc<NodeObj>, Failure> {
    if h.is_null() {
        return Err((VSAN_ERR_NULL_POINTER, "node is NULL".into()));
    }
    match REGISTRY.read().get(&(h as usize)) {
        Some(Object::Node(n)) => Ok(Arc::clone(n)),
        _ => Err(bad("node", h as usize)),
    }
}

/// The disk a handle stands for.
pub(crate) fn disk(h: *const vsan_disk) -> Result<Arc<DiskObj>, Failure> {
    if h.is_null() {
        return Err((VSAN_ERR_NULL_POINTER, "disk is NULL".into()));
    }
    match REGISTRY.read().get(&(h as usize)) {
        Some(Object::Disk(d)) => Ok(Arc::clone(d)),
        _ => Err(bad("disk", h as usize)),
    }
}

/// Forget a node handle and the handles of its disks; returns the node. A second call
/// with the same handle fails: the handle is gone.
pub(crate) fn unregister_node(h: *const vsan_node) -> Result<Arc<NodeObj>, Failure> {
    let n = node(h)?;
    let mut reg = REGISTRY.write();
    match reg.remove(&(h as usize)) {
        Some(Object::Node(n)) => {
            n.registered.store(false, Ordering::SeqCst);
            for d in n.disks.lock().drain(..) {
                reg.remove(&d);
            }
            Ok(n)
        }
        Some(other) => {
            reg.insert(h as usize, other);
            Err(bad("node", h as usize))
        }
        // Another thread closed it between the two looks.
        None => {
            drop(n);
            Err(bad("node", h as usize))
        }
    }
}

/// Forget a disk handle; returns the disk.
pub(crate) fn unregister_disk(h: *const vsan_disk) -> Result<Arc<DiskObj>, Failure> {
    disk(h)?;
    let mut reg = REGISTRY.write();
    match reg.remove(&(h as usize)) {
        Some(Object::Disk(d)) => {
            d.node.disks.lock().retain(|&x| x != h as usize);
            Ok(d)
        }
        Some(other) => {
            reg.insert(h as usize, other);
            Err(bad("disk", h as usize))
        }
        None => Err(bad("disk", h as usize)),
    }
}

/// For Rust programs that hold C handles (and the overhead benchmark): the device behind
/// a disk handle and the runtime its node runs on, or `None` for a closed or unknown
/// handle.
pub fn disk_for_rust(
    h: *mut vsan_disk,
) -> Option<(Arc<dyn vsan_core::BlockDevice>, tokio::runtime::Handle)> {
    let d = disk(h).ok()?;
    Some((Arc::clone(&d.disk.device), d.node.handle.clone()))
}
