"""Block keys: the index's own chained XXH3-64 over token ids.

A block's key is ``xxh3_64(token bytes, seed = parent_key ^ ctx)`` where the
token bytes are the block's uint32 token ids little-endian, ``parent_key`` is
the previous block's key (``ROOT`` for a sequence's first block) and ``ctx``
is ``xxh3_64`` of a canonical encoding of (block_size, lora_name, extra keys).
So two engines with different hash algorithms, PYTHONHASHSEED or NONE_HASH
produce the same keys for the same tokens, and routing never depends on them.

XXH3 is implemented here in numba (checked bit for bit against the ``xxhash``
package in tests/consumer/test_keys.py) because the chain is sequential: one
``xxhash`` call per block from Python costs ~150 ns of call overhead, which is
most of the 100 us budget for an 8k-token query; a jitted loop hashes a
16-token block in ~20 ns, and the scorer can hash lazily and stop at the
first block nobody holds. Queries and events go through the same functions.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash
from numba import njit

U64 = np.uint64
_M32 = U64(0xFFFFFFFF)
_P32_1 = U64(0x9E3779B1)
_P32_2 = U64(0x85EBCA77)
_P32_3 = U64(0xC2B2AE3D)
_P64_1 = U64(0x9E3779B185EBCA87)
_P64_2 = U64(0xC2B2AE3D27D4EB4F)
_P64_3 = U64(0x165667B19E3779F9)
_P64_4 = U64(0x85EBCA77C2B2AE63)
_P64_5 = U64(0x27D4EB2F165667C5)
_PMX1 = U64(0x165667919E3779F9)
_PMX2 = U64(0x9FB21C651E98DF25)

_KSECRET = np.array(
    [
        0xB8,
        0xFE,
        0x6C,
        0x39,
        0x23,
        0xA4,
        0x4B,
        0xBE,
        0x7C,
        0x01,
        0x81,
        0x2C,
        0xF7,
        0x21,
        0xAD,
        0x1C,
        0xDE,
        0xD4,
        0x6D,
        0xE9,
        0x83,
        0x90,
        0x97,
        0xDB,
        0x72,
        0x40,
        0xA4,
        0xA4,
        0xB7,
        0xB3,
        0x67,
        0x1F,
        0xCB,
        0x79,
        0xE6,
        0x4E,
        0xCC,
        0xC0,
        0xE5,
        0x78,
        0x82,
        0x5A,
        0xD0,
        0x7D,
        0xCC,
        0xFF,
        0x72,
        0x21,
        0xB8,
        0x08,
        0x46,
        0x74,
        0xF7,
        0x43,
        0x24,
        0x8E,
        0xE0,
        0x35,
        0x90,
        0xE6,
        0x81,
        0x3A,
        0x26,
        0x4C,
        0x3C,
        0x28,
        0x52,
        0xBB,
        0x91,
        0xC3,
        0x00,
        0xCB,
        0x88,
        0xD0,
        0x65,
        0x8B,
        0x1B,
        0x53,
        0x2E,
        0xA3,
        0x71,
        0x64,
        0x48,
        0x97,
        0xA2,
        0x0D,
        0xF9,
        0x4E,
        0x38,
        0x19,
        0xEF,
        0x46,
        0xA9,
        0xDE,
        0xAC,
        0xD8,
        0xA8,
        0xFA,
        0x76,
        0x3F,
        0xE3,
        0x9C,
        0x34,
        0x3F,
        0xF9,
        0xDC,
        0xBB,
        0xC7,
        0xC7,
        0x0B,
        0x4F,
        0x1D,
        0x8A,
        0x51,
        0xE0,
        0x4B,
        0xCD,
        0xB4,
        0x59,
        0x31,
        0xC8,
        0x9F,
        0x7E,
        0xC9,
        0xD9,
        0x78,
        0x73,
        0x64,
        0xEA,
        0xC5,
        0xAC,
        0x83,
        0x34,
        0xD3,
        0xEB,
        0xC3,
        0xC5,
        0x81,
        0xA0,
        0xFF,
        0xFA,
        0x13,
        0x63,
        0xEB,
        0x17,
        0x0D,
        0xDD,
        0x51,
        0xB7,
        0xF0,
        0xDA,
        0x49,
        0xD3,
        0x16,
        0x55,
        0x26,
        0x29,
        0xD4,
        0x68,
        0x9E,
        0x2B,
        0x16,
        0xBE,
        0x58,
        0x7D,
        0x47,
        0xA1,
        0xFC,
        0x8F,
        0xF8,
        0xB8,
        0xD1,
        0x7A,
        0xD0,
        0x31,
        0xCE,
        0x45,
        0xCB,
        0x3A,
        0x8F,
        0x95,
        0x16,
        0x04,
        0x28,
        0xAF,
        0xD7,
        0xFB,
        0xCA,
        0xBB,
        0x4B,
        0x40,
        0x7E,
    ],
    dtype=np.uint8,
)

# Fixed chain roots. ROOT starts every real sequence; orphans and engine-hash
# mode live under other constants so their keys can never equal a query key.
ROOT = 0x6B7677697265_0001  # "kvwire" + 1
ORPHAN_ROOT = 0x6B7677697265_00F0
ENGINE_NS = 0x6B7677697265_00E0


def _ks64_table() -> np.ndarray:
    s = _KSECRET.astype(np.uint64)
    return np.array([int(sum(int(s[o + k]) << (8 * k) for k in range(8))) for o in range(185)], dtype=np.uint64)


# kSecret read as a little-endian u64 at every byte offset: XXH3 reads the
# secret at odd offsets, and a table lookup beats assembling 8 bytes.
_KS = _ks64_table()


@njit(cache=True, inline="always")
def _in64(t, w):
    # Token data is uint32 words and every XXH3 read lands on a multiple of 4
    # bytes when the length is a multiple of 4, so two word loads suffice.
    return U64(t[w]) | (U64(t[w + 1]) << U64(32))


@njit(cache=True, inline="always")
def _rotl(x, r):
    return (x << U64(r)) | (x >> U64(64 - r))


@njit(cache=True, inline="always")
def _mul128_fold64(a, b):
    # numba has no uint128: the portable 32x32 decomposition from xxhash.h.
    alo = a & _M32
    ahi = a >> U64(32)
    blo = b & _M32
    bhi = b >> U64(32)
    lo_lo = alo * blo
    hi_lo = ahi * blo
    lo_hi = alo * bhi
    hi_hi = ahi * bhi
    cross = (lo_lo >> U64(32)) + (hi_lo & _M32) + lo_hi
    upper = (hi_lo >> U64(32)) + (cross >> U64(32)) + hi_hi
    lower = (cross << U64(32)) | (lo_lo & _M32)
    return lower ^ upper


@njit(cache=True, inline="always")
def _avalanche(h):
    h ^= h >> U64(37)
    h *= _PMX1
    h ^= h >> U64(32)
    return h


@njit(cache=True, inline="always")
def _rrmxmx(h, n):
    h ^= _rotl(h, 49) ^ _rotl(h, 24)
    h *= _PMX2
    h ^= (h >> U64(35)) + n
    h *= _PMX2
    h ^= h >> U64(28)
    return h


@njit(cache=True, inline="always")
def _mix16(t, w, so, seed):
    return _mul128_fold64(_in64(t, w) ^ (_KS[so] + seed), _in64(t, w + 2) ^ (_KS[so + 8] - seed))


@njit(cache=True, inline="always")
def _bswap32(x):
    return (
        ((x & U64(0xFF)) << U64(24))
        | ((x & U64(0xFF00)) << U64(8))
        | ((x >> U64(8)) & U64(0xFF00))
        | ((x >> U64(24)) & U64(0xFF))
    )


@njit(cache=True, inline="always")
def _bswap64(x):
    return (_bswap32(x & _M32) << U64(32)) | _bswap32(x >> U64(32))


@njit(cache=True, inline="always")
def _cs(W, o):
    # The seeded custom secret is kSecret's 8-byte words +/- seed; read it at
    # any byte offset from those words.
    j = o >> 3
    r = o & 7
    if r == 0:
        return W[j]
    return (W[j] >> U64(8 * r)) | (W[j + 1] << U64(64 - 8 * r))


@njit(cache=True, inline="always")
def _acc512(acc, t, w, W, so):
    for i in range(8):
        v = _in64(t, w + 2 * i)
        k = v ^ _cs(W, so + 8 * i)
        acc[i ^ 1] += v
        acc[i] += (k & _M32) * (k >> U64(32))


@njit(cache=True)
def _long(t, w, n, seed, W):
    for j in range(24):
        W[j] = _KS[8 * j] + seed if (j & 1) == 0 else _KS[8 * j] - seed
    W[24] = U64(0)
    acc = np.empty(8, dtype=np.uint64)
    acc[0] = _P32_3
    acc[1] = _P64_1
    acc[2] = _P64_2
    acc[3] = _P64_3
    acc[4] = _P64_4
    acc[5] = _P32_2
    acc[6] = _P64_5
    acc[7] = _P32_1
    nb_blocks = (n - 1) // 1024
    for blk in range(nb_blocks):
        base = w + blk * 256
        for st in range(16):
            _acc512(acc, t, base + st * 16, W, st * 8)
        for i in range(8):
            a = acc[i]
            a ^= a >> U64(47)
            a ^= W[16 + i]
            a *= _P32_1
            acc[i] = a
    base = w + nb_blocks * 256
    nstripes = ((n - 1) - 1024 * nb_blocks) // 64
    for st in range(nstripes):
        _acc512(acc, t, base + st * 16, W, st * 8)
    _acc512(acc, t, w + (n - 64) // 4, W, 192 - 64 - 7)
    r = U64(n) * _P64_1
    for i in range(4):
        r += _mul128_fold64(acc[2 * i] ^ _cs(W, 11 + 16 * i), acc[2 * i + 1] ^ _cs(W, 19 + 16 * i))
    return _avalanche(r)


@njit(cache=True)
def xxh3_64(t, w, n, seed, W):
    """XXH3-64 (seeded) of ``n`` bytes starting at word ``w`` of the uint32
    array ``t``; ``n`` must be a multiple of 4 (token blocks always are).
    ``W`` is a 25-word scratch for the long path, reused across a loop."""
    if n <= 16:
        if n > 8:
            bf1 = (_KS[24] ^ _KS[32]) + seed
            bf2 = (_KS[40] ^ _KS[48]) - seed
            lo = _in64(t, w) ^ bf1
            hi = _in64(t, w + (n - 8) // 4) ^ bf2
            acc = U64(n) + _bswap64(lo) + hi + _mul128_fold64(lo, hi)
            return _avalanche(acc)
        if n >= 4:
            seed2 = seed ^ (_bswap32(seed & _M32) << U64(32))
            in1 = U64(t[w])
            in2 = U64(t[w + (n - 4) // 4])
            bf = (_KS[8] ^ _KS[16]) - seed2
            return _rrmxmx((in2 + (in1 << U64(32))) ^ bf, U64(n))
        h = seed ^ (_KS[56] ^ _KS[64])
        h ^= h >> U64(33)
        h *= _P64_2
        h ^= h >> U64(29)
        h *= _P64_3
        h ^= h >> U64(32)
        return h
    if n <= 128:
        acc = U64(n) * _P64_1
        e = w + n // 4
        if n > 32:
            if n > 64:
                if n > 96:
                    acc += _mix16(t, w + 12, 96, seed)
                    acc += _mix16(t, e - 16, 112, seed)
                acc += _mix16(t, w + 8, 64, seed)
                acc += _mix16(t, e - 12, 80, seed)
            acc += _mix16(t, w + 4, 32, seed)
            acc += _mix16(t, e - 8, 48, seed)
        acc += _mix16(t, w, 0, seed)
        acc += _mix16(t, e - 4, 16, seed)
        return _avalanche(acc)
    if n <= 240:
        acc = U64(n) * _P64_1
        for i in range(8):
            acc += _mix16(t, w + 4 * i, 16 * i, seed)
        acc_end = _mix16(t, w + (n - 16) // 4, 136 - 17, seed)
        acc = _avalanche(acc)
        for i in range(8, n // 16):
            acc_end += _mix16(t, w + 4 * i, 16 * (i - 8) + 3, seed)
        return _avalanche(acc + acc_end)
    return _long(t, w, n, seed, W)


@njit(cache=True)
def chain_keys(tok, bs, nblocks, parent, ctx, out):
    """out[i] = xxh3(block i, seed = key(i-1) ^ ctx[i or 0]), key(-1) = parent.

    ``tok`` is uint32 tokens, ``bs`` tokens per block. ``ctx`` has one entry
    (same context for every block, the common case) or one per block."""
    W = np.empty(25, dtype=np.uint64)
    key = U64(parent)
    per_block = ctx.shape[0] > 1
    for i in range(nblocks):
        c = ctx[i] if per_block else ctx[0]
        key = xxh3_64(tok, i * bs, bs * 4, key ^ c, W)
        out[i] = key
    return out


# ---------------------------------------------------------------- context seeds


def _canon(v, out: bytearray) -> None:
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


def canonical(v) -> bytes:
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


def normalize_extra(extra, lora_name: str | None):
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


def block_contexts(block_size: int, lora_name: str | None, extra_keys: Sequence | None, nblocks: int) -> np.ndarray:
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


def token_words(token_ids) -> np.ndarray:
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
    token_ids,
    block_size: int,
    parent_key: int = ROOT,
    lora_name: str | None = None,
    extra_keys: Sequence | None = None,
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
        chain_keys(tok, block_size, n, U64(parent_key), block_contexts(block_size, lora_name, extra_keys, n), out)
    return out


def prompt_keys(
    token_ids, block_size: int, lora_name: str | None = None, extra_keys: Sequence | None = None
) -> np.ndarray:
    """Keys of a query's full blocks (a trailing partial block is never cached)."""
    return block_keys(token_ids, block_size, ROOT, lora_name, extra_keys)


_MASK64 = (1 << 64) - 1


def engine_hash_u64(h) -> int:
    """An engine hash as the uint64 id the index stores: ints (negative
    LMCache ones too) modulo 2^64, digests through xxh3."""
    if isinstance(h, int):
        return h & _MASK64
    return xxhash.xxh3_64_intdigest(bytes(h))


def engine_hashes(hashes: Sequence) -> np.ndarray:
    try:
        return np.array(hashes, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        return np.array([engine_hash_u64(h) for h in hashes], dtype=np.uint64)


def orphan_root(parent_hash: int) -> int:
    """Chain root for blocks whose parent is unknown: derived from the parent's
    engine hash so siblings under one unknown parent still chain together."""
    return xxhash.xxh3_64_intdigest(parent_hash.to_bytes(8, "little"), seed=ORPHAN_ROOT)


def engine_keys(hashes: Iterable) -> np.ndarray:
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
