"""vLLM's KV-event msgpack wire format -> kvwire events.

A batch is the positional array ``[ts, events, data_parallel_rank]`` (the rank
is omitted when None). Events come in two shapes, one per vLLM era:

* positional arrays before vLLM 0.26 (PR #42892):
  ``["BlockStored", hashes, parent, tokens, block_size, lora_id, medium,
  lora_name, extra_keys, group_idx, ...]`` with trailing optional fields left
  off when None;
* tagged maps from 0.26 on: ``{"type": "BlockStored", ...}`` with optional
  fields omitted when None.

Both are decoded with typed msgspec decoders (the map shape first: it is what
current engines send). A batch mixes no shapes, so a failed typed decode of the
whole batch is retried in the other shape before anything is reported.

Fields kvwire does not carry (e.g. 0.33's ``lookahead_token_ids``) and map
keys a future vLLM adds are dropped: they are not part of the contract and
must not make a newer engine's batches undecodable.

Medium policy: GPU/CPU/STORAGE in any case are upper-cased (DESIGN: the
well-known tiers are normalised so "cpu" from LMCache and "CPU" from vLLM's
offloader are one tier); any other medium is kept exactly as the engine sent
it, because it is an open set ("CPU_PINNED", "DISK", "FS", ...) whose spelling
is the only identity it has.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, token_array

_WELL_KNOWN_MEDIA = {"GPU", "CPU", "STORAGE"}


class WireError(ValueError):
    """A payload that is not a vLLM KV-event batch kvwire understands."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class UnknownEventType(WireError):
    """An event tag this decoder does not know (a newer engine, or garbage)."""


def normalize_medium(medium: Any) -> str | None:
    """Engine medium -> kvwire medium (see module doc for the policy).

    Accepts a torch.device (LMCache puts one there) without importing torch:
    anything with a string ``type`` attribute is read as its device type.
    """
    if medium is None:
        return None
    if not isinstance(medium, str):
        dev_type = getattr(medium, "type", None)
        medium = dev_type if isinstance(dev_type, str) else str(medium)
    up = medium.upper()
    return up if up in _WELL_KNOWN_MEDIA else medium


# ------------------------------------------------------------ wire structs
# Hash values are int | bytes; msgspec keeps uint64 >= 2^63 as Python ints.
_Hash = int | bytes


class _MapStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _MapRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


class _ArrStored(_MapStored, array_like=True, tag="BlockStored"):
    pass


class _ArrRemoved(_MapRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _ArrCleared(_MapCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapStored | _MapRemoved | _MapCleared]
    data_parallel_rank: int | None = None


class _ArrBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrStored | _ArrRemoved | _ArrCleared]
    data_parallel_rank: int | None = None


_MAP_DEC = msgspec.msgpack.Decoder(_MapBatch)
_ARR_DEC = msgspec.msgpack.Decoder(_ArrBatch)
_ANY_DEC = msgspec.msgpack.Decoder()
_KNOWN_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class WireBatch(NamedTuple):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None


# ------------------------------------------------------------ conversion


def _tupled(v: Any) -> Any:
    # msgpack has no tuple: (mm_identifier, offset) pairs arrive as lists.
    return tuple(_tupled(x) for x in v) if isinstance(v, list) else v


def _check_hashes(hashes: list, what: str) -> None:
    for h in hashes:
        # bool is an int subclass; a bool hash is a corrupt payload, not a hash.
        if type(h) is bool:
            raise WireError(f"{what}: boolean block hash")


def _convert(ev: Any) -> KVEvent:
    if isinstance(ev, _MapStored):
        _check_hashes(ev.block_hashes, "BlockStored")
        try:
            tokens = token_array(ev.token_ids)
        except ValueError as e:
            raise WireError(f"BlockStored: {e}") from None
        if ev.block_size < 0:
            raise WireError(f"BlockStored: negative block_size {ev.block_size}")
        extra = None if ev.extra_keys is None else tuple(None if k is None else _tupled(k) for k in ev.extra_keys)
        return BlockStored(
            tuple(ev.block_hashes),
            ev.parent_block_hash,
            tokens,
            ev.block_size,
            ev.lora_id,
            normalize_medium(ev.medium),
            ev.lora_name,
            extra,
            ev.group_idx,
            ev.kv_cache_spec_kind,
            ev.kv_cache_spec_sliding_window,
            ev.locality,
            ev.ownership,
            ev.session_id,
        )
    if isinstance(ev, _MapRemoved):
        _check_hashes(ev.block_hashes, "BlockRemoved")
        return BlockRemoved(
            tuple(ev.block_hashes), normalize_medium(ev.medium), ev.group_idx, ev.locality, ev.ownership
        )
    return AllBlocksCleared()


def _diagnose(payload: bytes, first: Exception) -> WireError:
    """Why neither typed decoder accepted the payload, as precisely as we can tell."""
    try:
        obj = _ANY_DEC.decode(payload)
    except msgspec.DecodeError as e:
        return WireError(f"not msgpack: {e}")
    if not isinstance(obj, list) or len(obj) not in (2, 3):
        return WireError(f"batch is not [ts, events, dp_rank]: {type(obj).__name__}")
    events = obj[1]
    if not isinstance(events, list):
        return WireError(f"batch events is a {type(events).__name__}, not an array")
    for i, ev in enumerate(events):
        tag = ev.get("type") if isinstance(ev, dict) else (ev[0] if isinstance(ev, list) and ev else None)
        if isinstance(tag, str) and tag not in _KNOWN_TAGS:
            return UnknownEventType(f"event {i}: unknown event type {tag!r}")
        if tag is None:
            return WireError(f"event {i}: neither a tagged map nor a tagged array")
    return WireError(f"malformed batch: {first}")


def decode_batch(payload: bytes) -> WireBatch:
    """One ZMQ payload -> WireBatch. Raises WireError (or UnknownEventType) only."""
    raw: _MapBatch | _ArrBatch
    try:
        raw = _MAP_DEC.decode(payload)
    except msgspec.DecodeError as e1:  # ValidationError is a DecodeError
        try:
            raw = _ARR_DEC.decode(payload)
        except msgspec.DecodeError:
            raise _diagnose(payload, e1) from None
    except Exception as e:  # a decoder bug must still surface as the typed error
        raise WireError(f"undecodable payload: {type(e).__name__}: {e}") from None
    return WireBatch(raw.ts, [_convert(ev) for ev in raw.events], raw.data_parallel_rank)


__all__ = ["UnknownEventType", "WireBatch", "WireError", "decode_batch", "normalize_medium"]


# ------------------------------------------------------------ in-process objects


def event_from_object(ev: Any) -> KVEvent:
    """An engine's in-process event object -> kvwire event, by duck typing.

    Used where events never crossed a wire: vLLM's ``BlockStored`` structs handed
    out by a KV connector, and LMCache's ``CacheStoreEvent`` (same fields as
    ``BlockStored``). Matching on the class name keeps vLLM/LMCache imports out
    of this module. Raises WireError for anything else.
    """
    name = type(ev).__name__
    try:
        if name in ("BlockStored", "CacheStoreEvent"):
            hashes = list(ev.block_hashes)
            _check_hashes(hashes, name)
            extra = getattr(ev, "extra_keys", None)
            if extra is not None:
                extra = tuple(None if k is None else _tupled(list(k)) for k in extra)
            return BlockStored(
                tuple(hashes),
                ev.parent_block_hash,
                token_array(ev.token_ids),
                int(ev.block_size),
                getattr(ev, "lora_id", None),
                normalize_medium(getattr(ev, "medium", None)),
                getattr(ev, "lora_name", None),
                extra,
                getattr(ev, "group_idx", None),
                getattr(ev, "kv_cache_spec_kind", None),
                getattr(ev, "kv_cache_spec_sliding_window", None),
                getattr(ev, "locality", None),
                getattr(ev, "ownership", None),
                getattr(ev, "session_id", None),
            )
        if name == "BlockRemoved":
            hashes = list(ev.block_hashes)
            _check_hashes(hashes, name)
            return BlockRemoved(
                tuple(hashes),
                normalize_medium(getattr(ev, "medium", None)),
                getattr(ev, "group_idx", None),
                getattr(ev, "locality", None),
                getattr(ev, "ownership", None),
            )
        if name == "AllBlocksCleared":
            return AllBlocksCleared()
    except WireError:
        raise
    except Exception as e:
        raise WireError(f"{name}: {type(e).__name__}: {e}") from None
    raise UnknownEventType(f"unknown event object {name}")


__all__.append("event_from_object")
