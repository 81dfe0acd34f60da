"""Tenants: a prompt matches only blocks stored under its own cache_salt and LoRA adapter.

The engines are vLLM 0.33's own ``KVCacheManager`` (block pool, prefix cache, KV events) on CPU,
each serving the same tokens for one tenant (no salt, two salts, two LoRA adapters, a salt with
an adapter), plus one engine serving several tenants. Their events take the real way in: vLLM's
``KVEventBatch`` msgpack -> kvwire's vLLM wire adapter -> Avro records -> the consumer's apply
path (``Applier.apply_records``, the core's decoder, which keys blocks with their extra keys).
Every query, for every tenant and every worker, compares the index's credit with what that
engine's own prefix cache returns for a Request of the same tenant (``get_computed_blocks``):
equal, so isolation holds both ways and the positive case is exact. Only the model forward
pass is absent: it does not touch the cache's bookkeeping.

The property test checks the query side (``cache_salt``/``extra_keys`` as ``/v1/score`` takes
them) against ``tests/oracle.py`` fed with vLLM-shaped extra keys.
"""

from __future__ import annotations

import importlib
import json
import random
import time
from array import array
from typing import Any, NamedTuple

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer
from ci_env import unavailable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import Oracle
from vllm_engine import BS, cache_manager, request

from kvwire.consumer.apply import Applier
from kvwire.consumer.http import make_app
from kvwire.consumer.index import PrefixIndex
from kvwire.consumer.router import Scorer
from kvwire.consumer.tenants import TenantError, tenant_extra_keys
from kvwire.producer.vllm_wire import decode_batch
from kvwire.schemas import codec
from kvwire.schemas.events import EventBatch, WorkerId, stored

# (cache_salt, LoRA adapter name) per tenant; None: none.
TENANTS: list[tuple[str | None, str | None]] = [
    (None, None),
    ("salt-a", None),
    ("salt-b", None),
    (None, "adapter-1"),
    (None, "adapter-2"),
    ("salt-a", "adapter-1"),
]


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as e:
        unavailable(f"{module} is not installed (CI installs it): {e}")


class Rec(NamedTuple):
    offset: int
    key: bytes | None
    value: bytes
    timestamp: int


class Engine:
    """One vLLM KVCacheManager whose events an Applier indexes as worker ``name``."""

    def __init__(self, name: str, applier: Applier, num_blocks: int = 256):
        self._ke = _require("vllm.distributed.kv_events")
        from vllm.lora.request import LoRARequest

        self.mgr = cache_manager(num_blocks)
        self._lora_ids: dict[str, int] = {}

        def lora_request(lora: str | None) -> Any:
            if lora is None:
                return None
            lid = self._lora_ids.setdefault(lora, len(self._lora_ids) + 1)
            return LoRARequest(lora, lid, f"/adapters/{lora}")

        self._request = lambda rid, toks, salt, lora: request(rid, toks, lora_request(lora), salt)
        self.name, self.applier = name, applier
        self._n = self._seq = self._offset = 0

    def serve(self, tokens: list[int], salt: str | None, lora: str | None) -> None:
        """A prefill (prefix-cache hit, allocation), the request ends, the step's events go out."""
        self._n += 1
        r = self._request(f"r{self._n}", tokens, salt, lora)
        blocks, hit = self.mgr.get_computed_blocks(r)[:2]
        assert self.mgr.allocate_slots(r, len(tokens) - hit, hit, blocks) is not None, "engine out of blocks"
        self.mgr.free(r)
        self.publish()

    def publish(self) -> None:
        events = self.mgr.take_events()
        if not events:
            return
        # The bytes vLLM's ZmqEventPublisher sends, through kvwire's adapter and Avro record.
        wire = decode_batch(msgspec.msgpack.encode(self._ke.KVEventBatch(ts=time.time(), events=events)))
        batch = EventBatch(
            WorkerId(self.name, 0), 1, self._seq, time.time_ns() // 1000, tuple(wire.events), reset=self._seq == 0
        )
        self._seq += 1
        rec = Rec(self._offset, self.name.encode(), codec.encode(batch), int(time.time() * 1000))
        self._offset += 1
        self.applier.apply_records("tenants", 0, [rec])

    def held_tokens(self, tokens: list[int], salt: str | None, lora: str | None) -> int:
        """What vLLM's own prefix cache gives a request of this tenant (it never serves the
        prompt's last token from cache, so prompts here end mid-block)."""
        self._n += 1
        return int(self.mgr.get_computed_blocks(self._request(f"q{self._n}", tokens, salt, lora))[1])


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 30000) for _ in range(n)]


@pytest.fixture(scope="module")
def fleet():
    """One engine per tenant serving the same prompts, and one serving several tenants."""
    applier = Applier()
    rng = random.Random(7)
    shared = _toks(rng, 5 * BS + 3)
    other = shared[: 2 * BS] + _toks(rng, 2 * BS + 9)
    engines = {t: Engine(f"tenant-{i}", applier) for i, t in enumerate(TENANTS)}
    for t, e in engines.items():
        e.serve(shared, *t)
        e.serve(other, *t)
    mixed = Engine("mixed", applier)
    mixed.serve(shared, "salt-a", None)
    mixed.serve(other[: 3 * BS + 1], None, "adapter-2")
    mixed.serve(shared[: 2 * BS + 1], None, None)
    assert not applier.dead_letters and not applier.ranks.untrusted_workers()
    queries = [shared, other, shared[: 3 * BS + 2], other[: 2 * BS + 5], shared[: BS - 1], _toks(rng, 3 * BS + 1)]
    return applier, [*engines.values(), mixed], queries


@pytest.mark.vllm
def test_each_tenant_matches_exactly_what_its_engines_hold(fleet):
    applier, engines, queries = fleet
    scorer = Scorer(applier)
    checked = positive = 0
    for q in queries:
        for salt, lora in [*TENANTS, ("salt-b", "adapter-1"), (None, "adapter-3")]:
            got = {s.instance_id: s.matched_tokens for s in scorer.score(q, lora_name=lora, cache_salt=salt)}
            for e in engines:
                want = e.held_tokens(q, salt, lora)
                assert got.get(e.name, 0) == want, (e.name, salt, lora, len(q))
                checked += 1
                positive += want > 0
    # The check has teeth: every tenant engine holds its prompts, under its own tenant only.
    assert positive >= len(TENANTS) * 4 and checked - positive >= len(TENANTS) * 20


@pytest.mark.vllm
def test_extra_keys_in_vllms_published_form_equal_cache_salt(fleet):
    applier, engines, queries = fleet
    scorer = Scorer(applier)
    q = queries[0]
    n = len(q) // BS
    for salt, lora in TENANTS:
        by_salt = scorer.score_json(q, lora_name=lora, cache_salt=salt)
        # What vLLM puts in BlockStored.extra_keys, as JSON carries it (arrays for tuples).
        ek = [[*([lora] if lora else []), *([salt] if (salt and i == 0) else [])] or None for i in range(n)]
        assert scorer.score_json(q, lora_name=lora, extra_keys=json.loads(json.dumps(ek))) == by_salt
        held = {e.name for e in engines if e.held_tokens(q, salt, lora)}
        assert {s["instance_id"] for s in json.loads(by_salt)} == held


@pytest.mark.vllm
async def test_http_score_takes_cache_salt_and_extra_keys(fleet):
    applier, engines, queries = fleet
    q = queries[0]
    async with TestClient(TestServer(make_app(applier, lambda: True))) as c:
        for salt, lora in TENANTS:
            body = {"token_ids": q, "lora_name": lora, "cache_salt": salt}
            got = {
                s["instance_id"]: s["matched_tokens"]
                for s in (await (await c.post("/v1/score", json=body)).json())["scores"]
            }
            want = {e.name: h for e in engines if (h := e.held_tokens(q, salt, lora))}
            assert got == want
            # The binary form carries them as query parameters, with the same answer.
            params = {k: v for k, v in (("lora_name", lora), ("cache_salt", salt)) if v is not None}
            r = await c.post(
                "/v1/score",
                data=array("I", q).tobytes(),
                params=params,
                headers={"content-type": "application/octet-stream"},
            )
            assert {s["instance_id"]: s["matched_tokens"] for s in (await r.json())["scores"]} == want
        for bad in ({"cache_salt": 3}, {"extra_keys": "x"}, {"extra_keys": [{"k": 1}]}, {"extra_keys": [[[["deep"]]]]}):
            r = await c.post("/v1/score", json={"token_ids": q, **bad})
            assert r.status == 400 and "error" in await r.json()
        r = await c.post(
            "/v1/score",
            data=b"\0" * 64,
            params={"extra_keys": "[not json"},
            headers={"content-type": "application/octet-stream"},
        )
        assert r.status == 400


def test_cache_salt_goes_last_in_block_zero_after_the_lora_name():
    assert tenant_extra_keys(None, None) is None
    assert tenant_extra_keys(None, "") is None  # vLLM: an empty salt is none
    assert tenant_extra_keys(None, "s") == [("s",)]
    assert tenant_extra_keys([["mm", 0], None], "s") == [("mm", 0, "s"), None]
    assert tenant_extra_keys([None, ["x"]], "s", "A") == [("A", "s"), ["x"]]
    assert tenant_extra_keys([["A", ["mm", 0]]], "s", "A") == [("A", ["mm", 0], "s")]
    # A salt equal to the LoRA name is not the one the index drops as the leading LoRA name.
    assert tenant_extra_keys(None, "A", "A") == [("A", "A")]
    with pytest.raises(TenantError):
        Scorer(Applier()).score([1] * 32, extra_keys=[object()])
    with pytest.raises(TenantError):
        Scorer(Applier()).score([1] * 32, cache_salt=5)  # type: ignore[arg-type]


# ------------------------------------------------------------------ property test against the oracle

_salts = st.sampled_from([None, "a", "b", "adapter"])
_loras = st.sampled_from([None, "adapter", "other"])


def _vllm_extra(lora: str | None, salt: str | None, n: int, mm: list | None) -> list | None:
    """BlockStored.extra_keys as vLLM publishes them: LoRA name, mm pairs, salt (block 0 only)."""
    out = []
    for i in range(n):
        keys: list[Any] = [lora] if lora else []
        if mm is not None and i < len(mm) and mm[i] is not None:
            keys.append(tuple(mm[i]))
        if salt and i == 0:
            keys.append(salt)
        out.append(tuple(keys) or None)
    return out if any(k is not None for k in out) else None


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    stores=st.lists(
        st.tuples(st.integers(0, 2), st.integers(1, 4), _salts, _loras, st.booleans()), min_size=1, max_size=8
    ),
    queries=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 5), _salts, _loras, st.booleans()), max_size=6),
)
def test_tenant_queries_match_the_oracle(stores, queries):
    """Blocks stored under random tenants (vLLM-shaped extra keys, mm pairs included) into the
    index and the oracle; a query's cache_salt/extra_keys (the /v1/score form) scores as the
    oracle does for vLLM's own per-block keys."""
    rng = random.Random(len(stores) * 31 + len(queries))
    bases = [_toks(rng, 5 * BS + 1) for _ in range(3)]
    mm = [["img-0", 3], None, ["img-1", 0]]
    index, oracle = PrefixIndex(), Oracle()
    for i, (b, n, salt, lora, with_mm) in enumerate(stores):
        ev = stored(
            [rng.getrandbits(63) for _ in range(n)],
            bases[b][: n * BS],
            BS,
            lora_name=lora,
            extra_keys=_vllm_extra(lora, salt, n, mm if with_mm else None),
        )
        rank = WorkerId(f"w{i % 3}")
        index.apply_batch(rank, (ev,))
        oracle.store(rank, ev)
    for b, n, salt, lora, with_mm in queries:
        q = bases[b][: n * BS + 1]
        caller = [list(x) if x is not None else None for x in mm] if with_mm else None
        want = oracle.score(q, lora_name=lora, extra_keys=_vllm_extra(lora, salt, n, mm if with_mm else None))
        caller_ek = None if caller is None else [[x] if x is not None else None for x in caller]
        got = index.score(q, lora_name=lora, extra_keys=tenant_extra_keys(caller_ek, salt, lora))
        assert [(s.instance_id, s.matched_tokens) for s in got] == [(s.instance_id, s.matched_tokens) for s in want]
