"""A kvwire process's start-up heap, frozen out of the garbage collector once it is up.

Why: the collector's full passes hold the GIL for as long as they take, and they traverse
every tracked object, the tens of thousands a process's imports and setup leave (aiokafka,
aiohttp, NumPy, the CLI): in ``kvwire index`` ~62k objects and ~22 ms a pass on this project's
2-CPU machine, in the middle of ingest's loop and every HTTP thread's score; in a bridge, in
its sender's turn. ``gc.freeze`` moves those objects to a generation no pass reads, so a pass
reads only what was made since. vLLM's engine core does the same after its own start-up
(``vllm.utils.gc_utils.freeze_gc_heap``).

What it costs: a reference cycle among the frozen objects is never collected. They are the
process's modules and long-lived setup, not garbage in the making.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left as garbage, then freeze the rest; returns the objects
    frozen. Call once the process is serving (every loop, thread and app made)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
