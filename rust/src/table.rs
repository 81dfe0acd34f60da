//! Open-addressing tables behind the index.
//!
//! Both kinds are linear probing over arrays of slots, deleted with backward
//! shift (no tombstones, so a long-lived index never degrades), sized to any
//! capacity (fastrange instead of a power-of-two mask, so growing by 1.5x keeps
//! the load between 0.6 and 0.9). Each table is split into shards chosen by the
//! top bits of the mixed hash, and a shard grows on its own: S, of 4096 shards,
//! never rehashes more than a few thousand slots in one call at 10M entries
//! (a growth is a wait for every score beside ingest: with 256 shards it was
//! ~1 ms, several hundred times a second at 1M blocks/s), and
//! shards fill at about the same rate but cross their thresholds in different
//! calls, so the growth is staggered instead of one long pause. Inside an apply
//! quantum even that pause is not taken: the shard runs fuller for a while and
//! the writer grows it between quanta, beside the scores (`index/growth.rs`).
//!
//! - **S** (one per index), the scoring table: (block key, rm) -> count, `rm`
//!   being a (worker, tp rank, medium, KV-cache group); the count is how many
//!   of that rank's engine-hash entries (distinct engine hashes) map to the
//!   key. Slot: key u64 + meta u32 = `(rm + 1) << 10 | count` + the position
//!   of the key's entry in its rm's chain log (`ChainLog`), 16 bytes. The
//!   home slot depends on the key only, so every holder of a key sits in the
//!   probe run that starts at its home: one contiguous scan lists a key's
//!   holders (and their TP ranks) without a per-key node or pointer. S keeps
//!   Robin Hood order (a cluster sorted by home), so that scan stops at the
//!   first slot homed after the key's instead of running to the cluster's
//!   end: a shared prompt's hundreds of holders make long clusters, and a
//!   plain linear probe through them cost the score walk ~56 slots a block
//!   at 10M holder-blocks where Robin Hood skips ~9.
//! - **R** (one per rank x medium x group), the removal table: engine hash ->
//!   (block key, refcount | ORPHAN | ENGINE), 18 bytes a slot.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

pub const MAX_LOAD_NUM: usize = 9;
pub const MAX_LOAD_DEN: usize = 10;
pub const MIN_CAP: usize = 8;

pub const REF_MASK: u16 = 0x3FFF;
pub const ORPHAN: u16 = 0x4000;
pub const ENGINE: u16 = 0x8000;
pub const CNT_BITS: u32 = 10;
pub const CNT_MASK: u32 = (1 << CNT_BITS) - 1;
pub const MAX_RM: u32 = (1 << (32 - CNT_BITS)) - 2;

#[inline]
pub fn mix(x: u64) -> u64 {
    let mut h = x;
    h ^= h >> 33;
    h = h.wrapping_mul(0xFF51AFD7ED558CCD);
    h ^= h >> 33;
    h = h.wrapping_mul(0xC4CEB9FE1A85EC53);
    h ^= h >> 33;
    h
}

/// The inverse of `mix` (each step of it is invertible): a key back from S.
#[inline]
pub fn unmix(h: u64) -> u64 {
    let mut x = h;
    x ^= x >> 33;
    x = x.wrapping_mul(0x9CB4B2F8129337DB);
    x ^= x >> 33;
    x = x.wrapping_mul(0x4F74430C22A54005);
    x ^= x >> 33;
    x
}

/// Ask for the cache line holding `p`. A hint only: a prefetch reads nothing observable and
/// never faults, so any address will do (one past a table's end included).
#[inline(always)]
pub(crate) fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: _mm_prefetch has no memory-safety requirement on its address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p as *const i8);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[inline]
fn home(h: u64, cap: usize) -> usize {
    (((h & 0xFFFF_FFFF) * cap as u64) >> 32) as usize
}

#[inline]
fn limit(cap: usize) -> usize {
    (cap * MAX_LOAD_NUM / MAX_LOAD_DEN).min(cap - 1)
}

/// How full a shard may get while its growth is deferred (`STable::defer`): past `limit`, an
/// apply quantum keeps inserting into it until the writer has grown it beside the scores (see
/// `Index::prepare_growth`); this far, the quantum grows it itself. At least one slot stays
/// empty, which every probe relies on.
#[inline]
fn hard_limit(cap: usize) -> usize {
    (cap - cap / 16).min(cap - 1)
}

fn next_cap(need: usize, mut cap: usize) -> usize {
    while limit(cap) < need {
        cap = MIN_CAP.max(cap * 3 / 2 + 1);
    }
    cap
}

// ------------------------------------------------------------------ R tables

/// One R slot: an engine hash, its key and its meta side by side, 18 bytes (packed, so no
/// padding costs bytes per holder-block). A store's probe and insert then touch one line of
/// one page, where three parallel arrays touched three pages: a random write into tables far
/// larger than the cache waits on a page walk per page (slow on a virtual machine), and a
/// store's prefetches of three pages per block were the apply's largest stall.
#[derive(Clone, Copy, Default)]
#[repr(C, packed(2))]
pub struct RSlot {
    eh: u64,
    key: u64,
    /// 0: empty; else refcount | ORPHAN | ENGINE.
    pub meta: u16,
}

const _: () = assert!(std::mem::size_of::<RSlot>() == 18);

impl RSlot {
    #[inline(always)]
    pub fn key(&self) -> u64 {
        self.key
    }
}

#[derive(Clone)]
pub struct RShard {
    pub slot: Vec<RSlot>,
    len: usize,
}

impl RShard {
    fn new(cap: usize) -> Self {
        RShard { slot: vec![RSlot::default(); cap], len: 0 }
    }

    #[inline]
    fn find(&self, eh: u64, h: u64) -> Option<usize> {
        self.find_or_vacant(eh, h).ok()
    }

    fn grow(&mut self, need: usize) {
        if next_cap(need, self.slot.len()) != self.slot.len() {
            *self = self.grown(need);
        }
    }

    /// This shard rehashed into the capacity `need` entries ask for; reads `self` only.
    fn grown(&self, need: usize) -> RShard {
        let mut new = RShard::new(next_cap(need, self.slot.len()));
        for x in &self.slot {
            if x.meta != 0 {
                new.put(x.eh, mix(x.eh), x.key, x.meta);
            }
        }
        new
    }

    /// Where `eh` is, or else the slot an insert would take (the first empty one from its
    /// home, as `put_in` would find it).
    #[inline]
    fn find_or_vacant(&self, eh: u64, h: u64) -> Result<usize, usize> {
        let cap = self.slot.len();
        let mut j = home(h, cap);
        while self.slot[j].meta != 0 {
            if self.slot[j].eh == eh {
                return Ok(j);
            }
            j += 1;
            if j == cap {
                j = 0;
            }
        }
        Err(j)
    }

    /// Insert an engine hash known to be absent (capacity checked here).
    #[inline]
    fn put(&mut self, eh: u64, h: u64, key: u64, meta: u16) {
        if self.len + 1 > limit(self.slot.len()) {
            self.grow(self.len + 1);
        }
        self.put_in(eh, h, key, meta);
    }

    /// `put` without the capacity check: the caller made room or deferred the growth.
    #[inline]
    fn put_in(&mut self, eh: u64, h: u64, key: u64, meta: u16) {
        let cap = self.slot.len();
        let mut j = home(h, cap);
        while self.slot[j].meta != 0 {
            j += 1;
            if j == cap {
                j = 0;
            }
        }
        self.slot[j] = RSlot { eh, key, meta };
        self.len += 1;
    }

    fn delete(&mut self, mut i: usize) {
        let cap = self.slot.len();
        let mut j = i;
        loop {
            j += 1;
            if j == cap {
                j = 0;
            }
            if self.slot[j].meta == 0 {
                break;
            }
            let h = home(mix(self.slot[j].eh), cap);
            // Move j back to the hole i unless j's home lies cyclically in (i, j].
            let stay = if i <= j { i < h && h <= j } else { h > i || h <= j };
            if !stay {
                self.slot[i] = self.slot[j];
                i = j;
            }
        }
        self.slot[i].meta = 0;
        self.len -= 1;
    }
}

/// R shards a table starts with.
pub const R_SHARDS: usize = 16;
/// Entries per shard past which a table splits one more shard (linear hashing): a shard's
/// growth rehashes it inside an apply quantum, which holds the index's write lock, and a
/// rank's table of 1.5M entries in 16 fixed shards stalled every score for ~2 ms at each
/// growth. Splitting keeps shards within about twice this.
const R_SPLIT_LEN: usize = 4096;

/// Where an absent engine hash would go (`RTable::find_for_store`).
#[derive(Clone, Copy)]
pub struct Vacant {
    shard: u32,
    slot: u32,
}

/// One rank x medium x group: engine hash -> (key, meta), plus its counters.
///
/// Linear hashing over the upper half of an engine hash's mix (the lower half places it in
/// its shard): at level L a table has `R_SHARDS << L` shards plus the `next` already split
/// into a shard of the level above, so a shard's index is two masks and a compare, and
/// the table grows one shard at a time, oldest first.
#[derive(Clone)]
pub struct RTable {
    pub shards: Vec<RShard>,
    /// Shards of the current level: `R_SHARDS << level`.
    base: usize,
    /// Shards below this one are split at this level.
    next: usize,
    pub rm: u32,
    pub medium: u32,
    pub group: i64,
    pub count: i64,
    pub orphans: i64,
    pub unknown: i64,
    pub dups: i64,
}

impl RTable {
    pub fn new(rm: u32, medium: u32, group: i64) -> Self {
        RTable {
            shards: (0..R_SHARDS).map(|_| RShard::new(MIN_CAP)).collect(),
            base: R_SHARDS,
            next: 0,
            rm,
            medium,
            group,
            count: 0,
            orphans: 0,
            unknown: 0,
            dups: 0,
        }
    }

    /// Start loading where `eh`'s lookup and insert read and write (its home slot). A store prefetches all its blocks' slots before it touches any: the
    /// tables are far larger than the cache, and one block's misses no longer wait on the last's.
    #[inline]
    pub fn prefetch(&self, eh: u64) {
        let h = mix(eh);
        let s = &self.shards[self.r_shard(h)];
        let p = s.slot.as_ptr().wrapping_add(home(h, s.slot.len())) as *const u8;
        // A slot's 18 bytes may straddle two lines.
        prefetch_line(p);
        prefetch_line(p.wrapping_add(std::mem::size_of::<RSlot>() - 1));
    }

    /// (key, meta) of an engine hash.
    #[inline]
    pub fn get(&self, eh: u64) -> Option<(u64, u16)> {
        let h = mix(eh);
        let s = &self.shards[self.r_shard(h)];
        s.find(eh, h).map(|j| (s.slot[j].key, s.slot[j].meta))
    }

    #[inline]
    pub fn meta_mut(&mut self, eh: u64) -> Option<&mut u16> {
        let h = mix(eh);
        let at = self.r_shard(h);
        let s = &mut self.shards[at];
        s.find(eh, h).map(move |j| &mut s.slot[j].meta)
    }

    /// A store's dup check and insert in one probe: the meta of `eh` if held, else where an
    /// insert would put it (for `insert_vacant`, with no other write to this table between).
    #[inline]
    pub fn find_for_store(&mut self, eh: u64) -> Result<&mut u16, Vacant> {
        let h = mix(eh);
        let at = self.r_shard(h);
        let s = &mut self.shards[at];
        match s.find_or_vacant(eh, h) {
            Ok(j) => Ok(&mut s.slot[j].meta),
            Err(j) => Err(Vacant { shard: at as u32, slot: j as u32 }),
        }
    }

    /// `insert_deferring` into the slot `find_for_store` found, where no split or growth moves
    /// the slots first (else the insert probes again).
    #[inline]
    pub fn insert_vacant(&mut self, v: Vacant, eh: u64, key: u64, meta: u16, defer: bool) -> bool {
        if self.count as usize >= self.shards.len() * R_SPLIT_LEN {
            return self.insert_deferring(eh, key, meta, defer);
        }
        let s = &mut self.shards[v.shard as usize];
        let cap = s.slot.len();
        let over = s.len + 1 > limit(cap);
        let deferred = defer && over && s.len < hard_limit(cap);
        if over && !deferred {
            return self.insert_deferring(eh, key, meta, defer);
        }
        let j = v.slot as usize;
        debug_assert!(s.slot[j].meta == 0, "a vacant slot taken since it was found");
        s.slot[j] = RSlot { eh, key, meta };
        s.len += 1;
        self.count += 1;
        if meta & ORPHAN != 0 {
            self.orphans += 1;
        }
        deferred && s.len == limit(cap) + 1
    }

    #[inline(always)]
    fn r_shard(&self, h: u64) -> usize {
        let u = (h >> 32) as usize;
        let i = u & (self.base - 1);
        if i < self.next {
            u & (2 * self.base - 1)
        } else {
            i
        }
    }

    /// Split shard `next`: the entries with the level's bit set go to a new shard at the end.
    fn split(&mut self) {
        let at = self.next;
        let old = std::mem::replace(&mut self.shards[at], RShard::new(MIN_CAP));
        let bit = self.base;
        let high = old.slot.iter().filter(|x| x.meta != 0 && (mix(x.eh) >> 32) as usize & bit != 0).count();
        // Each half as full as a growth would leave it (0.6-0.9): room to spare here costs
        // bytes per holder-block in every rank's table.
        let sized = |n: usize| RShard::new(next_cap(n, MIN_CAP));
        let (mut lo, mut hi) = (sized(old.len - high), sized(high));
        for x in &old.slot {
            if x.meta != 0 {
                let h = mix(x.eh);
                let s = if (h >> 32) as usize & bit != 0 { &mut hi } else { &mut lo };
                s.put(x.eh, h, x.key, x.meta);
            }
        }
        self.shards[at] = lo;
        self.shards.push(hi);
        self.next += 1;
        if self.next == self.base {
            self.base *= 2;
            self.next = 0;
        }
    }

    /// Insert an absent engine hash.
    #[inline]
    pub fn insert(&mut self, eh: u64, key: u64, meta: u16) {
        self.insert_deferring(eh, key, meta, false);
    }

    /// `insert`; with `defer`, a shard past its load limit takes the entry as it is (up to
    /// `hard_limit`) instead of growing inside the caller's quantum. True when this insert
    /// took a shard past its limit: the table is then for `Index::prepare_growth` to grow.
    #[inline]
    pub fn insert_deferring(&mut self, eh: u64, key: u64, meta: u16, defer: bool) -> bool {
        let h = mix(eh);
        if self.count as usize >= self.shards.len() * R_SPLIT_LEN {
            self.split();
        }
        let at = self.r_shard(h);
        let s = &mut self.shards[at];
        let cap = s.slot.len();
        let deferred = defer && s.len + 1 > limit(cap) && s.len < hard_limit(cap);
        if deferred {
            s.put_in(eh, h, key, meta);
        } else {
            s.put(eh, h, key, meta);
        }
        self.count += 1;
        if meta & ORPHAN != 0 {
            self.orphans += 1;
        }
        deferred && s.len == limit(cap) + 1
    }

    /// Each shard past its load limit (deferred growths), rehashed as `grow` would: reads only.
    pub fn grown_shards(&self) -> Vec<(usize, RShard)> {
        let over = |s: &RShard| s.len > limit(s.slot.len());
        self.shards.iter().enumerate().filter(|(_, s)| over(s)).map(|(i, s)| (i, s.grown(s.len + 1))).collect()
    }

    /// Put in shards `grown_shards` made from this table as it still is.
    pub fn install_shards(&mut self, grown: Vec<(usize, RShard)>) {
        for (i, s) in grown {
            debug_assert_eq!(self.shards[i].len, s.len, "a shard changed after it was grown");
            self.shards[i] = s;
        }
    }

    /// Remove a present engine hash; returns its (key, meta).
    pub fn remove(&mut self, eh: u64) -> Option<(u64, u16)> {
        let h = mix(eh);
        let at = self.r_shard(h);
        let s = &mut self.shards[at];
        let j = s.find(eh, h)?;
        let out = (s.slot[j].key, s.slot[j].meta);
        s.delete(j);
        self.count -= 1;
        if out.1 & ORPHAN != 0 {
            self.orphans -= 1;
        }
        Some(out)
    }

    /// Make room for `extra` more entries up front (imports).
    pub fn reserve(&mut self, extra: usize) {
        // Up to the split size: past it, inserts split shards as they fill.
        let per = (extra / self.shards.len()).min(R_SPLIT_LEN);
        for s in &mut self.shards {
            let need = s.len + per + per / 8 + 4;
            if need > limit(s.slot.len()) {
                s.grow(need);
            }
        }
    }

    /// Every live entry: (engine hash, key, meta).
    pub fn entries(&self) -> impl Iterator<Item = (u64, u64, u16)> + '_ {
        self.shards.iter().flat_map(|s| s.slot.iter().filter(|x| x.meta != 0).map(|x| (x.eh, x.key, x.meta)))
    }

    /// Empty the table (counters of unknown removes and duplicates survive).
    pub fn reset(&mut self) {
        self.shards = (0..R_SHARDS).map(|_| RShard::new(MIN_CAP)).collect();
        self.base = R_SHARDS;
        self.next = 0;
        self.count = 0;
        self.orphans = 0;
    }

    pub fn nbytes(&self) -> usize {
        self.shards.iter().map(|s| s.slot.len() * std::mem::size_of::<RSlot>()).sum::<usize>() + 64
    }
}

// ------------------------------------------------------------------ S table

/// One S slot: a key, its meta and its chain-log position side by side, 16
/// bytes, so that a probe costs one cache miss where parallel arrays cost two
/// (the score walk is bound by those misses at 10M holder-blocks). The key is kept
/// mixed (`h = mix(key)`, a bijection; `unmix` gives the key back): a probe
/// steps over other keys' slots by their home, and a stored `h` gives a
/// slot's home in one multiply instead of a mix per slot stepped over.
#[derive(Clone, Copy, Default)]
#[repr(C)]
pub struct Slot {
    pub h: u64,
    pub meta: u32,
    /// Where this slot's entry sits in its rm's `ChainLog`.
    pub pos: u32,
}

pub struct SShard {
    pub slot: Vec<Slot>,
    len: usize,
}

pub const S_SHARD_BITS: u32 = 12;

/// Slots from its home that a score probe compares at once (`STable::holders_fast`).
const WINDOW: usize = 4;

/// Slots from its home that `STable::has_holder` searches before the general scan: most of
/// the two lines `prefetch` asks for (Robin Hood displaces a key past a few slots often at
/// the loads S runs at, and a shared prompt's long clusters push keys homed in them further).
const HAS_WINDOW: usize = 8;

/// Slots `run_start` reads one by one before it gallops.
const LINEAR_STEPS: usize = 4;

#[inline]
fn s_shard(h: u64) -> usize {
    (h >> (64 - S_SHARD_BITS)) as usize
}

impl SShard {
    fn new(cap: usize) -> Self {
        SShard { slot: vec![Slot::default(); cap], len: 0 }
    }

    /// How far slot `j` (occupied) sits past its home.
    #[inline]
    fn disp(&self, j: usize, cap: usize) -> usize {
        let h = home(self.slot[j].h, cap);
        if j >= h {
            j - h
        } else {
            j + cap - h
        }
    }

    /// Where `key`'s slots would start, as (position, distance from `key`'s
    /// home `hk`): the first slot at or after `hk` that is empty or not homed
    /// before `hk`. Robin Hood order keeps a cluster sorted by home, so "homed
    /// before `hk`" holds for a prefix of the slots from `hk` on: after a few
    /// linear steps (the usual case: a short displacement) the search gallops
    /// and bisects. A shared prompt's key holds hundreds of slots in one run,
    /// and a key homed inside that run skips it in O(log n) slots instead of
    /// reading (and hashing) every one of them.
    #[inline]
    fn run_start(&self, hk: usize, cap: usize) -> (usize, usize) {
        let at = |d: usize| if hk + d >= cap { hk + d - cap } else { hk + d };
        // Homed before hk: occupied and displaced further than d.
        let before = |d: usize| {
            let j = at(d);
            self.slot[j].meta != 0 && self.disp(j, cap) > d
        };
        let mut lo = 0usize;
        while lo < LINEAR_STEPS {
            if !before(lo) {
                return (at(lo), lo);
            }
            lo += 1;
        }
        // before(lo - 1) holds; find hi with !before(hi), doubling the step.
        lo -= 1;
        let mut step = LINEAR_STEPS;
        let mut hi = lo + step;
        while before(hi) {
            lo = hi;
            step *= 2;
            // An empty slot always exists, so `before` turns false within one lap.
            hi = (lo + step).min(cap - 1);
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if before(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        (at(hi), hi)
    }

    /// Calls `f(j)` for each slot of the key whose mixed hash is `h`, in run
    /// order, until `f` returns false. Robin Hood order keeps a run sorted by
    /// home, so the slots homed before `key`'s are skipped by `run_start`, and
    /// the scan stops at the first slot homed after `key`'s.
    /// Returns where the scan stopped: the slot `f` stopped at, or else where
    /// a new slot of `key` belongs (see `place_at`).
    #[inline]
    fn slots_of(&self, h: u64, mut f: impl FnMut(usize) -> bool) -> usize {
        let cap = self.slot.len();
        let (mut j, mut d) = self.run_start(home(h, cap), cap);
        while self.slot[j].meta != 0 {
            if self.slot[j].h == h {
                if !f(j) {
                    return j;
                }
            } else if self.disp(j, cap) < d {
                return j;
            }
            j += 1;
            if j == cap {
                j = 0;
            }
            d += 1;
        }
        j
    }

    /// Robin Hood insert (the caller checked capacity): the entry goes to the
    /// first slot homed after its own (or the first empty one).
    fn place(&mut self, x: Slot) {
        let p = self.slots_of(x.h, |_| true);
        self.place_at(p, x);
    }

    /// Put an entry at `p`, where `slots_of` said it belongs: the rest of the
    /// cluster up to the next empty slot moves one place on, which keeps the
    /// run sorted by home without comparing anything.
    fn place_at(&mut self, p: usize, x: Slot) {
        let cap = self.slot.len();
        let mut e = p;
        while self.slot[e].meta != 0 {
            e += 1;
            if e == cap {
                e = 0;
            }
        }
        if e >= p {
            self.slot.copy_within(p..e, p + 1);
        } else {
            // The run wraps past the end: shift the front part, carry the last slot over, then the rest.
            self.slot.copy_within(0..e, 1);
            self.slot[0] = self.slot[cap - 1];
            self.slot.copy_within(p..cap - 1, p + 1);
        }
        self.slot[p] = x;
    }

    fn grow(&mut self, need: usize) {
        if next_cap(need, self.slot.len()) != self.slot.len() {
            *self = self.grown(need);
        }
    }

    /// This shard rehashed into the capacity `need` entries ask for; reads `self` only, so a
    /// writer can build it beside the scores reading the shard (`STable::prepare_growth`).
    fn grown(&self, need: usize) -> SShard {
        let cap = next_cap(need, self.slot.len());
        let old = self;
        let mut new = SShard::new(cap);
        new.len = old.len;
        // Entries in order of their new homes can each take the slot after the
        // previous one (or their home, if later): no probe, no shift. The few
        // that run past the end go in last, by the general insert.
        // The old slots, read from just after an empty one, are in the order of their old homes
        // (one wrap aside), and a home is monotone in the mixed key's low 32 bits whatever the
        // capacity: the new homes come nearly sorted, which a stable sort merges in ~one pass.
        let n_old = old.slot.len();
        let empty = (0..n_old).find(|&i| old.slot[i].meta == 0).expect("a table keeps an empty slot");
        let mut order: Vec<(u32, u32)> = (1..=n_old)
            .map(|k| (empty + k) % n_old)
            .filter(|&i| old.slot[i].meta != 0)
            .map(|i| (home(old.slot[i].h, cap) as u32, i as u32))
            .collect();
        order.sort_by_key(|&(hn, _)| hn);
        let mut next = 0usize;
        let mut late = vec![];
        for &(hn, i) in &order {
            let x = old.slot[i as usize];
            let j = next.max(hn as usize);
            if j < cap {
                new.slot[j] = x;
                next = j + 1;
            } else {
                late.push(x);
            }
        }
        for x in late {
            new.place(x);
        }
        new
    }

    /// Backward-shift delete: the displaced slots after `i` move back one
    /// place, which keeps the run sorted by home and leaves no tombstone.
    fn delete(&mut self, mut i: usize) {
        let cap = self.slot.len();
        loop {
            let j = if i + 1 == cap { 0 } else { i + 1 };
            if self.slot[j].meta == 0 || self.disp(j, cap) == 0 {
                break;
            }
            self.slot[i] = self.slot[j];
            i = j;
        }
        self.slot[i] = Slot::default();
        self.len -= 1;
    }
}

/// One rm's keys (mixed) in the order it first stored them, 0 where a key's slot
/// has gone: a record's chain lies contiguous in it, so the score walk's last
/// survivor checks its next block against the next entry (a sequential read)
/// instead of probing S (a random miss per block at 10M holder-blocks), and
/// probes only where the chain breaks. Exact because an entry is non-zero exactly
/// while the slot that wrote it is live: a slot's `pos` names its entry, and
/// deleting the slot blanks it. Positions are absolute (u32, wrapping): dropping
/// the blank head moves `base`, never a slot's `pos`.
///
/// Entries live in fixed chunks, never in one growing buffer: growing a log by
/// reallocating it copied (and faulted in) the whole log inside an apply quantum,
/// which holds the index's write lock, and scores beside a 1M blocks/s ingest
/// waited milliseconds for it (`score_p99_us_under_ingest` 1.6 → 9–12 ms).
#[derive(Default)]
pub struct ChainLog {
    chunks: std::collections::VecDeque<Box<[u64]>>,
    /// Absolute position of `chunks[0][0]`.
    base: u32,
    /// Entries of `chunks[0]` already dropped.
    head: usize,
    /// Entries from `head` on.
    len: usize,
    /// Non-zero entries.
    live: usize,
}

const CHUNK_BITS: u32 = 9;
/// Entries per chunk (4 KB): small beside a rank's log, and a partly filled last chunk
/// per rm costs little even at thousands of workers.
const CHUNK: usize = 1 << CHUNK_BITS;

/// Entries a log may carry beyond twice its live ones before `STable::recycle`
/// moves its oldest live entries to its end (a hot key stored long ago, such as
/// a system prompt, keeps the head from dropping as everything after it churns).
const LOG_SLACK: usize = 1024;
/// Head entries one recycle visits: a batch of moved entries stays contiguous,
/// so a recycled chain breaks at most once per batch, and a batch's probes
/// (~100 ns each) stay well inside an apply quantum.
const RECYCLE: usize = 64;

impl ChainLog {
    /// Offset from `chunks[0][0]` of `pos`, if the log holds it.
    #[inline(always)]
    fn index(&self, pos: u32) -> Option<usize> {
        let i = pos.wrapping_sub(self.base) as usize;
        (i >= self.head && i < self.head + self.len).then_some(i)
    }

    #[inline]
    fn push(&mut self, h: u64) -> u32 {
        let i = self.head + self.len;
        if i >> CHUNK_BITS == self.chunks.len() {
            self.chunks.push_back(vec![0u64; CHUNK].into_boxed_slice());
        }
        self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)] = h;
        self.len += 1;
        self.live += (h != 0) as usize;
        self.base.wrapping_add(i as u32)
    }

    /// The entries from `pos` to the end of its chunk or of the log, in order (empty when
    /// the log does not hold `pos`): what a walk following a chain compares its keys with.
    #[inline]
    pub fn run(&self, pos: u32) -> &[u64] {
        let Some(i) = self.index(pos) else { return &[] };
        let first = i & !(CHUNK - 1);
        let end = (first + CHUNK).min(self.head + self.len);
        &self.chunks[i >> CHUNK_BITS][i - first..end - first]
    }

    #[inline]
    fn front(&self) -> Option<u64> {
        (self.len > 0).then(|| self.chunks[0][self.head])
    }

    /// Drop the oldest entry (its live count is the caller's): returns it and its position.
    fn pop_front(&mut self) -> Option<(u64, u32)> {
        let h = self.front()?;
        let pos = self.base.wrapping_add(self.head as u32);
        self.head += 1;
        self.len -= 1;
        if self.head == CHUNK {
            self.chunks.pop_front();
            self.head = 0;
            self.base = self.base.wrapping_add(CHUNK as u32);
        }
        Some((h, pos))
    }

    fn drop_blank_head(&mut self) {
        while self.front() == Some(0) {
            self.pop_front();
        }
    }

    fn blank(&mut self, pos: u32) {
        let Some(i) = self.index(pos) else { return };
        let e = &mut self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)];
        if *e == 0 {
            return;
        }
        *e = 0;
        self.live -= 1;
        self.drop_blank_head();
    }

    fn over(&self) -> bool {
        self.len > 2 * self.live + LOG_SLACK
    }

    fn nbytes(&self) -> usize {
        self.chunks.len() * CHUNK * 8 + self.chunks.capacity() * 8
    }

    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        (self.head..self.head + self.len)
            .map(|i| (self.base.wrapping_add(i as u32), self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)]))
    }
}

/// What the holder counts of S depend on: rm -> wm, and per wm the TP degree
/// (0: a single rank with tp_size 1, no run scan needed).
#[derive(Default)]
pub struct Holders {
    pub rm_wm: Vec<u32>,
    pub wm_tp: Vec<u32>,
    pub wm_blocks: Vec<i64>,
}

pub struct STable {
    pub shards: Vec<SShard>,
    pub count: usize,
    /// Holder sets of hot keys: for a key with at least `PROMOTE` slots, the
    /// exact set of wms holding it (all their TP ranks), as a bitset over wm
    /// ids. The score walk reads a shared system prompt's 100+ holders from
    /// here instead of scanning (and comparing) their slots one by one. Kept
    /// exact at every hold/unhold event; absent keys fall back to the scan.
    pub multi: HashMap<u64, Vec<u64>, BuildHasherDefault<KeyHasher>>,
    /// Slots of one key before it gets a holder set (`PROMOTE`; tests lower it
    /// so every key takes the holder-set path).
    pub promote: u32,
    /// Retired rms (a bitset): their slots are garbage left by a cleared
    /// table, skipped by every reader until `purge` has removed them all. An
    /// AllBlocksCleared then costs O(1) slots instead of one delete per block
    /// (100 ms per million), and the deletes happen later in bounded sweeps.
    dead: Dead,
    /// Per rm, the keys it stored in order (`ChainLog`).
    logs: Vec<ChainLog>,
    /// While set (an apply quantum's inserts), a shard past its load limit is not grown by the
    /// insert that fills it but listed in `deferred`, for the writer to grow beside the scores
    /// between quanta (`Index::prepare_growth`): a growth inside a quantum held the write lock
    /// for 100-200 us, mostly the page faults of the new slots, and every score waited it out.
    pub defer: bool,
    /// Shards whose growth is deferred (may repeat, or be grown since: `prepare_growth` checks).
    deferred: Vec<u32>,
}

/// A key's mixed hash, shard and home slot: what `STable::probe` computes once
/// for `prefetch` and `holders_fast` both.
#[derive(Clone, Copy, Default)]
pub struct Probe {
    pub h: u64,
    shard: u32,
    home: u32,
}

/// A bitset of rms, with its population (readers skip the test while it is 0).
#[derive(Default)]
pub struct Dead {
    bits: Vec<u64>,
    n: usize,
}

impl Dead {
    #[inline(always)]
    pub fn has(&self, rm: usize) -> bool {
        self.n != 0 && self.bits.get(rm >> 6).is_some_and(|&b| b & (1 << (rm & 63)) != 0)
    }
}

/// Keys are XXH3 output already: one multiply spreads them for the map.
#[derive(Default)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100000001B3);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x.wrapping_mul(0x9E3779B97F4A7C15);
    }
}

/// Slots of one key before it gets a holder set.
pub const PROMOTE: u32 = 8;

#[inline]
fn set_bit(bits: &mut Vec<u64>, i: u32, on: bool) {
    let w = (i >> 6) as usize;
    if bits.len() <= w {
        if !on {
            return;
        }
        bits.resize(w + 1, 0);
    }
    if on {
        bits[w] |= 1 << (i & 63);
    } else {
        bits[w] &= !(1 << (i & 63));
    }
}

#[inline]
fn rm_of(meta: u32) -> usize {
    ((meta >> CNT_BITS) - 1) as usize
}

impl Default for STable {
    fn default() -> Self {
        Self::new()
    }
}

impl STable {
    pub fn new() -> Self {
        STable {
            shards: (0..1usize << S_SHARD_BITS).map(|_| SShard::new(MIN_CAP)).collect(),
            count: 0,
            multi: HashMap::default(),
            promote: PROMOTE,
            dead: Dead::default(),
            logs: vec![],
            defer: false,
            deferred: vec![],
        }
    }

    /// Whether `rm`'s slots are garbage (see `kill`).
    #[inline(always)]
    pub fn is_dead(&self, rm: usize) -> bool {
        self.dead.has(rm)
    }

    /// Retire `rm`: from now on no reader sees its slots. Its wm's holder-set
    /// bits and block count are the caller's (`forget_wm`), since a wm whose
    /// rank holds nothing holds nothing.
    pub fn kill(&mut self, rm: u32) {
        if !self.dead.has(rm as usize) {
            set_bit(&mut self.dead.bits, rm, true);
            self.dead.n += 1;
        }
    }

    /// Undo `kill` (a rolled-back clear), or mark a fully purged rm reusable.
    pub fn revive(&mut self, rm: u32) {
        if self.dead.has(rm as usize) {
            set_bit(&mut self.dead.bits, rm, false);
            self.dead.n -= 1;
        }
    }

    /// Drop one entry of a dead rm under `key` (what `dec` does, without the
    /// holder accounting `kill` already settled).
    pub fn purge(&mut self, key: u64, rm: u32) {
        let h = mix(key);
        let s = &mut self.shards[s_shard(h)];
        let tag = rm + 1;
        let mut found = None;
        s.slots_of(h, |j| {
            if (s.slot[j].meta >> CNT_BITS) == tag {
                found = Some(j);
                return false;
            }
            true
        });
        let Some(j) = found else { return };
        if s.slot[j].meta & CNT_MASK > 1 {
            s.slot[j].meta -= 1;
        } else {
            // The log is left as it is: no reader follows a dead rm's log, and the sweep drops
            // it whole once the last slot is gone (`reset_log`). Blanking entry by entry let the
            // last purge pop the whole blank log, ~1M entries of a cleared rank, in one apply.
            s.delete(j);
            self.count -= 1;
        }
    }

    /// How many entries of `rm`'s chain log precede the entry of `key` (its age in store
    /// order), `u32::MAX` without a slot: an export writes a table's entries in this order,
    /// so that the index importing them lays its chains out as contiguous again.
    pub fn log_age(&self, key: u64, rm: u32) -> u32 {
        let h = mix(key);
        let s = &self.shards[s_shard(h)];
        let base = self.logs.get(rm as usize).map_or(0, |l| l.base);
        let mut age = u32::MAX;
        s.slots_of(h, |j| {
            if (s.slot[j].meta >> CNT_BITS) == rm + 1 {
                age = s.slot[j].pos.wrapping_sub(base);
                return false;
            }
            true
        });
        age
    }

    /// Forget a fully purged rm's chain log (its id is about to be reused).
    pub fn reset_log(&mut self, rm: u32) {
        if let Some(log) = self.logs.get_mut(rm as usize) {
            *log = ChainLog::default();
        }
    }

    /// `rm`'s chain-log entries from `pos` on, as far as they are contiguous in memory
    /// (`ChainLog::run`): each the mixed key of a live slot of `rm`, or 0.
    #[inline]
    pub fn logged_run(&self, rm: usize, pos: u32) -> &[u64] {
        self.logs.get(rm).map_or(&[], |l| l.run(pos))
    }

    /// Move up to `RECYCLE` of `rm`'s oldest entries to its log's end, each live one's slot
    /// re-pointed, so that a log's length stays within about twice its live entries.
    fn recycle(&mut self, rm: u32) {
        let tag = rm + 1;
        let log = &mut self.logs[rm as usize];
        for _ in 0..RECYCLE {
            let Some((h, old)) = log.pop_front() else { break };
            if h == 0 {
                continue;
            }
            log.live -= 1;
            let pos = log.push(h);
            let s = &mut self.shards[s_shard(h)];
            let mut found = None;
            s.slots_of(h, |j| {
                if (s.slot[j].meta >> CNT_BITS) == tag && s.slot[j].pos == old {
                    found = Some(j);
                    return false;
                }
                true
            });
            debug_assert!(found.is_some(), "a live log entry without its slot");
            if let Some(j) = found {
                s.slot[j].pos = pos;
            }
        }
        log.drop_blank_head();
    }

    /// Take `wm` out of every holder set; returns the keys it was in (to put it back on rollback).
    pub fn forget_wm(&mut self, wm: u32) -> Vec<u64> {
        let (w, bit) = ((wm >> 6) as usize, 1u64 << (wm & 63));
        let mut had = vec![];
        self.multi.retain(|&key, bits| {
            if bits.get(w).is_some_and(|&b| b & bit != 0) {
                bits[w] &= !bit;
                had.push(key);
                return bits.iter().any(|&b| b != 0);
            }
            true
        });
        had
    }

    /// Put `wm` back into the holder sets of `keys` (the inverse of `forget_wm`).
    pub fn restore_wm(&mut self, wm: u32, keys: &[u64]) {
        for &key in keys {
            set_bit(self.multi.entry(key).or_default(), wm, true);
        }
    }

    /// Distinct ranks of `wm` holding `key` (each rm has at most one slot).
    #[inline]
    fn run_count(s: &SShard, dead: &Dead, h: u64, wm: u32, hd: &Holders) -> u32 {
        let mut n = 0;
        s.slots_of(h, |j| {
            let rm = rm_of(s.slot[j].meta);
            if hd.rm_wm[rm] == wm && !dead.has(rm) {
                n += 1;
            }
            true
        });
        n
    }

    /// Count one more entry of `rm` under `key`; false at the count ceiling (nothing changed).
    pub fn inc(&mut self, key: u64, rm: u32, hd: &mut Holders) -> bool {
        let h = mix(key);
        if self.logs.len() <= rm as usize {
            self.logs.resize_with(rm as usize + 1, ChainLog::default);
        }
        if self.logs[rm as usize].over() {
            self.recycle(rm);
        }
        let at_shard = s_shard(h);
        let s = &mut self.shards[at_shard];
        let dead = &self.dead;
        let tag = rm + 1;
        let mut slots = 1u32; // this key's slots once the new one is in (the walk sees them all)
        let mut found = None;
        let at = s.slots_of(h, |j| {
            if (s.slot[j].meta >> CNT_BITS) == tag {
                found = Some(j);
                return false;
            }
            slots += 1;
            true
        });
        if let Some(j) = found {
            let m = s.slot[j].meta;
            if m & CNT_MASK == CNT_MASK {
                return false;
            }
            s.slot[j].meta = m + 1;
            return true;
        }
        let x = Slot { h, meta: (tag << CNT_BITS) | 1, pos: self.logs[rm as usize].push(h) };
        let cap = s.slot.len();
        if s.len < limit(cap) {
            s.place_at(at, x);
        } else if self.defer && s.len < hard_limit(cap) {
            if s.len == limit(cap) {
                self.deferred.push(at_shard as u32);
            }
            s.place_at(at, x);
        } else {
            s.grow(s.len + 1);
            s.place(x);
        }
        s.len += 1;
        self.count += 1;
        let wm = hd.rm_wm[rm as usize];
        let tp = hd.wm_tp[wm as usize];
        let held = tp == 0 || Self::run_count(s, dead, h, wm, hd) == tp;
        if held {
            hd.wm_blocks[wm as usize] += 1;
        }
        if let Some(bits) = self.multi.get_mut(&key) {
            if held {
                set_bit(bits, wm, true);
            }
        } else if slots >= self.promote {
            let bits = Self::holder_set(s, dead, h, hd);
            if bits.iter().any(|&b| b != 0) {
                self.multi.insert(key, bits);
            }
        }
        true
    }

    /// The wms holding `key` (as many distinct ranks as their TP degree), computed from its slots.
    fn holder_set(s: &SShard, dead: &Dead, h: u64, hd: &Holders) -> Vec<u64> {
        let mut bits = vec![];
        s.slots_of(h, |j| {
            let rm = rm_of(s.slot[j].meta);
            if dead.has(rm) {
                return true;
            }
            let wm = hd.rm_wm[rm];
            if Self::run_count(s, dead, h, wm, hd) >= hd.wm_tp[wm as usize].max(1) {
                set_bit(&mut bits, wm, true);
            }
            true
        });
        bits
    }

    /// Forget every holder set (after a TP degree changed: they re-form as keys gain slots).
    pub fn drop_holder_sets(&mut self) {
        self.multi.clear();
    }

    /// Whether `inc(key, rm)` would hit the count ceiling.
    pub fn at_ceiling(&self, key: u64, rm: u32) -> bool {
        let h = mix(key);
        let s = &self.shards[s_shard(h)];
        let tag = rm + 1;
        let mut full = false;
        s.slots_of(h, |j| {
            if (s.slot[j].meta >> CNT_BITS) == tag {
                full = s.slot[j].meta & CNT_MASK == CNT_MASK;
                return false;
            }
            true
        });
        full
    }

    pub fn dec(&mut self, key: u64, rm: u32, hd: &mut Holders) {
        let h = mix(key);
        let s = &mut self.shards[s_shard(h)];
        let dead = &self.dead;
        let tag = rm + 1;
        let mut found = None;
        s.slots_of(h, |j| {
            if (s.slot[j].meta >> CNT_BITS) == tag {
                found = Some(j);
                return false;
            }
            true
        });
        let Some(j) = found else { return };
        let m = s.slot[j].meta;
        if m & CNT_MASK > 1 {
            s.slot[j].meta = m - 1;
            return;
        }
        let wm = hd.rm_wm[rm as usize];
        let tp = hd.wm_tp[wm as usize];
        if tp == 0 || Self::run_count(s, dead, h, wm, hd) == tp {
            hd.wm_blocks[wm as usize] -= 1;
            if let Some(bits) = self.multi.get_mut(&key) {
                set_bit(bits, wm, false);
                if bits.iter().all(|&b| b == 0) {
                    self.multi.remove(&key);
                }
            }
        }
        let pos = s.slot[j].pos;
        s.delete(j);
        self.count -= 1;
        self.logs[rm as usize].blank(pos);
    }

    /// Calls `f(key, wm, holders)` once per (key, wm) present in S, with the
    /// number of distinct ranks of wm holding the key: each group is taken at
    /// its first slot in run order, so the enumeration does not depend on slot
    /// positions, capacity or insertion order.
    pub fn for_each_key_wm(&self, hd: &Holders, mut f: impl FnMut(u64, u32, u32)) {
        let dead = &self.dead;
        for s in &self.shards {
            let cap = s.slot.len();
            for i in 0..cap {
                if s.slot[i].meta == 0 || dead.has(rm_of(s.slot[i].meta)) {
                    continue;
                }
                let h = s.slot[i].h;
                let wm = hd.rm_wm[rm_of(s.slot[i].meta)];
                let mut j = home(h, cap);
                let mut first = true;
                while j != i {
                    if s.slot[j].meta != 0
                        && s.slot[j].h == h
                        && hd.rm_wm[rm_of(s.slot[j].meta)] == wm
                        && !dead.has(rm_of(s.slot[j].meta))
                    {
                        first = false;
                        break;
                    }
                    j += 1;
                    if j == cap {
                        j = 0;
                    }
                }
                if first {
                    f(unmix(h), wm, Self::run_count(s, dead, h, wm, hd));
                }
            }
        }
    }

    /// Where `key`'s probe starts. A score walk computes it once per block, when it
    /// prefetches the block's slots, and reads the slots from it later.
    #[inline(always)]
    pub fn probe(&self, key: u64) -> Probe {
        let h = mix(key);
        let shard = s_shard(h);
        Probe { h, shard: shard as u32, home: home(h, self.shards[shard].slot.len()) as u32 }
    }

    /// A key's mixed hash alone, its shard and home left to `complete`: what the score walk's
    /// last survivor needs of a block its chain log answers (the shard's length is a load
    /// from a 128 KB array, a cache miss the log's compare does not need).
    #[inline(always)]
    pub fn lazy(key: u64) -> Probe {
        Probe { h: mix(key), shard: u32::MAX, home: 0 }
    }

    /// `p` with its shard and home, computed if `lazy` left them out.
    #[inline(always)]
    pub fn complete(&self, p: Probe) -> Probe {
        if p.shard != u32::MAX {
            return p;
        }
        let shard = s_shard(p.h);
        Probe { h: p.h, shard: shard as u32, home: home(p.h, self.shards[shard].slot.len()) as u32 }
    }

    /// Start loading the first two cache lines of a probe run. A score walk
    /// over a table much larger than the cache waits on one miss per block;
    /// asked a few blocks ahead, those misses overlap. A hint only: it
    /// changes no state.
    #[inline(always)]
    pub fn prefetch(&self, p: Probe) {
        let at = self.shards[p.shard as usize].slot.as_ptr().wrapping_add(p.home as usize) as *const u8;
        prefetch_line(at);
        // And the line after: a key displaced from its home, or a walk past its last
        // slot to the first slot homed after it, reads on into the next line.
        prefetch_line(at.wrapping_add(64));
    }

    /// Holders of a probed key for the score walk: `f(rm)` for each slot of the
    /// key, without bounds checks (the walk visits every holder of every matched
    /// block). Same stop rule as `SShard::slots_of`.
    #[inline(always)]
    pub fn holders_fast(&self, p: Probe, mut f: impl FnMut(usize)) {
        self.each_slot(p, |x| f(rm_of(x.meta)))
    }

    /// `holders_fast`'s scan, handing over each live slot of the key.
    #[inline(always)]
    fn each_slot(&self, p: Probe, mut f: impl FnMut(&Slot)) {
        let h = p.h;
        let s = &self.shards[p.shard as usize];
        let cap = s.slot.len();
        let slots = s.slot.as_ptr();
        let hk = p.home as usize;
        // Most keys have one slot or a few, within a few slots of their home: compare a
        // window of slots at once, without a branch per slot (the walk is bound by branch
        // misses when its slots are in cache). The window holds every slot of the key when
        // the slot after it is empty or homed after the key's home (Robin Hood order: a
        // cluster is sorted by home). Else the general scan below.
        if hk + WINDOW < cap {
            let mut mask = 0u32;
            for t in 0..WINDOW {
                let x = &s.slot[hk + t];
                mask |= ((x.h == h) as u32 & (x.meta != 0) as u32) << t;
            }
            // Homed after hk: displaced less than its distance from hk (a cluster may wrap
            // past the table's end, so homes are compared by displacement, not by value).
            if s.slot[hk + WINDOW].meta == 0 || s.disp(hk + WINDOW, cap) < WINDOW {
                while mask != 0 {
                    let x = &s.slot[hk + mask.trailing_zeros() as usize];
                    if !self.dead.has(rm_of(x.meta)) {
                        f(x);
                    }
                    mask &= mask - 1;
                }
                return;
            }
        }
        // Most keys sit at their home: nothing homed before them to step over.
        let (mut j, mut d) = if s.slot[hk].h == h { (hk, 0) } else { s.run_start(hk, cap) };
        // SAFETY: j < cap == key.len() == meta.len(), and the table always has an empty slot.
        unsafe {
            loop {
                let m = (*slots.add(j)).meta;
                if m == 0 {
                    break;
                }
                let k = (*slots.add(j)).h;
                if k == h {
                    let rm = ((m >> CNT_BITS) - 1) as usize;
                    if !self.dead.has(rm) {
                        f(&*slots.add(j));
                    }
                } else {
                    let hj = home(k, cap);
                    if (if j >= hj { j - hj } else { j + cap - hj }) < d {
                        break;
                    }
                }
                j += 1;
                if j == cap {
                    j = 0;
                }
                d += 1;
            }
        }
    }

    /// A live slot of a probed key whose rm `is` accepts, as (rm, its log position): the
    /// scan of `holders_fast` that stops at the first. A key's slots lie at or after its home,
    /// so one found in the window answers without `holders_fast`'s proof that the window
    /// holds them all (a long cluster's, which sends it to the general scan). The score
    /// walk's last survivor asks this where its chain log breaks.
    #[inline(always)]
    pub fn holder_slot(&self, p: Probe, is: impl Fn(usize) -> bool) -> Option<(usize, u32)> {
        let s = &self.shards[p.shard as usize];
        let hk = p.home as usize;
        if hk + HAS_WINDOW < s.slot.len() {
            for t in 0..HAS_WINDOW {
                let x = &s.slot[hk + t];
                if x.h == p.h && x.meta != 0 {
                    let rm = rm_of(x.meta);
                    if is(rm) && !self.dead.has(rm) {
                        return Some((rm, x.pos));
                    }
                }
            }
        }
        let mut found = None;
        self.each_slot(p, |x| {
            let rm = rm_of(x.meta);
            if found.is_none() && is(rm) {
                found = Some((rm, x.pos));
            }
        });
        found
    }

    /// Holders of `key`: calls `f(rm)` for each slot of the key.
    #[inline]
    pub fn holders(&self, key: u64, mut f: impl FnMut(u32)) {
        let h = mix(key);
        let s = &self.shards[s_shard(h)];
        s.slots_of(h, |j| {
            let rm = rm_of(s.slot[j].meta);
            if !self.dead.has(rm) {
                f(rm as u32);
            }
            true
        });
    }

    pub fn nbytes(&self) -> usize {
        self.shards.iter().map(|s| s.slot.len() * std::mem::size_of::<Slot>()).sum::<usize>()
            + self.logs.iter().map(|l| l.nbytes() + std::mem::size_of::<ChainLog>()).sum::<usize>()
    }

    /// Whether some shard's growth was deferred (`defer`).
    pub fn growth_deferred(&self) -> bool {
        !self.deferred.is_empty()
    }

    /// The deferred growths, each shard rehashed as its insert would have: reads only.
    pub fn prepare_growth(&self) -> Vec<(u32, SShard)> {
        let mut ids = self.deferred.clone();
        ids.sort_unstable();
        ids.dedup();
        let over = |s: &SShard| s.len > limit(s.slot.len());
        ids.into_iter()
            .map(|i| (i, &self.shards[i as usize]))
            .filter(|(_, s)| over(s))
            .map(|(i, s)| (i, s.grown(s.len + 1)))
            .collect()
    }

    /// Put in the shards `prepare_growth` made from this table as it still is.
    pub fn install_growth(&mut self, grown: Vec<(u32, SShard)>) {
        for (i, s) in grown {
            debug_assert_eq!(self.shards[i as usize].len, s.len, "a shard changed after it was grown");
            self.shards[i as usize] = s;
        }
        self.deferred.clear();
    }

    /// Size the shards for `total` entries up front.
    pub fn reserve(&mut self, total: usize) {
        let per = (total >> S_SHARD_BITS) + (total >> (S_SHARD_BITS + 3));
        for s in &mut self.shards {
            if per > limit(s.slot.len()) {
                s.grow(per);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap as Map;

    use crate::test_rng::xorshift as rng;

    /// Robin Hood order: along every cluster, an entry is homed no later than the next one.
    fn check_order(t: &STable) {
        for s in &t.shards {
            let cap = s.slot.len();
            for j in 0..cap {
                let n = (j + 1) % cap;
                if s.slot[j].meta != 0 && s.slot[n].meta != 0 {
                    assert!(s.disp(n, cap) <= s.disp(j, cap) + 1, "slot {n} jumps ahead of slot {j}");
                }
            }
        }
    }

    /// The chain logs' invariant: a live slot's `pos` names an entry holding its key, and
    /// every non-zero entry is named by exactly one live slot of its rm.
    fn check_logs(t: &STable) {
        let mut named: Map<(usize, u32), u64> = Map::new();
        for s in &t.shards {
            for x in s.slot.iter().filter(|x| x.meta != 0 && !t.dead.has(rm_of(x.meta))) {
                let rm = rm_of(x.meta);
                if x.h != 0 {
                    let entry = t.logged_run(rm, x.pos).first().copied().unwrap_or(0);
                    assert_eq!(entry, x.h, "slot of rm {rm} at log position {}", x.pos);
                }
                assert!(named.insert((rm, x.pos), x.h).is_none(), "two slots name one entry");
            }
        }
        for (rm, log) in t.logs.iter().enumerate().filter(|(rm, _)| !t.dead.has(*rm)) {
            let mut live = 0;
            for (pos, h) in log.iter() {
                if h != 0 {
                    live += 1;
                    assert_eq!(named.get(&(rm, pos)), Some(&h), "entry {pos} of rm {rm} without its slot");
                }
            }
            assert_eq!(live, log.live);
            assert!(log.front() != Some(0), "a blank head kept");
        }
    }

    /// A log stays within about twice its live entries while one old key pins its head and
    /// everything stored after it churns, and recycling keeps every slot pointing at its entry.
    #[test]
    fn a_pinned_chain_log_recycles_and_stays_exact() {
        let mut hd = Holders { rm_wm: vec![0, 1], wm_tp: vec![0; 2], wm_blocks: vec![0; 2] };
        let mut t = STable::new();
        let mut r = rng(5);
        let pinned: Vec<u64> = (0..300).map(|_| r()).collect();
        for &k in &pinned {
            assert!(t.inc(k, 0, &mut hd));
        }
        let mut held: std::collections::VecDeque<u64> = Default::default();
        for step in 0..200_000 {
            let k = r();
            assert!(t.inc(k, 0, &mut hd));
            held.push_back(k);
            if held.len() > 2_000 {
                t.dec(held.pop_front().unwrap(), 0, &mut hd);
            }
            let log = &t.logs[0];
            assert!(log.len <= 2 * log.live + LOG_SLACK + RECYCLE + 1, "log of {} for {} live", log.len, log.live);
            if step % 20_000 == 0 {
                check_logs(&t);
            }
        }
        check_logs(&t);
        // The pinned keys were recycled as one run: still contiguous in order, bar batch edges.
        let p = |k: u64| t.holder_slot(t.probe(k), |rm| rm == 0).expect("held").1;
        let breaks = pinned.windows(2).filter(|w| p(w[1]) != p(w[0]).wrapping_add(1)).count();
        assert!(breaks <= pinned.len() / RECYCLE + 1, "{breaks} breaks in the pinned chain");
    }

    /// An R table against a map through splits, growth, deletes and a reset: every entry found
    /// with its key and meta, none that was removed, and no shard past the split size (bar
    /// its growth margin). Half the inserts take a store's path (`find_for_store`, then
    /// `insert_vacant`), in the second round with growth deferred and installed later.
    #[test]
    fn r_table_splits_and_matches_a_map() {
        let mut t = RTable::new(0, 0, 0);
        let mut model: Map<u64, (u64, u16)> = Map::new();
        let mut r = rng(11);
        for round in 0..2 {
            let defer = round == 1;
            let mut deferred = 0;
            for step in 0..200_000u64 {
                let eh = r() % 400_000;
                if step % 3 == 2 {
                    assert_eq!(t.remove(eh), model.remove(&eh), "remove {eh}");
                } else if step % 3 == 1 {
                    match t.find_for_store(eh) {
                        Ok(m) => assert_eq!(Some(*m), model.get(&eh).map(|v| v.1), "held {eh}"),
                        Err(v) => {
                            assert!(!model.contains_key(&eh), "{eh} held but not found");
                            let (key, meta) = (r(), 1 + (step % 1000) as u16);
                            if t.insert_vacant(v, eh, key, meta, defer) {
                                deferred += 1;
                            }
                            model.insert(eh, (key, meta));
                        }
                    }
                } else if let std::collections::hash_map::Entry::Vacant(v) = model.entry(eh) {
                    let (key, meta) = (r(), 1 + (step % 1000) as u16);
                    t.insert_deferring(eh, key, meta, defer);
                    v.insert((key, meta));
                }
                if defer && step % 5_000 == 0 {
                    let g = t.grown_shards();
                    t.install_shards(g);
                }
            }
            assert_eq!(deferred > 0, defer, "round {round}: {deferred} growths deferred");
            assert_eq!(t.count as usize, model.len());
            assert!(t.shards.len() > 16, "round {round}: no split ({} shards)", t.shards.len());
            for s in &t.shards {
                assert!(s.len <= R_SPLIT_LEN * 3, "a shard of {} entries", s.len);
            }
            for (&eh, &v) in &model {
                assert_eq!(t.get(eh), Some(v));
            }
            let mut seen: Vec<u64> = t.entries().map(|(eh, _, _)| eh).collect();
            seen.sort_unstable();
            let mut want: Vec<u64> = model.keys().copied().collect();
            want.sort_unstable();
            assert_eq!(seen, want);
            t.reset();
            model.clear();
            assert_eq!(t.get(1), None);
        }
    }

    /// inc/dec against a map of counts: every key's holders, every count, the
    /// ceiling, through growth and deletes, with a few keys of many holders
    /// (the long runs Robin Hood order is for) among many of one.
    /// S keeps mixed keys and hands keys back through `unmix`: exact inverses.
    #[test]
    fn unmix_inverts_mix() {
        let mut next = rng(7);
        for x in [0u64, 1, u64::MAX, 1 << 63].into_iter().chain((0..10_000).map(|_| next())) {
            assert_eq!(unmix(mix(x)), x);
            assert_eq!(mix(unmix(x)), x);
        }
    }

    #[test]
    fn s_table_matches_a_map_through_growth_and_deletes() {
        let nrm = 40u32;
        let mut hd =
            Holders { rm_wm: (0..nrm).collect(), wm_tp: vec![0; nrm as usize], wm_blocks: vec![0; nrm as usize] };
        let mut t = STable::new();
        let mut model: Map<(u64, u32), u32> = Map::new();
        let mut r = rng(7);
        let hot: Vec<u64> = (0..6).map(|_| r()).collect();
        let mut keys: Vec<u64> = hot.clone();
        for step in 0..60_000 {
            let roll = r() % 100;
            let key = if roll < 30 {
                hot[(r() % 6) as usize]
            } else if roll < 60 || keys.len() < 10 {
                let k = r();
                keys.push(k);
                k
            } else {
                keys[(r() % keys.len() as u64) as usize]
            };
            let rm = (r() % nrm as u64) as u32;
            if r() % 3 == 0 {
                if let Some(c) = model.get_mut(&(key, rm)) {
                    t.dec(key, rm, &mut hd);
                    *c -= 1;
                    if *c == 0 {
                        model.remove(&(key, rm));
                    }
                }
            } else {
                assert!(t.inc(key, rm, &mut hd));
                *model.entry((key, rm)).or_insert(0) += 1;
            }
            if step % 5_000 == 0 {
                check_order(&t);
                check_logs(&t);
            }
        }
        check_order(&t);
        check_logs(&t);
        assert_eq!(t.count, model.len());
        let mut by_key: Map<u64, Vec<u32>> = Map::new();
        for &(k, rm) in model.keys() {
            by_key.entry(k).or_default().push(rm);
        }
        for k in keys.iter().chain(&hot) {
            let mut got = vec![];
            t.holders(*k, |rm| got.push(rm));
            let mut fast = vec![];
            t.holders_fast(t.probe(*k), |rm| fast.push(rm as u32));
            got.sort_unstable();
            fast.sort_unstable();
            let mut want = by_key.get(k).cloned().unwrap_or_default();
            want.sort_unstable();
            assert_eq!(got, want);
            assert_eq!(fast, want);
        }
        for (&(k, rm), &c) in &model {
            assert_eq!(t.at_ceiling(k, rm), c == CNT_MASK);
        }
        // Drain everything: the table ends empty, with every slot free.
        for (&(k, rm), &c) in &model {
            for _ in 0..c {
                t.dec(k, rm, &mut hd);
            }
        }
        assert_eq!(t.count, 0);
        assert!(t.shards.iter().all(|s| s.slot.iter().all(|x| x.meta == 0)));
    }
}

/// What Robin Hood order saves the score walk, on a table shaped like the
/// bench's 10M holder-blocks (1,024 shared-prompt keys with 170 holders each,
/// single-holder keys for the rest): slots a lookup of an absent key visits,
/// stopping at the first slot homed after it (what S does) and, for
/// comparison, running to the end of the cluster (plain linear probing).
/// `cargo test --release scan_lengths -- --ignored --nocapture`
#[cfg(test)]
mod scan_lengths {
    use super::*;

    #[test]
    #[ignore]
    fn scan_lengths() {
        let mut t = STable::new();
        let mut hd = Holders { rm_wm: (0..256).collect(), wm_tp: vec![0; 256], wm_blocks: vec![0; 256] };
        let mut rnd = crate::test_rng::xorshift(0x12345);
        let hot: Vec<u64> = (0..1024).map(|_| rnd()).collect();
        for &k in &hot {
            for rm in 0..170 {
                t.inc(k, rm, &mut hd);
            }
        }
        while t.count < 10_000_000 {
            let k = rnd();
            t.inc(k, (k % 256) as u32, &mut hd);
        }
        let (mut rh, mut lp, n) = (0usize, 0usize, 200_000);
        for _ in 0..n {
            let h = mix(rnd());
            let s = &t.shards[s_shard(h)];
            let cap = s.slot.len();
            let mut j = home(h, cap);
            let mut d = 0;
            while s.slot[j].meta != 0 {
                if s.disp(j, cap) >= d {
                    rh += 1;
                } else {
                    d = usize::MAX; // stopped: count the rest for linear probing only
                }
                lp += 1;
                j = (j + 1) % cap;
                d = d.saturating_add(1);
            }
        }
        eprintln!(
            "slots per absent-key lookup: {:.1} (Robin Hood), {:.1} (to the cluster's end)",
            rh as f64 / n as f64,
            lp as f64 / n as f64
        );
    }
}
