//! The replication wire format: [`Message`]s as framed, checksummed bytes.
//!
//! Every byte-stream transport (TCP today; shared-memory rings and others later) uses
//! this one codec; an in-process transport passes `Message` values without it, but
//! still checks them with the same [`validate`].
//!
//! # Frame layout (wire version 1)
//!
//! ```text
//!  offset  size  field      value
//!  ------  ----  ---------  ------------------------------------------------------
//!       0     4  magic      0x56535250 ("VSRP")
//!       4     1  version    1 (WIRE_VERSION)
//!       5     1  kind       what the frame holds, see below
//!       6     2  flags      reserved, 0
//!       8     4  meta_len   bytes of meta that follow the header, <= 64 KiB
//!      12     4  data_len   bytes of data that follow the meta, <= 64 MiB
//!      16     4  crc32      crc32 (IEEE, as crc32fast computes it) of header bytes
//!                           0..16, then the meta, then the data
//!      20     -  meta       a protobuf message (proto/replica.proto), by kind
//!       -     -  data       raw bytes: write, read or resync data, never re-encoded;
//!                           or a resync bitmap's runs
//! ```
//!
//! Integers in the header are big-endian; the only integers in a data section, a
//! `SyncBitmap`'s runs, are little-endian. The frame's length is `20 + meta_len +
//! data_len`; frames follow each other with no padding.
//!
//! | kind | message              | meta (replica.proto)     | data            |
//! |------|----------------------|--------------------------|-----------------|
//! | 1    | `Hello`              | `Hello`                  | none            |
//! | 2    | `Welcome`            | none (meta_len 0)        | none            |
//! | 3    | `Refuse`             | `Refuse`                 | none            |
//! | 4    | `Write`              | `Write`                  | the bytes when `op` is DATA, else none |
//! | 5    | `WriteAck`           | `Reply`                  | none            |
//! | 6    | `Flush`              | `Token`                  | none            |
//! | 7    | `FlushAck`           | `Reply`                  | none            |
//! | 8    | `Read`               | `Read`                   | none            |
//! | 9    | `ReadReply`          | `Reply`                  | the bytes read (none on failure) |
//! | 10   | `Ping`               | `Token`                  | none            |
//! | 11   | `Pong`               | `Token`                  | none            |
//! | 12   | `SyncBitmap`         | `SyncBitmap`             | the runs: `runs` pairs of little-endian u64 (first chunk, count), 16 bytes each |
//! | 13   | `SyncData`           | `SyncData`               | the bytes (never empty) |
//! | 14   | `SyncAck`            | `SyncAck`                | none            |
//! | 15   | `SyncCrc`            | `SyncCrc`                | none            |
//! | 16   | `SyncCrcReply`       | `SyncCrcReply`           | none            |
//! | 17   | `SyncCheckpoint`     | `Token`                  | none            |
//! | 18   | `SyncCheckpointAck`  | `Reply`                  | none            |
//! | 19   | `SyncDone`           | `SyncDone`               | none            |
//! | 20   | `SyncRequest`        | `SyncRequest`            | none            |
//! | 21   | `ReplicaDetached`    | `ReplicaDetached`        | none            |
//! | 22   | `Scsi`               | `Token` (the call id)    | the call's body (may be empty) |
//! | 23   | `ScsiReply`          | `Reply`                  | the answer's body (none on failure) |
//! | 64   | transport: auth challenge | `AuthChallenge`     | none            |
//! | 65   | transport: auth response  | `AuthResponse`      | none            |
//! | 66   | transport: `LaneSeq` | `Token` (the sequence number) | none |
//! | 67   | transport: `LaneJoin` | `LaneJoin`          | none            |
//!
//! Kinds 64 and up belong to the transport (peer authentication before the first
//! `Hello`; lane sequence numbers, see [`transport::lanes`](crate::transport::lanes))
//! and never reach the protocol.
//!
//! A `SyncBitmap` frame's data section is exactly 16 times its meta's `runs` count;
//! the runs are ascending and do not overlap (each starts at or after the previous
//! one's end), and none is empty or ends past `u64::MAX`. The `Generations` in `Hello`
//! and `SyncDone` are required and hold exactly two `history` entries. `Hello`'s
//! `split_brain_policy` is a plain number here; the protocol judges it.
//!
//! # Versioning
//!
//! The header's `version` describes this layout and the meaning of every kind; a
//! decoder refuses any other version, so a change an old peer would misread bumps it.
//! Inside a version, meta messages may gain fields (protobuf skips unknown ones).
//! [`PROTOCOL_VERSION`], carried in `Hello`,
//! versions the protocol's behaviour and is checked by the protocol, not here.
//!
//! # Decoding is total
//!
//! [`decode`] turns any byte string into a message, "need more bytes", or a
//! [`WireError`]; it never panics, and it never allocates more than one frame's
//! declared length, which the limits above bound. The header is checked (magic,
//! version, flags, kind, lengths, data allowed for the kind) as soon as its 20 bytes are
//! there, before waiting for the rest; the crc before the meta is parsed; the decoded
//! message is then checked by [`validate`] as every sent one is. After an error the
//! stream cannot be resynchronised: the link is dropped.
//!
//! Decoded data (of a write, a read reply or resync data) is a zero-copy slice of the
//! receive buffer; a `SyncBitmap`'s runs are parsed into a vector.

mod codec;
mod error;
mod header;
pub mod message;

pub(crate) use codec::{AuthFrame, decode_auth, encode_auth_challenge, encode_auth_response};
pub use codec::{Frame, decode, encode, encode_batch, encode_into, validate};
pub use error::WireError;
pub use header::{HEADER_LEN, Kind, MAGIC, MAX_DATA_LEN, MAX_LANES, MAX_META_LEN, WIRE_VERSION};
pub use message::{
    DiskId, GEN_JUST_CREATED, Generations, Hello, Message, PROTOCOL_VERSION, SplitBrainPolicy,
    Status, WritePayload,
};

/// Types generated from `proto/replica.proto` by prost (see `build.rs`).
#[allow(
    missing_docs,
    missing_debug_implementations,
    clippy::all,
    clippy::pedantic
)]
mod pb {
    include!(concat!(env!("OUT_DIR"), "/vsan.replica.rs"));
}
