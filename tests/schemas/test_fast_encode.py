"""The Rust encoder (kvwire._core.encode_record) against the reference, fastavro.

The rule, for any record dict codec.batch_to_record can give: the fast path returns exactly the
bytes fastavro writes, or declines (None), and then codec.encode's answer is fastavro's, error
included. And it must not decline what producers write: declining is safe but slow, and the
sender's cost on the engine's GIL depends on it never happening.
"""

from __future__ import annotations

import io
import math
from array import array

import fastavro
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec import batches  # the codec's own generators: same shapes, same ranges

from kvwire import _core
from kvwire.schemas import codec
from kvwire.schemas.codec import EncodeError
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WorkerId, stored

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FAST = codec.VERSIONS[_core.ENCODE_VERSION]
HEADERS = [FAST.header, codec.confluent_header(7)]


def fastavro_bytes(header: bytes, record: dict) -> bytes:
    buf = io.BytesIO()
    buf.write(header)
    fastavro.schemaless_writer(buf, FAST.parsed, record)
    return buf.getvalue()


def test_the_fast_path_writes_the_current_version():
    assert codec.CURRENT is FAST


@SETTINGS
@given(batches(), st.sampled_from(HEADERS))
def test_every_batch_a_producer_writes_is_fastavros_bytes(batch, header):
    record = codec.batch_to_record(batch)
    fast = _core.encode_record(header, record)
    assert fast is not None, "declined a batch the codec's generators make"
    assert fast == fastavro_bytes(header, record)


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)


@SETTINGS
@given(st.lists(st.none() | st.lists(SCALARS | st.lists(SCALARS, max_size=3), max_size=3), min_size=1, max_size=3))
def test_extra_keys_take_the_branch_fastavro_takes(keys):
    """Every scalar branch, floats (NaN, -0.0) and tuple keys, beside fastavro's own choice."""
    ev = stored([1] * len(keys), range(4 * len(keys)), 4)
    record = codec.batch_to_record(EventBatch(WorkerId("w"), 1, 0, 0, (ev,)))
    record["events"][0][1]["extra_keys"] = keys
    fast = _core.encode_record(FAST.header, record)
    assert fast is not None
    assert fast == fastavro_bytes(FAST.header, record)


def mutated(path: tuple, value) -> dict:
    record = codec.batch_to_record(
        EventBatch(
            WorkerId("w"), 1, 0, 0, (stored([1, 2], range(8), 4, extra_keys=[("a", 1), None]), BlockRemoved((3,)))
        )
    )
    d = record
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    return record


@pytest.mark.parametrize(
    "path,value",
    [
        (("events", 0, 1, "extra_keys", 0, 0), 2**64),  # beyond a long: fastavro writes a double
        (("events", 0, 1, "extra_keys", 0, 1), 2**70),
        (("worker", "dp_rank"), True),  # a bool where an int goes
        (("worker", "dp_rank"), 2**31),  # beyond an Avro int
        (("epoch",), 2**63),  # beyond a long
        (("engine_ts",), 3),  # an int where a double goes
        (("reset",), 1),
        (("worker", "instance_id"), "\udc80"),  # a lone surrogate: not UTF-8
        (("events", 0, 1, "block_hashes"), bytearray(8)),
        (("events", 0, 1, "hash_kind"), "U32"),
        (("events", 0, 1, "hash_width"), -8),
        (("events", 1, 1, "medium"), 5),
        (("events", 0), ("BlockStored", {})),  # an unqualified branch name
        (("events", 0), ("dev.kvwire.BlockStored", {}, 1)),
        (("events",), ()),
    ],
)
def test_what_the_fast_path_declines_fastavro_answers(path, value):
    record = mutated(path, value)
    assert _core.encode_record(FAST.header, record) is None
    try:
        want = fastavro_bytes(FAST.header, record)
    except Exception:
        want = None
    if want is not None:  # written by fastavro's own rules, e.g. a 2**64 key as a double
        return
    with pytest.raises(Exception):  # noqa: B017 - fastavro's own error, whatever it is
        fastavro_bytes(FAST.header, record)


def test_codec_encode_falls_back_and_keeps_its_errors():
    ev = stored([1], range(4), 4, extra_keys=[(2**64,)])
    batch = EventBatch(WorkerId("w"), 1, 0, 0, (ev,))
    data = codec.encode(batch)
    assert data == fastavro_bytes(FAST.header, codec.batch_to_record(batch))
    (key,) = codec.decode(data).events[0].extra_keys[0]
    assert isinstance(key, float) and math.isclose(key, 2.0**64)
    # fastavro writes an int field's value past 32 bits as is: so does encode, as before.
    wide = EventBatch(WorkerId("w", dp_rank=2**31), 1, 0, 0, ())
    assert codec.encode(wide) == fastavro_bytes(FAST.header, codec.batch_to_record(wide))
    with pytest.raises(EncodeError):
        codec.encode(EventBatch(WorkerId("w", dp_rank="0"), 1, 0, 0, ()))


def test_other_versions_are_fastavros():
    batch = EventBatch(WorkerId("w"), 1, 0, 0, (stored([1, 2], range(8), 4),))
    for v, sv in codec.VERSIONS.items():
        buf = io.BytesIO()
        buf.write(sv.header)
        fastavro.schemaless_writer(buf, sv.parsed, codec.batch_to_record(batch))
        assert codec.encode(batch, v) == buf.getvalue()


# ---------------------------------------------------------------- encode_batch: from the batch itself


@SETTINGS
@given(batches(), st.sampled_from(HEADERS))
def test_a_batch_read_as_objects_is_its_dicts_bytes_or_declined(batch, header):
    fast = _core.encode_batch(header, batch)
    if fast is not None:
        assert fast == fastavro_bytes(header, codec.batch_to_record(batch))
    assert codec.encode(batch) == fastavro_bytes(FAST.header, codec.batch_to_record(batch))


U64S = st.lists(st.integers(0, 2**64 - 1), max_size=6)


@st.composite
def producer_batches(draw):
    """What kvwire's sources publish: int hashes below 2^64, token ids from ``stored``, no
    extra keys; any optional field set or not."""

    def opt(s):
        return st.none() | s

    evs = []
    for _ in range(draw(st.integers(0, 4))):
        hashes = draw(U64S)
        kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
        if kind == "stored":
            bs = draw(st.sampled_from([1, 16]))
            evs.append(
                stored(
                    hashes,
                    draw(st.lists(st.integers(0, 2**32 - 1), min_size=len(hashes) * bs, max_size=len(hashes) * bs)),
                    bs,
                    parent_block_hash=draw(opt(st.integers(0, 2**64 - 1))),
                    lora_id=draw(opt(st.integers(0, 2**40))),
                    medium=draw(opt(st.sampled_from(["GPU", "CPU"]))),
                    lora_name=draw(opt(st.text(max_size=6))),
                    group_idx=draw(opt(st.integers(0, 3))),
                    kv_cache_spec_kind=draw(opt(st.just("sliding_window"))),
                    kv_cache_spec_sliding_window=draw(opt(st.integers(1, 4096))),
                    locality=draw(opt(st.just("LOCAL"))),
                    ownership=draw(opt(st.text(max_size=6))),
                    session_id=draw(opt(st.text(max_size=6))),
                )
            )
        elif kind == "removed":
            evs.append(BlockRemoved(tuple(hashes), medium=draw(opt(st.just("GPU"))), group_idx=draw(opt(st.just(1)))))
        else:
            evs.append(AllBlocksCleared())
    return EventBatch(
        WorkerId(draw(st.text(min_size=1, max_size=8)), draw(st.integers(0, 8)), 0, 1, draw(st.text(max_size=4))),
        draw(st.integers(0, 2**62)),
        draw(st.integers(0, 2**62)),
        draw(st.integers(0, 2**62)),
        tuple(evs),
        engine_ts=draw(opt(st.floats(allow_nan=False))),
        reset=draw(st.booleans()),
        gap=draw(st.integers(0, 2**40)),
        source=draw(st.sampled_from(["", "vllm-zmq-bridge"])),
    )


@SETTINGS
@given(producer_batches(), st.sampled_from(HEADERS))
def test_what_producers_publish_is_never_declined(batch, header):
    """The sender's cost on the engine's GIL depends on it: the dict's way is ~3x the CPU."""
    fast = _core.encode_batch(header, batch)
    assert fast is not None, "declined a batch kvwire's sources publish"
    assert fast == fastavro_bytes(header, codec.batch_to_record(batch))


@pytest.mark.parametrize("hashes", [[True, 2], [np.uint64(2**64 - 1), 3], []])
def test_hashes_the_codec_packs_as_u64_are_packed_by_the_one_core_rule_both_ways(hashes):
    """``codec.pack_hashes``' U64 case is ``_core.pack_u64``: what it takes (anything ``struct``'s Q
    took, e.g. a bool or a NumPy integer) the batch path takes too, with the dict's bytes."""
    batch = EventBatch(WorkerId("w"), 1, 0, 0, (stored(hashes, range(4 * len(hashes)), 4),))
    assert codec.pack_hashes(tuple(hashes))[0] == "U64"
    fast = _core.encode_batch(FAST.header, batch)
    assert fast is not None
    assert fast == fastavro_bytes(FAST.header, codec.batch_to_record(batch))


class _Subclassed(BlockStored):
    pass


@pytest.mark.parametrize(
    "event",
    [
        stored([1, -1], range(8), 4),  # I64 hashes
        stored([1], range(4), 4, parent_block_hash=-2),  # an I64 parent
        stored([b"x" * 32], range(4), 4),  # digests
        stored([1], range(4), 4, extra_keys=[("a", 1)]),
        BlockRemoved((2**64,)),
        _Subclassed((1,), None, array("I", range(4)), 4),
    ],
)
def test_what_encode_batch_declines_the_dicts_way_answers(event):
    batch = EventBatch(WorkerId("w"), 1, 0, 0, (event,))
    assert _core.encode_batch(FAST.header, batch) is None
    try:
        want = fastavro_bytes(FAST.header, codec.batch_to_record(batch))
    except EncodeError:  # the codec's own refusal, which encode keeps
        with pytest.raises(EncodeError):
            codec.encode(batch)
        return
    assert codec.encode(batch) == want
