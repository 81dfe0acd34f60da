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

from .dynamo_api import DynamoQuery, DynamoQueryByHash, DynamoScores, DynamoWorker, RouterEvents
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
    token_ids: Annotated[
        list[TokenId], Meta(description="The prompt's token ids (empty or absent with block_hashes).")
    ] = msgspec.field(default_factory=list)
    block_hashes: Annotated[
        list[int] | None,
        Meta(
            description="Instead of token_ids: the prompt's full blocks' v1 content hashes, as Dynamo, "
            "vllm-router and SMG compute them (dynamo.llm.compute_block_hash_for_seq; with a LoRA, its seed "
            "is in them), as signed i64 or u64. Not with lora_name, cache_salt or extra_keys (a v1 hash "
            "carries what it carries), and no speculative holds (they are keyed by tokens). block_size: "
            "what each hash covers; omitted, every block size the index has."
        ),
    ] = None
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
    model: Annotated[str, Meta(description="The served model its records name; empty when none did.")]
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


class StreamInfo(msgspec.Struct):
    instance_id: str
    dp_rank: Annotated[int, Meta(ge=0)]
    worker_id: Annotated[
        int,
        Meta(
            ge=0,
            description="The instance's stable id (kvwire.consumer.worker_ids), one per instance with its DP "
            "ranks under it, as Dynamo keys workers; the same on /query, /workers and /dump.",
        ),
    ]
    endpoint: Annotated[str, Meta(description="ZMQ PUB of vLLM's KV-event wire, on the empty topic.")]
    replay_endpoint: Annotated[str, Meta(description="ZMQ ROUTER answering vLLM's replay requests, at any age.")]
    block_size: Annotated[int, Meta(ge=0, description="Of the worker's latest store; 0 before any.")]
    model: Annotated[str, Meta(description="The served model its records name; empty when none did.")]


class StreamsAnswer(msgspec.Struct):
    streams: list[StreamInfo]


class ErrorAnswer(msgspec.Struct):
    error: Annotated[str, Meta(max_length=MAX_ERROR_CHARS + len(TRUNCATED))]


# The score fields the binary form carries in its query string.
SCORE_QUERY = ("lora_name", "cache_salt", "extra_keys", "block_size", "top_k", "limit", "local")

_ERROR = Body(ErrorAnswer)
_DYNAMO_ERROR = _ERROR  # Dynamo's error body is kvwire's: {"error": message}
# Dynamo's statuses for a refused query (axum's: 400 syntax, 422 schema, e.g. a hash outside i64).
_DYNAMO_REFUSALS = {
    400: ("Malformed JSON", _DYNAMO_ERROR),
    404: ("No worker serves model_name", _DYNAMO_ERROR),
    413: ("Body, token or hash count over the limit", _DYNAMO_ERROR),
    422: ("A body outside the schema", _DYNAMO_ERROR),
}
_DYNAMO = "Dynamo's standalone indexer (ai-dynamo 1.6.1), same path and shapes (kvwire.consumer.dynamo_api). "
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
        "POST",
        "/query",
        "dynamo_query",
        "Dynamo: per worker and DP rank, the leading tokens of a prompt held, per tier",
        description=_DYNAMO + "Tokens are hashed by kvwire's key rule, which is Dynamo's v1 block hash; "
        "model_name selects the workers whose records name that model, and workers that name none.",
        request=(Body(DynamoQuery),),
        responses={
            200: (
                "scores: device tier per worker id and DP rank; instances: every tier, cumulative",
                Body(DynamoScores),
            ),
            **_DYNAMO_REFUSALS,
        },
    ),
    Operation(
        "POST",
        "/query_by_hash",
        "dynamo_query_by_hash",
        "Dynamo: the same as /query, for a prompt given as its blocks' content hashes",
        description=_DYNAMO + "block_hashes are the v1 content hashes of the prompt's full blocks as signed "
        "i64 (dynamo.llm.compute_block_hash_for_seq), chained here into the sequence hashes kvwire keys by.",
        request=(Body(DynamoQueryByHash),),
        responses={200: ("As /query", Body(DynamoScores)), **_DYNAMO_REFUSALS},
    ),
    Operation(
        "GET",
        "/workers",
        "dynamo_workers",
        "Dynamo: the instances indexed, by worker id",
        description=_DYNAMO,
        responses={200: ("Known instances", Body(list[DynamoWorker]))},
    ),
    Operation(
        "GET",
        "/dump",
        "dynamo_dump",
        "Dynamo: the indexed state as RouterEvents, for peers that load it at start",
        description=_DYNAMO + 'Keyed "<model>:default"; the stored events of every trusted worker\'s held '
        "blocks, parents first (dynamo.select_service --indexer-peers and dynamo.indexer --peers load it). "
        "Needs the block table that --event-streams keeps (token ids are not index state).",
        responses={
            200: ("One entry per model", Body(dict[str, RouterEvents])),
            404: ("The member keeps no block table (started without --event-streams)", _DYNAMO_ERROR),
        },
    ),
    Operation(
        "POST",
        "/register",
        "dynamo_register",
        "Dynamo: register a worker's ZMQ endpoint (not supported: kvwire reads the log)",
        description=_DYNAMO + "Always 501: kvwire learns workers from the KV-event log.",
        responses={501: ("Not how kvwire learns workers", _DYNAMO_ERROR)},
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
        "/v1/streams",
        "streams",
        "The vLLM-format KV-event streams this member serves, one per worker (instance_id, dp_rank)",
        description="kvwire index --event-streams: each worker's state as the index holds it (TP ranks "
        "aggregated, trust applied) on vLLM's ZMQ wire, for routers that subscribe to engines "
        "(vllm-router --kv-event-source, dynamo.indexer --workers). A worker keeps its entry and ports "
        "while the member lives: once it is dead (expired) or its partition moved, its stream has sent "
        "AllBlocksCleared and stays cleared until the worker is trusted again. ZMQ there has no "
        "authentication or encryption.",
        responses={
            200: ("Every stream, in port order", Body(StreamsAnswer)),
            404: ("The member serves no streams (started without --event-streams)", _ERROR),
        },
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
