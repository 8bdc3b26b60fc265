//! End-to-end: short DeMo and AdamW runs learn; the model and data behave.

use protocol::config::{ModelConfig, OptimConfig};
use tch::Device;
use train::data::{Corpus, DataSpec, MarkovChain};
use train::model::Llama;
use train::run::{train, Optimizer, TrainOptions};

fn opts(optimizer: Optimizer, steps: u32) -> (TrainOptions, Corpus) {
    // A small chain (256 contexts) so that a couple of minutes of CPU reach near the floor.
    let corpus = Corpus::open(&DataSpec::Synthetic {
        seed: 1,
        vocab: 16,
        branch: 3,
    })
    .expect("the synthetic corpus opens");
    let mut model = ModelConfig::named("tiny", corpus.vocab() as u32).expect("tiny is a preset");
    model.layers = 2;
    model.seq_len = 32;
    let local = optimizer == Optimizer::Local;
    let o = TrainOptions {
        model,
        optimizer,
        replicas: 4,
        steps,
        batch: 4,
        seed: 3,
        optim: OptimConfig {
            lr: 3e-3,
            warmup_steps: 10,
            total_steps: steps,
            // Local steps: the defaults' windows with top-8 2-bit values.
            topk: if local { 8 } else { 4 },
            values: if local {
                protocol::config::ValueCodec::Q2
            } else {
                protocol::config::ValueCodec::Sign
            },
            ..OptimConfig::default()
        },
        adamw_lr: 3e-3,
        adamw_wd: 0.1,
        eval_every: 0,
        eval_batches: 4,
        schedule: Default::default(),
        init: None,
    };
    (o, corpus)
}

/// `fraction`: how much of the way from the start loss to the floor the run must cover.
fn check_learns(optimizer: Optimizer, fraction: f64) {
    let (o, corpus) = opts(optimizer, 120);
    let start = {
        let m = Llama::new(&o.model, Device::Cpu, o.seed);
        train::run::eval_loss(&m, &corpus, o.seed, 4, 4)
    };
    let (_, report) = train(&o, &corpus, Device::Cpu, |_| {}).expect("trains");
    let floor = report
        .loss_floor
        .expect("the synthetic corpus knows its floor");
    let end = report.final_eval_loss;
    eprintln!("{optimizer:?}: start {start:.3} end {end:.3} floor {floor:.3}");
    assert!(
        end < start - fraction * (start - floor),
        "{optimizer:?}: {start} -> {end} (floor {floor})"
    );
    assert!(end > floor - 0.05, "below the floor? {end} < {floor}");
}

#[test]
fn demo_learns() {
    // k = 4 of 4096 moves ~0.03 bits per parameter per step: slower than AdamW at this size.
    check_learns(Optimizer::Demo, 0.4);
}

#[test]
fn local_steps_learn() {
    check_learns(Optimizer::Local, 0.4);
}

#[test]
fn adamw_learns() {
    check_learns(Optimizer::Adamw, 0.6);
}

#[test]
fn demo_runs_are_reproducible() {
    let (o, corpus) = opts(Optimizer::Demo, 5);
    let (_, a) = train(&o, &corpus, Device::Cpu, |_| {}).unwrap();
    let (_, b) = train(&o, &corpus, Device::Cpu, |_| {}).unwrap();
    assert_eq!(a.final_digest, b.final_digest);
}

#[test]
fn markov_floor_is_consistent() {
    let m = MarkovChain::new(1, 64, 4);
    assert!(
        m.entropy_rate > 0.3 && m.entropy_rate < (4f64).ln(),
        "{}",
        m.entropy_rate
    );
    assert!(m.first_order_entropy > m.entropy_rate);
    // The empirical loss of the true conditional probabilities approaches the entropy rate.
    let mut rng = train::rng::Rng::new(9);
    let seqs: Vec<Vec<u32>> = (0..200).map(|_| m.sample(&mut rng, 200)).collect();
    assert!(seqs
        .iter()
        .all(|s| s.len() == 200 && s.iter().all(|&t| t < 64)));
}

#[test]
fn batches_are_a_pure_function_of_seed_node_step() {
    let c = Corpus::open(&DataSpec::synthetic_default()).unwrap();
    let a = c.sequences("train", 1, b"node-a", 5, 3, 16);
    assert_eq!(a, c.sequences("train", 1, b"node-a", 5, 3, 16));
    assert_ne!(a, c.sequences("train", 1, b"node-b", 5, 3, 16));
    assert_ne!(a, c.sequences("train", 1, b"node-a", 6, 3, 16));
    assert_ne!(a, c.sequences("train", 2, b"node-a", 5, 3, 16));
}

#[test]
fn text_and_shards_load() {
    let dir = std::env::temp_dir().join(format!("swarm-data-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = "To be, or not to be, that is the question. ".repeat(100);
    let tp = dir.join("t.txt");
    std::fs::write(&tp, &text).unwrap();
    let c = Corpus::open(&DataSpec::Text {
        path: tp.display().to_string(),
        tokenizer: None,
    })
    .unwrap();
    assert_eq!(c.vocab(), 256);
    let s = c.sequences("train", 0, b"x", 0, 2, 10);
    assert!(s
        .iter()
        .all(|q| q.len() == 11 && q.iter().all(|&t| t < 128)));
    // A HuggingFace tokenizer.json (a word-level model, written by hand).
    let tok = dir.join("tokenizer.json");
    std::fs::write(
        &tok,
        r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
            "pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab":{"[UNK]":0,"To":1,"be":2,",":3,"or":4,"not":5,"to":6},"unk_token":"[UNK]"}}"#,
    )
    .unwrap();
    let c = Corpus::open(&DataSpec::Text {
        path: tp.display().to_string(),
        tokenizer: Some(tok.display().to_string()),
    })
    .unwrap();
    assert_eq!(c.vocab(), 7);
    let s = c.sequences("train", 0, b"x", 0, 4, 12);
    assert!(s.iter().flatten().all(|&t| t < 7));
    assert!(s.iter().flatten().any(|&t| t == 2), "\"be\" appears");
    for width in [16u32, 32] {
        let toks: Vec<u32> = (0..5000u32).map(|i| (i * 7) % 1000).collect();
        let bytes: Vec<u8> = if width == 16 {
            toks.iter()
                .flat_map(|&t| (t as u16).to_le_bytes())
                .collect()
        } else {
            toks.iter().flat_map(|&t| t.to_le_bytes()).collect()
        };
        let p = dir.join(format!("s.u{width}"));
        std::fs::write(&p, bytes).unwrap();
        let c = Corpus::open(&DataSpec::Shard {
            path: p.display().to_string(),
            width,
            vocab: 0,
        })
        .unwrap();
        assert_eq!(c.vocab(), 1000);
        let s = c.sequences("eval", 0, b"x", 0, 1, 8);
        // Consecutive tokens of the stream: each is the previous + 7 (mod 1000).
        assert!(s[0].windows(2).all(|w| (w[0] + 7) % 1000 == w[1]));
    }
}

#[test]
fn grouped_query_attention_and_checkpoints() {
    let mut cfg = ModelConfig::named("tiny", 64).unwrap();
    cfg.kv_heads = 2;
    cfg.layers = 1;
    let m = Llama::new(&cfg, Device::Cpu, 1);
    let x = tch::Tensor::zeros([2, 16], (tch::Kind::Int64, Device::Cpu));
    assert_eq!(m.forward(&x).size(), vec![2, 16, 64]);
    let p = std::env::temp_dir().join(format!("swarm-ckpt-{}.safetensors", std::process::id()));
    m.save(&p).unwrap();
    let mut m2 = Llama::new(&cfg, Device::Cpu, 2);
    assert_ne!(m.digest(), m2.digest());
    m2.load(&p).unwrap();
    assert_eq!(m.digest(), m2.digest());
}
