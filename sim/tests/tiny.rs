//! The real model in the simulator (feature `torch`): a few `tiny` nodes train (eval loss
//! falls), every node holds the same parameters after every step, and the run is a pure
//! function of the scenario (same seed, same metrics bytes).
#![cfg(feature = "torch")]

use std::path::Path;
use std::sync::Mutex;

use sim::synth::SimTrainer;
use sim::Scenario;

/// The tests share two cores and libtorch's thread pool: run them one at a time (model
/// initialization itself is serialized inside `Llama::new`).
static TORCH: Mutex<()> = Mutex::new(());

fn scenario() -> Scenario {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/tiny_test.toml");
    Scenario::load(&p).unwrap()
}

#[test]
fn tiny_trains_agrees_and_is_deterministic() {
    let _g = TORCH.lock().unwrap_or_else(|e| e.into_inner());
    let sc = scenario();
    let n = sc.nodes() as u32;
    let m = sim::run(&sc, &mut |_, _| {}).unwrap();
    assert_eq!(m.steps.len() as u64, sc.steps);
    for s in &m.steps {
        // Every node applied every step, with every update, to the same parameters.
        assert_eq!(s.applied_nodes, n, "{s:?}");
        assert_eq!(s.agree, 1.0, "{s:?}");
        assert_eq!(s.included_min, n, "{s:?}");
        assert!(s.train_loss.is_some_and(f64::is_finite), "{s:?}");
    }
    assert_eq!(m.totals.desyncs, 0);
    assert_eq!(m.totals.rejected, 0);
    // Distinct parameters every step (a sign step always moves them).
    let digests: std::collections::BTreeSet<&str> =
        m.steps.iter().map(|s| s.digest.as_str()).collect();
    assert_eq!(digests.len(), m.steps.len());
    let (l0, l1) = (m.totals.initial_loss, m.totals.final_loss.unwrap());
    // ln 64 ≈ 4.16 at initialization; six sign steps of 1e-2 bring it well down.
    assert!(l0 > 4.0 && l1 < l0 - 0.3, "eval loss {l0} -> {l1}");
    // Same scenario and seed: the same bytes.
    let again = sim::run(&sc, &mut |_, _| {}).unwrap();
    assert_eq!(m.to_json(), again.to_json());
}

/// Local steps in the whole simulated swarm, every defence on: every node applies every
/// window with every update to the same parameters (so spot checks, copy detection and
/// bounded influence accept honest q2 pseudo-gradients), and the eval loss falls.
#[test]
fn tiny_local_steps_train_and_agree() {
    let _g = TORCH.lock().unwrap_or_else(|e| e.into_inner());
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/tiny_local_test.toml");
    let sc = Scenario::load(&p).unwrap();
    let n = sc.nodes() as u32;
    let m = sim::run(&sc, &mut |_, _| {}).unwrap();
    assert_eq!(m.steps.len() as u64, sc.steps);
    for s in &m.steps {
        assert_eq!(s.applied_nodes, n, "{s:?}");
        assert_eq!(s.agree, 1.0, "{s:?}");
        assert_eq!(s.included_min, n, "{s:?}");
    }
    assert_eq!(m.totals.desyncs, 0);
    assert_eq!(m.totals.rejected, 0);
    let (l0, l1) = (m.totals.initial_loss, m.totals.final_loss.unwrap());
    // Four windows of four AdamW steps at 1e-2 from ln 64 ≈ 4.16.
    assert!(l0 > 4.0 && l1 < l0 - 0.3, "eval loss {l0} -> {l1}");
}

/// The trainer alone: applying a node's own update must lower the loss on that node's batch
/// (the spot check's premise), an empty set changes nothing, and the digest is the model's.
#[test]
fn tiny_spot_check_and_digest() {
    let _g = TORCH.lock().unwrap_or_else(|e| e.into_inner());
    let sc = scenario();
    let mut run = protocol::run::RunConfig::new(
        "t",
        protocol::config::ModelConfig::named("tiny", 64).unwrap(),
        sc.optim.config(sc.steps),
        protocol::run::DataSpec::Synthetic { seed: 1, vocab: 32 },
        protocol::run::StepTiming {
            genesis_ms: 0,
            period_ms: 2000,
            grace_ms: 300,
            summary_ms: 700,
        },
    );
    run.batch_seqs = 2;
    let mut t = sim::tiny::Tiny::new(&run, &sc).unwrap();
    let p0 = t.init();
    assert_eq!(p0.len(), t.params_len());
    // The protocol's digest of the named tensors, as `Llama::digest` computes it.
    let m = train::model::Llama::new(&run.model, train::tch::Device::Cpu, run.seed);
    assert_eq!(t.digest(&p0).0, m.digest());
    assert_eq!(t.apply_round(0, &p0, &[]), p0);
    let id = sim::world::identity(sc.seed, 0).node_id();
    let local = t.train(0, &id, 0, 0, &p0);
    let gain = t.spot_check(&id, 0, &p0, &local.update, local.tokens);
    assert!(gain > 0.0, "own update on own batch: gain {gain}");
}

/// The simulator's trainer computes what the `train` crate computes: replicas keyed like
/// `train::run::train`'s (`replica_id(r)`) trained and applied through `Tiny` end with the same
/// parameter digest as `swarm train`'s in-process DeMo run of the same configuration.
#[test]
fn tiny_matches_train_run() {
    matches_train_run(train::run::Schedule::Sync, protocol::config::Lookahead::Off);
}

/// The same under the swarm's schedule (step t trained on parameters still lacking step t−1),
/// with and without the look-ahead, so `swarm train --schedule overlap` measures what the
/// simulator's nodes (and `swarm run`'s) compute.
#[test]
fn tiny_matches_train_run_overlapped() {
    use protocol::config::Lookahead;
    for la in [Lookahead::Off, Lookahead::Momentum, Lookahead::Update] {
        matches_train_run(train::run::Schedule::Overlap, la);
    }
}

/// Local steps too: windows of H AdamW steps, error-fed q2 pseudo-gradients, the exact outer
/// step, and (overlapped) each node starting from its own in-flight window.
#[test]
fn tiny_matches_train_run_local() {
    use protocol::config::Lookahead;
    for (schedule, dct) in [
        (train::run::Schedule::Sync, false),
        (train::run::Schedule::Overlap, false),
        (train::run::Schedule::Overlap, true),
    ] {
        let local = protocol::config::LocalSteps {
            inner_steps: 2,
            dct,
            ..Default::default()
        };
        matches_train_run_with(schedule, Lookahead::Off, Some(local));
    }
}

fn matches_train_run(schedule: train::run::Schedule, lookahead: protocol::config::Lookahead) {
    matches_train_run_with(schedule, lookahead, None)
}

fn matches_train_run_with(
    schedule: train::run::Schedule,
    lookahead: protocol::config::Lookahead,
    local: Option<protocol::config::LocalSteps>,
) {
    let _g = TORCH.lock().unwrap_or_else(|e| e.into_inner());
    let sc = scenario();
    // Protocol steps (windows for local steps) and batches per replica.
    let hh = local.as_ref().map_or(1, |l| l.inner_steps);
    let (replicas, steps) = (2usize, 4u32);
    let mut optim = sc.optim.config(steps as u64);
    // `train::run::train` runs its cosine over its own step count.
    optim.total_steps = steps;
    optim.lookahead = lookahead;
    if local.is_some() {
        optim.local = local.clone();
        optim.topk = 32;
        optim.values = protocol::config::ValueCodec::Q2;
        optim.combine = protocol::config::Combine::Share;
        optim.lr = 3e-3;
    }
    let model = protocol::config::ModelConfig::named("tiny", 64).unwrap();
    let opts = train::run::TrainOptions {
        model: model.clone(),
        optimizer: if local.is_some() {
            train::run::Optimizer::Local
        } else {
            train::run::Optimizer::Demo
        },
        replicas,
        steps: steps * hh,
        batch: 2,
        seed: 5,
        optim: optim.clone(),
        adamw_lr: 3e-3,
        adamw_wd: 0.1,
        eval_every: 0,
        eval_batches: 1,
        schedule,
        init: None,
    };
    let corpus = train::data::Corpus::open(&train::data::DataSpec::Synthetic {
        seed: 1,
        vocab: 32,
        branch: 4,
    })
    .unwrap();
    let (_, report) = train::run::train(&opts, &corpus, train::tch::Device::Cpu, |_| {}).unwrap();
    assert_eq!(report.steps.len(), steps as usize);

    let mut run = protocol::run::RunConfig::new(
        "t",
        model,
        optim,
        protocol::run::DataSpec::Synthetic { seed: 1, vocab: 32 },
        protocol::run::StepTiming {
            genesis_ms: 0,
            period_ms: 2000,
            grace_ms: 300,
            summary_ms: 700,
        },
    );
    // `swarm train` counts warm-up in batches; a run file counts it in windows.
    run.optim.warmup_steps = opts.optim.warmup_steps.div_ceil(hh);
    run.seed = 5;
    run.batch_seqs = 2;
    let mut t = sim::tiny::Tiny::new(&run, &sc).unwrap();
    let mut p = t.init();
    let overlap = schedule == train::run::Schedule::Overlap;
    // (step, updates) trained but not yet applied: the swarm's in-flight round.
    let mut pending: Option<(u64, Vec<sim::synth::Local>)> = None;
    let mut version = 0u64;
    for step in 0..steps as u64 {
        let locals: Vec<_> = (0..replicas)
            .map(|r| t.train_as(r, &train::run::replica_id(r), step, version, &p))
            .collect();
        let mut rounds = Vec::new();
        if overlap {
            rounds.extend(pending.take());
            if step + 1 == steps as u64 {
                rounds.push((step, locals));
            } else {
                pending = Some((step, locals));
            }
        } else {
            rounds.push((step, locals));
        }
        for (s, locals) in rounds {
            let set: Vec<_> = locals.iter().map(|l| (&l.update, l.tokens)).collect();
            p = t.apply_round(s, &p, &set);
            version = s + 1;
        }
    }
    assert_eq!(
        t.digest(&p).to_hex(),
        report.final_digest,
        "{schedule:?} look-ahead {lookahead:?} local {local:?}"
    );
}
