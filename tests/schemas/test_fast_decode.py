"""The Rust decoder (kvwire._core) against the reference, codec.decode (fastavro).

The rule, for any bytes: the fast path returns exactly what codec.decode returns, or declines
(None); whenever codec.decode raises DecodeError the fast path has declined. On top of that, the
fast path must not decline a well-formed record of any shipped writer version: declining is safe
but slow, and the consumer's speed depends on it never happening for what producers write.

Malformed inputs come from a walk of the writer schema over real encodings, which finds every
varint (ints, longs, lengths, union and enum indices, array counts) so each can be stretched,
negated or pushed out of range in place.
"""

from __future__ import annotations

import io
import math
import struct
from array import array
from typing import Any, NamedTuple

import fastavro
import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_codec import batches  # the codec's own generators: same shapes, same ranges

from kvwire import _core
from kvwire.schemas import codec
from kvwire.schemas.codec import DecodeError
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WorkerId, stored

VERSIONS = sorted(codec.VERSIONS)
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---------------------------------------------------------------- the rule


def same(a: Any, b: Any, path: str = "") -> None:
    """Equal values of equal types all the way down (True is not 1, -0.0 is not 0.0, NaN is NaN)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, msgspec.Struct):
        for f in a.__struct_fields__:
            same(getattr(a, f), getattr(b, f), f"{path}.{f}")
    elif isinstance(a, tuple | list):
        assert len(a) == len(b), f"{path}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    elif isinstance(a, array):
        assert a.typecode == b.typecode and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a} vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def check(data: bytes) -> tuple[EventBatch | None, EventBatch | None]:
    """Apply the rule to one value; -> (fast result, reference result), None for declined/rejected."""
    fast = _core.decode_record(data)
    reason = _core.decline_reason(data)
    assert (fast is None) == (reason is not None), reason
    n_ok, n_blocks, declined = _core.decode_many([data])
    assert (n_ok, declined) == ((0, [0]) if fast is None else (1, []))
    try:
        ref = codec.decode(data)
    except DecodeError as e:
        assert fast is None, f"the reference rejects ({e.reason}) but the fast path decoded {fast}"
        return None, None
    if fast is not None:
        same(fast, ref)
        assert n_blocks == ref.block_count()
    return fast, ref


def accepted(data: bytes) -> EventBatch:
    """A value both decoders must decode, identically."""
    fast, ref = check(data)
    assert ref is not None, "the reference rejects a record the test meant to be valid"
    assert fast is not None, f"the fast path declines a valid record: {_core.decline_reason(data)}"
    return fast


def declined(data: bytes) -> None:
    fast, _ = check(data)
    assert fast is None


# ---------------------------------------------------------------- generators

FLOATS = st.floats(allow_nan=True, allow_infinity=True)
I64 = st.integers(I64_MIN, I64_MAX)
SCALAR = st.none() | st.booleans() | I64 | FLOATS | st.text(max_size=6) | st.binary(max_size=6)
KEY = SCALAR | st.lists(SCALAR, max_size=3).map(tuple)
BLOCK_KEYS = st.none() | st.lists(KEY, max_size=3).map(tuple)


@st.composite
def rich_batches(draw: st.DrawFn) -> EventBatch:
    """test_codec's batches, with extra keys of every union branch (doubles included) and extremes."""
    b = draw(batches())
    events = []
    for e in b.events:
        if isinstance(e, BlockStored) and draw(st.booleans()):
            keys = draw(st.none() | st.lists(BLOCK_KEYS, max_size=len(e.block_hashes) + 1).map(tuple))
            e = msgspec.structs.replace(e, extra_keys=keys)
        events.append(e)
    return msgspec.structs.replace(
        b,
        events=tuple(events),
        epoch=draw(st.sampled_from([b.epoch, I64_MIN, I64_MAX, 0, -1])),
        engine_ts=draw(st.sampled_from([b.engine_ts, math.inf, -math.inf, math.nan, -0.0, 5e-324])),
    )


def encodings(batch: EventBatch) -> list[tuple[int, bytes]]:
    return [(v, codec.encode(batch, version=v)) for v in VERSIONS]


def rich_batch() -> EventBatch:
    """Every optional field set, every hash kind, every extra-key branch, extreme values."""
    keys = (None, True, False, I64_MIN, I64_MAX, 0, -1, 1.5, -0.0, math.inf, "é", "", b"ab", b"")
    return EventBatch(
        WorkerId("inst-é", I32_MAX, I32_MIN, 3, "model"),
        I64_MIN,
        I64_MAX,
        0,
        (
            stored(
                [2**64 - 1, 0, 2**63],
                range(48),
                16,
                parent_block_hash=2**63 + 1,
                lora_id=I64_MIN,
                medium="GPU",
                lora_name="lora",
                extra_keys=(keys, None, (keys, ("mm", 3), ())),
                group_idx=I32_MAX,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=I32_MIN,
                locality="LOCAL",
                ownership="own",
                session_id="s",
            ),
            stored([-1, I64_MIN, I64_MAX], [2**32 - 1, 0, 7], 1, parent_block_hash=-(2**62)),
            stored([b"\x00" * 32, b"\xff" * 32], [], 0, parent_block_hash=b"\x01" * 32, extra_keys=()),
            stored([], [], 16),
            BlockRemoved((2**64 - 1, 5), medium="CPU", group_idx=0, locality="REMOTE", ownership="x"),
            BlockRemoved((-5,)),
            BlockRemoved((b"d" * 20,)),
            BlockRemoved(()),
            AllBlocksCleared(),
        ),
        engine_ts=-1.25,
        reset=True,
        gap=I64_MAX,
        source="simulator",
    )


# ---------------------------------------------------------------- a schema walk to find every varint


class Span(NamedTuple):
    role: str  # int | long | len | union | enum | count
    start: int
    end: int
    value: int
    arity: int  # branches of a union, symbols of an enum


class ArraySpan(NamedTuple):
    start: int  # the first count
    items: list[tuple[int, int]]
    end: int  # after the terminating 0


def zz(v: int, width: int = 0) -> bytes:
    """Zig-zag varint of v; with width, padded with continuation bytes to exactly that many bytes."""
    n = ((v << 1) ^ (v >> 63)) & ((1 << 64) - 1)
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    if width > len(out):
        out[-1] |= 0x80
        out += b"\x80" * (width - len(out) - 1) + b"\x00"
    return bytes(out)


def walk(data: bytes) -> tuple[list[Span], list[ArraySpan]]:
    """Every varint and array of a record the writer encoded (canonical encodings only)."""
    schema = codec.BY_FINGERPRINT[data[2:10]].raw
    names: dict[str, Any] = {}
    spans: list[Span] = []
    arrays: list[ArraySpan] = []
    pos = 10

    def name_types(s: Any) -> None:  # a record may name a type whose definition it never reaches
        if isinstance(s, list):
            for b in s:
                name_types(b)
        elif isinstance(s, dict):
            if s["type"] in ("record", "enum"):
                names[s["name"]] = s
            for f in s.get("fields", ()):
                name_types(f["type"])
            if s["type"] == "array":
                name_types(s["items"])

    name_types(schema)

    def varint(role: str, arity: int = 0) -> int:
        nonlocal pos
        start, n, shift = pos, 0, 0
        while True:
            b = data[pos]
            pos += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        v = (n >> 1) ^ -(n & 1)
        spans.append(Span(role, start, pos, v, arity))
        return v

    def read(s: Any) -> None:
        nonlocal pos
        if isinstance(s, list):
            read(s[varint("union", len(s))])
        elif isinstance(s, str):
            if s in names:
                read(names[s])
            elif s in ("int", "long"):
                varint(s)
            elif s in ("string", "bytes"):
                n = varint("len")  # before touching pos: `pos += varint()` would add to the old pos
                pos += n
            else:
                pos += {"null": 0, "boolean": 1, "double": 8}[s]
        elif s["type"] == "record":
            for f in s["fields"]:
                read(f["type"])
        elif s["type"] == "enum":
            varint("enum", len(s["symbols"]))
        elif s["type"] == "array":
            start, items = pos, []
            for _ in range(varint("count")):
                item = pos
                read(s["items"])
                items.append((item, pos))
            if items:
                varint("count")
            arrays.append(ArraySpan(start, items, pos))
        else:
            raise AssertionError(s)

    read(schema)
    assert pos == len(data)
    return spans, arrays


def put(data: bytes, span: Span, new: bytes) -> bytes:
    return data[: span.start] + new + data[span.end :]


# ---------------------------------------------------------------- tests


def test_the_fast_path_knows_every_shipped_writer_version():
    assert {v: sv.fingerprint for v, sv in codec.VERSIONS.items()} == _core.FINGERPRINTS


@pytest.mark.parametrize("version", VERSIONS)
def test_every_field_branch_and_extreme_value_of_every_version(version):
    b = rich_batch()
    if version < 2:
        b = msgspec.structs.replace(b, source="")  # v1 has no source: it reads as the default
    got = accepted(codec.encode(b, version=version))
    same(got, b)


@pytest.mark.parametrize("version", VERSIONS)
def test_empty_arrays_and_heartbeats(version):
    w = WorkerId("w")
    for b in (
        EventBatch(w, 0, 0, 0),
        EventBatch(w, -1, 0, 0, (stored([], [], 0, extra_keys=()),)),
        EventBatch(w, -1, 0, 0, (stored([1], [], 16, extra_keys=((),)), BlockRemoved(()))),
    ):
        accepted(codec.encode(b, version=version))


def test_bytes_keys_stay_bytes_for_every_writer_version():
    keys = ((b"ab", (b"c", 1)), (b"\xff",))
    b = EventBatch(WorkerId("w"), 0, 0, 0, (stored([1, 2], [], 16, extra_keys=keys),))
    for _, data in encodings(b):
        assert accepted(data).events[0].extra_keys == keys


@SETTINGS
@given(rich_batches())
def test_generated_batches_decode_exactly_as_the_reference(batch):
    for _, data in encodings(batch):
        accepted(data)


@SETTINGS
@given(rich_batches(), st.sampled_from(VERSIONS), st.data())
def test_overlong_varints(batch, version, data):
    raw = codec.encode(batch, version=version)
    spans, _ = walk(raw)
    span = data.draw(st.sampled_from(spans))
    width = data.draw(st.integers(span.end - span.start + 1, 11))
    assume(width > span.end - span.start)
    fast, ref = check(put(raw, span, zz(span.value, width)))
    if width <= 10 and ref is not None:
        assert fast is not None, "an overlong varint within 64 bits reads its value"
    if width == 11:
        assert fast is None


@SETTINGS
@given(rich_batches(), st.sampled_from(VERSIONS), st.data())
def test_out_of_range_union_enum_and_int_values(batch, version, data):
    raw = codec.encode(batch, version=version)
    spans, _ = walk(raw)
    span = data.draw(st.sampled_from([s for s in spans if s.role in ("union", "enum", "int")]))
    if span.role == "int":
        bad = data.draw(st.sampled_from([I32_MAX + 1, I32_MIN - 1, I64_MAX, I64_MIN]))
    else:
        bad = data.draw(st.sampled_from([span.arity, span.arity + 1, -1, I64_MIN, I64_MAX]))
    declined(put(raw, span, zz(bad)))


@SETTINGS
@given(rich_batches(), st.sampled_from(VERSIONS), st.data())
def test_bad_lengths_and_counts(batch, version, data):
    raw = codec.encode(batch, version=version)
    spans, _ = walk(raw)
    lens = [s for s in spans if s.role in ("len", "count") and s.value > 0]
    assume(lens)
    span = data.draw(st.sampled_from(lens))
    bad = data.draw(
        st.sampled_from([-1, I64_MIN, len(raw), I64_MAX, 2**40])
        if span.role == "len"
        else st.sampled_from([I64_MIN, len(raw), I64_MAX, 2**60])
    )
    declined(put(raw, span, zz(bad)))


@SETTINGS
@given(rich_batches(), st.sampled_from(VERSIONS), st.data())
def test_arrays_in_negative_and_split_blocks(batch, version, data):
    """Avro lets a writer cut an array into blocks, and give a block's byte size with a negative
    count; the values are the same, so the fast path must read them the same."""
    raw = codec.encode(batch, version=version)
    _, arrays = walk(raw)
    arrs = [a for a in arrays if a.items]
    assume(arrs)
    a = data.draw(st.sampled_from(arrs))
    items = [raw[s:e] for s, e in a.items]
    if data.draw(st.booleans()):
        body = zz(-len(items)) + zz(sum(map(len, items))) + b"".join(items) + b"\x00"
    else:
        body = b"".join(zz(1) + it for it in items) + b"\x00"
    accepted(raw[: a.start] + body + raw[a.end :])


@pytest.mark.parametrize("version", VERSIONS)
def test_every_truncation_declines(version):
    b = rich_batch()
    raw = codec.encode(b, version=version)
    accepted(raw)
    for cut in range(len(raw)):
        declined(raw[:cut])  # an Avro encoding is prefix-free: no strict prefix is a record
    declined(raw + b"\x00")


@SETTINGS
@given(rich_batches(), st.sampled_from(VERSIONS), st.data())
def test_single_byte_mutations(batch, version, data):
    raw = bytearray(codec.encode(batch, version=version))
    i = data.draw(st.integers(0, len(raw) - 1))
    raw[i] = data.draw(st.integers(0, 255).filter(lambda x: x != raw[i]))
    check(bytes(raw))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(VERSIONS), st.binary(max_size=200))
def test_random_bytes(version, body):
    check(body)
    check(codec.VERSIONS[version].header + body)


def test_other_framings_and_non_bytes_decline():
    body = codec.encode(rich_batch())[10:]
    declined(b"\x00\x00\x00\x00\x07" + body)  # Confluent wire format: magic 0, 4-byte schema id
    declined(b"\xc3\x01" + b"\x00" * 8 + body)  # an unknown fingerprint
    assert _core.decode_record(None) is None
    assert _core.decode_record(bytearray(codec.encode(rich_batch()))) is None


def _with(event: dict[str, Any]) -> bytes:
    rec = codec.batch_to_record(EventBatch(WorkerId("w"), 0, 0, 0, (stored([1, 2], range(8), 4),)))
    name, ev = rec["events"][0]
    rec["events"][0] = (name, dict(ev, **event))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, codec.CURRENT.parsed, rec)
    return codec.CURRENT.header + buf.getvalue()


@pytest.mark.parametrize(
    "event",
    [
        {"token_ids": b"\x01\x02\x03"},
        {"block_hashes": b"\x01" * 9},
        {"hash_width": 4, "block_hashes": b"\x01" * 8},
        {"hash_kind": "DIGEST", "hash_width": 0, "block_hashes": b""},
        {"hash_kind": "DIGEST", "hash_width": 3, "block_hashes": b"\x01" * 8},
        {"parent_block_hash": b"\x01" * 7},
        {"hash_kind": "DIGEST", "hash_width": 4, "block_hashes": b"\x01" * 8, "parent_block_hash": b"\x01" * 8},
    ],
)
def test_packed_lengths_the_codec_rejects_are_declined(event):
    data = _with(event)
    with pytest.raises(DecodeError):
        codec.decode(data)
    declined(data)


def test_valid_digest_widths_decode():
    accepted(
        _with({"hash_kind": "DIGEST", "hash_width": 4, "block_hashes": b"\x01" * 8, "parent_block_hash": b"p" * 4})
    )
    accepted(_with({"hash_kind": "I64", "parent_block_hash": b"\xff" * 8}))
