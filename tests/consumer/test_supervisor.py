"""The supervisor alone (``consumer/supervision.py``): a snapshot store that keeps failing makes
the member unhealthy after ``failure_limit`` rounds in a row, and one success heals it; a
supervised task that ends unasked marks it too. (Through a real broker and HTTP:
tests/faults/test_supervision.py.)"""

from __future__ import annotations

import asyncio

from kvwire.consumer.apply import Applier
from kvwire.consumer.supervision import Supervisor


async def _until(cond, what: str) -> None:
    for _ in range(2000):  # a bound against hanging, not a timing assertion
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


async def test_failing_snapshots_make_the_member_unhealthy_until_one_succeeds():
    sup = Supervisor(Applier(), heartbeat_timeout_s=60)
    stopping = asyncio.Event()
    calls = {"n": 0, "fail": True}

    async def save() -> None:
        calls["n"] += 1
        if calls["fail"]:
            raise OSError("store down")

    loop = asyncio.create_task(sup.snapshot_loop(save, lambda: True, stopping, 0.001, 0.001, 3, 5.0))
    try:
        await _until(lambda: calls["n"] >= 2, "two failed rounds")
        assert sup.healthy, "fewer failures than the limit leave it healthy"
        await _until(lambda: sup.failure is not None, "the third failure")
        assert "snapshots_failing" in sup.failure and "store down" in sup.failure
        assert sup.failed.is_set()
        calls["fail"] = False
        await _until(lambda: sup.healthy, "a successful round")
        assert not sup.failed.is_set()
    finally:
        stopping.set()
        await loop


async def test_a_supervised_task_that_ends_unasked_is_a_failure_and_one_stopped_is_not():
    sup = Supervisor(Applier(), heartbeat_timeout_s=60)
    stopping = asyncio.Event()

    async def quits() -> None:
        return None

    t = asyncio.create_task(quits())
    sup.watch("ingest", t, stopping)
    assert await asyncio.wait_for(sup.wait_failed(), 10) == "ingest_task_dead: ingest task returned"

    calm = Supervisor(Applier(), heartbeat_timeout_s=60)
    stopping.set()
    t = asyncio.create_task(quits())
    calm.watch("snapshots", t, stopping)
    await t
    await asyncio.sleep(0)  # done callbacks run on the next loop turn
    assert calm.healthy
