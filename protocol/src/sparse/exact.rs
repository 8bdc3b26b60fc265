//! Aggregation and the exact decode.
//!
//! Every honest node must turn the same set of updates into bit-identical parameters, on CPU
//! or CUDA, with any thread count and in any arrival order. Floating-point matmuls round
//! differently on each device, so the decode is made exact instead:
//!
//! 1. The per-coefficient mean over the updates that kept it (or, with `Combine::Share`, the
//!    weighted sum over all included updates divided by their total weight: see
//!    [`aggregate_round`]) is computed here, in plain Rust, in a canonical order (updates sorted by content id; for 1-bit values the sums are small
//!    integers and order does not matter at all).
//! 2. Each block's means are scaled by a power of two fixed by the block's largest magnitude
//!    and rounded to integers `Yq` with `|Yq| ≤ 2^A`. The sign of the decoded block does not
//!    depend on a positive scale, so this costs nothing but rounding at 2^-A of the block max.
//! 3. The DCT basis is rounded to integers `Fq = round(F·2^B)` with `B = BASIS_BITS`.
//! 4. The decode `Fq_h · Yq · Fq_wᵀ` is then a sum of integer products. Every partial sum is
//!    bounded by `(Σ_b |Fq_h[j,b]|)·(Σ_d |Fq_w[i,d]|)·2^A ≤ (2^B·√h + h/2)(2^B·√w + w/2)·2^A`
//!    (rows of F have unit norm, so `Σ|F| ≤ √n`; rounding adds at most ½ per entry).
//!    [`coef_bits`] picks `A` so that bound is `≤ 2^52`: every intermediate is an exact
//!    integer in f64, so any summation order, blocking or FMA gives the same result, and
//!    `sign` of it is exact.
//!
//! Local steps apply the decoded values themselves, not their sign (`train::demo::DctCodec::
//! exact_values`). Step 4's integer `Z` is exact, and the block's values are
//! `Z · 2^-(A − e) · 2^-2B`: multiplying by a power of two is exact in f64 (barring underflow
//! far below f32's range), and the one rounding to f32 is IEEE round-to-nearest-even on every
//! device. The values differ from the float decode only by the rounding of `Y` at `2^-A` of
//! its block maximum (relative ≤ 2^-18 for 64×64 blocks) and of `F` at `2^-B`. Without the
//! DCT there is no decode at all: each combined f64 is rounded once to f32 and scattered into
//! zeros (padding entries add an exact 0). The outer step `p − f32(lr)·v` is then two
//! correctly rounded f32 operations per element, as the sign step is.

use super::{Layout, SparseUpdate};
use crate::config::Combine;

/// Bits of the quantized DCT basis.
pub const BASIS_BITS: u32 = 14;

/// The orthonormal DCT-II basis for length `n`, row-major `F[j·n + b] = c_b·cos(π(2j+1)b/2n)`
/// (j: position, b: frequency). Encode a block X as Fᵀ·X·F, decode Y as F·Y·Fᵀ.
pub fn dct_basis(n: usize) -> Vec<f64> {
    let mut f = vec![0.0; n * n];
    for j in 0..n {
        for b in 0..n {
            let c = if b == 0 {
                (1.0 / n as f64).sqrt()
            } else {
                (2.0 / n as f64).sqrt()
            };
            f[j * n + b] =
                c * (std::f64::consts::PI * (2 * j + 1) as f64 * b as f64 / (2 * n) as f64).cos();
        }
    }
    f
}

/// `round(F·2^BASIS_BITS)`: small integers, held in f64 for the exact matmul.
pub fn dct_basis_quantized(n: usize) -> Vec<f64> {
    let scale = (1u64 << BASIS_BITS) as f64;
    dct_basis(n)
        .into_iter()
        .map(|x| (x * scale).round_ties_even())
        .collect()
}

/// Bits `A` of the quantized coefficients for an `h × w` block (see the module docs).
pub fn coef_bits(h: usize, w: usize) -> u32 {
    let b = (1u64 << BASIS_BITS) as f64;
    let fh = b * (h as f64).sqrt() + h as f64 / 2.0;
    let fw = b * (w as f64).sqrt() + w as f64 / 2.0;
    let a = (52.0 - (fh * fw).log2()).floor();
    a.clamp(0.0, 24.0) as u32
}

/// One tensor's aggregated coefficients, sparse: for block `b`, entries
/// `offsets[b]..offsets[b+1]` of `index` (ascending within the block) and `mean`.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorAggregate {
    pub offsets: Vec<u32>,
    pub index: Vec<u32>,
    /// The mean over the senders that kept each coefficient.
    pub mean: Vec<f64>,
}

impl TensorAggregate {
    /// Most coefficients any block holds.
    pub fn max_nnz(&self) -> usize {
        self.offsets
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0)
    }

    /// Dense block-major means (`[blocks][elems]`), zero where nobody kept a coefficient.
    pub fn dense(&self, elems: usize) -> Vec<f64> {
        let blocks = self.offsets.len() - 1;
        let mut out = vec![0.0; blocks * elems];
        for b in 0..blocks {
            for e in self.offsets[b] as usize..self.offsets[b + 1] as usize {
                out[b * elems + self.index[e] as usize] = self.mean[e];
            }
        }
        out
    }
}

/// Aggregated coefficients of every tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Aggregate {
    pub tensors: Vec<TensorAggregate>,
    /// How many updates went in.
    pub count: usize,
}

/// Per-coefficient mean over the updates that selected it (the DeMo reference). `updates` must
/// be validated against `layout` and share one codec. Sums run in the order of the updates'
/// content ids (blake3 of their bytes), so the result does not depend on arrival order; for
/// 1-bit values they are small integers and exact in any order anyway.
pub fn aggregate(layout: &Layout, updates: &[&SparseUpdate]) -> Aggregate {
    let scale = vec![1.0; updates.len()];
    combine_scaled(layout, updates, &scale, Denominator::Keepers)
}

/// Largest weight one update gets in [`aggregate_round`] (a full nominal batch).
pub const MAX_WEIGHT: u32 = 16;

/// An update's weight from the tokens its header states: proportional to
/// `min(tokens, nominal)` in steps of `nominal / MAX_WEIGHT`, at least 1. The cap means a
/// sender gains nothing by overstating its tokens beyond the run's batch; an understated count
/// only costs the sender influence. Integers, so sign-valued sums stay exact.
pub fn token_weight(tokens: u64, nominal: u64) -> u32 {
    if nominal == 0 {
        return MAX_WEIGHT;
    }
    let t = tokens.min(nominal) as u128;
    let w = (t * MAX_WEIGHT as u128 + nominal as u128 / 2) / nominal as u128;
    (w as u32).clamp(1, MAX_WEIGHT)
}

/// Combine one round's included updates as the run says, each given with the tokens its
/// header states (`nominal`: the run's tokens per full local batch).
///
/// * [`Combine::Mean`]: [`aggregate`], tokens ignored (the reference).
/// * [`Combine::Share`]: per coefficient `Σ wᵢ·cᵢ·vᵢ / Σ wᵢ` over **all** included updates, where
///   `wᵢ = token_weight(tokensᵢ)` and `cᵢ = min(1, median‖v‖ / ‖vᵢ‖)` clips float-valued updates to
///   the round's median L2 norm (for sign values every update has the same norm, so `cᵢ = 1`).
///   A coefficient only one update kept therefore moves by that update's weight share, not by
///   its full value, and no update can outweigh others by inflating its values. Everything is a
///   function of the included set and their headers, so every node that includes the same set
///   computes the same aggregate.
pub fn aggregate_round(
    layout: &Layout,
    combine: Combine,
    nominal: u64,
    updates: &[(&SparseUpdate, u64)],
) -> Aggregate {
    let refs: Vec<&SparseUpdate> = updates.iter().map(|u| u.0).collect();
    match combine {
        Combine::Mean => aggregate(layout, &refs),
        Combine::Root => {
            let scale = vec![1.0; refs.len()];
            combine_scaled(layout, &refs, &scale, Denominator::Root(refs.len()))
        }
        Combine::Share => {
            let w: Vec<f64> = updates
                .iter()
                .map(|u| token_weight(u.1, nominal) as f64)
                .collect();
            let norms: Vec<f64> = refs.iter().map(|u| value_norm(u)).collect();
            let mut sorted = norms.clone();
            sorted.sort_by(|a, b| a.total_cmp(b));
            // The lower median: a fixed rule, and with an honest majority an honest norm.
            let med = sorted
                .get(sorted.len().saturating_sub(1) / 2)
                .copied()
                .unwrap_or(0.0);
            let scale: Vec<f64> = w
                .iter()
                .zip(&norms)
                .map(|(&wi, &n)| {
                    if n > med && n > 0.0 {
                        wi * (med / n)
                    } else {
                        wi
                    }
                })
                .collect();
            let total: f64 = w.iter().sum();
            combine_scaled(layout, &refs, &scale, Denominator::Fixed(total))
        }
    }
}

/// L2 norm of an update's values over all tensors (√(k·blocks) for sign values).
fn value_norm(u: &SparseUpdate) -> f64 {
    let mut s = 0.0f64;
    for t in &u.tensors {
        let (_, v) = t.entries(u.codec);
        for x in v {
            s += (x as f64) * (x as f64);
        }
    }
    s.sqrt()
}

/// What a coefficient's sum `Σ scaleᵢ·vᵢ` is divided by.
#[derive(Clone, Copy)]
enum Denominator {
    /// The number `n` of updates that kept the coefficient (the reference mean).
    Keepers,
    /// A fixed total weight.
    Fixed(f64),
    /// `√(n·N)` for `N` included updates ([`Combine::Root`]).
    Root(usize),
}

impl Denominator {
    fn of(self, keepers: u32) -> f64 {
        match self {
            Denominator::Keepers => keepers as f64,
            Denominator::Fixed(d) => d,
            // Both factors are small integers, so the product is exact and `sqrt` is the one
            // correctly rounded operation: the same bits on every device.
            Denominator::Root(n) => (keepers as f64 * n as f64).sqrt(),
        }
    }
}

/// Per coefficient `Σ scaleᵢ·vᵢ`, divided as `denominator` says.
fn combine_scaled(
    layout: &Layout,
    updates: &[&SparseUpdate],
    scale: &[f64],
    denominator: Denominator,
) -> Aggregate {
    let mut order: Vec<(blake3::Hash, usize)> = updates
        .iter()
        .enumerate()
        .map(|(i, u)| (blake3::hash(&u.encode()), i))
        .collect();
    order.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    let mut tensors = Vec::with_capacity(layout.tensors.len());
    for (ti, t) in layout.tensors.iter().enumerate() {
        let entries: Vec<(Vec<u32>, Vec<f32>, usize, f64)> = order
            .iter()
            .map(|&(_, ui)| {
                let tu = &updates[ui].tensors[ti];
                let (i, v) = tu.entries(updates[ui].codec);
                (i, v, tu.k as usize, scale[ui])
            })
            .collect();
        let blocks = t.blocks();
        let mut offsets = Vec::with_capacity(blocks + 1);
        let mut index = Vec::new();
        let mut mean = Vec::new();
        offsets.push(0u32);
        let mut scratch: Vec<(u32, f64)> = Vec::new();
        for b in 0..blocks {
            scratch.clear();
            for (idx, vals, k, c) in &entries {
                scratch.extend(
                    idx[b * k..(b + 1) * k]
                        .iter()
                        .copied()
                        .zip(vals[b * k..(b + 1) * k].iter().map(|&v| v as f64 * c)),
                );
            }
            // Stable: equal indices keep the canonical update order, so float sums are fixed.
            scratch.sort_by_key(|e| e.0);
            let mut i = 0;
            while i < scratch.len() {
                let id = scratch[i].0;
                let mut sum = 0.0f64;
                let mut n = 0u32;
                while i < scratch.len() && scratch[i].0 == id {
                    sum += scratch[i].1;
                    n += 1;
                    i += 1;
                }
                index.push(id);
                mean.push(sum / denominator.of(n));
            }
            offsets.push(index.len() as u32);
        }
        tensors.push(TensorAggregate {
            offsets,
            index,
            mean,
        });
    }
    Aggregate {
        tensors,
        count: updates.len(),
    }
}

/// Exponent `e` with `2^e ≥ x` for finite `x > 0` (from the bits, so it is exact everywhere).
fn ceil_exp2(x: f64) -> i32 {
    let bits = x.to_bits();
    let exp = ((bits >> 52) & 0x7ff) as i32;
    let mant = bits & ((1u64 << 52) - 1);
    if exp == 0 {
        return -1074; // subnormal: any tiny exponent works, 2^-1074 ≤ x ≤ 2^-1022
    }
    let e = exp - 1023; // x = 1.m · 2^e
    if mant == 0 {
        e
    } else {
        e + 1
    }
}

/// Quantize one tensor's aggregated means to integers for the exact decode: per block,
/// `round(y · 2^(A − e))` where `2^e ≥ max|y|`, so `|Yq| ≤ 2^A`. Returned in the same sparse
/// order as `t.mean`.
pub fn quantize_blocks(t: &TensorAggregate, h: usize, w: usize) -> Vec<f64> {
    quantize_blocks_scaled(t, h, w).0
}

/// [`quantize_blocks`], also returning each block's shift `A − e`: the block's values are
/// `Yq · 2^-(A − e)`, so a decode that needs magnitudes (local steps' outer step) rescales the
/// exact integer result by a power of two, which is itself exact.
pub fn quantize_blocks_scaled(t: &TensorAggregate, h: usize, w: usize) -> (Vec<f64>, Vec<i32>) {
    let a = coef_bits(h, w) as i32;
    let mut out = vec![0.0; t.mean.len()];
    let mut shifts = vec![0i32; t.offsets.len() - 1];
    for b in 0..t.offsets.len() - 1 {
        let r = t.offsets[b] as usize..t.offsets[b + 1] as usize;
        let blk = &t.mean[r.clone()];
        let m = blk.iter().fold(0.0f64, |m, &x| m.max(x.abs()));
        if m == 0.0 {
            continue;
        }
        let shift = a - ceil_exp2(m);
        shifts[b] = shift;
        // Scaling by a power of two in two steps keeps it exact even for extreme shifts.
        let s1 = 2f64.powi(shift / 2);
        let s2 = 2f64.powi(shift - shift / 2);
        for (x, y) in blk.iter().zip(out[r].iter_mut()) {
            *y = (x * s1 * s2).round_ties_even();
        }
    }
    (out, shifts)
}

/// Reference exact decode of one quantized block (`Fq_h · Yq · Fq_wᵀ`), row-major `h × w`.
/// The trainer does the same thing batched on its device; tests compare the two.
pub fn decode_block_exact(yq: &[f64], fh: &[f64], fw: &[f64], h: usize, w: usize) -> Vec<f64> {
    // z = Fq_h · Yq  (h × w)
    let mut z = vec![0.0; h * w];
    for j in 0..h {
        for b in 0..h {
            let f = fh[j * h + b];
            if f == 0.0 {
                continue;
            }
            for d in 0..w {
                z[j * w + d] += f * yq[b * w + d];
            }
        }
    }
    // out = z · Fq_wᵀ, out[j][i] = Σ_d z[j][d]·Fq_w[i][d]
    let mut out = vec![0.0; h * w];
    for j in 0..h {
        for i in 0..w {
            let mut s = 0.0;
            for d in 0..w {
                s += z[j * w + d] * fw[i * w + d];
            }
            out[j * w + i] = s;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ValueCodec;
    use crate::sparse::TensorUpdate;

    #[test]
    fn basis_is_orthonormal() {
        for n in [1usize, 2, 7, 29, 48, 64] {
            let f = dct_basis(n);
            for a in 0..n {
                for b in 0..n {
                    let dot: f64 = (0..n).map(|j| f[j * n + a] * f[j * n + b]).sum();
                    let want = if a == b { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() < 1e-12, "n={n} a={a} b={b} dot={dot}");
                }
            }
        }
    }

    #[test]
    fn quantized_basis_is_far_from_rounding_ties() {
        // A node on another platform whose cos() differs in the last bit must still round the
        // basis to the same integers: no entry may sit near a .5 boundary.
        for n in 1..=128usize {
            for x in dct_basis(n) {
                let s = x * (1u64 << BASIS_BITS) as f64;
                let frac = (s - s.floor() - 0.5).abs();
                assert!(frac > 1e-9, "n={n}: {s} is too close to a tie");
            }
        }
    }

    #[test]
    fn bound_keeps_every_partial_sum_exact() {
        for (h, w) in [(64usize, 64usize), (1, 64), (29, 64), (1, 1), (128, 128)] {
            let a = coef_bits(h, w);
            let qh: f64 = dct_basis_quantized(h)
                .chunks(h)
                .map(|r| r.iter().map(|x| x.abs()).sum::<f64>())
                .fold(0.0, f64::max);
            let qw: f64 = dct_basis_quantized(w)
                .chunks(w)
                .map(|r| r.iter().map(|x| x.abs()).sum::<f64>())
                .fold(0.0, f64::max);
            let bound = qh * qw * 2f64.powi(a as i32);
            assert!(bound < 2f64.powi(53), "({h},{w}) A={a}: {bound}");
            assert!(a >= 16, "({h},{w}) leaves only {a} bits");
        }
    }

    #[test]
    fn aggregate_means_over_selecting_senders() {
        let l = Layout::from_shapes(&[("a".into(), vec![2, 4])], 64);
        let t = &l.tensors[0];
        let mk = |idx: &[u32], v: &[f32]| SparseUpdate {
            codec: ValueCodec::F32,
            tensors: vec![TensorUpdate::from_entries(t, 2, ValueCodec::F32, idx, v)],
        };
        let u1 = mk(&[0, 3], &[1.0, 2.0]);
        let u2 = mk(&[3, 5], &[4.0, -1.0]);
        let a = aggregate(&l, &[&u1, &u2]);
        assert_eq!(
            a.tensors[0].dense(8),
            vec![1.0, 0.0, 0.0, 3.0, 0.0, -1.0, 0.0, 0.0]
        );
        assert_eq!(a.tensors[0].index, vec![0, 3, 5]);
        let b = aggregate(&l, &[&u2, &u1]);
        assert_eq!(a, b);
    }

    #[test]
    fn share_bounds_a_lone_senders_influence_and_weights_tokens() {
        let l = Layout::from_shapes(&[("a".into(), vec![2, 4])], 64);
        let t = &l.tensors[0];
        let mk = |codec, idx: &[u32], v: &[f32]| SparseUpdate {
            codec,
            tensors: vec![TensorUpdate::from_entries(t, 2, codec, idx, v)],
        };
        let s = ValueCodec::Sign;
        // Three agree on coefficient 0; one lone sender alone keeps 5 and 7.
        let h1 = mk(s, &[0, 1], &[1.0, 1.0]);
        let h2 = mk(s, &[0, 2], &[1.0, -1.0]);
        let h3 = mk(s, &[0, 3], &[1.0, 1.0]);
        let bad = mk(s, &[5, 7], &[-1.0, -1.0]);
        let set = [(&h1, 256), (&h2, 256), (&h3, 256), (&bad, 256)];
        let mean = aggregate_round(&l, Combine::Mean, 256, &set).tensors[0].dense(8);
        let share = aggregate_round(&l, Combine::Share, 256, &set).tensors[0].dense(8);
        // The reference gives the lone sender's coefficients full weight, as much as three.
        assert_eq!(mean[0], 1.0);
        assert_eq!(mean[5], -1.0);
        assert_eq!(share[0], 0.75);
        assert_eq!(share[5], -0.25);
        // Order-free.
        let rev = [set[3], set[2], set[1], set[0]];
        assert_eq!(
            aggregate_round(&l, Combine::Share, 256, &rev),
            aggregate_round(&l, Combine::Share, 256, &set)
        );
        // Half the tokens, half the weight; overstating beyond the nominal batch gains nothing.
        assert_eq!(token_weight(128, 256), MAX_WEIGHT / 2);
        assert_eq!(token_weight(10_000, 256), MAX_WEIGHT);
        assert_eq!(token_weight(0, 256), 1);
        let small = [(&h1, 256), (&bad, 128)];
        let a = aggregate_round(&l, Combine::Share, 256, &small).tensors[0].dense(8);
        assert_eq!(a[0], 16.0 / 24.0);
        assert_eq!(a[5], -8.0 / 24.0);
        // Float values are clipped to the round's median norm: ×100 buys nothing.
        let f = ValueCodec::F32;
        let g1 = mk(f, &[0, 1], &[1.0, 0.0]);
        let g2 = mk(f, &[0, 2], &[1.0, 0.0]);
        let big = mk(f, &[0, 3], &[-100.0, 0.0]);
        let a = aggregate_round(&l, Combine::Share, 1, &[(&g1, 1), (&g2, 1), (&big, 1)]);
        let d = a.tensors[0].dense(8);
        assert!((d[0] - 1.0 / 3.0).abs() < 1e-12, "{d:?}");
    }

    #[test]
    fn root_damps_lone_coefficients_by_the_root_of_the_round() {
        let l = Layout::from_shapes(&[("a".into(), vec![2, 4])], 64);
        let t = &l.tensors[0];
        let mk = |idx: &[u32], v: &[f32]| SparseUpdate {
            codec: ValueCodec::F32,
            tensors: vec![TensorUpdate::from_entries(t, 2, ValueCodec::F32, idx, v)],
        };
        // Four updates all keep coefficient 0; coefficient 5 is one sender's alone.
        let us = [
            mk(&[0, 1], &[2.0, 1.0]),
            mk(&[0, 2], &[2.0, 1.0]),
            mk(&[0, 3], &[2.0, 1.0]),
            mk(&[0, 5], &[2.0, 3.0]),
        ];
        let set: Vec<(&SparseUpdate, u64)> = us.iter().map(|u| (u, 256)).collect();
        let root = aggregate_round(&l, Combine::Root, 256, &set).tensors[0].dense(8);
        let mean = aggregate_round(&l, Combine::Mean, 256, &set).tensors[0].dense(8);
        // Kept by all: the mean. Kept by one of four: its value over √4, half of what `mean`
        // gives it and twice what `share` would.
        assert_eq!(root[0], mean[0]);
        assert_eq!(root[0], 2.0);
        assert_eq!(root[5], 1.5);
        assert_eq!(mean[5], 3.0);
        // Arrival order does not matter.
        let rev: Vec<(&SparseUpdate, u64)> = set.iter().rev().copied().collect();
        assert_eq!(
            aggregate_round(&l, Combine::Root, 256, &rev),
            aggregate_round(&l, Combine::Root, 256, &set)
        );
    }

    #[test]
    fn exact_decode_matches_float_decode_in_sign() {
        let (h, w) = (8usize, 16usize);
        let mut x = 12345u64;
        let y: Vec<f64> = (0..h * w)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 11) as f64 / (1u64 << 53) as f64) - 0.5
            })
            .collect();
        let agg = TensorAggregate {
            offsets: vec![0, (h * w) as u32],
            index: (0..(h * w) as u32).collect(),
            mean: y.clone(),
        };
        let yq = quantize_blocks(&agg, h, w);
        let out = decode_block_exact(&yq, &dct_basis_quantized(h), &dct_basis_quantized(w), h, w);
        let float = decode_block_exact(&y, &dct_basis(h), &dct_basis(w), h, w);
        let agree = out
            .iter()
            .zip(&float)
            .filter(|(a, b)| a.signum() == b.signum())
            .count();
        assert!(agree >= h * w - 1, "{agree} of {}", h * w);
        assert!(out.iter().all(|v| v.fract() == 0.0));
    }
}
