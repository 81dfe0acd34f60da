"""Block keys: the index's own chained XXH3-64 over token ids.

A block's key is ``xxh3_64(token bytes, seed = parent_key ^ ctx)`` where the
token bytes are the block's uint32 token ids little-endian, ``parent_key`` is
the previous block's key (``ROOT`` for a sequence's first block) and ``ctx``
is ``xxh3_64`` of a canonical encoding of (block_size, lora_name, extra keys).
So two engines with different hash algorithms, PYTHONHASHSEED or NONE_HASH
produce the same keys for the same tokens, and routing never depends on them.

The chain itself runs in the Rust core (``kvwire._core``, ``rust/src/keys.rs``):
it is sequential, and one ``xxhash`` call per block from Python costs ~150 ns
of call overhead, most of the budget of an 8k-token query. The seeds (context,
orphan root, namespaces) are defined here and in the core alike, checked bit
for bit against the ``xxhash`` package in tests/consumer/test_keys.py. These
definitions are frozen: snapshots and digests hold keys.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from kvwire import _core

# Fixed chain roots. ROOT starts every real sequence; orphans and engine-hash
# mode live under other constants so their keys can never equal a query key.
ROOT = 0x6B7677697265_0001  # "kvwire" + 1
ORPHAN_ROOT = 0x6B7677697265_00F0
ENGINE_NS = 0x6B7677697265_00E0
U64 = np.uint64
_MASK64 = (1 << 64) - 1


def xxh3_64(data: Any, seed: int = 0) -> int:
    """XXH3-64 of a buffer's bytes (the core's implementation, the one keys use)."""
    return int(_core.xxh3_64(data, seed & _MASK64))


def chain_keys(tok: np.ndarray, bs: int, nblocks: int, parent: int, ctx: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = xxh3(block i, seed = key(i-1) ^ ctx[i or 0]), key(-1) = parent.

    ``tok`` is uint32 tokens, ``bs`` tokens per block. ``ctx`` has one entry
    (same context for every block, the common case) or one per block."""
    raw = _core.chain_keys(
        np.ascontiguousarray(tok, np.uint32), bs, nblocks, int(parent) & _MASK64, ctx.astype(np.uint64).tobytes()
    )
    out[:nblocks] = np.frombuffer(raw, np.uint64)
    return out


# ---------------------------------------------------------------- context seeds


def _canon(v: Any, out: bytearray) -> None:
    """Type-tagged, length-prefixed encoding: equal values ⇔ equal bytes, with
    no dependence on Python's hash seed or repr details."""
    if v is None:
        out += b"N"
    elif v is True:
        out += b"T"
    elif v is False:
        out += b"F"
    elif isinstance(v, int):
        s = str(v).encode()
        out += b"i%d:" % len(s) + s
    elif isinstance(v, float):
        s = v.hex().encode()
        out += b"f%d:" % len(s) + s
    elif isinstance(v, str):
        s = v.encode("utf-8", "surrogatepass")
        out += b"s%d:" % len(s) + s
    elif isinstance(v, (bytes, bytearray, memoryview)):
        s = bytes(v)
        out += b"b%d:" % len(s) + s
    elif isinstance(v, (tuple, list)):
        out += b"t%d:" % len(v)
        for x in v:
            _canon(x, out)
    else:
        s = repr(v).encode()
        out += b"r%d:" % len(s) + s


def canonical(v: Any) -> bytes:
    out = bytearray()
    _canon(v, out)
    return bytes(out)


_CTX_CACHE: dict[tuple[int, str | None], int] = {}


def context_seed(block_size: int, lora_name: str | None = None) -> int:
    """The part of every block's seed that is shared by a whole sequence."""
    k = (block_size, lora_name)
    c = _CTX_CACHE.get(k)
    if c is None:
        c = xxhash.xxh3_64_intdigest(canonical(("kvwire-ctx/1", block_size, lora_name)))
        if len(_CTX_CACHE) < 4096:
            _CTX_CACHE[k] = c
    return c


def normalize_extra(extra: Any, lora_name: str | None) -> tuple[Any, ...] | None:
    """vLLM puts the LoRA name first in every block's extra keys while also
    sending ``lora_name``; drop it so a query that only knows ``lora_name`` gets
    the same key. Empty means none."""
    if extra is None:
        return None
    if not isinstance(extra, (tuple, list)):
        extra = (extra,)
    if lora_name is not None and extra and extra[0] == lora_name:
        extra = tuple(extra[1:])
    return tuple(extra) or None


def block_contexts(
    block_size: int, lora_name: str | None, extra_keys: Sequence[Any] | None, nblocks: int
) -> np.ndarray:
    """Per-block context seeds: a 1-element array when no block has extra keys."""
    base = context_seed(block_size, lora_name)
    if extra_keys is not None:
        norm = [normalize_extra(e, lora_name) for e in list(extra_keys)[:nblocks]]
        if any(e is not None for e in norm):
            norm += [None] * (nblocks - len(norm))
            return np.array(
                [base if e is None else xxhash.xxh3_64_intdigest(canonical(e), seed=base) for e in norm],
                dtype=np.uint64,
            )
    return np.array([base], dtype=np.uint64)


_BIG_ENDIAN = sys.byteorder == "big"


def token_words(token_ids: Any) -> np.ndarray:
    """Tokens as a (zero-copy where possible) uint32 array in little-endian order."""
    if isinstance(token_ids, np.ndarray):
        a = np.ascontiguousarray(token_ids, dtype=np.uint32)
    elif isinstance(token_ids, array) and token_ids.typecode == "I":
        a = np.frombuffer(token_ids, dtype=np.uint32) if len(token_ids) else np.zeros(0, np.uint32)
    else:
        a = np.asarray(list(token_ids) if not isinstance(token_ids, (list, tuple)) else token_ids, dtype=np.uint32)
    if _BIG_ENDIAN:
        a = a.byteswap()
    return a


def block_keys(
    token_ids: Any,
    block_size: int,
    parent_key: int = ROOT,
    lora_name: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    nblocks: int | None = None,
) -> np.ndarray:
    """Keys of consecutive full blocks of ``token_ids`` chained from ``parent_key``."""
    if block_size <= 0:
        raise ValueError("block_size must be > 0")
    tok = token_words(token_ids)
    full = tok.shape[0] // block_size
    n = full if nblocks is None else min(nblocks, full)
    out = np.empty(n, dtype=np.uint64)
    if n:
        chain_keys(tok, block_size, n, parent_key, block_contexts(block_size, lora_name, extra_keys, n), out)
    return out


def prompt_keys(
    token_ids: Any, block_size: int, lora_name: str | None = None, extra_keys: Sequence[Any] | None = None
) -> np.ndarray:
    """Keys of a query's full blocks (a trailing partial block is never cached)."""
    return block_keys(token_ids, block_size, ROOT, lora_name, extra_keys)


def engine_hash_u64(h: Any) -> int:
    """An engine hash as the uint64 id the index stores: ints (negative
    LMCache ones too) modulo 2^64, digests through xxh3."""
    if isinstance(h, int):
        return h & _MASK64
    return int(xxhash.xxh3_64_intdigest(bytes(h)))


def engine_hashes(hashes: Sequence[Any]) -> np.ndarray:
    try:
        return np.array(hashes, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        return np.array([engine_hash_u64(h) for h in hashes], dtype=np.uint64)


def orphan_root(parent_hash: int) -> int:
    """Chain root for blocks whose parent is unknown: derived from the parent's
    engine hash so siblings under one unknown parent still chain together."""
    return xxhash.xxh3_64_intdigest(parent_hash.to_bytes(8, "little"), seed=ORPHAN_ROOT)


def engine_keys(hashes: Iterable[Any]) -> np.ndarray:
    """Engine-hash mode keys: the engine hashes in their own namespace."""
    return engine_hashes(tuple(hashes)) ^ U64(ENGINE_NS)


__all__ = [
    "ENGINE_NS",
    "ORPHAN_ROOT",
    "ROOT",
    "block_contexts",
    "block_keys",
    "canonical",
    "chain_keys",
    "context_seed",
    "engine_hash_u64",
    "engine_hashes",
    "engine_keys",
    "normalize_extra",
    "orphan_root",
    "prompt_keys",
    "token_words",
    "xxh3_64",
]
