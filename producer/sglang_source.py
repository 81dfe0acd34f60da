"""SGLang's KV events -> kvwire: SGLang's wire decoded at the edge, then the ZMQ bridge.

SGLang (``sglang/srt/disaggregation/kv_events.py``, 0.5.23) publishes with a
``ZmqEventPublisher`` whose transport is vLLM's: live frames ``[topic, seq (8
bytes BE), payload]``, seq from 0 per process (no epoch), a ROUTER replay socket
answering ``[b"", start]`` with ``[b"", topic, seq, payload]`` frames and
``[b"", b"", -1, b""]``, one publisher per independent KV cache (port = base +
DP rank). So the bridge's whole trust machine (``ZmqBridge``: sync from the
replay socket, gaps, restarts, liveness) applies unchanged; only the payload
differs, and it is decoded here, never by vLLM's decoder, which would accept an
SGLang batch and silently drop what differs:

* ``BlockStored`` carries ``cache_salt`` as its own field (vLLM puts the salt in
  the first block's ``extra_keys``). Dropping it would let one tenant's prompt
  match another's blocks, so a store that starts a sequence (no parent) gets
  the salt as its first block's extra keys, the form the index and ``/v1/score``
  use for vLLM; a store with a parent inherits it through the chain.
* Block hashes are signed int64 (``hash_str_to_int64``); kept as ids.
* ``block_size`` is the page size, and the last page of a radix node can be
  shorter: such a page comes as its own event with ``block_size`` = its length.
* Media: ``GPU``, ``CPU_PINNED`` (host memory: kvwire's ``CPU``), ``DISK``
  (``STORAGE``), ``EXTERNAL`` (a shared pool, kept as is).
* EAGLE bigram pages carry token *pairs*: not a token sequence kvwire can key,
  so such a batch is undecodable and reported as a lost batch (a gap).
* ``lora_id`` is always None; ``lora_name`` is set only for adapters SGLang
  knows the name of. An ``extra_key`` namespace without a LoRA name is not in
  the event at all (see docs/engines/sglang.md).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec

from kvwire.schemas.events import CPU, GPU, STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, token_array

from .vllm_wire import UnknownEventType, WireBatch, WireError
from .zmq_bridge import ZmqBridge

log = logging.getLogger(__name__)

SOURCE = "sglang-zmq"
# SGLang's StorageMedium values -> kvwire media; others (EXTERNAL, future tiers) kept as sent.
MEDIA = {"GPU": GPU, "CPU_PINNED": CPU, "CPU": CPU, "DISK": STORAGE}


class _Stored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[int]
    medium: str | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    attn_dp_rank: int | None = None


_DEC = msgspec.msgpack.Decoder(_Batch)
_ANY = msgspec.msgpack.Decoder()
_KNOWN = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


def medium(m: str | None) -> str | None:
    return None if m is None else MEDIA.get(m, m)


def _convert(ev: Any) -> KVEvent:
    if isinstance(ev, _Stored):
        if ev.block_size < 0 or any(type(h) is bool for h in ev.block_hashes):
            raise WireError("BlockStored: negative block_size or boolean hash")
        try:
            tokens = token_array(ev.token_ids)
        except ValueError as e:
            raise WireError(f"BlockStored: {e}") from None
        extra = None
        if ev.cache_salt is not None and ev.parent_block_hash is None and ev.block_hashes:
            extra = ((ev.cache_salt,),) + (None,) * (len(ev.block_hashes) - 1)
        return BlockStored(
            tuple(ev.block_hashes),
            ev.parent_block_hash,
            tokens,
            ev.block_size,
            ev.lora_id,
            medium(ev.medium),
            ev.lora_name,
            extra,
            session_id=ev.session_id,
        )
    if isinstance(ev, _Removed):
        return BlockRemoved(tuple(ev.block_hashes), medium(ev.medium))
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> WireBatch:
    """One SGLang payload -> WireBatch (``data_parallel_rank`` = SGLang's ``attn_dp_rank``).
    Raises WireError (UnknownEventType for an unknown tag) only."""
    try:
        raw = _DEC.decode(payload)
    except msgspec.DecodeError as e:
        raise _diagnose(payload, e) from None
    except Exception as e:  # a decoder bug must still surface as the typed error
        raise WireError(f"undecodable payload: {type(e).__name__}: {e}") from None
    return WireBatch(raw.ts, [_convert(ev) for ev in raw.events], raw.attn_dp_rank)


def _diagnose(payload: bytes, first: Exception) -> WireError:
    try:
        obj = _ANY.decode(payload)
    except msgspec.DecodeError as e:
        return WireError(f"not msgpack: {e}")
    if isinstance(obj, list) and len(obj) >= 2 and isinstance(obj[1], list):
        for i, ev in enumerate(obj[1]):
            tag = ev.get("type") if isinstance(ev, dict) else None
            if isinstance(tag, str) and tag not in _KNOWN:
                return UnknownEventType(f"event {i}: unknown event type {tag!r}")
    return WireError(f"not an SGLang KV-event batch: {first}")


# ------------------------------------------------------------ into the bridge

# The bridge decodes vLLM's wire; an SGLang payload is re-encoded into it after our decode.
# A payload we could not decode becomes one the bridge cannot decode either, so the bridge
# counts it lost and reports the gap, exactly as for a bad vLLM payload.
_ENC = msgspec.msgpack.Encoder()
UNDECODABLE = b"\xc1"  # a byte msgpack never uses


def _vllm_event(ev: KVEvent) -> dict[str, Any]:
    if isinstance(ev, BlockStored):
        d: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(ev.block_hashes),
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": ev.token_ids.tolist(),
            "block_size": ev.block_size,
            "lora_id": ev.lora_id,
            "medium": ev.medium,
            "lora_name": ev.lora_name,
        }
        if ev.extra_keys is not None:
            d["extra_keys"] = [None if k is None else list(k) for k in ev.extra_keys]
        if ev.session_id is not None:
            d["session_id"] = ev.session_id
        return d
    if isinstance(ev, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": ev.medium}
    return {"type": "AllBlocksCleared"}


def to_vllm_payload(payload: bytes) -> tuple[bytes, str | None]:
    """An SGLang payload in vLLM's map shape, or (UNDECODABLE, why)."""
    try:
        b = decode_batch(payload)
    except WireError as e:
        return UNDECODABLE, e.reason
    return _ENC.encode([b.ts, [_vllm_event(e) for e in b.events], b.data_parallel_rank]), None


class SglangBridge(ZmqBridge):
    """``ZmqBridge`` over an SGLang publisher: same sockets, trust rules and records;
    payloads decoded by SGLang's wire format (module doc)."""

    def _deliver_many(self, items: Sequence[tuple[int, bytes]]) -> None:
        out = []
        for seq, payload in items:
            vllm_payload, why = to_vllm_payload(payload)
            if why is not None:
                # The bridge counts the frame bad and the batch lost when it meets UNDECODABLE.
                self.stats.last_error = f"sglang: {why}"
                log.warning("undecodable SGLang batch %d: %s", seq, why)
            out.append((seq, vllm_payload))
        super()._deliver_many(out)


__all__ = ["MEDIA", "SOURCE", "UNDECODABLE", "SglangBridge", "decode_batch", "medium", "to_vllm_payload"]
