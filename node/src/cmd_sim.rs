//! `swarm sim`: run a simulator scenario (sim/scenarios/*.toml) and write its metrics and plots.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, Result};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(clap::Args)]
pub(crate) struct SimArgs {
    /// Scenario file (TOML; see sim/scenarios/).
    pub scenario: Option<PathBuf>,
    /// Directory for metrics.json (one per sweep point) and the PNG plots.
    #[arg(long, short, default_value = "runs/sim")]
    pub out: PathBuf,
    /// Print the seed article's worked example (analytic and simulated) as a table and exit.
    #[arg(long)]
    pub worked_example: bool,
    /// Skip the PNG plots.
    #[arg(long)]
    pub no_plots: bool,
}

pub(crate) fn run(a: SimArgs) -> Result<()> {
    if a.worked_example {
        let rows = sim::worked::table();
        print!("{}", sim::worked::markdown(&rows));
        std::fs::create_dir_all(&a.out)?;
        std::fs::write(
            a.out.join("worked_example.json"),
            serde_json::to_string_pretty(&rows)?,
        )?;
        return Ok(());
    }
    let path = a
        .scenario
        .ok_or_else(|| anyhow!("give a scenario file, or --worked-example"))?;
    let sc = sim::Scenario::load(&path).map_err(|e| anyhow!("{e}"))?;
    std::fs::create_dir_all(&a.out)?;
    let points: Vec<sim::Scenario> = if sc.sweep.is_empty() {
        vec![sc.clone()]
    } else {
        sc.sweep.iter().map(|&n| sc.with_nodes(n)).collect()
    };
    let mut table = Vec::new();
    for p in &points {
        let bar = ProgressBar::new(p.steps);
        bar.set_style(
            ProgressStyle::with_template("{prefix} [{bar:40}] step {pos}/{len} {elapsed_precise}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_prefix(format!("{} ({} nodes)", p.name, p.nodes()));
        let t0 = Instant::now();
        let m = sim::run(p, &mut |s, _| bar.set_position(s)).map_err(|e| anyhow!("{e}"))?;
        let wall = t0.elapsed().as_secs_f64();
        bar.finish_and_clear();
        let dir = if points.len() > 1 {
            a.out.join(format!("n{}", p.nodes()))
        } else {
            a.out.clone()
        };
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("metrics.json"), m.to_json())?;
        if !a.no_plots {
            crate::plot::sim::metrics(&m, &dir)?;
        }
        let last = m.steps.last().cloned().unwrap_or_default();
        eprintln!(
            "{}: {} nodes, {} steps in {wall:.2} s wall, {} events; final loss {:.5} (AdamW {:.5}); wrote {}",
            p.name,
            m.nodes,
            m.steps.len(),
            m.totals.events,
            m.totals.final_loss.unwrap_or(f64::NAN),
            m.totals.final_baseline_loss,
            dir.display()
        );
        table.push(serde_json::json!({
            "nodes": m.nodes,
            "wall_s": wall,
            "down_mb_per_node_step": m.totals.mean_down_per_node_step / 1e6,
            "up_mb_per_node_step": m.totals.mean_up_per_node_step / 1e6,
            "latency_p50_ms": m.totals.latency_p50_ms,
            "latency_p99_ms": m.totals.latency_p99_ms,
            "included_last": last.included_mean,
            "final_loss": m.totals.final_loss,
            "baseline_loss": m.totals.final_baseline_loss,
        }));
    }
    println!("| nodes | down MB/node/step | up MB/node/step | latency p50 s | p99 s | included | final loss | AdamW | wall s |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &table {
        println!(
            "| {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.1} | {:.5} | {:.5} | {:.2} |",
            r["nodes"],
            r["down_mb_per_node_step"].as_f64().unwrap_or(0.0),
            r["up_mb_per_node_step"].as_f64().unwrap_or(0.0),
            r["latency_p50_ms"].as_f64().unwrap_or(0.0) / 1000.0,
            r["latency_p99_ms"].as_f64().unwrap_or(0.0) / 1000.0,
            r["included_last"].as_f64().unwrap_or(0.0),
            r["final_loss"].as_f64().unwrap_or(f64::NAN),
            r["baseline_loss"].as_f64().unwrap_or(f64::NAN),
            r["wall_s"].as_f64().unwrap_or(0.0),
        );
    }
    // Wall times vary by machine: kept out of metrics.json (which is byte-deterministic).
    std::fs::write(
        a.out.join("summary.json"),
        serde_json::to_string_pretty(&table)?,
    )?;
    Ok(())
}
