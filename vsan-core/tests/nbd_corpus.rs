//! The NBD fuzz corpora as a test: every file committed under `fuzz/corpus/<target>/`
//! (see `fuzz/README.md`) is run through the same check the fuzz target runs
//! (`vsan_core::fuzzing`): a whole client session against the real server over an
//! in-memory pipe, its output compared with a model of the protocol.
//!
//! * `nbd_handshake` files are what a client sends after the greeting, run against a
//!   server of one export and one of two.
//! * `nbd_request` files are a mode byte and a transmission-phase stream, run after a
//!   valid attach.
//!
//! The replay is shown not to be vacuous: the corpora reach every kind of option reply,
//! both ways of attaching, every command's success and every error a request can get,
//! reads of data the session wrote, and every way a session can end. A counting
//! allocator shows no session allocates more than the server's documented limits allow,
//! whatever lengths the client declares.
//!
//! `write_fuzz_seeds` (ignored) writes the seed inputs into the corpus directories; the
//! fuzzer grows and minimises the corpora from there.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use vsan_core::ErrorKind;
use vsan_core::export::nbd::proto::*;
use vsan_core::fuzzing::{
    self, DISK_SIZE, MAX_DISCARD_LEN, MAX_IO, MAX_OPTION_LEN, MAX_WRITE_PAYLOAD, Session,
    attach_prefix, info_data, option_frame,
};

/// The system allocator, recording the largest single allocation made.
struct Counting;

static LARGEST_ALLOCATION: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator, which upholds the
// `GlobalAlloc` contract; the extra work is an atomic update.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's `layout` is passed on as it came.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's `layout` is passed on as it came.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: the caller guarantees `ptr` came from this allocator (that is, from
        // `System`) with `layout`, and that `new_size` is valid for it.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller guarantees `ptr` came from this allocator (from `System`)
        // with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The most any one allocation of a session may take: the receive buffer growing for the
/// largest write the server accepts (which a growing buffer may round up to twice that),
/// the captured output, and slack. A buffer sized from an untrusted length (an option's
/// or a write's 4 GiB) would be far over it.
const ALLOCATION_LIMIT: usize = 2 * MAX_WRITE_PAYLOAD as usize + (1 << 20);

/// Where the fuzz targets' corpora live.
fn corpus_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus")
}

/// Every file of `target`'s committed corpus, sorted by name.
fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    vsan_core::corpus::files(&corpus_root().join(target))
}

/// What replaying one target's corpus gave, summed over its sessions.
#[derive(Debug, Default)]
struct Reach {
    files: usize,
    sessions: usize,
    option_replies: BTreeSet<u32>,
    attached_by: BTreeSet<u32>,
    ends: HashSet<Option<ErrorKind>>,
    /// (command, error) of every reply.
    replies: BTreeSet<(u16, u32)>,
    requests: u64,
    nonzero_read_bytes: u64,
    cut: usize,
}

impl Reach {
    fn add(&mut self, s: &Session) {
        self.sessions += 1;
        self.option_replies
            .extend(s.option_replies.iter().map(|&(_, kind)| kind));
        self.attached_by.extend(s.attached_by);
        self.ends.insert(s.error);
        self.replies.extend(s.replies.iter().copied());
        self.requests += s.requests;
        self.nonzero_read_bytes += s.nonzero_read_bytes;
        self.cut += usize::from(s.cut);
    }
}

/// Both corpora replayed once (shared by the tests below).
fn replayed() -> &'static (Reach, Reach) {
    static REPLAY: OnceLock<(Reach, Reach)> = OnceLock::new();
    REPLAY.get_or_init(|| {
        let started = Instant::now();
        let mut handshake = Reach::default();
        for (path, bytes) in corpus("nbd_handshake") {
            handshake.files += 1;
            for s in vsan_core::corpus::replay(&path, &bytes, fuzzing::check_handshake) {
                handshake.add(&s);
            }
        }
        let mut request = Reach::default();
        for (path, bytes) in corpus("nbd_request") {
            request.files += 1;
            request.add(&vsan_core::corpus::replay(
                &path,
                &bytes,
                fuzzing::check_request,
            ));
        }
        eprintln!(
            "replayed {} + {} corpus files in {:?}",
            handshake.files,
            request.files,
            started.elapsed()
        );
        (handshake, request)
    })
}

#[test]
fn every_committed_corpus_file_passes_its_check() {
    let (handshake, request) = replayed();
    assert!(handshake.files > 0, "no nbd_handshake corpus");
    assert!(request.files > 0, "no nbd_request corpus");
    let largest = LARGEST_ALLOCATION.load(Ordering::Relaxed);
    eprintln!("largest single allocation: {largest} bytes");
    assert!(
        largest <= ALLOCATION_LIMIT,
        "a session allocated {largest} bytes at once"
    );
}

#[test]
fn the_replay_reaches_every_part_of_the_protocol() {
    let (handshake, request) = replayed();

    // Negotiation: every kind of option reply, both ways into transmission, and every
    // way a session ends (an orderly close after ABORT, DISC or the end of input; a
    // client gone mid-option; a broken frame; an unknown export name).
    for kind in [
        REP_ACK,
        REP_SERVER,
        REP_INFO,
        REP_ERR_UNSUP,
        REP_ERR_INVALID,
        REP_ERR_UNKNOWN,
        REP_ERR_TOO_BIG,
    ] {
        assert!(
            handshake.option_replies.contains(&kind),
            "no option reply of type {kind:#x} in {handshake:?}"
        );
    }
    for opt in [OPT_GO, OPT_EXPORT_NAME] {
        assert!(
            handshake.attached_by.contains(&opt),
            "never attached by {opt}"
        );
    }
    for end in [
        None,
        Some(ErrorKind::Closed),
        Some(ErrorKind::Protocol),
        Some(ErrorKind::NotFound),
    ] {
        assert!(handshake.ends.contains(&end), "no session ended {end:?}");
    }

    // Transmission: every command succeeds somewhere and every error a request can get
    // is given; reads return data the session wrote; the connection is dropped for a
    // broken header, mid-stream, somewhere.
    for cmd in [CMD_READ, CMD_WRITE, CMD_FLUSH, CMD_TRIM, CMD_WRITE_ZEROES] {
        assert!(
            request.replies.contains(&(cmd, 0)),
            "command {cmd} never succeeds"
        );
    }
    let errnos: BTreeSet<u32> = request.replies.iter().map(|&(_, e)| e).collect();
    for errno in [EINVAL, ENOSPC, EPERM] {
        assert!(errnos.contains(&errno), "no request got error {errno}");
    }
    assert!(
        request
            .replies
            .iter()
            .any(|&(cmd, _)| cmd > CMD_WRITE_ZEROES),
        "no unknown command"
    );
    assert!(
        request.nonzero_read_bytes > 0,
        "no read returned written data"
    );
    assert!(request.cut > 0, "no session dropped mid-transmission");
    assert!(request.ends.contains(&Some(ErrorKind::Protocol)));
    assert!(request.ends.contains(&None));
    assert!(
        request.requests > 100,
        "only {} requests in the corpus",
        request.requests
    );
}

// ---------------------------------------------------------------------------------------
// Seeds
// ---------------------------------------------------------------------------------------

fn request(kind: u16, flags: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    Request {
        flags,
        kind,
        cookie,
        offset,
        length,
    }
    .encode()
    .to_vec()
}

fn write(cookie: u64, offset: u64, data: &[u8]) -> Vec<u8> {
    let mut out = request(CMD_WRITE, 0, cookie, offset, data.len() as u32);
    out.extend_from_slice(data);
    out
}

fn flags(f: u32) -> Vec<u8> {
    f.to_be_bytes().to_vec()
}

/// A raw option header with a length that need not match what follows.
fn option_head(magic: u64, opt: u32, len: u32) -> Vec<u8> {
    let mut out = magic.to_be_bytes().to_vec();
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
    out
}

/// Every request kind once or more, valid and not, on a writable export.
fn request_mix() -> Vec<u8> {
    let block = |tag: u8| vec![tag; 1024];
    [
        write(1, 0, &block(0xa1)),
        request(CMD_READ, 0, 2, 0, 1024),
        write(3, 8192, &block(0xb2)),
        request(CMD_READ, CMD_FLAG_FUA, 4, 7680, 2048),
        request(CMD_FLUSH, 0, 5, 0, 0),
        request(CMD_TRIM, 0, 6, 0, 1024),
        request(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 7, 8192, 512),
        request(CMD_READ, 0, 8, 0, 16384),
        // Misaligned, zero, over the maximum, past the end.
        request(CMD_READ, 0, 9, 100, 512),
        request(CMD_READ, 0, 10, 0, 0),
        request(CMD_READ, 0, 11, 0, MAX_IO + 512),
        request(CMD_READ, 0, 12, DISK_SIZE - 512, 1024),
        write(13, DISK_SIZE, &block(0xc3)),
        request(CMD_TRIM, 0, 14, u64::MAX - 511, 512),
        request(CMD_WRITE_ZEROES, 0, 15, 0, 0),
        // Unknown commands and flags.
        request(5, 0, 16, 0, 512),
        request(0xffff, 0, 17, 0, 512),
        request(CMD_READ, 0x8000, 18, 0, 512),
        write(19, 0, &block(0))
            .into_iter()
            .enumerate()
            .map(|(i, b)| if i == 4 { 0x40 } else { b })
            .collect(),
        request(CMD_DISC, CMD_FLAG_NO_HOLE, 20, 0, 0),
        request(CMD_DISC, 0, 21, 0, 0),
        // After DISC: never served.
        request(CMD_READ, 0, 22, 0, 512),
    ]
    .concat()
}

/// The seed inputs of each target, by name.
fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    let fixed = FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES;
    let go = |name: &[u8], infos: &[u16]| option_frame(OPT_GO, &info_data(name, infos));
    let info = |name: &[u8], infos: &[u16]| option_frame(OPT_INFO, &info_data(name, infos));
    let all_infos = [
        INFO_EXPORT,
        INFO_NAME,
        INFO_DESCRIPTION,
        INFO_BLOCK_SIZE,
        99,
    ];
    let reads = [
        write(1, 0, &[0x5a; 512]),
        request(CMD_READ, 0, 2, 0, 512),
        request(CMD_DISC, 0, 3, 0, 0),
    ]
    .concat();
    let mut bad_lengths = info_data(b"vol0", &[INFO_NAME]);
    bad_lengths[3] = 9; // the name length runs past the data
    let mut odd_count = info_data(b"vol0", &[INFO_NAME, INFO_BLOCK_SIZE]);
    odd_count.pop();
    let handshake = vec![
        (
            "go-vol0-then-requests",
            [flags(fixed), go(b"vol0", &all_infos), request_mix()].concat(),
        ),
        (
            "go-default-name",
            [flags(fixed), go(b"", &[]), reads.clone()].concat(),
        ),
        (
            "export-name-with-zeroes",
            [
                flags(FLAG_C_FIXED_NEWSTYLE),
                option_frame(OPT_EXPORT_NAME, b"vol0"),
                reads.clone(),
            ]
            .concat(),
        ),
        (
            "export-name-ro",
            [
                flags(fixed),
                option_frame(OPT_EXPORT_NAME, b"ro"),
                write(1, 0, &[1; 512]),
            ]
            .concat(),
        ),
        (
            "list-info-unsupported-abort",
            [
                flags(fixed),
                option_frame(OPT_LIST, &[]),
                info(b"ro", &all_infos),
                info(b"vol0", &[INFO_DESCRIPTION]),
                info(b"nope", &[]),
                option_frame(8, &[]),                       // STRUCTURED_REPLY
                option_frame(5, &[]),                       // STARTTLS
                option_frame(10, &info_data(b"vol0", &[])), // SET_META_CONTEXT
                option_frame(0xdead_beef, b"whatever"),
                option_frame(OPT_ABORT, &[]),
            ]
            .concat(),
        ),
        (
            "malformed-info-and-go",
            [
                flags(fixed),
                option_frame(OPT_LIST, b"x"),
                option_frame(OPT_GO, &bad_lengths),
                option_frame(OPT_INFO, &odd_count),
                option_frame(OPT_GO, &[]),
                go(b"\xff\xfe", &[]),
                go(b"vol0", &[INFO_BLOCK_SIZE]),
            ]
            .concat(),
        ),
        (
            "too-big-then-go-ro",
            [
                flags(fixed),
                option_frame(OPT_LIST, &vec![7; MAX_OPTION_LEN as usize + 1]),
                go(b"ro", &[INFO_NAME]),
                write(1, 0, &[1; 512]),
                request(CMD_TRIM, 0, 2, 0, 512),
                request(CMD_READ, 0, 3, 0, 512),
            ]
            .concat(),
        ),
        (
            "export-name-unknown",
            [flags(fixed), option_frame(OPT_EXPORT_NAME, b"nope")].concat(),
        ),
        (
            "export-name-not-utf8",
            [flags(fixed), option_frame(OPT_EXPORT_NAME, b"\xc3\x28")].concat(),
        ),
        ("unknown-client-flags", flags(0x8000_0001)),
        ("short-flags", vec![0, 0]),
        (
            "length-lies",
            [
                flags(fixed),
                option_head(IHAVEOPT, OPT_GO, 100),
                info_data(b"vol0", &[]),
            ]
            .concat(),
        ),
        (
            "absurd-length",
            [
                flags(fixed),
                option_head(IHAVEOPT, OPT_GO, MAX_DISCARD_LEN + 1),
            ]
            .concat(),
        ),
        (
            "bad-option-magic",
            [flags(fixed), option_head(NBDMAGIC, OPT_LIST, 0)].concat(),
        ),
    ];
    let mut all = Vec::new();
    for (name, bytes) in handshake {
        all.push(("nbd_handshake", name, bytes));
    }
    let request_seeds: Vec<(&str, Vec<u8>)> = vec![
        ("rw-go-mix", [vec![0], request_mix()].concat()),
        ("ro-go-mix", [vec![1], request_mix()].concat()),
        ("rw-export-name-mix", [vec![2], request_mix()].concat()),
        (
            "rw-export-name-zeroes-reads",
            [vec![6], reads.clone()].concat(),
        ),
        (
            "bad-magic-after-requests",
            [
                vec![0],
                write(1, 512, &[9; 1024]),
                request(CMD_READ, 0, 2, 0, 2048),
                vec![0; 28],
                request(CMD_READ, 0, 3, 0, 512),
            ]
            .concat(),
        ),
        (
            "write-beyond-any-limit",
            [
                vec![0],
                request(CMD_FLUSH, 0, 1, 0, 0),
                request(CMD_WRITE, 0, 2, 0, MAX_WRITE_PAYLOAD + 1),
            ]
            .concat(),
        ),
        (
            "write-cut-short",
            [
                vec![0],
                request(CMD_READ, 0, 1, 0, 512),
                request(CMD_WRITE, 0, 2, 0, 4096),
                vec![1; 100],
            ]
            .concat(),
        ),
        (
            "header-cut-short",
            [vec![0], request(CMD_FLUSH, 0, 1, 0, 0), vec![0x25, 0x60]].concat(),
        ),
        (
            "many-reads",
            [
                vec![0],
                write(1, 0, &(0..=255u8).cycle().take(2048).collect::<Vec<_>>()),
                (0..32)
                    .flat_map(|i| request(CMD_READ, 0, 2 + i, i * 512, 1024))
                    .collect(),
            ]
            .concat(),
        ),
    ];
    for (name, bytes) in request_seeds {
        all.push(("nbd_request", name, bytes));
    }
    all
}

#[test]
fn the_seeds_pass_their_checks() {
    for (target, name, bytes) in seeds() {
        match target {
            "nbd_handshake" => {
                let sessions = fuzzing::check_handshake(&bytes);
                assert_eq!(sessions.len(), 2, "{name}");
            }
            _ => {
                let s = fuzzing::check_request(&bytes);
                assert!(s.error.is_none() || s.cut, "{name}: {s:?}");
            }
        }
    }
}

#[test]
#[ignore = "writes into the source tree; run by hand to seed the fuzz corpus"]
fn write_fuzz_seeds() {
    for (target, name, bytes) in seeds() {
        let dir = corpus_root().join(target);
        std::fs::create_dir_all(&dir).expect("create the corpus directory");
        std::fs::write(dir.join(format!("seed-{name}")), bytes).expect("write a seed");
    }
}

#[test]
fn attach_prefix_attaches_every_way() {
    for mode in 0..8u8 {
        let s = fuzzing::check_session(&[fuzzing::VOL0], &attach_prefix(mode));
        let by = if mode & 2 != 0 {
            OPT_EXPORT_NAME
        } else {
            OPT_GO
        };
        assert_eq!(s.attached_by, Some(by), "mode {mode}");
        assert_eq!(s.error, None, "mode {mode}");
    }
}

// ---------------------------------------------------------------------------------------
// Regressions: inputs that broke a check, and what the check says about them now
// ---------------------------------------------------------------------------------------

/// An `NBD_OPT_EXPORT_NAME` over the server's 16 KiB option limit. The server answered it
/// with an `NBD_REP_ERR_TOO_BIG` option reply, but no option reply may answer EXPORT_NAME
/// (the client reads the 8-byte export size next, and would take the reply's magic for
/// it): the spec has the server close instead, as it does for an unknown name. Found by
/// the model's rule for EXPORT_NAME on this hand-made input (the fuzzer, limited to
/// mutating the one 17 KiB seed, did not reach it in its runs).
#[test]
fn an_export_name_over_the_option_limit_closes_instead_of_an_option_reply() {
    let mut input = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    input.extend_from_slice(&option_head(IHAVEOPT, OPT_EXPORT_NAME, MAX_OPTION_LEN + 1));
    input.extend_from_slice(&vec![b'a'; MAX_OPTION_LEN as usize + 1]);
    for s in fuzzing::check_handshake(&input) {
        assert_eq!(s.error, Some(ErrorKind::Protocol));
        assert!(s.option_replies.is_empty(), "{s:?}");
    }
}
