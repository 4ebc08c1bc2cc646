//! The reconnect decision: given what both replicas announced in their `Hello`, are they
//! in sync, which one is the sync source, did they split, or do they hold unrelated
//! data? Decided in one step, the same way on both nodes (each computes it with the
//! roles swapped, so the answers always mirror each other).
//!
//! The rules, in order (`me` and `peer` are the two announcements):
//! 1. A replica whose resync did not finish (`inconsistent`) is the target, bitmap
//!    based: both bitmaps together still name every chunk left to copy. When its
//!    bitmap marks every chunk (its replica lost data, or a full sync never got going)
//!    the resync compares checksums instead, so only chunks that differ travel. Both
//!    inconsistent: refused, neither holds usable data.
//! 2. Same `current`: both just created → full checksum sync from the lower node id
//!    (or to the node told to discard its data). Otherwise in sync when neither bitmap
//!    holds anything; if one does (crash recovery put activity-log extents there),
//!    those chunks are copied from the node that did not crash (a tie: the lower id).
//! 3. One side just created, the other not: full checksum sync from the other one.
//! 4. `me.bitmap == peer.current`: I went on without the peer and it did not: I am the
//!    source; my bitmap (plus the peer's) says what to copy. Full checksum sync when
//!    that common generation is "just created" (the two never synced, so nothing else
//!    is known to be equal). Mirrored for the peer.
//! 5. Same non-zero `bitmap` but different `current`: both went on alone from the same
//!    point — split brain. Resolved by an operator's "discard my data" on one node or
//!    by the configured automatic policy; otherwise refused on both.
//! 6. The peer's `current` is in my history: my bitmap no longer covers what changed
//!    since, so a full checksum sync from me. Mirrored.
//! 7. Any other shared generation: split brain without a usable bitmap (full sync
//!    when resolved). No shared generation at all: unrelated data, refused.

use super::message::{GEN_JUST_CREATED, Generations, SplitBrainPolicy};

/// One side's announcement, as far as the decision needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Side {
    /// Node id.
    pub node_id: u32,
    /// Generation ids.
    pub generations: Generations,
    /// Chunks its bitmap marks.
    pub dirty_chunks: u64,
    /// Chunks of the disk (the same on both sides once the handshake checked size and
    /// chunk size).
    pub chunks: u64,
    /// Restarted after a crash, activity-log extents in the bitmap.
    pub crashed: bool,
    /// An unfinished sync target.
    pub inconsistent: bool,
    /// The operator asked it to discard its data.
    pub discard_my_data: bool,
}

/// What happens on this link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Nothing to copy.
    InSync,
    /// This node sends; `full`: compare every chunk by checksum instead of trusting the
    /// bitmaps.
    Source {
        /// Full checksum sync.
        full: bool,
    },
    /// This node receives.
    Target {
        /// Full checksum sync.
        full: bool,
    },
    /// Refused, with the reason both operators see.
    Refuse(String),
}

impl Decision {
    fn mirrored(self) -> Decision {
        match self {
            Decision::Source { full } => Decision::Target { full },
            Decision::Target { full } => Decision::Source { full },
            d => d,
        }
    }
}

/// Decide for `me` (see the module docs).
pub fn decide(me: &Side, peer: &Side, policy: SplitBrainPolicy) -> Decision {
    let (a, b) = (me.generations, peer.generations);
    if me.inconsistent && peer.inconsistent {
        // (Both replicas failed, or both were cut off mid-resync.) Only an operator can
        // say which holds the data: the side that discards its own becomes the target
        // of a full resync from the other.
        return match (me.discard_my_data, peer.discard_my_data) {
            (true, false) => Decision::Target { full: true },
            (false, true) => Decision::Source { full: true },
            _ => Decision::Refuse(format!(
                "neither node {} nor node {} holds usable data: both are unfinished sync \
                 targets (or were distrusted after a failure); discard one node's data \
                 (discard-my-data) to resync it in full from the other",
                me.node_id.min(peer.node_id),
                me.node_id.max(peer.node_id)
            )),
        };
    }
    if me.inconsistent {
        return resume(me, peer);
    }
    if peer.inconsistent {
        return resume(peer, me).mirrored();
    }
    if a.current == b.current {
        if a.current == GEN_JUST_CREATED {
            return match tie_break(me, peer) {
                true => Decision::Source { full: true },
                false => Decision::Target { full: true },
            };
        }
        if me.dirty_chunks == 0 && peer.dirty_chunks == 0 {
            return Decision::InSync;
        }
        let me_source = match (me.crashed, peer.crashed) {
            (false, true) => true,
            (true, false) => false,
            _ => tie_break(me, peer),
        };
        return if me_source {
            Decision::Source { full: false }
        } else {
            Decision::Target { full: false }
        };
    }
    if b.current == GEN_JUST_CREATED {
        return Decision::Source { full: true };
    }
    if a.current == GEN_JUST_CREATED {
        return Decision::Target { full: true };
    }
    if a.bitmap != 0 && a.bitmap == b.current {
        return Decision::Source {
            full: a.bitmap == GEN_JUST_CREATED,
        };
    }
    if b.bitmap != 0 && b.bitmap == a.current {
        return Decision::Target {
            full: b.bitmap == GEN_JUST_CREATED,
        };
    }
    if a.bitmap != 0 && a.bitmap == b.bitmap {
        return split_brain(me, peer, policy, a.bitmap == GEN_JUST_CREATED);
    }
    if a.history.contains(&b.current) {
        return Decision::Source { full: true };
    }
    if b.history.contains(&a.current) {
        return Decision::Target { full: true };
    }
    let mine = [a.bitmap, a.history[0], a.history[1]];
    let theirs = [b.bitmap, b.history[0], b.history[1]];
    if mine.iter().any(|g| *g != 0 && theirs.contains(g)) {
        return split_brain(me, peer, policy, true);
    }
    let (lo, hi) = if me.node_id < peer.node_id {
        (me, peer)
    } else {
        (peer, me)
    };
    Decision::Refuse(format!(
        "unrelated data: node {} (generation {:016x}) and node {} (generation {:016x}) share no history; \
         recreate one replica's metadata to make it a new replica",
        lo.node_id, lo.generations.current, hi.node_id, hi.generations.current
    ))
}

/// `target` is an unfinished sync target: it resumes from `source` if `source` holds the
/// data it was syncing from (the same generation, or one that went on from it); a
/// replaced or unrelated peer cannot complete it.
fn resume(target: &Side, source: &Side) -> Decision {
    let (t, s) = (target.generations, source.generations);
    if s.current == t.current || (s.bitmap != 0 && s.bitmap == t.current) {
        // Every chunk marked: most are likely equal (a replica that lost some data), so
        // compare them rather than copy them all.
        let full = target.chunks > 0 && target.dirty_chunks >= target.chunks;
        return Decision::Target { full };
    }
    if s.history.contains(&t.current) || t.current == GEN_JUST_CREATED {
        // (A replica that never finished its first sync holds nothing of its own: any
        // consistent peer fills it in full, also one that moved on since, whose
        // finished first sync leaves "just created" out of its history.)
        return Decision::Target { full: true };
    }
    // The operator gave up this replica's data: any shared history lets it take the
    // peer's in full.
    let shared = |g: &u64| *g != 0 && (*g == s.current || *g == s.bitmap || s.history.contains(g));
    if target.discard_my_data
        && [t.current, t.bitmap, t.history[0], t.history[1]]
            .iter()
            .any(shared)
    {
        return Decision::Target { full: true };
    }
    Decision::Refuse(format!(
        "node {} is an unfinished sync target and node {} does not hold the data it was \
         syncing from (generation {:016x})",
        target.node_id, source.node_id, t.current
    ))
}

/// True when `me` wins a tie (is the source): an operator's discard on the other side,
/// else the lower node id.
fn tie_break(me: &Side, peer: &Side) -> bool {
    match (me.discard_my_data, peer.discard_my_data) {
        (false, true) => true,
        (true, false) => false,
        _ => me.node_id < peer.node_id,
    }
}

fn split_brain(me: &Side, peer: &Side, policy: SplitBrainPolicy, full: bool) -> Decision {
    // Worded and decided as the lower node sees it, so both nodes agree exactly.
    let (lo, hi) = if me.node_id < peer.node_id {
        (me, peer)
    } else {
        (peer, me)
    };
    let report = |why: &str| {
        Decision::Refuse(format!(
            "split brain: node {} changed {} chunks and node {} changed {} chunks while apart; {why}",
            lo.node_id, lo.dirty_chunks, hi.node_id, hi.dirty_chunks
        ))
    };
    match (me.discard_my_data, peer.discard_my_data) {
        (true, false) => return Decision::Target { full },
        (false, true) => return Decision::Source { full },
        (true, true) => return report("both nodes were told to discard their data"),
        (false, false) => {}
    }
    let lo_target = match policy {
        SplitBrainPolicy::Refuse => None,
        SplitBrainPolicy::DiscardZeroChanges => match (lo.dirty_chunks, hi.dirty_chunks) {
            (0, n) if n > 0 => Some(true),
            (n, 0) if n > 0 => Some(false),
            _ => None,
        },
        SplitBrainPolicy::DiscardLeastChanges => match lo.dirty_chunks.cmp(&hi.dirty_chunks) {
            std::cmp::Ordering::Less => Some(true),
            std::cmp::Ordering::Greater => Some(false),
            std::cmp::Ordering::Equal => None,
        },
        SplitBrainPolicy::DiscardNode(id) if id == lo.node_id => Some(true),
        SplitBrainPolicy::DiscardNode(id) if id == hi.node_id => Some(false),
        SplitBrainPolicy::DiscardNode(_) => None,
    };
    let Some(lo_target) = lo_target else {
        return report(&format!(
            "policy {policy} does not decide; resolve with \"discard my data\" on one node"
        ));
    };
    let lo_decision = if lo_target {
        Decision::Target { full }
    } else {
        Decision::Source { full }
    };
    if std::ptr::eq(lo, me) {
        lo_decision
    } else {
        lo_decision.mirrored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(id: u32, current: u64, bitmap: u64, history: [u64; 2], dirty: u64) -> Side {
        Side {
            node_id: id,
            generations: Generations {
                current,
                bitmap,
                history,
            },
            dirty_chunks: dirty,
            chunks: 16,
            crashed: false,
            inconsistent: false,
            discard_my_data: false,
        }
    }

    fn both(a: &Side, b: &Side, p: SplitBrainPolicy) -> Decision {
        let d = decide(a, b, p);
        assert_eq!(
            decide(b, a, p),
            d.clone().mirrored(),
            "asymmetric for {a:?} / {b:?}"
        );
        d
    }

    const P: SplitBrainPolicy = SplitBrainPolicy::Refuse;

    #[test]
    fn the_cases() {
        let fresh1 = side(1, GEN_JUST_CREATED, 0, [0; 2], 0);
        let fresh2 = side(2, GEN_JUST_CREATED, 0, [0; 2], 0);
        assert_eq!(both(&fresh1, &fresh2, P), Decision::Source { full: true });
        let s1 = side(1, 77, 0, [0; 2], 0);
        let s2 = side(2, 77, 0, [0; 2], 0);
        assert_eq!(both(&s1, &s2, P), Decision::InSync);
        // Node 1 went on alone.
        let a1 = side(1, 88, 77, [0; 2], 12);
        assert_eq!(both(&a1, &s2, P), Decision::Source { full: false });
        // Node 2 went on alone.
        let a2 = side(2, 99, 77, [0; 2], 3);
        assert_eq!(both(&s1, &a2, P), Decision::Target { full: false });
        // Both: split brain.
        assert!(matches!(both(&a1, &a2, P), Decision::Refuse(r) if r.contains("split brain")));
        let least = SplitBrainPolicy::DiscardLeastChanges;
        assert_eq!(both(&a1, &a2, least), Decision::Source { full: false });
        assert_eq!(
            both(&a1, &a2, SplitBrainPolicy::DiscardNode(1)),
            Decision::Target { full: false }
        );
        assert!(matches!(
            both(&a1, &a2, SplitBrainPolicy::DiscardZeroChanges),
            Decision::Refuse(_)
        ));
        let z2 = side(2, 99, 77, [0; 2], 0);
        assert_eq!(
            both(&a1, &z2, SplitBrainPolicy::DiscardZeroChanges),
            Decision::Source { full: false }
        );
        let mut d2 = a2;
        d2.discard_my_data = true;
        assert_eq!(both(&a1, &d2, P), Decision::Source { full: false });
        // Unrelated.
        let u = side(2, 5, 6, [7, 8], 0);
        assert!(matches!(both(&a1, &u, P), Decision::Refuse(r) if r.contains("unrelated")));
        // History: node 1 moved on twice.
        let h1 = side(1, 90, 88, [77, 0], 5);
        assert_eq!(both(&h1, &s2, P), Decision::Source { full: true });
        // Crash recovery with equal generations: the node that did not crash is the
        // source.
        let mut c1 = s1;
        c1.crashed = true;
        c1.dirty_chunks = 4;
        assert_eq!(both(&c1, &s2, P), Decision::Target { full: false });
        // Unfinished target: resumes from the node it synced from, not from a replaced
        // or unrelated one.
        let mut i2 = s2;
        i2.inconsistent = true;
        assert_eq!(both(&a1, &i2, P), Decision::Source { full: false });
        assert!(matches!(both(&fresh1, &i2, P), Decision::Refuse(r) if r.contains("unfinished")));
        assert!(matches!(
            both(
                &u,
                &{
                    let mut x = i2;
                    x.node_id = 1;
                    x
                },
                P
            ),
            Decision::Refuse(_)
        ));
        // An unfinished target with every chunk marked (its replica lost data): it
        // resumes by checksum, from a peer that stayed or went on.
        let mut l2 = i2;
        l2.dirty_chunks = l2.chunks;
        assert_eq!(both(&s1, &l2, P), Decision::Source { full: true });
        assert_eq!(both(&a1, &l2, P), Decision::Source { full: true });
        // A replaced replica.
        assert_eq!(both(&a1, &fresh2, P), Decision::Source { full: true });
        // Went on from "just created": full sync.
        let j1 = side(1, 55, GEN_JUST_CREATED, [0; 2], 2);
        assert_eq!(both(&j1, &fresh2, P), Decision::Source { full: true });
    }
}
