"""A real vLLM engine's KV cache on CPU, stepped by hand, and a workload of prompts for it.

The engine is vLLM 0.33's own ``KVCacheManager`` (block pool, prefix cache, LRU eviction, KV
events) publishing through vLLM's own ``ZmqEventPublisher`` exactly as ``EngineCore`` does
(``take_events()`` after a step -> ``KVEventBatch`` -> ``publish``). Only the model forward pass
is absent: it does not touch the cache's bookkeeping. ``held_blocks`` is the oracle: the leading
blocks of a prompt the engine's block pool holds.
"""

from __future__ import annotations

import random
import time

from ci_env import require

BS = 16


def cache_manager(num_blocks: int):
    """vLLM's own KVCacheManager on CPU: one full-attention group of BS-token blocks, KV events on."""
    torch = require("torch")
    require("vllm.distributed.kv_events")
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    init_none_hash(sha256)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    cfg = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    return KVCacheManager(
        cfg, max_model_len=8192, scheduler_block_size=BS, hash_block_size=BS, enable_kv_cache_events=True
    )


def request(rid: str, tokens, lora=None, salt=None):
    """A vLLM request hashed as the engine hashes it; ``lora``: a ``LoRARequest``."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    return Request(
        rid,
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BS, sha256),
        lora_request=lora,
        cache_salt=salt,
    )


class Engine:
    """vLLM's KVCacheManager + ZmqEventPublisher, stepped by hand."""

    def __init__(self, h, port: int, rport: int, num_blocks: int = 96, buffer_steps: int = 10_000, topic: str = "kv"):
        ke = h.require("vllm.distributed.kv_events")
        self.mgr = cache_manager(num_blocks)
        self._ke = ke
        self._req = request
        self.pub = ke.ZmqEventPublisher(
            0,
            endpoint=f"tcp://*:{port}",
            replay_endpoint=f"tcp://*:{rport}",
            buffer_steps=buffer_steps,
            topic=topic,
        )
        self._n = 0
        self.batches = 0
        self.removed = 0  # blocks the engine's events said it evicted

    def step(self) -> None:
        """What EngineCore does after a scheduler step."""
        events = self.mgr.take_events()
        self.removed += sum(len(e.block_hashes) for e in events if isinstance(e, self._ke.BlockRemoved))
        if events:
            self.pub.publish(self._ke.KVEventBatch(ts=time.time(), events=events))
            self.batches += 1

    def serve(self, tokens, lora=None, salt=None) -> None:
        """A prefill: prefix-cache hit, allocation (evicting LRU blocks), then the request ends.
        ``lora``: a ``vllm.lora.request.LoRARequest`` the request runs under; ``salt`` its cache_salt."""
        self._n += 1
        r = self._req(f"r{self._n}", tokens, lora, salt)
        blocks, hit, _ = self.mgr.get_computed_blocks(r)
        got = self.mgr.allocate_slots(r, len(tokens) - hit, hit, blocks)
        assert got is not None, "engine out of blocks"
        self.mgr.free(r)
        self.step()

    def reset_prefix_cache(self) -> None:
        assert self.mgr.reset_prefix_cache()
        self.step()

    def held_blocks(self, tokens, lora=None, salt=None) -> int:
        """Leading full blocks of ``tokens`` in the engine's prefix cache."""
        self._n += 1
        pool = self.mgr.block_pool
        n = 0
        for bh in self._req(f"q{self._n}", tokens, lora, salt).block_hashes:
            if pool.get_cached_block(bh, [0]) is None:
                break
            n += 1
        return n

    def wait_sent(self, h) -> None:
        h.wait_for(lambda: self.pub._event_queue.unfinished_tasks == 0, "vLLM's publisher thread to send")

    def shutdown(self) -> None:
        self.pub.shutdown()


class Workload:
    """Prompts sharing system prompts, with multi-turn growth: hits, misses and evictions."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.systems = [self._toks(self.rng.randint(2, 6) * BS) for _ in range(5)]
        self.served: list[list[int]] = []

    def _toks(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 30000) for _ in range(n)]

    def prompt(self) -> list[int]:
        r = self.rng.random()
        if self.served and r < 0.4:
            base = self.rng.choice(self.served)
            return base + self._toks(self.rng.randint(1, 3) * BS + self.rng.randrange(BS))
        return self.rng.choice(self.systems) + self._toks(self.rng.randint(0, 4) * BS + self.rng.randrange(1, BS))

    def run(self, engine: Engine, n: int) -> None:
        for _ in range(n):
            p = self.prompt()
            engine.serve(p)
            self.served.append(p)

    def queries(self, n: int) -> list[list[int]]:
        out = []
        for _ in range(n):
            if self.served and self.rng.random() < 0.6:
                p = self.rng.choice(self.served)
                out.append(p[: self.rng.randint(BS, len(p))] if self.rng.random() < 0.5 else p)
            else:
                out.append(self.prompt())
        return out
