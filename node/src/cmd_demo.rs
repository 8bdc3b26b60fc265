//! `swarm demo`: a whole swarm on this machine. A bootstrap peer and N trainers run as separate
//! `swarm` processes on loopback (fresh keys, ephemeral ports), train `tiny` on the synthetic
//! corpus over libp2p, and write one JSON status line per applied step; this process shows them
//! live, stops them after the requested steps, checks that every node's parameter digest agreed
//! after every step, and writes a report (JSON + PNG) beside an AdamW + all-reduce run of the
//! same size.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use crypto::Identity;
use protocol::config::OptimConfig;
use protocol::run::RunConfig;
use serde::Serialize;
use train::run::{Optimizer, StepRecord, TrainOptions, TrainReport};

use node::cmd_net::now_ms;
use node::status::{self, StatusLine};

/// The demo's embedded run: local steps, which measured best of DeMo and local steps for `tiny`
/// (docs/BENCHMARKS.md, "Local steps"). `--run node/runs/tiny-local.toml` runs DeMo.
const TINY_LOCAL_STEPS: &str = include_str!("../runs/tiny-local-steps.toml");

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  swarm demo\n  swarm demo --trainers 2 --steps 8 --period-ms 1500 --out /tmp/demo\n  swarm demo --run node/runs/small-local.toml --trainers 8 --period-ms 20000 --steps 8 --no-baseline"
)]
pub(crate) struct DemoArgs {
    /// Trainer processes.
    #[arg(long, default_value_t = 4)]
    pub trainers: usize,
    /// Protocol steps to train (a local-steps run's steps are windows of H batches); 0 = the
    /// run's whole schedule (`optim.total_steps`: the embedded run's 200 windows of 2 batches,
    /// enough for both curves to fall well below the ln 32 plateau within the demo's minutes).
    #[arg(long, default_value_t = 0)]
    pub steps: u64,
    /// Step period (grace and summary windows scale with it); 0 = 600 ms per batch of a step,
    /// which fits 4 `tiny` trainers on 2 cores. Raise it for bigger models or slower machines.
    #[arg(long, default_value_t = 0)]
    pub period_ms: u64,
    /// Seconds from now until step 0 (process start, model init, peer discovery).
    #[arg(long, default_value_t = 10)]
    pub start_in: u64,
    /// Report directory (report.json, report.png, and the nodes' keys, logs and status files).
    #[arg(long, default_value = "runs/demo")]
    pub out: PathBuf,
    /// A run config (TOML, as `swarm run --run` takes) instead of the embedded `tiny` one
    /// (node/runs/tiny-local-steps.toml), e.g. `node/runs/tiny-local.toml` (DeMo) or
    /// `node/runs/small-local.toml`; its timing is replaced by --period-ms and the start time.
    #[arg(long)]
    pub run: Option<PathBuf>,
    /// Give trainer i the simulator's key for node i under this seed (`sim::world::identity`),
    /// so that the same scenario in `swarm sim` trains on the same batches: the simulator's
    /// curve and this swarm's can be compared step by step. Default: fresh random keys.
    #[arg(long)]
    pub key_seed: Option<u64>,
    /// Skip the AdamW + all-reduce baseline.
    #[arg(long)]
    pub no_baseline: bool,
    /// Fault drill: kill -9 the last trainer once it has applied this step; the others must go
    /// on and keep agreeing.
    #[arg(long)]
    pub kill_at: Option<u64>,
    /// Start the bootstrap peer as the run's first hop (`swarm bootstrap --run --relay`): each
    /// trainer uploads its update to it once and fetches the others' from it.
    #[arg(long)]
    pub relay: bool,
    /// The trainers' gossipsub mesh degree (`swarm run --mesh`; default 6, or 2 with --relay).
    #[arg(long)]
    pub mesh: Option<usize>,
}

/// The nodes evaluate every this many steps (windows), and the baseline at the same tokens.
const EVAL_EVERY: u64 = 20;

struct Proc {
    name: String,
    child: Child,
    status: PathBuf,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Serialize)]
struct NodeReport {
    name: String,
    steps: Vec<StatusLine>,
}

#[derive(Serialize)]
struct DemoReport {
    run_id: String,
    trainers: usize,
    steps: u64,
    period_ms: u64,
    update_bytes: u64,
    /// Steps every trainer applied, and whether their digests agreed after each of them.
    common_steps: usize,
    digests_agree: bool,
    first_disagreement: Option<u64>,
    /// Per trainer and step, averaged over both: bytes sent / received (libp2p counters,
    /// payload after decryption, all protocols), and sent over the update's own size.
    mean_bytes_out_per_step: f64,
    mean_bytes_in_per_step: f64,
    upload_amplification: f64,
    /// The same without step 0, which carries the one-time cost of joining (connections,
    /// identify, discovery, hellos): what a node uploads per step once running.
    upload_amplification_after_first_step: f64,
    mean_train_ms: f64,
    /// Time from an update's publication (its sender's clock) until the last other trainer
    /// had it verified (same machine, same clock), over updates every other trainer applied
    /// in time: median, 90th percentile, max (ms), and how many such updates there were.
    spread_ms: Option<Spread>,
    /// Updates published but not held by every other trainer when it applied the step.
    updates_not_everywhere: usize,
    /// The relay's bytes sent / received per step (with --relay).
    relay_bytes_out_per_step: Option<f64>,
    relay_bytes_in_per_step: Option<f64>,
    final_eval_loss: Option<f64>,
    adamw_final_eval_loss: Option<f64>,
    adamw_bytes_per_step: Option<u64>,
    wall_seconds: f64,
    nodes: Vec<NodeReport>,
}

#[derive(Serialize, Debug, Clone, Copy)]
struct Spread {
    median: u64,
    p90: u64,
    max: u64,
    updates: usize,
}

/// The mean of `f` over `rows` (None for no rows).
fn mean_of<'a>(
    rows: impl IntoIterator<Item = &'a StatusLine>,
    f: impl Fn(&StatusLine) -> u64,
) -> Option<f64> {
    let (sum, n) = rows
        .into_iter()
        .fold((0.0, 0usize), |(s, n), r| (s + f(r) as f64, n + 1));
    (n > 0).then(|| sum / n as f64)
}

/// Publish-to-everyone times from the trainers' status lines, `rows` and the same by step
/// (see `DemoReport::spread_ms`).
fn spread(
    rows: &[Vec<StatusLine>],
    by_step: &[BTreeMap<u64, &StatusLine>],
) -> (Option<Spread>, usize) {
    let mut times = Vec::new();
    let mut missing = 0;
    for (i, r) in rows.iter().enumerate() {
        for s in r {
            let Some(p) = s.published_ms else { continue };
            let others: Vec<&StatusLine> = by_step
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .filter_map(|(_, m)| m.get(&s.step).copied())
                .collect();
            let got: Vec<u64> = others
                .iter()
                .filter_map(|o| o.arrivals.get(&s.node).copied())
                .collect();
            if others.is_empty() || got.len() < others.len() {
                missing += 1;
            } else {
                times.push(got.iter().max().expect("non-empty").saturating_sub(p));
            }
        }
    }
    if times.is_empty() {
        return (None, missing);
    }
    times.sort_unstable();
    let q = |f: f64| times[((times.len() - 1) as f64 * f).round() as usize];
    (
        Some(Spread {
            median: q(0.5),
            p90: q(0.9),
            max: *times.last().expect("non-empty"),
            updates: times.len(),
        }),
        missing,
    )
}

pub(crate) fn run(mut a: DemoArgs) -> Result<()> {
    let start = Instant::now();
    if a.trainers == 0 {
        bail!("--trainers must be at least 1");
    }
    let s = prepare(&mut a)?;
    let (boot, boot_addr) = spawn_bootstrap(&a, &s)?;
    let mut procs = spawn_trainers(&a, &s, &boot_addr)?;
    let killed = watch(&a, &s.work, start, &mut procs)?;
    linger(&a, &mut procs);
    let c = collect(&a, procs, boot);

    // Digest agreement: every step that every trainer applied.
    let by_step: Vec<BTreeMap<u64, &StatusLine>> = c
        .rows
        .iter()
        .map(|r| r.iter().map(|s| (s.step, s)).collect())
        .collect();
    let ag = agreement(&by_step, killed, a.steps);

    // The final model, from one trainer's checkpoint, evaluated on held-out data.
    let spec = node::trainer::data_spec(&s.run, None)?;
    let corpus = train::data::Corpus::open(&spec)?;
    let final_eval = final_eval(&a, &s, &c.names[0], &by_step, &ag.common, &corpus)?;

    let opts = baseline_options(&a, &s.run);
    let adamw = if a.no_baseline {
        None
    } else {
        eprintln!(
            "swarm demo: AdamW + all-reduce baseline ({} replicas, in process)",
            a.trainers
        );
        Some(train::run::train(&opts, &corpus, tch::Device::Cpu, |_| {})?.1)
    };

    let report = build_report(
        &a,
        &s.run,
        start,
        &c,
        &by_step,
        &ag,
        final_eval,
        adamw.as_ref(),
    );
    std::fs::create_dir_all(&a.out)?;
    let json = a.out.join("report.json");
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)?;
    let png = plot(&a, &s.run, &opts, &corpus, &c, &report, adamw)?;
    print_summary(&report, &c.rows, &json, &png);
    if !ag.agree {
        bail!(
            "trainers disagreed (first at step {:?}) or did not all finish {} steps; logs in {}",
            ag.first_disagreement,
            a.steps,
            s.work.display()
        );
    }
    Ok(())
}

/// The demo's work directory, the run it trains and where that run's file is.
struct Setup {
    work: PathBuf,
    exe: PathBuf,
    run: RunConfig,
    run_path: PathBuf,
}

/// Empties the work directory, reads the run, fills the defaults of `a` from it, sets its
/// timing and genesis, and writes it to the work directory.
fn prepare(a: &mut DemoArgs) -> Result<Setup> {
    let work = a.out.join("work");
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).with_context(|| work.display().to_string())?;
    let exe = std::env::current_exe()?;
    let mut run: RunConfig = match &a.run {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| p.display().to_string())?;
            toml::from_str(&text).with_context(|| format!("{}: not a run config", p.display()))?
        }
        None => toml::from_str(TINY_LOCAL_STEPS).context("embedded tiny-local-steps.toml")?,
    };
    // 0 = from the run: its whole schedule, at 600 ms per batch of a window.
    if a.steps == 0 {
        a.steps = run.optim.total_steps as u64;
    }
    if a.period_ms == 0 {
        a.period_ms = 600 * run.optim.inner_steps() as u64;
    }
    run.timing.period_ms = a.period_ms;
    run.timing.grace_ms = a.period_ms * 4 / 25;
    run.timing.summary_ms = a.period_ms * 8 / 25;

    // The run file is written before any process starts: a relay is in the run too.
    run.timing.genesis_ms = now_ms() + a.start_in * 1000;
    run.validate()?;
    let run_path = work.join("run.toml");
    std::fs::write(&run_path, toml::to_string(&run)?)?;
    Ok(Setup {
        work,
        exe,
        run,
        run_path,
    })
}

/// A fresh key for process `name`, written to the work directory.
fn new_key(work: &std::path::Path, name: &str) -> Result<PathBuf> {
    let p = work.join(format!("{name}.key"));
    Identity::generate()?
        .write_new(&p)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(p)
}

/// Process `name`'s log file in the work directory, as its stderr.
fn log_file(work: &std::path::Path, name: &str) -> Result<Stdio> {
    Ok(std::fs::File::create(work.join(format!("{name}.log")))?.into())
}

/// Starts the bootstrap peer (the relay too with --relay) and waits for its address.
fn spawn_bootstrap(a: &DemoArgs, s: &Setup) -> Result<(Proc, String)> {
    let work = &s.work;
    let addr_file = work.join("bootstrap.addr");
    let mut boot_cmd = Command::new(&s.exe);
    boot_cmd
        .args(["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key"])
        .arg(new_key(work, "bootstrap")?)
        .arg("--addr-file")
        .arg(&addr_file);
    let boot_status = work.join("bootstrap.jsonl");
    if a.relay {
        boot_cmd
            .args(["--relay", "--run"])
            .arg(&s.run_path)
            .args(["--steps", &a.steps.to_string(), "--status"])
            .arg(&boot_status);
    }
    let boot = Proc {
        name: "bootstrap".into(),
        child: boot_cmd
            .stdout(Stdio::null())
            .stderr(log_file(work, "bootstrap")?)
            .spawn()?,
        status: boot_status.clone(),
    };
    let t0 = Instant::now();
    let boot_addr = loop {
        if let Some(l) = std::fs::read_to_string(&addr_file)
            .ok()
            .and_then(|s| s.lines().next().map(str::to_string))
        {
            break l;
        }
        if t0.elapsed() > Duration::from_secs(20) {
            bail!(
                "the bootstrap peer did not start; see {}",
                work.join("bootstrap.log").display()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!(
        "swarm demo: {} trainers, {} steps of {} ms, run {}, {} {boot_addr}",
        a.trainers,
        a.steps,
        a.period_ms,
        &s.run.run_id().to_hex()[..16],
        if a.relay { "relay" } else { "bootstrap" }
    );
    Ok((boot, boot_addr))
}

/// Starts the trainers, each with its key, log, status file and checkpoint directory.
fn spawn_trainers(a: &DemoArgs, s: &Setup, boot_addr: &str) -> Result<Vec<Proc>> {
    let work = &s.work;
    let mesh = a
        .mesh
        .unwrap_or(if a.relay { 2 } else { node::net::DEFAULT_MESH });
    let mut procs = Vec::new();
    for i in 0..a.trainers {
        let name = format!("node{i}");
        let status = work.join(format!("{name}.jsonl"));
        let child = Command::new(&s.exe)
            .args(["run", "--run"])
            .arg(&s.run_path)
            .arg("--key")
            .arg(match a.key_seed {
                Some(seed) => {
                    let p = work.join(format!("{name}.key"));
                    sim::world::identity(seed, i)
                        .write_new(&p)
                        .map_err(|e| anyhow::anyhow!("{e}"))?;
                    p
                }
                None => new_key(work, &name)?,
            })
            .args([
                "--bootstrap",
                boot_addr,
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--device",
                "cpu",
                "--threads",
                "1",
            ])
            .args(["--eval-every", &EVAL_EVERY.to_string()])
            .args(["--steps", &a.steps.to_string(), "--status"])
            .arg(&status)
            .args(["--mesh", &mesh.to_string()])
            .arg("--checkpoint-dir")
            .arg(work.join(&name))
            .stdout(Stdio::null())
            .stderr(log_file(work, &name)?)
            .spawn()?;
        procs.push(Proc {
            name,
            child,
            status,
        });
    }
    Ok(procs)
}

/// Live view until every trainer applied every step (or left), or a generous deadline; kills
/// the last trainer for --kill-at and returns which one it killed.
fn watch(
    a: &DemoArgs,
    work: &std::path::Path,
    start: Instant,
    procs: &mut [Proc],
) -> Result<Option<usize>> {
    let tty = std::io::stderr().is_terminal();
    let deadline = Duration::from_millis(a.start_in * 1000 + (a.steps + 4) * a.period_ms + 60_000);
    let mut drawn = 0usize;
    let mut killed: Option<usize> = None;
    let procs_names: Vec<String> = procs.iter().map(|p| p.name.clone()).collect();
    let mut last_plain = Instant::now() - Duration::from_secs(60);
    loop {
        let rows: Vec<Vec<StatusLine>> = procs.iter().map(|p| status::read(&p.status)).collect();
        if let Some(k) = a.kill_at.filter(|_| killed.is_none()) {
            let last = procs.len() - 1;
            if rows[last].last().is_some_and(|s| s.step >= k) {
                // Child::kill is SIGKILL: no goodbye, exactly like a crash.
                procs[last].child.kill()?;
                eprintln!(
                    "swarm demo: killed {} (kill -9) after step {k}",
                    procs[last].name
                );
                killed = Some(last);
            }
        }
        let done = rows
            .iter()
            .enumerate()
            .filter(|(i, _)| Some(*i) != killed)
            .all(|(_, r)| r.last().is_some_and(|s| s.step + 1 >= a.steps));
        let mut exited = Vec::new();
        for p in procs.iter_mut() {
            if let Ok(Some(st)) = p
                .child
                .try_wait()
                .map(|s| s.filter(|_| killed.map(|k| procs_names[k] != p.name).unwrap_or(true)))
            {
                exited.push((p.name.clone(), st));
            }
        }
        let table = status_table(procs, &rows);
        if tty {
            let mut e = std::io::stderr().lock();
            if drawn > 0 {
                write!(e, "\x1b[{drawn}A")?;
            }
            for l in &table {
                writeln!(e, "\x1b[2K{l}")?;
            }
            drawn = table.len();
        } else if last_plain.elapsed() >= Duration::from_secs(5) || done {
            for l in &table {
                eprintln!("{l}");
            }
            last_plain = Instant::now();
        }
        if done {
            break;
        }
        if let Some((name, st)) = exited.iter().find(|(_, st)| !st.success()) {
            bail!(
                "{name} exited with {st}; see {}",
                work.join(format!("{name}.log")).display()
            );
        }
        if start.elapsed() > deadline {
            eprintln!("swarm demo: deadline reached before every trainer finished");
            break;
        }
        std::thread::sleep(Duration::from_millis(if tty { 500 } else { 1000 }));
    }
    Ok(killed)
}

/// The live view's lines: a header and each trainer's latest status.
fn status_table(procs: &[Proc], rows: &[Vec<StatusLine>]) -> Vec<String> {
    let mut table = vec![format!(
        "{:<7} {:>5} {:>8} {:>8} {:>5} {:>9} {:>9} {:>8}  digest",
        "node", "step", "loss", "eval", "peers", "out B/st", "in B/st", "train ms"
    )];
    for (p, r) in procs.iter().zip(rows) {
        let eval = r.iter().rev().find_map(|s| s.eval_loss);
        match r.last() {
            Some(s) => table.push(format!(
                "{:<7} {:>5} {:>8} {:>8} {:>5} {:>9} {:>9} {:>8}  {}",
                p.name,
                s.step,
                s.loss.map_or("-".into(), |l| format!("{l:.4}")),
                eval.map_or("-".into(), |l| format!("{l:.4}")),
                s.peers,
                s.bytes_out,
                s.bytes_in,
                s.train_ms,
                &s.digest[..12]
            )),
            None => table.push(format!("{:<7} {:>5}", p.name, "(starting)")),
        }
    }
    table
}

/// Lets the trainers save their final checkpoints (they leave after lingering two periods).
fn linger(a: &DemoArgs, procs: &mut [Proc]) {
    let linger = Instant::now();
    while linger.elapsed() < Duration::from_millis(3 * a.period_ms + 5000) {
        if procs
            .iter_mut()
            .all(|p| matches!(p.child.try_wait(), Ok(Some(_))))
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// What the swarm left: each trainer's name and status lines, and the relay's status lines.
struct Collected {
    names: Vec<String>,
    rows: Vec<Vec<StatusLine>>,
    relay_rows: Vec<StatusLine>,
}

/// Reads the status files and stops every process (trainers first, then the bootstrap peer).
fn collect(a: &DemoArgs, procs: Vec<Proc>, boot: Proc) -> Collected {
    // Only the requested steps: while lingering, trainers keep applying whatever still arrives.
    let rows: Vec<Vec<StatusLine>> = procs
        .iter()
        .map(|p| {
            status::read(&p.status)
                .into_iter()
                .filter(|s| s.step < a.steps)
                .collect()
        })
        .collect();
    let names: Vec<String> = procs.iter().map(|p| p.name.clone()).collect();
    drop(procs);
    let relay_rows: Vec<StatusLine> = status::read(&boot.status)
        .into_iter()
        .filter(|s| s.step < a.steps)
        .collect();
    drop(boot);
    Collected {
        names,
        rows,
        relay_rows,
    }
}

/// The steps every survivor applied, the first of them the trainers disagreed on, and whether
/// they agreed on all the requested steps.
struct Agreement {
    common: Vec<u64>,
    first_disagreement: Option<u64>,
    agree: bool,
}

/// Digest agreement over the trainers' status lines by step.
fn agreement(
    by_step: &[BTreeMap<u64, &StatusLine>],
    killed: Option<usize>,
    steps: u64,
) -> Agreement {
    // Every survivor must hold every step; a killed trainer must agree on the steps it applied.
    let survivors: Vec<usize> = (0..by_step.len()).filter(|i| Some(*i) != killed).collect();
    let common: Vec<u64> = by_step[0]
        .keys()
        .copied()
        .filter(|k| survivors.iter().all(|&i| by_step[i].contains_key(k)))
        .collect();
    let first_disagreement = common.iter().copied().find(|k| {
        by_step
            .iter()
            .any(|m| m.get(k).is_some_and(|s| s.digest != by_step[0][k].digest))
    });
    let agree = first_disagreement.is_none() && common.len() as u64 >= steps;
    Agreement {
        common,
        first_disagreement,
        agree,
    }
}

/// The final model's held-out eval loss, from trainer `name`'s last checkpoint (None if the
/// trainers did not all reach the last step or it left no checkpoint).
fn final_eval(
    a: &DemoArgs,
    s: &Setup,
    name: &str,
    by_step: &[BTreeMap<u64, &StatusLine>],
    common: &[u64],
    corpus: &train::data::Corpus,
) -> Result<Option<f64>> {
    let run = &s.run;
    let Some(last) = common.last().filter(|&&l| l + 1 == a.steps) else {
        return Ok(None);
    };
    let ck = s.work.join(name).join(format!("v{}.safetensors", a.steps));
    if !ck.exists() {
        return Ok(None);
    }
    let mut m = train::model::Llama::new(&run.model, tch::Device::Cpu, run.seed);
    m.load(&ck)?;
    let want = &by_step[0][last].digest;
    if train::run::hex(&m.digest()) != *want {
        bail!(
            "{}: checkpoint digest differs from the one the node reported",
            ck.display()
        );
    }
    Ok(Some(train::run::eval_loss(
        &m,
        corpus,
        run.seed,
        4,
        run.batch_seqs as usize,
    )))
}

/// The AdamW + all-reduce baseline's options: the same model, replicas and tokens.
fn baseline_options(a: &DemoArgs, run: &RunConfig) -> TrainOptions {
    // Equal tokens: a local-steps window is H batches; AdamW counts warm-up in batches.
    let hh = run.optim.inner_steps();
    TrainOptions {
        model: run.model.clone(),
        optimizer: Optimizer::Adamw,
        replicas: a.trainers,
        steps: a.steps as u32 * hh,
        batch: run.batch_seqs as usize,
        seed: run.seed,
        optim: OptimConfig {
            warmup_steps: run.optim.warmup_steps * hh,
            local: None,
            ..run.optim.clone()
        },
        adamw_lr: 3e-3,
        adamw_wd: 0.1,
        // The same points of the run as the nodes' evals: every EVAL_EVERY windows.
        eval_every: EVAL_EVERY as u32 * hh,
        eval_batches: 4,
        schedule: Default::default(),
        init: None,
    }
}

/// Mean bytes a trainer sent per step after step 0 (see
/// `DemoReport::upload_amplification_after_first_step`).
fn mean_out_after_first_step(rows: &[Vec<StatusLine>]) -> f64 {
    let later = rows.iter().flatten().filter(|s| s.step > 0);
    mean_of(later, |s| s.bytes_out).unwrap_or(0.0)
}

/// The report from the collected status lines, the final eval and the baseline.
#[allow(clippy::too_many_arguments)]
fn build_report(
    a: &DemoArgs,
    run: &RunConfig,
    start: Instant,
    c: &Collected,
    by_step: &[BTreeMap<u64, &StatusLine>],
    ag: &Agreement,
    final_eval: Option<f64>,
    adamw: Option<&TrainReport>,
) -> DemoReport {
    let all: Vec<&StatusLine> = c.rows.iter().flatten().collect();
    let mean = |f: fn(&StatusLine) -> u64| mean_of(all.iter().copied(), f).unwrap_or(0.0);
    let update_bytes = all.iter().map(|s| s.update_bytes).max().unwrap_or(0);
    let mean_out = mean(|s| s.bytes_out);
    let mean_out_later = mean_out_after_first_step(&c.rows);
    let (spread_ms, updates_not_everywhere) = spread(&c.rows, by_step);
    DemoReport {
        run_id: run.run_id().to_hex(),
        trainers: a.trainers,
        steps: a.steps,
        period_ms: a.period_ms,
        update_bytes,
        common_steps: ag.common.len(),
        digests_agree: ag.agree,
        first_disagreement: ag.first_disagreement,
        mean_bytes_out_per_step: mean_out,
        mean_bytes_in_per_step: mean(|s| s.bytes_in),
        upload_amplification: if update_bytes > 0 {
            mean_out / update_bytes as f64
        } else {
            0.0
        },
        upload_amplification_after_first_step: if update_bytes > 0 {
            mean_out_later / update_bytes as f64
        } else {
            0.0
        },
        mean_train_ms: mean(|s| s.train_ms),
        spread_ms,
        updates_not_everywhere,
        relay_bytes_out_per_step: mean_of(&c.relay_rows, |s| s.bytes_out),
        relay_bytes_in_per_step: mean_of(&c.relay_rows, |s| s.bytes_in),
        final_eval_loss: final_eval,
        adamw_final_eval_loss: adamw.map(|r| r.final_eval_loss),
        adamw_bytes_per_step: adamw.and_then(|r| r.steps.first().map(|s| s.bytes_sent)),
        wall_seconds: start.elapsed().as_secs_f64(),
        nodes: c
            .names
            .iter()
            .zip(&c.rows)
            .map(|(name, r)| NodeReport {
                name: name.clone(),
                steps: r.clone(),
            })
            .collect(),
    }
}

/// Plots each node's train loss (and bytes) beside the baseline, through the shared report
/// plotters; returns the loss plot's path.
fn plot(
    a: &DemoArgs,
    run: &RunConfig,
    opts: &TrainOptions,
    corpus: &train::data::Corpus,
    c: &Collected,
    report: &DemoReport,
    adamw: Option<TrainReport>,
) -> Result<PathBuf> {
    let hh = run.optim.inner_steps();
    let mut reports: Vec<(String, TrainReport)> = Vec::new();
    let base = adamw.clone().unwrap_or_else(|| TrainReport {
        options: opts.clone(),
        data: corpus.describe(),
        params: run.model.param_count() as i64,
        device: "Cpu".into(),
        threads: 1,
        loss_floor: corpus.loss_floor(run.model.seq_len as usize),
        update_bytes: None,
        steps: Vec::new(),
        final_eval_loss: f64::NAN,
        wall_seconds: 0.0,
        codec_fraction: None,
        final_digest: String::new(),
    });
    for (name, r) in c.names.iter().zip(&c.rows) {
        let mut rep = base.clone();
        rep.options.optimizer = if hh > 1 {
            Optimizer::Local
        } else {
            Optimizer::Demo
        };
        rep.update_bytes = Some(report.update_bytes);
        rep.final_eval_loss = report.final_eval_loss.unwrap_or(f64::NAN);
        rep.steps = r
            .iter()
            .filter_map(|s| {
                // In batches, as the baseline counts: a window is H of them.
                Some(StepRecord {
                    step: ((s.step + 1) * hh as u64 - 1) as u32,
                    train_loss: s.loss?,
                    bytes_sent: s.bytes_out,
                    bytes_received: s.bytes_in,
                    eval_loss: s.eval_loss,
                    ..Default::default()
                })
            })
            .collect();
        reports.push((format!("{name} (swarm)"), rep));
    }
    if let Some(r) = adamw {
        reports.push(("adamw all-reduce".into(), r));
    }
    let png = a.out.join("report.png");
    crate::plot::loss_plot(&reports, &png)?;
    let bytes_png = a.out.join("report-bytes.png");
    if reports.len() > 1 {
        crate::plot::bytes_plot(&reports, &bytes_png)?;
    }
    Ok(png)
}

/// The summary lines on stdout.
fn print_summary(
    report: &DemoReport,
    rows: &[Vec<StatusLine>],
    json: &std::path::Path,
    png: &std::path::Path,
) {
    println!(
        "digests {} over {} steps; update {} B; per node per step {:.0} B out, {:.0} B in (upload amplification {:.2}x); final eval loss {}{}",
        if report.digests_agree { "AGREE" } else { "DISAGREE" },
        report.common_steps,
        report.update_bytes,
        report.mean_bytes_out_per_step,
        report.mean_bytes_in_per_step,
        report.upload_amplification,
        report.final_eval_loss.map_or("-".into(), |l| format!("{l:.4}")),
        report.adamw_final_eval_loss.map_or(String::new(), |l| format!(" (AdamW all-reduce {l:.4})"))
    );
    println!(
        "after step 0 (joining): {:.0} B out per node per step, upload amplification {:.2}x",
        mean_out_after_first_step(rows),
        report.upload_amplification_after_first_step
    );
    if let Some(sp) = report.spread_ms {
        println!(
            "publish until every other trainer holds it: median {} ms, p90 {} ms, max {} ms over {} updates ({} not everywhere in time)",
            sp.median, sp.p90, sp.max, sp.updates, report.updates_not_everywhere
        );
    }
    if let (Some(o), Some(i)) = (
        report.relay_bytes_out_per_step,
        report.relay_bytes_in_per_step,
    ) {
        println!("relay per step: {o:.0} B out, {i:.0} B in");
    }
    println!("wrote {}, {}", json.display(), png.display());
}
