//! DeMo on tch: momentum, chunked orthonormal DCT-II, per-chunk top-k, the decoupling, and the
//! exact aggregate-and-apply.
//!
//! Everything is batched by block shape: all blocks of all tensors that share an `h × w`
//! chunk are stacked into one `[blocks, h, w]` tensor, so a Llama model costs a handful of
//! large matmuls per step (one group for the 64×64 matrices, one for the 1×64 norms, …),
//! not a loop per tensor.

use protocol::config::{OptimConfig, ValueCodec};
use protocol::sparse::{self, Aggregate, Layout, SparseUpdate, TensorLayout, TensorUpdate};
use tch::{Device, Kind, Tensor};

/// Tensors sharing one block shape.
struct Group {
    h: usize,
    w: usize,
    tensors: Vec<usize>,
    fh: Tensor,
    fw: Tensor,
    /// Transposed bases (rows = frequencies), for gathering one basis vector per coefficient.
    fht: Tensor,
    fwt: Tensor,
    /// Quantized bases, transposed like `fht`/`fwt`, for the exact decode.
    fhqt: Tensor,
    fwqt: Tensor,
}

/// The DCT codec for one model layout on one device.
pub struct DctCodec {
    pub layout: Layout,
    groups: Vec<Group>,
    device: Device,
    /// The exact decode's temporaries per slice (see [`DctCodec::slice_bytes`]).
    slice_bytes: usize,
}

/// Default decode slice: 32 MB of temporaries, a few hundred 64×64 blocks at 32 updates.
pub const SLICE_BYTES: usize = 32 << 20;

fn to_blocks(t: &Tensor, l: &TensorLayout) -> Tensor {
    let (r, c, h, w) = (l.rows as i64, l.cols as i64, l.h as i64, l.w as i64);
    t.reshape([r / h, h, c / w, w])
        .permute([0, 2, 1, 3])
        .reshape([-1, h, w])
}

fn from_blocks(b: &Tensor, l: &TensorLayout) -> Tensor {
    let (r, c, h, w) = (l.rows as i64, l.cols as i64, l.h as i64, l.w as i64);
    let shape: Vec<i64> = l.shape.iter().map(|&x| x as i64).collect();
    b.reshape([r / h, c / w, h, w])
        .permute([0, 2, 1, 3])
        .reshape(&shape[..])
}

/// `t -= from_blocks(blocks)` without materializing `from_blocks`: the subtraction runs on a
/// permuted view of `t` (in place, strided), saving a copy of the tensor per encode.
fn subtract_blocks(t: &mut Tensor, blocks: &Tensor, l: &TensorLayout) {
    let (r, c, h, w) = (l.rows as i64, l.cols as i64, l.h as i64, l.w as i64);
    if t.is_contiguous() {
        let _ = t
            .view([r / h, h, c / w, w])
            .permute([0, 2, 1, 3])
            .g_sub_(&blocks.view([r / h, c / w, h, w]));
    } else {
        let _ = t.g_sub_(&from_blocks(blocks, l));
    }
}

fn basis(n: usize, quantized: bool, device: Device) -> Tensor {
    let v = if quantized {
        sparse::dct_basis_quantized(n)
    } else {
        sparse::dct_basis(n)
    };
    let t = Tensor::from_slice(&v)
        .view([n as i64, n as i64])
        .to_device(device);
    if quantized {
        t
    } else {
        t.to_kind(Kind::Float)
    }
}

impl DctCodec {
    pub fn new(layout: Layout, device: Device) -> DctCodec {
        let mut groups: Vec<Group> = Vec::new();
        for (i, t) in layout.tensors.iter().enumerate() {
            if let Some(g) = groups.iter_mut().find(|g| g.h == t.h && g.w == t.w) {
                g.tensors.push(i);
                continue;
            }
            groups.push(Group {
                h: t.h,
                w: t.w,
                tensors: vec![i],
                fh: basis(t.h, false, device),
                fw: basis(t.w, false, device),
                fht: basis(t.h, false, device).tr().contiguous(),
                fwt: basis(t.w, false, device).tr().contiguous(),
                fhqt: basis(t.h, true, device).tr().contiguous(),
                fwqt: basis(t.w, true, device).tr().contiguous(),
            });
        }
        DctCodec {
            layout,
            groups,
            device,
            slice_bytes: SLICE_BYTES,
        }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// DCT coefficients of each block (`x`: `[blocks, h, w]`), `(Fhᵀ · X) · Fw`, as
    /// `[blocks, h·w]`. (A batched GEMM against the broadcast basis gives the same bits but
    /// materializes the broadcast: no faster, more memory; measured for issue 16.)
    fn forward(g: &Group, x: &Tensor) -> Tensor {
        let nb = x.size()[0];
        g.fh.tr()
            .matmul(x)
            .matmul(&g.fw)
            .reshape([nb, (g.h * g.w) as i64])
    }

    /// The group of layout entry `ti` (its chunk shape's bases).
    fn group_of(&self, ti: usize) -> &Group {
        self.groups
            .iter()
            .find(|g| g.tensors.contains(&ti))
            .expect("every tensor is in a group")
    }

    /// Per-chunk top-k of `flat` (`[blocks, h·w]`) by magnitude: (indices, values).
    fn top_k(flat: &Tensor, k: i64) -> (Tensor, Tensor) {
        let (_, idx) = flat.abs().topk(k, 1, true, false);
        let vals = flat.gather(1, &idx, false);
        (idx, vals)
    }

    /// `[blocks, k]` index and value tensors as the wire's entry lists.
    fn entries(idx: &Tensor, vals: &Tensor) -> (Vec<u32>, Vec<f32>) {
        let n = idx.numel();
        let mut iv = vec![0i64; n];
        idx.to_device(Device::Cpu)
            .to_kind(Kind::Int64)
            .reshape([-1])
            .copy_data(&mut iv, n);
        let mut vv = vec![0f32; n];
        vals.to_device(Device::Cpu)
            .to_kind(Kind::Float)
            .reshape([-1])
            .copy_data(&mut vv, n);
        (iv.into_iter().map(|x| x as u32).collect(), vv)
    }

    /// Compress `deltas` (the momentum, one tensor per layout entry): keep the top-k DCT
    /// coefficients of each block, subtract their decoded (unquantized) part from the
    /// momentum (DeMo's decoupling, in place) and return what is sent.
    ///
    /// One tensor at a time: the temporaries (its blocks, their transform, magnitudes, the
    /// decoded part) are a small multiple of the largest tensor, not of the model, which a
    /// group-wide batch made them (issue 16: ~6× the model's f32 size at peak).
    pub fn encode(&self, deltas: &mut [Tensor], k: u32, codec: ValueCodec) -> SparseUpdate {
        let tensors = deltas
            .iter_mut()
            .enumerate()
            .map(|(ti, d)| self.encode_tensor(ti, d, k, codec))
            .collect();
        SparseUpdate { codec, tensors }
    }

    /// [`Self::encode`] of layout entry `ti` alone (`delta` is its momentum, updated in
    /// place): a caller can stream a model through the encoder a tensor at a time, holding
    /// one tensor's temporaries (`swarm codec encode` reads a file so).
    pub fn encode_tensor(
        &self,
        ti: usize,
        delta: &mut Tensor,
        k: u32,
        codec: ValueCodec,
    ) -> TensorUpdate {
        let l = &self.layout.tensors[ti];
        let g = self.group_of(ti);
        let (h, w) = (g.h as i64, g.w as i64);
        tch::no_grad(|| {
            let x = to_blocks(delta, l);
            let flat = Self::forward(g, &x);
            drop(x);
            let ke = (k as i64).min(h * w);
            let (idx, vals) = Self::top_k(&flat, ke);
            drop(flat);
            // The kept part decoded as a sum of k rank-one terms per block
            // (v · Fh[:, b] ⊗ Fw[:, d]): k·h·w work instead of two dense matmuls.
            let dec = Self::sparse_inverse(&g.fht, &g.fwt, &idx, &vals, h, w);
            subtract_blocks(delta, &dec, l);
            let (iu, vv) = Self::entries(&idx, &vals);
            TensorUpdate::from_entries(l, ke as usize, codec, &iu, &vv)
        })
    }

    /// Local steps' encode: per chunk, the top-k of `bufs` (the error-feedback buffers, one
    /// per layout entry) by magnitude, of the DCT coefficients when `dct` or of the raw values;
    /// values in `codec`; what the receivers will decode (the dequantized values) is
    /// subtracted from the buffers in place, so the quantization error is fed back too. One
    /// tensor at a time, as [`DctCodec::encode`].
    pub fn encode_local(
        &self,
        bufs: &mut [Tensor],
        k: u32,
        codec: ValueCodec,
        dct: bool,
    ) -> SparseUpdate {
        let mut tensors = Vec::with_capacity(self.layout.tensors.len());
        tch::no_grad(|| {
            for (ti, l) in self.layout.tensors.iter().enumerate() {
                let g = self.group_of(ti);
                let (h, w) = (g.h as i64, g.w as i64);
                let x = to_blocks(&bufs[ti], l);
                let nb = x.size()[0];
                let flat = if dct {
                    Self::forward(g, &x)
                } else {
                    x.reshape([nb, h * w])
                };
                let ke = (k as i64).min(h * w);
                let (idx, vals) = Self::top_k(&flat, ke);
                drop(flat);
                let (iu, vv) = Self::entries(&idx, &vals);
                let (tu, deq) =
                    TensorUpdate::from_entries_dequantized(l, ke as usize, codec, &iu, &vv);
                tensors.push(tu);
                let deq = Tensor::from_slice(&deq)
                    .view([nb, ke])
                    .to_device(x.device());
                let dec = if dct {
                    Self::sparse_inverse(&g.fht, &g.fwt, &idx, &deq, h, w)
                } else {
                    Tensor::zeros([nb, h * w], (Kind::Float, x.device()))
                        .scatter(1, &idx, &deq)
                        .view([nb, h, w])
                };
                subtract_blocks(&mut bufs[ti], &dec, l);
            }
        });
        SparseUpdate { codec, tensors }
    }

    /// The combined values themselves (local steps' outer step), decoded exactly: f32 tensors
    /// bit-identical on every device, thread count and arrival order.
    ///
    /// Without the DCT each aggregated value (an f64 computed in a canonical order by
    /// `protocol::sparse::aggregate_round`) is rounded once to f32 in Rust and scattered into
    /// zeros: no arithmetic happens on the device but adding exact zeros. With the DCT each
    /// block is quantized to integers `Yq = Y·2^s` (`|Yq| ≤ 2^A`), decoded with the integer
    /// basis `Fq = F·2^B` so every partial sum is an exact integer below 2^52 (the bound of
    /// `protocol::sparse::exact`), then scaled by `2^-(s + 2B)` (a power of two: exact) and
    /// rounded once to f32. The only departures from the float decode are the rounding of Y
    /// at 2^-A of its block maximum and of F at 2^-B.
    pub fn exact_values(&self, agg: &Aggregate, dct: bool) -> Vec<Tensor> {
        self.decode_dense(agg, Decode::Values { dct })
    }

    /// The aggregate before the sign, decoded in floating point (for inspection).
    pub fn decode_float(&self, agg: &Aggregate) -> Vec<Tensor> {
        self.decode_dense(agg, Decode::Float)
    }

    /// `sign` of the decoded aggregate, exactly (see `protocol::sparse::exact`): f32 tensors
    /// of −1, 0 and 1, bit-identical on every device, thread count and arrival order.
    pub fn exact_sign(&self, agg: &Aggregate) -> Vec<Tensor> {
        self.decode_dense(agg, Decode::Sign)
    }

    /// DeMo's step straight from the aggregate: `p *= 1 − lr·wd`, then `p −= lr·sign(Δ)` with
    /// `Δ` decoded exactly, slice by slice into the parameters. The same bits as
    /// [`Self::exact_sign`] followed by [`apply_sign_step`], without a dense sign tensor of the
    /// model: its memory is one slice's temporaries ([`Self::slice_bytes`]).
    pub fn apply_exact_sign(&self, params: &[Tensor], agg: &Aggregate, lr: f64, wd: f64) {
        self.apply_stream(params, agg, Decode::Sign, lr, wd)
    }

    /// Local steps' outer step straight from the aggregate: `p −= lr · values`, the values
    /// decoded exactly as [`Self::exact_values`] does, slice by slice into the parameters.
    pub fn apply_exact_values(&self, params: &[Tensor], agg: &Aggregate, dct: bool, lr: f64) {
        self.apply_stream(params, agg, Decode::Values { dct }, lr, 0.0)
    }

    /// Decode into fresh dense tensors (one per layout entry), slice by slice.
    fn decode_dense(&self, agg: &Aggregate, mode: Decode) -> Vec<Tensor> {
        let out: Vec<Tensor> = self
            .layout
            .tensors
            .iter()
            .map(|l| Tensor::zeros([l.rows as i64, l.cols as i64], (Kind::Float, self.device)))
            .collect();
        self.decode_stream(agg, mode, |ti, r0, part| {
            let n = part.size()[0];
            out[ti].narrow(0, r0, n).copy_(&part);
        });
        out.into_iter()
            .zip(&self.layout.tensors)
            .map(|(t, l)| {
                let shape: Vec<i64> = l.shape.iter().map(|&x| x as i64).collect();
                t.reshape(&shape[..])
            })
            .collect()
    }

    /// Weight decay then `p −= lr · decoded`, slice by slice, in place. Each element sees the
    /// same two IEEE operations as [`apply_sign_step`] (so the bits agree with it).
    fn apply_stream(&self, params: &[Tensor], agg: &Aggregate, mode: Decode, lr: f64, wd: f64) {
        assert_eq!(
            params.len(),
            self.layout.tensors.len(),
            "one parameter per layout entry"
        );
        // A parameter that is not contiguous has no in-place 2-D view: decode it densely.
        if params.iter().any(|p| !p.is_contiguous()) {
            let dense = self.decode_dense(agg, mode);
            apply_sign_step(params, &dense, lr, wd);
            return;
        }
        let decay = (1.0 - lr * wd) as f32;
        let lr32 = lr as f32;
        let views: Vec<Tensor> = params
            .iter()
            .zip(&self.layout.tensors)
            .map(|(p, l)| p.view([l.rows as i64, l.cols as i64]))
            .collect();
        tch::no_grad(|| {
            for p in &views {
                decay_in_place(p, decay);
            }
            self.decode_stream(agg, mode, |ti, r0, part| {
                step_in_place(&views[ti].narrow(0, r0, part.size()[0]), &part, lr32);
            });
        });
    }

    /// Bytes of temporaries one decode slice may take (gathered basis rows, the f64 block
    /// results). The exact decode streams each tensor in slices of whole block rows within
    /// this budget, so its memory does not grow with the model (issue 16).
    pub fn slice_bytes(&self) -> usize {
        self.slice_bytes
    }

    /// Set the slice budget (tests and benchmarks; at least one block row is decoded at once).
    pub fn with_slice_bytes(mut self, bytes: usize) -> DctCodec {
        self.slice_bytes = bytes.max(1);
        self
    }

    /// The decode's one loop: tensor by tensor, blocks gathered from the aggregate a slice of
    /// whole block rows at a time, decoded on the device, handed to `sink(tensor, first row,
    /// [rows, cols] f32)` in the tensor's 2-D view. Exact modes are integer sums below 2^52,
    /// so how the blocks are sliced cannot change a bit.
    fn decode_stream(
        &self,
        agg: &Aggregate,
        mode: Decode,
        mut sink: impl FnMut(usize, i64, Tensor),
    ) {
        tch::no_grad(|| {
            for (ti, l) in self.layout.tensors.iter().enumerate() {
                let g = self.group_of(ti);
                let t = &agg.tensors[ti];
                let (h, w) = (l.h, l.w);
                let per_row = l.cols / w;
                let block_rows = l.rows / h;
                let m = t.max_nnz().max(1);
                // Integer coefficients (and their power-of-two shifts) for the exact DCT decodes.
                let quantized = match mode {
                    Decode::Sign | Decode::Values { dct: true } => {
                        Some(sparse::quantize_blocks_scaled(t, h, w))
                    }
                    _ => None,
                };
                let per_block = (m * (h + w) + 2 * h * w) * 8;
                let rows_per_slice =
                    (self.slice_bytes / (per_block * per_row)).clamp(1, block_rows);
                let mut br = 0;
                while br < block_rows {
                    let nr = rows_per_slice.min(block_rows - br);
                    let (b0, nb) = (br * per_row, nr * per_row);
                    let mut idx = vec![0i64; nb * m];
                    let mut val = vec![0f64; nb * m];
                    let mut shifts = vec![0i32; nb];
                    for b in 0..nb {
                        let r = t.offsets[b0 + b] as usize..t.offsets[b0 + b + 1] as usize;
                        for (j, e) in r.enumerate() {
                            idx[b * m + j] = t.index[e] as i64;
                            val[b * m + j] = match &quantized {
                                Some((q, _)) => q[e],
                                None => t.mean[e],
                            };
                        }
                        if let Some((_, sh)) = &quantized {
                            shifts[b] = sh[b0 + b];
                        }
                    }
                    let blocks = self.decode_blocks(g, mode, &idx, &val, &shifts, nb, m);
                    // [blocks, h, w] in block-row order → the slice's rows of the 2-D view.
                    let part = blocks
                        .view([nr as i64, per_row as i64, h as i64, w as i64])
                        .permute([0, 2, 1, 3])
                        .reshape([(nr * h) as i64, l.cols as i64]);
                    sink(ti, (br * h) as i64, part);
                    br += nr;
                }
            }
        });
    }

    /// Decode `nb` gathered blocks (`idx`, `val`: `[nb, m]`, padded with index 0 value 0,
    /// which adds an exact zero) to `[nb, h, w]` f32.
    #[allow(clippy::too_many_arguments)]
    fn decode_blocks(
        &self,
        g: &Group,
        mode: Decode,
        idx: &[i64],
        val: &[f64],
        shifts: &[i32],
        nb: usize,
        m: usize,
    ) -> Tensor {
        let (h, w) = (g.h as i64, g.w as i64);
        let (nb, m) = (nb as i64, m as i64);
        let dev = self.device;
        let idx = Tensor::from_slice(idx).view([nb, m]).to_device(dev);
        let val64 = || Tensor::from_slice(val).view([nb, m]).to_device(dev);
        match mode {
            Decode::Values { dct: false } => {
                let v32: Vec<f32> = val.iter().map(|&x| x as f32).collect();
                let val = Tensor::from_slice(&v32).view([nb, m]).to_device(dev);
                Tensor::zeros([nb, h * w], (Kind::Float, dev))
                    .scatter_add(1, &idx, &val)
                    .view([nb, h, w])
            }
            Decode::Float => {
                let (fh, fw) = (g.fht.to_kind(Kind::Double), g.fwt.to_kind(Kind::Double));
                Self::sparse_inverse(&fh, &fw, &idx, &val64(), h, w).to_kind(Kind::Float)
            }
            Decode::Sign => Self::sparse_inverse(&g.fhqt, &g.fwqt, &idx, &val64(), h, w)
                .sign()
                .to_kind(Kind::Float),
            Decode::Values { dct: true } => {
                let b = protocol::sparse::BASIS_BITS as i32;
                let s1: Vec<f64> = shifts.iter().map(|&s| 2f64.powi(-(s / 2 + b))).collect();
                let s2: Vec<f64> = shifts
                    .iter()
                    .map(|&s| 2f64.powi(-(s - s / 2 + b)))
                    .collect();
                let s1 = Tensor::from_slice(&s1).view([nb, 1, 1]).to_device(dev);
                let s2 = Tensor::from_slice(&s2).view([nb, 1, 1]).to_device(dev);
                let d = Self::sparse_inverse(&g.fhqt, &g.fwqt, &idx, &val64(), h, w);
                (d * s1 * s2).to_kind(Kind::Float)
            }
        }
    }

    /// `Σ_j v_j · Fh[:, b_j] ⊗ Fw[:, d_j]` per block, for flat indices `i = b·w + d`
    /// (`idx`, `vals`: `[blocks, m]`). With integer operands every partial sum is an integer
    /// bounded as in `protocol::sparse::exact`, so the f64 result is exact in any order.
    fn sparse_inverse(
        fh: &Tensor,
        fw: &Tensor,
        idx: &Tensor,
        vals: &Tensor,
        h: i64,
        w: i64,
    ) -> Tensor {
        let nb = idx.size()[0];
        let m = idx.size()[1];
        let flat = idx.reshape([-1]);
        let b = flat.divide_scalar_mode(w, "floor");
        let d = flat.remainder(w);
        let a = fh.index_select(0, &b).view([nb, m, h]) * vals.unsqueeze(2).to_kind(fh.kind());
        let c = fw.index_select(0, &d).view([nb, m, w]);
        a.transpose(1, 2).bmm(&c)
    }
}

/// What a decode produces from the aggregate.
#[derive(Clone, Copy, Debug)]
enum Decode {
    /// The float inverse DCT (inspection only; not bit-stable across devices).
    Float,
    /// `sign` of the exact integer decode (DeMo's step).
    Sign,
    /// The exactly decoded values (local steps), through the DCT or as raw coefficients.
    Values { dct: bool },
}

/// Weight decay and the sign step, each a single correctly rounded IEEE operation per element:
/// `p *= 1 − lr·wd` then `p −= lr·s`.
pub fn apply_sign_step(params: &[Tensor], signs: &[Tensor], lr: f64, wd: f64) {
    tch::no_grad(|| {
        let decay = (1.0 - lr * wd) as f32;
        let lr32 = lr as f32;
        for (p, s) in params.iter().zip(signs) {
            decay_in_place(p, decay);
            step_in_place(p, s, lr32);
        }
    });
}

/// `p *= decay` in place (one IEEE multiply per element; nothing when `decay` is 1). Shared
/// by [`apply_sign_step`] and the streamed apply so both give the same bits.
fn decay_in_place(p: &Tensor, decay: f32) {
    if decay != 1.0 {
        let _ = p
            .shallow_clone()
            .g_mul_(&Tensor::from(decay).to_device(p.device()));
    }
}

/// `p −= lr · s` in place: the step rounded to f32, then one subtraction per element.
fn step_in_place(p: &Tensor, s: &Tensor, lr32: f32) {
    let step = s.to_device(p.device()) * Tensor::from(lr32).to_device(p.device());
    let _ = p.shallow_clone().g_sub_(&step);
}

/// One node's DeMo state: its momentum ("delta").
pub struct DemoState {
    pub delta: Vec<Tensor>,
}

impl DemoState {
    pub fn new(params: &[Tensor]) -> DemoState {
        DemoState {
            delta: params.iter().map(|p| p.detach().zeros_like()).collect(),
        }
    }

    /// `delta = β·delta + lr·grad`, with the gradient clipped to `clip` global norm first.
    /// Returns the gradient's norm before clipping.
    pub fn accumulate(&mut self, grads: &[Tensor], lr: f64, cfg: &OptimConfig) -> f64 {
        let norm = grad_norm(grads);
        let scale = if cfg.grad_clip > 0.0 && norm > cfg.grad_clip {
            cfg.grad_clip / norm
        } else {
            1.0
        };
        tch::no_grad(|| {
            for (d, g) in self.delta.iter_mut().zip(grads) {
                let _ = d.g_mul_scalar_(cfg.beta);
                let _ = d.g_add_(&(g * (lr * scale)));
            }
        });
        norm
    }
}

pub fn grad_norm(grads: &[Tensor]) -> f64 {
    let s: f64 = grads
        .iter()
        .map(|g| g.pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]))
        .sum();
    s.sqrt()
}
