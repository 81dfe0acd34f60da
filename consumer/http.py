"""HTTP API of an index member (aiohttp).

``POST /v1/score``   {"token_ids": [...], "lora_name": null} -> scores, best first; or the token
                     ids as a little-endian uint32 body (``application/octet-stream``) with
                     ``lora_name``, ``cache_salt``, ``extra_keys`` (JSON text), ``block_size``,
                     ``top_k``, ``local`` as query parameters
``POST /v1/route``   {"token_ids": [...], "candidates"?: [...]} -> the worker to send the prompt
                     to; records a speculative hold on it (``kvwire.consumer.holds``)
``GET  /v1/workers`` per worker: blocks, epochs, last seqs, trust (and whether approximate), last seen
``GET  /v1/digest``  order-independent digest of the index (replay checks)
``GET  /healthz``    200 once caught up with the end offsets seen at start and healthy, else 503
``GET  /metrics``    Prometheus
``GET  /openapi.json`` the OpenAPI document of all of the above (``kvwire.consumer.openapi``)

The routes and the structs requests are decoded with and answers encoded from are declared once,
in ``kvwire.consumer.api``: the app registers its handlers from that table, and the document is
rendered from it.

With ``peers`` (members of the same group, each holding other partitions) a
score is scattered to every peer with ``"local": true`` and the answers are
merged; a peer that fails marks the answer ``partial`` instead of failing it.
Input is bounded: a body over ``max_body_bytes`` gets 413 from aiohttp, more
than ``max_tokens`` tokens gets 413, anything malformed gets 400 — never 500.

Why a binary body: an 8k-token prompt is ~55 KB of JSON that costs ~200 µs to parse, more
than the score itself; as packed uint32 it is 32 KB read in place (no copy, no parse). Both
forms reach the same ``Applier.score_json`` (the core hashes, walks, orders and encodes),
so they answer byte for byte the same.

Tenants: ``cache_salt`` and ``extra_keys`` (per block, as vLLM publishes them in BlockStored)
key a query the way the engine keyed its blocks, so a prompt matches only its own tenant's
blocks (``kvwire.consumer.tenants``).

Holds (``kvwire.consumer.holds``) are this member's router state, shared by its HTTP loops: a
score answer shows them (``speculative_tokens``) only while one is live, and is otherwise byte
for byte what it was without them. Peers asked with ``local`` answer without their holds; the
member a request reached adds its own.

The score lane (``kvwire.consumer.score_lane``): every connection starts there, and a plain
``POST /v1/score`` is answered by ``make_app``'s own decode, checks and answer without aiohttp's
request and response objects; anything else goes to aiohttp, which answers as it always has.

Scale-out within a host: ``HttpWorkers`` runs the same app on N threads, each with its
own event loop on an ``SO_REUSEPORT`` socket of the same port; the kernel spreads
connections over them and they all read the one index (see ``kvwire.consumer.router``
for how a reader stays consistent while ingest applies). ``kvwire index`` serves from
threads only, so ingest keeps its loop to itself.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import sys
import threading
import time
from array import array
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
import msgspec
import numpy as np
import uvloop
from aiohttp import web

from kvwire import _core

from .api import (
    BINARY,
    MAX_ERROR_CHARS,
    MAX_RESULTS,
    ROUTES,
    SCORE_QUERY,
    TRUNCATED,
    DigestAnswer,
    ErrorAnswer,
    ExtraKeys,
    HealthAnswer,
    HoldAnswer,
    Prompt,
    RouteAnswer,
    RouteRequest,
    RouteScore,
    ScoreRequest,
    StreamInfo,
    StreamsAnswer,
    WorkerInfo,
    WorkerRef,
    WorkersAnswer,
)
from .apply import Applier
from .cpus import CpuSplit
from .dynamo_api import (
    REGISTER_ANSWER,
    BlockTable,
    DynamoQuery,
    DynamoQueryByHash,
    UnknownModel,
    dump,
    listing,
    overlaps,
    query_by_hash_keys,
    select,
)
from .holds import (
    Holds,
    NoCandidate,
    Route,
    block_sizes,
    route,
    score_json_with_holds,
    trusted_workers,
    with_speculation,
)
from .http_security import HttpSecurity
from .keys import sequence_keys
from .metrics import LatencyHistogram
from .openapi import document
from .score_lane import SCORE_LANE, Lane, LaneRunner, Plain
from .tenants import TenantError, check_extra_keys, tenant_extra_keys

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256 * 1024
MAX_HASHES = DEFAULT_MAX_TOKENS  # a hash stands for at least one token
DEFAULT_MAX_BODY = 8 * 1024 * 1024


# A request body: aiohttp's bytes, or the score lane's view of the bytes it read.
Body = bytes | memoryview


class BadRequest(ValueError):
    """A request outside the contract: answered with ``status`` and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


_LE = sys.byteorder == "little"
_ARRAY_I = _LE and array("I").itemsize == 4


def query_request(query: Any) -> ScoreRequest:
    """The fields of the binary form, from the query string (no tokens yet). Checked
    whatever the body (unknown parameters are refused, as unknown JSON fields are); a JSON
    body carries its own fields and the query's are then not used."""
    if not query:
        # Most binary requests carry no query: skip building and converting a dict per request.
        return _NO_QUERY
    unknown = sorted(set(query.keys()) - set(SCORE_QUERY))
    if unknown:
        raise BadRequest(400, f"invalid request: unknown query parameter(s) {', '.join(unknown)[:200]}")
    # The struct's own types and bounds read the text: strict=False takes "12" for 12 and "true" for true.
    fields = {name: query[name] for name in SCORE_QUERY if name in query and name != "extra_keys"}
    try:
        req = msgspec.convert({"token_ids": [], **fields}, ScoreRequest, strict=False)
    except msgspec.ValidationError as e:
        raise BadRequest(400, f"invalid request: query parameter: {e}") from None
    extra = query.get("extra_keys")
    if extra is None:
        return req
    try:
        return msgspec.structs.replace(req, extra_keys=_extra_decoder.decode(extra))
    except msgspec.DecodeError as e:  # ValidationError is one
        raise BadRequest(400, f"invalid request: extra_keys must be a JSON array of arrays or nulls: {e}") from None


_NO_QUERY = ScoreRequest()  # shared: callers replace fields (msgspec.structs.replace), never set them


def binary_request(body: Body, query: Any, max_tokens: int) -> ScoreRequest:
    """The octet-stream form: the body is the token ids as little-endian uint32, read in
    place; the other fields come from the query string (``query_request``)."""
    req = query_request(query)
    refused = _core.binary_body_refusal(len(body), max_tokens)  # the rule's home: rust/src/score_lane.rs
    if refused is not None:
        raise BadRequest(*refused)
    # The core reads the buffer's bytes as little-endian words, so the body goes as it came.
    return msgspec.structs.replace(req, token_ids=np.frombuffer(body, np.uint32))


def _packed(tokens: Any) -> Any:
    if isinstance(tokens, list) and _ARRAY_I:
        # The core reads an array('I') in place; a list would go through numpy's
        # per-element conversion, several times slower than this copy.
        return array("I", tokens)
    return tokens


def _top_k(req: ScoreRequest) -> int:
    return req.top_k if req.top_k is not None else req.limit


_PLAIN_K = _top_k(_NO_QUERY)  # a request without a query string asks for this many workers
# /v1/score's answer (``ScoreAnswer``) around the core's JSON list of scores.
SCORES_OPEN, SCORES_CLOSE = b'{"scores":', b"}"


_decoder = msgspec.json.Decoder(ScoreRequest)
_route_decoder = msgspec.json.Decoder(RouteRequest)
_extra_decoder = msgspec.json.Decoder(ExtraKeys)


def tenant_keys(req: Prompt) -> list[Any] | None:
    """The request's per-block extra keys with its salt folded in; BadRequest when malformed."""
    hashes = getattr(req, "block_hashes", None)
    if hashes is not None:
        if req.token_ids:
            raise BadRequest(400, "invalid request: token_ids or block_hashes, not both")
        if req.lora_name is not None or req.cache_salt or req.extra_keys is not None:
            raise BadRequest(
                400, "invalid request: block_hashes carry their LoRA; no lora_name, cache_salt, extra_keys"
            )
        if any(not -(2**63) <= h < 2**64 for h in hashes):
            raise BadRequest(400, "invalid request: a block hash outside i64 and u64")
        if len(hashes) > MAX_HASHES:
            raise BadRequest(413, f"{len(hashes)} block hashes; at most {MAX_HASHES}")
        return None
    try:
        # A block holds at least one token: more entries than tokens is no prompt's keys.
        check_extra_keys(req.extra_keys, max(len(req.token_ids), 1))
    except TenantError as e:
        raise BadRequest(400, f"invalid request: {e}") from None
    return tenant_extra_keys(req.extra_keys, req.cache_salt, req.lora_name)


_json = msgspec.json.Encoder()


def _error(status: int, message: str) -> web.Response:
    # msgspec quotes offending input in its messages (an unknown field's whole name): capped, or
    # a body of one long key gets itself echoed back, up to max_body_bytes.
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + TRUNCATED
    return _answer(ErrorAnswer(message), status)


class StreamsListing(Protocol):
    """What ``/v1/streams`` reads (``consumer.event_streams.EventStreams``)."""

    def listing(self) -> list[dict[str, Any]]: ...


def _answer(body: msgspec.Struct, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_json.encode(body), content_type="application/json")


JSON_TYPE = "application/json"
_dynamo_query = msgspec.json.Decoder(DynamoQuery)
_dynamo_query_by_hash = msgspec.json.Decoder(DynamoQueryByHash)


def _answer_list(body: list[Any]) -> web.Response:
    return web.Response(body=_json.encode(body), content_type=JSON_TYPE)


def _route_answer(picked: Route) -> RouteAnswer:
    return RouteAnswer(
        worker=WorkerRef(*picked.worker),
        matched_tokens=picked.matched_tokens,
        speculative_tokens=picked.speculative_tokens,
        hold=None if picked.hold_expires_in_ms is None else HoldAnswer(picked.hold_expires_in_ms),
        scores=[
            RouteScore(r.worker[0], r.worker[1], r.matched_tokens, r.speculative_tokens, r.score) for r in picked.rows
        ],
    )


def _limits(max_tokens: int, max_body_bytes: int) -> str:
    return f"at most {max_tokens} tokens in a body of at most {max_body_bytes} bytes"


async def _gathered(peers: list[str], one: Callable[[str], Awaitable[Any]]) -> tuple[list[Any], list[str]]:
    """Every peer's answer, and the peers that failed (an answer is partial, never failed, for them)."""
    results = await asyncio.gather(*(one(p) for p in peers), return_exceptions=True)
    answers, failed = [], []
    for peer, res in zip(peers, results, strict=False):
        if isinstance(res, BaseException):
            log.warning("peer %s failed: %r", peer, res)
            failed.append(peer)
        else:
            answers.append(res)
    return answers, failed


def v1_keys(block_hashes: list[int]) -> np.ndarray:
    """The routers' content hashes (signed i64 or u64) -> kvwire's keys."""
    return sequence_keys(np.array([h & _U64 for h in block_hashes], dtype=np.uint64))


_U64 = (1 << 64) - 1


def merge_scores(answers: list[list[dict]], limit: int) -> list[dict]:
    """Union of members' answers; a worker appears in one member's partitions,
    but during a rebalance two may answer for it: keep the better answer."""
    best: dict[tuple[str, int], dict] = {}
    for answer in answers:
        for s in answer:
            k = (s["instance_id"], s["dp_rank"])
            if k not in best or (s["score"], s["matched_tokens"]) > (best[k]["score"], best[k]["matched_tokens"]):
                best[k] = s
    return sorted(best.values(), key=lambda s: (-s["score"], -s["matched_tokens"], s["instance_id"], s["dp_rank"]))[
        :limit
    ]


def make_app(
    applier: Applier,
    ready: Callable[[], bool],
    peers: list[str] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    max_body_bytes: int = DEFAULT_MAX_BODY,
    peer_timeout_s: float = 2.0,
    health: Callable[[], str | None] | None = None,
    home: asyncio.AbstractEventLoop | None = None,
    holds: Holds | None = None,
    topic: str = "",
    block_table: BlockTable | None = None,
    rank_endpoint: Callable[[str, int], str | None] | None = None,
    rank_block_size: Callable[[str, int], int | None] | None = None,
    streams: StreamsListing | None = None,
    security: HttpSecurity | None = None,
) -> web.Application:
    """``health()`` returns why the member is unhealthy (None while healthy): /healthz then
    answers 503 with the reason even when caught up.

    ``holds``: the member's speculative holds; apps of one member served from several loops
    must share one (``kvwire index`` does). None: this app keeps its own, default TTL.

    ``home``: the loop that feeds ``applier`` (ingest's), when this app is served from
    another (``HttpWorkers`` threads). Scores read only the core, which is consistent from
    any thread; /v1/workers, /v1/digest and /healthz read Python-side state that ingest
    mutates, so they run on ``home``, between ingest steps.

    Dynamo's indexer API (``kvwire.consumer.dynamo_api``): ``topic`` names where workers come
    from in ``/workers``; ``block_table`` (the event streams' table) is what ``/dump`` is built
    from, 404 without it; ``rank_endpoint`` and ``rank_block_size`` say where and in what block
    size the event streams republish a rank.

    ``streams``: the event streams (``kvwire.consumer.event_streams``) ``/v1/streams`` lists,
    read on ``home``; without them it answers 404.

    ``security`` (``kvwire.consumer.http_security``): the bearer token every request must carry,
    and what scatters to peers present (their token, their client certificate); TLS itself is
    the listening socket's (``serve``, ``HttpWorkers``)."""

    async def at_home(fn: Callable[[], Any]) -> Any:
        if home is None or home is asyncio.get_running_loop():
            return fn()

        async def call() -> Any:
            return fn()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(call(), home))

    peers = [p.rstrip("/") for p in (peers or [])]
    held = holds if holds is not None else Holds()
    score_latency = applier.metrics.score_latency
    applier.metrics.watch_holds(held)
    guard = [security.middleware()] if security is not None and security.token else []
    app = web.Application(client_max_size=max_body_bytes, middlewares=guard)
    session: dict[str, aiohttp.ClientSession] = {}
    doc: dict[str, bytes] = {}

    def checked(body: Body, decode: Callable[[Body], Any]) -> tuple[Any, Any]:
        """A request body -> (request, its tenant keys); BadRequest for what is answered 4xx:
        413 over the token limit, 400 for anything outside the schema (checked first)."""
        try:
            req = decode(body)
            extra = tenant_keys(req)
        except msgspec.ValidationError as e:
            raise BadRequest(400, f"invalid request: {e}") from None
        except msgspec.DecodeError as e:
            raise BadRequest(400, f"invalid JSON: {e}") from None
        refused = _core.token_count_refusal(len(req.token_ids), max_tokens)
        if refused is not None:
            raise BadRequest(*refused)
        return req, extra

    async def parse(request: web.Request, decode: Callable[[Body], Any]) -> tuple[Any, Any] | web.Response:
        """A request body -> (request, its tenant keys), or the 4xx answer (``checked``; 413
        over the body limit)."""
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body over {max_body_bytes} bytes")
        try:
            return checked(body, decode)
        except BadRequest as e:
            return _error(e.status, str(e))

    def score_decoder(content_type: str, query: Any) -> Callable[[Body], Any]:
        if content_type == BINARY:
            return lambda body: binary_request(body, query, max_tokens)

        def decode(body: Body) -> Any:
            if query:
                query_request(query)
            return _decoder.decode(body)

        return decode

    def route_body(request: web.Request) -> Callable[[Body], Any]:
        def decode(body: Body) -> Any:
            if request.query:
                raise BadRequest(400, "invalid request: /v1/route takes no query parameters")
            return _route_decoder.decode(body)

        return decode

    async def answer(
        request: web.Request,
        decode: Callable[[Body], Any],
        run: Callable[[Any, Any], Awaitable[web.Response]],
        latency: Any,
    ) -> web.Response:
        """Parse, answer, and time the answer in ``latency`` by scope (a peer's ``local`` part,
        or this member alone, is "local")."""
        parsed = await parse(request, decode)
        if isinstance(parsed, web.Response):
            return parsed
        req, extra = parsed
        t0 = time.perf_counter()
        try:
            return await run(req, extra)
        finally:
            observe(latency, req, time.perf_counter() - t0)

    def observe(latency: LatencyHistogram, req: Any, seconds: float) -> None:
        latency.observe("local" if getattr(req, "local", False) or not peers else "scatter", seconds)

    async def score(request: web.Request) -> web.Response:
        return await answer(
            request, score_decoder(request.content_type, request.query), _score, applier.metrics.score_latency
        )

    def local_scores(req: ScoreRequest, extra: list[Any] | None) -> bytes | None:
        """The answer's body when this member answers alone (a peer's ``local`` part, or no
        peers), else None: the request scatters."""
        k = _top_k(req)
        if req.block_hashes is not None:
            if req.local or not peers:
                return (
                    SCORES_OPEN + applier.score_keys_json(v1_keys(req.block_hashes), req.block_size, k) + SCORES_CLOSE
                )
            return None
        if req.local:
            # A peer's part of a scatter: index state only, the asking member adds its holds.
            local = applier.score_json(_packed(req.token_ids), req.lora_name, req.block_size, k, extra)
        elif not peers:
            local = score_json_with_holds(
                applier, held, _packed(req.token_ids), req.lora_name, req.block_size, k, extra
            )
        else:
            return None
        return SCORES_OPEN + local + SCORES_CLOSE

    async def _score(req: ScoreRequest, extra: list[Any] | None) -> web.Response:
        alone = local_scores(req, extra)
        if alone is not None:
            return web.Response(body=alone, content_type="application/json")
        k = _top_k(req)
        tokens = _packed(req.token_ids)
        if req.block_hashes is not None:
            local = applier.score_keys_json(v1_keys(req.block_hashes), req.block_size, k)
        else:
            local = applier.score_json(tokens, req.lora_name, req.block_size, k, extra)
        answers, failed = await _scatter(req, k)
        scores = merge_scores([msgspec.json.decode(local), *answers], k)
        if req.block_hashes is None and held.live():
            spec = held.credit(tokens, req.lora_name, extra, _sizes(req.block_size))
            scores = with_speculation(scores, spec, k)
        return web.Response(
            body=_json.encode({"scores": scores, "partial": bool(failed), "failed_peers": failed}),
            content_type="application/json",
        )

    def lane(body: Body, content_type: bytes, authorization: bytes | None, query: Any) -> bytes | None:
        """``score`` on the score lane (``kvwire.consumer.score_lane``): the same decode,
        checks and answer; None hands the request to aiohttp, which answers what it refuses
        and scatters what this member does not answer alone."""
        if security is not None and not security.authorized(authorization):
            return None
        ctype = content_type.decode()
        if peers and ctype != BINARY:
            return None  # a JSON body is decoded once, by aiohttp, which will likely scatter it
        try:
            req, extra = checked(body, score_decoder(ctype, query))
        except BadRequest:
            return None
        t0 = time.perf_counter()
        alone = local_scores(req, extra)
        if alone is not None:
            observe(applier.metrics.score_latency, req, time.perf_counter() - t0)
        return alone

    def _sizes(block_size: int | None) -> list[int]:
        return block_sizes(applier.index.block_sizes(), block_size)

    async def route_handler(request: web.Request) -> web.Response:
        return await answer(request, route_body(request), _route, applier.metrics.route_latency)

    async def _route(req: RouteRequest, extra: list[Any] | None) -> web.Response:
        tokens = _packed(req.token_ids)
        cands = None if req.candidates is None else [(c.instance_id, c.dp_rank) for c in req.candidates]
        confirmed = None
        failed: list[str] = []
        if peers:
            sreq = ScoreRequest(
                token_ids=req.token_ids,
                lora_name=req.lora_name,
                cache_salt=req.cache_salt,
                extra_keys=req.extra_keys,
                block_size=req.block_size,
                top_k=MAX_RESULTS,
            )
            local = applier.score_json(tokens, req.lora_name, req.block_size, MAX_RESULTS, extra)
            answers, failed = await _scatter(sreq, MAX_RESULTS)
            confirmed = merge_scores([msgspec.json.decode(local), *answers], MAX_RESULTS)
            if cands is None:
                cands = sorted(set(trusted_workers(applier)) | {(s["instance_id"], s["dp_rank"]) for s in confirmed})
        try:
            picked = route(applier, held, tokens, req.lora_name, extra, cands, req.block_size, confirmed)
        except NoCandidate as e:
            return _error(503, str(e))
        out = _route_answer(picked)
        if peers:
            out = msgspec.structs.replace(out, partial=bool(failed), failed_peers=failed)
        return _answer(out)

    async def _scatter(req: ScoreRequest, k: int):
        if "s" not in session:
            tls = security.peer_context() if security is not None else None
            session["s"] = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=peer_timeout_s),
                headers=security.peer_headers() if security is not None else None,
                connector=aiohttp.TCPConnector(ssl=tls) if tls is not None else None,
            )
        if req.block_hashes is not None:
            # No tokens to send packed: the hashes go as JSON.
            body = {"block_hashes": req.block_hashes, "block_size": req.block_size, "local": True, "top_k": k}

            async def one_json(peer: str):
                async with session["s"].post(f"{peer}/v1/score", json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}")
                    return (await r.json())["scores"]

            return await _gathered(peers, one_json)
        # Peers get the binary form: no JSON to build here or to parse there.
        tokens = np.ascontiguousarray(req.token_ids, "<u4").tobytes()
        params = {"local": "true", "top_k": str(k)}
        if req.lora_name is not None:
            params["lora_name"] = req.lora_name
        if req.cache_salt is not None:
            params["cache_salt"] = req.cache_salt
        if req.extra_keys is not None:
            params["extra_keys"] = _json.encode(req.extra_keys).decode()
        if req.block_size is not None:
            params["block_size"] = str(req.block_size)

        async def one(peer: str):
            async with session["s"].post(
                f"{peer}/v1/score", data=tokens, params=params, headers={"content-type": BINARY}
            ) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}")
                return (await r.json())["scores"]

        return await _gathered(peers, one)

    async def dynamo_body(request: web.Request, decoder: msgspec.json.Decoder, size: Callable[[Any], int]) -> Any:
        """A Dynamo body, or its error answer: 413 over the limits, 400 for bad JSON, 422 outside
        the schema (Dynamo's own statuses)."""
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body over {max_body_bytes} bytes")
        try:
            req = decoder.decode(body)
        except msgspec.ValidationError as e:
            return _error(422, f"invalid request: {e}")
        except msgspec.DecodeError as e:
            return _error(400, f"invalid JSON: {e}")
        if size(req) > max_tokens:
            return _error(413, f"{size(req)} tokens or hashes; at most {max_tokens}")
        return req

    async def dynamo_query(request: web.Request) -> web.Response:
        req = await dynamo_body(request, _dynamo_query, lambda r: len(r.token_ids))
        if isinstance(req, web.Response):
            return req
        try:
            extra = tenant_extra_keys(None, req.cache_salt, req.lora_name)
            ws = select(applier, req.model_name)
        except UnknownModel as e:
            return _error(404, str(e))
        return _answer(overlaps(applier, ws, _packed(req.token_ids), req.lora_name, extra))

    async def dynamo_query_by_hash(request: web.Request) -> web.Response:
        req = await dynamo_body(request, _dynamo_query_by_hash, lambda r: len(r.block_hashes))
        if isinstance(req, web.Response):
            return req
        try:
            ws = select(applier, req.model_name)
        except UnknownModel as e:
            return _error(404, str(e))
        return _answer(overlaps(applier, ws, keys=query_by_hash_keys(req.block_hashes)))

    async def dynamo_workers(request: web.Request) -> web.Response:
        return _answer_list(listing(applier, topic, rank_endpoint, rank_block_size))

    async def dynamo_dump(request: web.Request) -> web.Response:
        if block_table is None:
            return _error(404, "this member keeps no block table: start kvwire index with --event-streams for /dump")
        table = block_table
        return web.Response(body=_json.encode(await at_home(lambda: dump(table, applier))), content_type=JSON_TYPE)

    async def dynamo_register(request: web.Request) -> web.Response:
        return _error(501, REGISTER_ANSWER)

    async def streams_handler(request: web.Request) -> web.Response:
        if streams is None:
            return _error(404, "this member serves no event streams: start kvwire index with --event-streams")
        listed = await at_home(streams.listing)
        return _answer(StreamsAnswer(msgspec.convert(listed, list[StreamInfo])))

    async def workers(request: web.Request) -> web.Response:
        ws = await at_home(applier.workers)
        return _answer(WorkersAnswer(msgspec.convert(ws, list[WorkerInfo])))

    async def digest(request: web.Request) -> web.Response:
        return _answer(await at_home(lambda: DigestAnswer(applier.index.digest(), len(applier.index))))

    async def healthz(request: web.Request) -> web.Response:
        ok, failure = await at_home(lambda: (ready(), health() if health is not None else None))
        body = HealthAnswer(ok, failure is None, msgspec.UNSET if failure is None else failure)
        return _answer(body, 200 if ok and failure is None else 503)

    async def openapi(request: web.Request) -> web.Response:
        if "doc" not in doc:
            doc["doc"] = _json.encode(document(ROUTES, _limits(max_tokens, max_body_bytes)))
        return web.Response(body=doc["doc"], content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=applier.metrics.render(), content_type="text/plain", charset="utf-8")

    async def close_session(app):
        if "s" in session:
            await session["s"].close()

    handlers = {
        "score": score,
        "route": route_handler,
        "workers": workers,
        "digest": digest,
        "healthz": healthz,
        "metrics": metrics,
        "openapi": openapi,
        "dynamo_query": dynamo_query,
        "dynamo_query_by_hash": dynamo_query_by_hash,
        "dynamo_workers": dynamo_workers,
        "dynamo_dump": dynamo_dump,
        "dynamo_register": dynamo_register,
        "streams": streams_handler,
    }
    # Served only from the table the document is rendered from: no route without its description.
    if set(handlers) != {op.name for op in ROUTES}:
        raise RuntimeError(f"handlers {sorted(handlers)} and ROUTES {sorted(op.name for op in ROUTES)} differ")
    for op in ROUTES:
        if op.method == "GET":
            app.router.add_get(op.path, handlers[op.name])  # HEAD with it, as GET's shadow
        else:
            app.router.add_route(op.method, op.path, handlers[op.name])
    app.on_cleanup.append(close_session)
    plain = None
    if not peers and (security is None or security.authorized(None)):
        # The plain request (token ids alone, no query string) is every other field at its
        # default: the core answers it whole while no hold counts (``_core.score_plain``).
        plain = Plain(
            applier.index.core,
            applier.ranks.core,
            max_tokens,
            _PLAIN_K,
            SCORES_OPEN,
            SCORES_CLOSE,
            lambda: not held.live(),
            lambda seconds: score_latency.observe("local", seconds),
        )
    app[SCORE_LANE] = Lane(lane, max_body_bytes, plain)
    return app


async def serve(
    app: web.Application, host: str, port: int, reuse_port: bool = False, tls: ssl.SSLContext | None = None
) -> web.AppRunner:
    lane = app.get(SCORE_LANE)
    runner = web.AppRunner(app, access_log=None) if lane is None else LaneRunner(app, lane, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_port=reuse_port or None, ssl_context=tls).start()
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The port a runner's site listens on (what port 0 became)."""
    for s in runner.sites:
        server = getattr(s, "_server", None)
        for sock in getattr(server, "sockets", None) or ():
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                return int(sock.getsockname()[1])
    raise RuntimeError("no listening TCP site")


class HttpWorkers:
    """The HTTP API on ``n`` event loops over one index, each with its own app (``make()``)
    on an ``SO_REUSEPORT`` socket of the same port; the kernel spreads connections over them.

    ``on_caller_loop`` (the default) serves the first on the caller's loop and runs
    ``n - 1`` threads; without it all ``n`` are threads and the caller's loop (ingest's)
    serves nothing: ingest then competes with HTTP for the GIL, not for its own loop, so a
    flood of requests cannot starve it (bench/http_score.py showed ingest falling to a
    third of its offered rate when it shared the loop with a saturated server). Everything
    a request does in Python (HTTP parsing, the body, the response) is under the GIL; the
    score walk is not, so extra loops buy concurrency for the walk, and a second core for
    the rest only when one is free. Threads, not processes: one index in memory and one
    ingest, so the answers are one member's; processes would each need their own group and
    ingest. Apps made for threads should be given ``home`` (``make_app``), so that what
    reads Python-side ingest state runs on ingest's loop.

    ``cpus``: the threads run on its serving CPUs (``kvwire.consumer.cpus``), away from
    ingest's."""

    def __init__(
        self,
        make: Callable[[], web.Application],
        host: str,
        port: int,
        n: int,
        on_caller_loop: bool = True,
        tls: ssl.SSLContext | None = None,
        cpus: CpuSplit | None = None,
    ) -> None:
        if n < 1:
            raise ValueError("at least one HTTP worker")
        self.make, self.host, self.port, self.n, self.tls = make, host, port, n, tls
        self.cpus = cpus
        self.on_caller_loop = on_caller_loop
        self._runner: web.AppRunner | None = None
        self._threads: list[tuple[threading.Thread, asyncio.AbstractEventLoop]] = []

    async def start(self) -> int:
        """Listen; returns the port (resolved when ``port`` was 0)."""
        reuse = self.n > 1
        if self.on_caller_loop:
            self._runner = await serve(self.make(), self.host, self.port, reuse_port=reuse, tls=self.tls)
            self.port = bound_port(self._runner)
        for i in range(0 if not self.on_caller_loop else 1, self.n):
            started: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            loop = uvloop.new_event_loop()  # its transports cost a request less CPU than asyncio's
            t = threading.Thread(target=self._thread, args=(loop, started, reuse), name=f"kvwire-http-{i}", daemon=True)
            self._threads.append((t, loop))
            t.start()
            try:
                self.port = await started  # the first one resolves port 0 for the others
            except BaseException:
                # The thread closes its loop on the way out: gone before `cleanup` could
                # stop it (stopping a closed loop raises), so that one has nothing to stop.
                await asyncio.to_thread(t.join, 10)
                self._threads.remove((t, loop))
                raise
        return self.port

    def _thread(self, loop: asyncio.AbstractEventLoop, started: asyncio.Future[int], reuse: bool) -> None:
        if self.cpus is not None:
            self.cpus.pin_serving()
        asyncio.set_event_loop(loop)
        caller = started.get_loop()
        try:
            runner = loop.run_until_complete(serve(self.make(), self.host, self.port, reuse_port=reuse, tls=self.tls))
            port = bound_port(runner)
        except BaseException as e:  # handed to the caller, which raises it
            caller.call_soon_threadsafe(started.set_exception, e)
            loop.close()  # here, not when the collector finds it after the process closed its fds
            return
        caller.call_soon_threadsafe(started.set_result, port)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.close()

    async def cleanup(self) -> None:
        for _t, loop in self._threads:
            loop.call_soon_threadsafe(loop.stop)
        for t, _ in self._threads:
            await asyncio.to_thread(t.join, 10)
        self._threads.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
