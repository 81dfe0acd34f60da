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
//! Bounded, first in first out: a worker costs at most `PARENT_MEMO` entries
//! (~33 B each). Updating an entry keeps its place in the line.
//!
//! Snapshots carry it, line order included (`entries`, `Index::import_memo`):
//! the order decides what is pushed out next, so a restored index fed the
//! log's tail chains (and forgets) exactly what the index it came from does.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use crate::table::KeyHasher;

/// Removed engine hashes a worker remembers (the oracle reads the same
/// number from `_core.PARENT_MEMO`).
pub const PARENT_MEMO: usize = 4096;

#[derive(Default)]
pub struct Memo {
    /// engine hash -> (block key, orphan)
    map: HashMap<u64, (u64, bool), BuildHasherDefault<KeyHasher>>,
    /// Engine hashes in the order they entered the map, oldest first.
    order: VecDeque<u64>,
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
        self.map.get(&eh).copied()
    }

    pub fn remember(&mut self, eh: u64, key: u64, orphan: bool) -> MemoUndo {
        if let Some(old) = self.map.insert(eh, (key, orphan)) {
            return MemoUndo::Updated(eh, old);
        }
        // Room made before the push: the line never outgrows PARENT_MEMO, nor does its buffer.
        let out = if self.order.len() == PARENT_MEMO {
            self.order.pop_front().map(|old| (old, self.map.remove(&old).expect("in the map")))
        } else {
            None
        };
        self.order.push_back(eh);
        MemoUndo::Added(eh, out)
    }

    /// Undo one `remember`; undos come newest first.
    pub fn undo(&mut self, u: MemoUndo) {
        match u {
            MemoUndo::Updated(eh, old) => {
                self.map.insert(eh, old);
            }
            MemoUndo::Added(eh, out) => {
                let back = self.order.pop_back();
                debug_assert_eq!(back, Some(eh));
                self.map.remove(&eh);
                if let Some((old, v)) = out {
                    self.order.push_front(old);
                    self.map.insert(old, v);
                }
            }
        }
    }

    /// (engine hash, block key, orphan), oldest first: the line as `remember` rebuilds it.
    pub fn entries(&self) -> impl Iterator<Item = (u64, u64, bool)> + '_ {
        self.order.iter().map(|&eh| {
            let (key, orphan) = self.map[&eh];
            (eh, key, orphan)
        })
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    pub fn clear(&mut self) {
        self.map = HashMap::default();
        self.order = VecDeque::new();
    }

    pub fn nbytes(&self) -> usize {
        // hashbrown: a (u64, (u64, bool)) bucket of 24 B and a control byte each.
        self.map.capacity() * 25 + self.order.capacity() * 8
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
        assert_eq!((m.get(0), m.get(1 << 40), m.map.len()), (None, Some((5, false)), PARENT_MEMO));
        m.undo(u);
        assert_eq!((m.get(0), m.get(1 << 40), m.map.len()), (Some((7, true)), None, PARENT_MEMO));
        // Undone, the line is as it was: the next hash pushes out 0 again.
        m.remember(1 << 41, 5, false);
        assert_eq!(m.get(0), None);
        assert_eq!(m.get(1), Some((2, false)));
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
