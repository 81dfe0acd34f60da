"""A Python reference of the key rules whose one home is the Rust core (``rust/src/keys.rs``).

For tests only: ``tests/oracle.py`` chains keys with it, and tests/consumer/test_keys.py holds the
core to it bit for bit. It is written from the definitions (frozen: snapshots and digests hold
keys), not from the core's code, so the two can only agree by both being right.
"""

from __future__ import annotations

from typing import Any

import xxhash

ROOT = 0x6B7677697265_0001  # "kvwire" + 1
ORPHAN_ROOT = 0x6B7677697265_00F0
ENGINE_NS = 0x6B7677697265_00E0
M64 = (1 << 64) - 1


def _canon(v: Any, out: bytearray) -> None:
    """Type-tagged, length-prefixed: equal values <=> equal bytes, no hash seed or repr quirks."""
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


V1_SEED = 1337


def context_seed(lora_name: str | None = None) -> int:
    """v1's content seed: 1337, plus XXH3-64 of a non-empty adapter name (seed 0), wrapping."""
    return (V1_SEED + (xxhash.xxh3_64_intdigest(lora_name.encode()) if lora_name else 0)) & M64


def chain_step(parent: int, content: int) -> int:
    """v1's sequence hash: a first block's is its content hash."""
    if parent == ROOT:
        return content
    return xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + content.to_bytes(8, "little"), seed=V1_SEED)


def normalize_extra(extra: Any, lora_name: str | None) -> tuple[Any, ...] | None:
    """A bare value is a one-tuple; vLLM's leading LoRA name is dropped; empty means none."""
    if extra is None:
        return None
    if not isinstance(extra, (tuple, list)):
        extra = (extra,)
    if lora_name is not None and extra and extra[0] == lora_name:
        extra = tuple(extra[1:])
    return tuple(extra) or None


def block_context(base: int, extra: Any, lora_name: str | None) -> int:
    e = normalize_extra(extra, lora_name)
    return base if e is None else (base + xxhash.xxh3_64_intdigest(canonical(e), seed=2)) & M64


def block_contexts(lora_name: str | None, extra_keys: Any, nblocks: int) -> list[int]:
    """Per-block content seeds; one seed when no block has extra keys."""
    base = context_seed(lora_name)
    ek = list(extra_keys or ())[:nblocks]
    ctx = [block_context(base, e, lora_name) for e in ek] + [base] * (nblocks - len(ek))
    return ctx if any(c != base for c in ctx) else [base]


def engine_hash_u64(h: Any) -> int:
    return h & M64 if isinstance(h, int) else xxhash.xxh3_64_intdigest(bytes(h))


def orphan_root(parent_hash: int) -> int:
    return xxhash.xxh3_64_intdigest((parent_hash & M64).to_bytes(8, "little"), seed=ORPHAN_ROOT)
