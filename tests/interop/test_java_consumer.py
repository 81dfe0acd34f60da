"""Cross-language proof of the contract: records kvwire writes are decoded by a plain Java consumer
using only the official Kafka client and Avro's BinaryMessageDecoder + SchemaStore, with the
schemas read from .avsc files. Every field Java prints is compared with what was produced.

Needs java + mvn (the jar is built here, into tests/interop/target, only when sources changed) and a
real broker. Under CI=true a missing toolchain or a failed build fails the test instead of skipping.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
import subprocess
import sys
from array import array
from pathlib import Path

import pytest
from ci_env import unavailable
from schema_registry import schema_registry  # noqa: F401  (the session fixture, by name)

from kvwire.kafka.positions import seek_to_beginning
from kvwire.schemas.codec import CONTENT_TYPE, VERSIONS, encode
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, EventBatch, WorkerId, stored

pytestmark = pytest.mark.integration

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
JAR = HERE / "target" / "kvwire-interop.jar"
CLASSPATH = f"{JAR}{os.pathsep}{HERE / 'target' / 'lib' / '*'}"
MAIN = "dev.kvwire.interop.ConsumeAndDecode"


def _stale() -> bool:
    if not JAR.exists() or not (HERE / "target" / "lib").is_dir():
        return True
    sources = [HERE / "pom.xml", *(HERE / "src").rglob("*")]
    return max(p.stat().st_mtime for p in sources) > JAR.stat().st_mtime


@pytest.fixture(scope="session")
def interop_jar() -> Path:
    for tool in ("java", "mvn"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} not on PATH: the Java interop check needs a JDK 17+ and Maven")
    if _stale():
        proc = subprocess.run(
            ["mvn", "-q", "-B", "-f", str(HERE / "pom.xml"), "package"], capture_output=True, text=True, timeout=900
        )
        if proc.returncode != 0:
            unavailable(f"mvn package failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return JAR


def _java(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["java", "-cp", CLASSPATH, MAIN, *args], capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------- what is produced

DIGEST_A = bytes(range(32))
DIGEST_B = bytes(range(100, 132))
U64_BIG = [(1 << 64) - 1, 1 << 63, (1 << 63) + 12345]


def sample_batches() -> list[tuple[EventBatch, int]]:
    """(batch, writer schema version): every event type, hash packing, optional field set/unset."""
    w_a0 = WorkerId("inst-a", dp_rank=0, tp_rank=1, tp_size=2, model="llama-3-8b")
    w_a1 = WorkerId("inst-a", dp_rank=1)
    w_b = WorkerId("inst-b/x", dp_rank=3, tp_rank=0, tp_size=4, model="")
    t0 = 1_717_000_000_000_000
    every_optional = stored(
        U64_BIG,
        range(3 * 4),
        4,
        parent_block_hash=(1 << 64) - 2,
        lora_id=7,
        medium="GPU",
        lora_name="sql-lora",
        extra_keys=(
            ("sql-lora", ("mm-image-1", 0), DIGEST_A),  # LoRA, [id, offset] pair, digest
            None,  # a block without extra keys
            ("salt", 3, 2.5, True, None, ("mm", 16)),  # every primitive branch
        ),
        group_idx=1,
        kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=4096,
        locality="LOCAL",
        ownership="owner-1",
        session_id="sess-9",
    )
    minimal = stored([5, 6], [1, 2, 3, 4], 2)
    negative = stored([-1, -(1 << 63), 42], [0xFFFFFFFF, 0, 7], 1, parent_block_hash=-17, medium="CPU")
    digests = stored(
        [DIGEST_A, DIGEST_B], range(1000, 1016), 8, parent_block_hash=bytes(32), medium="STORAGE", lora_name="lora-x"
    )
    return [
        (EventBatch(w_a0, 0x1234_5678_9ABC_DEF0, 0, t0, (minimal,), reset=True, source="vllm-connector"), 2),
        (
            EventBatch(
                w_a0,
                0x1234_5678_9ABC_DEF0,
                1,
                t0 + 1,
                (every_optional, negative, digests),
                engine_ts=1717000000.123456,
                source="vllm-connector",
            ),
            2,
        ),
        (
            EventBatch(
                w_a0,
                0x1234_5678_9ABC_DEF0,
                2,
                t0 + 2,
                (
                    BlockRemoved(U64_BIG[:2], medium="GPU", group_idx=0, locality="REMOTE", ownership="o"),
                    BlockRemoved([-5, 9]),
                    BlockRemoved([DIGEST_B], medium="CPU"),
                    AllBlocksCleared(),
                ),
                source="lmcache",
            ),
            2,
        ),
        (EventBatch(w_a0, 0x1234_5678_9ABC_DEF0, 3, t0 + 3, source="vllm-connector"), 2),  # heartbeat
        (EventBatch(w_a0, 0x1234_5678_9ABC_DEF0, 7, t0 + 4, (minimal,), gap=3), 2),
        (EventBatch(w_a1, -(1 << 63), 0, t0 + 5, (every_optional,), reset=True, gap=0), 1),
        (EventBatch(w_a1, -(1 << 63), 1, t0 + 6, (negative, digests), engine_ts=0.5), 1),
        (EventBatch(w_a1, -(1 << 63), 2, t0 + 7), 1),  # heartbeat
        (EventBatch(w_b, (1 << 63) - 1, 0, t0 + 8, (AllBlocksCleared(),), reset=True, source="simulator"), 2),
        (EventBatch(w_b, (1 << 63) - 1, 5, t0 + 9, (), gap=4, source="simulator"), 2),
    ]


def headers_for(version: int) -> list[tuple[str, bytes]]:
    sv = VERSIONS[version]
    return [
        ("content-type", CONTENT_TYPE.encode()),
        ("schema", sv.name.encode()),
        ("fingerprint", sv.fingerprint_hex.encode()),
    ]


async def produce(bootstrap: str, topic: str, batches) -> dict[tuple[int, int], tuple]:
    # Raw aiokafka rather than producer.publisher: the test must choose the writer schema (v1 and
    # v2), epochs, sequences and gaps itself, which a real publisher rightly does not allow.
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    await producer.start()
    try:
        sent = {}
        for batch, version in batches:
            key = batch.worker.kafka_key()
            md = await producer.send_and_wait(
                topic, encode(batch, version=version), key=key, headers=headers_for(version)
            )
            sent[(md.partition, md.offset)] = (batch, version, key)
        return sent
    finally:
        await producer.stop()


# ---------------------------------------------------------------- reading Java's JSON back


def unpack_hashes(kind: str, width: int, hex_: str) -> list:
    raw = bytes.fromhex(hex_)
    if kind == "DIGEST":
        return [raw[i : i + width] for i in range(0, len(raw), width)]
    assert width == 8 and len(raw) % 8 == 0
    return list(struct.unpack(f"<{len(raw) // 8}{'Q' if kind == 'U64' else 'q'}", raw))


def unpack_tokens(hex_: str) -> list[int]:
    a = array("I")
    a.frombytes(bytes.fromhex(hex_))
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()


def untag(v):
    """Java tags multi-branch unions {"branch": value} (Avro JSON style); back to Python values."""
    if v is None:
        return None
    if isinstance(v, list):
        return tuple(untag(x) for x in v)
    ((branch, inner),) = v.items()
    if branch == "bytes":
        return bytes.fromhex(inner)
    if branch == "array":
        return tuple(untag(x) for x in inner)
    assert branch in ("string", "long", "double", "boolean"), branch
    return inner


def normalise_extra(keys):
    if keys is None:
        return None
    return tuple(None if b is None else tuple(tuple(k) if isinstance(k, (tuple, list)) else k for k in b) for b in keys)


def check_stored(got: dict, e) -> None:
    kind, width = got["hash_kind"], got["hash_width"]
    ints = not isinstance(e.block_hashes[0], bytes)
    assert kind == (
        "DIGEST"
        if not ints
        else "I64"
        if min([*e.block_hashes, *([e.parent_block_hash] if e.parent_block_hash is not None else [])]) < 0
        else "U64"
    )
    assert width == (8 if ints else len(e.block_hashes[0]))
    assert unpack_hashes(kind, width, got["block_hashes"]) == list(e.block_hashes)
    parent = got["parent_block_hash"]
    assert (None if parent is None else unpack_hashes(kind, width, parent)[0]) == e.parent_block_hash
    assert unpack_tokens(got["token_ids"]) == e.token_ids.tolist()
    for name in (
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
    ):
        assert got[name] == getattr(e, name), name
    assert (
        None
        if got["extra_keys"] is None
        else tuple(None if b is None else tuple(untag(k) for k in b) for b in got["extra_keys"])
    ) == normalise_extra(e.extra_keys)
    assert set(got) == {
        "hash_kind",
        "hash_width",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
    }


def check_removed(got: dict, e) -> None:
    kind, width = got["hash_kind"], got["hash_width"]
    assert unpack_hashes(kind, width, got["block_hashes"]) == list(e.block_hashes)
    assert kind == ("DIGEST" if isinstance(e.block_hashes[0], bytes) else "I64" if min(e.block_hashes) < 0 else "U64")
    for name in ("medium", "group_idx", "locality", "ownership"):
        assert got[name] == getattr(e, name), name
    assert set(got) == {"hash_kind", "hash_width", "block_hashes", "medium", "group_idx", "locality", "ownership"}


def check_record(line: dict, batch: EventBatch, version: int, key: bytes, java_fp: dict[int, str]) -> None:
    assert "error" not in line, line.get("error")
    assert line["key"] == key.decode()
    assert [(k, v.encode()) for k, v in line["headers"]] == headers_for(version)
    assert line["writer_fingerprint"] == java_fp[version]
    r = line["record"]
    w = batch.worker
    assert r["worker"] == {
        "instance_id": w.instance_id,
        "model": w.model,
        "dp_rank": w.dp_rank,
        "tp_rank": w.tp_rank,
        "tp_size": w.tp_size,
    }
    for name in ("epoch", "seq", "ts_us", "engine_ts", "reset", "gap"):
        assert r[name] == getattr(batch, name), name
    # A v1 writer has no `source`: Java must resolve it to the v2 default, as the Python codec does.
    assert r["source"] == (batch.source if version >= 2 else "")
    assert len(r["events"]) == len(batch.events)
    for tagged, e in zip(r["events"], batch.events, strict=False):
        ((name, got),) = tagged.items()
        assert name == f"dev.kvwire.{type(e).__name__}"
        if isinstance(e, AllBlocksCleared):
            assert got == {}
        elif isinstance(e, BlockRemoved):
            check_removed(got, e)
        else:
            check_stored(got, e)


# ---------------------------------------------------------------- the tests


def java_fingerprints(schema_dir: Path) -> dict[int, dict]:
    proc = _java("fingerprints", str(schema_dir))
    assert proc.returncode == 0, proc.stderr
    return {d["version"]: d for d in map(json.loads, proc.stdout.splitlines())}


def test_fingerprints_match_java(interop_jar, tmp_path):
    from typer.testing import CliRunner

    from kvwire.cli import app
    from kvwire.schemas_cli import shipped

    java = java_fingerprints(REPO / "schemas" / "avro")
    assert sorted(java) == sorted(VERSIONS)

    res = CliRunner().invoke(app, ["schemas", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    exported = json.loads((tmp_path / "fingerprints.json").read_text())
    assert java_fingerprints(tmp_path) == java  # the exported .avsc files are the same contract
    for s in shipped():
        assert s.fingerprint_hex == java[s.version]["fingerprint"]
        assert s.header.hex() == java[s.version]["header_hex"]
    for v in exported["versions"]:
        assert (v["fingerprint"], v["header"]) == (java[v["version"]]["fingerprint"], java[v["version"]]["header_hex"])
    res = CliRunner().invoke(app, ["schemas"])
    for d in java.values():
        assert f"fingerprint={d['fingerprint']}" in res.output


def test_codec_frames_records_as_java_expects(interop_jar):
    # The single-object header is where byte order goes wrong silently (Python-only round trips
    # still pass); Java's encoder is the reference: C3 01 + parsingFingerprint64, little-endian.
    java = java_fingerprints(REPO / "schemas" / "avro")
    batch = sample_batches()[0][0]
    for v, sv in VERSIONS.items():
        assert encode(batch, version=v)[:10].hex() == java[v]["header_hex"], f"v{v} header"
        assert sv.fingerprint_hex == java[v]["fingerprint"], f"v{v} fingerprint_hex"


def test_java_consumer_decodes_every_record(interop_jar, kafka_bootstrap, new_topic, tmp_path):
    topic = new_topic(partitions=3)
    batches = sample_batches()
    sent = asyncio.run(produce(kafka_bootstrap, topic, batches))
    assert len(sent) == len(batches)
    assert {v for _, v, _ in sent.values()} == {1, 2}

    java_fp = {v: d["fingerprint"] for v, d in java_fingerprints(REPO / "schemas" / "avro").items()}
    proc = _java(
        "consume", kafka_bootstrap, topic, str(REPO / "schemas" / "avro"), str(len(sent)), "120000", timeout=300
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert sorted((d["partition"], d["offset"]) for d in lines) == sorted(sent)
    for line in lines:
        batch, version, key = sent[(line["partition"], line["offset"])]
        check_record(line, batch, version, key, java_fp)


async def _read_all(bootstrap: str, topic: str) -> dict[tuple[int, int], tuple[bytes, bytes]]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        cluster = await consumer._client.fetch_all_metadata()
        tps = [TopicPartition(topic, p) for p in cluster.partitions_for_topic(topic)]
        consumer.assign(tps)
        await seek_to_beginning(consumer, *tps)
        end = await consumer.end_offsets(tps)
        out = {}
        while any([await consumer.position(tp) < end[tp] for tp in tps]):
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                for r in records:
                    out[(r.partition, r.offset)] = (r.key, r.value)
        return out
    finally:
        await consumer.stop()


def test_java_decodes_what_the_kvwire_publisher_wrote(interop_jar, kafka_bootstrap, new_topic):
    # The publisher picks epochs, sequences, headers and framing itself: this proves the real
    # producer path (not just the codec) is readable from Java.
    from kvwire.producer.config import PublisherConfig
    from kvwire.producer.publisher import KafkaPublisher

    topic = new_topic(partitions=2)
    worker = WorkerId("pub-a", dp_rank=1, tp_rank=0, tp_size=2, model="m")
    published = [
        ev
        for ev in (
            (
                stored(
                    U64_BIG,
                    range(12),
                    4,
                    medium="GPU",
                    lora_name="l",
                    extra_keys=(("l", ("img", 0)), None, (DIGEST_A,)),
                ),
            ),
            (
                stored([-1, 2], [5, 6], 1, parent_block_hash=-3, medium="CPU"),
                BlockRemoved([DIGEST_A], medium="STORAGE"),
            ),
            (AllBlocksCleared(),),
        )
    ]
    pub = KafkaPublisher(
        PublisherConfig(bootstrap_servers=kafka_bootstrap, topic=topic, partitions=2, heartbeat_interval_s=3600.0)
    )
    try:
        stream = pub.stream(worker, "simulator")
        for events in published:
            assert stream.publish(events)
    finally:
        pub.close()

    records = asyncio.run(_read_all(kafka_bootstrap, topic))
    proc = _java(
        "consume", kafka_bootstrap, topic, str(REPO / "schemas" / "avro"), str(len(records)), "120000", timeout=300
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    java_fp = {v: d["fingerprint"] for v, d in java_fingerprints(REPO / "schemas" / "avro").items()}
    from kvwire.schemas.codec import CURRENT, decode

    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert not [d for d in lines if "error" in d], next(d["error"] for d in lines if "error" in d)
    lines.sort(key=lambda d: d["record"]["seq"])
    assert sorted((d["partition"], d["offset"]) for d in lines) == sorted(records)
    seen = []
    for line in lines:
        key, value = records[(line["partition"], line["offset"])]
        batch = decode(value)
        check_record(line, batch, CURRENT.version, key, java_fp)
        seen.extend(batch.events)
    assert lines[0]["record"]["reset"] is True
    assert tuple(seen) == tuple(e for events in published for e in events)


# ---------------------------------------------------------------- Confluent framing


def test_java_consumer_reads_confluent_framed_records(interop_jar, kafka_bootstrap, new_topic, schema_registry):  # noqa: F811
    # Both framings and both writer versions interleaved in one topic: Java takes the writer
    # schema of a Confluent-framed record from the registry by its id (plain Apache Avro, no
    # kvwire code) and resolves it to the newest shipped version, as it does for single-object.
    from kvwire.kafka.registry.client import RegistryClient, RegistryConfig, topic_subject
    from kvwire.kafka.registry.shipped import register_shipped

    topic = new_topic(partitions=3)
    ids = dict(register_shipped(RegistryClient(RegistryConfig(schema_registry)), topic_subject(topic)))
    batches = sample_batches()
    framed = [(b, v, ids[v] if i % 2 == 0 else None) for i, (b, v) in enumerate(batches)]
    assert {(v, sid is None) for _, v, sid in framed} == {(1, True), (1, False), (2, True), (2, False)}

    async def produce_framed() -> dict[tuple[int, int], tuple]:
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True)
        await producer.start()
        try:
            sent = {}
            for batch, version, sid in framed:
                key = batch.worker.kafka_key()
                value = encode(batch, version=version, schema_id=sid)
                md = await producer.send_and_wait(topic, value, key=key, headers=headers_for(version))
                sent[(md.partition, md.offset)] = (batch, version, key, sid)
            return sent
        finally:
            await producer.stop()

    sent = asyncio.run(produce_framed())
    java_fp = {v: d["fingerprint"] for v, d in java_fingerprints(REPO / "schemas" / "avro").items()}
    proc = _java(
        "consume-confluent",
        kafka_bootstrap,
        topic,
        str(REPO / "schemas" / "avro"),
        schema_registry,
        str(len(sent)),
        "120000",
        timeout=300,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [json.loads(x) for x in proc.stdout.splitlines()]
    assert sorted((d["partition"], d["offset"]) for d in lines) == sorted(sent)
    for line in lines:
        batch, version, key, sid = sent[(line["partition"], line["offset"])]
        assert line["framing"] == ("single-object" if sid is None else "confluent")
        assert line.get("schema_id") == sid
        # writer_fingerprint of a Confluent record is that of the schema the registry returned
        # for its id: the registry holds exactly the version it was written with
        check_record(line, batch, version, key, java_fp)
