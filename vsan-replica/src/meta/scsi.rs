//! The SCSI state area: where a replica keeps the state the SCSI layer serves with it
//! (persistent reservations, issue 20), so that the state travels with the replica's
//! data and metadata (one file per replica).
//!
//! The area follows the bitmap ([`Layout::scsi_offset`]): two copies of
//! [`SCSI_COPY_LEN`] bytes each, written alternately like the superblock, so a torn
//! write leaves the previous state whole. A metadata area without it (one made before
//! it existed, [`Layout::total_len`] bytes long) holds no SCSI state; `vsan-node` grows
//! such a file when it opens it.
//!
//! # Record (one copy, integers little-endian)
//!
//! | offset | size | field                                       |
//! |--------|------|---------------------------------------------|
//! | 0      | 8    | magic `VSANSCSI`                            |
//! | 8      | 8    | seq (copy `seq % 2`)                        |
//! | 16     | 4    | length of the state in bytes                |
//! | 20     | 4    | reserved, 0                                 |
//! | 24     | len  | the state, as the SCSI layer encoded it     |
//! | ...    |      | zero                                        |
//! | [`SCSI_COPY_LEN`] − 4 | 4 | crc32 of everything before it   |
//!
//! A copy that is all zeroes is an empty slot (never written); one with a bad magic or
//! crc is damage, and the other copy is used (with a warning) when it is good.

use bytes::Bytes;
use tracing::warn;
use vsan_core::{BlockDevice, Error, ErrorKind, IoFlags, Result};

use super::{Layout, corrupt, le_u32, le_u64, put};

/// Bytes of one copy: room for the SCSI layer's largest state (256 registrations with
/// the longest iSCSI names) with a margin.
pub const SCSI_COPY_LEN: usize = 256 * 1024;

const MAGIC: &[u8; 8] = b"VSANSCSI";
const HEADER: usize = 24;

/// The largest state a copy holds.
pub const SCSI_STATE_MAX: usize = SCSI_COPY_LEN - HEADER - 4;

/// What the SCSI state area holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScsiArea {
    /// Seq of the newest valid copy (0 with none: the next write is seq 1).
    pub seq: u64,
    /// Its state; `None` when no copy was ever written.
    pub state: Option<Bytes>,
}

/// Encode copy `seq` holding `state` ([`SCSI_STATE_MAX`] bytes at most).
pub fn encode_scsi(seq: u64, state: &[u8]) -> Result<Bytes> {
    if state.len() > SCSI_STATE_MAX {
        return Err(Error::new(
            ErrorKind::NoSpace,
            format!(
                "the SCSI state is {} bytes, the metadata holds at most {SCSI_STATE_MAX}",
                state.len()
            ),
        ));
    }
    let mut b = vec![0u8; SCSI_COPY_LEN];
    b[..8].copy_from_slice(MAGIC);
    put(&mut b, 8, &seq.to_le_bytes());
    put(&mut b, 16, &(state.len() as u32).to_le_bytes());
    b[HEADER..HEADER + state.len()].copy_from_slice(state);
    let crc = crc32fast::hash(&b[..SCSI_COPY_LEN - 4]);
    put(&mut b, SCSI_COPY_LEN - 4, &crc.to_le_bytes());
    Ok(Bytes::from(b))
}

/// Decode one copy: `Ok(None)` for an empty slot, `Ok(Some((seq, state)))`, or `Err` for
/// damage. Total: any bytes give one of the three.
pub fn decode_scsi(b: &[u8]) -> Result<Option<(u64, Bytes)>> {
    if b.len() != SCSI_COPY_LEN {
        return Err(corrupt(format!(
            "SCSI state copy of {} bytes, not {SCSI_COPY_LEN}",
            b.len()
        )));
    }
    if b.iter().all(|&x| x == 0) {
        return Ok(None);
    }
    if &b[..8] != MAGIC {
        return Err(corrupt("SCSI state copy: bad magic"));
    }
    let crc = le_u32(b, SCSI_COPY_LEN - 4);
    if crc32fast::hash(&b[..SCSI_COPY_LEN - 4]) != crc {
        return Err(corrupt("SCSI state copy: bad crc"));
    }
    let seq = le_u64(b, 8);
    let len = le_u32(b, 16) as usize;
    if len > SCSI_STATE_MAX || le_u32(b, 20) != 0 {
        return Err(corrupt("SCSI state copy: bad length"));
    }
    Ok(Some((
        seq,
        Bytes::copy_from_slice(&b[HEADER..HEADER + len]),
    )))
}

/// Whether `dev` (a metadata area laid out as `layout`) has the SCSI state area.
pub fn has_scsi_area(dev: &dyn BlockDevice, layout: &Layout) -> bool {
    dev.geometry().size() >= layout.total_len_with_scsi()
}

/// Read the SCSI state area of `dev`: the newest valid copy. A metadata area without
/// one reads as empty. Both copies damaged is [`ErrorKind::Corrupt`].
pub async fn read_scsi_area(dev: &dyn BlockDevice, layout: &Layout) -> Result<ScsiArea> {
    if !has_scsi_area(dev, layout) {
        return Ok(ScsiArea::default());
    }
    let mut found: Vec<Result<Option<(u64, Bytes)>>> = Vec::with_capacity(2);
    for slot in 0..2u64 {
        let bytes = dev.read(layout.scsi_offset(slot), SCSI_COPY_LEN).await?;
        found.push(decode_scsi(&bytes).and_then(|c| match c {
            Some((seq, _)) if seq % 2 != slot => Err(corrupt(format!(
                "SCSI state copy {slot} holds seq {seq}, which belongs in the other copy"
            ))),
            c => Ok(c),
        }));
    }
    let bad = found.iter().filter(|c| c.is_err()).count();
    let newest = found
        .iter()
        .filter_map(|c| c.as_ref().ok().and_then(|c| c.clone()))
        .max_by_key(|(seq, _)| *seq);
    match (newest, bad) {
        (_, 2) => Err(Error::new(
            ErrorKind::Corrupt,
            "both copies of the SCSI state in the metadata are damaged",
        )),
        (Some((seq, state)), bad) => {
            if bad == 1 {
                warn!(
                    "one copy of the SCSI state in the metadata is damaged; using the other (seq {seq})"
                );
            }
            Ok(ScsiArea {
                seq,
                state: Some(state),
            })
        }
        (None, 1) => Err(Error::new(
            ErrorKind::Corrupt,
            "the only written copy of the SCSI state in the metadata is damaged",
        )),
        (None, _) => Ok(ScsiArea::default()),
    }
}

/// Write `state` as the next copy after `area` and make it durable (FUA); `area` then
/// describes it. On error `area` is unchanged and the previous copy still holds.
pub async fn write_scsi_area(
    dev: &dyn BlockDevice,
    layout: &Layout,
    area: &mut ScsiArea,
    state: Bytes,
) -> Result<()> {
    if !has_scsi_area(dev, layout) {
        return Err(Error::new(
            ErrorKind::NoSpace,
            format!(
                "the metadata area is {} bytes: it has no room for the SCSI state ({} bytes needed)",
                dev.geometry().size(),
                layout.total_len_with_scsi()
            ),
        ));
    }
    let seq = area.seq + 1;
    let copy = encode_scsi(seq, &state)?;
    dev.write(layout.scsi_offset(seq), copy, IoFlags::FUA)
        .await?;
    area.seq = seq;
    area.state = Some(state);
    Ok(())
}
