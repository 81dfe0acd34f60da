"""Moving a consumer to a partition's first offset, or past its last.

aiokafka (0.14) resets a position (``seek_to_beginning``, ``seek_to_end``, ``auto_offset_reset``)
by asking the partition's leader as its client last heard of it. When that broker answers
NOT_LEADER_OR_FOLLOWER the reset waits and asks the same broker again, without refreshing
metadata (the Java consumer had the same bug, KAFKA-9535). After a leadership move such a reset
loops until the client's next periodic refresh, 5 minutes by default: a rolling restart's
leader moves stalled the fault suite's log reader that long. ``beginning_offsets`` and
``end_offsets`` refresh metadata on that error and retry, so kvwire looks the offsets up and
seeks to them.
"""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, TopicPartition


async def seek_to_beginning(consumer: AIOKafkaConsumer, *tps: TopicPartition) -> dict[TopicPartition, int]:
    """Each partition's first offset, sought to; returned."""
    offsets: dict[TopicPartition, int] = await consumer.beginning_offsets(list(tps)) if tps else {}
    for tp, offset in offsets.items():
        consumer.seek(tp, offset)
    return offsets


async def seek_to_end(consumer: AIOKafkaConsumer, *tps: TopicPartition) -> dict[TopicPartition, int]:
    """Each partition's end offset (the next record's), sought to; returned."""
    offsets: dict[TopicPartition, int] = await consumer.end_offsets(list(tps)) if tps else {}
    for tp, offset in offsets.items():
        consumer.seek(tp, offset)
    return offsets


__all__ = ["seek_to_beginning", "seek_to_end"]
