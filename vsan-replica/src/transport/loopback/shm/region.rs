//! The shared memory of a link: a sealed memfd holding the header and both rings, made
//! by the connector and checked and mapped by the acceptor.

use std::fmt;
use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU32, AtomicU64};

use memmap2::{MmapOptions, MmapRaw};
use vsan_core::{Error, ErrorKind, Result};

use super::{
    MAX_RING_SIZE, MIN_RING_SIZE, OFF_CONTROL, OFF_RING_SIZE, SHM_HEADER_LEN, SHM_MAGIC,
    SHM_VERSION, valid_ring_size,
};

/// One ring's place in the mapping.
#[derive(Debug, Clone, Copy)]
pub(super) struct RingGeom {
    /// Offset of its control block.
    pub(super) control: usize,
    /// Offset of its bytes.
    pub(super) data: usize,
    /// Bytes in the ring, a power of two.
    pub(super) size: u64,
}

/// The mapped shared memory of one link: header, control blocks, both rings.
///
/// Invariant: the mapping is at least `SHM_HEADER_LEN + size0 + size1` bytes, the
/// geometries lie inside it, and the file under it cannot shrink (it is sealed), so
/// every offset this type computes stays inside mapped memory.
pub(super) struct Region {
    pub(super) map: MmapRaw,
    pub(super) rings: [RingGeom; 2],
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("len", &self.map.len())
            .field("rings", &self.rings)
            .finish()
    }
}

impl Region {
    /// The connector's side: a fresh sealed memfd with two rings of `ring_size` bytes,
    /// mapped. Returns the file too, to hand to the peer.
    pub(super) fn create(ring_size: usize) -> io::Result<(Region, File)> {
        let size = ring_size as u64;
        let total = SHM_HEADER_LEN as u64 + 2 * size;
        let file = File::from(memfd()?);
        file.set_len(total)?;
        let mut header = [0u8; 32];
        header[0..8].copy_from_slice(&SHM_MAGIC);
        header[8..12].copy_from_slice(&SHM_VERSION.to_ne_bytes());
        header[12..16].copy_from_slice(&(SHM_HEADER_LEN as u32).to_ne_bytes());
        header[16..24].copy_from_slice(&size.to_ne_bytes());
        header[24..32].copy_from_slice(&size.to_ne_bytes());
        file.write_all_at(&header, 0)?;
        add_seals(
            file.as_fd(),
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )?;
        let map = MmapOptions::new().len(total as usize).map_raw(&file)?;
        Ok((Region::new(map, [size, size]), file))
    }

    /// The acceptor's side: checks and maps the memory the peer handed over. The error is
    /// the reason to give the peer.
    pub(super) fn open(file: &File) -> Result<Region> {
        // Only a tmpfs memfd sealed against shrinking, checked before any read: a read of
        // another kind of file may block a runtime thread, and a hugetlbfs page the peer
        // punches out cannot be faulted back in (SIGBUS).
        let seals = get_seals(file.as_fd())
            .map_err(|e| refused(format!("the shared memory is not a sealable memfd: {e}")))?;
        if seals & libc::F_SEAL_SHRINK == 0 {
            return Err(refused("the shared memory is not sealed against shrinking"));
        }
        let mut fs = MaybeUninit::<libc::statfs>::uninit();
        // SAFETY: fstatfs writes a statfs into `fs` on success.
        if unsafe { libc::fstatfs(file.as_raw_fd(), fs.as_mut_ptr()) } < 0 {
            let e = io::Error::last_os_error();
            return Err(os_failure(
                &e,
                format!("cannot statfs the shared memory: {e}"),
            ));
        }
        // SAFETY: initialised by the successful fstatfs.
        let fs_type = unsafe { fs.assume_init() }.f_type;
        if fs_type != libc::TMPFS_MAGIC as _ {
            return Err(refused(format!(
                "the shared memory is not a tmpfs memfd (file system {fs_type:#x})"
            )));
        }
        let mut header = [0u8; 32];
        file.read_exact_at(&mut header, 0)
            .map_err(|e| os_failure(&e, format!("cannot read the shared memory header: {e}")))?;
        if header[0..8] != SHM_MAGIC {
            return Err(refused("bad shared memory magic"));
        }
        let word = |at: usize| u32::from_ne_bytes([0, 1, 2, 3].map(|i| header[at + i]));
        let size_at =
            |at: usize| u64::from_ne_bytes([0, 1, 2, 3, 4, 5, 6, 7].map(|i| header[at + i]));
        let version = word(8);
        if version != SHM_VERSION {
            return Err(refused(format!(
                "shared memory layout version {version}, this side speaks {SHM_VERSION}"
            )));
        }
        let header_len = word(12);
        if header_len as usize != SHM_HEADER_LEN {
            return Err(refused(format!(
                "shared memory header length {header_len}, expected {SHM_HEADER_LEN}"
            )));
        }
        let sizes = OFF_RING_SIZE.map(size_at);
        for (i, s) in sizes.iter().enumerate() {
            if !valid_ring_size(*s) {
                return Err(refused(format!(
                    "ring {i} size {s} is not a power of two between {MIN_RING_SIZE} and \
                     {MAX_RING_SIZE}"
                )));
            }
        }
        let total = SHM_HEADER_LEN as u64 + sizes[0] + sizes[1];
        // The seals were checked first: it cannot shrink, so the size checked next stays
        // true.
        let len = file
            .metadata()
            .map_err(|e| os_failure(&e, format!("cannot stat the shared memory: {e}")))?
            .len();
        if len < total {
            return Err(refused(format!(
                "the shared memory is {len} bytes, its header needs {total}"
            )));
        }
        let map = MmapOptions::new()
            .len(total as usize)
            .map_raw(file)
            .map_err(|e| os_failure(&e, format!("cannot map the shared memory: {e}")))?;
        Ok(Region::new(map, sizes))
    }

    /// `map` must hold the header and both rings of `sizes`.
    pub(super) fn new(map: MmapRaw, sizes: [u64; 2]) -> Region {
        let rings = [
            RingGeom {
                control: OFF_CONTROL[0],
                data: SHM_HEADER_LEN,
                size: sizes[0],
            },
            RingGeom {
                control: OFF_CONTROL[1],
                data: SHM_HEADER_LEN + sizes[0] as usize,
                size: sizes[1],
            },
        ];
        debug_assert!(map.len() >= SHM_HEADER_LEN + (sizes[0] + sizes[1]) as usize);
        Region { map, rings }
    }

    pub(super) fn atomic_u64(&self, offset: usize) -> &AtomicU64 {
        debug_assert!(offset % 8 == 0 && offset + 8 <= SHM_HEADER_LEN);
        // SAFETY: `offset` is one of the fixed control-block offsets, 8-aligned and inside
        // the header page, which is inside the mapping (page-aligned, so the address is
        // 8-aligned) for as long as `self` lives; this process only ever accesses these
        // words atomically.
        unsafe { AtomicU64::from_ptr(self.map.as_mut_ptr().add(offset).cast()) }
    }

    pub(super) fn atomic_u32(&self, offset: usize) -> &AtomicU32 {
        debug_assert!(offset % 4 == 0 && offset + 4 <= SHM_HEADER_LEN);
        // SAFETY: as in `atomic_u64`, for a 4-aligned control-block word.
        unsafe { AtomicU32::from_ptr(self.map.as_mut_ptr().add(offset).cast()) }
    }
}

pub(super) fn memfd() -> io::Result<OwnedFd> {
    // SAFETY: the name is a NUL-terminated string; memfd_create has no other
    // preconditions.
    let fd = unsafe {
        libc::memfd_create(
            c"vsan-shm".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created for us and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(super) fn add_seals(fd: BorrowedFd<'_>, seals: libc::c_int) -> io::Result<()> {
    // SAFETY: F_ADD_SEALS takes an int argument; `fd` is open for the call.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub(super) fn get_seals(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: F_GET_SEALS takes no argument; `fd` is open for the call.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(seals)
}

/// Why the acceptor refuses the memory it was handed: the peer broke the protocol. The
/// text is the reason the peer is told.
fn refused(why: impl Into<String>) -> Error {
    Error::new(ErrorKind::Protocol, why)
}

/// An OS failure while checking the memory, in words the peer is told too.
fn os_failure(e: &io::Error, why: String) -> Error {
    Error::new(ErrorKind::from_io(e), why)
}
