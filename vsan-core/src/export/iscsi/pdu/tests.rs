use bytes::BytesMut;

use super::frame::be32;
use super::*;
use crate::export::iscsi::fuzzing::sample_requests;

const BOTH: Digests = Digests {
    header: true,
    data: true,
};
const ALL_DIGESTS: [Digests; 4] = [
    Digests {
        header: false,
        data: false,
    },
    Digests {
        header: true,
        data: false,
    },
    Digests {
        header: false,
        data: true,
    },
    BOTH,
];

fn z() -> [u8; BHS_LEN] {
    [0; BHS_LEN]
}

fn sample_replies() -> Vec<Reply> {
    let mut bhs = [0u8; BHS_LEN];
    bhs[0] = 0x1c;
    vec![
        Reply::NopIn(NopIn {
            lun: 1,
            itt: RESERVED_TAG,
            ttt: 5,
            stat_sn: 6,
            exp_cmd_sn: 7,
            max_cmd_sn: 8,
            data: Bytes::from_static(b"abc"),
        }),
        Reply::ScsiResponse(ScsiResponse {
            itt: 1,
            response: 0,
            status: 2,
            overflow: false,
            underflow: true,
            residual: 512,
            bidi_overflow: true,
            bidi_underflow: false,
            bidi_residual: 4,
            stat_sn: 10,
            exp_cmd_sn: 11,
            max_cmd_sn: 42,
            exp_data_sn: 3,
            sense: Bytes::from_static(&[0x70, 0, 5, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x20, 0]),
        }),
        Reply::ScsiResponse(ScsiResponse {
            itt: 2,
            ..Default::default()
        }),
        Reply::TaskMgmtResp(TaskMgmtResp {
            response: 1,
            itt: 3,
            stat_sn: 4,
            exp_cmd_sn: 5,
            max_cmd_sn: 6,
        }),
        Reply::LoginResp(LoginResp {
            transit: true,
            cont: false,
            csg: 1,
            nsg: 3,
            version_max: 0,
            version_active: 0,
            isid: [1, 2, 3, 4, 5, 6],
            tsih: 7,
            itt: 8,
            stat_sn: 9,
            exp_cmd_sn: 10,
            max_cmd_sn: 11,
            status_class: 2,
            status_detail: 1,
            data: Bytes::from_static(b"HeaderDigest=None\0"),
        }),
        Reply::TextResp(TextResp {
            final_: false,
            cont: true,
            lun: 0,
            itt: 1,
            ttt: 2,
            stat_sn: 3,
            exp_cmd_sn: 4,
            max_cmd_sn: 5,
            data: Bytes::from_static(b"TargetName=iqn.y\0"),
        }),
        Reply::DataIn(DataIn {
            final_: true,
            status: Some(0),
            overflow: false,
            underflow: true,
            residual: 100,
            lun: 0,
            itt: 5,
            ttt: RESERVED_TAG,
            stat_sn: 6,
            exp_cmd_sn: 7,
            max_cmd_sn: 8,
            data_sn: 0,
            offset: 0,
            data: Bytes::from(vec![9; 1000]),
        }),
        Reply::DataIn(DataIn {
            final_: false,
            status: None,
            itt: 5,
            data_sn: 1,
            offset: 1000,
            exp_cmd_sn: 7,
            max_cmd_sn: 8,
            data: Bytes::from(vec![3; 7]),
            ..Default::default()
        }),
        Reply::LogoutResp(LogoutResp {
            response: 0,
            itt: 9,
            stat_sn: 10,
            exp_cmd_sn: 11,
            max_cmd_sn: 12,
            time2wait: 2,
            time2retain: 20,
        }),
        Reply::R2t(R2t {
            lun: 0,
            itt: 1,
            ttt: 2,
            stat_sn: 3,
            exp_cmd_sn: 4,
            max_cmd_sn: 5,
            r2t_sn: 6,
            offset: 65536,
            len: 262144,
        }),
        Reply::Async(AsyncMsg {
            lun: 0,
            stat_sn: 1,
            exp_cmd_sn: 2,
            max_cmd_sn: 3,
            event: 1,
            vcode: 0,
            param1: 0,
            param2: 2,
            param3: 20,
            data: Bytes::new(),
        }),
        Reply::Reject(Reject {
            reason: reject_reason::COMMAND_NOT_SUPPORTED,
            stat_sn: 1,
            exp_cmd_sn: 2,
            max_cmd_sn: 3,
            data_sn: 0,
            header: bhs,
        }),
    ]
}

fn cleared(mut r: Request) -> Request {
    *r.header_mut() = [0; BHS_LEN];
    r
}

#[test]
fn every_request_round_trips_with_every_digest_setting() {
    for d in ALL_DIGESTS {
        for req in sample_requests() {
            let mut buf = BytesMut::new();
            req.encode(d, &mut buf);
            let wire = buf.clone();
            let mut dec = Decoder::new(1 << 20);
            dec.set_digests(d);
            let got = dec.decode(&mut buf).expect("decodes").expect("whole");
            assert!(buf.is_empty(), "{req:?} left bytes");
            assert_eq!(&got.header()[..], &wire[..BHS_LEN]);
            assert_eq!(cleared(got), req, "digests {d:?}");
        }
    }
}

#[test]
fn every_reply_round_trips_with_every_digest_setting() {
    for d in ALL_DIGESTS {
        for rep in sample_replies() {
            let mut buf = BytesMut::new();
            rep.encode(d, &mut buf);
            let mut dec = ReplyDecoder::new(1 << 20);
            dec.set_digests(d);
            let got = dec.decode(&mut buf).expect("decodes").expect("whole");
            assert!(buf.is_empty());
            assert_eq!(got, rep, "digests {d:?}");
        }
    }
}

#[test]
fn crc32c_matches_the_rfc_vectors() {
    // RFC 3720 appendix B.4 (also in RFC 7143's references): the digest bytes in wire
    // order for 32 bytes of zeros, of ones, incrementing and decrementing.
    let inc: Vec<u8> = (0..32).collect();
    let dec: Vec<u8> = (0..32).rev().collect();
    let cases: [(&[u8], [u8; 4]); 4] = [
        (&[0; 32], [0xaa, 0x36, 0x91, 0x8a]),
        (&[0xff; 32], [0x43, 0xab, 0xa8, 0x62]),
        (&inc, [0x4e, 0x79, 0xdd, 0x46]),
        (&dec, [0x5c, 0xdb, 0x3f, 0x11]),
    ];
    for (input, wire) in cases {
        assert_eq!(crc32c(input).to_le_bytes(), wire);
    }
    assert_eq!(crc32c(b"123456789"), 0xe306_9283);
}

#[test]
fn digests_are_placed_after_the_header_and_after_the_padded_data() {
    let req = Request::NopOut(NopOut {
        header: z(),
        immediate: true,
        lun: 0,
        itt: 1,
        ttt: RESERVED_TAG,
        cmd_sn: 1,
        exp_stat_sn: 1,
        data: Bytes::from_static(b"hello"),
    });
    let mut buf = BytesMut::new();
    req.encode(BOTH, &mut buf);
    assert_eq!(buf.len(), 48 + 4 + 8 + 4);
    let hd = u32::from_le_bytes(buf[48..52].try_into().unwrap());
    assert_eq!(hd, crc32c(&buf[..48]));
    assert_eq!(&buf[52..60], b"hello\0\0\0");
    let dd = u32::from_le_bytes(buf[60..64].try_into().unwrap());
    assert_eq!(dd, crc32c(b"hello\0\0\0"));
    // No data: no data digest.
    let mut buf = BytesMut::new();
    sample_requests()[7].encode(BOTH, &mut buf);
    assert_eq!(buf.len(), 52);
}

#[test]
fn padding_rounds_the_data_segment_to_four_bytes_with_zeros() {
    for n in 0..9usize {
        let req = Request::NopOut(NopOut {
            header: z(),
            immediate: false,
            lun: 0,
            itt: 1,
            ttt: RESERVED_TAG,
            cmd_sn: 1,
            exp_stat_sn: 1,
            data: Bytes::from(vec![0xee; n]),
        });
        let mut buf = BytesMut::new();
        req.encode(Digests::default(), &mut buf);
        assert_eq!(buf.len(), 48 + n.div_ceil(4) * 4);
        assert_eq!(be32(&buf, 4) & 0xff_ffff, n as u32, "DSL is unpadded");
        assert!(buf[48 + n..].iter().all(|&b| b == 0));
        let got = Decoder::new(8192).decode(&mut buf).unwrap().unwrap();
        assert_eq!(cleared(got), req);
    }
}

#[test]
fn a_bad_header_digest_is_fatal() {
    let mut buf = BytesMut::new();
    sample_requests()[0].encode(BOTH, &mut buf);
    buf[50] ^= 1;
    let mut dec = Decoder::new(8192);
    dec.set_digests(BOTH);
    assert!(matches!(dec.decode(&mut buf), Err(PduError::Fatal(_))));
    // A changed header byte is as bad as a changed digest.
    let mut buf = BytesMut::new();
    sample_requests()[0].encode(BOTH, &mut buf);
    buf[20] ^= 0x80;
    assert!(matches!(dec.decode(&mut buf), Err(PduError::Fatal(_))));
}

#[test]
fn a_bad_data_digest_rejects_one_pdu_and_the_next_decodes() {
    let mut buf = BytesMut::new();
    let reqs = sample_requests();
    reqs[0].encode(BOTH, &mut buf);
    let last = buf.len() - 1;
    buf[last] ^= 0xff;
    reqs[5].encode(BOTH, &mut buf);
    let mut dec = Decoder::new(8192);
    dec.set_digests(BOTH);
    match dec.decode(&mut buf) {
        Err(PduError::Reject { reason, header, .. }) => {
            assert_eq!(reason, reject_reason::DATA_DIGEST_ERROR);
            assert_eq!(header[0] & 0x3f, opcode::NOP_OUT);
        }
        other => panic!("{other:?}"),
    }
    let next = dec.decode(&mut buf).unwrap().unwrap();
    assert_eq!(cleared(next), reqs[5]);
}

#[test]
fn an_extended_cdb_ahs_extends_the_cdb() {
    let cdb: Vec<u8> = (0..40).collect();
    let req = Request::Command(ScsiCommand {
        header: z(),
        immediate: false,
        final_: true,
        read: false,
        write: false,
        attr: 1,
        lun: 0,
        itt: 1,
        expected_len: 0,
        cmd_sn: 1,
        exp_stat_sn: 1,
        cdb: Bytes::from(cdb.clone()),
        bidi_read_len: None,
        data: Bytes::new(),
    });
    let mut buf = BytesMut::new();
    req.encode(Digests::default(), &mut buf);
    // AHS: length 25 (24 CDB bytes + the reserved byte), type 1, padded to 28.
    assert_eq!(buf[4], 7);
    assert_eq!(&buf[48..52], &[0, 25, 1, 0]);
    assert_eq!(&buf[52..76], &cdb[16..]);
    let Request::Command(got) = Decoder::new(8192).decode(&mut buf).unwrap().unwrap() else {
        panic!("not a command");
    };
    assert_eq!(&got.cdb[..], &cdb[..]);
    // A short CDB is zero-padded to 16.
    let Request::Command(mut short) = req else {
        unreachable!()
    };
    short.cdb = Bytes::from_static(&[0, 0, 0, 0, 0, 0]);
    let mut buf = BytesMut::new();
    Request::Command(short).encode(Digests::default(), &mut buf);
    let Request::Command(got) = Decoder::new(8192).decode(&mut buf).unwrap().unwrap() else {
        panic!("not a command");
    };
    assert_eq!(&got.cdb[..], &[0; 16]);
}

fn with_ahs(op: u8, ahs: &[u8]) -> BytesMut {
    let mut h = [0u8; BHS_LEN];
    h[0] = op;
    h[1] = 0x80;
    h[4] = (ahs.len() / 4) as u8;
    let mut buf = BytesMut::from(&h[..]);
    buf.extend_from_slice(ahs);
    buf
}

#[test]
fn malformed_ahs_is_rejected_as_an_invalid_field_and_consumed() {
    let cases: [(u8, &[u8]); 6] = [
        (opcode::SCSI_COMMAND, &[0, 9, 1, 0, 1, 2, 3, 4]), // longer than the AHS area
        (opcode::SCSI_COMMAND, &[0, 0, 1, 0]),             // zero length
        (opcode::SCSI_COMMAND, &[0, 5, 3, 0, 0, 0, 0, 1]), // unknown type
        (opcode::SCSI_COMMAND, &[0, 4, 2, 0, 0, 0, 0, 1]), // bidi of the wrong length
        (opcode::NOP_OUT, &[0, 5, 2, 0, 0, 0, 0, 1]),      // AHS on a non-command
        (
            opcode::SCSI_COMMAND,
            &[0, 5, 2, 0, 0, 0, 0, 1, 0, 5, 2, 0, 0, 0, 0, 1],
        ), // twice
    ];
    for (op, ahs) in cases {
        let mut buf = with_ahs(op, ahs);
        match Decoder::new(8192).decode(&mut buf) {
            Err(PduError::Reject { reason, .. }) => {
                assert_eq!(reason, reject_reason::INVALID_PDU_FIELD, "{ahs:?}")
            }
            other => panic!("{ahs:?}: {other:?}"),
        }
        assert!(buf.is_empty());
    }
}

#[test]
fn every_prefix_of_a_pdu_asks_for_more_and_consumes_nothing() {
    for d in ALL_DIGESTS {
        let mut whole = BytesMut::new();
        for r in sample_requests() {
            r.encode(d, &mut whole);
        }
        // Fed one byte at a time, the same requests come out.
        let mut dec = Decoder::new(1 << 20);
        dec.set_digests(d);
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for &b in whole.iter() {
            buf.extend_from_slice(&[b]);
            let before = buf.len();
            match dec.decode(&mut buf).unwrap() {
                Some(r) => got.push(cleared(r)),
                None => assert_eq!(buf.len(), before),
            }
        }
        assert_eq!(got, sample_requests());
    }
}

#[test]
fn opcodes_a_target_does_not_take_are_rejected_not_fatal() {
    for (op, reason) in [
        (0x07, reject_reason::COMMAND_NOT_SUPPORTED),
        (0x1c, reject_reason::COMMAND_NOT_SUPPORTED),
        (opcode::SCSI_RESPONSE, reject_reason::PROTOCOL_ERROR),
        (opcode::REJECT, reject_reason::PROTOCOL_ERROR),
    ] {
        let mut h = [0u8; BHS_LEN];
        h[0] = op;
        h[7] = 3; // a 3-byte data segment, padded
        let mut buf = BytesMut::from(&h[..]);
        buf.extend_from_slice(&[1, 2, 3, 0]);
        let r = sample_requests().remove(0);
        r.encode(Digests::default(), &mut buf);
        let mut dec = Decoder::new(8192);
        match dec.decode(&mut buf) {
            Err(PduError::Reject { reason: got, .. }) => assert_eq!(got, reason),
            other => panic!("{op:#x}: {other:?}"),
        }
        assert_eq!(cleared(dec.decode(&mut buf).unwrap().unwrap()), r);
    }
}

#[test]
fn data_on_a_pdu_that_takes_none_is_an_invalid_field() {
    for op in [opcode::TASK_MGMT, opcode::LOGOUT, opcode::SNACK] {
        let mut h = [0u8; BHS_LEN];
        h[0] = op;
        h[1] = 0x80;
        h[7] = 4;
        let mut buf = BytesMut::from(&h[..]);
        buf.extend_from_slice(&[1, 2, 3, 4]);
        match Decoder::new(8192).decode(&mut buf) {
            Err(PduError::Reject { reason, .. }) => {
                assert_eq!(reason, reject_reason::INVALID_PDU_FIELD)
            }
            other => panic!("{op:#x}: {other:?}"),
        }
        assert!(buf.is_empty());
    }
}

#[test]
fn an_oversized_data_segment_is_rejected_and_skipped_without_buffering() {
    let big = Request::DataOut(DataOut {
        header: z(),
        final_: true,
        lun: 0,
        itt: 1,
        ttt: 2,
        exp_stat_sn: 0,
        data_sn: 0,
        offset: 0,
        data: Bytes::from(vec![7; 10_000]),
    });
    let next = sample_requests().remove(0);
    let mut wire = BytesMut::new();
    big.encode(BOTH, &mut wire);
    next.encode(BOTH, &mut wire);
    for chunk in [1, 7, 100, 4096, wire.len()] {
        let mut dec = Decoder::new(8192);
        dec.set_digests(BOTH);
        let mut buf = BytesMut::new();
        let (mut rejects, mut got) = (0, Vec::new());
        for piece in wire.chunks(chunk) {
            buf.extend_from_slice(piece);
            loop {
                match dec.decode(&mut buf) {
                    Ok(Some(r)) => got.push(cleared(r)),
                    Ok(None) => break,
                    Err(PduError::Reject { reason, .. }) => {
                        assert_eq!(reason, reject_reason::PROTOCOL_ERROR);
                        rejects += 1;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            assert!(buf.len() <= chunk.max(128));
        }
        assert_eq!(rejects, 1, "chunk {chunk}");
        assert_eq!(got, vec![next.clone()], "chunk {chunk}");
    }
}

#[test]
fn garbage_never_panics_and_always_makes_progress_or_waits() {
    // A cheap deterministic generator: whatever the bytes, decode returns, and a
    // returned PDU or Reject always consumed bytes.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for round in 0..300 {
        let mut bytes = vec![0u8; 48 + round * 7];
        for b in bytes.iter_mut() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            *b = x as u8;
        }
        // Keep lengths small often enough to reach the parsers.
        if round % 2 == 0 {
            bytes[4] %= 4;
            bytes[5] = 0;
            bytes[6] = 0;
        }
        for d in ALL_DIGESTS {
            let mut buf = BytesMut::from(&bytes[..]);
            let mut dec = Decoder::new(8192);
            dec.set_digests(d);
            loop {
                let before = buf.len();
                match dec.decode(&mut buf) {
                    Ok(None) | Err(PduError::Fatal(_)) => break,
                    Ok(Some(_)) | Err(PduError::Reject { .. }) => assert!(buf.len() < before),
                }
            }
        }
    }
}

#[test]
fn target_opcodes_sent_to_an_initiator_decoder_are_rejected() {
    let mut buf = BytesMut::new();
    sample_requests()[0].encode(Digests::default(), &mut buf);
    assert!(matches!(
        ReplyDecoder::new(8192).decode(&mut buf),
        Err(PduError::Reject { .. })
    ));
}
