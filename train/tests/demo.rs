//! DeMo behaviour: the DCT, top-k, the decoupling, exact and order-free aggregation.

use protocol::config::{ModelConfig, ValueCodec};
use protocol::sparse::{self, Layout, SparseUpdate};
use tch::{Device, Kind, Tensor};
use train::demo::{apply_sign_step, DctCodec};
use train::model::{param_digest, Llama};
use train::rng::randn;

fn layout() -> Layout {
    // A 2-D matrix of 64×64 blocks, an awkward one (29-row blocks), a 1-D vector, a 3-D tensor.
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

/// Random tensors from the project's own seeded generator (not libtorch's global one, which
/// tests running in parallel would share).
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

fn max_abs_diff(a: &[Tensor], b: &[Tensor]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

#[test]
fn keeping_every_coefficient_round_trips() {
    let l = layout();
    let codec = DctCodec::new(l.clone(), Device::Cpu);
    let orig = random(&l, 1);
    let mut delta: Vec<Tensor> = orig.iter().map(|t| t.copy()).collect();
    let u = codec.encode(&mut delta, 64 * 64, ValueCodec::F32);
    u.validate(&l, 64 * 64, ValueCodec::F32).unwrap();
    // Everything was transmitted, so nothing is left in the momentum…
    let zeros: Vec<Tensor> = orig.iter().map(|t| t.zeros_like()).collect();
    assert!(max_abs_diff(&delta, &zeros) < 1e-4);
    // …and decoding the one update gives the tensors back.
    let agg = sparse::aggregate(&l, &[&u]);
    let back = codec.decode_float(&agg);
    assert!(
        max_abs_diff(&back, &orig) < 1e-4,
        "{}",
        max_abs_diff(&back, &orig)
    );
}

#[test]
fn topk_keeps_the_largest_coefficients() {
    // One 8×8 block whose DCT we know: put energy on chosen coefficients through the inverse.
    let l = Layout::from_shapes(&[("x".into(), vec![8, 8])], 64);
    let codec = DctCodec::new(l.clone(), Device::Cpu);
    let f = Tensor::from_slice(&sparse::dct_basis(8))
        .view([8, 8])
        .to_kind(Kind::Float);
    let mut coef = vec![0.01f32; 64];
    coef[5] = 3.0;
    coef[17] = -5.0;
    coef[40] = 4.0;
    coef[63] = -0.5;
    let y = Tensor::from_slice(&coef).view([8, 8]);
    let x = f.matmul(&y).matmul(&f.tr());
    let mut delta = vec![x];
    let u = codec.encode(&mut delta, 3, ValueCodec::F32);
    let (idx, vals) = u.tensors[0].entries(ValueCodec::F32);
    assert_eq!(idx, vec![5, 17, 40]);
    assert!(
        (vals[0] - 3.0).abs() < 1e-4
            && (vals[1] + 5.0).abs() < 1e-4
            && (vals[2] - 4.0).abs() < 1e-4
    );
}

#[test]
fn decoupling_subtracts_exactly_what_is_sent() {
    let l = layout();
    let codec = DctCodec::new(l.clone(), Device::Cpu);
    let before = random(&l, 2);
    let mut delta: Vec<Tensor> = before.iter().map(|t| t.copy()).collect();
    let u = codec.encode(&mut delta, 4, ValueCodec::F32);
    let sent = codec.decode_float(&sparse::aggregate(&l, &[&u]));
    let removed: Vec<Tensor> = before.iter().zip(&delta).map(|(b, a)| b - a).collect();
    assert!(
        max_abs_diff(&removed, &sent) < 1e-5,
        "{}",
        max_abs_diff(&removed, &sent)
    );
    // Energy only goes down.
    let e0: f64 = before
        .iter()
        .map(|t| t.pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]))
        .sum();
    let e1: f64 = delta
        .iter()
        .map(|t| t.pow_tensor_scalar(2).sum(Kind::Double).double_value(&[]))
        .sum();
    assert!(e1 < e0);
}

fn updates(l: &Layout, n: usize, codec_kind: ValueCodec) -> Vec<SparseUpdate> {
    let codec = DctCodec::new(l.clone(), Device::Cpu);
    (0..n)
        .map(|i| {
            let mut d = random(l, 100 + i as u64);
            codec.encode(&mut d, 4, codec_kind)
        })
        .collect()
}

#[test]
fn exact_sign_matches_the_plain_rust_reference() {
    let l = layout();
    let ups = updates(&l, 5, ValueCodec::Bf16);
    let refs: Vec<&SparseUpdate> = ups.iter().collect();
    let agg = sparse::aggregate(&l, &refs);
    let signs = DctCodec::new(l.clone(), Device::Cpu).exact_sign(&agg);
    for (ti, t) in l.tensors.iter().enumerate() {
        let q = sparse::quantize_blocks(&agg.tensors[ti], t.h, t.w);
        let dq = protocol::sparse::TensorAggregate {
            mean: q,
            ..agg.tensors[ti].clone()
        }
        .dense(t.block_elems());
        let (fh, fw) = (
            sparse::dct_basis_quantized(t.h),
            sparse::dct_basis_quantized(t.w),
        );
        // Expected signs, block by block, arranged back into the tensor's 2-D view.
        let mut want = vec![0f32; t.numel()];
        let bw = t.cols / t.w;
        for b in 0..t.blocks() {
            let out = sparse::decode_block_exact(
                &dq[b * t.block_elems()..(b + 1) * t.block_elems()],
                &fh,
                &fw,
                t.h,
                t.w,
            );
            let (br, bc) = (b / bw, b % bw);
            for j in 0..t.h {
                for i in 0..t.w {
                    want[(br * t.h + j) * t.cols + bc * t.w + i] =
                        out[j * t.w + i].signum() as f32 * (out[j * t.w + i] != 0.0) as i32 as f32;
                }
            }
        }
        let mut got = vec![0f32; t.numel()];
        signs[ti].reshape([-1]).copy_data(&mut got, t.numel());
        assert_eq!(got, want, "tensor {ti}");
    }
}

#[test]
fn aggregation_is_bit_identical_across_orders_and_threads() {
    let cfg = ModelConfig::named("tiny", 64).unwrap();
    let l = Layout::for_model(&cfg, 64);
    for kind in [ValueCodec::Sign, ValueCodec::F32] {
        let model = Llama::new(&cfg, Device::Cpu, 7);
        let codec = DctCodec::new(l.clone(), Device::Cpu);
        let ups: Vec<SparseUpdate> = (0..6)
            .map(|i| {
                let mut d: Vec<Tensor> = model
                    .params
                    .iter()
                    .enumerate()
                    .map(|(j, p)| randn(&p.size(), 1000 * (i + 1) + j as u64))
                    .collect();
                codec.encode(&mut d, 4, kind)
            })
            .collect();
        let mut digests = Vec::new();
        for (perm, threads) in [
            (vec![0, 1, 2, 3, 4, 5], 1),
            (vec![5, 3, 1, 0, 2, 4], 2),
            (vec![2, 4, 0, 5, 1, 3], 1),
            (vec![1, 0, 3, 2, 5, 4], 2),
        ] {
            tch::set_num_threads(threads);
            let m = Llama::new(&cfg, Device::Cpu, 7);
            let refs: Vec<&SparseUpdate> = perm.iter().map(|&i| &ups[i]).collect();
            let agg = sparse::aggregate(&l, &refs);
            let signs = DctCodec::new(l.clone(), Device::Cpu).exact_sign(&agg);
            apply_sign_step(&m.params, &signs, 3e-3, 0.1);
            digests.push(param_digest(&m.params));
        }
        assert!(
            digests.windows(2).all(|w| w[0] == w[1]),
            "{kind:?}: digests differ"
        );
        assert_ne!(digests[0], model.digest(), "the step changed nothing");
    }
}

#[test]
fn sign_values_aggregate_to_votes() {
    let l = Layout::from_shapes(&[("a".into(), vec![64, 64])], 64);
    let ups = updates(&l, 3, ValueCodec::Sign);
    let refs: Vec<&SparseUpdate> = ups.iter().collect();
    let agg = sparse::aggregate(&l, &refs);
    // Each coefficient's mean is a signed count over its count of senders.
    for &m in &agg.tensors[0].mean {
        assert!(
            [-1.0, -1.0 / 3.0, 1.0 / 3.0, 1.0, 0.0, 0.5, -0.5]
                .iter()
                .any(|v| (v - m).abs() < 1e-12),
            "{m}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device: run with SWARM_GPU_TESTS=1 cargo test -- --ignored"]
fn exact_sign_is_identical_on_cuda() {
    if std::env::var("SWARM_GPU_TESTS").is_err() || !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA (set SWARM_GPU_TESTS=1 on a GPU machine)");
        return;
    }
    let l = layout();
    let ups = updates(&l, 7, ValueCodec::F32);
    let refs: Vec<&SparseUpdate> = ups.iter().collect();
    let agg = sparse::aggregate(&l, &refs);
    let cpu = DctCodec::new(l.clone(), Device::Cpu).exact_sign(&agg);
    let gpu = DctCodec::new(l.clone(), Device::Cuda(0)).exact_sign(&agg);
    for (a, b) in cpu.iter().zip(&gpu) {
        assert!(a.equal(&b.to_device(Device::Cpu)));
    }
}

#[test]
fn streaming_apply_matches_the_dense_sign_step_bit_for_bit() {
    // The decode streams block rows in slices; any slicing, straight into the parameters,
    // must give the bits of a dense sign followed by `apply_sign_step`.
    let l = layout();
    let ups = updates(&l, 5, ValueCodec::Bf16);
    let refs: Vec<&SparseUpdate> = ups.iter().collect();
    let agg = sparse::aggregate(&l, &refs);
    let dense = DctCodec::new(l.clone(), Device::Cpu);
    let want = random(&l, 9);
    apply_sign_step(&want, &dense.exact_sign(&agg), 3e-3, 0.1);
    // 1 byte: one block row per slice; 200 KB: a few rows; the default: whole tensors.
    for budget in [1, 200_000, train::demo::SLICE_BYTES] {
        let codec = DctCodec::new(l.clone(), Device::Cpu).with_slice_bytes(budget);
        let signs = codec.exact_sign(&agg);
        for (a, b) in signs.iter().zip(dense.exact_sign(&agg).iter()) {
            assert!(a.equal(b), "exact_sign, slice budget {budget}");
        }
        let got = random(&l, 9);
        codec.apply_exact_sign(&got, &agg, 3e-3, 0.1);
        assert_eq!(
            param_digest(&got),
            param_digest(&want),
            "apply, slice budget {budget}"
        );
    }
}
