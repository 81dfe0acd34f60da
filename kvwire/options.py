"""Kafka client options shared by every kvwire command: security from the environment.

Credentials come from the environment (or config) and are never logged:
KVWIRE_KAFKA_SECURITY_PROTOCOL (PLAINTEXT, SASL_PLAINTEXT, SASL_SSL, SSL),
KVWIRE_KAFKA_SASL_MECHANISM (SCRAM-SHA-256, SCRAM-SHA-512, PLAIN),
KVWIRE_KAFKA_SASL_USERNAME, KVWIRE_KAFKA_SASL_PASSWORD, KVWIRE_KAFKA_SSL_CAFILE.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

PROTOCOLS = ("PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL")
MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")
# Substrings of option names whose values are secrets, in aiokafka's and our own naming.
_SECRET_PARTS = ("password", "secret", "token", "jaas")


class ClientOptions(dict):
    """A plain dict for aiokafka (`**opts`), but its repr is redacted: the options end up inside
    config dataclasses (PublisherConfig, IngestConfig) whose repr anyone may log."""

    def __repr__(self) -> str:
        return repr(redact(self))

    __str__ = __repr__


def client_options_from_env(env: Mapping[str, str] = os.environ) -> dict:
    """aiokafka keyword arguments for the configured security, or {} for PLAINTEXT.

    Raises ValueError for a configuration that could only fail later as an opaque connection
    error (unknown protocol or mechanism, SASL without a username or password); the message
    names the variable, never its value."""
    proto = (env.get("KVWIRE_KAFKA_SECURITY_PROTOCOL") or "PLAINTEXT").strip().upper()
    if proto not in PROTOCOLS:
        raise ValueError(f"KVWIRE_KAFKA_SECURITY_PROTOCOL must be one of {', '.join(PROTOCOLS)}, not {proto!r}")
    if proto == "PLAINTEXT":
        return ClientOptions()
    opts = ClientOptions(security_protocol=proto)
    if proto.startswith("SASL"):
        mech = (env.get("KVWIRE_KAFKA_SASL_MECHANISM") or "SCRAM-SHA-256").strip().upper()
        if mech not in MECHANISMS:
            raise ValueError(f"KVWIRE_KAFKA_SASL_MECHANISM must be one of {', '.join(MECHANISMS)}, not {mech!r}")
        user = env.get("KVWIRE_KAFKA_SASL_USERNAME", "")
        password = env.get("KVWIRE_KAFKA_SASL_PASSWORD", "")
        missing = [
            n for n, v in (("KVWIRE_KAFKA_SASL_USERNAME", user), ("KVWIRE_KAFKA_SASL_PASSWORD", password)) if not v
        ]
        if missing:
            raise ValueError(f"{proto} needs {' and '.join(missing)}")
        opts.update(sasl_mechanism=mech, sasl_plain_username=user, sasl_plain_password=password)
    if proto.endswith("SSL"):
        import ssl

        # Hostname checking stays on: the broker's certificate must name the bootstrap host.
        opts["ssl_context"] = ssl.create_default_context(cafile=env.get("KVWIRE_KAFKA_SSL_CAFILE") or None)
    return opts


def _is_secret(key: Any) -> bool:
    k = str(key).lower()
    return any(p in k for p in _SECRET_PARTS)


def redact(opts: Mapping[str, Any]) -> dict:
    """Options safe to log: secret values become "***" (nested mappings too)."""
    out: dict = {}
    for k, v in opts.items():
        if _is_secret(k):
            out[k] = "***" if v else v
        elif isinstance(v, Mapping):
            out[k] = redact(v)
        else:
            out[k] = v
    return out
