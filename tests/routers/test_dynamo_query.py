"""kvwire's Dynamo API against Dynamo itself: the same engines' events, two indexers, one answer.

Three real vLLM engines (``KVCacheManager`` on CPU, LRU eviction, vLLM's own ``ZmqEventPublisher``:
tests/vllm_engine.py) publish their KV events. The real ``python -m dynamo.indexer`` (ai-dynamo
1.6.1) subscribes to them directly, registered with their replay endpoints. ``kvwire bridge``
forwards each to Kafka and ``kvwire index`` serves Dynamo's API from the topic. Engine 12 runs half
its requests under a LoRA adapter; engine 11 offloads to a CPU tier (what vLLM's offloading
connector publishes: medium "CPU" stores of blocks it copies, removals when its LRU evicts), so
two tiers are compared. Every prompt is asked of both with ``POST /query``; the answers, device
tier per worker and DP rank and every cumulative tier per instance, must be equal, and kvwire's
device tier must equal what the engine's own block pool holds.

Differences that are Dynamo's, not kvwire's, are asserted as such at the end: a prompt whose
salt vLLM publishes in the first block's ``extra_keys`` is indexed unsalted by Dynamo (routers.md).
"""

from __future__ import annotations

import random
import time
import types
from collections import OrderedDict
from pathlib import Path

import pytest
from ci_env import require
from polling import free_port, wait_for
from processes import Process, http_json
from vllm_engine import BS, Engine, Workload

pytestmark = [pytest.mark.vllm, pytest.mark.integration, pytest.mark.timeout(900)]

MODEL = "m"
PROMPTS = 240
LORA = "adapter-1"


class OffloadingEngine(Engine):
    """An engine with a CPU tier: every block the GPU stores is copied there (once), and the tier
    evicts least recently stored blocks beyond ``cpu_blocks``, as events say it does."""

    def __init__(self, *a, cpu_blocks: int = 150, **kw) -> None:
        super().__init__(*a, **kw)
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self.cpu_blocks = cpu_blocks

    def step(self) -> None:
        ke = self._ke
        events = self.mgr.take_events()
        extra = []
        for e in events:
            if not isinstance(e, ke.BlockStored):
                continue
            parent = e.parent_block_hash
            for i, bh in enumerate(e.block_hashes):
                if bh not in self.cpu:
                    tok = e.token_ids[i * BS : (i + 1) * BS]
                    extra.append(
                        ke.BlockStored(
                            block_hashes=[bh],
                            parent_block_hash=parent,
                            token_ids=tok,
                            block_size=BS,
                            lora_id=e.lora_id,
                            medium="CPU",
                            lora_name=e.lora_name,
                            extra_keys=None if e.extra_keys is None else [e.extra_keys[i]],
                        )
                    )
                self.cpu[bh] = None
                self.cpu.move_to_end(bh)
                parent = bh
        evicted = []
        while len(self.cpu) > self.cpu_blocks:
            evicted.append(self.cpu.popitem(last=False)[0])
        if evicted:
            extra.append(ke.BlockRemoved(block_hashes=evicted, medium="CPU"))
            self.removed += len(evicted)
        self.removed += sum(len(e.block_hashes) for e in events if isinstance(e, ke.BlockRemoved))
        if events or extra:
            self.pub.publish(ke.KVEventBatch(ts=time.time(), events=[*events, *extra]))
            self.batches += 1


def test_query_answers_equal_dynamos_over_the_same_events(kafka_bootstrap, new_topic, tmp_path: Path):
    require("dynamo.llm")
    require("vllm.distributed.kv_events")
    from vllm.lora.request import LoRARequest

    h = types.SimpleNamespace(require=require, wait_for=wait_for)
    topic = new_topic(partitions=3)
    ids = ("11", "12", "13")
    ports = {i: (free_port(), free_port()) for i in ids}
    engines = {
        "11": OffloadingEngine(h, *ports["11"], num_blocks=80, topic=""),
        "12": Engine(h, *ports["12"], num_blocks=80, topic=""),
        "13": Engine(h, *ports["13"], num_blocks=64, topic=""),
    }
    lora = LoRARequest(LORA, 1, "/nonexistent/adapter")
    procs: list[Process] = []
    try:
        dyn_port = free_port()
        dyn = Process.python_module(
            "dynamo.indexer", ["--port", str(dyn_port), "--block-size", str(BS), "--threads", "1"], tmp_path / "dyn.log"
        )
        procs.append(dyn)
        dyn_url = f"http://127.0.0.1:{dyn_port}"
        wait_for(lambda: _up(dyn_url + "/workers"), f"dynamo.indexer to listen ({dyn.tail()})", timeout=120)
        for i in ids:
            p, r = ports[i]
            status, _ = http_json(
                "POST",
                dyn_url + "/register",
                {
                    "instance_id": int(i),
                    "endpoint": f"tcp://127.0.0.1:{p}",
                    "replay_endpoint": f"tcp://127.0.0.1:{r}",
                    "model_name": MODEL,
                    "block_size": BS,
                },
            )
            assert status == 201
        kv_url = start_kvwire(kafka_bootstrap, topic, ports, tmp_path, procs)
        # Dynamo's subscriptions: a store it misses before its SUB connects would be a difference
        # of the test's making. Its listeners say when they are up.
        wait_for(
            lambda: all(
                all(lst["status"] == "active" for lst in w["listeners"].values())
                for w in http_json("GET", dyn_url + "/workers")[1]
            ),
            "Dynamo's listeners",
        )
        time.sleep(1.0)

        rng = random.Random(7)
        loads = {i: Workload(seed) for i, seed in zip(ids, (1, 2, 3), strict=True)}
        # Engine 13 serves engine 12's system prompts too: two workers share prefixes.
        loads["13"].systems = loads["12"].systems[:2] + loads["13"].systems[2:]
        for _ in range(70):
            for i in ids:
                p = loads[i].prompt()
                engines[i].serve(p, lora if i == "12" and rng.random() < 0.5 else None)
                loads[i].served.append(p)
        for e in engines.values():
            e.wait_sent(h)
        queries: list[tuple[list[int], str | None]] = []
        for n in range(PROMPTS):
            i = ids[n % len(ids)]
            q = loads[i].queries(1)[0]
            queries.append((q, LORA if i == "12" and rng.random() < 0.5 else None))

        def ask(url: str, q: list[int], lname: str | None, salt: str | None = None) -> dict:
            body = {"token_ids": q, "model_name": MODEL, **({"lora_name": lname} if lname else {})}
            if salt:
                body["cache_salt"] = salt
            status, out = http_json("POST", url + "/query", body)
            assert status == 200, out
            return out

        def differences() -> list[tuple[int, dict, dict]]:
            out = []
            for n, (q, lname) in enumerate(queries):
                a, b = ask(kv_url, q, lname), ask(dyn_url, q, lname)
                if a != b:
                    out.append((n, a, b))
            return out

        # Both read the same events at their own pace: compare once both have caught up.
        deadline = time.monotonic() + 60
        diff = differences()
        while diff and time.monotonic() < deadline:
            time.sleep(1.0)
            diff = differences()
        assert not diff, f"{len(diff)} of {len(queries)} prompts differ; first: {diff[0]}"

        # The check has teeth: many prompts hit, on both tiers, under LoRA too, and the device tier
        # is the engines' own truth.
        hits = cpu_only = lora_hits = 0
        for q, lname in queries:
            got = ask(kv_url, q, lname)
            hits += bool(got["scores"])
            cpu_only += any(o["cpu"] > o["gpu"] for o in got["instances"].values())
            lora_hits += bool(lname and got["scores"])
            for i, e in engines.items():
                held = e.held_blocks(q, lora if lname else None) * BS
                assert got["scores"].get(i, {}).get("0", 0) == held, (i, q[:4], got)
        assert hits >= PROMPTS // 3 and cpu_only >= 5 and lora_hits >= 10, (hits, cpu_only, lora_hits)
        assert all(e.removed for e in engines.values()), "every engine ran full and evicted"
        assert engines["11"].removed > engines["11"].cpu_blocks // 4, "the CPU tier evicted too"

        # Dynamo's difference, not kvwire's: vLLM publishes a salt in the first block's extra_keys;
        # kvwire keys the blocks by it, Dynamo 1.6.1 indexes them unsalted.
        salted = [rng.randrange(40_000, 50_000) for _ in range(5 * BS)]  # tokens no engine served before
        engines["13"].serve(salted, salt="tenant-a")
        engines["13"].wait_sent(h)
        want = engines["13"].held_blocks(salted, salt="tenant-a") * BS
        assert want == 5 * BS
        wait_for(lambda: ask(kv_url, salted, None, "tenant-a")["scores"].get("13") == {"0": want}, "kvwire")
        assert "13" not in ask(kv_url, salted, None)["scores"], "kvwire: unsalted prompts never match salted blocks"
        wait_for(lambda: ask(dyn_url, salted, None)["scores"].get("13") == {"0": want}, "Dynamo's unsalted copy")
        assert "13" not in ask(dyn_url, salted, None, "tenant-a")["scores"], "Dynamo: the salted query misses"
    finally:
        for p in reversed(procs):
            p.stop()
        for e in engines.values():
            e.shutdown()


def start_kvwire(
    bootstrap: str, topic: str, ports: dict[str, tuple[int, int]], tmp: Path, procs: list[Process], *index_args: str
) -> str:
    """``kvwire bridge`` per engine and one ``kvwire index``, as an operator starts them; returns the
    index's URL once it trusts every engine."""
    for i, (p, r) in ports.items():
        procs.append(
            Process.kvwire(
                ["bridge", "-b", bootstrap, "-t", topic, "--instance-id", i, "--model", MODEL]
                + ["--zmq-endpoint", f"tcp://127.0.0.1:{p}", "--replay-endpoint", f"tcp://127.0.0.1:{r}"],
                tmp / f"bridge-{i}.log",
            )
        )
    port = free_port()
    index = Process.kvwire(
        ["index", "-b", bootstrap, "-t", topic, "--http", f"127.0.0.1:{port}", "--no-snapshots", *index_args],
        tmp / "index.log",
    )
    procs.append(index)
    url = f"http://127.0.0.1:{port}"

    def knows_all() -> bool:
        status, body = http_json("GET", url + "/v1/workers") if _up(url + "/healthz") else (0, {})
        return status == 200 and sum(w["trusted"] for w in body["workers"]) == len(ports)

    wait_for(knows_all, f"kvwire to trust every engine ({index.tail()})", timeout=120)
    return url


def test_select_service_loads_kvwires_dump_and_picks_the_holder(kafka_bootstrap, new_topic, tmp_path: Path):
    """``dynamo.select_service --indexer-peers <kvwire>`` starts after the engines served their
    traffic, recovers from kvwire's ``/dump``, and selects for each prompt a worker holding its
    longest cached prefix, with that prefix as its overlap. Its workers are registered with an
    events endpoint nobody publishes on, so what it knows is what the dump told it."""
    require("dynamo.llm")
    from streams_fleet import free_base

    h = types.SimpleNamespace(require=require, wait_for=wait_for)
    topic = new_topic(partitions=2)
    ids = ("21", "22")
    ports = {i: (free_port(), free_port()) for i in ids}
    engines = {i: Engine(h, *ports[i], num_blocks=72, topic="") for i in ids}
    procs: list[Process] = []
    try:
        kv_url = start_kvwire(
            kafka_bootstrap, topic, ports, tmp_path, procs, "--event-streams", f"127.0.0.1:{free_base()}"
        )
        loads = {i: Workload(seed) for i, seed in zip(ids, (4, 5), strict=True)}
        loads["22"].systems = loads["21"].systems[:3] + loads["22"].systems[3:]
        for _ in range(60):
            for i in ids:
                p = loads[i].prompt()
                engines[i].serve(p)
                loads[i].served.append(p)
        for e in engines.values():
            e.wait_sent(h)
        queries = [loads[ids[n % 2]].queries(1)[0] for n in range(120)]
        truth = [{i: e.held_blocks(q) * BS for i, e in engines.items()} for q in queries]

        def kvwire_caught_up() -> bool:
            for q, t in zip(queries, truth, strict=True):
                got = http_json("POST", kv_url + "/query", {"token_ids": q, "model_name": MODEL})[1]
                if {i: got["scores"].get(i, {}).get("0", 0) for i in ids} != t:
                    return False
            return True

        wait_for(kvwire_caught_up, "kvwire to hold what the engines hold")
        status, dump = http_json("GET", kv_url + "/dump")
        assert status == 200 and list(dump) == [f"{MODEL}:default"] and dump[f"{MODEL}:default"]["block_size"] == BS

        sel_port = free_port()
        sel = Process.python_module(
            "dynamo.select_service",
            ["--port", str(sel_port), "--threads", "1", "--indexer-peers", kv_url],
            tmp_path / "select.log",
        )
        procs.append(sel)
        sel_url = f"http://127.0.0.1:{sel_port}"
        wait_for(lambda: _up(sel_url + "/workers"), f"select_service to start ({sel.tail()})", timeout=120)
        assert "recovery from peer succeeded" in sel.log.read_text(errors="replace")
        for i in ids:
            status, body = http_json(
                "POST",
                sel_url + "/workers",
                {
                    "worker_id": int(i),
                    "model_name": MODEL,
                    "endpoint": f"http://127.0.0.1:1/{i}",
                    "block_size": BS,
                    "kv_events_endpoint": f"tcp://127.0.0.1:{free_port()}",
                },
            )
            assert status == 201 and body["lifecycle"] == "schedulable", body
        picked_by_prefix = 0
        for q, t in zip(queries, truth, strict=True):
            status, got = http_json("POST", sel_url + "/select", {"model_name": MODEL, "token_ids": q})
            assert status == 200, got
            best = max(t.values())
            assert got["overlap"]["gpu"] == best, (q[:4], t, got)
            if best:
                assert t[str(got["worker_id"])] == best, (t, got)
                picked_by_prefix += len({v for v in t.values()}) > 1
        assert picked_by_prefix >= 20, "prompts where the holders differ, so the pick had to use the dump"
    finally:
        for p in reversed(procs):
            p.stop()
        for e in engines.values():
            e.shutdown()


def _up(url: str) -> bool:
    try:
        http_json("GET", url, timeout=2)
        return True
    except OSError:
        return False


async def test_dynamo_indexer_peers_loads_kvwires_dump_with_both_tiers(tmp_path: Path):
    """``python -m dynamo.indexer --peers <kvwire>`` starts from kvwire's ``/dump`` and answers
    ``/query`` exactly as kvwire does, the host tier included."""
    import asyncio

    require("dynamo.llm")
    from kvwire.consumer.apply import Applier
    from kvwire.consumer.http import bound_port, make_app, serve
    from kvwire.consumer.stream_table import StreamTable
    from kvwire.schemas.events import EventBatch, WorkerId, stored

    applier = Applier()
    table = StreamTable(applier.index)
    rng = random.Random(3)
    prompts = [[rng.randrange(30_000) for _ in range(6 * BS)] for _ in range(4)]
    for n, (inst, blocks, medium) in enumerate(
        (("31", 6, "GPU"), ("32", 2, "GPU"), ("32", 5, "CPU"), ("33", 3, "GPU"))
    ):
        seq = 0 if medium == "GPU" else 1
        events = tuple(
            stored([n * 1000 + p * 10 + i for i in range(blocks)], prompts[p][: blocks * BS], BS, medium=medium)
            for p in range(len(prompts))
            if (p + n) % 3
        )
        batch = EventBatch(WorkerId(inst, 0, 0, 1, MODEL), 1, seq, seq, events, reset=seq == 0)
        applier.apply_batch(batch)
        table.observe(batch)
    table.refresh()
    runner = await serve(make_app(applier, lambda: True, block_table=table), "127.0.0.1", 0)
    kv_url = f"http://127.0.0.1:{bound_port(runner)}"
    port = free_port()
    dyn = Process.python_module(
        "dynamo.indexer", ["--port", str(port), "--threads", "1", "--peers", kv_url], tmp_path / "dyn.log"
    )
    try:
        dyn_url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(wait_for, lambda: _up(dyn_url + "/workers"), f"dynamo.indexer ({dyn.tail()})", 120)
        assert "recovery from peer succeeded" in dyn.log.read_text(errors="replace")
        host_hits = 0
        for p in prompts:
            body = {"token_ids": p, "model_name": MODEL}
            ours = await asyncio.to_thread(http_json, "POST", kv_url + "/query", body)
            theirs = await asyncio.to_thread(http_json, "POST", dyn_url + "/query", body)
            assert ours == theirs and ours[0] == 200
            host_hits += any(o["cpu"] > o["gpu"] for o in ours[1]["instances"].values())
        assert host_hits >= 1
    finally:
        dyn.stop()
        await runner.cleanup()
