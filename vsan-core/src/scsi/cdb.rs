//! CDB decoding: the operation codes this layer serves, total field readers (a short CDB
//! reads as zeros, never panics), how much data each CDB moves, and the table REPORT
//! SUPPORTED OPERATION CODES answers from.

use super::Direction;
use super::sense::{self, Sense};
use crate::device::Geometry;

/// TEST UNIT READY.
pub const TEST_UNIT_READY: u8 = 0x00;
/// REQUEST SENSE.
pub const REQUEST_SENSE: u8 = 0x03;
/// READ(6).
pub const READ_6: u8 = 0x08;
/// WRITE(6).
pub const WRITE_6: u8 = 0x0A;
/// INQUIRY.
pub const INQUIRY: u8 = 0x12;
/// MODE SELECT(6).
pub const MODE_SELECT_6: u8 = 0x15;
/// RESERVE(6).
pub const RESERVE_6: u8 = 0x16;
/// RELEASE(6).
pub const RELEASE_6: u8 = 0x17;
/// MODE SENSE(6).
pub const MODE_SENSE_6: u8 = 0x1A;
/// START STOP UNIT.
pub const START_STOP_UNIT: u8 = 0x1B;
/// PREVENT ALLOW MEDIUM REMOVAL.
pub const PREVENT_ALLOW: u8 = 0x1E;
/// READ CAPACITY(10).
pub const READ_CAPACITY_10: u8 = 0x25;
/// READ(10).
pub const READ_10: u8 = 0x28;
/// WRITE(10).
pub const WRITE_10: u8 = 0x2A;
/// WRITE AND VERIFY(10).
pub const WRITE_VERIFY_10: u8 = 0x2E;
/// VERIFY(10).
pub const VERIFY_10: u8 = 0x2F;
/// PRE-FETCH(10).
pub const PRE_FETCH_10: u8 = 0x34;
/// SYNCHRONIZE CACHE(10).
pub const SYNC_CACHE_10: u8 = 0x35;
/// WRITE SAME(10).
pub const WRITE_SAME_10: u8 = 0x41;
/// UNMAP.
pub const UNMAP: u8 = 0x42;
/// MODE SELECT(10).
pub const MODE_SELECT_10: u8 = 0x55;
/// RESERVE(10).
pub const RESERVE_10: u8 = 0x56;
/// RELEASE(10).
pub const RELEASE_10: u8 = 0x57;
/// MODE SENSE(10).
pub const MODE_SENSE_10: u8 = 0x5A;
/// PERSISTENT RESERVE IN.
pub const PR_IN: u8 = 0x5E;
/// PERSISTENT RESERVE OUT.
pub const PR_OUT: u8 = 0x5F;
/// READ(16).
pub const READ_16: u8 = 0x88;
/// COMPARE AND WRITE.
pub const COMPARE_AND_WRITE: u8 = 0x89;
/// WRITE(16).
pub const WRITE_16: u8 = 0x8A;
/// ORWRITE(16): OR the data into the blocks, atomically.
pub const ORWRITE_16: u8 = 0x8B;
/// WRITE AND VERIFY(16).
pub const WRITE_VERIFY_16: u8 = 0x8E;
/// VERIFY(16).
pub const VERIFY_16: u8 = 0x8F;
/// PRE-FETCH(16).
pub const PRE_FETCH_16: u8 = 0x90;
/// SYNCHRONIZE CACHE(16).
pub const SYNC_CACHE_16: u8 = 0x91;
/// WRITE SAME(16).
pub const WRITE_SAME_16: u8 = 0x93;
/// SERVICE ACTION IN(16).
pub const SERVICE_ACTION_IN_16: u8 = 0x9E;
/// SERVICE ACTION IN(16) / READ CAPACITY(16).
pub const SA_READ_CAPACITY_16: u8 = 0x10;
/// SERVICE ACTION IN(16) / GET LBA STATUS.
pub const SA_GET_LBA_STATUS: u8 = 0x12;
/// REPORT LUNS.
pub const REPORT_LUNS: u8 = 0xA0;
/// MAINTENANCE IN.
pub const MAINTENANCE_IN: u8 = 0xA3;
/// MAINTENANCE IN / REPORT TARGET PORT GROUPS.
pub const SA_REPORT_TPGS: u8 = 0x0A;
/// MAINTENANCE IN / REPORT SUPPORTED OPERATION CODES.
pub const SA_REPORT_OPCODES: u8 = 0x0C;
/// MAINTENANCE IN / REPORT SUPPORTED TASK MANAGEMENT FUNCTIONS.
pub const SA_REPORT_TMFS: u8 = 0x0D;
/// READ(12).
pub const READ_12: u8 = 0xA8;
/// WRITE(12).
pub const WRITE_12: u8 = 0xAA;
/// WRITE AND VERIFY(12).
pub const WRITE_VERIFY_12: u8 = 0xAE;
/// VERIFY(12).
pub const VERIFY_12: u8 = 0xAF;

/// The longest PERSISTENT RESERVE OUT parameter list accepted.
pub const MAX_PR_OUT_PARAM: u32 = 64 << 10;

/// Byte `i` of the CDB, 0 past its end.
#[inline]
pub fn u8_at(c: &[u8], i: usize) -> u8 {
    c.get(i).copied().unwrap_or(0)
}

/// Big-endian u16 at `i`.
#[inline]
pub fn be16(c: &[u8], i: usize) -> u16 {
    u16::from_be_bytes([u8_at(c, i), u8_at(c, i + 1)])
}

/// Big-endian u32 at `i`.
#[inline]
pub fn be32(c: &[u8], i: usize) -> u32 {
    u32::from_be_bytes([
        u8_at(c, i),
        u8_at(c, i + 1),
        u8_at(c, i + 2),
        u8_at(c, i + 3),
    ])
}

/// Big-endian u64 at `i`.
#[inline]
pub fn be64(c: &[u8], i: usize) -> u64 {
    (u64::from(be32(c, i)) << 32) | u64::from(be32(c, i + 4))
}

/// The CDB length an operation code's group implies (SPC-4 4.2.5.1).
pub fn cdb_len(opcode: u8) -> usize {
    match opcode >> 5 {
        0 => 6,
        1 | 2 => 10,
        4 => 16,
        5 => 12,
        _ => 16,
    }
}

/// The service action of a CDB whose opcode has them.
pub fn service_action(c: &[u8]) -> u8 {
    u8_at(c, 1) & 0x1F
}

/// The LBA and block count of a block command (READ/WRITE/VERIFY/WRITE AND VERIFY/
/// WRITE SAME/COMPARE AND WRITE/PRE-FETCH/SYNCHRONIZE CACHE). READ(6)/WRITE(6) count
/// 0 as 256.
pub fn lba_blocks(c: &[u8]) -> (u64, u32) {
    let op = u8_at(c, 0);
    match op {
        READ_6 | WRITE_6 => {
            let lba = (u64::from(u8_at(c, 1) & 0x1F) << 16) | u64::from(be16(c, 2));
            let n = match u8_at(c, 4) {
                0 => 256,
                n => u32::from(n),
            };
            (lba, n)
        }
        COMPARE_AND_WRITE => (be64(c, 2), u32::from(u8_at(c, 13))),
        READ_12 | WRITE_12 | WRITE_VERIFY_12 | VERIFY_12 => (u64::from(be32(c, 2)), be32(c, 6)),
        _ if cdb_len(op) == 16 => (be64(c, 2), be32(c, 10)),
        _ => (u64::from(be32(c, 2)), u32::from(be16(c, 7))),
    }
}

/// VERIFY's BYTCHK field.
pub fn bytchk(c: &[u8]) -> u8 {
    (u8_at(c, 1) >> 1) & 0x3
}

fn blocks_bytes(blocks: u64, g: &Geometry) -> Result<u32, Sense> {
    let n = blocks.saturating_mul(u64::from(g.block_size()));
    if n > u64::from(g.max_io()) {
        return Err(sense::INVALID_FIELD_IN_CDB);
    }
    u32::try_from(n).map_err(|_| sense::INVALID_FIELD_IN_CDB)
}

/// What data a CDB moves (see [`super::LogicalUnit::inspect`]).
pub fn direction(c: &[u8], g: &Geometry) -> Result<Direction, Sense> {
    let Some(&op) = c.first() else {
        return Err(sense::INVALID_OPCODE);
    };
    if !is_supported(op, c) {
        return Err(match op {
            SERVICE_ACTION_IN_16 | MAINTENANCE_IN => sense::INVALID_FIELD_IN_CDB,
            _ => sense::INVALID_OPCODE,
        });
    }
    let len = cdb_len(op);
    if c.len() < len {
        return Err(sense::INVALID_FIELD_IN_CDB);
    }
    // NACA: we offer no ACA.
    if u8_at(c, len - 1) & 0x04 != 0 {
        return Err(sense::INVALID_FIELD_IN_CDB);
    }
    let bs = u64::from(g.block_size());
    Ok(match op {
        READ_6 | READ_10 | READ_12 | READ_16 => {
            Direction::In(blocks_bytes(u64::from(lba_blocks(c).1), g)?)
        }
        WRITE_6 | WRITE_10 | WRITE_12 | WRITE_16 | WRITE_VERIFY_10 | WRITE_VERIFY_12
        | WRITE_VERIFY_16 | ORWRITE_16 => {
            Direction::Out(blocks_bytes(u64::from(lba_blocks(c).1), g)?)
        }
        VERIFY_10 | VERIFY_12 | VERIFY_16 => match bytchk(c) {
            0 => Direction::None,
            1 => Direction::Out(blocks_bytes(u64::from(lba_blocks(c).1), g)?),
            3 => Direction::Out(blocks_bytes(1, g)?),
            _ => return Err(sense::INVALID_FIELD_IN_CDB),
        },
        WRITE_SAME_16 if u8_at(c, 1) & 0x01 != 0 => Direction::None,
        WRITE_SAME_10 | WRITE_SAME_16 => Direction::Out(blocks_bytes(1, g)?),
        COMPARE_AND_WRITE => {
            let n = u64::from(lba_blocks(c).1) * 2;
            // Checked against the CAW limit in execute; the length itself is bounded.
            Direction::Out(u32::try_from(n * bs).map_err(|_| sense::INVALID_FIELD_IN_CDB)?)
        }
        UNMAP => Direction::Out(u32::from(be16(c, 7))),
        MODE_SELECT_6 => Direction::Out(u32::from(u8_at(c, 4))),
        MODE_SELECT_10 => Direction::Out(u32::from(be16(c, 7))),
        // A parameter list past any registration we could hold (24 bytes, the TransportID
        // list of SPEC_I_PT) is refused before any data is collected.
        PR_OUT if be32(c, 5) > MAX_PR_OUT_PARAM => return Err(sense::PARAM_LIST_LENGTH),
        PR_OUT => Direction::Out(be32(c, 5)),
        PR_IN => Direction::In(u32::from(be16(c, 7))),
        INQUIRY => Direction::In(u32::from(be16(c, 3))),
        MODE_SENSE_6 | REQUEST_SENSE => Direction::In(u32::from(u8_at(c, 4))),
        MODE_SENSE_10 => Direction::In(u32::from(be16(c, 7))),
        READ_CAPACITY_10 => Direction::In(8),
        SERVICE_ACTION_IN_16 => Direction::In(be32(c, 10)),
        REPORT_LUNS | MAINTENANCE_IN => Direction::In(be32(c, 6)),
        _ => Direction::None,
    })
}

/// One supported command, as REPORT SUPPORTED OPERATION CODES describes it.
#[derive(Debug)]
pub struct OpInfo {
    /// Operation code.
    pub opcode: u8,
    /// Service action, for opcodes that have them.
    pub sa: Option<u8>,
    /// The CDB usage data: the bits this target looks at (the first byte is the opcode).
    pub usage: &'static [u8],
}

macro_rules! op {
    ($op:expr, $($b:expr),*) => {
        OpInfo { opcode: $op, sa: None, usage: &[$op, $($b),*] }
    };
}
macro_rules! op_sa {
    ($op:expr, $sa:expr, $($b:expr),*) => {
        OpInfo { opcode: $op, sa: Some($sa), usage: &[$op, $($b),*] }
    };
}

/// Every command this layer serves.
pub static SUPPORTED: &[OpInfo] = SUPPORTED_LIST;

/// Which opcodes [`SUPPORTED`] has, for the per-command check without a scan.
static OPCODE_MAP: [bool; 256] = {
    let mut map = [false; 256];
    let mut i = 0;
    while i < SUPPORTED_LIST.len() {
        map[SUPPORTED_LIST[i].opcode as usize] = true;
        i += 1;
    }
    map
};

const SUPPORTED_LIST: &[OpInfo] = &[
    op!(TEST_UNIT_READY, 0, 0, 0, 0, 0x07),
    op!(REQUEST_SENSE, 0x01, 0, 0, 0xFF, 0x07),
    op!(READ_6, 0x1F, 0xFF, 0xFF, 0xFF, 0x07),
    op!(WRITE_6, 0x1F, 0xFF, 0xFF, 0xFF, 0x07),
    op!(INQUIRY, 0x01, 0xFF, 0xFF, 0xFF, 0x07),
    op!(MODE_SELECT_6, 0x11, 0, 0, 0xFF, 0x07),
    op!(RESERVE_6, 0, 0, 0, 0, 0x07),
    op!(RELEASE_6, 0, 0, 0, 0, 0x07),
    op!(MODE_SENSE_6, 0x08, 0xFF, 0xFF, 0xFF, 0x07),
    op!(START_STOP_UNIT, 0x01, 0, 0x0F, 0xF7, 0x07),
    op!(PREVENT_ALLOW, 0, 0, 0, 0x03, 0x07),
    op!(
        READ_CAPACITY_10,
        0,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0,
        0,
        0x01,
        0x07
    ),
    op!(
        READ_10, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0x1F, 0xFF, 0xFF, 0x07
    ),
    op!(
        WRITE_10, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0x1F, 0xFF, 0xFF, 0x07
    ),
    op!(
        WRITE_VERIFY_10,
        0xF2,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0x1F,
        0xFF,
        0xFF,
        0x07
    ),
    op!(
        VERIFY_10, 0xF6, 0xFF, 0xFF, 0xFF, 0xFF, 0x1F, 0xFF, 0xFF, 0x07
    ),
    op!(
        PRE_FETCH_10,
        0x02,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0x1F,
        0xFF,
        0xFF,
        0x07
    ),
    op!(
        SYNC_CACHE_10,
        0x02,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0x1F,
        0xFF,
        0xFF,
        0x07
    ),
    op!(
        WRITE_SAME_10,
        0xE8,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0x1F,
        0xFF,
        0xFF,
        0x07
    ),
    op!(UNMAP, 0x01, 0, 0, 0, 0, 0x1F, 0xFF, 0xFF, 0x07),
    op!(MODE_SELECT_10, 0x11, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0x07),
    op!(RESERVE_10, 0, 0, 0, 0, 0, 0, 0, 0, 0x07),
    op!(RELEASE_10, 0, 0, 0, 0, 0, 0, 0, 0, 0x07),
    op!(MODE_SENSE_10, 0x18, 0xFF, 0xFF, 0, 0, 0, 0xFF, 0xFF, 0x07),
    op_sa!(PR_IN, 0x00, 0x1F, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0x07),
    op_sa!(PR_IN, 0x01, 0x1F, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0x07),
    op_sa!(PR_IN, 0x02, 0x1F, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0x07),
    op_sa!(PR_IN, 0x03, 0x1F, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0x07),
    op_sa!(PR_OUT, 0x00, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0x07),
    op_sa!(PR_OUT, 0x01, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0x07),
    op_sa!(PR_OUT, 0x02, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0x07),
    op_sa!(PR_OUT, 0x03, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0x07),
    op_sa!(PR_OUT, 0x04, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0x07),
    op_sa!(PR_OUT, 0x05, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0x07),
    op_sa!(PR_OUT, 0x06, 0x1F, 0xFF, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF, 0x07),
    op!(
        READ_16, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
        0x1F, 0x07
    ),
    op!(
        COMPARE_AND_WRITE,
        0xF8,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0,
        0,
        0,
        0xFF,
        0x1F,
        0x07
    ),
    op!(
        WRITE_16, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
        0x1F, 0x07
    ),
    op!(
        ORWRITE_16, 0xFA, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
        0x1F, 0x07
    ),
    op!(
        WRITE_VERIFY_16,
        0xF2,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0x1F,
        0x07
    ),
    op!(
        VERIFY_16, 0xF6, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
        0x1F, 0x07
    ),
    op!(
        PRE_FETCH_16,
        0x02,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0x1F,
        0x07
    ),
    op!(
        SYNC_CACHE_16,
        0x02,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0x1F,
        0x07
    ),
    op!(
        WRITE_SAME_16,
        0xE9,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0x1F,
        0x07
    ),
    op_sa!(
        SERVICE_ACTION_IN_16,
        SA_READ_CAPACITY_16,
        0x1F,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0,
        0x07
    ),
    op_sa!(
        SERVICE_ACTION_IN_16,
        SA_GET_LBA_STATUS,
        0x1F,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0,
        0x07
    ),
    op!(
        REPORT_LUNS,
        0,
        0xFF,
        0,
        0,
        0,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0,
        0x07
    ),
    op_sa!(
        MAINTENANCE_IN,
        SA_REPORT_TPGS,
        0xFF,
        0,
        0,
        0,
        0,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0,
        0x07
    ),
    op_sa!(
        MAINTENANCE_IN,
        SA_REPORT_OPCODES,
        0x1F,
        0x87,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0,
        0x07
    ),
    op_sa!(
        MAINTENANCE_IN,
        SA_REPORT_TMFS,
        0x1F,
        0x80,
        0,
        0,
        0,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0,
        0x07
    ),
    op!(
        READ_12, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x1F, 0x07
    ),
    op!(
        WRITE_12, 0xF8, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x1F, 0x07
    ),
    op!(
        WRITE_VERIFY_12,
        0xF2,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0xFF,
        0x1F,
        0x07
    ),
    op!(
        VERIFY_12, 0xF6, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x1F, 0x07
    ),
];

/// Whether an opcode has service actions (so REPORT SUPPORTED OPERATION CODES must be
/// asked with one).
pub fn has_service_actions(opcode: u8) -> bool {
    matches!(
        opcode,
        PR_IN | PR_OUT | SERVICE_ACTION_IN_16 | MAINTENANCE_IN
    )
}

fn is_supported(op: u8, c: &[u8]) -> bool {
    match op {
        SERVICE_ACTION_IN_16 => {
            matches!(service_action(c), SA_READ_CAPACITY_16 | SA_GET_LBA_STATUS)
        }
        MAINTENANCE_IN => matches!(
            service_action(c),
            SA_REPORT_TPGS | SA_REPORT_OPCODES | SA_REPORT_TMFS
        ),
        // PR IN/OUT service actions are checked by the PR code (INVALID FIELD IN CDB).
        _ => OPCODE_MAP[usize::from(op)],
    }
}

/// The table entry for an opcode (and service action, where it has them).
pub fn lookup(opcode: u8, sa: Option<u8>) -> Option<&'static OpInfo> {
    SUPPORTED
        .iter()
        .find(|i| i.opcode == opcode && (i.sa.is_none() || i.sa == sa))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g() -> Geometry {
        Geometry::with_max_io(1 << 20, 512, 64 << 10).unwrap()
    }

    #[test]
    fn usage_data_matches_cdb_length() {
        for i in SUPPORTED {
            assert_eq!(i.usage.len(), cdb_len(i.opcode), "opcode {:#x}", i.opcode);
            assert_eq!(i.usage[0], i.opcode);
        }
    }

    #[test]
    fn read6_zero_means_256() {
        assert_eq!(
            lba_blocks(&[READ_6, 0x01, 0x02, 0x03, 0, 0]),
            (0x10203, 256)
        );
        let big = Geometry::with_max_io(1 << 20, 512, 1 << 20).unwrap();
        assert_eq!(
            direction(&[READ_6, 0, 0, 0, 0, 0], &big),
            Ok(Direction::In(256 * 512))
        );
    }

    #[test]
    fn directions_of_the_data_moving_commands() {
        let mut w10 = [WRITE_10, 0, 0, 0, 0, 0, 0, 0, 8, 0];
        assert_eq!(direction(&w10, &g()), Ok(Direction::Out(4096)));
        w10[7] = 1; // 264 blocks > 64 KiB max
        assert_eq!(direction(&w10, &g()), Err(sense::INVALID_FIELD_IN_CDB));
        let mut caw = [0u8; 16];
        caw[0] = COMPARE_AND_WRITE;
        caw[13] = 1;
        assert_eq!(direction(&caw, &g()), Ok(Direction::Out(1024)));
        let mut ws = [0u8; 16];
        ws[0] = WRITE_SAME_16;
        ws[1] = 1;
        assert_eq!(direction(&ws, &g()), Ok(Direction::None));
        assert_eq!(direction(&[0xFF; 16], &g()), Err(sense::INVALID_OPCODE));
        let mut pr = [0u8; 10];
        pr[0] = PR_OUT;
        pr[5] = 0xFF;
        assert_eq!(direction(&pr, &g()), Err(sense::PARAM_LIST_LENGTH));
        assert_eq!(direction(&[], &g()), Err(sense::INVALID_OPCODE));
        assert_eq!(
            direction(&[READ_10, 0], &g()),
            Err(sense::INVALID_FIELD_IN_CDB)
        );
    }
}
