"""vLLM's KV-event wire, encoded: what the event streams send (``consumer.event_streams``).

The layout is vLLM's own (``vllm/distributed/kv_events.py``, 0.26 and later): a batch is the
positional msgpack array ``[ts, events, data_parallel_rank]``; events are maps tagged with
``"type"`` (the class name), their required fields always present, optional ones omitted when
None. These structs declare the same fields, in vLLM's order, with the same msgspec options, so
a router written against vLLM decodes them as vLLM's; tests/consumer/test_vllm_events.py holds
them to vLLM's own decoder. kvwire does not import vLLM here: a member serving streams must not
need an engine installed.

Block hashes go out as unsigned 64-bit ints, as vLLM sends them by default: kvwire's keys (the
routers' v1 sequence hashes, docs/DESIGN.md), which a router uses as block ids while it hashes
``token_ids`` for matching.
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode(batch: Batch) -> bytes:
    return _encoder.encode(batch)


__all__ = ["AllBlocksCleared", "Batch", "BlockRemoved", "BlockStored", "Event", "encode"]
