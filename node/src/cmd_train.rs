//! `swarm train`.

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use protocol::config::{Lookahead, ModelConfig, OptimConfig, ValueCodec};
use std::io::IsTerminal;
use std::path::PathBuf;
use train::data::{Corpus, DataSpec};
use train::model::Llama;
use train::run::{Optimizer, Schedule, TrainOptions, TrainReport};

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  swarm train --report runs/demo.json\n  swarm train --optimizer adamw --report runs/adamw.json\n  \
swarm plot runs/demo.json runs/adamw.json --out runs/compare.png\n  \
swarm train --data ../shared/data/tinyshakespeare.txt --steps 300 --report runs/shakespeare.json\n  \
swarm train --schedule overlap --replicas 16 --steps 1000 --report runs/swarm-schedule.json\n  \
swarm train --schedule overlap --lookahead off --report runs/no-lookahead.json   # the stall\n  \
swarm train --optimizer local --schedule overlap --replicas 16 --steps 1000 --report runs/local.json"
)]
pub(crate) struct TrainArgs {
    /// Model: tiny (~0.85M params, minutes on a CPU), small (~27M), 1.2b (the DisTrO report's).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// demo (DisTrO/DeMo sparse sign updates), adamw (AdamW on the all-reduced mean gradient) or
    /// local (local steps: each replica takes --inner-steps AdamW steps at --adamw-lr, then the
    /// replicas exchange the top-k of their error-fed pseudo-gradients and average them).
    #[arg(long, default_value = "demo", value_parser = parse_opt)]
    optimizer: Optimizer,
    /// Data-parallel replicas in this process.
    #[arg(long, default_value_t = 8)]
    replicas: usize,
    /// Batches each replica trains (equal tokens for every optimizer; local steps run
    /// steps / inner-steps windows).
    #[arg(long, default_value_t = 300)]
    steps: u32,
    /// Sequences per replica per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// `synthetic[:VOCAB[:BRANCH[:SEED]]]` (the embedded order-2 Markov-chain corpus with an
    /// exactly known loss floor; default vocab 32, branch 4, seed 1), a UTF-8 text file
    /// (byte tokens, or --tokenizer), or a flat token shard (*.bin, *.u16, *.u32).
    #[arg(long, default_value = "synthetic")]
    data: String,
    /// A HuggingFace tokenizer.json for text data.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Bits per token of a shard (16 or 32); *.u32 files default to 32.
    #[arg(long)]
    token_width: Option<u32>,
    /// Coefficients kept per chunk (default: 4 for demo, 10 for local).
    #[arg(long)]
    topk: Option<u32>,
    /// DeMo: target chunk length per dimension.
    #[arg(long, default_value_t = 64)]
    chunk: u32,
    /// Value encoding on the wire: sign (1 bit), q2 / q4 (2 / 4 bits on a per-tensor scale),
    /// bf16 or f32 (default: sign for demo, q2 for local).
    #[arg(long)]
    values: Option<ValueCodec>,
    /// Local steps: AdamW steps per window (H); one exchange per window. For `tiny` with 16
    /// replicas, H = 2 with k = 8 beat H = 4…16 at equal bytes per token, and k = 10 beat k = 8
    /// and 11 at 1,000 batches (docs/BENCHMARKS.md).
    #[arg(long, default_value_t = 2)]
    inner_steps: u32,
    /// Local steps: outer step size on the combined pseudo-gradient (1 = plain averaging).
    /// Default 2 with --combine root, 0.7 with mean (the best of each in docs/BENCHMARKS.md).
    #[arg(long)]
    outer_lr: Option<f64>,
    /// Local steps: outer Nesterov momentum, kept by each sender on its own pseudo-gradients
    /// (0 = off; DiLoCo uses 0.9 with --outer-lr 0.7).
    #[arg(long, default_value_t = 0.0)]
    outer_momentum: f64,
    /// Local steps: error-feedback decay.
    #[arg(long, default_value_t = 0.95)]
    ef_decay: f64,
    /// Local steps: select the top-k of each chunk's DCT coefficients rather than of its raw
    /// values.
    #[arg(long)]
    dct: bool,
    /// DeMo: peak sign-step size. Sign steps want a smaller rate than AdamW's: 1e-3 was best
    /// of 3e-4 / 1e-3 / 3e-3 for `tiny` (docs/BENCHMARKS.md, "Why the swarm stalled").
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    /// DeMo: momentum decay β. A short memory suits runs of hundreds to a few thousand steps
    /// (0.95 beat 0.9 / 0.99 / 0.999 for `tiny`); long runs may want 0.99–0.999.
    #[arg(long, default_value_t = 0.95)]
    beta: f64,
    /// DeMo: decoupled weight decay.
    #[arg(long, default_value_t = 0.0)]
    wd: f64,
    /// AdamW: peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    adamw_lr: f64,
    /// AdamW: weight decay.
    #[arg(long, default_value_t = 0.1)]
    adamw_wd: f64,
    /// Warm-up steps (default: a tenth of the run, at most 250).
    #[arg(long)]
    warmup: Option<u32>,
    /// Gradient clipping (global L2 norm; 0 = off).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    /// How the replicas' updates are combined: mean (the DeMo reference: per coefficient, the
    /// mean over those who kept it), share (bounded influence: weighted by tokens over all) or
    /// root (per coefficient, the sum over those who kept it divided by √(kept · all)).
    /// Default: root for local steps (within 2 % of mean at 16 nodes, far better at 64), mean
    /// for DeMo.
    #[arg(long, value_enum)]
    combine: Option<CombineArg>,
    /// sync: step t trains on parameters holding every earlier step (one process, no
    /// network). overlap: the swarm's schedule, where step t trains on parameters that still
    /// lack step t−1 (its updates are in flight), so staleness is measured without a network.
    #[arg(long, default_value = "sync")]
    schedule: Schedule,
    /// DeMo under `--schedule overlap`: delay compensation at zero bytes. off; momentum (train
    /// at w − lr·sign(own momentum), Psyche's); update (train at w − the exact step of the
    /// node's own last update).
    #[arg(long, default_value = "momentum")]
    lookahead: Lookahead,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// auto (CUDA when present), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// CPU threads for libtorch (default: its own choice).
    #[arg(long)]
    threads: Option<i32>,
    /// Evaluate on held-out data every this many steps (and at the end).
    #[arg(long, default_value_t = 25)]
    eval_every: u32,
    #[arg(long, default_value_t = 8)]
    eval_batches: usize,
    /// Write the report (JSON) here, and a PNG plot of its loss curves beside it.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Save the final weights as safetensors.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Start from these weights instead of the seeded initialization: a checkpoint swarm wrote
    /// (`--save`, `--checkpoint-dir`) or one `swarm import` made from a Hugging Face model. The
    /// model's sizes come from the file (its `swarm.model` metadata, or the named model whose
    /// shapes it has), so --model is ignored.
    #[arg(long)]
    init: Option<PathBuf>,
}

fn parse_opt(s: &str) -> Result<Optimizer, String> {
    match s {
        "demo" => Ok(Optimizer::Demo),
        "adamw" => Ok(Optimizer::Adamw),
        "local" => Ok(Optimizer::Local),
        o => Err(format!(
            "unknown optimizer {o:?} (expected demo, adamw or local)"
        )),
    }
}

pub(crate) fn data_spec(data: &str, tokenizer: Option<&PathBuf>, width: Option<u32>) -> DataSpec {
    if let Some(rest) = data.strip_prefix("synthetic") {
        // synthetic[:VOCAB[:BRANCH[:SEED]]]
        let mut spec = DataSpec::synthetic_default();
        if let DataSpec::Synthetic {
            seed,
            vocab,
            branch,
        } = &mut spec
        {
            let parts: Vec<&str> = rest
                .trim_start_matches(':')
                .split(':')
                .filter(|s| !s.is_empty())
                .collect();
            if let Some(v) = parts.first().and_then(|s| s.parse().ok()) {
                *vocab = v;
            }
            if let Some(b) = parts.get(1).and_then(|s| s.parse().ok()) {
                *branch = b;
            }
            if let Some(x) = parts.get(2).and_then(|s| s.parse().ok()) {
                *seed = x;
            }
        }
        return spec;
    }
    let lower = data.to_lowercase();
    if lower.ends_with(".bin") || lower.ends_with(".u16") || lower.ends_with(".u32") {
        let w = width.unwrap_or(if lower.ends_with(".u32") { 32 } else { 16 });
        return DataSpec::Shard {
            path: data.to_string(),
            width: w,
            vocab: 0,
        };
    }
    DataSpec::Text {
        path: data.to_string(),
        tokenizer: tokenizer.map(|p| p.display().to_string()),
    }
}

pub(crate) fn run(a: TrainArgs) -> Result<()> {
    if let Some(t) = a.threads {
        tch::set_num_threads(t);
    }
    let device = train::parse_device(&a.device)?;
    let spec = data_spec(&a.data, a.tokenizer.as_ref(), a.token_width);
    let corpus = Corpus::open(&spec).with_context(|| format!("opening --data {}", a.data))?;
    let model = model_config(&a, &corpus)?;
    let opts = train_options(&a, &model);
    eprintln!("data: {}", corpus.describe());
    eprintln!(
        "model: {} ({} params, vocab {}), optimizer {:?}, schedule {:?}, {} replicas × {} seqs × {} tokens, device {:?}",
        model.name,
        model.param_count(),
        model.vocab,
        a.optimizer,
        a.schedule,
        a.replicas,
        a.batch,
        model.seq_len,
        device
    );
    if let Some(f) = corpus.loss_floor(model.seq_len as usize) {
        eprintln!("loss floor (exact, this corpus and sequence length): {f:.4} nats/token");
    }
    let (pb, tty) = progress_bar(a.steps);
    let mut last_eval = None;
    let every = (a.steps / 10).max(1);
    let hh = opts.optim.inner_steps();
    let (model_out, report) = train::run::train(&opts, &corpus, device, |r| {
        if let Some(e) = r.eval_loss {
            last_eval = Some(e);
        }
        let msg = format!(
            "loss {:.4}  eval {}  lr {:.2e}  sent {} B/step",
            r.train_loss,
            last_eval.map(|e| format!("{e:.4}")).unwrap_or("-".into()),
            r.lr,
            r.bytes_sent
        );
        pb.set_message(msg.clone());
        // A record covers one batch, or a window of H of them for local steps.
        let covered = (r.step + 1).saturating_sub(hh)..=r.step;
        pb.set_position(r.step as u64 + 1);
        if !tty && (covered.clone().any(|s| s % every == 0) || r.step + hh >= a.steps) {
            eprintln!("step {}/{}: {msg}", r.step + 1, a.steps);
        }
    })?;
    pb.finish_and_clear();
    print_summary(&a, &opts, &model, &report);
    write_outputs(&a, &model_out, report)?;
    Ok(())
}

/// The model to train: the one `--init`'s file holds, or the named `--model` for the corpus's
/// vocabulary.
fn model_config(a: &TrainArgs, corpus: &Corpus) -> Result<ModelConfig> {
    let model = match &a.init {
        Some(p) => {
            // The header names the model; the values are read once, by the trainer.
            let (shapes, meta) = train::hf::read_header(p)?;
            let c = train::hf::infer_config(&shapes, &meta)
                .with_context(|| format!("--init {}", p.display()))?;
            eprintln!("init: {} ({} model from the file)", p.display(), c.name);
            c
        }
        None => match ModelConfig::named(&a.model, corpus.vocab() as u32) {
            Some(m) => m,
            None => bail!("unknown model {:?} (expected tiny, small or 1.2b)", a.model),
        },
    };
    Ok(model)
}

/// The trainer's options from the arguments, with the defaults that depend on the optimizer
/// (combine rule, outer rate, top-k, value codec, inner optimizer's rate and decay).
fn train_options(a: &TrainArgs, model: &ModelConfig) -> TrainOptions {
    let warmup = a.warmup.unwrap_or((a.steps / 10).min(250));
    let local = a.optimizer == Optimizer::Local;
    let combine = match a.combine {
        Some(CombineArg::Mean) => protocol::config::Combine::Mean,
        Some(CombineArg::Share) => protocol::config::Combine::Share,
        Some(CombineArg::Root) => protocol::config::Combine::Root,
        None if local => protocol::config::Combine::Root,
        None => protocol::config::Combine::Mean,
    };
    let outer_lr = a
        .outer_lr
        .unwrap_or(if combine == protocol::config::Combine::Root {
            2.0
        } else {
            0.7
        });
    TrainOptions {
        model: model.clone(),
        optimizer: a.optimizer,
        replicas: a.replicas,
        steps: a.steps,
        batch: a.batch,
        seed: a.seed,
        optim: OptimConfig {
            chunk: a.chunk,
            topk: a.topk.unwrap_or(if local { 10 } else { 4 }),
            values: a.values.unwrap_or(if local {
                ValueCodec::Q2
            } else {
                ValueCodec::Sign
            }),
            beta: a.beta,
            // Local steps' inner optimizer is AdamW: its rate and decay.
            lr: if local { a.adamw_lr } else { a.lr },
            weight_decay: if local { a.adamw_wd } else { a.wd },
            warmup_steps: warmup,
            total_steps: a.steps,
            min_lr_ratio: 0.1,
            grad_clip: a.clip,
            combine,
            lookahead: a.lookahead,
            local: local.then(|| protocol::config::LocalSteps {
                inner_steps: a.inner_steps.max(1),
                outer_lr,
                ef_decay: a.ef_decay,
                dct: a.dct,
                outer_momentum: a.outer_momentum,
                ..Default::default()
            }),
        },
        adamw_lr: a.adamw_lr,
        adamw_wd: a.adamw_wd,
        eval_every: a.eval_every,
        eval_batches: a.eval_batches,
        schedule: a.schedule,
        init: a.init.as_ref().map(|p| p.display().to_string()),
    }
}

/// The progress bar (drawn only on a terminal; elsewhere progress goes to stderr as lines),
/// and whether stderr is a terminal.
fn progress_bar(steps: u32) -> (ProgressBar, bool) {
    let tty = std::io::stderr().is_terminal();
    let pb = ProgressBar::new(steps as u64);
    if tty {
        pb.set_style(
            ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}  [{elapsed} < {eta}]")
                .expect("a valid template"),
        );
    } else {
        pb.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    (pb, tty)
}

/// Print the run's final figures: eval loss, gap to the loss floor, update size, codec share,
/// wall time and parameter digest.
fn print_summary(a: &TrainArgs, opts: &TrainOptions, model: &ModelConfig, report: &TrainReport) {
    let local = a.optimizer == Optimizer::Local;
    println!("final eval loss: {:.4}", report.final_eval_loss);
    if let Some(f) = report.loss_floor {
        println!(
            "loss floor:      {f:.4}  (gap {:.4})",
            report.final_eval_loss - f
        );
    }
    if let Some(b) = report.update_bytes {
        let hh = opts.optim.inner_steps().max(1) as f64;
        let hh = if local { hh } else { 1.0 };
        let tokens = hh * (a.batch as f64) * model.seq_len as f64;
        println!(
            "update size:     {b} bytes ({:.4} bits/param, {:.2} bytes/token{})",
            b as f64 * 8.0 / report.params as f64,
            b as f64 / tokens,
            if local {
                format!(", one per {} batches", hh as u32)
            } else {
                String::new()
            }
        );
    }
    if let Some(c) = report.codec_fraction {
        println!(
            "codec share:     {:.1}% of forward+backward (compress + aggregate + apply)",
            c * 100.0
        );
    }
    println!("wall time:       {:.1} s", report.wall_seconds);
    println!("param digest:    {}", report.final_digest);
}

/// Save the weights (`--save`) and write the report and its loss plot (`--report`).
fn write_outputs(a: &TrainArgs, model_out: &Llama, report: TrainReport) -> Result<()> {
    if let Some(path) = &a.save {
        model_out
            .save(path)
            .with_context(|| format!("saving {}", path.display()))?;
        println!("saved weights to {}", path.display());
    }
    if let Some(path) = &a.report {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).ok();
        }
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&report)?)?;
        std::fs::rename(&tmp, path)?;
        println!("wrote {}", path.display());
        let png = path.with_extension("png");
        let label = format!("{:?}", a.optimizer).to_lowercase();
        match crate::plot::loss_plot(&[(label, report)], &png) {
            Ok(()) => println!("wrote {}", png.display()),
            Err(e) => eprintln!("warning: could not draw {}: {e:#}", png.display()),
        }
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum CombineArg {
    Mean,
    Share,
    Root,
}
