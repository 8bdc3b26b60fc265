//! A scenario's per-step curve: mean train loss over nodes, eval loss, the AdamW baseline, how
//! many updates were included and the majority parameter digest, one row per step — what a
//! real swarm with the same keys and run file must reproduce (issue 5 item 6: compare with
//! `swarm demo`'s per-node status lines, which carry each node's train loss and digest).
//!
//! `cargo run --release -p sim --features torch --example curve -- SCENARIO.toml [--steps N]
//!  [--json OUT.jsonl] [--out DIR]`
//!
//! `--json` writes one JSON object per step (`step`, `train_loss`, `eval_loss`,
//! `baseline_loss`, `included_min`, `agree`, `digest`), for a test on the node side to read;
//! `--out` writes `metrics.json` as `swarm sim` does (`swarm plot` draws it). The wall time is split into
//! the simulation itself (until the last step boundary) and what follows it (the AdamW
//! baseline, when the scenario runs one, and the metrics).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("curve: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let mut scenario = None;
    let mut steps = None;
    let mut json: Option<PathBuf> = None;
    let mut out: Option<PathBuf> = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--steps" => {
                let v = args.next().ok_or("--steps needs a number")?;
                steps = Some(v.parse::<u64>().map_err(|e| format!("--steps {v}: {e}"))?);
            }
            "--json" => json = Some(args.next().ok_or("--json needs a path")?.into()),
            "--out" => out = Some(args.next().ok_or("--out needs a directory")?.into()),
            s if s.starts_with("--") => {
                return Err(format!("unknown flag {s} (see the file's docs)"))
            }
            s => scenario = Some(PathBuf::from(s)),
        }
    }
    let path = scenario.ok_or("usage: curve SCENARIO.toml [--steps N] [--json OUT.jsonl]")?;
    let mut sc = sim::Scenario::load(&path).map_err(|e| e.to_string())?;
    if let Some(s) = steps {
        sc.steps = s;
        sc.check().map_err(|e| e.to_string())?;
    }
    if let Some(dir) = &out {
        // Before the run, so that a bad path fails at once and `--json` may point into it.
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let t0 = Instant::now();
    // The progress callback marks each step boundary of virtual time; the last one is the end
    // of the simulation proper (the baseline runs after it).
    let mut sim_wall = 0.0;
    let m = sim::run(&sc, &mut |step, steps| {
        sim_wall = t0.elapsed().as_secs_f64();
        if step % 10 == 0 || step == steps {
            eprintln!("[{sim_wall:7.1} s] step {step}/{steps}");
        }
    })
    .map_err(|e| e.to_string())?;
    let wall = t0.elapsed().as_secs_f64();
    let opt = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.6}"));
    println!("| step | train loss (mean) | eval loss | AdamW | included | agree | digest |");
    println!("|---:|---:|---:|---:|---:|---:|---|");
    let mut lines = String::new();
    for s in &m.steps {
        println!(
            "| {} | {} | {} | {} | {} | {:.2} | {} |",
            s.step,
            opt(s.train_loss),
            opt(s.loss),
            opt(Some(s.baseline_loss).filter(|v| v.is_finite())),
            s.included_min,
            s.agree,
            s.digest.get(..16).unwrap_or(&s.digest)
        );
        let row = serde_json::json!({
            "step": s.step,
            "train_loss": s.train_loss,
            "eval_loss": s.loss,
            "baseline_loss": Some(s.baseline_loss).filter(|v| v.is_finite()),
            "included_min": s.included_min,
            "agree": s.agree,
            "digest": s.digest,
        });
        lines += &row.to_string();
        lines.push('\n');
    }
    eprintln!(
        "{}: {} nodes, {} steps, initial eval loss {:.4}, final {} (AdamW {}); wall {wall:.1} s: \
         simulation {sim_wall:.1} s ({:.3} s/step), then baseline + metrics {:.1} s",
        sc.name,
        m.nodes,
        m.steps.len(),
        m.totals.initial_loss,
        opt(m.totals.final_loss),
        opt(Some(m.totals.final_baseline_loss).filter(|v| v.is_finite())),
        sim_wall / m.steps.len().max(1) as f64,
        wall - sim_wall
    );
    if let Some(dir) = out {
        std::fs::write(dir.join("metrics.json"), m.to_json())
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        eprintln!(
            "draw it: swarm plot {} --out {}",
            dir.join("metrics.json").display(),
            dir.display()
        );
    }
    if let Some(p) = json {
        let mut f = std::fs::File::create(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        f.write_all(lines.as_bytes())
            .map_err(|e| format!("{}: {e}", p.display()))?;
    }
    Ok(())
}
