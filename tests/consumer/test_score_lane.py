"""The score lane answers a router's hot requests itself and everything else through aiohttp:
each answer is compared with plain aiohttp's (the same app served without the lane, the
oracle), over hand-written requests, pipelines across a hand-over, requests in pieces, and
heads that hypothesis makes up."""

from __future__ import annotations

import asyncio
import json
import socket

import numpy as np
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scoring_workload import fed, oracle_json, queries, records

from kvwire.consumer import score_lane
from kvwire.consumer.holds import Holds
from kvwire.consumer.http import bound_port, make_app, serve
from kvwire.consumer.http_security import HttpSecurity

MAX_BODY = 64 * 1024
MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def populated():
    return fed(records())


def le(tokens) -> bytes:
    return np.asarray(tokens, "<u4").tobytes()


def request(body: bytes, *headers: str, line: str = "POST /v1/score HTTP/1.1", length: bool = True) -> bytes:
    head = [line, "Host: 127.0.0.1", *headers]
    if length:
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


BIN = "Content-Type: application/octet-stream"
JSON = "Content-Type: application/json"


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, str, bytes] | None:
    """(status, content type, body) of one answer; None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    fields = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await reader.readexactly(int(fields.get("content-length", "0")))
    return status, fields.get("content-type", ""), body


async def exchange(
    port: int, raw: bytes, answers: int = 1, pieces: int = 0, wait_s: float = 10
) -> list[tuple[int, str, bytes] | str | None]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if pieces:
            for i in range(0, len(raw), pieces):
                writer.write(raw[i : i + pieces])
                await writer.drain()
        else:
            writer.write(raw)
        out: list[tuple[int, str, bytes] | str | None] = []
        for _ in range(answers):
            try:
                out.append(await asyncio.wait_for(read_answer(reader), wait_s))
            except TimeoutError:
                out.append("no answer")  # the server waits for more of the request
        return out
    finally:
        writer.close()


class Pair:
    """The same app twice over one index: on the lane (``serve``) and on plain aiohttp."""

    def __init__(
        self, applier, security: HttpSecurity | None = None, peers: list[str] | None = None, holds=None
    ) -> None:
        self.applier, self.security, self.peers, self.holds = applier, security, peers, holds

    async def __aenter__(self) -> Pair:
        def app() -> web.Application:
            return make_app(
                self.applier,
                lambda: True,
                max_tokens=MAX_TOKENS,
                max_body_bytes=MAX_BODY,
                security=self.security,
                peers=self.peers,
                holds=self.holds,
            )

        self.lane_runner = await serve(app(), "127.0.0.1", 0)
        assert isinstance(self.lane_runner, score_lane.LaneRunner)
        self.lane = bound_port(self.lane_runner)
        self.plain_runner = web.AppRunner(app(), access_log=None)
        await self.plain_runner.setup()
        await web.TCPSite(self.plain_runner, "127.0.0.1", 0).start()
        self.plain = bound_port(self.plain_runner)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.lane_runner.cleanup()
        await self.plain_runner.cleanup()

    async def both(self, raw: bytes, answers: int = 1, wait_s: float = 10):
        return await exchange(self.lane, raw, answers, wait_s=wait_s), await exchange(
            self.plain, raw, answers, wait_s=wait_s
        )

    async def on_lane(self, raw: bytes) -> bool:
        """Whether the lane, not aiohttp, answered ``raw`` (the connection is still a lane's)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.lane)
        try:
            writer.write(raw)
            await asyncio.wait_for(read_answer(reader), 10)
            return len(self.lane_runner.lanes) == 1
        finally:
            writer.close()
            await writer.wait_closed()
            for _ in range(100):  # the server sees the close on its next read
                if not self.lane_runner.lanes:
                    break
                await asyncio.sleep(0.01)


TOKENS = queries()[0][0]
HOT = [
    request(le(TOKENS), BIN),
    request(json.dumps({"token_ids": TOKENS}).encode(), JSON),
    request(json.dumps({"token_ids": TOKENS, "limit": 2}).encode(), "content-type: APPLICATION/JSON"),
    request(le(TOKENS), BIN, "Connection: keep-alive", "X-Anything: at all", "Authorization: Bearer ignored"),
    request(le(TOKENS), "content-type:application/octet-stream", "user-agent:\tx y\t"),
    request(b"", BIN),
    request(le(TOKENS), BIN, line="POST /v1/score?top_k=2 HTTP/1.1"),
    request(le(TOKENS), BIN, line="POST /v1/score?local=true&top_k=3&block_size=16 HTTP/1.1"),
    request(le(TOKENS), BIN, line="POST /v1/score?lora_name=a%20b&top_k=1&top_k=2 HTTP/1.1"),
    request(le(TOKENS), BIN, line="POST /v1/score? HTTP/1.1"),
]
HANDED_OVER = [
    request(le(TOKENS), BIN, line="POST /v1/score?top_k=0 HTTP/1.1"),  # the lane's check refuses it: 400
    request(le(TOKENS), BIN, line="POST /v1/score?tokens=1 HTTP/1.1"),
    request(le(TOKENS), BIN, line="POST /v1/score?top_k=2#frag HTTP/1.1"),
    request(le(TOKENS), BIN, line="POST /v1/score/ HTTP/1.1"),
    request(le(TOKENS), BIN, line="POST /v1/score HTTP/1.0"),
    request(le(TOKENS), BIN, "Connection: close"),
    request(le(TOKENS), "Content-Type: application/octet-stream; x=1"),
    request(le(TOKENS), BIN, "Content-Length: 5", length=False),
    request(b"\x01\x00\x00", BIN),
    request(le(range(MAX_TOKENS + 1)), BIN),
    request(b"{", JSON),
    request(b'{"token_ids": [1], "nope": 1}', JSON),
    request(b"x" * (MAX_BODY + 1), BIN),
    request(b"x" * MAX_BODY, BIN),
    request(b"", line="GET /v1/workers HTTP/1.1", length=False),
    request(b"", line="GET /healthz HTTP/1.1", length=False),
    request(le(TOKENS), "Content-Type: text/plain"),
    request(le(TOKENS), BIN, "Expect: 100-continue"),
    request(le(TOKENS), BIN, "Bad Header: x"),
    request(le(TOKENS), BIN, "Content-Length: 4", "Content-Length: 4", length=False),
    (
        b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % len(le(TOKENS)) + le(TOKENS) + b"\r\n0\r\n\r\n"
    ),
]


async def test_the_lane_answers_hot_requests_and_aiohttp_the_rest_the_same(populated):
    async with Pair(populated[0]) as p:
        for raw in HOT + HANDED_OVER:
            lane, plain = await p.both(raw)
            assert lane == plain, raw[:120]
            assert lane[0] is not None
        for raw in HOT:
            assert await p.on_lane(raw), raw[:120]
        for raw in HANDED_OVER:
            assert not await p.on_lane(raw), raw[:120]


async def test_with_peers_the_lane_answers_local_parts_and_aiohttp_scatters(populated):
    down = "http://127.0.0.1:9"  # a peer that refuses: the scatter's answer is partial
    async with Pair(populated[0], peers=[down]) as p:
        local = request(le(TOKENS), BIN, line="POST /v1/score?local=true&top_k=4 HTTP/1.1")
        whole = request(le(TOKENS), BIN)
        as_json = request(json.dumps({"token_ids": TOKENS, "local": True}).encode(), JSON)
        for raw, on_lane in ((local, True), (whole, False), (as_json, False)):
            a, b = await p.both(raw)
            assert a == b and a[0][0] == 200
            assert await p.on_lane(raw) is on_lane
        [(_, _, scattered)] = await exchange(p.lane, whole)
        assert json.loads(scattered)["failed_peers"] == [down]


async def test_the_core_answers_plain_requests_whole_and_the_lane_the_rest(populated, monkeypatch):
    """Token ids alone without a query string (binary, or JSON of ``token_ids`` only) are
    answered by ``_core.score_plain``; every other hot request, a body the binary rule
    refuses, JSON the core does not read (other fields, numbers msgspec reads its own way or
    refuses), and one not yet all read, by the general path. Either way the answer is
    aiohttp's, byte for byte."""
    answered: list[bytes] = []
    real = score_lane._core.score_plain

    def spy(*args):
        got = real(*args)
        if got is not None:
            answered.append(args[2][args[3] : got[1]])
        return got

    monkeypatch.setattr(score_lane._core, "score_plain", spy)
    plain = [
        request(le(TOKENS), BIN),
        request(le(TOKENS), BIN, line="POST /v1/score? HTTP/1.1"),
        request(le(TOKENS), "content-type:application/octet-stream", "Authorization: Bearer ignored"),
        request(b"", BIN),
        request(json.dumps({"token_ids": TOKENS}).encode(), JSON),
        request(b' {\n"token_ids" :[ %s ]\t} ' % ",".join(map(str, TOKENS)).encode(), "content-type: application/JSON"),
        request(b'{"token_ids":[]}', JSON),
    ]
    general = [
        request(le(TOKENS), BIN, line="POST /v1/score?top_k=2 HTTP/1.1"),
        request(json.dumps({"token_ids": TOKENS}).encode(), JSON, line="POST /v1/score?top_k=2 HTTP/1.1"),
        request(json.dumps({"token_ids": TOKENS, "limit": 2}).encode(), JSON),
        request(json.dumps({"limit": 2, "token_ids": TOKENS}).encode(), JSON),
        request(b'{"token_ids": [01]}', JSON),
        request(b'{"token_ids": [-0]}', JSON),
        request(b'{"token_ids": [1.0]}', JSON),
        request(b'{"token_ids": [4294967296]}', JSON),
        request(json.dumps({"token_ids": list(range(MAX_TOKENS + 1))}).encode(), JSON),
        request(b"\x01\x00\x00", BIN),
        request(le(range(MAX_TOKENS + 1)), BIN),
    ]
    async with Pair(populated[0]) as p:
        for raw in plain + general:
            answered.clear()
            lane, aio = await p.both(raw)
            assert lane == aio, raw[:120]
            assert answered == ([raw] if raw in plain else []), raw[:120]
        # Sent in two pieces: the core declines the first read, answers once the body is whole.
        answered.clear()
        [(status, _, _)] = await exchange(p.lane, plain[0], pieces=len(plain[0]) - 7)
        assert status == 200 and answered == [plain[0]]


async def test_a_live_hold_counts_in_the_lanes_answers(populated):
    """A route's hold credits its worker in scores until the worker's own events confirm it:
    the lane's answers to binary requests (with or without a query) count it as aiohttp's do."""
    async with Pair(populated[0], holds=Holds()) as p:
        plain = request(le(TOKENS), BIN)
        queried = request(le(TOKENS), BIN, line="POST /v1/score?top_k=8 HTTP/1.1")
        [(_, _, before)] = await exchange(p.lane, plain)
        routed = request(json.dumps({"token_ids": TOKENS}).encode(), JSON, line="POST /v1/route HTTP/1.1")
        [(status, _, picked)] = await exchange(p.lane, routed)
        assert status == 200, picked
        for raw in (plain, queried):
            lane, aio = await p.both(raw)
            assert lane == aio and lane[0][0] == 200
            assert await p.on_lane(raw)
        [(_, _, after)] = await exchange(p.lane, plain)
        assert after != before  # the hold counted


async def test_lane_answers_equal_the_oracle(populated):
    applier, oracle = populated
    async with Pair(applier) as p:
        for tokens, lora, bs in queries():
            query = "&".join(f"{k}={v}" for k, v in (("lora_name", lora), ("block_size", bs)) if v is not None)
            line = f"POST /v1/score{'?' + query if query else ''} HTTP/1.1"
            raw = request(le(tokens), BIN, line=line)
            [(status, ctype, body)] = await exchange(p.lane, raw)
            assert (status, ctype) == (200, "application/json")
            assert json.loads(body)["scores"] == oracle_json(oracle, tokens, lora, bs, 64)
            assert await p.on_lane(raw)


async def test_a_pipeline_is_answered_in_order_across_a_hand_over(populated):
    q = queries()
    pipeline = [request(le(q[0][0]), BIN), request(b"", line="GET /v1/digest HTTP/1.1", length=False)]
    pipeline += [request(le(q[1][0]), BIN), request(b"\x01", BIN), request(le(q[2][0]), BIN)]
    async with Pair(populated[0]) as p:
        lane = await exchange(p.lane, b"".join(pipeline), len(pipeline))
        one_by_one = [(await exchange(p.plain, raw))[0] for raw in pipeline]
        assert lane == one_by_one
        assert [a[0] for a in lane if a] == [200, 200, 200, 400, 200]


async def test_a_request_arriving_in_pieces(populated):
    raw = b"".join([request(le(TOKENS), BIN), request(le(queries()[1][0]), BIN)])
    async with Pair(populated[0]) as p:
        for pieces in (1, 7, 1000):
            lane, plain = await exchange(p.lane, raw, 2, pieces), await exchange(p.plain, raw, 2)
            assert lane == plain and lane[0][0] == 200


async def test_a_client_that_reads_late_gets_every_answer(populated, monkeypatch):
    """Enough pipelined answers to fill the socket's buffers before the client reads one:
    the lane stops reading while it cannot write, then answers the rest, and a request it
    does not answer, met while it waits, still goes to aiohttp once writing resumes."""
    raw = request(le(TOKENS), BIN)
    other = request(b"", line="GET /v1/digest HTTP/1.1", length=False)
    n = 20_000  # ~6 MB of answers: more than the kernel buffers past a small receive window
    pauses = []
    pause = score_lane.ScoreLane.pause_writing
    monkeypatch.setattr(score_lane.ScoreLane, "pause_writing", lambda lane: pauses.append(1) or pause(lane))
    async with Pair(populated[0]) as p:
        [want] = await exchange(p.plain, raw)
        [digest] = await exchange(p.plain, other)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", p.lane))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(raw * n + other + raw)
        await asyncio.sleep(0.5)
        got = [await asyncio.wait_for(read_answer(reader), 10) for _ in range(n + 2)]
        writer.close()
        assert got == [want] * n + [digest, want]
        assert pauses  # the case this test is for: the lane had to stop


async def test_the_lane_times_its_scores(populated):
    applier = populated[0]

    def count() -> float:
        n = applier.metrics.registry.get_sample_value("kvwire_score_latency_seconds_count", {"scope": "local"})
        return n or 0.0

    async with Pair(applier) as p:
        before = count()
        assert await p.on_lane(request(le(TOKENS), BIN))
        assert count() == before + 1


async def test_a_token_is_checked_before_the_lane_answers(populated, tmp_path):
    (tmp_path / "t").write_text("s3cret\n")
    sec = HttpSecurity.from_files(token_file=str(tmp_path / "t"))
    async with Pair(populated[0], sec) as p:
        for auth, status, lane in (
            ("Authorization: Bearer s3cret", 200, True),
            ("Authorization: Bearer wrong", 401, False),
            ("X-No-Token: 1", 401, False),
        ):
            raw = request(le(TOKENS), BIN, auth)
            a, b = await p.both(raw)
            assert a == b and a[0][0] == status
            assert await p.on_lane(raw) is lane


async def test_an_idle_lane_is_closed(populated, monkeypatch):
    monkeypatch.setattr(score_lane, "IDLE_S", 0.2)
    async with Pair(populated[0]) as p:
        reader, writer = await asyncio.open_connection("127.0.0.1", p.lane)
        writer.write(request(le(TOKENS), BIN))
        assert (await read_answer(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the sweep
        writer.close()


_NAMES = st.sampled_from(
    ["Content-Type", "content-length", "Connection", "Expect", "X-A", "Transfer-Encoding", "Bad Name", "Upgrade"]
)
_VALUES = st.sampled_from(
    [
        "application/octet-stream",
        "application/json",
        "keep-alive",
        "close",
        "16",
        "+16",
        "016",
        "16 16",
        " 16 ",
        "chunked",
        "100-continue",
        "",
        "\t x",
        "a\x01b",
        "websocket",
    ]
)


_TARGETS = st.sampled_from(
    [
        "/v1/score",
        "/v1/score?top_k=2",
        "/v1/score?local=true&top_k=1",
        "/v1/score?local=1",
        "/v1/score?top_k=%32",
        "/v1/score?lora_name=%E2%82%AC",
        "/v1/score?lora_name=%zz",
        "/v1/score?top_k=1&top_k=x",
        "/v1/score?extra_keys=%5B%5D",
        "/v1/score?cache_salt=a+b",
        "/v1/score?=",
        "/v1/score??",
        "/v1//score",
    ]
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(headers=st.lists(st.tuples(_NAMES, _VALUES), max_size=5), hot=st.booleans(), target=_TARGETS)
def test_made_up_heads_are_answered_as_aiohttp_answers_them(populated, headers, hot, target):
    """Whatever the head, the lane's answer is aiohttp's: the lane answers only what it
    reads exactly as aiohttp does, and hands the rest over."""
    body = le(TOKENS[:4])
    fixed = [BIN, f"Content-Length: {len(body)}"] if hot else []
    raw = request(body, *fixed, *(f"{n}:{v}" for n, v in headers), line=f"POST {target} HTTP/1.1", length=False)

    async def run():
        async with Pair(populated[0]) as p:
            return await p.both(raw, wait_s=1)

    lane, plain = asyncio.run(run())
    assert lane == plain, raw[:300]


_WS = st.sampled_from(["", " ", "\n", "\t ", "\r\n", "\x0b", "\xa0"])
_NUMBERS = st.sampled_from(
    ["0", "7", "00", "01", "-0", "-1", "1.0", "1e2", "1E2", "4294967295", "4294967296", "99999999999999999999", '"5"']
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    numbers=st.lists(_NUMBERS, max_size=6),
    ws=st.lists(_WS, min_size=8, max_size=8),
    key=st.sampled_from(["token_ids", "token_id", "token_\\u0069ds", "limit"]),
    tail=st.sampled_from(["", ',"limit":2', ",", " x"]),
)
def test_made_up_json_bodies_are_answered_as_aiohttp_answers_them(populated, numbers, ws, key, tail):
    """Whatever JSON body of token ids, the lane's answer is aiohttp's: the core reads only
    bodies the schema reads the same way, and leaves the rest to msgspec."""
    body = f'{ws[0]}{{{ws[1]}"{key}"{ws[2]}:{ws[3]}[{ws[4]}{f"{ws[5]},".join(numbers)}{ws[6]}]{tail}}}{ws[7]}'
    raw = request(body.encode(), JSON)

    async def run():
        async with Pair(populated[0]) as p:
            return await p.both(raw, wait_s=1)

    lane, plain = asyncio.run(run())
    assert lane == plain, raw[:300]


async def test_http_workers_threads_serve_the_lane_over_tls(populated, tmp_path):
    """HttpWorkers' threads (uvloop's transports) under TLS: a score on the lane, a hand-over,
    and scores again on the connection aiohttp now keeps, each as plain aiohttp answers."""
    import ssl

    import aiohttp
    from certs import self_signed

    from kvwire.consumer.http import HttpWorkers

    pem, ca = self_signed(tmp_path)
    sec = HttpSecurity.from_files(cert=str(pem))
    assert sec is not None
    workers = HttpWorkers(
        lambda: make_app(populated[0], lambda: True, security=sec),
        "127.0.0.1",
        0,
        1,
        on_caller_loop=False,
        tls=sec.server_context(),
    )
    port = await workers.start()
    try:
        async with Pair(populated[0]) as p:
            [want] = await exchange(p.plain, request(le(TOKENS), BIN))
        ctx = ssl.create_default_context(cafile=str(ca))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=1)) as s:
            url = f"https://127.0.0.1:{port}"
            for step in ("score", "digest", "score", "score"):
                if step == "digest":
                    async with s.get(f"{url}/v1/digest") as r:
                        assert r.status == 200
                    continue
                async with s.post(
                    f"{url}/v1/score", data=le(TOKENS), headers={"Content-Type": "application/octet-stream"}
                ) as r:
                    assert (r.status, r.content_type, await r.read()) == want
    finally:
        await workers.cleanup()
