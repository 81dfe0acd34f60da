"""kvwire's schema versions in a registry: what `kvwire schemas --register` and a producer do."""

from __future__ import annotations

from kvwire.schemas.codec import CURRENT, VERSIONS, SchemaVersion

from .client import KVWIRE_COMPATIBILITY, RegistryClient


def register_shipped(client: RegistryClient, subject: str, level: str = KVWIRE_COMPATIBILITY) -> list[tuple[int, int]]:
    """Set the subject's compatibility, then register every shipped version oldest first, so the
    registry checks each one against all before it. Returns [(version, id)]. Raises
    IncompatibleSchema at the first version the registry refuses (the ones before it stay)."""
    # First: a registry's global default is often NONE, which would accept anything.
    client.set_compatibility(subject, level)
    return [(v, client.register(subject, sv.registry_text)) for v, sv in VERSIONS.items()]


def writer_id(
    client: RegistryClient, subject: str, version: SchemaVersion = CURRENT, auto_register: bool = True
) -> int:
    """The id a producer frames its records with. ``auto_register`` false: the version must
    already be registered (a platform team that registers centrally), else NotFound-like
    LookupError."""
    if auto_register:
        return client.register(subject, version.registry_text)
    sid = client.lookup(subject, version.registry_text)
    if sid is None:
        raise LookupError(f"{version.name} is not registered under subject {subject!r} at {client.url}")
    return sid
