//! What the index modules' tests share.

/// `n` token ids (1000, 1001, ...) in the wire form, little-endian u32.
pub(super) fn toks(n: u32) -> Vec<u8> {
    (1000..1000 + n).flat_map(|t: u32| t.to_le_bytes()).collect()
}
