//! The real model as a simulator trainer (feature `torch`): every node's step is the `train`
//! crate's [`NodeStep`], the one `swarm run`'s trainer thread and `swarm train`'s replicas call,
//! so a simulated swarm and a real one with the same keys, run file and included sets hold
//! bit-identical parameters after every step.
//!
//! * Parameters live in the world as one flat `f32` vector: the model's tensors in wire order
//!   (`ModelConfig::tensor_shapes`), each row-major. One `Llama` instance serves every node: its
//!   weights are overwritten with the node's flat parameters before each forward pass, so 32
//!   nodes cost 32 optimizer states (momentum and look-ahead), not 32 models.
//! * A node trains step t on the parameters it holds (version `base_version`, as the engine's
//!   `StartStep` says: one step stale in the swarm's schedule), with its own [`NodeState`].
//! * Applying, spot checks and the digest are the node's too ([`NodeStep::apply`],
//!   [`NodeStep::spot_check`], `protocol::checkpoint::f32_params_digest`).
//! * The reported loss is the mean loss on `eval_batches` fixed held-out batches
//!   (`train::run::eval_loss`, as `swarm train`, `swarm demo` and the AdamW baseline report).

use std::collections::HashMap;

use crypto::{Digest, NodeId};
use protocol::checkpoint::f32_params_digest;
use protocol::run::RunConfig;
use protocol::sparse::{Layout, SparseUpdate};
use train::data::{Corpus, DataSpec};
use train::model::Llama;
use train::node::{NodeState, NodeStep};
use train::run::{eval_loss, Optimizer, TrainOptions};
use train::tch::{self, Device, Kind, Tensor};

use crate::scenario::Scenario;
use crate::synth::{Local, SimTrainer};
use crate::{ScenarioError, SimError};

/// The real `tiny` (or a run file's) model, trained with DeMo by every simulated node.
pub struct Tiny {
    run: RunConfig,
    /// The one model instance every node's step loads its parameters into.
    model: Llama,
    /// What every node computes (train, apply, spot check).
    step: NodeStep,
    corpus: Corpus,
    /// Initial parameters (version 0), flat.
    init: Vec<f32>,
    /// Each tensor's name and element count, in wire order (the flat layout).
    tensors: Vec<(String, Vec<u32>, usize)>,
    /// Per node: its optimizer state (`None`: fresh, zero).
    states: Vec<Option<NodeState>>,
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
    DataSpec::for_run(run, None).map_err(|_| ScenarioError::TinyNeedsSynthetic.into())
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
        let corpus = Corpus::open(&corpus_spec(run)?).map_err(SimError::Corpus)?;
        if corpus.vocab() as u32 > run.model.vocab {
            return Err(ScenarioError::VocabTooLarge {
                data: corpus.vocab(),
                model: run.model.vocab,
            }
            .into());
        }
        if run.batch_seqs == 0 {
            return Err(ScenarioError::NoBatch.into());
        }
        // The node's initial weights: `Llama::new` seeds from the run seed.
        // `Llama::new` holds its own lock around libtorch's global generator, so models built
        // on several threads at once still start from the run's weights.
        let model = Llama::new(&run.model, Device::Cpu, run.seed);
        let step = NodeStep::for_run(run, Device::Cpu);
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
            model,
            step,
            corpus,
            init,
            tensors,
            states: Vec::new(),
            eval_batches: spec.eval_batches.max(1),
            adamw_lr: sc.optim.adamw_lr,
            adamw_wd: spec.adamw_wd,
            spot_cache: HashMap::new(),
        })
    }

    pub fn params_len(&self) -> usize {
        self.init.len()
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
    /// in-process replica of `train::run`: `replica_id(r)`), state slot `node`, on `params`
    /// holding `version` applied steps.
    pub fn train_as(
        &mut self,
        node: usize,
        who: &[u8],
        step: u64,
        version: u64,
        params: &[f32],
    ) -> Local {
        self.load(params);
        if self.states.len() <= node {
            self.states.resize_with(node + 1, || None);
        }
        let model = &self.model;
        let state = self.states[node].get_or_insert_with(|| NodeState::new(&model.params));
        let t = self
            .step
            .train(&self.corpus, &self.model, state, who, step, version);
        Local {
            update: t.update,
            tokens: t.tokens,
            train_loss: Some(t.loss),
        }
    }
}

impl SimTrainer for Tiny {
    fn init(&mut self) -> Vec<f32> {
        self.init.clone()
    }

    /// `node::trainer::Trainer::train`, on `params` instead of the node's own model.
    fn train(
        &mut self,
        node: usize,
        id: &NodeId,
        step: u64,
        version: u64,
        params: &[f32],
    ) -> Local {
        self.train_as(node, &id.0, step, version, params)
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
        self.step.apply(&p, step, updates);
        flatten(&p)
    }

    fn eval(&mut self, params: &[f32]) -> f64 {
        self.load(params);
        eval_loss(
            &self.model,
            &self.corpus,
            self.run.seed,
            self.eval_batches,
            self.step.batch,
        )
    }

    /// `protocol::checkpoint::params_digest` of the named tensors (= `Llama::digest`).
    fn digest(&self, params: &[f32]) -> Digest {
        let t = self.checkpoint_tensors(params);
        f32_params_digest(
            t.iter()
                .map(|(name, shape, b)| (name.as_str(), shape.as_slice(), b.as_slice())),
        )
    }

    /// The named tensors, as `swarm run` serves them.
    fn checkpoint_tensors(&self, params: &[f32]) -> Vec<(String, Vec<u32>, Vec<u8>)> {
        let mut off = 0;
        self.tensors
            .iter()
            .map(|(name, shape, n)| {
                let b = params[off..off + n]
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                off += n;
                (name.clone(), shape.clone(), b)
            })
            .collect()
    }

    fn wire_digest(&self, params: &[f32]) -> Digest {
        self.digest(params)
    }

    fn reset_node(&mut self, node: usize) {
        if let Some(s) = self.states.get_mut(node) {
            *s = None;
        }
    }

    /// `train::run::train` with AdamW on the exact mean gradient of `nodes` replicas, the same
    /// model, seed, batch and schedule; its eval loss after every step (for local steps, after
    /// every H batches: equal tokens).
    fn baseline(&mut self, steps: u64, nodes: usize) -> Result<Vec<f64>, SimError> {
        let hh = self.run.optim.inner_steps() as u64;
        let steps32 = u32::try_from(steps * hh).map_err(|_| ScenarioError::TooManySteps(steps))?;
        let opts = TrainOptions {
            model: self.run.model.clone(),
            optimizer: Optimizer::Adamw,
            replicas: nodes.max(1),
            steps: steps32,
            batch: self.step.batch,
            seed: self.run.seed,
            // Local steps count warm-up in windows; AdamW in batches.
            optim: protocol::config::OptimConfig {
                warmup_steps: self.run.optim.warmup_steps * hh as u32,
                local: None,
                ..self.run.optim.clone()
            },
            adamw_lr: self.adamw_lr,
            adamw_wd: self.adamw_wd,
            eval_every: 1,
            eval_batches: self.eval_batches,
            schedule: Default::default(),
            init: None,
        };
        let (_, report) = train::run::train(&opts, &self.corpus, Device::Cpu, |_| {})
            .map_err(SimError::Baseline)?;
        Ok(report
            .steps
            .iter()
            .skip(hh as usize - 1)
            .step_by(hh as usize)
            .map(|r| r.eval_loss.unwrap_or(f64::NAN))
            .collect())
    }

    fn layout(&self) -> &Layout {
        self.step.layout()
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
        self.load(params);
        let gain = self
            .step
            .spot_check(&self.corpus, &self.model, &sender.0, step, update, tokens);
        // Checks concern the last few steps only (the engine's window): keep those.
        self.spot_cache.retain(|_, (s, _)| *s + 4 > step);
        self.spot_cache.insert(key, (step, gain));
        gain
    }
}
