"""Codec contract: lossless round trips, schema evolution both ways, and bad
bytes that always end in one typed error."""

from __future__ import annotations

import io
import struct

import fastavro
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
        (b"\x00\x01" + GOOD[2:], "bad magic"),
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
