//! Every attacker of `sim::adversary` at 10%, 25% and 40% of the nodes, each against the
//! honest-only run of the same size and seed, with the content defences on (and off, for
//! comparison, for a few). Writes `table.md` and `attacks.json` to the output directory and
//! prints the table; `swarm plot DIR/attacks.json --out DIR/attacks.png` draws the bars.
//!
//! `cargo run --release -p sim --example attacks -- [--scenario FILE] [--out DIR]
//!  [--trainer synthetic|tiny] [--fractions 0.1,0.25,0.4] [--steps N] [--nodes N]
//!  [--only alie,ipm] [--defences full|off|both] [--jobs N] [--no-accuse]`
//!
//! The base scenario (default `sim/scenarios/attacks.toml`; with `--trainer tiny`,
//! `sim/scenarios/attacks_tiny.toml`, whose optimizer suits the real model) gives nodes, links,
//! timing and optimizer; its attackers and defences are replaced per row. `--trainer tiny` needs
//! the `torch` feature. The real model costs seconds per simulated step, so a reduced sweep
//! picks attacks with `--only`, fractions with `--fractions` and `--defences full` to skip the
//! undefended rows (the honest-only and attackers-silent references always run).

// A measurement run by hand: a failure stops it with its line, which is what its user wants.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::Instant;

use sim::adversary::{self, Attack};
use sim::scenario::TrainerKind;

/// The command line (see the file's docs).
struct Args {
    scenario: Option<PathBuf>,
    out: PathBuf,
    trainer: Option<TrainerKind>,
    fractions: Vec<f64>,
    steps: Option<u64>,
    only: Vec<String>,
    nodes: Option<usize>,
    jobs: usize,
    no_accuse: bool,
    defended: bool,
    undefended_rows: bool,
}

fn main() {
    let args = parse_args();
    let base = base_scenario(&args);
    let (attacks, defences) = rows_to_run(&args);
    let t0 = Instant::now();
    let rows = adversary::sweep(
        &base,
        &attacks,
        &args.fractions,
        &defences,
        args.jobs,
        &|l| eprintln!("[{:6.1}s] {l}", t0.elapsed().as_secs_f64()),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    write_outputs(&args, &base, &rows, t0);
}

/// Parse the command line; a bad argument panics with its name.
fn parse_args() -> Args {
    let mut args = std::env::args().skip(1);
    let mut scenario: Option<PathBuf> = None;
    let mut out = PathBuf::from("runs/attacks");
    let mut trainer = None;
    let mut fractions = vec![0.1, 0.25, 0.4];
    let mut steps = None;
    let mut only: Vec<String> = Vec::new();
    let mut nodes: Option<usize> = None;
    // Runs in parallel (each is independent and seeded; the table is the same for any value).
    let mut jobs = std::thread::available_parallelism().map_or(1, |n| n.get());
    // Every defence but accusations (how the tables before they existed were measured).
    let mut no_accuse = false;
    let (mut defended, mut undefended_rows) = (true, true);
    while let Some(a) = args.next() {
        let mut val = || args.next().unwrap_or_else(|| panic!("{a} needs a value"));
        match a.as_str() {
            "--scenario" => scenario = Some(val().into()),
            "--out" => out = val().into(),
            "--trainer" => {
                trainer = Some(match val().as_str() {
                    "synthetic" => TrainerKind::Synthetic,
                    "tiny" => TrainerKind::Tiny,
                    t => panic!("unknown trainer {t}"),
                })
            }
            "--fractions" => {
                fractions = val()
                    .split(',')
                    .map(|x| x.parse().expect("a number"))
                    .collect()
            }
            "--steps" => steps = Some(val().parse().expect("a number")),
            "--only" => only = val().split(',').map(String::from).collect(),
            "--nodes" => nodes = Some(val().parse().expect("a number")),
            "--jobs" => jobs = val().parse().expect("a number"),
            "--no-accuse" => no_accuse = true,
            "--defences" => {
                (defended, undefended_rows) = match val().as_str() {
                    "full" => (true, false),
                    "off" => (false, true),
                    "both" => (true, true),
                    d => panic!("--defences {d}: full, off or both"),
                }
            }
            _ => panic!("unknown argument {a} (see the file's docs)"),
        }
    }
    Args {
        scenario,
        out,
        trainer,
        fractions,
        steps,
        only,
        nodes,
        jobs,
        no_accuse,
        defended,
        undefended_rows,
    }
}

/// The base scenario (the named file, or the default for the trainer) with the command line's
/// trainer, steps, accusations and node count applied.
fn base_scenario(args: &Args) -> sim::Scenario {
    let trainer = args.trainer;
    let scenario = args.scenario.clone().unwrap_or_else(|| {
        let file = match trainer {
            Some(TrainerKind::Tiny) => "scenarios/attacks_tiny.toml",
            _ => "scenarios/attacks.toml",
        };
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(file)
    });
    let mut base = sim::Scenario::load(&scenario).unwrap_or_else(|e| panic!("{e}"));
    if let Some(t) = trainer {
        base.trainer.kind = t;
    }
    if let Some(s) = args.steps {
        base.steps = s;
    }
    if args.no_accuse {
        base.defence = sim::scenario::DefenceSpec::Fields(protocol::run::Defence {
            accuse: false,
            ..protocol::run::Defence::full()
        });
    }
    if let Some(n) = args.nodes {
        base = base.with_nodes(n);
        base.name = base.name.trim_end_matches(&format!("-n{n}")).to_string();
    }
    base
}

/// The attacks to run (`--only`, else all) and the defence settings to run them under: with
/// defences on, and off for the content attacks the defences are for.
fn rows_to_run(args: &Args) -> (Vec<Attack>, Vec<(bool, Vec<Attack>)>) {
    let only = &args.only;
    if let Some(o) = only
        .iter()
        .find(|o| !Attack::all().iter().any(|a| a.name() == o.as_str()))
    {
        panic!("--only {o}: no such attack");
    }
    let attacks: Vec<Attack> = Attack::all()
        .into_iter()
        .filter(|a| only.is_empty() || only.iter().any(|o| o == a.name()))
        .collect();
    // Without defences: the content attacks the defences are for (the rest are refused by
    // validation, which is always on).
    let undefended = vec![
        Attack::Noise { scale: 10.0 },
        Attack::Signflip,
        Attack::Scale {
            factor: 100.0,
            claim: true,
        },
        Attack::Alie { z: 1.0 },
        Attack::Ipm { epsilon: 0.1 },
    ];
    let mut defences = Vec::new();
    if args.defended {
        defences.push((true, Vec::new()));
    }
    if args.undefended_rows {
        defences.push((false, undefended));
    }
    (attacks, defences)
}

/// Print the table and write `table.md` and `attacks.json` into `--out`.
fn write_outputs(args: &Args, base: &sim::Scenario, rows: &[adversary::Row], t0: Instant) {
    let out = &args.out;
    let no_accuse = args.no_accuse;
    let table = adversary::markdown(rows, 2.0);
    let head = format!(
        "Scenario `{}`: {} nodes, {} steps, seed {}, trainer {:?}, values {:?}, k {}, accusations {}. % worse = final loss vs the honest-only run with the same defences; ✗ = over the 2% target at 25% with defences on.\n\n",
        base.name,
        base.nodes(),
        base.steps,
        base.seed,
        base.trainer.kind,
        base.optim.values,
        base.optim.topk,
        if no_accuse { "off" } else { "on" }
    );
    print!("{head}{table}");
    std::fs::create_dir_all(out).unwrap();
    std::fs::write(out.join("table.md"), format!("{head}{table}")).unwrap();
    std::fs::write(
        out.join("attacks.json"),
        serde_json::to_string_pretty(rows).unwrap(),
    )
    .unwrap();
    eprintln!(
        "wrote {} in {:.1}s (draw it: swarm plot {} --out {})",
        out.display(),
        t0.elapsed().as_secs_f64(),
        out.join("attacks.json").display(),
        out.join("attacks.png").display()
    );
}
