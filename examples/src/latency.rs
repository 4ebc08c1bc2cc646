//! `vsan-bench latency`: what synchronous mirroring adds to one write.
//!
//! In one run, alternating rounds of: QD1 4 KiB random writes to a local file
//! (`FileDevice`), the same writes to a `MirroredDisk` whose two replicas are files of the
//! same kind linked over TCP loopback, and a bare TCP ping-pong carrying the same bytes
//! (4 KiB out, a 20-byte answer back: what the mirror's Write and WriteAck frames are).
//! Each node runs on a runtime of its own with one worker thread, as two `vsan-node`s
//! do; the writer (a front door's connection, in effect) runs on node 1's, and the
//! ping-pong's two ends on node 1's and node 2's, so the round trip crosses the same
//! two threads the mirror's does.
//! The mirror's target (issue 22) is p50 <= local p50 + ping-pong p50 + 5 us: the
//! mirror itself adds next to nothing to the local write and one network round trip.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vsan_core::{BlockDevice, FileOptions, IoFlags};
use vsan_replica::connect::{accept_loop, dial_loop};
use vsan_replica::protocol::{Config, DiskId, LinkState};
use vsan_replica::transport::Transport;
use vsan_replica::transport::tcp::TcpTransport;
use vsan_replica::{MirroredDisk, Replica};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const SIZE: u64 = 256 << 20;
const BLOCK: usize = 4096;

/// Up to 10 ms; a slower sample (a busy shared machine) counts as 10 ms instead of
/// ending the run.
fn hist() -> Result<Histogram<u64>, BoxError> {
    Ok(Histogram::new_with_bounds(1, 10_000_000, 3)?)
}

/// QD1 writes of 4 KiB at random aligned offsets; latency in ns.
async fn writes(dev: &dyn BlockDevice, count: u32, seed: u64) -> Result<Histogram<u64>, BoxError> {
    let mut h = hist()?;
    let mut rng = SmallRng::seed_from_u64(seed);
    let data = Bytes::from(vec![0x5a; BLOCK]);
    for _ in 0..count {
        let off = rng.random_range(0..SIZE / BLOCK as u64) * BLOCK as u64;
        let t = Instant::now();
        dev.write(off, data.clone(), IoFlags::empty()).await?;
        h.saturating_record(t.elapsed().as_nanos() as u64);
    }
    Ok(h)
}

/// 4 KiB out, 20 bytes back, QD1, over a loopback TCP connection whose far end runs on
/// `far`; latency in ns.
async fn ping_pong(count: u32, far: tokio::runtime::Handle) -> Result<Histogram<u64>, BoxError> {
    let listener = far
        .spawn(async { tokio::net::TcpListener::bind("127.0.0.1:0").await })
        .await??;
    let addr = listener.local_addr()?;
    let server = far.spawn(async move {
        let (mut s, _) = listener.accept().await?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; BLOCK];
        loop {
            if s.read_exact(&mut buf).await.is_err() {
                return Ok::<(), std::io::Error>(());
            }
            s.write_all(&[0u8; 20]).await?;
        }
    });
    let mut c = tokio::net::TcpStream::connect(addr).await?;
    c.set_nodelay(true)?;
    let out = vec![0x5a; BLOCK];
    let mut back = [0u8; 20];
    let mut h = hist()?;
    for _ in 0..count {
        let t = Instant::now();
        c.write_all(&out).await?;
        c.read_exact(&mut back).await?;
        h.saturating_record(t.elapsed().as_nanos() as u64);
    }
    drop(c);
    let _ = server.await;
    Ok(h)
}

fn us(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// A node's runtime: one worker thread.
fn node_runtime(name: &str) -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()
}

/// Run the comparison and print the table.
///
/// With `one_runtime` both nodes, the writer and both ends of the ping-pong share node 1's
/// one thread instead.
pub fn run(count: u32, rounds: u32, dir: PathBuf, one_runtime: bool) -> Result<(), BoxError> {
    let node1 = node_runtime("lat-node1")?;
    let node2 = node_runtime("lat-node2")?;
    let near = node1.handle().clone();
    // One runtime for both: nothing crosses threads, so the figures are CPU work only
    // (and the two replicas' writes cannot overlap).
    let far = if one_runtime {
        near.clone()
    } else {
        node2.handle().clone()
    };
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let result = main.block_on(async move {
        std::fs::create_dir_all(&dir)?;
        let path = |n: &str| dir.join(format!("latency-{n}.img"));
        for n in ["local", "m1", "m2"] {
            let _ = std::fs::remove_file(path(n));
        }
        let local = Arc::new(FileOptions::new().create(SIZE).open(path("local"))?);
        let r1: Arc<dyn BlockDevice> = Arc::new(FileOptions::new().create(SIZE).open(path("m1"))?);
        let r2: Arc<dyn BlockDevice> = Arc::new(FileOptions::new().create(SIZE).open(path("m2"))?);
        let cfg = |me, peer| Config::new(me, peer, DiskId::from_name("lat"), "lat", SIZE, 512);
        let start = |rt: &tokio::runtime::Handle, me: u32, peer: u32, data: Arc<dyn BlockDevice>| {
            rt.spawn(async move {
                let replica = Replica::with_memory_meta(&cfg(me, peer), data).await?;
                MirroredDisk::start(cfg(me, peer), replica, None)
            })
        };
        let m1 = start(&near, 1, 2, r1).await??;
        let m2 = start(&far, 2, 1, r2).await??;
        let transport: Arc<dyn Transport> = Arc::new(TcpTransport::new());
        let t = Arc::clone(&transport);
        let listener = far.spawn(async move { t.listen("127.0.0.1:0").await }).await??;
        let addr = listener.local_addr();
        let acc = far.spawn(accept_loop(listener, HashMap::from([("lat".to_string(), m2.clone())])));
        let dial = near.spawn(dial_loop(Arc::clone(&transport), addr, m1.clone()));
        let mut st = m1.watch_status();
        tokio::time::timeout(Duration::from_secs(10), st.wait_for(|s| s.link == LinkState::Connected && !s.syncing && s.dirty_chunks == 0)).await??;

        let (mut hl, mut hm, mut hr) = (hist()?, hist()?, hist()?);
        // CPU seconds of both nodes' threads, per measurement.
        let mut cpu = [0.0f64; 3];
        let threads = || crate::cpu::threads_seconds("lat-node");
        for round in 0..rounds {
            let l = local.clone();
            let t = threads()?;
            hl.add(near.spawn(async move { writes(l.as_ref(), count, round.into()).await }).await??)?;
            cpu[0] += threads()? - t;
            let m = m1.clone();
            let t = threads()?;
            hm.add(near.spawn(async move { writes(&m, count, round.into()).await }).await??)?;
            cpu[1] += threads()? - t;
            let t = threads()?;
            hr.add(near.spawn(ping_pong(count, far.clone())).await??)?;
            cpu[2] += threads()? - t;
        }
        let per_op = |c: f64| c * 1e6 / f64::from(count * rounds);
        dial.abort();
        acc.abort();
        println!(
            "QD1 4 KiB writes, {count} per round, {rounds} rounds alternating (us), {}:",
            if one_runtime { "both nodes on one thread" } else { "each node on a thread of its own" }
        );
        println!("| path | p50 | p99 | mean | CPU per op (both threads) |");
        println!("|---|---:|---:|---:|---:|");
        for (name, h, c) in [("local file (FileDevice)", &hl, cpu[0]), ("MirroredDisk over TCP loopback", &hm, cpu[1]), ("TCP ping-pong 4 KiB / 20 B", &hr, cpu[2])] {
            println!("| {name} | {:.1} | {:.1} | {:.1} | {:.1} |", us(h, 0.5), us(h, 0.99), h.mean() / 1000.0, per_op(c));
        }
        let budget = us(&hl, 0.5) + us(&hr, 0.5) + 5.0;
        let got = us(&hm, 0.5);
        println!(
            "target: mirror p50 <= local p50 + RTT p50 + 5 us = {budget:.1} us; measured {got:.1} us (mirror - local - RTT = {:.1} us) -> {}",
            got - us(&hl, 0.5) - us(&hr, 0.5),
            if got <= budget { "met" } else { "MISSED" }
        );
        for n in ["local", "m1", "m2"] {
            let _ = std::fs::remove_file(path(n));
        }
        Ok::<(), BoxError>(())
    });
    node1.shutdown_timeout(Duration::from_secs(5));
    node2.shutdown_timeout(Duration::from_secs(5));
    result
}
