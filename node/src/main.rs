//! `swarm`: a permissionless peer-to-peer node for training language models with DisTrO/DeMo.

mod cmd_codec;
mod cmd_demo;
mod cmd_model;
mod cmd_sim;
mod cmd_train;
mod plot;

use clap::{Parser, Subcommand};
use node::{cmd_net, tui};

#[derive(Parser)]
#[command(
    name = "swarm",
    version,
    about = "Train one language model across many machines with DisTrO/DeMo updates",
    long_about = "swarm trains a Llama-style model with the DeMo optimizer: each node compresses its \
step's momentum to a few bits per thousand parameters (chunked DCT, top-k, 1-bit values), the \
nodes exchange those sparse updates, and every node applies the same exact sign step.\n\n\
Start here:\n  swarm train                      train `tiny` on the embedded synthetic corpus, 8 replicas\n  \
swarm train --optimizer adamw    the AdamW + all-reduce baseline on the same data\n  \
swarm codec size --model 1.2b    bytes of one update for the DisTrO report's 1.2B model\n  \
swarm export --checkpoint F --out DIR   the model as a Hugging Face directory (transformers)\n  \
swarm eval --checkpoint F --data T      held-out loss, perplexity, bits per byte (JSON)\n  \
swarm demo                       a local swarm of 4 nodes, live, then a report beside AdamW\n  \
swarm run --tui …                one node in a run, with a live terminal view (q leaves)\n\n\
Logging: set RUST_LOG (e.g. RUST_LOG=debug or RUST_LOG=info,libp2p_gossipsub=warn); with\n\
`swarm run --tui` the log shows in the view's bottom pane instead of on stderr."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train N data-parallel replicas in one process (DeMo or the AdamW baseline) and report.
    Train(Box<cmd_train::TrainArgs>),
    /// Inspect exactly what the optimizer sends: encode tensors, decode and aggregate updates, sizes.
    #[command(subcommand)]
    Codec(cmd_codec::CodecCmd),
    /// Run a simulator scenario (sim/scenarios/*.toml): metrics JSON and PNG plots into --out.
    Sim(cmd_sim::SimArgs),
    /// Create a node identity (an ed25519 key) in a new file, readable only by you.
    #[command(
        after_help = "The file is never overwritten. Its node id is the libp2p PeerId of the key.\nExample: swarm keygen --out ~/.swarm/node.key"
    )]
    Keygen {
        #[arg(long)]
        out: std::path::PathBuf,
    },
    /// Print the node id (libp2p PeerId) of a key file.
    Id { key: std::path::PathBuf },
    /// Join a run: train with the swarm over libp2p (see `swarm run --help`).
    Run(Box<cmd_net::RunArgs>),
    /// Run a seed peer that trainers list as --bootstrap: discovery only, or (with --run) also
    /// in the run, and with --relay the first hop that takes each node's upload once.
    Bootstrap(cmd_net::BootstrapArgs),
    /// A whole swarm on this machine: a bootstrap peer and 4 trainers as processes on loopback,
    /// a live view, then a report (JSON + PNG) beside AdamW + all-reduce.
    Demo(cmd_demo::DemoArgs),
    /// Write a checkpoint as a Hugging Face model directory (LlamaForCausalLM: model.safetensors,
    /// config.json, generation_config.json, tokenizer.json) that `transformers` loads.
    Export(cmd_model::ExportArgs),
    /// Read a Hugging Face Llama directory into a swarm checkpoint (`swarm train --init`).
    Import(cmd_model::ImportArgs),
    /// Held-out loss, perplexity and bits per byte of a checkpoint on a text file, a token shard
    /// or the synthetic corpus, as JSON.
    Eval(cmd_model::EvalArgs),
    /// Draw JSON results as PNG: several `--report` files as one loss plot (e.g. DeMo beside
    /// AdamW) with a table of final losses, gaps to the first report and bytes per step (with
    /// several reports also OUT-bytes.png: final loss against bytes sent per token); a
    /// simulator `metrics.json` as loss/bytes/latency/included PNGs in the directory OUT; an
    /// attack sweep's `attacks.json` as the bar chart OUT.
    #[command(
        after_help = "Examples:\n  swarm plot runs/demo/adamw.json runs/demo/swarm.json --out runs/demo/loss.png\n  swarm plot runs/sim/metrics.json --out runs/sim\n  swarm plot runs/attacks/attacks.json --out runs/attacks/attacks.png"
    )]
    Plot {
        /// Reports written by `swarm train --report`, or one simulator metrics.json, or one
        /// attacks.json.
        #[arg(required = true)]
        files: Vec<std::path::PathBuf>,
        /// Output PNG (a directory for a simulator metrics.json).
        #[arg(long, short)]
        out: std::path::PathBuf,
    },
}

fn main() -> anyhow::Result<()> {
    train::keep_freed_memory();
    let cli = Cli::parse();
    let filter =
        || tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // `swarm run --tui` at a terminal: the log goes to the view's pane, not over the screen.
    let tui_log = match &cli.cmd {
        Cmd::Run(a) if a.tui => {
            if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                Some(tui::LogRing::default())
            } else {
                eprintln!("--tui: stdout is not a terminal; writing plain status lines instead");
                None
            }
        }
        _ => None,
    };
    match &tui_log {
        Some(ring) => tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_writer(ring.clone())
            .with_ansi(false)
            .without_time()
            .init(),
        None => tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            // Colour only for a person at a terminal: log files and pipes get plain text.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
    }
    match cli.cmd {
        Cmd::Train(a) => cmd_train::run(*a),
        Cmd::Codec(c) => cmd_codec::run(c),
        Cmd::Sim(a) => cmd_sim::run(a),
        Cmd::Keygen { out } => {
            if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir)?;
            }
            let id = crypto::Identity::generate()?;
            id.write_new(&out)
                .map_err(|e| anyhow::anyhow!("{}: {e}", out.display()))?;
            println!("{}", id.node_id().peer_id_string());
            eprintln!("wrote {} (mode 0600)", out.display());
            Ok(())
        }
        Cmd::Id { key } => {
            let id = crypto::Identity::load(&key)
                .map_err(|e| anyhow::anyhow!("{}: {e}", key.display()))?;
            println!("{}", id.node_id().peer_id_string());
            Ok(())
        }
        Cmd::Run(a) => cmd_net::run_cli(*a, tui_log),
        Cmd::Bootstrap(a) => cmd_net::bootstrap(a),
        Cmd::Demo(a) => cmd_demo::run(a),
        Cmd::Export(a) => cmd_model::export(a),
        Cmd::Import(a) => cmd_model::import(a),
        Cmd::Eval(a) => cmd_model::eval(a),
        Cmd::Plot { files, out } => plot::draw(&files, &out),
    }
}
