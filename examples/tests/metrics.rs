//! `vsan-node`'s metrics endpoint (`node.metrics`) as a scraper sees it: real processes,
//! scraped over HTTP on loopback and parsed with a Prometheus text-format parser; the I/O
//! counters, byte counters and latency histograms grow by at least what a real NBD client
//! (qemu-io) did; a mirror's link state reads connected on both nodes, then degraded on
//! the survivor when its peer is killed, and the out-of-sync count it left goes back to 0
//! once the peer returns and resyncs; a busy metrics address refuses the start (exit 2)
//! before any image is made; paths other than `/metrics` are 404.
//!
//! A missing tool skips its test with a `SKIP:` line, or fails it when
//! `VSAN_REQUIRE_INTEROP=1`.

use crate::common;

use std::time::{Duration, Instant};

use common::in_process::node;
use common::mirror::{CONNECTED, Side};
use common::{
    Node, Region, Sig, TestDir, disk_section, field, image, node_section, qemu_io_reads,
    qemu_io_writes, require_tool, run_node_to_exit, toml_str,
};
use prometheus_parse::{LineInfo, Sample, Scrape, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// How long something the test waits for may take.
const EVENT_TIMEOUT: Duration = Duration::from_secs(20);

/// An HTTP client that reports every status (a 404 is an answer here, not an error).
fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(10)))
        .build()
        .into()
}

/// `GET http://addr/path`: (status, content type, body).
fn get(addr: &str, path: &str) -> (u16, String, String) {
    let url = format!("http://{addr}{path}");
    let mut resp = agent()
        .get(&url)
        .call()
        .unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let status = resp.status().as_u16();
    let content_type = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let body = resp
        .body_mut()
        .read_to_string()
        .unwrap_or_else(|e| panic!("GET {url}: reading the body: {e}"));
    (status, content_type, body)
}

/// Scrape `addr` and parse what it serves. Every line must be something the parser
/// understands (it skips what it does not, so that is checked line by line), every
/// sample must belong to a family with a `# TYPE`, and the content type must be the
/// Prometheus text format 0.0.4.
fn scrape(addr: &str) -> Scrape {
    let (status, content_type, body) = get(addr, "/metrics");
    assert_eq!(status, 200, "GET /metrics:\n{body}");
    assert!(
        content_type.starts_with("text/plain") && content_type.contains("version=0.0.4"),
        "content type {content_type:?}"
    );
    let mut typed = Vec::new();
    for line in body.lines() {
        match LineInfo::parse(line) {
            LineInfo::Ignored => panic!("a line the parser does not understand: {line:?}"),
            LineInfo::Type { metric_name, .. } => {
                typed.push(metric_name.trim_end_matches("_bucket").to_string())
            }
            LineInfo::Sample { metric_name, .. } => assert!(
                typed.iter().any(|t| metric_name.starts_with(t.as_str())),
                "sample {line:?} has no # TYPE before it"
            ),
            LineInfo::Doc { .. } | LineInfo::Empty => {}
        }
    }
    Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
        .unwrap_or_else(|e| panic!("the scrape does not parse: {e}\n{body}"))
}

fn find<'a>(scrape: &'a Scrape, name: &str, labels: &[(&str, &str)]) -> Option<&'a Sample> {
    scrape
        .samples
        .iter()
        .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
}

fn sample<'a>(scrape: &'a Scrape, name: &str, labels: &[(&str, &str)]) -> &'a Sample {
    find(scrape, name, labels).unwrap_or_else(|| {
        let names: Vec<_> = scrape.samples.iter().map(|s| &s.metric).collect();
        panic!("no {name} {labels:?} in the scrape; it has {names:?}")
    })
}

/// A counter's value.
fn counter(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    match sample(scrape, name, labels).value {
        Value::Counter(v) => v,
        ref v => panic!("{name} {labels:?} is not a counter: {v:?}"),
    }
}

/// A gauge's value.
fn gauge(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    match sample(scrape, name, labels).value {
        Value::Gauge(v) => v,
        ref v => panic!("{name} {labels:?} is not a gauge: {v:?}"),
    }
}

/// A histogram's observation count (its `+Inf` bucket), checking the buckets are
/// cumulative.
fn histogram_count(scrape: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    match &sample(scrape, name, labels).value {
        Value::Histogram(buckets) => {
            assert!(
                buckets.windows(2).all(|w| w[0].count <= w[1].count),
                "{name} {labels:?}: buckets not cumulative: {buckets:?}"
            );
            let last = buckets.last().expect("a histogram has buckets");
            assert!(last.less_than.is_infinite(), "{name}: no +Inf bucket");
            last.count
        }
        v => panic!("{name} {labels:?} is not a histogram: {v:?}"),
    }
}

/// The address of the `ready metrics=<addr>` line.
fn metrics_addr(node: &Node) -> String {
    let line = node.wait_stdout(&["ready metrics="], EVENT_TIMEOUT);
    field(&line, "metrics").unwrap_or_else(|| panic!("no address in {line:?}"))
}

/// `metrics = <addr>` in the `[node]` section of `config`.
fn with_metrics(config: &str, addr: &str) -> String {
    assert!(config.starts_with("[node]\n"), "{config}");
    config.replacen(
        "[node]\n",
        &format!("[node]\nmetrics = {}\n", toml_str(addr)),
        1,
    )
}

/// One node, a plain file disk and a cached one: qemu-io writes and reads through NBD,
/// and every I/O metric grows by at least that.
#[test]
fn counters_move_under_load() {
    if !require_tool("qemu-io") {
        return;
    }
    let dir = TestDir::new("metrics-load");
    let config = with_metrics(&node_section(&dir), "127.0.0.1:0")
        + &disk_section("vol0", "\"16MiB\"", "127.0.0.1:0")
        + &disk_section("vol1", "\"16MiB\"", "127.0.0.1:0")
        + &format!(
            "[disk.cache]\npath = {}\nsize = \"32MiB\"\n",
            toml_str(dir.join("vol1.cache"))
        );
    let node = Node::start(&dir, &config, &["vol0", "vol1"]);
    let addr = metrics_addr(&node);

    let before = scrape(&addr);
    let op = |disk, op| [("disk", disk), ("op", op)];
    let ops = "vsan_disk_operations_total";
    let latency = "vsan_disk_operation_duration_seconds";
    // Every disk's I/O metrics exist from the start, at zero.
    for disk in ["vol0", "vol1"] {
        for kind in ["read", "write", "flush", "discard", "write_zeroes"] {
            assert_eq!(counter(&before, ops, &op(disk, kind)), 0.0);
            assert_eq!(
                counter(&before, "vsan_disk_errors_total", &op(disk, kind)),
                0.0
            );
            assert_eq!(histogram_count(&before, latency, &op(disk, kind)), 0.0);
        }
        assert_eq!(
            gauge(&before, "vsan_disk_size_bytes", &[("disk", disk)]),
            16.0 * 1024.0 * 1024.0
        );
    }

    // Eight 64 KiB writes and reads of them, on each disk, at scattered offsets.
    let regions: Vec<Region> = (0..8u64)
        .map(|i| Region::new(0x40 + i as u8, i * 1024 * KIB, 64 * KIB))
        .collect();
    let total = regions.iter().map(|r| r.len).sum::<u64>() as f64;
    for disk in ["vol0", "vol1"] {
        qemu_io_writes(&node.uri_named(disk), &regions);
        qemu_io_reads(&node.uri_named(disk), &regions);
    }

    let after = scrape(&addr);
    let n = regions.len() as f64;
    for disk in ["vol0", "vol1"] {
        let grew = |name: &str, labels: &[(&str, &str)]| {
            counter(&after, name, labels) - counter(&before, name, labels)
        };
        assert!(grew(ops, &op(disk, "write")) >= n, "{disk}: writes");
        assert!(grew(ops, &op(disk, "read")) >= n, "{disk}: reads");
        let d = [("disk", disk)];
        assert!(
            grew("vsan_disk_written_bytes_total", &d) >= total,
            "{disk}: bytes written"
        );
        assert!(
            grew("vsan_disk_read_bytes_total", &d) >= total,
            "{disk}: bytes read"
        );
        for kind in ["read", "write"] {
            let observed = histogram_count(&after, latency, &op(disk, kind))
                - histogram_count(&before, latency, &op(disk, kind));
            assert!(
                observed >= n,
                "{disk}: {observed} {kind} latencies for {n} {kind}s"
            );
            assert_eq!(
                counter(&after, "vsan_disk_errors_total", &op(disk, kind)),
                0.0
            );
        }
    }
    // The cached disk's writes sit in the cache log (far below the high watermark,
    // nothing is destaged); the plain disk has no cache metrics, neither has mirror ones.
    let c = [("disk", "vol1")];
    assert!(
        gauge(&after, "vsan_cache_dirty_bytes", &c) >= total,
        "cache dirty bytes after {total} bytes written"
    );
    assert!(gauge(&after, "vsan_cache_log_size_bytes", &c) > 0.0);
    assert!(counter(&after, "vsan_cache_read_hits_total", &c) > 0.0);
    assert!(find(&after, "vsan_cache_dirty_bytes", &[("disk", "vol0")]).is_none());
    assert!(
        !after
            .samples
            .iter()
            .any(|s| s.metric.starts_with("vsan_mirror_"))
    );

    node.stop_clean(Sig::TERM);
}

/// Two mirrored nodes, each serving metrics: the first sync running with bytes left,
/// then connected on both; node 1 killed, node 2
/// degraded with out-of-sync chunks after writes; node 1 back, a resync with bytes left
/// while it runs, and nothing out of sync once it is done.
#[test]
fn mirror_link_state_and_resync() {
    if !require_tool("qemu-io") {
        return;
    }
    let s1 = Side::new(1, "vol0", "\"8MiB\"")
        .timeout(2000)
        .resync_rate("2MiB");
    let s2 = Side::new(2, "vol0", "\"8MiB\"")
        .timeout(2000)
        .resync_rate("2MiB");
    let disk = [("disk", "vol0")];
    let dir1 = TestDir::new("metrics-mirror-n1");
    let dir2 = TestDir::new("metrics-mirror-n2");
    let config2 = with_metrics(
        &s2.config(&dir2, Some("127.0.0.1:0"), "127.0.0.1:1"),
        "127.0.0.1:0",
    );
    let n2 = Node::start_listening(&dir2, &config2, &["vol0"]);
    let config1 = with_metrics(&s1.config(&dir1, None, n2.replication()), "127.0.0.1:0");
    let n1 = Node::start(&dir1, &config1, &["vol0"]);
    let (m1, m2) = (metrics_addr(&n1), metrics_addr(&n2));
    // The first connection checks the whole disk (8 MiB at 2 MiB/s): node 2, the
    // target, reports it running with bytes left.
    n2.wait_stdout(&["sync disk=vol0 started", "role=target"], EVENT_TIMEOUT);
    let s = scrape(&m2);
    assert_eq!(gauge(&s, "vsan_mirror_syncing", &disk), 1.0);
    let left = gauge(&s, "vsan_mirror_resync_remaining_bytes", &disk);
    assert!(
        left > 0.0 && left <= 8.0 * MIB as f64,
        "bytes left {left} while checking 8 MiB"
    );
    n1.wait_log(CONNECTED, EVENT_TIMEOUT);
    n2.wait_log(CONNECTED, EVENT_TIMEOUT);
    n1.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);
    n2.wait_stdout(&["sync disk=vol0 done"], EVENT_TIMEOUT);

    let link = "vsan_mirror_link_state";
    for (addr, peer) in [(&m1, "2"), (&m2, "1")] {
        let s = scrape(addr);
        let labels = [("disk", "vol0"), ("peer", peer), ("state", "connected")];
        assert_eq!(gauge(&s, link, &labels), 3.0, "{addr}");
        assert_eq!(gauge(&s, "vsan_mirror_syncing", &[("disk", "vol0")]), 0.0);
        assert_eq!(
            gauge(
                &s,
                "vsan_mirror_resync_remaining_bytes",
                &[("disk", "vol0")]
            ),
            0.0
        );
        assert_eq!(
            gauge(&s, "vsan_mirror_out_of_sync_chunks", &[("disk", "vol0")]),
            0.0
        );
        let proven = [("disk", "vol0"), ("proof", "handshake")];
        assert_eq!(gauge(&s, "vsan_mirror_replica_current", &proven), 1.0);
        assert_eq!(
            gauge(&s, "vsan_mirror_unproven_seconds", &[("disk", "vol0")]),
            0.0
        );
    }

    let killed = n1.stop(Sig::KILL);
    assert!(!killed.status.success(), "kill -9: {}", killed.status);
    n2.wait_log("peer lost", EVENT_TIMEOUT);
    // The log line and the status the scrape reads are set by one driver step; give
    // that step a bounded moment.
    let deadline = Instant::now() + EVENT_TIMEOUT;
    let degraded = [("disk", "vol0"), ("peer", "1"), ("state", "degraded")];
    while find(&scrape(&m2), link, &degraded).is_none() {
        assert!(
            Instant::now() < deadline,
            "node 2 not degraded within {EVENT_TIMEOUT:?}:\n{}",
            get(&m2, "/metrics").2
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // 4 MiB written alone: 64 chunks of 64 KiB for the resync.
    let regions: Vec<Region> = (0..4u64)
        .map(|i| Region::new(0x5a + i as u8, i * 2 * MIB, MIB))
        .collect();
    qemu_io_writes(&n2.uri("vol0"), &regions);
    let s = scrape(&m2);
    assert_eq!(gauge(&s, link, &degraded), 4.0);
    assert!(gauge(&s, "vsan_mirror_out_of_sync_chunks", &disk) >= 64.0);

    // Node 1 returns: node 2 resyncs it (at 2 MiB/s, so a scrape sees it run), and
    // nothing is left out of sync.
    let seen = n2.stdout_lines().len();
    let n1 = Node::start(&dir1, &config1, &["vol0"]);
    let m1 = metrics_addr(&n1);
    n2.wait_stdout_after(
        seen,
        &["sync disk=vol0 started", "role=source"],
        EVENT_TIMEOUT,
    );
    let s = scrape(&m2);
    assert_eq!(gauge(&s, "vsan_mirror_syncing", &disk), 1.0);
    let left = gauge(&s, "vsan_mirror_resync_remaining_bytes", &disk);
    assert!(
        left > 0.0 && left <= 4.0 * MIB as f64,
        "resync bytes left {left} while syncing 4 MiB"
    );
    n2.wait_stdout_after(seen, &["sync disk=vol0 done", "role=source"], EVENT_TIMEOUT);
    let deadline = Instant::now() + EVENT_TIMEOUT;
    loop {
        let s = scrape(&m2);
        let connected = [("disk", "vol0"), ("peer", "1"), ("state", "connected")];
        if find(&s, link, &connected).is_some()
            && gauge(&s, "vsan_mirror_out_of_sync_chunks", &disk) == 0.0
        {
            assert_eq!(gauge(&s, "vsan_mirror_syncing", &disk), 0.0);
            assert_eq!(gauge(&s, "vsan_mirror_resync_remaining_bytes", &disk), 0.0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "node 2 not back in sync within {EVENT_TIMEOUT:?}:\n{}",
            get(&m2, "/metrics").2
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let s = scrape(&m1);
    let labels = [("disk", "vol0"), ("peer", "2"), ("state", "connected")];
    assert_eq!(gauge(&s, link, &labels), 3.0);
    n1.stop_clean(Sig::TERM);
    n2.stop_clean(Sig::TERM);
}

/// A metrics address in use refuses the start as a configuration error, before any
/// image is created.
#[test]
fn busy_metrics_address_refuses_the_start() {
    let dir = TestDir::new("metrics-busy");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    let addr = taken.local_addr().expect("its address").to_string();
    let config = with_metrics(&node_section(&dir), &addr)
        + &disk_section("vol0", "\"16MiB\"", "127.0.0.1:0");
    let out = run_node_to_exit(&dir, &config);
    assert_eq!(out.status.code(), Some(2), "{out}");
    assert!(
        out.stderr.contains("node.metrics") && out.stderr.contains("in use"),
        "{out}"
    );
    assert!(!image(&dir, "vol0").exists(), "an image was created anyway");

    let config = with_metrics(&node_section(&dir), "not-an-address")
        + &disk_section("vol0", "\"16MiB\"", "127.0.0.1:0");
    let out = run_node_to_exit(&dir, &config);
    assert_eq!(out.status.code(), Some(2), "{out}");
    assert!(out.stderr.contains("node.metrics"), "{out}");
}

/// Only `/metrics` is served: other paths are 404, other methods 405.
#[test]
fn other_paths_are_not_found() {
    let dir = TestDir::new("metrics-404");
    let config = with_metrics(&node_section(&dir), "127.0.0.1:0")
        + &disk_section("vol0", "\"16MiB\"", "127.0.0.1:0");
    let node = Node::start(&dir, &config, &["vol0"]);
    let addr = metrics_addr(&node);
    for path in ["/", "/metric", "/metrics/", "/metrics/x", "/favicon.ico"] {
        let (status, _, _) = get(&addr, path);
        assert_eq!(status, 404, "GET {path}");
    }
    // A query string does not change the path.
    assert_eq!(get(&addr, "/metrics?debug=1").0, 200);
    let resp = agent()
        .post(&format!("http://{addr}/metrics"))
        .send("")
        .expect("POST /metrics");
    assert_eq!(resp.status().as_u16(), 405);
    // Still serving after all that.
    scrape(&addr);
    node.stop_clean(Sig::TERM);
}

/// 64 clients that pipeline requests and never read the answers held every metrics
/// connection slot for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_clients_that_never_read_do_not_lock_out_scrapes() {
    let dir = tempfile::tempdir().unwrap();
    let n = node(
        dir.path(),
        "metrics = \"127.0.0.1:0\"",
        "[[disk]]\nname = \"vol0\"\nsize = \"1MiB\"\nbacking = \"mem\"\n",
    )
    .await;
    let addr = n.metrics_address().unwrap().to_string();
    let req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(4000);
    let mut hogs = Vec::new();
    for _ in 0..64 {
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(2), s.write_all(&req)).await;
        hogs.push(s);
    }
    // Past the connection limit (10 s).
    tokio::time::sleep(Duration::from_secs(12)).await;
    let scrape = tokio::time::timeout(Duration::from_secs(5), async {
        let mut s = tokio::net::TcpStream::connect(&addr).await?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        Ok::<_, std::io::Error>(out)
    })
    .await;
    drop(hogs);
    n.shutdown().await.unwrap();
    let ok = matches!(&scrape, Ok(Ok(b)) if b.starts_with(b"HTTP/1.1 200"));
    assert!(
        ok,
        "a scrape after 64 stalled clients: {:?}",
        scrape.map(|r| r.map(|b| b.len()))
    );
}
