"""Topic admin for tests: importable by name (a test module cannot safely import `conftest`:
several directories have one and whichever loads first owns the name)."""

from __future__ import annotations

import socket


async def create_topics(
    bootstrap: str, names: list[str], partitions: int, config: dict[str, str] | None = None
) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        resp = await admin.create_topics(
            [NewTopic(n, partitions, 1, topic_configs=config or {}) for n in names], timeout_ms=30000
        )
        # create_topics reports per-topic errors in the response instead of raising.
        errors = [(t[0], t[1], t[2] if len(t) > 2 else "") for t in resp.topic_errors if t[1] != 0]
        if errors:
            raise RuntimeError(f"create_topics failed: {errors}")
    finally:
        await admin.close()


async def delete_topics(bootstrap: str, names: list[str]) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
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
