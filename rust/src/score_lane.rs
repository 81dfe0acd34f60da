//! The score lane's plain request (`consumer/score_lane.py`), answered whole in one call: a
//! router's usual request, a binary body of token ids with no query string, on a member whose
//! answer needs nothing but the index and the fence (no bearer token, no peers, no live holds:
//! the Python side decides that, and otherwise never calls this).
//!
//! Why: the same answer through Python (the head's fields handed out, the body checked, the
//! query built, the JSON framed, the response head formatted) cost ~25 µs of a ~120 µs request
//! on the member's HTTP thread at 10M holder-blocks (`bench.http_score`); here it is the head,
//! the score and two copies.
//!
//! This is also the one home of the binary body's rule (`binary_body_refusal`), which the
//! Python request decoder calls for every other binary request.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMemoryView, PySlice};

use crate::pipeline::{score_trusted, PyFence};
use crate::py_index::{PyIndex, ScoreQuery};
use crate::score_head::{parse, BINARY};

/// Why a binary body of `length` bytes is refused, as (HTTP status, message), or None: it must
/// be whole little-endian uint32 token ids, at most `max_tokens` of them.
pub fn refusal(length: u64, max_tokens: u64) -> Option<(u16, String)> {
    if length % 4 != 0 {
        return Some((400, format!("invalid request: binary body of {length} bytes is not whole uint32 token ids")));
    }
    if length / 4 > max_tokens {
        return Some((413, format!("{} tokens; at most {max_tokens}", length / 4)));
    }
    None
}

#[pyfunction]
fn binary_body_refusal(length: u64, max_tokens: u64) -> Option<(u16, String)> {
    refusal(length, max_tokens)
}

/// How an answer is framed, as the Python side formats it (`score_lane.Frame`): the response
/// head up to its Content-Length value, the rest of the head, and the JSON body's opening and
/// closing around the scores list.
type Frame<'a> = (&'a [u8], &'a [u8], &'a [u8], &'a [u8]);

/// The answer to the plain request whose head is `data[start:end]` (`end` at its blank line):
/// (the whole HTTP response, the offset past the request's body); None when the request is not
/// plain (a query string, a JSON body, a head the lane does not take), its body is refused or
/// not all read yet: the caller's general path then handles it.
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
    if h.content_type != BINARY || h.query.is_some_and(|q| !q.is_empty()) || refusal(h.length, max_tokens).is_some() {
        return Ok(None);
    }
    let (body_at, stop) = (end + 4, end + 4 + h.length as usize);
    if stop > bytes.len() {
        return Ok(None);
    }
    // The body in place: a view the score's buffer reads, as the Python path passes it.
    let view = PyMemoryView::from(data.as_any())?.get_item(PySlice::new(py, body_at as isize, stop as isize, 1))?;
    let query =
        Bound::new(py, ScoreQuery::Tokens { tokens: view.unbind(), block_size: 0, extra_keys: None, lora_name: None })?;
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
    m.add_function(wrap_pyfunction!(score_plain, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
    }
}
