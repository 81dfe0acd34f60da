//! The fast decoder: both wire framings, specialised by hand to every shipped
//! writer version of `schemas/avro/event_batch.v*.avsc`.
//!
//! A single-object record names its writer by fingerprint. A Confluent-framed
//! one (`00` + a 4-byte big-endian registry id) names it by an id that only its
//! registry can resolve: the caller resolves ids in Python (`codec.SchemaIds`)
//! and says which shipped version an id stands for; an id it cannot name (not
//! resolved, refused, or a schema kvwire does not ship) is declined.
//!
//! The contract with the reference decoder (`kvwire.schemas.codec.decode`,
//! fastavro) is one-sided: for any bytes, `decode` either returns exactly the
//! values the reference returns, or declines. It declines everything the
//! reference rejects, and also some bytes the reference tolerates (fastavro
//! reads a negative or too-long length as "the rest of the buffer", truncates
//! an 11-byte varint, takes any non-zero byte as `true`, an `int` outside 32
//! bits, a negative enum index from the end). A declined record goes through
//! the reference, which either decodes it or names the dead-letter reason, so
//! declining is always safe; it only costs speed, and no record a kvwire
//! producer writes is declined.

pub mod py;

use crate::record::{Event, ExtraKey, HashKind, Hashes, Record, Removed, Scalar, Stored, Worker};

/// Avro single-object encoding marker.
pub const MAGIC: [u8; 2] = [0xC3, 0x01];
/// Magic + the 8-byte CRC-64-AVRO fingerprint of the writer schema.
pub const HEADER_SIZE: usize = 10;
/// Confluent framing: `00` + the registry id of the writer schema, big-endian.
pub const CONFLUENT_MAGIC: u8 = 0;
pub const CONFLUENT_HEADER_SIZE: usize = 5;
/// Same bound as `codec.MAX_RECORD_BYTES`.
pub const MAX_RECORD_BYTES: usize = 64 * 1024 * 1024;

/// The writer versions this decoder is specialised to, with their
/// fingerprints as framed on the wire (little-endian). The parity test checks
/// this list against every schema shipped in `schemas/avro`.
pub const FINGERPRINTS: [(u32, [u8; 8]); 2] =
    [(1, [0x8e, 0x16, 0xc2, 0xd2, 0x80, 0x14, 0x78, 0xda]), (2, [0xab, 0x49, 0x96, 0x8c, 0x92, 0xeb, 0xe7, 0xad])];

/// Why the fast path did not decode a record. The reason is for counters and
/// debugging only: the reference decoder gives the dead-letter reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decline {
    pub reason: &'static str,
    /// Byte offset in the record where decoding stopped.
    pub at: usize,
}

impl std::fmt::Display for Decline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at byte {}", self.reason, self.at)
    }
}

impl std::error::Error for Decline {}

type R<T> = Result<T, Decline>;

/// Most items reserved from an array's claimed count before they are read: a count is bounded
/// only by the bytes left (an item can be one byte), and reserving 64 Mi events up front would
/// ask for gigabytes; past this, vectors grow as items actually parse.
const RESERVE_CAP: usize = 64;

/// The writer version a record's header names, if this decoder knows it.
pub fn writer_version(value: &[u8]) -> Option<u32> {
    if value.len() < HEADER_SIZE || value[..2] != MAGIC {
        return None;
    }
    let fp = &value[2..HEADER_SIZE];
    FINGERPRINTS.iter().find(|(_, f)| f == fp).map(|(v, _)| *v)
}

/// The registry id a Confluent-framed value names (`codec.confluent_id`).
pub fn confluent_id(value: &[u8]) -> Option<u32> {
    match value {
        [CONFLUENT_MAGIC, a, b, c, d, ..] => Some(u32::from_be_bytes([*a, *b, *c, *d])),
        _ => None,
    }
}

/// Decode one single-object record value, or decline it (a Confluent-framed
/// one included: see `decode_framed`).
pub fn decode(value: &[u8]) -> R<Record<'_>> {
    decode_framed(value, |_| None)
}

/// Decode one record value in either framing, or decline it. `version_of`
/// names the shipped writer version a Confluent registry id stands for.
pub fn decode_framed(value: &[u8], version_of: impl FnOnce(u32) -> Option<u32>) -> R<Record<'_>> {
    if value.len() > MAX_RECORD_BYTES {
        return Err(Decline { reason: "record too large", at: 0 });
    }
    let (version, start) = if let Some(id) = confluent_id(value) {
        let Some(v) = version_of(id).filter(|v| FINGERPRINTS.iter().any(|(known, _)| known == v)) else {
            return Err(Decline { reason: "registry id of no shipped writer version", at: 1 });
        };
        (v, CONFLUENT_HEADER_SIZE)
    } else {
        if value.len() < HEADER_SIZE {
            return Err(Decline { reason: "shorter than the header", at: 0 });
        }
        if value[..2] != MAGIC {
            return Err(Decline { reason: "not single-object framing", at: 0 });
        }
        let Some(v) = writer_version(value) else {
            return Err(Decline { reason: "unknown writer fingerprint", at: 2 });
        };
        (v, HEADER_SIZE)
    };
    let mut c = Cursor { buf: value, pos: start };
    let rec = c.record(version)?;
    if c.pos != value.len() {
        return Err(c.decline("trailing bytes"));
    }
    Ok(rec)
}

/// A read position in one record. Every read checks bounds and advances only on success.
pub(crate) struct Cursor<'a> {
    pub(crate) buf: &'a [u8],
    pub(crate) pos: usize,
}

impl<'a> Cursor<'a> {
    #[cold]
    fn decline(&self, reason: &'static str) -> Decline {
        Decline { reason, at: self.pos }
    }

    #[inline]
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Avro `long`: zig-zag varint of at most 10 bytes whose value fits 64
    /// bits. Overlong encodings within 10 bytes are accepted (the value is
    /// unambiguous); an 11th byte or bits past 64 decline.
    #[inline]
    pub(crate) fn long(&mut self) -> R<i64> {
        let buf = self.buf;
        let mut pos = self.pos;
        let mut n: u64 = 0;
        let mut shift = 0u32;
        loop {
            let Some(&b) = buf.get(pos) else {
                return Err(Decline { reason: "truncated varint", at: pos });
            };
            pos += 1;
            if shift == 63 {
                // the 10th byte carries bit 63 only
                if b > 1 {
                    return Err(Decline { reason: "varint longer than 64 bits", at: pos - 1 });
                }
                n |= (b as u64) << 63;
                break;
            }
            n |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                break;
            }
            shift += 7;
        }
        self.pos = pos;
        Ok(zigzag(n))
    }

    /// Avro `int`: a `long` that fits 32 bits.
    #[inline]
    fn int(&mut self) -> R<i32> {
        let at = self.pos;
        let v = self.long()?;
        i32::try_from(v).map_err(|_| Decline { reason: "int outside 32 bits", at })
    }

    /// A length prefix: non-negative and within the record.
    #[inline]
    fn len(&mut self) -> R<usize> {
        let at = self.pos;
        let v = self.long()?;
        if v < 0 {
            return Err(Decline { reason: "negative length", at });
        }
        if v as u64 > self.remaining() as u64 {
            return Err(Decline { reason: "length past the end", at });
        }
        Ok(v as usize)
    }

    #[inline]
    fn bytes(&mut self) -> R<&'a [u8]> {
        let n = self.len()?;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    fn string(&mut self) -> R<&'a str> {
        let at = self.pos;
        let b = self.bytes()?;
        std::str::from_utf8(b).map_err(|_| Decline { reason: "invalid UTF-8", at })
    }

    #[inline]
    fn boolean(&mut self) -> R<bool> {
        match self.buf.get(self.pos) {
            Some(&0) => {
                self.pos += 1;
                Ok(false)
            }
            Some(&1) => {
                self.pos += 1;
                Ok(true)
            }
            Some(_) => Err(self.decline("boolean not 0 or 1")),
            None => Err(self.decline("truncated boolean")),
        }
    }

    #[inline]
    fn double(&mut self) -> R<f64> {
        match self.buf.get(self.pos..self.pos + 8) {
            Some(b) => {
                self.pos += 8;
                Ok(f64::from_le_bytes(b.try_into().expect("8 bytes")))
            }
            None => Err(self.decline("truncated double")),
        }
    }

    /// A union branch index in `0..n`.
    #[inline]
    fn branch(&mut self, n: i64) -> R<i64> {
        let at = self.pos;
        let i = self.long()?;
        if !(0..n).contains(&i) {
            return Err(Decline { reason: "invalid union branch", at });
        }
        Ok(i)
    }

    /// `["null", T]`: whether T follows.
    #[inline]
    fn some(&mut self) -> R<bool> {
        Ok(self.branch(2)? == 1)
    }

    #[inline]
    fn opt_string(&mut self) -> R<Option<&'a str>> {
        Ok(if self.some()? { Some(self.string()?) } else { None })
    }

    #[inline]
    fn opt_int(&mut self) -> R<Option<i32>> {
        Ok(if self.some()? { Some(self.int()?) } else { None })
    }

    /// The item count of the next array block; 0 ends the array. Every item of
    /// our arrays takes at least one byte (each is a union), so a count past
    /// the remaining bytes is declined before anything is allocated.
    #[inline]
    fn block_count(&mut self) -> R<usize> {
        let at = self.pos;
        let mut n = self.long()?;
        if n < 0 {
            if n == i64::MIN {
                return Err(Decline { reason: "invalid array block count", at });
            }
            // a negative count is followed by the block's byte size, which readers may skip by
            let size = self.long()?;
            if size < 0 {
                return Err(Decline { reason: "negative array block size", at });
            }
            n = -n;
        }
        if n as u64 > self.remaining() as u64 {
            return Err(Decline { reason: "array count past the end", at });
        }
        Ok(n as usize)
    }

    fn record(&mut self, version: u32) -> R<Record<'a>> {
        let worker = Worker {
            instance_id: self.string()?,
            model: self.string()?,
            dp_rank: self.int()?,
            tp_rank: self.int()?,
            tp_size: self.int()?,
        };
        let epoch = self.long()?;
        let seq = self.long()?;
        let ts_us = self.long()?;
        let engine_ts = if self.some()? { Some(self.double()?) } else { None };
        let reset = self.boolean()?;
        let gap = self.long()?;
        let mut events = Vec::new();
        loop {
            let n = self.block_count()?;
            if n == 0 {
                break;
            }
            events.reserve(n.min(RESERVE_CAP));
            for _ in 0..n {
                events.push(self.event()?);
            }
        }
        // v2 added `source` (default ""): a v1 writer's record reads as "".
        let source = if version >= 2 { self.string()? } else { "" };
        Ok(Record { writer_version: version, worker, epoch, seq, ts_us, engine_ts, reset, gap, source, events })
    }

    fn event(&mut self) -> R<Event<'a>> {
        Ok(match self.branch(3)? {
            0 => Event::Stored(self.stored()?),
            1 => Event::Removed(self.removed()?),
            _ => Event::Cleared,
        })
    }

    /// hash_kind, hash_width, block_hashes, checked as `codec.unpack_hashes` checks them.
    #[inline]
    fn hashes(&mut self) -> R<Hashes<'a>> {
        let at = self.pos;
        let kind = match self.long()? {
            0 => HashKind::U64,
            1 => HashKind::I64,
            2 => HashKind::Digest,
            _ => return Err(Decline { reason: "invalid enum index", at }),
        };
        let at = self.pos;
        let width = self.int()?;
        let packed = self.bytes()?;
        let ok = match kind {
            HashKind::Digest => width > 0 && packed.len() % width as usize == 0,
            _ => width == 8 && packed.len() % 8 == 0,
        };
        if !ok {
            return Err(Decline { reason: "hash bytes do not divide by hash_width", at });
        }
        Ok(Hashes { kind, width: width as usize, packed })
    }

    fn stored(&mut self) -> R<Stored<'a>> {
        let block_hashes = self.hashes()?;
        let at = self.pos;
        let parent_block_hash = if self.some()? {
            let p = self.bytes()?;
            // U64/I64 parents are 8 bytes; a digest parent is hash_width bytes
            if p.len() != block_hashes.width {
                return Err(Decline { reason: "parent hash of the wrong size", at });
            }
            Some(p)
        } else {
            None
        };
        let at = self.pos;
        let token_ids = self.bytes()?;
        if token_ids.len() % 4 != 0 {
            return Err(Decline { reason: "token_ids not a multiple of 4 bytes", at });
        }
        Ok(Stored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size: self.int()?,
            lora_id: if self.some()? { Some(self.long()?) } else { None },
            medium: self.opt_string()?,
            lora_name: self.opt_string()?,
            extra_keys: if self.some()? { Some(self.extra_keys()?) } else { None },
            group_idx: self.opt_int()?,
            kv_cache_spec_kind: self.opt_string()?,
            kv_cache_spec_sliding_window: self.opt_int()?,
            locality: self.opt_string()?,
            ownership: self.opt_string()?,
            session_id: self.opt_string()?,
        })
    }

    fn removed(&mut self) -> R<Removed<'a>> {
        Ok(Removed {
            block_hashes: self.hashes()?,
            medium: self.opt_string()?,
            group_idx: self.opt_int()?,
            locality: self.opt_string()?,
            ownership: self.opt_string()?,
        })
    }

    fn extra_keys(&mut self) -> R<Vec<Option<Vec<ExtraKey<'a>>>>> {
        let mut blocks = Vec::new();
        loop {
            let n = self.block_count()?;
            if n == 0 {
                return Ok(blocks);
            }
            blocks.reserve(n.min(RESERVE_CAP));
            for _ in 0..n {
                blocks.push(if self.some()? { Some(self.block_keys()?) } else { None });
            }
        }
    }

    fn block_keys(&mut self) -> R<Vec<ExtraKey<'a>>> {
        let mut keys = Vec::new();
        loop {
            let n = self.block_count()?;
            if n == 0 {
                return Ok(keys);
            }
            keys.reserve(n.min(RESERVE_CAP));
            for _ in 0..n {
                let i = self.branch(7)?;
                keys.push(if i == 6 { ExtraKey::Tuple(self.tuple_key()?) } else { ExtraKey::Scalar(self.scalar(i)?) });
            }
        }
    }

    fn tuple_key(&mut self) -> R<Vec<Scalar<'a>>> {
        let mut items = Vec::new();
        loop {
            let n = self.block_count()?;
            if n == 0 {
                return Ok(items);
            }
            items.reserve(n.min(RESERVE_CAP));
            for _ in 0..n {
                let i = self.branch(6)?;
                items.push(self.scalar(i)?);
            }
        }
    }

    /// The scalar of union branch `i` (`null|boolean|long|double|string|bytes`).
    #[inline]
    fn scalar(&mut self, i: i64) -> R<Scalar<'a>> {
        Ok(match i {
            0 => Scalar::Null,
            1 => Scalar::Bool(self.boolean()?),
            2 => Scalar::Long(self.long()?),
            3 => Scalar::Double(self.double()?),
            4 => Scalar::Str(self.string()?),
            _ => Scalar::Bytes(self.bytes()?),
        })
    }
}

/// Zig-zag decoding: 0, -1, 1, -2, ... from 0, 1, 2, 3, ...
#[inline]
pub(crate) fn zigzag(n: u64) -> i64 {
    ((n >> 1) as i64) ^ -((n & 1) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(mut n: u64) -> Vec<u8> {
        let mut out = Vec::new();
        while n >= 0x80 {
            out.push((n as u8) | 0x80);
            n >>= 7;
        }
        out.push(n as u8);
        out
    }

    fn zz(v: i64) -> u64 {
        ((v << 1) ^ (v >> 63)) as u64
    }

    fn read_long(b: &[u8]) -> R<(i64, usize)> {
        let mut c = Cursor { buf: b, pos: 0 };
        let v = c.long()?;
        Ok((v, c.pos))
    }

    #[test]
    fn zigzag_round_trips_the_extremes() {
        for v in [0, -1, 1, -2, 2, 63, -64, 64, -65, i32::MAX as i64, i32::MIN as i64, i64::MAX, i64::MIN] {
            assert_eq!(zigzag(zz(v)), v, "{v}");
            let enc = varint(zz(v));
            assert_eq!(read_long(&enc), Ok((v, enc.len())), "{v}");
        }
        assert_eq!(varint(zz(i64::MIN)).len(), 10);
        assert_eq!(varint(zz(i64::MAX)).len(), 10);
    }

    #[test]
    fn overlong_varints_within_ten_bytes_read_their_value() {
        // 0 as 10 bytes, and -1 (zig-zag 1) padded with continuation bytes
        let zero10 = [0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00];
        assert_eq!(read_long(&zero10), Ok((0, 10)));
        assert_eq!(read_long(&[0x81, 0x80, 0x00]), Ok((-1, 3)));
        // bit 63 set via the 10th byte: zig-zag u64::MAX is i64::MIN
        let max = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01];
        assert_eq!(read_long(&max), Ok((i64::MIN, 10)));
    }

    #[test]
    fn varints_past_64_bits_decline() {
        let eleven = [0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00];
        assert_eq!(read_long(&eleven).unwrap_err().reason, "varint longer than 64 bits");
        let high = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
        assert_eq!(read_long(&high).unwrap_err().reason, "varint longer than 64 bits");
    }

    #[test]
    fn truncated_varints_decline_without_moving() {
        for b in [&[][..], &[0x80][..], &[0xff, 0xff, 0xff][..]] {
            let mut c = Cursor { buf: b, pos: 0 };
            assert_eq!(c.long().unwrap_err().reason, "truncated varint");
            assert_eq!(c.pos, 0);
        }
    }

    #[test]
    fn ints_outside_32_bits_decline() {
        for (v, ok) in [(i32::MAX as i64, true), (i32::MIN as i64, true), (1 << 31, false), (-(1 << 31) - 1, false)] {
            let enc = varint(zz(v));
            let mut c = Cursor { buf: &enc, pos: 0 };
            assert_eq!(c.int().is_ok(), ok, "{v}");
        }
    }

    #[test]
    fn lengths_are_bounded_by_the_record() {
        let mut b = varint(zz(3));
        b.extend_from_slice(b"abc");
        let mut c = Cursor { buf: &b, pos: 0 };
        assert_eq!(c.bytes(), Ok(&b"abc"[..]));
        let mut short = varint(zz(4));
        short.extend_from_slice(b"abc");
        assert_eq!(Cursor { buf: &short, pos: 0 }.bytes().unwrap_err().reason, "length past the end");
        let neg = varint(zz(-1));
        assert_eq!(Cursor { buf: &neg, pos: 0 }.bytes().unwrap_err().reason, "negative length");
        let huge = varint(zz(i64::MAX));
        assert_eq!(Cursor { buf: &huge, pos: 0 }.bytes().unwrap_err().reason, "length past the end");
    }

    #[test]
    fn booleans_are_zero_or_one() {
        assert_eq!(Cursor { buf: &[1], pos: 0 }.boolean(), Ok(true));
        assert_eq!(Cursor { buf: &[0], pos: 0 }.boolean(), Ok(false));
        assert!(Cursor { buf: &[2], pos: 0 }.boolean().is_err());
        assert!(Cursor { buf: &[], pos: 0 }.boolean().is_err());
    }

    #[test]
    fn array_counts_past_the_end_decline_before_allocating() {
        let b = varint(zz(1 << 60));
        assert_eq!(Cursor { buf: &b, pos: 0 }.block_count().unwrap_err().reason, "array count past the end");
        let min = varint(zz(i64::MIN));
        assert!(Cursor { buf: &min, pos: 0 }.block_count().is_err());
        // negative count: |n| items after a byte size
        let mut neg = varint(zz(-2));
        neg.extend(varint(zz(2)));
        neg.extend([0, 0]);
        assert_eq!(Cursor { buf: &neg, pos: 0 }.block_count(), Ok(2));
    }

    #[test]
    fn framing_other_than_known_single_object_declines() {
        assert_eq!(decode(b"").unwrap_err().reason, "shorter than the header");
        let confluent = [0u8, 0, 0, 0, 1, 2, 0, 0, 0, 0, 0, 0];
        assert_eq!(decode(&confluent).unwrap_err().reason, "registry id of no shipped writer version");
        assert_eq!(confluent_id(&confluent), Some(1));
        let unshipped = decode_framed(&confluent, |_| Some(9)).unwrap_err();
        assert_eq!(unshipped.reason, "registry id of no shipped writer version");
        assert_eq!(decode(&[1u8, 2, 3, 4, 5, 6, 7, 8, 9, 10]).unwrap_err().reason, "not single-object framing");
        let unknown = [0xc3, 0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(decode(&unknown).unwrap_err().reason, "unknown writer fingerprint");
        for (v, fp) in FINGERPRINTS {
            let mut h = MAGIC.to_vec();
            h.extend(fp);
            assert_eq!(writer_version(&h), Some(v));
        }
    }

    /// A minimal v2 heartbeat, then the same record cut at every offset.
    #[test]
    fn a_heartbeat_decodes_and_every_truncation_declines() {
        let mut b = MAGIC.to_vec();
        b.extend(FINGERPRINTS[1].1);
        b.extend(varint(zz(1)));
        b.push(b'w'); // instance_id
        b.extend(varint(0)); // model ""
        b.extend([0, 0, 2]); // dp 0, tp 0, tp_size 1
        b.extend(varint(zz(-5))); // epoch
        b.extend(varint(zz(7))); // seq
        b.extend(varint(zz(9))); // ts_us
        b.push(0); // engine_ts null
        b.push(1); // reset
        b.extend(varint(0)); // gap
        b.extend(varint(0)); // no events
        b.extend(varint(zz(3)));
        b.extend(b"sim");
        let r = decode(&b).unwrap();
        assert_eq!(r.writer_version, 2);
        assert_eq!((r.worker.instance_id, r.worker.tp_size, r.epoch, r.seq, r.ts_us), ("w", 1, -5, 7, 9));
        assert!(r.reset && r.events.is_empty() && r.source == "sim" && r.engine_ts.is_none());
        for cut in 0..b.len() {
            assert!(decode(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut trailing = b.clone();
        trailing.push(0);
        assert_eq!(decode(&trailing).unwrap_err().reason, "trailing bytes");

        // The same body behind a registry id that names version 2.
        let mut cf = vec![CONFLUENT_MAGIC, 0, 0, 1, 7];
        cf.extend_from_slice(&b[HEADER_SIZE..]);
        assert_eq!(decode_framed(&cf, |id| (id == 263).then_some(2)).unwrap(), r);
        assert!(decode(&cf).is_err());
        for cut in 0..cf.len() {
            assert!(decode_framed(&cf[..cut], |_| Some(2)).is_err(), "cut at {cut}");
        }
    }
}
