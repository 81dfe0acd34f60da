# Typed surface of the Rust extension (rust/src/lib.rs). Keep in step with the #[pyfunction]s there.
# The index engineer's half (rust/src/py_index.rs) adds its own names below the decoder's.

from kvwire.schemas.events import EventBatch

__version__: str

# ---------------------------------------------------------------- decoder (rust/src/decode/)

# {writer schema version: its CRC-64-AVRO fingerprint as framed on the wire} for every version the
# fast path is specialised to.
FINGERPRINTS: dict[int, bytes]

def decode_record(value: object, /) -> EventBatch | None:
    """The record as codec.decode gives it, or None when the fast path declines it."""

def decline_reason(value: object, /) -> str | None:
    """Why the fast path declines a value; None when it decodes it."""

def decode_many(values: list[bytes], /) -> tuple[int, int, list[int]]:
    """Decode to Rust records and drop them: (records decoded, their blocks, indices declined)."""
