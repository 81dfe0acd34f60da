"""KVWireConnector around vLLM's own LMCacheConnectorV1 event path, over a real LMCacheEngine on
CPU that evicts: the index equals ``LMCacheEngine.lookup`` (issue 13).

The inner connector is vLLM's ``LMCacheConnectorV1`` class with only its constructor replaced:
the real one builds LMCache's vLLM adapter, which needs CUDA and a GPU model runner. Its
``get_kv_connector_kv_cache_events`` (the method the wrapper observes) is vLLM's own, draining
the engine through an adapter object that holds the real LMCacheEngine, as LMCache's adapter
does. Only the GPU copy is mocked (LMCache's MockGPUConnector)."""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.lmcache, pytest.mark.integration]

ENGINE = None  # the LMCacheEngine the inner connector wraps, set by the test

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1
except Exception:  # collected without vllm: the test fails/skips through `h.require`
    KVConnectorBase_V1 = LMCacheConnectorV1 = object


class _Adapter:
    """What LMCacheConnectorV1 holds as ``_lmcache_engine``: LMCache's vLLM adapter, reduced to
    the two members the event path uses."""

    def __init__(self, engine):
        self.lmcache_engine = engine

    def get_kv_events(self):
        return self.lmcache_engine.get_kv_events()


class LMCacheOnCPU(LMCacheConnectorV1):
    def __init__(self, vllm_config, role, kv_cache_config):
        KVConnectorBase_V1.__init__(self, vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._lmcache_engine = _Adapter(ENGINE)


def test_connector_publishes_lmcache_evictions(h, small_engine, kafka_bootstrap, new_topic, index_reader):
    global ENGINE
    torch = h.require("torch")
    h.require("vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector")
    from test_connector import vllm_config
    from test_lmcache_eviction import prompts
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.producer.connector import KVWireConnector

    ENGINE = small_engine
    topic = new_topic()
    opts = {
        "instance_id": "vllm-lmc",
        "inner_connector": "LMCacheOnCPU",
        "inner_module_path": "test_connector_lmcache",
        "bootstrap_servers": kafka_bootstrap,
        "topic": topic,
    }
    c = KVWireConnector(vllm_config(opts), KVConnectorRole.WORKER, None)
    assert c._stream is not None, c.last_error
    assert c.source == "vllm-connector"  # removals observed: not approximate
    reader = index_reader(topic)
    worker = ("vllm-lmc", 0)
    rng = random.Random(5)
    try:
        stored = prompts(rng, 150)
        for p in stored:
            small_engine.store(torch.tensor(p, dtype=torch.long))
            c.get_kv_connector_kv_cache_events()  # after each engine step, as vLLM calls it
        c.get_kv_connector_kv_cache_events()
        reader.catch_up(c._stream)
        assert c._membership.removals > 50 and c.gaps_reported == 0 and reader.trusted(worker)
        queries = [q[: rng.randint(16, len(q))] if rng.random() < 0.4 else q for q in rng.sample(stored, 100)]
        mismatches = hits = 0
        for q in queries + prompts(rng, 20):
            want = small_engine.lookup(torch.tensor(q, dtype=torch.long))
            mismatches += reader.credit(worker, q) != want
            hits += want > 0
        assert hits >= 30 and mismatches == 0
    finally:
        c._membership.observer.detach()
        c.shutdown()
        ENGINE = None
