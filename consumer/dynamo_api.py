"""Dynamo's standalone-indexer API (``python -m dynamo.indexer``, ai-dynamo 1.6.1) over kvwire's index.

A caller of Dynamo's indexer (``dynamo.select_service --indexer-peers``, ``dynamo.indexer
--peers``, or code written against its HTTP API) points at ``kvwire index --http`` instead and
gets the same paths and shapes, answered from the log:

``POST /query``          {token_ids, model_name, lora_name?, cache_salt?} -> per worker id and DP
                         rank, the leading tokens held on the device tier, and per instance the
                         cumulative tiers (``gpu`` <= ``cpu`` <= ``disk``)
``POST /query_by_hash``  {block_hashes (signed i64 content hashes), model_name}: the same, for a
                         router that hashes blocks itself (routers.md's "v1" hash)
``GET  /workers``        the instances kvwire indexes, in Dynamo's listing shape
``GET  /dump``           the indexed state as Dynamo's RouterEvents (what its peers load at start)
``POST /register``       501: kvwire learns workers from the log, not from registrations

Why the answers agree with Dynamo's by construction: kvwire's block keys are the v1 sequence
hashes Dynamo computes (docs/DESIGN.md), so ``/query`` hashes tokens with kvwire's one key rule
and ``/query_by_hash`` chains the caller's content hashes into the same keys
(``keys.sequence_keys``). What differs is what kvwire knows that an engine's own stream does not
say: TP ranks (a block counts once every rank holds it), trust (an untrusted worker is credited
nothing), and the media of every source.

Tiers are the media kvwire records, mapped the way Dynamo maps vLLM's ``medium``: GPU (and no
medium) is the device; CPU and CPU_PINNED the host; DISK, NVME and kvwire's STORAGE (LMCache's
and the offloading connector's lower tier) the disk; any other medium is "external", counted only
in ``longest_matched``. Each tier is cumulative, as Dynamo's are: ``cpu`` is the longest prefix
every block of which the device or the host holds, ``disk`` the same with the disk too. The core
computes each view (``PrefixIndex.score_media``): one walk per tier present.

Models: ``model_name`` selects the workers whose records name that model (``kvwire bridge
--model``, the ``model`` every source fills). A worker whose records name no model answers to
every ``model_name``: a single-model fleet need not name it, and a fleet serving several models
must, or its unnamed workers are credited for every model's prompts. A model no worker names,
while no unnamed worker exists, is 404, as Dynamo answers a model it has no indexer for.
Worker ids are ``worker_ids.worker_id``: the same here, in ``/v1/streams`` and in ``/dump``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Protocol

import msgspec
import numpy as np
from msgspec import Meta

from .apply import Applier
from .index import PrefixIndex, ScoreArrays
from .keys import block_contexts, sequence_keys, token_words, xxh3_64
from .worker_ids import worker_id

DEVICE, HOST, DISK, EXTERNAL = "device", "host_pinned", "disk", "external"
# kvwire's medium (normalised by the core: GPU, CPU, STORAGE upper-cased; others as sent) -> tier.
_TIERS = {"GPU": DEVICE, "CPU": HOST, "CPU_PINNED": HOST, "DISK": DISK, "NVME": DISK, "STORAGE": DISK}
# The cumulative views /query reports, each counting its tier and those above it.
_VIEWS = (("gpu", (DEVICE,)), ("cpu", (DEVICE, HOST)), ("disk", (DEVICE, HOST, DISK)))
ROUTING_GROUP = "default"

TokenId = Annotated[int, Meta(ge=0, lt=2**32)]
SignedHash = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


def tier(medium: str) -> str:
    return _TIERS.get(medium.upper(), EXTERNAL)


class DynamoQuery(msgspec.Struct):
    """Dynamo's ``/query`` body. Unknown fields are ignored, as Dynamo's own server does."""

    token_ids: list[TokenId]
    model_name: str
    lora_name: str | None = None
    cache_salt: str | None = None


class DynamoQueryByHash(msgspec.Struct):
    """Dynamo's ``/query_by_hash`` body: the prompt's full blocks' content hashes (the v1 block
    hash, ``dynamo.llm.compute_block_hash_for_seq``) as signed i64, in prompt order."""

    block_hashes: list[SignedHash]
    model_name: str


class Overlap(msgspec.Struct):
    """One instance's match in tokens: over every tier, per tier (cumulative), and the device
    tier per DP rank."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


class DynamoScores(msgspec.Struct):
    """``scores``: worker id -> DP rank -> device-tier tokens, for ranks with any (Dynamo's
    "scores"); ``instances``: every instance with a match on some tier."""

    scores: dict[str, dict[str, int]]
    frequencies: list[int]
    instances: dict[str, Overlap]


class DynamoListener(msgspec.Struct):
    endpoint: str
    status: str


class DynamoWorker(msgspec.Struct):
    """An instance as Dynamo's ``GET /workers`` lists it. ``source`` is "kafka" (kvwire's log);
    ``endpoints`` and ``listeners`` name where kvwire republishes each DP rank
    (``/v1/streams``) when it does, else ``kafka://<topic>``; ``status`` is "active" while
    every DP rank is trusted, else "untrusted" (credited nothing)."""

    instance_id: int
    source: str
    status: str
    model_name: str
    routing_group: str
    block_size: int
    endpoints: dict[str, str]
    listeners: dict[str, DynamoListener]


class DumpBlock(msgspec.Struct):
    block_hash: int  # the block's id on kvwire's streams: its key (the v1 sequence hash)
    tokens_hash: int  # its v1 content hash, what Dynamo matches prompts by
    mm_extra_info: None = None


class DumpStored(msgspec.Struct):
    parent_hash: int | None
    blocks: list[DumpBlock]
    start_position: None = None


class DumpData(msgspec.Struct):
    stored: DumpStored


class DumpEvent(msgspec.Struct):
    event_id: int
    data: DumpData
    dp_rank: int


class RouterEvent(msgspec.Struct):
    worker_id: int
    storage_tier: str
    event: DumpEvent
    residency_domain: str = "worker"


class RouterEvents(msgspec.Struct):
    """One model's state as Dynamo's ``/dump`` gives it: stored events only, parents first."""

    block_size: int
    events: list[RouterEvent]


class BlockTable(Protocol):
    """What ``/dump`` needs beyond the index: the token-derived facts of held blocks, kept by the
    event streams' table (``consumer.stream_table.StreamTable``, ``kvwire index --event-streams``)."""

    @property
    def blocks(
        self,
    ) -> Mapping[int, Any]: ...  # key -> .parent (key or None), .depth, .token_ids, .lora_name, .extra_keys

    @property
    def workers(self) -> Mapping[tuple[str, int], Any]: ...

    def held(self, worker: tuple[str, int]) -> dict[tuple[str, int], set[int]]: ...

    def block_size(self, worker: tuple[str, int]) -> int: ...


def content_hash(block: Any) -> int:
    """A block's v1 content hash (what Dynamo's ``tokens_hash`` is), by the core's seed rule."""
    seed = block_contexts(block.lora_name, None if block.extra_keys is None else [block.extra_keys], 1)[0]
    return xxh3_64(token_words(block.token_ids).tobytes(), int(seed))


def dump(table: BlockTable, applier: Applier[PrefixIndex]) -> dict[str, RouterEvents]:
    """The trusted workers' held blocks as one stored event per block, parents first, keyed
    "<model>:default" (a worker without a model under "default", Dynamo's own default name).
    Only KV-cache group 0, the full-attention one: Dynamo's tree has no groups."""
    untrusted = {tuple(w) for w in applier.ranks.core.untrusted_workers()}
    models: dict[tuple[str, int], str] = {}
    for r in applier.ranks.core.ranks():
        w = (r.instance_id, r.dp_rank)
        models[w] = r.model or models.get(w, "")
    out: dict[str, RouterEvents] = {}
    for worker in sorted(table.workers):
        if worker in untrusted or worker not in models:  # distrusted, or gone from the fence
            continue
        group = out.setdefault(f"{models.get(worker) or 'default'}:{ROUTING_GROUP}", RouterEvents(0, []))
        group.block_size = group.block_size or table.block_size(worker)
        wid = worker_id(worker[0])
        event_id: dict[str, int] = defaultdict(int)
        for (medium, kv_group), keys in sorted(table.held(worker).items()):
            if kv_group != 0:
                continue
            t = tier(medium)
            known = [(table.blocks[k].depth, k) for k in keys if k in table.blocks]
            for _, key in sorted(known):
                b = table.blocks[key]
                stored = DumpStored(b.parent, [DumpBlock(key, content_hash(b))])
                group.events.append(RouterEvent(wid, t, DumpEvent(event_id[t], DumpData(stored), worker[1])))
                event_id[t] += 1
    return out


class UnknownModel(LookupError):
    pass


def select(applier: Applier[PrefixIndex], model_name: str) -> list[tuple[str, int]]:
    """The trusted workers that answer to ``model_name``; UnknownModel when no worker does."""
    models: dict[tuple[str, int], str] = {}
    for r in applier.ranks.core.ranks():
        w = (r.instance_id, r.dp_rank)
        if r.model or w not in models:
            models[w] = r.model
    chosen = [w for w, m in models.items() if m in ("", model_name)]
    if not chosen:
        raise UnknownModel(f"no indexer for model={model_name} routing_group={ROUTING_GROUP}")
    untrusted = {tuple(w) for w in applier.ranks.core.untrusted_workers()}
    return [w for w in chosen if w not in untrusted]


def overlaps(
    applier: Applier[PrefixIndex],
    workers: list[tuple[str, int]],
    token_ids: Any = None,
    lora_name: str | None = None,
    extra_keys: list[Any] | None = None,
    keys: np.ndarray | None = None,
    block_size: int | None = None,
) -> DynamoScores:
    """The prompt (``token_ids``, or its ``keys`` of ``block_size`` tokens) against ``workers``."""
    index = applier.index
    if not workers:
        return DynamoScores({}, [], {})
    media = index.media()
    present = {tier(m) for m in media}

    def view(tiers: Iterable[str] | None) -> dict[tuple[str, int], int]:
        counted = media if tiers is None else [m for m in media if tier(m) in tiers]
        if not counted:
            return {}
        a: ScoreArrays = index.score_media(counted, token_ids, lora_name, extra_keys, keys, block_size, workers)
        return {index.worker_key(w): t for w, t in zip(a.worker.tolist(), a.matched_tokens.tolist(), strict=True)}

    views: dict[str, dict[tuple[str, int], int]] = {}
    for name, tiers in _VIEWS:
        # A view whose lowest tier no medium maps to equals the one above it: one walk fewer.
        views[name] = view(tiers) if tiers[-1] in present or name == "gpu" else views[_prev(name)]
    views["all"] = view(None) if EXTERNAL in present else views["disk"]
    by_instance: dict[str, dict[int, dict[str, int]]] = defaultdict(dict)
    for name, held in views.items():
        for (inst, dp), t in held.items():
            by_instance[inst].setdefault(dp, {})[name] = t
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, Overlap] = {}
    for inst, ranks in sorted(by_instance.items()):
        wid = str(worker_id(inst))
        per_dp = {str(d): v.get("gpu", 0) for d, v in sorted(ranks.items())}
        on_device = {d: g for d, g in per_dp.items() if g > 0}
        if on_device:
            scores[wid] = on_device
        top = {n: max(v.get(n, 0) for v in ranks.values()) for n in ("gpu", "cpu", "disk", "all")}
        instances[wid] = Overlap(top["all"], top["gpu"], per_dp, top["cpu"], top["disk"])
    return DynamoScores(scores, [], instances)


def _prev(name: str) -> str:
    names = [n for n, _ in _VIEWS]
    return names[names.index(name) - 1]


def query_by_hash_keys(block_hashes: list[int]) -> np.ndarray:
    """Signed i64 content hashes -> kvwire's keys (the v1 sequence hashes)."""
    return sequence_keys(np.asarray(block_hashes, dtype=np.int64).view(np.uint64))


def listing(
    applier: Applier[PrefixIndex],
    topic: str,
    endpoints: Callable[[str, int], str | None] | None = None,
    block_size: Callable[[str, int], int | None] | None = None,
) -> list[DynamoWorker]:
    """Every instance the member knows, in Dynamo's ``/workers`` shape.

    ``endpoints(instance_id, dp_rank)``: where the event streams republish a rank, if they do;
    ``block_size(instance_id, dp_rank)``: a worker's block size if known. Without either, the
    rank's endpoint is the topic and its block size the index's only one (0 when it has several)."""
    sizes = applier.index.block_sizes()
    only = sizes[0] if len(sizes) == 1 else 0
    per: dict[str, dict[int, tuple[str, bool]]] = defaultdict(dict)
    models: dict[str, str] = {}
    untrusted = {tuple(w) for w in applier.ranks.core.untrusted_workers()}
    for r in applier.ranks.core.ranks():
        per[r.instance_id][r.dp_rank] = ("", (r.instance_id, r.dp_rank) not in untrusted)
        if r.model:
            models[r.instance_id] = r.model
    out = []
    for inst, ranks in sorted(per.items()):
        eps: dict[str, str] = {}
        listeners: dict[str, DynamoListener] = {}
        bs = 0
        for dp, (_, trusted) in sorted(ranks.items()):
            ep = (endpoints(inst, dp) if endpoints is not None else None) or f"kafka://{topic}"
            eps[str(dp)] = ep
            listeners[str(dp)] = DynamoListener(ep, "active" if trusted else "untrusted")
            bs = bs or ((block_size(inst, dp) if block_size is not None else None) or only)
        status = "active" if all(t for _, t in ranks.values()) else "untrusted"
        out.append(
            DynamoWorker(worker_id(inst), "kafka", status, models.get(inst, ""), ROUTING_GROUP, bs, eps, listeners)
        )
    return out


REGISTER_ANSWER = (
    "kvwire does not take registrations: it learns every worker from the KV-event log (kvwire bridge, "
    "the KV connector, LMCache's sources write it) and serves what the log says. Point the engine's "
    "events at kvwire's topic instead (see the README's 'Using kvwire with vllm-router, Dynamo and llm-d')."
)
