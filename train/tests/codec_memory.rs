//! The codec's memory is bounded by construction (issue 16): encoding a model holds a small
//! multiple of its largest tensor, and aggregate + exact decode + apply a few decode slices,
//! however large the model. One test in its own binary, so no other test's allocations share
//! the process whose peak resident memory it reads.

use protocol::config::ValueCodec;
use protocol::sparse::{self, Layout, SparseUpdate};
use tch::{Device, Tensor};
use train::demo::DctCodec;

/// Resident and peak resident bytes of this process (`VmRSS`, `VmHWM`).
fn rss() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .expect("a kB figure")
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Start a new peak: Linux resets `VmHWM` to the current RSS on "5" (kernel ≥ 4.0). Where
/// that is refused, the peak so far is the momentum's allocation, which only lowers the
/// measured growth's baseline below the truth, never hides growth.
/// Heap pages freed earlier are first handed back to the system (glibc's `malloc_trim`), so
/// memory a step reuses from earlier frees shows as growth too.
fn reset_peak() {
    extern "C" {
        fn malloc_trim(pad: usize) -> i32;
    }
    // Safety: glibc's malloc_trim takes no pointers and only releases free heap memory.
    unsafe {
        malloc_trim(0);
    }
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

#[test]
fn encode_and_apply_hold_a_bounded_multiple_of_a_tensor_not_of_the_model() {
    const MB: u64 = 1 << 20;
    tch::set_num_threads(1);
    // 48 tensors of 512 × 2048 (4 MB of f32 each): a 192 MB model whose largest tensor is
    // 4 MB. The old group-wide encoder held ~6× the model here (over 1 GB).
    let shapes: Vec<(String, Vec<u32>)> = (0..48)
        .map(|i| (format!("w{i:02}"), vec![512, 2048]))
        .collect();
    let layout = Layout::from_shapes(&shapes, 64);
    let largest = 512 * 2048 * 4;
    let model = layout.numel() as u64 * 4;
    let slice = 4 << 20;
    let codec = DctCodec::new(layout.clone(), Device::Cpu).with_slice_bytes(slice);

    let momentum = |seed: u64| -> Vec<Tensor> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, (_, s))| {
                train::rng::randn(&[s[0] as i64, s[1] as i64], seed * 100 + i as u64)
            })
            .collect()
    };

    // Encode: the momentum (the model's size) exists before; growth is the encoder's own.
    let mut updates: Vec<SparseUpdate> = Vec::new();
    let mut encode_growth = 0;
    for seed in 0..3 {
        let mut m = momentum(seed);
        reset_peak();
        let (before, _) = rss();
        updates.push(codec.encode(&mut m, 4, ValueCodec::Sign));
        let (_, peak) = rss();
        encode_growth = encode_growth.max(peak.saturating_sub(before));
    }
    // Its own temporaries are ~4 tensors at once (blocks, transform, magnitudes, decoded
    // part); the allocator's reuse of freed blocks at new addresses roughly doubles what is
    // resident. Still a third of the model, which it no longer scales with.
    assert!(
        encode_growth <= 12 * largest + 16 * MB,
        "encode grew resident memory by {} MB for a {} MB model whose largest tensor is {} MB",
        encode_growth / MB,
        model / MB,
        largest / MB
    );

    // Aggregate + exact decode + sign step, straight into the parameters.
    let params = momentum(9);
    let refs: Vec<&SparseUpdate> = updates.iter().collect();
    reset_peak();
    let (before, _) = rss();
    let agg = sparse::aggregate(&layout, &refs);
    codec.apply_exact_sign(&params, &agg, 1e-3, 0.1);
    let (_, peak) = rss();
    let apply_growth = peak.saturating_sub(before);
    // The aggregate itself (index, mean, offsets: ~13 bytes per kept entry) plus a few
    // slices' temporaries.
    let entries: u64 = agg.tensors.iter().map(|t| t.index.len() as u64).sum();
    assert!(
        apply_growth <= 13 * entries + 4 * slice as u64 + 16 * MB,
        "apply grew resident memory by {} MB ({} MB model, {} MB slices, {entries} entries)",
        apply_growth / MB,
        model / MB,
        slice / MB as usize
    );
    eprintln!(
        "model {} MB: encode +{} MB, apply of 3 updates +{} MB",
        model / MB,
        encode_growth / MB,
        apply_growth / MB
    );
}
