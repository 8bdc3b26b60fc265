//! Wire-path costs for a `1.2b`-shaped update (k = 4 of 64×64, 1-bit values):
//! `cargo run --release -p protocol --example bench_wire`.
//!
//! Prints: blob size; sender cost (blob id + header signature); receiver cost (header
//! signature + length + blob id + CBOR pre-check + decode + canonical check + validation
//! against the layout), as GB/s of blob on one core; and header sizes.

// A measurement run by hand: a failure stops it with its line, which is what its user wants.
#![allow(clippy::unwrap_used)]

use std::time::Instant;

use crypto::{ContentId, Digest, Identity};
use protocol::config::{ModelConfig, OptimConfig};
use protocol::run::{DataSpec, RunConfig, StepTiming};
use protocol::sparse::{SparseUpdate, TensorUpdate};
use protocol::wire::{Message, Signed, UpdateHeader, UpdateRules};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let model = ModelConfig::named("1.2b", 0).unwrap();
    let optim = OptimConfig::default();
    let timing = StepTiming {
        genesis_ms: 0,
        period_ms: 30_000,
        grace_ms: 2_000,
        summary_ms: 8_000,
    };
    let run = RunConfig::new(
        "bench",
        model,
        optim,
        DataSpec::Synthetic {
            seed: 0,
            vocab: 32000,
        },
        timing,
    );
    run.validate().unwrap();
    let layout = run.layout();
    let k = run.optim.topk;

    // A random valid update: k distinct ascending indices per block, random signs.
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let tensors: Vec<TensorUpdate> = layout
        .tensors
        .iter()
        .map(|t| {
            let ke = t.k_eff(k);
            let elems = t.block_elems() as u64;
            let mut idx = Vec::with_capacity(t.blocks() * ke);
            let mut vals = Vec::with_capacity(t.blocks() * ke);
            for _ in 0..t.blocks() {
                let mut picked: Vec<u32> = Vec::with_capacity(ke);
                while picked.len() < ke {
                    let i = (rnd() % elems) as u32;
                    if !picked.contains(&i) {
                        picked.push(i);
                    }
                }
                for i in picked {
                    idx.push(i);
                    vals.push(if rnd() & 1 == 0 { 1.0 } else { -1.0 });
                }
            }
            TensorUpdate::from_entries(t, ke, run.optim.values, &idx, &vals)
        })
        .collect();
    let update = SparseUpdate {
        codec: run.optim.values,
        tensors,
    };
    let blob = update.encode();
    let id = Identity::from_seed([1; 32]);
    let rules = UpdateRules::new(&run);
    println!(
        "model 1.2b: {} tensors, {} blocks, k = {k}, codec {:?}",
        layout.tensors.len(),
        layout.blocks(),
        run.optim.values
    );
    println!(
        "blob: {} bytes ({:.3} MB)",
        blob.len(),
        blob.len() as f64 / 1e6
    );

    let iters = 15;
    // Sender: content id of the blob + sign the header.
    let mut sign_t = Vec::new();
    let mut header = None;
    for _ in 0..iters {
        let t0 = Instant::now();
        let h = UpdateHeader {
            run: run.run_id(),
            step: 12345,
            sender: id.node_id(),
            blob: ContentId::of(&blob),
            blob_len: blob.len() as u64,
            codec: run.optim.values,
            topk: run.optim.topk,
            chunk: run.optim.chunk,
            tokens: 4 * 2048,
            base_version: 12344,
            base_digest: Digest([7; 32]),
            pow: 0,
        };
        let s = Signed::sign(h, &id);
        sign_t.push(t0.elapsed().as_secs_f64());
        header = Some(s);
    }
    let header = header.unwrap();

    // Receiver: decode the fetch-response frame, verify, check the blob fully.
    let frame = Message::Update {
        header: header.clone(),
        blob: blob.clone(),
    }
    .encode();
    let mut verify_t = Vec::new();
    let mut frame_t = Vec::new();
    let mut sig_t = Vec::new();
    for _ in 0..iters {
        let t0 = Instant::now();
        header.verify().unwrap();
        let t1 = Instant::now();
        rules.check_header(&header.body).unwrap();
        let u = rules.check_blob(&header.body, &blob).unwrap();
        verify_t.push(t0.elapsed().as_secs_f64());
        sig_t.push((t1 - t0).as_secs_f64());
        std::hint::black_box(u);

        let t0 = Instant::now();
        let m = Message::decode(&frame, &run.limits).unwrap();
        let Message::Update { header: h, blob: b } = m else {
            unreachable!()
        };
        h.verify().unwrap();
        rules.check_blob(&h.body, &b).unwrap();
        frame_t.push(t0.elapsed().as_secs_f64());
    }
    let (s, v, f, sg) = (
        median(sign_t),
        median(verify_t),
        median(frame_t),
        median(sig_t),
    );
    let gbps = |t: f64| blob.len() as f64 / t / 1e9;
    println!(
        "sign (blob id + header signature): {:.3} ms ({:.2} GB/s of blob)",
        s * 1e3,
        gbps(s)
    );
    println!("header signature verify alone: {:.1} µs", sg * 1e6);
    println!(
        "verify + decode + validate (blob in hand): {:.3} ms = {:.2} GB/s of blob (target >= 1)",
        v * 1e3,
        gbps(v)
    );
    println!(
        "same from the wire frame (frame decode + copy + all checks): {:.3} ms = {:.2} GB/s",
        f * 1e3,
        gbps(f)
    );
    // Where the receive time goes (to aim optimization at the right stage).
    let stage = |name: &str, f: &dyn Fn()| {
        let mut t = Vec::new();
        for _ in 0..iters {
            let t0 = Instant::now();
            f();
            t.push(t0.elapsed().as_secs_f64());
        }
        println!("  stage {name}: {:.3} ms", median(t) * 1e3);
    };
    stage("blake3 content id", &|| {
        std::hint::black_box(ContentId::of(&blob));
    });
    stage("cbor pre-check", &|| {
        protocol::cbor::precheck(&blob).unwrap()
    });
    stage("SparseUpdate::decode (incl. canonical re-encode)", &|| {
        std::hint::black_box(SparseUpdate::decode(&blob, blob.len()).unwrap());
    });
    stage("SparseUpdate::validate", &|| {
        update.validate(&layout, k, run.optim.values).unwrap()
    });
    let announce = Message::Announce {
        header: header.clone(),
        blob: None,
    }
    .encode();
    println!(
        "header: signed body {} bytes; announce frame (header + signature, no blob) {} bytes (target <= 512)",
        header.raw.body.len(),
        announce.len()
    );
}
