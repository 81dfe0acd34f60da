"""`kvwire tail`: read a kvwire topic as a human (or jq) would, without touching the system.

It never joins a consumer group: partitions are assigned and positions set by hand, so tailing a
production topic commits nothing and triggers no rebalance of the real consumers. Malformed records
are printed with their partition, offset and decode error instead of stopping the tail: they are
exactly what an operator looks for.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dc_field
from datetime import UTC, datetime, timedelta
from typing import IO, Any

import typer

from kvwire.cli_failure import BadSetting, kafka_client_options, one_line, reaching_kafka
from kvwire.cli_options import DEFAULT_TOPIC, Bootstrap, KafkaConfig, Topic
from kvwire.kafka.options import consumer_options
from kvwire.kafka.positions import seek_to_beginning, seek_to_end

app = typer.Typer(help="Print decoded kvwire batches from a topic (no consumer group).")

_EPOCH0 = datetime(1970, 1, 1, tzinfo=UTC)
_U64 = (1 << 64) - 1
_EVENT_LABEL = {"BlockStored": "STORED", "BlockRemoved": "REMOVED", "AllBlocksCleared": "CLEARED"}


@dataclass(frozen=True)
class TailOptions:
    bootstrap_servers: str
    topic: str
    start: str = "latest"  # "earliest", "latest" or an ISO-8601 time
    worker: str | None = None
    partition: int | None = None
    as_json: bool = False
    max_records: int | None = None
    timeout_s: float | None = None  # stop after this long without a new record
    # aiokafka security/client options (kvwire.kafka.options); a ClientOptions keeps the repr redacted.
    client_options: Mapping[str, Any] = dc_field(default_factory=dict)
    # Resolves Confluent-framed records' schema ids (None: $KVWIRE_SCHEMA_REGISTRY_URL).
    schema_registry_url: str | None = None


class TailError(BadSetting):
    """A usage or setup problem (unknown topic, bad --from): reported, never a traceback."""


# ---------------------------------------------------------------- start position


def parse_start(value: str) -> str | int:
    """'earliest' / 'latest', or an ISO time -> epoch milliseconds (no offset given = UTC)."""
    v = value.strip().lower()
    if v in ("earliest", "latest"):
        return v
    try:
        t = datetime.fromisoformat(value.strip())
    except ValueError:
        raise TailError(f"--from must be earliest, latest or an ISO-8601 time, not {value!r}") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return int(t.timestamp() * 1000)


# ---------------------------------------------------------------- worker filter


def worker_matches(wanted: str | None, instance_id: str, dp_rank: int) -> bool:
    """`--worker` is an instance_id (all its DP ranks) or `instance_id/dp_rank` (the Kafka key)."""
    return wanted is None or wanted == instance_id or wanted == f"{instance_id}/{dp_rank}"


def key_matches(wanted: str | None, key: bytes | None) -> bool:
    # A malformed record has no decoded worker; its key is the only attribution there is.
    if wanted is None:
        return True
    if key is None:
        return False
    k = key.decode("utf-8", "replace")
    return wanted == k or wanted == k.rsplit("/", 1)[0]


# ---------------------------------------------------------------- rendering


def _iso_us(ts_us: int) -> str:
    try:
        return (_EPOCH0 + timedelta(microseconds=ts_us)).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    except (OverflowError, ValueError):  # a producer clock gone wild must not kill the tail
        return f"ts_us={ts_us}"


def _hash_text(h) -> str:
    return h.hex() if isinstance(h, (bytes, bytearray)) else str(h)


def _short(h) -> str:
    s = _hash_text(h)
    return s if len(s) <= 20 else s[:16] + "…"


def _json_value(v: Any) -> Any:
    # Bytes are tagged so a digest and a string extra key stay distinguishable in JSON.
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"bytes": bytes(v).hex()}
    if isinstance(v, (tuple, list)):
        return [_json_value(x) for x in v]
    return v


def _hashes_json(hashes) -> Any:
    return [h.hex() if isinstance(h, (bytes, bytearray)) else h for h in hashes]


def event_json(e) -> dict:
    name = type(e).__name__
    if name == "AllBlocksCleared":
        return {"type": name}
    d: dict[str, Any] = {"type": name}
    # Declared order reads best; msgspec Structs list it in __struct_fields__ (__slots__ is sorted).
    for field in getattr(type(e), "__struct_fields__", None) or type(e).__slots__:
        v = getattr(e, field)
        if field == "block_hashes":
            d[field] = _hashes_json(v)
        elif field == "parent_block_hash":
            d[field] = None if v is None else _hashes_json([v])[0]
        elif field == "token_ids":
            d[field] = v.tolist()
        else:
            d[field] = _json_value(v)
    return d


def batch_json(batch) -> dict:
    w = batch.worker
    return {
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
        "source": batch.source,
        "heartbeat": batch.is_heartbeat,
        "events": [event_json(e) for e in batch.events],
    }


def _event_text(e) -> str:
    label = _EVENT_LABEL.get(type(e).__name__, type(e).__name__)
    if label == "CLEARED":
        return label
    hashes = e.block_hashes
    parts = [label, f"n={len(hashes)}", e.medium or "-"]
    if hashes:
        parts.append("first=" + _short(hashes[0]) + ("…" if len(hashes) > 1 else ""))
    if label == "STORED":
        parts.append(f"bs={e.block_size}")
        if e.parent_block_hash is not None:
            parts.append("parent=" + _short(e.parent_block_hash))
        if e.lora_name is not None or e.lora_id is not None:
            parts.append(f"lora={e.lora_name if e.lora_name is not None else e.lora_id}")
    if e.group_idx is not None:
        parts.append(f"group={e.group_idx}")
    return " ".join(parts)


def batch_lines(partition: int, offset: int, batch) -> list[str]:
    """One line per event; an event-less batch still gets one line (heartbeat/reset/gap)."""
    w = batch.worker
    # Eight hex digits tell incarnations apart at a glance; --json has the full value.
    epoch = f"{batch.epoch & _U64:016x}"[:8]
    head = (
        f"{_iso_us(batch.ts_us)} {partition}@{offset} {w.instance_id}/{w.dp_rank} "
        f"tp{w.tp_rank}/{w.tp_size} epoch={epoch} seq={batch.seq}"
    )
    flags = ("" if not batch.reset else " reset") + ("" if not batch.gap else f" gap={batch.gap}")
    if not batch.events:
        what = "HEARTBEAT" if batch.is_heartbeat else ("RESET" if batch.reset else "GAP")
        return [f"{head} {what}{flags}"]
    return [f"{head} {_event_text(e)}{flags}" for e in batch.events]


def malformed_line(partition: int, offset: int, ts_ms: int | None, key: bytes | None, error: str) -> str:
    when = _iso_us(ts_ms * 1000) if ts_ms is not None and ts_ms >= 0 else "-"
    k = "-" if key is None else key.decode("utf-8", "replace")
    return f"{when} {partition}@{offset} MALFORMED key={k} error={error}"


def render(rec, opts: TailOptions) -> list[str]:
    """Lines to print for one Kafka record ([] when filtered out). Never raises."""
    from kvwire.schemas.codec import DecodeError, confluent_id, decode, framing, writer_version

    base = {
        "partition": rec.partition,
        "offset": rec.offset,
        "timestamp_ms": rec.timestamp,
        "key": None if rec.key is None else rec.key.decode("utf-8", "replace"),
    }
    try:
        batch = decode(rec.value)
        schema_version = writer_version(rec.value).version
    except DecodeError as e:
        error = e.reason
    except Exception as e:  # decode promises DecodeError only; a tail still must not die on a bug
        error = f"{type(e).__name__}: {e}"
    else:
        if not worker_matches(opts.worker, batch.worker.instance_id, batch.worker.dp_rank):
            return []
        try:
            if opts.as_json:
                wire = {"framing": framing(rec.value), "schema_id": confluent_id(rec.value)}
                return [json.dumps({**base, "schema_version": schema_version, **wire, "batch": batch_json(batch)})]
            return batch_lines(rec.partition, rec.offset, batch)
        except Exception as e:
            error = f"cannot render: {type(e).__name__}: {e}"
    if not key_matches(opts.worker, rec.key):
        return []
    if opts.as_json:
        return [json.dumps({**base, "error": error, "size": None if rec.value is None else len(rec.value)})]
    return [malformed_line(rec.partition, rec.offset, rec.timestamp, rec.key, error)]


# ---------------------------------------------------------------- consuming


async def _position(consumer, tps, start: str | int) -> None:
    if start == "earliest":
        await seek_to_beginning(consumer, *tps)
    elif start == "latest":
        await seek_to_end(consumer, *tps)
    else:
        found = await consumer.offsets_for_times({tp: start for tp in tps})
        late = []
        for tp in tps:
            ot = found.get(tp)
            if ot is None:  # nothing at or after that time yet: only new records
                late.append(tp)
            else:
                consumer.seek(tp, ot.offset)
        if late:
            await seek_to_end(consumer, *late)


# How long records known to exist may fail to arrive before --timeout stops anyway (broker gone).
_BACKLOG_STALL_S = 60.0


async def run_tail(opts: TailOptions, out: IO[str]) -> int:
    """Prints records until --max-records or --timeout (idle); returns how many were printed."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    start = parse_start(opts.start)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=opts.bootstrap_servers,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if start == "earliest" else "latest",
        **consumer_options({"client_id": "kvwire-tail", **opts.client_options}),
    )
    try:
        await consumer.start()  # in the try: a client whose start failed must still be stopped
        # A group-less consumer has no topic metadata yet, and consumer.topics() fetches it without
        # keeping it; one explicit fetch also answers "no such topic" at once instead of retrying.
        cluster = await consumer._client.fetch_all_metadata()
        partitions = cluster.partitions_for_topic(opts.topic)
        if not partitions:
            raise TailError(f"topic {opts.topic!r} does not exist on {opts.bootstrap_servers}")
        if opts.partition is not None:
            if opts.partition not in partitions:
                raise TailError(f"topic {opts.topic!r} has no partition {opts.partition}")
            partitions = {opts.partition}
        tps = [TopicPartition(opts.topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await _position(consumer, tps, start)

        from kvwire.kafka.registry.client import RegistryError
        from kvwire.kafka.registry.resolver import IdResolver

        try:
            ids = IdResolver.from_env(opts.schema_registry_url)
        except ValueError as e:
            raise TailError(str(e)) from None
        loop = asyncio.get_running_loop()
        printed = 0
        # --timeout counts idle time once the records that existed at the start have been read:
        # a slow first fetch (a loaded machine, a broker in a container) is not "nothing more".
        backlog = await consumer.end_offsets(tps)
        stalled_since = loop.time()
        idle_until = None if opts.timeout_s is None else loop.time() + opts.timeout_s
        while opts.max_records is None or printed < opts.max_records:
            wait = 1.0 if idle_until is None else max(0.0, min(1.0, idle_until - loop.time()))
            got = await consumer.getmany(timeout_ms=int(wait * 1000), max_records=500)
            try:  # registry ids of Confluent-framed records, fetched before decoding
                await ids.prefetch_retrying((r.value for rs in got.values() for r in rs), deadline_s=30.0)
            except RegistryError as e:
                raise TailError(f"schema registry: {e}") from None
            for records in got.values():
                for rec in records:
                    lines = render(rec, opts)
                    if not lines:
                        continue
                    out.write("\n".join(lines) + "\n")
                    printed += 1
                    if opts.max_records is not None and printed >= opts.max_records:
                        break
                if opts.max_records is not None and printed >= opts.max_records:
                    break
            out.flush()
            if got:
                stalled_since = loop.time()
                if opts.timeout_s is not None:
                    idle_until = loop.time() + opts.timeout_s
            elif idle_until is not None and loop.time() >= idle_until:
                behind = [tp for tp in tps if await consumer.position(tp) < backlog[tp]]
                if not behind or loop.time() - stalled_since > max(_BACKLOG_STALL_S, opts.timeout_s or 0):
                    break
                idle_until = loop.time() + min(1.0, opts.timeout_s or 1.0)
        return printed
    finally:
        await consumer.stop()


@app.callback(invoke_without_command=True)
def tail(
    bootstrap_servers: Bootstrap,
    topic: Topic = DEFAULT_TOPIC,
    start: str = typer.Option(
        "latest",
        "--from",
        help="earliest, latest, or an ISO-8601 time: start at each partition's first record stamped at or after it (UTC if no offset)",
    ),
    worker: str | None = typer.Option(None, "--worker", help="instance_id, or instance_id/dp_rank"),
    partition: int | None = typer.Option(None, "--partition"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per record"),
    max_records: int | None = typer.Option(None, "--max-records", min=1),
    timeout: float | None = typer.Option(None, "--timeout", help="stop after S seconds without a record"),
    kafka_config: KafkaConfig = None,
    schema_registry_url: str | None = typer.Option(
        None,
        "--schema-registry-url",
        envvar="KVWIRE_SCHEMA_REGISTRY_URL",
        help="schema registry (Confluent API) for Confluent-framed records",
    ),
) -> None:
    """Print decoded kvwire batches: one line per event, or JSON lines with --json."""
    with one_line("tail"):
        opts = TailOptions(
            bootstrap_servers,
            topic,
            start=start,
            worker=worker,
            partition=partition,
            as_json=as_json,
            max_records=max_records,
            timeout_s=timeout,
            client_options=kafka_client_options(kafka_config),
            schema_registry_url=schema_registry_url,
        )
        parse_start(start)  # fail on a bad --from before connecting
        try:
            with reaching_kafka(bootstrap_servers):
                asyncio.run(run_tail(opts, sys.stdout))
        except BrokenPipeError:  # `kvwire tail ... | head` is normal use
            raise typer.Exit(0) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None


if __name__ == "__main__":
    app()
