//! Block keys: the index's own chained XXH3-64 over token ids.
//!
//! A block's key is `xxh3_64(token bytes, seed = parent_key ^ ctx)`: the token
//! bytes are the block's u32 token ids little-endian, `parent_key` is the
//! previous block's key (`ROOT` for a sequence's first block) and `ctx` is
//! `xxh3_64` of a canonical encoding of (block_size, lora_name, extra keys).
//! These definitions are frozen: snapshots and digests hold keys, so any change
//! here would silently make every stored index disagree with the live one.
//! `kvwire/consumer/keys.py` documents the same rules and
//! `tests/consumer/test_keys.py` checks this code bit for bit against the
//! `xxhash` package and an independent Python chain.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// "kvwire" + 1: starts every real sequence.
pub const ROOT: u64 = 0x6B76_7769_7265_0001;
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

/// The key of one block of tokens chained from `parent` under context `ctx`.
#[inline]
pub fn block_key(tokens: &[u32], parent: u64, ctx: u64) -> u64 {
    xxh3(&token_bytes(tokens), parent ^ ctx)
}

/// `block_key` over the tokens' little-endian bytes (the wire form).
#[inline]
pub fn block_key_le(token_le: &[u8], parent: u64, ctx: u64) -> u64 {
    xxh3(token_le, parent ^ ctx)
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

/// Keys of `n` consecutive blocks of `bs` tokens (little-endian bytes) chained from `parent`.
pub fn chain(token_le: &[u8], bs: usize, n: usize, parent: u64, ctx: Ctx<'_>, out: &mut Vec<u64>) {
    let mut key = parent;
    let w = bs * 4;
    for i in 0..n {
        key = block_key_le(&token_le[i * w..(i + 1) * w], key, ctx.at(i));
        out.push(key);
    }
}

fn canon_str(s: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(format!("s{}:", s.len()).as_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// `keys.context_seed`: xxh3 of canonical(("kvwire-ctx/1", block_size, lora_name)).
pub fn context_seed(block_size: i64, lora_name: Option<&str>) -> u64 {
    let mut b = Vec::with_capacity(48);
    b.extend_from_slice(b"t3:");
    canon_str("kvwire-ctx/1", &mut b);
    let s = block_size.to_string();
    b.extend_from_slice(format!("i{}:", s.len()).as_bytes());
    b.extend_from_slice(s.as_bytes());
    match lora_name {
        None => b.push(b'N'),
        Some(l) => canon_str(l, &mut b),
    }
    xxh3(&b, 0)
}

/// Root for blocks whose parent is unknown, derived from the parent's engine
/// hash so siblings under one unknown parent still chain together.
pub fn orphan_root(parent_hash: u64) -> u64 {
    xxh3(&parent_hash.to_le_bytes(), ORPHAN_ROOT)
}

/// Engine-hash mode key.
#[inline]
pub fn engine_key(eh: u64) -> u64 {
    eh ^ ENGINE_NS
}

/// Context seeds by (block size, LoRA name), cached: computing one costs a
/// format and a hash, and a stream uses a handful.
#[derive(Default)]
pub struct CtxCache {
    plain: std::collections::HashMap<i64, u64>,
    lora: std::collections::HashMap<String, std::collections::HashMap<i64, u64>>,
}

impl CtxCache {
    pub fn get(&mut self, bs: i64, lora: Option<&str>) -> u64 {
        match lora {
            None => *self.plain.entry(bs).or_insert_with(|| context_seed(bs, None)),
            Some(l) => {
                if let Some(c) = self.lora.get(l).and_then(|m| m.get(&bs)) {
                    return *c;
                }
                let c = context_seed(bs, Some(l));
                if self.lora.len() < 4096 {
                    self.lora.entry(l.to_owned()).or_default().insert(bs, c);
                }
                c
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_continues() {
        let toks: Vec<u8> = (0u32..64).flat_map(|t| t.to_le_bytes()).collect();
        let mut all = vec![];
        chain(&toks, 16, 4, ROOT, Ctx::One(context_seed(16, None)), &mut all);
        let mut tail = vec![];
        chain(&toks[128..], 16, 2, all[1], Ctx::One(context_seed(16, None)), &mut tail);
        assert_eq!(&all[2..], &tail[..]);
    }

    #[test]
    fn canonical_context_matches_python() {
        // keys.context_seed(16) == xxh3(b"t3:s12:kvwire-ctx/1i2:16N")
        assert_eq!(context_seed(16, None), xxh3(b"t3:s12:kvwire-ctx/1i2:16N", 0));
        assert_eq!(context_seed(-1, Some("ad")), xxh3(b"t3:s12:kvwire-ctx/1i2:-1s2:ad", 0));
    }
}
