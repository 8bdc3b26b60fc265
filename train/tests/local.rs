//! Local steps: the codec with error feedback, the exact outer step, a node's window.

use protocol::config::{Combine, LocalSteps, ModelConfig, OptimConfig, ValueCodec};
use protocol::sparse::{self, Layout, SparseUpdate};
use tch::{Device, Kind, Tensor};
use train::data::{Corpus, DataSpec};
use train::demo::{apply_sign_step, DctCodec};
use train::model::{param_digest, Llama};
use train::node::{NodeState, NodeStep};
use train::rng::randn;

fn layout() -> Layout {
    // 64×64 blocks, awkward 29-row blocks, a 1-D vector, a 3-D tensor.
    Layout::from_shapes(
        &[
            ("a".into(), vec![128, 192]),
            ("b".into(), vec![58, 64]),
            ("c".into(), vec![100]),
            ("d".into(), vec![4, 3, 32]),
        ],
        64,
    )
}

fn random(l: &Layout, seed: u64) -> Vec<Tensor> {
    l.tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let shape: Vec<i64> = t.shape.iter().map(|&x| x as i64).collect();
            randn(&shape, seed * 1000 + i as u64)
        })
        .collect()
}

fn sq(ts: &[Tensor]) -> f64 {
    ts.iter()
        .map(|t| t.pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]))
        .sum()
}

/// The error-feedback invariant: what is left in the buffer plus what the receivers decode is
/// exactly what went in (up to f32 rounding), for both selections and every value codec.
#[test]
fn error_feedback_keeps_what_was_not_sent() {
    let l = layout();
    let codec = DctCodec::new(l.clone(), Device::Cpu);
    for dct in [false, true] {
        for values in [ValueCodec::Q2, ValueCodec::Q4, ValueCodec::F32] {
            let orig = random(&l, 3);
            let mut buf: Vec<Tensor> = orig.iter().map(|t| t.copy()).collect();
            let u = codec.encode_local(&mut buf, 16, values, dct);
            u.validate(&l, 16, values).unwrap();
            let agg = sparse::aggregate(&l, &[&u]);
            let sent = codec.exact_values(&agg, dct);
            let err: f64 = orig
                .iter()
                .zip(&buf)
                .zip(&sent)
                .map(|((o, b), s)| (o - b - s).abs().max().double_value(&[]))
                .fold(0.0, f64::max);
            // Plain chunks: exact. With the DCT the sender subtracts its float decode while
            // receivers use the exact one, whose basis is rounded at 2^-14 (values here ~1).
            let tol = if dct { 2e-3 } else { 1e-6 };
            assert!(err < tol, "dct {dct} {values:?}: {err}");
            // Something was sent and the buffer shrank.
            assert!(sq(&buf) < sq(&orig), "dct {dct} {values:?}");
            assert!(sq(&sent) > 0.0);
        }
    }
}

/// Without the DCT, every kept value is one of the chunk's largest entries, and 4-bit values
/// track them more closely than 2-bit ones.
#[test]
fn plain_selection_keeps_the_largest_entries_and_more_bits_are_closer() {
    let l = Layout::from_shapes(&[("a".into(), vec![64, 64])], 64);
    let codec = DctCodec::new(l.clone(), Device::Cpu);
    let x = randn(&[64, 64], 9);
    let mut errs = Vec::new();
    for values in [ValueCodec::Q2, ValueCodec::Q4, ValueCodec::F32] {
        let mut buf = vec![x.copy()];
        let u = codec.encode_local(&mut buf, 64, values, false);
        let (idx, _) = u.tensors[0].entries(values);
        let mut flat = vec![0f32; 4096];
        x.reshape([-1]).copy_data(&mut flat, 4096);
        let mut sorted: Vec<f32> = flat.iter().map(|v| v.abs()).collect();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let threshold = sorted[63];
        assert!(idx.iter().all(|&i| flat[i as usize].abs() >= threshold));
        // What was sent, as decoded, against the true values at those places.
        let sent = codec.exact_values(&sparse::aggregate(&l, &[&u]), false);
        let mut s = vec![0f32; 4096];
        sent[0].reshape([-1]).copy_data(&mut s, 4096);
        let e: f64 = idx
            .iter()
            .map(|&i| ((s[i as usize] - flat[i as usize]) as f64).powi(2))
            .sum();
        errs.push(e);
    }
    assert!(errs[0] > errs[1] && errs[1] > errs[2], "{errs:?}");
    assert!(errs[2] < 1e-10);
}

/// The outer step is bit-identical whatever the order of arrival and the thread count, with
/// and without the DCT, for both combine rules; and the exact decode is the float decode up to
/// its stated rounding.
#[test]
fn outer_step_is_bit_identical_across_orders_and_threads() {
    let cfg = ModelConfig::named("tiny", 64).unwrap();
    let l = Layout::for_model(&cfg, 64);
    for dct in [false, true] {
        let model = Llama::new(&cfg, Device::Cpu, 7);
        let codec = DctCodec::new(l.clone(), Device::Cpu);
        let ups: Vec<SparseUpdate> = (0..6)
            .map(|i| {
                let mut d: Vec<Tensor> = model
                    .params
                    .iter()
                    .enumerate()
                    .map(|(j, p)| randn(&p.size(), 1000 * (i + 1) + j as u64) * 1e-3)
                    .collect();
                codec.encode_local(&mut d, 64, ValueCodec::Q2, dct)
            })
            .collect();
        for combine in [Combine::Mean, Combine::Share] {
            let mut digests = Vec::new();
            for (perm, threads) in [
                (vec![0, 1, 2, 3, 4, 5], 1),
                (vec![5, 3, 1, 0, 2, 4], 2),
                (vec![2, 4, 0, 5, 1, 3], 1),
                (vec![1, 0, 3, 2, 5, 4], 2),
            ] {
                tch::set_num_threads(threads);
                let m = Llama::new(&cfg, Device::Cpu, 7);
                let set: Vec<(&SparseUpdate, u64)> = perm.iter().map(|&i| (&ups[i], 256)).collect();
                let agg = sparse::aggregate_round(&l, combine, 256, &set);
                let vals = DctCodec::new(l.clone(), Device::Cpu).exact_values(&agg, dct);
                let float = DctCodec::new(l.clone(), Device::Cpu).decode_float(&agg);
                if !dct {
                    // decode_float is the DCT's inverse; compare magnitudes only for the DCT.
                } else {
                    for (a, b) in vals.iter().zip(&float) {
                        let scale = b.abs().max().double_value(&[]).max(1e-30);
                        let d = (a - b).abs().max().double_value(&[]);
                        assert!(d <= 1e-3 * scale, "exact vs float: {d} of {scale}");
                    }
                }
                apply_sign_step(&m.params, &vals, 0.7, 0.0);
                // Streamed into the parameters a block row at a time: the same bits.
                let s = Llama::new(&cfg, Device::Cpu, 7);
                DctCodec::new(l.clone(), Device::Cpu)
                    .with_slice_bytes(1)
                    .apply_exact_values(&s.params, &agg, dct, 0.7);
                assert_eq!(
                    param_digest(&s.params),
                    param_digest(&m.params),
                    "streamed apply"
                );
                digests.push(param_digest(&m.params));
            }
            assert!(
                digests.windows(2).all(|w| w[0] == w[1]),
                "dct {dct} {combine:?}: digests differ"
            );
            assert_ne!(digests[0], model.digest(), "the step changed nothing");
        }
    }
}

fn local_step(h: u32) -> (NodeStep, Corpus, ModelConfig) {
    let corpus = Corpus::open(&DataSpec::Synthetic {
        seed: 1,
        vocab: 16,
        branch: 3,
    })
    .expect("the synthetic corpus opens");
    let mut model = ModelConfig::named("tiny", corpus.vocab() as u32).expect("tiny is a preset");
    model.layers = 1;
    model.seq_len = 16;
    let optim = OptimConfig {
        lr: 3e-3,
        topk: 64,
        values: ValueCodec::Q2,
        warmup_steps: 1,
        total_steps: 10,
        combine: Combine::Share,
        local: Some(LocalSteps {
            inner_steps: h,
            ..Default::default()
        }),
        ..OptimConfig::default()
    };
    (
        NodeStep::new(&model, &optim, 5, 2, Device::Cpu),
        corpus,
        model,
    )
}

/// A window leaves the shared weights bit for bit, states its tokens, and its update passes
/// its own spot check; starting from the node's in-flight progress changes what it sends.
#[test]
fn a_window_leaves_the_shared_weights_and_helps_its_own_batch() {
    let (step, corpus, cfg) = local_step(4);
    let model = Llama::new(&cfg, Device::Cpu, 5);
    let before = model.digest();
    let mut st = NodeState::new(&model.params);
    let t0 = step.train(&corpus, &model, &mut st, b"n1", 0, 0);
    assert_eq!(model.digest(), before);
    assert_eq!(t0.tokens, 4 * 2 * 16);
    t0.update
        .validate(step.layout(), 64, ValueCodec::Q2)
        .unwrap();
    let gain = step.spot_check(&corpus, &model, b"n1", 0, &t0.update, t0.tokens);
    assert!(gain > 0.0, "own update should lower its own loss: {gain}");
    // Window 1 while window 0 is in flight (version 0) starts from the node's own end of
    // window 0; with window 0 applied (version 1) it starts from the shared weights.
    let mut a = NodeState::new(&model.params);
    let _ = step.train(&corpus, &model, &mut a, b"n1", 0, 0);
    let mut b = NodeState::new(&model.params);
    let _ = step.train(&corpus, &model, &mut b, b"n1", 0, 0);
    let ua = step.train(&corpus, &model, &mut a, b"n1", 1, 0).update;
    let ub = step.train(&corpus, &model, &mut b, b"n1", 1, 1).update;
    assert_ne!(ua, ub);
    assert_eq!(model.digest(), before);
}

#[test]
#[ignore = "needs a CUDA device: run with SWARM_GPU_TESTS=1 cargo test -- --ignored"]
fn outer_step_is_identical_on_cuda() {
    if std::env::var("SWARM_GPU_TESTS").is_err() || !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA (set SWARM_GPU_TESTS=1 on a GPU machine)");
        return;
    }
    let l = layout();
    let cpu = DctCodec::new(l.clone(), Device::Cpu);
    let ups: Vec<SparseUpdate> = (0..7)
        .map(|i| {
            let mut d = random(&l, 50 + i);
            cpu.encode_local(&mut d, 16, ValueCodec::Q2, i % 2 == 0)
        })
        .collect();
    let set: Vec<(&SparseUpdate, u64)> = ups.iter().map(|u| (u, 256)).collect();
    let agg = sparse::aggregate_round(&l, Combine::Share, 256, &set);
    for dct in [false, true] {
        let a = cpu.exact_values(&agg, dct);
        let b = DctCodec::new(l.clone(), Device::Cuda(0)).exact_values(&agg, dct);
        for (x, y) in a.iter().zip(&b) {
            assert!(x.equal(&y.to_device(Device::Cpu)), "dct {dct}");
        }
    }
}
