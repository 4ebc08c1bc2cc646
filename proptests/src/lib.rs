//! Model-based property tests of vsan (the tests live in `tests/`); this library holds the
//! reference model they compare against.
//!
//! [`DiskModel`] is the simplest thing that can be called a disk with a volatile write
//! cache: one register per logical block, holding
//!
//! ```text
//!   durable   what the block holds after a power cut that loses every unflushed write
//!   volatile  what a read returns now
//!   unflushed values written since the block was last durable, oldest first
//! ```
//!
//! A flush closes an epoch: every register's `volatile` becomes `durable` and `unflushed`
//! is cleared. A FUA write makes just its own blocks durable. After a power cut that may
//! keep any part of the unflushed writes (a torn cut), a block must hold its `durable`
//! value or one of its `unflushed` values — never bytes that were not written to it, never
//! a mix of two values within one block, and never an older value on top of FUA data.
//!
//! The model also decides, independently of `Geometry::validate`, which requests are bad
//! input and with which [`ErrorKind`]: a test that only compared a device with its own
//! validation would prove nothing.
#![deny(missing_docs)]

use vsan_core::ErrorKind;

pub mod sim;

/// One logical block of the model.
#[derive(Debug, Clone)]
struct Register {
    durable: Vec<u8>,
    volatile: Vec<u8>,
    unflushed: Vec<Vec<u8>>,
}

/// The reference model of a block device with a volatile write cache.
#[derive(Debug, Clone)]
pub struct DiskModel {
    block_size: u64,
    max_io: u64,
    blocks: Vec<Register>,
    epoch: u64,
}

impl DiskModel {
    /// A zero-filled, fully durable disk of `size` bytes (a multiple of `block_size`) that
    /// accepts reads and writes of at most `max_io` bytes.
    pub fn new(size: u64, block_size: u32, max_io: u32) -> DiskModel {
        let bs = u64::from(block_size);
        assert!(size % bs == 0, "model size must be whole blocks");
        let zero = Register {
            durable: vec![0; bs as usize],
            volatile: vec![0; bs as usize],
            unflushed: Vec::new(),
        };
        DiskModel {
            block_size: bs,
            max_io: u64::from(max_io),
            blocks: vec![zero; (size / bs) as usize],
            epoch: 0,
        }
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.blocks.len() as u64 * self.block_size
    }

    /// The logical block size.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// How many flushes (epochs) have completed.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// What a device must answer to a request at `offset` of `len` bytes: `Ok` or the kind
    /// of error. `payload` is true for reads and writes, which also have a maximum size.
    ///
    /// The order matters only when a request is bad in two ways; it follows the documented
    /// order: zero length, maximum size, alignment, range.
    pub fn check(&self, payload: bool, offset: u64, len: u64) -> Result<(), ErrorKind> {
        if len == 0 || (payload && len > self.max_io) {
            return Err(ErrorKind::InvalidArgument);
        }
        if offset % self.block_size != 0 || len % self.block_size != 0 {
            return Err(ErrorKind::InvalidArgument);
        }
        if u128::from(offset) + u128::from(len) > u128::from(self.size()) {
            return Err(ErrorKind::OutOfRange);
        }
        Ok(())
    }

    /// A read: the volatile contents of the range.
    pub fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, ErrorKind> {
        self.check(true, offset, len)?;
        let mut out = Vec::with_capacity(len as usize);
        for b in self.block_range(offset, len) {
            out.extend_from_slice(&self.blocks[b].volatile);
        }
        Ok(out)
    }

    /// A write of `data`; with `fua` its blocks are durable at once.
    pub fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), ErrorKind> {
        self.check(true, offset, data.len() as u64)?;
        let bs = self.block_size as usize;
        for (i, b) in self.block_range(offset, data.len() as u64).enumerate() {
            self.set(b, &data[i * bs..(i + 1) * bs], fua);
        }
        Ok(())
    }

    /// A discard: the range reads as zeros afterwards (and is not durable until flushed).
    pub fn discard(&mut self, offset: u64, len: u64) -> Result<(), ErrorKind> {
        self.zero(offset, len, false)
    }

    /// A write of zeros; with `fua` durable at once.
    pub fn write_zeroes(&mut self, offset: u64, len: u64, fua: bool) -> Result<(), ErrorKind> {
        self.zero(offset, len, fua)
    }

    /// A flush: everything written so far becomes durable; a new epoch begins.
    pub fn flush(&mut self) {
        for r in &mut self.blocks {
            r.durable.clone_from(&r.volatile);
            r.unflushed.clear();
        }
        self.epoch += 1;
    }

    /// The whole disk as a read would see it now.
    pub fn volatile_image(&self) -> Vec<u8> {
        self.blocks
            .iter()
            .flat_map(|r| r.volatile.clone())
            .collect()
    }

    /// The whole disk as a power cut that drops every unflushed write would leave it.
    pub fn durable_image(&self) -> Vec<u8> {
        self.blocks.iter().flat_map(|r| r.durable.clone()).collect()
    }

    /// How many blocks hold data a power cut could lose.
    pub fn unflushed_blocks(&self) -> usize {
        self.blocks
            .iter()
            .filter(|r| !r.unflushed.is_empty())
            .count()
    }

    /// A power cut that lost every unflushed write: the disk is its durable image.
    pub fn power_cut_drop(&mut self) {
        for r in &mut self.blocks {
            r.volatile.clone_from(&r.durable);
            r.unflushed.clear();
        }
    }

    /// A power cut that kept every write: the disk is its volatile image, all durable.
    pub fn power_cut_keep(&mut self) {
        self.flush();
    }

    /// Whether `image` (the whole disk, read after a power cut that may keep any part of
    /// the unflushed writes) is a state the model allows: each block holds its durable
    /// value or one of the values written to it since. Err names the first block that
    /// does not.
    pub fn check_torn(&self, image: &[u8]) -> Result<(), String> {
        if image.len() as u64 != self.size() {
            return Err(format!(
                "image of {} bytes, disk of {}",
                image.len(),
                self.size()
            ));
        }
        let bs = self.block_size as usize;
        for (b, (r, got)) in self.blocks.iter().zip(image.chunks(bs)).enumerate() {
            if got != r.durable.as_slice() && !r.unflushed.iter().any(|v| v.as_slice() == got) {
                return Err(format!(
                    "block {b} holds neither its durable value nor any of the {} values \
                     written to it since (first bytes {:02x?})",
                    r.unflushed.len(),
                    &got[..got.len().min(16)]
                ));
            }
        }
        Ok(())
    }

    /// After a torn power cut: take `image` (already accepted by
    /// [`check_torn`](Self::check_torn)) as the new, fully durable state.
    pub fn adopt(&mut self, image: &[u8]) {
        let bs = self.block_size as usize;
        for (r, got) in self.blocks.iter_mut().zip(image.chunks(bs)) {
            r.durable = got.to_vec();
            r.volatile = got.to_vec();
            r.unflushed.clear();
        }
    }

    fn zero(&mut self, offset: u64, len: u64, fua: bool) -> Result<(), ErrorKind> {
        self.check(false, offset, len)?;
        let zero = vec![0; self.block_size as usize];
        for b in self.block_range(offset, len) {
            self.set(b, &zero, fua);
        }
        Ok(())
    }

    fn set(&mut self, block: usize, value: &[u8], fua: bool) {
        let r = &mut self.blocks[block];
        r.volatile = value.to_vec();
        if fua {
            // Durable now; older unflushed values of this block can never reappear.
            r.durable = value.to_vec();
            r.unflushed.clear();
        } else {
            r.unflushed.push(value.to_vec());
        }
    }

    fn block_range(&self, offset: u64, len: u64) -> std::ops::Range<usize> {
        let first = (offset / self.block_size) as usize;
        first..first + (len / self.block_size) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_classes() {
        let m = DiskModel::new(64 * 512, 512, 4096);
        assert_eq!(m.check(true, 0, 512), Ok(()));
        assert_eq!(m.check(true, 0, 0), Err(ErrorKind::InvalidArgument));
        assert_eq!(m.check(true, 1, 512), Err(ErrorKind::InvalidArgument));
        assert_eq!(m.check(true, 0, 8192), Err(ErrorKind::InvalidArgument));
        assert_eq!(m.check(false, 0, 8192), Ok(()));
        assert_eq!(m.check(false, 512, 64 * 512), Err(ErrorKind::OutOfRange));
        assert_eq!(
            m.check(true, u64::MAX - 511, 512),
            Err(ErrorKind::OutOfRange)
        );
    }

    #[test]
    fn fua_and_flush_epochs() {
        let mut m = DiskModel::new(4 * 512, 512, 4096);
        m.write(0, &[1; 1024], false).unwrap();
        m.write(0, &[2; 512], true).unwrap();
        assert_eq!(m.unflushed_blocks(), 1);
        let mut torn = m.volatile_image();
        torn[512..1024].fill(0); // block 1 lost its unflushed write: allowed
        assert!(m.check_torn(&torn).is_ok());
        torn[..512].fill(1); // block 0 shows the write older than its FUA data: not allowed
        assert!(m.check_torn(&torn).is_err());
        let mut crashed = m.clone();
        crashed.power_cut_drop();
        assert_eq!(
            crashed.read(0, 1024).unwrap(),
            [[2; 512], [0; 512]].concat()
        );
        m.flush();
        m.power_cut_drop();
        assert_eq!(m.read(0, 1024).unwrap(), [[2; 512], [1; 512]].concat());
        assert_eq!(m.epoch(), 1);
    }
}
