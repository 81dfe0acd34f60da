"""Readiness = a real Kafka round trip, not just an open port: a KRaft broker accepts connections
before its controller has registered it, and clients then fail with NOT_CONTROLLER / no brokers."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from sync code, even when the caller is inside an event loop
    (async tests, the CLI under an embedding app): a private loop in a private thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["v"] = asyncio.run(factory())
        except BaseException as e:  # re-raised in the caller's thread
            box["e"] = e

    t = threading.Thread(target=target, name="kvwire-run-sync", daemon=True)
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


async def describe_cluster(bootstrap: str, timeout_s: float = 5.0, **client_config: Any) -> dict:
    """ApiVersions + Metadata through aiokafka; returns the cluster description."""
    from aiokafka.admin import AIOKafkaAdminClient

    ms = int(timeout_s * 1000)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=ms, **client_config)
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        return await asyncio.wait_for(admin.describe_cluster(), timeout_s)
    finally:
        await admin.close()


def answers(bootstrap: str, timeout_s: float = 5.0, **client_config: Any) -> bool:
    """True when the broker serves metadata listing at least one registered broker."""
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    if not port_open(host.strip("[]"), int(port)):
        return False
    try:
        desc = run_sync(lambda: describe_cluster(bootstrap, timeout_s, **client_config))
    except Exception:
        return False
    return bool(desc.get("brokers"))
