//! The head of a request the score lane answers (`consumer/score_lane.py`), read in one pass.
//! This is the one home of the rule for which heads the lane takes; everything else goes to
//! aiohttp, which answers it first-hand.
//!
//! The lane takes a head when it is plainly a router's hot request:
//! - the request line is `POST /v1/score HTTP/1.1`, with or without a query string of the
//!   characters RFC 3986 allows in one (nothing llhttp would refuse);
//! - every header line is a token, a colon and a value of visible ASCII, spaces and tabs;
//! - `Content-Length` appears once, in digits, below the body limit (at the limit itself
//!   aiohttp decides: its versions have differed on whether it is in);
//! - `Content-Type` appears once and is the binary or the JSON form (any case);
//! - `Authorization` appears at most once;
//! - `Connection`, if present, is keep-alive; there is no `Transfer-Encoding`, `Expect` or
//!   `Upgrade`.
//!
//! Why here: Python's regexes spent ~7 µs of a request on this (`bench.http_score`'s member).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

const METHOD_TARGET: &[u8] = b"POST /v1/score";
const VERSION: &[u8] = b" HTTP/1.1";
/// The binary form's content type: token ids as little-endian uint32 (`score_lane.rs`).
pub const BINARY: &[u8] = b"application/octet-stream";
/// The content types the lane answers, as it hands them on (lower case).
const CONTENT_TYPES: [&[u8]; 2] = [BINARY, b"application/json"];
const REFUSED: [&[u8]; 3] = [b"transfer-encoding", b"expect", b"upgrade"];

/// What the lane needs of a head it answers.
#[derive(Debug, PartialEq, Eq)]
pub struct ScoreHead<'a> {
    pub length: u64,
    /// One of `CONTENT_TYPES`.
    pub content_type: &'static [u8],
    pub authorization: Option<&'a [u8]>,
    /// The query string, without its `?` (empty for a bare `?`); None without one.
    pub query: Option<&'a [u8]>,
}

fn query_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"_!$&'()*+,/:;=?@.~%-".contains(&b)
}

fn token_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+.^_`|~-".contains(&b)
}

fn value_char(b: u8) -> bool {
    b == b'\t' || (0x20..=0x7e).contains(&b)
}

fn trim(mut v: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = v {
        v = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = v {
        v = rest;
    }
    v
}

/// The lines of a head, split at each CRLF (a head ending in CRLF has an empty last line).
fn lines(head: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(head);
    std::iter::from_fn(move || {
        let r = rest?;
        match r.windows(2).position(|w| w == b"\r\n") {
            Some(i) => {
                rest = Some(&r[i + 2..]);
                Some(&r[..i])
            }
            None => {
                rest = None;
                Some(r)
            }
        }
    })
}

/// The query string of a request line the lane takes (`Some(None)`: none), or None.
fn request_line(line: &[u8]) -> Option<Option<&[u8]>> {
    let rest = line.strip_prefix(METHOD_TARGET)?.strip_suffix(VERSION)?;
    if rest.is_empty() {
        return Some(None);
    }
    let query = rest.strip_prefix(b"?")?;
    query.iter().all(|&b| query_char(b)).then_some(Some(query))
}

/// `head` (the bytes before the blank line) if the lane answers it, else None.
pub fn parse(head: &[u8], max_body: u64) -> Option<ScoreHead<'_>> {
    let mut it = lines(head);
    let query = request_line(it.next()?)?;
    let (mut length, mut content_type, mut authorization) = (None, None, None);
    for line in it {
        let colon = line.iter().position(|&b| b == b':')?;
        let (name, value) = (&line[..colon], trim(&line[colon + 1..]));
        if name.is_empty() || !name.iter().all(|&b| token_char(b)) || !value.iter().all(|&b| value_char(b)) {
            return None;
        }
        let is = |n: &[u8]| name.eq_ignore_ascii_case(n);
        if is(b"content-length") {
            if length.is_some() || value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
                return None;
            }
            // Saturating: a length past u64 is over any body limit, as the exact one is.
            length = Some(value.iter().fold(0u64, |n, d| n.saturating_mul(10).saturating_add(u64::from(d - b'0'))));
        } else if is(b"content-type") {
            if content_type.is_some() {
                return None;
            }
            content_type = Some(*CONTENT_TYPES.iter().find(|t| value.eq_ignore_ascii_case(t))?);
        } else if is(b"authorization") {
            if authorization.is_some() {
                return None;
            }
            authorization = Some(value);
        } else if is(b"connection") {
            if !value.eq_ignore_ascii_case(b"keep-alive") {
                return None;
            }
        } else if REFUSED.iter().any(|r| is(r)) {
            return None;
        }
    }
    let length = length.filter(|&n| n < max_body)?;
    Some(ScoreHead { length, content_type: content_type?, authorization, query })
}

type HeadTuple<'py> = (u64, Bound<'py, PyBytes>, Option<Bound<'py, PyBytes>>, Option<Bound<'py, PyBytes>>);

/// `data[start:end]` read as a score head: (body length, content type, Authorization or None,
/// query string or None), or None when the lane does not answer it. Offsets, so the caller
/// does not copy the head out of what it read.
#[pyfunction]
fn score_head<'py>(
    py: Python<'py>,
    data: &Bound<'py, PyBytes>,
    start: usize,
    end: usize,
    max_body: u64,
) -> Option<HeadTuple<'py>> {
    let head = data.as_bytes().get(start..end)?;
    let h = parse(head, max_body)?;
    let bytes = |b: &[u8]| PyBytes::new(py, b);
    Some((h.length, bytes(h.content_type), h.authorization.map(bytes), h.query.map(bytes)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(score_head, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const BIN: &[u8] = b"application/octet-stream";

    fn head(lines: &[&str]) -> Vec<u8> {
        lines.join("\r\n").into_bytes()
    }

    #[test]
    fn a_routers_head_is_read() {
        let h = head(&[
            "POST /v1/score HTTP/1.1",
            "Host: x",
            "Content-Type: Application/Octet-Stream",
            "Content-Length: 016",
        ]);
        assert_eq!(parse(&h, 100), Some(ScoreHead { length: 16, content_type: BIN, authorization: None, query: None }));
        let h = head(&[
            "POST /v1/score?top_k=2&lora_name=%E2%82%AC HTTP/1.1",
            "content-length:\t 4 ",
            "content-type: application/json",
            "Authorization: Bearer  a b ",
            "Connection: Keep-Alive",
            "X-Empty:",
        ]);
        let got = parse(&h, 100).unwrap();
        assert_eq!(got.query, Some(&b"top_k=2&lora_name=%E2%82%AC"[..]));
        assert_eq!(
            (got.length, got.content_type, got.authorization),
            (4, &b"application/json"[..], Some(&b"Bearer  a b"[..]))
        );
        assert_eq!(
            parse(&head(&["POST /v1/score? HTTP/1.1", "Content-Length: 4", "Content-Type: application/json"]), 100)
                .unwrap()
                .query,
            Some(&b""[..])
        );
    }

    #[test]
    fn anything_else_goes_to_aiohttp() {
        let ok = ["Content-Length: 16", "Content-Type: application/octet-stream"];
        let with = |line: &str, extra: &[&str]| {
            let mut v = vec![line];
            v.extend_from_slice(extra);
            head(&v)
        };
        for line in [
            "GET /v1/score HTTP/1.1",
            "POST /v1/score HTTP/1.0",
            "POST /v1/scores HTTP/1.1",
            "POST /v1/score?a b HTTP/1.1",
            "POST /v1/score?a#b HTTP/1.1",
            "POST /v1//score HTTP/1.1",
        ] {
            assert_eq!(parse(&with(line, &ok), 100), None, "{line}");
        }
        let line = "POST /v1/score HTTP/1.1";
        for bad in [
            &["Content-Length: 16"][..],                                // no type
            &["Content-Type: application/json"],                        // no length
            &["Content-Length: +16", "Content-Type: application/json"], // not digits
            &["Content-Length: 16 16", "Content-Type: application/json"],
            &["Content-Length: 100", "Content-Type: application/json"], // at the limit
            &["Content-Length: 99999999999999999999999", "Content-Type: application/json"],
            &["Content-Length: 1", "Content-Length: 1", "Content-Type: application/json"],
            &["Content-Length: 1", "Content-Type: text/plain"],
            &["Content-Length: 1", "Content-Type: application/json", "Content-Type: application/json"],
            &["Content-Length: 1", "Content-Type: application/json", "Connection: close"],
            &["Content-Length: 1", "Content-Type: application/json", "Expect: 100-continue"],
            &["Content-Length: 1", "Content-Type: application/json", "transfer-encoding: chunked"],
            &["Content-Length: 1", "Content-Type: application/json", "Upgrade: websocket"],
            &["Content-Length: 1", "Content-Type: application/json", "Authorization: a", "Authorization: a"],
            &["Content-Length: 1", "Content-Type: application/json", "Bad Name: x"],
            &["Content-Length: 1", "Content-Type: application/json", ": x"],
            &["Content-Length: 1", "Content-Type: application/json", "no colon"],
            &["Content-Length: 1", "Content-Type: application/json", "X: a\x01b"],
            &["Content-Length: 1", "Content-Type: application/json", "X: \u{e9}"],
            &["Content-Length: 1", "Content-Type: application/json", ""],
        ] {
            assert_eq!(parse(&with(line, bad), 100), None, "{bad:?}");
        }
    }
}
