"""Kafka's default key partitioner, bit for bit.

Java's ``BuiltInPartitioner`` and librdkafka's ``murmur2_random`` both place a
keyed record at ``toPositive(murmur2(key)) % numPartitions``. kvwire computes
the partition itself so a consumer, a replay tool or a Java service can tell
which partition holds a worker without asking a producer.
"""

from __future__ import annotations

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka ``Utils.murmur2``: returns the signed 32-bit int Java returns."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    n4 = length & ~3
    for i in range(0, n4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    rest = length & 3
    if rest == 3:
        h ^= data[n4 + 2] << 16
    if rest >= 2:
        h ^= data[n4 + 1] << 8
    if rest >= 1:
        h ^= data[n4]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def default_partition(key: bytes, num_partitions: int) -> int:
    """The partition Kafka's default partitioner picks for ``key``."""
    if num_partitions <= 0:
        raise ValueError(f"num_partitions must be positive, got {num_partitions}")
    # Java's toPositive is `& 0x7fffffff`, not abs(): the two differ for negatives.
    return (murmur2(key) & 0x7FFFFFFF) % num_partitions
