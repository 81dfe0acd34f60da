"""kvwire's LMCache path over real paged KV tensors on CUDA: one self-contained check.

What runs, all of it real code except where named:

* A real ``LMCacheEngine`` (lmcache 0.5.6; CPU tier ``LocalCPUBackend`` with a small budget, so
  LMCache evicts LRU while it stores; ``enable_kv_events=True``).
* Its GPU connector is the one LMCache's own vLLM integration builds on CUDA:
  ``CreateGPUConnector(config, metadata, EngineType.VLLM, layout_hints={"kv_layout": "NHD"})``,
  i.e. ``VLLMPagedMemGPUConnectorV2`` over vLLM-shaped paged KV caches (one tensor per layer,
  ``[2, num_blocks, block_size, num_heads, head_size]``, flash-attention NHD) on ``cuda``, with a
  ``slot_mapping`` on ``cuda`` as vLLM passes it. V2 copies through ``lmcache.device_ops``: the
  compiled ``lmcache.cuda_ops`` kernels when that extension loads against the local torch, else
  LMCache's own pure-torch baseline (``lmcache.v1.platform.torch_ops``) on the same CUDA tensors,
  through the same V2 calls (LMCache falls back by itself on the ImportError). Expect the
  baseline with torch 2.11: the lmcache 0.5.6 cp312 wheel's ``cuda_ops`` (linked to
  libcudart.so.13) was built against a torch between 2.11 and 2.15. Checked with ``nm`` against
  the torch 2.11.0+cu130 wheel's libraries, it needs ``c10::NotImplementedError(SourceLocation,
  std::string)``, which 2.11 does not export; against 2.15 it misses the five-argument
  ``c10::cuda::c10_cuda_check_implementation``. ``lmcache_native`` (imported always) needs no
  torch symbol. The summary says which path ran (``ops_path``) and why (``cuda_ops``);
  ``--ops torch`` forces the baseline where the kernels do load.
  With ``--device cpu`` (for a machine without CUDA) V2 cannot be built (it makes CUDA streams
  and asserts CUDA tensors), so a script-local connector with V2's copy calls minus the streams
  (``TorchPagedConnector`` below) drives the same ``lmcache.device_ops.multi_layer_kv_transfer``
  on CPU tensors. It is the only code here standing in for LMCache's.
* Events: kvwire's producer code as the tests use it (``producer/lmcache_source.py``:
  ``LMCacheSource`` with its ``LMCacheRepair`` and ``RemovalObserver``), polled on the engine's
  thread after every store, into an in-memory ``EventSink`` that numbers records like the
  publisher's ledger (epoch, contiguous seq, reset on the first, gap carried) and encodes each
  batch with kvwire's real Avro codec (``kvwire.schemas.codec.encode``). There is NO Kafka
  broker here (the GPU machine has no Java and no network): the records never touch Kafka.
* Consumer: those bytes go through ``kvwire.consumer.apply.Applier.apply_records`` (the Rust
  core ``kvwire._core``: decode, fence, keys, index) as a live consumer would feed them, after
  every store.
* Truth: for every stored prompt, prefixes of some, and unseen prompts, kvwire's credited tokens
  for the worker must equal ``LMCacheEngine.lookup`` (checked several times while LMCache
  evicts, and at the end). Then some prompts are retrieved back through the connector into the
  paged KV tensors, zeroed first, at new slots (the same tensors: V2 binds the layers' pointers on
  first use, as vLLM allocates its KV caches once), and must equal, byte for byte
  (``torch.equal``), the KV that was stored; the number of tokens retrieved must equal
  ``lookup`` too (KV content is a deterministic function of the token prefix, as in a real engine, so
  shared prefixes hold the same bytes whichever prompt stored them).
* Stores are incremental by default (``--mask lookup``), as vLLM's LMCache adapter makes them: a
  request skips the chunk-aligned head LMCache held at its lookup, so LMCache reports its first
  new chunk with parent 0 and kvwire's repair has to find the parent. Under eviction this has a
  case this check found: LMCache evicts a chunk's parent just before the chunk goes in (the
  store's own allocations can evict the head it skipped). kvwire's index used to file such a
  chunk under an orphan root for good, under-crediting the chain once the parent was back
  (``--device cpu --seed 2`` showed 4 such mismatches); a worker now remembers the keys of the
  hashes it removed lately (``rust/src/index/memo.rs``). Mismatches of that kind are still
  counted apart, as ``orphan_mismatches``. ``--mask none`` stores every
  prompt whole, as the project's tests do.

Prints progress and one JSON summary; writes it to ``$OUT/cuda_check.json`` when ``OUT`` is set
(or ``--out``). Exits 1 on any mismatch, gap, dead letter or byte difference, 2 if it could not
run.

    python bench/cuda_connector_check.py                 # CUDA (the default)
    python bench/cuda_connector_check.py --ops torch     # CUDA, LMCache's torch copy path forced
    python bench/cuda_connector_check.py --device cpu    # the same checks on CPU tensors
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
import traceback
import uuid

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")  # LMCache logs every store (INFO) and eviction (WARNING)

T0 = time.perf_counter()
CLEANUP: list = []  # run after the summary is out (LMCache's threads can outlive a failure)


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.2f}s] {msg}", flush=True)


# ------------------------------------------------------------------ the in-memory sink


class Rec:
    """One Kafka-like record, the shape ``Applier.apply_records`` reads."""

    __slots__ = ("key", "offset", "timestamp", "value")

    def __init__(self, offset: int, key: bytes, value: bytes, timestamp: int):
        self.offset, self.key, self.value, self.timestamp = offset, key, value, timestamp


class EncodingSink:
    """kvwire's EventSink protocol in memory: each publish() becomes one EventBatch, numbered as
    the publisher's ledger numbers it (first record of the epoch ``reset``, seq contiguous, lost
    batches carried as ``gap``), encoded with kvwire's Avro codec. No broker."""

    def __init__(self, worker, source: str = "lmcache"):
        from kvwire.schemas import codec
        from kvwire.schemas.events import EventBatch

        self._encode, self._batch = codec.encode, EventBatch
        self.worker, self.source = worker, source
        self.epoch = random.getrandbits(63) or 1
        self.seq = 0
        self.reset_due = True
        self.gap_due = 0
        self.gaps_reported = 0
        self.records: list[Rec] = []
        self.events = 0
        self.bytes = 0
        # What the index was told, in order: chunks held, and whether each was stored while its
        # parent was absent (an orphan chain for kvwire's index, whatever happens to the parent later)
        self.held: set = set()
        self.orphan: dict = {}

    def _track(self, events) -> None:
        from kvwire.schemas.events import AllBlocksCleared, BlockStored

        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.held.clear()
            elif isinstance(e, BlockStored):
                for i, h in enumerate(e.block_hashes):
                    par = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
                    self.orphan[h] = par is not None and (par not in self.held or self.orphan.get(par, False))
                    self.held.add(h)
            else:
                self.held.difference_update(e.block_hashes)

    def publish(self, events, engine_ts=None) -> bool:
        self._track(events)
        b = self._batch(
            self.worker,
            self.epoch,
            self.seq,
            time.time_ns() // 1000,
            tuple(events),
            engine_ts=engine_ts,
            reset=self.reset_due,
            gap=self.gap_due,
            source=self.source,
        )
        value = self._encode(b)
        self.records.append(Rec(len(self.records), self.worker.kafka_key(), value, int(time.time() * 1000)))
        self.seq += 1
        self.reset_due, self.gap_due = False, 0
        self.events += len(b.events)
        self.bytes += len(value)
        return True

    def new_epoch(self) -> int:
        self.epoch, self.seq, self.reset_due, self.gap_due = random.getrandbits(63) or 1, 0, True, 0
        return self.epoch

    def report_gap(self, n: int) -> None:
        self.gap_due += n
        self.gaps_reported += n


# ------------------------------------------------------------------ the CPU stand-in connector


def torch_paged_connector_class():
    """``VLLMPagedMemGPUConnectorV2``'s copy calls without its CUDA streams (for --device cpu)."""
    import torch
    from lmcache import device_ops
    from lmcache import lmcache_native as native
    from lmcache.utils import EngineType
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.gpu_connector.utils import (
        get_block_size,
        get_head_size,
        get_num_blocks,
        normalize_kv_and_discover_format,
    )

    class TorchPagedConnector(GPUConnectorInterface):
        def __init__(self, hidden_dim_size: int, num_layers: int, layout_hints=None):
            self.hidden_dim_size, self.num_layers = hidden_dim_size, num_layers
            self.layout_hints = layout_hints or {}
            self._ready = None

        def _init(self, kvcaches):
            if self._ready is not kvcaches:
                self.fmt, self.kv = normalize_kv_and_discover_format(
                    kvcaches, EngineType.VLLM, layout_hints=self.layout_hints
                )
                self.block_size = get_block_size(self.kv, self.fmt)
                self.page_buffer_size = get_num_blocks(self.kv, self.fmt) * self.block_size
                self.head_size = get_head_size(self.kv, self.fmt)
                # as V2 does: the layers' base pointers, which LMCache's ops turn back into tensors
                self.pointers = torch.tensor([t.data_ptr() for t in self.kv], dtype=torch.int64)
                self._ready = kvcaches

        def _copy(self, memory_obj, start, end, direction, **kw):
            self._init(kw["kvcaches"])
            device_ops.multi_layer_kv_transfer(
                memory_obj.tensor,
                self.pointers,
                kw["slot_mapping"][start:end],
                self.kv[0].device,
                self.page_buffer_size,
                direction,
                self.fmt,
                block_size=self.block_size,
                head_size=self.head_size,
            )

        def from_gpu(self, memory_obj, start, end, **kw):
            self._copy(memory_obj, start, end, native.TransferDirection.D2H, **kw)

        def to_gpu(self, memory_obj, start, end, **kw):
            self._copy(memory_obj, start, end, native.TransferDirection.H2D, **kw)

        def batched_from_gpu(self, memory_objs, starts, ends, **kw):
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(m, s, e, **kw)

        def batched_to_gpu(self, memory_objs, starts, ends, **kw):
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(m, s, e, **kw)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim_size])

    return TorchPagedConnector


# ------------------------------------------------------------------ workload


def make_prompts(rng: random.Random, n: int, chunk: int) -> list[list[int]]:
    """tests/producer/test_lmcache_eviction.py's mix: shared system prompts, random tails, and
    later turns of earlier conversations (an earlier prompt + more)."""
    shared = [[rng.randrange(30000) for _ in range(chunk * rng.randint(1, 4))] for _ in range(8)]
    out: list[list[int]] = []
    for _ in range(n):
        p = rng.choice(shared) + [rng.randrange(30000) for _ in range(rng.randint(chunk, 5 * chunk))]
        if out and rng.random() < 0.3:
            p = rng.choice(out) + p[: rng.randint(chunk, 3 * chunk)]
        out.append(p)
    return out


def prefix_seed(tokens, end: int) -> int:
    return int.from_bytes(hashlib.blake2b(repr(tokens[:end]).encode(), digest_size=8).digest(), "little") >> 1


def run(args) -> dict:
    import torch

    dev = torch.device(args.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible to torch (use --device cpu)")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    say(f"torch {torch.__version__} on {dev}")

    import lmcache
    from lmcache.utils import EngineType
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import CreateGPUConnector
    from lmcache.v1.metadata import LMCacheMetadata

    from kvwire import _core
    from kvwire.consumer.apply import Applier
    from kvwire.producer.lmcache_source import LMCacheSource
    from kvwire.schemas import codec
    from kvwire.schemas.events import WorkerId

    cuda_ops = "not tried (cpu)"
    if dev.type == "cuda":
        try:
            import lmcache.cuda_ops

            cuda_ops = "loaded"
        except Exception as e:
            cuda_ops = f"{type(e).__name__}: {e}"
    if args.ops == "torch":  # drop the native kernel bound on the instance: LMCache's torch baseline
        vars(lmcache.device_ops).pop("multi_layer_kv_transfer", None)
    mlkt = lmcache.device_ops.multi_layer_kv_transfer
    ops_path = (
        f"native {getattr(mlkt, '__module__', None) or type(mlkt).__name__}"
        if not hasattr(mlkt, "__func__")
        else f"python (torch baseline) {mlkt.__func__.__module__}"
    )
    say(
        f"lmcache {getattr(lmcache, '__version__', '?')}: device_ops={type(lmcache.device_ops).__name__}, "
        f"multi_layer_kv_transfer={ops_path}, cuda_ops={cuda_ops}"
    )

    L, H, D, BS, C = args.layers, args.heads, args.head_size, args.block_size, args.chunk
    dtype = torch.float16
    chunk_bytes = 2 * L * C * H * D * dtype.itemsize
    budget_gib = args.budget_chunks * chunk_bytes / 1024**3
    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=C, local_cpu=True, max_local_cpu_size=budget_gib, enable_kv_events=True
    )
    md = LMCacheMetadata(
        model_name="tiny",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=dev.index or 0,
        kv_dtype=dtype,
        kv_shape=(L, 2, C, H, D),
    )
    hints = {"kv_layout": "NHD"}
    if dev.type == "cuda":
        connector = CreateGPUConnector(cfg, md, EngineType.VLLM, layout_hints=hints)
    else:
        connector = torch_paged_connector_class()(H * D, L, layout_hints=hints)
    say(
        f"connector {type(connector).__module__}.{type(connector).__name__}; chunk {C} tokens = "
        f"{chunk_bytes} B, CPU budget {args.budget_chunks} chunks ({budget_gib * 1024:.2f} MiB)"
    )

    name = f"kvwire-cuda-check-{uuid.uuid4().hex[:8]}"
    engine = LMCacheEngineBuilder.get_or_create(name, cfg, md, connector, lambda *a: None, lambda *a: None)
    engine.post_init()

    worker = WorkerId("lmc-cuda", 0, 0, 1, "tiny")
    sink = EncodingSink(worker)
    src = LMCacheSource(engine, sink, observe_removals=not args.no_removals)
    applier = Applier()
    applied = 0

    def feed() -> None:
        nonlocal applied
        recs = sink.records
        while applied < len(recs):
            applied = applier.apply_records("in-memory", 0, recs, start=applied, budget_us=1 << 40)

    # vLLM-shaped paged KV: per layer [2, num_blocks, block_size, heads, head_size] on the device
    num_blocks = args.pool_blocks
    kv = [torch.zeros((2, num_blocks, BS, H, D), dtype=dtype, device=dev) for _ in range(L)]
    flat = [t.view(2, num_blocks * BS, H, D) for t in kv]
    gen = torch.Generator(device=dev)

    def chunk_kv(tokens, c: int) -> torch.Tensor:
        """The KV of chunk c ([L, 2, C, H, D]): a function of the token prefix, as in an engine."""
        gen.manual_seed(prefix_seed(tokens, (c + 1) * C))
        return torch.randn((L, 2, C, H, D), generator=gen, device=dev, dtype=torch.float32).to(dtype)

    def slots_for(n: int, rng: random.Random) -> torch.Tensor:
        blocks = rng.sample(range(num_blocks), (n + BS - 1) // BS)
        s = [b * BS + i for b in blocks for i in range(BS)][:n]
        return torch.tensor(s, dtype=torch.long, device=dev)

    def write_kv(tokens, slots: torch.Tensor) -> None:
        n = len(tokens)
        for c in range(n // C):
            data = chunk_kv(tokens, c)
            sl = slots[c * C : (c + 1) * C]
            for li in range(L):
                flat[li][:, sl] = data[li]
        if n % C:  # the unfull tail: LMCache does not save it; any bytes
            sl = slots[(n // C) * C :]
            for li in range(L):
                flat[li][:, sl] = torch.randn((2, len(sl), H, D), device=dev).to(dtype)

    rng = random.Random(args.seed)
    prompts = make_prompts(rng, args.prompts, C)
    say(f"{len(prompts)} prompts, {sum(len(p) for p in prompts)} tokens, pool {num_blocks} blocks x {BS}")

    def orphaned(q, got: int, want: int) -> bool:
        """kvwire credits less because the first chunk it does not credit was stored while its parent
        was absent from the index (evicted, or never repaired), and the parent came back later."""
        if got >= want:
            return False
        hashes = [k.chunk_hash for _, _, k in engine.token_database.process_tokens(torch.tensor(q, dtype=torch.long))]
        k = got // C
        return k < len(hashes) and sink.orphan.get(hashes[k], False)

    def compare(queries, label: str) -> dict:
        feed()
        mism, orphans, hits, examples = 0, 0, 0, []
        for q in queries:
            want = engine.lookup(torch.tensor(q, dtype=torch.long))
            got = 0
            for s in applier.score(q):
                if (s.instance_id, s.dp_rank) == worker.worker:
                    got = s.matched_tokens
            if got != want:
                mism += 1
                orphan = orphaned(q, got, want)
                orphans += orphan
                if len(examples) < 5:
                    examples.append({"len": len(q), "lookup": want, "kvwire": got, "orphan": orphan})
            hits += want > 0
        say(
            f"compare[{label}]: {len(queries)} queries, {hits} hit in LMCache, {mism} mismatches"
            + (f" ({orphans} orphan under-credits)" if mism else "")
        )
        return {
            "label": label,
            "queries": len(queries),
            "hits": hits,
            "mismatches": mism,
            "orphan_mismatches": orphans,
            "examples": examples,
        }

    checks = []
    stored_so_far: list[list[int]] = []
    masked_stores = skipped_stores = 0
    t_store = 0.0
    for i, p in enumerate(prompts):
        slots = slots_for(len(p), rng)
        write_kv(p, slots)
        if dev.type == "cuda":
            torch.cuda.synchronize()  # V2 copies on its own stream, which does not wait for ours
        mask, head = None, 0
        if args.mask == "lookup":
            # vLLM's LMCache adapter: a new request skips what LMCache held when it was looked up
            # (skip_leading_tokens = the hit, chunk-aligned); LMCache then reports the first chunk it
            # stores with parent 0, which kvwire's LMCacheRepair resolves
            head = engine.lookup(torch.tensor(p, dtype=torch.long)) // C * C
        elif args.mask == "history" and rng.random() < 0.5:
            # a request whose earlier steps stored its head: masked whether or not LMCache still
            # holds that head (it may have been evicted since)
            head = max((len(o) for o in stored_so_far if len(o) < len(p) and p[: len(o)] == o), default=0)
            head = head // C * C
        if head >= len(p) // C * C > 0:
            skipped_stores += 1  # nothing new to save: the adapter skips the store
        else:
            if head:
                mask = torch.ones(len(p), dtype=torch.bool)
                mask[:head] = False
                masked_stores += 1
            t = time.perf_counter()
            engine.store(
                torch.tensor(p, dtype=torch.long), mask=mask, kvcaches=kv, slot_mapping=slots, req_id=f"req-{i}"
            )
            t_store += time.perf_counter() - t
        src.poll_once()  # on the engine's thread, after each store (as the tests do)
        feed()
        stored_so_far.append(p)
        if (i + 1) % args.check_every == 0 and i + 1 < len(prompts):
            checks.append(compare(stored_so_far, f"after {i + 1} stores"))
    src.poll_once()
    feed()
    say(
        f"stored {len(prompts)} prompts ({masked_stores} masked, {skipped_stores} fully held) in {t_store:.2f}s of store(); "
        f"{sink.events} events in {len(sink.records)} records ({sink.bytes} B Avro), "
        f"removals {src.removals}, duplicates {src.duplicates}, gaps {src.gaps}"
    )

    queries = list(prompts)
    queries += [q[: rng.randint(C, len(q))] for q in rng.sample(prompts, min(len(prompts), 100))]
    queries += make_prompts(random.Random(args.seed + 1), 40, C)  # unseen
    queries += [q[: rng.randint(1, len(q))] + [rng.randrange(30000) for _ in range(C)] for q in rng.sample(prompts, 40)]
    checks.append(compare(queries, "final"))

    # KV bytes round trip: zero the paged KV, retrieve into new slots, compare with what was stored.
    # The same tensors, zeroed, not new ones: V2 binds the layers' base pointers on first use, as
    # vLLM allocates its KV caches once per process.
    held = [(q, engine.lookup(torch.tensor(q, dtype=torch.long))) for q in prompts]
    held = [(q, n) for q, n in held if n > 0]
    pick = rng.sample(held, min(args.retrieve, len(held)))
    bytes_checked, byte_mismatches, retrieve_mismatches, retrieved_tokens = 0, 0, 0, 0
    for j, (q, n) in enumerate(pick):
        for t in kv:
            t.zero_()
        slots = slots_for(len(q), rng)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ret = engine.retrieve(torch.tensor(q, dtype=torch.long), kvcaches=kv, slot_mapping=slots, req_id=f"ret-{j}")
        if dev.type == "cuda":
            torch.cuda.synchronize()
        got_n = int(ret.sum())
        if got_n != n or not bool(ret[:got_n].all()):
            retrieve_mismatches += 1
            say(f"retrieve: prompt of {len(q)} tokens: lookup {n}, retrieved {got_n}")
        retrieved_tokens += got_n
        for c in range(got_n // C):
            want = chunk_kv(q, c)
            sl = slots[c * C : (c + 1) * C]
            for li in range(L):
                got = flat[li][:, sl]
                bytes_checked += got.numel() * got.element_size()
                if not torch.equal(got, want[li]):
                    byte_mismatches += 1
    say(
        f"retrieved {len(pick)} prompts ({retrieved_tokens} tokens) into the zeroed paged KV: "
        f"{bytes_checked} B compared, {byte_mismatches} chunk-layer differences, "
        f"{retrieve_mismatches} retrieve/lookup disagreements"
    )

    trusted = applier.ranks.worker_trusted(worker.worker)
    src.stop()
    CLEANUP.append(lambda: LMCacheEngineBuilder.destroy(name))

    mismatches = sum(c["mismatches"] for c in checks)
    orphan_mismatches = sum(c["orphan_mismatches"] for c in checks)
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    summary = {
        "device": dev_name,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "lmcache": getattr(lmcache, "__version__", "?"),
        "connector": f"{type(connector).__module__}.{type(connector).__name__}",
        "ops": args.ops,
        "ops_path": ops_path,
        "cuda_ops": cuda_ops,
        "kafka": "none: records encoded with kvwire's Avro codec and applied in memory (no broker on this machine)",
        "schema": codec.CURRENT.name,
        "kvwire_core": os.path.basename(getattr(_core, "__file__", "?")),
        "kv": {
            "layers": L,
            "heads": H,
            "head_size": D,
            "block_size": BS,
            "chunk": C,
            "dtype": str(dtype),
            "pool_blocks": num_blocks,
            "cpu_budget_chunks": args.budget_chunks,
        },
        "prompts_stored": len(prompts),
        "mask": args.mask,
        "masked_stores": masked_stores,
        "skipped_stores": skipped_stores,
        "lmcache_events": src.repair.stats.events,
        "events": sink.events,
        "records": len(sink.records),
        "record_bytes": sink.bytes,
        "records_applied": applier.records,
        "dead_letters": len(applier.dead_letters),
        "removals": src.removals,
        "duplicates": src.duplicates,
        "parents_repaired": src.repair.stats.parents_repaired,
        "parents_unrepaired": src.repair.stats.parents_unrepaired,
        "gaps": src.gaps,
        "observer_hooked": src.observer.hooked if src.observer else [],
        "approximate": src.approximate,
        "trusted": trusted,
        "checks": checks,
        "mismatches": mismatches,
        "orphan_mismatches": orphan_mismatches,
        "orphan_chunks_published": sum(sink.orphan.values()),
        "retrieved_prompts": len(pick),
        "retrieved_tokens": retrieved_tokens,
        "retrieve_mismatches": retrieve_mismatches,
        "bytes_checked": bytes_checked,
        "byte_mismatches": byte_mismatches,
        "store_seconds": round(t_store, 3),
        "wall_seconds": round(time.perf_counter() - T0, 2),
    }
    problems = []
    if mismatches:
        problems.append(
            f"{mismatches} credit/lookup mismatches, {orphan_mismatches} of them kvwire under-crediting a chunk "
            "it was told of while the chunk's parent was absent (an orphan in the index even after the parent "
            "is stored again; LMCache's lookup credits the chain once every chunk is back)"
        )
    if byte_mismatches or retrieve_mismatches:
        problems.append(f"{byte_mismatches} byte and {retrieve_mismatches} retrieve mismatches")
    if src.gaps or sink.gaps_reported or applier.dead_letters or not trusted:
        problems.append(f"gaps {src.gaps}, dead letters {len(applier.dead_letters)}, trusted {trusted}")
    if src.approximate:
        problems.append("LMCache's removals were not observed (approximate source)")
    if not src.removals and not args.no_removals:
        problems.append("LMCache never evicted: raise --prompts or lower --budget-chunks")
    if not pick or not bytes_checked:
        problems.append("no KV bytes were compared")
    if not any(c["hits"] for c in checks):
        problems.append("no query hit LMCache")
    summary["ok"] = not problems
    summary["problems"] = problems
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu")
    ap.add_argument(
        "--ops",
        choices=("auto", "torch"),
        default="auto",
        help="auto: whatever lmcache.device_ops binds (cuda_ops kernels if they load); torch: LMCache's torch baseline",
    )
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--chunk", type=int, default=16, help="LMCache chunk size (tokens)")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM page size (tokens)")
    ap.add_argument("--layers", type=int, default=None, help="default 8 on cuda, 2 on cpu")
    ap.add_argument("--heads", type=int, default=None, help="default 8 on cuda, 2 on cpu")
    ap.add_argument("--head-size", type=int, default=None, help="default 128 on cuda, 8 on cpu")
    ap.add_argument("--pool-blocks", type=int, default=4096, help="paged KV blocks per layer")
    ap.add_argument("--budget-chunks", type=int, default=200, help="LMCache CPU tier size, in chunks")
    ap.add_argument("--retrieve", type=int, default=32, help="prompts whose KV bytes are checked")
    ap.add_argument("--check-every", type=int, default=100, help="compare with lookup every N stores")
    ap.add_argument(
        "--mask",
        choices=("lookup", "history", "none"),
        default="lookup",
        help="incremental stores: lookup = skip the head LMCache holds at lookup (vLLM's adapter); "
        "history = skip, for half the later turns, the head an earlier store covered, held or not "
        "(a request's earlier steps, evicted since); none = store every prompt whole",
    )
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument(
        "--no-removals",
        action="store_true",
        help="negative control: do not observe LMCache's evictions (the comparison must then fail)",
    )
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/cuda_check.json when OUT is set)")
    args = ap.parse_args()
    cpu = args.device == "cpu"
    args.layers = args.layers or (2 if cpu else 8)
    args.heads = args.heads or (2 if cpu else 8)
    args.head_size = args.head_size or (8 if cpu else 128)
    out = args.out or (os.path.join(os.environ["OUT"], "cuda_check.json") if os.environ.get("OUT") else None)
    try:
        summary = run(args)
        rc = 0 if summary["ok"] else 1
    except Exception as e:
        traceback.print_exc()
        summary = {"ok": False, "error": f"{type(e).__name__}: {e}", "wall_seconds": round(time.perf_counter() - T0, 2)}
        rc = 2
    text = json.dumps(summary, indent=1)
    print(text, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    say("OK" if rc == 0 else f"FAILED (exit {rc})")
    for fn in CLEANUP:
        try:
            fn()
        except Exception as e:
            say(f"cleanup: {type(e).__name__}: {e}")
    return rc


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # LMCache's non-daemon threads must not keep a finished check alive
