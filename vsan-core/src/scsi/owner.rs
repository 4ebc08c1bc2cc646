//! Which node may run a COMPARE AND WRITE on a region without asking the other: the
//! cross-node half of the CAW lock (see [`super::peer`]'s module docs).
//!
//! A CAW must exclude every write to its blocks through both nodes. Within a node the
//! stripe lock ([`super::lock`]) does that. Across the pair a region is at any time
//! *shared* (both nodes write, neither runs a CAW) or *owned* by one node (it runs CAWs
//! there under its own stripe lock alone; the other node's writes there first take the
//! ownership back). Ownership stays with the node that asked for it until the other
//! needs the region, so a node that keeps running CAWs on the same blocks (a VMFS
//! heartbeat, an ATS lock taken through one path) asks once, and each CAW after that
//! costs what a WRITE does, plus a local read.
//!
//! Three calls move it (`Msg::Lock`, `Msg::Revoke` in [`super::peer`]):
//!
//! - **Take** (a CAW on regions this node does not own): the other node takes their
//!   stripes exclusive (so its writes in flight there end first, on both replicas),
//!   gives up its own ownership of them, marks them *granted*, and answers with a grant
//!   number. Its later writes there see the mark and revoke first.
//! - **Revoke** (a write on the granting node into a granted region): the owner takes
//!   the stripes exclusive (its CAW running there ends first) and gives the regions up;
//!   the granting node then clears its mark.
//!
//! Calls may cross (both nodes asking at once, a revoke passing a grant's answer), so
//! every grant carries a number, counted by the node that grants. A node keeps, per
//! stripe, the highest number of the other node's grants that are void here (the other
//! node took them back or asked for them itself since): an answer whose grant is void
//! gives nothing, and the CAW asks again. A node clears its own *granted* mark only
//! when the other node gave up every grant made so far in that stripe. So at every
//! instant a node owns a region only while the other holds it granted, and it gives it
//! up only under its own stripe lock, with no CAW of its own running there. (Numbers
//! and voids are kept per stripe, coarser than the regions: that can only void a grant
//! or keep a mark longer, which costs a call, never exclusion. The marks themselves are
//! per region, so a write that shares a stripe with an owned region elsewhere on the
//! disk pays nothing.)
//!
//! Everything belongs to one mirror link: a node forgets what it owned and granted when
//! the link goes, and a call made on a link older than the newest it has seen changes
//! nothing (its grant is void). A CAW whose link changed while it ran fails, as before
//! (its write may land after what the other node wrote since).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::lock::STRIPES;

/// Regions `first..=last` (see [`super::lock::StripeLock::regions`]).
pub(super) type Regions = (u64, u64);

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct Ownership {
    /// The stripes of the regions granted to the other node, for the write path's one
    /// load (a copy kept by `State`).
    granted_stripes: AtomicU64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The link the rest belongs to (the newest seen).
    link: u64,
    /// Links up to this one are gone (forgotten).
    gone: u64,
    /// Regions this node owns.
    owned: HashSet<u64>,
    /// Regions this node granted to the other.
    granted: HashSet<u64>,
    /// Grant numbers this node gave so far (never reset: a number names one grant; 0
    /// names none).
    counter: u64,
    /// The number of this node's latest grant in each stripe.
    last_grant: [u64; STRIPES],
    /// The other node's grants in each stripe up to this number are void here.
    void_upto: [u64; STRIPES],
}

impl Default for State {
    fn default() -> Self {
        State {
            link: 0,
            gone: 0,
            owned: HashSet::new(),
            granted: HashSet::new(),
            counter: 0,
            last_grant: [0; STRIPES],
            void_upto: [0; STRIPES],
        }
    }
}

fn stripe(region: u64) -> usize {
    (region % STRIPES as u64) as usize
}

/// The stripes of regions `r` (at most one of each).
fn stripes((first, last): Regions) -> impl Iterator<Item = usize> {
    (first..=last.min(first + STRIPES as u64 - 1)).map(stripe)
}

fn within((first, last): Regions, region: u64) -> bool {
    first <= region && region <= last
}

impl State {
    /// The state of link `link`; `None` when that link is older than the newest seen,
    /// or gone (what was made on a newer link must not be undone by a late call).
    fn on(&mut self, link: u64) -> Option<&mut State> {
        if link <= self.gone || link < self.link {
            return None;
        }
        if link > self.link {
            self.link = link;
            self.clear();
        }
        Some(self)
    }

    fn clear(&mut self) {
        self.owned.clear();
        self.granted.clear();
        self.last_grant = [0; STRIPES];
        self.void_upto = [0; STRIPES];
    }

    fn granted_stripes(&self) -> u64 {
        self.granted.iter().fold(0, |m, &r| m | 1 << stripe(r))
    }
}

impl Ownership {
    /// Run `f` on the state of link `link` (`None`: a stale link), then publish the
    /// granted stripes.
    fn at<R>(&self, link: u64, f: impl FnOnce(&mut State) -> R) -> Option<R> {
        let mut st = self.state.lock();
        let r = st.on(link).map(f);
        self.granted_stripes
            .store(st.granted_stripes(), Ordering::Release);
        r
    }

    /// The granted regions among `regions` (stripes `mask`): a write there revokes them
    /// first. Call it under the write's shared stripes (a grant is made under them
    /// exclusive). One load when none of the write's stripes holds a granted region.
    pub(super) fn granted(&self, regions: Regions, mask: u64) -> Option<Regions> {
        if self.granted_stripes.load(Ordering::Acquire) & mask == 0 {
            return None;
        }
        let st = self.state.lock();
        let hit = st.granted.iter().filter(|&&r| within(regions, r));
        let (lo, hi) = hit.fold((u64::MAX, 0), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        (lo <= hi).then_some((lo, hi))
    }

    /// Whether this node owns every region of `regions` on link `link`. Call it under
    /// their stripes' exclusive lock: ownership is given up only under it.
    pub(super) fn owns(&self, (first, last): Regions, link: u64) -> bool {
        self.at(link, |st| (first..=last).all(|r| st.owned.contains(&r)))
            .unwrap_or(false)
    }

    /// Forget everything (the link went).
    pub(super) fn forget(&self) {
        let mut st = self.state.lock();
        st.gone = st.link;
        st.clear();
        self.granted_stripes.store(0, Ordering::Release);
    }

    /// A take or a revoke is about to go out: the number to send with it
    /// (the other node voids this node's grants up to it, in the regions' stripes).
    pub(super) fn sending(&self) -> u64 {
        self.state.lock().counter
    }

    /// The other node asks for `regions` on link `link`, having sent `their_counter`
    /// ([`Self::sending`]): call it under their stripes' exclusive lock. This node
    /// gives up its own ownership of them, voids the other's grants up to
    /// `their_counter`, and grants them; returns the grant's number (0, void, on a
    /// stale link).
    pub(super) fn grant(&self, regions: Regions, their_counter: u64, link: u64) -> u64 {
        self.at(link, |st| {
            st.counter += 1;
            let n = st.counter;
            for r in regions.0..=regions.1 {
                st.owned.remove(&r);
                st.granted.insert(r);
            }
            for s in stripes(regions) {
                st.void_upto[s] = st.void_upto[s].max(their_counter);
                st.last_grant[s] = n;
            }
            n
        })
        .unwrap_or(0)
    }

    /// The answer to a take of `regions` sent on link `link` with `sent`
    /// ([`Self::sending`]): grant number `grant`, and the link is `now`. Returns
    /// whether this node owns the regions now (`false`: the grant is void or the link
    /// changed; ask again).
    ///
    /// Takes that cross (each node granted the other's while its own was out) leave
    /// the regions to the resolver: the other node's grant is void. (The other node
    /// asks holding its own stripes, which its grants wait for, so it never sees a
    /// crossing; the resolver does, when the other node took the regions and gave them
    /// back meanwhile, and then it owns them rightly.)
    pub(super) fn taken(
        &self,
        regions: Regions,
        (sent, grant): (u64, u64),
        (link, now): (u64, u64),
        resolver: bool,
    ) -> bool {
        if now != link {
            return false;
        }
        self.at(link, |st| {
            if stripes(regions).any(|s| grant <= st.void_upto[s]) {
                return false;
            }
            if !resolver && stripes(regions).any(|s| st.last_grant[s] > sent) {
                return false;
            }
            for r in regions.0..=regions.1 {
                st.owned.insert(r);
            }
            // The other node gave up what this node granted it before asking (it did
            // so under its own lock, and voided those grants).
            clear_given_up(st, regions, sent);
            true
        })
        .unwrap_or(false)
    }

    /// The other node revokes `regions` on link `link`, voiding this node's grants up
    /// to `upto`: call it under their stripes' exclusive lock.
    pub(super) fn give_up(&self, regions: Regions, upto: u64, link: u64) {
        self.at(link, |st| {
            st.owned.retain(|&r| !within(regions, r));
            for s in stripes(regions) {
                st.void_upto[s] = st.void_upto[s].max(upto);
            }
        });
    }

    /// The answer to a revoke of `regions` sent on link `link` with `upto`
    /// ([`Self::sending`]), the link now `now`: the regions granted no later than `upto`
    /// are free here.
    pub(super) fn revoked(&self, regions: Regions, upto: u64, (link, now): (u64, u64)) {
        if now != link {
            self.at(now, |_| ());
            return;
        }
        self.at(link, |st| clear_given_up(st, regions, upto));
    }
}

/// The other node gave up every grant of this node up to `upto` in the stripes of
/// `regions`: those of their granted regions whose stripe saw no later grant are free.
fn clear_given_up(st: &mut State, regions: Regions, upto: u64) {
    let last_grant = st.last_grant;
    st.granted
        .retain(|&r| !(within(regions, r) && last_grant[stripe(r)] <= upto));
}

#[cfg(test)]
mod tests {
    use super::*;

    const R0: Regions = (0, 0);
    const ALL: u64 = u64::MAX;

    #[test]
    fn a_take_owns_until_revoked_and_the_grant_stays_marked_until_given_up() {
        let (a, b) = (Ownership::default(), Ownership::default());
        // a asks for region 0 on link 1; b grants.
        let sent = a.sending();
        let g = b.grant(R0, sent, 1);
        assert_eq!(b.granted((0, 100), ALL), Some(R0));
        assert!(a.taken(R0, (sent, g), (1, 1), false));
        assert!(a.owns(R0, 1));
        assert!(!a.owns((0, 1), 1), "region 1 is not owned");
        // Region 64 shares the stripe, not the mark.
        assert_eq!(b.granted((64, 64), 1), None);
        // b writes region 0: revokes.
        let upto = b.sending();
        a.give_up(R0, upto, 1);
        assert!(!a.owns(R0, 1));
        b.revoked(R0, upto, (1, 1));
        assert_eq!(b.granted((0, 100), ALL), None);
    }

    #[test]
    fn a_revoke_that_passes_the_grants_answer_voids_it() {
        let (a, b) = (Ownership::default(), Ownership::default());
        let sent = a.sending();
        let g = b.grant(R0, sent, 1);
        // b revokes before a saw the answer; a gives up (nothing yet).
        let upto = b.sending();
        a.give_up(R0, upto, 1);
        b.revoked(R0, upto, (1, 1));
        assert_eq!(b.granted(R0, ALL), None);
        assert!(
            !a.taken(R0, (sent, g), (1, 1), false),
            "the grant was revoked"
        );
        assert!(!a.owns(R0, 1));
    }

    #[test]
    fn a_revoke_answered_after_a_newer_grant_keeps_the_newer_grant_marked() {
        let (a, b) = (Ownership::default(), Ownership::default());
        let upto = b.sending();
        // a asks again and b grants before the revoke's answer comes back.
        a.give_up(R0, upto, 1);
        let sent = a.sending();
        let g = b.grant(R0, sent, 1);
        assert!(a.taken(R0, (sent, g), (1, 1), false));
        b.revoked(R0, upto, (1, 1));
        assert_eq!(
            b.granted(R0, ALL),
            Some(R0),
            "a owns the region: b's writes must revoke"
        );
    }

    #[test]
    fn crossing_takes_leave_at_most_one_owner() {
        let (a, b) = (Ownership::default(), Ownership::default());
        let sa = a.sending();
        let sb = b.sending();
        // b grants a's take, then a grants b's (each under its own lock).
        let ga = b.grant(R0, sa, 1);
        let gb = a.grant(R0, sb, 1);
        // a is the resolver: b's grant stands, a's is void.
        assert!(a.taken(R0, (sa, ga), (1, 1), true));
        assert!(!b.taken(R0, (sb, gb), (1, 1), false));
        assert_eq!(b.granted(R0, ALL), Some(R0), "b must revoke before writing");
    }

    #[test]
    fn a_new_link_forgets_everything_and_a_stale_call_changes_nothing() {
        let (a, b) = (Ownership::default(), Ownership::default());
        let sent = a.sending();
        let g = b.grant(R0, sent, 1);
        assert!(
            !a.taken(R0, (sent, g), (1, 2), false),
            "answered on another link"
        );
        assert!(a.taken(R0, (sent, g), (1, 1), false));
        assert!(!a.owns(R0, 2));
        assert!(
            !a.owns(R0, 1),
            "link 2 was seen: link 1's ownership is gone"
        );
        // A grant made on link 2, then a late call of link 1: nothing changes.
        assert_ne!(b.grant((3, 3), 0, 2), 0);
        assert_eq!(b.grant(R0, 0, 1), 0, "a stale link's grant is void");
        b.give_up((3, 3), 99, 1);
        b.revoked((3, 3), 99, (1, 1));
        assert_eq!(b.granted((3, 3), ALL), Some((3, 3)));
        b.forget();
        assert_eq!(b.granted((0, 100), ALL), None);
        assert_eq!(b.grant(R0, 0, 2), 0, "link 2 is gone");
        assert_ne!(b.grant(R0, 0, 3), 0);
        b.revoked(R0, 0, (3, 4));
        assert_eq!(b.granted(R0, ALL), None, "another link: nothing granted");
    }
}
