"""``KVWireConnector``: a vLLM KV connector that wraps another one and puts its
worker-side KV events on Kafka, one stream per TP rank.

Why a wrapper: vLLM's own event path aggregates worker events across TP ranks
and keeps only those *every* rank reported identically in the same step
(``KVEventAggregator``), and ``--kv-events-config`` accepts no publisher but
"zmq". Publishing per rank from the worker, keyed by (instance, dp rank), lets
the index do the TP aggregation itself, over time instead of per step.

Every ``KVConnectorBase_V1`` method is delegated unchanged to the inner
connector (explicitly below, and ``__getattr__`` for connector-specific extras).
Only two are observed: ``get_kv_connector_kv_cache_events`` and
``build_connector_worker_meta`` (for connectors that carry events in worker
metadata, vLLM PR #34522's ``kv_cache_events`` attribute). With
``forward_events_to_vllm`` false the wrapper keeps those events from vLLM's own
event path.

Configuration (``kv_connector_extra_config["kvwire"]``): bootstrap_servers, topic,
instance_id, inner_connector (default "LMCacheConnectorV1"), inner_module_path
(None = vLLM's registry), forward_events_to_vllm (default true), partitions,
partition, model, repair_lmcache_events (default: inner is an LMCache connector),
publisher (extra PublisherConfig fields), kafka_config (a Kafka client properties file) and
kafka_properties (standard Kafka client property names; see kvwire.kafka.options, which also reads
the environment), framing ("single-object" by default, or "confluent") and
schema_registry_url (for "confluent"; default $KVWIRE_SCHEMA_REGISTRY_URL).

Engine thread is sacred: publishing goes through the never-blocking publisher
and every kvwire step is wrapped so a failure is counted, never raised.
vLLM and torch are imported by vLLM before this module is ever loaded.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)

log = logging.getLogger(__name__)

DEFAULT_INNER = "LMCacheConnectorV1"


def kvwire_options(extra_config: dict | None) -> dict:
    opts = (extra_config or {}).get("kvwire") or {}
    if not isinstance(opts, dict):
        raise ValueError("kv_connector_extra_config['kvwire'] must be an object")
    return opts


def resolve_inner_class(opts: dict) -> Any:
    name = opts.get("inner_connector") or DEFAULT_INNER
    module_path = opts.get("inner_module_path")
    if module_path:
        return getattr(importlib.import_module(module_path), name)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return KVConnectorFactory.get_connector_class_by_name(name)


def _inner_vllm_config(vllm_config: Any, opts: dict) -> Any:
    """The config the inner connector sees: itself as the configured connector.

    Connectors may read ``kv_transfer_config.kv_connector`` to find themselves;
    everything else, extra config included, is shared unchanged.
    """
    ktc = vllm_config.kv_transfer_config
    try:
        inner_ktc = dataclasses.replace(
            ktc,
            kv_connector=opts.get("inner_connector") or DEFAULT_INNER,
            kv_connector_module_path=opts.get("inner_module_path"),
        )
        cfg = copy.copy(vllm_config)
        object.__setattr__(cfg, "kv_transfer_config", inner_ktc)
        return cfg
    except Exception as e:  # an unusual config type: the shared one is still usable
        log.debug("inner connector shares the wrapper's config: %s", e)
        return vllm_config


def worker_identity(vllm_config: Any, instance_id: str, model: str | None = None):
    """(instance, dp rank, tp rank, tp size) of the worker running this code."""
    from kvwire.schemas.events import WorkerId

    pc = vllm_config.parallel_config
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    dp_rank = int(getattr(pc, "data_parallel_rank", 0) or 0)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = int(get_tensor_model_parallel_rank())
    except Exception:
        # Distributed state not initialised (e.g. a single-process test):
        # a worker's global rank within its DP group, TP innermost.
        tp_rank = int(getattr(pc, "rank", 0) or 0) % tp_size
    if model is None:
        mc = getattr(vllm_config, "model_config", None)
        served = getattr(mc, "served_model_name", None) if mc is not None else None
        if isinstance(served, (list, tuple)):
            served = served[0] if served else None
        model = served or (getattr(mc, "model", "") if mc is not None else "") or ""
    return WorkerId(instance_id, dp_rank, tp_rank, tp_size, str(model))


class KVWireConnector(KVConnectorBase_V1):
    # Set by the first instance in this process: the class-level hooks vLLM calls
    # without a config (build_kv_connector_stats) then reach the right inner class.
    _inner_cls_hint: Any = None

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any, *, sink: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        opts = kvwire_options(self._kv_transfer_config.kv_connector_extra_config)
        self._opts = opts
        inner_cls = resolve_inner_class(opts)
        KVWireConnector._inner_cls_hint = inner_cls
        self._inner = inner_cls(_inner_vllm_config(vllm_config, opts), role, kv_cache_config)
        self._match_capabilities(inner_cls)
        self._forward = bool(opts.get("forward_events_to_vllm", True))
        self.published_events = 0
        self.publish_errors = 0
        self.gaps_reported = 0
        self.last_error = ""
        self._publisher: Any = None
        self._stream = sink  # tests hand in a sink; production builds one lazily
        self._repair = None
        self._membership = None
        # The record's `source`: "/approximate" when removals cannot be seen (see README).
        self.source = "vllm-connector"
        if opts.get("repair_lmcache_events", "LMCache" in inner_cls.__name__):
            from .lmcache_source import LMCacheRepair, Membership, RemovalObserver, engine_chunk_hasher

            # LMCacheConnectorV1 keeps the LMCacheEngine's events' defects; the
            # engine's hasher verifies parent repairs when it is reachable.
            eng = getattr(getattr(self._inner, "_lmcache_engine", None), "lmcache_engine", None)
            self._repair = LMCacheRepair(engine_chunk_hasher(eng) if eng is not None else None)
            # LMCache emits stores only: its own inserts and evictions are observed on the engine
            # (the worker's), as LMCacheSource does, or the worker is published as approximate.
            exact = False
            if eng is not None and role == KVConnectorRole.WORKER and opts.get("observe_removals", True):
                try:
                    obs = RemovalObserver(eng)
                    if obs.hooked:
                        self._membership = Membership(obs)
                        exact = obs.exact
                except Exception as e:
                    self._fail(e)
            if not exact:
                self.source = "vllm-connector/approximate"
        if role == KVConnectorRole.WORKER and self._stream is None:
            self._start_publisher(vllm_config)

    def _match_capabilities(self, inner_cls: type) -> None:
        """Declare exactly the optional capabilities (vLLM's mixins) the inner connector has."""
        if supports_hma(inner_cls) and not isinstance(self, SupportsHMA):
            # vLLM's config-time probe reads the class named in --kv-transfer-config before any
            # inner exists, so it saw no HMA and turned the hybrid KV cache manager off; the
            # scheduler's runtime probe (isinstance) sees the capability from here on.
            self.__class__ = KVWireHMAConnector
            log.warning(
                "kvwire: %s supports the hybrid KV cache manager (HMA), which vLLM turned off because it "
                "was configured with KVWireConnector; name KVWireHMAConnector to keep it on",
                inner_cls.__name__,
            )
        elif isinstance(self, SupportsHMA) and not supports_hma(inner_cls):
            raise ValueError(
                f"{inner_cls.__name__} does not support the hybrid KV cache manager (HMA): configure "
                "KVWireConnector instead of KVWireHMAConnector"
            )

    # ------------------------------------------------------------ kvwire side

    def _start_publisher(self, vllm_config: Any) -> None:
        try:
            from kvwire.kafka.options import connector_client_options

            from .publisher import KafkaPublisher, PublisherConfig

            o = self._opts
            worker = worker_identity(vllm_config, str(o["instance_id"]), o.get("model"))
            cfg = PublisherConfig(
                bootstrap_servers=o.get("bootstrap_servers", PublisherConfig.bootstrap_servers),
                topic=o.get("topic", PublisherConfig.topic),
                partitions=int(o.get("partitions", PublisherConfig.partitions)),
                partition=o.get("partition"),
                **{
                    "framing": o.get("framing", PublisherConfig.framing),
                    "schema_registry_url": o.get("schema_registry_url"),
                    **(o.get("publisher") or {}),
                    "client_options": connector_client_options(o),
                },
            )
            self._publisher = KafkaPublisher(cfg)
            self._stream = self._publisher.stream(worker, source=self.source)
            log.info("kvwire: publishing %s events as %s to %s", type(self._inner).__name__, worker, cfg.topic)
        except Exception as e:
            # No Kafka must never mean no inference.
            self._fail(e)
            log.error("kvwire: publisher not started, events are not published: %s", e)

    def _fail(self, e: BaseException) -> None:
        self.publish_errors += 1
        self.last_error = f"{type(e).__name__}: {e}"

    def _publish(self, raw_events: Iterable[Any]) -> None:
        # Every event that does not reach the stream is a gap on it: the index must stop
        # crediting this rank rather than miss a removal silently.
        if self._stream is None:
            return
        try:
            raw = list(raw_events)
            if not raw and self._membership is None:
                return
            lost = 0
            if self._repair is not None:
                before = self._repair.stats.bad_events
                events = self._repair.convert(raw)
                lost = self._repair.stats.bad_events - before
            else:
                from .vllm_wire import WireError, event_from_object

                events = []
                for r in raw:
                    try:
                        events.append(event_from_object(r))
                    except WireError as e:
                        self._fail(e)
                        lost += 1
            why = f"{lost} event(s) could not be converted"
            if self._membership is not None:
                events, unmatched = self._membership.apply(events)
                if unmatched:
                    lost += unmatched
                    why += f", {unmatched} inserted chunk(s) without a store event"
            if lost:
                self._lost(why)
            if events and self._stream.publish(events, engine_ts=time.time()):
                self.published_events += len(events)
        except Exception as e:
            self._fail(e)
            self._lost(f"batch dropped: {type(e).__name__}: {e}")

    def _lost(self, why: str) -> None:
        self.gaps_reported += 1
        log.warning("kvwire: %s; reported as a gap", why)
        try:
            self._stream.report_gap(1)
        except Exception as e:
            self._fail(e)
        try:
            self._stream.publish((), engine_ts=time.time())
        except Exception as e:
            self._fail(e)

    @property
    def inner(self) -> KVConnectorBase_V1:
        return self._inner

    @property
    def _connectors(self) -> list[KVConnectorBase_V1]:
        # vLLM finds connectors inside wrappers through `_connectors` (MultiConnector's children,
        # e.g. the worker's search for a SimpleCPUOffloadConnector): the inner is our only child.
        return [self._inner]

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the wrapper lacks: connector-specific extras.
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    # ------------------------------------------------------------ observed methods

    def get_kv_connector_kv_cache_events(self):
        ev = self._inner.get_kv_connector_kv_cache_events()
        if ev is not None or self._membership is not None:
            try:
                # With no new events an eviction or removal may still be waiting to go out.
                self._publish(ev.get_all_events() if ev is not None else ())
            except Exception as e:
                self._fail(e)
        return ev if self._forward else None

    def build_connector_worker_meta(self):
        meta = self._inner.build_connector_worker_meta()
        if meta is None:
            return None
        try:
            carried = getattr(meta, "kv_cache_events", None)
            if carried is not None:
                self._publish(carried.get_all_events() if hasattr(carried, "get_all_events") else carried)
                if not self._forward:
                    meta = copy.copy(meta)
                    meta.kv_cache_events = None
        except Exception as e:
            self._fail(e)
        return meta

    def shutdown(self):
        try:
            return self._inner.shutdown()
        finally:
            if self._publisher is not None:
                try:
                    self._publisher.close(timeout=5.0)
                except Exception as e:
                    self._fail(e)

    # ------------------------------------------------------------ plain delegation

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        return self._inner.supports_divergent_local_hybrid_hits

    @property
    def requires_kv_delivery(self) -> bool:
        return self._inner.requires_kv_delivery

    @property
    def role(self) -> KVConnectorRole:
        return self._inner.role

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return resolve_inner_class(kvwire_options(kv_transfer_config.kv_connector_extra_config)).supports_sleep_mode(
            kv_transfer_config
        )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        ktc = vllm_config.kv_transfer_config
        inner = resolve_inner_class(kvwire_options(ktc.kv_connector_extra_config if ktc else None))
        return inner.get_required_kvcache_layout(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return resolve_inner_class(kvwire_options(extra_config)).requires_piecewise_for_cudagraph(extra_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        inner = cls._inner_cls_hint
        return inner.build_kv_connector_stats(data) if inner is not None else None

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        ktc = vllm_config.kv_transfer_config
        inner = resolve_inner_class(kvwire_options(ktc.kv_connector_extra_config if ktc else None))
        return inner.build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # worker side
    def get_mem_pool_context(self):
        return self._inner.get_mem_pool_context()

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._inner.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._inner.clear_connector_metadata()

    def _get_connector_metadata(self):
        return self._inner._get_connector_metadata()

    def has_connector_metadata(self) -> bool:
        return self._inner.has_connector_metadata()

    def register_kv_caches(self, kv_caches):
        return self._inner.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        return self._inner.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        return self._inner.restore_kv_caches()

    def set_host_xfer_buffer_ops(self, copy_operation):
        return self._inner.set_host_xfer_buffer_ops(copy_operation)

    def finish_forward(self) -> None:
        return self._inner.finish_forward()

    def reset_capture_state(self) -> None:
        return self._inner.reset_capture_state()

    def handle_preemptions(self, kv_connector_metadata):
        return self._inner.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        return self._inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return self._inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return self._inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        return self._inner.wait_for_save()

    def get_finished(self, finished_req_ids):
        return self._inner.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids):
        return self._inner.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._inner.get_block_ids_with_load_errors()

    def get_kv_connector_stats(self):
        return self._inner.get_kv_connector_stats()

    def get_handshake_metadata(self):
        return self._inner.get_handshake_metadata()

    # scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_cache_manager = kv_cache_manager
        return self._inner.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool) -> None:
        return self._inner.bind_gpu_block_pool(gpu_block_pool)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return self._inner.get_loaded_kv_cache_group_ids(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self._inner.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        return self._inner.get_external_cache_hit_sources(request, num_external_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        return self._inner.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self._inner.build_connector_meta(scheduler_output)

    def on_new_request(self, request) -> None:
        return self._inner.on_new_request(request)

    def update_connector_output(self, connector_output):
        return self._inner.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self._inner.request_finished(request, block_ids)

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads) -> bool:
        return self._inner.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    def take_events(self):
        return self._inner.take_events()

    def has_pending_block_frees(self) -> bool:
        return self._inner.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self._inner.has_pending_push_work()

    def get_finished_count(self) -> int | None:
        return self._inner.get_finished_count()

    def set_xfer_handshake_metadata(self, metadata) -> None:
        return self._inner.set_xfer_handshake_metadata(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata) -> None:
        return self._inner.set_xfer_handshake_metadata_pp_aware(metadata)

    def reset_cache(self) -> bool | None:
        return self._inner.reset_cache()


class KVWireHMAConnector(KVWireConnector, SupportsHMA):
    """KVWireConnector around an inner connector that supports vLLM's hybrid KV cache manager.

    vLLM decides HMA at config time from the class named in ``--kv-transfer-config``
    (``KVConnectorFactory.supports_hma_config``), before any connector exists, so a wrapper
    cannot inherit it from its inner there: name this class to keep HMA on. Constructing it
    around an inner without HMA is an error, like vLLM's own check."""

    def request_finished_all_groups(self, request, block_ids):
        return self._inner.request_finished_all_groups(request, block_ids)


__all__ = ["KVWireConnector", "KVWireHMAConnector", "kvwire_options", "resolve_inner_class", "worker_identity"]
