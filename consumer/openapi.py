"""The OpenAPI 3.1 description of an index member's HTTP API, served at ``GET /openapi.json``.

Rendered from the route table ``kvwire.consumer.http.ROUTES``, the one the app registers its
handlers from, and from the msgspec structs its handlers decode requests with and encode answers
from (``msgspec.json.schema_components``): a route cannot be served without being described, and
a field cannot change without the document changing with it. ``tests/consumer/test_openapi.py``
runs schemathesis against a live member with it. Answers' objects allow fields beyond those
listed, so adding a field to an answer is not a breaking change; requests' do not.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

JSON = "application/json"
_REF = "#/components/schemas/{name}"


@dataclass(frozen=True)
class Body:
    """A request or answer body: ``type``, a msgspec type, as JSON; or, for what is not JSON,
    ``schema`` (a JSON Schema) under ``media``."""

    type: Any = None
    media: str = JSON
    schema: Mapping[str, Any] | None = None
    description: str | None = None


@dataclass(frozen=True)
class Operation:
    """One route: ``make_app`` serves it with its handler named ``name`` (the operationId)."""

    method: str
    path: str
    name: str
    summary: str
    responses: Mapping[int, tuple[str, Body]]
    description: str | None = None
    request: tuple[Body, ...] = ()
    # Fields of the JSON request's struct that the query string may carry too (the binary form's).
    query: tuple[str, ...] = ()
    query_description: str | None = None


def _bodies(op: Operation) -> Iterator[Body]:
    yield from op.request
    for _, body in op.responses.values():
        yield body


def _without_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A field's schema as a query parameter, which is there or not but never null."""
    s = {k: v for k, v in schema.items() if not (k == "default" and v is None)}
    branches = s.pop("anyOf", None)
    if branches is not None:
        rest = [b for b in branches if b != {"type": "null"}]
        s = {**(rest[0] if len(rest) == 1 else {"anyOf": rest}), **s}
    return s


def _query_parameter(name: str, schema: dict[str, Any], note: str | None) -> dict[str, Any]:
    s = _without_null(schema)
    description = " ".join(x for x in (s.pop("description", None), note) if x)
    if s.get("type") == "array":
        # Query strings carry no arrays: the field goes as its JSON text.
        s = {"type": "string", "contentMediaType": JSON, "contentSchema": s}
    out: dict[str, Any] = {"name": name, "in": "query", "required": False, "schema": s}
    if description:
        out["description"] = description
    return out


def document(routes: tuple[Operation, ...], limits: str) -> dict[str, Any]:
    """``limits`` is the member's input bounds in words, the 413s' description."""
    types = list(dict.fromkeys(b.type for op in routes for b in _bodies(op) if b.type is not None))
    rendered, components = msgspec.json.schema_components(types, ref_template=_REF)
    schema_of = dict(zip(types, rendered, strict=True))

    def content(body: Body) -> dict[str, Any]:
        schema = dict(body.schema or {}) if body.type is None else schema_of[body.type]
        if body.description:
            schema = {**schema, "description": body.description}
        return {body.media: {"schema": schema}}

    paths: dict[str, dict[str, Any]] = {}
    for op in routes:
        spec: dict[str, Any] = {"operationId": op.name, "summary": op.summary}
        if op.description:
            spec["description"] = op.description
        if op.query:
            fields = components[op.request[0].type.__name__]["properties"]
            spec["parameters"] = [_query_parameter(n, fields[n], op.query_description) for n in op.query]
        if op.request:
            spec["requestBody"] = {
                "required": True,
                "content": {k: v for b in op.request for k, v in content(b).items()},
            }
        spec["responses"] = {
            str(status): {"description": f"{text} ({limits})" if status == 413 else text, "content": content(body)}
            for status, (text, body) in op.responses.items()
        }
        paths.setdefault(op.path, {})[op.method.lower()] = spec
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvwire index member",
            "version": "1",
            "description": "Prefix-cache scores from the index a consumer-group member builds from Kafka.",
        },
        "paths": paths,
        "components": {"schemas": components},
    }
