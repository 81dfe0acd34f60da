"""The score lane: a router's hot request answered without aiohttp's per-request Python.

A member's HTTP connections start on ``ScoreLane``. A request whose head is plainly what a
router (or a peer asking for its ``local`` part) sends on its hot path is answered here:
``POST /v1/score HTTP/1.1``, with or without a query string, a ``Content-Length`` under the
body limit, ``Content-Type`` the binary or the JSON form, every header line well formed, and
none of ``Transfer-Encoding``, ``Expect``, ``Upgrade`` or a ``Connection`` other than
keep-alive (``_core.score_head`` reads the head: ``rust/src/score_head.rs`` is that rule's
home). The answer is the app's own ``LaneAnswer``: the same decode, checks, score and
latency metric as the aiohttp handler (``kvwire.consumer.http``). Anything else, and any
request the answer refuses (a 4xx, a wrong token, an error), hands the connection over to
aiohttp's protocol with every byte of that request, unanswered: aiohttp then answers it exactly
as it answers any request, and keeps the connection. So the lane only ever answers 200s, and
no rule of HTTP or of the API lives here that aiohttp does not apply first-hand to everything
the lane passes on.

The plain request, token ids alone with no query string (a binary body, or a JSON body of
``token_ids`` and nothing else: a router's usual request), is answered whole by the core
(``_core.score_plain``, ``rust/src/score_lane.rs``) when the app says its answer needs only
the index and the fence (``Plain``: no bearer token, no peers, no live hold); the core
declines anything else, which then takes the path above.

Why: at 8k tokens a score is ~15 µs in the core, and aiohttp's request and response objects,
middleware chain and writer cost the member ~60 µs of Python per request on top
(``bench.http_score``; docs/DESIGN.md, "What an HTTP score costs the member"); the lane's
own Python layers cost ~25 µs more than the core's one call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any

from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE
from multidict import MultiDict, MultiDictProxy
from yarl import URL

from kvwire import _core

# (body, its content type, the Authorization header or None, the query as aiohttp reads it)
# -> the 200 answer's JSON body, or None: let aiohttp answer this request. The body is a view
# of the bytes read.
LaneAnswer = Callable[[memoryview, bytes, "bytes | None", "MultiDictProxy[str]"], "bytes | None"]


@dataclass(frozen=True)
class Plain:
    """What the core needs to answer the plain request whole (``_core.score_plain``: token
    ids alone, no query string): the app's index and fence cores, its token limit and
    default top_k, the JSON body's opening and closing around the scores list, whether it
    may answer now (``ready``: false while a hold counts, which the core does not see) and
    the app's latency metric."""

    index: Any
    fence: Any
    max_tokens: int
    top_k: int
    body_open: bytes
    body_close: bytes
    ready: Callable[[], bool]
    observe: Callable[[float], None]


@dataclass(frozen=True)
class Lane:
    """What an app answers on the lane (``make_app``'s), and its body limit (the app's
    ``client_max_size``). ``plain``: set where the plain request needs nothing but the
    index and the fence (no bearer token, no peers)."""

    answer: LaneAnswer
    max_body: int
    plain: Plain | None = None


SCORE_LANE = web.AppKey("score_lane", Lane)

_MAX_HEAD = 8190  # aiohttp's own limit on a request line and on a header line
IDLE_S = 75.0  # aiohttp's keep-alive timeout: an idle lane closes as an idle aiohttp connection does


def _query(query: bytes | None) -> MultiDictProxy[str]:
    """The query string as ``request.query`` reads it: aiohttp's parser builds a request's URL
    with this same call."""
    if not query:
        return _NO_QUERY
    return URL.build(path="/v1/score", query_string=query.decode(), encoded=True).query


_NO_QUERY: MultiDictProxy[str] = MultiDictProxy(MultiDict())


# A 200 answer's head up to its Content-Length value; ``_head_rest`` is the rest.
_HEAD_OPEN = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "


class _HeadRest:
    """A 200 answer's head after its Content-Length value (the Date in it formatted once a
    second)."""

    def __init__(self) -> None:
        self.second = -1
        self.value = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            date = formatdate(now, usegmt=True).encode()
            self.second, self.value = now, b"\r\nDate: %s\r\nServer: %s\r\n\r\n" % (date, _SERVER)
        return self.value


_head_rest = _HeadRest()


class ScoreLane(asyncio.Protocol):
    """One connection: hot-path scores answered here until a request is not one.

    A request that arrives whole in one read (the usual case) is sliced out of that read once,
    its body with it; one that arrives in pieces is kept as its pieces and joined once it is
    all there."""

    def __init__(self, server: web.Server, lane: Lane, lanes: set[ScoreLane]) -> None:
        self.server, self.answer, self.max_body, self.lanes = server, lane.answer, lane.max_body, lanes
        self.plain = lane.plain
        self.transport: asyncio.Transport | None = None
        self.pending: list[bytes] = []  # the start of a request not yet whole (or not yet served)
        self.have = 0  # bytes in pending
        self.wanted = 0  # bytes pending must reach before the request is looked at again
        self.paused = False
        self.seen = 0.0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.lanes.add(self)
        self.seen = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lanes.discard(self)
        self.transport = None

    @property
    def idle(self) -> bool:
        return not self.pending

    def data_received(self, data: bytes) -> None:
        self.seen = time.monotonic()
        if self.pending:
            self.pending.append(data)
            self.have += len(data)
            if self.have < self.wanted or self.paused:
                return
            data = b"".join(self.pending)
            self.pending, self.have = [], 0
        self._serve(data)

    def pause_writing(self) -> None:
        # A client that does not read its answers stops being read, as aiohttp does.
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None:
            self.transport.resume_reading()
            if self.pending:
                data = b"".join(self.pending)
                self.pending, self.have = [], 0
                self._serve(data)

    def _keep(self, rest: bytes, wanted: int) -> None:
        self.pending, self.have, self.wanted = [rest], len(rest), wanted

    def _serve(self, data: bytes) -> None:
        pos, n = 0, len(data)
        while pos < n:
            if self.paused or self.transport is None:
                self._keep(data[pos:], 0)
                return
            end = data.find(b"\r\n\r\n", pos, pos + _MAX_HEAD + 4)
            if end < 0:
                if n - pos > _MAX_HEAD + 4:
                    self._hand_over(data[pos:])
                else:
                    self._keep(data[pos:], n - pos + 1)
                return
            plain = self.plain
            if plain is not None and plain.ready():
                t0 = time.perf_counter()
                try:
                    frame = (_HEAD_OPEN, _head_rest(), plain.body_open, plain.body_close)
                    got = _core.score_plain(
                        plain.index, plain.fence, data, pos, end, self.max_body, plain.max_tokens, plain.top_k, frame
                    )
                except Exception:  # the general path answers it, or aiohttp does
                    got = None
                if got is not None:
                    self.transport.write(got[0])
                    plain.observe(time.perf_counter() - t0)
                    pos = got[1]
                    continue
            parsed = _core.score_head(data, pos, end, self.max_body)
            if parsed is None:
                self._hand_over(data[pos:])
                return
            length, ctype, auth, query = parsed
            stop = end + 4 + length
            if stop > n:
                self._keep(data[pos:], stop - pos)
                return
            try:
                # A view, not a copy: the body is read in place (~2 µs a 32 KB body).
                body = self.answer(memoryview(data)[end + 4 : stop], ctype, auth, _query(query))
            except Exception:  # aiohttp answers it again, and logs what it raises, as a 500
                body = None
            if body is None:
                self._hand_over(data[pos:])
                return
            self.transport.writelines((_HEAD_OPEN, b"%d" % len(body), _head_rest(), body))
            pos = stop

    def _hand_over(self, data: bytes) -> None:
        """aiohttp's protocol takes the connection and every byte of the unanswered request.
        Never while paused (``_serve`` keeps the bytes until writing resumes): the lane paused
        the reading, and aiohttp's protocol would not know to resume it."""
        transport = self.transport
        assert transport is not None and not self.paused
        self.lanes.discard(self)
        self.transport = None
        handler = self.server()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if data:
            handler.data_received(data)


_SERVER = SERVER_SOFTWARE.encode()


class LaneRunner(web.AppRunner):
    """An ``AppRunner`` whose sites accept connections on ``ScoreLane``."""

    def __init__(self, app: web.Application, lane: Lane, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.lane = lane
        self.lanes: set[ScoreLane] = set()
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def server(self) -> Any:  # what a site's create_server calls per connection
        real = web.AppRunner.server.fget(self)  # type: ignore[attr-defined]
        if real is None:
            return None

        def lane() -> ScoreLane:
            if self._sweeper is None:
                self._sweep()
            return ScoreLane(real, self.lane, self.lanes)

        return lane

    def _sweep(self) -> None:
        cutoff = time.monotonic() - IDLE_S
        for lane in [ln for ln in self.lanes if ln.seen < cutoff and ln.idle]:
            if lane.transport is not None:
                lane.transport.close()
        self._sweeper = asyncio.get_running_loop().call_later(IDLE_S / 5, self._sweep)

    async def shutdown(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for lane in list(self.lanes):
            if lane.transport is not None:
                lane.transport.close()
        await super().shutdown()
