"""Codec contract: lossless round trips, schema evolution both ways, and bad
bytes that always end in one typed error."""

from __future__ import annotations

import io
import json
import struct

import fastavro
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.schemas import codec
from kvwire.schemas.codec import DecodeError, EncodeError, decode, encode
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WorkerId, stored

U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
DIGEST = st.binary(min_size=32, max_size=32)
opt_str = st.none() | st.text(max_size=12)
opt_int = st.none() | st.integers(0, 2**31 - 1)
scalar = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=8) | st.binary(max_size=8)
extra_key = scalar | st.tuples(st.text(max_size=8), st.integers(0, 10_000)) | st.tuples(scalar, scalar)


@st.composite
def block_stored(draw):
    kind = draw(st.sampled_from([U64, I64, DIGEST]))
    n = draw(st.integers(0, 6))
    hashes = draw(st.lists(kind, min_size=n, max_size=n))
    parent = draw(st.none() | kind)
    if kind is I64 and not any(h < 0 for h in hashes + [parent or 0]):
        # an all-non-negative list is (losslessly) U64; keep I64 meaningful
        hashes = hashes + [-1]
        n += 1
    block_size = draw(st.sampled_from([0, 1, 16, 256]))
    tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=40))
    extra = draw(st.none() | st.lists(st.none() | st.lists(extra_key, max_size=3).map(tuple), min_size=n, max_size=n))
    return stored(
        hashes,
        tokens,
        block_size,
        parent_block_hash=parent,
        lora_id=draw(st.none() | st.integers(0, 2**40)),
        medium=draw(st.none() | st.sampled_from(["GPU", "CPU", "STORAGE", "cpu", "CPU_PINNED", "DISK"])),
        lora_name=draw(opt_str),
        extra_keys=extra,
        group_idx=draw(opt_int),
        kv_cache_spec_kind=draw(st.none() | st.sampled_from(["full_attention", "sliding_window", "mamba", "x"])),
        kv_cache_spec_sliding_window=draw(opt_int),
        locality=draw(st.none() | st.sampled_from(["LOCAL", "REMOTE"])),
        ownership=draw(opt_str),
        session_id=draw(opt_str),
    )


@st.composite
def block_removed(draw):
    kind = draw(st.sampled_from([U64, I64, DIGEST]))
    return BlockRemoved(
        tuple(draw(st.lists(kind, max_size=6))),
        medium=draw(st.none() | st.sampled_from(["GPU", "CPU"])),
        group_idx=draw(opt_int),
        locality=draw(st.none() | st.just("LOCAL")),
        ownership=draw(opt_str),
    )


event = st.one_of(block_stored(), block_removed(), st.just(AllBlocksCleared()))


@st.composite
def batches(draw):
    return EventBatch(
        worker=WorkerId(
            draw(st.text(min_size=1, max_size=10)),
            draw(st.integers(0, 64)),
            draw(st.integers(0, 7)),
            draw(st.integers(1, 8)),
            draw(st.text(max_size=10)),
        ),
        epoch=draw(I64),
        seq=draw(st.integers(0, 2**63 - 1)),
        ts_us=draw(st.integers(0, 2**62)),
        events=tuple(draw(st.lists(event, max_size=5))),
        engine_ts=draw(st.none() | st.floats(allow_nan=False)),
        reset=draw(st.booleans()),
        gap=draw(st.integers(0, 2**40)),
        source=draw(st.sampled_from(["", "simulator", "vllm-zmq-bridge"])),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_round_trip_is_lossless(batch):
    data = encode(batch)
    assert data[:2] == b"\xc3\x01"
    assert decode(data) == batch


def test_hash_forms_survive_exactly():
    big = [2**64 - 1, 2**63, 18446744073709551611]
    neg = [-(2**63), -1, 5]
    dig = [bytes(range(32)), b"\xff" * 32]
    w = WorkerId("w")
    evs = (
        stored(big, range(48), 16, parent_block_hash=2**63 + 7),
        stored(neg, range(48), 16, parent_block_hash=0),
        stored(dig, range(32), 16, parent_block_hash=b"\x00" * 32),
        BlockRemoved(tuple(big)),
    )
    got = decode(encode(EventBatch(w, 1, 0, 0, evs))).events
    assert got[0].block_hashes == tuple(big) and got[0].parent_block_hash == 2**63 + 7
    assert got[1].block_hashes == tuple(neg) and got[1].parent_block_hash == 0
    assert got[2].block_hashes == tuple(dig)
    assert all(type(h) is int for h in got[0].block_hashes + got[1].block_hashes)
    assert got[3].block_hashes == tuple(big)


@pytest.mark.parametrize(
    "hashes,parent",
    [([1, b"x" * 32], None), ([2**64], None), ([-1, 2**63], None), ([b"a" * 32, b"b" * 16], None), ([1], b"p" * 32)],
)
def test_unrepresentable_hashes_raise_encode_error(hashes, parent):
    with pytest.raises(EncodeError):
        encode(EventBatch(WorkerId("w"), 0, 0, 0, (stored(hashes, [], 16, parent_block_hash=parent),)))


def test_token_ids_outside_uint32_are_rejected_at_construction():
    with pytest.raises(ValueError):
        stored([1], [2**32], 16)
    with pytest.raises(ValueError):
        stored([1], [-1], 16)


# ------------------------------------------------------------ evolution (FULL)


def _sample_batch():
    return EventBatch(
        WorkerId("w1", 2, 1, 4, "m"),
        -42,
        7,
        123456,
        (stored([2**63 + 1], range(16), 16, medium="GPU", lora_name="l"), AllBlocksCleared()),
        engine_ts=1.25,
        reset=True,
        gap=3,
        source="simulator",
    )


def test_v1_writer_read_by_v2_reader_gets_the_default():
    v1, v2 = codec.VERSIONS[1], codec.VERSIONS[2]
    data = encode(_sample_batch(), version=1)
    assert codec.writer_version(data) is v1
    got = decode(data, reader=v2)
    assert got.source == ""  # the v2 field's default
    assert got.events == _sample_batch().events and got.gap == 3


def test_v2_writer_read_by_v1_reader_ignores_the_new_field():
    data = encode(_sample_batch(), version=2)
    rec = codec.decode_record(data, reader=1)
    assert "source" not in rec
    assert rec["worker"]["instance_id"] == "w1" and rec["seq"] == 7


def test_v2_writer_read_by_plain_fastavro_with_v1_reader_schema():
    """The same resolution any Avro library does, without kvwire's codec."""
    data = encode(_sample_batch(), version=2)
    rec = fastavro.schemaless_reader(io.BytesIO(data[10:]), codec.VERSIONS[2].parsed, codec.VERSIONS[1].parsed)
    assert rec["epoch"] == -42 and rec["reset"] is True


# Every branch extra_keys can hold, alone and inside the nested array, incl. bytes that are valid
# UTF-8 (fastavro's resolver used to turn those into str silently) and bytes that are not (it used
# to fail the record).
EXTRA_KEY_TYPES = {
    "null": None,
    "boolean": True,
    "long": -(2**63),
    "double": 2.5,
    "string": "sql-lora",
    "bytes-utf8": b"abc",
    "bytes-binary": b"\xff\xfe\x00",
    "bytes-empty": b"",
}
EXTRA_KEYS = {
    **{k: (v,) for k, v in EXTRA_KEY_TYPES.items()},
    **{f"array<{k}>": ((v, v),) for k, v in EXTRA_KEY_TYPES.items()},
    "mm-pair": (("mm-image", 16),),
    "mixed": ("lora", ("img", 0), b"\x80digest", 3, None, 1.0, False),
}


def _expected(batch: EventBatch, writer: int) -> EventBatch:
    # v1 has no `source`: a v2 reader sees the default.
    return msgspec.structs.replace(batch, source=batch.source if writer >= 2 else "")


@pytest.mark.parametrize("writer", sorted(codec.VERSIONS))
@pytest.mark.parametrize("key_type", sorted(EXTRA_KEYS))
def test_every_writer_version_with_every_extra_key_type(writer, key_type):
    keys = EXTRA_KEYS[key_type]
    batch = EventBatch(
        WorkerId("w", 1, 0, 2, "m"),
        3,
        4,
        5,
        (stored([1, 2], range(8), 4, extra_keys=(keys, None), medium="GPU"),),
        source="vllm-connector",
    )
    for reader in codec.VERSIONS:
        data = encode(batch, version=writer)
        got = decode(data, reader=reader)
        assert got.events == batch.events, (writer, reader, key_type)
        assert [type(k) for k in got.events[0].extra_keys[0]] == [type(k) for k in keys]
        if reader == codec.CURRENT.version:
            assert got == _expected(batch, writer)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_every_writer_version_round_trips_to_the_current_reader(batch):
    for writer in codec.VERSIONS:
        assert decode(encode(batch, version=writer)) == _expected(batch, writer)


def test_a_registry_writer_kvwire_does_not_ship_resolves_to_the_reader():
    # A newer producer's schema, as a registry would hand it over: a field added at the top with
    # a default, one in a nested record, and one removed (all that FULL allows).
    raw = json.loads(json.dumps(codec.CURRENT.raw))
    raw["fields"] = [f for f in raw["fields"] if f["name"] != "engine_ts"]
    raw["fields"].append({"name": "region", "type": "string", "default": "eu"})
    raw["fields"][0]["type"]["fields"].append({"name": "host", "type": ["null", "string"], "default": None})
    ids = codec.SchemaIds()
    newer = ids.add(77, json.dumps(raw))
    assert newer.version == 0 and newer.fingerprint not in codec.BY_FINGERPRINT
    rec = codec.batch_to_record(_sample_batch())
    del rec["engine_ts"]
    rec["region"] = "us"
    rec["worker"]["host"] = "h1"
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, newer.parsed, rec)
    got = decode(codec.confluent_header(77) + buf.getvalue(), ids=ids)
    assert got == msgspec.structs.replace(_sample_batch(), engine_ts=None)  # the reader's default
    assert "region" not in codec.decode_record(codec.confluent_header(77) + buf.getvalue(), ids=ids)


# ------------------------------------------------------------ Confluent framing


def test_confluent_framing_is_magic_zero_then_big_endian_id():
    batch = _sample_batch()
    data = encode(batch, schema_id=0x01020304)
    assert data[:5] == b"\x00\x01\x02\x03\x04"
    assert data[5:] == encode(batch)[10:]  # the same Avro body as single-object
    assert codec.framing(data) == codec.CONFLUENT and codec.framing(encode(batch)) == codec.SINGLE_OBJECT
    assert codec.confluent_id(data) == 0x01020304 and codec.confluent_id(encode(batch)) is None
    with pytest.raises(EncodeError):
        encode(batch, schema_id=1 << 32)


@pytest.mark.parametrize("writer", sorted(codec.VERSIONS))
def test_confluent_records_decode_through_the_id_cache(writer):
    ids = codec.SchemaIds()
    batch = _sample_batch()
    data = encode(batch, version=writer, schema_id=9)
    assert ids.missing([data, encode(batch), None, b"\x00"]) == {9}
    with pytest.raises(DecodeError, match="schema id 9 not resolved"):
        decode(data, ids=ids)
    # whitespace and docs differ from the shipped text; the canonical form maps it to the version
    sv = ids.add(9, json.dumps(codec.VERSIONS[writer].raw, indent=2))
    assert sv is codec.VERSIONS[writer]
    assert ids.missing([data]) == set()
    assert codec.writer_version(data, ids) is codec.VERSIONS[writer]
    assert decode(data, ids=ids) == _expected(batch, writer)


def test_unknown_and_foreign_ids_carry_their_reason():
    ids = codec.SchemaIds()
    ids.refuse(5, "schema id 5 is not known to the schema registry at http://r")
    with pytest.raises(DecodeError, match="not known to the schema registry"):
        decode(encode(_sample_batch(), schema_id=5), ids=ids)
    with pytest.raises(codec.CodecError, match=r"not dev\.kvwire\.EventBatch"):
        ids.add(6, '{"type":"record","name":"Other","fields":[]}')
    with pytest.raises(codec.CodecError, match="unusable"):
        ids.add(6, "{not json")
    ids.add(7, codec.VERSIONS[1].registry_text)
    with pytest.raises(codec.CodecError, match="another schema"):
        ids.add(7, codec.VERSIONS[2].registry_text)


def test_the_default_cache_serves_decode_without_arguments():
    # The Rust fast path falls back to codec.decode(value): the consumer's prefetch fills SCHEMA_IDS.
    sid = 0xFFFFFFF0
    data = encode(_sample_batch(), schema_id=sid)
    try:
        codec.SCHEMA_IDS.add(sid, codec.CURRENT.registry_text)
        assert decode(data) == _sample_batch()
    finally:
        codec.SCHEMA_IDS.clear()


def test_fingerprints_are_crc64_avro_of_canonical_form():
    for sv in codec.VERSIONS.values():
        # wire order (little-endian) is fastavro's hex; Java's %016x is its reverse
        assert sv.fingerprint.hex() == fastavro.schema.fingerprint(sv.canonical, "CRC-64-AVRO")
        assert sv.fingerprint_hex == sv.fingerprint[::-1].hex()
    assert len({sv.fingerprint for sv in codec.VERSIONS.values()}) == len(codec.VERSIONS)


# ------------------------------------------------------------ bad bytes

GOOD = encode(_sample_batch())


@pytest.mark.parametrize(
    "data,why",
    [
        (b"", "truncated"),
        (b"\xc3", "truncated"),
        (b"\x01\x01" + GOOD[2:], "bad magic"),
        (b"\x00\x00\x00", "Confluent header"),
        (GOOD[:2] + b"\x00" * 8 + GOOD[10:], "unknown schema fingerprint"),
        (GOOD[:-3], "invalid Avro body"),
        (GOOD + b"\x00", "trailing"),
    ],
)
def test_bad_bytes_raise_decode_error(data, why):
    with pytest.raises(DecodeError, match=why):
        decode(data)


def _zigzag(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def test_gigabyte_length_claims_fail_fast_without_allocating():
    header = codec.CURRENT.header
    # worker.instance_id claims 2^40 bytes; an events array claims 2^60 items
    for body in (
        _zigzag(1 << 40) + b"abc",
        _zigzag(1) + b"a" + _zigzag(0) * 4 + _zigzag(1) + b"\x00" * 20 + _zigzag(1 << 60),
    ):
        with pytest.raises(DecodeError):
            decode(header + body)


def test_invalid_union_branch_is_a_decode_error():
    # engine_ts union has 2 branches; index 5 does not exist
    good = codec.batch_to_record(_sample_batch())
    good["engine_ts"] = None
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, codec.CURRENT.parsed, good)
    body = buf.getvalue()
    # the engine_ts union index (0 = null) sits right after worker, epoch, seq, ts_us
    prefix = io.BytesIO(body)
    fastavro.schemaless_reader(prefix, {"type": "record", "name": "P", "fields": codec.CURRENT.raw["fields"][:4]}, None)
    pos = prefix.tell()
    assert body[pos] == 0
    bad = body[:pos] + _zigzag(5) + body[pos + 1 :]
    with pytest.raises(DecodeError):
        decode(codec.CURRENT.header + bad)


def test_packed_lengths_are_validated():
    rec = codec.batch_to_record(_sample_batch())
    name, ev = rec["events"][0]
    rec["events"][0] = (name, dict(ev, token_ids=b"\x01\x02\x03"))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, codec.CURRENT.parsed, rec)
    with pytest.raises(DecodeError, match="token_ids"):
        decode(codec.CURRENT.header + buf.getvalue())
    rec["events"][0] = (name, dict(ev, block_hashes=b"\x01" * 9))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, codec.CURRENT.parsed, rec)
    with pytest.raises(DecodeError, match="hashes"):
        decode(codec.CURRENT.header + buf.getvalue())


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_decode_error(data):
    try:
        decode(data)
    except DecodeError:
        pass


@settings(max_examples=600, deadline=None)
@given(batches(), st.data())
def test_mutated_records_decode_or_raise_decode_error(batch, data):
    raw = bytearray(encode(batch))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "truncate", "insert"]))
        if op == "flip" and len(raw) > 10:
            i = data.draw(st.integers(10, len(raw) - 1))
            raw[i] ^= data.draw(st.integers(1, 255))
        elif op == "truncate":
            del raw[data.draw(st.integers(0, len(raw))) :]
        else:
            i = data.draw(st.integers(0, len(raw)))
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=9))
    try:
        out = decode(bytes(raw))
    except DecodeError:
        return
    assert isinstance(out, EventBatch)
    # a mutation that still decodes must yield a well-formed model
    for e in out.events:
        if isinstance(e, BlockStored):
            assert len(e.token_ids) * 4 == len(e.token_ids.tobytes())
    struct.pack("<q", out.epoch)
