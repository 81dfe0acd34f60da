"""Schema registry: a client for the Confluent-compatible API (Confluent's registry or Apicurio's
ccompat), the consumer's id resolver, and a local Apicurio Registry for dev, tests and CI."""

from .client import (
    ENV_PASSWORD,
    ENV_URL,
    ENV_USERNAME,
    KVWIRE_COMPATIBILITY,
    IncompatibleSchema,
    NotFound,
    RegistryClient,
    RegistryConfig,
    RegistryError,
    RegistryUnavailable,
    topic_subject,
)

__all__ = [
    "ENV_PASSWORD",
    "ENV_URL",
    "ENV_USERNAME",
    "KVWIRE_COMPATIBILITY",
    "IncompatibleSchema",
    "NotFound",
    "RegistryClient",
    "RegistryConfig",
    "RegistryError",
    "RegistryUnavailable",
    "topic_subject",
]
