"""How many brokers a cluster has, a broker that is down included (DescribeCluster v2, KIP-1073).

Metadata (what aiokafka's ``describe_cluster`` sends) lists only brokers that are up and
unfenced, so counting it while one broker restarts gives two brokers of three. A KRaft cluster
keeps every broker registered until an operator unregisters it; DescribeCluster v2 with
IncludeFencedBrokers lists the fenced ones too. aiokafka has no DescribeCluster request: the
two structs below are its wire schema (request and response v2, flexible versions).
"""

from __future__ import annotations

from typing import Any

from aiokafka.errors import IncompatibleBrokerVersion, for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    Boolean,
    CompactArray,
    CompactString,
    Int8,
    Int16,
    Int32,
    Schema,
    TaggedFields,
)

API_KEY = 60
ENDPOINT_BROKERS = 1


class DescribeClusterResponse_v2(Response):
    API_KEY = API_KEY
    API_VERSION = 2
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("error_code", Int16),
        ("error_message", CompactString("utf-8")),
        ("endpoint_type", Int8),
        ("cluster_id", CompactString("utf-8")),
        ("controller_id", Int32),
        (
            "brokers",
            CompactArray(
                ("broker_id", Int32),
                ("host", CompactString("utf-8")),
                ("port", Int32),
                ("rack", CompactString("utf-8")),
                ("is_fenced", Boolean),
                ("tags", TaggedFields),
            ),
        ),
        ("cluster_authorized_operations", Int32),
        ("tags", TaggedFields),
    )


class DescribeClusterRequest_v2(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = API_KEY
    API_VERSION = 2
    RESPONSE_TYPE = DescribeClusterResponse_v2
    SCHEMA = Schema(
        ("include_cluster_authorized_operations", Boolean),
        ("endpoint_type", Int8),
        ("include_fenced_brokers", Boolean),
        ("tags", TaggedFields),
    )


class DescribeClusterRequest(Request[DescribeClusterRequest_v2]):
    API_KEY = API_KEY

    def build(self, request_struct_class: type[DescribeClusterRequest_v2]) -> DescribeClusterRequest_v2:
        return request_struct_class(False, ENDPOINT_BROKERS, True, {})


async def registered_brokers(admin: Any) -> dict[int, bool] | None:
    """broker id -> fenced, for every broker registered with the cluster; None when the brokers
    do not speak DescribeCluster v2 (before Kafka 4.0), so the caller falls back to Metadata."""
    try:
        resp = await admin._send_request(DescribeClusterRequest())
    except (IncompatibleBrokerVersion, NotImplementedError):
        return None
    obj = resp.to_object()
    if obj["error_code"]:
        raise for_code(obj["error_code"])(obj["error_message"] or "DescribeCluster failed")
    return {b["broker_id"]: bool(b["is_fenced"]) for b in obj["brokers"]}
