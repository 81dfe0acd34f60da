"""`kvwire tail` against a real broker: what it prints equals what was produced, malformed records
are shown (partition, offset, error) without stopping it, and --worker/--partition/--from filter.

Runs the real entry point in a subprocess (`python -m kvwire.cli tail ...`). Runs that must show
"nothing more" end by --timeout (idle seconds), which is a stop condition, not a timed assertion.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime

import pytest
from kafka_admin import create_topics, delete_topics

from kvwire.kafka.broker.probe import run_sync
from kvwire.schemas.codec import CONTENT_TYPE, CURRENT, VERSIONS, encode
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, EventBatch, WorkerId, stored

pytestmark = pytest.mark.integration

T_OLD_MS = 1_700_000_000_000  # 2023-11-14T22:13:20Z
T_NEW_MS = 1_710_000_000_000  # 2024-03-09T16:00:00Z
BETWEEN = "2024-01-01T00:00:00+00:00"

A0 = WorkerId("inst-a", dp_rank=0, tp_rank=1, tp_size=2, model="m")
A1 = WorkerId("inst-a", dp_rank=1)
B0 = WorkerId("inst-b", dp_rank=0)
EPOCH = 0xDEADBEEF_00000001 - (1 << 64)  # Avro long: epochs are signed 64-bit
DIGEST = bytes(range(32))

GOOD = [  # (partition, kafka timestamp, batch, writer version)
    (
        0,
        T_OLD_MS,
        EventBatch(
            A0,
            EPOCH,
            0,
            1_700_000_000_000_000,
            (
                stored(
                    [(1 << 64) - 1, 1 << 63],
                    range(8),
                    4,
                    medium="GPU",
                    lora_name="lora-1",
                    extra_keys=(("lora-1", ("img", 3)), None),
                ),
            ),
            reset=True,
            source="simulator",
        ),
        2,
    ),
    (0, T_OLD_MS, EventBatch(A0, EPOCH, 1, 1_700_000_000_000_001, (), source="simulator"), 2),
    (
        1,
        T_OLD_MS,
        EventBatch(
            A1, -5, 0, 1_700_000_000_000_002, (stored([-3, 4], [1, 2], 1, parent_block_hash=-9, medium="CPU"),), gap=2
        ),
        1,
    ),
    (
        0,
        T_NEW_MS,
        EventBatch(
            A0,
            EPOCH,
            2,
            1_710_000_000_000_000,
            (
                BlockRemoved([1 << 63], medium="GPU"),
                AllBlocksCleared(),
                stored(
                    [DIGEST],
                    range(16),
                    16,
                    parent_block_hash=bytes(32),
                    medium="STORAGE",
                    extra_keys=((DIGEST, "salt"),),
                ),
            ),
            engine_ts=1.25,
            source="simulator",
        ),
        2,
    ),
    (1, T_NEW_MS, EventBatch(B0, 77, 0, 1_710_000_000_000_001, (AllBlocksCleared(),), reset=True), 2),
]
BAD = [  # (partition, kafka timestamp, key, value, error text tail prints)
    (0, T_OLD_MS, b"inst-a/0", b"\x01\x01not-an-avro-record", "bad magic"),
    (1, T_NEW_MS, b"inst-b/0", b"\xc3\x01" + b"\xff" * 8 + b"\x02", "unknown schema fingerprint"),
    (1, T_NEW_MS, b"inst-a/1", CURRENT.header + b"\x02", "invalid Avro body"),
    (0, T_NEW_MS, b"inst-a/0", None, "tombstone"),
    # Confluent framing (00 + id) and no schema registry configured: says what to configure
    (0, T_NEW_MS, b"inst-a/0", b"\x00\x00\x00\x00\x07not-an-avro-record", "no schema registry was asked"),
]


async def _produce(bootstrap: str, topic: str):
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    await producer.start()
    good, bad = {}, {}
    try:
        # Interleave so malformed records sit between good ones in both partitions.
        for i in range(max(len(GOOD), len(BAD))):
            if i < len(GOOD):
                p, ts, batch, v = GOOD[i]
                sv = VERSIONS[v]
                md = await producer.send_and_wait(
                    topic,
                    encode(batch, version=v),
                    key=batch.worker.kafka_key(),
                    partition=p,
                    timestamp_ms=ts,
                    headers=[
                        ("content-type", CONTENT_TYPE.encode()),
                        ("schema", sv.name.encode()),
                        ("fingerprint", sv.fingerprint_hex.encode()),
                    ],
                )
                good[(md.partition, md.offset)] = (ts, batch, v)
            if i < len(BAD):
                p, ts, key, value, err = BAD[i]
                md = await producer.send_and_wait(topic, value, key=key, partition=p, timestamp_ms=ts)
                bad[(md.partition, md.offset)] = (ts, key, err)
    finally:
        await producer.stop()
    return good, bad


@pytest.fixture(scope="module")
def loaded(kafka_bootstrap):
    topic = f"t-tail-{uuid.uuid4().hex[:8]}"
    # The records are stamped in 2023 and 2024 on purpose (--from TIME): under the broker's default
    # 7-day time retention its next retention check deletes them, which emptied this topic part-way
    # through the module whenever a check fell inside it (seen on fresh container brokers, whose
    # first check runs 30 s after start). Keep them for good.
    run_sync(lambda: create_topics(kafka_bootstrap, [topic], 2, {"retention.ms": "-1"}))
    good, bad = asyncio.run(_produce(kafka_bootstrap, topic))
    yield kafka_bootstrap, topic, good, bad
    try:
        run_sync(lambda: delete_topics(kafka_bootstrap, [topic]))
    except Exception:
        pass


def tail(bootstrap: str, topic: str, *args: str) -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvwire.cli", "tail", "--bootstrap-servers", bootstrap, "--topic", topic, *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def expected_event(e) -> dict:
    # Written independently of kvwire.tail: ints stay ints, digests are hex, bytes in extra keys
    # are {"bytes": hex} so they cannot be mistaken for strings.
    if isinstance(e, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}

    def h(x):
        return x.hex() if isinstance(x, bytes) else x

    def extra(v):
        if isinstance(v, bytes):
            return {"bytes": v.hex()}
        if isinstance(v, tuple):
            return [extra(x) for x in v]
        return v

    if isinstance(e, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [h(x) for x in e.block_hashes],
            "medium": e.medium,
            "group_idx": e.group_idx,
            "locality": e.locality,
            "ownership": e.ownership,
        }
    return {
        "type": "BlockStored",
        "block_hashes": [h(x) for x in e.block_hashes],
        "parent_block_hash": None if e.parent_block_hash is None else h(e.parent_block_hash),
        "token_ids": e.token_ids.tolist(),
        "block_size": e.block_size,
        "lora_id": e.lora_id,
        "medium": e.medium,
        "lora_name": e.lora_name,
        "extra_keys": None if e.extra_keys is None else [extra(b) for b in e.extra_keys],
        "group_idx": e.group_idx,
        "kv_cache_spec_kind": e.kv_cache_spec_kind,
        "kv_cache_spec_sliding_window": e.kv_cache_spec_sliding_window,
        "locality": e.locality,
        "ownership": e.ownership,
        "session_id": e.session_id,
    }


def expected_json(pos, ts, batch: EventBatch, version: int) -> dict:
    w = batch.worker
    return {
        "partition": pos[0],
        "offset": pos[1],
        "timestamp_ms": ts,
        "key": w.kafka_key().decode(),
        "schema_version": version,
        # every record here is single-object; tests/registry covers Confluent-framed ones
        "framing": "single-object",
        "schema_id": None,
        "batch": {
            "worker": {
                "instance_id": w.instance_id,
                "dp_rank": w.dp_rank,
                "tp_rank": w.tp_rank,
                "tp_size": w.tp_size,
                "model": w.model,
            },
            "epoch": batch.epoch,
            "seq": batch.seq,
            "ts_us": batch.ts_us,
            "engine_ts": batch.engine_ts,
            "reset": batch.reset,
            "gap": batch.gap,
            "source": batch.source if version >= 2 else "",
            "heartbeat": not batch.events and not batch.reset and not batch.gap,
            "events": [expected_event(e) for e in batch.events],
        },
    }


def by_position(lines: list[str]) -> dict:
    out = {}
    for line in lines:
        d = json.loads(line)
        out[(d["partition"], d["offset"])] = d
    return out


def test_json_equals_what_was_produced(loaded):
    bootstrap, topic, good, bad = loaded
    lines = tail(bootstrap, topic, "--from", "earliest", "--json", "--timeout", "3")
    got = by_position(lines)
    assert len(lines) == len(got) == len(good) + len(bad)
    for pos, (ts, batch, v) in good.items():
        assert got[pos] == expected_json(pos, ts, batch, v)
    for pos, (bad_ts, key, err) in bad.items():
        d = got[pos]
        assert d["key"] == key.decode() and d["timestamp_ms"] == bad_ts
        assert err in d["error"], d
        assert "batch" not in d


def test_text_lines(loaded):
    bootstrap, topic, good, bad = loaded
    lines = tail(bootstrap, topic, "--from", "earliest", "--timeout", "3")
    per_pos: dict[tuple[int, int], list[str]] = {}
    for line in lines:
        where = line.split()[1]
        p, o = where.split("@")
        per_pos.setdefault((int(p), int(o)), []).append(line)
    assert set(per_pos) == set(good) | set(bad)

    a0_new = next(pos for pos, (_, b, _) in good.items() if b.worker == A0 and b.seq == 2)
    removed, cleared, digests = per_pos[a0_new]  # one line per event, in order
    assert removed.startswith("2024-03-09T16:00:00.000Z 0@")
    assert " inst-a/0 tp1/2 epoch=deadbeef seq=2 REMOVED n=1 GPU first=9223372036854775808" in removed
    assert cleared.endswith(" seq=2 CLEARED")
    assert f"STORED n=1 STORAGE first={DIGEST.hex()[:16]}… bs=16 parent={bytes(8).hex()}" in digests

    a0_first = next(pos for pos, (_, b, _) in good.items() if b.worker == A0 and b.seq == 0)
    (line,) = per_pos[a0_first]
    assert f"STORED n=2 GPU first={(1 << 64) - 1}… bs=4 lora=lora-1 reset" in line
    hb = next(pos for pos, (_, b, _) in good.items() if b.worker == A0 and b.seq == 1)
    assert per_pos[hb][0].endswith(" seq=1 HEARTBEAT")
    gap = next(pos for pos, (_, b, _) in good.items() if b.worker == A1)
    assert per_pos[gap][0].endswith("STORED n=2 CPU first=-3… bs=1 parent=-9 gap=2")
    assert "epoch=ffffffff" in per_pos[gap][0]  # negative epochs shown as their 64-bit pattern

    for pos, (_ts, key, err) in bad.items():
        (line,) = per_pos[pos]
        assert f" {pos[0]}@{pos[1]} MALFORMED key={key.decode()} error=" in line
        assert err in line


def _positions(lines):
    return set(by_position(lines))


def test_worker_filter(loaded):
    bootstrap, topic, good, bad = loaded
    inst_a = _positions(tail(bootstrap, topic, "--from", "earliest", "--json", "--timeout", "3", "--worker", "inst-a"))
    assert inst_a == (
        {pos for pos, (_, b, _) in good.items() if b.worker.instance_id == "inst-a"}
        | {pos for pos, (_, k, _) in bad.items() if k.startswith(b"inst-a/")}
    )
    a1 = _positions(tail(bootstrap, topic, "--from", "earliest", "--json", "--timeout", "3", "--worker", "inst-a/1"))
    assert a1 == (
        {pos for pos, (_, b, _) in good.items() if b.worker == A1}
        | {pos for pos, (_, k, _) in bad.items() if k == b"inst-a/1"}
    )


def test_partition_from_time_and_max_records(loaded):
    bootstrap, topic, good, bad = loaded
    everything = set(good) | set(bad)
    p1 = _positions(tail(bootstrap, topic, "--from", "earliest", "--json", "--timeout", "3", "--partition", "1"))
    assert p1 == {pos for pos in everything if pos[0] == 1}

    since = _positions(tail(bootstrap, topic, "--from", BETWEEN, "--json", "--timeout", "3"))
    new_ms = int(datetime.fromisoformat(BETWEEN).astimezone(UTC).timestamp() * 1000)
    # --from TIME is a start position (Kafka's offsets_for_times), not a filter: an older-stamped
    # record after the first newer one is still shown, as partition 1 has here.
    stamps = {pos: ts for pos, (ts, *_) in [*good.items(), *bad.items()]}
    first = {p: min(o for (q, o), ts in stamps.items() if q == p and ts >= new_ms) for p in (0, 1)}
    assert since == {(p, o) for (p, o) in stamps if o >= first[p]}
    assert any(stamps[pos] < new_ms for pos in since)

    two = tail(bootstrap, topic, "--from", "earliest", "--json", "--max-records", "2", "--partition", "0")
    assert [(d["partition"], d["offset"]) for d in map(json.loads, two)] == [(0, 0), (0, 1)]

    assert tail(bootstrap, topic, "--from", "latest", "--timeout", "2") == []


def test_usage_errors_are_reported_not_raised(loaded):
    bootstrap, topic, _, _ = loaded
    for args in (["--from", "yesterday"], ["--partition", "9"]):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvwire.cli",
                "tail",
                "--bootstrap-servers",
                bootstrap,
                "--topic",
                topic,
                "--timeout",
                "1",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and "kvwire tail:" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvwire.cli",
            "tail",
            "--bootstrap-servers",
            bootstrap,
            "--topic",
            f"missing-{uuid.uuid4().hex[:6]}",
            "--timeout",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr
