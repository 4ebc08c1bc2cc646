//! The SBC-3 block commands: READ, WRITE, WRITE AND VERIFY, VERIFY, SYNCHRONIZE CACHE,
//! PRE-FETCH, UNMAP, WRITE SAME, COMPARE AND WRITE, GET LBA STATUS. Every range is
//! checked before any I/O, so a bad command changes nothing; every write path holds the
//! stripe lock shared, COMPARE AND WRITE holds it exclusive.

use bytes::{Bytes, BytesMut};

use super::cdb::*;
use super::exec::{Fail, Res, good, good_data};
use super::inquiry::{self, MAX_UNMAP_BLOCKS, MAX_UNMAP_DESCRIPTORS, MAX_WRITE_SAME_BLOCKS};
use super::sense::{self, Access, Sense};
use super::{LogicalUnit, mode};
use crate::device::IoFlags;
use crate::error::ErrorKind;

fn dev_err(e: crate::error::Error, access: Access) -> Fail {
    Fail::Check(sense::from_error(e.kind(), access))
}

/// The byte offset of the first difference, if any.
fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

impl LogicalUnit {
    /// LBA + blocks inside the medium (LBA == capacity with 0 blocks is allowed).
    fn check_range(&self, lba: u64, blocks: u64) -> Result<(), Sense> {
        match lba.checked_add(blocks) {
            Some(end) if end <= self.blocks() => Ok(()),
            _ => Err(sense::LBA_OUT_OF_RANGE),
        }
    }

    fn check_writable(&self, mb: mode::ModeBits) -> Result<(), Sense> {
        if self.config.read_only || mb.swp() {
            Err(sense::WRITE_PROTECTED)
        } else {
            Ok(())
        }
    }

    fn bytes_of(&self, lba: u64, blocks: u64) -> (u64, u64) {
        let bs = u64::from(self.geometry.block_size());
        (lba * bs, blocks * bs)
    }

    pub(super) async fn block_command(&self, cdb: &[u8], data: Bytes, mb: mode::ModeBits) -> Res {
        let op = cdb[0];
        let (lba, blocks) = lba_blocks(cdb);
        let blocks64 = u64::from(blocks);
        let protect = if matches!(op, READ_6 | WRITE_6) {
            0
        } else {
            u8_at(cdb, 1) >> 5
        };
        match op {
            READ_6 | READ_10 | READ_12 | READ_16 => {
                if protect != 0 {
                    return Err(sense::INVALID_FIELD_IN_CDB.into());
                }
                self.check_range(lba, blocks64)?;
                if blocks == 0 {
                    return Ok(good());
                }
                let (off, len) = self.bytes_of(lba, blocks64);
                let data = self
                    .device
                    .read(off, len as usize)
                    .await
                    .map_err(|e| dev_err(e, Access::Read))?;
                Ok(good_data(data))
            }
            WRITE_6 | WRITE_10 | WRITE_12 | WRITE_16 | WRITE_VERIFY_10 | WRITE_VERIFY_12
            | WRITE_VERIFY_16 => {
                if protect != 0 {
                    return Err(sense::INVALID_FIELD_IN_CDB.into());
                }
                self.check_writable(mb)?;
                self.check_range(lba, blocks64)?;
                if blocks == 0 {
                    return Ok(good());
                }
                let verify = matches!(op, WRITE_VERIFY_10 | WRITE_VERIFY_12 | WRITE_VERIFY_16);
                // WRITE AND VERIFY: the data must be on the medium when it completes.
                let fua = verify || !mb.wce() || (op != WRITE_6 && u8_at(cdb, 1) & 0x08 != 0);
                let flags = if fua { IoFlags::FUA } else { IoFlags::empty() };
                let (off, _) = self.bytes_of(lba, blocks64);
                let _held = self.write_stripes(lba, blocks64).await?;
                self.device
                    .write(off, data, flags)
                    .await
                    .map_err(|e| dev_err(e, Access::Write))?;
                Ok(good())
            }
            VERIFY_10 | VERIFY_12 | VERIFY_16 => self.verify(cdb, lba, blocks64, data).await,
            SYNC_CACHE_10 | SYNC_CACHE_16 => {
                self.check_range(lba, blocks64)?;
                self.device
                    .flush()
                    .await
                    .map_err(|e| dev_err(e, Access::Write))?;
                Ok(good())
            }
            PRE_FETCH_10 | PRE_FETCH_16 => {
                self.check_range(lba, blocks64)?;
                Ok(good())
            }
            UNMAP => self.unmap(cdb, &data, mb).await,
            WRITE_SAME_10 | WRITE_SAME_16 => self.write_same(cdb, lba, blocks64, data, mb).await,
            COMPARE_AND_WRITE => self.compare_and_write(cdb, lba, blocks64, data, mb).await,
            ORWRITE_16 => self.or_write(cdb, lba, blocks64, data, mb).await,
            _ => Err(sense::INVALID_OPCODE.into()),
        }
    }

    /// Read a range in pieces the device accepts, handing each to `f` with its offset
    /// (in bytes from the start of the range).
    async fn read_pieces(
        &self,
        lba: u64,
        blocks: u64,
        mut f: impl FnMut(u64, &[u8]) -> Result<(), Fail>,
    ) -> Result<(), Fail> {
        let bs = u64::from(self.geometry.block_size());
        let per = u64::from(self.geometry.max_io()) / bs;
        let mut done = 0u64;
        while done < blocks {
            let n = per.min(blocks - done);
            let (off, len) = self.bytes_of(lba + done, n);
            let piece = self
                .device
                .read_once(off, len as usize)
                .await
                .map_err(|e| dev_err(e, Access::Read))?;
            f(done * bs, &piece)?;
            done += n;
        }
        Ok(())
    }

    async fn verify(&self, cdb: &[u8], lba: u64, blocks: u64, data: Bytes) -> Res {
        if u8_at(cdb, 1) >> 5 != 0 {
            return Err(sense::INVALID_FIELD_IN_CDB.into());
        }
        self.check_range(lba, blocks)?;
        if blocks == 0 {
            return Ok(good());
        }
        let bs = self.geometry.block_size() as usize;
        let mode = bytchk(cdb);
        self.read_pieces(lba, blocks, |at, piece| {
            let at_us = at as usize;
            let diff = match mode {
                0 => None,
                1 => data
                    .get(at_us..at_us + piece.len())
                    .and_then(|want| first_difference(piece, want)),
                _ => piece
                    .chunks(bs)
                    .enumerate()
                    .find_map(|(i, blk)| first_difference(blk, &data).map(|d| i * bs + d)),
            };
            match diff {
                Some(d) => Err(sense::MISCOMPARE_VERIFY
                    .with_information(at + d as u64)
                    .into()),
                None => Ok(()),
            }
        })
        .await?;
        Ok(good())
    }

    /// Deallocate a range; devices that cannot discard write zeroes instead (the range
    /// reads back as zeros either way, as LBPRZ promises).
    async fn deallocate(&self, lba: u64, blocks: u64) -> Result<(), Fail> {
        let (off, len) = self.bytes_of(lba, blocks);
        let _held = self.write_stripes(lba, blocks).await?;
        match self.device.discard(off, len, IoFlags::empty()).await {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotSupported => self
                .device
                .write_zeroes(off, len, IoFlags::empty())
                .await
                .map_err(|e| dev_err(e, Access::Write)),
            Err(e) => Err(dev_err(e, Access::Write)),
        }
    }

    async fn unmap(&self, cdb: &[u8], data: &[u8], mb: mode::ModeBits) -> Res {
        if u8_at(cdb, 1) & 0x01 != 0 {
            return Err(sense::INVALID_FIELD_IN_CDB.into()); // ANCHOR
        }
        let len = usize::from(be16(cdb, 7));
        if len == 0 {
            return Ok(good());
        }
        if len < 8 {
            return Err(sense::PARAM_LIST_LENGTH.into());
        }
        self.check_writable(mb)?;
        let data = data.get(..len).ok_or(sense::PARAM_LIST_LENGTH)?;
        let bdl = usize::from(be16(data, 2)).min(len - 8);
        let count = bdl / 16;
        if count > MAX_UNMAP_DESCRIPTORS as usize {
            return Err(sense::INVALID_FIELD_IN_PARAM.into());
        }
        let desc = |i: usize| (be64(data, 8 + i * 16), u64::from(be32(data, 16 + i * 16)));
        // Every descriptor is checked before any is applied.
        for i in 0..count {
            let (lba, n) = desc(i);
            if n > u64::from(MAX_UNMAP_BLOCKS) {
                return Err(sense::INVALID_FIELD_IN_PARAM.into());
            }
            self.check_range(lba, n)?;
        }
        for i in 0..count {
            let (lba, n) = desc(i);
            if n > 0 {
                self.deallocate(lba, n).await?;
            }
        }
        Ok(good())
    }

    async fn write_same(
        &self,
        cdb: &[u8],
        lba: u64,
        blocks: u64,
        data: Bytes,
        mb: mode::ModeBits,
    ) -> Res {
        let flags = u8_at(cdb, 1);
        let ndob = cdb[0] == WRITE_SAME_16 && flags & 0x01 != 0;
        if flags >> 5 != 0 || flags & 0x10 != 0 {
            return Err(sense::INVALID_FIELD_IN_CDB.into()); // WRPROTECT, ANCHOR
        }
        self.check_range(lba, blocks)?;
        if blocks == 0 || blocks > u64::from(MAX_WRITE_SAME_BLOCKS) {
            return Err(sense::INVALID_FIELD_IN_CDB.into()); // WSNZ
        }
        self.check_writable(mb)?;
        // UNMAP deallocates whatever the pattern (what libiscsi's UnmapUntilEnd expects:
        // it sends 0xFF blocks with UNMAP and reads zeros back under LBPRZ).
        let unmap = flags & 0x08 != 0;
        let zero = ndob || data.iter().all(|&b| b == 0);
        if unmap || zero {
            if unmap {
                self.deallocate(lba, blocks).await?;
            } else {
                let (off, len) = self.bytes_of(lba, blocks);
                let _held = self.write_stripes(lba, blocks).await?;
                self.device
                    .write_zeroes(off, len, IoFlags::empty())
                    .await
                    .map_err(|e| dev_err(e, Access::Write))?;
            }
            return Ok(good());
        }
        let bs = u64::from(self.geometry.block_size());
        let per = (u64::from(self.geometry.max_io()) / bs)
            .min(blocks)
            .min(256);
        let mut chunk = BytesMut::with_capacity((per * bs) as usize);
        for _ in 0..per {
            chunk.extend_from_slice(&data);
        }
        let chunk = chunk.freeze();
        let _held = self.write_stripes(lba, blocks).await?;
        let mut done = 0;
        while done < blocks {
            let n = per.min(blocks - done);
            let (off, len) = self.bytes_of(lba + done, n);
            self.device
                .write(off, chunk.slice(..len as usize), IoFlags::empty())
                .await
                .map_err(|e| dev_err(e, Access::Write))?;
            done += n;
        }
        Ok(good())
    }

    async fn compare_and_write(
        &self,
        cdb: &[u8],
        lba: u64,
        blocks: u64,
        data: Bytes,
        mb: mode::ModeBits,
    ) -> Res {
        if u8_at(cdb, 1) >> 5 != 0 {
            return Err(sense::INVALID_FIELD_IN_CDB.into());
        }
        if blocks == 0 {
            return Ok(good());
        }
        if blocks > u64::from(inquiry::max_caw_blocks(self.geometry)) {
            return Err(sense::INVALID_FIELD_IN_CDB.into());
        }
        self.check_writable(mb)?;
        self.check_range(lba, blocks)?;
        let len = self.bytes_of(lba, blocks).1;
        let len = len as usize;
        if data.len() != 2 * len {
            return Err(sense::INVALID_FIELD_IN_CDB.into());
        }
        self.read_modify_write(cdb, lba, blocks, mb, |current| {
            if let Some(d) = first_difference(current, &data[..len]) {
                return Err(sense::MISCOMPARE_VERIFY.with_information(d as u64).into());
            }
            Ok(data.slice(len..))
        })
        .await
    }

    /// Read `blocks` at `lba`, let `f` make the new contents (or refuse), and write them,
    /// all under the exclusive stripe lock: atomic against every other write through
    /// this LU. FUA when the CDB's FUA bit is set or the write cache is off.
    async fn read_modify_write(
        &self,
        cdb: &[u8],
        lba: u64,
        blocks: u64,
        mb: mode::ModeBits,
        f: impl FnOnce(&[u8]) -> Result<Bytes, Fail>,
    ) -> Res {
        let (off, len) = self.bytes_of(lba, blocks);
        let fua = !mb.wce() || u8_at(cdb, 1) & 0x08 != 0;
        let flags = if fua { IoFlags::FUA } else { IoFlags::empty() };
        // This node's stripes, and their ownership across the pair (peer.rs).
        let admitted = self.peer_link_id();
        let (_held, owned_on) = self.caw_stripes(lba, blocks).await.map_err(|e| {
            tracing::warn!("COMPARE AND WRITE: the other node's grant: {e}");
            // The link changed (NOT READY, retry), the mirror refuses to go on alone
            // (no quorum: NOT READY), or the other node failed the call.
            Fail::Check(sense::from_error(e.kind(), Access::Write))
        })?;
        self.same_link(admitted)?;
        let current = self
            .device
            .read(off, len as usize)
            .await
            .map_err(|e| dev_err(e, Access::Read))?;
        let new = f(&current)?;
        // The link the ownership belongs to (or, alone, the link that was away) must
        // hold until the write has landed: a new link may let the other node write the
        // blocks (its grants went with the old link; alone, nothing was granted).
        let on_link = || owned_on.is_none_or(|link| self.peer_link_id() == link);
        if !on_link() {
            tracing::warn!(
                "COMPARE AND WRITE: the link to the other node changed before its write; refused (retry)"
            );
            return Err(Fail::Check(sense::NOT_READY_TRANSITION));
        }
        self.device
            .write(off, new, flags)
            .await
            .map_err(|e| dev_err(e, Access::Write))?;
        // Changed during the write: the other node may have written the blocks since,
        // while this node's write may still land later (a write held across a
        // reconnect), so the COMPARE AND WRITE cannot count as atomic.
        if !on_link() {
            tracing::warn!(
                "COMPARE AND WRITE: the link to the other node changed while it ran; reported as failed (its write may have landed)"
            );
            return Err(Fail::Check(sense::INTERNAL_FAILURE));
        }
        Ok(good())
    }

    /// ORWRITE(16) (SBC-3 5.8): each block becomes itself OR the data-out, atomic
    /// against every other write through this LU (the COMPARE AND WRITE lock). No
    /// protection information: ORPROTECT must be 0; BMOP (byte 14) must be 0 (the plain
    /// OR operation).
    async fn or_write(
        &self,
        cdb: &[u8],
        lba: u64,
        blocks: u64,
        data: Bytes,
        mb: mode::ModeBits,
    ) -> Res {
        if u8_at(cdb, 1) >> 5 != 0 || u8_at(cdb, 14) & 0x07 != 0 {
            return Err(sense::INVALID_FIELD_IN_CDB.into());
        }
        self.check_writable(mb)?;
        self.check_range(lba, blocks)?;
        if blocks == 0 {
            return Ok(good());
        }
        if data.len() as u64 != self.bytes_of(lba, blocks).1 {
            return Err(sense::INVALID_FIELD_IN_CDB.into());
        }
        self.read_modify_write(cdb, lba, blocks, mb, |current| {
            let merged: Vec<u8> = current
                .iter()
                .zip(data.iter())
                .map(|(a, b)| a | b)
                .collect();
            Ok(Bytes::from(merged))
        })
        .await
    }

    /// GET LBA STATUS: without an allocation map, a block that reads as zeros is
    /// reported deallocated (LBPRZ makes the two indistinguishable) and any other block
    /// mapped. At most 1 MiB past the LBA is looked at; the descriptors say how far.
    pub(super) async fn get_lba_status(&self, cdb: &[u8]) -> Res {
        let lba = be64(cdb, 2);
        let alloc = be32(cdb, 10) as usize;
        if lba >= self.blocks() {
            return Err(sense::LBA_OUT_OF_RANGE.into());
        }
        let bs = u64::from(self.geometry.block_size());
        let span = ((1u64 << 20) / bs)
            .min(u64::from(self.geometry.max_io()) / bs)
            .max(1);
        let n = span.min(self.blocks() - lba);
        let max_desc = (alloc.saturating_sub(8) / 16).max(1);
        let mut runs: Vec<(u64, u32, u8)> = Vec::new();
        self.read_pieces(lba, n, |at, piece| {
            for (i, blk) in piece.chunks(bs as usize).enumerate() {
                let b = lba + at / bs + i as u64;
                let status = u8::from(blk.iter().all(|&x| x == 0));
                match runs.last_mut() {
                    Some((_, count, s)) if *s == status => *count = count.saturating_add(1),
                    _ => runs.push((b, 1, status)),
                }
            }
            Ok(())
        })
        .await?;
        runs.truncate(max_desc);
        let mut out = Vec::with_capacity(8 + runs.len() * 16);
        out.extend_from_slice(&((runs.len() * 16 + 4) as u32).to_be_bytes());
        out.extend_from_slice(&[0; 4]);
        for (b, count, status) in runs {
            out.extend_from_slice(&b.to_be_bytes());
            out.extend_from_slice(&count.to_be_bytes());
            out.extend_from_slice(&[status, 0, 0, 0]);
        }
        Ok(good_data(out))
    }
}
