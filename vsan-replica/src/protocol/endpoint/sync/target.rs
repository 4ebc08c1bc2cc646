//! The sync target's side: chunks and checksums from the source written or compared
//! through the apply list (never over its own writes the source has not acknowledged),
//! bits cleared in memory and persisted at each checkpoint, and the end of the pass
//! (the source's generations taken).

use std::time::Instant;

use bytes::Bytes;
use tracing::info;
use vsan_core::ErrorKind;

use super::{ApplyKind, Endpoint, Event, MAX_RUN, MetaWaiter, SyncRole};
use crate::protocol::message::{Generations, Message, Status};
use crate::protocol::ranges::{Range, Ranges, subtract};

impl Endpoint {
    /// Target: a run of chunks from the source.
    pub(super) fn on_sync_data(&mut self, now: Instant, offset: u64, data: Bytes) {
        if matches!(&self.sync, Some(s) if s.role == SyncRole::Source) {
            return self.protocol_violation(now, "resync data sent to the source".into());
        }
        let cs = self.journal.layout().chunk_size();
        let len = data.len() as u64;
        let end = offset.saturating_add(len);
        if self.chunk_of(offset).is_none()
            || len == 0
            || len > MAX_RUN * cs
            || end > self.cfg.size
            || (end % cs != 0 && end != self.cfg.size)
        {
            return self.protocol_violation(now, format!("resync data of {len} bytes at {offset}"));
        }
        if let Some(s) = self.sync.as_mut() {
            s.transferred_bytes += data.len() as u64;
        }
        if self.is_detached() {
            // The source ends its run on this failed ack; this side ends its own
            // too, or it would wait for the rest forever (and an operator's
            // attach, which needs no run going, could never start).
            self.abort_sync(now, "this replica is detached and cannot take the data");
            return self.send(
                now,
                Message::SyncAck {
                    offset,
                    status: Status::Failed(ErrorKind::Io as u32),
                },
            );
        }
        let range = Range::new(offset, len);
        let ranges = subtract(range, &self.unacked_own_ranges());
        if ranges.is_empty() {
            self.clear_synced_range(offset, len);
            return self.send(
                now,
                Message::SyncAck {
                    offset,
                    status: Status::Ok,
                },
            );
        }
        let gate = self.sync.as_ref().map_or(0, |s| s.gate);
        self.push_apply(
            ApplyKind::SyncWrite { offset, data },
            Ranges::from_vec(ranges),
            gate,
        );
    }

    /// Target: the source's checksum of a chunk, to compare with this replica's.
    pub(super) fn on_sync_crc(
        &mut self,
        now: Instant,
        offset: u64,
        len: u32,
        crc: u32,
        verify: bool,
    ) {
        let Some(chunk) = self.chunk_of(offset) else {
            return self.protocol_violation(now, format!("checksum at {offset}"));
        };
        if u64::from(len) != self.chunk_len(chunk) {
            return self.protocol_violation(now, format!("checksum of {len} bytes"));
        }
        if self.is_detached() {
            return self.send(
                now,
                Message::SyncCrcReply {
                    offset,
                    equal: false,
                    verify,
                },
            );
        }
        let range = Range::new(offset, u64::from(len));
        self.push_apply(
            ApplyKind::SyncCompare {
                offset,
                len,
                crc,
                verify,
            },
            smallvec::smallvec![range],
            0,
        );
    }

    /// Target: persist what was received (after a flush) and answer.
    pub(super) fn on_sync_checkpoint(&mut self, id: u64) {
        self.journal.persist_cleared();
        let mgen = self.journal.touch();
        self.journal.wait(mgen, MetaWaiter::CheckpointAck(id));
    }

    /// Target: the pass is done; take the source's generations.
    pub(super) fn on_sync_done(&mut self, now: Instant, generations: Generations) {
        let summary = match self.sync.take() {
            Some(s) if s.role == SyncRole::Target => s.summary(now, true),
            None if self.is_detached() => {
                // The run this node aborted when its replica lost data or was
                // detached: its data is not the source's, it stays inconsistent.
                info!(disk = %self.cfg.disk_name, "resync done on the peer, but this replica is detached: it stays inconsistent");
                return;
            }
            other => {
                self.sync = other;
                return self.protocol_violation(now, "resync done unexpectedly".into());
            }
        };
        self.journal.finish_as_target(generations);
        self.journal.touch();
        info!(
            disk = %self.cfg.disk_name,
            "{} done as target: {} bytes received in {:?}; in sync",
            summary.kind, summary.transferred_bytes, summary.elapsed
        );
        self.last_sync = Some(summary);
        self.events.push_back(Event::SyncEnded(summary));
        if self.cfg.quorum.is_some() {
            self.events.push_back(Event::ReleaseQuorum);
        }
    }

    pub(super) fn chunk_of(&self, offset: u64) -> Option<u64> {
        let cs = self.journal.layout().chunk_size();
        (offset % cs == 0 && offset < self.cfg.size).then_some(offset / cs)
    }

    pub(super) fn chunk_len(&self, chunk: u64) -> u64 {
        self.journal.layout().chunk_range(chunk).1
    }

    /// Target: the chunks of `[offset, offset + len)` hold the source's data.
    pub(super) fn clear_synced_range(&mut self, offset: u64, len: u64) {
        for c in self.journal.layout().chunks_of(offset, len) {
            self.clear_synced(c);
        }
    }

    /// Target: a chunk now holds the source's data (persisted at the next checkpoint).
    pub(super) fn clear_synced(&mut self, chunk: u64) {
        if self.journal.clear_until_checkpoint(chunk) {
            let len = self.chunk_len(chunk);
            if let Some(s) = self.sync.as_mut() {
                s.done_bytes += len;
            }
        }
    }
}
