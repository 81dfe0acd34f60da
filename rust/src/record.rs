//! The decoded record: what `decode::decode` hands the index.
//!
//! Everything variable-length borrows from the record's bytes, so decoding a
//! record allocates only its event list (and extra keys, when a record has
//! them). The packed forms stay packed: hashes and token ids are slices of the
//! wire bytes, already checked to divide evenly, so a consumer can hash or
//! index them without copying.

/// How `block_hashes` and `parent_block_hash` are packed (the Avro enum `HashKind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HashKind {
    /// 8-byte little-endian unsigned ints (vLLM's default hashes are often >= 2^63).
    U64,
    /// 8-byte little-endian signed ints (LMCache's Python hashes can be negative).
    I64,
    /// Raw digests of `width` bytes each.
    Digest,
}

/// One event's block hashes, packed back to back as on the wire.
///
/// Invariants the decoder guarantees: `width >= 1`; `width == 8` for `U64` and
/// `I64`; `packed.len() % width == 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hashes<'a> {
    pub kind: HashKind,
    pub width: usize,
    pub packed: &'a [u8],
}

impl<'a> Hashes<'a> {
    #[inline]
    pub fn len(&self) -> usize {
        self.packed.len() / self.width
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.packed.is_empty()
    }

    /// The `i`th hash's bytes (`width` of them). Panics if `i >= len()`.
    #[inline]
    pub fn get(&self, i: usize) -> &'a [u8] {
        &self.packed[i * self.width..(i + 1) * self.width]
    }

    /// Each hash's bytes, in chain order.
    #[inline]
    pub fn iter(&self) -> std::slice::ChunksExact<'a, u8> {
        self.packed.chunks_exact(self.width)
    }

    /// The `i`th hash as the 64 bits on the wire (U64 and I64: the value's
    /// two's-complement bits; cast to i64 for I64). Panics for `Digest` or `i >= len()`.
    #[inline]
    pub fn bits_at(&self, i: usize) -> u64 {
        assert!(self.kind != HashKind::Digest, "a digest hash is not 64 bits");
        u64::from_le_bytes(self.get(i).try_into().expect("width is 8"))
    }
}

/// A scalar extra hash key (one branch of the Avro union `null|boolean|long|double|string|bytes`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar<'a> {
    Null,
    Bool(bool),
    Long(i64),
    Double(f64),
    Str(&'a str),
    Bytes(&'a [u8]),
}

/// One extra hash key: a scalar, or a tuple of scalars (e.g. an `(mm identifier, offset)` pair).
#[derive(Clone, Debug, PartialEq)]
pub enum ExtraKey<'a> {
    Scalar(Scalar<'a>),
    Tuple(Vec<Scalar<'a>>),
}

/// Who emitted the batch (the Avro record `Worker`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Worker<'a> {
    pub instance_id: &'a str,
    pub model: &'a str,
    pub dp_rank: i32,
    pub tp_rank: i32,
    pub tp_size: i32,
}

/// The worker now holds these blocks, in chain order.
#[derive(Clone, Debug, PartialEq)]
pub struct Stored<'a> {
    pub block_hashes: Hashes<'a>,
    /// Packed like `block_hashes`: exactly `block_hashes.width` bytes.
    pub parent_block_hash: Option<&'a [u8]>,
    /// Token ids of all blocks, uint32 little-endian; `len() % 4 == 0`.
    pub token_ids: &'a [u8],
    pub block_size: i32,
    pub lora_id: Option<i64>,
    pub medium: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    /// Per block (one entry per hash when the engine is well-behaved; not
    /// checked, as the codec does not check it): none, or that block's keys.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey<'a>>>>>,
    pub group_idx: Option<i32>,
    pub kv_cache_spec_kind: Option<&'a str>,
    pub kv_cache_spec_sliding_window: Option<i32>,
    pub locality: Option<&'a str>,
    pub ownership: Option<&'a str>,
    pub session_id: Option<&'a str>,
}

impl<'a> Stored<'a> {
    #[inline]
    pub fn token_count(&self) -> usize {
        self.token_ids.len() / 4
    }

    /// The token ids as integers.
    #[inline]
    pub fn tokens(&self) -> impl ExactSizeIterator<Item = u32> + 'a {
        self.token_ids.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
    }
}

/// The worker no longer holds these blocks on `medium`.
#[derive(Clone, Debug, PartialEq)]
pub struct Removed<'a> {
    pub block_hashes: Hashes<'a>,
    pub medium: Option<&'a str>,
    pub group_idx: Option<i32>,
    pub locality: Option<&'a str>,
    pub ownership: Option<&'a str>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event<'a> {
    Stored(Stored<'a>),
    Removed(Removed<'a>),
    /// The worker dropped every block it held.
    Cleared,
}

/// One Kafka record, as the *current* (reader) schema sees it, whatever
/// version wrote it: fields a writer version lacks hold the reader's default
/// (`source` is `""` for v1), and values are those schema resolution gives
/// (`kvwire.schemas.codec.decode`, with fastavro, is the reference: the
/// decoder yields exactly its values or declines the record).
#[derive(Clone, Debug, PartialEq)]
pub struct Record<'a> {
    /// The schema version named by the record's fingerprint (which writer).
    pub writer_version: u32,
    pub worker: Worker<'a>,
    pub epoch: i64,
    pub seq: i64,
    pub ts_us: i64,
    pub engine_ts: Option<f64>,
    pub reset: bool,
    pub gap: i64,
    pub source: &'a str,
    /// Empty for a heartbeat.
    pub events: Vec<Event<'a>>,
}

impl Record<'_> {
    /// Blocks named by the record's stores and removals.
    pub fn block_count(&self) -> usize {
        self.events
            .iter()
            .map(|e| match e {
                Event::Stored(s) => s.block_hashes.len(),
                Event::Removed(r) => r.block_hashes.len(),
                Event::Cleared => 0,
            })
            .sum()
    }

    /// No events, no reset, no gap (mirrors `EventBatch.is_heartbeat`).
    pub fn is_heartbeat(&self) -> bool {
        self.events.is_empty() && !self.reset && self.gap == 0
    }
}
