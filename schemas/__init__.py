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
    "AllBlocksCleared", "BlockHash", "BlockRemoved", "BlockStored", "CONTENT_TYPE", "CPU", "CURRENT",
    "CodecError", "DecodeError", "EncodeError", "EventBatch", "GPU", "KVEvent", "STORAGE", "VERSIONS",
    "WorkerId", "decode", "encode", "stored", "token_array",
]
