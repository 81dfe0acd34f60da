"""One stable u64 per worker instance: the id routers that speak Dynamo's shapes key workers by.

kvwire names a worker by its ``instance_id`` string (and its DP ranks under it); Dynamo and the
routers built on its shapes name an instance by an integer, with ``{worker_id: {dp_rank: ...}}``
under it. The id must be the same on every surface (``/v1/streams``, ``/query``, ``/workers``,
``/dump``), on every member and across restarts, so it is a function of the name alone: an
``instance_id`` that already is a decimal integer below 2^63 (what a Dynamo-launched engine is
given) is that integer, any other is its XXH3-64 (the core's) with the top bit cleared, so that it
survives every JSON reader as a non-negative integer.
"""

from __future__ import annotations

from .keys import xxh3_64

MAX_WORKER_ID = (1 << 63) - 1


def worker_id(instance_id: str) -> int:
    if instance_id.isascii() and instance_id.isdigit() and (instance_id == "0" or instance_id[0] != "0"):
        n = int(instance_id)
        if n <= MAX_WORKER_ID:
            return n
    return xxh3_64(instance_id.encode(), 0) & MAX_WORKER_ID
