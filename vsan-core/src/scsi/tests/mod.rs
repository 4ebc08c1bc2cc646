//! Tests of the SCSI layer over a `MemDevice`: each command's good path and error cases,
//! sense formats, the PR state machine and its persistence, COMPARE AND WRITE atomicity,
//! and a total-decoder check.

use std::sync::Arc;

use bytes::Bytes;

use super::cdb::*;
use super::*;
use crate::device::{Geometry, MemDevice};

const BS: u32 = 512;
const BLOCKS: u64 = 2048;

fn config(state_file: Option<PathBuf>) -> LuConfig {
    LuConfig {
        identity: LuIdentity::from_disk_id("disk0"),
        port: TargetPort {
            name: "iqn.2026-12.io.vsan:disk0,t,0x0001".into(),
            relative_id: 1,
            group: 1,
        },
        read_only: false,
        state_file,
    }
}

fn device() -> Arc<MemDevice> {
    Arc::new(MemDevice::new(
        Geometry::with_max_io(BLOCKS * u64::from(BS), BS, 64 << 10).unwrap(),
    ))
}

fn lu() -> Arc<LogicalUnit> {
    LogicalUnit::new(device(), config(None)).unwrap()
}

fn nexus(name: &str) -> Nexus {
    let port = format!("iqn.2026-12.test:{name},i,0x000000000001");
    let mut tid = vec![0x45, 0, 0, 0];
    tid.extend_from_slice(port.as_bytes());
    tid.push(0);
    while tid.len() % 4 != 0 {
        tid.push(0);
    }
    let add = (tid.len() - 4) as u16;
    tid[2..4].copy_from_slice(&add.to_be_bytes());
    Nexus {
        initiator_port: port,
        transport_id: Bytes::from(tid),
        relative_target_port: 1,
    }
}

async fn run(lu: &LogicalUnit, h: &NexusHandle, cdb: &[u8], data: &[u8]) -> Response {
    lu.execute(
        h,
        Command {
            cdb: Bytes::copy_from_slice(cdb),
            data_out: Bytes::copy_from_slice(data),
            expected_in: 1 << 20,
        },
    )
    .await
}

/// Attach and consume the power-on unit attention.
async fn attach(lu: &Arc<LogicalUnit>, name: &str) -> NexusHandle {
    let h = lu.attach(nexus(name));
    let r = run(lu, &h, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(sense_of(&r), (6, 0x29, 0x00));
    good(&run(lu, &h, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await);
    h
}

/// (key, asc, ascq) of a CHECK CONDITION, either format.
fn sense_of(r: &Response) -> (u8, u8, u8) {
    assert_eq!(r.status, Status::CheckCondition, "{r:?}");
    let s = &r.sense;
    match s[0] & 0x7F {
        0x70 => (s[2] & 0x0F, s[12], s[13]),
        0x72 => (s[1], s[2], s[3]),
        f => panic!("sense format {f:#x}"),
    }
}

fn good(r: &Response) {
    assert_eq!(r.status, Status::Good, "{r:?}");
}

fn rw10(op: u8, lba: u32, blocks: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = op;
    c[2..6].copy_from_slice(&lba.to_be_bytes());
    c[7..9].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn rw16(op: u8, lba: u64, blocks: u32) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = op;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[10..14].copy_from_slice(&blocks.to_be_bytes());
    c
}

fn caw(lba: u64, blocks: u8) -> [u8; 16] {
    let mut c = [0u8; 16];
    c[0] = COMPARE_AND_WRITE;
    c[2..10].copy_from_slice(&lba.to_be_bytes());
    c[13] = blocks;
    c
}

fn pattern(blocks: usize, v: u8) -> Vec<u8> {
    vec![v; blocks * BS as usize]
}

#[tokio::test]
async fn first_command_gets_power_on_ua_but_inquiry_does_not() {
    let lu = lu();
    let h = lu.attach(nexus("a"));
    good(&run(&lu, &h, &[INQUIRY, 0, 0, 0, 96, 0], &[]).await);
    good(
        &run(
            &lu,
            &h,
            &[REPORT_LUNS, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
            &[],
        )
        .await,
    );
    let r = run(&lu, &h, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(sense_of(&r), (6, 0x29, 0));
    good(&run(&lu, &h, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await);
}

#[tokio::test]
async fn request_sense_reports_and_clears_the_ua() {
    let lu = lu();
    let h = lu.attach(nexus("a"));
    let r = run(&lu, &h, &[REQUEST_SENSE, 0, 0, 0, 18, 0], &[]).await;
    good(&r);
    assert_eq!((r.data[2], r.data[12], r.data[13]), (6, 0x29, 0));
    let r = run(&lu, &h, &[REQUEST_SENSE, 0, 0, 0, 18, 0], &[]).await;
    assert_eq!((r.data[2], r.data[12]), (0, 0));
    good(&run(&lu, &h, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await);
}

#[tokio::test]
async fn unknown_opcode_is_invalid_command_operation_code() {
    let lu = lu();
    let r = lu.inspect(&[0xC7, 0, 0, 0, 0, 0]).unwrap_err();
    assert_eq!(sense_of(&r), (5, 0x20, 0));
    let h = attach(&lu, "a").await;
    let r = run(&lu, &h, &[0x02, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(sense_of(&r), (5, 0x20, 0));
    // An unknown service action of SERVICE ACTION IN is a bad field.
    let r = lu.inspect(&rw16(SERVICE_ACTION_IN_16, 0, 0)).unwrap_err();
    assert_eq!(sense_of(&r), (5, 0x24, 0));
}

#[tokio::test]
async fn write_then_read_all_sizes() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    let data = pattern(4, 0xA5);
    good(&run(&lu, &h, &rw10(WRITE_10, 8, 4), &data).await);
    let r = run(&lu, &h, &rw10(READ_10, 8, 4), &[]).await;
    good(&r);
    assert_eq!(&r.data[..], &data[..]);
    let r = run(&lu, &h, &rw16(READ_16, 8, 4), &[]).await;
    assert_eq!(&r.data[..], &data[..]);
    let mut r12 = [0u8; 12];
    r12[0] = READ_12;
    r12[5] = 8;
    r12[9] = 4;
    assert_eq!(&run(&lu, &h, &r12, &[]).await.data[..], &data[..]);
    let r = run(&lu, &h, &[READ_6, 0, 0, 8, 4, 0], &[]).await;
    assert_eq!(&r.data[..], &data[..]);
    // WRITE(6)/READ(6); a 0 count means 256 blocks, more than this device's 64 KiB.
    let big = pattern(100, 0x11);
    good(&run(&lu, &h, &[WRITE_6, 0, 1, 0, 100, 0], &big).await);
    let r = run(&lu, &h, &[READ_6, 0, 1, 0, 100, 0], &[]).await;
    assert_eq!(&r.data[..], &big[..]);
    let r = lu.inspect(&[READ_6, 0, 1, 0, 0, 0]).unwrap_err();
    assert_eq!(sense_of(&r), (5, 0x24, 0));
}

#[tokio::test]
async fn zero_blocks_is_a_no_op_and_beyond_end_is_lba_out_of_range() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    good(&run(&lu, &h, &rw10(READ_10, BLOCKS as u32, 0), &[]).await);
    good(&run(&lu, &h, &rw10(WRITE_10, 0, 0), &[]).await);
    let r = run(&lu, &h, &rw10(READ_10, BLOCKS as u32 + 1, 0), &[]).await;
    assert_eq!(sense_of(&r), (5, 0x21, 0));
    let r = run(&lu, &h, &rw10(READ_10, BLOCKS as u32 - 1, 2), &[]).await;
    assert_eq!(sense_of(&r), (5, 0x21, 0));
    let r = run(&lu, &h, &rw16(WRITE_16, u64::MAX, 1), &pattern(1, 1)).await;
    assert_eq!(sense_of(&r), (5, 0x21, 0));
    // Nothing of a write that reaches past the end is applied.
    let r = run(
        &lu,
        &h,
        &rw10(WRITE_10, BLOCKS as u32 - 1, 2),
        &pattern(2, 9),
    )
    .await;
    assert_eq!(sense_of(&r), (5, 0x21, 0));
    let r = run(&lu, &h, &rw10(READ_10, BLOCKS as u32 - 1, 1), &[]).await;
    assert!(r.data.iter().all(|&b| b == 0));
}

#[tokio::test]
async fn protect_fields_and_oversize_are_invalid_field() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    let mut c = rw10(READ_10, 0, 1);
    c[1] = 0x20;
    assert_eq!(sense_of(&run(&lu, &h, &c, &[]).await), (5, 0x24, 0));
    let mut c = rw10(WRITE_10, 0, 1);
    c[1] = 0x40;
    assert_eq!(
        sense_of(&run(&lu, &h, &c, &pattern(1, 1)).await),
        (5, 0x24, 0)
    );
    // DPO and FUA are accepted.
    let mut c = rw10(WRITE_10, 0, 1);
    c[1] = 0x18;
    good(&run(&lu, &h, &c, &pattern(1, 1)).await);
    // More than max_io (64 KiB = 128 blocks).
    let r = lu.inspect(&rw10(READ_10, 0, 129)).unwrap_err();
    assert_eq!(sense_of(&r), (5, 0x24, 0));
}

#[tokio::test]
async fn short_data_out_is_refused_without_a_partial_write() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    let r = run(&lu, &h, &rw10(WRITE_10, 0, 4), &pattern(2, 7)).await;
    assert_eq!(sense_of(&r), (5, 0x24, 0));
    let r = run(&lu, &h, &rw10(READ_10, 0, 4), &[]).await;
    assert!(r.data.iter().all(|&b| b == 0));
}

#[tokio::test]
async fn read_only_refuses_every_medium_change() {
    let mut cfg = config(None);
    cfg.read_only = true;
    let lu = LogicalUnit::new(device(), cfg).unwrap();
    let h = attach(&lu, "a").await;
    let wp = (7, 0x27, 0);
    assert_eq!(
        sense_of(&run(&lu, &h, &rw10(WRITE_10, 0, 1), &pattern(1, 1)).await),
        wp
    );
    assert_eq!(
        sense_of(&run(&lu, &h, &rw16(WRITE_SAME_16, 0, 1), &pattern(1, 1)).await),
        wp
    );
    assert_eq!(
        sense_of(&run(&lu, &h, &caw(0, 1), &pattern(2, 0)).await),
        wp
    );
    let mut unmap = [0u8; 10];
    unmap[0] = UNMAP;
    unmap[8] = 24;
    assert_eq!(
        sense_of(&run(&lu, &h, &unmap, &unmap_list(&[(0, 1)])).await),
        wp
    );
    good(&run(&lu, &h, &rw10(READ_10, 0, 1), &[]).await);
    // MODE SENSE reports WP.
    let r = run(&lu, &h, &[MODE_SENSE_6, 0, 0x3F, 0, 255, 0], &[]).await;
    assert_eq!(r.data[2] & 0x80, 0x80);
}

#[tokio::test]
async fn inquiry_standard_and_vpd_pages() {
    let lu = lu();
    let h = lu.attach(nexus("a"));
    let r = run(&lu, &h, &[INQUIRY, 0, 0, 0, 255, 0], &[]).await;
    good(&r);
    let d = &r.data;
    assert_eq!(d.len(), 96);
    assert_eq!((d[0], d[2], d[3] & 0x1F, d[4]), (0, 6, 0x12, 91));
    assert_eq!(d[5] & 0x30, 0x10, "implicit ALUA");
    assert_eq!(d[7] & 0x02, 0x02, "CMDQUE");
    assert_eq!(&d[8..12], b"VSAN");
    // Allocation length truncation.
    let r = run(&lu, &h, &[INQUIRY, 0, 0, 0, 36, 0], &[]).await;
    assert_eq!(r.data.len(), 36);
    // Page code without EVPD.
    assert_eq!(
        sense_of(&run(&lu, &h, &[INQUIRY, 0, 0x80, 0, 255, 0], &[]).await),
        (5, 0x24, 0)
    );
    let r = run(&lu, &h, &[INQUIRY, 1, 0, 0, 255, 0], &[]).await;
    assert_eq!(&r.data[4..], &[0x00, 0x80, 0x83, 0xB0, 0xB1, 0xB2]);
    for page in [0x80u8, 0x83, 0xB0, 0xB1, 0xB2] {
        let r = run(&lu, &h, &[INQUIRY, 1, page, 0x10, 0, 0], &[]).await;
        good(&r);
        assert_eq!(r.data[1], page);
        assert_eq!(usize::from(be16(&r.data, 2)) + 4, r.data.len());
    }
    assert_eq!(
        sense_of(&run(&lu, &h, &[INQUIRY, 1, 0x99, 0, 255, 0], &[]).await),
        (5, 0x24, 0)
    );
    let r = run(&lu, &h, &[INQUIRY, 1, 0x80, 0, 255, 0], &[]).await;
    assert_eq!(&r.data[4..], lu.identity().serial.as_bytes());
    let r = run(&lu, &h, &[INQUIRY, 1, 0xB0, 0, 255, 0], &[]).await;
    assert_eq!(r.data.len(), 64);
    assert_eq!(be32(&r.data, 8), 128, "max transfer");
    assert_eq!(r.data[5], 64, "max CAW: half the max transfer");
    let r = run(&lu, &h, &[INQUIRY, 1, 0xB2, 0, 255, 0], &[]).await;
    assert_eq!(r.data[5] & 0xE4, 0xE4);
}

#[tokio::test]
async fn device_identification_is_the_same_for_the_same_disk() {
    let a = lu();
    let b = LogicalUnit::new(device(), config(None)).unwrap();
    let ha = a.attach(nexus("a"));
    let hb = b.attach(nexus("b"));
    let ra = run(&a, &ha, &[INQUIRY, 1, 0x83, 0, 255, 0], &[]).await;
    let rb = run(&b, &hb, &[INQUIRY, 1, 0x83, 0, 255, 0], &[]).await;
    assert_eq!(ra.data, rb.data);
    // First designator: NAA 6, LU association, 16 bytes.
    assert_eq!(&ra.data[4..8], &[0x01, 0x03, 0, 16]);
    assert_eq!(ra.data[8] >> 4, 6);
    assert_ne!(
        LuIdentity::from_disk_id("x").id,
        LuIdentity::from_disk_id("y").id
    );
}

#[tokio::test]
async fn read_capacity_10_and_16() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    let r = run(&lu, &h, &[READ_CAPACITY_10, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(be32(&r.data, 0), BLOCKS as u32 - 1);
    assert_eq!(be32(&r.data, 4), BS);
    let r = run(&lu, &h, &[READ_CAPACITY_10, 0, 0, 0, 0, 1, 0, 0, 0, 0], &[]).await;
    assert_eq!(sense_of(&r), (5, 0x24, 0));
    let mut c = [0u8; 16];
    c[0] = SERVICE_ACTION_IN_16;
    c[1] = SA_READ_CAPACITY_16;
    c[13] = 32;
    let r = run(&lu, &h, &c, &[]).await;
    assert_eq!(r.data.len(), 32);
    assert_eq!(be64(&r.data, 0), BLOCKS - 1);
    assert_eq!(r.data[14] & 0xC0, 0xC0, "LBPME and LBPRZ");
    c[13] = 8;
    assert_eq!(run(&lu, &h, &c, &[]).await.data.len(), 8);
}

#[tokio::test]
async fn verify_compares_and_reports_the_offset() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    good(&run(&lu, &h, &rw10(WRITE_10, 0, 2), &pattern(2, 3)).await);
    good(&run(&lu, &h, &rw10(VERIFY_10, 0, 2), &[]).await);
    let mut c = rw10(VERIFY_10, 0, 2);
    c[1] = 0x02; // BYTCHK=1
    good(&run(&lu, &h, &c, &pattern(2, 3)).await);
    let mut other = pattern(2, 3);
    other[700] = 4;
    let r = run(&lu, &h, &c, &other).await;
    assert_eq!(sense_of(&r), (0x0E, 0x1D, 0));
    assert_eq!(r.sense[0], 0xF0, "VALID");
    assert_eq!(be32(&r.sense, 3), 700);
    let mut c = rw10(VERIFY_10, 0, 1);
    c[1] = 0x20; // VRPROTECT
    assert_eq!(sense_of(&run(&lu, &h, &c, &[]).await), (5, 0x24, 0));
    assert_eq!(
        sense_of(&run(&lu, &h, &rw10(VERIFY_10, BLOCKS as u32, 1), &[]).await),
        (5, 0x21, 0)
    );
}

fn unmap_list(d: &[(u64, u32)]) -> Vec<u8> {
    let mut v = vec![0u8; 8];
    let bdl = (d.len() * 16) as u16;
    v[0..2].copy_from_slice(&(bdl + 6).to_be_bytes());
    v[2..4].copy_from_slice(&bdl.to_be_bytes());
    for (lba, n) in d {
        v.extend_from_slice(&lba.to_be_bytes());
        v.extend_from_slice(&n.to_be_bytes());
        v.extend_from_slice(&[0; 4]);
    }
    v
}

fn unmap_cdb(len: u16) -> [u8; 10] {
    let mut c = [0u8; 10];
    c[0] = UNMAP;
    c[7..9].copy_from_slice(&len.to_be_bytes());
    c
}

#[tokio::test]
async fn unmap_deallocates_and_never_applies_a_bad_list_partly() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    good(&run(&lu, &h, &rw10(WRITE_10, 0, 8), &pattern(8, 0xEE)).await);
    let list = unmap_list(&[(0, 2), (BLOCKS, 1)]);
    let r = run(&lu, &h, &unmap_cdb(list.len() as u16), &list).await;
    assert_eq!(sense_of(&r), (5, 0x21, 0));
    let r = run(&lu, &h, &rw10(READ_10, 0, 8), &[]).await;
    assert!(r.data.iter().all(|&b| b == 0xEE), "nothing unmapped");
    let list = unmap_list(&[(0, 2), (4, 1)]);
    good(&run(&lu, &h, &unmap_cdb(list.len() as u16), &list).await);
    let r = run(&lu, &h, &rw10(READ_10, 0, 8), &[]).await;
    let blk = |i: usize| &r.data[i * 512..(i + 1) * 512];
    assert!(blk(0).iter().chain(blk(1)).chain(blk(4)).all(|&b| b == 0));
    assert!(
        blk(2)
            .iter()
            .chain(blk(3))
            .chain(blk(5))
            .all(|&b| b == 0xEE)
    );
    // Zero length and zero-block descriptors are no-ops.
    good(&run(&lu, &h, &unmap_cdb(0), &[]).await);
    let list = unmap_list(&[(0, 0)]);
    good(&run(&lu, &h, &unmap_cdb(list.len() as u16), &list).await);
    // Short parameter list.
    assert_eq!(
        sense_of(&run(&lu, &h, &unmap_cdb(4), &[0; 4]).await),
        (5, 0x1A, 0)
    );
}

#[tokio::test]
async fn write_same_patterns_zeroes_and_unmap() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    let mut blk = pattern(1, 0);
    blk[0] = 0xAB;
    blk[511] = 0xCD;
    good(&run(&lu, &h, &rw16(WRITE_SAME_16, 10, 300), &blk).await);
    let r = run(&lu, &h, &rw16(READ_16, 10, 120), &[]).await;
    for c in r.data.chunks(512) {
        assert_eq!(c, &blk[..]);
    }
    let r = run(&lu, &h, &rw16(READ_16, 309, 2), &[]).await;
    assert_eq!(&r.data[..512], &blk[..]);
    assert!(r.data[512..].iter().all(|&b| b == 0));
    // Zero pattern with UNMAP deallocates.
    let mut c = rw10(WRITE_SAME_10, 10, 5);
    c[1] = 0x08;
    good(&run(&lu, &h, &c, &pattern(1, 0)).await);
    let r = run(&lu, &h, &rw16(READ_16, 10, 5), &[]).await;
    assert!(r.data.iter().all(|&b| b == 0));
    // UNMAP deallocates even when the pattern is not zeros.
    good(&run(&lu, &h, &rw10(WRITE_10, 30, 2), &pattern(2, 0xFF)).await);
    let mut c = rw10(WRITE_SAME_10, 30, 2);
    c[1] = 0x08;
    good(&run(&lu, &h, &c, &pattern(1, 0xFF)).await);
    let r = run(&lu, &h, &rw10(READ_10, 30, 2), &[]).await;
    assert!(r.data.iter().all(|&b| b == 0));
    // NDOB: no data.
    let mut c = rw16(WRITE_SAME_16, 20, 3);
    c[1] = 0x09;
    assert_eq!(lu.inspect(&c).unwrap(), Direction::None);
    good(&run(&lu, &h, &c, &[]).await);
    // ANCHOR, 0 blocks (WSNZ), beyond the end.
    let mut c = rw10(WRITE_SAME_10, 0, 1);
    c[1] = 0x10;
    assert_eq!(sense_of(&run(&lu, &h, &c, &blk).await), (5, 0x24, 0));
    assert_eq!(
        sense_of(&run(&lu, &h, &rw10(WRITE_SAME_10, 0, 0), &blk).await),
        (5, 0x24, 0)
    );
    let r = run(&lu, &h, &rw10(WRITE_SAME_10, BLOCKS as u32 - 1, 2), &blk).await;
    assert_eq!(sense_of(&r), (5, 0x21, 0));
}

#[tokio::test]
async fn compare_and_write_good_and_miscompare() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    let mut d = pattern(1, 0);
    d.extend(pattern(1, 0x77));
    good(&run(&lu, &h, &caw(5, 1), &d).await);
    let r = run(&lu, &h, &rw10(READ_10, 5, 1), &[]).await;
    assert!(r.data.iter().all(|&b| b == 0x77));
    // Now expecting zeros miscompares at offset 0, and nothing is written.
    let mut d2 = pattern(1, 0x77);
    d2[100] = 0;
    d2.extend(pattern(1, 0x99));
    let r = run(&lu, &h, &caw(5, 1), &d2).await;
    assert_eq!(sense_of(&r), (0x0E, 0x1D, 0));
    assert_eq!(be32(&r.sense, 3), 100);
    let r = run(&lu, &h, &rw10(READ_10, 5, 1), &[]).await;
    assert!(r.data.iter().all(|&b| b == 0x77));
    // Beyond the end; too many blocks; wrong data-out size.
    assert_eq!(
        sense_of(&run(&lu, &h, &caw(BLOCKS, 1), &pattern(2, 0)).await),
        (5, 0x21, 0)
    );
    assert_eq!(
        sense_of(&run(&lu, &h, &caw(0, 65), &pattern(130, 0)).await),
        (5, 0x24, 0)
    );
    assert_eq!(
        sense_of(&run(&lu, &h, &caw(0, 1), &pattern(1, 0)).await),
        (5, 0x24, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_one_of_two_same_expectation_caws_wins() {
    for round in 0..50u8 {
        let lu = lu();
        let a = Arc::new(attach(&lu, "a").await);
        let b = Arc::new(attach(&lu, "b").await);
        let mut da = pattern(2, 0);
        da.extend(pattern(2, 1 + round % 100));
        let mut db = pattern(2, 0);
        db.extend(pattern(2, 200));
        let (l1, l2) = (lu.clone(), lu.clone());
        let (a2, b2) = (a.clone(), b.clone());
        let t1 = tokio::spawn(async move { run(&l1, &a2, &caw(64, 2), &da).await });
        let t2 = tokio::spawn(async move { run(&l2, &b2, &caw(64, 2), &db).await });
        let (r1, r2) = (t1.await.unwrap(), t2.await.unwrap());
        let wins = [&r1, &r2]
            .iter()
            .filter(|r| r.status == Status::Good)
            .count();
        assert_eq!(wins, 1, "{r1:?} {r2:?}");
        for r in [&r1, &r2] {
            if r.status != Status::Good {
                assert_eq!(sense_of(r), (0x0E, 0x1D, 0));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn caw_counter_increments_are_never_lost_against_writes() {
    // Many tasks increment a counter block with CAW while others write a neighbour
    // region that shares the stripe: the final count equals the number of successes.
    let lu = lu();
    let h = Arc::new(attach(&lu, "a").await);
    let mut tasks = Vec::new();
    for t in 0..4u8 {
        let (lu, h) = (lu.clone(), h.clone());
        tasks.push(tokio::spawn(async move {
            let mut wins = 0u32;
            for _ in 0..40 {
                let cur = run(&lu, &h, &rw10(READ_10, 0, 1), &[]).await.data;
                let n = u32::from_be_bytes([cur[0], cur[1], cur[2], cur[3]]);
                let mut d = cur.to_vec();
                let mut new = cur.to_vec();
                new[..4].copy_from_slice(&(n + 1).to_be_bytes());
                d.extend(new);
                if run(&lu, &h, &caw(0, 1), &d).await.status == Status::Good {
                    wins += 1;
                }
                run(&lu, &h, &rw10(WRITE_10, 1, 1), &pattern(1, t)).await;
            }
            wins
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    let cur = run(&lu, &h, &rw10(READ_10, 0, 1), &[]).await.data;
    assert_eq!(u32::from_be_bytes([cur[0], cur[1], cur[2], cur[3]]), total);
    assert!(total > 0);
}

#[tokio::test]
async fn get_lba_status_reports_zero_blocks_deallocated() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    good(&run(&lu, &h, &rw10(WRITE_10, 0, 4), &pattern(4, 0x41)).await);
    let mut c = rw16(SERVICE_ACTION_IN_16, 2, 0);
    c[1] = SA_GET_LBA_STATUS;
    c[10..14].copy_from_slice(&24u32.to_be_bytes());
    let r = run(&lu, &h, &c, &[]).await;
    good(&r);
    assert_eq!(r.data.len(), 24);
    assert_eq!(be64(&r.data, 8), 2);
    assert_eq!(be32(&r.data, 16), 2);
    assert_eq!(r.data[20], 0, "mapped");
    c[2..10].copy_from_slice(&4u64.to_be_bytes());
    let r = run(&lu, &h, &c, &[]).await;
    assert_eq!(r.data[20], 1, "deallocated");
    c[2..10].copy_from_slice(&BLOCKS.to_be_bytes());
    assert_eq!(sense_of(&run(&lu, &h, &c, &[]).await), (5, 0x21, 0));
}

fn mode_sense6(page: u8, pc: u8) -> [u8; 6] {
    [MODE_SENSE_6, 0, (pc << 6) | page, 0, 255, 0]
}

#[tokio::test]
async fn mode_sense_pages_and_block_descriptor() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    let r = run(&lu, &h, &mode_sense6(0x3F, 0), &[]).await;
    good(&r);
    let d = &r.data;
    assert_eq!(usize::from(d[0]) + 1, d.len());
    assert_eq!(d[3], 8, "block descriptor");
    assert_eq!(be32(d, 4), BLOCKS as u32);
    assert_eq!(be32(d, 8) & 0xFFFFFF, BS);
    assert_eq!(d[2] & 0x10, 0x10, "DPOFUA");
    assert_eq!(&d[12..14], &[0x08, 0x12]);
    assert_eq!(d[14] & 0x04, 0x04, "WCE");
    // DBD drops the descriptor; MODE SENSE(10) with LLBAA gives a long one.
    let r = run(&lu, &h, &[MODE_SENSE_6, 0x08, 0x0A, 0, 255, 0], &[]).await;
    assert_eq!(r.data[3], 0);
    assert_eq!(&r.data[4..6], &[0x0A, 0x0A]);
    let r = run(
        &lu,
        &h,
        &[MODE_SENSE_10, 0x10, 0x1C, 0, 0, 0, 0, 0, 255, 0],
        &[],
    )
    .await;
    assert_eq!(be16(&r.data, 0) as usize + 2, r.data.len());
    assert_eq!(be16(&r.data, 6), 16);
    assert_eq!(be64(&r.data, 8), BLOCKS);
    // Changeable values.
    let r = run(&lu, &h, &[MODE_SENSE_6, 0x08, 0x4A, 0, 255, 0], &[]).await;
    assert_eq!((r.data[6], r.data[8], r.data[9]), (0x04, 0x08, 0x40));
    assert_eq!(
        sense_of(&run(&lu, &h, &mode_sense6(0x05, 0), &[]).await),
        (5, 0x24, 0)
    );
    assert_eq!(
        sense_of(&run(&lu, &h, &[MODE_SENSE_6, 0, 0x0A, 1, 255, 0], &[]).await),
        (5, 0x24, 0)
    );
}

async fn control_page(lu: &LogicalUnit, h: &NexusHandle) -> Vec<u8> {
    let r = run(lu, h, &[MODE_SENSE_6, 0x08, 0x0A, 0, 255, 0], &[]).await;
    r.data[4..16].to_vec()
}

#[tokio::test]
async fn mode_select_swp_d_sense_and_the_ua_to_others() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    let other = attach(&lu, "b").await;
    let mut page = control_page(&lu, &h).await;
    page[4] |= 0x08; // SWP
    page[2] |= 0x04; // D_SENSE
    let mut list = vec![0u8, 0, 0, 0];
    list.extend_from_slice(&page);
    let sel = [MODE_SELECT_6, 0x10, 0, 0, list.len() as u8, 0];
    good(&run(&lu, &h, &sel, &list).await);
    // Descriptor-format sense now, and writes are refused.
    let r = run(&lu, &h, &rw10(WRITE_10, 0, 1), &pattern(1, 1)).await;
    assert_eq!(r.sense[0], 0x72);
    assert_eq!(sense_of(&r), (7, 0x27, 0));
    let r = run(&lu, &other, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await;
    assert_eq!(sense_of(&r), (6, 0x2A, 0x01));
    // A non-changeable bit is an invalid field in the parameter list.
    let mut bad = list.clone();
    bad[4 + 3] ^= 0x01;
    assert_eq!(sense_of(&run(&lu, &h, &sel, &bad).await), (5, 0x26, 0));
    // PF=0 and SP=1 are refused.
    assert_eq!(
        sense_of(
            &run(
                &lu,
                &h,
                &[MODE_SELECT_6, 0, 0, 0, list.len() as u8, 0],
                &list
            )
            .await
        ),
        (5, 0x24, 0)
    );
    assert_eq!(
        sense_of(
            &run(
                &lu,
                &h,
                &[MODE_SELECT_6, 0x11, 0, 0, list.len() as u8, 0],
                &list
            )
            .await
        ),
        (5, 0x39, 0)
    );
    // Back to normal.
    let mut list = vec![0u8, 0, 0, 0];
    let mut page = page.clone();
    page[4] &= !0x08;
    page[2] &= !0x04;
    list.extend_from_slice(&page);
    good(&run(&lu, &h, &sel, &list).await);
    good(&run(&lu, &h, &rw10(WRITE_10, 0, 1), &pattern(1, 1)).await);
}

#[tokio::test]
async fn report_luns_opcodes_tmfs_and_tpgs() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    let r = run(
        &lu,
        &h,
        &[REPORT_LUNS, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0],
        &[],
    )
    .await;
    assert_eq!(
        &r.data[..],
        &[0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    assert_eq!(
        sense_of(
            &run(
                &lu,
                &h,
                &[REPORT_LUNS, 0, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0],
                &[]
            )
            .await
        ),
        (5, 0x24, 0)
    );
    let mut c = [0u8; 12];
    c[0] = MAINTENANCE_IN;
    c[1] = SA_REPORT_OPCODES;
    c[8] = 0x10;
    let r = run(&lu, &h, &c, &[]).await;
    good(&r);
    assert_eq!(be32(&r.data, 0) as usize, SUPPORTED.len() * 8);
    // One command: READ(10).
    c[2] = 1;
    c[3] = READ_10;
    let r = run(&lu, &h, &c, &[]).await;
    assert_eq!(r.data[1] & 0x07, 3);
    assert_eq!(be16(&r.data, 2), 10);
    assert_eq!(r.data[4], READ_10);
    // With RCTD: a timeouts descriptor follows.
    c[2] = 0x81;
    assert_eq!(run(&lu, &h, &c, &[]).await.data.len(), 4 + 10 + 12);
    // An opcode with service actions asked without one.
    c[2] = 1;
    c[3] = PR_IN;
    assert_eq!(sense_of(&run(&lu, &h, &c, &[]).await), (5, 0x24, 0));
    c[2] = 2;
    c[5] = 1;
    assert_eq!(run(&lu, &h, &c, &[]).await.data[1] & 0x07, 3);
    c[3] = 0xC7;
    c[2] = 1;
    c[5] = 0;
    assert_eq!(run(&lu, &h, &c, &[]).await.data[1] & 0x07, 1);
    let mut c = [0u8; 12];
    c[0] = MAINTENANCE_IN;
    c[1] = SA_REPORT_TMFS;
    c[9] = 4;
    let r = run(&lu, &h, &c, &[]).await;
    assert_eq!(r.data[0] & 0x08, 0x08, "LUN RESET");
    let mut c = [0u8; 12];
    c[0] = MAINTENANCE_IN;
    c[1] = SA_REPORT_TPGS;
    c[9] = 255;
    let r = run(&lu, &h, &c, &[]).await;
    assert_eq!(be32(&r.data, 0), 12);
    assert_eq!(r.data[4] & 0x0F, 0, "active/optimized");
    assert_eq!(be16(&r.data, 6), 1);
    assert_eq!(r.data[11], 1);
    assert_eq!(be16(&r.data, 14), 1);
}

#[tokio::test]
async fn alua_states_gate_commands_and_raise_the_ua() {
    let lu = lu();
    let h = attach(&lu, "a").await;
    lu.set_port_groups(vec![
        PortGroup {
            id: 1,
            state: AluaState::Transitioning,
            relative_ports: vec![1],
        },
        PortGroup {
            id: 2,
            state: AluaState::ActiveOptimized,
            relative_ports: vec![2],
        },
    ]);
    let r = run(&lu, &h, &rw10(READ_10, 0, 1), &[]).await;
    assert_eq!(sense_of(&r), (6, 0x2A, 0x06));
    let r = run(&lu, &h, &rw10(READ_10, 0, 1), &[]).await;
    assert_eq!(sense_of(&r), (2, 0x04, 0x0A));
    good(&run(&lu, &h, &[INQUIRY, 0, 0, 0, 96, 0], &[]).await);
    let mut c = [0u8; 12];
    c[0] = MAINTENANCE_IN;
    c[1] = SA_REPORT_TPGS;
    c[9] = 255;
    let r = run(&lu, &h, &c, &[]).await;
    assert_eq!(be32(&r.data, 0), 24);
    assert_eq!(r.data[4] & 0x0F, 0x0F);
    lu.set_port_groups(vec![PortGroup {
        id: 1,
        state: AluaState::ActiveOptimized,
        relative_ports: vec![1],
    }]);
    run(&lu, &h, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await;
    good(&run(&lu, &h, &rw10(READ_10, 0, 1), &[]).await);
}

#[tokio::test]
async fn missing_lun_answers() {
    let c = |cdb: &[u8]| Command {
        cdb: Bytes::copy_from_slice(cdb),
        data_out: Bytes::new(),
        expected_in: 255,
    };
    let r = missing_lun(&c(&[INQUIRY, 0, 0, 0, 96, 0]), 1);
    good(&r);
    assert_eq!(r.data[0], 0x7F);
    let r = missing_lun(&c(&[REPORT_LUNS, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]), 2);
    assert_eq!(be32(&r.data, 0), 16);
    let r = missing_lun(&c(&[REQUEST_SENSE, 0, 0, 0, 18, 0]), 1);
    good(&r);
    assert_eq!((r.data[2], r.data[12]), (5, 0x25));
    let r = missing_lun(&c(&rw10(READ_10, 0, 1)), 1);
    assert_eq!(sense_of(&r), (5, 0x25, 0));
}

#[tokio::test]
async fn reserve6_conflicts_and_is_released_by_reset_and_logout() {
    let lu = lu();
    let a = attach(&lu, "a").await;
    let b = attach(&lu, "b").await;
    good(&run(&lu, &a, &[RESERVE_6, 0, 0, 0, 0, 0], &[]).await);
    good(&run(&lu, &a, &[RESERVE_6, 0, 0, 0, 0, 0], &[]).await);
    assert_eq!(
        run(&lu, &b, &[RESERVE_6, 0, 0, 0, 0, 0], &[]).await.status,
        Status::ReservationConflict
    );
    assert_eq!(
        run(&lu, &b, &rw10(READ_10, 0, 1), &[]).await.status,
        Status::ReservationConflict
    );
    good(&run(&lu, &b, &[INQUIRY, 0, 0, 0, 96, 0], &[]).await);
    // RELEASE from the other nexus is a no-op.
    good(&run(&lu, &b, &[RELEASE_6, 0, 0, 0, 0, 0], &[]).await);
    assert_eq!(
        run(&lu, &b, &rw10(READ_10, 0, 1), &[]).await.status,
        Status::ReservationConflict
    );
    lu.task_management(&b, TaskFunction::LunReset).unwrap();
    for h in [&a, &b] {
        let r = run(&lu, h, &rw10(READ_10, 0, 1), &[]).await;
        assert_eq!(sense_of(&r), (6, 0x29, 0x03));
    }
    good(&run(&lu, &b, &rw10(READ_10, 0, 1), &[]).await);
    good(&run(&lu, &a, &[RESERVE_6, 0, 0, 0, 0, 0], &[]).await);
    drop(a);
    good(&run(&lu, &b, &[RESERVE_6, 0, 0, 0, 0, 0], &[]).await);
}

#[tokio::test]
async fn task_management_bumps_the_aborts_of_others() {
    let lu = lu();
    let a = attach(&lu, "a").await;
    let b = attach(&lu, "b").await;
    let wa = a.aborts();
    let wb = b.aborts();
    lu.task_management(&a, TaskFunction::ClearTaskSet).unwrap();
    assert_eq!(wb.borrow().count, 1);
    assert!(wb.borrow().cleared, "CLEAR TASK SET says so");
    assert_eq!(wa.borrow().count, 0);
    lu.task_management(&a, TaskFunction::AbortTaskSet).unwrap();
    assert_eq!(wb.borrow().count, 1);
    lu.task_management(&a, TaskFunction::TargetWarmReset)
        .unwrap();
    assert!(!wb.borrow().cleared, "a reset is no CLEAR TASK SET");
    assert_eq!(
        sense_of(&run(&lu, &b, &[TEST_UNIT_READY, 0, 0, 0, 0, 0], &[]).await),
        (6, 0x29, 0x02)
    );
    assert!(lu.task_management(&a, TaskFunction::ClearAca).is_err());
}

#[tokio::test]
async fn device_errors_become_sense() {
    use crate::device::{FaultConfig, FaultyDevice, OpKind};
    let dev = Arc::new(FaultyDevice::new(MemDevice::new(
        Geometry::with_max_io(BLOCKS * u64::from(BS), BS, 64 << 10).unwrap(),
    )));
    let lu = LogicalUnit::new(dev.clone(), config(None)).unwrap();
    let h = attach(&lu, "a").await;
    for (kind, op, want) in [
        (ErrorKind::Io, OpKind::Write, (3, 0x0C, 0)),
        (ErrorKind::Io, OpKind::Read, (3, 0x11, 0)),
        (ErrorKind::NoSpace, OpKind::Write, (7, 0x27, 0x07)),
        (ErrorKind::ReadOnly, OpKind::Write, (7, 0x27, 0)),
        (ErrorKind::NoQuorum, OpKind::Read, (2, 0x04, 0x0C)),
        (ErrorKind::WrongState, OpKind::Write, (2, 0x04, 0x0A)),
        (ErrorKind::Timeout, OpKind::Read, (0x0B, 0x08, 0x01)),
    ] {
        dev.set_faults(FaultConfig::new().ops(&[op]).kind(kind));
        let r = match op {
            OpKind::Read => run(&lu, &h, &rw10(READ_10, 0, 1), &[]).await,
            _ => run(&lu, &h, &rw10(WRITE_10, 0, 1), &pattern(1, 1)).await,
        };
        assert_eq!(sense_of(&r), want, "{kind:?}");
        dev.clear_faults();
    }
}

mod peer_tests;
mod pr_tests;
