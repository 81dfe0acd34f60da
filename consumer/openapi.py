"""The OpenAPI 3.1 description of an index member's HTTP API, served at ``GET /openapi.json``.

Kept beside, not inside, the handlers (``kvwire.consumer.http``) so the contract reads in one
place; ``tests/consumer/test_openapi.py`` runs schemathesis against a live member with it: every
documented input either succeeds or gets its documented 4xx, never a 5xx, and every response
matches the schema below. Objects allow fields beyond those listed, so adding a field to an
answer is not a breaking change.
"""

from __future__ import annotations

from typing import Any

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "string", "maxLength": 600}},
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def document(max_tokens: int = 256 * 1024, max_results: int = 1024) -> dict[str, Any]:
    score = {
        "type": "object",
        "required": ["instance_id", "dp_rank", "matched_tokens", "by_medium", "score"],
        "properties": {
            "instance_id": {"type": "string"},
            "dp_rank": {"type": "integer", "minimum": 0},
            "matched_tokens": {"type": "integer", "minimum": 0},
            "by_medium": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
            "score": {"type": "number"},
            "approximate": {
                "type": "boolean",
                "description": "present (true) when the worker's source cannot observe removals",
            },
            "speculative_tokens": {
                "type": "integer",
                "minimum": 0,
                "description": "Present on every entry while a speculative hold (POST /v1/route) is live: the "
                "leading tokens a hold on this worker shares with the prompt, never counted in matched_tokens. "
                "A worker with only a hold appears with matched_tokens 0. Entries are then ordered by "
                "max(matched_tokens, speculative_tokens), then score, then matched_tokens, then "
                "(instance_id, dp_rank); with no live hold the field is absent and the order is the usual one.",
            },
        },
    }
    scalar = {"type": ["string", "integer", "number", "boolean", "null"]}
    # The 256-values bound is in the description, not a maxItems: a generator breaking a maxItems
    # writes bodies over the size limit, which get 413 before the fields are read.
    block_keys = {
        "type": ["array", "null"],
        "items": {"anyOf": [scalar, {"type": "array", "items": scalar}]},
        "description": "One block's keys (at most 256 values, each a scalar or an array of at most 256 scalars)",
    }
    tenant = {
        "cache_salt": {
            "type": ["string", "null"],
            "description": "vLLM's cache_salt: only blocks stored under the same salt match (an empty salt is "
            "none, as in vLLM). Added to the first block's extra keys, where vLLM puts it.",
        },
        "extra_keys": {
            "type": ["array", "null"],
            "items": block_keys,
            "description": "Per block, the extra keys vLLM publishes in BlockStored.extra_keys (LoRA name, "
            "[mm identifier, offset] pairs, cache salt), or null for a block with none; arrays stand for "
            "vLLM's tuples. At most one entry per token, else 400.",
        },
    }
    token_ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 2**32 - 1},
        "description": f"The prompt's token ids; more than {max_tokens} get 413.",
    }
    request = {
        "type": "object",
        "required": ["token_ids"],
        "additionalProperties": False,
        "properties": {
            "token_ids": token_ids,
            "lora_name": {"type": ["string", "null"]},
            **tenant,
            "block_size": {"type": ["integer", "null"], "minimum": 1, "maximum": 1 << 20},
            "local": {
                "type": "boolean",
                "default": False,
                "description": "Answer from this member's partitions only (what peers send each other).",
            },
            "limit": {"type": "integer", "minimum": 1, "maximum": max_results, "default": 64},
            "top_k": {
                "type": ["integer", "null"],
                "minimum": 1,
                "maximum": max_results,
                "description": "The binary form's name for limit; given both, top_k wins.",
            },
        },
    }
    binary = {
        "type": "string",
        "format": "binary",
        "description": f"The prompt's token ids as little-endian uint32, 4 bytes each (at most {max_tokens}; "
        "a length that is not a multiple of 4 gets 400). The other fields are query parameters.",
    }

    def query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
        return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}

    binary_params = [
        query("lora_name", {"type": "string"}, "Binary body only (checked, then unused, with JSON): the LoRA name."),
        query("cache_salt", {"type": "string"}, "Binary body only: as the JSON field."),
        query(
            "extra_keys",
            {"type": "string", "contentMediaType": "application/json"},
            "Binary body only: the JSON field's array as JSON text.",
        ),
        query("block_size", {"type": "integer", "minimum": 1, "maximum": 1 << 20}, "Binary body only."),
        query("top_k", {"type": "integer", "minimum": 1, "maximum": max_results}, "Binary body only (default 64)."),
        query("limit", {"type": "integer", "minimum": 1, "maximum": max_results}, "Binary body only: as top_k."),
        query("local", {"type": "boolean"}, "Binary body only: answer from this member's partitions only."),
    ]
    rank = {
        "type": "object",
        "required": ["tp_rank", "epoch", "last_seq", "trusted"],
        "properties": {
            "tp_rank": {"type": "integer"},
            "epoch": {"type": "integer"},
            "last_seq": {"type": "integer"},
            "trusted": {"type": "boolean"},
            "untrusted_reason": {"type": ["string", "null"]},
            "last_seen_us": {"type": "integer"},
            "records": {"type": "integer"},
            "gaps": {"type": "integer"},
        },
    }
    worker = {
        "type": "object",
        "required": ["instance_id", "dp_rank", "blocks", "trusted"],
        "properties": {
            "instance_id": {"type": "string"},
            "dp_rank": {"type": "integer"},
            "tp_size": {"type": "integer"},
            "blocks": {"type": "integer", "minimum": 0},
            "blocks_by_medium": {"type": "object", "additionalProperties": {"type": "integer"}},
            "orphans": {"type": "integer"},
            "trusted": {"type": "boolean"},
            "approximate": {
                "type": "boolean",
                "description": "a rank's latest record came from a source that cannot observe removals",
            },
            "ranks": {"type": "array", "items": rank},
        },
    }
    candidate = {
        "type": "object",
        "required": ["instance_id"],
        "additionalProperties": False,
        "properties": {
            "instance_id": {"type": "string"},
            "dp_rank": {"type": "integer", "minimum": 0, "default": 0},
        },
    }
    route_request = {
        "type": "object",
        "required": ["token_ids"],
        "additionalProperties": False,
        "properties": {
            "token_ids": token_ids,
            "lora_name": {"type": ["string", "null"]},
            **tenant,
            "candidates": {
                "type": ["array", "null"],
                "items": candidate,
                "minItems": 1,
                "maxItems": max_results,
                "description": "Workers to choose from (not empty); omitted: every trusted worker the index "
                "knows, and none known gets 503.",
            },
            "block_size": {"type": ["integer", "null"], "minimum": 1, "maximum": 1 << 20},
        },
    }
    route_row = {
        "type": "object",
        "required": ["instance_id", "dp_rank", "matched_tokens", "speculative_tokens", "score"],
        "properties": {
            "instance_id": {"type": "string"},
            "dp_rank": {"type": "integer", "minimum": 0},
            "matched_tokens": {"type": "integer", "minimum": 0, "description": "Confirmed by the index"},
            "speculative_tokens": {"type": "integer", "minimum": 0, "description": "Credit of live holds"},
            "score": {"type": "number"},
        },
    }
    route_answer = {
        "type": "object",
        "required": ["worker", "matched_tokens", "speculative_tokens", "hold", "scores"],
        "properties": {
            "worker": {
                "type": "object",
                "required": ["instance_id", "dp_rank"],
                "properties": {"instance_id": {"type": "string"}, "dp_rank": {"type": "integer", "minimum": 0}},
            },
            "matched_tokens": {"type": "integer", "minimum": 0, "description": "The worker's confirmed prefix"},
            "speculative_tokens": {
                "type": "integer",
                "minimum": 0,
                "description": "The worker's credit from holds recorded before this route",
            },
            "hold": {
                "type": ["object", "null"],
                "required": ["expires_in_ms"],
                "properties": {"expires_in_ms": {"type": "integer", "minimum": 0}},
                "description": "The hold recorded on the worker; null when holds are off (TTL 0) or the "
                "prompt has no full block.",
            },
            "scores": {"type": "array", "items": route_row, "description": "Every candidate, in pick order"},
            "partial": {"type": "boolean", "description": "A peer did not answer."},
            "failed_peers": {"type": "array", "items": {"type": "string"}},
        },
    }
    health = {
        "type": "object",
        "required": ["ready"],
        "properties": {
            "ready": {"type": "boolean", "description": "Caught up with the end offsets seen at assignment."},
            "healthy": {"type": "boolean", "description": "False once ingest died or snapshots keep failing."},
            "failure": {"type": "string", "description": "Why the member is unhealthy."},
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvwire index member",
            "version": "1",
            "description": "Prefix-cache scores from the index a consumer-group member builds from Kafka.",
        },
        "paths": {
            "/v1/score": {
                "post": {
                    "operationId": "score",
                    "summary": "Score workers by the longest cached prefix of a prompt",
                    "description": "JSON, or the binary form (application/octet-stream) whose fields other "
                    "than the tokens travel as query parameters; both give the same answer.",
                    "parameters": binary_params,
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {"schema": request},
                            "application/octet-stream": {"schema": binary},
                        },
                    },
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["scores"],
                                "properties": {
                                    "scores": {"type": "array", "items": score, "maxItems": max_results},
                                    "partial": {"type": "boolean", "description": "A peer did not answer."},
                                    "failed_peers": {"type": "array", "items": {"type": "string"}},
                                },
                            },
                            "Workers with a matched prefix, best first",
                        ),
                        "400": _json(
                            _ERROR, "Malformed JSON, a binary body not whole uint32s, or a request outside the schema"
                        ),
                        "413": _json(_ERROR, "Body or token count over the limit"),
                    },
                }
            },
            "/v1/route": {
                "post": {
                    "operationId": "route",
                    "summary": "Pick the worker for a prompt and record a speculative hold on it",
                    "description": "The pick: highest effective tokens (max of the confirmed matched_tokens "
                    "and the speculative tokens of live holds), then highest confirmed score, then the fewest "
                    "routes sent to the worker within the last hold TTL (2 s when holds are off), then "
                    "(instance_id, dp_rank) order. The hold counts for prompts sharing leading blocks with "
                    "this one until the worker's own BlockStored confirms it or its TTL ends; it is never "
                    "index state (snapshots, digests) and never reported as matched_tokens.",
                    "requestBody": {"required": True, "content": {"application/json": {"schema": route_request}}},
                    "responses": {
                        "200": _json(route_answer, "The chosen worker, and every candidate's figures"),
                        "400": _json(_ERROR, "Malformed JSON, query parameters, or a request outside the schema"),
                        "413": _json(_ERROR, "Body or token count over the limit"),
                        "503": _json(_ERROR, "No candidate: none given and no trusted worker known"),
                    },
                }
            },
            "/v1/workers": {
                "get": {
                    "operationId": "workers",
                    "summary": "Per worker: blocks, epochs, sequence numbers, trust",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["workers"],
                                "properties": {"workers": {"type": "array", "items": worker}},
                            },
                            "Known workers",
                        )
                    },
                }
            },
            "/v1/digest": {
                "get": {
                    "operationId": "digest",
                    "summary": "Order-independent digest of the index (replay checks)",
                    "responses": {
                        "200": _json(
                            {
                                "type": "object",
                                "required": ["digest", "holder_blocks"],
                                "properties": {
                                    "digest": {"type": "string"},
                                    "holder_blocks": {"type": "integer", "minimum": 0},
                                },
                            },
                            "Digest and size",
                        )
                    },
                }
            },
            "/healthz": {
                "get": {
                    "operationId": "healthz",
                    "summary": "Readiness and health for an orchestrator",
                    "responses": {
                        "200": _json(health, "Caught up and healthy"),
                        "503": _json(health, "Still catching up, or unhealthy (see failure)"),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "Prometheus text exposition format",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "summary": "This document",
                    "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1 document")},
                }
            },
        },
    }
