"""Block keys: the routers' shared "v1" sequence hashes over token ids.

A block's content hash is ``xxh3_64(token bytes, seed)``: its uint32 token
ids little-endian, seed 1337 plus ``xxh3_64(lora_name, 0)`` for an adapter.
Its key is the content hash for a sequence's first block (parent ``ROOT``) and
``xxh3_64(le(parent key) || le(content), 1337)`` after it: the hashes Dynamo,
vllm-router and SMG compute (docs/DESIGN.md). A block with extra keys
(multimodal ids, a salt on the first block) adds ``xxh3_64(canonical(extra),
2)`` to its seed. So two engines with different hash algorithms,
PYTHONHASHSEED or NONE_HASH produce the same keys for the same tokens, and
routing never depends on them.

Every rule here has its one home in the Rust core (``kvwire._core``,
``rust/src/keys.rs``): the roots, the seeds, the canonical encoding of extra
keys and its normalisation, the chain. A stored block's key and a query's are
computed by the same code, so they agree exactly when their values do. This
module is the typed Python face; tests/consumer/test_keys.py holds the core to
the ``xxhash`` package, to a Python reference (``tests/keys_oracle.py``) and to
the routers' published vector bit for bit. Snapshots and digests hold keys:
changing them needs a new snapshot format version.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvwire import _core

# Fixed chain roots (defined in the core). ROOT is a sequence's start; orphans and
# engine-hash mode live under other constants so their keys can never equal a query key.
ROOT: int = _core.ROOT
ORPHAN_ROOT: int = _core.ORPHAN_ROOT
ENGINE_NS: int = _core.ENGINE_NS
_MASK64 = (1 << 64) - 1


def xxh3_64(data: Any, seed: int = 0) -> int:
    """XXH3-64 of a buffer's bytes (the core's implementation, the one keys use)."""
    return int(_core.xxh3_64(data, seed & _MASK64))


def canonical(v: Any) -> bytes:
    """The canonical encoding extra keys are hashed as: equal values ⇔ equal bytes."""
    out: bytes = _core.canonical(v)
    return out


def context_seed(lora_name: str | None = None) -> int:
    """The part of every block's content seed that is shared by a whole sequence."""
    return int(_core.context_seed(lora_name))


def block_contexts(lora_name: str | None, extra_keys: Sequence[Any] | None, nblocks: int) -> np.ndarray:
    """Per-block content seeds: a 1-element array when no block has extra keys."""
    ek = None if extra_keys is None else list(extra_keys)
    return np.frombuffer(_core.block_contexts(lora_name, ek, nblocks), np.uint64)


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
    ek = None if extra_keys is None else list(extra_keys)
    raw = _core.block_keys(token_words(token_ids), block_size, int(parent_key) & _MASK64, lora_name, ek, nblocks)
    return np.frombuffer(raw, np.uint64).copy()


def prompt_keys(
    token_ids: Any, block_size: int, lora_name: str | None = None, extra_keys: Sequence[Any] | None = None
) -> np.ndarray:
    """Keys of a query's full blocks (a trailing partial block is never cached)."""
    return block_keys(token_ids, block_size, ROOT, lora_name, extra_keys)


def sequence_keys(content_hashes: Any) -> np.ndarray:
    """Keys of a prompt given as its full blocks' content hashes (uint64, Dynamo's
    ``compute_block_hash_for_seq``): the sequence-hash chain from ``ROOT``."""
    c = np.ascontiguousarray(content_hashes, dtype="<u8")
    return np.frombuffer(_core.sequence_keys(c), np.uint64)


def engine_hash_u64(h: Any) -> int:
    """An engine hash as the uint64 id the index stores: ints (negative
    LMCache ones too) modulo 2^64, digests through xxh3."""
    return int(_core.engine_hash(h))


def engine_hashes(hashes: Sequence[Any]) -> np.ndarray:
    return np.array([engine_hash_u64(h) for h in hashes], dtype=np.uint64)


def orphan_root(parent_hash: int) -> int:
    """Chain root for blocks whose parent is unknown: derived from the parent's
    engine hash so siblings under one unknown parent still chain together."""
    return int(_core.orphan_root(parent_hash))


def engine_keys(hashes: Iterable[Any]) -> np.ndarray:
    """Engine-hash mode keys: the engine hashes in their own namespace."""
    return np.frombuffer(_core.engine_keys(tuple(hashes)), np.uint64)


__all__ = [
    "ENGINE_NS",
    "ORPHAN_ROOT",
    "ROOT",
    "block_contexts",
    "block_keys",
    "canonical",
    "context_seed",
    "engine_hash_u64",
    "engine_hashes",
    "engine_keys",
    "orphan_root",
    "prompt_keys",
    "sequence_keys",
    "token_words",
    "xxh3_64",
]
