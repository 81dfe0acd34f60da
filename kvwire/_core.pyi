# Typed surface of the Rust extension (rust/src/lib.rs). Keep in step with the #[pyfunction]s there.
# The index engineer's half (rust/src/py_index.rs) adds its own names below the decoder's.

import enum
from typing import Any, Literal, final, overload

import numpy as np

from kvwire.schemas.events import EventBatch

__version__: str

# ---------------------------------------------------------------- decoder (rust/src/decode/) and encoder (rust/src/encode/)

# {writer schema version: its CRC-64-AVRO fingerprint as framed on the wire} for every version the
# fast path is specialised to.
FINGERPRINTS: dict[int, bytes]

def decode_record(value: object, /) -> EventBatch | None:
    """The record as codec.decode gives it, or None when the fast path declines it."""

def decline_reason(value: object, /) -> str | None:
    """Why the fast path declines a value; None when it decodes it."""

ENCODE_VERSION: int

def encode_record(header: bytes, record: dict[str, Any], /) -> bytes | None:
    """header + the record's body in schema version ENCODE_VERSION, from the dict
    codec.batch_to_record builds; None when the fast path declines its values."""

def encode_batch(header: bytes, batch: Any, /) -> bytes | None:
    """encode_record's bytes straight from an EventBatch; None when it declines the batch
    (hashes other than U64 ints, token ids not an array('I'), extra keys)."""

def pack_u64(hashes: Any, parent: Any = None, /) -> tuple[bytes, bytes | None] | None:
    """codec.pack_hashes' U64 case: every hash an int (or __index__) in [0, 2^64), the parent None
    or an int there -> (packed, packed parent); None otherwise."""

def decode_many(values: list[bytes], /) -> tuple[int, int, list[int]]:
    """Decode to Rust records and drop them: (records decoded, their blocks, indices declined)."""

# ---------------------------------------------------------------- index (rust/src/py_index.rs)
# Only kvwire.consumer.index calls these; its PrefixIndex is the typed API.

PARENT_MEMO: int  # removed engine hashes a worker remembers as parents (rust/src/index/memo.rs)

class ScoreQuery:
    """One score query: token ids the core hashes, or keys computed before. A ``block_size``
    (or ``tokens_per_key``) of 0 stands for every block size the index holds, read under the
    score's own lock."""

    @final
    class Tokens(ScoreQuery):
        tokens: Any
        block_size: int
        extra_keys: list[Any] | None
        lora_name: str | None
        def __init__(
            self, tokens: Any, block_size: int, extra_keys: list[Any] | None, lora_name: str | None
        ) -> None: ...

    @final
    class Keys(ScoreQuery):
        keys: Any
        tokens_per_key: int
        def __init__(self, keys: Any, tokens_per_key: int) -> None: ...

# A score's results, best first, as ``consumer.index.ScoreArrays``' fields in order: worker
# (u32 ids), matched_tokens (i64), score (f64), by_off (u32, one more than results), by_medium
# (u32 medium ids), by_tokens (i64).
ScoreResult = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]

@final
class StatsRow:
    """A worker's index statistics, the fields of ``consumer.index.WorkerStats``."""

    instance_id: str
    dp_rank: int
    tp_size: int
    ranks: int
    blocks: list[tuple[str, int]]
    entries: int
    orphans: int
    unknown_removes: int
    duplicate_stores: int

@final
class TableRow:
    """One exported table, a row of the snapshot blob's header."""

    instance_id: str
    dp_rank: int
    tp_size: int
    tp_rank: int
    medium: str
    group: int
    entries: int
    unknown_removes: int
    duplicate_stores: int

@final
class Exported:
    tables: list[TableRow]
    ehs: bytes  # u64 engine hashes, table after table
    keys: bytes  # u64 block keys
    metas: bytes  # u16 refcount|flags
    memos: list[tuple[str, int, int, int]]  # (instance_id, dp_rank, tp_size, entries) per worker with a memo
    memo_ehs: bytes  # u64 removed engine hashes, oldest first, worker after worker
    memo_keys: bytes  # u64 block keys
    memo_orphans: bytes  # u8 orphan flags (0 or 1)

@final
class GroupReach:
    """A KV-cache group and the blocks before a prefix's end it must hold (0: every block)."""

    instance_id: str
    dp_rank: int
    group: int
    tail: int

class Index:
    def __init__(
        self,
        weights: dict[str, float] | None = None,
        default_weight: float = 0.5,
        capacity: int = 0,
        holder_sets_at: int | None = None,
    ) -> None: ...
    def clear(self, inst: str, dp: int, tp_rank: int) -> None: ...
    def drop_rank(self, inst: str, dp: int, tp_rank: int) -> None: ...
    def drop_worker(self, inst: str, dp: int) -> None: ...
    @overload
    def score(
        self,
        queries: list[ScoreQuery],
        weights: dict[str, float] | None = None,
        workers: list[tuple[str, int]] | None = None,
        exclude: list[tuple[str, int]] | None = None,
        top_k: int | None = None,
        as_json: Literal[False] = False,
    ) -> ScoreResult: ...
    @overload
    def score(
        self,
        queries: list[ScoreQuery],
        weights: dict[str, float] | None,
        workers: list[tuple[str, int]] | None,
        exclude: list[tuple[str, int]] | None,
        top_k: int | None,
        as_json: Literal[True],
    ) -> bytes: ...
    def worker_names(self) -> list[tuple[str, int]]: ...
    def media(self) -> list[str]: ...
    def wm_names(self) -> list[tuple[str, int, str]]: ...
    def stats(self) -> list[StatsRow]: ...
    def score_media(
        self,
        queries: list[ScoreQuery],
        media: list[str],
        workers: list[tuple[str, int]] | None = None,
        top_k: int | None = None,
    ) -> ScoreResult: ...
    def holder_keys(self) -> tuple[bytes, bytes]: ...
    def worker_holding(self, inst: str, dp: int, keys: Any) -> tuple[bytes, bytes, bytes, bytes]: ...
    def worker_held(self, inst: str, dp: int) -> tuple[bytes, bytes, bytes]: ...
    def __len__(self) -> int: ...
    def entries(self) -> int: ...
    def nbytes(self) -> int: ...
    def unswept(self) -> tuple[int, int]: ...
    def block_sizes(self) -> list[int]: ...
    def add_block_sizes(self, sizes: list[int]) -> None: ...
    def has_blocks(self) -> bool: ...
    def export_groups(self, workers: list[tuple[str, int]]) -> list[GroupReach]: ...
    def import_group(self, inst: str, dp: int, group: int, tail: int) -> None: ...
    def digest(self, seeds: Any) -> tuple[int, int]: ...
    def export_workers(self, workers: list[tuple[str, int]]) -> Exported: ...
    def import_table(
        self,
        inst: str,
        dp: int,
        tp_size: int,
        tp_rank: int,
        medium: str,
        group: int,
        ehs: Any,
        keys: Any,
        metas: Any,
        unknown: int,
        dups: int,
    ) -> None: ...
    def import_memo(self, inst: str, dp: int, tp_size: int, ehs: Any, keys: Any, orphans: Any) -> None: ...

# ---------------------------------------------------------------- keys (rust/src/py_keys.rs)
# The one home of every key rule; kvwire.consumer.keys is the typed face.

ROOT: int
RETIRED_EPOCHS: int
ORPHAN_ROOT: int
ENGINE_NS: int

def xxh3_64(data: Any, seed: int = 0) -> int: ...
def chain_keys(tokens: Any, bs: int, n: int, parent: int, ctx: Any) -> bytes: ...
def sequence_keys(content: Any) -> bytes: ...
def block_keys(
    tokens: Any,
    block_size: int,
    parent: int = ...,
    lora_name: str | None = None,
    extra_keys: list[Any] | None = None,
    nblocks: int | None = None,
) -> bytes: ...
def block_contexts(lora_name: str | None, extra_keys: list[Any] | None, nblocks: int) -> bytes: ...
def context_seed(lora_name: str | None = None) -> int: ...
def canonical(value: Any) -> bytes: ...
def engine_hash(h: Any) -> int: ...
def engine_keys(hashes: Any) -> bytes: ...
def orphan_root(parent_hash: int) -> int: ...
def normalize_medium(medium: str | None = None) -> str: ...

# ---------------------------------------------------------------- the score lane's head (rust/src/score_head.rs)

def score_head(
    data: bytes, start: int, end: int, max_body: int, /
) -> tuple[int, bytes, bytes | None, bytes | None] | None: ...

# ---------------------------------------------------------------- the lane's plain request (rust/src/score_lane.rs)

def binary_body_refusal(length: int, max_tokens: int, /) -> tuple[int, str] | None: ...
def token_count_refusal(count: int, max_tokens: int, /) -> tuple[int, str] | None: ...
def score_plain(
    index: Index,
    fence: Fence,
    data: bytes,
    start: int,
    end: int,
    max_body: int,
    max_tokens: int,
    top_k: int,
    frame: tuple[bytes, bytes, bytes, bytes],
    /,
) -> tuple[bytes, int] | None: ...

# ---------------------------------------------------------------- fence and pipeline (rust/src/pipeline.rs)

# Enums defined in the core (pyo3's simple enums: == compares, a new object per value).
@final
class Verdict(enum.Enum):
    APPLY = 0
    RESET = 1
    DUPLICATE = 2
    STALE_EPOCH = 3
    @property
    def label(self) -> str: ...

@final
class ApplyStatus(enum.Enum):
    APPLIED = 0
    MALFORMED = 1
    OVERFLOW = 2

@final
class Tally:
    """What the records of one apply call did, for the counters."""

    records: int
    duplicates: int
    stale: int
    gaps: int
    resets: int
    blocks: int
    events: int
    max_lag_us: int | None
    def __init__(
        self,
        *,
        records: int = 0,
        duplicates: int = 0,
        stale: int = 0,
        gaps: int = 0,
        resets: int = 0,
        blocks: int = 0,
        events: int = 0,
        max_lag_us: int | None = None,
    ) -> None: ...

@final
class EventsApplied:
    """What ``apply_events`` did: the blocks its events named, or why it applied nothing."""

    status: ApplyStatus
    blocks: int
    message: str

@final
class DeadKind(enum.Enum):
    MALFORMED = 0
    OVERFLOW = 1

@final
class DeadRecord:
    """A record of an ``apply_poll`` call that goes to the dead-letter topic."""

    index: int
    kind: DeadKind
    message: str
    def __init__(self, index: int, kind: DeadKind, message: str) -> None: ...
    @property
    def reason(self) -> str:
        """The dead letter's reason: "apply failed: <error>: <message>"."""

@final
class Poll:
    """What one ``apply_poll`` call did; with ``declined``, ``records[next]`` was declined."""

    next: int
    declined: bool
    tally: Tally
    dead: list[DeadRecord]
    seen: list[tuple[str, int]]
    def __init__(
        self, *, next: int, declined: bool, tally: Tally, dead: list[DeadRecord], seen: list[tuple[str, int]]
    ) -> None: ...

@final
class RankRow:
    """One rank's fence state, the fields of ``consumer.rank_state.RankState``."""

    instance_id: str
    dp_rank: int
    tp_rank: int
    epoch: int
    last_seq: int
    trusted: bool
    untrusted_reason: str
    last_seen_us: int
    retired: list[int]
    records: int
    gaps: int
    approximate: bool
    model: str

class Fence:
    def __init__(self) -> None: ...
    def admit(self, batch: EventBatch) -> Verdict: ...
    def approximate_workers(self) -> list[tuple[str, int]]: ...
    def worker_trusted(self, inst: str, dp: int) -> bool: ...
    def untrusted_workers(self) -> list[tuple[str, int]]: ...
    def workers(self) -> list[tuple[str, int]]: ...
    def expired(self, now_us: int, timeout_us: int) -> list[tuple[str, int, int]]: ...
    def forget(self, inst: str, dp: int, tp_rank: int) -> None: ...
    def forget_worker(self, inst: str, dp: int) -> None: ...
    def state_known(self, inst: str, dp: int, tp_rank: int) -> None: ...
    def ranks(self) -> list[RankRow]: ...
    def tp_sizes(self) -> list[tuple[str, int, int]]: ...
    def restore(self, rank: tuple[str, int, int], tp_size: int, state: Any) -> None:
        """``state``: a ``kvwire.consumer.rank_state.RankState``."""

def apply_poll(
    index: Index,
    fence: Fence,
    records: list[Any],
    start: int,
    budget_us: int,
    now_us: int,
    schema_ids: dict[int, int] | None = None,
) -> Poll: ...
def apply_events(index: Index, value: bytes, atomic: bool) -> EventsApplied: ...
def score_trusted(
    index: Index, fence: Fence, queries: list[ScoreQuery], top_k: int | None = None, as_json: bool = True
) -> Any: ...
