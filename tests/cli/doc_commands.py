"""Every `kvwire ...` command line the documentation shows, as argument lists.

Two kinds, because the docs use two:

- *command lines*: shell in code blocks (fenced or indented), the compose file's entrypoints and
  commands, and the synopses in the first cell of a table row (``| `kvwire index -b B ...` |``).
  A reader copies these; they must parse as written.
- *mentions*: a `kvwire ...` code span inside prose (``(`kvwire index --hold-ttl-s`, 0 turns...``)
  names a command and maybe an option, not a whole line. Every name it uses must exist.

Synopsis notation is expanded, never ignored: ``[--x V]`` is included, ``a|b`` (``a\\|b`` in a
table) gives one line per alternative, and a placeholder (``B``, ``HOST:PORT``, ``...``) becomes
the concrete value in :data:`PLACEHOLDERS`, so that every option is still parsed with a value.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# What a reader substitutes for the docs' placeholders; "..." by the option it follows.
PLACEHOLDERS = {
    "B": "127.0.0.1:9092",
    "T": "kvwire.events",
    "G": "router-a",
    "M": "llama-3-8b",
    "N": "3",
    "S": "30",
    "ID": "vllm-a",
    "HOST:PORT": "127.0.0.1:8080",
    "PATH": "summary.json",
    "DIR": "contract",
    "URL": "http://127.0.0.1:18081",
    "IMAGE": "debian:bookworm-slim",
    "ISO": "2026-11-30T10:00:00Z",
    "<time>": "2026-11-30T10:00:00Z",
}
ELLIPSIS_AFTER = {
    "--zmq-endpoint": "tcp://127.0.0.1:5557",
    "--replay-endpoint": "tcp://127.0.0.1:5558",
    "--instance-id": "vllm-a",
    "--from": "earliest",
}
# Variables the docs' shell lines read without setting them in the same block.
SHELL_ENV = {"KVWIRE_SCHEMA_REGISTRY_URL": PLACEHOLDERS["URL"]}

_COMMAND_START = re.compile(r"(?:^|&&|\|\||;|\||\$\(|\bexec\s)\s*(kvwire\s+[a-z])")
_SPAN = re.compile(r"`(kvwire [a-z][^`]*)`")
# "kvwire index: cannot reach ...": what a command prints, quoted, not a command.
_OUTPUT = re.compile(r"kvwire [\w -]+: ")
_FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    text: str  # as the docs show it
    argv: tuple[str, ...]  # after "kvwire", placeholders substituted
    env: tuple[tuple[str, str], ...] = ()  # `export`s earlier in the same code block
    mention: bool = False  # prose mention: names are checked, completeness is not

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "schemas" / "README.md", ROOT / "bench" / "README.md"]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if f.is_file()]


def _alternatives(token: str) -> list[str]:
    # `start\|status\|stop` in a table, `earliest|snapshot|<time>` elsewhere.
    return [t for t in token.replace("\\|", "|").split("|") if t]


def _expand(words: list[str]) -> list[list[str]]:
    """Synopsis words -> concrete argument lists (optional groups kept, alternatives multiplied)."""
    plain: list[list[str]] = []
    prev = None
    for w in words:
        w = w.replace("[", "").replace("]", "")
        if not w:
            continue
        if w == "...":
            plain.append([ELLIPSIS_AFTER.get(prev or "", "x")])
        else:
            plain.append([PLACEHOLDERS.get(a, a) for a in _alternatives(w)])
        prev = w
    return [list(p) for p in itertools.product(*plain)]


def _shell_words(segment: str, env: dict[str, str]) -> list[str]:
    words = shlex.split(segment, comments=True)
    return [os.path.expandvars(w) if "$" in w else w for w in _with_env(words, env)]


def _with_env(words: list[str], env: dict[str, str]) -> list[str]:
    out = []
    for w in words:
        for k, v in {**SHELL_ENV, **env}.items():
            w = w.replace(f"${{{k}}}", v).replace(f"${k}", v)
        out.append(w)
    return out


def _segments(line: str) -> list[str]:
    """The `kvwire ...` commands of one shell line: each up to the next pipe, &&, ; or )."""
    out = []
    for m in _COMMAND_START.finditer(line):
        rest = line[m.start(1) :]
        out.append(re.split(r"\s(?:\||&&|\|\||;)\s|\)|\s#", rest, maxsplit=1)[0].strip())
    return out


def _code_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line number, line, starts a new block) for shell in fenced and indented code blocks,
    with backslash continuations joined."""
    out: list[tuple[int, str, bool]] = []
    fenced = False
    pending: tuple[int, str] | None = None
    new_block = True
    for i, raw in enumerate(text.splitlines(), 1):
        if _FENCE.match(raw):
            fenced = not fenced
            new_block = True
            continue
        indented = raw.startswith("    ") and raw.strip().startswith("kvwire ")
        if not (fenced or indented or pending):
            new_block = True
            continue
        line = raw.strip()
        if pending:
            line = pending[1] + " " + line
            i = pending[0]
            pending = None
        if line.endswith("\\"):
            pending = (i, line[:-1].rstrip())
            continue
        out.append((i, line, new_block))
        new_block = False
    return out


_EXPORT = re.compile(r"^export\s+(\w+)=(\S+)")


def _from_code(rel: str, text: str) -> list[DocCommand]:
    found = []
    env: dict[str, str] = {}
    for lineno, line, new_block in _code_lines(text):
        if new_block:
            env = {}
        m = _EXPORT.match(line)
        if m and "$(" not in m.group(2):
            env[m.group(1)] = m.group(2)
        for seg in _segments(line.removeprefix("$ ")):
            for argv in _expand(_shell_words(seg, env)[1:]):
                found.append(DocCommand(f"{rel}:{lineno}", seg, tuple(argv), tuple(env.items())))
    return found


def _without_code(text: str) -> str:
    """Prose only: code blocks blanked (line numbers kept)."""
    lines, fenced = [], False
    for raw in text.splitlines():
        if _FENCE.match(raw):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced or raw.startswith("    ") else raw)
    return "\n".join(lines)


def _synopsis(lines: list[str], i: int, span: str) -> bool:
    """A span that begins its line, or the first cell of a row in a table of commands (a table
    whose first column is headed "command"): a synopsis, to be run, not a mention."""
    line = lines[i].lstrip()
    if line.startswith(span):
        return True
    if not (line.startswith("|") and line[1:].lstrip().startswith(span)):
        return False
    while i > 0 and lines[i - 1].lstrip().startswith("|"):
        i -= 1  # up to the table's header row
    return lines[i].strip("| ").split("|")[0].strip().lower() == "command"


def _from_spans(rel: str, text: str) -> list[DocCommand]:
    found = []
    prose = _without_code(text)
    for m in _SPAN.finditer(prose):
        span = " ".join(m.group(1).split())  # a span may wrap onto the next line
        if _OUTPUT.match(span):
            continue
        lineno = prose.count("\n", 0, m.start()) + 1
        synopsis = _synopsis(prose.splitlines(), lineno - 1, m.group(0))
        # A table of a command's settings: `| `kvwire bridge` | `--framing confluent ...` |`.
        options = re.match(r"\s*\|\s*`(--[^`]*)`", prose[m.end() :])
        if options and not synopsis:
            span += " " + options.group(1)
        for argv in _expand(span.split()[1:]):
            found.append(DocCommand(f"{rel}:{lineno}", span, tuple(argv), mention=not synopsis))
    return found


def _from_compose(path: Path) -> list[DocCommand]:
    """The entrypoints' own commands, each service's command (run as `kvwire "$@"`), and the
    shell and spans its comments show."""
    import yaml

    rel = str(path.relative_to(ROOT))
    text = path.read_text()
    comments = "\n".join(ln.split("#", 1)[1] if ln.lstrip().startswith("#") else "" for ln in text.splitlines())
    found = _from_spans(rel, comments)
    for lineno, line in enumerate(comments.splitlines(), 1):
        for seg in _segments(line):
            for argv in _expand(_shell_words(seg, {})[1:]):
                found.append(DocCommand(f"{rel}:{lineno}", seg, tuple(argv)))
    # safe_load resolves the `<<: *app` merge keys: each service as compose sees it.
    for name, svc in yaml.safe_load(text)["services"].items():
        entry = svc.get("entrypoint") or []
        script = entry[2] if entry[:2] == ["sh", "-c"] else shlex.join(entry)
        for seg in _segments(script):
            found.append(DocCommand(f"{rel}:services.{name}", seg, tuple(shlex.split(seg)[1:])))
        if 'exec kvwire "$$@"' in script and svc.get("command"):
            argv = tuple(svc["command"])
            found.append(DocCommand(f"{rel}:services.{name}", shlex.join(["kvwire", *argv]), argv))
    return found


def documented_commands() -> list[DocCommand]:
    found: list[DocCommand] = []
    for f in doc_files():
        rel = str(f.relative_to(ROOT))
        text = f.read_text()
        found += _from_code(rel, text) + _from_spans(rel, text)
    found += _from_compose(ROOT / "docker-compose.yml")
    return found
