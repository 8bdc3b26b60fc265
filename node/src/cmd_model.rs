//! `swarm export`, `swarm import`, `swarm eval`: the model of a run in the tools researchers
//! already use (Hugging Face `transformers`), and back; its held-out loss as JSON.

use anyhow::{bail, Context, Result};
use clap::Args;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use train::data::Corpus;
use train::eval::{EvalOptions, Split};
use train::tch::Tensor;

#[derive(Args, Debug)]
#[command(
    after_help = "The directory loads in Hugging Face transformers as a LlamaForCausalLM:\n  \
python -c \"import transformers as t; m = t.AutoModelForCausalLM.from_pretrained('runs/hf')\"\n\
Any harness that takes a HF checkpoint runs on it (see the README, \"Evaluate\").\n\n\
Examples:\n  swarm export --checkpoint runs/ckpt/v200.safetensors --out runs/hf\n  \
swarm export --checkpoint runs/ckpt/v200.safetensors --run run.toml --out runs/hf --dtype bf16"
)]
pub(crate) struct ExportArgs {
    /// A checkpoint swarm wrote: `--checkpoint-dir`'s vN.safetensors, `swarm train --save`, or
    /// `swarm import`'s output.
    #[arg(long)]
    checkpoint: PathBuf,
    /// The run file that trained it: the model's sizes, and its tokenizer.json when it has one.
    /// Without it the sizes come from the file (its metadata, or the named model — tiny, small,
    /// 1.2b — whose tensor shapes it has).
    #[arg(long)]
    run: Option<PathBuf>,
    /// Output directory (created; files in it are replaced).
    #[arg(long)]
    out: PathBuf,
    /// Weights on disk: f32 (exact) or bf16 (half the size).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    dtype: String,
    /// A tokenizer.json to ship with the model (default: the run's, when it names one).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
}

#[derive(Args, Debug)]
#[command(
    after_help = "The output trains on with `swarm train --init FILE` (its sizes travel \
in the file's metadata).\n\nExample:\n  swarm import --hf runs/hf --out runs/imported.safetensors"
)]
pub(crate) struct ImportArgs {
    /// A Hugging Face Llama directory: config.json and model.safetensors (or the shards of
    /// model.safetensors.index.json). Tied embeddings become an untied head.
    #[arg(long)]
    hf: PathBuf,
    /// Output: a swarm checkpoint (safetensors, f32, swarm's tensor names).
    #[arg(long)]
    out: PathBuf,
    /// Training sequence length (default: the config's max_position_embeddings).
    #[arg(long)]
    seq_len: Option<u32>,
    /// The model's name in swarm's configs (default: the directory's name).
    #[arg(long)]
    name: Option<String>,
}

#[derive(Args, Debug)]
#[command(
    after_help = "Prints one JSON object (and writes it to --out): loss (nats/token), \
perplexity, bits per token and, for text, bits per byte.\n\n\
Examples:\n  swarm eval --checkpoint runs/ckpt/v200.safetensors --data ../shared/data/tinyshakespeare.txt\n  \
swarm eval --checkpoint runs/train.safetensors            # the synthetic corpus, beside its floor\n  \
swarm eval --checkpoint v9.safetensors --data heldout.txt --split all --tokenizer tok.json"
)]
pub(crate) struct EvalArgs {
    /// The checkpoint to evaluate (any swarm safetensors file; see `swarm export --help`).
    #[arg(long)]
    checkpoint: PathBuf,
    /// The run file that trained it (model sizes and, for a synthetic run, its corpus).
    #[arg(long)]
    run: Option<PathBuf>,
    /// `synthetic[:VOCAB[:BRANCH[:SEED]]]`, a UTF-8 text file (bytes, or --tokenizer) or a
    /// token shard, as `swarm train --data` (default: the run's synthetic corpus, else synthetic).
    #[arg(long)]
    data: Option<String>,
    /// A HuggingFace tokenizer.json for text data.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Bits per token of a shard (16 or 32).
    #[arg(long)]
    token_width: Option<u32>,
    /// heldout: the stream's last tenth, which training never reads; all: the whole file.
    #[arg(long, default_value = "heldout", value_parser = ["heldout", "all"])]
    split: String,
    /// Score at most this many tokens (0 = all of the split; synthetic: 0 means 64 batches).
    #[arg(long, default_value_t = 1_000_000)]
    max_tokens: u64,
    /// Sequences per forward pass.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// auto (CUDA when present), cpu, cuda or cuda:N.
    #[arg(long, default_value = "auto")]
    device: String,
    /// CPU threads for libtorch.
    #[arg(long)]
    threads: Option<i32>,
    /// Also write the JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// A checkpoint's tensors and the model configuration they belong to.
fn open_checkpoint(
    path: &Path,
    run: Option<&Path>,
) -> Result<(
    protocol::config::ModelConfig,
    Vec<(String, Tensor)>,
    Option<protocol::run::RunConfig>,
)> {
    let (tensors, meta) = train::hf::read_f32(path).with_context(|| path.display().to_string())?;
    let run = run.map(|r| node::cmd_net::load_run(r, None)).transpose()?;
    let cfg = match &run {
        Some(r) => r.model.clone(),
        None => train::hf::infer_config(&train::hf::shapes_of(&tensors), &meta)
            .with_context(|| path.display().to_string())?,
    };
    train::hf::check_shapes(&cfg, &tensors).with_context(|| {
        format!(
            "{} does not hold the run's model {}",
            path.display(),
            cfg.name
        )
    })?;
    Ok((cfg, tensors, run))
}

pub(crate) fn export(a: ExportArgs) -> Result<()> {
    let (cfg, tensors, run) = open_checkpoint(&a.checkpoint, a.run.as_deref())?;
    let tokenizer = a
        .tokenizer
        .clone()
        .or_else(|| match run.as_ref().map(|r| &r.data) {
            Some(protocol::run::DataSpec::Text { tokenizer, .. })
                if !tokenizer.is_empty() && tokenizer != "bytes" =>
            {
                Some(PathBuf::from(tokenizer))
            }
            _ => None,
        });
    if let Some(t) = &tokenizer {
        if !t.is_file() {
            bail!(
                "tokenizer {} not found (pass --tokenizer PATH)",
                t.display()
            );
        }
    }
    let e = train::hf::export(
        &cfg,
        &tensors,
        &a.out,
        a.dtype == "bf16",
        tokenizer.as_deref(),
    )
    .with_context(|| format!("exporting to {}", a.out.display()))?;
    println!(
        "exported {} ({} parameters, {}) to {}: {}",
        cfg.name,
        e.params,
        a.dtype,
        a.out.display(),
        e.files.join(", ")
    );
    if tokenizer.is_none() {
        println!(
            "no tokenizer.json: this run's tokens are {} (pass --tokenizer for a text run that used one)",
            if cfg.vocab <= 320 { "bytes or synthetic ids" } else { "ids of an unnamed tokenizer" }
        );
    }
    println!(
        "load it: python -c \"import transformers; transformers.AutoModelForCausalLM.from_pretrained('{}')\"",
        a.out.display()
    );
    Ok(())
}

pub(crate) fn import(a: ImportArgs) -> Result<()> {
    let name = a.name.clone().unwrap_or_else(|| {
        a.hf.file_name()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_else(|| "hf".into())
    });
    let (cfg, tensors) = train::hf::import(&a.hf, &name, a.seq_len)
        .with_context(|| format!("importing {}", a.hf.display()))?;
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let meta = HashMap::from([(
        train::hf::MODEL_META.to_string(),
        serde_json::to_string(&cfg)?,
    )]);
    train::hf::write(&a.out, &tensors, false, meta)
        .with_context(|| format!("writing {}", a.out.display()))?;
    let names: Vec<String> = tensors.iter().map(|(n, _)| n.clone()).collect();
    let params: Vec<Tensor> = tensors.into_iter().map(|(_, t)| t).collect();
    println!(
        "imported {} ({} layers, dim {}, vocab {}, seq {}) to {}",
        cfg.name,
        cfg.layers,
        cfg.dim,
        cfg.vocab,
        cfg.seq_len,
        a.out.display()
    );
    println!(
        "param digest: {}",
        train::run::hex(&train::model::named_digest(&names, &params))
    );
    println!(
        "train on: swarm train --init {} --optimizer local",
        a.out.display()
    );
    Ok(())
}

pub(crate) fn eval(a: EvalArgs) -> Result<()> {
    if let Some(t) = a.threads {
        train::tch::set_num_threads(t);
    }
    let device = train::parse_device(&a.device)?;
    let (cfg, tensors, run) = open_checkpoint(&a.checkpoint, a.run.as_deref())?;
    let spec = match (&a.data, &run) {
        (Some(d), _) => crate::cmd_train::data_spec(d, a.tokenizer.as_ref(), a.token_width),
        (None, Some(r)) => train::data::DataSpec::for_run(r, None)
            .context("this run trains on a file: pass it with --data PATH")?,
        (None, None) => train::data::DataSpec::synthetic_default(),
    };
    let corpus = Corpus::open(&spec).context("opening the data")?;
    if corpus.vocab() as u32 > cfg.vocab {
        bail!(
            "the data's vocabulary ({}) exceeds the model's ({}): is this the run's data and tokenizer?",
            corpus.vocab(),
            cfg.vocab
        );
    }
    // Bits per byte need the text's bytes per token: 1 for byte tokens, the file's mean for a
    // tokenizer (its length over its token count), unknown for shards and the synthetic chain.
    let bytes_per_token = match (&spec, &corpus) {
        (
            train::data::DataSpec::Text {
                tokenizer: None, ..
            },
            _,
        ) => Some(1.0),
        (train::data::DataSpec::Text { path, .. }, Corpus::Stream { tokens, .. }) => {
            let bytes = std::fs::metadata(path)?.len() as f64;
            Some(bytes / tokens.len() as f64)
        }
        _ => None,
    };
    let mut model = train::model::Llama::new(&cfg, device, 0);
    model.set_params(&tensors)?;
    let o = EvalOptions {
        split: if a.split == "all" {
            Split::All
        } else {
            Split::Heldout
        },
        max_tokens: a.max_tokens,
        batch: a.batch,
        seed: 0,
        bytes_per_token,
    };
    let r = train::eval::evaluate(&model, &corpus, &o);
    let mut j = serde_json::to_value(&r)?;
    j["checkpoint"] = serde_json::json!(a.checkpoint.display().to_string());
    j["model"] = serde_json::json!(cfg.name);
    j["param_digest"] = serde_json::json!(train::run::hex(&model.digest()));
    let text = serde_json::to_string_pretty(&j)?;
    println!("{text}");
    if let Some(p) = &a.out {
        std::fs::write(p, text + "\n").with_context(|| p.display().to_string())?;
    }
    Ok(())
}
