//! What the index modules' tests share.

use super::{Ev, Index, Query, RankId, Store};
use crate::keys::Ctx;

/// `n` token ids (1000, 1001, ...) in the wire form, little-endian u32.
pub(super) fn toks(n: u32) -> Vec<u8> {
    (1000..1000 + n).flat_map(|t: u32| t.to_le_bytes()).collect()
}

/// Rank `tp_rank` of worker (`inst`, dp 0) at TP degree `tp_size`.
pub(super) fn rank(inst: &str, tp_rank: i64, tp_size: i64) -> RankId<'_> {
    RankId { inst, dp: 0, tp_rank, tp_size }
}

/// A BlockStored of 16-token blocks in group 0, without LoRA or extra keys.
pub(super) fn stored<'a>(medium: Option<&'a str>, ehs: &'a [u64], tokens: &'a [u8], parent: Option<u64>) -> Ev<'a> {
    Ev::Store(Store {
        medium,
        group: 0,
        ehs,
        tokens,
        bs: 16,
        parent,
        lora: None,
        blk_ctx: None,
        kind: None,
        window: None,
    })
}

/// (worker, matched tokens, score) per result of `score` for `tokens` read in 16-token blocks,
/// in the order it returns them.
pub(super) fn ranked(
    ix: &mut Index,
    tokens: &[u8],
    weight: impl Fn(&str) -> f64,
    mask: Option<&[bool]>,
    top_k: Option<usize>,
) -> Vec<(String, i64, f64)> {
    let ctx = Ctx::One(ix.context(None));
    let w = ix.weight_array(weight);
    let s = ix.score(&[Query::Tokens { tokens, bs: 16, ctx }], &w, mask, top_k);
    (0..s.worker.len()).map(|i| (ix.workers[s.worker[i] as usize].inst.clone(), s.matched[i], s.score[i])).collect()
}
