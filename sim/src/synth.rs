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

use crypto::{Digest, NodeId};
use protocol::config::{lr_at, Combine, OptimConfig, ValueCodec};
use protocol::sparse::{token_weight, Layout, SparseUpdate, TensorUpdate};

use crate::rng::derive;
use crate::SimError;

/// One node's contribution to a step: its update, the tokens its header states, and (for a
/// real model) the loss of the batch it trained on.
pub struct Local {
    pub update: SparseUpdate,
    pub tokens: u64,
    pub train_loss: Option<f64>,
}

/// What every trainer (synthetic or real) offers engine mode. Parameters are a flat `f32`
/// vector whose layout the trainer defines; the world only stores, shares and hashes it.
pub trait SimTrainer {
    /// Initial parameters (version 0).
    fn init(&mut self) -> Vec<f32>;
    /// Node `node` (identity `id`: real batches are a function of it) trains `step` on
    /// `params`, which hold `version` applied steps (the engine's `StartStep::base_version`:
    /// `step − 1` in the swarm's overlapped schedule), keeping its own optimizer state.
    fn train(&mut self, node: usize, id: &NodeId, step: u64, version: u64, params: &[f32])
        -> Local;
    /// Parameters after applying `updates` (validated, in the engine's order, each with the
    /// tokens its header states) at `step`.
    fn apply_round(
        &mut self,
        step: u64,
        params: &[f32],
        updates: &[(&SparseUpdate, u64)],
    ) -> Vec<f32>;
    /// The loss the metrics report for `params` (synthetic: the exact objective; a real model:
    /// eval loss on fixed held-out batches).
    fn eval(&mut self, params: &[f32]) -> f64;
    /// The parameter digest nodes compare (a real model: the protocol's `params_digest`).
    fn digest(&self, params: &[f32]) -> Digest {
        flat_digest(params)
    }
    /// The parameters as the tensors a served checkpoint carries: (name, shape, f32
    /// little-endian bytes), whose concatenation is `params` in order. Default: one tensor,
    /// `params`, of the flat vector.
    fn checkpoint_tensors(&self, params: &[f32]) -> Vec<(String, Vec<u32>, Vec<u8>)> {
        let bytes = params.iter().flat_map(|x| x.to_le_bytes()).collect();
        vec![("params".into(), vec![params.len() as u32], bytes)]
    }
    /// The digest engines attest and checkpoints name: the protocol's parameter digest of
    /// [`SimTrainer::checkpoint_tensors`]. A real model's [`SimTrainer::digest`] already is that;
    /// the synthetic trainer's metrics keep their flat hash.
    fn wire_digest(&self, params: &[f32]) -> Digest {
        let t = self.checkpoint_tensors(params);
        protocol::checkpoint::f32_params_digest(
            t.iter()
                .map(|(n, s, b)| (n.as_str(), s.as_slice(), b.as_slice())),
        )
    }
    /// Forget a node's momentum (it crashed, or joined fresh).
    fn reset_node(&mut self, node: usize);
    /// The AdamW + all-reduce baseline's loss after each of `steps` steps with `nodes` nodes.
    fn baseline(&mut self, steps: u64, nodes: usize) -> Result<Vec<f64>, SimError>;
    /// The update layout (for the metrics' update size).
    fn layout(&self) -> &Layout;
    /// A spot check (`protocol::engine::Action::SpotCheck`): the loss before minus after
    /// applying `update` (stating `tokens`) **alone** as the step's sign step to `params`.
    /// Positive: it helped. The protocol evaluates on the sender's own recomputable batch
    /// (`sender`, `step`); a trainer without batches may use its objective. The default does
    /// that with [`SimTrainer::eval`], which for `Synthetic` is the exact objective; a real model
    /// should override it with the sender's batch loss (eval on held-out data is too costly
    /// and too noisy for two forward passes per check).
    fn spot_check(
        &mut self,
        sender: &NodeId,
        step: u64,
        params: &[f32],
        update: &SparseUpdate,
        tokens: u64,
    ) -> f64 {
        let _ = sender;
        let before = self.eval(params);
        let after = self.apply_round(step, params, &[(update, tokens)]);
        before - self.eval(&after)
    }
}

/// L2 norm of an update's values (√(k·blocks) for sign values).
fn value_norm(u: &SparseUpdate) -> f64 {
    u.tensors
        .iter()
        .flat_map(|t| t.entries(u.codec).1)
        .map(|x| x as f64 * x as f64)
        .sum::<f64>()
        .sqrt()
}

/// blake3 of the parameters' f32 little-endian bytes.
pub fn flat_digest(p: &[f32]) -> Digest {
    let mut b = Vec::with_capacity(p.len() * 4);
    for x in p {
        b.extend_from_slice(&x.to_le_bytes());
    }
    Digest::of(&b)
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
    /// Tokens every node's header states (the run's nominal batch: equal weights).
    pub tokens: u64,
    /// The AdamW baseline's peak rate.
    pub adamw_lr: f64,
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
            tokens: 1,
            adamw_lr: 0.05,
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

impl Synthetic {
    pub fn init(&self) -> Vec<f32> {
        vec![0.0; self.target.len()]
    }

    pub fn local_update(&mut self, node: usize, step: u64, params: &[f32]) -> SparseUpdate {
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

    /// Parameters after applying `updates` with equal weights.
    pub fn apply(&self, step: u64, params: &[f32], updates: &[SparseUpdate]) -> Vec<f32> {
        let set: Vec<(&SparseUpdate, u64)> = updates.iter().map(|u| (u, self.tokens)).collect();
        self.apply_weighted(step, params, &set)
    }

    /// With the identity basis the decoded aggregate of a coefficient is the coefficient
    /// itself, so its sign is the sign of the (token-weighted, under `share`) sum of the values
    /// sent for it: integers for sign values, exact in any order.
    pub fn apply_weighted(
        &self,
        step: u64,
        params: &[f32],
        updates: &[(&SparseUpdate, u64)],
    ) -> Vec<f32> {
        let mut sum = vec![0f64; params.len()];
        // Under `share`, float values are clipped to the round's (lower) median L2 norm, as
        // `protocol::sparse::aggregate_round` does; sign values all have the same norm.
        let norms: Vec<f64> = updates.iter().map(|(u, _)| value_norm(u)).collect();
        let med = {
            let mut v = norms.clone();
            v.sort_by(|a, b| a.total_cmp(b));
            v.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0.0)
        };
        for (&(u, tokens), &norm) in updates.iter().zip(&norms) {
            let w = match self.optim.combine {
                // The sign of `Σv/n` or `Σv/√(nN)` is the sign of `Σv`.
                Combine::Mean | Combine::Root => 1.0,
                Combine::Share => {
                    let w = token_weight(tokens, self.tokens) as f64;
                    if norm > med && norm > 0.0 {
                        w * (med / norm)
                    } else {
                        w
                    }
                }
            };
            for ((tu, t), &off) in u
                .tensors
                .iter()
                .zip(&self.layout.tensors)
                .zip(&self.offsets)
            {
                let (idx, vals) = tu.entries(u.codec);
                let (k, elems) = (tu.k as usize, t.block_elems());
                for (e, (i, v)) in idx.iter().zip(&vals).enumerate() {
                    sum[off + (e / k) * elems + *i as usize] += w * *v as f64;
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

    pub fn loss(&self, params: &[f32]) -> f64 {
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

    pub fn reset_node(&mut self, node: usize) {
        if let Some(m) = self.momentum.get_mut(node) {
            m.clear();
        }
    }
}

impl SimTrainer for Synthetic {
    fn init(&mut self) -> Vec<f32> {
        Synthetic::init(self)
    }

    fn train(
        &mut self,
        node: usize,
        _id: &NodeId,
        step: u64,
        _version: u64,
        params: &[f32],
    ) -> Local {
        Local {
            update: self.local_update(node, step, params),
            tokens: self.tokens,
            train_loss: None,
        }
    }

    fn apply_round(
        &mut self,
        step: u64,
        params: &[f32],
        updates: &[(&SparseUpdate, u64)],
    ) -> Vec<f32> {
        self.apply_weighted(step, params, updates)
    }

    fn eval(&mut self, params: &[f32]) -> f64 {
        self.loss(params)
    }

    fn reset_node(&mut self, node: usize) {
        Synthetic::reset_node(self, node)
    }

    fn baseline(&mut self, steps: u64, nodes: usize) -> Result<Vec<f64>, SimError> {
        let mut base = AdamBaseline::new(self.init(), self.adamw_lr, 0.0);
        Ok((0..steps)
            .map(|s| {
                base.step(self, s, nodes);
                self.loss(&base.params)
            })
            .collect())
    }

    fn layout(&self) -> &Layout {
        &self.layout
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
