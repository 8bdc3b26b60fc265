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

use protocol::config::{Lookahead, ModelConfig, OptimConfig};
use protocol::run::RunConfig;
use protocol::sparse::{self, Layout, SparseUpdate};
use tch::{Device, Tensor};

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
}

impl NodeState {
    pub fn new(params: &[Tensor]) -> NodeState {
        NodeState {
            demo: DemoState::new(params),
            ahead: None,
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

    /// Tokens of one node's nominal step: the weight cap of `Combine::Share`.
    pub fn nominal_tokens(&self) -> u64 {
        (self.nominal * self.seq()) as u64
    }

    /// The learning rate at `step` (warm-up, then cosine to `lr·min_lr_ratio`).
    pub fn lr(&self, step: u64) -> f64 {
        let o = &self.optim;
        protocol::config::lr_at(
            step.min(u32::MAX as u64) as u32,
            o.lr,
            o.warmup_steps,
            o.total_steps,
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
    pub fn apply(&self, params: &[Tensor], step: u64, updates: &[(&SparseUpdate, u64)]) {
        if updates.is_empty() {
            return;
        }
        let signs = self.round_signs(updates);
        apply_sign_step(params, &signs, self.lr(step), self.optim.weight_decay);
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
        let seqs = ((tokens as usize) / seq.max(1)).clamp(1, self.nominal.max(1));
        let (x, y) = corpus.batch("train", self.seed, sender, step, seqs, seq, model.device());
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
