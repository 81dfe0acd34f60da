"""freeze_startup_heap: start-up's garbage collected, the rest out of every later full pass,
and what is made afterwards still collected. In a child interpreter: a freeze is for the life
of its process, and this one runs every other test."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import gc, weakref
    from kvwire.heap import freeze_startup_heap

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    kept = [Node() for _ in range(1000)]
    garbage = cycle()          # unreachable already: start-up's garbage
    n = freeze_startup_heap()
    assert garbage() is None, "start-up's garbage was frozen instead of collected"
    assert n == gc.get_freeze_count() and n >= 1000, n
    gen2 = {id(o) for o in gc.get_objects(2)}
    assert not any(id(o) in gen2 for o in kept), "a frozen object is still read by full passes"
    later = cycle()            # made after the freeze: collected as ever
    gc.collect()
    assert later() is None, "garbage made after the freeze was not collected"
    print("ok", n)
    """
)


def test_startup_heap_is_frozen_after_its_garbage_goes_and_later_garbage_still_goes():
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.startswith("ok ")
