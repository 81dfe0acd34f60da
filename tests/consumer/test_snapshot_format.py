"""Snapshot container: versioned, checksummed, never trusted when damaged."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.consumer.snapshot import RankRecord, SnapshotBody, SnapshotError, decode_snapshot, encode_snapshot


def body(index=b"\x01\x02" * 1000):
    r = RankRecord("w", 0, 1, 2, -7, 41, False, "gap", 123, [5, 6], 42, 1)
    return SnapshotBody("topic", 3, 1000, 99, [r], index)


@pytest.mark.parametrize("compress", [True, False])
def test_round_trip(compress):
    b = body()
    assert decode_snapshot(encode_snapshot(b, compress=compress)) == b


def test_every_single_byte_flip_is_rejected():
    data = bytearray(encode_snapshot(body(b"abc" * 50)))
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x40
        with pytest.raises(SnapshotError):
            decode_snapshot(bytes(bad))


def test_version_and_truncation_are_rejected():
    data = encode_snapshot(body())
    with pytest.raises(SnapshotError, match="version"):
        decode_snapshot(data[:4] + b"\x09\x00" + data[6:])
    for cut in (0, 5, 27, len(data) - 1):
        with pytest.raises(SnapshotError):
            decode_snapshot(data[:cut])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_are_rejected(data):
    with pytest.raises(SnapshotError):
        decode_snapshot(data)
