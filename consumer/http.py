"""HTTP API of an index member (aiohttp).

``POST /v1/score``   {"token_ids": [...], "lora_name": null} -> scores, best first
``GET  /v1/workers`` per worker: blocks, epochs, last seqs, trust, last seen
``GET  /v1/digest``  order-independent digest of the index (replay checks)
``GET  /healthz``    200 once caught up with the end offsets seen at start and healthy, else 503
``GET  /metrics``    Prometheus
``GET  /openapi.json`` the OpenAPI document of all of the above (``kvwire.consumer.openapi``)

With ``peers`` (members of the same group, each holding other partitions) a
score is scattered to every peer with ``"local": true`` and the answers are
merged; a peer that fails marks the answer ``partial`` instead of failing it.
Input is bounded: a body over ``max_body_bytes`` gets 413 from aiohttp, more
than ``max_tokens`` tokens gets 413, anything malformed gets 400 — never 500.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Annotated

import aiohttp
import msgspec
from aiohttp import web

from .apply import Applier

log = logging.getLogger(__name__)

TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
DEFAULT_MAX_TOKENS = 256 * 1024
DEFAULT_MAX_BODY = 8 * 1024 * 1024
MAX_RESULTS = 1024


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: list[TokenId]
    lora_name: str | None = None
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    local: bool = False
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_RESULTS)] = 64


_decoder = msgspec.json.Decoder(ScoreRequest)
_json = msgspec.json.Encoder()


def _scores_json(scores) -> list[dict]:
    return [
        {
            "instance_id": s.instance_id,
            "dp_rank": s.dp_rank,
            "matched_tokens": s.matched_tokens,
            "by_medium": dict(s.by_medium),
            "score": s.score,
        }
        for s in scores
    ]


MAX_ERROR_CHARS = 512


def _error(status: int, message: str) -> web.Response:
    # msgspec quotes offending input in its messages (an unknown field's whole name): capped, or
    # a body of one long key gets itself echoed back, up to max_body_bytes.
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "... (truncated)"
    return web.Response(status=status, body=_json.encode({"error": message}), content_type="application/json")


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
) -> web.Application:
    """``health()`` returns why the member is unhealthy (None while healthy): /healthz then
    answers 503 with the reason even when caught up."""
    peers = [p.rstrip("/") for p in (peers or [])]
    app = web.Application(client_max_size=max_body_bytes)
    session: dict[str, aiohttp.ClientSession] = {}

    async def score(request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"body over {max_body_bytes} bytes")
        try:
            req = _decoder.decode(body)
        except msgspec.ValidationError as e:
            return _error(400, f"invalid request: {e}")
        except msgspec.DecodeError as e:
            return _error(400, f"invalid JSON: {e}")
        if len(req.token_ids) > max_tokens:
            return _error(413, f"{len(req.token_ids)} tokens; at most {max_tokens}")
        t0 = time.perf_counter()
        try:
            return await _score(req)
        finally:
            scope = "local" if req.local or not peers else "scatter"
            applier.metrics.score_latency.labels(scope).observe(time.perf_counter() - t0)

    async def _score(req: ScoreRequest) -> web.Response:
        local = _scores_json(applier.score(req.token_ids, lora_name=req.lora_name, block_size=req.block_size))[
            : req.limit
        ]
        if req.local or not peers:
            return web.Response(body=_json.encode({"scores": local}), content_type="application/json")
        answers, failed = await _scatter(req)
        return web.Response(
            body=_json.encode(
                {"scores": merge_scores([local, *answers], req.limit), "partial": bool(failed), "failed_peers": failed}
            ),
            content_type="application/json",
        )

    async def _scatter(req: ScoreRequest):
        if "s" not in session:
            session["s"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=peer_timeout_s))
        payload = _json.encode(
            {
                "token_ids": req.token_ids,
                "lora_name": req.lora_name,
                "block_size": req.block_size,
                "local": True,
                "limit": req.limit,
            }
        )

        async def one(peer: str):
            async with session["s"].post(
                f"{peer}/v1/score", data=payload, headers={"content-type": "application/json"}
            ) as r:
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}")
                return (await r.json())["scores"]

        results = await asyncio.gather(*(one(p) for p in peers), return_exceptions=True)
        answers, failed = [], []
        for peer, res in zip(peers, results, strict=False):
            if isinstance(res, BaseException):
                log.warning("peer %s failed: %r", peer, res)
                failed.append(peer)
            else:
                answers.append(res)
        return answers, failed

    async def workers(request: web.Request) -> web.Response:
        return web.Response(body=_json.encode({"workers": applier.workers()}), content_type="application/json")

    async def digest(request: web.Request) -> web.Response:
        return web.Response(
            body=_json.encode({"digest": applier.index.digest(), "holder_blocks": len(applier.index)}),
            content_type="application/json",
        )

    async def healthz(request: web.Request) -> web.Response:
        ok = ready()
        failure = health() if health is not None else None
        body: dict = {"ready": ok, "healthy": failure is None}
        if failure is not None:
            body["failure"] = failure
        return web.Response(
            status=200 if ok and failure is None else 503, body=_json.encode(body), content_type="application/json"
        )

    async def openapi(request: web.Request) -> web.Response:
        from .openapi import document

        return web.Response(
            body=_json.encode(document(max_tokens=max_tokens, max_results=MAX_RESULTS)),
            content_type="application/json",
        )

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=applier.metrics.render(), content_type="text/plain", charset="utf-8")

    async def close_session(app):
        if "s" in session:
            await session["s"].close()

    app.router.add_post("/v1/score", score)
    app.router.add_get("/v1/workers", workers)
    app.router.add_get("/v1/digest", digest)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.on_cleanup.append(close_session)
    return app


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
