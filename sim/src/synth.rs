//! The synthetic trainer: a cheap objective with a known optimum, producing DeMo updates of the
//! run's real layout and sparsity, so the engine validates and applies them like real ones.
//!
//! Parameters are one flat vector over the layout's blocks (tensor by tensor, block-major, each
//! block's `h·w` elements contiguous); the objective is separable, so how blocks map back to 2-D
//! tensors does not matter. `f(θ) = ½·mean(c_i·(θ_i − θ*_i)²)` with `θ*_i` uniform in [−1, 1] and
//! curvatures `c_i` in [0.1, 1], from the seed; its optimum is exactly 0. Each node's gradient
//! is the true one plus uniform noise of standard deviation `noise`, drawn from (seed, node,
//! step), so it is a pure function of who trains which step.
//!
//! The update follows DeMo without the DCT (the identity basis: top-k runs on raw coordinates,
//! which keeps the trainer O(params) and changes nothing about sizes or sparsity):
//! `delta = β·delta + lr·grad`, per block keep the k largest |delta|, subtract the kept values
//! from delta, send their signs. Applying: per coordinate the mean over the updates that kept
//! it, then `θ −= lr·sign(mean)` — with sign values the mean's sign is the sign of an integer
//! sum, exact in any order, so every node that applies the same set gets the same bits.

use protocol::config::{lr_at, OptimConfig, ValueCodec};
use protocol::sparse::{Layout, SparseUpdate, TensorUpdate};

use crate::rng::derive;

/// What every trainer (synthetic or real) offers the simulator.
pub trait Trainer {
    /// Initial parameters (version 0).
    fn init(&self) -> Vec<f32>;
    /// Node `node`'s update for `step`, trained on `params`. Keeps the node's own momentum.
    fn local_update(&mut self, node: usize, step: u64, params: &[f32]) -> SparseUpdate;
    /// Parameters after applying `updates` (already validated, in canonical order) at `step`.
    fn apply(&self, step: u64, params: &[f32], updates: &[SparseUpdate]) -> Vec<f32>;
    /// The objective (for the synthetic trainer: exact; its optimum is 0).
    fn loss(&self, params: &[f32]) -> f64;
    /// Forget a node's momentum (it crashed, or joined fresh).
    fn reset_node(&mut self, node: usize);
}

#[derive(Clone, Debug)]
pub struct Synthetic {
    pub layout: Layout,
    pub optim: OptimConfig,
    pub noise: f32,
    seed: u64,
    /// Flat offset of each tensor.
    offsets: Vec<usize>,
    target: Vec<f32>,
    curv: Vec<f32>,
    momentum: Vec<Vec<f32>>,
}

impl Synthetic {
    pub fn new(layout: Layout, optim: OptimConfig, noise: f32, seed: u64) -> Synthetic {
        let mut offsets = Vec::new();
        let mut n = 0;
        for t in &layout.tensors {
            offsets.push(n);
            n += t.blocks() * t.block_elems();
        }
        let mut r = derive(&[seed, 0x74617267]);
        let target = (0..n).map(|_| (r.unit() * 2.0 - 1.0) as f32).collect();
        let curv = (0..n).map(|_| (0.1 + 0.9 * r.unit()) as f32).collect();
        Synthetic {
            layout,
            optim,
            noise,
            seed,
            offsets,
            target,
            curv,
            momentum: Vec::new(),
        }
    }

    pub fn params_len(&self) -> usize {
        self.target.len()
    }

    fn lr(&self, step: u64) -> f64 {
        let o = &self.optim;
        lr_at(
            step as u32,
            o.lr,
            o.warmup_steps,
            o.total_steps,
            o.min_lr_ratio,
        )
    }

    /// The true gradient at `params` plus node-and-step noise of std `noise` (uniform).
    pub fn gradient(&self, node: u64, step: u64, params: &[f32], noise: f32) -> Vec<f32> {
        let mut r = derive(&[self.seed, node, step, 0x67726164]);
        // Uniform in [−√3, √3]·noise has standard deviation `noise`.
        let a = 3f32.sqrt() * noise;
        params
            .iter()
            .zip(&self.target)
            .zip(&self.curv)
            .map(|((p, t), c)| c * (p - t) + a * (r.unit() as f32 * 2.0 - 1.0))
            .collect()
    }
}

impl Trainer for Synthetic {
    fn init(&self) -> Vec<f32> {
        vec![0.0; self.target.len()]
    }

    fn local_update(&mut self, node: usize, step: u64, params: &[f32]) -> SparseUpdate {
        if self.momentum.len() <= node {
            self.momentum.resize(node + 1, Vec::new());
        }
        let grad = self.gradient(node as u64, step, params, self.noise);
        let (beta, lr) = (self.optim.beta as f32, self.lr(step) as f32);
        let n = self.target.len();
        let m = &mut self.momentum[node];
        if m.len() != n {
            *m = vec![0.0; n];
        }
        for (d, g) in m.iter_mut().zip(&grad) {
            *d = beta * *d + lr * g;
        }
        let codec = self.optim.values;
        let k = self.optim.topk;
        let mut order: Vec<u32> = Vec::new();
        let tensors = self
            .layout
            .tensors
            .iter()
            .zip(&self.offsets)
            .map(|(t, &off)| {
                let (ke, elems) = (t.k_eff(k), t.block_elems());
                let mut idx = Vec::with_capacity(t.blocks() * ke);
                let mut vals = Vec::with_capacity(t.blocks() * ke);
                for b in 0..t.blocks() {
                    let base = off + b * elems;
                    let blk = &mut m[base..base + elems];
                    order.clear();
                    order.extend(0..elems as u32);
                    // Largest |delta| first; ties by index, so the choice is deterministic.
                    order.select_nth_unstable_by(ke - 1, |&x, &y| {
                        blk[y as usize]
                            .abs()
                            .total_cmp(&blk[x as usize].abs())
                            .then(x.cmp(&y))
                    });
                    for &j in &order[..ke] {
                        let v = blk[j as usize];
                        blk[j as usize] = 0.0;
                        idx.push(j);
                        vals.push(match codec {
                            ValueCodec::Sign => {
                                if v >= 0.0 {
                                    1.0
                                } else {
                                    -1.0
                                }
                            }
                            _ => v,
                        });
                    }
                }
                TensorUpdate::from_entries(t, ke, codec, &idx, &vals)
            })
            .collect();
        SparseUpdate { codec, tensors }
    }

    fn apply(&self, step: u64, params: &[f32], updates: &[SparseUpdate]) -> Vec<f32> {
        let mut sum = vec![0f64; params.len()];
        for u in updates {
            for ((tu, t), &off) in u
                .tensors
                .iter()
                .zip(&self.layout.tensors)
                .zip(&self.offsets)
            {
                let (idx, vals) = tu.entries(u.codec);
                let (k, elems) = (tu.k as usize, t.block_elems());
                for (e, (i, v)) in idx.iter().zip(&vals).enumerate() {
                    sum[off + (e / k) * elems + *i as usize] += *v as f64;
                }
            }
        }
        let lr = self.lr(step) as f32;
        let decay = 1.0 - lr * self.optim.weight_decay as f32;
        params
            .iter()
            .zip(&sum)
            .map(|(&p, &s)| {
                let p = p * decay;
                if s > 0.0 {
                    p - lr
                } else if s < 0.0 {
                    p + lr
                } else {
                    p
                }
            })
            .collect()
    }

    fn loss(&self, params: &[f32]) -> f64 {
        let s: f64 = params
            .iter()
            .zip(&self.target)
            .zip(&self.curv)
            .map(|((p, t), c)| {
                let d = (p - t) as f64;
                *c as f64 * d * d
            })
            .sum();
        0.5 * s / params.len().max(1) as f64
    }

    fn reset_node(&mut self, node: usize) {
        if let Some(m) = self.momentum.get_mut(node) {
            m.clear();
        }
    }
}

impl Synthetic {
    /// Train without sending: the gradient goes into the node's momentum and stays there until
    /// the node next sends (a node outside the step's committee, in the flow model).
    pub fn accumulate(&mut self, node: usize, step: u64, params: &[f32]) {
        if self.momentum.len() <= node {
            self.momentum.resize(node + 1, Vec::new());
        }
        let grad = self.gradient(node as u64, step, params, self.noise);
        let (beta, lr) = (self.optim.beta as f32, self.lr(step) as f32);
        let m = &mut self.momentum[node];
        if m.len() != grad.len() {
            *m = vec![0.0; grad.len()];
        }
        for (d, g) in m.iter_mut().zip(&grad) {
            *d = beta * *d + lr * g;
        }
    }
}

/// The AdamW + all-reduce baseline on the same objective: every step uses the exact mean of
/// `nodes` gradients. Its noise is drawn directly at std `noise/√nodes` (what the mean of that
/// many independent noisy gradients has), so it costs O(params) per step whatever the size.
pub struct AdamBaseline {
    pub params: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    t: i32,
    pub lr: f64,
    pub wd: f64,
}

impl AdamBaseline {
    pub fn new(init: Vec<f32>, lr: f64, wd: f64) -> AdamBaseline {
        let n = init.len();
        AdamBaseline {
            params: init,
            m: vec![0.0; n],
            v: vec![0.0; n],
            t: 0,
            lr,
            wd,
        }
    }

    pub fn step(&mut self, obj: &Synthetic, step: u64, nodes: usize) {
        let noise = obj.noise / (nodes.max(1) as f32).sqrt();
        let g = obj.gradient(u64::MAX, step, &self.params, noise);
        let o = &obj.optim;
        let lr = lr_at(
            step as u32,
            self.lr,
            o.warmup_steps,
            o.total_steps,
            o.min_lr_ratio,
        ) as f32;
        self.t += 1;
        let (b1, b2) = (0.9f32, 0.95f32);
        let (c1, c2) = (1.0 - b1.powi(self.t), 1.0 - b2.powi(self.t));
        for i in 0..self.params.len() {
            self.m[i] = b1 * self.m[i] + (1.0 - b1) * g[i];
            self.v[i] = b2 * self.v[i] + (1.0 - b2) * g[i] * g[i];
            self.params[i] *= 1.0 - lr * self.wd as f32;
            self.params[i] -= lr * (self.m[i] / c1) / ((self.v[i] / c2).sqrt() + 1e-8);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::config::ModelConfig;

    fn small() -> Synthetic {
        let m = ModelConfig {
            name: "s".into(),
            vocab: 64,
            dim: 16,
            layers: 1,
            heads: 2,
            kv_heads: 2,
            ffn: 32,
            seq_len: 8,
            rope_theta: 1e4,
            norm_eps: 1e-5,
        };
        let optim = OptimConfig {
            chunk: 8,
            topk: 4,
            lr: 0.02,
            warmup_steps: 0,
            total_steps: 100,
            ..OptimConfig::default()
        };
        Synthetic::new(Layout::for_model(&m, 8), optim, 0.5, 3)
    }

    #[test]
    fn updates_validate_and_descend() {
        let mut s = small();
        let mut p = s.init();
        let l0 = s.loss(&p);
        for step in 0..60 {
            let us: Vec<_> = (0..8).map(|n| s.local_update(n, step, &p)).collect();
            for u in &us {
                let b = u.encode();
                let d = SparseUpdate::decode(&b, b.len()).unwrap();
                d.validate(&s.layout, s.optim.topk, s.optim.values).unwrap();
            }
            p = s.apply(step, &p, &us);
        }
        let l1 = s.loss(&p);
        assert!(l1 < 0.3 * l0, "loss {l0} -> {l1}");
        // Deterministic: the same inputs give the same bits.
        let mut s2 = small();
        let u = s2.local_update(0, 0, &s2.init());
        assert_eq!(u, small().local_update(0, 0, &small().init()));
    }
}
