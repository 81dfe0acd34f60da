"""kvwire: LLM KV-cache events on Kafka."""

__version__ = "0.1.0"
