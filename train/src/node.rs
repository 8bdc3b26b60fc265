//! One node's computation, written once: `swarm run`'s trainer thread, the simulator's real-model
//! trainer (`sim::tiny`) and `swarm train`'s in-process replicas all call it, so a change to the
//! optimizer lands everywhere a node runs and the three agree bit for bit on the same seeds and
//! schedule.
//!
//! * [`NodeStep`] is what every node of a run shares: the run's optimizer settings, seed, batch,
//!   the codec. It trains one node's step (its recomputable batch → gradient → momentum →
//!   compressed update), applies a round exactly, spot-checks an update and evaluates.
//! * [`NodeState`] is one node's own optimizer state: its DeMo momentum and what its look-ahead
//!   needs. It is never sent and never part of a digest.
//! * [`NodeTrainer`] owns a node's model, state and step: the network node's trainer.
//!
//! # The swarm's schedule
//! A node trains step t while step t−1's updates are still in flight (compute overlaps the
//! exchange), so its parameters lack step t−1 when it takes the gradient: one step stale. With
//! [`Lookahead`] on, the node first moves its weights by `−lr(t−1)·ŝ`, where the pending step
//! will probably land, takes the gradient there and copies the weights back bit for bit. What
//! it sends and what everyone applies are unchanged.
//!
//! # Local steps
//! With `optim.local` (see [`protocol::config::LocalSteps`]) one protocol step is a window of
//! H inner AdamW steps on the node's own batches `t·H … t·H + H − 1`. The model's parameters
//! stay the *shared* parameters (what every node applies and the digest names); the node
//! trains a window on a copy placed at the shared parameters plus its own progress of the
//! previous window when that window is still in flight (eager / delayed averaging), and puts
//! the shared parameters back bit for bit. So a node never waits for the network and never
//! loses its own last window, while the others' windows reach it one window late.

use protocol::config::{lr_at, LocalSteps, Lookahead, ModelConfig, OptimConfig};
use protocol::run::RunConfig;
use protocol::sparse::{self, Layout, SparseUpdate};
use tch::{Device, Tensor};

use crate::adamw::AdamW;
use crate::data::Corpus;
use crate::demo::{apply_sign_step, DctCodec, DemoState};
use crate::model::Llama;

/// What one node's training step produced.
pub struct Trained {
    pub update: SparseUpdate,
    /// Tokens the update was computed on (what its header states).
    pub tokens: u64,
    pub loss: f64,
    /// The gradient's global norm before clipping.
    pub grad_norm: f64,
    /// Seconds in forward + backward (with the look-ahead's moves), and in momentum + DCT +
    /// top-k + packing.
    pub t_fwd_bwd: f64,
    pub t_compress: f64,
}

/// One node's own optimizer state.
pub struct NodeState {
    pub demo: DemoState,
    /// The look-ahead direction for the step after the one it was computed in:
    /// `(step, ŝ)` with ŝ ∈ {−1, 0, 1} per weight.
    ahead: Option<(u64, Vec<Tensor>)>,
    /// Local steps' state (made on the first window).
    local: Option<LocalState>,
}

impl NodeState {
    pub fn new(params: &[Tensor]) -> NodeState {
        NodeState {
            demo: DemoState::new(params),
            ahead: None,
            local: None,
        }
    }
}

/// One node's local-steps state: never sent, never digested.
struct LocalState {
    /// The inner optimizer, kept across windows.
    adam: AdamW,
    /// Error feedback: what the node has not yet sent of its pseudo-gradients.
    ef: Vec<Tensor>,
    /// Sender-side outer momentum (when the run asks for it).
    momentum: Vec<Tensor>,
    /// `(window, end − start)`: the node's own uncompressed progress over its last window,
    /// which it keeps while that window is in flight.
    own: Option<(u64, Vec<Tensor>)>,
}

impl LocalState {
    fn new(params: &[Tensor], o: &OptimConfig, l: &LocalSteps) -> LocalState {
        let mut adam = AdamW::new(params, o.weight_decay);
        adam.beta1 = l.adam_beta1;
        adam.beta2 = l.adam_beta2;
        LocalState {
            adam,
            ef: params.iter().map(|p| p.detach().zeros_like()).collect(),
            momentum: if l.outer_momentum != 0.0 {
                params.iter().map(|p| p.detach().zeros_like()).collect()
            } else {
                Vec::new()
            },
            own: None,
        }
    }
}

/// What every node of a run computes alike.
pub struct NodeStep {
    pub model: ModelConfig,
    pub optim: OptimConfig,
    /// The run's seed: batches are `Corpus::batch("train", seed, node id, step, …)`.
    pub seed: u64,
    /// Sequences this node trains per step (the run's nominal batch unless the operator
    /// chose otherwise for their hardware).
    pub batch: usize,
    /// The run's nominal sequences per node per step: the weight cap of `Combine::Share` and
    /// the spot check's batch cap.
    pub nominal: usize,
    pub codec: DctCodec,
}

impl NodeStep {
    pub fn new(
        model: &ModelConfig,
        optim: &OptimConfig,
        seed: u64,
        batch: usize,
        device: Device,
    ) -> NodeStep {
        NodeStep {
            model: model.clone(),
            optim: optim.clone(),
            seed,
            batch,
            nominal: batch,
            codec: DctCodec::new(Layout::for_model(model, optim.chunk), device),
        }
    }

    /// The step of a run (its model, optimizer, seed and nominal batch).
    pub fn for_run(run: &RunConfig, device: Device) -> NodeStep {
        NodeStep::new(
            &run.model,
            &run.optim,
            run.seed,
            run.batch_seqs as usize,
            device,
        )
    }

    pub fn layout(&self) -> &Layout {
        &self.codec.layout
    }

    pub fn seq(&self) -> usize {
        self.model.seq_len as usize
    }

    /// Inner steps per protocol step (H; 1 for DeMo).
    pub fn inner_steps(&self) -> u64 {
        self.optim.inner_steps() as u64
    }

    /// Tokens of one node's nominal step (a window of H batches for local steps): the weight
    /// cap of `Combine::Share`.
    pub fn nominal_tokens(&self) -> u64 {
        (self.nominal * self.seq()) as u64 * self.inner_steps()
    }

    /// The learning rate at `step` (warm-up, then cosine to `lr·min_lr_ratio`); for local
    /// steps the inner rate at the window's first inner step.
    pub fn lr(&self, step: u64) -> f64 {
        self.inner_lr(step * self.inner_steps())
    }

    /// The rate at inner step `i` (= the protocol step for DeMo): the schedule's warm-up and
    /// length, counted in protocol steps, stretched by H.
    fn inner_lr(&self, i: u64) -> f64 {
        let o = &self.optim;
        let hh = o.inner_steps();
        lr_at(
            i.min(u32::MAX as u64) as u32,
            o.lr,
            o.warmup_steps.saturating_mul(hh),
            o.total_steps.saturating_mul(hh),
            o.min_lr_ratio,
        )
    }

    /// Train step `step` for the node `who` (its id bytes: the batch is a pure function of
    /// them) on `model`'s parameters, which hold `version` applied steps; returns the update
    /// and leaves the weights bit-identical. `version < step` means step `step − 1` is still
    /// in flight: the look-ahead, when the run asks for it, applies then.
    pub fn train(
        &self,
        corpus: &Corpus,
        model: &Llama,
        state: &mut NodeState,
        who: &[u8],
        step: u64,
        version: u64,
    ) -> Trained {
        if let Some(l) = &self.optim.local {
            return self.train_local(l, corpus, model, state, who, step, version);
        }
        let t0 = std::time::Instant::now();
        let seq = self.seq();
        let (x, y) = corpus.batch(
            "train",
            self.seed,
            who,
            step,
            self.batch,
            seq,
            model.device(),
        );
        // Move to where the pending step will probably land, only when exactly that step is
        // pending and this node predicted it (a node that just joined or loaded has no guess).
        let ahead = match (&state.ahead, self.optim.lookahead) {
            (_, Lookahead::Off) => None,
            (Some((s, dir)), _) if version < step && *s + 1 == step => Some(dir),
            _ => None,
        };
        let saved: Option<Vec<Tensor>> = ahead.map(|dir| {
            let saved: Vec<Tensor> = model.params.iter().map(|p| p.detach().copy()).collect();
            apply_sign_step(&model.params, dir, self.lr(step - 1), 0.0);
            saved
        });
        model.zero_grad();
        let loss = model.loss(&x, &y);
        loss.backward();
        let l = loss.double_value(&[]);
        let grads = model.grads();
        if let Some(saved) = saved {
            tch::no_grad(|| {
                for (p, s) in model.params.iter().zip(&saved) {
                    p.shallow_clone().copy_(s);
                }
            });
        }
        let t_fwd_bwd = t0.elapsed().as_secs_f64();
        let t1 = std::time::Instant::now();
        let o = &self.optim;
        let grad_norm = state.demo.accumulate(&grads, self.lr(step), o);
        if o.lookahead == Lookahead::Momentum {
            let dir = tch::no_grad(|| state.demo.delta.iter().map(|d| d.sign()).collect());
            state.ahead = Some((step, dir));
        }
        let update = self.codec.encode(&mut state.demo.delta, o.topk, o.values);
        let tokens = (self.batch * seq) as u64;
        if o.lookahead == Lookahead::Update {
            state.ahead = Some((step, self.round_signs(&[(&update, tokens)])));
        }
        Trained {
            update,
            tokens,
            loss: l,
            grad_norm,
            t_fwd_bwd,
            t_compress: t1.elapsed().as_secs_f64(),
        }
    }

    /// A window of local steps (see the module docs); leaves the weights bit-identical.
    #[allow(clippy::too_many_arguments)]
    fn train_local(
        &self,
        l: &LocalSteps,
        corpus: &Corpus,
        model: &Llama,
        state: &mut NodeState,
        who: &[u8],
        step: u64,
        version: u64,
    ) -> Trained {
        let t0 = std::time::Instant::now();
        let seq = self.seq();
        let hh = self.inner_steps();
        let o = &self.optim;
        let ls = state
            .local
            .get_or_insert_with(|| LocalState::new(&model.params, o, l));
        let saved: Vec<Tensor> = model.params.iter().map(|p| p.detach().copy()).collect();
        // Start where this node's own last window ended while that window is in flight.
        tch::no_grad(|| {
            if let Some((s, own)) = &ls.own {
                if version < step && *s + 1 == step {
                    for (p, d) in model.params.iter().zip(own) {
                        let _ = p.shallow_clone().g_add_(d);
                    }
                }
            }
        });
        let start: Vec<Tensor> = model.params.iter().map(|p| p.detach().copy()).collect();
        let mut loss_sum = 0.0;
        let mut norm_sum = 0.0;
        for i in 0..hh {
            let inner = step * hh + i;
            let (x, y) = corpus.batch(
                "train",
                self.seed,
                who,
                inner,
                self.batch,
                seq,
                model.device(),
            );
            model.zero_grad();
            let loss = model.loss(&x, &y);
            loss.backward();
            loss_sum += loss.double_value(&[]);
            let mut grads = model.grads();
            norm_sum += crate::run::clip(&mut grads, o.grad_clip);
            ls.adam.step(&model.params, &grads, self.inner_lr(inner));
        }
        let t_fwd_bwd = t0.elapsed().as_secs_f64();
        let t1 = std::time::Instant::now();
        let own = tch::no_grad(|| {
            let mut own = Vec::with_capacity(start.len());
            for (i, ((p, s0), e)) in model
                .params
                .iter()
                .zip(&start)
                .zip(ls.ef.iter_mut())
                .enumerate()
            {
                let progress = p.detach() - s0;
                // The pseudo-gradient is start − end = −progress.
                let _ = e.g_mul_scalar_(l.ef_decay);
                if l.outer_momentum != 0.0 {
                    // Nesterov on the sender's side: m = μ·m + Δ; send Δ + μ·m.
                    let m = &mut ls.momentum[i];
                    let _ = m.g_mul_scalar_(l.outer_momentum);
                    let _ = m.g_sub_(&progress);
                    let _ = e.g_sub_(&progress);
                    let _ = e.g_add_(&(&*m * l.outer_momentum));
                } else {
                    let _ = e.g_sub_(&progress);
                }
                own.push(progress);
            }
            for (p, s) in model.params.iter().zip(&saved) {
                p.shallow_clone().copy_(s);
            }
            own
        });
        ls.own = Some((step, own));
        let update = self.codec.encode_local(&mut ls.ef, o.topk, o.values, l.dct);
        Trained {
            update,
            tokens: (self.batch * seq) as u64 * hh,
            loss: loss_sum / hh as f64,
            grad_norm: norm_sum / hh as f64,
            t_fwd_bwd,
            t_compress: t1.elapsed().as_secs_f64(),
        }
    }

    /// The exact sign of the round's combined updates (each with the tokens its header
    /// states), before the step is taken.
    fn round_signs(&self, updates: &[(&SparseUpdate, u64)]) -> Vec<Tensor> {
        let agg = sparse::aggregate_round(
            self.layout(),
            self.optim.combine,
            self.nominal_tokens(),
            updates,
        );
        self.codec.exact_sign(&agg)
    }

    /// Apply round `step`: the included updates combined as the run says, decoded exactly and
    /// taken as one sign step on `params`. Bit-identical on every device for the same set, in
    /// any order. An empty set changes nothing.
    ///
    /// Local steps: the combined pseudo-gradients, decoded exactly, times the outer rate.
    pub fn apply(&self, params: &[Tensor], step: u64, updates: &[(&SparseUpdate, u64)]) {
        if updates.is_empty() {
            return;
        }
        let agg = sparse::aggregate_round(
            self.layout(),
            self.optim.combine,
            self.nominal_tokens(),
            updates,
        );
        // Decoded slice by slice into the parameters: no dense copy of the model's step.
        if let Some(l) = &self.optim.local {
            self.codec
                .apply_exact_values(params, &agg, l.dct, l.outer_lr);
            return;
        }
        self.codec
            .apply_exact_sign(params, &agg, self.lr(step), self.optim.weight_decay);
    }

    /// The protocol's spot check: the loss on `sender`'s own batch for `step` (recomputed from
    /// its id) before minus after applying `update` alone to `model`'s parameters; the
    /// parameters are restored bit for bit. The batch has the sequences `tokens` states, at
    /// most the run's nominal batch: a sender that trained on more drew them from the same
    /// stream, and a claim of huge token counts costs the checker nothing extra.
    pub fn spot_check(
        &self,
        corpus: &Corpus,
        model: &Llama,
        sender: &[u8],
        step: u64,
        update: &SparseUpdate,
        tokens: u64,
    ) -> f64 {
        let seq = self.seq();
        let hh = self.inner_steps();
        let seqs = ((tokens / hh) as usize / seq.max(1)).clamp(1, self.nominal.max(1));
        // Local steps: the window's last batch (the one its end parameters fit best).
        let (x, y) = corpus.batch(
            "train",
            self.seed,
            sender,
            step * hh + hh - 1,
            seqs,
            seq,
            model.device(),
        );
        let _guard = tch::no_grad_guard();
        let before = model.loss(&x, &y).double_value(&[]);
        let saved: Vec<Tensor> = model.params.iter().map(|p| p.copy()).collect();
        self.apply(&model.params, step, &[(update, tokens)]);
        let after = model.loss(&x, &y).double_value(&[]);
        for (p, s) in model.params.iter().zip(&saved) {
            p.shallow_clone().copy_(s);
        }
        before - after
    }
}

/// A network node's trainer: its model, its own state and the run's step.
pub struct NodeTrainer {
    pub step: NodeStep,
    pub model: Llama,
    pub state: NodeState,
    /// This node's id bytes (its batches are keyed by them).
    pub id: Vec<u8>,
    /// Steps applied to the parameters held.
    pub version: u64,
}

impl NodeTrainer {
    /// A node of `run` at version 0 (every node starts from the run seed's weights).
    pub fn new(run: &RunConfig, id: Vec<u8>, batch: usize, device: Device) -> NodeTrainer {
        let mut step = NodeStep::for_run(run, device);
        step.batch = batch;
        let model = Llama::new(&run.model, device, run.seed);
        let state = NodeState::new(&model.params);
        NodeTrainer {
            step,
            model,
            state,
            id,
            version: 0,
        }
    }

    /// Train step `step` on the parameters held (see [`NodeStep::train`]).
    pub fn train(&mut self, corpus: &Corpus, step: u64) -> Trained {
        self.step.train(
            corpus,
            &self.model,
            &mut self.state,
            &self.id,
            step,
            self.version,
        )
    }

    /// Apply round `step`; the parameters then hold version `step + 1`.
    pub fn apply(&mut self, step: u64, updates: &[(&SparseUpdate, u64)]) {
        self.step.apply(&self.model.params, step, updates);
        self.version = step + 1;
    }

    pub fn spot_check(
        &self,
        corpus: &Corpus,
        sender: &[u8],
        step: u64,
        update: &SparseUpdate,
        tokens: u64,
    ) -> f64 {
        self.step
            .spot_check(corpus, &self.model, sender, step, update, tokens)
    }

    /// New parameters came from elsewhere (a checkpoint): the momentum belongs to the old
    /// ones, so start afresh.
    pub fn reset_state(&mut self, version: u64) {
        self.state = NodeState::new(&self.model.params);
        self.version = version;
    }

    /// The protocol's parameter digest of the weights held.
    pub fn digest(&self) -> [u8; 32] {
        self.model.digest()
    }
}
