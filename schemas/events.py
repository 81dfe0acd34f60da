"""The typed event model both sides share.

The types are frozen ``msgspec.Struct``s rather than dataclasses: a frozen
dataclass costs ~4.5 us to build with 14 fields, a Struct ~0.5 us, and the
consumer builds one per decoded event. Use ``msgspec.structs.replace`` to copy
with changes.

These are the only types that cross module boundaries: engine adapters
(vLLM msgpack, LMCache) build them, the codec turns them into Avro and back,
the index applies them. Field names and meanings follow vLLM's
``vllm/distributed/kv_events.py`` so an engine's event maps one to one.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec.structs import force_setattr as _force

# A block hash as engines emit it: an unsigned 64-bit int (vLLM default), a
# possibly negative Python int (LMCache), or a digest (vLLM with int hashes off).
BlockHash = int | bytes
# One block's extra hash keys: LoRA name, (mm identifier, offset) pairs,
# cache_salt, prompt-embeds digest. Values are str/int/float/bool/bytes/None or
# a tuple of those.
ExtraKeys = tuple[object, ...]

# array is generic only to type checkers before Python 3.12; msgspec evaluates annotations at run time.
if TYPE_CHECKING:
    TokenArray = array[int]
else:
    TokenArray = array

GPU = "GPU"
CPU = "CPU"
STORAGE = "STORAGE"


def token_array(token_ids: Iterable[int]) -> TokenArray:
    """Token ids as a packed uint32 array: the form the codec and index use.

    Packing once here lets the index hash raw bytes instead of Python ints.
    """
    if isinstance(token_ids, array) and token_ids.typecode == "I":
        return token_ids
    try:
        return array("I", token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be ints in [0, 2^32): {e}") from None


class WorkerId(msgspec.Struct, frozen=True):
    """Who emits a stream of batches.

    A *worker* — (instance_id, dp_rank) — is what a router sends requests to.
    It runs ``tp_size`` tensor-parallel ranks; each rank publishes its own
    stream (own epoch and sequence), and the index counts a block for the
    worker only once every rank holds it.
    """

    instance_id: str
    dp_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    model: str = ""

    @property
    def worker(self) -> tuple[str, int]:
        """The routing unit: all TP ranks of one engine share it."""
        return (self.instance_id, self.dp_rank)

    @property
    def rank(self) -> tuple[str, int, int]:
        """The stream identity: epochs and sequences are per rank."""
        return (self.instance_id, self.dp_rank, self.tp_rank)

    def kafka_key(self) -> bytes:
        """Record key. TP ranks share it so one worker lives in one partition
        and a single consumer sees every rank it must aggregate."""
        return f"{self.instance_id}/{self.dp_rank}".encode()


class BlockStored(msgspec.Struct, frozen=True):
    """The worker now holds these blocks, in chain order."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    # Tokens of all blocks concatenated; len == block_size * len(block_hashes)
    # for a well-formed event (LMCache violates this; its adapter repairs it).
    token_ids: TokenArray
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block hash when present.
    extra_keys: tuple[ExtraKeys | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block_hashes, tuple):
            _force(self, "block_hashes", tuple(self.block_hashes))
        if not (isinstance(self.token_ids, array) and self.token_ids.typecode == "I"):
            _force(self, "token_ids", token_array(self.token_ids))
        if self.extra_keys is not None and not isinstance(self.extra_keys, tuple):
            _force(self, "extra_keys", tuple(self.extra_keys))


class BlockRemoved(msgspec.Struct, frozen=True):
    """The worker no longer holds these blocks on ``medium``."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block_hashes, tuple):
            _force(self, "block_hashes", tuple(self.block_hashes))


class AllBlocksCleared(msgspec.Struct, frozen=True):
    """The worker dropped every block it held (vLLM ``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True):
    """One Kafka record: a rank's events plus what a durable log needs.

    vLLM's own batch has only a timestamp and a DP rank; ``epoch``, ``seq``,
    ``reset`` and ``gap`` let a consumer that reads the log at any time tell
    a complete view of a rank from an incomplete one.
    """

    worker: WorkerId
    epoch: int
    seq: int
    ts_us: int
    events: tuple[KVEvent, ...] = ()
    engine_ts: float | None = None
    # First record of an epoch: the rank holds nothing before these events.
    reset: bool = False
    # Batches lost since the previous record; >0 makes the rank untrusted
    # until its next reset.
    gap: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.events, tuple):
            _force(self, "events", tuple(self.events))

    @property
    def is_heartbeat(self) -> bool:
        return not self.events and not self.reset and not self.gap

    def block_count(self) -> int:
        return sum(len(e.block_hashes) for e in self.events if not isinstance(e, AllBlocksCleared))


def stored(
    block_hashes: Sequence[BlockHash],
    token_ids: Iterable[int],
    block_size: int,
    parent_block_hash: BlockHash | None = None,
    **kw: Any,
) -> BlockStored:
    """Keyword-friendly constructor for tests, simulators and adapters."""
    return BlockStored(tuple(block_hashes), parent_block_hash, token_array(token_ids), block_size, **kw)


__all__ = [
    "CPU",
    "GPU",
    "STORAGE",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVEvent",
    "WorkerId",
    "stored",
    "token_array",
]
