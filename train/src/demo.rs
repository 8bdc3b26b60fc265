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
}

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
        }
    }

    pub fn device(&self) -> Device {
        self.device
    }

    /// DCT coefficients of each block: `Fhᵀ · X · Fw`.
    fn forward(g: &Group, x: &Tensor) -> Tensor {
        g.fh.tr().matmul(x).matmul(&g.fw)
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
        let mut tensors = Vec::with_capacity(self.layout.tensors.len());
        tch::no_grad(|| {
            for (ti, l) in self.layout.tensors.iter().enumerate() {
                let g = self.group_of(ti);
                let (h, w) = (g.h as i64, g.w as i64);
                let x = to_blocks(&deltas[ti], l);
                let nb = x.size()[0];
                let flat = Self::forward(g, &x).reshape([nb, h * w]);
                drop(x);
                let ke = (k as i64).min(h * w);
                let (idx, vals) = Self::top_k(&flat, ke);
                drop(flat);
                // The kept part decoded as a sum of k rank-one terms per block
                // (v · Fh[:, b] ⊗ Fw[:, d]): k·h·w work instead of two dense matmuls.
                let dec = Self::sparse_inverse(&g.fht, &g.fwt, &idx, &vals, h, w);
                let _ = deltas[ti].g_sub_(&from_blocks(&dec, l));
                let (iu, vv) = Self::entries(&idx, &vals);
                tensors.push(TensorUpdate::from_entries(l, ke as usize, codec, &iu, &vv));
            }
        });
        SparseUpdate { codec, tensors }
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
                    Self::forward(g, &x).reshape([nb, h * w])
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
                let _ = bufs[ti].g_sub_(&from_blocks(&dec, l));
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
        let mut out: Vec<Option<Tensor>> = (0..self.layout.tensors.len()).map(|_| None).collect();
        tch::no_grad(|| {
            for g in &self.groups {
                let (h, w) = (g.h as i64, g.w as i64);
                let (idx, val, nb, m, shifts) = self.gather_group_scaled(g, agg, dct);
                let idx = Tensor::from_slice(&idx)
                    .view([nb as i64, m as i64])
                    .to_device(self.device);
                let all = if dct {
                    let val = Tensor::from_slice(&val)
                        .view([nb as i64, m as i64])
                        .to_device(self.device);
                    let b = protocol::sparse::BASIS_BITS as i32;
                    let s1: Vec<f64> = shifts.iter().map(|&s| 2f64.powi(-(s / 2 + b))).collect();
                    let s2: Vec<f64> = shifts
                        .iter()
                        .map(|&s| 2f64.powi(-(s - s / 2 + b)))
                        .collect();
                    let s1 = Tensor::from_slice(&s1)
                        .view([nb as i64, 1, 1])
                        .to_device(self.device);
                    let s2 = Tensor::from_slice(&s2)
                        .view([nb as i64, 1, 1])
                        .to_device(self.device);
                    let parts: Vec<Tensor> = Self::slices(nb, m, g.h, g.w)
                        .into_iter()
                        .map(|(s, n)| {
                            let (s, n) = (s as i64, n as i64);
                            let d = Self::sparse_inverse(
                                &g.fhqt,
                                &g.fwqt,
                                &idx.narrow(0, s, n),
                                &val.narrow(0, s, n),
                                h,
                                w,
                            );
                            (d * s1.narrow(0, s, n) * s2.narrow(0, s, n)).to_kind(Kind::Float)
                        })
                        .collect();
                    Tensor::cat(&parts, 0)
                } else {
                    let v32: Vec<f32> = val.iter().map(|&x| x as f32).collect();
                    let val = Tensor::from_slice(&v32)
                        .view([nb as i64, m as i64])
                        .to_device(self.device);
                    // Padding entries (index 0, value 0) add an exact zero.
                    Tensor::zeros([nb as i64, h * w], (Kind::Float, self.device))
                        .scatter_add(1, &idx, &val)
                        .view([nb as i64, h, w])
                };
                self.split_group(g, &all, &mut out);
            }
        });
        out.into_iter().map(|t| t.unwrap()).collect()
    }

    /// [`Self::gather_group`], also returning each block's power-of-two shift (with
    /// `quantize`; zeros otherwise).
    fn gather_group_scaled(
        &self,
        g: &Group,
        agg: &Aggregate,
        quantize: bool,
    ) -> (Vec<i64>, Vec<f64>, usize, usize, Vec<i32>) {
        let m = g
            .tensors
            .iter()
            .map(|&ti| agg.tensors[ti].max_nnz())
            .max()
            .unwrap_or(0)
            .max(1);
        let nb: usize = g
            .tensors
            .iter()
            .map(|&ti| self.layout.tensors[ti].blocks())
            .sum();
        let mut idx = vec![0i64; nb * m];
        let mut val = vec![0f64; nb * m];
        let mut shifts = vec![0i32; nb];
        let mut row = 0;
        for &ti in &g.tensors {
            let t = &agg.tensors[ti];
            let (q, sh) = if quantize {
                sparse::quantize_blocks_scaled(t, g.h, g.w)
            } else {
                (t.mean.clone(), vec![0; t.offsets.len() - 1])
            };
            for b in 0..t.offsets.len() - 1 {
                for (j, e) in (t.offsets[b] as usize..t.offsets[b + 1] as usize).enumerate() {
                    idx[row * m + j] = t.index[e] as i64;
                    val[row * m + j] = q[e];
                }
                shifts[row] = sh[b];
                row += 1;
            }
        }
        (idx, val, nb, m, shifts)
    }

    /// Cut a group's stacked `[blocks, h, w]` result back into its tensors' shapes.
    fn split_group(&self, g: &Group, all: &Tensor, out: &mut [Option<Tensor>]) {
        let mut start = 0i64;
        for &ti in &g.tensors {
            let l = &self.layout.tensors[ti];
            let n = l.blocks() as i64;
            out[ti] = Some(from_blocks(&all.narrow(0, start, n), l));
            start += n;
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

    /// Block slices small enough that the gathered bases stay near `budget` bytes.
    fn slices(nb: usize, m: usize, h: usize, w: usize) -> Vec<(usize, usize)> {
        let budget = 256usize << 20;
        let per = (m.max(1) * (h + w) + h * w) * 8;
        let step = (budget / per).max(1);
        (0..nb)
            .step_by(step)
            .map(|s| (s, step.min(nb - s)))
            .collect()
    }

    /// Per group: padded `[blocks, m]` index and value tensors from a sparse aggregate, with
    /// values optionally quantized for the exact decode. Padding entries have value 0.
    fn gather_group(
        &self,
        g: &Group,
        agg: &Aggregate,
        quantize: bool,
    ) -> (Vec<i64>, Vec<f64>, usize, usize) {
        let (idx, val, nb, m, _) = self.gather_group_scaled(g, agg, quantize);
        (idx, val, nb, m)
    }

    /// Decode every group's aggregate, in float or exactly (then its sign), into per-tensor outputs.
    fn decode_groups(&self, agg: &Aggregate, exact: bool) -> Vec<Tensor> {
        let mut out: Vec<Option<Tensor>> = (0..self.layout.tensors.len()).map(|_| None).collect();
        tch::no_grad(|| {
            for g in &self.groups {
                let (idx, val, nb, m) = self.gather_group(g, agg, exact);
                let (h, w) = (g.h as i64, g.w as i64);
                let idx = Tensor::from_slice(&idx)
                    .view([nb as i64, m as i64])
                    .to_device(self.device);
                let val = Tensor::from_slice(&val)
                    .view([nb as i64, m as i64])
                    .to_device(self.device);
                let (fh, fw) = if exact {
                    (g.fhqt.shallow_clone(), g.fwqt.shallow_clone())
                } else {
                    (g.fht.to_kind(Kind::Double), g.fwt.to_kind(Kind::Double))
                };
                let parts: Vec<Tensor> = Self::slices(nb, m, g.h, g.w)
                    .into_iter()
                    .map(|(s, n)| {
                        let d = Self::sparse_inverse(
                            &fh,
                            &fw,
                            &idx.narrow(0, s as i64, n as i64),
                            &val.narrow(0, s as i64, n as i64),
                            h,
                            w,
                        );
                        if exact {
                            d.sign().to_kind(Kind::Float)
                        } else {
                            d.to_kind(Kind::Float)
                        }
                    })
                    .collect();
                let all = Tensor::cat(&parts, 0);
                self.split_group(g, &all, &mut out);
            }
        });
        out.into_iter().map(|t| t.unwrap()).collect()
    }

    /// The aggregate before the sign, decoded in floating point (for inspection).
    pub fn decode_float(&self, agg: &Aggregate) -> Vec<Tensor> {
        self.decode_groups(agg, false)
    }

    /// `sign` of the decoded aggregate, exactly (see `protocol::sparse::exact`): f32 tensors
    /// of −1, 0 and 1, bit-identical on every device, thread count and arrival order.
    pub fn exact_sign(&self, agg: &Aggregate) -> Vec<Tensor> {
        self.decode_groups(agg, true)
    }
}

/// Weight decay and the sign step, each a single correctly rounded IEEE operation per element:
/// `p *= 1 − lr·wd` then `p −= lr·s`.
pub fn apply_sign_step(params: &[Tensor], signs: &[Tensor], lr: f64, wd: f64) {
    tch::no_grad(|| {
        let decay = (1.0 - lr * wd) as f32;
        let lr32 = lr as f32;
        for (p, s) in params.iter().zip(signs) {
            let mut p = p.shallow_clone();
            if decay != 1.0 {
                let _ = p.g_mul_(&Tensor::from(decay).to_device(p.device()));
            }
            let step = s.to_device(p.device()) * Tensor::from(lr32).to_device(p.device());
            let _ = p.g_sub_(&step);
        }
    });
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
