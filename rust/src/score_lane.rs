//! The score lane's plain request (`consumer/score_lane.py`), answered whole in one call: a
//! router's usual request, token ids alone (a binary body, or a JSON body with `token_ids` and
//! nothing else) and no query string, on a member whose answer needs nothing but the index and
//! the fence (no bearer token, no peers, no live holds: the Python side decides that, and
//! otherwise never calls this).
//!
//! Why: the same answer through Python (the head's fields handed out, the body checked, the
//! query built, the JSON framed, the response head formatted) cost ~25 µs of a ~120 µs request
//! on the member's HTTP thread at 10M holder-blocks (`bench.http_score`); here it is the head,
//! the score and two copies. A JSON body of 8k token ids took msgspec ~470 µs here (and its
//! list another ~80 µs to pack); `json_tokens` reads that one shape.
//!
//! This is also the one home of the rules on a query's tokens, whatever its form: a binary
//! body is whole uint32 words (`binary_body_refusal`) and a query holds at most `max_tokens`
//! (`token_count_refusal`). The Python request decoder asks these for every other request.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMemoryView, PySlice};

use crate::pipeline::{score_trusted, PyFence};
use crate::py_index::{PyIndex, ScoreQuery};
use crate::score_head::{parse, BINARY};

/// Why a query of `count` token ids is refused, as (HTTP status, message), or None: at most
/// `max_tokens` of them, whatever the body's form.
pub fn count_refusal(count: u64, max_tokens: u64) -> Option<(u16, String)> {
    (count > max_tokens).then(|| (413, format!("{count} tokens; at most {max_tokens}")))
}

/// Why a binary body of `length` bytes is refused, as (HTTP status, message), or None: it must
/// be whole little-endian uint32 token ids, as many as `count_refusal` lets in.
pub fn refusal(length: u64, max_tokens: u64) -> Option<(u16, String)> {
    if length % 4 != 0 {
        return Some((400, format!("invalid request: binary body of {length} bytes is not whole uint32 token ids")));
    }
    count_refusal(length / 4, max_tokens)
}

#[pyfunction]
fn binary_body_refusal(length: u64, max_tokens: u64) -> Option<(u16, String)> {
    refusal(length, max_tokens)
}

#[pyfunction]
fn token_count_refusal(count: u64, max_tokens: u64) -> Option<(u16, String)> {
    count_refusal(count, max_tokens)
}

/// JSON's whitespace.
fn skip_ws(b: &[u8], mut at: usize) -> usize {
    while at < b.len() && matches!(b[at], b' ' | b'\t' | b'\n' | b'\r') {
        at += 1;
    }
    at
}

/// `at` past `what` when `b` has `what` there.
fn expect(b: &[u8], at: usize, what: &[u8]) -> Option<usize> {
    b.get(at..at + what.len()).filter(|got| *got == what).map(|_| at + what.len())
}

/// The JSON integer at `at` if it has no sign, fraction, exponent or leading zero and is
/// below 2^32, with the offset past its digits.
#[inline(always)]
fn number(b: &[u8], at: usize) -> Option<(u32, usize)> {
    // Eight bytes at once where there are eight: where the first non-digit is gives the count,
    // and three multiplies the value (SWAR). A digit at a time took ~110 µs for 8k ids here,
    // mostly the branch on each number's length.
    if let Some(chunk) = b.get(at..at + 8) {
        let x = u64::from_le_bytes(chunk.try_into().ok()?) ^ 0x3030_3030_3030_3030;
        // A byte's top bit set where it is not a digit: x & 0x7f + 0x76 passes 0x7f from 10 up
        // (no carry into the next byte), and x's own top bit covers bytes from 0x80.
        let not_digit = (((x & 0x7f7f_7f7f_7f7f_7f7f) + 0x7676_7676_7676_7676) | x) & 0x8080_8080_8080_8080;
        if not_digit != 0 {
            let k = (not_digit.trailing_zeros() / 8) as usize;
            if k == 0 || (k > 1 && b[at] == b'0') {
                return None;
            }
            // The k digits in the top bytes, zero digits below: the same number in eight.
            let mut v = x << (64 - 8 * k);
            v = v.wrapping_mul(10).wrapping_add(v >> 8);
            v = ((v & 0x0000_00ff_0000_00ff).wrapping_mul(100 + (1_000_000 << 32))
                + ((v >> 16) & 0x0000_00ff_0000_00ff).wrapping_mul(1 + (10_000 << 32)))
                >> 32;
            return Some((v as u32, at + k));
        }
    }
    let mut n: u64 = 0;
    let mut end = at;
    while let Some(&d @ b'0'..=b'9') = b.get(end) {
        n = n * 10 + u64::from(d - b'0');
        end += 1;
        if n >= 1 << 32 {
            return None;
        }
    }
    let digits = end - at;
    if digits == 0 || (digits > 1 && b[at] == b'0') {
        return None;
    }
    Some((n as u32, end))
}

/// The token ids of a plain JSON body, as little-endian uint32 words: exactly
/// `{"token_ids": [n, ...]}` with JSON's whitespace anywhere between tokens, each `n` a JSON
/// integer without sign, fraction or exponent (no leading zero) below 2^32. None for any
/// other body: the Python decoder (msgspec, the schema's home) reads those and answers what
/// it refuses. Only ever stricter than the schema, so what this reads, the schema reads the
/// same.
pub fn json_tokens(body: &[u8]) -> Option<Vec<u8>> {
    let mut at = expect(body, skip_ws(body, 0), b"{")?;
    at = expect(body, skip_ws(body, at), b"\"token_ids\"")?;
    at = expect(body, skip_ws(body, at), b":")?;
    at = skip_ws(body, expect(body, skip_ws(body, at), b"[")?);
    // A number and its comma take six bytes or more in the usual body: a word each.
    let mut words = Vec::with_capacity(body.len() / 6 * 4 + 4);
    if body.get(at) == Some(&b']') {
        at += 1;
    } else {
        loop {
            let (n, next) = number(body, at)?;
            words.extend_from_slice(&n.to_le_bytes());
            at = skip_ws(body, next);
            match body.get(at) {
                Some(b',') => at = skip_ws(body, at + 1),
                Some(b']') => {
                    at += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    at = expect(body, skip_ws(body, at), b"}")?;
    (skip_ws(body, at) == body.len()).then_some(words)
}

/// How an answer is framed, as the Python side formats it (`ScoreLane._serve`'s `frame`): the
/// response head up to its Content-Length value, the rest of the head, and the JSON body's
/// opening and closing around the scores list.
type Frame<'a> = (&'a [u8], &'a [u8], &'a [u8], &'a [u8]);

/// The answer to the plain request whose head is `data[start:end]` (`end` at its blank line):
/// (the whole HTTP response, the offset past the request's body); None when the request is not
/// plain (a query string, a JSON body other than `json_tokens`', a head the lane does not
/// take), its body is refused or not all read yet: the caller's general path then handles it.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn score_plain<'py>(
    py: Python<'py>,
    index: &Bound<'py, PyIndex>,
    fence: &Bound<'py, PyFence>,
    data: &Bound<'py, PyBytes>,
    start: usize,
    end: usize,
    max_body: u64,
    max_tokens: u64,
    top_k: usize,
    frame: Frame<'_>,
) -> PyResult<Option<(Bound<'py, PyBytes>, usize)>> {
    let bytes = data.as_bytes();
    let Some(h) = bytes.get(start..end).and_then(|head| parse(head, max_body)) else {
        return Ok(None);
    };
    // A bare `?` is no query string to the Python side either (`score_lane._query`).
    if h.query.is_some_and(|q| !q.is_empty()) {
        return Ok(None);
    }
    let (body_at, stop) = (end + 4, end + 4 + h.length as usize);
    if stop > bytes.len() {
        return Ok(None);
    }
    let tokens = if h.content_type == BINARY {
        if refusal(h.length, max_tokens).is_some() {
            return Ok(None);
        }
        // The body in place: a view the score's buffer reads, as the Python path passes it.
        PyMemoryView::from(data.as_any())?.get_item(PySlice::new(py, body_at as isize, stop as isize, 1))?
    } else {
        match json_tokens(&bytes[body_at..stop]) {
            Some(words) if count_refusal(words.len() as u64 / 4, max_tokens).is_none() => {
                PyBytes::new(py, &words).into_any()
            }
            _ => return Ok(None),
        }
    };
    let query = Bound::new(
        py,
        ScoreQuery::Tokens { tokens: tokens.unbind(), block_size: 0, extra_keys: None, lora_name: None },
    )?;
    let json = score_trusted(py, index, fence, &PyList::new(py, [query])?, Some(top_k), true)?;
    let json = json.cast::<PyBytes>()?.as_bytes();
    let (head_open, head_close, body_open, body_close) = frame;
    let mut num = itoa::Buffer::new();
    let length = num.format(body_open.len() + json.len() + body_close.len()).as_bytes();
    let parts = [head_open, length, head_close, body_open, json, body_close];
    let answer = PyBytes::new_with(py, parts.iter().map(|p| p.len()).sum(), |buf| {
        let mut at = 0;
        for p in parts {
            buf[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        Ok(())
    })?;
    Ok(Some((answer, stop)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(binary_body_refusal, m)?)?;
    m.add_function(wrap_pyfunction!(token_count_refusal, m)?)?;
    m.add_function(wrap_pyfunction!(score_plain, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(ids: &[u32]) -> Vec<u8> {
        ids.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn a_plain_json_body_is_read() {
        assert_eq!(json_tokens(br#"{"token_ids":[1,2,3]}"#), Some(words(&[1, 2, 3])));
        assert_eq!(json_tokens(b" {\n\t\"token_ids\" :\r[ 0 , 4294967295 ]\n} "), Some(words(&[0, u32::MAX])));
        assert_eq!(json_tokens(br#"{"token_ids": []}"#), Some(vec![]));
        assert_eq!(json_tokens(br#"{"token_ids": [7, 8]}"#), Some(words(&[7, 8])));
    }

    #[test]
    fn any_other_json_body_is_left_to_the_schema() {
        for body in [
            &br#"{"token_ids": [4294967296]}"#[..],
            br#"{"token_ids": [01]}"#,
            br#"{"token_ids": [-1]}"#,
            br#"{"token_ids": [-0]}"#,
            br#"{"token_ids": [1.0]}"#,
            br#"{"token_ids": [1e2]}"#,
            br#"{"token_ids": [1,]}"#,
            br#"{"token_ids": [,1]}"#,
            br#"{"token_ids": ["1"]}"#,
            br#"{"token_ids": [1] "#,
            br#"{"token_ids": [1]} x"#,
            br#"{"token_ids": [1], "top_k": 2}"#,
            br#"{"top_k": 2, "token_ids": [1]}"#,
            br#"{"token_\u0069ds": [1]}"#,
            br#"{"token_ids": null}"#,
            br#"[1, 2]"#,
            b"",
            b"\xef\xbb\xbf{\"token_ids\": [1]}",
            b"{\"token_ids\": [1]\x0b}",
            br#"{"token_ids": [99999999999999999999999]}"#,
        ] {
            assert_eq!(json_tokens(body), None, "{}", String::from_utf8_lossy(body));
        }
    }

    /// `number`'s rule read the slow way: the digit run at `at`, whole.
    fn number_oracle(b: &[u8], at: usize) -> Option<(u32, usize)> {
        let digits = b[at..].iter().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 || (digits > 1 && b[at] == b'0') || digits > 12 {
            return None;
        }
        let n: u64 = std::str::from_utf8(&b[at..at + digits]).ok()?.parse().ok()?;
        (n < 1 << 32).then_some((n as u32, at + digits))
    }

    #[test]
    fn numbers_are_read_as_the_slow_rule_reads_them() {
        // Every digit count 0-12 (leading zeros included), each followed by every kind of byte
        // and by the end of the body, at every offset into an eight-byte window.
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..200_000 {
            let digits = (next() % 13) as usize;
            let mut b: Vec<u8> = (0..next() % 9).map(|_| b'x').collect();
            let at = b.len();
            for i in 0..digits {
                let d = if i == 0 && next() % 4 != 0 { 1 + next() % 9 } else { next() % 10 };
                b.push(b'0' + d as u8);
            }
            let tail: &[u8] =
                [&b""[..], b",", b"]", b" ", b"/", b":", b".", b"e", b"\xb0", b"\x3a"][(next() % 10) as usize];
            b.extend_from_slice(tail);
            b.extend((0..next() % 10).map(|_| b"0123456789, ]"[(next() % 13) as usize]));
            assert_eq!(number(&b, at), number_oracle(&b, at), "{:?} at {at}", String::from_utf8_lossy(&b));
        }
        for s in ["4294967295]", "4294967296]", "42949672950", "0,", "00,", "1234567,", "12345678,", "99999999]"] {
            assert_eq!(number(s.as_bytes(), 0), number_oracle(s.as_bytes(), 0), "{s}");
        }
    }

    #[test]
    fn a_binary_body_is_whole_words_up_to_the_limit() {
        assert_eq!(refusal(0, 0), None);
        assert_eq!(refusal(16, 4), None);
        assert_eq!(refusal(20, 4).map(|r| r.0), Some(413));
        for odd in [1, 2, 3, 17] {
            assert_eq!(refusal(odd, 100).map(|r| r.0), Some(400));
        }
        // Not whole words is the first refusal, whatever the length.
        assert_eq!(refusal(4 * 1000 + 1, 10).map(|r| r.0), Some(400));
        assert_eq!(count_refusal(10, 10), None);
        assert_eq!(count_refusal(11, 10), Some((413, "11 tokens; at most 10".to_string())));
    }
}
