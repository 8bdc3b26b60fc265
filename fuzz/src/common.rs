// A small fixed run shared by the targets (the same shape as protocol's tests use).
use protocol::config::{ModelConfig, OptimConfig, ValueCodec};
use protocol::run::{DataSpec, RunConfig, StepTiming};

pub fn run() -> RunConfig {
    let model = ModelConfig {
        name: "fuzz".into(),
        vocab: 64,
        dim: 16,
        layers: 1,
        heads: 2,
        kv_heads: 2,
        ffn: 32,
        seq_len: 8,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
    };
    let optim = OptimConfig {
        chunk: 8,
        topk: 2,
        values: ValueCodec::Sign,
        ..OptimConfig::default()
    };
    let timing = StepTiming {
        genesis_ms: 1_000_000,
        period_ms: 1000,
        grace_ms: 100,
        summary_ms: 400,
    };
    RunConfig::new(
        "fuzz",
        model,
        optim,
        DataSpec::Synthetic { seed: 7, vocab: 64 },
        timing,
    )
}
