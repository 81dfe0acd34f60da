"""Kafka client configuration shared by every kvwire client: the standard Kafka property names.

Operators already hold their cluster's client settings as Java-style properties
(``security.protocol``, ``sasl.mechanism``, ``sasl.jaas.config``, ``ssl.ca.location``, ...).
kvwire reads the same names, from two places, later winning:

1. a properties file: ``--kafka-config PATH`` on every command, or ``$KVWIRE_KAFKA_CONFIG``;
2. the environment: ``KVWIRE_KAFKA_`` + the property name upper-cased with ``.`` -> ``_``
   (``security.protocol`` -> ``KVWIRE_KAFKA_SECURITY_PROTOCOL``). ``KVWIRE_KAFKA_SSL_CAFILE``
   is kept as an alias of ``ssl.ca.location``.

:func:`aiokafka_options` is the one mapping from those properties to aiokafka keyword arguments,
used by the producer, consumer, admin, tail, replay and the vLLM connector alike. Credentials
never reach a log line, metric or repr: the result is a :class:`ClientOptions` whose repr is
redacted, and error messages name a property, never its value.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROTOCOLS = ("PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL")
MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN")
ENV_PREFIX = "KVWIRE_KAFKA_"
CONFIG_ENV = "KVWIRE_KAFKA_CONFIG"
# Substrings of option names whose values are secrets, in aiokafka's, Kafka's and our own naming.
_SECRET_PARTS = ("password", "secret", "token", "jaas")

# kvwire's consumers refresh metadata every 5 s unless metadata.max.age.ms says otherwise;
# aiokafka's default is 5 minutes. A subscriber finds a topic created after it started at its next
# refresh, and aiokafka's reset of a position that fell off the log start retries a stale leader
# until then (kafka/positions.py). One small request each time.
CONSUMER_METADATA_MAX_AGE_MS = 5000


def consumer_options(client_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The caller's client options over kvwire's consumer defaults."""
    return {"metadata_max_age_ms": CONSUMER_METADATA_MAX_AGE_MS, **(client_options or {})}


# Properties with a direct aiokafka keyword that every client (producer, consumer, admin) takes.
_PASSTHROUGH = {
    "client.id": ("client_id", str),
    "request.timeout.ms": ("request_timeout_ms", int),
    "metadata.max.age.ms": ("metadata_max_age_ms", int),
    "connections.max.idle.ms": ("connections_max_idle_ms", int),
    "retry.backoff.ms": ("retry_backoff_ms", int),
}
# Properties that shape the security options below.
_SECURITY = {
    "security.protocol",
    "sasl.mechanism",
    "sasl.mechanisms",  # librdkafka's spelling
    "sasl.username",
    "sasl.password",
    "sasl.jaas.config",
    "ssl.ca.location",
    "ssl.certificate.location",
    "ssl.key.location",
    "ssl.key.password",
    "ssl.endpoint.identification.algorithm",
    "ssl.truststore.type",
    "ssl.truststore.location",
    "ssl.keystore.type",
    "ssl.keystore.location",
    "ssl.keystore.password",
}
KNOWN = frozenset(_SECURITY | set(_PASSTHROUGH))
_ALIASES = {"KVWIRE_KAFKA_SSL_CAFILE": "ssl.ca.location"}


class ClientOptions(dict):
    """A plain dict for aiokafka (`**opts`), but its repr is redacted: the options end up inside
    config dataclasses (PublisherConfig, IngestConfig) whose repr anyone may log."""

    def __repr__(self) -> str:
        return repr(redact(self))

    __str__ = __repr__


class ClientProperties(dict):
    """Kafka client properties (str -> str); repr redacted like :class:`ClientOptions`."""

    def __repr__(self) -> str:
        return repr(redact(self))

    __str__ = __repr__


def env_name(prop: str) -> str:
    return ENV_PREFIX + prop.upper().replace(".", "_")


def _where(prop: str) -> str:
    """How an error names a property: both spellings, so either kind of deployment finds it."""
    return f"{prop} ({env_name(prop)})"


def read_properties(path: str | os.PathLike) -> ClientProperties:
    """A Java properties file: ``key=value`` or ``key: value``, ``#``/``!`` comments, ``\\``
    continuation lines. Values are kept verbatim (a JAAS line holds ``=`` and quotes)."""
    props = ClientProperties()
    pending = ""
    for raw in Path(path).read_text().splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        pending = ""
        if not line or line[0] in "#!":
            continue
        if line.endswith("\\") and not line.endswith("\\\\"):
            pending = line[:-1]
            continue
        m = re.match(r"([^=:\s]+)\s*[=:\s]\s*(.*)$", line)
        if m is None:
            props[line] = ""
        else:
            props[m.group(1)] = m.group(2)
    if pending:
        m = re.match(r"([^=:\s]+)\s*[=:\s]\s*(.*)$", pending)
        if m:
            props[m.group(1)] = m.group(2)
    return props


def client_properties(env: Mapping[str, str] = os.environ, path: str | os.PathLike | None = None) -> ClientProperties:
    """The properties in effect: the file (``path`` or ``$KVWIRE_KAFKA_CONFIG``), then the
    environment on top. Only known property names are taken from the environment, so
    KVWIRE_KAFKA_HOME/PORT/... (the local broker's own settings) are never mistaken for one."""
    props = ClientProperties()
    file = path or env.get(CONFIG_ENV)
    if file:
        try:
            props.update(read_properties(file))
        except OSError as e:
            raise ValueError(f"cannot read Kafka client properties {file}: {e.strerror or e}") from None
    for name, prop in _ALIASES.items():
        if env.get(name):
            props[prop] = env[name]
    for prop in KNOWN:
        v = env.get(env_name(prop))
        if v is not None and v != "":
            props[prop] = v
    return props


_JAAS_FIELD = re.compile(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"')


def _jaas_credentials(jaas: str) -> tuple[str, str]:
    fields = dict(_JAAS_FIELD.findall(jaas))
    return fields.get("username", ""), fields.get("password", "")


def aiokafka_options(props: Mapping[str, str]) -> ClientOptions:
    """aiokafka keyword arguments for these Kafka client properties ({} for PLAINTEXT).

    Raises ValueError for a configuration that could only fail later as an opaque connection
    error (unknown protocol or mechanism, SASL without credentials, a JKS store); the message
    names the property and its variable, never a value."""
    for k in props:
        if k not in KNOWN:
            # A Java client warns and goes on; a producer tuning knob (acks, linger.ms) is kvwire's own.
            log.warning("Kafka client property %s is not used by kvwire; ignored", k)
    opts = ClientOptions()
    for prop, (kw, conv) in _PASSTHROUGH.items():
        if props.get(prop):
            try:
                opts[kw] = conv(props[prop])
            except ValueError:
                raise ValueError(f"{_where(prop)} must be an integer") from None
    proto = (props.get("security.protocol") or "PLAINTEXT").strip().upper()
    if proto not in PROTOCOLS:
        raise ValueError(f"{_where('security.protocol')} must be one of {', '.join(PROTOCOLS)}, not {proto!r}")
    if proto == "PLAINTEXT":
        return opts
    opts["security_protocol"] = proto
    if proto.startswith("SASL"):
        mech = (props.get("sasl.mechanism") or props.get("sasl.mechanisms") or "SCRAM-SHA-256").strip().upper()
        if mech not in MECHANISMS:
            raise ValueError(f"{_where('sasl.mechanism')} must be one of {', '.join(MECHANISMS)}, not {mech!r}")
        user, password = props.get("sasl.username", ""), props.get("sasl.password", "")
        if props.get("sasl.jaas.config") and not (user and password):
            ju, jp = _jaas_credentials(props["sasl.jaas.config"])
            user, password = user or ju, password or jp
        missing = [_where(n) for n, v in (("sasl.username", user), ("sasl.password", password)) if not v]
        if missing:
            raise ValueError(f"{proto} needs {' and '.join(missing)} (or username/password in sasl.jaas.config)")
        opts.update(sasl_mechanism=mech, sasl_plain_username=user, sasl_plain_password=password)
    if proto.endswith("SSL"):
        opts["ssl_context"] = _ssl_context(props)
    return opts


def _pem_only(props: Mapping[str, str], store: str) -> str | None:
    loc = props.get(f"ssl.{store}.location")
    if not loc:
        return None
    if (props.get(f"ssl.{store}.type") or "JKS").upper() != "PEM":
        raise ValueError(
            f"{_where(f'ssl.{store}.location')}: only PEM stores can be read (set ssl.{store}.type=PEM, or use "
            "ssl.ca.location / ssl.certificate.location / ssl.key.location)"
        )
    return loc


def _ssl_context(props: Mapping[str, str]):
    import ssl

    cafile = props.get("ssl.ca.location") or _pem_only(props, "truststore")
    try:
        ctx = ssl.create_default_context(cafile=cafile or None)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"{_where('ssl.ca.location')} cannot be loaded: {type(e).__name__}") from None
    # Hostname checking stays on unless the operator turns it off the Java way (an empty value).
    algo = props.get("ssl.endpoint.identification.algorithm")
    if algo is not None and algo.strip().lower() in ("", "none"):
        ctx.check_hostname = False
    cert = props.get("ssl.certificate.location")
    key = props.get("ssl.key.location")
    key_password = props.get("ssl.key.password") or None
    if not cert:
        cert = _pem_only(props, "keystore")  # a PEM keystore holds key and certificate in one file
        key_password = key_password or props.get("ssl.keystore.password") or None
    if key and not cert:
        raise ValueError(f"{_where('ssl.key.location')} is set without {_where('ssl.certificate.location')}")
    if cert:
        try:
            ctx.load_cert_chain(cert, key or None, key_password)
        except (OSError, ssl.SSLError) as e:
            # The exception text can quote nothing secret, but its type is all an operator needs.
            raise ValueError(
                f"client certificate {_where('ssl.certificate.location')} / {_where('ssl.key.location')} "
                f"cannot be loaded: {type(e).__name__}"
            ) from None
    return ctx


def client_options_from_env(
    env: Mapping[str, str] = os.environ, path: str | os.PathLike | None = None
) -> ClientOptions:
    """aiokafka keyword arguments from the properties file and the environment (see the module)."""
    return aiokafka_options(client_properties(env, path))


def client_options(
    path: str | os.PathLike | None = None,
    properties: Mapping[str, Any] | None = None,
    env: Mapping[str, str] = os.environ,
) -> ClientOptions:
    """Every command's entry point: file + environment, then explicit ``properties`` (the
    connector's ``kv_connector_extra_config``) on top."""
    props = client_properties(env, path)
    props.update({str(k): str(v) for k, v in (properties or {}).items()})
    return aiokafka_options(props)


# Keywords AIOKafkaAdminClient takes (it refuses producer/consumer-only ones).
_ADMIN_KEYS = {
    "client_id",
    "request_timeout_ms",
    "metadata_max_age_ms",
    "connections_max_idle_ms",
    "retry_backoff_ms",
    "security_protocol",
    "ssl_context",
    "api_version",
}


def admin_options(opts: Mapping[str, Any]) -> dict:
    """The subset of client options an admin client accepts."""
    return {k: v for k, v in opts.items() if k in _ADMIN_KEYS or k.startswith("sasl_")}


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


def connector_client_options(extra: Mapping[str, Any]) -> ClientOptions:
    """The vLLM connector's client options (its ``kv_connector_extra_config["kvwire"]``): the
    environment and ``kafka_config`` (a properties file), then ``kafka_properties`` (standard
    names), then any aiokafka keywords already given as ``publisher.client_options``."""
    opts = client_options(extra.get("kafka_config"), extra.get("kafka_properties"))
    opts.update((extra.get("publisher") or {}).get("client_options") or {})
    return opts
