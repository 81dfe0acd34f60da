"""KVWireConnector with vLLM's real KVConnectorBase_V1, VllmConfig, KVTransferConfig and
event classes (BlockStored, LMCacheKVEvents) on CPU.

The inner connector is `EmittingInner` below, a real KVConnectorBase_V1 subclass that
emits real vLLM BlockStored events the way LMCacheConnectorV1 does (its
get_kv_connector_kv_cache_events returns an LMCacheKVEvents). The real LMCacheConnectorV1
is not used as the inner: its constructor builds LMCache's vLLM adapter, which needs a
CUDA device and an initialised vLLM worker (paged KV caches registered from the GPU
model runner); there is no GPU here. Nothing else is mocked."""

from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm
BIG = (1 << 64) - 3


def _base():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return KVConnectorBase_V1


try:  # the inner connector must be a module-level class so kvwire can load it by path
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1 as _Base,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorWorkerMetadata as _WM,
    )
except Exception:  # collected without vllm: the tests fail/skip through `h.require`
    _Base, _WM = object, object


class EventsMeta(_WM):
    """Worker metadata carrying events, the shape vLLM PR #34522 proposes."""

    def __init__(self, kv_cache_events):
        self.kv_cache_events = kv_cache_events
        self.other = "inner's own data"

    def aggregate(self, other):
        return self


class EmittingInner(_Base):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.calls = []
        self.pending = []
        self.meta_events = None

    def store(self, *events):
        self.pending.extend(events)

    def get_kv_connector_kv_cache_events(self):
        from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheKVEvents

        if not self.pending:
            return None
        ev = LMCacheKVEvents(num_workers=1)
        ev.add_events(self.pending)
        self.pending = []
        return ev

    def build_connector_worker_meta(self):
        if self.meta_events is None:
            return None
        m, self.meta_events = EventsMeta(self.meta_events), None
        return m

    def __getattribute__(self, name):
        # Record every base-class method call so delegation is checked for all of them.
        attr = object.__getattribute__(self, name)
        if callable(attr) and not name.startswith("__") and hasattr(_Base, name):
            calls = object.__getattribute__(self, "calls")

            def rec(*a, **kw):
                calls.append(name)
                return attr(*a, **kw)

            return rec
        return attr

    def start_load_kv(self, forward_context, **kwargs):
        return ("load", forward_context)

    def wait_for_layer_load(self, layer_name):
        return ("wait", layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return ("save", layer_name)

    def wait_for_save(self):
        return "saved"

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return (num_computed_tokens + 16, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        return ("alloc", num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return ("meta", scheduler_output)

    def reset_cache(self):
        return True


try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA as _HMA
except Exception:
    _HMA = object


class HMAInner(EmittingInner, _HMA):
    """An inner connector with hybrid KV cache manager support (vLLM's SupportsHMA mixin)."""

    def request_finished_all_groups(self, request, block_ids):
        return (True, {"groups": len(block_ids)})


def vllm_config(opts, tp_size=1, dp_rank=0, rank=0, connector="KVWireConnector"):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.config import DeviceConfig, KVTransferConfig, ParallelConfig, VllmConfig

    k = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path="kvwire.producer.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"kvwire": opts},
    )
    pc = ParallelConfig()
    # Set after construction: validating a TP world would need that many devices.
    pc.tensor_parallel_size, pc.data_parallel_rank, pc.rank = tp_size, dp_rank, rank
    return VllmConfig(kv_transfer_config=k, device_config=DeviceConfig(device="cpu"), parallel_config=pc)


def opts(**kw):
    base = {
        "instance_id": "vllm-x",
        "inner_connector": "EmittingInner",
        "inner_module_path": "test_connector",
        "forward_events_to_vllm": True,
        "bootstrap_servers": "127.0.0.1:1",
        "topic": "unused",
    }
    base.update(kw)
    return base


@pytest.fixture
def vk(h):
    h.require("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from vllm.distributed import kv_events
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvwire.producer.connector import KVWireConnector

    return SimpleNamespace(ev=kv_events, Role=KVConnectorRole, KVWireConnector=KVWireConnector)


def stored_event(ev, i):
    return ev.BlockStored(
        block_hashes=[BIG - i],
        parent_block_hash=None if i == 0 else BIG - i + 1,
        token_ids=list(range(16 * i, 16 * i + 16)),
        block_size=16,
        lora_id=None,
        medium="cpu",
        lora_name=None,
    )


def test_every_base_method_is_explicitly_delegated(vk):
    base = _base()
    names = {
        n
        for n, v in inspect.getmembers(base)
        if not n.startswith("__") and (callable(v) or isinstance(inspect.getattr_static(base, n), property))
    }
    missing = sorted(n for n in names if n not in vk.KVWireConnector.__dict__)
    assert missing == []


def test_calls_reach_the_inner_connector_unchanged(vk, sink):
    c = vk.KVWireConnector(vllm_config(opts()), vk.Role.WORKER, None, sink=sink)
    inner = c.inner
    assert type(inner).__name__ == "EmittingInner"
    # The inner sees itself as the configured connector; options are shared.
    assert inner._kv_transfer_config.kv_connector == "EmittingInner"
    assert c.start_load_kv("fc") == ("load", "fc")
    assert c.wait_for_layer_load("l0") == ("wait", "l0")
    assert c.save_kv_layer("l0", None, None) == ("save", "l0")
    assert c.wait_for_save() == "saved"
    assert c.get_num_new_matched_tokens(None, 32) == (48, False)
    assert c.update_state_after_alloc(None, None, 7) == ("alloc", 7)
    assert c.build_connector_meta("so") == ("meta", "so")
    assert c.reset_cache() is True
    assert c.get_finished({"r"}) == (None, None)
    assert c.take_events() == ()
    assert c.role == vk.Role.WORKER and c.requires_kv_delivery is True
    c.bind_connector_metadata("m")
    assert c.has_connector_metadata() and inner.has_connector_metadata()
    c.clear_connector_metadata()
    assert not inner.has_connector_metadata()
    assert c.shutdown() is None
    assert {
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
        "reset_cache",
        "get_finished",
        "take_events",
        "bind_connector_metadata",
        "clear_connector_metadata",
        "shutdown",
    } <= set(inner.calls)
    assert vk.KVWireConnector.requires_piecewise_for_cudagraph({"kvwire": opts()}) is False


@pytest.mark.parametrize("forward", [True, False])
def test_worker_events_are_published_and_optionally_forwarded(vk, sink, forward):
    c = vk.KVWireConnector(vllm_config(opts(forward_events_to_vllm=forward)), vk.Role.WORKER, None, sink=sink)
    c.inner.store(stored_event(vk.ev, 0), stored_event(vk.ev, 1))
    out = c.get_kv_connector_kv_cache_events()
    assert (out is not None) == forward
    if forward:
        assert len(out.get_all_events()) == 2
    got = sink.events()
    assert [e.block_hashes for e in got] == [(BIG,), (BIG - 1,)]
    assert got[1].parent_block_hash == BIG and got[0].medium == "CPU"
    assert c.get_kv_connector_kv_cache_events() is None  # nothing new: nothing published
    assert len(sink.records) == 1


@pytest.mark.parametrize("forward", [True, False])
def test_events_carried_in_worker_metadata(vk, sink, forward):
    c = vk.KVWireConnector(vllm_config(opts(forward_events_to_vllm=forward)), vk.Role.WORKER, None, sink=sink)
    c.inner.meta_events = [stored_event(vk.ev, 3)]
    meta = c.build_connector_worker_meta()
    assert meta.other == "inner's own data"
    assert (meta.kv_cache_events is not None) == forward
    assert [e.block_hashes for e in sink.events()] == [(BIG - 3,)]


def test_publishing_never_raises_into_the_engine(vk):
    class Broken:
        def publish(self, *a, **k):
            raise RuntimeError("kafka on fire")

    c = vk.KVWireConnector(vllm_config(opts()), vk.Role.WORKER, None, sink=Broken())
    c.inner.store(stored_event(vk.ev, 0))
    assert c.get_kv_connector_kv_cache_events() is not None
    c.inner.store(object())  # not an event at all
    c.get_kv_connector_kv_cache_events()
    # Both losses were reported as gaps (this sink breaks on that too: counted, never raised).
    assert c.gaps_reported == 2 and c.publish_errors >= 2


def test_worker_identity_from_parallel_config(vk):
    from kvwire.producer.connector import worker_identity

    w = worker_identity(vllm_config(opts(), tp_size=4, dp_rank=2, rank=6), "inst", "m")
    assert (w.instance_id, w.dp_rank, w.tp_rank, w.tp_size, w.model) == ("inst", 2, 2, 4, "m")


def test_scheduler_role_starts_no_publisher(vk):
    c = vk.KVWireConnector(vllm_config(opts()), vk.Role.SCHEDULER, None)
    assert c._publisher is None and c._stream is None


@pytest.mark.integration
def test_connector_to_kafka(vk, h, kafka_bootstrap, topic_name):
    """The production path: WORKER role builds its own KafkaPublisher from kvwire options."""
    cfg = vllm_config(
        opts(bootstrap_servers=kafka_bootstrap, topic=topic_name, partitions=1, model="tiny"), tp_size=2, rank=1
    )
    c = vk.KVWireConnector(cfg, vk.Role.WORKER, None)
    assert c._stream is not None, c.last_error
    sent = [stored_event(vk.ev, i) for i in range(4)]
    c.inner.store(*sent[:2])
    c.get_kv_connector_kv_cache_events()
    c.inner.store(*sent[2:])
    c.get_kv_connector_kv_cache_events()
    c.shutdown()
    recs = h.read_batches(kafka_bootstrap, topic_name, lambda bs: sum(len(b.events) for b in bs) >= 4)
    batches = [b for _, b in recs]
    assert batches[0].reset and sum(b.gap for b in batches) == 0
    w = batches[0].worker
    assert (w.instance_id, w.dp_rank, w.tp_rank, w.tp_size, w.model) == ("vllm-x", 0, 1, 2, "tiny")
    from kvwire.producer.vllm_wire import event_from_object

    assert [e for b in batches for e in b.events] == [event_from_object(e) for e in sent]
    assert c.publish_errors == 0 and c.published_events == 4


# ------------------------------------------------------------------ capabilities vLLM probes


def test_hma_is_visible_exactly_when_the_inner_has_it(vk):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    hma = opts(inner_connector="HMAInner")
    # vLLM's config-time probe: the class named in --kv-transfer-config decides.
    assert KVConnectorFactory.supports_hma_config(vllm_config(hma, connector="KVWireHMAConnector").kv_transfer_config)
    assert not KVConnectorFactory.supports_hma_config(vllm_config(opts()).kv_transfer_config)
    # The runtime probe (the scheduler's isinstance) sees the inner's capability whatever the name.
    for name in ("KVWireConnector", "KVWireHMAConnector"):
        from kvwire.producer import connector as mod

        c = getattr(mod, name)(vllm_config(hma, connector=name), vk.Role.SCHEDULER, None)
        assert supports_hma(c)
        assert c.request_finished_all_groups(None, ([1], [2])) == (True, {"groups": 2})
        assert "request_finished_all_groups" in c.inner.calls or isinstance(c.inner, HMAInner)
    plain = vk.KVWireConnector(vllm_config(opts()), vk.Role.SCHEDULER, None)
    assert not supports_hma(plain) and not hasattr(plain, "request_finished_all_groups")
    from kvwire.producer.connector import KVWireHMAConnector

    with pytest.raises(ValueError, match="does not support"):
        KVWireHMAConnector(vllm_config(opts(), connector="KVWireHMAConnector"), vk.Role.SCHEDULER, None)


def test_vllm_finds_connectors_inside_the_wrapper(vk):
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
        _find_simple_cpu_offload_connector,
    )

    c = vk.KVWireConnector(vllm_config(opts()), vk.Role.SCHEDULER, None)
    assert c._connectors == [c.inner]
    assert _find_simple_cpu_offload_connector(c) is None  # walks into the inner, finds no offloader


# ------------------------------------------------------------------ losses are gaps (issue 14)


class FailingOnce:
    """The real RankStream, except that one publish() of events raises (a broken sink)."""

    def __init__(self, stream):
        self.stream, self.armed = stream, False

    def publish(self, events, engine_ts=None):
        if self.armed and events:
            self.armed = False
            raise RuntimeError("publish broke")
        return self.stream.publish(events, engine_ts)

    def report_gap(self, n):
        self.stream.report_gap(n)

    def new_epoch(self):
        self.stream.new_epoch()


@pytest.mark.integration
@pytest.mark.parametrize("failure", ["unconvertible", "publish"])
def test_lost_events_distrust_the_worker(vk, h, kafka_bootstrap, new_topic, index_reader, failure):
    """An event the connector cannot convert, or a batch whose publishing fails, is a gap:
    the index stops crediting the worker instead of missing what was lost."""
    topic = new_topic()
    c = vk.KVWireConnector(
        vllm_config(opts(instance_id=f"vllm-{failure}", bootstrap_servers=kafka_bootstrap, topic=topic)),
        vk.Role.WORKER,
        None,
    )
    assert c._stream is not None, c.last_error
    stream, worker = c._stream, (f"vllm-{failure}", 0)
    reader = index_reader(topic)
    try:
        c.inner.store(stored_event(vk.ev, 0), stored_event(vk.ev, 1))
        c.get_kv_connector_kv_cache_events()
        reader.catch_up(stream)
        tokens = list(range(32))
        assert reader.trusted(worker) and reader.credit(worker, tokens) == 32
        if failure == "unconvertible":
            c.inner.store(stored_event(vk.ev, 2), object())
        else:
            c._stream = FailingOnce(stream)
            c._stream.armed = True
            c.inner.store(stored_event(vk.ev, 2))
        c.get_kv_connector_kv_cache_events()
        reader.catch_up(stream)
        assert c.gaps_reported == 1
        assert not reader.trusted(worker) and reader.credit(worker, tokens) == 0
    finally:
        c.shutdown()


@pytest.mark.parametrize("name", ["LMCacheConnectorV1", "ExampleConnector"])
def test_documented_inner_connectors_load_from_the_extras(vk, name):
    """The README's inner connectors resolve through vLLM's registry with only the vllm/lmcache
    extras installed (LMCacheConnectorV1 imports uvicorn, ExampleConnector einops)."""
    from kvwire.producer.connector import resolve_inner_class

    assert resolve_inner_class({"inner_connector": name}).__name__ == name
