//! INQUIRY: standard data and the vital product data pages (SPC-4 6.6, 7.8; SBC-3 6.5).

use super::cdb::u8_at;
use super::sense::{self, Sense};
use super::{LuIdentity, TargetPort};
use crate::device::Geometry;

/// The IEEE company id in our NAA designators. A placeholder: vsan has no OUI of its
/// own; the designator only has to be the same for the same disk on every node.
pub const NAA_OUI: u32 = 0x00_1F_AA;

/// The largest COMPARE AND WRITE, in blocks.
pub const MAX_CAW_BLOCKS: u32 = 255;
/// The largest UNMAP block descriptor count.
pub const MAX_UNMAP_DESCRIPTORS: u32 = 256;
/// The largest UNMAP / WRITE SAME range, in blocks.
pub const MAX_UNMAP_BLOCKS: u32 = 1 << 20;
/// The largest WRITE SAME, in blocks.
pub const MAX_WRITE_SAME_BLOCKS: u32 = 1 << 20;

/// Everything INQUIRY reports.
pub struct InquiryInput<'a> {
    /// LU identity.
    pub identity: &'a LuIdentity,
    /// This node's port.
    pub port: &'a TargetPort,
    /// The device's shape.
    pub geometry: Geometry,
}

fn pad(out: &mut Vec<u8>, s: &str, n: usize) {
    let b = s.as_bytes();
    for i in 0..n {
        let c = b.get(i).copied().unwrap_or(b' ');
        out.push(if (0x20..0x7F).contains(&c) { c } else { b' ' });
    }
}

/// The INQUIRY data for a CDB (standard or a VPD page).
pub fn inquiry(cdb: &[u8], input: &InquiryInput<'_>) -> Result<Vec<u8>, Sense> {
    let evpd = u8_at(cdb, 1) & 0x01 != 0;
    let page = u8_at(cdb, 2);
    if u8_at(cdb, 1) & 0x02 != 0 {
        return Err(sense::INVALID_FIELD_IN_CDB);
    }
    if !evpd {
        if page != 0 {
            return Err(sense::INVALID_FIELD_IN_CDB);
        }
        return Ok(standard(input));
    }
    let mut out = vec![0x00, page, 0, 0];
    match page {
        0x00 => out.extend_from_slice(&[0x00, 0x80, 0x83, 0xB0, 0xB1, 0xB2]),
        0x80 => pad(
            &mut out,
            &input.identity.serial,
            input.identity.serial.len().clamp(1, 250),
        ),
        0x83 => device_identification(&mut out, input),
        0xB0 => block_limits(&mut out, input.geometry),
        0xB1 => {
            let mut p = [0u8; 60];
            p[1] = 0x01; // MEDIUM ROTATION RATE: non-rotating
            out.extend_from_slice(&p);
        }
        0xB2 => {
            // THRESHOLD EXPONENT, LBPU|LBPWS|LBPWS10|LBPRZ, provisioning type thin.
            out.extend_from_slice(&[0x00, 0x80 | 0x40 | 0x20 | 0x04, 0x02, 0x00]);
        }
        _ => return Err(sense::INVALID_FIELD_IN_CDB),
    }
    let len = (out.len() - 4) as u16;
    out[2..4].copy_from_slice(&len.to_be_bytes());
    Ok(out)
}

fn standard(input: &InquiryInput<'_>) -> Vec<u8> {
    let mut out = Vec::with_capacity(96);
    out.extend_from_slice(&[
        0x00, // connected, direct access block device
        0x00, // not removable
        0x06, // SPC-4
        0x12, // HISUP, response data format 2
        91,   // additional length
        0x10, // TPGS = 01b: implicit ALUA
        0x00, 0x02, // CMDQUE
    ]);
    pad(&mut out, &input.identity.vendor, 8);
    pad(&mut out, &input.identity.product, 16);
    pad(&mut out, &input.identity.revision, 4);
    out.resize(58, 0);
    // Version descriptors: SAM-5, iSCSI, SPC-4, SBC-3.
    for v in [0x00A0u16, 0x0960, 0x0460, 0x04C0] {
        out.extend_from_slice(&v.to_be_bytes());
    }
    out.resize(96, 0);
    out
}

/// The NAA IEEE Registered Extended designator (16 bytes) of an identity.
pub fn naa_designator(id: &[u8; 16]) -> [u8; 16] {
    let mut d = [0u8; 16];
    // NAA 6 | OUI (24 bits) | 100 bits of the identity.
    d[0] = 0x60 | ((NAA_OUI >> 20) & 0x0F) as u8;
    d[1] = (NAA_OUI >> 12) as u8;
    d[2] = (NAA_OUI >> 4) as u8;
    d[3] = (((NAA_OUI & 0x0F) as u8) << 4) | (id[0] & 0x0F);
    d[4..16].copy_from_slice(&id[1..13]);
    d
}

fn designator(out: &mut Vec<u8>, proto_code: u8, piv_assoc_type: u8, value: &[u8]) {
    out.push(proto_code);
    out.push(piv_assoc_type);
    out.push(0);
    out.push(value.len().min(255) as u8);
    out.extend_from_slice(&value[..value.len().min(255)]);
}

fn name_string(s: &str) -> Vec<u8> {
    let mut v: Vec<u8> = s.as_bytes().iter().copied().take(251).collect();
    v.push(0);
    while v.len() % 4 != 0 {
        v.push(0);
    }
    v
}

fn device_identification(out: &mut Vec<u8>, input: &InquiryInput<'_>) {
    let id = &input.identity.id;
    // NAA, binary, LU association.
    designator(out, 0x01, 0x03, &naa_designator(id));
    // T10 vendor id: vendor (8) + hex of the identity.
    let mut t10 = Vec::with_capacity(40);
    pad(&mut t10, &input.identity.vendor, 8);
    for b in id {
        t10.extend_from_slice(format!("{b:02x}").as_bytes());
    }
    designator(out, 0x02, 0x01, &t10);
    // iSCSI (protocol 5), UTF-8, PIV, target port association, SCSI name string.
    designator(
        out,
        0x53,
        0x80 | 0x10 | 0x08,
        &name_string(&input.port.name),
    );
    // The target device name: the port name without its ",t,0x..." part.
    if let Some((device, _)) = input.port.name.split_once(",t,") {
        designator(out, 0x53, 0x80 | 0x20 | 0x08, &name_string(device));
    }
    let rtp = input.port.relative_id.to_be_bytes();
    designator(out, 0x51, 0x80 | 0x10 | 0x04, &[0, 0, rtp[0], rtp[1]]);
    let tpg = input.port.group.to_be_bytes();
    designator(out, 0x51, 0x80 | 0x10 | 0x05, &[0, 0, tpg[0], tpg[1]]);
}

fn block_limits(out: &mut Vec<u8>, g: Geometry) {
    let bs = g.block_size();
    let max_blocks = g.max_io() / bs;
    let caw = MAX_CAW_BLOCKS.min(max_blocks / 2).max(1);
    let mut p = [0u8; 60];
    p[0] = 0x01; // WSNZ: WRITE SAME with 0 blocks is refused
    p[1] = caw as u8;
    let optimal_gran = (4096 / bs).max(1) as u16;
    p[2..4].copy_from_slice(&optimal_gran.to_be_bytes());
    p[4..8].copy_from_slice(&max_blocks.to_be_bytes());
    p[8..12].copy_from_slice(&max_blocks.min((1 << 20) / bs).max(1).to_be_bytes());
    p[16..20].copy_from_slice(&MAX_UNMAP_BLOCKS.to_be_bytes());
    p[20..24].copy_from_slice(&MAX_UNMAP_DESCRIPTORS.to_be_bytes());
    p[24..28].copy_from_slice(&1u32.to_be_bytes()); // optimal unmap granularity
    p[28..32].copy_from_slice(&0x8000_0000u32.to_be_bytes()); // UGAVALID, alignment 0
    p[32..40].copy_from_slice(&u64::from(MAX_WRITE_SAME_BLOCKS).to_be_bytes());
    out.extend_from_slice(&p);
}

/// The largest COMPARE AND WRITE this geometry allows, in blocks.
pub fn max_caw_blocks(g: Geometry) -> u32 {
    MAX_CAW_BLOCKS.min(g.max_io() / g.block_size() / 2).max(1)
}
