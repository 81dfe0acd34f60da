//! Open-addressing tables behind the index.
//!
//! Both kinds are linear probing over parallel arrays, deleted with backward
//! shift (no tombstones, so a long-lived index never degrades), sized to any
//! capacity (fastrange instead of a power-of-two mask, so growing by 1.5x keeps
//! the load between 0.6 and 0.9). Each table is split into shards chosen by the
//! top bits of the mixed hash, and a shard grows on its own: a table of 10M
//! entries never rehashes more than a few tens of thousands of slots in one
//! call (the "no single apply holds the loop for more than ~5 ms"), and
//! shards fill at about the same rate but cross their thresholds in different
//! calls, so the growth is staggered instead of one long pause.
//!
//! - **S** (one per index), the scoring table: (block key, rm) -> count, `rm`
//!   being a (worker, tp rank, medium, KV-cache group); the count is how many
//!   of that rank's engine-hash entries (distinct engine hashes) map to the
//!   key. Slot: key u64 + meta u32 = `(rm + 1) << 10 | count`, 12 bytes. The
//!   home slot depends on the key only, so every holder of a key sits in the
//!   probe run that starts at its home: one contiguous scan lists a key's
//!   holders (and their TP ranks) without a per-key node or pointer.
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

#[inline]
fn home(h: u64, cap: usize) -> usize {
    (((h & 0xFFFF_FFFF) * cap as u64) >> 32) as usize
}

#[inline]
fn limit(cap: usize) -> usize {
    (cap * MAX_LOAD_NUM / MAX_LOAD_DEN).min(cap - 1)
}

fn next_cap(need: usize, mut cap: usize) -> usize {
    while limit(cap) < need {
        cap = MIN_CAP.max(cap * 3 / 2 + 1);
    }
    cap
}

// ------------------------------------------------------------------ R tables

#[derive(Clone)]
pub struct RShard {
    pub eh: Vec<u64>,
    pub key: Vec<u64>,
    pub meta: Vec<u16>,
    len: usize,
}

impl RShard {
    fn new(cap: usize) -> Self {
        RShard { eh: vec![0; cap], key: vec![0; cap], meta: vec![0; cap], len: 0 }
    }

    #[inline]
    fn find(&self, eh: u64, h: u64) -> Option<usize> {
        let cap = self.eh.len();
        let mut j = home(h, cap);
        while self.meta[j] != 0 {
            if self.eh[j] == eh {
                return Some(j);
            }
            j += 1;
            if j == cap {
                j = 0;
            }
        }
        None
    }

    fn grow(&mut self, need: usize) {
        let cap = next_cap(need, self.eh.len());
        if cap == self.eh.len() {
            return;
        }
        let old = std::mem::replace(self, RShard::new(cap));
        for i in 0..old.eh.len() {
            if old.meta[i] != 0 {
                self.put(old.eh[i], mix(old.eh[i]), old.key[i], old.meta[i]);
            }
        }
    }

    /// Insert an engine hash known to be absent (capacity checked here).
    #[inline]
    fn put(&mut self, eh: u64, h: u64, key: u64, meta: u16) {
        if self.len + 1 > limit(self.eh.len()) {
            self.grow(self.len + 1);
        }
        let cap = self.eh.len();
        let mut j = home(h, cap);
        while self.meta[j] != 0 {
            j += 1;
            if j == cap {
                j = 0;
            }
        }
        self.eh[j] = eh;
        self.key[j] = key;
        self.meta[j] = meta;
        self.len += 1;
    }

    fn delete(&mut self, mut i: usize) {
        let cap = self.eh.len();
        let mut j = i;
        loop {
            j += 1;
            if j == cap {
                j = 0;
            }
            if self.meta[j] == 0 {
                break;
            }
            let h = home(mix(self.eh[j]), cap);
            // Move j back to the hole i unless j's home lies cyclically in (i, j].
            let stay = if i <= j { i < h && h <= j } else { h > i || h <= j };
            if !stay {
                self.eh[i] = self.eh[j];
                self.key[i] = self.key[j];
                self.meta[i] = self.meta[j];
                i = j;
            }
        }
        self.meta[i] = 0;
        self.len -= 1;
    }
}

pub const R_SHARD_BITS: u32 = 4;

/// One rank x medium x group: engine hash -> (key, meta), plus its counters.
#[derive(Clone)]
pub struct RTable {
    pub shards: Vec<RShard>,
    pub rm: u32,
    pub medium: u32,
    pub group: i64,
    pub count: i64,
    pub orphans: i64,
    pub unknown: i64,
    pub dups: i64,
}

#[inline]
fn r_shard(h: u64) -> usize {
    (h >> (64 - R_SHARD_BITS)) as usize
}

impl RTable {
    pub fn new(rm: u32, medium: u32, group: i64) -> Self {
        RTable {
            shards: (0..1usize << R_SHARD_BITS).map(|_| RShard::new(MIN_CAP)).collect(),
            rm,
            medium,
            group,
            count: 0,
            orphans: 0,
            unknown: 0,
            dups: 0,
        }
    }

    /// (key, meta) of an engine hash.
    #[inline]
    pub fn get(&self, eh: u64) -> Option<(u64, u16)> {
        let h = mix(eh);
        let s = &self.shards[r_shard(h)];
        s.find(eh, h).map(|j| (s.key[j], s.meta[j]))
    }

    #[inline]
    pub fn meta_mut(&mut self, eh: u64) -> Option<&mut u16> {
        let h = mix(eh);
        let s = &mut self.shards[r_shard(h)];
        s.find(eh, h).map(move |j| &mut s.meta[j])
    }

    /// Insert an absent engine hash.
    #[inline]
    pub fn insert(&mut self, eh: u64, key: u64, meta: u16) {
        let h = mix(eh);
        self.shards[r_shard(h)].put(eh, h, key, meta);
        self.count += 1;
        if meta & ORPHAN != 0 {
            self.orphans += 1;
        }
    }

    /// Remove a present engine hash; returns its (key, meta).
    pub fn remove(&mut self, eh: u64) -> Option<(u64, u16)> {
        let h = mix(eh);
        let s = &mut self.shards[r_shard(h)];
        let j = s.find(eh, h)?;
        let out = (s.key[j], s.meta[j]);
        s.delete(j);
        self.count -= 1;
        if out.1 & ORPHAN != 0 {
            self.orphans -= 1;
        }
        Some(out)
    }

    /// Make room for `extra` more entries up front (imports).
    pub fn reserve(&mut self, extra: usize) {
        let per = extra >> R_SHARD_BITS;
        for s in &mut self.shards {
            let need = s.len + per + per / 8 + 4;
            if need > limit(s.eh.len()) {
                s.grow(need);
            }
        }
    }

    /// Every live entry: (engine hash, key, meta).
    pub fn entries(&self) -> impl Iterator<Item = (u64, u64, u16)> + '_ {
        self.shards
            .iter()
            .flat_map(|s| (0..s.eh.len()).filter(move |&i| s.meta[i] != 0).map(move |i| (s.eh[i], s.key[i], s.meta[i])))
    }

    /// Empty the table (counters of unknown removes and duplicates survive).
    pub fn reset(&mut self) {
        for s in &mut self.shards {
            *s = RShard::new(MIN_CAP);
        }
        self.count = 0;
        self.orphans = 0;
    }

    pub fn nbytes(&self) -> usize {
        self.shards.iter().map(|s| s.eh.len() * 18).sum::<usize>() + 64
    }
}

// ------------------------------------------------------------------ S table

pub struct SShard {
    pub key: Vec<u64>,
    pub meta: Vec<u32>,
    len: usize,
}

pub const S_SHARD_BITS: u32 = 8;

#[inline]
fn s_shard(h: u64) -> usize {
    (h >> (64 - S_SHARD_BITS)) as usize
}

impl SShard {
    fn new(cap: usize) -> Self {
        SShard { key: vec![0; cap], meta: vec![0; cap], len: 0 }
    }

    fn grow(&mut self, need: usize) {
        let cap = next_cap(need, self.key.len());
        if cap == self.key.len() {
            return;
        }
        let old = std::mem::replace(self, SShard::new(cap));
        self.len = old.len;
        let cap = self.key.len();
        for i in 0..old.key.len() {
            if old.meta[i] != 0 {
                let mut j = home(mix(old.key[i]), cap);
                while self.meta[j] != 0 {
                    j += 1;
                    if j == cap {
                        j = 0;
                    }
                }
                self.key[j] = old.key[i];
                self.meta[j] = old.meta[i];
            }
        }
    }

    fn delete(&mut self, mut i: usize) {
        let cap = self.key.len();
        let mut j = i;
        loop {
            j += 1;
            if j == cap {
                j = 0;
            }
            if self.meta[j] == 0 {
                break;
            }
            let h = home(mix(self.key[j]), cap);
            let stay = if i <= j { i < h && h <= j } else { h > i || h <= j };
            if !stay {
                self.key[i] = self.key[j];
                self.meta[i] = self.meta[j];
                i = j;
            }
        }
        self.meta[i] = 0;
        self.key[i] = 0;
        self.len -= 1;
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
        }
    }

    /// Distinct ranks of `wm` holding `key` (each rm has at most one slot).
    #[inline]
    fn run_count(s: &SShard, key: u64, h: u64, wm: u32, hd: &Holders) -> u32 {
        let cap = s.key.len();
        let mut j = home(h, cap);
        let mut n = 0;
        while s.meta[j] != 0 {
            if s.key[j] == key && hd.rm_wm[rm_of(s.meta[j])] == wm {
                n += 1;
            }
            j += 1;
            if j == cap {
                j = 0;
            }
        }
        n
    }

    /// Count one more entry of `rm` under `key`; false at the count ceiling (nothing changed).
    pub fn inc(&mut self, key: u64, rm: u32, hd: &mut Holders) -> bool {
        let h = mix(key);
        let s = &mut self.shards[s_shard(h)];
        let tag = rm + 1;
        let cap = s.key.len();
        let mut j = home(h, cap);
        let mut slots = 1u32; // this key's slots once the new one is in (the walk sees them all)
        while s.meta[j] != 0 {
            let m = s.meta[j];
            if s.key[j] == key {
                if (m >> CNT_BITS) == tag {
                    if m & CNT_MASK == CNT_MASK {
                        return false;
                    }
                    s.meta[j] = m + 1;
                    return true;
                }
                slots += 1;
            }
            j += 1;
            if j == cap {
                j = 0;
            }
        }
        if s.len + 1 > limit(cap) {
            s.grow(s.len + 1);
            let cap = s.key.len();
            j = home(h, cap);
            while s.meta[j] != 0 {
                j += 1;
                if j == cap {
                    j = 0;
                }
            }
        }
        s.key[j] = key;
        s.meta[j] = (tag << CNT_BITS) | 1;
        s.len += 1;
        self.count += 1;
        let wm = hd.rm_wm[rm as usize];
        let tp = hd.wm_tp[wm as usize];
        let held = tp == 0 || Self::run_count(s, key, h, wm, hd) == tp;
        if held {
            hd.wm_blocks[wm as usize] += 1;
        }
        if let Some(bits) = self.multi.get_mut(&key) {
            if held {
                set_bit(bits, wm, true);
            }
        } else if slots >= self.promote {
            let bits = Self::holder_set(s, key, h, hd);
            if bits.iter().any(|&b| b != 0) {
                self.multi.insert(key, bits);
            }
        }
        true
    }

    /// The wms holding `key` (as many distinct ranks as their TP degree), computed from its slots.
    fn holder_set(s: &SShard, key: u64, h: u64, hd: &Holders) -> Vec<u64> {
        let mut bits = vec![];
        let cap = s.key.len();
        let mut j = home(h, cap);
        while s.meta[j] != 0 {
            if s.key[j] == key {
                let wm = hd.rm_wm[rm_of(s.meta[j])];
                if Self::run_count(s, key, h, wm, hd) >= hd.wm_tp[wm as usize].max(1) {
                    set_bit(&mut bits, wm, true);
                }
            }
            j += 1;
            if j == cap {
                j = 0;
            }
        }
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
        let cap = s.key.len();
        let mut j = home(h, cap);
        while s.meta[j] != 0 {
            if s.key[j] == key && (s.meta[j] >> CNT_BITS) == tag {
                return s.meta[j] & CNT_MASK == CNT_MASK;
            }
            j += 1;
            if j == cap {
                j = 0;
            }
        }
        false
    }

    pub fn dec(&mut self, key: u64, rm: u32, hd: &mut Holders) {
        let h = mix(key);
        let s = &mut self.shards[s_shard(h)];
        let tag = rm + 1;
        let cap = s.key.len();
        let mut j = home(h, cap);
        while s.meta[j] != 0 {
            let m = s.meta[j];
            if s.key[j] == key && (m >> CNT_BITS) == tag {
                if m & CNT_MASK > 1 {
                    s.meta[j] = m - 1;
                    return;
                }
                let wm = hd.rm_wm[rm as usize];
                let tp = hd.wm_tp[wm as usize];
                if tp == 0 || Self::run_count(s, key, h, wm, hd) == tp {
                    hd.wm_blocks[wm as usize] -= 1;
                    if let Some(bits) = self.multi.get_mut(&key) {
                        set_bit(bits, wm, false);
                        if bits.iter().all(|&b| b == 0) {
                            self.multi.remove(&key);
                        }
                    }
                }
                s.delete(j);
                self.count -= 1;
                return;
            }
            j += 1;
            if j == cap {
                j = 0;
            }
        }
    }

    /// Calls `f(key, wm, holders)` once per (key, wm) present in S, with the
    /// number of distinct ranks of wm holding the key: each group is taken at
    /// its first slot in run order, so the enumeration does not depend on slot
    /// positions, capacity or insertion order.
    pub fn for_each_key_wm(&self, hd: &Holders, mut f: impl FnMut(u64, u32, u32)) {
        for s in &self.shards {
            let cap = s.key.len();
            for i in 0..cap {
                if s.meta[i] == 0 {
                    continue;
                }
                let key = s.key[i];
                let wm = hd.rm_wm[rm_of(s.meta[i])];
                let h = mix(key);
                let mut j = home(h, cap);
                let mut first = true;
                while j != i {
                    if s.meta[j] != 0 && s.key[j] == key && hd.rm_wm[rm_of(s.meta[j])] == wm {
                        first = false;
                        break;
                    }
                    j += 1;
                    if j == cap {
                        j = 0;
                    }
                }
                if first {
                    f(key, wm, Self::run_count(s, key, h, wm, hd));
                }
            }
        }
    }

    /// Holders of `key` for the score walk: `f(rm)` for each slot of the key,
    /// without bounds checks (the walk visits every holder of every matched block).
    #[inline(always)]
    pub fn holders_fast(&self, key: u64, mut f: impl FnMut(usize)) {
        let h = mix(key);
        let s = &self.shards[s_shard(h)];
        let cap = s.key.len();
        let (keys, metas) = (s.key.as_ptr(), s.meta.as_ptr());
        let mut j = home(h, cap);
        // SAFETY: j < cap == key.len() == meta.len(), and the table always has an empty slot.
        unsafe {
            loop {
                let m = *metas.add(j);
                if m == 0 {
                    break;
                }
                if *keys.add(j) == key {
                    f(((m >> CNT_BITS) - 1) as usize);
                }
                j += 1;
                if j == cap {
                    j = 0;
                }
            }
        }
    }

    /// Holders of `key`: calls `f(rm)` for each slot of the key.
    #[inline]
    pub fn holders(&self, key: u64, mut f: impl FnMut(u32)) {
        let h = mix(key);
        let s = &self.shards[s_shard(h)];
        let cap = s.key.len();
        let mut j = home(h, cap);
        while s.meta[j] != 0 {
            if s.key[j] == key {
                f((s.meta[j] >> CNT_BITS) - 1);
            }
            j += 1;
            if j == cap {
                j = 0;
            }
        }
    }

    pub fn nbytes(&self) -> usize {
        self.shards.iter().map(|s| s.key.len() * 12).sum()
    }

    /// Size the shards for `total` entries up front.
    pub fn reserve(&mut self, total: usize) {
        let per = (total >> S_SHARD_BITS) + (total >> (S_SHARD_BITS + 3));
        for s in &mut self.shards {
            if per > limit(s.key.len()) {
                s.grow(per);
            }
        }
    }
}
