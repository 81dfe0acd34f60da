"""The HTTP API's contract: its request and answer structs and its route table.

``kvwire.consumer.http`` decodes requests with these structs, encodes answers from them (the
score answer's entries are encoded by the core, as ``HeldScore`` describes them) and registers
its handlers from ``ROUTES``; ``kvwire.consumer.openapi`` renders the same table and structs
as the OpenAPI document. So a route, a field or a bound is declared here once.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, UnsetType

from .holds import HeldScore
from .openapi import JSON, Body, Operation
from .tenants import MAX_KEYS_PER_BLOCK

MAX_RESULTS = 1024
MAX_ERROR_CHARS = 512
TRUNCATED = "... (truncated)"
BINARY = "application/octet-stream"

TokenId = Annotated[int, Meta(ge=0, lt=2**32)]
BlockSize = Annotated[int, Meta(ge=1, le=1 << 20)]
TopK = Annotated[int, Meta(ge=1, le=MAX_RESULTS)]
Count = Annotated[int, Meta(ge=0)]
# What JSON can carry of a key value (arrays stand for vLLM's tuples); the counts are checked by
# ``tenants.check_extra_keys``. No maxItems: a generator breaking one writes bodies over the size
# limit, which get 413 before the fields are read.
KeyValue = str | int | float | bool | None
BlockKeys = Annotated[
    list[KeyValue | list[KeyValue]],
    Meta(
        description=f"One block's keys: at most {MAX_KEYS_PER_BLOCK} values, each a scalar or an array "
        f"of at most {MAX_KEYS_PER_BLOCK} scalars"
    ),
]
ExtraKeys = list[BlockKeys | None]


class Prompt(msgspec.Struct, forbid_unknown_fields=True):
    """What a query names: the prompt and its tenant (``kvwire.consumer.tenants``)."""

    token_ids: Annotated[list[TokenId], Meta(description="The prompt's token ids.")]
    lora_name: str | None = None
    cache_salt: Annotated[
        str | None,
        Meta(
            description="vLLM's cache_salt: only blocks stored under the same salt match (an empty salt "
            "is none, as in vLLM). Added to the first block's extra keys, where vLLM puts it."
        ),
    ] = None
    extra_keys: Annotated[
        ExtraKeys | None,
        Meta(
            description="Per block, the extra keys vLLM publishes in BlockStored.extra_keys (LoRA name, "
            "[mm identifier, offset] pairs, cache salt), or null for a block with none; arrays stand for "
            "vLLM's tuples. At most one entry per token, else 400."
        ),
    ] = None
    block_size: BlockSize | None = None


class ScoreRequest(Prompt, forbid_unknown_fields=True):
    local: Annotated[
        bool, Meta(description="Answer from this member's partitions only (what peers send each other).")
    ] = False
    limit: TopK = 64
    top_k: Annotated[TopK | None, Meta(description="The binary form's name for limit; given both, top_k wins.")] = None


class Candidate(msgspec.Struct, forbid_unknown_fields=True):
    instance_id: str
    dp_rank: Annotated[int, Meta(ge=0)] = 0


class RouteRequest(Prompt, forbid_unknown_fields=True):
    candidates: Annotated[
        Annotated[list[Candidate], Meta(min_length=1, max_length=MAX_RESULTS)] | None,
        Meta(
            description="Workers to choose from (not empty); omitted: every trusted worker the index "
            "knows, and none known gets 503."
        ),
    ] = None


Partial = Annotated[bool, Meta(description="Present with peers: a peer did not answer.")] | UnsetType
FailedPeers = Annotated[list[str], Meta(description="Present with peers: those that did not answer.")] | UnsetType


class ScoreAnswer(msgspec.Struct):
    scores: Annotated[list[HeldScore], Meta(max_length=MAX_RESULTS)]
    partial: Partial = UNSET
    failed_peers: FailedPeers = UNSET


class WorkerRef(msgspec.Struct):
    instance_id: str
    dp_rank: int


class HoldAnswer(msgspec.Struct):
    expires_in_ms: Count


class RouteScore(msgspec.Struct):
    instance_id: str
    dp_rank: int
    matched_tokens: Annotated[Count, Meta(description="Confirmed by the index")]
    speculative_tokens: Annotated[Count, Meta(description="Credit of live holds")]
    score: float


class RouteAnswer(msgspec.Struct):
    worker: WorkerRef
    matched_tokens: Annotated[Count, Meta(description="The worker's confirmed prefix")]
    speculative_tokens: Annotated[Count, Meta(description="The worker's credit from holds recorded before this route")]
    hold: Annotated[
        HoldAnswer | None,
        Meta(
            description="The hold recorded on the worker; null when holds are off (TTL 0) or the prompt "
            "has no full block."
        ),
    ]
    scores: Annotated[list[RouteScore], Meta(description="Every candidate, in pick order")]
    partial: Partial = UNSET
    failed_peers: FailedPeers = UNSET


class RankInfo(msgspec.Struct):
    tp_rank: int
    epoch: int
    last_seq: int
    trusted: bool
    untrusted_reason: str | None
    last_seen_us: int
    records: int
    gaps: int


class WorkerInfo(msgspec.Struct):
    instance_id: str
    dp_rank: int
    tp_size: int
    blocks: Count
    blocks_by_medium: dict[str, Count]
    orphans: Count
    trusted: bool
    approximate: Annotated[
        bool, Meta(description="A rank's latest record came from a source that cannot observe removals.")
    ]
    ranks: list[RankInfo]


class WorkersAnswer(msgspec.Struct):
    workers: list[WorkerInfo]


class DigestAnswer(msgspec.Struct):
    digest: str
    holder_blocks: Count


class HealthAnswer(msgspec.Struct):
    ready: Annotated[bool, Meta(description="Caught up with the end offsets seen at assignment.")]
    healthy: Annotated[bool, Meta(description="False once ingest died or snapshots keep failing.")]
    failure: Annotated[str, Meta(description="Why the member is unhealthy.")] | UnsetType = UNSET


class ErrorAnswer(msgspec.Struct):
    error: Annotated[str, Meta(max_length=MAX_ERROR_CHARS + len(TRUNCATED))]


# The score fields the binary form carries in its query string.
SCORE_QUERY = ("lora_name", "cache_salt", "extra_keys", "block_size", "top_k", "limit", "local")

_ERROR = Body(ErrorAnswer)
_TOO_LARGE = ("Body or token count over the limit", _ERROR)

ROUTES: tuple[Operation, ...] = (
    Operation(
        "POST",
        "/v1/score",
        "score",
        "Score workers by the longest cached prefix of a prompt",
        description="JSON, or the binary form (application/octet-stream) whose fields other than the "
        "tokens travel as query parameters; both give the same answer.",
        request=(
            Body(ScoreRequest),
            Body(
                media=BINARY,
                schema={"type": "string", "format": "binary"},
                description="The prompt's token ids as little-endian uint32, 4 bytes each (a length "
                "that is not a multiple of 4 gets 400). The other fields are query parameters.",
            ),
        ),
        query=SCORE_QUERY,
        query_description="For the binary body; with a JSON body checked, then unused.",
        responses={
            200: ("Workers with a matched prefix, best first", Body(ScoreAnswer)),
            400: ("Malformed JSON, a binary body not whole uint32s, or a request outside the schema", _ERROR),
            413: _TOO_LARGE,
        },
    ),
    Operation(
        "POST",
        "/v1/route",
        "route",
        "Pick the worker for a prompt and record a speculative hold on it",
        description="The pick: highest effective tokens (max of the confirmed matched_tokens and the "
        "speculative tokens of live holds), then highest confirmed score, then the fewest routes sent to "
        "the worker within the last hold TTL (2 s when holds are off), then (instance_id, dp_rank) order. "
        "The hold counts for prompts sharing leading blocks with this one until the worker's own "
        "BlockStored confirms it or its TTL ends; it is never index state (snapshots, digests) and never "
        "reported as matched_tokens.",
        request=(Body(RouteRequest),),
        responses={
            200: ("The chosen worker, and every candidate's figures", Body(RouteAnswer)),
            400: ("Malformed JSON, query parameters, or a request outside the schema", _ERROR),
            413: _TOO_LARGE,
            503: ("No candidate: none given and no trusted worker known", _ERROR),
        },
    ),
    Operation(
        "GET",
        "/v1/workers",
        "workers",
        "Per worker: blocks, epochs, sequence numbers, trust",
        responses={200: ("Known workers", Body(WorkersAnswer))},
    ),
    Operation(
        "GET",
        "/v1/digest",
        "digest",
        "Order-independent digest of the index (replay checks)",
        responses={200: ("Digest and size", Body(DigestAnswer))},
    ),
    Operation(
        "GET",
        "/healthz",
        "healthz",
        "Readiness and health for an orchestrator",
        responses={
            200: ("Caught up and healthy", Body(HealthAnswer)),
            503: ("Still catching up, or unhealthy (see failure)", Body(HealthAnswer)),
        },
    ),
    Operation(
        "GET",
        "/metrics",
        "metrics",
        "Prometheus metrics",
        responses={200: ("Prometheus text exposition format", Body(media="text/plain", schema={"type": "string"}))},
    ),
    Operation(
        "GET",
        "/openapi.json",
        "openapi",
        "This document",
        responses={200: ("OpenAPI 3.1 document", Body(media=JSON, schema={"type": "object"}))},
    ),
)
