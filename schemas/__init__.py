"""The kvwire contract: Avro schemas (``avro/*.avsc``), the typed event model and the codec."""

from .codec import CONTENT_TYPE, CURRENT, VERSIONS, CodecError, DecodeError, EncodeError, decode, encode
from .events import (
    CPU,
    GPU,
    STORAGE,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    WorkerId,
    stored,
    token_array,
)

__all__ = [
    "CONTENT_TYPE",
    "CPU",
    "CURRENT",
    "GPU",
    "STORAGE",
    "VERSIONS",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "CodecError",
    "DecodeError",
    "EncodeError",
    "EventBatch",
    "KVEvent",
    "WorkerId",
    "decode",
    "encode",
    "stored",
    "token_array",
]
