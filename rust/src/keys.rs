//! Block keys: the routers' shared "v1" sequence hashes over token ids, and every
//! rule they rest on. This module is their one home: the seeds, the roots, the
//! canonical encoding of extra keys and its normalisation, the chain. Python
//! reaches them through `py_keys.rs`; nothing else hashes a block.
//!
//! As Dynamo, vllm-router and SMG compute them (docs/DESIGN.md has the decision):
//! a block's **content hash** is `xxh3_64(token bytes, seed)`, the token bytes
//! being its u32 token ids little-endian and the seed `1337`, plus
//! `xxh3_64(lora_name, 0)` for an adapter (wrapping). Its **key**, the sequence
//! hash, is the content hash for a sequence's first block (parent `ROOT`) and
//! `xxh3_64(le(parent key) ‖ le(content), 1337)` after it. kvwire's additions
//! change only blocks that v1 does not describe: a block with extra keys (vLLM's
//! multimodal ids, the salt on a first block) adds `xxh3_64(canonical(extra), 2)`
//! to its seed, and orphan chains start from `orphan_root`, never from `ROOT`.
//! Snapshots and digests hold keys: any change here needs a new snapshot format
//! version. `tests/consumer/test_keys.py` checks this code bit for bit against
//! the `xxhash` package, an independent Python chain (`tests/keys_oracle.py`) and
//! the routers' published vector.

use std::borrow::Cow;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The parent of a sequence's first block: its key is its content hash, as in v1.
pub const ROOT: u64 = 0x6B76_7769_7265_0001;
/// v1's seed of every content hash and of the chain step.
pub const V1_SEED: u64 = 1337;
/// The seed under which a block's extra keys join its content seed.
const EXTRA_SEED: u64 = 2;
/// Roots of chains under an unknown parent: never equal to a query key.
pub const ORPHAN_ROOT: u64 = 0x6B76_7769_7265_00F0;
/// Engine-hash mode keys live in this namespace (engine hash ^ ENGINE_NS).
pub const ENGINE_NS: u64 = 0x6B76_7769_7265_00E0;

#[inline]
pub fn xxh3(data: &[u8], seed: u64) -> u64 {
    xxh3_64_with_seed(data, seed)
}

/// The little-endian bytes of u32 tokens, without a copy on little-endian hosts.
#[inline]
fn token_bytes(t: &[u32]) -> std::borrow::Cow<'_, [u8]> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: u32 has no padding and any byte pattern is a valid u8.
        std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(t.as_ptr() as *const u8, t.len() * 4) })
    }
    #[cfg(not(target_endian = "little"))]
    {
        std::borrow::Cow::Owned(t.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// The sequence hash of a block whose content hash is `content`, after `parent`.
/// The content hash does not depend on the parent, so a walk's content hashes
/// overlap in the CPU; only this 16-byte step is serial.
#[inline]
pub fn chain_step(parent: u64, content: u64) -> u64 {
    if parent == ROOT {
        return content;
    }
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&parent.to_le_bytes());
    b[8..].copy_from_slice(&content.to_le_bytes());
    xxh3(&b, V1_SEED)
}

/// The key of one block of tokens chained from `parent` under content seed `ctx`.
#[inline]
pub fn block_key(tokens: &[u32], parent: u64, ctx: u64) -> u64 {
    chain_step(parent, xxh3(&token_bytes(tokens), ctx))
}

/// `block_key` over the tokens' little-endian bytes (the wire form).
#[inline]
pub fn block_key_le(token_le: &[u8], parent: u64, ctx: u64) -> u64 {
    chain_step(parent, xxh3(token_le, ctx))
}

/// Per-block contexts: one shared seed (the common case) or one per block.
#[derive(Clone, Copy)]
pub enum Ctx<'a> {
    One(u64),
    PerBlock(&'a [u64]),
}

impl Ctx<'_> {
    #[inline]
    pub fn at(&self, i: usize) -> u64 {
        match self {
            Ctx::One(c) => *c,
            Ctx::PerBlock(v) => v[i],
        }
    }
}

/// Blocks whose keys `chain_batch` computes in one call.
pub const CHAIN_BATCH: usize = 8;

/// How many blocks ahead of its chain step `chain_batch` computes a block's content hash.
const CONTENT_AHEAD: usize = 3;

/// Keys of blocks `from..to` (at most `CHAIN_BATCH` of them) of `bs` tokens (little-endian
/// bytes), chained from `parent`, into `out[..to - from]`. Content hashes do not depend on the
/// parent; only the chain steps are serial. Each step is issued beside the content hash of a
/// block `CONTENT_AHEAD` further on, so the CPU fills a step's latency with independent work.
/// Blocks of 16 tokens (vLLM's default) get a copy compiled for their length, which lets the
/// hash drop its length dispatch.
#[inline]
pub fn chain_batch(
    token_le: &[u8],
    bs: usize,
    from: usize,
    to: usize,
    parent: u64,
    ctx: Ctx<'_>,
    out: &mut [u64; CHAIN_BATCH],
) {
    match bs {
        16 => chain_batch_w::<64>(token_le, 64, from, to, parent, ctx, out),
        _ => chain_batch_w::<0>(token_le, bs * 4, from, to, parent, ctx, out),
    }
}

/// `chain_batch` for blocks of `w` bytes, `W` when it is not 0.
#[inline(always)]
fn chain_batch_w<const W: usize>(
    token_le: &[u8],
    w: usize,
    from: usize,
    to: usize,
    parent: u64,
    ctx: Ctx<'_>,
    out: &mut [u64; CHAIN_BATCH],
) {
    // A function, not a closure: the closure was left a call per block (perf).
    #[inline(always)]
    fn content(token_le: &[u8], w: usize, b: usize, ctx: Ctx<'_>) -> u64 {
        xxh3(&token_le[b * w..(b + 1) * w], ctx.at(b))
    }
    let w = if W == 0 { w } else { W };
    let n = to - from;
    for (j, c) in out.iter_mut().enumerate().take(n.min(CONTENT_AHEAD)) {
        *c = content(token_le, w, from + j, ctx);
    }
    let mut key = parent;
    for j in 0..n {
        if j + CONTENT_AHEAD < n {
            out[j + CONTENT_AHEAD] = content(token_le, w, from + j + CONTENT_AHEAD, ctx);
        }
        key = chain_step(key, out[j]);
        out[j] = key;
    }
}

/// Keys of `n` consecutive blocks of `bs` tokens (little-endian bytes) chained from `parent`.
pub fn chain(token_le: &[u8], bs: usize, n: usize, parent: u64, ctx: Ctx<'_>, out: &mut Vec<u64>) {
    let mut key = parent;
    let mut batch = [0u64; CHAIN_BATCH];
    for from in (0..n).step_by(CHAIN_BATCH) {
        let to = n.min(from + CHAIN_BATCH);
        chain_batch(token_le, bs, from, to, key, ctx, &mut batch);
        out.extend_from_slice(&batch[..to - from]);
        key = batch[to - from - 1];
    }
}

/// One value of a block's extra keys, as the canonical encoding sees it. The
/// record decoder's scalars and tuples and a query's Python values both become
/// these, so stored blocks and queries share one encoding.
#[derive(Clone, Debug, PartialEq)]
pub enum Key<'a> {
    Null,
    Bool(bool),
    Int(i64),
    /// An integer past 64 bits, as its decimal digits (only a query can name one).
    BigInt(String),
    Float(f64),
    /// UTF-8 bytes (a Python string's lone surrogates passed through).
    Str(Cow<'a, [u8]>),
    Bytes(Cow<'a, [u8]>),
    /// A tuple or list: the encoding treats them alike.
    Seq(Vec<Key<'a>>),
    /// Any other Python value, by its `repr` (never equal to a stored key's encoding).
    Repr(String),
}

fn tagged(tag: u8, body: &[u8], out: &mut Vec<u8>) {
    out.push(tag);
    out.extend_from_slice(body.len().to_string().as_bytes());
    out.push(b':');
    out.extend_from_slice(body);
}

fn canon_seq(items: &[Key], out: &mut Vec<u8>) {
    out.push(b't');
    out.extend_from_slice(items.len().to_string().as_bytes());
    out.push(b':');
    for k in items {
        canon(k, out);
    }
}

/// The type-tagged, length-prefixed encoding of a value: equal values give
/// equal bytes and values of different types never do, with no dependence on a
/// hash seed. Frozen with the keys.
pub fn canon(k: &Key, out: &mut Vec<u8>) {
    match k {
        Key::Null => out.push(b'N'),
        Key::Bool(true) => out.push(b'T'),
        Key::Bool(false) => out.push(b'F'),
        Key::Int(v) => tagged(b'i', v.to_string().as_bytes(), out),
        Key::BigInt(digits) => tagged(b'i', digits.as_bytes(), out),
        Key::Float(v) => tagged(b'f', float_hex(*v).as_bytes(), out),
        Key::Str(s) => tagged(b's', s, out),
        Key::Bytes(b) => tagged(b'b', b, out),
        Key::Seq(items) => canon_seq(items, out),
        Key::Repr(r) => tagged(b'r', r.as_bytes(), out),
    }
}

/// A float as Python's `float.hex()` writes it: the encoding was defined by
/// it, and it is exact (every bit of the value, no rounding).
pub fn float_hex(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf" } else { "-inf" }.into();
    }
    let sign = if x.is_sign_negative() { "-" } else { "" };
    if x == 0.0 {
        return format!("{sign}0x0.0p+0");
    }
    let bits = x.to_bits();
    let biased = ((bits >> 52) & 0x7ff) as i32;
    let mantissa = bits & ((1u64 << 52) - 1);
    // Subnormals keep the smallest normal exponent behind a leading 0, as CPython prints them.
    let (lead, exp) = if biased == 0 { (0, -1022) } else { (1, biased - 1023) };
    let esign = if exp < 0 { '-' } else { '+' };
    format!("{sign}0x{lead}.{mantissa:013x}p{esign}{}", exp.abs())
}

/// v1's content seed, the part of every block's seed that a whole sequence
/// shares: 1337, plus `xxh3_64(lora_name, 0)` for an adapter (an empty name is
/// none, as in v1). The block size is not part of it: blocks of other sizes
/// differ in their bytes, and the index keeps each worker's block size.
pub fn context_seed(lora_name: Option<&str>) -> u64 {
    match lora_name {
        Some(l) if !l.is_empty() => V1_SEED.wrapping_add(xxh3(l.as_bytes(), 0)),
        _ => V1_SEED,
    }
}

/// One block's extra keys as the key encodes them: a bare value stands for a
/// one-tuple, and vLLM's leading LoRA name (it puts the name first in every
/// block's keys while also sending `lora_name`) is dropped, so that a query
/// that knows only `lora_name` gets the same key. None: no extra keys.
pub fn normalized<'k, 'a>(keys: &'k Key<'a>, lora: Option<&str>) -> Option<&'k [Key<'a>]> {
    let mut items: &[Key] = match keys {
        Key::Seq(v) => v,
        one => std::slice::from_ref(one),
    };
    if let (Some(l), Some(Key::Str(first))) = (lora, items.first()) {
        if first.as_ref() == l.as_bytes() {
            items = &items[1..];
        }
    }
    (!items.is_empty()).then_some(items)
}

/// Per-block contexts of `n` blocks under the shared seed `base`, `blocks[i]`
/// being block i's extra keys (blocks past `n` are ignored, missing ones have
/// none). None when no block has extra keys: every block's context is `base`.
pub fn block_contexts(blocks: &[Option<Key>], lora: Option<&str>, base: u64, n: usize) -> Option<Vec<u64>> {
    let mut out: Option<Vec<u64>> = None;
    let mut buf = Vec::new();
    for (i, b) in blocks.iter().take(n).enumerate() {
        let Some(items) = b.as_ref().and_then(|k| normalized(k, lora)) else { continue };
        buf.clear();
        canon_seq(items, &mut buf);
        out.get_or_insert_with(|| vec![base; n])[i] = base.wrapping_add(xxh3(&buf, EXTRA_SEED));
    }
    out
}

/// Root for blocks whose parent is unknown, derived from the parent's engine
/// hash so siblings under one unknown parent still chain together.
pub fn orphan_root(parent_hash: u64) -> u64 {
    xxh3(&parent_hash.to_le_bytes(), ORPHAN_ROOT)
}

/// A digest engine hash (bytes, not an int) as the u64 the index stores.
#[inline]
pub fn digest_hash(digest: &[u8]) -> u64 {
    xxh3(digest, 0)
}

/// Engine-hash mode key.
#[inline]
pub fn engine_key(eh: u64) -> u64 {
    eh ^ ENGINE_NS
}

/// Content seeds by LoRA name, cached: an adapter's costs a hash of its name,
/// and a stream uses a handful.
#[derive(Default)]
pub struct CtxCache {
    lora: std::collections::HashMap<String, u64>,
}

impl CtxCache {
    pub fn get(&mut self, lora: Option<&str>) -> u64 {
        let Some(l) = lora else { return context_seed(None) };
        if let Some(c) = self.lora.get(l) {
            return *c;
        }
        let c = context_seed(Some(l));
        if self.lora.len() < 4096 {
            self.lora.insert(l.to_owned(), c);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_continues() {
        let toks: Vec<u8> = (0u32..64).flat_map(|t| t.to_le_bytes()).collect();
        let mut all = vec![];
        chain(&toks, 16, 4, ROOT, Ctx::One(context_seed(None)), &mut all);
        let mut tail = vec![];
        chain(&toks[128..], 16, 2, all[1], Ctx::One(context_seed(None)), &mut tail);
        assert_eq!(&all[2..], &tail[..]);
    }

    #[test]
    fn batched_chain_is_the_block_by_block_chain() {
        // Every batch shape (shorter than the content look-ahead, partial, whole), both
        // compiled widths (16 tokens and any other), one context and one per block.
        let toks: Vec<u32> = (0..40 * 16).map(|t: u32| t.wrapping_mul(2_654_435_761) ^ 0x5bd1).collect();
        let le: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
        let per: Vec<u64> = (0..40u64).map(|i| 1337 + i * 7).collect();
        for bs in [4usize, 16, 32] {
            for n in 0..=(le.len() / (4 * bs)).min(21) {
                for ctx in [Ctx::One(1337), Ctx::PerBlock(&per)] {
                    let (mut want, mut key) = (vec![], ROOT);
                    for b in 0..n {
                        key = block_key(&toks[b * bs..(b + 1) * bs], key, ctx.at(b));
                        want.push(key);
                    }
                    let mut got = vec![];
                    chain(&le, bs, n, ROOT, ctx, &mut got);
                    assert_eq!(got, want, "bs {bs}, {n} blocks");
                }
            }
        }
    }

    #[test]
    fn floats_are_written_as_python_float_hex() {
        // (x).hex() in CPython
        for (x, hex) in [
            (2.5, "0x1.4000000000000p+1"),
            (1.0, "0x1.0000000000000p+0"),
            (-0.1, "-0x1.999999999999ap-4"),
            (0.0, "0x0.0p+0"),
            (-0.0, "-0x0.0p+0"),
            (5e-324, "0x0.0000000000001p-1022"),
            (f64::MAX, "0x1.fffffffffffffp+1023"),
            (f64::INFINITY, "inf"),
            (f64::NEG_INFINITY, "-inf"),
            (f64::NAN, "nan"),
        ] {
            assert_eq!(float_hex(x), hex, "{x}");
        }
    }

    #[test]
    fn extra_keys_normalise_as_vllm_sends_them() {
        let s = |v: &'static str| Key::Str(Cow::Borrowed(v.as_bytes()));
        let base = context_seed(Some("ad"));
        let lora_only = [Some(Key::Seq(vec![s("ad")])), None];
        assert_eq!(block_contexts(&lora_only, Some("ad"), base, 2), None);
        let bare = [Some(s("img")), None];
        let tuple = [Some(Key::Seq(vec![s("ad"), s("img")]))];
        let a = block_contexts(&bare, Some("ad"), base, 3).unwrap();
        assert_eq!(a, block_contexts(&tuple, Some("ad"), base, 3).unwrap());
        assert_eq!((a[0], a[1], a[2]), (base.wrapping_add(xxh3(b"t1:s3:img", 2)), base, base));
    }

    #[test]
    fn v1_seeds_and_the_routers_published_vector() {
        assert_eq!(context_seed(None), 1337);
        assert_eq!(context_seed(Some("")), 1337);
        assert_eq!(context_seed(Some("ad")), 1337u64.wrapping_add(xxh3(b"ad", 0)));
        // tokens 1..8, block size 4: Dynamo's compute_block_hash_for_seq gives these
        // content hashes (routers.md); the second key is the chain step over them.
        let toks: Vec<u32> = (1..=8).collect();
        let content: Vec<u64> = toks.chunks(4).map(|b| xxh3(&token_bytes(b), 1337)).collect();
        assert_eq!(content, [14643705804678351452, 16777012769546811212]);
        let le: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
        let mut keys = vec![];
        chain(&le, 4, 2, ROOT, Ctx::One(context_seed(None)), &mut keys);
        assert_eq!(keys, [14643705804678351452, 4945711292740353085]);
    }
}
