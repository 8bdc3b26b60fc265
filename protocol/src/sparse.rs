//! The sparse DeMo update: what one node sends for one step, in plain Rust.
//!
//! A tensor is viewed as 2-D (`[d0, d1·d2·…]`; a 1-D tensor as `[1, n]`) and cut into blocks
//! of `h × w` (the chunk rule, per dimension). Each block's orthonormal DCT-II coefficients are
//! flattened row-frequency-major (`b·w + d`); the sender keeps `k` of them per block and sends
//! their indices (packed into exactly the bits the block needs) and values (1 bit, bf16 or
//! f32). Indices within a block are strictly ascending: that makes the encoding canonical (one
//! byte string per content, so equivocation is meaningful) and duplicates impossible.
//!
//! Aggregation and the exact decode also live here (no tch): every honest node must turn the
//! same set of updates into bit-identical parameters on any device. See [`exact`].

use crate::config::{ModelConfig, ValueCodec};
use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Chunk length for one dimension of size `n` with target `s`: `n` itself when `n ≤ s`, else
/// the largest divisor of `n` not above `s` (no padding, as in the DeMo reference).
pub fn chunk_len(n: usize, s: usize) -> usize {
    let s = s.max(1);
    if n <= s {
        return n.max(1);
    }
    (1..=s).rev().find(|&d| n.is_multiple_of(d)).unwrap_or(1)
}

/// Bits needed for an index into a block of `elems` coefficients (0 for a 1-element block).
pub fn index_bits(elems: usize) -> u32 {
    if elems <= 1 {
        0
    } else {
        usize::BITS - (elems - 1).leading_zeros()
    }
}

/// Where one tensor's blocks lie.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLayout {
    pub name: String,
    pub shape: Vec<u32>,
    /// The 2-D view.
    pub rows: usize,
    pub cols: usize,
    /// Block height and width.
    pub h: usize,
    pub w: usize,
}

impl TensorLayout {
    pub fn new(name: &str, shape: &[u32], s: usize) -> TensorLayout {
        let (rows, cols) = view(shape);
        // A 1-D tensor is chunked along its only axis: its "row" axis has length 1.
        let h = chunk_len(rows, s);
        let w = chunk_len(cols, s);
        TensorLayout {
            name: name.to_string(),
            shape: shape.to_vec(),
            rows,
            cols,
            h,
            w,
        }
    }
    pub fn numel(&self) -> usize {
        self.rows * self.cols
    }
    pub fn blocks(&self) -> usize {
        (self.rows / self.h) * (self.cols / self.w)
    }
    pub fn block_elems(&self) -> usize {
        self.h * self.w
    }
    /// Coefficients kept per block for a requested `k`.
    pub fn k_eff(&self, k: u32) -> usize {
        (k as usize).min(self.block_elems())
    }
}

/// The layout of every tensor of a model, in wire order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub chunk: u32,
    pub tensors: Vec<TensorLayout>,
}

impl Layout {
    pub fn from_shapes(shapes: &[(String, Vec<u32>)], chunk: u32) -> Layout {
        Layout {
            chunk,
            tensors: shapes
                .iter()
                .map(|(n, s)| TensorLayout::new(n, s, chunk as usize))
                .collect(),
        }
    }
    pub fn for_model(m: &ModelConfig, chunk: u32) -> Layout {
        Self::from_shapes(&m.tensor_shapes(), chunk)
    }
    pub fn blocks(&self) -> usize {
        self.tensors.iter().map(|t| t.blocks()).sum()
    }
    pub fn numel(&self) -> usize {
        self.tensors.iter().map(|t| t.numel()).sum()
    }
}

/// One tensor's kept coefficients.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorUpdate {
    pub shape: Vec<u32>,
    /// Block height and width `[h, w]`.
    pub chunk: [u32; 2],
    /// Coefficients per block (already capped at the block size).
    pub k: u32,
    /// `blocks · k` indices, `index_bits(h·w)` bits each, LSB-first.
    #[serde(with = "serde_bytes")]
    pub indices: Vec<u8>,
    /// `blocks · k` values in the update's codec (sign: 1 bit each, set = positive).
    #[serde(with = "serde_bytes")]
    pub values: Vec<u8>,
}

/// A node's update for one step: every tensor of the model, in layout order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SparseUpdate {
    pub codec: ValueCodec,
    pub tensors: Vec<TensorUpdate>,
}

/// Why an update was refused. Each names its cause, so a peer can be penalized precisely.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SparseError {
    #[error("update is {len} bytes, over the limit of {max}")]
    Oversize { len: usize, max: usize },
    #[error("malformed update encoding: {0}")]
    Malformed(crate::error::CborError),
    /// Parses, but re-encodes to other bytes: one content must have one id.
    #[error("update encoding is not canonical")]
    NotCanonical,
    #[error("update has {got} tensors, the model has {want}")]
    TensorCount { got: usize, want: usize },
    #[error("tensor {tensor}: shape {got:?}, expected {want:?}")]
    ShapeMismatch {
        tensor: usize,
        got: Vec<u32>,
        want: Vec<u32>,
    },
    #[error("tensor {tensor}: chunk {got:?}, expected {want:?}")]
    ChunkMismatch {
        tensor: usize,
        got: [u32; 2],
        want: [u32; 2],
    },
    #[error("tensor {tensor}: k = {got}, expected {want}")]
    TopKMismatch { tensor: usize, got: u32, want: u32 },
    #[error("codec {got:?}, the run uses {want:?}")]
    CodecMismatch { got: ValueCodec, want: ValueCodec },
    #[error("tensor {tensor}: {what} is {got} bytes, expected {want}")]
    LengthMismatch {
        tensor: usize,
        what: &'static str,
        got: usize,
        want: usize,
    },
    #[error("tensor {tensor}, block {block}: index {index} out of range (block has {elems})")]
    IndexOutOfRange {
        tensor: usize,
        block: usize,
        index: u32,
        elems: usize,
    },
    #[error("tensor {tensor}, block {block}: index {index} repeated or out of order")]
    DuplicateIndex {
        tensor: usize,
        block: usize,
        index: u32,
    },
    #[error("tensor {tensor}: value {position} is not finite")]
    NonFinite { tensor: usize, position: usize },
    #[error("tensor {tensor}: padding bits are not zero")]
    NonZeroPadding { tensor: usize },
}

/// Pack `vals` with `bits` bits each, LSB-first. Values must fit.
pub fn pack_bits(vals: &[u32], bits: u32) -> Vec<u8> {
    let total = vals.len() * bits as usize;
    let mut out = vec![0u8; total.div_ceil(8)];
    if bits == 0 {
        return out;
    }
    let mut acc: u64 = 0;
    let mut nacc = 0u32;
    let mut pos = 0usize;
    for &v in vals {
        debug_assert!(bits == 32 || v < (1u32 << bits));
        acc |= (v as u64) << nacc;
        nacc += bits;
        while nacc >= 8 {
            out[pos] = acc as u8;
            pos += 1;
            acc >>= 8;
            nacc -= 8;
        }
    }
    if nacc > 0 {
        out[pos] = acc as u8;
    }
    out
}

/// Reads fixed-width values LSB-first; the caller has checked the length.
struct BitReader<'a> {
    bytes: &'a [u8],
    pos: usize,
    acc: u64,
    nacc: u32,
    bits: u32,
    mask: u64,
}

impl<'a> BitReader<'a> {
    fn new(bytes: &'a [u8], bits: u32) -> Self {
        let mask = if bits >= 32 {
            u32::MAX as u64
        } else {
            (1u64 << bits) - 1
        };
        BitReader {
            bytes,
            pos: 0,
            acc: 0,
            nacc: 0,
            bits,
            mask,
        }
    }
    #[inline]
    fn next_value(&mut self) -> u32 {
        if self.bits == 0 {
            return 0;
        }
        if self.nacc < self.bits {
            // Refill up to 7 bytes at once when available.
            while self.nacc <= 56 && self.pos < self.bytes.len() {
                self.acc |= (self.bytes[self.pos] as u64) << self.nacc;
                self.pos += 1;
                self.nacc += 8;
            }
        }
        let v = (self.acc & self.mask) as u32;
        self.acc >>= self.bits;
        self.nacc = self.nacc.saturating_sub(self.bits);
        v
    }
}

/// Inverse of [`pack_bits`]. `bytes` must hold at least `count·bits` bits.
pub fn unpack_bits(bytes: &[u8], bits: u32, count: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(count);
    if bits == 0 {
        out.resize(count, 0);
        return out;
    }
    let mask: u64 = if bits == 32 {
        u32::MAX as u64
    } else {
        (1u64 << bits) - 1
    };
    let mut acc: u64 = 0;
    let mut nacc = 0u32;
    let mut it = bytes.iter();
    for _ in 0..count {
        while nacc < bits {
            acc |= (*it.next().expect("caller checked length") as u64) << nacc;
            nacc += 8;
        }
        out.push((acc & mask) as u32);
        acc >>= bits;
        nacc -= bits;
    }
    out
}

/// Bytes of packed values for `n` entries (a quantized codec adds its 4-byte scale).
pub fn values_len(codec: ValueCodec, n: usize) -> usize {
    let header = if codec.is_quantized() { 4 } else { 0 };
    header + (n * codec.bits() as usize).div_ceil(8)
}

/// Bits of `values` that carry information (the rest is zero padding).
fn values_used_bits(codec: ValueCodec, n: usize) -> usize {
    let header = if codec.is_quantized() { 32 } else { 0 };
    header + n * codec.bits() as usize
}

/// Levels of a quantized codec.
fn quant_levels(codec: ValueCodec) -> u32 {
    match codec {
        ValueCodec::Q2 => 4,
        ValueCodec::Q4 => 16,
        _ => unreachable!("not a quantized codec"),
    }
}

/// The code of `v` on the grid `(c − mid)·step`, `c ∈ 0..levels`.
fn quant_code(v: f32, step: f32, levels: u32) -> u32 {
    let mid = (levels - 1) as f32 / 2.0;
    (v / step + mid).round().clamp(0.0, (levels - 1) as f32) as u32
}

/// Quantize values to a codec: the packed bytes and what the receiver will decode from them
/// (the sender subtracts the latter from its error feedback).
///
/// The step is the sender's choice (receivers read it): the one of a fixed ladder of
/// multiples of the values' RMS with the least squared error. Top-k values are the tails of
/// their chunks, far from Gaussian, so no fixed ratio suits every tensor.
pub fn quantize_values(codec: ValueCodec, vals: &[f32]) -> (Vec<u8>, Vec<f32>) {
    if !codec.is_quantized() {
        let bytes = pack_values(codec, vals);
        let back = unpack_values(codec, &bytes, vals.len());
        return (bytes, back);
    }
    let levels = quant_levels(codec);
    let mid = (levels - 1) as f32 / 2.0;
    let ms = vals.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / vals.len().max(1) as f64;
    let rms = ms.sqrt() as f32;
    let mut step = 0.0f32;
    if rms.is_finite() && rms > 0.0 {
        let mut best = f64::INFINITY;
        // The outermost level at 0.5 … 4.0 RMS in steps of 1/8 (for Gaussian data the best
        // are 1.49 for 4 levels and 2.51 for 16).
        for i in 4..=32 {
            let s = rms * (i as f32 * 0.125) / mid;
            let err: f64 = vals
                .iter()
                .map(|&v| {
                    let q = (quant_code(v, s, levels) as f32 - mid) * s;
                    ((v - q) as f64).powi(2)
                })
                .sum();
            if err < best {
                best = err;
                step = s;
            }
        }
    }
    let codes: Vec<u32> = vals
        .iter()
        .map(|&v| {
            if step == 0.0 {
                levels / 2
            } else {
                quant_code(v, step, levels)
            }
        })
        .collect();
    let mut bytes = step.to_le_bytes().to_vec();
    bytes.extend(pack_bits(&codes, codec.bits()));
    let back = unpack_values(codec, &bytes, vals.len());
    (bytes, back)
}

/// Pack f32 values in a codec (sign: positive or zero → bit set; quantized: see
/// [`quantize_values`]).
pub fn pack_values(codec: ValueCodec, vals: &[f32]) -> Vec<u8> {
    match codec {
        ValueCodec::Sign => {
            let bits: Vec<u32> = vals.iter().map(|&v| (v >= 0.0) as u32).collect();
            pack_bits(&bits, 1)
        }
        ValueCodec::Bf16 => vals
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_bits().to_le_bytes())
            .collect(),
        ValueCodec::F32 => vals.iter().flat_map(|&v| v.to_le_bytes()).collect(),
        ValueCodec::Q2 | ValueCodec::Q4 => quantize_values(codec, vals).0,
    }
}

/// Unpack `n` values (sign bits decode as ±1; quantized codes as `(c − mid)·step`, one f32
/// multiply each, so every node decodes the same floats).
pub fn unpack_values(codec: ValueCodec, bytes: &[u8], n: usize) -> Vec<f32> {
    match codec {
        ValueCodec::Sign => unpack_bits(bytes, 1, n)
            .into_iter()
            .map(|b| if b == 1 { 1.0 } else { -1.0 })
            .collect(),
        ValueCodec::Bf16 => bytes[..2 * n]
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        ValueCodec::F32 => bytes[..4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        ValueCodec::Q2 | ValueCodec::Q4 => {
            let levels = quant_levels(codec);
            let mid = (levels - 1) as f32 / 2.0;
            let step = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            unpack_bits(&bytes[4..], codec.bits(), n)
                .into_iter()
                .map(|c| (c as f32 - mid) * step)
                .collect()
        }
    }
}

impl TensorUpdate {
    /// Build from per-block indices (any order within a block) and their values; sorts each
    /// block's entries by index so the encoding is canonical.
    pub fn from_entries(
        t: &TensorLayout,
        k: usize,
        codec: ValueCodec,
        idx: &[u32],
        vals: &[f32],
    ) -> TensorUpdate {
        Self::from_entries_dequantized(t, k, codec, idx, vals).0
    }

    /// [`TensorUpdate::from_entries`], also returning the values a receiver will decode, in
    /// the order of `vals` (what a sender with error feedback subtracts from its buffer).
    pub fn from_entries_dequantized(
        t: &TensorLayout,
        k: usize,
        codec: ValueCodec,
        idx: &[u32],
        vals: &[f32],
    ) -> (TensorUpdate, Vec<f32>) {
        assert_eq!(idx.len(), t.blocks() * k);
        assert_eq!(vals.len(), idx.len());
        let mut si = Vec::with_capacity(idx.len());
        let mut sv = Vec::with_capacity(idx.len());
        let mut pos = Vec::with_capacity(idx.len());
        let mut order: Vec<usize> = Vec::with_capacity(k);
        for b in 0..t.blocks() {
            order.clear();
            order.extend(b * k..(b + 1) * k);
            order.sort_by_key(|&i| idx[i]);
            for &i in &order {
                si.push(idx[i]);
                sv.push(vals[i]);
                pos.push(i);
            }
        }
        let (values, back) = quantize_values(codec, &sv);
        let mut deq = vec![0f32; vals.len()];
        for (j, &i) in pos.iter().enumerate() {
            deq[i] = back[j];
        }
        (
            TensorUpdate {
                shape: t.shape.clone(),
                chunk: [t.h as u32, t.w as u32],
                k: k as u32,
                indices: pack_bits(&si, index_bits(t.block_elems())),
                values,
            },
            deq,
        )
    }

    /// Indices and values, block-major (call only on a validated update).
    pub fn entries(&self, codec: ValueCodec) -> (Vec<u32>, Vec<f32>) {
        let (rows, cols) = view(&self.shape);
        let (h, w) = (self.chunk[0].max(1) as usize, self.chunk[1].max(1) as usize);
        let count = (rows / h) * (cols / w) * self.k as usize;
        (
            unpack_bits(&self.indices, index_bits(h * w), count),
            unpack_values(codec, &self.values, count),
        )
    }
}

/// The 2-D view of a tensor: `[d0, d1·d2·…]`, a 1-D tensor as `[1, n]`, a scalar as `[1, 1]`.
fn view(shape: &[u32]) -> (usize, usize) {
    match shape.len() {
        0 => (1, 1),
        1 => (1, shape[0] as usize),
        _ => (
            shape[0] as usize,
            shape[1..].iter().map(|&x| x as usize).product(),
        ),
    }
}

impl SparseUpdate {
    /// Canonical CBOR bytes (the blob on the wire).
    pub fn encode(&self) -> Vec<u8> {
        serde_cbor::to_vec(self).expect("plain data always serializes")
    }

    /// Decode untrusted bytes. The size is checked before anything is parsed; the result still
    /// needs [`SparseUpdate::validate`] against the run's layout.
    pub fn decode(bytes: &[u8], max_len: usize) -> Result<SparseUpdate, SparseError> {
        if bytes.len() > max_len {
            return Err(SparseError::Oversize {
                len: bytes.len(),
                max: max_len,
            });
        }
        let u: SparseUpdate = serde_cbor::from_slice(bytes)
            .map_err(|e| SparseError::Malformed(crate::error::CborError::Serde(e.to_string())))?;
        // Canonical form: re-encoding must give the same bytes, so one content has one id.
        if u.encode() != bytes {
            return Err(SparseError::NotCanonical);
        }
        Ok(u)
    }

    /// Check an update against the run's layout, `k` and codec: shapes, chunk sizes, lengths,
    /// every index in range and strictly ascending within its block, values finite, padding
    /// bits zero.
    pub fn validate(&self, layout: &Layout, k: u32, codec: ValueCodec) -> Result<(), SparseError> {
        if self.codec != codec {
            return Err(SparseError::CodecMismatch {
                got: self.codec,
                want: codec,
            });
        }
        if self.tensors.len() != layout.tensors.len() {
            return Err(SparseError::TensorCount {
                got: self.tensors.len(),
                want: layout.tensors.len(),
            });
        }
        for (ti, (u, t)) in self.tensors.iter().zip(&layout.tensors).enumerate() {
            if u.shape != t.shape {
                return Err(SparseError::ShapeMismatch {
                    tensor: ti,
                    got: u.shape.clone(),
                    want: t.shape.clone(),
                });
            }
            let want_chunk = [t.h as u32, t.w as u32];
            if u.chunk != want_chunk {
                return Err(SparseError::ChunkMismatch {
                    tensor: ti,
                    got: u.chunk,
                    want: want_chunk,
                });
            }
            let ke = t.k_eff(k);
            if u.k as usize != ke {
                return Err(SparseError::TopKMismatch {
                    tensor: ti,
                    got: u.k,
                    want: ke as u32,
                });
            }
            let n = t.blocks() * ke;
            let bits = index_bits(t.block_elems());
            let want_idx = (n * bits as usize).div_ceil(8);
            if u.indices.len() != want_idx {
                return Err(SparseError::LengthMismatch {
                    tensor: ti,
                    what: "indices",
                    got: u.indices.len(),
                    want: want_idx,
                });
            }
            let want_val = values_len(codec, n);
            if u.values.len() != want_val {
                return Err(SparseError::LengthMismatch {
                    tensor: ti,
                    what: "values",
                    got: u.values.len(),
                    want: want_val,
                });
            }
            if !padding_zero(&u.indices, n * bits as usize)
                || !padding_zero(&u.values, values_used_bits(codec, n))
            {
                return Err(SparseError::NonZeroPadding { tensor: ti });
            }
            // Stream the indices (no allocation): this check runs on every received blob.
            let elems = t.block_elems();
            let mut it = BitReader::new(&u.indices, bits);
            for b in 0..t.blocks() {
                let mut prev: Option<u32> = None;
                for _ in 0..ke {
                    let i = it.next_value();
                    if i as usize >= elems {
                        return Err(SparseError::IndexOutOfRange {
                            tensor: ti,
                            block: b,
                            index: i,
                            elems,
                        });
                    }
                    if prev.is_some_and(|p| i <= p) {
                        return Err(SparseError::DuplicateIndex {
                            tensor: ti,
                            block: b,
                            index: i,
                        });
                    }
                    prev = Some(i);
                }
            }
            // An exponent of all ones is ±inf or NaN, in f32 and bf16 alike.
            let bad = match codec {
                ValueCodec::Sign => None,
                // The scale: finite and not negative (a negative step would flip every value,
                // and −0.0 would give one content two encodings).
                ValueCodec::Q2 | ValueCodec::Q4 => {
                    let s =
                        u32::from_le_bytes([u.values[0], u.values[1], u.values[2], u.values[3]]);
                    (s & 0x7f80_0000 == 0x7f80_0000 || s >> 31 == 1).then_some(0)
                }
                ValueCodec::Bf16 => u
                    .values
                    .chunks_exact(2)
                    .position(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80),
                ValueCodec::F32 => u.values.chunks_exact(4).position(|c| {
                    u32::from_le_bytes([c[0], c[1], c[2], c[3]]) & 0x7f80_0000 == 0x7f80_0000
                }),
            };
            if let Some(p) = bad {
                return Err(SparseError::NonFinite {
                    tensor: ti,
                    position: p,
                });
            }
        }
        Ok(())
    }
}

fn padding_zero(bytes: &[u8], used_bits: usize) -> bool {
    let rem = used_bits % 8;
    rem == 0 || bytes.last().is_none_or(|&b| b >> rem == 0)
}

/// Bytes of one encoded update for a layout, without building the model: encodes an update of
/// the right lengths (all zero bytes), so the figure includes the CBOR framing exactly.
pub fn encoded_size(layout: &Layout, k: u32, codec: ValueCodec) -> usize {
    let tensors = layout
        .tensors
        .iter()
        .map(|t| {
            let ke = t.k_eff(k);
            let n = t.blocks() * ke;
            TensorUpdate {
                shape: t.shape.clone(),
                chunk: [t.h as u32, t.w as u32],
                k: ke as u32,
                indices: vec![0; (n * index_bits(t.block_elems()) as usize).div_ceil(8)],
                values: vec![0; values_len(codec, n)],
            }
        })
        .collect();
    SparseUpdate { codec, tensors }.encode().len()
}

pub mod exact;
pub use exact::*;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_rule_on_awkward_sizes() {
        assert_eq!(chunk_len(50257, 64), 29); // 50257 = 29 · 1733
        assert_eq!(chunk_len(4096, 64), 64);
        assert_eq!(chunk_len(65521, 64), 1); // a prime
        assert_eq!(chunk_len(48, 64), 48);
        assert_eq!(chunk_len(96, 64), 48);
        // 1-D: a [1, n] view chunked along its only axis.
        let t = TensorLayout::new("norm", &[384], 64);
        assert_eq!((t.rows, t.cols, t.h, t.w, t.blocks()), (1, 384, 1, 64, 6));
        // 3-D: flattened to [d0, d1·d2].
        let t = TensorLayout::new("conv", &[8, 3, 100], 64);
        assert_eq!((t.rows, t.cols, t.h, t.w), (8, 300, 8, 60));
        assert_eq!(t.blocks(), 5);
        // A prime row count gives 1-row blocks of 64: k=32 keeps half of each.
        let t = TensorLayout::new("p", &[65521, 64], 64);
        assert_eq!((t.h, t.w, t.k_eff(32)), (1, 64, 32));
    }

    #[test]
    fn index_bits_fit_block() {
        assert_eq!(index_bits(4096), 12);
        assert_eq!(index_bits(64), 6);
        assert_eq!(index_bits(65), 7);
        assert_eq!(index_bits(2), 1);
        assert_eq!(index_bits(1), 0);
    }

    #[test]
    fn pack_roundtrip_every_width() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for bits in 0..=32u32 {
            let vals: Vec<u32> = (0..1000)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if bits == 0 {
                        0
                    } else {
                        (x as u32) & (((1u64 << bits) - 1) as u32)
                    }
                })
                .collect();
            let p = pack_bits(&vals, bits);
            assert_eq!(p.len(), (1000 * bits as usize).div_ceil(8));
            assert_eq!(unpack_bits(&p, bits, vals.len()), vals, "width {bits}");
        }
    }

    #[test]
    fn sign_values_decode_as_unit() {
        let v = [0.3f32, -2.0, 0.0, -0.001, 7.0];
        let p = pack_values(ValueCodec::Sign, &v);
        assert_eq!(p.len(), 1);
        assert_eq!(
            unpack_values(ValueCodec::Sign, &p, 5),
            vec![1.0, -1.0, 1.0, -1.0, 1.0]
        );
    }

    fn layout() -> Layout {
        Layout::from_shapes(&[("a".into(), vec![128, 64]), ("b".into(), vec![100])], 64)
    }

    fn update(l: &Layout) -> SparseUpdate {
        let tensors = l
            .tensors
            .iter()
            .map(|t| {
                let k = t.k_eff(4);
                let idx: Vec<u32> = (0..t.blocks())
                    .flat_map(|b| {
                        (0..k as u32).map(move |i| (i * 7 + b as u32) % t.block_elems() as u32)
                    })
                    .collect();
                let vals: Vec<f32> = (0..idx.len()).map(|i| i as f32 - 3.5).collect();
                TensorUpdate::from_entries(t, k, ValueCodec::F32, &idx, &vals)
            })
            .collect();
        SparseUpdate {
            codec: ValueCodec::F32,
            tensors,
        }
    }

    #[test]
    fn validate_accepts_good_and_names_each_fault() {
        let l = layout();
        let u = update(&l);
        u.validate(&l, 4, ValueCodec::F32).unwrap();
        let bytes = u.encode();
        assert_eq!(SparseUpdate::decode(&bytes, 1 << 20).unwrap(), u);
        assert!(matches!(
            SparseUpdate::decode(&bytes, 10),
            Err(SparseError::Oversize { .. })
        ));
        assert!(matches!(
            SparseUpdate::decode(&bytes[..bytes.len() - 3], 1 << 20),
            Err(SparseError::Malformed(_))
        ));
        // The same map with its length in a longer form than needed: it parses, but one
        // content would have two ids.
        assert_eq!(bytes[0], 0xa2, "a map of two fields");
        let long: Vec<u8> = [0xb8, 2]
            .into_iter()
            .chain(bytes[1..].iter().copied())
            .collect();
        assert_eq!(
            SparseUpdate::decode(&long, 1 << 20),
            Err(SparseError::NotCanonical)
        );

        let mut bad = u.clone();
        bad.tensors[0].shape = vec![64, 128];
        assert!(matches!(
            bad.validate(&l, 4, ValueCodec::F32),
            Err(SparseError::ShapeMismatch { .. })
        ));

        // Block 0 of tensor 0 holds indices sorted ascending; swap two to make them repeat.
        let mut bad = u.clone();
        let t = &l.tensors[0];
        let (mut idx, _) = bad.tensors[0].entries(ValueCodec::F32);
        idx[1] = idx[0];
        bad.tensors[0].indices = pack_bits(&idx, index_bits(t.block_elems()));
        assert!(matches!(
            bad.validate(&l, 4, ValueCodec::F32),
            Err(SparseError::DuplicateIndex { .. })
        ));

        let mut bad = u.clone();
        let (_, mut v) = bad.tensors[1].entries(ValueCodec::F32);
        v[2] = f32::NAN;
        bad.tensors[1].values = pack_values(ValueCodec::F32, &v);
        assert!(matches!(
            bad.validate(&l, 4, ValueCodec::F32),
            Err(SparseError::NonFinite {
                tensor: 1,
                position: 2
            })
        ));

        // Tensor b is [1, 100]: one block of 50 (largest divisor of 100 ≤ 64), 6-bit indices.
        let mut bad = u.clone();
        let (mut idx, _) = bad.tensors[1].entries(ValueCodec::F32);
        idx[3] = 63;
        bad.tensors[1].indices = pack_bits(&idx, 6);
        assert!(matches!(
            bad.validate(&l, 4, ValueCodec::F32),
            Err(SparseError::IndexOutOfRange { .. })
        ));

        assert!(matches!(
            u.validate(&l, 8, ValueCodec::F32),
            Err(SparseError::TopKMismatch { .. })
        ));
        assert!(matches!(
            u.validate(&l, 4, ValueCodec::Sign),
            Err(SparseError::CodecMismatch { .. })
        ));
    }

    #[test]
    fn quantized_values_round_trip_and_validate() {
        let vals = [0.9f32, -0.1, 2.5, -3.0, 0.0, 0.4, -0.6];
        for (codec, levels) in [(ValueCodec::Q2, 4u32), (ValueCodec::Q4, 16)] {
            let (bytes, back) = quantize_values(codec, &vals);
            assert_eq!(bytes.len(), values_len(codec, vals.len()));
            assert_eq!(
                bytes.len(),
                4 + (vals.len() * codec.bits() as usize).div_ceil(8)
            );
            assert_eq!(unpack_values(codec, &bytes, vals.len()), back);
            let step = f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            assert!(step > 0.0);
            let mid = (levels - 1) as f32 / 2.0;
            for (&v, &b) in vals.iter().zip(&back) {
                // A level of the grid, the nearest one unless v lies beyond the outermost.
                let c = b / step + mid;
                assert!((c - c.round()).abs() < 1e-5 && (0.0..levels as f32).contains(&c));
                if v.abs() <= mid * step {
                    assert!((v - b).abs() <= 0.5 * step + 1e-6, "{codec:?} {v} -> {b}");
                }
                if v != 0.0 {
                    assert_eq!(
                        v > 0.0,
                        b > 0.0,
                        "{codec:?}: the sign survives ({v} -> {b})"
                    );
                }
            }
            // More bits, closer values.
        }
        let e = |c| {
            let (_, b) = quantize_values(c, &vals);
            vals.iter()
                .zip(&b)
                .map(|(v, b)| (v - b).powi(2))
                .sum::<f32>()
        };
        assert!(e(ValueCodec::Q4) < e(ValueCodec::Q2));

        // On the wire: a good update validates; a negative, infinite or NaN scale and
        // non-zero padding are each refused before anything is decoded.
        let l = layout();
        let tensors: Vec<TensorUpdate> = l
            .tensors
            .iter()
            .map(|t| {
                let k = t.k_eff(4);
                let idx: Vec<u32> = (0..t.blocks())
                    .flat_map(|b| {
                        (0..k as u32).map(move |i| (i * 7 + b as u32) % t.block_elems() as u32)
                    })
                    .collect();
                let v: Vec<f32> = (0..idx.len()).map(|i| i as f32 - 3.3).collect();
                TensorUpdate::from_entries(t, k, ValueCodec::Q2, &idx, &v)
            })
            .collect();
        let u = SparseUpdate {
            codec: ValueCodec::Q2,
            tensors,
        };
        u.validate(&l, 4, ValueCodec::Q2).unwrap();
        assert_eq!(u.encode().len(), encoded_size(&l, 4, ValueCodec::Q2));
        for scale in [-1.0f32, f32::INFINITY, f32::NAN, -0.0] {
            let mut bad = u.clone();
            bad.tensors[1].values[..4].copy_from_slice(&scale.to_le_bytes());
            assert!(
                matches!(
                    bad.validate(&l, 4, ValueCodec::Q2),
                    Err(SparseError::NonFinite { tensor: 1, .. })
                ),
                "scale {scale}"
            );
        }
        // Tensor b: 4 values of 2 bits fill one byte exactly; tensor a: 8 blocks·4 = 32 values.
        let mut bad = u.clone();
        bad.tensors[0].values.push(0);
        assert!(matches!(
            bad.validate(&l, 4, ValueCodec::Q2),
            Err(SparseError::LengthMismatch { .. })
        ));
        let l3 = Layout::from_shapes(&[("c".into(), vec![3])], 64);
        let t3 = &l3.tensors[0];
        let mut odd = SparseUpdate {
            codec: ValueCodec::Q2,
            tensors: vec![TensorUpdate::from_entries(
                t3,
                3,
                ValueCodec::Q2,
                &[0, 1, 2],
                &[1.0, -1.0, 0.5],
            )],
        };
        odd.validate(&l3, 3, ValueCodec::Q2).unwrap();
        *odd.tensors[0].values.last_mut().unwrap() |= 0x80;
        assert!(matches!(
            odd.validate(&l3, 3, ValueCodec::Q2),
            Err(SparseError::NonZeroPadding { .. })
        ));
    }

    #[test]
    fn size_of_1_2b_update() {
        let m = ModelConfig::named("1.2b", 0).unwrap();
        let l = Layout::for_model(&m, 64);
        let bytes = encoded_size(&l, 4, ValueCodec::Sign);
        // 12-bit indices + 1 sign bit for 4 coefficients per 64×64 block.
        assert!(bytes < 2_500_000, "{bytes}");
    }
}
