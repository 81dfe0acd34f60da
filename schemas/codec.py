"""Avro codec for :class:`~schemas.events.EventBatch`, in both wire framings.

- **Single-object** (the default): ``C3 01`` + the 8-byte little-endian
  CRC-64-AVRO fingerprint of the writer schema's canonical form + the Avro
  body. The record names its own schema: no registry needed.
- **Confluent**: ``00`` + a 4-byte big-endian schema-registry id + the Avro
  body: what Kafka Connect's AvroConverter, ksqlDB and Confluent's/Apicurio's
  serdes read. The id means something only to the registry that issued it, so
  decoding needs :class:`SchemaIds`, a synchronous cache the consumer fills
  from the registry *before* it decodes (decode itself never does I/O).

The first byte tells the framings apart (``C3`` vs ``00``), so a topic may mix
them. The codec knows every schema version shipped in ``schemas/avro`` and
resolves an older (or registry-supplied) writer to the current reader
(compatibility rule: FULL, see README).

Resolution is done here, not by fastavro: the writer's own schema decodes the
body and :func:`_resolution_plan` then adds the reader's defaults and drops
fields the reader lacks. fastavro's resolver maps a writer ``bytes`` inside a
union to the reader union's first *promotable* branch, ``string``, and so
fails (or silently turns bytes into text) for ``extra_keys`` written by v1.

Hashes and token ids travel packed in ``bytes`` (see the .avsc docs): this is
the bulk of every record and decodes several times faster than arrays.
"""

from __future__ import annotations

import copy
import io
import json
import re
import struct
import sys
import threading
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from kvwire import _core

from .events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    WorkerId,
)

MAGIC = b"\xc3\x01"
HEADER_SIZE = 10
CONFLUENT_MAGIC = b"\x00"
CONFLUENT_HEADER_SIZE = 5
SINGLE_OBJECT = "single-object"
CONFLUENT = "confluent"
FRAMINGS = (SINGLE_OBJECT, CONFLUENT)
# Kafka's default max.message.bytes is 1 MiB; anything far beyond is hostile.
MAX_RECORD_BYTES = 64 * 1024 * 1024
CONTENT_TYPE = "application/vnd.apache.avro+single-object"
# Informational like every header: Confluent's tools never read it, they read the id in the value.
CONFLUENT_CONTENT_TYPE = "application/vnd.apache.avro+confluent"
RECORD_NAME = "dev.kvwire.EventBatch"
NAMESPACE = "dev.kvwire"
_STORED = f"{NAMESPACE}.BlockStored"
_REMOVED = f"{NAMESPACE}.BlockRemoved"
_CLEARED = f"{NAMESPACE}.AllBlocksCleared"
# The events union's branch names, in the union's order, as batch_to_record tags events
# (fastavro's tuple notation). The core's encoder reads them from here.
EVENT_BRANCHES = (_STORED, _REMOVED, _CLEARED)
_BIG_ENDIAN = sys.byteorder == "big"
_U64_MAX = (1 << 64) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


class CodecError(ValueError):
    """Base of the codec's errors."""


class EncodeError(CodecError):
    """An event cannot be represented losslessly in the contract."""


class DecodeError(CodecError):
    """Bytes that are not a valid kvwire record. ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class SchemaVersion:
    """A writer or reader schema. ``version`` is 0 for a schema the registry holds that kvwire
    does not ship (a newer producer's): records written with it still resolve to the reader."""

    version: int
    raw: dict[str, Any]
    parsed: Any
    canonical: str
    fingerprint: bytes  # 8 bytes, little-endian as framed on the wire

    @property
    def fingerprint_hex(self) -> str:
        """CRC-64-AVRO as the big-endian hex fastavro and Java print."""
        return self.fingerprint[::-1].hex()

    @property
    def header(self) -> bytes:
        return MAGIC + self.fingerprint

    @property
    def name(self) -> str:
        return f"{NAMESPACE}.EventBatch/v{self.version}"

    @property
    def registry_text(self) -> str:
        """The schema as registered: one text everywhere, so every registration of a version
        (``kvwire schemas --register``, a producer, a Confluent serializer) gets the same id."""
        return json.dumps(self.raw, separators=(",", ":"))


def schema_version(raw: dict[str, Any], version: int = 0) -> SchemaVersion:
    canonical = to_parsing_canonical_form(raw)
    # fastavro's hex already lists the fingerprint's little-endian bytes,
    # which is the order single-object encoding puts on the wire.
    fp = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
    return SchemaVersion(version, raw, fastavro.parse_schema(raw), canonical, fp)


def _load_versions() -> dict[int, SchemaVersion]:
    out: dict[int, SchemaVersion] = {}
    for entry in resources.files(__package__).joinpath("avro").iterdir():
        m = re.fullmatch(r"event_batch\.v(\d+)\.avsc", entry.name)
        if not m:
            continue
        out[int(m.group(1))] = schema_version(json.loads(entry.read_text()), int(m.group(1)))
    if not out:
        raise RuntimeError("no schemas shipped in schemas/avro")
    return dict(sorted(out.items()))


VERSIONS: dict[int, SchemaVersion] = _load_versions()
BY_FINGERPRINT: dict[bytes, SchemaVersion] = {v.fingerprint: v for v in VERSIONS.values()}
CURRENT: SchemaVersion = VERSIONS[max(VERSIONS)]


def _full_name(raw: dict[str, Any]) -> str:
    name = str(raw.get("name", ""))
    return name if "." in name or not raw.get("namespace") else f"{raw['namespace']}.{name}"


class SchemaIds:
    """Schema-registry id -> writer schema, for decoding Confluent-framed records.

    A synchronous cache so that decode stays pure CPU: the consumer scans each poll for ids it
    lacks and fills them from the registry (``kvwire.kafka.registry.resolver``) *before* it decodes.
    An id the registry answered "unknown" (or that names a non-kvwire schema) is remembered with
    the reason, which becomes the record's dead-letter reason. Ids are one registry's numbering:
    one cache per registry (the process-wide :data:`SCHEMA_IDS` for the usual single one)."""

    MAX_REFUSED = 10_000  # hostile ids must not grow memory without bound

    def __init__(self) -> None:
        self._schemas: dict[int, SchemaVersion] = {}
        self._refused: dict[int, str] = {}
        # id -> shipped version, for the core's fast decoder (it knows only the shipped versions)
        self._shipped: dict[int, int] = {}
        self._lock = threading.Lock()

    def get(self, schema_id: int) -> SchemaVersion | None:
        return self._schemas.get(schema_id)

    def shipped(self) -> dict[int, int]:
        """{id: version} of the ids that name a schema kvwire ships: the Rust decoder reads
        records of these ids itself; any other id's records take the reference decoder here."""
        return self._shipped

    def refusal(self, schema_id: int) -> str | None:
        return self._refused.get(schema_id)

    def known(self, schema_id: int) -> bool:
        return schema_id in self._schemas or schema_id in self._refused

    def add(self, schema_id: int, schema: str | dict[str, Any]) -> SchemaVersion:
        """Cache what the registry holds under ``schema_id``. A shipped version maps to its
        own :class:`SchemaVersion` (same object as ``VERSIONS[n]``). Raises CodecError for a
        schema that is not a kvwire EventBatch or cannot be parsed."""
        try:
            raw = json.loads(schema) if isinstance(schema, str) else schema
            if not isinstance(raw, dict) or _full_name(raw) != RECORD_NAME:
                name = _full_name(raw) if isinstance(raw, dict) else type(raw).__name__
                raise CodecError(f"schema id {schema_id} is {name!r}, not {RECORD_NAME}")
            sv = schema_version(raw)
        except CodecError:
            raise
        except Exception as e:
            raise CodecError(f"schema id {schema_id}: unusable schema: {type(e).__name__}: {e}") from None
        sv = BY_FINGERPRINT.get(sv.fingerprint, sv)
        with self._lock:
            old = self._schemas.get(schema_id)
            if old is not None and old.fingerprint != sv.fingerprint:
                raise CodecError(f"schema id {schema_id} already names another schema: one cache per registry")
            self._schemas[schema_id] = sv
            if sv.version:
                self._shipped[schema_id] = sv.version
            self._refused.pop(schema_id, None)
        return sv

    def refuse(self, schema_id: int, reason: str) -> None:
        with self._lock:
            if len(self._refused) >= self.MAX_REFUSED:
                self._refused.pop(next(iter(self._refused)))
            self._refused[schema_id] = reason

    def missing(self, values: Iterable[bytes | None]) -> set[int]:
        """Ids named by Confluent-framed values that this cache cannot answer yet."""
        out: set[int] = set()
        for v in values:
            if v is not None and len(v) >= CONFLUENT_HEADER_SIZE and v[0] == 0:
                sid = int.from_bytes(v[1:CONFLUENT_HEADER_SIZE], "big")
                if sid not in self._schemas and sid not in self._refused:
                    out.add(sid)
        return out

    def clear(self) -> None:
        with self._lock:
            self._schemas.clear()
            self._refused.clear()
            self._shipped.clear()


# The process-wide cache codec.decode() and the consumer's Applier use by default, so the
# consumer's prefetch (kvwire.kafka.registry.resolver) lands here.
SCHEMA_IDS = SchemaIds()

# ---------------------------------------------------------------- hashes


def pack_hashes(hashes: tuple[BlockHash, ...], parent: BlockHash | None = None) -> tuple[str, int, bytes, bytes | None]:
    """-> (kind, width, packed, packed_parent). Lossless for all three forms."""
    n = len(hashes)
    # The common vLLM case, non-negative ints below 2^64, is the core's (the encoder's fast path
    # packs them the same way): U64 whenever it takes them.
    u64 = _core.pack_u64(hashes, parent)
    if u64 is not None:
        return "U64", 8, u64[0], u64[1]
    values = hashes if parent is None else (*hashes, parent)
    ints = [h for h in values if type(h) is int]
    if len(ints) == len(values):
        if all(_I64_MIN <= h <= _I64_MAX for h in ints):
            kind, fmt = "I64", "q"
        elif all(0 <= h <= _U64_MAX for h in ints):
            kind, fmt = "U64", "Q"
        else:
            raise EncodeError("int block hashes must all fit in uint64 or all in int64")
        return (
            kind,
            8,
            struct.pack(f"<{n}{fmt}", *hashes),
            None if parent is None else struct.pack(f"<{fmt}", parent),
        )
    digests = [h for h in values if isinstance(h, (bytes, bytearray, memoryview))]
    if len(digests) == len(values):
        width = len(digests[0])
        if width == 0 or any(len(h) != width for h in digests):
            raise EncodeError("digest block hashes must be non-empty and of one size")
        return (
            "DIGEST",
            width,
            b"".join(bytes(h) for h in digests[:n]),
            None if parent is None else bytes(digests[-1]),
        )
    raise EncodeError("block hashes must be all ints or all bytes within one event")


def unpack_hashes(kind: str, width: int, data: bytes) -> tuple[BlockHash, ...]:
    if kind == "DIGEST":
        if width <= 0 or len(data) % width:
            raise DecodeError(f"digest hashes: {len(data)} bytes is not a multiple of {width}")
        return tuple(data[i : i + width] for i in range(0, len(data), width))
    if width != 8 or len(data) % 8:
        raise DecodeError(f"{kind} hashes: width {width}, {len(data)} bytes")
    return struct.unpack(f"<{len(data) // 8}{'Q' if kind == 'U64' else 'q'}", data)


def _unpack_one(kind: str, width: int, data: bytes | None) -> BlockHash | None:
    if data is None:
        return None
    if (kind != "DIGEST" and len(data) != 8) or (kind == "DIGEST" and len(data) != width):
        raise DecodeError(f"parent hash: {len(data)} bytes for {kind}/{width}")
    return unpack_hashes(kind, width, data)[0]


# ---------------------------------------------------------------- tokens


def pack_tokens(tokens: array[int]) -> bytes:
    if _BIG_ENDIAN:
        tokens = array("I", tokens)
        tokens.byteswap()
    return tokens.tobytes()


def unpack_tokens(data: bytes) -> array[int]:
    if len(data) % 4:
        raise DecodeError(f"token_ids: {len(data)} bytes is not a multiple of 4")
    a = array("I")
    a.frombytes(data)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


# ---------------------------------------------------------------- extra keys


def _extra_out(keys: Any) -> list[Any] | None:
    if keys is None:
        return None
    out: list[Any] = []
    for block in keys:
        if block is None:
            out.append(None)
        elif isinstance(block, (tuple, list)):
            out.append([list(k) if isinstance(k, (tuple, list)) else k for k in block])
        else:  # a bare key: still one block's keys
            out.append([block])
    return out


def _extra_in(keys: Any) -> tuple[Any, ...] | None:
    if keys is None:
        return None
    return tuple(None if b is None else tuple(tuple(k) if type(k) is list else k for k in b) for b in keys)


# ---------------------------------------------------------------- encode


def _event_out(e: KVEvent) -> tuple[str, dict[str, Any]]:
    if type(e) is BlockStored:
        kind, width, packed, parent = pack_hashes(e.block_hashes, e.parent_block_hash)
        return (
            _STORED,
            {
                "hash_kind": kind,
                "hash_width": width,
                "block_hashes": packed,
                "parent_block_hash": parent,
                "token_ids": pack_tokens(e.token_ids),
                "block_size": e.block_size,
                "lora_id": e.lora_id,
                "medium": e.medium,
                "lora_name": e.lora_name,
                "extra_keys": _extra_out(e.extra_keys),
                "group_idx": e.group_idx,
                "kv_cache_spec_kind": e.kv_cache_spec_kind,
                "kv_cache_spec_sliding_window": e.kv_cache_spec_sliding_window,
                "locality": e.locality,
                "ownership": e.ownership,
                "session_id": e.session_id,
            },
        )
    if type(e) is BlockRemoved:
        kind, width, packed, _ = pack_hashes(e.block_hashes)
        return (
            _REMOVED,
            {
                "hash_kind": kind,
                "hash_width": width,
                "block_hashes": packed,
                "medium": e.medium,
                "group_idx": e.group_idx,
                "locality": e.locality,
                "ownership": e.ownership,
            },
        )
    if type(e) is AllBlocksCleared:
        return (_CLEARED, {})
    raise EncodeError(f"not a kvwire event: {type(e).__name__}")


def batch_to_record(batch: EventBatch) -> dict[str, Any]:
    w = batch.worker
    return {
        "worker": {
            "instance_id": w.instance_id,
            "model": w.model,
            "dp_rank": w.dp_rank,
            "tp_rank": w.tp_rank,
            "tp_size": w.tp_size,
        },
        "epoch": batch.epoch,
        "seq": batch.seq,
        "ts_us": batch.ts_us,
        "engine_ts": batch.engine_ts,
        "reset": batch.reset,
        "gap": batch.gap,
        "events": [_event_out(e) for e in batch.events],
        "source": batch.source,
    }


def confluent_header(schema_id: int) -> bytes:
    if not 0 <= schema_id <= 0xFFFFFFFF:
        raise EncodeError(f"schema id {schema_id} does not fit the 4-byte Confluent header")
    return CONFLUENT_MAGIC + schema_id.to_bytes(4, "big")


def encode(batch: EventBatch, version: SchemaVersion | int = CURRENT, *, schema_id: int | None = None) -> bytes:
    """EventBatch -> bytes. Single-object encoding, or with ``schema_id`` (the id the registry
    gave ``version``) the Confluent framing. Raises EncodeError."""
    sv = VERSIONS[version] if isinstance(version, int) else version
    header = sv.header if schema_id is None else confluent_header(schema_id)
    try:
        # The core writes the version it lays out in ~1 us; fastavro takes ~14 us a 16-block
        # record (it re-reads the schema's named types per call), on the engine's GIL. First
        # from the batch itself (the dict below costs the sender more than the encoding), then
        # from the dict; the core declines values it does not write plainly, and fastavro then
        # has the last word.
        if sv.version == _core.ENCODE_VERSION:
            fast = _core.encode_batch(header, batch)
            if fast is not None:
                return fast
        record = batch_to_record(batch)
        if sv.version == _core.ENCODE_VERSION:
            fast = _core.encode_record(header, record)
            if fast is not None:
                return fast
        buf = io.BytesIO()
        buf.write(header)
        fastavro.schemaless_writer(buf, sv.parsed, record)
    except EncodeError:
        raise
    except (ValueError, TypeError, OverflowError, struct.error, KeyError) as e:
        raise EncodeError(f"cannot encode batch: {e}") from None
    return buf.getvalue()


# ---------------------------------------------------------------- decode


def _event_in(item: tuple[str, dict[str, Any]]) -> KVEvent:
    name, r = item
    if name == _STORED:
        kind, width = r["hash_kind"], r["hash_width"]
        return BlockStored(
            unpack_hashes(kind, width, r["block_hashes"]),
            _unpack_one(kind, width, r["parent_block_hash"]),
            unpack_tokens(r["token_ids"]),
            r["block_size"],
            r["lora_id"],
            r["medium"],
            r["lora_name"],
            _extra_in(r["extra_keys"]),
            r["group_idx"],
            r["kv_cache_spec_kind"],
            r["kv_cache_spec_sliding_window"],
            r["locality"],
            r["ownership"],
            r["session_id"],
        )
    if name == _REMOVED:
        return BlockRemoved(
            unpack_hashes(r["hash_kind"], r["hash_width"], r["block_hashes"]),
            r["medium"],
            r["group_idx"],
            r["locality"],
            r["ownership"],
        )
    if name == _CLEARED:
        return AllBlocksCleared()
    raise DecodeError(f"unknown event type {name!r}")


def record_to_batch(r: dict[str, Any]) -> EventBatch:
    w = r["worker"]
    return EventBatch(
        WorkerId(w["instance_id"], w["dp_rank"], w["tp_rank"], w["tp_size"], w["model"]),
        r["epoch"],
        r["seq"],
        r["ts_us"],
        tuple(_event_in(e) for e in r["events"]),
        r["engine_ts"],
        r["reset"],
        r["gap"],
        r.get("source", ""),
    )


def framing(data: bytes | None) -> str | None:
    """SINGLE_OBJECT or CONFLUENT by the first byte, None for neither (or an empty value)."""
    if not data:
        return None
    return SINGLE_OBJECT if data[0] == 0xC3 else CONFLUENT if data[0] == 0 else None


def confluent_id(data: bytes | None) -> int | None:
    """The registry id a Confluent-framed value names, else None."""
    if data is None or len(data) < CONFLUENT_HEADER_SIZE or data[0] != 0:
        return None
    return int.from_bytes(data[1:CONFLUENT_HEADER_SIZE], "big")


def _writer(data: bytes, ids: SchemaIds | None) -> tuple[SchemaVersion, int]:
    """(writer schema, offset of the Avro body). Raises DecodeError."""
    if len(data) and data[0] == 0:
        if len(data) < CONFLUENT_HEADER_SIZE:
            raise DecodeError(f"truncated: {len(data)} bytes, Confluent header needs {CONFLUENT_HEADER_SIZE}")
        sid = int.from_bytes(data[1:CONFLUENT_HEADER_SIZE], "big")
        cache = SCHEMA_IDS if ids is None else ids
        sv = cache.get(sid)
        if sv is None:
            raise DecodeError(
                cache.refusal(sid)
                or f"schema id {sid} not resolved: no schema registry was asked (set KVWIRE_SCHEMA_REGISTRY_URL)"
            )
        return sv, CONFLUENT_HEADER_SIZE
    if len(data) < HEADER_SIZE:
        raise DecodeError(f"truncated: {len(data)} bytes, header needs {HEADER_SIZE}")
    if data[:2] != MAGIC:
        raise DecodeError(
            f"bad magic {bytes(data[:2]).hex()}: neither Avro single-object (c301) nor Confluent (00) framing"
        )
    sv = BY_FINGERPRINT.get(bytes(data[2:HEADER_SIZE]))
    if sv is None:
        raise DecodeError(f"unknown schema fingerprint {bytes(data[2:HEADER_SIZE])[::-1].hex()}")
    return sv, HEADER_SIZE


def writer_version(data: bytes, ids: SchemaIds | None = None) -> SchemaVersion:
    """The schema a record names in its header (fingerprint or registry id). Raises DecodeError."""
    return _writer(data, ids)[0]


# ---------------------------------------------------------------- resolution

_Plan = Callable[[Any], None]


def _named_types(raw: Any, out: dict[str, Any], ns: str = "") -> None:
    if isinstance(raw, list):
        for r in raw:
            _named_types(r, out, ns)
    elif isinstance(raw, dict):
        t = raw.get("type")
        if t in ("record", "error", "enum", "fixed"):
            name = str(raw["name"])
            ns = raw.get("namespace", ns) if "." not in name else name.rpartition(".")[0]
            full = name if "." in name else f"{ns}.{name}" if ns else name
            out[full] = raw
            for f in raw.get("fields", ()):
                _named_types(f["type"], out, ns)
        elif t == "array":
            _named_types(raw["items"], out, ns)
        elif t == "map":
            _named_types(raw["values"], out, ns)
        elif isinstance(t, (dict, list)):
            _named_types(t, out, ns)


def _default_value(schema: Any, value: Any, names: dict[str, Any]) -> Any:
    """An Avro JSON default as the decoder would have produced it."""
    if isinstance(schema, str) and schema in names:
        schema = names[schema]
    if isinstance(schema, list):  # a union's default belongs to its first branch
        return _default_value(schema[0], value, names)
    t = schema.get("type") if isinstance(schema, dict) else schema
    if isinstance(t, (dict, list)):
        return _default_value(t, value, names)
    if t in ("bytes", "fixed") and isinstance(value, str):
        return value.encode("latin-1")
    if t in ("record", "error") and isinstance(value, dict):
        return {
            f["name"]: _default_value(f["type"], value.get(f["name"], f.get("default")), names)
            for f in schema["fields"]
        }
    if t == "array" and isinstance(value, list):
        return [_default_value(schema["items"], v, names) for v in value]
    return copy.deepcopy(value)


def _plan_for(
    reader: Any, ns: str, r_names: dict[str, Any], w_fields: dict[str, set[str]], seen: frozenset[str]
) -> _Plan | None:
    if isinstance(reader, str):
        full = reader if "." in reader or not ns else f"{ns}.{reader}"
        target = r_names.get(full, r_names.get(reader))
        if target is None or full in seen:
            return None  # a primitive, or a recursive reference (left as written)
        return _plan_for(target, ns, r_names, w_fields, seen)
    if isinstance(reader, list):
        rec_plans: dict[str, _Plan] = {}
        arr_plan = map_plan = None
        for branch in reader:
            b = r_names.get(branch, r_names.get(f"{ns}.{branch}", branch)) if isinstance(branch, str) else branch
            if not isinstance(b, dict):
                continue
            p = _plan_for(b, ns, r_names, w_fields, seen)
            if p is None:
                continue
            if b.get("type") in ("record", "error"):
                name = str(b["name"])
                rec_plans[name if "." in name else f"{b.get('namespace', ns)}.{name}"] = p
            elif b.get("type") == "array":
                arr_plan = p
            elif b.get("type") == "map":
                map_plan = p
        if not (rec_plans or arr_plan or map_plan):
            return None

        def union(v: Any) -> None:
            tv = type(v)
            if tv is tuple:  # (record name, record) with return_record_name
                p = rec_plans.get(v[0])
                if p is not None:
                    p(v[1])
            elif tv is list and arr_plan is not None:
                arr_plan(v)
            elif tv is dict and map_plan is not None:
                map_plan(v)

        return union
    t = reader.get("type")
    if isinstance(t, (dict, list)):
        return _plan_for(t, ns, r_names, w_fields, seen)
    if t == "array":
        item = _plan_for(reader["items"], ns, r_names, w_fields, seen)
        if item is None:
            return None

        def array_items(v: list[Any]) -> None:
            for x in v:
                item(x)

        return array_items
    if t == "map":
        val = _plan_for(reader["values"], ns, r_names, w_fields, seen)
        if val is None:
            return None

        def map_values(v: dict[str, Any]) -> None:
            for x in v.values():
                val(x)

        return map_values
    if t not in ("record", "error"):
        return None
    name = str(reader["name"])
    ns = reader.get("namespace", ns) if "." not in name else name.rpartition(".")[0]
    full = name if "." in name else f"{ns}.{name}" if ns else name
    written = w_fields.get(full)
    if written is None:
        return None  # the writer never writes this record type
    fields = reader["fields"]
    names = {f["name"] for f in fields}
    extra = tuple(written - names)
    add: list[tuple[str, Any]] = []
    for f in fields:
        if f["name"] not in written:
            if "default" not in f:
                raise DecodeError(f"writer schema lacks {full}.{f['name']}, which has no default")
            add.append((f["name"], _default_value(f["type"], f["default"], r_names)))
    children = [
        (f["name"], p)
        for f in fields
        if f["name"] in written and (p := _plan_for(f["type"], ns, r_names, w_fields, seen | {full})) is not None
    ]
    if not (extra or add or children):
        return None

    def record(rec: dict[str, Any]) -> None:
        for k in extra:
            rec.pop(k, None)
        for k, d in add:
            rec[k] = copy.deepcopy(d) if isinstance(d, (dict, list)) else d
        for k, p in children:
            v = rec.get(k)
            if v is not None:
                p(v)

    return record


_PLANS: dict[tuple[bytes, bytes], _Plan | None] = {}


def _resolution_plan(writer: SchemaVersion, reader: SchemaVersion) -> _Plan | None:
    """What turns a record decoded with ``writer`` into one of ``reader`` (FULL compatibility:
    fields are only added or removed, each with a default), or None when nothing changes."""
    key = (writer.fingerprint, reader.fingerprint)
    if key in _PLANS:
        return _PLANS[key]
    w_names: dict[str, Any] = {}
    r_names: dict[str, Any] = {}
    _named_types(writer.raw, w_names)
    _named_types(reader.raw, r_names)
    w_fields = {n: {f["name"] for f in d["fields"]} for n, d in w_names.items() if d.get("type") in ("record", "error")}
    plan = _plan_for(reader.raw, "", r_names, w_fields, frozenset())
    if len(_PLANS) < 1024:  # bounded: registry-supplied writers are few, but not ours to trust
        _PLANS[key] = plan
    return plan


def decode_record(
    data: bytes, reader: SchemaVersion | int = CURRENT, *, ids: SchemaIds | None = None
) -> dict[str, Any]:
    """Bytes (either framing) -> the Avro record as a dict, resolved to ``reader``."""
    if data is None:
        raise DecodeError("empty record value (tombstone)")
    if len(data) > MAX_RECORD_BYTES:
        raise DecodeError(f"record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}")
    writer, start = _writer(data, ids)
    rd = VERSIONS[reader] if isinstance(reader, int) else reader
    fo = io.BytesIO(data)
    fo.seek(start)
    try:
        # The writer schema alone: see the module doc for why fastavro does not resolve.
        rec = fastavro.schemaless_reader(fo, writer.parsed, None, return_record_name=True)
    except Exception as e:  # fastavro raises many types for bad bytes
        raise DecodeError(f"invalid Avro body: {type(e).__name__}: {e}") from None
    if fo.tell() != len(data):
        raise DecodeError(f"{len(data) - fo.tell()} trailing bytes after the record")
    if not isinstance(rec, dict):
        raise DecodeError(f"writer schema {writer.name} is not a record")
    if writer.fingerprint != rd.fingerprint:
        plan = _resolution_plan(writer, rd)
        if plan is not None:
            try:
                plan(rec)
            except Exception as e:
                raise DecodeError(f"cannot resolve to {rd.name}: {type(e).__name__}: {e}") from None
    return rec


def decode(data: bytes, reader: SchemaVersion | int = CURRENT, *, ids: SchemaIds | None = None) -> EventBatch:
    """Bytes in either framing -> EventBatch. Raises DecodeError only. A Confluent-framed
    record needs its id in ``ids`` (default: the process-wide :data:`SCHEMA_IDS`)."""
    rec = decode_record(data, reader, ids=ids)
    try:
        return record_to_batch(rec)
    except DecodeError:
        raise
    except Exception as e:  # e.g. a token id array of odd length inside valid Avro
        raise DecodeError(f"invalid batch content: {type(e).__name__}: {e}") from None


__all__ = [
    "BY_FINGERPRINT",
    "CONFLUENT",
    "CONFLUENT_CONTENT_TYPE",
    "CONTENT_TYPE",
    "CURRENT",
    "FRAMINGS",
    "MAGIC",
    "SCHEMA_IDS",
    "SINGLE_OBJECT",
    "VERSIONS",
    "CodecError",
    "DecodeError",
    "EncodeError",
    "SchemaIds",
    "SchemaVersion",
    "confluent_header",
    "confluent_id",
    "decode",
    "decode_record",
    "encode",
    "framing",
    "writer_version",
]
