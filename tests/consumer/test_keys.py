"""Block keys: bit-exact XXH3, chaining, and what changes a key."""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

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
from kvwire.schemas.events import stored


@pytest.mark.parametrize("nbytes", list(range(0, 260, 4)) + [512, 1020, 1024, 1028, 2048, 4096, 5000])
def test_xxh3_matches_xxhash_package(nbytes):
    rng = random.Random(nbytes)
    for seed in (0, 1, rng.getrandbits(64), (1 << 64) - 1):
        words = np.array([rng.getrandbits(32) for _ in range(nbytes // 4 + 2)], np.uint32)
        got = xxh3_64(words[1 : 1 + nbytes // 4], seed)
        assert got == xxhash.xxh3_64_intdigest(words[1 : 1 + nbytes // 4].tobytes(), seed=seed)


def test_chain_is_xxh3_seeded_by_parent_and_context():
    toks = list(range(32))
    keys = prompt_keys(toks, 16)
    from kvwire.consumer.keys import context_seed

    c = context_seed(16)
    k0 = xxhash.xxh3_64_intdigest(array("I", toks[:16]).tobytes(), seed=ROOT ^ c)
    k1 = xxhash.xxh3_64_intdigest(array("I", toks[16:]).tobytes(), seed=k0 ^ c)
    assert keys.tolist() == [k0, k1]


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
