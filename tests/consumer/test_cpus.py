"""Where a member's threads run (`kvwire.consumer.cpus`): ingest on one CPU, the HTTP loops on
the others, background threads anywhere; and `kvwire index` placing its own threads that way."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from polling import free_port
from processes import Process, http_json

from kvwire.consumer.cpus import CpuSplit
from kvwire.consumer.http import HttpWorkers

ALLOWED = frozenset(os.sched_getaffinity(0))
# This machine's split; with one CPU allowed (no split to make), that CPU in every role, so the
# placement tests still run, and pin where the OS lets them.
SPLIT = CpuSplit.here() or CpuSplit(ALLOWED, ALLOWED, ALLOWED)


def test_one_cpu_is_ingests_and_the_rest_serve():
    s = CpuSplit.of([5, 2, 7])
    assert s is not None
    assert (s.ingest, s.serving, s.every) == ({7}, {2, 5}, {2, 5, 7})
    assert CpuSplit.of({0, 1}) == CpuSplit(frozenset({1}), frozenset({0}), frozenset({0, 1}))
    # Nothing to split: every thread runs where the OS puts it.
    assert CpuSplit.of({3}) is None
    assert CpuSplit.of([]) is None
    assert CpuSplit.here() == CpuSplit.of(ALLOWED)


def test_a_refused_placement_warns_and_leaves_the_thread_where_it_was(caplog):
    """A member must serve even where the OS refuses to pin (a sandbox, a changed cpuset)."""
    nowhere = frozenset({max(ALLOWED) + 4096})  # a CPU this process may not use
    s = CpuSplit(nowhere, nowhere, nowhere)

    def place():
        return s.pin_ingest(), s.pin_serving(), os.sched_getaffinity(0)

    with caplog.at_level("WARNING", logger="kvwire.consumer.cpus"):
        assert _in_thread(place) == (False, False, ALLOWED)
    assert "not placed" in caplog.text


def _in_thread(fn):
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_pinning_moves_only_the_calling_thread():
    s = SPLIT

    def ingest():
        s.pin_ingest()
        mine = os.sched_getaffinity(0)
        s.unpin()
        return mine, os.sched_getaffinity(0)

    assert _in_thread(ingest) == (s.ingest, s.every)
    assert _in_thread(lambda: (s.pin_serving(), os.sched_getaffinity(0))[1]) == s.serving
    assert os.sched_getaffinity(0) == ALLOWED


def test_threads_ingests_loop_starts_run_anywhere():
    """A new thread inherits its creator's CPUs: without `install`, a snapshot written through
    `asyncio.to_thread` from ingest's loop would compete with ingest on its one CPU."""
    s = SPLIT

    def run():
        async def main():
            s.install(asyncio.get_running_loop())
            s.pin_ingest()
            here = os.sched_getaffinity(0)
            there = await asyncio.to_thread(os.sched_getaffinity, 0)
            return here, there

        return asyncio.run(main())

    assert _in_thread(run) == (s.ingest, s.every)


async def test_http_loops_answer_from_the_serving_cpus():
    s = SPLIT

    def make() -> web.Application:
        app = web.Application()

        async def where(_req: web.Request) -> web.Response:
            return web.json_response(sorted(os.sched_getaffinity(0)))

        app.router.add_get("/where", where)
        return app

    workers = HttpWorkers(make, "127.0.0.1", 0, 2, on_caller_loop=False, cpus=s)
    port = await workers.start()
    try:
        async with aiohttp.ClientSession() as c:
            for _ in range(4):  # connections spread over both loops
                async with c.get(f"http://127.0.0.1:{port}/where", headers={"Connection": "close"}) as r:
                    assert await r.json() == sorted(s.serving)
    finally:
        await workers.cleanup()
    assert os.sched_getaffinity(0) == ALLOWED  # the caller's thread stays where it was


def _threads(pid: int) -> dict[int, frozenset[int]]:
    """Each thread of ``pid``: the CPUs it may run on (/proc's Cpus_allowed_list)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
        cpus: set[int] = set()
        for part in line.split(":", 1)[1].strip().split(","):
            a, _, b = part.partition("-")
            cpus.update(range(int(a), int(b or a) + 1))
        out[int(task.name)] = frozenset(cpus)
    return out


@pytest.mark.integration
@pytest.mark.parametrize("flag", [[], ["--no-cpu-split"]])
def test_kvwire_index_places_its_threads(kafka_bootstrap, new_topic, tmp_path, flag):
    port = free_port()
    p = Process.kvwire(
        ["index", "-b", kafka_bootstrap, "-t", new_topic(), "--http", f"127.0.0.1:{port}", "--no-snapshots", *flag],
        tmp_path / "index.log",
    )
    try:
        deadline = time.monotonic() + 60
        while not _healthy(port):  # ingest started: the threads are placed
            assert p.alive(), p.tail()
            assert time.monotonic() < deadline, p.tail()
            time.sleep(0.2)
        threads = _threads(p.proc.pid)
        split = CpuSplit.of(ALLOWED)
        while "kvwire index: group" not in p.tail():  # its start line, printed once ingest runs
            assert time.monotonic() < deadline, p.tail()
            time.sleep(0.1)
        said = "ingest on CPU" in p.tail()
        if flag or split is None:
            assert set(threads.values()) == {ALLOWED}, threads
            assert not said, p.tail()
        else:
            assert f"ingest on CPU {min(split.ingest)}" in p.tail(), p.tail()
            # The main thread runs ingest's loop; the HTTP loop is one of the others.
            assert threads[p.proc.pid] == split.ingest, threads
            assert split.serving in threads.values(), threads
            assert set(threads.values()) <= {split.ingest, split.serving, split.every}, threads
    finally:
        p.stop()


def _healthy(port: int) -> bool:
    try:
        return http_json("GET", f"http://127.0.0.1:{port}/healthz", timeout=2)[0] == 200
    except OSError:  # not listening yet
        return False
