//! `swarm train`: N data-parallel replicas in one process, with DeMo (replicas exchange their
//! sparse updates in memory) or AdamW on the exact mean gradient (all-reduce).
//!
//! The replicas of a DeMo run hold bit-identical parameters by construction (every one applies
//! the same exact sign step), so the process keeps one copy of the weights and one momentum per
//! replica; each replica computes its own gradient on its own batch with the node's own step
//! (`crate::node::NodeStep`), exactly as `swarm run` and the simulator do.
//!
//! [`Schedule::Overlap`] is the swarm's schedule without the network: step t is trained on
//! parameters that still lack step t−1 (in a swarm its updates are in flight while the next
//! step computes), and step t−1 is applied after step t's gradients are taken. For AdamW the
//! same schedule is a one-step-delayed all-reduce.

use crate::adamw::AdamW;
use crate::data::Corpus;
use crate::demo::grad_norm;
use crate::model::Llama;
use crate::node::{NodeState, NodeStep};
use crate::{ConfigError, TrainError};
use protocol::config::{lr_at, ModelConfig, OptimConfig};
use protocol::sparse::SparseUpdate;
use serde::{Deserialize, Serialize};
use std::time::Instant;
use tch::{Device, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    Demo,
    Adamw,
    /// Local steps (`optim.local`): windows of H inner AdamW steps, compressed pseudo-gradients.
    Local,
}

/// When a step's result reaches the parameters the next step trains on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Step t trains on parameters holding every step before it (one process, no network).
    #[default]
    Sync,
    /// The swarm's: step t trains on parameters that lack step t−1.
    Overlap,
}

impl std::str::FromStr for Schedule {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sync" => Ok(Schedule::Sync),
            "overlap" => Ok(Schedule::Overlap),
            o => Err(format!("unknown schedule {o:?} (expected sync or overlap)")),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainOptions {
    pub model: ModelConfig,
    pub optimizer: Optimizer,
    pub replicas: usize,
    /// Batches each replica trains (for local steps, `steps / H` windows of H).
    pub steps: u32,
    /// Sequences per replica per step.
    pub batch: usize,
    pub seed: u64,
    /// DeMo hyperparameters; `lr`, warm-up, schedule and clip are shared with AdamW.
    pub optim: OptimConfig,
    /// AdamW's peak rate and weight decay (its own sweep differs from DeMo's sign step).
    pub adamw_lr: f64,
    pub adamw_wd: f64,
    pub eval_every: u32,
    pub eval_batches: usize,
    #[serde(default)]
    pub schedule: Schedule,
    /// Start from these weights (a safetensors file in swarm's names, e.g. from `swarm
    /// import`) instead of the seeded initialization.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StepRecord {
    /// The last batch this record covers, counted per replica from 0 (a local-steps window
    /// covers H of them), so runs of every optimizer line up at equal tokens.
    pub step: u32,
    pub lr: f64,
    /// Mean train loss over replicas.
    pub train_loss: f64,
    pub eval_loss: Option<f64>,
    /// Bytes one replica sends per step (DeMo: its update once, as over gossip or a relay;
    /// AdamW: its share of a ring all-reduce of f32 gradients).
    pub bytes_sent: u64,
    /// Bytes one replica receives per step (DeMo: every other replica's update).
    pub bytes_received: u64,
    /// Seconds, summed over replicas, in forward + backward.
    pub t_fwd_bwd: f64,
    /// Seconds, summed over replicas, in momentum + DCT + top-k + packing.
    pub t_compress: f64,
    /// Seconds for aggregation + exact decode + apply (done once: every replica would do the
    /// same work on the same inputs).
    pub t_apply: f64,
    pub grad_norm: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainReport {
    pub options: TrainOptions,
    pub data: String,
    pub params: i64,
    pub device: String,
    pub threads: i32,
    pub loss_floor: Option<f64>,
    pub update_bytes: Option<u64>,
    pub steps: Vec<StepRecord>,
    pub final_eval_loss: f64,
    pub wall_seconds: f64,
    /// Per node and step: (compress + aggregate + apply) / (forward + backward).
    pub codec_fraction: Option<f64>,
    pub final_digest: String,
}

/// Mean loss over fixed held-out batches.
pub fn eval_loss(model: &Llama, corpus: &Corpus, seed: u64, batches: usize, batch: usize) -> f64 {
    let seq = model.cfg.seq_len as usize;
    tch::no_grad(|| {
        let mut s = 0.0;
        for i in 0..batches {
            let (x, y) = corpus.batch("eval", seed, b"eval", i as u64, batch, seq, model.device());
            s += model.loss(&x, &y).double_value(&[]);
        }
        s / batches as f64
    })
}

/// Clip gradients to `max` global L2 norm (0 = off); returns the norm before clipping.
pub fn clip(grads: &mut [Tensor], max: f64) -> f64 {
    let n = grad_norm(grads);
    if max > 0.0 && n > max {
        let s = max / n;
        tch::no_grad(|| {
            grads.iter_mut().for_each(|g| {
                let _ = g.g_mul_scalar_(s);
            })
        });
    }
    n
}

/// Identity bytes of in-process replica `r` (a real node uses its public key).
pub fn replica_id(r: usize) -> Vec<u8> {
    format!("replica-{r}").into_bytes()
}

pub fn train(
    opts: &TrainOptions,
    corpus: &Corpus,
    device: Device,
    mut on_step: impl FnMut(&StepRecord),
) -> Result<(Llama, TrainReport), TrainError> {
    if opts.replicas == 0 || opts.steps == 0 || opts.batch == 0 {
        return Err(ConfigError::ZeroCount.into());
    }
    if (corpus.vocab() as u32) > opts.model.vocab {
        return Err(ConfigError::VocabTooLarge {
            data: corpus.vocab(),
            model: opts.model.vocab,
        }
        .into());
    }
    check_memory(opts, device)?;
    let start = Instant::now();
    let mut model = Llama::new(&opts.model, device, opts.seed);
    if let Some(path) = &opts.init {
        let (tensors, _) = crate::hf::read_f32(std::path::Path::new(path))?;
        model.set_params(&tensors)?;
    }
    let seq = opts.model.seq_len as usize;
    let n = opts.replicas;
    let overlap = opts.schedule == Schedule::Overlap;
    let mut o = opts.optim.clone();
    if opts.optimizer == Optimizer::Local {
        o.local.get_or_insert_with(Default::default);
    } else {
        o.local = None;
    }
    // Batches per protocol step, and protocol steps in the run.
    let hh = o.inner_steps();
    let steps = opts.steps / hh;
    if steps == 0 {
        return Err(ConfigError::ShorterThanWindow {
            steps: opts.steps,
            window: hh,
        }
        .into());
    }
    // The cosine ends at this run's last step (warm-up and length count windows).
    o.total_steps = steps;
    o.warmup_steps = o.warmup_steps.div_ceil(hh);
    let mut records = Vec::with_capacity(opts.steps as usize);
    let mut update_bytes = None;

    enum Opt {
        Demo {
            node: NodeStep,
            states: Vec<NodeState>,
            /// Overlap: the last step's updates, not yet applied.
            pending: Option<(u64, Vec<SparseUpdate>)>,
        },
        Adam {
            adam: AdamW,
            /// Overlap: the last step's all-reduced (clipped) gradient, not yet applied.
            pending: Option<(u32, Vec<Tensor>)>,
        },
    }
    let mut opt = match opts.optimizer {
        Optimizer::Demo | Optimizer::Local => Opt::Demo {
            node: NodeStep::new(&opts.model, &o, opts.seed, opts.batch, device),
            states: (0..n).map(|_| NodeState::new(&model.params)).collect(),
            pending: None,
        },
        Optimizer::Adamw => Opt::Adam {
            adam: AdamW::new(&model.params, opts.adamw_wd),
            pending: None,
        },
    };
    let ids: Vec<Vec<u8>> = (0..n).map(replica_id).collect();
    // Steps applied to the parameters.
    let mut version = 0u64;
    for step in 0..steps {
        let last = step + 1 == steps;
        let mut rec = StepRecord {
            step: step * hh + hh - 1,
            ..Default::default()
        };
        match &mut opt {
            Opt::Demo {
                node,
                states,
                pending,
            } => {
                rec.lr = node.lr(step as u64);
                let mut updates: Vec<SparseUpdate> = Vec::with_capacity(n);
                let mut tokens = 0;
                for r in 0..n {
                    let t = node.train(
                        corpus,
                        &model,
                        &mut states[r],
                        &ids[r],
                        step as u64,
                        version,
                    );
                    rec.train_loss += t.loss / n as f64;
                    rec.grad_norm += t.grad_norm / n as f64;
                    rec.t_fwd_bwd += t.t_fwd_bwd;
                    rec.t_compress += t.t_compress;
                    tokens = t.tokens;
                    updates.push(t.update);
                }
                let t2 = Instant::now();
                let blob = updates[0].encode().len() as u64;
                update_bytes = Some(blob);
                rec.bytes_sent = blob;
                rec.bytes_received = blob * (n as u64 - 1);
                // Every replica trains a full batch: equal token counts.
                let mut apply = |s: u64, ups: &[SparseUpdate]| {
                    let set: Vec<(&SparseUpdate, u64)> = ups.iter().map(|u| (u, tokens)).collect();
                    node.apply(&model.params, s, &set);
                    version = s + 1;
                };
                if overlap {
                    if let Some((s, ups)) = pending.take() {
                        apply(s, &ups);
                    }
                    if last {
                        apply(step as u64, &updates);
                    } else {
                        *pending = Some((step as u64, updates));
                    }
                } else {
                    apply(step as u64, &updates);
                }
                rec.t_apply = t2.elapsed().as_secs_f64();
            }
            Opt::Adam { adam, pending } => {
                let lr_of =
                    |s: u32| lr_at(s, opts.adamw_lr, o.warmup_steps, opts.steps, o.min_lr_ratio);
                rec.lr = lr_of(step);
                let t0 = Instant::now();
                model.zero_grad();
                for r in 0..n {
                    let (x, y) = corpus.batch(
                        "train",
                        opts.seed,
                        &ids[r],
                        step as u64,
                        opts.batch,
                        seq,
                        device,
                    );
                    let loss = model.loss(&x, &y);
                    // Backward of loss/N accumulates the exact mean gradient: all-reduce.
                    (&loss / n as f64).backward();
                    rec.train_loss += loss.double_value(&[]) / n as f64;
                }
                let mut grads = model.grads();
                rec.t_fwd_bwd = t0.elapsed().as_secs_f64();
                let t1 = Instant::now();
                rec.grad_norm = clip(&mut grads, o.grad_clip);
                if overlap {
                    if let Some((s, g)) = pending.take() {
                        adam.step(&model.params, &g, lr_of(s));
                    }
                    if last {
                        adam.step(&model.params, &grads, lr_of(step));
                    } else {
                        *pending = Some((step, grads));
                    }
                } else {
                    adam.step(&model.params, &grads, lr_of(step));
                }
                rec.t_apply = t1.elapsed().as_secs_f64();
                // A ring all-reduce sends and receives 2·(N−1)/N of the f32 gradient per node.
                let b = (2.0 * (n as f64 - 1.0) / n as f64 * 4.0 * model.numel() as f64) as u64;
                rec.bytes_sent = b;
                rec.bytes_received = b;
            }
        }
        // Evaluate when this record crosses a multiple of `eval_every` batches.
        let first = step * hh;
        if opts.eval_every > 0
            && (first.div_ceil(opts.eval_every) != (rec.step + 1).div_ceil(opts.eval_every) || last)
        {
            rec.eval_loss = Some(eval_loss(
                &model,
                corpus,
                opts.seed,
                opts.eval_batches,
                opts.batch,
            ));
        }
        on_step(&rec);
        records.push(rec);
    }
    let final_eval_loss = match records.last().and_then(|r| r.eval_loss) {
        Some(l) => l,
        None => eval_loss(
            &model,
            corpus,
            opts.seed,
            opts.eval_batches.max(1),
            opts.batch,
        ),
    };
    let codec_fraction = match opts.optimizer {
        Optimizer::Demo | Optimizer::Local => {
            let fb: f64 = records.iter().map(|r| r.t_fwd_bwd).sum::<f64>() / n as f64;
            let cm: f64 = records.iter().map(|r| r.t_compress).sum::<f64>() / n as f64;
            let ap: f64 = records.iter().map(|r| r.t_apply).sum::<f64>();
            Some((cm + ap) / fb)
        }
        Optimizer::Adamw => None,
    };
    let report = TrainReport {
        options: opts.clone(),
        data: corpus.describe(),
        params: model.numel(),
        device: format!("{device:?}"),
        threads: tch::get_num_threads(),
        loss_floor: corpus.loss_floor(seq),
        update_bytes,
        steps: records,
        final_eval_loss,
        wall_seconds: start.elapsed().as_secs_f64(),
        codec_fraction,
        final_digest: hex(&model.digest()),
    };
    Ok((model, report))
}

/// Bytes of state a run holds: weights, gradients and their copy, plus one momentum per DeMo
/// replica or AdamW's two moments (activations come on top).
pub fn state_bytes(opts: &TrainOptions) -> u64 {
    let p = opts.model.param_count() * 4;
    let per = match opts.optimizer {
        Optimizer::Demo => opts.replicas as u64,
        Optimizer::Adamw => 2,
        // Moments, error feedback, own progress and two copies per replica.
        Optimizer::Local => 6 * opts.replicas as u64,
    };
    p * (3 + per)
}

/// Refuse, with a clear message, a run that cannot fit in this machine's free memory, rather
/// than being killed by the kernel half-way through allocating.
fn check_memory(opts: &TrainOptions, device: Device) -> Result<(), TrainError> {
    if device != Device::Cpu {
        return Ok(());
    }
    let Some(avail) = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    }) else {
        return Ok(());
    };
    let need = state_bytes(opts);
    if need > avail {
        return Err(ConfigError::OutOfMemory {
            model: opts.model.name.clone(),
            replicas: opts.replicas,
            optimizer: opts.optimizer,
            need,
            avail,
        }
        .into());
    }
    Ok(())
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
