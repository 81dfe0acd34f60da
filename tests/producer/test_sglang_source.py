"""SGLang's KV events against SGLang's own code (sglang 0.5.23, installed --no-deps, on CPU).

The engine side is SGLang's ``RadixCache`` (its radix tree and ``KVCacheEventRecorder``)
publishing through SGLang's ``ZmqEventPublisher``, stepped the way its scheduler does
(``take_events()`` -> ``KVEventBatch`` -> ``publish``). Only the GPU KV allocator is stood in
for (``_Allocator``: eviction frees pages there, nothing the events depend on). The bridge
runs into the real publisher and broker; an ``Applier`` reads the topic, and every query
compares the index's credit with the prefix SGLang's own ``match_prefix`` finds."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from array import array

import pytest
import zmq.asyncio

from kvwire.producer import vllm_wire
from kvwire.producer.sglang_source import UNDECODABLE, SglangBridge, decode_batch, to_vllm_payload
from kvwire.producer.vllm_wire import WireError
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, WorkerId

pytestmark = pytest.mark.sglang
PAGE = 4
WORKER = ("sgl-a", 0)


@pytest.fixture
def kv(h):
    return h.require("sglang.srt.disaggregation.kv_events")


def encode(kv, events, dp_rank=None) -> bytes:
    """What SGLang's publisher thread puts in a frame."""
    import msgspec

    return msgspec.msgpack.Encoder().encode(kv.KVEventBatch(ts=1.5, events=events, attn_dp_rank=dp_rank))


def test_sglang_payloads_decode_with_their_differences(kv):
    payload = encode(
        kv,
        [
            kv.BlockStored([-5, 2**63 - 1], None, list(range(8)), 4, None, kv.StorageMedium.GPU, cache_salt="t1"),
            kv.BlockStored([9], -5, [1, 2], 2, None, kv.StorageMedium.CPU, cache_salt="t1", lora_name="ad"),
            kv.BlockRemoved([-5], kv.StorageMedium.DISK),
            kv.BlockRemoved([7], kv.StorageMedium.EXTERNAL),
            kv.AllBlocksCleared(),
        ],
        dp_rank=3,
    )
    b = decode_batch(payload)
    assert b.ts == 1.5 and b.data_parallel_rank == 3
    s0, s1, r0, r1, c = b.events
    assert isinstance(s0, BlockStored) and s0.block_hashes == (-5, 2**63 - 1) and s0.parent_block_hash is None
    assert s0.token_ids.tolist() == list(range(8)) and s0.block_size == 4 and s0.medium == "GPU"
    assert s0.extra_keys == (("t1",), None)  # the salt, where vLLM puts it: the first block's extra keys
    assert s1.extra_keys is None and s1.parent_block_hash == -5  # inherited through the chain
    assert s1.block_size == 2 and s1.medium == "CPU" and s1.lora_name == "ad"  # a short last page; CPU_PINNED
    assert isinstance(r0, BlockRemoved) and r0.medium == "STORAGE" and r1.medium == "EXTERNAL"
    assert isinstance(c, AllBlocksCleared)
    # vLLM's decoder reads the same bytes without complaint and loses the salt: why SGLang has its own.
    assert vllm_wire.decode_batch(payload).events[0].extra_keys is None
    # the bridge gets it in vLLM's shape, salt included
    assert vllm_wire.decode_batch(to_vllm_payload(payload)[0]).events == b.events


def test_bigram_pages_and_garbage_are_typed_errors(kv):
    bigram = encode(kv, [kv.BlockStored([1], None, [(1, 2), (2, 3)], 2, None, "GPU")])
    with pytest.raises(WireError):
        decode_batch(bigram)
    assert to_vllm_payload(bigram)[0] == UNDECODABLE
    with pytest.raises(WireError, match="unknown event type"):
        decode_batch(encode(kv, [{"type": "BlockMoved"}]))
    with pytest.raises(WireError, match="not msgpack"):
        decode_batch(b"\xc1")


# ------------------------------------------------------------ SGLang's radix cache, end to end


class _Allocator:
    """Stands in for the GPU KV pool allocator: eviction hands pages back here."""

    device = "cpu"

    def free_segment(self, value, start_pos: int = 0) -> None:
        pass

    def free(self, value) -> None:
        pass


class Engine:
    def __init__(self, h, port: int, rport: int):
        h.require("sglang.srt.mem_cache.radix_cache")
        from sglang.srt.disaggregation.kv_events import KVEventBatch, ZmqEventPublisher
        from sglang.srt.mem_cache.radix_cache import RadixCache

        self.cache = RadixCache.create_simulated(
            mock_allocator=_Allocator(), page_size=PAGE, enable_kv_cache_events=True
        )
        self.cache.take_events()  # the AllBlocksCleared of its construction
        self._batch = KVEventBatch
        self.pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}", topic="kv")

    def step(self, raw_events=None) -> None:
        """What SGLang's scheduler does after a step (SchedulerKvEventsPublisher)."""
        events = raw_events if raw_events is not None else self.cache.take_events()
        if events:
            self.pub.publish(self._batch(ts=time.time(), events=events))

    def insert(self, tokens, salt=None) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.cache.insert(InsertParams(key=RadixKey(array("q", tokens), cache_salt=salt)))
        self.step()

    def evict(self, n: int) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.cache.evict(EvictParams(num_tokens=n))
        self.step()

    def held(self, tokens, salt=None) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens), cache_salt=salt)))
        return m.device_prefix_len

    def wait_sent(self, h) -> None:
        h.wait_for(lambda: self.pub._event_queue.unfinished_tasks == 0, "SGLang's publisher thread to send")

    def shutdown(self) -> None:
        self.pub.shutdown()


class Pipeline:
    """SglangBridge (own thread) -> KafkaPublisher -> topic; read back by ``IndexReader``."""

    def __init__(self, bootstrap: str, topic: str, port: int, rport: int):
        from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
        from kvwire.producer.zmq_bridge import BridgeConfig

        self.pub = KafkaPublisher(PublisherConfig(bootstrap_servers=bootstrap, topic=topic, linger_ms=1))
        self.stream = self.pub.stream(WorkerId(*WORKER, 0, 1, "m"), source="sglang-zmq")
        cfg = BridgeConfig(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", zmq_topic="kv")
        self.bridge = SglangBridge(cfg, self.stream, ctx=zmq.asyncio.Context())
        self.loop = asyncio.new_event_loop()
        self.stop: asyncio.Event | None = None
        started = threading.Event()

        def main():
            asyncio.set_event_loop(self.loop)
            self.stop = asyncio.Event()
            started.set()
            self.loop.run_until_complete(self.bridge.run(self.stop))

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        started.wait()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        self.pub.close()


def test_index_matches_sglangs_radix_cache(h, kafka_bootstrap, new_topic, index_reader):
    rng = random.Random(4)
    toks = lambda n: [rng.randrange(1, 30000) for _ in range(n)]
    systems = [toks(rng.randint(2, 5) * PAGE) for _ in range(4)]
    port, rport = h.free_port(), h.free_port()
    engine = Engine(h, port, rport)
    topic = new_topic()
    pipe = Pipeline(kafka_bootstrap, topic, port, rport)
    reader = index_reader(topic)
    served: list[tuple[list[int], str | None]] = []
    try:
        h.wait_for(lambda: pipe.bridge.known, "the bridge to sync with SGLang's replay socket")
        for i in range(60):
            p = rng.choice(systems) + toks(rng.randint(0, 4) * PAGE + rng.randrange(PAGE))
            salt = "tenant-b" if i % 5 == 0 else None
            engine.insert(p, salt)
            served.append((p, salt))
            if i % 15 == 14:
                engine.evict(6 * PAGE)
        engine.wait_sent(h)
        reader.catch_up(pipe.stream)

        def compare() -> tuple[int, int]:
            checked = held = 0
            for p, salt in served + [(s, None) for s in systems]:
                for q in (p, p[: rng.randint(1, len(p))]):
                    extra = [(salt,)] if salt else None
                    want = engine.held(q, salt)
                    got = 0
                    for s in reader.applier.score(q, block_size=PAGE, extra_keys=extra):
                        if (s.instance_id, s.dp_rank) == WORKER:
                            got = s.matched_tokens
                    assert got == want, (q, salt)
                    if salt:  # the other tenant never sees these blocks
                        other = reader.credit(WORKER, q, PAGE)
                        assert other == engine.held(q, None)
                    checked += 1
                    held += want > 0
            return checked, held

        checked, held = compare()
        assert reader.trusted(WORKER) and held >= checked // 3  # the comparison has teeth
        # An EAGLE bigram batch kvwire cannot key: lost, so the worker stops being credited ...
        engine.step([_bigram()])
        engine.wait_sent(h)
        h.wait_for(lambda: pipe.bridge.stats.lost_batches >= 1, "the bridge to count the lost batch")
        reader.catch_up(pipe.stream)
        assert not reader.trusted(WORKER) and reader.credit(WORKER, served[0][0], PAGE) == 0
        # ... until SGLang flushes its cache: an AllBlocksCleared makes its state known (empty) again
        engine.cache.reset()
        engine.step()
        engine.insert(served[1][0])
        engine.wait_sent(h)
        reader.catch_up(pipe.stream)
        assert reader.trusted(WORKER)
        assert reader.credit(WORKER, served[1][0], PAGE) == engine.held(served[1][0]) > 0
        assert reader.credit(WORKER, served[2][0], PAGE) == engine.held(served[2][0])
    finally:
        pipe.close()
        engine.shutdown()


def _bigram():
    from sglang.srt.disaggregation.kv_events import BlockStored as SgStored

    return SgStored([1], None, [(1, 2), (2, 3)], 2, None, "GPU")
