//! `vsan-bench ffi`: what the C ABI adds to an operation.
//!
//! One node is opened through the C ABI (`vsan_node_new_from_toml`) with one RAM disk;
//! the same disk is then driven, in alternating rounds, through the Rust API (its
//! `BlockDevice`, awaited on the node's own runtime) and through the C functions
//! (called from Rust exactly as a C program calls them: same symbols, same checks,
//! same copies). 4 KiB reads at random aligned offsets:
//! - QD1: Rust `read().await` in a loop; C `vsan_disk_read` (blocking); C
//!   `vsan_disk_submit_read` waiting for each callback;
//! - QD32: Rust with 32 reads in flight (`FuturesUnordered`); C with up to 32 submitted
//!   reads in flight, callbacks counting completions.
//!
//! The figure is nanoseconds per operation (total time / operations), the median over
//! rounds, and the C case minus its Rust baseline. Target: at most 1 us added.

use crate::median;
use std::ffi::{CString, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use vsan::{
    VSAN_OK, disk_for_rust, vsan_disk, vsan_disk_free, vsan_disk_open, vsan_disk_read,
    vsan_disk_submit_read, vsan_node, vsan_node_free, vsan_node_new_from_toml, vsan_result,
};
use vsan_core::{BlockDevice, IoFlags};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const BLOCK: usize = 4096;
const DEPTH: u64 = 32;

/// Options of `vsan-bench ffi`.
#[derive(Debug, Clone)]
pub struct Opts {
    /// Reads per case per round.
    pub count: u32,
    /// Rounds (cases alternate within each).
    pub rounds: u32,
    /// Disk size in MiB.
    pub size_mib: u64,
    /// Worker threads of the node's runtime.
    pub threads: usize,
}

struct Cases {
    names: [&'static str; 5],
    ns: [Vec<f64>; 5],
}

fn check(r: vsan_result, what: &str) -> Result<(), BoxError> {
    if r == VSAN_OK {
        return Ok(());
    }
    let mut buf = vec![0 as std::ffi::c_char; 512];
    // SAFETY: a valid buffer of its length.
    unsafe { vsan::vsan_last_error_message(buf.as_mut_ptr(), buf.len(), std::ptr::null_mut()) };
    // SAFETY: NUL-terminated (the buffer was zeroed, and the call terminates what it
    // writes).
    let msg = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    Err(format!("{what}: code {r}: {msg}").into())
}

/// Counts completions of C reads; the callback's userdata.
struct Counter {
    done: AtomicU64,
    failed: AtomicU64,
    /// Which buffer slots a read is using (the tag is the slot).
    busy: Vec<AtomicBool>,
}

unsafe extern "C" fn count(userdata: *mut c_void, result: vsan_result, tag: u64) {
    // SAFETY: the benchmark passes a `*const Counter` that outlives every read.
    let c = unsafe { &*(userdata as *const Counter) };
    if result != VSAN_OK {
        c.failed.fetch_add(1, Ordering::Relaxed);
    }
    c.busy[tag as usize].store(false, Ordering::Release);
    c.done.fetch_add(1, Ordering::Release);
}

/// Run the benchmark and print the table.
pub fn run(opts: Opts) -> Result<(), BoxError> {
    let size = opts.size_mib << 20;
    let toml = CString::new(format!(
        "[node]\nid = 1\ndata_dir = \"/nonexistent\"\nthreads = {}\n\n[[disk]]\nname = \"bench\"\n\
         size = {size}\nbacking = \"mem\"\n",
        opts.threads
    ))?;
    let mut node: *mut vsan_node = std::ptr::null_mut();
    check(
        // SAFETY: a valid string and out pointer.
        unsafe { vsan_node_new_from_toml(toml.as_ptr(), &mut node) },
        "open node",
    )?;
    let name = CString::new("bench")?;
    let mut disk: *mut vsan_disk = std::ptr::null_mut();
    check(
        // SAFETY: valid arguments.
        unsafe { vsan_disk_open(node, name.as_ptr(), &mut disk) },
        "open disk",
    )?;
    let result = measure(&opts, disk, size);
    // SAFETY: handles from above, closed once.
    unsafe {
        vsan_disk_free(disk);
        check(vsan_node_free(node), "close node")?;
    }
    result
}

fn measure(opts: &Opts, disk: *mut vsan_disk, size: u64) -> Result<(), BoxError> {
    let (dev, rt) = disk_for_rust(disk).ok_or("no device behind the disk handle")?;
    // Fill the disk so reads copy real data.
    rt.block_on(async {
        let chunk = Bytes::from(vec![0xa5u8; 1 << 20]);
        for off in (0..size).step_by(1 << 20) {
            dev.write(off, chunk.clone(), IoFlags::empty()).await?;
        }
        Ok::<(), vsan_core::Error>(())
    })?;
    let blocks = size / BLOCK as u64;
    let mut rng = SmallRng::seed_from_u64(7);
    let offsets: Arc<Vec<u64>> = Arc::new(
        (0..opts.count)
            .map(|_| rng.random_range(0..blocks) * BLOCK as u64)
            .collect(),
    );
    let mut cases = Cases {
        names: [
            "Rust read().await, QD1",
            "C vsan_disk_read (blocking), QD1",
            "C vsan_disk_submit_read, QD1",
            "Rust 32 reads in flight, QD32",
            "C vsan_disk_submit_read, QD32",
        ],
        ns: Default::default(),
    };
    println!(
        "vsan-bench ffi: 4 KiB reads of a {} MiB RAM disk, {} per case per round, {} rounds, \
         node runtime {} worker thread(s)",
        opts.size_mib, opts.count, opts.rounds, opts.threads
    );
    for round in 0..opts.rounds {
        // Rotate the order so drift hits every case alike.
        for k in 0..5 {
            let case = (k + round as usize) % 5;
            let n = opts.count as f64;
            let t = Instant::now();
            match case {
                0 => rust_qd1(&dev, &rt, &offsets)?,
                1 => c_blocking(disk, &offsets)?,
                2 => c_async(disk, &offsets, 1)?,
                3 => rust_qd32(&dev, &rt, &offsets)?,
                _ => c_async(disk, &offsets, DEPTH)?,
            }
            cases.ns[case].push(t.elapsed().as_nanos() as f64 / n);
        }
    }
    let m: Vec<f64> = cases.ns.iter().map(|v| median(v)).collect();
    println!(
        "{:<36} {:>10} {:>10} {:>10} {:>12}",
        "case", "ns/op", "min", "max", "added"
    );
    let mut worst: f64 = 0.0;
    for (i, name) in cases.names.iter().enumerate() {
        let base = if i < 3 { m[0] } else { m[3] };
        let added = if i == 0 || i == 3 {
            "(baseline)".to_string()
        } else {
            worst = worst.max(m[i] - base);
            format!("{:+.0} ns", m[i] - base)
        };
        let min = cases.ns[i].iter().copied().fold(f64::INFINITY, f64::min);
        let max = cases.ns[i].iter().copied().fold(0.0, f64::max);
        println!(
            "{name:<36} {:>10.0} {min:>10.0} {max:>10.0} {added:>12}",
            m[i]
        );
    }
    println!(
        "target: <= 1000 ns added per operation: {} (largest added: {worst:.0} ns)",
        if worst <= 1000.0 { "met" } else { "MISSED" }
    );
    Ok(())
}

fn rust_qd1(
    dev: &Arc<dyn BlockDevice>,
    rt: &tokio::runtime::Handle,
    offsets: &[u64],
) -> Result<(), BoxError> {
    rt.block_on(async {
        for &off in offsets {
            let data = dev.read(off, BLOCK).await?;
            std::hint::black_box(data);
        }
        Ok::<(), vsan_core::Error>(())
    })?;
    Ok(())
}

fn rust_qd32(
    dev: &Arc<dyn BlockDevice>,
    rt: &tokio::runtime::Handle,
    offsets: &[u64],
) -> Result<(), BoxError> {
    rt.block_on(async {
        let mut pending = FuturesUnordered::new();
        let mut next = offsets.iter();
        for &off in next.by_ref().take(DEPTH as usize) {
            pending.push(dev.read(off, BLOCK));
        }
        while let Some(r) = pending.next().await {
            std::hint::black_box(r?);
            if let Some(&off) = next.next() {
                pending.push(dev.read(off, BLOCK));
            }
        }
        Ok::<(), vsan_core::Error>(())
    })?;
    Ok(())
}

fn c_blocking(disk: *mut vsan_disk, offsets: &[u64]) -> Result<(), BoxError> {
    let mut buf = vec![0u8; BLOCK];
    for &off in offsets {
        // SAFETY: a valid buffer of BLOCK bytes.
        let r = unsafe { vsan_disk_read(disk, off, buf.as_mut_ptr().cast(), BLOCK) };
        check(r, "vsan_disk_read")?;
    }
    std::hint::black_box(&buf);
    Ok(())
}

/// Reads through `vsan_disk_submit_read` with up to `depth` in flight, each into a
/// buffer slot of its own (the slot is the tag).
fn c_async(disk: *mut vsan_disk, offsets: &[u64], depth: u64) -> Result<(), BoxError> {
    let counter = Counter {
        done: AtomicU64::new(0),
        failed: AtomicU64::new(0),
        busy: (0..depth).map(|_| AtomicBool::new(false)).collect(),
    };
    let mut bufs = vec![0u8; BLOCK * depth as usize];
    let base = bufs.as_mut_ptr();
    let total = offsets.len() as u64;
    let mut submitted = 0u64;
    let mut slot = 0usize;
    while counter.done.load(Ordering::Acquire) < total {
        if submitted < total && !counter.busy[slot].load(Ordering::Acquire) {
            counter.busy[slot].store(true, Ordering::Relaxed);
            // SAFETY: the slot is used by one read at a time (marked busy until its
            // callback); the buffer and counter outlive every read (this loop waits for
            // all of them).
            let r = unsafe {
                vsan_disk_submit_read(
                    disk,
                    offsets[submitted as usize],
                    base.add(slot * BLOCK).cast(),
                    BLOCK,
                    Some(count),
                    &counter as *const Counter as *mut c_void,
                    slot as u64,
                )
            };
            check(r, "vsan_disk_submit_read")?;
            submitted += 1;
        } else {
            std::hint::spin_loop();
        }
        slot = (slot + 1) % depth as usize;
    }
    if counter.failed.load(Ordering::Relaxed) > 0 {
        return Err("some reads failed".into());
    }
    std::hint::black_box(&bufs);
    Ok(())
}
