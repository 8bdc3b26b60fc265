//! Scenario files (TOML): who the nodes are, their links, the run's timing and optimizer, the
//! faults and attackers, and which model of the network to run. See `sim/scenarios/*.toml`.

use protocol::config::{ModelConfig, OptimConfig, ValueCodec};
use protocol::run::Defence;
use serde::{Deserialize, Serialize};

use crate::net::LinkProfile;
use crate::{ScenarioError, SimError};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A real `protocol::engine::Engine` per node, real signed frames, the gossip model.
    Engine,
    /// The flow model for thousands of nodes (see `flow`): same network model and trainer,
    /// the engine's inclusion rule applied per node, no per-message cryptography.
    Flow,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timing {
    pub period_ms: u64,
    pub grace_ms: u64,
    pub summary_ms: u64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            period_ms: 2000,
            grace_ms: 300,
            summary_ms: 700,
        }
    }
}

/// The model whose layout the synthetic trainer's updates have.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSpec {
    pub vocab: u32,
    pub dim: u32,
    pub layers: u32,
    pub heads: u32,
    pub ffn: u32,
    /// Bytes each update blob is charged on the wire. 0: its real encoded size. Set it to
    /// model a large model's update (e.g. 1.92 MB for `1.2b`) while the trainer and the engine
    /// work on this small layout: the blob bytes are modelled, not materialized.
    pub wire_blob_bytes: u64,
    /// Bytes of a checkpoint download (0: the parameters as f32); each chunk response is
    /// charged its share.
    pub checkpoint_bytes: u64,
    /// The run's `max_checkpoint_chunk_bytes` (0: the run's default): small chunks spread a
    /// download over more of its servers.
    pub checkpoint_chunk_bytes: u32,
}

impl Default for ModelSpec {
    fn default() -> Self {
        ModelSpec {
            vocab: 64,
            dim: 32,
            layers: 1,
            heads: 2,
            ffn: 64,
            wire_blob_bytes: 0,
            checkpoint_bytes: 0,
            checkpoint_chunk_bytes: 0,
        }
    }
}

impl ModelSpec {
    pub fn config(&self) -> ModelConfig {
        ModelConfig {
            name: "sim".into(),
            vocab: self.vocab,
            dim: self.dim,
            layers: self.layers,
            heads: self.heads,
            kv_heads: self.heads,
            ffn: self.ffn,
            seq_len: 16,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Optim {
    pub chunk: u32,
    pub topk: u32,
    pub beta: f64,
    /// Sign-step size (DeMo) at its peak.
    pub lr: f64,
    pub warmup_steps: u32,
    /// Cosine length (0: the scenario's step count).
    pub total_steps: u32,
    /// Standard deviation of each node's gradient noise (the synthetic objective).
    pub noise: f32,
    /// The AdamW baseline's peak rate.
    pub adamw_lr: f64,
    /// How updates are combined: `mean` (the DeMo reference) or `share` (bounded influence).
    pub combine: protocol::config::Combine,
    /// How kept values travel: `sign` (1 bit, the DeMo default), `bf16` or `f32`.
    pub values: ValueCodec,
    /// Clip each node's gradient to this global L2 norm (0 = off; the `tiny` trainer).
    pub grad_clip: f64,
    /// Decoupled weight decay of the sign step.
    pub weight_decay: f64,
    /// Delay compensation while a step is in flight (`off`, `momentum`, `update`; the `tiny`
    /// trainer).
    pub lookahead: protocol::config::Lookahead,
    /// Local steps in place of DeMo (the `tiny` trainer; the synthetic trainer ignores it).
    pub local: Option<protocol::config::LocalSteps>,
}

impl Default for Optim {
    fn default() -> Self {
        Optim {
            chunk: 8,
            topk: 2,
            beta: 0.9,
            lr: 0.05,
            warmup_steps: 0,
            total_steps: 0,
            noise: 1.0,
            adamw_lr: 0.05,
            combine: protocol::config::Combine::Mean,
            values: ValueCodec::Sign,
            grad_clip: 0.0,
            weight_decay: 0.0,
            lookahead: protocol::config::Lookahead::Off,
            local: None,
        }
    }
}

impl Optim {
    pub fn config(&self, steps: u64) -> OptimConfig {
        OptimConfig {
            chunk: self.chunk,
            topk: self.topk,
            values: self.values,
            beta: self.beta,
            lr: self.lr,
            weight_decay: self.weight_decay,
            warmup_steps: self.warmup_steps,
            total_steps: if self.total_steps == 0 {
                steps as u32
            } else {
                self.total_steps
            },
            min_lr_ratio: 0.1,
            grad_clip: self.grad_clip,
            combine: self.combine,
            lookahead: self.lookahead,
            local: self.local.clone(),
        }
    }
}

/// Which trainer the nodes run (engine mode; flow mode always uses the synthetic one).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainerKind {
    /// The separable quadratic of `synth` (known optimum 0, no libtorch).
    Synthetic,
    /// The real `train` crate: `tiny` Llama, synthetic Markov corpus, DeMo exactly as
    /// `swarm run` computes it (`tiny`). Needs the `torch` feature (`swarm sim` has it).
    Tiny,
}

/// `[trainer]`: what the nodes train. For `kind = "tiny"` the `[model]` shape fields and
/// `optim.noise` are not used (the model is the `tiny` preset, or the run file's).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainerSpec {
    pub kind: TrainerKind,
    /// A real run config (TOML, as `swarm run --run` takes; relative to the scenario file):
    /// model, optimizer, data, seed and batch come from it, timing and nodes from the
    /// scenario. Empty: the `tiny` preset with `[optim]`, `batch`, `data_seed`, `data_vocab`.
    pub run: String,
    /// Sequences per node per step (without `run`).
    pub batch: u32,
    /// The synthetic Markov corpus (without `run`): its seed and vocabulary.
    pub data_seed: u64,
    pub data_vocab: u32,
    /// libtorch CPU threads. 1 (the default) is what `swarm demo`'s nodes use, so simulated
    /// and real nodes reduce floats in the same order.
    pub threads: i32,
    /// Held-out batches of the reported eval loss (fixed: `eval` split, ids `eval`, 0..n).
    pub eval_batches: usize,
    /// Run the AdamW + all-reduce baseline (`train::run` on the same model, nodes, steps).
    pub baseline: bool,
    /// AdamW's decoupled weight decay (its rate is `optim.adamw_lr`).
    pub adamw_wd: f64,
}

impl Default for TrainerSpec {
    fn default() -> Self {
        TrainerSpec {
            kind: TrainerKind::Synthetic,
            run: String::new(),
            batch: 4,
            data_seed: 1,
            data_vocab: 32,
            threads: 1,
            eval_batches: 1,
            baseline: true,
            adamw_wd: 0.1,
        }
    }
}

/// The gossip layer's parameters, with the real node's settings they stand for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Gossip {
    /// Mesh degree (gossipsub `mesh_n`, default 6; `mesh_n_low` 5 / `mesh_n_high` 12 are not
    /// modelled: the mesh is fixed, joiners graft to `mesh_degree` random live peers).
    pub mesh_degree: usize,
    /// Request-response timeout for a fetch that got no answer (lost, partitioned, dead peer).
    pub fetch_timeout_ms: u64,
    /// Bytes of a fetch request (request-response framing + the 32-byte blob id).
    pub request_bytes: u64,
}

impl Default for Gossip {
    fn default() -> Self {
        Gossip {
            mesh_degree: 6,
            fetch_timeout_ms: 2000,
            request_bytes: 96,
        }
    }
}

/// A group of alike nodes.
// No deny_unknown_fields here: serde does not support it together with `flatten`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeClass {
    #[serde(default = "one")]
    pub count: usize,
    #[serde(flatten)]
    pub link: LinkProfile,
    /// Virtual time one training step takes on this node.
    #[serde(default = "train_ms")]
    pub compute_ms: u64,
}

fn one() -> usize {
    1
}
fn train_ms() -> u64 {
    500
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Fault {
    /// Node `node` crashes at the start of `at_step` (+ `offset_ms`); with `recover_step`, it
    /// restarts then as a fresh process and joins through a checkpoint.
    Crash {
        node: usize,
        at_step: u64,
        #[serde(default)]
        offset_ms: u64,
        #[serde(default)]
        recover_step: Option<u64>,
    },
    /// `count` new nodes of class `class` join at `at_step`.
    Join {
        at_step: u64,
        #[serde(default = "one")]
        count: usize,
        #[serde(default)]
        class: usize,
    },
    /// Nodes `[lo, hi)` are cut off from the rest from `at_step` until `heal_step`.
    Partition {
        at_step: u64,
        heal_step: u64,
        lo: usize,
        hi: usize,
    },
    /// Node `node`'s link rates are multiplied by `factor` and its training slowed by
    /// `slowdown` from `at_step` on.
    Degrade {
        node: usize,
        at_step: u64,
        #[serde(default = "unit")]
        factor: f64,
        #[serde(default = "unit")]
        slowdown: f64,
    },
}

impl Fault {
    /// When the fault strikes (unix ms on `timing`'s clock): its step's start, plus a crash's
    /// offset. The engine-mode world and flow mode schedule it at this instant.
    pub fn at_ms(&self, timing: &protocol::run::StepTiming) -> u64 {
        match self {
            Fault::Crash {
                at_step, offset_ms, ..
            } => timing.step_start(*at_step) + offset_ms,
            Fault::Join { at_step, .. }
            | Fault::Partition { at_step, .. }
            | Fault::Degrade { at_step, .. } => timing.step_start(*at_step),
        }
    }
}

fn unit() -> f64 {
    1.0
}

pub use crate::adversary::{Attack, Attacker};

/// `defence = "full"` (every content defence, `Defence::full()`), `"off"`, or a table of
/// `protocol::run::Defence` fields (`[defence] majority = true spot_checks = 2 ...`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DefenceSpec {
    Preset(String),
    Fields(Defence),
}

impl Default for DefenceSpec {
    fn default() -> Self {
        DefenceSpec::Fields(Defence::default())
    }
}

impl DefenceSpec {
    pub fn full() -> DefenceSpec {
        DefenceSpec::Preset("full".into())
    }

    /// The run's defence settings.
    pub fn resolve(&self) -> Result<Defence, SimError> {
        match self {
            DefenceSpec::Fields(d) => Ok(d.clone()),
            DefenceSpec::Preset(p) => match p.as_str() {
                "full" => Ok(Defence::full()),
                "off" => Ok(Defence::default()),
                other => Err(ScenarioError::UnknownDefence(other.to_string()).into()),
            },
        }
    }
}

/// Which updates a step includes, in the flow model (the engine mode always includes all).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Policy {
    /// Every node's update: per-node download grows as (N−1)·update.
    All,
    /// A committee of `m` per step: the reputable nodes (online and in sync for at least
    /// `min_reputation` steps) ordered by a per-step hash, so the seats rotate evenly. Only its
    /// members publish updates and summaries; everyone else keeps training (their momentum
    /// keeps what they have not sent, as DeMo's decoupling does) and downloads m updates.
    Committee {
        m: usize,
        #[serde(default = "min_rep")]
        min_reputation: u64,
    },
}

fn min_rep() -> u64 {
    2
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Flow {
    pub policy: Policy,
    /// Bytes of a signed header announcement and of a summary's fixed part (+33 per id).
    pub header_bytes: u64,
    pub summary_bytes: u64,
}

impl Default for Flow {
    fn default() -> Self {
        Flow {
            policy: Policy::All,
            header_bytes: 330,
            summary_bytes: 300,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Scenario {
    pub name: String,
    pub description: String,
    pub mode: Mode,
    pub seed: u64,
    pub steps: u64,
    pub timing: Timing,
    pub model: ModelSpec,
    pub optim: Optim,
    pub trainer: TrainerSpec,
    pub gossip: Gossip,
    pub flow: Flow,
    #[serde(rename = "class")]
    pub classes: Vec<NodeClass>,
    #[serde(rename = "fault")]
    pub faults: Vec<Fault>,
    #[serde(rename = "attacker")]
    pub attackers: Vec<Attacker>,
    /// The run's content defences (engine mode); see [`DefenceSpec`]. Default: off.
    pub defence: DefenceSpec,
    /// Run the scenario once per node count listed here (the first class takes the count):
    /// the scale sweep. Empty: run it as written.
    pub sweep: Vec<usize>,
    /// Nodes that lie when serving checkpoints (engine mode); otherwise honest.
    #[serde(rename = "checkpoint_liar")]
    pub checkpoint_liars: Vec<CheckpointLiar>,
}

/// A node that serves false checkpoints (`[[checkpoint_liar]] node = 3 lie = "chunk"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointLiar {
    pub node: usize,
    pub lie: Lie,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lie {
    /// Signs the true manifest and serves chunks with a byte flipped: provably wrong (the
    /// chunk does not hash to what its own signed manifest says), so it is banned.
    Chunk,
    /// Signs a manifest of other parameters for the version asked (and serves them
    /// faithfully): no provable lie by itself; once the joiner loads the attested checkpoint
    /// from others, it never asks this server for one again.
    Manifest,
}

impl Default for Scenario {
    fn default() -> Self {
        Scenario {
            name: "default".into(),
            description: String::new(),
            mode: Mode::Engine,
            seed: 1,
            steps: 20,
            timing: Timing::default(),
            model: ModelSpec::default(),
            optim: Optim::default(),
            trainer: TrainerSpec::default(),
            gossip: Gossip::default(),
            flow: Flow::default(),
            classes: vec![NodeClass {
                count: 8,
                link: LinkProfile::default(),
                compute_ms: 500,
            }],
            faults: Vec::new(),
            attackers: Vec::new(),
            defence: DefenceSpec::default(),
            sweep: Vec::new(),
            checkpoint_liars: Vec::new(),
        }
    }
}

impl Scenario {
    pub fn from_toml(text: &str) -> Result<Scenario, SimError> {
        let s: Scenario = toml::from_str(text).map_err(|e| SimError::Parse(Box::new(e)))?;
        s.check()?;
        Ok(s)
    }

    pub fn load(path: &std::path::Path) -> Result<Scenario, SimError> {
        let text = std::fs::read_to_string(path).map_err(|source| SimError::Io {
            path: path.into(),
            source,
        })?;
        let mut s = Self::from_toml(&text)?;
        // A run file is named relative to the scenario, so scenarios work from any directory.
        if !s.trainer.run.is_empty() {
            let p = std::path::Path::new(&s.trainer.run);
            if p.is_relative() {
                let base = path.parent().unwrap_or(std::path::Path::new("."));
                s.trainer.run = base.join(p).to_string_lossy().into_owned();
            }
        }
        Ok(s)
    }

    /// This scenario with `n` nodes in its first class (one point of a sweep).
    pub fn with_nodes(&self, n: usize) -> Scenario {
        let mut s = self.clone();
        let others: usize = s.classes.iter().skip(1).map(|c| c.count).sum();
        s.classes[0].count = n.saturating_sub(others).max(1);
        s.name = format!("{}-n{}", self.name, n);
        s.sweep.clear();
        s
    }

    /// Initial node count.
    pub fn nodes(&self) -> usize {
        self.classes.iter().map(|c| c.count).sum()
    }

    /// Class of each initial node, in order.
    pub fn node_classes(&self) -> Vec<usize> {
        self.classes
            .iter()
            .enumerate()
            .flat_map(|(i, c)| std::iter::repeat_n(i, c.count))
            .collect()
    }

    /// The simulated network: every node's link by its class, in node order, seeded by the
    /// scenario.
    pub fn network(&self) -> crate::net::Network {
        crate::net::Network::new(
            self.node_classes()
                .iter()
                .map(|&c| self.classes[c].link.clone())
                .collect(),
            self.seed,
        )
    }

    pub fn check(&self) -> Result<(), SimError> {
        let bad = |e: ScenarioError| Err(SimError::from(e));
        if self.nodes() == 0 {
            return bad(ScenarioError::NoNodes);
        }
        if self.steps == 0 {
            return bad(ScenarioError::NoSteps);
        }
        let t = &self.timing;
        if t.period_ms == 0 || t.grace_ms + t.summary_ms > t.period_ms {
            return bad(ScenarioError::Timing {
                grace: t.grace_ms,
                summary: t.summary_ms,
                period: t.period_ms,
            });
        }
        let most = self
            .sweep
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(self.nodes());
        if self.mode == Mode::Engine && most > 250 {
            return bad(ScenarioError::TooManyForEngine);
        }
        if self.trainer.kind == TrainerKind::Tiny {
            if self.mode == Mode::Flow {
                return bad(ScenarioError::TinyInFlow);
            }
            if self.trainer.batch == 0 || self.trainer.threads < 1 || self.trainer.eval_batches == 0
            {
                return bad(ScenarioError::TinyZero);
            }
        }
        self.defence.resolve()?;
        for a in &self.attackers {
            a.attack.check()?;
            let attacker = a.attack.name();
            if !(0.0..1.0).contains(&a.fraction) {
                return bad(ScenarioError::AttackerFraction { attacker });
            }
            if a.fraction == 0.0 && a.nodes.is_empty() {
                return bad(ScenarioError::AttackerNobody { attacker });
            }
            if let Some(&node) = a.nodes.iter().find(|&&x| x >= self.nodes()) {
                return bad(ScenarioError::AttackerNoNode { attacker, node });
            }
            // The flow model has no engines to attack (it only ever modelled withholding).
            if self.mode == Mode::Flow && !matches!(a.attack, Attack::Withhold | Attack::Silent) {
                return bad(ScenarioError::AttackerInFlow { attacker });
            }
        }
        if let Some(l) = self
            .checkpoint_liars
            .iter()
            .find(|l| l.node >= self.nodes())
        {
            return bad(ScenarioError::LiarNoNode(l.node));
        }
        if self.mode == Mode::Flow && !self.checkpoint_liars.is_empty() {
            return bad(ScenarioError::LiarInFlow);
        }
        for f in &self.faults {
            if let Fault::Join { class, .. } = f {
                if *class >= self.classes.len() {
                    return bad(ScenarioError::JoinNoClass(*class));
                }
            }
        }
        Ok(())
    }
}
