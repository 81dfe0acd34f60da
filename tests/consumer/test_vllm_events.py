"""kvwire's encoding of vLLM's KV-event wire is vLLM's: vLLM's own decoder (vllm 0.33) reads what
``consumer.vllm_events`` writes, field for field, and the msgpack holds the same values as what
vLLM's own classes encode for the same events (optional fields omitted when None, as vLLM does;
only map header widths differ: vLLM's 16-field BlockStored always writes a map16 header)."""

from __future__ import annotations

import msgspec
import pytest
from ci_env import require

from kvwire.consumer import vllm_events as ours

kv = require("vllm.distributed.kv_events")

HUGE = (1 << 64) - 5  # vLLM's default int hashes are unsigned 64-bit


def _ours() -> ours.Batch:
    return ours.Batch(
        1.5,
        [
            ours.AllBlocksCleared(),
            ours.BlockStored([HUGE, 7], None, list(range(32)), 16, None, "GPU", None),
            ours.BlockStored(
                [9], HUGE, list(range(16)), 16, None, "CPU", "ad1", [("ad1", ("mm", 3))], 2, "sliding_window", 128
            ),
            ours.BlockRemoved([7, HUGE], "GPU"),
            ours.BlockRemoved([9], "CPU", 2),
        ],
        3,
    )


def _vllm() -> object:
    return kv.KVEventBatch(
        ts=1.5,
        events=[
            kv.AllBlocksCleared(),
            kv.BlockStored(
                block_hashes=[HUGE, 7],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            kv.BlockStored(
                block_hashes=[9],
                parent_block_hash=HUGE,
                token_ids=list(range(16)),
                block_size=16,
                lora_id=None,
                medium="CPU",
                lora_name="ad1",
                extra_keys=[("ad1", ("mm", 3))],
                group_idx=2,
                kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=128,
            ),
            kv.BlockRemoved(block_hashes=[7, HUGE], medium="GPU"),
            kv.BlockRemoved(block_hashes=[9], medium="CPU", group_idx=2),
        ],
        data_parallel_rank=3,
    )


def test_the_values_are_vllms() -> None:
    assert msgspec.msgpack.decode(ours.encode(_ours())) == msgspec.msgpack.decode(msgspec.msgpack.encode(_vllm()))


def test_vllms_decoder_reads_every_field() -> None:
    dec = msgspec.msgpack.Decoder(type=kv.KVEventBatch)
    got = dec.decode(ours.encode(_ours()))
    assert got == dec.decode(msgspec.msgpack.encode(_vllm()))
    assert got.events[1].block_hashes[0] == HUGE


@pytest.mark.parametrize("rank", [0, 5])
def test_an_empty_batch_is_a_heartbeat_vllm_reads(rank: int) -> None:
    got = msgspec.msgpack.Decoder(type=kv.KVEventBatch).decode(ours.encode(ours.Batch(2.0, [], rank)))
    assert got.events == [] and got.data_parallel_rank == rank
