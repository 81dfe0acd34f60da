//! Table growth prepared beside the scores. A shard that an apply quantum fills past its load
//! limit is not grown by that quantum (`STable::defer`): the writer rebuilds it between quanta
//! under the read lock, beside the scores, and the next quantum puts it in. A growth inside a
//! quantum held the index's write lock for 100-200 us at 10M holder-blocks (mostly the page
//! faults of the new slots), and a score arriving then waited it out, or slept past it.

use super::{Index, Loc};
use crate::table::{RShard, SShard};

/// Shards grown from the index as it was at `stamp` (`Index::writes`).
pub struct Growth {
    stamp: u64,
    s: Vec<(u32, SShard)>,
    r: Vec<(Loc, Vec<(usize, RShard)>)>,
}

impl Index {
    /// Defer growths from now on (an apply quantum's inserts), or grow where an insert fills a
    /// shard, as every other writer does.
    pub fn defer_growth(&mut self, on: bool) {
        self.s.defer = on;
    }

    /// Whether some shard waits for `prepare_growth`.
    pub fn growth_deferred(&self) -> bool {
        self.s.growth_deferred() || !self.r_deferred.is_empty()
    }

    /// Every deferred growth, built from the index as it is: reads only, so the writer runs it
    /// under the read lock while scores run.
    pub fn prepare_growth(&self) -> Growth {
        let mut locs = self.r_deferred.clone();
        locs.sort_unstable();
        locs.dedup();
        let table = |l: Loc| self.workers.get(l.0 as usize)?.ranks.get(l.1)?.tables.get(l.2);
        let r = locs.into_iter().filter_map(|l| Some((l, table(l)?.grown_shards()))).collect();
        Growth { stamp: self.writes, s: self.s.prepare_growth(), r }
    }

    /// Put in what `prepare_growth` built, if the index has not changed since (false: it has,
    /// and the growths stay deferred, for the next `prepare_growth`).
    pub fn install_growth(&mut self, g: Growth) -> bool {
        if g.stamp != self.writes {
            return false;
        }
        self.s.install_growth(g.s);
        for (l, shards) in g.r {
            self.tab(l).install_shards(shards);
        }
        self.r_deferred.clear();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::*;

    /// Conversation `c`'s tokens, 16-token blocks of ids no other conversation has.
    fn conv(c: u32, blocks: u32) -> Vec<u8> {
        (0..blocks * 16).flat_map(|t| (c * 100_000 + t).to_le_bytes()).collect()
    }

    /// Worker `w` stores conversation `c` record by record, 16 blocks a record.
    fn store_conv(ix: &mut Index, w: &str, c: u32, blocks: u32) {
        let tokens = conv(c, blocks);
        let ehs: Vec<u64> = (0..blocks as u64).map(|b| (c as u64) << 32 | (b + 1)).collect();
        for r in 0..(blocks / 16) as usize {
            let parent = if r == 0 { None } else { Some(ehs[r * 16 - 1]) };
            let ev = stored(None, &ehs[r * 16..(r + 1) * 16], &tokens[r * 256 * 4..(r + 1) * 256 * 4], parent);
            ix.apply(&rank(w, 0, 1), &[ev], true).expect("applied");
        }
    }

    fn holders(ix: &Index) -> Vec<(u64, u32)> {
        let mut out = vec![];
        ix.holder_keys(|k, wm| out.push((k, wm)));
        out.sort_unstable();
        out
    }

    /// The same stores with growth deferred (installed at once, later, or refused as stale
    /// once another write came between) leave the same holders and answers as with growth
    /// inline.
    #[test]
    fn deferred_growth_changes_no_answer() {
        let (mut plain, mut deferred) = (Index::new(), Index::new());
        let (mut grew, mut refused) = (0, 0);
        for c in 0..120u32 {
            let w = ["a", "b", "c"][c as usize % 3];
            store_conv(&mut plain, w, c, 64);
            deferred.defer_growth(true);
            store_conv(&mut deferred, w, c, 64);
            deferred.defer_growth(false);
            if !deferred.growth_deferred() || c % 4 == 0 {
                continue;
            }
            let g = deferred.prepare_growth();
            if c % 7 == 1 {
                deferred.writes += 1;
                assert!(!deferred.install_growth(g), "prepared before another write: stale");
                assert!(deferred.growth_deferred());
                refused += 1;
                continue;
            }
            assert!(deferred.install_growth(g));
            assert!(!deferred.growth_deferred());
            grew += 1;
        }
        assert!(grew > 10 && refused > 0, "{grew} growths installed, {refused} refused");
        assert_eq!(holders(&plain), holders(&deferred));
        for c in [0, 1, 2, 59, 119] {
            let q = conv(c, 64);
            assert_eq!(ranked(&mut plain, &q, |_| 1.0, None, None), ranked(&mut deferred, &q, |_| 1.0, None, None));
        }
        let g = deferred.prepare_growth();
        assert!(deferred.install_growth(g));
        assert_eq!(holders(&plain), holders(&deferred));
        assert_eq!(plain.nbytes(), deferred.nbytes(), "every growth done, the tables are the same size");
    }
}
