//! Recovery scan: walk the log from the tail and find where the persisted records end.

use super::{FormatError, HEADER_LEN, RECORD_ALIGN, RecordHeader, check_log_len, decode_header};

/// Where a [`scan`] ended and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScanEnd {
    /// The position after the last record accepted (the tail when none was): where the
    /// next append goes.
    pub head: u64,
    /// The sequence number the next record takes.
    pub next_seq: u64,
    /// Why the scan stopped at `head`.
    pub stopped: StopReason,
}

/// Why a [`scan`] stopped. All but [`BadLog`](StopReason::BadLog) are the ordinary end of
/// a log after a crash; they say what lies at `head`, for logs and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    /// The bytes at `head` are not a record header: unwritten (zero) space, a torn
    /// header, or the middle of an older record.
    BadHeader(FormatError),
    /// A sound header with another sequence number: a record from an earlier lap.
    StaleSeq {
        /// The seq the next record must carry.
        expected: u64,
        /// The seq found.
        found: u64,
    },
    /// A sound header whose data does not match its crc: a torn data write.
    DataCrc {
        /// The crc in the header.
        stored: u32,
        /// The crc of the data found.
        computed: u32,
    },
    /// A sound header for a record that would straddle the end of the log region, which
    /// no writer produces.
    Straddles {
        /// The record's length.
        len: u64,
    },
    /// The next record would end past `tail + log_len`: the scan has gone round the whole
    /// log (or past the last position a `u64` holds, which no writer reaches).
    FullCircle,
    /// The arguments do not describe a log (`log.len() != log_len`, a `log_len` that
    /// [`check_log_len`](super::check_log_len) refuses, a `tail` not a multiple of 64);
    /// nothing was scanned.
    BadLog(FormatError),
}

/// Walks the log region `log` from position `tail`, expecting sequence number `tail_seq`
/// there, and calls `visit(pos, header, data)` for each record accepted, in log order.
/// WRAP records and FLUSH marks are visited too (with empty data).
///
/// A record is accepted when its header decodes (magic, header crc, flags), its seq is
/// the one expected, it does not straddle the end of the region, it ends no later than
/// `tail + log_len`, and its data matches its data crc. The scan stops at the first record
/// that is not, and returns where that is; WRAP records send it on to the next lap.
///
/// It reads only `log[..log_len]`, visits each position at most once, and never panics.
pub fn scan(
    log: &[u8],
    log_len: u64,
    tail: u64,
    tail_seq: u64,
    mut visit: impl FnMut(u64, &RecordHeader, &[u8]),
) -> ScanEnd {
    let end = |head, next_seq, stopped| ScanEnd {
        head,
        next_seq,
        stopped,
    };
    if let Err(e) = check_log_len(log_len) {
        return end(tail, tail_seq, StopReason::BadLog(e));
    }
    if log.len() as u64 != log_len {
        let e = FormatError::BadGeometry(format!(
            "log buffer of {} bytes for a log of {log_len}",
            log.len()
        ));
        return end(tail, tail_seq, StopReason::BadLog(e));
    }
    if tail % RECORD_ALIGN != 0 {
        return end(
            tail,
            tail_seq,
            StopReason::BadLog(FormatError::MisalignedPosition(tail)),
        );
    }
    // Positions past u64::MAX cannot be written, so saturating is exact enough here.
    let limit = tail.saturating_add(log_len);
    let (mut pos, mut seq) = (tail, tail_seq);
    loop {
        let off = pos % log_len;
        // `off` is a multiple of 64 below `log_len`: the header is inside the region.
        let off_us = off as usize;
        if pos.saturating_add(HEADER_LEN as u64) > limit {
            return end(pos, seq, StopReason::FullCircle);
        }
        let h = match decode_header(&log[off_us..off_us + HEADER_LEN]) {
            Ok(h) => h,
            Err(e) => return end(pos, seq, StopReason::BadHeader(e)),
        };
        if h.seq != seq {
            return end(
                pos,
                seq,
                StopReason::StaleSeq {
                    expected: seq,
                    found: h.seq,
                },
            );
        }
        let (len, next) = if h.is_wrap() {
            (HEADER_LEN as u64, (pos - off).checked_add(log_len))
        } else {
            let len = h.stored_len();
            if off + len > log_len {
                return end(pos, seq, StopReason::Straddles { len });
            }
            (len, pos.checked_add(len))
        };
        // A record that would end past the last position a u64 holds was never written.
        let Some(next) = next.filter(|&n| n <= limit) else {
            return end(pos, seq, StopReason::FullCircle);
        };
        let data_at = off_us + HEADER_LEN;
        // Bounded by the straddle check; 0 for WRAP and FLUSH.
        let data = &log[data_at..data_at + h.data_len() as usize];
        let computed = crc32fast::hash(data);
        if computed != h.data_crc {
            return end(
                pos,
                seq,
                StopReason::DataCrc {
                    stored: h.data_crc,
                    computed,
                },
            );
        }
        debug_assert!(len <= next - pos);
        visit(pos, &h, data);
        pos = next;
        seq = seq.wrapping_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{CACHE_BLOCK, MIN_LOG_LEN, encode_header, place, record_len};

    const LOG: u64 = MIN_LOG_LEN; // 16 blocks

    /// A record as the scan should visit it.
    #[derive(Clone, PartialEq, Eq)]
    struct Seen {
        pos: u64,
        header: RecordHeader,
        data: Vec<u8>,
    }

    impl std::fmt::Debug for Seen {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            // The data is kilobytes of one byte; its crc is in the header.
            write!(
                f,
                "@{} {:?} ({} data bytes)",
                self.pos,
                self.header,
                self.data.len()
            )
        }
    }

    /// Appends records into a log buffer the way the cache will: `place`, then a WRAP if
    /// needed, then the record. No space accounting: tests choose what they overwrite.
    struct Writer {
        log: Vec<u8>,
        pos: u64,
        seq: u64,
        written: Vec<Seen>,
    }

    impl Writer {
        fn new(log_len: u64, tail: u64, tail_seq: u64) -> Writer {
            Writer {
                log: vec![0; log_len as usize],
                pos: tail,
                seq: tail_seq,
                written: Vec::new(),
            }
        }

        fn put(&mut self, pos: u64, h: RecordHeader, data: &[u8]) {
            let off = (pos % self.log.len() as u64) as usize;
            self.log[off..off + HEADER_LEN].copy_from_slice(&encode_header(&h));
            self.log[off + HEADER_LEN..off + HEADER_LEN + data.len()].copy_from_slice(data);
            self.written.push(Seen {
                pos,
                header: h,
                data: data.to_vec(),
            });
        }

        fn take_seq(&mut self) -> u64 {
            self.seq += 1;
            self.seq - 1
        }

        /// Appends a data record of `nblocks` blocks filled with `fill`; returns its position.
        fn append(&mut self, lba: u64, nblocks: u32, fill: u8) -> u64 {
            let data = vec![fill; (nblocks * CACHE_BLOCK) as usize];
            self.append_data(lba, &data)
        }

        fn append_data(&mut self, lba: u64, data: &[u8]) -> u64 {
            let nblocks = (data.len() / CACHE_BLOCK as usize) as u32;
            let p = place(self.pos, nblocks, self.log.len() as u64).unwrap();
            if let Some(w) = p.wrap_at {
                let seq = self.take_seq();
                self.put(w, RecordHeader::wrap(seq), &[]);
            }
            let seq = self.take_seq();
            let h = if nblocks == 0 {
                RecordHeader::flush_mark(seq)
            } else {
                RecordHeader::data(seq, lba, data).unwrap()
            };
            self.put(p.start, h, data);
            self.pos = p.next;
            p.start
        }

        fn flush_mark(&mut self) -> u64 {
            self.append_data(0, &[])
        }

        fn scan(&self, tail: u64, tail_seq: u64) -> (Vec<Seen>, ScanEnd) {
            let mut seen = Vec::new();
            let end = scan(
                &self.log,
                self.log.len() as u64,
                tail,
                tail_seq,
                |pos, h, d| {
                    seen.push(Seen {
                        pos,
                        header: *h,
                        data: d.to_vec(),
                    })
                },
            );
            (seen, end)
        }
    }

    #[test]
    fn scans_records_across_the_wrap() {
        // Start late in the third lap so the records wrap into the fourth.
        let tail = 3 * LOG - 8192;
        let mut w = Writer::new(LOG, tail, 500);
        w.append(10, 1, 0xa1);
        w.flush_mark();
        w.append(11, 2, 0xa2); // does not fit: WRAP, then at 3 * LOG
        w.append(900, 3, 0xa3);
        w.flush_mark();
        w.append(12, 1, 0xa4);
        let (seen, end) = w.scan(tail, 500);
        assert_eq!(seen, w.written);
        assert!(seen[2].header.is_wrap(), "{:?}", seen[2]);
        assert_eq!(seen[3].pos, 3 * LOG);
        assert_eq!(seen[3].header.lba, 11);
        assert_eq!(seen[3].data, vec![0xa2; 8192]);
        assert_eq!(
            end,
            ScanEnd {
                head: w.pos,
                next_seq: 507,
                stopped: StopReason::BadHeader(FormatError::BadRecordMagic { found: 0 }),
            }
        );
    }

    #[test]
    fn an_empty_log_ends_at_the_tail() {
        let w = Writer::new(LOG, 0, 0);
        let (seen, end) = w.scan(LOG * 5 + 128, 77);
        assert!(seen.is_empty());
        assert_eq!(end.head, LOG * 5 + 128);
        assert_eq!(end.next_seq, 77);
        assert_eq!(
            end.stopped,
            StopReason::BadHeader(FormatError::BadRecordMagic { found: 0 })
        );
    }

    /// Three records, the log cut at the second.
    fn three() -> (Writer, u64) {
        let mut w = Writer::new(LOG, 0, 1);
        w.append(1, 1, 1);
        let second = w.append(2, 2, 2);
        w.append(3, 1, 3);
        (w, second)
    }

    #[test]
    fn stops_at_a_torn_data_byte() {
        let (mut w, second) = three();
        // The last byte of the second record's data never made it.
        let last = (second + record_len(2) - 1) as usize;
        w.log[last] ^= 0xff;
        let (seen, end) = w.scan(0, 1);
        assert_eq!(seen, w.written[..1]);
        assert_eq!(end.head, second);
        assert_eq!(end.next_seq, 2);
        assert!(matches!(end.stopped, StopReason::DataCrc { .. }), "{end:?}");
    }

    #[test]
    fn stops_at_a_torn_header_byte() {
        for at in [0, 9, 28, 40, 63] {
            let (mut w, second) = three();
            w.log[second as usize + at] ^= 0x04;
            let (seen, end) = w.scan(0, 1);
            assert_eq!(seen, w.written[..1], "byte {at}");
            assert_eq!((end.head, end.next_seq), (second, 2), "byte {at}");
            assert!(
                matches!(end.stopped, StopReason::BadHeader(_)),
                "byte {at}: {end:?}"
            );
        }
    }

    #[test]
    fn stops_at_a_record_from_the_previous_lap() {
        // Lap 0 full of records; lap 1 overwrites its start, then the crash.
        let mut w = Writer::new(LOG, 0, 100);
        while w.pos + record_len(1) <= LOG {
            w.append(7, 1, 0x70);
        }
        let lap0 = w.written.len();
        w.pos = LOG;
        let tail_seq = w.seq;
        w.append(8, 1, 0x80);
        w.append(9, 1, 0x90);
        let (seen, end) = w.scan(LOG, tail_seq);
        assert_eq!(seen, w.written[lap0..]);
        assert_eq!(end.head, LOG + 2 * 4160);
        // What lies there is the third record of lap 0, intact but old.
        assert_eq!(
            end.stopped,
            StopReason::StaleSeq {
                expected: tail_seq + 2,
                found: 102
            }
        );
    }

    #[test]
    fn stops_at_zeroed_space_after_a_wrap() {
        let mut w = Writer::new(LOG, LOG - 64, 0);
        w.append(1, 1, 1);
        let (seen, end) = w.scan(LOG - 64, 0);
        assert_eq!(seen.len(), 2);
        assert_eq!(end.head, LOG + 4160);
        assert_eq!(end.next_seq, 2);
        // A torn WRAP leaves the record behind it unreachable.
        w.log[(LOG - 1) as usize] ^= 1;
        let (seen, end) = w.scan(LOG - 64, 0);
        assert!(seen.is_empty());
        assert_eq!((end.head, end.next_seq), (LOG - 64, 0));
    }

    #[test]
    fn stops_after_exactly_one_lap() {
        // Every byte of the log is a valid record in sequence, the last ones wrapping.
        let tail = 5 * LOG + 8 * 4160;
        let mut w = Writer::new(LOG, tail, 1);
        while w.pos + record_len(1) <= tail + LOG {
            w.append(w.seq, 1, w.seq as u8);
        }
        while w.pos < tail + LOG {
            w.flush_mark();
        }
        assert_eq!(w.pos, tail + LOG);
        let (seen, end) = w.scan(tail, 1);
        assert_eq!(seen, w.written);
        assert_eq!(end.head, tail + LOG);
        assert_eq!(end.next_seq, w.seq);
        assert_eq!(end.stopped, StopReason::FullCircle);
    }

    #[test]
    fn stops_before_a_record_that_passes_the_tail() {
        // Records from the tail round to 64 bytes short of it; a sound header sitting
        // there with the expected seq claims a block that would run over the tail.
        let tail = 8192;
        let mut w = Writer::new(LOG, tail, 0);
        while w.pos + 2 * record_len(1) <= tail + LOG {
            w.append(1, 1, 1);
        }
        assert!(w.written.iter().any(|r| r.header.is_wrap()));
        let pos = w.pos;
        assert!(pos + record_len(1) > tail + LOG && pos + 64 <= tail + LOG);
        // Only the header: its data would have overwritten the tail's record.
        let h = RecordHeader::data(w.seq, 2, &[2; 4096]).unwrap();
        let off = (pos % LOG) as usize;
        w.log[off..off + HEADER_LEN].copy_from_slice(&encode_header(&h));
        let (seen, end) = w.scan(tail, 0);
        assert_eq!(seen, w.written);
        assert_eq!((end.head, end.next_seq), (pos, w.seq));
        assert_eq!(end.stopped, StopReason::FullCircle);
    }

    #[test]
    fn never_reads_past_the_log() {
        // A sound header near the end claiming more data than the region holds.
        let mut w = Writer::new(LOG, 0, 0);
        let pos = LOG - 128;
        let h = RecordHeader {
            nblocks: 1000,
            ..RecordHeader::data(0, 0, &[0; 4096]).unwrap()
        };
        w.log[pos as usize..pos as usize + HEADER_LEN].copy_from_slice(&encode_header(&h));
        let end = scan(&w.log, LOG, pos, 0, |_, _, _| panic!("nothing to visit"));
        assert_eq!(end.head, pos);
        assert_eq!(
            end.stopped,
            StopReason::Straddles {
                len: record_len(1000)
            }
        );
        // A u32::MAX-block claim at the very start is refused the same way.
        let h = RecordHeader {
            nblocks: u32::MAX,
            ..h
        };
        w.log[..HEADER_LEN].copy_from_slice(&encode_header(&h));
        let end = scan(&w.log, LOG, 0, 0, |_, _, _| panic!("nothing to visit"));
        assert!(
            matches!(end.stopped, StopReason::Straddles { .. }),
            "{end:?}"
        );
    }

    #[test]
    fn refuses_arguments_that_are_not_a_log() {
        let log = vec![0u8; LOG as usize];
        let no_visit = |_: u64, _: &RecordHeader, _: &[u8]| panic!("nothing to visit");
        for (buf, len, tail) in [
            (&log[..], LOG + 4096, 0),
            (&log[..4096], 4096, 0),
            (&log[..], LOG, 32),
            (&log[..], 0, 0),
        ] {
            let end = scan(buf, len, tail, 9, no_visit);
            assert!(matches!(end.stopped, StopReason::BadLog(_)), "{end:?}");
            assert_eq!((end.head, end.next_seq), (tail, 9));
        }
    }

    #[test]
    fn a_tail_near_the_end_of_positions_does_not_overflow() {
        let tail = u64::MAX - 63;
        let w = Writer::new(LOG, 0, 0);
        let (_, end) = w.scan(tail, 0);
        assert!(matches!(end.stopped, StopReason::BadHeader(_)));
    }

    mod torn_logs {
        //! Random appends over many laps, a power cut during the last few, and a check
        //! that the scan returns exactly the records whose bytes all landed, in order.

        use std::collections::VecDeque;

        use proptest::prelude::*;

        use super::*;

        /// One append: `nblocks` (0 = FLUSH mark), then how many of the oldest records
        /// destage afterwards.
        #[derive(Debug, Clone)]
        struct Op {
            nblocks: u32,
            destage: usize,
        }

        fn op() -> impl Strategy<Value = Op> {
            (prop_oneof![1 => Just(0u32), 6 => 1u32..=5], 0usize..=2)
                .prop_map(|(nblocks, destage)| Op { nblocks, destage })
        }

        /// A record as written: where, what header, all its bytes.
        #[derive(Debug, Clone)]
        struct Rec {
            pos: u64,
            next: u64,
            header: RecordHeader,
            bytes: Vec<u8>,
        }

        fn noise(seed: u64, len: usize) -> Vec<u8> {
            let mut x = seed | 1;
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect()
        }

        struct Model {
            log_len: u64,
            log: Vec<u8>,
            pos: u64,
            seq: u64,
            /// Records in `tail..pos`, oldest first.
            live: VecDeque<Rec>,
            tail: u64,
            tail_seq: u64,
        }

        impl Model {
            fn destage_one(&mut self) {
                if let Some(r) = self.live.pop_front() {
                    self.tail = r.next;
                    self.tail_seq = r.header.seq + 1;
                }
            }

            /// The records for one append (a WRAP first if needed), after destaging to make
            /// room; none when only records not yet persisted are in the way.
            fn records(&mut self, nblocks: u32, data_seed: u64) -> Vec<Rec> {
                let p = place(self.pos, nblocks, self.log_len).unwrap();
                while p.next - self.tail > self.log_len {
                    if self.live.is_empty() {
                        return Vec::new();
                    }
                    self.destage_one();
                }
                let mut out = Vec::new();
                if let Some(w) = p.wrap_at {
                    let h = RecordHeader::wrap(self.seq);
                    out.push(Rec {
                        pos: w,
                        next: p.start,
                        header: h,
                        bytes: encode_header(&h).to_vec(),
                    });
                    self.seq += 1;
                }
                let data = noise(data_seed ^ self.seq, (nblocks * CACHE_BLOCK) as usize);
                let h = if nblocks == 0 {
                    RecordHeader::flush_mark(self.seq)
                } else {
                    RecordHeader::data(self.seq, self.seq % 1000, &data).unwrap()
                };
                let mut bytes = encode_header(&h).to_vec();
                bytes.extend_from_slice(&data);
                out.push(Rec {
                    pos: p.start,
                    next: p.next,
                    header: h,
                    bytes,
                });
                self.seq += 1;
                self.pos = p.next;
                out
            }

            fn write(&mut self, r: &Rec, upto: usize) {
                let off = (r.pos % self.log_len) as usize;
                self.log[off..off + upto].copy_from_slice(&r.bytes[..upto]);
            }

            fn intact(&self, r: &Rec) -> bool {
                let off = (r.pos % self.log_len) as usize;
                self.log[off..off + r.bytes.len()] == r.bytes[..]
            }
        }

        proptest! {
            #[test]
            fn scan_returns_exactly_the_records_that_landed(
                log_blocks in 16u64..=24,
                start_lap in 0u64..4,
                start_slot in 0u64..1024,
                start_seq in 0u64..(u64::MAX / 2),
                garbage_start in any::<bool>(),
                seed in any::<u64>(),
                ops in prop::collection::vec(op(), 1..80),
                in_flight in 1usize..6,
                cut in any::<prop::sample::Index>(),
                landed_anyway in prop::collection::vec(any::<bool>(), 12),
            ) {
                let log_len = log_blocks * 4096;
                let tail = start_lap * log_len + start_slot * 64 % log_len;
                let log = if garbage_start {
                    noise(seed, log_len as usize)
                } else {
                    vec![0; log_len as usize]
                };
                let mut m = Model {
                    log_len,
                    log,
                    pos: tail,
                    seq: start_seq,
                    live: VecDeque::new(),
                    tail,
                    tail_seq: start_seq,
                };
                let settled = ops.len().saturating_sub(in_flight);
                // Appends persisted before the crash.
                for op in &ops[..settled] {
                    for r in m.records(op.nblocks, seed) {
                        m.write(&r, r.bytes.len());
                        m.live.push_back(r);
                    }
                    for _ in 0..op.destage {
                        m.destage_one();
                    }
                }
                // Appends in flight at the crash: their bytes land in order up to the cut;
                // after it some whole records land anyway (the device reordered them).
                let mut flight = Vec::new();
                for op in &ops[settled..] {
                    flight.extend(m.records(op.nblocks, seed));
                }
                let total: usize = flight.iter().map(|r| r.bytes.len()).sum();
                let mut cut = cut.index(total + 1);
                for (i, r) in flight.iter().enumerate() {
                    let n = cut.min(r.bytes.len());
                    cut -= n;
                    if n == r.bytes.len() || landed_anyway[i % landed_anyway.len()] {
                        m.write(r, r.bytes.len());
                    } else {
                        m.write(r, n);
                    }
                }
                m.live.extend(flight);

                let want: Vec<&Rec> = m.live.iter().take_while(|r| m.intact(r)).collect();
                let mut seen = Vec::new();
                let end = scan(&m.log, log_len, m.tail, m.tail_seq, |pos, h, d| {
                    seen.push((pos, *h, d.to_vec()));
                });
                prop_assert_eq!(seen.len(), want.len(), "{:?}", end);
                for ((pos, h, d), r) in seen.iter().zip(&want) {
                    prop_assert_eq!(*pos, r.pos);
                    prop_assert_eq!(h, &r.header);
                    prop_assert_eq!(&d[..], &r.bytes[HEADER_LEN..]);
                }
                let (head, next_seq) = want
                    .last()
                    .map_or((m.tail, m.tail_seq), |r| (r.next, r.header.seq + 1));
                prop_assert_eq!((end.head, end.next_seq), (head, next_seq));
                prop_assert!(!matches!(end.stopped, StopReason::BadLog(_)));
                if want.len() == m.live.len() && head - m.tail == log_len {
                    prop_assert_eq!(end.stopped, StopReason::FullCircle);
                }
            }
        }
    }
}
