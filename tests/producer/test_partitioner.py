"""Kafka's default partitioner, checked against Kafka's own vectors and aiokafka."""

from __future__ import annotations

import random

import pytest
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.partitioner import murmur2 as aiokafka_murmur2

from kvwire.producer.partitioner import default_partition, murmur2

# org.apache.kafka.common.utils.UtilsTest#testMurmur2
JAVA_VECTORS = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.mark.parametrize("key,expected", JAVA_VECTORS.items())
def test_java_vectors(key, expected):
    assert murmur2(key) == expected


def test_matches_aiokafka_for_every_tail_length():
    rng = random.Random(0)
    for n in range(200):
        data = rng.randbytes(n % 37)
        # aiokafka returns the same 32 bits, unsigned.
        assert murmur2(data) & 0xFFFFFFFF == aiokafka_murmur2(data) & 0xFFFFFFFF


def test_default_partition_matches_kafka_default_partitioner():
    parts = list(range(12))
    for i in range(500):
        key = f"instance-{i}/{i % 4}".encode()
        assert default_partition(key, 12) == DefaultPartitioner()(key, parts, parts)


def test_to_positive_is_a_mask_not_abs():
    # murmur2(b"21") is negative: abs() would pick another partition than Java's toPositive().
    assert default_partition(b"21", 1000) == (-973932308 & 0x7FFFFFFF) % 1000 != abs(-973932308) % 1000


def test_rejects_no_partitions():
    with pytest.raises(ValueError):
        default_partition(b"x", 0)
