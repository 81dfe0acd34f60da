"""kvwire's consumer defaults: every consumer refreshes metadata far sooner than aiokafka's
default unless the user's client options say otherwise (a stale leader then costs a position
reset seconds, not minutes: kafka/positions.py)."""

from __future__ import annotations

import inspect

from aiokafka import AIOKafkaConsumer

from kvwire.kafka.options import CONSUMER_METADATA_MAX_AGE_MS, consumer_options


def test_a_consumer_refreshes_metadata_far_sooner_than_aiokafkas_default():
    aiokafka_default = inspect.signature(AIOKafkaConsumer).parameters["metadata_max_age_ms"].default
    assert aiokafka_default >= CONSUMER_METADATA_MAX_AGE_MS * 60
    assert consumer_options() == {"metadata_max_age_ms": CONSUMER_METADATA_MAX_AGE_MS}
    assert consumer_options({"client_id": "x"}) == {
        "metadata_max_age_ms": CONSUMER_METADATA_MAX_AGE_MS,
        "client_id": "x",
    }


def test_the_users_metadata_max_age_wins():
    opts = {"metadata_max_age_ms": 60000, "security_protocol": "SSL"}
    assert consumer_options(opts) == opts
    assert opts == {"metadata_max_age_ms": 60000, "security_protocol": "SSL"}  # not mutated
