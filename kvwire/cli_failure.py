"""How a command fails when something it needs cannot be had: one line on stderr naming what it
could not reach and where, exit status 1, no traceback.

Every command runs its body inside :func:`one_line` and wraps the steps that first reach Kafka in
:func:`reaching_kafka`. aiokafka's own log lines about the failed connection are held back while
a start is under way (a refused port alone logs one per attempt), and the last of them becomes
the reason of the one line: ``kvwire index: cannot reach Kafka at 127.0.0.1:1 (bootstrap):
Unable connect to "127.0.0.1:1": [Errno 111] Connect call failed``. A start that succeeds passes
them on as usual."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer

# A failure about a setting (a bad --from, an unreadable properties file) exits 2, like a usage
# error; one about something not answering exits 1.
EXIT_UNREACHABLE = 1
EXIT_BAD_SETTING = 2
_WHY_CHARS = 300


class Unreachable(Exception):
    """``what`` (Kafka, the schema registry, an HTTP port) could not be had at ``where``."""

    def __init__(self, what: str, where: str, why: str, *, verb: str = "reach") -> None:
        super().__init__(f"cannot {verb} {what} at {where}: {why}")
        self.what, self.where, self.why = what, where, why


class BadSetting(Exception):
    """A setting that can never work (reported as given, never a value of a secret)."""


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _WHY_CHARS else text[: _WHY_CHARS - 1] + "…"


def _fail(command: str, message: str, code: int) -> NoReturn:
    typer.echo(f"kvwire {command}: {_one_line(message)}", err=True)
    raise typer.Exit(code)


@contextmanager
def one_line(command: str) -> Iterator[None]:
    """The body of `kvwire <command>`: a failure to reach something, or a setting that cannot
    work, ends the command with one line instead of a traceback."""
    from kvwire.kafka.registry.client import RegistryError, RegistryUnavailable

    try:
        yield
    except Unreachable as e:
        _fail(command, str(e), EXIT_UNREACHABLE)
    except RegistryUnavailable as e:
        _fail(command, f"cannot reach the schema registry: {e}", EXIT_UNREACHABLE)
    except RegistryError as e:
        _fail(command, f"schema registry: {e}", EXIT_UNREACHABLE)
    except BadSetting as e:
        _fail(command, str(e), EXIT_BAD_SETTING)


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def reason(self) -> str | None:
        errors = [r for r in self.records if r.levelno >= logging.WARNING]
        return errors[-1].getMessage() if errors else None


@contextmanager
def reaching_kafka(bootstrap_servers: str) -> Iterator[None]:
    """Around the steps that first reach the brokers: an aiokafka error there becomes
    :class:`Unreachable` naming the bootstrap servers."""
    from aiokafka.errors import KafkaError

    logger = logging.getLogger("aiokafka")
    held = _Held()
    propagate = logger.propagate
    logger.addHandler(held)
    logger.propagate = False
    failed = False
    try:
        yield
    except KafkaError as e:
        failed = True
        why = held.reason() or f"{type(e).__name__}: {e}"
        raise Unreachable("Kafka", f"{bootstrap_servers} (bootstrap)", why) from None
    finally:
        logger.removeHandler(held)
        logger.propagate = propagate
        if not failed:
            for record in held.records:
                if logger.isEnabledFor(record.levelno):
                    logging.getLogger().handle(record)


def kafka_client_options(path: str | None):
    """The client options of `--kafka-config` and the environment (kvwire.kafka.options); a
    misconfiguration is a :class:`BadSetting`."""
    from kvwire.kafka.options import client_options

    try:
        return client_options(path)
    except ValueError as e:
        raise BadSetting(str(e)) from None
