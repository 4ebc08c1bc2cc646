use super::*;

fn limits() -> Limits {
    Limits {
        size: 64 << 20,
        block_size: 4096,
        size_max: 1 << 20,
        seg_max: 126,
        max_transfer: 16 << 20,
        max_range_sectors: 1 << 21,
        max_ranges: 1,
        queues: 4,
    }
}

fn le32(c: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(c[off..off + 4].try_into().unwrap())
}

#[test]
fn config_space_follows_the_virtio_layout() {
    let c = config_space(&limits(), true);
    assert_eq!(CONFIG_LEN, 60);
    assert_eq!(
        u64::from_le_bytes(c[0..8].try_into().unwrap()),
        (64 << 20) / 512
    );
    assert_eq!(le32(&c, 8), 1 << 20, "size_max");
    assert_eq!(le32(&c, 12), 126, "seg_max");
    assert_eq!(le32(&c, 20), 4096, "blk_size");
    assert_eq!(c[32], 1, "writeback");
    assert_eq!(
        u16::from_le_bytes(c[34..36].try_into().unwrap()),
        4,
        "num_queues"
    );
    assert_eq!(le32(&c, 36), 1 << 21, "max_discard_sectors");
    assert_eq!(le32(&c, 40), 1, "max_discard_seg");
    assert_eq!(le32(&c, 44), 8, "discard_sector_alignment in sectors");
    assert_eq!(le32(&c, 48), 1 << 21, "max_write_zeroes_sectors");
    assert_eq!(le32(&c, 52), 1, "max_write_zeroes_seg");
    assert_eq!(c[56], 1, "write_zeroes_may_unmap");
    assert_eq!(config_space(&limits(), false)[CONFIG_WCE_OFFSET], 0);
}

#[test]
fn a_read_only_export_offers_ro_and_no_discard() {
    let bit = |f: u64, b: u32| f & (1 << b) != 0;
    let rw = device_features(false);
    let ro = device_features(true);
    assert!(!bit(rw, blk::VIRTIO_BLK_F_RO) && bit(ro, blk::VIRTIO_BLK_F_RO));
    assert!(bit(rw, blk::VIRTIO_BLK_F_DISCARD) && !bit(ro, blk::VIRTIO_BLK_F_DISCARD));
    assert!(bit(rw, blk::VIRTIO_BLK_F_WRITE_ZEROES) && !bit(ro, blk::VIRTIO_BLK_F_WRITE_ZEROES));
    for b in [
        blk::VIRTIO_BLK_F_FLUSH,
        blk::VIRTIO_BLK_F_MQ,
        blk::VIRTIO_BLK_F_CONFIG_WCE,
        blk::VIRTIO_BLK_F_BLK_SIZE,
        blk::VIRTIO_BLK_F_TOPOLOGY,
        blk::VIRTIO_BLK_F_SEG_MAX,
        blk::VIRTIO_BLK_F_SIZE_MAX,
        virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX,
        virtio_bindings::virtio_ring::VIRTIO_RING_F_INDIRECT_DESC,
        virtio_bindings::virtio_config::VIRTIO_F_VERSION_1,
    ] {
        assert!(bit(rw, b) && bit(ro, b), "feature bit {b}");
    }
}

#[test]
fn byte_ranges_refuse_overflow_the_end_and_misalignment() {
    let l = limits();
    assert_eq!(byte_range(&l, 8, 8), Some((4096, 4096)));
    assert_eq!(byte_range(&l, u64::MAX / 256, 8), None, "offset overflows");
    assert_eq!(
        byte_range(&l, (64 << 20) / 512 - 8, 16),
        None,
        "past the end"
    );
    assert_eq!(byte_range(&l, 1, 8), None, "not block aligned");
    assert_eq!(byte_range(&l, 8, 1), None, "not a whole block");
}

#[test]
fn segments_split_at_any_byte() {
    let s = |a: u64, l: u32| Seg {
        addr: GuestAddress(a),
        len: l,
    };
    let segs = [s(0, 10), s(100, 6), s(200, 20)];
    let (h, t) = split_segs(&segs, 16);
    assert_eq!(h, vec![s(0, 10), s(100, 6)]);
    assert_eq!(t, vec![s(200, 20)]);
    let (h, t) = split_segs(&segs, 12);
    assert_eq!(h, vec![s(0, 10), s(100, 2)]);
    assert_eq!(t, vec![s(102, 4), s(200, 20)]);
    let (h, t) = split_segs(&segs, 36);
    assert_eq!((h.len(), t.len()), (3, 0));
}
