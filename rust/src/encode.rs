//! The write half of the wire layout that `decode` reads: a `Record` as Avro binary of schema
//! version `VERSION`, byte for byte what fastavro writes for the same values
//! (`kvwire.schemas.codec.encode` is the reference; tests/schemas/test_fast_encode.py holds
//! the two equal). The producer's sender encodes every batch, on the engine's GIL: fastavro
//! spent ~14 us of it per 16-block record, mostly re-reading the schema's named types per call.

pub mod py;

use crate::record::{Event, ExtraKey, HashKind, Hashes, Record, Removed, Scalar, Stored};

/// The schema version this writer lays out (v2: `source` after `events`).
pub const VERSION: u32 = 2;

/// Appends `r`'s body (no framing header) to `out`. `r.writer_version` is not read: the bytes
/// are always version `VERSION`'s.
pub fn encode_into(r: &Record<'_>, out: &mut Vec<u8>) {
    let w = &r.worker;
    string(out, w.instance_id);
    string(out, w.model);
    long(out, w.dp_rank.into());
    long(out, w.tp_rank.into());
    long(out, w.tp_size.into());
    long(out, r.epoch);
    long(out, r.seq);
    long(out, r.ts_us);
    match r.engine_ts {
        Some(t) => {
            long(out, 1);
            out.extend_from_slice(&t.to_le_bytes());
        }
        None => long(out, 0),
    }
    out.push(u8::from(r.reset));
    long(out, r.gap);
    array(out, &r.events, event);
    string(out, r.source);
}

/// Zig-zag varint: Avro's `int` and `long` alike.
#[inline]
fn long(out: &mut Vec<u8>, v: i64) {
    let mut n = ((v << 1) ^ (v >> 63)) as u64;
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

#[inline]
fn bytes(out: &mut Vec<u8>, b: &[u8]) {
    long(out, b.len() as i64);
    out.extend_from_slice(b);
}

#[inline]
fn string(out: &mut Vec<u8>, s: &str) {
    bytes(out, s.as_bytes());
}

/// One block of `items.len()` items, then the end marker (an empty array is the marker alone),
/// as fastavro writes arrays.
fn array<T>(out: &mut Vec<u8>, items: &[T], item: impl Fn(&mut Vec<u8>, &T)) {
    if !items.is_empty() {
        long(out, items.len() as i64);
        for it in items {
            item(out, it);
        }
    }
    long(out, 0);
}

/// `["null", T]`: branch 0 for none, 1 then the value.
#[inline]
fn opt<T>(out: &mut Vec<u8>, v: Option<T>, some: impl FnOnce(&mut Vec<u8>, T)) {
    match v {
        Some(v) => {
            long(out, 1);
            some(out, v);
        }
        None => long(out, 0),
    }
}

fn opt_string(out: &mut Vec<u8>, v: Option<&str>) {
    opt(out, v, string);
}

fn opt_int(out: &mut Vec<u8>, v: Option<i32>) {
    opt(out, v, |o, n| long(o, n.into()));
}

fn event(out: &mut Vec<u8>, e: &Event<'_>) {
    match e {
        Event::Stored(s) => {
            long(out, 0);
            stored(out, s);
        }
        Event::Removed(r) => {
            long(out, 1);
            removed(out, r);
        }
        Event::Cleared => long(out, 2),
    }
}

fn hashes(out: &mut Vec<u8>, h: &Hashes<'_>) {
    long(
        out,
        match h.kind {
            HashKind::U64 => 0,
            HashKind::I64 => 1,
            HashKind::Digest => 2,
        },
    );
    long(out, h.width as i64);
    bytes(out, h.packed);
}

fn stored(out: &mut Vec<u8>, s: &Stored<'_>) {
    hashes(out, &s.block_hashes);
    opt(out, s.parent_block_hash, bytes);
    bytes(out, s.token_ids);
    long(out, s.block_size.into());
    opt(out, s.lora_id, long);
    opt_string(out, s.medium);
    opt_string(out, s.lora_name);
    opt(out, s.extra_keys.as_deref(), |o, blocks| {
        array(o, blocks, |o, keys| opt(o, keys.as_deref(), |o, keys| array(o, keys, extra_key)))
    });
    opt_int(out, s.group_idx);
    opt_string(out, s.kv_cache_spec_kind);
    opt_int(out, s.kv_cache_spec_sliding_window);
    opt_string(out, s.locality);
    opt_string(out, s.ownership);
    opt_string(out, s.session_id);
}

fn removed(out: &mut Vec<u8>, r: &Removed<'_>) {
    hashes(out, &r.block_hashes);
    opt_string(out, r.medium);
    opt_int(out, r.group_idx);
    opt_string(out, r.locality);
    opt_string(out, r.ownership);
}

/// A block key: union `null|boolean|long|double|string|bytes|array<scalar>`.
fn extra_key(out: &mut Vec<u8>, k: &ExtraKey<'_>) {
    match k {
        ExtraKey::Scalar(s) => scalar(out, s),
        ExtraKey::Tuple(items) => {
            long(out, 6);
            array(out, items, scalar);
        }
    }
}

/// A scalar key: its union branch, then its value.
fn scalar(out: &mut Vec<u8>, s: &Scalar<'_>) {
    match *s {
        Scalar::Null => long(out, 0),
        Scalar::Bool(b) => {
            long(out, 1);
            out.push(u8::from(b));
        }
        Scalar::Long(n) => {
            long(out, 2);
            long(out, n);
        }
        Scalar::Double(d) => {
            long(out, 3);
            out.extend_from_slice(&d.to_le_bytes());
        }
        Scalar::Str(t) => {
            long(out, 4);
            string(out, t);
        }
        Scalar::Bytes(b) => {
            long(out, 5);
            bytes(out, b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::{decode, FINGERPRINTS};
    use crate::record::Worker;

    fn framed(r: &Record<'_>) -> Vec<u8> {
        let fp = FINGERPRINTS.iter().find(|(v, _)| *v == VERSION).expect("the decoder knows VERSION").1;
        let mut out = vec![0xC3, 0x01];
        out.extend_from_slice(&fp);
        encode_into(r, &mut out);
        out
    }

    fn record<'a>(events: Vec<Event<'a>>) -> Record<'a> {
        Record {
            writer_version: VERSION,
            worker: Worker { instance_id: "w-0", model: "m", dp_rank: 3, tp_rank: 1, tp_size: 2 },
            epoch: i64::MIN,
            seq: i64::MAX,
            ts_us: 1_733_000_000_000_000,
            engine_ts: Some(1.5),
            reset: true,
            gap: 7,
            source: "vllm",
            events,
        }
    }

    #[test]
    fn every_field_reads_back_through_the_decoder() {
        let packed = [1u8, 0, 0, 0, 0, 0, 0, 0x80, 2, 0, 0, 0, 0, 0, 0, 0];
        let tokens = [5u8, 0, 0, 0, 6, 0, 0, 0];
        let keys = vec![
            Some(vec![
                ExtraKey::Scalar(Scalar::Null),
                ExtraKey::Scalar(Scalar::Bool(true)),
                ExtraKey::Scalar(Scalar::Long(-300)),
                ExtraKey::Scalar(Scalar::Double(-0.25)),
                ExtraKey::Tuple(vec![Scalar::Str("mm"), Scalar::Bytes(b"\x00\xff"), Scalar::Long(i64::MIN)]),
                ExtraKey::Tuple(vec![]),
            ]),
            None,
        ];
        let stored = Stored {
            block_hashes: Hashes { kind: HashKind::U64, width: 8, packed: &packed },
            parent_block_hash: Some(&packed[8..]),
            token_ids: &tokens,
            block_size: 1,
            lora_id: Some(1 << 40),
            medium: Some("GPU"),
            lora_name: None,
            extra_keys: Some(keys),
            group_idx: Some(1),
            kv_cache_spec_kind: Some("sliding_window"),
            kv_cache_spec_sliding_window: Some(4096),
            locality: None,
            ownership: Some("own"),
            session_id: Some("s"),
        };
        let removed = Removed {
            block_hashes: Hashes { kind: HashKind::Digest, width: 2, packed: b"abcd" },
            medium: None,
            group_idx: None,
            locality: Some("LOCAL"),
            ownership: None,
        };
        let r = record(vec![Event::Stored(stored), Event::Removed(removed), Event::Cleared]);
        assert_eq!(decode(&framed(&r)).unwrap(), r);
    }

    #[test]
    fn a_heartbeat_reads_back_and_ends_its_empty_array_with_one_marker() {
        let mut r = record(vec![]);
        r.engine_ts = None;
        r.reset = false;
        let bytes = framed(&r);
        assert_eq!(decode(&bytes).unwrap(), r);
        // ... gap 7 (zig-zag 14), the events array's end marker alone, then source "vllm".
        assert!(bytes.ends_with(&[14, 0, 8, b'v', b'l', b'l', b'm']));
    }

    #[test]
    fn varints_take_ten_bytes_at_the_extremes() {
        for (v, len) in [(0i64, 1usize), (-1, 1), (63, 1), (64, 2), (i64::MAX, 10), (i64::MIN, 10)] {
            let mut out = Vec::new();
            long(&mut out, v);
            assert_eq!(out.len(), len, "{v}");
            assert_eq!(crate::decode::zigzag(varint_value(&out)), v);
        }
    }

    fn varint_value(b: &[u8]) -> u64 {
        b.iter().enumerate().fold(0u64, |n, (i, byte)| n | (u64::from(byte & 0x7f) << (7 * i)))
    }
}
