"""One index whatever framing and decoder a record took.

The same records, hybrid-model sparse stores and float extra keys among them, go through a real
broker into a real index member (what `kvwire index` runs), once per route:

- single-object framing: the core's fast decoder;
- Confluent framing with a shipped schema's registry id: the core's fast decoder too;
- Confluent framing with the id of a newer producer's schema (one field more, which kvwire does
  not ship): the core declines it, the reference decoder resolves it and the core applies it;
- Confluent framing with a shipped id while the core is not told which version the id names
  (the cache withholds its id -> version map): every record takes the declined route.

Each route must give the index the single-object records give applied in-process, keep the
sparse stores as orphans and dead-letter nothing.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import NamedTuple

import pytest
from test_confluent_wire import _wait_ready, _workers_view
from wire_workload import produce, workload

from kvwire.consumer.apply import Applier
from kvwire.consumer.ingest import IndexMember, IngestConfig
from kvwire.kafka.registry.client import RegistryClient, RegistryConfig, topic_subject
from kvwire.kafka.registry.shipped import register_shipped
from kvwire.schemas import codec
from kvwire.schemas.events import BlockRemoved, EventBatch, WorkerId, stored

pytestmark = pytest.mark.integration

BS = 4
SEQ = list(range(500, 540))  # 10 blocks
HYBRID = WorkerId("hybrid", 0, 0, 1, "m")
FULL = {"kv_cache_spec_kind": "full_attention"}
WINDOW = {"kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 2 * BS + 1}


def _eh(upto: int) -> int:
    return (upto * 0x9E3779B1) & 0xFFFFFFFFFFFF


def _hybrid_batches(now_us: int) -> list[EventBatch]:
    """Full attention in group 0; the sliding window's store in group 1 is sparse (token ids of 10
    blocks, hashes of the 2 the window keeps), as vLLM's ``cache_full_blocks`` sends it."""
    full = stored([_eh((i + 1) * BS) for i in range(10)], SEQ, BS, group_idx=0, extra_keys=(("x", 3),), **FULL)
    sparse = stored([_eh(9 * BS), _eh(10 * BS)], SEQ, BS, group_idx=1, **WINDOW)
    later = stored([_eh(99)], SEQ[:BS], BS, group_idx=1, extra_keys=((-0.0, float("inf"), 1e-310),), **WINDOW)
    return [
        EventBatch(HYBRID, 7, 0, now_us, (full, sparse), reset=True, source="t"),
        EventBatch(HYBRID, 7, 1, now_us + 1, (later, BlockRemoved((_eh(10 * BS),), group_idx=1)), source="t"),
    ]


class _Record(NamedTuple):
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int


def _newer_schema() -> dict:
    """The current schema plus an optional field: a newer producer's, FULL-compatible."""
    raw = copy.deepcopy(codec.CURRENT.raw)
    raw["fields"].append({"name": "note", "type": ["null", "string"], "default": None})
    return raw


def _values(route: str, batches: list[EventBatch], client: RegistryClient, subject: str) -> list[bytes]:
    if route == "single-object":
        return [codec.encode(b) for b in batches]
    ids = dict(register_shipped(client, subject))
    if route == "confluent-newer-writer":
        raw = _newer_schema()
        sid = client.register(subject, json.dumps(raw, separators=(",", ":")))
        assert sid not in ids.values()
        return [codec.encode(b, codec.schema_version(raw), schema_id=sid) for b in batches]
    return [codec.encode(b, schema_id=ids[codec.CURRENT.version]) for b in batches]


ROUTES = ["single-object", "confluent", "confluent-newer-writer", "confluent-declined"]
FAST = {"single-object", "confluent"}


@pytest.mark.parametrize("route", ROUTES)
async def test_every_framing_and_decoder_gives_one_index(
    route, kafka_bootstrap, new_topic, schema_registry, monkeypatch
):
    batches = workload(seed=13, batches_per_rank=8)
    batches += _hybrid_batches(batches[0].ts_us)
    topic = new_topic(partitions=1)
    client = RegistryClient(RegistryConfig(schema_registry))
    values = _values(route, batches, client, topic_subject(topic))
    if route == "confluent-declined":
        monkeypatch.setattr(codec.SCHEMA_IDS, "shipped", dict)

    # The reference: the single-object records applied in-process by the fast path.
    ref = Applier()
    recs = [_Record(i, b.worker.kafka_key(), codec.encode(b), 0) for i, b in enumerate(batches)]
    assert ref.apply_records(topic, 0, recs, budget_us=10**9) == len(batches)
    assert ref.dead_letters == []
    assert ref.index.workers()[("hybrid", 0)].orphans == 1  # the sparse store, less its removed hash

    await produce(kafka_bootstrap, topic, [(b.worker.kafka_key(), v) for b, v in zip(batches, values, strict=True)])
    member = IndexMember(
        IngestConfig(kafka_bootstrap, topic, heartbeat_timeout_s=3600.0, schema_registry_url=schema_registry)
    )
    await member.start()
    try:
        await _wait_ready(member)
        for _ in range(300):  # ready means caught up with the end offsets seen at assignment
            if member.applier.records == len(batches) or member.applier.metrics.dead_letters._value.get():
                break
            await asyncio.sleep(0.1)
        a = member.applier
        assert a.metrics.dead_letters._value.get() == 0
        assert a.records == len(batches)
        assert a.index.holder_blocks() == ref.index.holder_blocks()
        assert a.index.digest() == ref.index.digest()
        assert a.index.workers() == ref.index.workers()
        assert _workers_view(a) == _workers_view(ref)
        assert a.score(SEQ) == ref.score(SEQ)
        # The route taken is the one named: the fast decoder declined exactly the slow routes' records.
        assert ref.declined == 0
        assert a.declined == (0 if route in FAST else len(batches))
    finally:
        await member.stop()
