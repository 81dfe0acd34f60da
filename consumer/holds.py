"""Speculative holds: closing the window between routing a prompt and its engine's BlockStored.

A router that sends a prompt to a worker knows that worker will soon hold the prompt's blocks,
but the index learns it only once the engine has prefilled and its events went through Kafka.
A burst of identical new prompts inside that window sees no worker holding anything and, by
load, spreads over the fleet: each worker then computes the same prefix. A hold records the
routing decision so that the next prompt of the burst sees it: ``POST /v1/route`` picks a
worker and records a hold on it; scores and routes credit the hold until the worker's own
BlockStored confirms it or its TTL runs out.

Holds are router state, not index state: they live here, never in ``PrefixIndex``, snapshots,
digests or fencing, and a speculative credit is never reported as ``matched_tokens``: answers
carry it as ``speculative_tokens`` beside the confirmed figure.

A hold's credit for a query is the leading full blocks the query shares with the hold's prompt,
in tokens, compared as index keys (``keys.prompt_keys``: same tokens, LoRA and extra keys, i.e.
the same tenant) per block size the index has (or the request names; with none known yet, vLLM's
default block size). A hold ends when

- its TTL expires (``ttl_s``; 0 disables holds), or
- the worker's confirmed ``matched_tokens`` for the hold's prompt (a normal score restricted to
  that worker, trusted only) covers the hold's full blocks. A hold whose worker stores fewer
  blocks (a larger block size than the one compared, part of the prompt evicted at once) is not
  confirmed and ends with its TTL.

Nothing runs on a timer: expiry and confirmation happen lazily on the score and route calls,
at most ``checks_per_call`` confirmation scores per call. One lock makes a route's pick and its
hold one step, so concurrent routes (``--http-workers``) see each other's holds.

Route tie-break (documented in the OpenAPI document and the README): higher effective tokens
(max of confirmed and speculative), then higher confirmed score, then fewer routes sent to the
worker within the last TTL (the last ``DEFAULT_TTL_S`` when holds are off: it spreads load
when nothing is cached), then (instance_id, dp_rank) order.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import numpy as np

from .index import WorkerScore
from .keys import prompt_keys, token_words

DEFAULT_TTL_S = 2.0
# vLLM's default block size: what holds compare in before any block size is known.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CHECKS_PER_CALL = 4
DEFAULT_MAX_HOLDS = 65536

Worker = tuple[str, int]


class HeldScore(WorkerScore, frozen=True, omit_defaults=True):
    """A worker's score with the speculative credit of its holds (0 and omitted when none)."""

    speculative_tokens: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            description="Present on every entry while a speculative hold (POST /v1/route) is live: the leading "
            "tokens a hold on this worker shares with the prompt, never counted in matched_tokens. A worker "
            "with only a hold appears with matched_tokens 0. Entries are then ordered by max(matched_tokens, "
            "speculative_tokens), then score, then matched_tokens, then (instance_id, dp_rank); with no live "
            "hold the field is absent and the order is the usual one.",
        ),
    ] = 0


@dataclass(eq=False)
class Hold:
    worker: Worker
    tokens: np.ndarray  # uint32
    lora_name: str | None
    extra_keys: list[Any] | None  # per block, cache_salt already folded in
    created: float
    expires: float
    keys: dict[int, np.ndarray]  # block size -> keys of the prompt's full blocks
    dead: bool = False

    @property
    def full_tokens(self) -> int:
        """What the worker must confirm: the prompt's full blocks, in tokens."""
        return max((len(k) * bs for bs, k in self.keys.items()), default=0)


@dataclass(frozen=True)
class RouteRow:
    worker: Worker
    matched_tokens: int
    speculative_tokens: int
    score: float
    recent_routes: int

    @property
    def effective_tokens(self) -> int:
        return max(self.matched_tokens, self.speculative_tokens)

    def order(self) -> tuple[int, float, int, str, int]:
        return (-self.effective_tokens, -self.score, self.recent_routes, self.worker[0], self.worker[1])


@dataclass(frozen=True)
class Route:
    worker: Worker
    matched_tokens: int  # confirmed only
    speculative_tokens: int  # the chosen worker's credit from earlier holds
    hold_expires_in_ms: int | None  # None: no hold recorded (holds disabled, or no full block)
    rows: list[RouteRow] = field(default_factory=list)  # every candidate, in pick order


class NoCandidate(LookupError):
    """No worker to route to: no candidate given and no trusted worker known."""


QueryKeys = dict[int, np.ndarray]


def query_keys(
    token_ids: Any, lora_name: str | None, extra_keys: Sequence[Any] | None, sizes: Iterable[int]
) -> QueryKeys:
    """The query's full-block keys per block size (sizes with no full block left out)."""
    tok = token_words(token_ids)
    out = {}
    for bs in sizes:
        if tok.shape[0] >= bs:
            out[bs] = prompt_keys(tok, bs, lora_name, extra_keys)
    return out


def block_sizes(index_sizes: Sequence[int], block_size: int | None) -> list[int]:
    """The sizes a hold compares in: the request's, else the index's, else vLLM's default."""
    if block_size:
        return [block_size]
    return list(index_sizes) or [DEFAULT_BLOCK_SIZE]


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    eq = a[:m] == b[:m]
    return m if bool(eq.all()) else int(np.argmin(eq))


class Holds:
    """The live holds of one router (all HTTP loops of a member share one)."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        checks_per_call: int = DEFAULT_CHECKS_PER_CALL,
        max_holds: int = DEFAULT_MAX_HOLDS,
    ) -> None:
        if ttl_s < 0:
            raise ValueError(f"hold TTL must be >= 0, got {ttl_s}")
        if max_holds < 1 or checks_per_call < 0:
            raise ValueError("max_holds must be >= 1 and checks_per_call >= 0")
        self.ttl_s = float(ttl_s)
        self.load_window_s = self.ttl_s or DEFAULT_TTL_S
        self.clock = clock
        self.checks_per_call = checks_per_call
        self.max_holds = max_holds
        self._lock = threading.Lock()
        self._order: deque[Hold] = deque()  # creation order = expiry order (one TTL)
        self._check: deque[Hold] = deque()  # round robin of confirmation checks
        self._first: dict[tuple[int, int], list[Hold]] = {}  # (block size, first key) -> holds
        self._same: dict[tuple[Any, ...], Hold] = {}  # one hold per worker and prompt
        self._live = 0
        self._routes: deque[tuple[float, Worker]] = deque()
        self._load: Counter[Worker] = Counter()
        self.made = 0
        self.confirmed = 0
        self.expired = 0

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def __len__(self) -> int:
        with self._lock:
            self._prune(self.clock())
            return self._live

    def live(self) -> bool:
        """Whether any hold counts now (the score path's fast check)."""
        if not self._live:
            return False
        with self._lock:
            self._prune(self.clock())
            return self._live > 0

    # ------------------------------------------------------------ state (under the lock)

    def _kill(self, h: Hold) -> None:
        if h.dead:
            return
        h.dead = True
        self._live -= 1
        for bs, k in h.keys.items():
            lst = self._first.get((bs, int(k[0])))
            if lst is not None:
                lst.remove(h)
                if not lst:
                    del self._first[(bs, int(k[0]))]
        ident = self._ident(h.worker, h.keys)
        if self._same.get(ident) is h:
            del self._same[ident]

    def _prune(self, now: float) -> None:
        while self._order and (self._order[0].dead or self._order[0].expires <= now):
            h = self._order.popleft()
            if not h.dead:
                self.expired += 1
                self._kill(h)
        while self._check and self._check[0].dead:
            self._check.popleft()
        horizon = now - self.load_window_s
        while self._routes and (self._routes[0][0] <= horizon or len(self._routes) > self.max_holds):
            _, w = self._routes.popleft()
            self._load[w] -= 1
            if self._load[w] <= 0:
                del self._load[w]

    @staticmethod
    def _ident(worker: Worker, keys: QueryKeys) -> tuple[Any, ...]:
        # A chained key names its whole prefix: the last key per block size names the prompt.
        return (worker, tuple(sorted((bs, len(k), int(k[-1])) for bs, k in keys.items())))

    def _add(
        self,
        worker: Worker,
        tokens: np.ndarray,
        lora_name: str | None,
        extra_keys: list[Any] | None,
        keys: QueryKeys,
        now: float,
    ) -> Hold | None:
        if not self.enabled or not keys:
            return None
        old = self._same.get(self._ident(worker, keys))
        if old is not None:
            self._kill(old)  # routed again: the hold starts over
        h = Hold(worker, tokens, lora_name, extra_keys, now, now + self.ttl_s, keys)
        self._order.append(h)
        self._check.append(h)
        for bs, k in keys.items():
            self._first.setdefault((bs, int(k[0])), []).append(h)
        self._same[self._ident(worker, keys)] = h
        self._live += 1
        self.made += 1
        while self._live > self.max_holds:
            oldest = self._order.popleft()
            self._kill(oldest)
        return h

    def _credit(self, keys: QueryKeys, workers: set[Worker] | None) -> dict[Worker, int]:
        out: dict[Worker, int] = {}
        for bs, qk in keys.items():
            for h in self._first.get((bs, int(qk[0])), ()):
                if workers is not None and h.worker not in workers:
                    continue
                t = _shared(h.keys[bs], qk) * bs
                if t > out.get(h.worker, 0):
                    out[h.worker] = t
        return out

    # ------------------------------------------------------------ public

    def add(
        self,
        worker: Worker,
        token_ids: Any,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        sizes: Sequence[int] = (DEFAULT_BLOCK_SIZE,),
    ) -> Hold | None:
        """Record a hold (None: holds disabled, or the prompt has no full block)."""
        tok = np.array(token_words(token_ids), np.uint32)  # a copy: the caller's buffer may be reused
        ek = None if extra_keys is None else list(extra_keys)
        keys = query_keys(tok, lora_name, ek, sizes)
        now = self.clock()
        with self._lock:
            self._prune(now)
            return self._add((str(worker[0]), int(worker[1])), tok, lora_name, ek, keys, now)

    def credit(
        self,
        token_ids: Any,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        sizes: Sequence[int] = (DEFAULT_BLOCK_SIZE,),
        workers: Iterable[Worker] | None = None,
    ) -> dict[Worker, int]:
        """Speculative tokens per worker with a live hold sharing leading blocks with the query."""
        if not self.live():
            return {}
        keys = query_keys(token_ids, lora_name, extra_keys, sizes)
        only = None if workers is None else set(workers)
        with self._lock:
            self._prune(self.clock())
            return self._credit(keys, only)

    def maintain(self, confirmed: Callable[[Hold], int]) -> int:
        """Expire holds and check up to ``checks_per_call`` of them against the index
        (``confirmed(hold)``: the worker's confirmed matched_tokens for the hold's prompt).
        Returns how many were confirmed and ended."""
        if not self._live:
            return 0
        picked: list[Hold] = []
        with self._lock:
            self._prune(self.clock())
            for _ in range(min(self.checks_per_call, len(self._check))):
                h = self._check.popleft()
                if h.dead:
                    continue
                picked.append(h)
                self._check.append(h)
        done = [h for h in picked if confirmed(h) >= h.full_tokens]
        if done:
            with self._lock:
                for h in done:
                    if not h.dead:
                        self.confirmed += 1
                        self._kill(h)
        return len(done)

    def route(
        self,
        candidates: Sequence[Worker],
        confirmed: Mapping[Worker, tuple[int, float]],
        token_ids: Any,
        lora_name: str | None = None,
        extra_keys: Sequence[Any] | None = None,
        sizes: Sequence[int] = (DEFAULT_BLOCK_SIZE,),
    ) -> Route:
        """Pick the best of ``candidates`` (``confirmed``: worker -> (matched_tokens, score) of
        trusted workers) by the module's tie-break rule, and record a hold on it."""
        if not candidates:
            raise NoCandidate("no candidate worker")
        tok = np.array(token_words(token_ids), np.uint32)
        ek = None if extra_keys is None else list(extra_keys)
        keys = query_keys(tok, lora_name, ek, sizes)
        cands = list(dict.fromkeys((str(w[0]), int(w[1])) for w in candidates))
        now = self.clock()
        with self._lock:
            self._prune(now)
            spec = self._credit(keys, set(cands)) if self._live else {}
            rows = []
            for w in cands:
                matched, score = confirmed.get(w, (0, 0.0))
                rows.append(RouteRow(w, matched, spec.get(w, 0), score, self._load.get(w, 0)))
            rows.sort(key=RouteRow.order)
            best = rows[0]
            hold = self._add(best.worker, tok, lora_name, ek, keys, now)
            self._routes.append((now, best.worker))
            self._load[best.worker] += 1
        return Route(
            best.worker,
            best.matched_tokens,
            best.speculative_tokens,
            None if hold is None else round(self.ttl_s * 1000),
            rows,
        )


# ------------------------------------------------------------ answers with holds


def order_key(s: Mapping[str, Any]) -> tuple[int, float, int, str, int]:
    """Score answers while a hold is live: effective credit first, like a route's pick."""
    m = int(s["matched_tokens"])
    return (-max(m, int(s.get("speculative_tokens", 0))), -float(s["score"]), -m, s["instance_id"], s["dp_rank"])


def with_speculation(scores: Sequence[Mapping[str, Any]], spec: Mapping[Worker, int], limit: int) -> list[dict]:
    """Score answers plus holds: every entry carries ``speculative_tokens``; a worker with only
    a hold appears with ``matched_tokens`` 0 and nothing by medium."""
    out: dict[Worker, dict[str, Any]] = {}
    for s in scores:
        w = (s["instance_id"], s["dp_rank"])
        out[w] = {**s, "speculative_tokens": spec.get(w, 0)}
    for w, t in spec.items():
        if w not in out and t > 0:
            out[w] = {
                "instance_id": w[0],
                "dp_rank": w[1],
                "matched_tokens": 0,
                "by_medium": {},
                "score": 0.0,
                "speculative_tokens": t,
            }
    return sorted(out.values(), key=order_key)[:limit]


_encode = msgspec.json.Encoder().encode
_decode_scores = msgspec.json.Decoder(list[dict[str, Any]]).decode


def score_json_with_holds(
    applier: Any,
    holds: Holds,
    token_ids: Any,
    lora_name: str | None,
    block_size: int | None,
    top_k: int,
    extra_keys: Sequence[Any] | None,
) -> bytes:
    """``Applier.score_json`` plus the live holds of trusted workers. With no live hold this is
    ``Applier.score_json`` itself, byte for byte."""
    maintain(applier, holds)
    if not holds.live():
        out: bytes = applier.score_json(token_ids, lora_name, block_size, top_k, extra_keys)
        return out
    sizes = block_sizes(applier.index.block_sizes(), block_size)
    spec = holds.credit(token_ids, lora_name, extra_keys, sizes)
    # The answer lists trusted workers only, holds or not (a route may name any candidate).
    trusted = set(trusted_workers(applier))
    spec = {w: t for w, t in spec.items() if w in trusted}
    # Every confirmed answer: a worker cut by top_k may rank higher with its hold.
    full = _decode_scores(applier.score_json(token_ids, lora_name, block_size, None, extra_keys))
    return _encode(with_speculation(full, spec, top_k))


def confirmed_tokens(applier: Any, h: Hold) -> int:
    """The hold's worker's confirmed matched_tokens for the hold's prompt (0 when untrusted)."""
    got = applier.score(h.tokens, lora_name=h.lora_name, extra_keys=h.extra_keys, workers=[h.worker])
    return max((s.matched_tokens for s in got), default=0)


def maintain(applier: Any, holds: Holds) -> int:
    return holds.maintain(lambda h: confirmed_tokens(applier, h))


def trusted_workers(applier: Any) -> list[Worker]:
    """Every worker the index knows whose ranks are all trusted, in (instance_id, dp_rank) order."""
    return sorted(applier.ranks.known_workers() - applier.ranks.untrusted_workers())


def route(
    applier: Any,
    holds: Holds,
    token_ids: Any,
    lora_name: str | None = None,
    extra_keys: Sequence[Any] | None = None,
    candidates: Sequence[Worker] | None = None,
    block_size: int | None = None,
    confirmed_scores: Sequence[Mapping[str, Any]] | None = None,
) -> Route:
    """Pick a worker for a prompt and record a hold on it (``Holds.route``). ``confirmed_scores``:
    the confirmed answer when it came from elsewhere (peers); else the local trusted score."""
    maintain(applier, holds)
    cands = list(candidates) if candidates is not None else trusted_workers(applier)
    if not cands:
        raise NoCandidate("no candidate worker: none given and no trusted worker known")
    if confirmed_scores is None:
        got = applier.score(token_ids, lora_name=lora_name, block_size=block_size, extra_keys=extra_keys, workers=cands)
        conf = {(s.instance_id, s.dp_rank): (s.matched_tokens, s.score) for s in got}
    else:
        conf = {
            (s["instance_id"], s["dp_rank"]): (int(s["matched_tokens"]), float(s["score"])) for s in confirmed_scores
        }
    sizes = block_sizes(applier.index.block_sizes(), block_size)
    return holds.route(cands, conf, token_ids, lora_name, extra_keys, sizes)


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_TTL_S",
    "HeldScore",
    "Hold",
    "Holds",
    "NoCandidate",
    "Route",
    "RouteRow",
    "block_sizes",
    "confirmed_tokens",
    "maintain",
    "query_keys",
    "route",
    "score_json_with_holds",
    "trusted_workers",
    "with_speculation",
]
