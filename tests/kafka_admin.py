"""Topic admin for tests: importable by name (a test module cannot safely import `conftest`:
several directories have one and whichever loads first owns the name)."""

from __future__ import annotations

import socket


async def create_topics(
    bootstrap: str,
    names: list[str],
    partitions: int,
    config: dict[str, str] | None = None,
    client_options: dict | None = None,
    **replication: int | None,
) -> None:
    """kvwire's own helper (kvwire.kafka.topics), so tests create topics exactly as kvwire does."""
    from kvwire.kafka.topics import Replication, ensure_topics

    await ensure_topics(
        bootstrap,
        names,
        partitions,
        config,
        replication=Replication.from_env(**replication),
        client_options=client_options,
    )


async def delete_topics(bootstrap: str, names: list[str], *, derived: bool = False) -> None:
    """``derived``: also the topics kvwire made beside them (``<name>.dlq``, ``<name>.snapshots``),
    which otherwise pile up on a developer's broker, hundreds per test run."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        if derived:
            prefixes = tuple(f"{n}." for n in names)
            names = [*names, *(t for t in await admin.list_topics() if t.startswith(prefixes))]
        await admin.delete_topics(names, timeout_ms=30000)
    finally:
        await admin.close()


def free_port_pair() -> int:
    """A free port whose successor is free too: a private broker's listener and controller."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")
