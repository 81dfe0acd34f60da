"""Kafka client options shared by every kvwire command: security from the environment.

Credentials come from the environment (or config) and are never logged:
KVWIRE_KAFKA_SECURITY_PROTOCOL (PLAINTEXT, SASL_PLAINTEXT, SASL_SSL, SSL),
KVWIRE_KAFKA_SASL_MECHANISM (SCRAM-SHA-256, SCRAM-SHA-512, PLAIN),
KVWIRE_KAFKA_SASL_USERNAME, KVWIRE_KAFKA_SASL_PASSWORD, KVWIRE_KAFKA_SSL_CAFILE.
"""

from __future__ import annotations

import os


def client_options_from_env(env=os.environ) -> dict:
    """aiokafka keyword arguments for the configured security, or {} for PLAINTEXT."""
    proto = env.get("KVWIRE_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT").upper()
    if proto == "PLAINTEXT":
        return {}
    opts: dict = {"security_protocol": proto}
    if proto.startswith("SASL"):
        opts["sasl_mechanism"] = env.get("KVWIRE_KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
        opts["sasl_plain_username"] = env.get("KVWIRE_KAFKA_SASL_USERNAME", "")
        opts["sasl_plain_password"] = env.get("KVWIRE_KAFKA_SASL_PASSWORD", "")
    if proto.endswith("SSL"):
        import ssl

        ctx = ssl.create_default_context(cafile=env.get("KVWIRE_KAFKA_SSL_CAFILE") or None)
        opts["ssl_context"] = ctx
    return opts


def redact(opts: dict) -> dict:
    """Options safe to log."""
    return {k: ("***" if "password" in k else v) for k, v in opts.items()}
