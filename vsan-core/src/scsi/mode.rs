//! Mode pages (SPC-4 7.5, SBC-3 6.4): caching (WCE), control (D_SENSE, SWP, TAS) and
//! informational exceptions, for MODE SENSE(6/10) and MODE SELECT(6/10). The settable
//! bits live in one atomic byte so the I/O path reads them without a lock.

use std::sync::atomic::{AtomicU8, Ordering};

use super::cdb::{MODE_SELECT_6, MODE_SENSE_6, be16, be32, u8_at};
use super::sense::{self, Sense};
use crate::device::Geometry;

const WCE: u8 = 1;
const D_SENSE: u8 = 2;
const SWP: u8 = 4;
const TAS: u8 = 8;
const DEFAULT: u8 = WCE;

/// The changeable mode parameters of a logical unit.
#[derive(Debug)]
pub struct ModeState(AtomicU8);

/// A snapshot of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModeBits(u8);

impl ModeBits {
    /// Write cache enabled (else every write is FUA).
    pub fn wce(self) -> bool {
        self.0 & WCE != 0
    }
    /// Descriptor format sense.
    pub fn d_sense(self) -> bool {
        self.0 & D_SENSE != 0
    }
    /// Software write protect.
    pub fn swp(self) -> bool {
        self.0 & SWP != 0
    }
    /// Aborted tasks get TASK ABORTED status.
    pub fn tas(self) -> bool {
        self.0 & TAS != 0
    }
}

impl Default for ModeState {
    fn default() -> Self {
        ModeState(AtomicU8::new(DEFAULT))
    }
}

impl ModeState {
    /// The current values.
    pub fn get(&self) -> ModeBits {
        ModeBits(self.0.load(Ordering::Relaxed))
    }
    /// Replace them.
    pub fn set(&self, b: ModeBits) {
        self.0.store(b.0, Ordering::Relaxed)
    }
    /// Back to the defaults (a reset).
    pub fn reset(&self) {
        self.0.store(DEFAULT, Ordering::Relaxed)
    }
}

const CACHING: u8 = 0x08;
const CONTROL: u8 = 0x0A;
const IEC: u8 = 0x1C;

fn page(code: u8, bits: ModeBits, changeable: bool) -> Vec<u8> {
    match code {
        CACHING => {
            let mut p = vec![0u8; 20];
            p[0] = CACHING;
            p[1] = 0x12;
            if changeable {
                p[2] = 0x04;
            } else {
                p[2] = if bits.wce() { 0x04 } else { 0 };
                p[4..6].copy_from_slice(&[0xFF, 0xFF]);
                p[8..12].copy_from_slice(&[0xFF, 0xFF, 0xFF, 0xFF]);
            }
            p
        }
        CONTROL => {
            let mut p = vec![0u8; 12];
            p[0] = CONTROL;
            p[1] = 0x0A;
            if changeable {
                p[2] = 0x04;
                p[4] = 0x08;
                p[5] = 0x40;
            } else {
                p[2] = if bits.d_sense() { 0x04 } else { 0 };
                p[3] = 0x10; // QAM 1: unrestricted reordering; QERR 0
                p[4] = if bits.swp() { 0x08 } else { 0 };
                p[5] = if bits.tas() { 0x40 } else { 0 };
                p[8..10].copy_from_slice(&[0xFF, 0xFF]); // busy timeout: unlimited
            }
            p
        }
        _ => {
            let mut p = vec![0u8; 12];
            p[0] = IEC;
            p[1] = 0x0A;
            if !changeable {
                p[2] = 0x08; // DEXCPT: no informational exceptions reported
            }
            p
        }
    }
}

/// MODE SENSE(6/10) data. `wp`: the unit is write protected (read-only or SWP).
pub fn sense_data(
    cdb: &[u8],
    current: ModeBits,
    g: Geometry,
    read_only: bool,
) -> Result<Vec<u8>, Sense> {
    let six = u8_at(cdb, 0) == MODE_SENSE_6;
    let dbd = u8_at(cdb, 1) & 0x08 != 0;
    let llbaa = !six && u8_at(cdb, 1) & 0x10 != 0;
    let pc = u8_at(cdb, 2) >> 6;
    let code = u8_at(cdb, 2) & 0x3F;
    let sub = u8_at(cdb, 3);
    let codes: &[u8] = match (code, sub) {
        (0x3F, 0x00 | 0xFF) => &[CACHING, CONTROL, IEC],
        (CACHING, 0) => &[CACHING],
        (CONTROL, 0) => &[CONTROL],
        (IEC, 0) => &[IEC],
        _ => return Err(sense::INVALID_FIELD_IN_CDB),
    };
    let bits = match pc {
        0 => current,
        // Default and saved (saving is not offered: the saved values are the defaults).
        2 | 3 => ModeBits(DEFAULT),
        _ => current,
    };
    let mut pages = Vec::with_capacity(48);
    for &c in codes {
        pages.extend_from_slice(&page(c, bits, pc == 1));
    }
    let mut bd = Vec::new();
    if !dbd {
        let blocks = g.size() / u64::from(g.block_size());
        if llbaa {
            bd.extend_from_slice(&blocks.to_be_bytes());
            bd.extend_from_slice(&[0; 4]);
            bd.extend_from_slice(&g.block_size().to_be_bytes());
        } else {
            let n = u32::try_from(blocks).unwrap_or(u32::MAX);
            bd.extend_from_slice(&n.to_be_bytes());
            bd.push(0);
            bd.extend_from_slice(&g.block_size().to_be_bytes()[1..]);
        }
    }
    // Device-specific parameter: WP, DPOFUA.
    let dsp = if read_only || current.swp() { 0x80 } else { 0 } | 0x10;
    let mut out = Vec::with_capacity(8 + bd.len() + pages.len());
    if six {
        let len = 3 + bd.len() + pages.len();
        out.extend_from_slice(&[len.min(255) as u8, 0, dsp, bd.len() as u8]);
    } else {
        let len = 6 + bd.len() + pages.len();
        out.extend_from_slice(&(len.min(0xFFFF) as u16).to_be_bytes());
        out.extend_from_slice(&[0, dsp, u8::from(llbaa), 0]);
        out.extend_from_slice(&(bd.len() as u16).to_be_bytes());
    }
    out.extend_from_slice(&bd);
    out.extend_from_slice(&pages);
    Ok(out)
}

/// MODE SELECT(6/10): the new values, or the sense for a bad CDB or parameter list.
pub fn select(cdb: &[u8], data: &[u8], current: ModeBits, g: Geometry) -> Result<ModeBits, Sense> {
    let six = u8_at(cdb, 0) == MODE_SELECT_6;
    let pf = u8_at(cdb, 1) & 0x10 != 0;
    let sp = u8_at(cdb, 1) & 0x01 != 0;
    let len = if six {
        usize::from(u8_at(cdb, 4))
    } else {
        usize::from(be16(cdb, 7))
    };
    if sp {
        return Err(sense::SAVING_NOT_SUPPORTED);
    }
    if len == 0 {
        return Ok(current);
    }
    if !pf {
        return Err(sense::INVALID_FIELD_IN_CDB);
    }
    let data = data.get(..len).ok_or(sense::PARAM_LIST_LENGTH)?;
    let (hdr, bdl) = if six {
        (4usize, usize::from(u8_at(data, 3)))
    } else {
        (8usize, usize::from(be16(data, 6)))
    };
    if data.len() < hdr {
        return Err(sense::PARAM_LIST_LENGTH);
    }
    let bd = data.get(hdr..hdr + bdl).ok_or(sense::PARAM_LIST_LENGTH)?;
    // A block descriptor may only restate the block length.
    let long = !six && u8_at(data, 4) & 0x01 != 0;
    match (bdl, long) {
        (0, _) => {}
        (8, false) => {
            let bl = be32(bd, 4) & 0x00FF_FFFF;
            if bl != 0 && bl != g.block_size() {
                return Err(sense::INVALID_FIELD_IN_PARAM);
            }
        }
        (16, true) => {
            let bl = be32(bd, 12);
            if bl != 0 && bl != g.block_size() {
                return Err(sense::INVALID_FIELD_IN_PARAM);
            }
        }
        _ => return Err(sense::INVALID_FIELD_IN_PARAM),
    }
    let mut rest = &data[hdr + bdl..];
    let mut bits = current;
    while !rest.is_empty() {
        let code = u8_at(rest, 0);
        if code & 0x40 != 0 {
            return Err(sense::INVALID_FIELD_IN_PARAM); // no subpages
        }
        let code = code & 0x3F;
        let plen = usize::from(u8_at(rest, 1)) + 2;
        let p = rest.get(..plen).ok_or(sense::PARAM_LIST_LENGTH)?;
        if !matches!(code, CACHING | CONTROL | IEC) {
            return Err(sense::INVALID_FIELD_IN_PARAM);
        }
        let cur = page(code, current, false);
        let mask = page(code, current, true);
        if p.len() != cur.len() {
            return Err(sense::INVALID_FIELD_IN_PARAM);
        }
        // Bytes 0-1 (code, length) are checked above; every other bit that is not
        // changeable must equal the current value.
        for i in 2..cur.len() {
            if (p[i] ^ cur[i]) & !mask[i] != 0 {
                return Err(sense::INVALID_FIELD_IN_PARAM);
            }
        }
        let mut v = bits.0;
        let mut setb = |flag: u8, on: bool| {
            if on { v |= flag } else { v &= !flag }
        };
        match code {
            CACHING => setb(WCE, p[2] & 0x04 != 0),
            CONTROL => {
                setb(D_SENSE, p[2] & 0x04 != 0);
                setb(SWP, p[4] & 0x08 != 0);
                setb(TAS, p[5] & 0x40 != 0);
            }
            _ => {}
        }
        bits = ModeBits(v);
        rest = &rest[plen..];
    }
    Ok(bits)
}
