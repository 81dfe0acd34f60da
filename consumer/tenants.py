"""What separates one tenant's cache from another's in a query: ``cache_salt`` and ``extra_keys``.

vLLM 0.33 folds them into every block hash and publishes them, untagged, in each BlockStored's
``extra_keys``: one entry per block, each a tuple of the LoRA name (every block, when a LoRA is
set), ``(mm identifier, offset)`` pairs, the ``cache_salt`` (first block only) and the
prompt-embeds digest (``kv_cache_utils.generate_block_hash_extra_keys`` and
``to_event_extra_keys``). The index keys a block with its extra keys
(``rust/src/keys.rs``, the same code for stored blocks and queries), so a query must name the same ones to match: a
prompt under one salt never matches blocks stored under another, or under none.

A query gives them in that same per-block form (JSON arrays stand for tuples: the key
encoding treats a list and a tuple alike), plus ``cache_salt`` as its own field, which this
module appends to the first block's keys, where vLLM puts it. An empty salt is no salt, as in
vLLM (``if request.cache_salt``). What JSON cannot carry (the prompt-embeds digest is bytes)
cannot be asked for over HTTP; the in-process API takes any value the key encoding does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# One block's keys hold a LoRA name, a few (mm identifier, offset) pairs, a salt and a digest:
# far fewer than this. The bound keeps a hostile request from making the key encoding walk a
# huge or deeply nested value.
MAX_KEYS_PER_BLOCK = 256
MAX_DEPTH = 3
_SCALARS = (str, int, float, bool, bytes, type(None))


class TenantError(ValueError):
    """``cache_salt`` or ``extra_keys`` outside the form vLLM publishes."""


def _check_value(v: Any, depth: int, where: str) -> None:
    if isinstance(v, _SCALARS):
        return
    if isinstance(v, list | tuple):
        if depth >= MAX_DEPTH:
            raise TenantError(f"{where}: nested deeper than {MAX_DEPTH}")
        if len(v) > MAX_KEYS_PER_BLOCK:
            raise TenantError(f"{where}: more than {MAX_KEYS_PER_BLOCK} values")
        for x in v:
            _check_value(x, depth + 1, where)
        return
    raise TenantError(f"{where}: {type(v).__name__} is not a key value (str, int, float, bool, null or array)")


def check_extra_keys(extra_keys: Any, nblocks_max: int | None = None) -> None:
    """Raise ``TenantError`` unless ``extra_keys`` is None or one entry per block, each None or an
    array of key values."""
    if extra_keys is None:
        return
    if not isinstance(extra_keys, list | tuple):
        raise TenantError(f"extra_keys must be an array (one entry per block), got {type(extra_keys).__name__}")
    if nblocks_max is not None and len(extra_keys) > nblocks_max:
        raise TenantError(f"extra_keys has {len(extra_keys)} entries; the prompt has at most {nblocks_max} blocks")
    for i, block in enumerate(extra_keys):
        if block is None:
            continue
        if not isinstance(block, list | tuple):
            raise TenantError(f"extra_keys[{i}] must be an array of keys or null, got {type(block).__name__}")
        _check_value(block, 1, f"extra_keys[{i}]")


def check_cache_salt(cache_salt: Any) -> None:
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TenantError(f"cache_salt must be a string, got {type(cache_salt).__name__}")


def tenant_extra_keys(
    extra_keys: Sequence[Any] | None, cache_salt: str | None, lora_name: str | None = None
) -> list[Any] | None:
    """Per-block extra keys of a query: the caller's, with ``cache_salt`` appended to block 0's.

    With a LoRA, block 0 gets the LoRA name in front unless it already starts with it: the
    index drops one leading LoRA name from a block's keys (``keys::normalized`` in the core), so a salt
    equal to the LoRA name must not be the one dropped."""
    if not cache_salt:
        return None if extra_keys is None else list(extra_keys)
    out = list(extra_keys) if extra_keys is not None else []
    first = tuple(out[0]) if out and out[0] is not None else ()
    if lora_name is not None and (not first or first[0] != lora_name):
        first = (lora_name, *first)
    first = (*first, cache_salt)
    if out:
        out[0] = first
    else:
        out.append(first)
    return out


__all__ = ["TenantError", "check_cache_salt", "check_extra_keys", "tenant_extra_keys"]
