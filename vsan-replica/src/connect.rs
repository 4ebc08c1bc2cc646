//! Keeping mirrored disks linked to their peers: dialing with backoff, and accepting
//! links and routing each to its disk.
//!
//! One side dials and the other accepts (by convention the node with the lower id
//! dials), so the two never race to build two links for one disk. Either may start
//! first: the dialer retries with exponential backoff until the peer listens, and again
//! whenever the link drops.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};
use vsan_core::ErrorKind;

use crate::mirror::MirroredDisk;
use crate::protocol::Message;
use crate::transport::{Listener, Transport};

const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(3);
/// A link that drops sooner than this after it was attached counts as a failed attempt.
const STABLE_AFTER: Duration = Duration::from_secs(2);
/// How long an accepted link may take to say which disk it is for.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Dial `addr` for `disk` whenever it has no link, forever (run it as a task and abort
/// it to stop).
pub async fn dial_loop(transport: Arc<dyn Transport>, addr: String, disk: MirroredDisk) {
    let mut status = disk.watch_status();
    let mut backoff = BACKOFF_MIN;
    // The last refusal logged, so a peer that keeps refusing is reported once per reason.
    let mut last_refusal = String::new();
    loop {
        // Wait until the disk needs a link.
        while status.borrow_and_update().link_attached {
            if status.changed().await.is_err() {
                return;
            }
        }
        match transport.connect(&addr).await {
            Ok(link) => {
                last_refusal.clear();
                debug!(disk = disk.name(), %addr, "connected to the peer");
                let attached_at = tokio::time::Instant::now();
                disk.attach(link, None);
                // Wait for the attach to show, then for the link to drop again.
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    while !status.borrow_and_update().link_attached {
                        if status.changed().await.is_err() {
                            return;
                        }
                    }
                })
                .await;
                while status.borrow_and_update().link_attached {
                    if status.changed().await.is_err() {
                        return;
                    }
                }
                if attached_at.elapsed() >= STABLE_AFTER {
                    backoff = BACKOFF_MIN;
                    continue;
                }
            }
            Err(e) if e.kind() == ErrorKind::Protocol => {
                // Authentication or certificate refused, or the wrong protocol: the
                // operator must act; retrying will not fix it.
                let text = e.to_string();
                if text != last_refusal {
                    warn!(disk = disk.name(), %addr, "link to the peer refused: {e}");
                    last_refusal = text;
                }
            }
            Err(e) => debug!(disk = disk.name(), %addr, "peer not reachable yet: {e}"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Accept links on `listener` and hand each to the disk its first message (the peer's
/// Hello) names, forever.
pub async fn accept_loop(listener: Box<dyn Listener>, disks: HashMap<String, MirroredDisk>) {
    accept_loop_shared(listener, Arc::new(parking_lot::RwLock::new(disks))).await
}

/// The mirrored disks an acceptor routes links to, by name; disks may come and go while
/// it runs.
pub type DiskRegistry = Arc<parking_lot::RwLock<HashMap<String, MirroredDisk>>>;

fn lookup(disks: &DiskRegistry, name: &str) -> Option<MirroredDisk> {
    disks.read().get(name).cloned()
}

/// Like [`accept_loop`], over a registry that may change while it runs (disks created or
/// deleted by an operator).
pub async fn accept_loop_shared(listener: Box<dyn Listener>, disks: DiskRegistry) {
    info!(addr = listener.local_addr(), "replication listener up");
    loop {
        let mut link = match listener.accept().await {
            Ok(l) => l,
            Err(e) => {
                warn!("replication accept failed: {e}");
                tokio::time::sleep(BACKOFF_MIN).await;
                continue;
            }
        };
        let disks = Arc::clone(&disks);
        tokio::spawn(async move {
            let first = tokio::time::timeout(HELLO_TIMEOUT, link.recv()).await;
            match first {
                Ok(Ok(Message::Hello(h))) => match lookup(&disks, &h.disk_name) {
                    Some(disk) => disk.attach(link, Some(Message::Hello(h))),
                    None => {
                        let reason =
                            format!("this node has no mirrored disk named {:?}", h.disk_name);
                        warn!(peer = link.peer(), "{reason}");
                        let _ = link.send(Message::Refuse { reason }).await;
                        let _ = link.close().await;
                    }
                },
                Ok(Ok(other)) => warn!(
                    peer = link.peer(),
                    "link did not start with Hello: {other:?}"
                ),
                Ok(Err(e)) if e.kind() == ErrorKind::Protocol => {
                    warn!(peer = link.peer(), "incoming link dropped: {e}");
                }
                Ok(Err(e)) => info!(peer = link.peer(), "incoming link closed before Hello: {e}"),
                Err(_) => warn!(peer = link.peer(), "no Hello within {HELLO_TIMEOUT:?}"),
            }
        });
    }
}
