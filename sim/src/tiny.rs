//! The real model as a simulator trainer (feature `torch`): the `train` crate's Llama, DeMo and
//! exact sign step, computing exactly what `swarm run` computes (`node/src/trainer.rs`), so a
//! simulated swarm and a real one with the same keys, run file and included sets hold
//! bit-identical parameters after every step.
//!
//! * Parameters live in the world as one flat `f32` vector: the model's tensors in wire order
//!   (`ModelConfig::tensor_shapes`), each row-major. One `Llama` instance serves every node: its
//!   weights are overwritten with the node's flat parameters before each forward pass, so 32
//!   nodes cost 32 momenta (one parameter-sized tensor set each), not 32 models.
//! * A node's step: its batch is `Corpus::batch("train", run seed, node id bytes, step,
//!   batch_seqs, seq_len)` (a pure function, so anyone can recompute it), the gradient goes into
//!   the node's own `DemoState` (clip, `delta = β·delta + lr·grad`), and `DctCodec::encode` gives
//!   the update and removes its kept part from the momentum. The learning rate follows the
//!   run's schedule (`train::demo::run_lr`, as the node's).
//! * Applying: `train::demo::apply_round`, as the node does (`aggregate_round`, token-weighted
//!   under `share`, the exact decoded sign and `apply_sign_step`); an empty set leaves the
//!   parameters untouched, as the node does.
//! * The digest is the protocol's `params_digest` of the named f32 tensors, the one nodes put
//!   in summaries and checkpoints (`Llama::digest` computes the same from tensors).
//! * The reported loss is the mean loss on `eval_batches` fixed held-out batches
//!   (`train::run::eval_loss`, as `swarm train`, `swarm demo` and the AdamW baseline report).
//!
//! Duplicated from the node (the `train` crate does not offer them and this crate may not
//! reach into `node`): the mapping of a run's `DataSpec::Synthetic` onto the trainer's corpus
//! (branch 4: the chain `swarm train` uses by default) and the ten-line train/apply sequence.
//! A `train::data::DataSpec::from_run` and a `train::demo` "node step" function would let
//! both call one implementation.

use std::collections::HashMap;

use crypto::{Digest, NodeId};
use protocol::checkpoint::{params_digest, Dtype, TensorEntry};
use protocol::run::{DataSpec as RunData, RunConfig};
use protocol::sparse::{Layout, SparseUpdate};
use train::data::{Corpus, DataSpec};
use train::demo::{apply_round, DctCodec, DemoState};
use train::model::Llama;
use train::run::{eval_loss, Optimizer, TrainOptions};
use train::tch::{self, Device, Kind, Tensor};

use crate::scenario::Scenario;
use crate::synth::{Local, Trainer};
use crate::SimError;

/// The real `tiny` (or a run file's) model, trained with DeMo by every simulated node.
pub struct Tiny {
    run: RunConfig,
    layout: Layout,
    /// The one model instance every node's step loads its parameters into.
    model: Llama,
    codec: DctCodec,
    corpus: Corpus,
    /// Initial parameters (version 0), flat.
    init: Vec<f32>,
    /// Each tensor's name and element count, in wire order (the flat layout).
    tensors: Vec<(String, Vec<u32>, usize)>,
    /// Per node: its DeMo momentum (`None`: fresh, zero).
    states: Vec<Option<DemoState>>,
    /// Sequences per node per step (the run's nominal batch, as `swarm run` without `--batch`).
    batch: usize,
    eval_batches: usize,
    adamw_lr: f64,
    adamw_wd: f64,
    /// Spot-check results by (parameters, sender, step, update, tokens) → (step, gain). The
    /// gain is a pure function of these, and honest nodes hold the same parameters, so two
    /// checkers of one sender cost one check (each is two forward passes and a decode).
    spot_cache: HashMap<[u8; 32], (u64, f64)>,
}

/// The trainer's corpus for a run's data. Only the synthetic corpus is a pure function of the
/// run file; a text or token corpus needs a local file the scenario does not name.
fn corpus_spec(run: &RunConfig) -> Result<DataSpec, SimError> {
    match &run.data {
        // Branch 4, as `node::trainer::data_spec` maps it (the chain of `swarm train`).
        RunData::Synthetic { seed, vocab } => Ok(DataSpec::Synthetic {
            seed: *seed,
            vocab: *vocab as usize,
            branch: 4,
        }),
        _ => Err(SimError::Scenario(
            "trainer kind \"tiny\": the simulator trains on the run's synthetic corpus only \
             ([data.Synthetic] in the run file)"
                .into(),
        )),
    }
}

/// The tensors' values, flat, in order.
fn flatten(params: &[Tensor]) -> Vec<f32> {
    let total: usize = params.iter().map(|p| p.numel()).sum();
    let mut out = vec![0f32; total];
    let mut off = 0;
    for p in params {
        let n = p.numel();
        let c = p
            .detach()
            .to_device(Device::Cpu)
            .to_kind(Kind::Float)
            .contiguous();
        c.view([-1]).copy_data(&mut out[off..off + n], n);
        off += n;
    }
    out
}

impl Tiny {
    pub fn new(run: &RunConfig, sc: &Scenario) -> Result<Tiny, SimError> {
        let spec = &sc.trainer;
        // The node runs with `--threads 1` in `swarm demo`; the same count keeps float
        // reductions in the same order, so gradients (not only applies) match a real node.
        tch::set_num_threads(spec.threads.max(1));
        let corpus =
            Corpus::open(&corpus_spec(run)?).map_err(|e| SimError::Scenario(e.to_string()))?;
        if corpus.vocab() as u32 > run.model.vocab {
            return Err(SimError::Scenario(format!(
                "data vocabulary {} exceeds the model's {}",
                corpus.vocab(),
                run.model.vocab
            )));
        }
        if run.batch_seqs == 0 {
            return Err(SimError::Scenario(
                "run: batch_seqs must be at least 1".into(),
            ));
        }
        // The node's initial weights: `Llama::new` seeds from the run seed.
        // `Llama::new` holds its own lock around libtorch's global generator, so models built
        // on several threads at once still start from the run's weights.
        let model = Llama::new(&run.model, Device::Cpu, run.seed);
        let layout = run.layout();
        let codec = DctCodec::new(layout.clone(), Device::Cpu);
        let init = flatten(&model.params);
        let tensors = model
            .names
            .iter()
            .zip(&model.params)
            .map(|(n, p)| {
                let shape: Vec<u32> = p.size().iter().map(|&d| d as u32).collect();
                (n.clone(), shape, p.numel())
            })
            .collect();
        Ok(Tiny {
            run: run.clone(),
            layout,
            model,
            codec,
            corpus,
            init,
            tensors,
            states: Vec::new(),
            batch: run.batch_seqs as usize,
            eval_batches: spec.eval_batches.max(1),
            adamw_lr: sc.optim.adamw_lr,
            adamw_wd: spec.adamw_wd,
            spot_cache: HashMap::new(),
        })
    }

    pub fn params_len(&self) -> usize {
        self.init.len()
    }

    fn seq(&self) -> usize {
        self.run.model.seq_len as usize
    }

    /// The node's `Trainer::lr`: the run's schedule at `step`.
    fn lr(&self, step: u64) -> f64 {
        train::demo::run_lr(&self.run, step)
    }

    /// Overwrite the shared model's weights with `params` (flat, wire order).
    fn load(&mut self, params: &[f32]) {
        // The world only ever hands back vectors this trainer produced: a length mismatch is a
        // bug in the simulator, not bad input.
        assert_eq!(
            params.len(),
            self.init.len(),
            "flat parameters of another model"
        );
        tch::no_grad(|| {
            let mut off = 0;
            for p in self.model.params.iter_mut() {
                let n = p.numel();
                let t = Tensor::from_slice(&params[off..off + n]).view(p.size().as_slice());
                p.copy_(&t);
                off += n;
            }
        });
    }

    /// Fresh tensors holding `params`, shaped like the model's (for applying a step without
    /// touching the shared model).
    fn tensors_of(&self, params: &[f32]) -> Vec<Tensor> {
        let mut off = 0;
        self.tensors
            .iter()
            .map(|(_, shape, n)| {
                let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
                let t = Tensor::from_slice(&params[off..off + n]).view(dims.as_slice());
                off += n;
                t
            })
            .collect()
    }

    /// A node's training step with its batch keyed by `who` (a node: its id's 32 bytes; an
    /// in-process replica of `train::run`: `replica_id(r)`), momentum slot `node`.
    pub fn train_as(&mut self, node: usize, who: &[u8], step: u64, params: &[f32]) -> Local {
        self.load(params);
        let seq = self.seq();
        let (x, y) = self.corpus.batch(
            "train",
            self.run.seed,
            who,
            step,
            self.batch,
            seq,
            Device::Cpu,
        );
        self.model.zero_grad();
        let loss = self.model.loss(&x, &y);
        loss.backward();
        let l = loss.double_value(&[]);
        let grads = self.model.grads();
        let lr = self.lr(step);
        if self.states.len() <= node {
            self.states.resize_with(node + 1, || None);
        }
        let model = &self.model;
        let state = self.states[node].get_or_insert_with(|| DemoState::new(&model.params));
        let o = &self.run.optim;
        state.accumulate(&grads, lr, o);
        let update = self.codec.encode(&mut state.delta, o.topk, o.values);
        Local {
            update,
            tokens: (self.batch * seq) as u64,
            train_loss: Some(l),
        }
    }

    /// Loss of the shared model (already loaded) on `batch` sequences of `who`'s training
    /// batch for `step`, without gradients.
    fn batch_loss(&self, who: &[u8], step: u64, batch: usize) -> f64 {
        let (x, y) = self.corpus.batch(
            "train",
            self.run.seed,
            who,
            step,
            batch,
            self.seq(),
            Device::Cpu,
        );
        tch::no_grad(|| self.model.loss(&x, &y).double_value(&[]))
    }
}

impl Trainer for Tiny {
    fn init(&mut self) -> Vec<f32> {
        self.init.clone()
    }

    /// `node::trainer::Trainer::train`, on `params` instead of the node's own model.
    fn train(&mut self, node: usize, id: &NodeId, step: u64, params: &[f32]) -> Local {
        self.train_as(node, &id.0, step, params)
    }

    /// `node::trainer::Trainer::apply`.
    fn apply_round(
        &mut self,
        step: u64,
        params: &[f32],
        updates: &[(&SparseUpdate, u64)],
    ) -> Vec<f32> {
        // Nothing to apply: every node that saw the empty set keeps its parameters.
        if updates.is_empty() {
            return params.to_vec();
        }
        let p = self.tensors_of(params);
        apply_round(&self.codec, &self.run, step, &p, updates);
        flatten(&p)
    }

    fn eval(&mut self, params: &[f32]) -> f64 {
        self.load(params);
        eval_loss(
            &self.model,
            &self.corpus,
            self.run.seed,
            self.eval_batches,
            self.batch,
        )
    }

    /// `protocol::checkpoint::params_digest` of the named tensors (= `Llama::digest`).
    fn digest(&self, params: &[f32]) -> Digest {
        let mut off = 0;
        let entries: Vec<TensorEntry> = self
            .tensors
            .iter()
            .map(|(name, shape, n)| {
                let bytes: Vec<u8> = params[off..off + n]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                off += n;
                TensorEntry {
                    name: name.clone(),
                    shape: shape.clone(),
                    dtype: Dtype::F32,
                    hash: Digest::of(&bytes),
                }
            })
            .collect();
        params_digest(&entries)
    }

    fn reset_node(&mut self, node: usize) {
        if let Some(s) = self.states.get_mut(node) {
            *s = None;
        }
    }

    /// `train::run::train` with AdamW on the exact mean gradient of `nodes` replicas, the same
    /// model, seed, batch and schedule; its eval loss after every step.
    fn baseline(&mut self, steps: u64, nodes: usize) -> Result<Vec<f64>, SimError> {
        let steps32 = u32::try_from(steps)
            .map_err(|_| SimError::Scenario(format!("{steps} steps: too many for the baseline")))?;
        let opts = TrainOptions {
            model: self.run.model.clone(),
            optimizer: Optimizer::Adamw,
            replicas: nodes.max(1),
            steps: steps32,
            batch: self.batch,
            seed: self.run.seed,
            optim: self.run.optim.clone(),
            adamw_lr: self.adamw_lr,
            adamw_wd: self.adamw_wd,
            eval_every: 1,
            eval_batches: self.eval_batches,
        };
        let (_, report) = train::run::train(&opts, &self.corpus, Device::Cpu, |_| {})
            .map_err(|e| SimError::Scenario(format!("AdamW baseline: {e}")))?;
        Ok(report
            .steps
            .iter()
            .map(|r| r.eval_loss.unwrap_or(f64::NAN))
            .collect())
    }

    fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The protocol's check: the loss on the sender's own batch for `step` (recomputed from its
    /// id) before minus after applying `update` alone to the checker's `params`. The batch has
    /// the sequences the header's tokens state, at most the run's nominal batch: a sender that
    /// trained on more drew them from the same stream, so the first `batch_seqs` are its own,
    /// and a hostile claim of huge token counts costs the checker nothing extra.
    fn spot_check(
        &mut self,
        sender: &NodeId,
        step: u64,
        params: &[f32],
        update: &SparseUpdate,
        tokens: u64,
    ) -> f64 {
        let mut key = self.digest(params).0.to_vec();
        key.extend_from_slice(&sender.0);
        key.extend_from_slice(&step.to_le_bytes());
        key.extend_from_slice(&Digest::of(&update.encode()).0);
        key.extend_from_slice(&tokens.to_le_bytes());
        let key = Digest::of(&key).0;
        if let Some(&(_, gain)) = self.spot_cache.get(&key) {
            return gain;
        }
        let seqs = (tokens / self.seq().max(1) as u64).clamp(1, self.batch as u64) as usize;
        self.load(params);
        let before = self.batch_loss(&sender.0, step, seqs);
        let after = self.apply_round(step, params, &[(update, tokens)]);
        self.load(&after);
        let gain = before - self.batch_loss(&sender.0, step, seqs);
        // Checks concern the last few steps only (the engine's window): keep those.
        self.spot_cache.retain(|_, (s, _)| *s + 4 > step);
        self.spot_cache.insert(key, (step, gain));
        gain
    }
}
