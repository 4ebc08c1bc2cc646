//! A node's metrics, served in the Prometheus text format (0.0.4) at `GET /metrics` on
//! the address `node.metrics` gives.
//!
//! ```text
//!  NBD clients, C ABI
//!         |
//!   MeteredDevice ---- counts, bytes, latency ----> atomics (handles taken at wrap time)
//!         |                                               |
//!   mirror / cache / image                                v
//!         ^                                  Registry (prometheus-client) --> GET /metrics
//!         |                                               ^                  (hyper, HTTP/1.1)
//!   MirroredDisk::status, sync_progress,  <-- DiskStates collector, read at scrape time
//!   WriteBackCache::stats
//! ```
//!
//! What clients do is counted where they enter the disk: [`MeteredDevice`] wraps the
//! client-facing device of each disk (the mirror, cache or image), so NBD and the C ABI
//! are both counted and resync or destage traffic underneath is not. The I/O path only
//! touches atomics: each disk's counters and histograms are looked up once, when the
//! disk is wrapped, and the latency histogram keeps its buckets in atomics too
//! (prometheus-client's own `Histogram` takes a lock per observation). Everything that
//! is state rather than a count (link state, resync bytes left, cache dirty bytes) is
//! read from the disks when a scrape asks, so it is never stale.
//!
//! The metrics, labelled `disk="<name>"` (the iSCSI portal counters `portal="<address>"`):
//!
//! | name | type | what |
//! |---|---|---|
//! | `vsan_disk_operations_total{op}` | counter | requests completed (`op`: read, write, flush, discard, write_zeroes), failed ones included |
//! | `vsan_disk_errors_total{op}` | counter | requests that failed |
//! | `vsan_disk_read_bytes_total` | counter | bytes read by successful reads |
//! | `vsan_disk_written_bytes_total` | counter | bytes written by successful writes |
//! | `vsan_disk_operation_duration_seconds{op}` | histogram | request latency, submission to completion |
//! | `vsan_disk_size_bytes` | gauge | the disk's size |
//! | `vsan_mirror_link_state{peer,state}` | gauge | the link: 1 waiting, 2 handshaking, 3 connected, 4 degraded, the C ABI's `VSAN_LINK_*` codes (`state` names it) |
//! | `vsan_mirror_syncing` | gauge | 1 while a resync or verify runs |
//! | `vsan_mirror_resync_remaining_bytes` | gauge | bytes the running resync or verify has left (0 when none runs) |
//! | `vsan_mirror_out_of_sync_chunks` | gauge | chunks this replica's bitmap marks out of sync |
//! | `vsan_mirror_replica_current{proof}` | gauge | 1 once the local replica is proven current since the start (`proof`: handshake, witness, operator, only-writer, startup-timeout), 0 while unproven (`proof="none"`: nothing is served from it) |
//! | `vsan_mirror_unproven_seconds` | gauge | how long the replica has been waiting to be proven current (0 once it is) |
//! | `vsan_cache_dirty_bytes` | gauge | log bytes not yet destaged |
//! | `vsan_cache_log_size_bytes` | gauge | the cache log's size |
//! | `vsan_cache_read_hits_total`, `vsan_cache_read_misses_total` | counter | blocks read from the cache / the backing store |
//! | `vsan_cache_destaged_bytes_total` | counter | log bytes destaged |
//!
//! | `vsan_iscsi_commands_total{portal}` | counter | SCSI commands completed by the portal's iSCSI server (labelled `portal`, not `disk`: one server serves every target on its portal) |
//! | `vsan_iscsi_sessions_total{portal}` | counter | iSCSI sessions that completed login there (discovery and normal) |
//! | `vsan_iscsi_sessions_open{portal}` | gauge | iSCSI sessions open there now |
//! | `vsan_iscsi_logins_refused_total{portal}` | counter | logins refused there (authentication, bad keys, unknown target) |
//! | `vsan_iscsi_target_sessions{target}` | gauge | sessions logged in to the disk's iSCSI target |
//! | `vsan_vhost_user_connected` | gauge | 1 while a vhost-user front end is connected to the disk's socket |
//! | `vsan_vhost_user_connections_total` | counter | vhost-user front ends accepted there |
//! | `vsan_vhost_user_{requests,reads,writes,errors,bad_chains}_total{queue}` | counter | per queue of the disk's vhost-user export: chains taken, reads and writes completed, requests failed by the disk (IOERR), chains refused as malformed |
//! | `vsan_vhost_user_{read,written}_bytes_total{queue}` | counter | bytes read and written through the queue |
//! | `vsan_vhost_user_in_flight{queue}` | gauge | requests of the queue running now |
//!
//! Mirror metrics exist for mirrored disks, cache metrics for cached ones, iSCSI metrics
//! for disks with a target (iSCSI I/O is also counted by the `vsan_disk_*` metrics: it
//! enters the disk through the same counted device).

use std::convert::Infallible;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet, prometheus_text,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Registry, Unit};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, warn};
use vsan_core::export::iscsi::ServerStats;
use vsan_core::{BlockDevice, Geometry, IoFlags, IoFuture, Result};
use vsan_replica::protocol::{Freshness, LinkState};

use super::{NodeDisk, StartError};

/// Upper bounds of the latency buckets, in nanoseconds: 10 µs doubling to about 10.5 s
/// (an NBD round trip on loopback is tens of µs; a mirrored write to a slow disk, or one
/// held while the peer times out, takes seconds).
const LATENCY_BOUNDS_NS: [u64; 21] = {
    let mut b = [0u64; 21];
    let mut i = 0;
    while i < b.len() {
        b[i] = 10_000 << i;
        i += 1;
    }
    b
};

/// Connections served at once; more are closed as they come (a scraper needs one).
const MAX_CONNECTIONS: usize = 64;

/// How long a connection may take to send its request headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a metrics connection is kept, whatever it does.
const CONNECTION_LIMIT: Duration = Duration::from_secs(10);

/// A latency histogram whose buckets are atomics: observing is a few relaxed adds.
#[derive(Debug, Clone, Default)]
struct Latency(Arc<LatencyBuckets>);

#[derive(Debug, Default)]
struct LatencyBuckets {
    /// Observations per bucket (not cumulative); the last one is `+Inf`.
    counts: [AtomicU64; LATENCY_BOUNDS_NS.len() + 1],
    sum_ns: AtomicU64,
}

impl Latency {
    /// Count one request that took `took`.
    fn observe(&self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        // The first bucket whose bound is at least `ns` (`le` is inclusive).
        let i = LATENCY_BOUNDS_NS.partition_point(|&b| b < ns);
        self.0.counts[i].fetch_add(1, Ordering::Relaxed);
        self.0.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Observations so far.
    #[cfg(test)]
    fn count(&self) -> u64 {
        self.0
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }
}

impl TypedMetric for Latency {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Latency {
    fn encode(&self, mut encoder: MetricEncoder) -> std::result::Result<(), fmt::Error> {
        let buckets: Vec<(f64, u64)> = LATENCY_BOUNDS_NS
            .iter()
            .map(|&ns| ns as f64 / 1e9)
            .chain(std::iter::once(f64::INFINITY))
            .zip(&self.0.counts)
            .map(|(le, c)| (le, c.load(Ordering::Relaxed)))
            .collect();
        // The count is the buckets' sum, so `_count` and the `+Inf` bucket always agree.
        let count = buckets.iter().map(|(_, c)| c).sum();
        let sum = self.0.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    disk: String,
    op: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DiskLabels {
    disk: String,
}

/// One operation kind's metrics on one disk.
#[derive(Debug, Clone)]
struct OpMetrics {
    completed: Counter,
    errors: Counter,
    latency: Latency,
}

impl OpMetrics {
    /// Account for a request that started at `start` and ended with `r`; `bytes` (when
    /// given) grows by `len` if it succeeded.
    fn done<T>(&self, start: Instant, r: &Result<T>, bytes: Option<(&Counter, u64)>) {
        self.latency.observe(start.elapsed());
        self.completed.inc();
        match (r, bytes) {
            (Ok(_), Some((counter, len))) => {
                counter.inc_by(len);
            }
            (Ok(_), None) => {}
            (Err(_), _) => {
                self.errors.inc();
            }
        }
    }
}

/// The handles of one disk's I/O metrics.
#[derive(Debug, Clone)]
struct DiskIo {
    read: OpMetrics,
    write: OpMetrics,
    flush: OpMetrics,
    discard: OpMetrics,
    write_zeroes: OpMetrics,
    read_bytes: Counter,
    written_bytes: Counter,
}

/// A [`BlockDevice`] that counts what goes through it: requests by kind, failures,
/// bytes read and written, and each request's latency. Every call goes on to the inner
/// device unchanged.
pub struct MeteredDevice {
    inner: Arc<dyn BlockDevice>,
    io: DiskIo,
}

impl fmt::Debug for MeteredDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MeteredDevice")
            .field("geometry", &self.inner.geometry())
            .finish_non_exhaustive()
    }
}

impl MeteredDevice {
    /// Time `fut` (made after `start`) and account for it in `op`.
    fn timed<'a, T: Send + 'a>(
        op: &'a OpMetrics,
        start: Instant,
        fut: IoFuture<'a, T>,
        bytes: Option<(&'a Counter, u64)>,
    ) -> IoFuture<'a, T> {
        Box::pin(async move {
            let r = fut.await;
            op.done(start, &r, bytes);
            r
        })
    }
}

impl BlockDevice for MeteredDevice {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }

    fn read(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        // The clock starts before the inner call: a mirror sends the request when the
        // future is made, not when it is first polled.
        let start = Instant::now();
        let fut = self.inner.read(offset, len);
        Self::timed(
            &self.io.read,
            start,
            fut,
            Some((&self.io.read_bytes, len as u64)),
        )
    }

    fn write(&self, offset: u64, data: Bytes, flags: IoFlags) -> IoFuture<'_, ()> {
        let start = Instant::now();
        let len = data.len() as u64;
        let fut = self.inner.write(offset, data, flags);
        Self::timed(
            &self.io.write,
            start,
            fut,
            Some((&self.io.written_bytes, len)),
        )
    }

    fn flush(&self) -> IoFuture<'_, ()> {
        let start = Instant::now();
        let fut = self.inner.flush();
        Self::timed(&self.io.flush, start, fut, None)
    }

    fn discard(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        let start = Instant::now();
        let fut = self.inner.discard(offset, len, flags);
        Self::timed(&self.io.discard, start, fut, None)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: IoFlags) -> IoFuture<'_, ()> {
        let start = Instant::now();
        let fut = self.inner.write_zeroes(offset, len, flags);
        Self::timed(&self.io.write_zeroes, start, fut, None)
    }

    fn read_once(&self, offset: u64, len: usize) -> IoFuture<'_, Bytes> {
        let start = Instant::now();
        let fut = self.inner.read_once(offset, len);
        Self::timed(
            &self.io.read,
            start,
            fut,
            Some((&self.io.read_bytes, len as u64)),
        )
    }

    fn data_loss_count(&self) -> u64 {
        self.inner.data_loss_count()
    }
}

/// The `op` label of each kind of request.
const OPS: [&str; 5] = ["read", "write", "flush", "discard", "write_zeroes"];

/// The node's disk I/O metrics (registered once per node): what wraps a disk's device in
/// a [`MeteredDevice`], and drops a deleted disk's series. Cheap to clone; clones share
/// the series.
#[derive(Debug, Clone)]
pub struct DiskMeters {
    completed: Family<OpLabels, Counter>,
    errors: Family<OpLabels, Counter>,
    latency: Family<OpLabels, Latency>,
    read_bytes: Family<DiskLabels, Counter>,
    written_bytes: Family<DiskLabels, Counter>,
}

impl DiskMeters {
    fn register(registry: &mut Registry) -> DiskMeters {
        let f = DiskMeters {
            completed: Family::default(),
            errors: Family::default(),
            latency: Family::default(),
            read_bytes: Family::default(),
            written_bytes: Family::default(),
        };
        registry.register(
            "vsan_disk_operations",
            "Requests completed by clients of the disk (NBD, C ABI), failed ones included",
            f.completed.clone(),
        );
        registry.register("vsan_disk_errors", "Requests that failed", f.errors.clone());
        registry.register_with_unit(
            "vsan_disk_operation_duration",
            "Request latency, from submission to completion",
            Unit::Seconds,
            f.latency.clone(),
        );
        registry.register_with_unit(
            "vsan_disk_read",
            "Bytes read by successful reads",
            Unit::Bytes,
            f.read_bytes.clone(),
        );
        registry.register_with_unit(
            "vsan_disk_written",
            "Bytes written by successful writes",
            Unit::Bytes,
            f.written_bytes.clone(),
        );
        f
    }

    /// `device`, counted as disk `disk` (its series created at zero).
    pub fn wrap(&self, disk: &str, device: Arc<dyn BlockDevice>) -> Arc<dyn BlockDevice> {
        Arc::new(MeteredDevice {
            inner: device,
            io: self.disk(disk),
        })
    }

    /// Drop disk `disk`'s series (a deleted disk); a wrapper still counting for it
    /// counts unseen.
    pub fn forget(&self, disk: &str) {
        for op in OPS {
            let labels = OpLabels {
                disk: disk.to_string(),
                op,
            };
            self.completed.remove(&labels);
            self.errors.remove(&labels);
            self.latency.remove(&labels);
        }
        let labels = DiskLabels {
            disk: disk.to_string(),
        };
        self.read_bytes.remove(&labels);
        self.written_bytes.remove(&labels);
    }

    /// The handles of `disk`'s metrics (created at zero), taken once.
    fn disk(&self, disk: &str) -> DiskIo {
        let op = |op: &'static str| {
            let labels = OpLabels {
                disk: disk.to_string(),
                op,
            };
            OpMetrics {
                completed: self.completed.get_or_create_owned(&labels),
                errors: self.errors.get_or_create_owned(&labels),
                latency: self.latency.get_or_create_owned(&labels),
            }
        };
        let labels = DiskLabels {
            disk: disk.to_string(),
        };
        DiskIo {
            read: op(OPS[0]),
            write: op(OPS[1]),
            flush: op(OPS[2]),
            discard: op(OPS[3]),
            write_zeroes: op(OPS[4]),
            read_bytes: self.read_bytes.get_or_create_owned(&labels),
            written_bytes: self.written_bytes.get_or_create_owned(&labels),
        }
    }
}

/// Where the collector finds the node's disks on each scrape.
type DiskSource = Box<dyn Fn() -> Vec<NodeDisk> + Send + Sync>;

/// The node's disks, read on each scrape: size, mirror and cache state.
struct DiskStates(DiskSource);

impl fmt::Debug for DiskStates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DiskStates").finish_non_exhaustive()
    }
}

/// The number a link state is exported as, and its `state` label.
/// The `state` label of a link state (its value is the C ABI's `VSAN_LINK_*` code).
fn link_word(state: LinkState) -> &'static str {
    match state {
        LinkState::Waiting => "waiting",
        LinkState::Handshaking => "handshaking",
        LinkState::Connected => "connected",
        LinkState::Degraded => "degraded",
    }
}

fn gauge(v: u64) -> ConstGauge {
    ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX))
}

/// One gauge or counter per disk that `value` gives a value for.
fn per_disk<M: EncodeMetric>(
    disks: &[NodeDisk],
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    metric_type: MetricType,
    value: impl Fn(&NodeDisk) -> Option<M>,
) -> std::result::Result<(), fmt::Error> {
    let values: Vec<(&str, M)> = disks
        .iter()
        .filter_map(|d| Some((d.name.as_str(), value(d)?)))
        .collect();
    if values.is_empty() {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(name, help, unit, metric_type)?;
    for (disk, v) in &values {
        v.encode(metric.encode_family(&[("disk", *disk)])?)?;
    }
    Ok(())
}

impl Collector for DiskStates {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::result::Result<(), fmt::Error> {
        use MetricType::{Counter as C, Gauge as G};
        let disks = (self.0)();
        per_disk(
            &disks,
            &mut encoder,
            "vsan_disk_size",
            "The disk's size.",
            Some(&Unit::Bytes),
            G,
            |d| Some(gauge(d.device.geometry().size())),
        )?;

        // One status per mirror per scrape, so its gauges agree with each other.
        let mirrors: Vec<(&str, u32, _, Option<u64>)> = disks
            .iter()
            .filter_map(|d| {
                let m = d.mirror.as_ref()?;
                let remaining = m.sync_progress().map(|p| p.remaining_bytes());
                Some((d.name.as_str(), d.peer_id?, m.status(), remaining))
            })
            .collect();
        if !mirrors.is_empty() {
            let mut metric = encoder.encode_descriptor(
                "vsan_mirror_link_state",
                "The link to the peer: 1 waiting (never connected), 2 handshaking, \
                 3 connected (mirroring), 4 degraded (peer lost; writes go on alone), as the \
                 C ABI's VSAN_LINK_* codes; the state label names it.",
                None,
                G,
            )?;
            for (disk, peer, status, _) in &mirrors {
                let (code, word) = (crate::link_code(status.link), link_word(status.link));
                let peer = peer.to_string();
                let labels = [("disk", *disk), ("peer", peer.as_str()), ("state", word)];
                ConstGauge::new(i64::from(code)).encode(metric.encode_family(&labels)?)?;
            }
            let mut metric = encoder.encode_descriptor(
                "vsan_mirror_syncing",
                "1 while a resync or online verify runs.",
                None,
                G,
            )?;
            for (disk, _, status, _) in &mirrors {
                ConstGauge::new(i64::from(status.syncing))
                    .encode(metric.encode_family(&[("disk", *disk)])?)?;
            }
            let mut metric = encoder.encode_descriptor(
                "vsan_mirror_resync_remaining",
                "Bytes the running resync or verify has left to go through (0 when none runs).",
                Some(&Unit::Bytes),
                G,
            )?;
            for (disk, _, _, remaining) in &mirrors {
                gauge(remaining.unwrap_or(0)).encode(metric.encode_family(&[("disk", *disk)])?)?;
            }
            let mut metric = encoder.encode_descriptor(
                "vsan_mirror_out_of_sync_chunks",
                "Chunks this replica's bitmap marks out of sync with the peer.",
                None,
                G,
            )?;
            for (disk, _, status, _) in &mirrors {
                gauge(status.dirty_chunks).encode(metric.encode_family(&[("disk", *disk)])?)?;
            }
            let mut metric = encoder.encode_descriptor(
                "vsan_mirror_replica_current",
                "1 once the local replica is proven current since the node started (the \
                 proof label says how), 0 while it is not (proof=\"none\": nothing is \
                 served from it; requests wait).",
                None,
                G,
            )?;
            for (disk, _, status, _) in &mirrors {
                let (v, proof) = match status.freshness {
                    Freshness::Current(p) => (1, p.as_str()),
                    Freshness::Unproven { .. } => (0, "none"),
                };
                ConstGauge::new(v)
                    .encode(metric.encode_family(&[("disk", *disk), ("proof", proof)])?)?;
            }
            let mut metric = encoder.encode_descriptor(
                "vsan_mirror_unproven",
                "How long the local replica has been waiting to be proven current (0 once \
                 it is).",
                Some(&Unit::Seconds),
                G,
            )?;
            for (disk, _, status, _) in &mirrors {
                let waited = status
                    .unproven_since
                    .map_or(0.0, |t| t.elapsed().map_or(0.0, |d| d.as_secs_f64()));
                ConstGauge::new(waited).encode(metric.encode_family(&[("disk", *disk)])?)?;
            }
        }

        let caches: Vec<(&str, vsan_cache::CacheStats)> = disks
            .iter()
            .filter_map(|d| Some((d.name.as_str(), d.cache.as_ref()?.stats())))
            .collect();
        if !caches.is_empty() {
            type Stat = fn(&vsan_cache::CacheStats) -> u64;
            let rows: [(&str, &str, Option<Unit>, MetricType, Stat); 5] = [
                (
                    "vsan_cache_dirty",
                    "Log bytes not yet destaged to the backing store.",
                    Some(Unit::Bytes),
                    G,
                    |s| s.dirty_bytes,
                ),
                (
                    "vsan_cache_log_size",
                    "The cache log's size.",
                    Some(Unit::Bytes),
                    G,
                    |s| s.log_bytes,
                ),
                (
                    "vsan_cache_read_hits",
                    "Blocks read from the cache.",
                    None,
                    C,
                    |s| s.read_hits,
                ),
                (
                    "vsan_cache_read_misses",
                    "Blocks read from the backing store.",
                    None,
                    C,
                    |s| s.read_misses,
                ),
                (
                    "vsan_cache_destaged",
                    "Log bytes destaged to the backing store.",
                    Some(Unit::Bytes),
                    C,
                    |s| s.destaged_bytes,
                ),
            ];
            for (name, help, unit, kind, stat) in rows {
                let mut metric = encoder.encode_descriptor(name, help, unit.as_ref(), kind)?;
                for (disk, s) in &caches {
                    let labels = [("disk", *disk)];
                    let encoder = metric.encode_family(&labels)?;
                    if kind == C {
                        ConstCounter::new(stat(s)).encode(encoder)?;
                    } else {
                        gauge(stat(s)).encode(encoder)?;
                    }
                }
            }
        }
        iscsi_metrics(&disks, &mut encoder)?;
        #[cfg(target_os = "linux")]
        vhost_user_metrics(&disks, &mut encoder)?;
        Ok(())
    }
}

/// The vhost-user-blk metrics: per disk, whether a front end is connected and how many
/// were accepted; per disk and queue, its requests, bytes, failures and refused chains.
#[cfg(target_os = "linux")]
fn vhost_user_metrics(
    disks: &[NodeDisk],
    encoder: &mut DescriptorEncoder,
) -> std::result::Result<(), fmt::Error> {
    use MetricType::{Counter as C, Gauge as G};
    use vsan_core::export::vhost_user::QueueCounters;
    let exports: Vec<(&str, vsan_core::export::vhost_user::VhostUserStatus)> = disks
        .iter()
        .filter_map(|d| Some((d.name.as_str(), d.vhost_user.as_ref()?.status())))
        .collect();
    if exports.is_empty() {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(
        "vsan_vhost_user_connected",
        "1 while a vhost-user front end is connected to the disk's socket.",
        None,
        G,
    )?;
    for (disk, st) in &exports {
        gauge(u64::from(st.connected)).encode(metric.encode_family(&[("disk", *disk)])?)?;
    }
    let mut metric = encoder.encode_descriptor(
        "vsan_vhost_user_connections",
        "vhost-user front ends accepted on the disk's socket.",
        None,
        C,
    )?;
    for (disk, st) in &exports {
        ConstCounter::new(st.connections).encode(metric.encode_family(&[("disk", *disk)])?)?;
    }
    type Stat = fn(&QueueCounters) -> u64;
    let rows: [(&str, &str, MetricType, Stat); 8] = [
        (
            "vsan_vhost_user_requests",
            "Descriptor chains the queue took from its ring.",
            C,
            |q| q.requests,
        ),
        (
            "vsan_vhost_user_reads",
            "Reads the queue completed.",
            C,
            |q| q.reads,
        ),
        (
            "vsan_vhost_user_writes",
            "Writes the queue completed.",
            C,
            |q| q.writes,
        ),
        (
            "vsan_vhost_user_read_bytes",
            "Bytes the queue read.",
            C,
            |q| q.read_bytes,
        ),
        (
            "vsan_vhost_user_written_bytes",
            "Bytes the queue wrote.",
            C,
            |q| q.written_bytes,
        ),
        (
            "vsan_vhost_user_errors",
            "Requests answered IOERR because the disk failed them.",
            C,
            |q| q.errors,
        ),
        (
            "vsan_vhost_user_bad_chains",
            "Chains refused as malformed or hostile.",
            C,
            |q| q.bad_chains,
        ),
        (
            "vsan_vhost_user_in_flight",
            "Requests of the queue running now.",
            G,
            |q| q.in_flight,
        ),
    ];
    for (name, help, kind, stat) in rows {
        let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
        for (disk, st) in &exports {
            for (i, q) in st.queues.iter().enumerate() {
                let queue = i.to_string();
                let labels = [("disk", *disk), ("queue", queue.as_str())];
                let encoder = metric.encode_family(&labels)?;
                if kind == C {
                    ConstCounter::new(stat(q)).encode(encoder)?;
                } else {
                    gauge(stat(q)).encode(encoder)?;
                }
            }
        }
    }
    Ok(())
}

/// The iSCSI metrics: per portal, its server's counters (one server serves every
/// target on its portal); per disk, the sessions logged in to its target.
fn iscsi_metrics(
    disks: &[NodeDisk],
    encoder: &mut DescriptorEncoder,
) -> std::result::Result<(), fmt::Error> {
    use MetricType::{Counter as C, Gauge as G};
    let mut portals: Vec<(&str, ServerStats)> = Vec::new();
    for t in disks.iter().filter_map(|d| d.iscsi.as_ref()) {
        if !portals.iter().any(|(p, _)| *p == t.portal) {
            portals.push((t.portal.as_str(), t.server.stats()));
        }
    }
    if portals.is_empty() {
        return Ok(());
    }
    type Stat = fn(&ServerStats) -> u64;
    let rows: [(&str, &str, MetricType, Stat); 4] = [
        (
            "vsan_iscsi_commands",
            "SCSI commands the portal's iSCSI server completed.",
            C,
            |s| s.commands,
        ),
        (
            "vsan_iscsi_sessions",
            "iSCSI sessions that completed login on the portal (discovery and normal).",
            C,
            |s| s.sessions_total,
        ),
        (
            "vsan_iscsi_sessions_open",
            "iSCSI sessions open on the portal now.",
            G,
            |s| s.sessions_open,
        ),
        (
            "vsan_iscsi_logins_refused",
            "Logins the portal refused (authentication, bad keys, unknown target).",
            C,
            |s| s.logins_refused,
        ),
    ];
    for (name, help, kind, stat) in rows {
        let mut metric = encoder.encode_descriptor(name, help, None, kind)?;
        for (portal, s) in &portals {
            let labels = [("portal", *portal)];
            let encoder = metric.encode_family(&labels)?;
            if kind == C {
                ConstCounter::new(stat(s)).encode(encoder)?;
            } else {
                gauge(stat(s)).encode(encoder)?;
            }
        }
    }
    let mut metric = encoder.encode_descriptor(
        "vsan_iscsi_target_sessions",
        "iSCSI sessions logged in to the disk's target.",
        None,
        G,
    )?;
    for d in disks {
        if let Some(t) = &d.iscsi {
            let labels = [("disk", d.name.as_str()), ("target", t.target.as_str())];
            gauge(t.sessions().len() as u64).encode(metric.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// A node's metrics before it serves them: the registry, with the listener already
/// bound (so a busy address refuses the start before anything is created).
#[derive(Debug)]
pub struct NodeMetrics {
    registry: Registry,
    io: DiskMeters,
    listener: TcpListener,
    address: String,
}

impl NodeMetrics {
    /// Listen on `addr` (`host:port`, port 0 for any) for scrapes; `node.metrics` in
    /// errors.
    pub async fn bind(addr: &str) -> std::result::Result<NodeMetrics, StartError> {
        let key = "key `node.metrics`";
        let socket: SocketAddr = addr.parse().map_err(|_| {
            StartError::Config(format!(
                "{key}: {addr:?} is not an address such as \"127.0.0.1:9100\""
            ))
        })?;
        let listener = TcpListener::bind(socket).await.map_err(|e| {
            super::listen_error(
                "node.metrics",
                addr,
                e.kind() == std::io::ErrorKind::AddrInUse,
                &e,
            )
        })?;
        let address = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| addr.to_string());
        let mut registry = Registry::default();
        let io = DiskMeters::register(&mut registry);
        Ok(NodeMetrics {
            registry,
            io,
            listener,
            address,
        })
    }

    /// The address it listens on (with the actual port when `bind` was given port 0).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// `device` (disk `disk`'s client-facing device), counted.
    pub fn wrap(&self, disk: &str, device: Arc<dyn BlockDevice>) -> Arc<dyn BlockDevice> {
        self.io.wrap(disk, device)
    }

    /// What wraps disks; the endpoint [`serve`](Self::serve) returns has it too.
    pub fn meters(&self) -> &DiskMeters {
        &self.io
    }

    /// Serve the metrics until the returned endpoint is stopped or dropped. Each scrape
    /// calls `disks` for the node's disks now (their size, mirror and cache state; the
    /// I/O counts are those of the disks [`wrap`](Self::wrap)ped). Must be called
    /// within a tokio runtime.
    pub fn serve(
        mut self,
        disks: impl Fn() -> Vec<NodeDisk> + Send + Sync + 'static,
    ) -> MetricsEndpoint {
        self.registry
            .register_collector(Box::new(DiskStates(Box::new(disks))));
        let (stop, stopped) = oneshot::channel();
        let registry = Arc::new(self.registry);
        let task = tokio::spawn(accept_loop(self.listener, registry, stopped));
        MetricsEndpoint {
            address: self.address,
            io: self.io,
            stop: Some(stop),
            task,
        }
    }
}

/// The metrics endpoint of a running node. Dropping it stops it without waiting.
#[derive(Debug)]
pub struct MetricsEndpoint {
    address: String,
    io: DiskMeters,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl MetricsEndpoint {
    /// The address it listens on.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// What wraps (and forgets) disks created (deleted) while the node runs.
    pub fn meters(&self) -> &DiskMeters {
        &self.io
    }

    /// Stop listening and close every connection; returns once none is left (and so
    /// nothing holds the node's disks for a scrape any more).
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let _ = (&mut self.task).await;
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    registry: Arc<Registry>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            // A send or a dropped sender: stop either way.
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    if connections.len() >= MAX_CONNECTIONS {
                        debug!(%peer, "metrics: too many connections; closing this one");
                        continue;
                    }
                    connections.spawn(serve_connection(stream, Arc::clone(&registry)));
                }
                Err(e) => {
                    // Out of descriptors, say: wait rather than spin.
                    warn!("metrics: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    connections.shutdown().await;
}

async fn serve_connection(stream: TcpStream, registry: Arc<Registry>) {
    let service = service_fn(move |req: Request<Incoming>| {
        let response = respond(&registry, req.method(), req.uri().path());
        async move { Ok::<_, Infallible>(response) }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    // A connection lives at most CONNECTION_LIMIT: a client that sends requests but
    // never reads the answers must not hold one of the few slots for good.
    match tokio::time::timeout(CONNECTION_LIMIT, conn.as_mut()).await {
        Ok(Err(e)) => debug!("metrics: connection ended: {e}"),
        Ok(Ok(())) => {}
        Err(_) => {
            debug!("metrics: connection open for {CONNECTION_LIMIT:?}: closed");
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(Duration::from_secs(1), conn).await;
        }
    }
}

/// The answer to `method path`: the metrics at `/metrics`, 404 elsewhere.
fn respond(registry: &Registry, method: &Method, path: &str) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: String| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r
    };
    if path != "/metrics" {
        return reply(
            StatusCode::NOT_FOUND,
            "not found: the metrics are at /metrics\n".to_string(),
        );
    }
    if method != Method::GET && method != Method::HEAD {
        let mut r = reply(
            StatusCode::METHOD_NOT_ALLOWED,
            "only GET and HEAD\n".to_string(),
        );
        r.headers_mut()
            .insert(ALLOW, hyper::header::HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    let mut text = String::new();
    match prometheus_text::encode(&mut text, registry) {
        Ok(()) => {
            let mut r = reply(StatusCode::OK, text);
            r.headers_mut().insert(
                CONTENT_TYPE,
                hyper::header::HeaderValue::from_static(prometheus_text::CONTENT_TYPE),
            );
            r
        }
        Err(e) => {
            warn!("metrics: encoding failed: {e}");
            reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                "encoding the metrics failed\n".to_string(),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use vsan_core::MemDevice;

    #[test]
    fn latency_buckets_are_inclusive_and_overflow_to_inf() {
        let l = Latency::default();
        l.observe(Duration::from_nanos(10_000)); // le 1e-5
        l.observe(Duration::from_nanos(10_001)); // le 2e-5
        l.observe(Duration::from_secs(3600)); // +Inf
        let c: Vec<u64> =
            l.0.counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect();
        assert_eq!(c[0], 1);
        assert_eq!(c[1], 1);
        assert_eq!(c[LATENCY_BOUNDS_NS.len()], 1);
        assert_eq!(l.count(), 3);
    }

    /// `GET path` over a real connection: (status line, body).
    async fn get(addr: &str, path: &str) -> (String, String) {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        (head.lines().next().unwrap().to_string(), body.to_string())
    }

    fn sample<'a>(
        scrape: &'a prometheus_parse::Scrape,
        name: &str,
        labels: &[(&str, &str)],
    ) -> &'a prometheus_parse::Sample {
        scrape
            .samples
            .iter()
            .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .unwrap_or_else(|| panic!("no {name} {labels:?} in the scrape"))
    }

    fn counter(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
        match sample(scrape, name, labels).value {
            prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) => v,
            ref v => panic!("{name}: not a counter: {v:?}"),
        }
    }

    #[tokio::test]
    async fn counts_what_goes_through_and_serves_it() {
        let metrics = NodeMetrics::bind("127.0.0.1:0").await.unwrap();
        let mem: Arc<dyn BlockDevice> =
            Arc::new(MemDevice::new(Geometry::new(1 << 20, 512).unwrap()));
        let dev = metrics.wrap("vol0", mem);
        for i in 0..3u64 {
            dev.write(i * 4096, Bytes::from(vec![7u8; 4096]), IoFlags::empty())
                .await
                .unwrap();
        }
        dev.read(0, 8192).await.unwrap();
        dev.read_once(0, 512).await.unwrap();
        dev.flush().await.unwrap();
        dev.discard(0, 4096, IoFlags::empty()).await.unwrap();
        dev.write_zeroes(0, 4096, IoFlags::FUA).await.unwrap();
        // Refused: beyond the end. A failure, counted as one.
        assert!(dev.read(1 << 20, 512).await.is_err());

        let disk = NodeDisk {
            name: "vol0".into(),
            device: dev,
            mirror: None,
            peer_id: None,
            transport: None,
            nbd: None,
            iscsi: None,
            #[cfg(target_os = "linux")]
            vhost_user: None,
            cache: None,
        };
        let endpoint = metrics.serve(move || vec![disk.clone()]);
        let addr = endpoint.address().to_string();

        let (status, body) = get(&addr, "/metrics").await;
        assert!(status.contains("200"), "{status}");
        let lines = body.lines().map(|l| Ok(l.to_string()));
        let scrape = prometheus_parse::Scrape::parse(lines).unwrap();
        let op = |op| [("disk", "vol0"), ("op", op)];
        assert_eq!(
            counter(&scrape, "vsan_disk_operations_total", &op("write")),
            3.0
        );
        assert_eq!(
            counter(&scrape, "vsan_disk_operations_total", &op("read")),
            3.0
        );
        assert_eq!(counter(&scrape, "vsan_disk_errors_total", &op("read")), 1.0);
        assert_eq!(
            counter(&scrape, "vsan_disk_errors_total", &op("write")),
            0.0
        );
        for kind in ["flush", "discard", "write_zeroes"] {
            assert_eq!(
                counter(&scrape, "vsan_disk_operations_total", &op(kind)),
                1.0
            );
        }
        let disk = [("disk", "vol0")];
        assert_eq!(
            counter(&scrape, "vsan_disk_written_bytes_total", &disk),
            3.0 * 4096.0
        );
        assert_eq!(
            counter(&scrape, "vsan_disk_read_bytes_total", &disk),
            8192.0 + 512.0
        );
        assert_eq!(
            counter(&scrape, "vsan_disk_size_bytes", &disk),
            f64::from(1u32 << 20)
        );
        match &sample(
            &scrape,
            "vsan_disk_operation_duration_seconds",
            &op("write"),
        )
        .value
        {
            prometheus_parse::Value::Histogram(buckets) => {
                let inf = buckets.last().unwrap();
                assert!(inf.less_than.is_infinite());
                assert_eq!(inf.count, 3.0);
            }
            v => panic!("not a histogram: {v:?}"),
        }
        // No mirror, no cache: no such metrics.
        assert!(!body.contains("vsan_mirror_") && !body.contains("vsan_cache_"));

        let (status, _) = get(&addr, "/").await;
        assert!(status.contains("404"), "{status}");
        // A deleted disk's I/O series go.
        endpoint.meters().forget("vol0");
        let (_, body) = get(&addr, "/metrics").await;
        assert!(
            !body.contains("vsan_disk_operations_total{disk=\"vol0\""),
            "{body}"
        );
        assert!(
            !body.contains("vsan_disk_read_bytes_total{disk=\"vol0\""),
            "{body}"
        );
        endpoint.stop().await;
        assert!(TcpStream::connect(&addr).await.is_err());
    }
}
