//! Which node may run a COMPARE AND WRITE on a stripe without asking the other: the
//! cross-node half of the CAW lock (see [`super::peer`]'s module docs).
//!
//! A CAW must exclude every write to its blocks through both nodes. Within a node the
//! stripe lock ([`super::lock`]) does that. Across the pair a stripe is at any time
//! *shared* (both nodes write, neither runs a CAW) or *owned* by one node (it runs CAWs
//! under its own stripe lock alone; the other node's writes there first take the
//! ownership back). Ownership stays with the node that asked for it until the other
//! needs the stripe, so a node that keeps running CAWs on the same blocks (a VMFS
//! heartbeat, an ATS lock held through one path) asks once, and each CAW after that
//! costs a local read and the mirrored write, as a WRITE does, plus the read.
//!
//! Three calls move it (`Msg::Lock`, `Msg::Revoke` in [`super::peer`]):
//!
//! - **Take** (a CAW where this node does not own the stripe): the other node takes its
//!   stripes exclusive (so its writes in flight there end first, on both replicas),
//!   gives up its own ownership of them, marks them *granted*, and answers with a grant
//!   number. Its later writes there see the mark and revoke first.
//! - **Revoke** (a write on the granting node into a granted stripe): the owner takes
//!   its stripes exclusive (its CAW running there ends first) and gives them up; the
//!   granting node then clears its mark.
//!
//! Calls may cross (both nodes asking at once, a revoke passing a grant's answer), so
//! every grant carries a number, counted by the node that grants. A node keeps, per
//! stripe, the highest number of the other node's grants that are void here (the other
//! node took the stripe back or asked for it itself since): an answer whose grant is
//! void gives nothing, and the CAW asks again. A node clears its own *granted* mark only
//! when the other node gave up every grant made so far for that stripe. So at every
//! instant: a node owns a stripe only while the other holds it granted, and it gives
//! it up only under its own stripe lock, with no CAW of its own running there.
//!
//! Everything belongs to one mirror link: on a new link (or with the link away) a node
//! forgets what it owned and granted. A CAW whose link changed while it ran fails, as
//! before (its write may land after what the other node wrote since).

use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::lock::STRIPES;

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct Ownership {
    /// Stripes this node granted to the other (a copy of `State::granted`, for the
    /// write path's one load).
    granted: AtomicU64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// The link the rest belongs to.
    link: u64,
    /// Stripes this node owns.
    owned: u64,
    /// Stripes this node granted to the other.
    granted: u64,
    /// Grant numbers this node gave so far (never reset: a number names one grant).
    counter: u64,
    /// The number of this node's latest grant of each stripe.
    last_grant: [u64; STRIPES],
    /// The other node's grants of each stripe up to this number are void here.
    void_upto: [u64; STRIPES],
}

impl Default for State {
    fn default() -> Self {
        State {
            link: 0,
            owned: 0,
            granted: 0,
            counter: 0,
            last_grant: [0; STRIPES],
            void_upto: [0; STRIPES],
        }
    }
}

fn stripes(mask: u64) -> impl Iterator<Item = usize> {
    (0..STRIPES).filter(move |s| mask & (1 << s) != 0)
}

impl State {
    /// The state of link `link` (what belonged to another link is forgotten).
    fn on(&mut self, link: u64) -> &mut State {
        if self.link != link {
            self.link = link;
            self.owned = 0;
            self.granted = 0;
            self.last_grant = [0; STRIPES];
            self.void_upto = [0; STRIPES];
        }
        self
    }
}

impl Ownership {
    /// Run `f` on the state of link `link`, then publish `granted`.
    fn at<R>(&self, link: u64, f: impl FnOnce(&mut State) -> R) -> R {
        let mut st = self.state.lock();
        let r = f(st.on(link));
        self.granted.store(st.granted, Ordering::Release);
        r
    }

    /// The stripes of `mask` granted to the other node: a write there revokes them
    /// first ([`Self::revoking`]). One load.
    pub(super) fn granted(&self, mask: u64) -> u64 {
        self.granted.load(Ordering::Acquire) & mask
    }

    /// Whether this node owns every stripe of `mask` on link `link`. Call it under those
    /// stripes' exclusive lock: ownership is given up only under it.
    pub(super) fn owns(&self, mask: u64, link: u64) -> bool {
        self.at(link, |st| st.owned & mask == mask)
    }

    /// Forget everything (the link went).
    pub(super) fn forget(&self) {
        let mut st = self.state.lock();
        let counter = st.counter;
        *st = State {
            counter,
            ..State::default()
        };
        self.granted.store(0, Ordering::Release);
    }

    /// A take is about to go out on link `link`: the number to send with it (this
    /// node's grants up to it become void on the other node).
    pub(super) fn asking(&self, link: u64) -> u64 {
        self.at(link, |st| st.counter)
    }

    /// The other node asks for the stripes of `mask` on link `link`, having sent
    /// `their_counter` ([`Self::asking`]): call it under those stripes' exclusive lock.
    /// This node gives up its own ownership of them, voids the other's grants up to
    /// `their_counter`, and grants them; returns the grant's number.
    pub(super) fn grant(&self, mask: u64, their_counter: u64, link: u64) -> u64 {
        self.at(link, |st| {
            st.counter += 1;
            let n = st.counter;
            st.owned &= !mask;
            st.granted |= mask;
            for s in stripes(mask) {
                st.void_upto[s] = st.void_upto[s].max(their_counter);
                st.last_grant[s] = n;
            }
            n
        })
    }

    /// The answer to a take sent on link `link` with `sent` ([`Self::asking`]): grant
    /// number `grant`, and the link is `now`. Returns whether this node owns the
    /// stripes now (`false`: the grant is void or the link changed; ask again).
    ///
    /// Takes that cross (each node granted the other's while its own was out) leave
    /// the stripes to the resolver: the other node's grant is void. (The other node
    /// asks holding its own stripes, which its grants wait for, so it never sees a
    /// crossing; the resolver does, when the other node took the stripes and gave them
    /// back meanwhile, and then it owns them rightly.)
    pub(super) fn taken(
        &self,
        mask: u64,
        sent: u64,
        grant: u64,
        (link, now): (u64, u64),
        resolver: bool,
    ) -> bool {
        if now != link {
            return false;
        }
        self.at(link, |st| {
            if stripes(mask).any(|s| grant <= st.void_upto[s]) {
                return false;
            }
            if !resolver && stripes(mask).any(|s| st.last_grant[s] > sent) {
                return false;
            }
            st.owned |= mask;
            // The other node gave up what this node granted it before asking (it did
            // so under its own lock, and voided those grants).
            for s in stripes(mask) {
                if st.last_grant[s] <= sent {
                    st.granted &= !(1 << s);
                }
            }
            true
        })
    }

    /// A revoke is about to go out on link `link`: the number to send with it (the
    /// other node gives up this node's grants up to it).
    pub(super) fn revoking(&self, link: u64) -> u64 {
        self.asking(link)
    }

    /// The other node revokes the stripes of `mask` on link `link`, voiding this
    /// node's grants up to `upto`: call it under those stripes' exclusive lock.
    pub(super) fn give_up(&self, mask: u64, upto: u64, link: u64) {
        self.at(link, |st| {
            st.owned &= !mask;
            for s in stripes(mask) {
                st.void_upto[s] = st.void_upto[s].max(upto);
            }
        })
    }

    /// The answer to a revoke sent on link `link` with `upto` ([`Self::revoking`]), the
    /// link now `now`: the stripes of `mask` granted no later than `upto` are free here.
    pub(super) fn revoked(&self, mask: u64, upto: u64, link: u64, now: u64) {
        self.at(now, |st| {
            if now != link {
                return;
            }
            for s in stripes(mask) {
                if st.last_grant[s] <= upto {
                    st.granted &= !(1 << s);
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_take_owns_until_revoked_and_the_grant_stays_marked_until_given_up() {
        let (a, b) = (Ownership::default(), Ownership::default());
        // a asks for stripe 0 on link 1; b grants.
        let sent = a.asking(1);
        let g = b.grant(1, sent, 1);
        assert_eq!(b.granted(u64::MAX), 1);
        assert!(a.taken(1, sent, g, (1, 1), false));
        assert!(a.owns(1, 1));
        assert!(!a.owns(3, 1), "stripe 1 is not owned");
        // b writes stripe 0: revokes.
        let upto = b.revoking(1);
        a.give_up(1, upto, 1);
        assert!(!a.owns(1, 1));
        b.revoked(1, upto, 1, 1);
        assert_eq!(b.granted(u64::MAX), 0);
    }

    #[test]
    fn a_revoke_that_passes_the_grants_answer_voids_it() {
        let (a, b) = (Ownership::default(), Ownership::default());
        let sent = a.asking(1);
        let g = b.grant(1, sent, 1);
        // b revokes before a saw the answer; a gives up (nothing yet).
        let upto = b.revoking(1);
        a.give_up(1, upto, 1);
        b.revoked(1, upto, 1, 1);
        assert_eq!(b.granted(1), 0);
        assert!(!a.taken(1, sent, g, (1, 1), false), "the grant was revoked");
        assert!(!a.owns(1, 1));
    }

    #[test]
    fn a_revoke_answered_after_a_newer_grant_keeps_the_newer_grant_marked() {
        let (a, b) = (Ownership::default(), Ownership::default());
        let upto = b.revoking(1);
        // a asks again and b grants before the revoke's answer comes back.
        a.give_up(1, upto, 1);
        let sent = a.asking(1);
        let g = b.grant(1, sent, 1);
        assert!(a.taken(1, sent, g, (1, 1), false));
        b.revoked(1, upto, 1, 1);
        assert_eq!(b.granted(1), 1, "a owns the stripe: b's writes must revoke");
    }

    #[test]
    fn crossing_takes_leave_at_most_one_owner() {
        let (a, b) = (Ownership::default(), Ownership::default());
        let sa = a.asking(1);
        let sb = b.asking(1);
        // b grants a's take, then a grants b's (each under its own lock).
        let ga = b.grant(1, sa, 1);
        let gb = a.grant(1, sb, 1);
        // a is the resolver: b's grant stands, a's is void.
        assert!(a.taken(1, sa, ga, (1, 1), true));
        assert!(!b.taken(1, sb, gb, (1, 1), false));
        assert_eq!(b.granted(1), 1, "b must revoke before writing");
    }

    #[test]
    fn a_new_link_forgets_everything() {
        let (a, b) = (Ownership::default(), Ownership::default());
        let sent = a.asking(1);
        let g = b.grant(1, sent, 1);
        assert!(
            !a.taken(1, sent, g, (1, 2), false),
            "answered on another link"
        );
        assert!(a.taken(1, sent, g, (1, 1), false));
        assert!(!a.owns(1, 2));
        assert!(!a.owns(1, 1), "link 2 was seen: link 1's ownership is gone");
        b.forget();
        assert_eq!(b.granted(u64::MAX), 0);
        let _ = b.grant(2, 0, 3);
        assert_eq!(b.granted(u64::MAX), 2);
        b.revoked(2, 0, 3, 4);
        assert_eq!(b.granted(u64::MAX), 0, "another link: nothing granted");
    }
}
