//! `swarm codec`: encode tensors as DeMo updates, decode and aggregate updates, and size them.

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use protocol::config::{ModelConfig, ValueCodec};
use protocol::sparse::{self, Layout, SparseUpdate};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};
use train::demo::DctCodec;

#[derive(Subcommand, Debug)]
pub(crate) enum CodecCmd {
    /// Compress every tensor of a safetensors file, each treated as a momentum, into one update.
    #[command(
        after_help = "The output holds the tensor names and the update blob exactly as it goes on the wire.\n\
Example: swarm codec encode --input m.safetensors --topk 4 --values sign --output u.bin"
    )]
    Encode {
        #[arg(long)]
        input: PathBuf,
        #[command(flatten)]
        knobs: Knobs,
        #[arg(long)]
        output: PathBuf,
    },
    /// Aggregate updates (per-coefficient mean over the updates that hold it) and inverse-DCT
    /// them: the aggregate before the sign step, as safetensors.
    Decode {
        /// One or more files written by `swarm codec encode` for tensors of the same shapes.
        #[arg(required = true)]
        updates: Vec<PathBuf>,
        #[arg(long)]
        output: PathBuf,
        /// Write sign(aggregate), computed exactly as nodes apply it, instead of the aggregate.
        #[arg(long)]
        sign: bool,
    },
    /// Bytes of one update for a named model, and ratios to dense and all-reduce traffic,
    /// without allocating the model.
    Size {
        #[arg(long, default_value = "1.2b")]
        model: String,
        /// Vocabulary for tiny/small (1.2b uses 32000).
        #[arg(long, default_value_t = 256)]
        vocab: u32,
        #[command(flatten)]
        knobs: Knobs,
        /// Peers in the comparison (the DisTrO report used 32).
        #[arg(long, default_value_t = 32)]
        peers: u64,
        /// Batches per exchange: 1 for DeMo, H for local steps (one update per window).
        #[arg(long, default_value_t = 1)]
        inner_steps: u32,
        /// Sequences one node trains per batch (for bytes per token).
        #[arg(long, default_value_t = 4)]
        seqs: u32,
    },
    /// Time the codec on a named model's shapes with random momenta: encode (momentum → DCT →
    /// top-k → wire blob, with the decoupling subtraction), and aggregate + exact decode +
    /// sign step for 8 and 32 updates; peak resident memory; GB/s of parameters.
    #[command(
        after_help = "Example: swarm codec bench --model small --repeat 3\nThe 1.2b model needs ~5 GB for its momentum and as much again for the parameters the apply\nwrites (the codec itself adds a few of its largest tensors; docs/BENCHMARKS.md, \"The codec at memory speed\")."
    )]
    Bench {
        #[arg(long, default_value = "small")]
        model: String,
        /// Vocabulary for tiny/small (1.2b uses 32000).
        #[arg(long, default_value_t = 256)]
        vocab: u32,
        #[command(flatten)]
        knobs: Knobs,
        /// cpu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Timed repetitions of each measurement (the median is reported).
        #[arg(long, default_value_t = 3)]
        repeat: usize,
        /// Update counts for aggregate-and-apply.
        #[arg(long, value_delimiter = ',', default_values_t = [8usize, 32])]
        updates: Vec<usize>,
        /// Write the figures as JSON here too.
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

/// The codec's settings, shared by `encode` and `size`.
#[derive(clap::Args, Debug)]
pub(crate) struct Knobs {
    /// Target chunk length per dimension.
    #[arg(long, default_value_t = 64)]
    chunk: u32,
    /// Coefficients kept per chunk.
    #[arg(long, default_value_t = 4)]
    topk: u32,
    /// sign (1 bit), q2 / q4 (2 / 4 bits on a per-tensor scale, for local steps), bf16 or f32.
    #[arg(long, default_value = "sign")]
    values: ValueCodec,
}

/// File format of `codec encode`: tensor names plus the wire blob.
#[derive(Serialize, Deserialize)]
struct CodecFile {
    version: u32,
    chunk: u32,
    names: Vec<String>,
    #[serde(with = "serde_bytes")]
    blob: Vec<u8>,
}

pub(crate) fn run(c: CodecCmd) -> Result<()> {
    match c {
        CodecCmd::Encode {
            input,
            knobs,
            output,
        } => encode(&input, &knobs, &output),
        CodecCmd::Decode {
            updates,
            output,
            sign,
        } => decode(&updates, &output, sign),
        CodecCmd::Size {
            model,
            vocab,
            knobs,
            peers,
            inner_steps,
            seqs,
        } => size(&model, vocab, &knobs, peers, inner_steps, seqs),
        CodecCmd::Bench {
            model,
            vocab,
            knobs,
            device,
            repeat,
            updates,
            json,
        } => bench(
            &named(&model, vocab)?,
            &knobs,
            &device,
            repeat,
            &updates,
            json,
        ),
    }
}

/// `codec encode`: every tensor of `input`, each treated as a momentum, into one update
/// written to `output` with the tensor names.
fn encode(input: &Path, knobs: &Knobs, output: &Path) -> Result<()> {
    let (chunk, topk, values) = (knobs.chunk, knobs.topk, knobs.values);
    // Names and shapes from the header; then one tensor at a time through the
    // encoder (sorted by name, so every encode agrees): the process holds one
    // tensor and its temporaries, never the file (issue 16).
    let (shapes, _) =
        train::hf::read_header(input).with_context(|| format!("reading {}", input.display()))?;
    if shapes.is_empty() {
        bail!("{} holds no tensors", input.display());
    }
    let names: Vec<String> = shapes.iter().map(|(n, _)| n.clone()).collect();
    let shapes: Vec<(String, Vec<u32>)> = shapes
        .into_iter()
        .map(|(n, s)| (n, s.into_iter().map(|d| d as u32).collect()))
        .collect();
    let layout = Layout::from_shapes(&shapes, chunk);
    let codec = DctCodec::new(layout.clone(), Device::Cpu);
    let mut parts = Vec::with_capacity(names.len());
    train::hf::for_each_f32(input, |i, name, mut t| {
        debug_assert_eq!(name, names[i]);
        parts.push(codec.encode_tensor(i, &mut t, topk, values));
        Ok(())
    })
    .with_context(|| format!("reading {}", input.display()))?;
    let update = SparseUpdate {
        codec: values,
        tensors: parts,
    };
    let blob = update.encode();
    let f = CodecFile {
        version: 1,
        chunk,
        names,
        blob,
    };
    std::fs::write(output, serde_cbor::to_vec(&f)?)?;
    let numel = layout.numel();
    println!(
        "{} tensors, {} values -> update of {} bytes ({:.4} bits/value; dense bf16 would be {} bytes, {:.0}x more)",
        layout.tensors.len(),
        numel,
        f.blob.len(),
        f.blob.len() as f64 * 8.0 / numel as f64,
        2 * numel,
        (2 * numel) as f64 / f.blob.len() as f64
    );
    Ok(())
}

/// `codec decode`: aggregate the update files and inverse-DCT them (or take the exact sign)
/// into the safetensors file `output`.
fn decode(updates: &[PathBuf], output: &Path, sign: bool) -> Result<()> {
    let mut files = Vec::new();
    for p in updates {
        let bytes = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
        let f: CodecFile = serde_cbor::from_slice(&bytes)
            .with_context(|| format!("{}: not a codec file", p.display()))?;
        files.push(f);
    }
    let first = &files[0];
    let mut ups = Vec::new();
    for (p, f) in updates.iter().zip(&files) {
        if f.names != first.names || f.chunk != first.chunk {
            bail!(
                "{} holds other tensors (or chunk) than {}",
                p.display(),
                updates[0].display()
            );
        }
        ups.push(
            SparseUpdate::decode(&f.blob, usize::MAX).with_context(|| p.display().to_string())?,
        );
    }
    let shapes: Vec<(String, Vec<u32>)> = first
        .names
        .iter()
        .cloned()
        .zip(ups[0].tensors.iter().map(|t| t.shape.clone()))
        .collect();
    let layout = Layout::from_shapes(&shapes, first.chunk);
    for (p, u) in updates.iter().zip(&ups) {
        u.validate(&layout, max_k(&ups[0]), ups[0].codec)
            .with_context(|| format!("{} is not a valid update for these tensors", p.display()))?;
    }
    let refs: Vec<&SparseUpdate> = ups.iter().collect();
    let agg = sparse::aggregate(&layout, &refs);
    let codec = DctCodec::new(layout.clone(), Device::Cpu);
    let out = if sign {
        codec.exact_sign(&agg)
    } else {
        codec.decode_float(&agg)
    };
    let named: Vec<(&str, Tensor)> = first.names.iter().map(|s| s.as_str()).zip(out).collect();
    Tensor::write_safetensors(&named, output)?;
    println!("aggregated {} updates into {}", ups.len(), output.display());
    Ok(())
}

/// `codec size`: the size table of one update for a named model, then its bytes per batch
/// and per token trained.
fn size(
    model: &str,
    vocab: u32,
    knobs: &Knobs,
    peers: u64,
    inner_steps: u32,
    seqs: u32,
) -> Result<()> {
    let (chunk, topk, values) = (knobs.chunk, knobs.topk, knobs.values);
    let m = named(model, vocab)?;
    size_table(&m, chunk, topk, values, peers);
    let bytes = sparse::encoded_size(&Layout::for_model(&m, chunk), topk, values) as f64;
    let hh = inner_steps.max(1) as f64;
    let tokens = hh * seqs as f64 * m.seq_len as f64;
    println!(
        "{:<44} {:>14.0}  (one exchange per {} batches)",
        "per batch of training",
        bytes / hh,
        hh as u32
    );
    println!(
        "{:<44} {:>14.2}  ({} seqs x {} tokens per batch)",
        "per token trained",
        bytes / tokens,
        seqs,
        m.seq_len
    );
    Ok(())
}

/// Peak resident memory of this process so far (VmHWM), in bytes; None off Linux.
fn peak_rss() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let l = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = l.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Figures of `swarm codec bench`.
#[derive(Serialize)]
struct Bench {
    model: String,
    params: u64,
    device: String,
    chunk: u32,
    topk: u32,
    values: String,
    update_bytes: usize,
    encode_s: f64,
    encode_gb_per_s: f64,
    /// (updates, seconds for aggregate + exact decode + sign step, ms per update)
    apply: Vec<(usize, f64, f64)>,
    peak_rss_bytes: Option<u64>,
    /// Peak after the encodes, before anything is applied.
    peak_rss_encode_bytes: Option<u64>,
    rss_before_bytes: Option<u64>,
}

/// A named model's config (`tiny`, `small`, `1.2b`).
fn named(model: &str, vocab: u32) -> Result<ModelConfig> {
    match ModelConfig::named(model, vocab) {
        Some(m) => Ok(m),
        None => bail!("unknown model {model:?} (tiny, small or 1.2b)"),
    }
}

fn bench(
    m: &ModelConfig,
    knobs: &Knobs,
    device: &str,
    repeat: usize,
    counts: &[usize],
    json: Option<PathBuf>,
) -> Result<()> {
    let (chunk, topk, values) = (knobs.chunk, knobs.topk, knobs.values);
    let dev = train::parse_device(device)?;
    let repeat = repeat.max(1);
    let layout = Layout::for_model(m, chunk);
    let shapes = m.tensor_shapes();
    let params: u64 = layout.numel() as u64;
    let rss_before = peak_rss();
    eprintln!(
        "codec bench: {} ({} params, {} tensors) on {device}, chunk {chunk}, top-{topk}, {} values",
        m.name,
        params,
        shapes.len(),
        values.name()
    );
    tch::manual_seed(7);
    let momentum = |salt: i64| -> Vec<Tensor> {
        tch::manual_seed(7 + salt);
        shapes
            .iter()
            .map(|(_, s)| {
                let dims: Vec<i64> = s.iter().map(|&d| d as i64).collect();
                Tensor::randn(dims.as_slice(), (Kind::Float, dev))
            })
            .collect()
    };
    let codec = DctCodec::new(layout.clone(), dev);
    let sync = || {
        if let Device::Cuda(i) = dev {
            tch::Cuda::synchronize(i as i64);
        }
    };
    // Encode: a fresh momentum each time (the decoupling subtracts in place).
    let mut times = Vec::new();
    let mut blob_len = 0;
    for r in 0..repeat {
        let mut mom = momentum(r as i64);
        sync();
        let t0 = std::time::Instant::now();
        let u = codec.encode(&mut mom, topk, values);
        let blob = u.encode();
        sync();
        times.push(t0.elapsed().as_secs_f64());
        blob_len = blob.len();
        eprintln!("  encode {}/{repeat}: {:.3} s", r + 1, times[r]);
    }
    let encode_s = median(times);
    let peak_encode = peak_rss();
    // Updates to apply: as many distinct encodes as the largest count.
    let most = counts.iter().copied().max().unwrap_or(0);
    let mut ups = Vec::with_capacity(most);
    for i in 0..most {
        let mut mom = momentum(1000 + i as i64);
        ups.push(codec.encode(&mut mom, topk, values));
        if (i + 1) % 8 == 0 || i + 1 == most {
            eprintln!("  made {}/{most} updates to apply", i + 1);
        }
    }
    let target: Vec<Tensor> = momentum(5000);
    let mut apply = Vec::new();
    for &n in counts {
        let refs: Vec<&SparseUpdate> = ups.iter().take(n).collect();
        let mut t = Vec::new();
        for _ in 0..repeat {
            sync();
            let t0 = std::time::Instant::now();
            let agg = sparse::aggregate(&layout, &refs);
            codec.apply_exact_sign(&target, &agg, 1e-4, 0.0);
            sync();
            t.push(t0.elapsed().as_secs_f64());
        }
        let s = median(t);
        apply.push((n, s, s * 1e3 / n.max(1) as f64));
    }
    let peak = peak_rss();
    let b = Bench {
        model: m.name.clone(),
        params,
        device: device.to_string(),
        chunk,
        topk,
        values: values.name().to_string(),
        update_bytes: blob_len,
        encode_s,
        encode_gb_per_s: params as f64 * 4.0 / encode_s / 1e9,
        apply,
        peak_rss_bytes: peak,
        peak_rss_encode_bytes: peak_encode,
        rss_before_bytes: rss_before,
    };
    print_bench(&b, json)
}

/// Print `codec bench`'s figures as a table, and write them as JSON to `json` when asked.
fn print_bench(b: &Bench, json: Option<PathBuf>) -> Result<()> {
    let params = b.params;
    println!(
        "{} ({} params) on {}: update {} B",
        b.model, b.params, b.device, b.update_bytes
    );
    println!(
        "{:<40} {:>10.3} s  ({:.2} GB/s of f32 parameters)",
        "encode (median)", b.encode_s, b.encode_gb_per_s
    );
    for (n, s, per) in &b.apply {
        println!(
            "{:<40} {:>10.3} s  ({per:.1} ms per update)",
            format!("aggregate + exact decode + apply, {n}"),
            s
        );
    }
    if let Some(p) = b.peak_rss_encode_bytes {
        println!(
            "{:<40} {:>10.0} MB",
            "peak resident memory after the encodes",
            p as f64 / 1e6
        );
    }
    if let Some(p) = b.peak_rss_bytes {
        println!(
            "{:<40} {:>10.0} MB  (at start {:.0} MB; one momentum {:.0} MB of f32)",
            "peak resident memory (whole process)",
            p as f64 / 1e6,
            b.rss_before_bytes.unwrap_or(0) as f64 / 1e6,
            params as f64 * 4.0 / 1e6
        );
    }
    if let Some(j) = json {
        std::fs::write(&j, serde_json::to_string_pretty(b)?)?;
        println!("wrote {}", j.display());
    }
    Ok(())
}

/// The k an update was made with (tensors smaller than k cap it; take the largest).
fn max_k(u: &SparseUpdate) -> u32 {
    u.tensors.iter().map(|t| t.k).max().unwrap_or(0)
}

pub(crate) fn size_table(m: &ModelConfig, chunk: u32, topk: u32, values: ValueCodec, peers: u64) {
    let layout = Layout::for_model(m, chunk);
    let bytes = sparse::encoded_size(&layout, topk, values) as f64;
    let p = m.param_count() as f64;
    let dense = 2.0 * p; // bf16 gradient
    let n = peers as f64;
    let ring = 2.0 * (n - 1.0) / n * dense;
    // Information bound: log2 C(elems, k) + k sign bits per block.
    let bound_bits: f64 = layout
        .tensors
        .iter()
        .map(|t| {
            let e = t.block_elems() as f64;
            let k = t.k_eff(topk) as f64;
            let lc: f64 = (0..k as usize)
                .map(|i| ((e - i as f64) / (i as f64 + 1.0)).log2())
                .sum();
            t.blocks() as f64
                * (lc
                    + if values == ValueCodec::Sign {
                        k
                    } else {
                        k * values.bits() as f64
                    })
        })
        .sum();
    println!(
        "model {} ({} params), chunk {chunk}, top-{topk}, {} values, {} blocks",
        m.name,
        p as u64,
        values.name(),
        layout.blocks()
    );
    println!("{:<44} {:>14}", "", "bytes");
    println!(
        "{:<44} {:>14.0}  ({:.2} MB, {:.4} bits/param)",
        "one update (CBOR, as sent)",
        bytes,
        bytes / 1e6,
        bytes * 8.0 / p
    );
    println!(
        "{:<44} {:>14.0}  ({:.2} MB)",
        "information bound (index set + values)",
        bound_bits / 8.0,
        bound_bits / 8e6
    );
    println!(
        "{:<44} {:>14.0}  ({:.0}x the update)",
        "dense bf16 gradient (one peer's)",
        dense,
        dense / bytes
    );
    println!(
        "{:<44} {:>14.0}  ({:.0}x the {} updates received)",
        format!("ring all-reduce per node, {peers} peers"),
        ring,
        ring / (bytes * (n - 1.0)),
        peers - 1
    );
    println!(
        "{:<44} {:>14.0}  vs {:.0} all-to-all bf16 ({:.0}x)",
        format!("received per node per step, {peers} peers"),
        bytes * (n - 1.0),
        dense * (n - 1.0),
        dense / bytes
    );
}
