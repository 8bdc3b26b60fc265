//! Run a scenario without the `swarm` binary (no libtorch, builds in seconds):
//! `cargo run --release -p sim --example simrun -- SCENARIO.toml [OUT_DIR]`, or
//! `... --example simrun -- --worked-example`. Prints one line per sweep point with wall time.

// A measurement run by hand: a failure stops it with its line, which is what its user wants.
#![allow(clippy::unwrap_used)]

use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--worked-example") {
        print!("{}", sim::worked::markdown(&sim::worked::table()));
        return;
    }
    let path = args.first().expect("usage: simrun SCENARIO.toml [OUT_DIR]");
    let out = args.get(1).map(std::path::PathBuf::from);
    let sc = sim::Scenario::load(std::path::Path::new(path)).unwrap_or_else(|e| panic!("{e}"));
    let points: Vec<_> = if sc.sweep.is_empty() {
        vec![sc.clone()]
    } else {
        sc.sweep.iter().map(|&n| sc.with_nodes(n)).collect()
    };
    println!("| nodes | steps | down MB/node/step | up MB/node/step | latency p50 s | p99 s | included | final loss | AdamW | wall s |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in &points {
        let t0 = Instant::now();
        let m = sim::run(p, &mut |_, _| {}).unwrap();
        let wall = t0.elapsed().as_secs_f64();
        let t = &m.totals;
        println!(
            "| {} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.1} | {:.5} | {:.5} | {:.2} |",
            m.nodes,
            m.steps.len(),
            t.mean_down_per_node_step / 1e6,
            t.mean_up_per_node_step / 1e6,
            t.latency_p50_ms / 1e3,
            t.latency_p99_ms / 1e3,
            m.steps.last().map_or(0.0, |s| s.included_mean),
            t.final_loss.unwrap_or(f64::NAN),
            t.final_baseline_loss,
            wall
        );
        if let Some(o) = &out {
            let dir = if points.len() > 1 {
                o.join(format!("n{}", m.nodes))
            } else {
                o.clone()
            };
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("metrics.json"), m.to_json()).unwrap();
            eprintln!(
                "draw it: swarm plot {} --out {}",
                dir.join("metrics.json").display(),
                dir.display()
            );
        }
    }
}
