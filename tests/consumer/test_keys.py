"""Block keys: bit-exact XXH3, chaining, what changes a key, and the core held bit for bit to the
Python reference of its rules (``tests/keys_oracle.py``)."""

from __future__ import annotations

import random
from array import array

import keys_oracle
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire import _core
from kvwire.consumer.index import PrefixIndex
from kvwire.consumer.keys import (
    ROOT,
    block_keys,
    canonical,
    engine_hash_u64,
    engine_hashes,
    orphan_root,
    prompt_keys,
    xxh3_64,
)
from kvwire.schemas.events import WorkerId, stored


@pytest.mark.parametrize("nbytes", list(range(0, 260, 4)) + [512, 1020, 1024, 1028, 2048, 4096, 5000])
def test_xxh3_matches_xxhash_package(nbytes):
    rng = random.Random(nbytes)
    for seed in (0, 1, rng.getrandbits(64), (1 << 64) - 1):
        words = np.array([rng.getrandbits(32) for _ in range(nbytes // 4 + 2)], np.uint32)
        got = xxh3_64(words[1 : 1 + nbytes // 4], seed)
        assert got == xxhash.xxh3_64_intdigest(words[1 : 1 + nbytes // 4].tobytes(), seed=seed)


def test_keys_are_v1_content_hashes_chained_as_sequence_hashes():
    """The routers' shared hash (Dynamo, vllm-router, SMG): content = XXH3-64(tokens LE, 1337),
    seq[0] = content[0], seq[i] = XXH3-64(le(seq[i-1]) || le(content[i]), 1337)."""
    toks = list(range(32))
    c0 = xxhash.xxh3_64_intdigest(array("I", toks[:16]).tobytes(), seed=1337)
    c1 = xxhash.xxh3_64_intdigest(array("I", toks[16:]).tobytes(), seed=1337)
    k1 = xxhash.xxh3_64_intdigest(c0.to_bytes(8, "little") + c1.to_bytes(8, "little"), seed=1337)
    assert prompt_keys(toks, 16).tolist() == [c0, k1]
    # an adapter adds XXH3-64(name, seed 0) to the seed, wrapping
    s = (1337 + xxhash.xxh3_64_intdigest(b"ad")) & ((1 << 64) - 1)
    assert prompt_keys(toks, 16, lora_name="ad")[0] == xxhash.xxh3_64_intdigest(array("I", toks[:16]).tobytes(), seed=s)


def test_the_routers_published_vector():
    """tokens 1..8, block size 4: Dynamo's compute_block_hash_for_seq returns these content
    hashes (../shared/reference/routers.md); the first key is the first content hash."""
    content = [14643705804678351452, 16777012769546811212]
    keys = prompt_keys(list(range(1, 9)), 4).tolist()
    assert keys[0] == content[0]
    assert keys[1] == keys_oracle.chain_step(content[0], content[1]) == 4945711292740353085


def test_same_tokens_same_key_whatever_the_engine_hash():
    toks = list(range(100, 164))
    a = stored([1, 2, 3, 4], toks, 16)
    b = stored([999, 42, 7, 2**64 - 1], toks, 16)
    assert (block_keys(a.token_ids, 16) == block_keys(b.token_ids, 16)).all()
    assert (block_keys(a.token_ids, 16) == prompt_keys(toks, 16)).all()


def test_only_full_blocks_and_input_forms_agree():
    toks = list(range(40))
    k = prompt_keys(toks, 16)
    assert k.shape == (2,)
    assert (prompt_keys(array("I", toks), 16) == k).all()
    assert (prompt_keys(np.arange(40, dtype=np.uint32), 16) == k).all()
    assert (prompt_keys(np.arange(40, dtype=np.int64), 16) == k).all()
    assert prompt_keys([], 16).shape == (0,)


def test_event_blocks_continue_a_query_chain():
    toks = list(range(64))
    full = prompt_keys(toks, 16)
    tail = block_keys(toks[32:], 16, parent_key=int(full[1]))
    assert (tail == full[2:]).all()


def test_lora_block_size_and_extra_keys_change_keys():
    toks = list(range(64))
    base = prompt_keys(toks, 16)
    assert not (prompt_keys(toks, 16, lora_name="ad") == base).any()
    assert not (prompt_keys(toks, 16, lora_name="ad") == prompt_keys(toks, 16, lora_name="bd")).any()
    assert not (prompt_keys(toks, 32) == base[:2]).any()
    extra = [("img", 0), None, None, None]
    k = prompt_keys(toks, 16, extra_keys=extra)
    assert k[0] != base[0] and not (k[1:] == base[1:]).any()  # the chain carries it on
    assert (prompt_keys(toks, 16, extra_keys=[None] * 4) == base).all()
    assert (prompt_keys(toks, 16, extra_keys=[()] * 4) == base).all()


def test_vllm_lora_name_in_extra_keys_is_not_counted_twice():
    toks = list(range(32))
    assert (
        block_keys(toks, 16, lora_name="ad", extra_keys=[("ad",), ("ad",)]) == prompt_keys(toks, 16, lora_name="ad")
    ).all()
    mm = block_keys(toks, 16, lora_name="ad", extra_keys=[("ad", "mmhash"), ("ad",)])
    assert (mm == prompt_keys(toks, 16, lora_name="ad", extra_keys=[("mmhash",), None])).all()


def test_chain_sensitivity():
    toks = list(range(64))
    base = prompt_keys(toks, 16)
    changed = list(toks)
    changed[3] = 10_000
    k = prompt_keys(changed, 16)
    assert not (k == base).any()  # one token in block 0 changes every later key
    changed = list(toks)
    changed[40] = 10_000
    k = prompt_keys(changed, 16)
    assert (k[:2] == base[:2]).all() and not (k[2:] == base[2:]).any()


def test_canonical_encoding_is_injective_on_types():
    vals = [None, True, False, 1, 1.0, "1", b"1", (1,), [1], (("a", 1),), ("a", 1), 0, ""]
    encs = {canonical(v) for v in vals}
    assert len(encs) == len(vals) - 1  # (1,) and [1] are the same sequence


def test_engine_hash_forms():
    assert engine_hash_u64(-1) == 2**64 - 1
    assert engine_hash_u64(2**64 - 5) == 2**64 - 5
    assert engine_hash_u64(b"\x01" * 32) == xxhash.xxh3_64_intdigest(b"\x01" * 32)
    assert engine_hashes((1, -1, b"x")).tolist() == [1, 2**64 - 1, xxhash.xxh3_64_intdigest(b"x")]
    assert orphan_root(5) != orphan_root(6) and orphan_root(5) != ROOT


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.sampled_from([1, 2, 3, 16, 64]))
def test_prompt_keys_equal_a_python_chain(toks, bs):
    from oracle import chain

    assert prompt_keys(toks, bs).tolist() == chain(toks, bs, ROOT)


# ---------------------------------------------------------------- the core against the reference

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True)
    | st.text(max_size=6)
    | st.binary(max_size=6)
)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner), max_leaves=8)


class _Odd:
    def __repr__(self) -> str:
        return "odd<1>"


@settings(max_examples=300, deadline=None)
@given(_values)
def test_canonical_encoding_is_the_references(v):
    assert _core.canonical(v) == keys_oracle.canonical(v)


def test_canonical_encoding_of_what_json_and_vllm_cannot_carry():
    for v in ["\udcff", bytearray(b"ab"), memoryview(b"cd"), {"a": 1}, _Odd(), 2**64, -(2**63) - 1, 5e-324, -0.0]:
        assert _core.canonical(v) == keys_oracle.canonical(v), v


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.none() | _values, max_size=6),
    st.sampled_from([None, "ad", ""]),
    st.integers(0, 8),
)
def test_block_contexts_are_the_references(extra, lora, nblocks):
    if lora and extra and extra[0] is not None:
        extra[0] = (lora, *extra[0]) if isinstance(extra[0], (tuple, list)) else (lora, extra[0])
    got = np.frombuffer(_core.block_contexts(lora, extra, nblocks), np.uint64).tolist()
    assert got == keys_oracle.block_contexts(lora, extra, nblocks)


def test_roots_and_seeds_are_the_references():
    assert (_core.ROOT, _core.ORPHAN_ROOT, _core.ENGINE_NS) == (
        keys_oracle.ROOT,
        keys_oracle.ORPHAN_ROOT,
        keys_oracle.ENGINE_NS,
    )
    for lora in (None, "ad", "é", ""):
        assert _core.context_seed(lora) == keys_oracle.context_seed(lora)
    for h in (0, 5, -1, 2**64 - 1, 2**70 + 3, b"\x01" * 32):
        assert engine_hash_u64(h) == keys_oracle.engine_hash_u64(h)
        if isinstance(h, int):
            assert orphan_root(h) == keys_oracle.orphan_root(h)


# ---------------------------------------------------------------- bad input raises, never panics


def test_chain_keys_refuses_contexts_that_do_not_cover_the_blocks():
    tok = np.arange(64, dtype=np.uint32)
    c = np.array([keys_oracle.context_seed()], np.uint64)
    assert _core.chain_keys(tok, 16, 4, ROOT, c.tobytes()) == prompt_keys(tok, 16).tobytes()
    with pytest.raises(ValueError, match="no context"):
        _core.chain_keys(tok, 16, 4, ROOT, b"")
    with pytest.raises(ValueError, match="no context"):
        _core.chain_keys(tok, 16, 4, ROOT, b"\0" * 7)
    with pytest.raises(ValueError, match="2 contexts for 4 blocks"):
        _core.chain_keys(tok, 16, 4, ROOT, np.zeros(2, np.uint64).tobytes())


def test_chain_keys_refuses_block_counts_past_the_tokens_or_past_64_bits():
    tok = np.arange(64, dtype=np.uint32)
    c = np.zeros(1, np.uint64).tobytes()
    with pytest.raises(ValueError, match="need more tokens"):
        _core.chain_keys(tok, 16, 5, ROOT, c)
    with pytest.raises(ValueError, match="need more tokens"):
        _core.chain_keys(tok, 2**62, 2**62, ROOT, c)  # n * bs * 4 wraps to 0 in 64 bits
    with pytest.raises(ValueError, match="block_size"):
        _core.chain_keys(tok, 0, 1, ROOT, c)


def test_queries_with_extra_keys_the_encoding_refuses_raise():
    ix = PrefixIndex()
    ix.apply_batch(WorkerId("a", 0), [stored([1, 2], range(32), 16)])
    deep: list = []
    for _ in range(40):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper"):
        ix.score(list(range(32)), extra_keys=[deep])
    with pytest.raises(ValueError, match="nested deeper"):
        prompt_keys(list(range(32)), 16, extra_keys=[deep])
    with pytest.raises(TypeError):
        ix.score(list(range(32)), extra_keys=5)
    # more entries than blocks, or fewer: the extra ones are ignored, the missing ones have none
    assert ix.score(list(range(32)), extra_keys=[None] * 9) == ix.score(list(range(32)))
    assert ix.score(list(range(32)), extra_keys=[]) == ix.score(list(range(32)))
