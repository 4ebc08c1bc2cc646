//! Byte ranges and the operations on them the write-ordering rules need.

/// A half-open byte range `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Range {
    pub start: u64,
    pub end: u64,
}

impl Range {
    pub fn new(offset: u64, len: u64) -> Range {
        Range {
            start: offset,
            end: offset.saturating_add(len),
        }
    }

    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    pub fn overlaps(&self, other: &Range) -> bool {
        self.start < other.end && other.start < self.end
    }
}

/// The ranges of one apply entry: nearly always one, held inline.
pub(crate) type Ranges = smallvec::SmallVec<[Range; 1]>;

/// The smallest range that covers all of `ranges` (empty for none): two lists can only
/// overlap where their spans do.
pub(crate) fn span(ranges: &[Range]) -> Range {
    match ranges {
        [] => Range { start: 0, end: 0 },
        [one] => *one,
        [first, rest @ ..] => rest.iter().fold(*first, |s, r| Range {
            start: s.start.min(r.start),
            end: s.end.max(r.end),
        }),
    }
}

/// `piece` minus every range in `mask`, as ordered non-overlapping pieces.
pub(crate) fn subtract(piece: Range, mask: &[Range]) -> Vec<Range> {
    let mut out = vec![piece];
    for m in mask {
        let mut next = Vec::with_capacity(out.len() + 1);
        for r in out {
            if !r.overlaps(m) {
                next.push(r);
                continue;
            }
            if r.start < m.start {
                next.push(Range {
                    start: r.start,
                    end: m.start,
                });
            }
            if m.end < r.end {
                next.push(Range {
                    start: m.end,
                    end: r.end,
                });
            }
        }
        out = next;
    }
    out.sort_by_key(|r| r.start);
    out
}

/// Whether any range of `a` overlaps any range of `b`.
pub(crate) fn any_overlap(a: &[Range], b: &[Range]) -> bool {
    a.iter().any(|x| b.iter().any(|y| x.overlaps(y)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subtract_cases() {
        let r = Range::new(0, 100);
        assert_eq!(subtract(r, &[]), vec![r]);
        assert_eq!(subtract(r, &[Range::new(0, 100)]), vec![]);
        assert_eq!(
            subtract(r, &[Range::new(10, 10)]),
            vec![Range::new(0, 10), Range::new(20, 80)]
        );
        assert_eq!(subtract(r, &[Range::new(90, 50)]), vec![Range::new(0, 90)]);
        assert_eq!(
            subtract(r, &[Range::new(10, 10), Range::new(50, 10)]),
            vec![Range::new(0, 10), Range::new(20, 30), Range::new(60, 40)]
        );
        assert_eq!(subtract(r, &[Range::new(200, 10)]), vec![r]);
    }
}
