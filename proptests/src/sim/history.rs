//! What the simulated clients did and saw, and the checks that follow from it.
//!
//! Every sector written by the simulation carries the id of the write that put it there
//! (see [`sector_bytes`]), so a read tells exactly which write it returned. The history
//! records each write's submission, its end (completion, or the crash of the node that
//! submitted it) and outcome, each flush, and each power cut; from these it decides which
//! writes a read (or the final image) may return.
//!
//! # Which values a read may return
//!
//! For a read of sector `s` submitted at `rs` and completed at `rc`, a write `W` to `s`
//! is allowed unless it is *superseded*: some write `W'` to `s`, acknowledged (Ok) before
//! `rs`, was submitted after `W` ended, and `W'` *survives* until `rs`. Writes still in
//! flight when the read completed, and writes submitted after it, are concurrent or later:
//! a write submitted after `rc` is never allowed. The initial zeroes are a write that
//! ended at time 0.
//!
//! (A power cut between the read's submission and its completion counts: the read may
//! have been served after it.)
//!
//! A write survives a power cut (of either node) only if it was durable before it: a FUA
//! write once acknowledged, any write once a flush submitted after its acknowledgement
//! completed on a node that holds it (the node that acknowledged it, or a node on the same
//! link while it was mirroring). This is the block-device contract: an acknowledged write
//! that was not flushed may be lost by a power cut. (A mirror often keeps more: such a
//! write usually survives on the other node. The check does not demand it.)
//!
//! Failed writes may have landed on one replica, so they stay allowed until superseded,
//! like any other; they never supersede anything. A write fenced while in flight (its
//! initiator preempted and aborted: the SCSI runs) counts as ended at its fence. Writes refused before they could
//! change anything (a reservation conflict, a unit attention, a miscompare: the SCSI
//! runs) are never allowed.

use std::time::Duration;

/// Bytes per sector: the unit every check works in (the disks' logical block size).
pub const SECTOR: u64 = 512;

/// The id the initial contents (zeroes) and every zeroing write stand for.
pub const ZERO: u64 = 0;

/// The contents of `sector` as written by write `id`: the id, the sector number, and a
/// fill derived from both, so a sector holding anything else (a mix of two writes, a
/// sector written to the wrong place) is recognised.
pub fn sector_bytes(id: u64, sector: u64, out: &mut [u8]) {
    out[..8].copy_from_slice(&id.to_le_bytes());
    out[8..16].copy_from_slice(&sector.to_le_bytes());
    out[16..].fill(fill_byte(id, sector));
}

fn fill_byte(id: u64, sector: u64) -> u8 {
    ((id.wrapping_mul(0x9e37_79b9) ^ sector.wrapping_mul(31)) as u8) | 1
}

/// The write id a sector's bytes name: [`ZERO`] for zeroes, `Err` for bytes that no write
/// wrote there.
pub fn decode_sector(sector: u64, bytes: &[u8]) -> Result<u64, String> {
    if bytes.iter().all(|b| *b == 0) {
        return Ok(ZERO);
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&bytes[..8]);
    let id = u64::from_le_bytes(id);
    let mut at = [0u8; 8];
    at.copy_from_slice(&bytes[8..16]);
    let at = u64::from_le_bytes(at);
    if at != sector {
        return Err(format!(
            "sector {sector} holds write {id}'s data for sector {at}"
        ));
    }
    let fill = fill_byte(id, sector);
    if bytes[16..].iter().any(|b| *b != fill) {
        return Err(format!(
            "sector {sector} holds a mix of write {id} and something else (torn within a sector)"
        ));
    }
    Ok(id)
}

/// One write (data, write_zeroes or discard) a client submitted.
#[derive(Debug, Clone)]
pub struct Write {
    /// Its id ([`ZERO`] for the initial contents).
    pub id: u64,
    /// The node (1 or 2) it was submitted on; 0 for the initial contents.
    pub node: u32,
    /// The value its sectors read back as: its id, or [`ZERO`] for a zeroing write.
    pub value: u64,
    /// First sector and number of sectors.
    pub sectors: (u64, u64),
    /// With FUA.
    pub fua: bool,
    /// When it was submitted.
    pub submit: Duration,
    /// When it ended: completed (either way), or its node crashed. `None`: in flight.
    pub end: Option<Duration>,
    /// Completed Ok.
    pub ok: bool,
    /// The link epoch it was acknowledged on, if its node was mirroring then.
    pub link: Option<u64>,
    /// When it became durable (FUA acknowledgement, or a covering flush's completion).
    pub durable: Option<Duration>,
    /// Submitted after the nodes were separated (the simulation's link down or cut) and
    /// acknowledged before they met again: the number of the connection it came after
    /// (for the quorum check).
    pub apart: Option<u64>,
    /// Refused before it could change anything (a reservation conflict, a unit
    /// attention, a COMPARE AND WRITE's miscompare): no read may ever return it.
    pub refused: bool,
    /// Fenced at this time: a PERSISTENT RESERVE OUT PREEMPT AND ABORT of its initiator
    /// completed while it was in flight. From then on it must not land: it counts as
    /// ended then (see [`History::fence`]).
    pub fenced: Option<Duration>,
}

impl Write {
    /// When it ended as far as what it may still change goes: its end, or its fence if
    /// that came first.
    fn landed_by(&self) -> Option<Duration> {
        match (self.end, self.fenced) {
            (Some(e), Some(f)) => Some(e.min(f)),
            (e, None) => e,
            (None, f) => f,
        }
    }
}

/// One flush a client submitted.
#[derive(Debug, Clone)]
struct Flush {
    node: u32,
    submit: Duration,
    link: Option<u64>,
}

/// Everything the clients did, with the checks.
#[derive(Debug)]
pub struct History {
    writes: Vec<Write>,
    flushes: Vec<Flush>,
    /// Per sector, the writes to it (indices into `writes`), in submission order.
    by_sector: Vec<Vec<usize>>,
    /// Acknowledged writes not yet durable.
    not_durable: Vec<usize>,
    /// Power cuts, in time order.
    cuts: Vec<Duration>,
    /// Reads checked.
    pub reads_checked: u64,
}

impl History {
    /// A history of a disk of `sectors` sectors holding zeroes.
    pub fn new(sectors: u64) -> History {
        let initial = Write {
            id: ZERO,
            node: 0,
            value: ZERO,
            sectors: (0, sectors),
            fua: true,
            submit: Duration::ZERO,
            end: Some(Duration::ZERO),
            ok: true,
            link: None,
            durable: Some(Duration::ZERO),
            apart: None,
            refused: false,
            fenced: None,
        };
        History {
            writes: vec![initial],
            flushes: Vec::new(),
            by_sector: vec![vec![0]; sectors as usize],
            not_durable: Vec::new(),
            cuts: Vec::new(),
            reads_checked: 0,
        }
    }

    /// Record a write submitted now; returns its index.
    pub fn submit_write(
        &mut self,
        id: u64,
        node: u32,
        zero: bool,
        sectors: (u64, u64),
        fua: bool,
        now: Duration,
    ) -> usize {
        let i = self.writes.len();
        self.writes.push(Write {
            id,
            node,
            value: if zero { ZERO } else { id },
            sectors,
            fua,
            submit: now,
            end: None,
            ok: false,
            link: None,
            durable: None,
            apart: None,
            refused: false,
            fenced: None,
        });
        for s in sectors.0..sectors.0 + sectors.1 {
            self.by_sector[s as usize].push(i);
        }
        i
    }

    /// A write completed: `link` is the link epoch if its node was mirroring, `apart` the
    /// connection number if the simulation's link was down or cut.
    pub fn write_done(
        &mut self,
        i: usize,
        ok: bool,
        link: Option<u64>,
        apart: Option<u64>,
        now: Duration,
    ) {
        let w = &mut self.writes[i];
        w.end = Some(now);
        w.ok = ok;
        if ok {
            w.link = link;
            w.apart = apart;
            if w.fua {
                w.durable = Some(now);
            } else {
                self.not_durable.push(i);
            }
        }
    }

    /// A write was refused before it could change anything (see [`Write::refused`]).
    pub fn write_refused(&mut self, i: usize, now: Duration) {
        let w = &mut self.writes[i];
        w.end = Some(now);
        w.ok = false;
        w.refused = true;
    }

    /// A PREEMPT AND ABORT of write `i`'s initiator completed now, while the write was
    /// in flight (on either node): the write must not land after now (SPC-4 5.13.11.2.4:
    /// the fenced initiator's tasks are aborted, and a cluster relies on nothing of it
    /// reaching the disk after the fence). A read, or the final image, may return it
    /// only as it may return a write that ended now.
    pub fn fence(&mut self, i: usize, now: Duration) {
        let w = &mut self.writes[i];
        if w.end.is_none_or(|e| e > now) && w.fenced.is_none() {
            w.fenced = Some(now);
        }
    }

    /// When write `i` was fenced, if it was.
    pub fn fenced_at(&self, i: usize) -> Option<Duration> {
        self.writes[i].fenced
    }

    /// When the write whose data is value `v` ended (`None`: still in flight, or no such
    /// write; the initial zeroes ended at time 0).
    pub fn end_of(&self, v: u64) -> Option<Duration> {
        self.writes.iter().find(|w| w.id == v).and_then(|w| w.end)
    }

    /// Whether a power cut happened between `from` and `to`.
    pub fn cut_between(&self, from: Duration, to: Duration) -> bool {
        self.cuts.iter().any(|c| *c >= from && *c <= to)
    }

    /// A node crashed: its writes in flight end now (they may or may not have landed).
    pub fn node_crashed(&mut self, i: usize, now: Duration) {
        let w = &mut self.writes[i];
        if w.end.is_none() {
            w.end = Some(now);
        }
    }

    /// Record a flush submitted now; returns its index.
    pub fn submit_flush(&mut self, node: u32, link: Option<u64>, now: Duration) -> usize {
        self.flushes.push(Flush {
            node,
            submit: now,
            link,
        });
        self.flushes.len() - 1
    }

    /// A flush completed Ok: the writes it covers are durable from now on.
    pub fn flush_done(&mut self, f: usize, now: Duration) {
        let f = self.flushes[f].clone();
        let writes = &mut self.writes;
        self.not_durable.retain(|&i| {
            let w = &mut writes[i];
            let acked = w.end.expect("acknowledged");
            let holds = w.node == f.node || (w.link.is_some() && w.link == f.link);
            if acked < f.submit && holds {
                w.durable = Some(now);
                false
            } else {
                true
            }
        });
    }

    /// A power cut (of one node or both) at `now`.
    pub fn power_cut(&mut self, now: Duration) {
        self.cuts.push(now);
    }

    /// Whether write `w`, acknowledged, still holds at time `at` (no power cut since its
    /// acknowledgement, or it was durable before the first one).
    fn survives(&self, w: &Write, at: Duration) -> bool {
        let acked = w.end.expect("acknowledged");
        match self.cuts.iter().find(|c| **c > acked) {
            Some(cut) if *cut < at => w.durable.is_some_and(|d| d <= *cut),
            _ => true,
        }
    }

    /// Whether sector `s` may hold value `v` for a read submitted at `rs` and completed
    /// at `rc`; `Err` says why not.
    pub fn allowed(&self, s: u64, v: u64, rs: Duration, rc: Duration) -> Result<(), String> {
        let list = &self.by_sector[s as usize];
        // The latest submission among surviving writes acknowledged before the read.
        let mut floor = None::<Duration>;
        let mut floor_w = None::<&Write>;
        for &i in list {
            let w = &self.writes[i];
            if w.ok
                && w.end.is_some_and(|e| e < rs)
                && self.survives(w, rc)
                && floor.is_none_or(|f| w.submit > f)
            {
                floor = Some(w.submit);
                floor_w = Some(w);
            }
        }
        let ok = list.iter().any(|&i| {
            let w = &self.writes[i];
            w.value == v && !w.refused && w.submit < rc.max(Duration::from_nanos(1)) && {
                match (w.landed_by(), floor) {
                    (_, None) => true,
                    (None, Some(_)) => true,
                    (Some(e), Some(f)) => e >= f,
                }
            }
        });
        if ok {
            return Ok(());
        }
        let holder = list
            .iter()
            .map(|&i| &self.writes[i])
            .find(|w| w.value == v)
            .map_or("no write to this sector".to_string(), |w| format!("{w:?}"));
        Err(format!(
            "sector {s} read as write {v} (read submitted {rs:?}, completed {rc:?}), but \
             this write, acknowledged before the read and not lost since, supersedes it: {floor_w:?}; \
             the value's write: {holder}"
        ))
    }

    /// Check that both nodes never acknowledged writes while apart during the same
    /// separation; `Err` names two such writes.
    pub fn check_exclusive(&self) -> Result<(), String> {
        let mut first: std::collections::HashMap<u64, &Write> = Default::default();
        for w in &self.writes {
            let Some(p) = w.apart else { continue };
            match first.get(&p) {
                Some(other) if other.node != w.node => {
                    return Err(format!(
                        "both nodes acknowledged writes while apart (after connection {p}): \
                         {other:?} and {w:?}"
                    ));
                }
                Some(_) => {}
                None => {
                    first.insert(p, w);
                }
            }
        }
        Ok(())
    }

    /// When write `i` was submitted.
    pub fn submitted(&self, i: usize) -> Duration {
        self.writes[i].submit
    }

    /// Writes submitted.
    pub fn writes(&self) -> usize {
        self.writes.len() - 1
    }

    /// Writes acknowledged Ok.
    pub fn writes_ok(&self) -> usize {
        self.writes.iter().skip(1).filter(|w| w.ok).count()
    }
}
