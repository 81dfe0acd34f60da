//! The prefix-cache index: which worker holds how many leading tokens of a prompt.
//!
//! The semantics are those of `kvwire/consumer/index.py`'s docstring (the
//! Python wrapper) and `tests/oracle.py` (the executable spec); this module is
//! the one implementation. Registry: workers (instance_id, dp_rank) and media
//! are interned to small ids; `wm` = (worker, medium, KV-cache group), `rm` =
//! (worker, tp rank, medium, group). Tables: see `table.rs`.
//!
//! Writes are whole-or-nothing per call: every change an `apply` makes is
//! logged, and a call that hits a reference-count ceiling rolls the log back
//! before it returns, so a record is never left half applied. (Tables and
//! registry entries the call created stay: they are empty, hold no block, and
//! the record's rank exists anyway once it has been fenced.)
//!
//! One job per file, so that a change to how blocks are kept or walked
//! touches only the file that does it: `registry` (ids), `write` (events and
//! their undo log), `walk` (the score), `grouped` (hybrid models' groups),
//! `inspect` (counts and read-backs), `import` (snapshots), `memo` (the keys
//! of parents removed before their children are stored), `growth` (tables
//! grown beside the scores instead of inside an apply quantum). The types the
//! rest of the crate names live here.

use std::collections::{BTreeSet, HashMap};

use crate::keys::{Ctx, CtxCache};
use crate::table::{Holders, RTable, STable};

mod grouped;
mod growth;
mod import;
mod inspect;
mod memo;
mod registry;
#[cfg(test)]
mod test_util;
mod walk;
mod write;

pub use growth::Growth;
pub use memo::PARENT_MEMO;
use write::Undo;

pub struct Rank {
    pub tp_rank: i64,
    pub tables: Vec<RTable>,
}

pub struct Worker {
    pub inst: String,
    pub dp: i64,
    pub tp_size: u32,
    pub ranks: Vec<Rank>,
    pub wms: Vec<u32>,
    /// The KV-cache groups its stores named, with what each needs for a hit.
    pub groups: Vec<GroupSpec>,
    /// Scored group by group (`score_grouped`): several groups, or a sparse one.
    pub grouped: bool,
    /// Keys of engine hashes it removed lately (`memo.rs`): parents gone before their child.
    memo: memo::Memo,
}

/// What a KV-cache group must hold for a prefix of L blocks to be usable.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Reach {
    /// Every block of the prefix (full attention, MLA, and any kind we do not know).
    Full,
    /// Only the last `n` blocks before the prefix's end (sliding window: the
    /// blocks the window reaches; Mamba: the state block at the end).
    Tail(u32),
}

#[derive(Clone, Copy, Debug)]
pub struct GroupSpec {
    pub group: i64,
    pub reach: Reach,
}

/// A group's reach from vLLM's spec kind (an open set) and window in tokens.
/// vLLM's sliding-window hit needs `cdiv(window - 1, block_size)` contiguous
/// blocks ending at the hit (`SlidingWindowManager._contiguous_blocks_for_hit`);
/// a Mamba hit needs the block at its end. A kind we do not know, or a window
/// we are not told, is read as full attention: it can only under-credit.
pub fn reach_of(kind: &str, window: Option<i64>, bs: i64) -> Reach {
    match kind {
        "sliding_window" | "sliding_window_mla" => match window {
            Some(w) if w > 0 && bs > 0 => Reach::Tail(((w - 1 + bs - 1) / bs).max(1) as u32),
            _ => Reach::Full,
        },
        "mamba" => Reach::Tail(1),
        _ => Reach::Full,
    }
}

/// A rank as events name it.
#[derive(Clone, Copy)]
pub struct RankId<'a> {
    pub inst: &'a str,
    pub dp: i64,
    pub tp_rank: i64,
    pub tp_size: i64,
}

/// A BlockStored event's fields.
#[derive(Clone, Copy)]
pub struct Store<'a> {
    pub medium: Option<&'a str>,
    pub group: i64,
    pub ehs: &'a [u64],
    /// Token ids as little-endian u32 bytes (the wire form).
    pub tokens: &'a [u8],
    pub bs: i64,
    pub parent: Option<u64>,
    pub lora: Option<&'a str>,
    /// Per-block contexts when extra keys are present (else derived from bs, lora).
    pub blk_ctx: Option<&'a [u64]>,
    /// vLLM's `kv_cache_spec_kind` and `kv_cache_spec_sliding_window` of the group.
    pub kind: Option<&'a str>,
    pub window: Option<i64>,
}

/// One exported table of a rank, as `Index::import_table` installs it.
#[derive(Clone, Copy)]
pub struct TableBlob<'a> {
    pub medium: &'a str,
    pub group: i64,
    /// Per entry: engine hash, block key and refcount|flags.
    pub ehs: &'a [u64],
    pub keys: &'a [u64],
    pub metas: &'a [u16],
    pub unknown: i64,
    pub dups: i64,
}

/// One event, borrowed from a decoded record or from Python objects.
pub enum Ev<'a> {
    Store(Store<'a>),
    Remove { medium: Option<&'a str>, group: i64, ehs: &'a [u64] },
    Clear,
}

#[derive(Debug, PartialEq)]
pub enum ApplyError {
    /// Event `.0`'s token ids do not cover its blocks.
    Malformed(usize, String),
    /// A reference count hit its ceiling; nothing of the call was applied.
    Overflow,
}

type Loc = (u32, usize, usize);

/// The weight that marks a medium as not counted by a score (`score`'s tier views).
pub const EXCLUDED: f64 = -1.0;

pub fn normalize_medium(m: Option<&str>) -> std::borrow::Cow<'_, str> {
    match m {
        None => "GPU".into(),
        Some(s) => {
            let u = s.to_uppercase();
            if u == "GPU" || u == "CPU" || u == "STORAGE" {
                u.into()
            } else {
                s.into()
            }
        }
    }
}

/// Whether a worker is scored group by group: the plain walk credits a block
/// held by any group, right only for a worker with one full-attention group.
fn is_grouped(groups: &[GroupSpec]) -> bool {
    groups.len() > 1 || groups.iter().any(|g| g.reach != Reach::Full)
}

/// Per-worker statistics (`WorkerStats` in Python).
pub struct Stats {
    pub inst: String,
    pub dp: i64,
    pub tp_size: u32,
    pub ranks: usize,
    pub blocks: Vec<(String, i64)>,
    pub entries: i64,
    pub orphans: i64,
    pub unknown: i64,
    pub dups: i64,
}

/// Where a query's block keys come from.
pub enum Query<'a> {
    /// Token ids hashed lazily in `bs`-token blocks under `ctx`.
    Tokens { tokens: &'a [u8], bs: usize, ctx: Ctx<'a> },
    /// Precomputed keys, each worth `scale` tokens.
    Keys { keys: &'a [u64], scale: i64 },
}

/// Scores as arrays, best first: worker ids, matched tokens, weighted score,
/// and per result a slice `by_off[i]..by_off[i+1]` of (medium id, tokens).
#[derive(Default, Debug, PartialEq)]
pub struct Scores {
    pub worker: Vec<u32>,
    pub matched: Vec<i64>,
    pub score: Vec<f64>,
    pub by_off: Vec<u32>,
    pub by_medium: Vec<u32>,
    pub by_tokens: Vec<i64>,
}

#[derive(Default)]
pub struct Index {
    pub workers: Vec<Worker>,
    worker_ids: HashMap<String, Vec<(i64, u32)>>,
    pub media: Vec<String>,
    media_ids: HashMap<String, u32>,
    raw_media: HashMap<String, u32>,
    wm_ids: HashMap<(u32, u32, i64), u32>,
    pub wm_worker: Vec<u32>,
    pub wm_medium: Vec<u32>,
    /// wm -> its KV-cache group: a wm is (worker, medium, group), so that one
    /// group's blocks never stand in for another's.
    pub wm_group: Vec<i64>,
    rm_ids: HashMap<(u32, i64, u32, i64), u32>,
    /// rm -> its worker (the score walk's one lookup per holder slot).
    rm_w: Vec<u32>,
    pub hd: Holders,
    pub s: STable,
    pub block_sizes: BTreeSet<i64>,
    ctx: CtxCache,
    undo: Vec<Undo>,
    /// Cleared tables whose S slots are still to be purged, oldest first,
    /// with how far the sweep has gone through each (a slot position).
    graveyard: std::collections::VecDeque<(RTable, (usize, usize))>,
    /// Retired rm ids with no slot left in S, for the next table to reuse.
    free_rm: Vec<u32>,
    /// Each worker id's rank in (instance_id, dp_rank) order: the score's last tie-break.
    name_rank: Vec<u32>,
    /// Worker ids in that order, `name_rank`'s inverse; both kept where a worker is made.
    name_ids: Vec<u32>,
    scratch: Vec<u64>,
    /// How many workers are `grouped`: a score visits the workers for them only when some are.
    n_grouped: usize,
    /// Some wm's id is not its worker's id. While none is (one wm per worker, made in worker
    /// order: one medium, one group each), a score's answer reads a hit's wm at its worker id.
    wm_not_worker: bool,
    /// Tables whose growth an apply quantum deferred (`growth.rs`).
    r_deferred: Vec<Loc>,
    /// Moved on by every write (each apply quantum once it has put its growths in, and every
    /// `PyIndex::write`): growth built from the index at one stamp is put in only at the same
    /// stamp (`Index::install_growth`).
    pub writes: u64,
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every change of a worker's `grouped` goes through here, which keeps `n_grouped`.
    fn set_grouped(&mut self, w: u32, grouped: bool) {
        let wk = &mut self.workers[w as usize];
        if wk.grouped != grouped {
            wk.grouped = grouped;
            if grouped {
                self.n_grouped += 1;
            } else {
                self.n_grouped -= 1;
            }
        }
    }
}
