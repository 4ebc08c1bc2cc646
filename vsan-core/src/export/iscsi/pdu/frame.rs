//! Framing: the BHS, AHS, digests and padding of one PDU, both ways.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{BHS_LEN, DIGEST_LEN, Digests, MAX_DATA_SEGMENT_FIELD, PduError, reject_reason};

/// CRC32C as the digests carry it.
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

pub(super) fn be16(b: &[u8], at: usize) -> u16 {
    let mut v = [0u8; 2];
    if let Some(s) = b.get(at..at + 2) {
        v.copy_from_slice(s);
    }
    u16::from_be_bytes(v)
}

pub(super) fn be32(b: &[u8], at: usize) -> u32 {
    let mut v = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        v.copy_from_slice(s);
    }
    u32::from_be_bytes(v)
}

pub(super) fn be64(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        v.copy_from_slice(s);
    }
    u64::from_be_bytes(v)
}

pub(super) fn put16(b: &mut [u8; BHS_LEN], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

pub(super) fn put32(b: &mut [u8; BHS_LEN], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

pub(super) fn put64(b: &mut [u8; BHS_LEN], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_be_bytes());
}

/// Bytes of padding after a segment of `len` bytes.
pub(super) fn pad(len: usize) -> usize {
    (4 - len % 4) % 4
}

/// One PDU cut off the stream: the BHS, the AHS and the data segment (without padding).
pub(super) struct Frame {
    pub(super) bhs: [u8; BHS_LEN],
    pub(super) ahs: Bytes,
    pub(super) data: Bytes,
}

/// Cuts whole PDUs off a byte stream, checking digests and the data segment limit.
#[derive(Debug)]
pub(super) struct Framer {
    pub(super) max_data_segment: u32,
    pub(super) digests: Digests,
    /// Bytes of an oversized PDU still to throw away as they arrive.
    skip: usize,
}

impl Framer {
    pub(super) fn new(max_data_segment: u32) -> Framer {
        Framer {
            max_data_segment,
            digests: Digests::default(),
            skip: 0,
        }
    }

    pub(super) fn next(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, PduError> {
        if self.skip > 0 {
            let n = self.skip.min(buf.len());
            buf.advance(n);
            self.skip -= n;
            if self.skip > 0 {
                return Ok(None);
            }
        }
        if buf.len() < BHS_LEN {
            return Ok(None);
        }
        let mut bhs = [0u8; BHS_LEN];
        bhs.copy_from_slice(&buf[..BHS_LEN]);
        let ahs_len = usize::from(bhs[4]) * 4;
        let dsl = be32(&bhs, 4) & MAX_DATA_SEGMENT_FIELD;
        let hd = if self.digests.header { DIGEST_LEN } else { 0 };
        let head_len = BHS_LEN + ahs_len + hd;
        let data_len = dsl as usize;
        let dd = if self.digests.data && data_len > 0 {
            DIGEST_LEN
        } else {
            0
        };
        let total = head_len + data_len + pad(data_len) + dd;
        if dsl > self.max_data_segment {
            // Check the header before trusting its length enough to skip by it.
            if buf.len() < head_len {
                return Ok(None);
            }
            self.check_header_digest(&buf[..head_len])?;
            let have = buf.len().min(total);
            buf.advance(have);
            self.skip = total - have;
            return Err(PduError::Reject {
                reason: reject_reason::PROTOCOL_ERROR,
                header: bhs,
                detail: format!(
                    "data segment of {dsl} bytes over the limit of {}",
                    self.max_data_segment
                ),
            });
        }
        if buf.len() < total {
            buf.reserve(total - buf.len());
            return Ok(None);
        }
        let mut pdu = buf.split_to(total).freeze();
        self.check_header_digest(&pdu[..head_len])?;
        let head = pdu.split_to(head_len);
        let ahs = head.slice(BHS_LEN..BHS_LEN + ahs_len);
        let padded = data_len + pad(data_len);
        if dd > 0 {
            let want = crc32c(&pdu[..padded]);
            let got = u32::from_le_bytes([
                pdu[padded],
                pdu[padded + 1],
                pdu[padded + 2],
                pdu[padded + 3],
            ]);
            if want != got {
                return Err(PduError::Reject {
                    reason: reject_reason::DATA_DIGEST_ERROR,
                    header: bhs,
                    detail: format!("data digest {got:#010x}, computed {want:#010x}"),
                });
            }
        }
        Ok(Some(Frame {
            bhs,
            ahs,
            data: pdu.slice(..data_len),
        }))
    }

    fn check_header_digest(&self, head: &[u8]) -> Result<(), PduError> {
        if !self.digests.header {
            return Ok(());
        }
        let n = head.len() - DIGEST_LEN;
        let want = crc32c(&head[..n]);
        let got = u32::from_le_bytes([head[n], head[n + 1], head[n + 2], head[n + 3]]);
        if want != got {
            return Err(PduError::Fatal(format!(
                "header digest {got:#010x}, computed {want:#010x}"
            )));
        }
        Ok(())
    }
}

/// Appends one whole PDU: `bhs` (its TotalAHSLength and DataSegmentLength filled in
/// here), `ahs` (a multiple of 4 bytes), `data` with its padding, and the digests.
pub(super) fn put_pdu(
    mut bhs: [u8; BHS_LEN],
    ahs: &[u8],
    data: &[u8],
    digests: Digests,
    out: &mut BytesMut,
) {
    debug_assert!(ahs.len() % 4 == 0 && ahs.len() <= 255 * 4);
    debug_assert!(data.len() <= MAX_DATA_SEGMENT_FIELD as usize);
    bhs[4] = (ahs.len() / 4) as u8;
    let dsl = (data.len() as u32)
        .min(MAX_DATA_SEGMENT_FIELD)
        .to_be_bytes();
    bhs[5..8].copy_from_slice(&dsl[1..]);
    let padding = pad(data.len());
    out.reserve(BHS_LEN + ahs.len() + data.len() + padding + 2 * DIGEST_LEN);
    let start = out.len();
    out.put_slice(&bhs);
    out.put_slice(ahs);
    if digests.header {
        let crc = crc32c(&out[start..]);
        out.put_u32_le(crc);
    }
    if !data.is_empty() {
        let start = out.len();
        out.put_slice(data);
        out.put_bytes(0, padding);
        if digests.data {
            let crc = crc32c(&out[start..]);
            out.put_u32_le(crc);
        }
    }
}
