//! A lean NBD load generator: one connection, a fixed number of requests in flight,
//! the requests of one round trip sent with one write and the replies read in bulk, so
//! that the server and not the client sets the pace (fio's nbd engine works the same
//! way). The demo's headline figures come from it.
//!
//! Writes are verifiable: each goes to a block no other request in flight touches, with
//! the contents [`expected_block`] gives for the block's next generation, which the
//! [`BlockLog`] records once the server acknowledges it.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, BytesMut};
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vsan_core::export::nbd::Stream;
use vsan_core::export::nbd::negotiate;
use vsan_core::{Error, ErrorKind, Result};

use crate::pattern::{BLOCK, BlockLog, expected_block};

use vsan_core::export::nbd::proto::{
    CMD_READ, CMD_WRITE, REQUEST_MAGIC, SIMPLE_REPLY_LEN as REPLY_LEN, SIMPLE_REPLY_MAGIC,
};

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    /// Requests in flight.
    pub depth: usize,
    /// How long.
    pub duration: Duration,
    /// Writes (verifiable) or reads.
    pub writes: bool,
    /// Blocks of [`BLOCK`] bytes the requests go to, at random.
    pub blocks: u64,
    /// Seed of the block choice.
    pub seed: u64,
}

/// What it measured.
#[derive(Debug)]
pub struct LoadReport {
    /// Requests completed.
    pub ios: u64,
    /// Requests the server failed.
    pub errors: u64,
    /// Reads whose data was not what the log expects.
    pub mismatches: u64,
    /// From the first request to the last reply.
    pub elapsed: Duration,
    /// Completion latency, microseconds.
    pub latency: Histogram<u64>,
}

struct Slot {
    block: u64,
    generation: u32,
    sent: Instant,
}

/// Run `load` on an NBD connection to `export` over `stream`: negotiate, then keep
/// `load.depth` requests in flight until `load.duration` has passed, then drain.
pub async fn run<S: Stream>(
    mut stream: S,
    export: &str,
    load: Load,
    log: &BlockLog,
) -> Result<LoadReport> {
    let info = negotiate(&mut stream, export).await?;
    if load.blocks == 0 || load.blocks * BLOCK as u64 > info.size {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "{} blocks do not fit the export's {} bytes",
                load.blocks, info.size
            ),
        ));
    }
    let mut latency = Histogram::new_with_bounds(1, 60_000_000, 3)
        .map_err(|e| Error::new(ErrorKind::InvalidArgument, e.to_string()))?;
    let mut rng = SmallRng::seed_from_u64(load.seed);
    let mut slots: Vec<Option<Slot>> = (0..load.depth).map(|_| None).collect();
    let mut busy: HashSet<u64> = HashSet::with_capacity(load.depth * 2);
    let mut out = BytesMut::with_capacity(load.depth * (28 + BLOCK));
    let mut inbuf = BytesMut::with_capacity(256 << 10);
    let (mut ios, mut errors, mut mismatches) = (0u64, 0u64, 0u64);
    let started = Instant::now();
    let deadline = started + load.duration;
    let mut in_flight = 0usize;

    let mut issue = |slot: usize,
                     out: &mut BytesMut,
                     busy: &mut HashSet<u64>,
                     slots: &mut Vec<Option<Slot>>| {
        let block = loop {
            let b = rng.random_range(0..load.blocks);
            if busy.insert(b) {
                break b;
            }
        };
        let generation = log.generation(block) + 1;
        out.put_u32(REQUEST_MAGIC);
        out.put_u16(0);
        out.put_u16(if load.writes { CMD_WRITE } else { CMD_READ });
        out.put_u64(slot as u64);
        out.put_u64(block * BLOCK as u64);
        out.put_u32(BLOCK as u32);
        if load.writes {
            out.put_slice(&expected_block(block, generation));
        }
        slots[slot] = Some(Slot {
            block,
            generation,
            sent: Instant::now(),
        });
    };
    for slot in 0..load.depth {
        issue(slot, &mut out, &mut busy, &mut slots);
        in_flight += 1;
    }
    let io = |what: &'static str| move |e| Error::io(what, e);
    while in_flight > 0 {
        if !out.is_empty() {
            stream.write_all(&out).await.map_err(io("send requests"))?;
            out.clear();
        }
        if stream
            .read_buf(&mut inbuf)
            .await
            .map_err(io("read replies"))?
            == 0
        {
            return Err(Error::new(
                ErrorKind::Closed,
                "the server closed the connection",
            ));
        }
        let more = Instant::now() < deadline;
        loop {
            if inbuf.len() < REPLY_LEN {
                break;
            }
            let magic = u32::from_be_bytes([inbuf[0], inbuf[1], inbuf[2], inbuf[3]]);
            let errno = u32::from_be_bytes([inbuf[4], inbuf[5], inbuf[6], inbuf[7]]);
            let mut c = [0u8; 8];
            c.copy_from_slice(&inbuf[8..16]);
            let cookie = u64::from_be_bytes(c) as usize;
            if magic != SIMPLE_REPLY_MAGIC {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("bad reply magic {magic:#x}"),
                ));
            }
            let data_len = if !load.writes && errno == 0 { BLOCK } else { 0 };
            if inbuf.len() < REPLY_LEN + data_len {
                break;
            }
            let Some(slot) = slots.get_mut(cookie).and_then(Option::take) else {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("reply for unknown cookie {cookie}"),
                ));
            };
            inbuf.advance(REPLY_LEN);
            let _ = latency.record(slot.sent.elapsed().as_micros().max(1) as u64);
            busy.remove(&slot.block);
            in_flight -= 1;
            ios += 1;
            if errno != 0 {
                errors += 1;
            } else if load.writes {
                log.set_generation(slot.block, slot.generation);
            } else {
                let data = inbuf.split_to(data_len);
                if data[..] != expected_block(slot.block, slot.generation - 1)[..] {
                    mismatches += 1;
                }
            }
            if more {
                issue(cookie, &mut out, &mut busy, &mut slots);
                in_flight += 1;
            }
        }
    }
    Ok(LoadReport {
        ios,
        errors,
        mismatches,
        elapsed: started.elapsed(),
        latency,
    })
}
