"""vLLM msgpack wire -> kvwire events: both event shapes, hash forms, medium policy, typed errors."""

from __future__ import annotations

import msgspec
import pytest

from kvwire.producer.vllm_wire import (
    UnknownEventType,
    WireError,
    decode_batch,
    event_from_object,
    normalize_medium,
)
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, stored

BIG = (1 << 64) - 5  # vLLM's default int hashes are unsigned 64-bit, often >= 2^63
enc = msgspec.msgpack.encode


def positional_stored(hashes, parent, tokens, block_size, lora_id=None, medium="GPU", lora_name=None, *tail):
    """A pre-0.26 BlockStored: array_like msgspec struct, tag first, trailing Nones omitted."""
    return ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium, lora_name, *tail]


def test_positional_shape_pre_026():
    payload = enc(
        [
            12.5,
            [
                positional_stored([BIG, 7], None, list(range(32)), 16),
                positional_stored(
                    [9],
                    7,
                    list(range(32, 48)),
                    16,
                    None,
                    "cpu",
                    "adapter",
                    [["adapter", ["mm-hash", 3]]],
                    1,
                    "sliding_window",
                    128,
                ),
                ["BlockRemoved", [BIG], "GPU"],
                ["BlockRemoved", [b"\x01" * 32], "CPU_PINNED", 2],
                ["AllBlocksCleared"],
            ],
            3,
        ]
    )
    b = decode_batch(payload)
    assert b.ts == 12.5 and b.data_parallel_rank == 3
    assert b.events == [
        stored([BIG, 7], range(32), 16, None, medium="GPU"),
        stored(
            [9],
            range(32, 48),
            16,
            7,
            medium="CPU",
            lora_name="adapter",
            extra_keys=(("adapter", ("mm-hash", 3)),),
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=128,
        ),
        BlockRemoved((BIG,), "GPU"),
        BlockRemoved((b"\x01" * 32,), "CPU_PINNED", 2),
        AllBlocksCleared(),
    ]


def test_positional_shape_before_lora_name_and_without_dp_rank():
    # Oldest shape: no lora_name, batch with the None dp rank omitted.
    b = decode_batch(enc([1.0, [["BlockStored", [1], None, [5, 6], 2, None, "GPU"]]]))
    assert b.data_parallel_rank is None
    assert b.events == [stored([1], [5, 6], 2, medium="GPU")]


def test_map_shape_with_omitted_optionals_and_unknown_keys():
    ev = {
        "type": "BlockStored",
        "block_hashes": [b"\xaa" * 32],
        "parent_block_hash": b"\xbb" * 32,
        "token_ids": [1, 2, 3, 4],
        "block_size": 4,
        "lora_id": None,
        "medium": "storage",
        "lora_name": None,
        "locality": "REMOTE",
        "session_id": "s1",
        "lookahead_token_ids": [[9]],
        "a_future_field": {"x": 1},
    }
    b = decode_batch(enc([2.0, [ev, {"type": "AllBlocksCleared"}], 0]))
    assert b.events == [
        stored([b"\xaa" * 32], [1, 2, 3, 4], 4, b"\xbb" * 32, medium="STORAGE", locality="REMOTE", session_id="s1"),
        AllBlocksCleared(),
    ]


@pytest.mark.vllm
def test_real_vllm_structs_round_trip(h):
    """Encoded by vLLM's own msgspec structs (0.26+ map shape)."""
    ke = h.require("vllm.distributed.kv_events")
    batch = ke.KVEventBatch(
        ts=3.25,
        events=[
            ke.BlockStored(
                block_hashes=[BIG, 7],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[("a",), None],
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            ),
            ke.BlockRemoved(block_hashes=[7], medium="GPU"),
            ke.AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )
    b = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert b.ts == 3.25 and b.data_parallel_rank == 1
    assert b.events == [
        stored(
            [BIG, 7],
            range(32),
            16,
            medium="GPU",
            extra_keys=(("a",), None),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockRemoved((7,), "GPU"),
        AllBlocksCleared(),
    ]
    # The same objects handed over in-process (connector path) convert identically.
    assert [event_from_object(e) for e in batch.events] == b.events


@pytest.mark.parametrize(
    "given,want",
    [
        ("gpu", "GPU"),
        ("GPU", "GPU"),
        ("cpu", "CPU"),
        ("Storage", "STORAGE"),
        ("CPU_PINNED", "CPU_PINNED"),
        ("disk", "disk"),
        ("FS", "FS"),
        (None, None),
    ],
)
def test_medium_policy(given, want):
    assert normalize_medium(given) == want


def test_medium_from_a_device_object():
    class Device:  # stands in for torch.device: only `.type` is read
        type = "cpu"

    assert normalize_medium(Device()) == "CPU"


@pytest.mark.parametrize(
    "payload,err",
    [
        (b"\xc1", WireError),
        (b"", WireError),
        (enc({"ts": 1}), WireError),
        (enc([1.0, "nope"]), WireError),
        (enc([1.0, [{"type": "BlockTouched", "block_hashes": [1]}]]), UnknownEventType),
        (enc([1.0, [["BlockEvicted", [1]]]]), UnknownEventType),
        (enc([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]), WireError),
        (enc([1.0, [positional_stored([1], None, [-1], 1)]]), WireError),
        (enc([1.0, [positional_stored([1], None, [1 << 33], 1)]]), WireError),
        (enc([1.0, [positional_stored([True], None, [1], 1)]]), WireError),
        (enc([1.0, [positional_stored(["h"], None, [1], 1)]]), WireError),
        (enc([1.0, [{"no": "type"}]]), WireError),
    ],
)
def test_malformed_payloads_raise_the_typed_error(payload, err):
    with pytest.raises(err):
        decode_batch(payload)


def test_event_from_object_rejects_unknown():
    with pytest.raises(UnknownEventType):
        event_from_object(object())
