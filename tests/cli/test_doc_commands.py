"""Every `kvwire ...` line the README, docs/, schemas/README.md, bench/README.md and the compose
file show runs as written, at least as far as argument parsing (tests/cli/doc_commands.py finds
them). The real root command parses each line; only the commands' bodies are replaced, by a
guard that records which command was reached: the lines are examples against other people's
brokers, so running them would prove nothing here."""

from __future__ import annotations

import pytest
import typer.main
from doc_commands import DocCommand, documented_commands
from typer import _click as click  # typer builds commands from its own copy of click

from kvwire.cli import app

# Variables that would let a line parse that does not as written.
_ENV = ("KAFKA_BOOTSTRAP_SERVERS", "KVWIRE_KAFKA_CONFIG", "KVWIRE_SCHEMA_REGISTRY_URL", "KVWIRE_FRAMING")

ALL = documented_commands()
LINES = [c for c in ALL if not c.mention]
MENTIONS = [c for c in ALL if c.mention]


def test_the_docs_show_commands():
    # The extractor must keep finding them: a silent change of the docs' format would pass all below.
    shown = {c.argv[0] for c in LINES}
    assert {"demo", "index", "bridge", "sglang-bridge", "replay", "tail", "schemas", "kafka", "bench"} <= shown
    assert any(c.where.startswith("docker-compose.yml:services.") and c.argv[0] == "index" for c in LINES)


@pytest.mark.parametrize("cmd", LINES, ids=str)
def test_documented_line_parses(cmd: DocCommand, monkeypatch: pytest.MonkeyPatch):
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in cmd.env:
        monkeypatch.setenv(name, value)
    reached: list[click.Context] = []

    def guard(self: click.Command, ctx: click.Context) -> None:
        reached.append(ctx)  # parsing is done when a command's body would run

    root = typer.main.get_command(app)
    # The guard must stand in for every command's body, or these lines would really run here.
    assert all(isinstance(c, click.Command) for c in _tree(root))
    monkeypatch.setattr(click.Command, "invoke", guard)
    try:
        root.main(list(cmd.argv), prog_name="kvwire", standalone_mode=False)
    except click.ClickException as e:
        pytest.fail(f"{cmd}\n  does not parse: {e.format_message()}", pytrace=False)
    assert reached, f"{cmd}: no command reached"
    leaf = reached[-1]
    assert not _subcommands(leaf.command), f"{cmd}: stops at a group ({leaf.command_path})"


@pytest.mark.parametrize("cmd", MENTIONS, ids=str)
def test_documented_mention_names_what_exists(cmd: DocCommand):
    """A mention in prose need not be a whole line, but its command and options must exist."""
    command = typer.main.get_command(app)
    words = list(cmd.argv)
    path = ["kvwire"]
    while words and _subcommands(command) and not words[0].startswith("-"):
        sub = _subcommands(command).get(words[0])
        assert sub is not None, f"{cmd}: {' '.join(path)} has no command {words[0]!r}"
        path.append(words.pop(0))
        command = sub
    known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
    for w in words:
        if w.startswith("-"):
            assert w.split("=", 1)[0] in known, f"{cmd}: {' '.join(path)} has no option {w}"


def _subcommands(command: click.Command) -> dict[str, click.Command]:
    return dict(getattr(command, "commands", {}))


def _tree(command: click.Command) -> list[click.Command]:
    return [command, *(c for sub in _subcommands(command).values() for c in _tree(sub))]
