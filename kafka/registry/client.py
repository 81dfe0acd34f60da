"""A small client for the Confluent-compatible schema-registry REST API.

Speaks to Confluent Schema Registry and to Apicurio Registry's ``/apis/ccompat/v7`` alike, so
pointing kvwire at either is one setting, the base URL. Synchronous (stdlib urllib): kvwire asks
the registry rarely (once per producer start, once per unknown id on a consumer), and async
callers run it in a thread. Credentials come from the environment and never appear in a repr,
a log line or an error message.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
COMPATIBILITY_LEVELS = (
    "NONE",
    "BACKWARD",
    "BACKWARD_TRANSITIVE",
    "FORWARD",
    "FORWARD_TRANSITIVE",
    "FULL",
    "FULL_TRANSITIVE",
)
# kvwire's rule (schemas/README.md): every version reads every other, in both directions.
KVWIRE_COMPATIBILITY = "FULL_TRANSITIVE"

ENV_URL = "KVWIRE_SCHEMA_REGISTRY_URL"
ENV_USERNAME = "KVWIRE_SCHEMA_REGISTRY_USERNAME"
ENV_PASSWORD = "KVWIRE_SCHEMA_REGISTRY_PASSWORD"


class RegistryError(RuntimeError):
    """The registry answered with an error. ``status`` is the HTTP status (0: no answer),
    ``error_code`` the registry's own code (40401 subject not found, 40403 schema not found,
    409 incompatible, ...)."""

    def __init__(self, message: str, status: int = 0, error_code: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.error_code = error_code


class NotFound(RegistryError):
    """404: no such subject, version or schema id."""


class IncompatibleSchema(RegistryError):
    """409: the subject's compatibility rule refuses the schema."""


class RegistryUnavailable(RegistryError):
    """No answer, or a 5xx: worth retrying, never a verdict about the schema."""


@dataclass(frozen=True)
class RegistryConfig:
    """Where the registry is. ``url`` is the Confluent-compatible base: ``http://host:8081`` for
    Confluent's, ``http://host:8080/apis/ccompat/v7`` for Apicurio's (what `kvwire registry start`
    prints)."""

    url: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"schema registry URL must be http(s)://host[:port][/path], not {self.url!r}")
        if parts.username or parts.password:
            raise ValueError(f"put registry credentials in {ENV_USERNAME}/{ENV_PASSWORD}, not in the URL")
        object.__setattr__(self, "url", self.url.rstrip("/"))

    def __repr__(self) -> str:
        auth = "basic-auth" if self.username else "no auth"
        return f"RegistryConfig(url={self.url!r}, {auth})"

    @classmethod
    def from_env(cls, url: str | None = None, env: Mapping[str, str] = os.environ) -> RegistryConfig | None:
        """``url`` (or KVWIRE_SCHEMA_REGISTRY_URL) with basic-auth credentials from
        KVWIRE_SCHEMA_REGISTRY_USERNAME / _PASSWORD; None when no URL is configured."""
        url = url or env.get(ENV_URL) or None
        if not url:
            return None
        user = env.get(ENV_USERNAME) or None
        password = env.get(ENV_PASSWORD) or None
        if (user is None) != (password is None):
            raise ValueError(f"basic auth needs both {ENV_USERNAME} and {ENV_PASSWORD}")
        return cls(url, user, password)


def topic_subject(topic: str) -> str:
    """Confluent's default TopicNameStrategy for record values: what AvroConverter, ksqlDB and
    kafka-avro-console-consumer expect."""
    return f"{topic}-value"


class RegistryClient:
    def __init__(self, config: RegistryConfig) -> None:
        self.config = config
        headers = {"Content-Type": CONTENT_TYPE, "Accept": CONTENT_TYPE + ", application/json"}
        if config.username is not None:
            token = base64.b64encode(f"{config.username}:{config.password}".encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        self._headers = headers

    def __repr__(self) -> str:
        return f"RegistryClient({self.config!r})"

    @property
    def url(self) -> str:
        return self.config.url

    # ------------------------------------------------------------ transport

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=self._headers)
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout_s) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as e:
            raise self._error(method, path, e) from None
        except (OSError, ValueError) as e:  # refused, reset, timeout, DNS, TLS
            raise RegistryUnavailable(f"{method} {self.url}{path}: {type(e).__name__}: {e}") from None
        try:
            return json.loads(text) if text else None
        except ValueError:
            raise RegistryError(f"{method} {self.url}{path}: not JSON: {text[:200]!r}", 200) from None

    def _error(self, method: str, path: str, e: urllib.error.HTTPError) -> RegistryError:
        try:
            doc = json.loads(e.read().decode() or "{}")
        except (ValueError, OSError):
            doc = {}
        code = doc.get("error_code") if isinstance(doc, dict) else None
        detail = doc.get("message") if isinstance(doc, dict) else None
        msg = f"{method} {self.url}{path}: HTTP {e.code}" + (f": {str(detail)[:500]}" if detail else "")
        cls: type[RegistryError]
        if e.code == 404:
            cls = NotFound
        elif e.code == 409:
            cls = IncompatibleSchema
        elif e.code >= 500 or e.code == 429:
            cls = RegistryUnavailable
        else:
            cls = RegistryError
        return cls(msg, e.code, code if isinstance(code, int) else None)

    @staticmethod
    def _subject(subject: str) -> str:
        return urllib.parse.quote(subject, safe="")

    # ------------------------------------------------------------ API

    def register(self, subject: str, schema: str) -> int:
        """The subject's id for ``schema``, registering it as the next version when new.
        Raises IncompatibleSchema when the subject's compatibility rule refuses it."""
        doc = self._call("POST", f"/subjects/{self._subject(subject)}/versions", {"schema": schema})
        return int(doc["id"])

    def lookup(self, subject: str, schema: str) -> int | None:
        """The id of ``schema`` (this exact text) under ``subject``, or None if not registered."""
        try:
            doc = self._call("POST", f"/subjects/{self._subject(subject)}", {"schema": schema})
        except NotFound:
            return None
        return int(doc["id"])

    def schema(self, schema_id: int) -> str:
        """The schema text registered under ``schema_id``. Raises NotFound."""
        doc = self._call("GET", f"/schemas/ids/{int(schema_id)}")
        return str(doc["schema"])

    def versions(self, subject: str) -> list[int]:
        try:
            return [int(v) for v in self._call("GET", f"/subjects/{self._subject(subject)}/versions")]
        except NotFound:
            return []

    def subjects(self) -> list[str]:
        return [str(s) for s in self._call("GET", "/subjects")]

    def compatibility(self, subject: str | None = None) -> str | None:
        """The subject's level (None when it has none of its own), or the global one."""
        path = "/config" if subject is None else f"/config/{self._subject(subject)}"
        try:
            doc = self._call("GET", path)
        except NotFound:
            return None
        level = doc.get("compatibilityLevel") or doc.get("compatibility")
        return None if level is None else str(level)

    def set_compatibility(self, subject: str, level: str = KVWIRE_COMPATIBILITY) -> None:
        if level not in COMPATIBILITY_LEVELS:
            raise ValueError(f"compatibility must be one of {', '.join(COMPATIBILITY_LEVELS)}")
        self._call("PUT", f"/config/{self._subject(subject)}", {"compatibility": level})

    def is_compatible(self, subject: str, schema: str) -> bool:
        """What register() would decide, without registering."""
        doc = self._call(
            "POST", f"/compatibility/subjects/{self._subject(subject)}/versions/latest", {"schema": schema}
        )
        return bool(doc.get("is_compatible"))
