"""The Confluent framing against the real registry and Confluent's own client library:

- records kvwire's publisher writes with Confluent framing are decoded by confluent-kafka's
  AvroDeserializer, field by field;
- records confluent-kafka's AvroSerializer writes are applied by a kvwire index member, which
  ends up with the index the same batches give applied directly;
- a record naming an id the registry does not know (or a non-kvwire schema) is dead-lettered
  with that reason, and the rest of the topic is applied;
- a topic holding both framings (and both schema versions) replays to the digest of the same
  events in one framing, and `kvwire tail` prints both.
"""

from __future__ import annotations

import asyncio
import io
import json

import pytest
from aiokafka import AIOKafkaConsumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from wire_workload import produce, read_all, reference, workload

from kvwire.consumer.ingest import IndexMember, IngestConfig
from kvwire.consumer.replay import replay
from kvwire.kafka.registry.client import NotFound, RegistryClient, RegistryConfig, topic_subject
from kvwire.kafka.registry.resolver import IdResolver
from kvwire.kafka.registry.shipped import register_shipped
from kvwire.producer.config import PublisherConfig
from kvwire.producer.publisher import KafkaPublisher
from kvwire.schemas import codec
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, WorkerId, stored
from kvwire.tail import TailOptions, run_tail

pytestmark = pytest.mark.integration


def _client(url: str) -> RegistryClient:
    return RegistryClient(RegistryConfig(url))


async def _wait_ready(member: IndexMember, timeout: float = 90.0) -> None:
    for _ in range(int(timeout / 0.1)):
        if member.ready:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"member not ready: {member.assigned} {member.applier.positions}")


def _workers_view(applier) -> list[dict]:
    # last_seen_us is wall clock of the apply, the rest is state
    return [
        {**w, "ranks": [{k: v for k, v in r.items() if k != "last_seen_us"} for r in w["ranks"]]}
        for w in applier.workers()
    ]


def test_kvwire_confluent_records_are_read_by_confluents_deserializer(kafka_bootstrap, new_topic, schema_registry):
    topic = new_topic(partitions=2)
    worker = WorkerId("pub-a", dp_rank=1, tp_rank=0, tp_size=2, model="m")
    published = [
        (
            stored(
                [(1 << 64) - 1, 1 << 63, 5],
                range(12),
                4,
                parent_block_hash=(1 << 64) - 2,
                lora_id=3,
                medium="GPU",
                lora_name="l",
                extra_keys=(("l", ("img", 0)), None, (b"\xffdigest", 2.5, True, None)),
                group_idx=1,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=64,
                locality="LOCAL",
                ownership="o",
                session_id="s",
            ),
        ),
        (stored([-1, 2], [5, 6], 1, parent_block_hash=-3, medium="CPU"), BlockRemoved([bytes(32)], medium="STORAGE")),
        (AllBlocksCleared(),),
    ]
    pub = KafkaPublisher(
        PublisherConfig(
            bootstrap_servers=kafka_bootstrap,
            topic=topic,
            partitions=2,
            heartbeat_interval_s=3600.0,
            framing="confluent",
            schema_registry_url=schema_registry,
        )
    )
    try:
        stream = pub.stream(worker, "simulator")
        for events in published:
            assert stream.publish(events)
    finally:
        pub.close()
    assert not [s for s in pub.stats() if s.lost or s.dropped or s.failed], pub.stats()

    # The id the producer framed with is the registry's id for the current version, under the
    # subject Confluent's tools look in.
    sid = _client(schema_registry).lookup(topic_subject(topic), codec.CURRENT.registry_text)
    assert sid is not None
    records = asyncio.run(read_all(kafka_bootstrap, topic))
    assert len(records) == 1 + len(published)  # the epoch's opening reset, then each batch

    deserialize = AvroDeserializer(SchemaRegistryClient({"url": schema_registry}), return_record_name=True)
    ids = codec.SchemaIds()
    IdResolver(_client(schema_registry), ids).resolve({sid})
    seen = []
    for r in sorted(records, key=lambda r: codec.decode(r.value, ids=ids).seq):
        assert r.value[:5] == b"\x00" + sid.to_bytes(4, "big")
        assert dict(r.headers)["content-type"] == codec.CONFLUENT_CONTENT_TYPE.encode()
        theirs = deserialize(r.value, SerializationContext(topic, MessageField.VALUE))
        ours = codec.decode(r.value, ids=ids)
        # field by field: Confluent's decode is exactly the record kvwire meant to write
        assert theirs == codec.batch_to_record(ours)
        assert codec.record_to_batch(theirs) == ours
        assert ours.worker == worker and ours.source == "simulator"
        seen.append(ours.events)
    assert seen[0] == () and tuple(seen[1:]) == tuple(published)


async def test_confluent_serializer_records_are_applied_by_an_index_member(kafka_bootstrap, new_topic, schema_registry):
    topic = new_topic(partitions=1)
    batches = workload(seed=11)
    serialize = AvroSerializer(
        SchemaRegistryClient({"url": schema_registry}),
        codec.CURRENT.registry_text,
        conf={"auto.register.schemas": True},
    )
    ctx = SerializationContext(topic, MessageField.VALUE)
    values = [(b.worker.kafka_key(), serialize(codec.batch_to_record(b), ctx)) for b in batches]
    assert all(v[:1] == b"\x00" for _, v in values)
    await produce(kafka_bootstrap, topic, values)

    member = IndexMember(
        IngestConfig(kafka_bootstrap, topic, heartbeat_timeout_s=3600.0, schema_registry_url=schema_registry)
    )
    await member.start()
    try:
        await _wait_ready(member)
        a = member.applier
        assert a.metrics.dead_letters._value.get() == 0
        assert a.records == len(batches)
        # field by field: every record, decoded the way the member decoded it, is the batch sent
        for b, (_, v) in zip(batches, values, strict=True):
            assert codec.decode(v) == b
        ref = reference(batches)
        assert len(ref.index) > 0
        assert a.index.digest() == ref.index.digest()
        assert _workers_view(a) == _workers_view(ref)
        assert a.score(list(range(1000))) == ref.score(list(range(1000)))
    finally:
        await member.stop()


async def test_an_id_the_registry_does_not_know_is_dead_lettered_with_that_reason(
    kafka_bootstrap, new_topic, schema_registry
):
    topic = new_topic(partitions=1)
    client = _client(schema_registry)
    ids = dict(register_shipped(client, topic_subject(topic)))
    foreign = client.register(
        f"{topic}-other-value", '{"type":"record","name":"Other","namespace":"x","fields":[{"name":"a","type":"int"}]}'
    )
    unknown = 2**31 - 7
    with pytest.raises(NotFound):
        client.schema(unknown)
    good = workload(seed=3, batches_per_rank=3)
    values = [
        (good[0].worker.kafka_key(), codec.encode(good[0], schema_id=ids[codec.CURRENT.version])),
        (b"bad-unknown", codec.encode(good[1], schema_id=unknown)),
        (b"bad-foreign", codec.encode(good[1], schema_id=foreign)),
        *((b.worker.kafka_key(), codec.encode(b, schema_id=ids[codec.CURRENT.version])) for b in good[1:]),
    ]
    await produce(kafka_bootstrap, topic, values)
    member = IndexMember(
        IngestConfig(kafka_bootstrap, topic, heartbeat_timeout_s=3600.0, schema_registry_url=schema_registry)
    )
    await member.start()
    try:
        await _wait_ready(member)
        assert member.applier.index.digest() == reference(good).index.digest()
        assert member.applier.metrics.dead_letters._value.get() == 2
    finally:
        await member.stop()
    c = AIOKafkaConsumer(
        f"{topic}.dlq", bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await c.start()
    try:
        got: list = []
        while len(got) < 2:
            for recs in (await c.getmany(timeout_ms=5000)).values():
                got.extend(recs)
    finally:
        await c.stop()
    errors = {r.key: dict(r.headers)["kvwire-error"].decode() for r in got}
    assert f"schema id {unknown} is not known to the schema registry" in errors[b"bad-unknown"]
    assert f"schema id {foreign} is 'x.Other', not dev.kvwire.EventBatch" in errors[b"bad-foreign"]
    assert {r.value for r in got} == {values[1][1], values[2][1]}  # kept whole


async def test_a_topic_in_both_framings_replays_to_the_same_digest(kafka_bootstrap, new_topic, schema_registry):
    mixed, single = new_topic(partitions=1), new_topic(partitions=1)
    client = _client(schema_registry)
    ids = dict(register_shipped(client, topic_subject(mixed)))
    batches = workload(seed=5)
    # Framing switches mid-stream, back and forth, and both schema versions appear in both framings.
    mixed_values = []
    for i, b in enumerate(batches):
        version = 1 if i % 3 == 0 else codec.CURRENT.version
        b_v = b if version >= 2 else b.__class__(**{**{f: getattr(b, f) for f in b.__struct_fields__}, "source": ""})
        schema_id = ids[version] if (i // 4) % 2 else None
        mixed_values.append((b.worker.kafka_key(), codec.encode(b_v, version=version, schema_id=schema_id)))
    framings = {codec.framing(v) for _, v in mixed_values}
    assert framings == {codec.CONFLUENT, codec.SINGLE_OBJECT}
    await produce(kafka_bootstrap, mixed, mixed_values)
    await produce(kafka_bootstrap, single, [(b.worker.kafka_key(), codec.encode(b)) for b in batches])

    resolver = IdResolver(client)
    got_mixed = (await replay(kafka_bootstrap, mixed, schema_ids=resolver)).summary()
    got_single = (await replay(kafka_bootstrap, single, schema_ids=resolver)).summary()
    assert got_mixed["dead_letters"] == got_single["dead_letters"] == 0
    assert got_mixed["records"] == got_single["records"] == len(batches)
    assert got_mixed["holder_blocks"] > 0
    assert got_mixed["digest"] == got_single["digest"] == reference(batches).index.digest()
    assert got_mixed["workers"] == got_single["workers"]

    # kvwire tail reads the same topic, each record with its framing
    out = io.StringIO()
    opts = TailOptions(
        kafka_bootstrap, mixed, "earliest", as_json=True, timeout_s=5.0, schema_registry_url=schema_registry
    )
    printed = await run_tail(opts, out)
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert printed == len(lines) == len(batches)
    assert not [x for x in lines if "error" in x]
    for line, (_, v) in zip(lines, mixed_values, strict=True):
        assert line["framing"] == codec.framing(v) and line["schema_id"] == codec.confluent_id(v)
        assert line["batch"]["seq"] == codec.decode(v).seq


def test_a_centrally_registered_producer_only_looks_its_id_up(kafka_bootstrap, new_topic, schema_registry):
    # The platform team registered the versions (kvwire schemas --register); producers must not
    # add versions, only frame with the id the registry already holds for theirs.
    topic = new_topic(partitions=1)
    client = _client(schema_registry)
    ids = dict(register_shipped(client, topic_subject(topic)))
    versions_before = client.versions(topic_subject(topic))
    pub = KafkaPublisher(
        PublisherConfig(
            bootstrap_servers=kafka_bootstrap,
            topic=topic,
            partitions=1,
            heartbeat_interval_s=3600.0,
            framing="confluent",
            schema_registry_url=schema_registry,
            auto_register_schema=False,
        )
    )
    try:
        assert pub.stream(WorkerId("central"), "simulator").publish((AllBlocksCleared(),))
    finally:
        pub.close()
    records = asyncio.run(read_all(kafka_bootstrap, topic))
    assert len(records) == 2
    assert {codec.confluent_id(r.value) for r in records} == {ids[codec.CURRENT.version]}
    assert dict(records[0].headers)["schema-id"] == str(ids[codec.CURRENT.version]).encode()
    assert client.versions(topic_subject(topic)) == versions_before
