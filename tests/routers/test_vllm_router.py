"""vllm-router 0.1.17 ``--policy kv_aware``, subscribed to kvwire's event streams instead of the
engines' sockets, routes each prompt to the worker the engines' caches say holds its longest
prefix: started after the events, after an engine died, and restarted after more than 10,000
batches (past what vLLM's own replay ring keeps).

The backends vllm-router forwards to are tiny HTTP fakes that answer with their own name: no
engine can run on a machine without an accelerator, and routing is decided before forwarding.
Everything else is real: the engines' records go through kvwire's publisher and a real broker
to a ``kvwire index --event-streams`` process, and the router is the released binary."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from polling import free_port, wait_for
from router_procs import IndexProcess, Proc, http_json, wait_http
from routing_fleet import E0, RANKS, WORKERS, build, churn, expected, stream_seq, stream_state, topic_sync

pytestmark = pytest.mark.integration

MODEL = "m"


class FakeWorkers:
    """One OpenAI-style HTTP backend per worker; a completion answers with the worker's name."""

    def __init__(self, names: list[str]) -> None:
        self.servers = {}
        for name in names:
            srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(name))
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            self.servers[name] = srv
        self.url = {n: f"http://127.0.0.1:{s.server_address[1]}" for n, s in self.servers.items()}

    def close(self) -> None:
        for s in self.servers.values():
            s.shutdown()
            s.server_close()


def _handler(name: str) -> type[BaseHTTPRequestHandler]:
    class H(BaseHTTPRequestHandler):
        def _json(self, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._json({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._json(
                {
                    "id": "c",
                    "object": "text_completion",
                    "model": MODEL,
                    "choices": [{"index": 0, "text": name, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )

        def log_message(self, *a: object) -> None:
            pass

    return H


@pytest.fixture
def fakes() -> Iterator[FakeWorkers]:
    f = FakeWorkers([w for w, _ in WORKERS])
    yield f
    f.close()


def start_router(binary: str, index: IndexProcess, fakes: FakeWorkers) -> tuple[Proc, str]:
    port = free_port()
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware"]
    cmd += ["--kv-event-model", MODEL, "--kv-event-block-size", "16", "--worker-urls", *fakes.url.values()]
    for s in index.streams():
        url = fakes.url[s["instance_id"]]
        cmd += [
            "--kv-event-source",
            f"{url}={s['endpoint']}",
            "--kv-event-replay-source",
            f"{url}={s['replay_endpoint']}",
        ]
    proc = Proc(cmd, "vllm-router")
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/health", proc)
    return proc, base


# vllm-router credits at most len(prompt) - 1 cached tokens (the engine recomputes the last one),
# so a prompt that is exactly its held blocks would tie with a worker holding one block less: the
# prompts sent carry a partial block more, which no cache holds.
TAIL = [1, 2, 3, 4, 5]


def routed(base: str, tokens: list[int]) -> str:
    prompt = tokens + TAIL
    status, body = http_json(base + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert status == 200, body
    return body["choices"][0]["text"]


def check(base: str, fleet, want: dict[int, tuple[str, int]], router: Proc, probes: list[int] = ()) -> None:
    try:
        _check(base, fleet, want, list(probes))
    except AssertionError as e:
        raise AssertionError(f"{e}\nvllm-router's log:\n{router.tail()}") from None


def _check(base: str, fleet, want: dict[int, tuple[str, int]], probes: list[int]) -> None:
    # The router reads each stream in the background, and a replay it asked for brings a
    # worker's state at once, so what it credits only grows towards the truth: each prompt (the
    # ``probes``, whose answer a change made, first) is waited for until it routes as the caches
    # say, then every prompt must still, in one pass (a router that passed through states the
    # workers were never in would have moved one back).
    for p in [*probes, *want]:
        wait_for(lambda p=p: routed(base, fleet.prompts[p]) == want[p][0], f"vllm-router learned prompt {p}")
    got = {p: routed(base, fleet.prompts[p]) for p in want}
    assert got == {p: w[0] for p, w in want.items()}


def test_vllm_router_routes_by_kvwire_streams(kafka_bootstrap, vllm_router_bin, fakes, procs):
    with topic_sync(kafka_bootstrap) as t:
        fleet = build(kafka_bootstrap, t)
        index = IndexProcess(kafka_bootstrap, t, heartbeat_timeout_s=3.0)
        procs.append(index)
        wait_for(lambda: len(index.streams()) == len(WORKERS), "a stream per worker")
        router, base = start_router(vllm_router_bin, index, fakes)
        procs.append(router)
        want = expected(fleet)
        assert len(want) >= 10, want
        check(base, fleet, want, router)

        # An engine dies: kvwire expires it and clears its stream; the router stops crediting it.
        fleet.pubs["e2"].close()
        wait_for(lambda: ("e2", 0, 0) not in index.ranks(), "kvwire expired e2")
        alive = [w for w in WORKERS if w[0] != "e2"]
        want_alive = expected(fleet, alive)
        moved = [p for p in want_alive if want[p] == ("e2", 0)]
        assert moved, "some prompt's best holder was e2"
        check(base, fleet, want_alive, router, moved)

        # Restarted after more than 10,000 batches of one stream (vLLM's ring would have lost its start).
        router.stop()
        churn(fleet, E0, 10_200)
        last = fleet.rank(E0).stats().next_seq - 1
        wait_for(lambda: index.ranks()[("e0", 0, 0)]["last_seq"] >= last, "kvwire applied the churn", timeout=120)
        e0 = next(s for s in index.streams() if s["instance_id"] == "e0")
        assert stream_seq(e0) > 10_000
        assert stream_state(e0) == fleet.truth(RANKS)[("e0", 0)]
        router, base = start_router(vllm_router_bin, index, fakes)
        procs.append(router)
        check(base, fleet, expected(fleet, alive), router)
        for p in fleet.pubs.values():
            p.close()
