//! Per worker, the block keys of engine hashes it removed lately, for parents
//! that are gone by the time their child is stored.
//!
//! LMCache evicts a chunk's parent just before the chunk goes in (one record:
//! BlockRemoved(parent), BlockStored(child, parent)), and vLLM can free and
//! reuse a parent block before a child of it is stored. Without the parent's
//! key the child is an orphan forever, even once the parent is back: the
//! worker is under-credited for the whole chain. An engine hash is
//! prefix-chained, so it names its whole prefix: the key it was last stored
//! under is still its key after it is removed. `resolve_parent` asks the memo
//! only after every live table missed, so a live entry always wins.
//!
//! Bounded, first in first out: a worker costs at most `PARENT_MEMO` entries.
//! Updating an entry keeps its place in the line.
//!
//! The line is a ring of entries with a small open-addressing index (engine
//! hash -> ring slot, 2 bytes a bucket, at most half full), not a hash map
//! beside a queue. Every removal of a held block remembers it, so in a cache
//! that turns over each removed block paid a map insert, a queue push and, once
//! the line was full, a map delete: `hashbrown`'s insert was 6% of the samples
//! of applying `bench.lag`'s records (16 stores or 16 removes each), and the
//! ring's `remember` is 3%. A full memo is 112 KiB (24 B an entry, 16 KiB of
//! index), where the map and the queue took ~232 KiB.
//!
//! Snapshots carry it, line order included (`entries`, `Index::import_memo`):
//! the order decides what is pushed out next, so a restored index fed the
//! log's tail chains (and forgets) exactly what the index it came from does.

use crate::table::mix;

/// Removed engine hashes a worker remembers (the oracle reads the same
/// number from `_core.PARENT_MEMO`).
pub const PARENT_MEMO: usize = 4096;

// Index buckets hold a ring slot + 1 in a u16 (0: empty).
const _: () = assert!(PARENT_MEMO < u16::MAX as usize && PARENT_MEMO.is_power_of_two());

#[derive(Clone, Copy)]
struct Entry {
    eh: u64,
    key: u64,
    orphan: bool,
}

/// The ring grows as a plain vector (`head` 0, every slot live) until it holds
/// `PARENT_MEMO` entries; from then on its length stays `PARENT_MEMO` and the
/// line is the `len` slots from `head`, wrapping.
#[derive(Default)]
pub struct Memo {
    ring: Vec<Entry>,
    head: usize,
    len: usize,
    /// engine hash -> ring slot + 1, linear probing, at most half full.
    index: Vec<u16>,
}

/// What one `remember` changed, for the undo log.
pub enum MemoUndo {
    /// The hash was there already: its old value.
    Updated(u64, (u64, bool)),
    /// The hash is new; the entry that made room for it, if any.
    Added(u64, Option<(u64, (u64, bool))>),
}

impl Memo {
    pub fn get(&self, eh: u64) -> Option<(u64, bool)> {
        self.find(eh).map(|(_, s)| {
            let e = &self.ring[s];
            (e.key, e.orphan)
        })
    }

    pub fn remember(&mut self, eh: u64, key: u64, orphan: bool) -> MemoUndo {
        if let Some((_, s)) = self.find(eh) {
            let e = &mut self.ring[s];
            let old = (e.key, e.orphan);
            (e.key, e.orphan) = (key, orphan);
            return MemoUndo::Updated(eh, old);
        }
        // Room made before the push: the line never outgrows PARENT_MEMO, nor does its ring.
        let out = if self.len == PARENT_MEMO {
            let e = self.pop_front();
            Some((e.eh, (e.key, e.orphan)))
        } else {
            None
        };
        self.push_back(Entry { eh, key, orphan });
        MemoUndo::Added(eh, out)
    }

    /// Undo one `remember`; undos come newest first.
    pub fn undo(&mut self, u: MemoUndo) {
        match u {
            MemoUndo::Updated(eh, (key, orphan)) => {
                let (_, s) = self.find(eh).expect("an updated hash is in the memo");
                (self.ring[s].key, self.ring[s].orphan) = (key, orphan);
            }
            MemoUndo::Added(eh, out) => {
                let back = self.pop_back();
                debug_assert_eq!(back.eh, eh);
                if let Some((eh, (key, orphan))) = out {
                    self.push_front(Entry { eh, key, orphan });
                }
            }
        }
    }

    /// (engine hash, block key, orphan), oldest first: the line as `remember` rebuilds it.
    pub fn entries(&self) -> impl Iterator<Item = (u64, u64, bool)> + '_ {
        (0..self.len).map(|i| {
            let e = &self.ring[self.slot(i)];
            (e.eh, e.key, e.orphan)
        })
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn clear(&mut self) {
        *self = Memo::default();
    }

    pub fn nbytes(&self) -> usize {
        self.ring.capacity() * std::mem::size_of::<Entry>() + self.index.capacity() * 2
    }

    /// The ring slot of the line's `i`-th entry.
    #[inline]
    fn slot(&self, i: usize) -> usize {
        let s = self.head + i;
        if s >= self.ring.len() {
            s - self.ring.len()
        } else {
            s
        }
    }

    #[inline]
    fn home(&self, eh: u64) -> usize {
        // The top bits of a mixed hash: engine hashes of some sources are small or sequential.
        (mix(eh) >> (64 - self.index.len().trailing_zeros())) as usize
    }

    /// (bucket, ring slot) of `eh`.
    fn find(&self, eh: u64) -> Option<(usize, usize)> {
        if self.index.is_empty() {
            return None;
        }
        let mask = self.index.len() - 1;
        let mut b = self.home(eh);
        loop {
            let v = self.index[b];
            if v == 0 {
                return None;
            }
            if self.ring[v as usize - 1].eh == eh {
                return Some((b, v as usize - 1));
            }
            b = (b + 1) & mask;
        }
    }

    fn index_insert(&mut self, eh: u64, slot: usize) {
        let mask = self.index.len() - 1;
        let mut b = self.home(eh);
        while self.index[b] != 0 {
            b = (b + 1) & mask;
        }
        self.index[b] = slot as u16 + 1;
    }

    /// Empty bucket `hole`, moving back into it every later entry of its cluster that
    /// may live there (backward-shift deletion: no tombstones, so probes stay short).
    fn index_remove(&mut self, mut hole: usize) {
        let mask = self.index.len() - 1;
        let mut b = hole;
        loop {
            b = (b + 1) & mask;
            let v = self.index[b];
            if v == 0 {
                break;
            }
            let home = self.home(self.ring[v as usize - 1].eh);
            // Movable when the hole lies on its probe path, from its home to b.
            if (b.wrapping_sub(home) & mask) >= (b.wrapping_sub(hole) & mask) {
                self.index[hole] = v;
                hole = b;
            }
        }
        self.index[hole] = 0;
    }

    /// Keep the index at most half full for one more entry.
    fn reserve_one(&mut self) {
        if (self.len + 1) * 2 <= self.index.len() {
            return;
        }
        self.index = vec![0; (self.index.len() * 2).max(16)];
        for i in 0..self.len {
            let s = self.slot(i);
            self.index_insert(self.ring[s].eh, s);
        }
    }

    fn push_back(&mut self, e: Entry) {
        self.reserve_one();
        let s = if self.ring.len() < PARENT_MEMO {
            self.ring.push(e);
            self.ring.len() - 1
        } else {
            let s = self.slot(self.len);
            self.ring[s] = e;
            s
        };
        self.len += 1;
        self.index_insert(e.eh, s);
    }

    /// Only a full ring is popped at its front (`remember` making room), and pushed there
    /// (its undo).
    fn pop_front(&mut self) -> Entry {
        let e = self.ring[self.head];
        let (b, _) = self.find(e.eh).expect("a ring entry is indexed");
        self.index_remove(b);
        self.head = self.slot(1);
        self.len -= 1;
        e
    }

    fn push_front(&mut self, e: Entry) {
        debug_assert_eq!(self.ring.len(), PARENT_MEMO);
        self.head = self.slot(PARENT_MEMO - 1);
        self.ring[self.head] = e;
        self.len += 1;
        self.index_insert(e.eh, self.head);
    }

    fn pop_back(&mut self) -> Entry {
        let s = self.slot(self.len - 1);
        let e = self.ring[s];
        let (b, _) = self.find(e.eh).expect("a ring entry is indexed");
        self.index_remove(b);
        self.len -= 1;
        if self.ring.len() < PARENT_MEMO {
            self.ring.pop();
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_in_first_out_and_undone_exactly() {
        let mut m = Memo::default();
        for eh in 0..PARENT_MEMO as u64 {
            m.remember(eh, eh + 1, false);
        }
        // An update keeps its place; a new hash pushes out the oldest.
        assert!(matches!(m.remember(0, 7, true), MemoUndo::Updated(0, (1, false))));
        let u = m.remember(1 << 40, 5, false);
        assert!(matches!(u, MemoUndo::Added(_, Some((0, (7, true))))));
        assert_eq!((m.get(0), m.get(1 << 40), m.entries().count()), (None, Some((5, false)), PARENT_MEMO));
        m.undo(u);
        assert_eq!((m.get(0), m.get(1 << 40), m.entries().count()), (Some((7, true)), None, PARENT_MEMO));
        // Undone, the line is as it was: the next hash pushes out 0 again.
        m.remember(1 << 41, 5, false);
        assert_eq!(m.get(0), None);
        assert_eq!(m.get(1), Some((2, false)));
    }

    /// The line as a map beside a queue, the plainest form of its rule.
    #[derive(Default)]
    struct Model {
        map: std::collections::HashMap<u64, (u64, bool)>,
        order: std::collections::VecDeque<u64>,
    }

    impl Model {
        fn remember(&mut self, eh: u64, key: u64, orphan: bool) -> Option<u64> {
            if self.map.insert(eh, (key, orphan)).is_some() {
                return None;
            }
            let out = (self.order.len() == PARENT_MEMO).then(|| self.order.pop_front().unwrap());
            if let Some(o) = out {
                self.map.remove(&o);
            }
            self.order.push_back(eh);
            out
        }

        fn entries(&self) -> Vec<(u64, u64, bool)> {
            self.order.iter().map(|&eh| (eh, self.map[&eh].0, self.map[&eh].1)).collect()
        }
    }

    /// Random lines of remembers, updates and undone batches, hashes drawn from a small
    /// range so that updates, evictions and index clusters all happen: every get and the
    /// whole line agree with the model, and an undone batch leaves the memo as it was.
    #[test]
    fn the_ring_keeps_the_rule_of_a_map_beside_a_queue() {
        let mut next = crate::test_rng::xorshift(0x9E37_79B9_7F4A_7C15);
        let (mut m, mut model) = (Memo::default(), Model::default());
        for round in 0..400 {
            let before = m.entries().collect::<Vec<_>>();
            let n = 1 + (next() % 64) as usize;
            let span = if round % 3 == 0 { 64 } else { 3 * PARENT_MEMO as u64 };
            let mut undos = vec![];
            let mut batch = vec![];
            for _ in 0..n {
                let (eh, key, orphan) = (next() % span, next(), next() % 5 == 0);
                undos.push(m.remember(eh, key, orphan));
                batch.push((eh, key, orphan));
            }
            if round % 4 == 1 {
                // Refused record: undone newest first, nothing of it stays.
                for u in undos.into_iter().rev() {
                    m.undo(u);
                }
                assert_eq!(m.entries().collect::<Vec<_>>(), before, "round {round}");
            } else {
                for (eh, key, orphan) in batch {
                    model.remember(eh, key, orphan);
                }
                assert_eq!(m.entries().collect::<Vec<_>>(), model.entries(), "round {round}");
            }
            for _ in 0..64 {
                let eh = next() % span;
                assert_eq!(m.get(eh), model.map.get(&eh).copied(), "round {round}, hash {eh}");
            }
        }
        assert_eq!(m.entries().count(), PARENT_MEMO, "the line filled and wrapped");
    }

    #[test]
    fn entries_rebuild_the_same_line() {
        let mut m = Memo::default();
        for eh in 0..PARENT_MEMO as u64 + 3 {
            m.remember(eh * 7, eh, eh % 3 == 0);
        }
        m.remember(21, 9, true); // an update keeps its place
        let mut back = Memo::default();
        for (eh, key, orphan) in m.entries() {
            back.remember(eh, key, orphan);
        }
        assert_eq!(back.entries().collect::<Vec<_>>(), m.entries().collect::<Vec<_>>());
        assert_eq!(back.entries().next(), Some((21, 9, true)));
        // Both push out the same hash next.
        for x in [&mut m, &mut back] {
            assert!(matches!(x.remember(1 << 50, 1, false), MemoUndo::Added(_, Some((21, (9, true))))));
        }
    }
}
