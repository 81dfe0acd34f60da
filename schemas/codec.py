"""Avro single-object codec for :class:`~schemas.events.EventBatch`.

Every record is ``C3 01`` + the 8-byte little-endian CRC-64-AVRO fingerprint
of the writer schema's canonical form + the Avro body, so any record names the
schema it was written with and any Avro library can decode it. The codec
knows every schema version shipped in ``schemas/avro`` and resolves an older
writer to the current reader (compatibility rule: FULL, see README).

Hashes and token ids travel packed in ``bytes`` (see the .avsc docs): this is
the bulk of every record and decodes several times faster than arrays.
"""

from __future__ import annotations

import io
import json
import re
import struct
import sys
from array import array
from dataclasses import dataclass
from importlib import resources
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

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
# Kafka's default max.message.bytes is 1 MiB; anything far beyond is hostile.
MAX_RECORD_BYTES = 64 * 1024 * 1024
CONTENT_TYPE = "application/vnd.apache.avro+single-object"
NAMESPACE = "dev.kvwire"
_STORED = f"{NAMESPACE}.BlockStored"
_REMOVED = f"{NAMESPACE}.BlockRemoved"
_CLEARED = f"{NAMESPACE}.AllBlocksCleared"
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
    version: int
    raw: dict
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


def _load_versions() -> dict[int, SchemaVersion]:
    out: dict[int, SchemaVersion] = {}
    for entry in resources.files(__package__).joinpath("avro").iterdir():
        m = re.fullmatch(r"event_batch\.v(\d+)\.avsc", entry.name)
        if not m:
            continue
        raw = json.loads(entry.read_text())
        canonical = to_parsing_canonical_form(raw)
        # fastavro's hex already lists the fingerprint's little-endian bytes,
        # which is the order single-object encoding puts on the wire.
        fp = bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))
        out[int(m.group(1))] = SchemaVersion(int(m.group(1)), raw, fastavro.parse_schema(raw), canonical, fp)
    if not out:
        raise RuntimeError("no schemas shipped in schemas/avro")
    return dict(sorted(out.items()))


VERSIONS: dict[int, SchemaVersion] = _load_versions()
BY_FINGERPRINT: dict[bytes, SchemaVersion] = {v.fingerprint: v for v in VERSIONS.values()}
CURRENT: SchemaVersion = VERSIONS[max(VERSIONS)]

# ---------------------------------------------------------------- hashes


def pack_hashes(hashes: tuple[BlockHash, ...], parent: BlockHash | None = None):
    """-> (kind, width, packed, packed_parent). Lossless for all three forms."""
    n = len(hashes)
    try:  # the common vLLM case: non-negative ints below 2^64
        packed = struct.pack(f"<{n}Q", *hashes)
        if parent is None:
            return "U64", 8, packed, None
        if type(parent) is int and 0 <= parent <= _U64_MAX:
            return "U64", 8, packed, struct.pack("<Q", parent)
    except (struct.error, TypeError):
        pass
    values = hashes if parent is None else (*hashes, parent)
    if all(type(h) is int for h in values):
        if all(_I64_MIN <= h <= _I64_MAX for h in values):
            kind, fmt = "I64", "q"
        elif all(0 <= h <= _U64_MAX for h in values):
            kind, fmt = "U64", "Q"
        else:
            raise EncodeError("int block hashes must all fit in uint64 or all in int64")
        return (
            kind,
            8,
            struct.pack(f"<{n}{fmt}", *hashes),
            None if parent is None else struct.pack(f"<{fmt}", parent),
        )
    if all(isinstance(h, (bytes, bytearray, memoryview)) for h in values):
        width = len(values[0])
        if width == 0 or any(len(h) != width for h in values):
            raise EncodeError("digest block hashes must be non-empty and of one size")
        return (
            "DIGEST",
            width,
            b"".join(bytes(h) for h in hashes),
            None if parent is None else bytes(parent),
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


def pack_tokens(tokens: array) -> bytes:
    if _BIG_ENDIAN:
        tokens = array("I", tokens)
        tokens.byteswap()
    return tokens.tobytes()


def unpack_tokens(data: bytes) -> array:
    if len(data) % 4:
        raise DecodeError(f"token_ids: {len(data)} bytes is not a multiple of 4")
    a = array("I")
    a.frombytes(data)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


# ---------------------------------------------------------------- extra keys


def _extra_out(keys):
    if keys is None:
        return None
    out = []
    for block in keys:
        if block is None:
            out.append(None)
        elif isinstance(block, (tuple, list)):
            out.append([list(k) if isinstance(k, (tuple, list)) else k for k in block])
        else:  # a bare key: still one block's keys
            out.append([block])
    return out


def _extra_in(keys):
    if keys is None:
        return None
    return tuple(None if b is None else tuple(tuple(k) if type(k) is list else k for k in b) for b in keys)


# ---------------------------------------------------------------- encode


def _event_out(e: KVEvent):
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


def batch_to_record(batch: EventBatch) -> dict:
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


def encode(batch: EventBatch, version: SchemaVersion | int = CURRENT) -> bytes:
    """EventBatch -> single-object-encoded bytes. Raises EncodeError."""
    sv = VERSIONS[version] if isinstance(version, int) else version
    buf = io.BytesIO()
    buf.write(sv.header)
    try:
        fastavro.schemaless_writer(buf, sv.parsed, batch_to_record(batch))
    except EncodeError:
        raise
    except (ValueError, TypeError, OverflowError, struct.error, KeyError) as e:
        raise EncodeError(f"cannot encode batch: {e}") from None
    return buf.getvalue()


# ---------------------------------------------------------------- decode


def _event_in(item) -> KVEvent:
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


def record_to_batch(r: dict) -> EventBatch:
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


def writer_version(data: bytes) -> SchemaVersion:
    """The schema a record names in its header. Raises DecodeError."""
    if len(data) < HEADER_SIZE:
        raise DecodeError(f"truncated: {len(data)} bytes, header needs {HEADER_SIZE}")
    if data[:2] != MAGIC:
        raise DecodeError(f"bad magic {bytes(data[:2]).hex()}: not Avro single-object encoding")
    sv = BY_FINGERPRINT.get(bytes(data[2:HEADER_SIZE]))
    if sv is None:
        raise DecodeError(f"unknown schema fingerprint {bytes(data[2:HEADER_SIZE])[::-1].hex()}")
    return sv


def decode_record(data: bytes, reader: SchemaVersion | int = CURRENT) -> dict:
    """Bytes -> the Avro record as a dict, resolved to ``reader``."""
    if data is None:
        raise DecodeError("empty record value (tombstone)")
    if len(data) > MAX_RECORD_BYTES:
        raise DecodeError(f"record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}")
    writer = writer_version(data)
    rd = VERSIONS[reader] if isinstance(reader, int) else reader
    fo = io.BytesIO(data)
    fo.seek(HEADER_SIZE)
    try:
        rec = fastavro.schemaless_reader(
            fo,
            writer.parsed,
            None if rd is writer else rd.parsed,
            return_record_name=True,
        )
    except Exception as e:  # fastavro raises many types for bad bytes
        raise DecodeError(f"invalid Avro body: {type(e).__name__}: {e}") from None
    if fo.tell() != len(data):
        raise DecodeError(f"{len(data) - fo.tell()} trailing bytes after the record")
    return rec


def decode(data: bytes, reader: SchemaVersion | int = CURRENT) -> EventBatch:
    """Single-object-encoded bytes -> EventBatch. Raises DecodeError only."""
    rec = decode_record(data, reader)
    try:
        return record_to_batch(rec)
    except DecodeError:
        raise
    except Exception as e:  # e.g. a token id array of odd length inside valid Avro
        raise DecodeError(f"invalid batch content: {type(e).__name__}: {e}") from None


__all__ = [
    "BY_FINGERPRINT",
    "CONTENT_TYPE",
    "CURRENT",
    "MAGIC",
    "VERSIONS",
    "CodecError",
    "DecodeError",
    "EncodeError",
    "SchemaVersion",
    "decode",
    "decode_record",
    "encode",
    "writer_version",
]
