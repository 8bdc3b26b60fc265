//! Plain-data descriptions of a model and of the optimizer, shared by the trainer, the run
//! config and validators. They carry no tensors, so a node can check an update's shapes
//! against a model it never allocated.

use serde::{Deserialize, Serialize};

/// How the values of the kept DCT coefficients travel on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Hash, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum ValueCodec {
    /// One bit per coefficient: its sign (the DeMo/Psyche default).
    Sign,
    /// bfloat16, little-endian.
    Bf16,
    /// IEEE f32, little-endian.
    F32,
    /// 2 bits per value on a per-tensor scale: an f32 step `s` (little-endian, finite, ≥ 0)
    /// and then codes `c ∈ 0..4` meaning `(c − 1.5)·s` (a uniform mid-rise quantizer with no
    /// zero level: every kept coefficient moves). For local steps' pseudo-gradients, whose
    /// quantization error goes back into the sender's error feedback.
    Q2,
    /// 4 bits per value on a per-tensor scale: codes `c ∈ 0..16` meaning `(c − 7.5)·s`.
    Q4,
}

impl ValueCodec {
    /// Bits one value occupies on the wire.
    pub fn bits(self) -> u32 {
        match self {
            ValueCodec::Sign => 1,
            ValueCodec::Bf16 => 16,
            ValueCodec::F32 => 32,
            ValueCodec::Q2 => 2,
            ValueCodec::Q4 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ValueCodec::Sign => "sign",
            ValueCodec::Bf16 => "bf16",
            ValueCodec::F32 => "f32",
            ValueCodec::Q2 => "q2",
            ValueCodec::Q4 => "q4",
        }
    }

    /// Codecs with a per-tensor scale: their values cannot be summed as small integers.
    pub fn is_quantized(self) -> bool {
        matches!(self, ValueCodec::Q2 | ValueCodec::Q4)
    }
}

impl std::str::FromStr for ValueCodec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sign" => Ok(ValueCodec::Sign),
            "bf16" => Ok(ValueCodec::Bf16),
            "f32" => Ok(ValueCodec::F32),
            "q2" => Ok(ValueCodec::Q2),
            "q4" => Ok(ValueCodec::Q4),
            other => Err(format!(
                "unknown value codec {other:?} (expected sign, q2, q4, bf16 or f32)"
            )),
        }
    }
}

/// A Llama-2 style decoder: RMSNorm, RoPE, (grouped-query) attention, SwiGLU MLP, untied head,
/// no biases.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub name: String,
    pub vocab: u32,
    pub dim: u32,
    pub layers: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub ffn: u32,
    pub seq_len: u32,
    pub rope_theta: f64,
    pub norm_eps: f64,
}

/// Round a vocabulary up to a multiple of 64 so that the embedding and head chunk into full
/// 64-row blocks (an awkward size like 50257 would chunk into 29-row blocks).
pub fn pad_vocab(v: u32) -> u32 {
    v.div_ceil(64) * 64
}

impl ModelConfig {
    /// Named configurations. `vocab` is the data's vocabulary for `tiny` and `small` (padded to
    /// a multiple of 64); `1.2b` always uses the DisTrO report's 32000.
    pub fn named(name: &str, data_vocab: u32) -> Option<ModelConfig> {
        let v = pad_vocab(data_vocab.max(1));
        let c = |name: &str, vocab, dim, layers, heads, kv_heads, ffn, seq_len| ModelConfig {
            name: name.to_string(),
            vocab,
            dim,
            layers,
            heads,
            kv_heads,
            ffn,
            seq_len,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
        };
        match name {
            // ~0.85M parameters with a byte vocabulary: trains on a 2-core CPU in minutes.
            "tiny" => Some(c("tiny", v, 128, 4, 4, 4, 384, 64)),
            // ~27M parameters with a byte vocabulary (20-50M with most tokenizers below 20k).
            "small" => Some(c("small", v, 512, 8, 8, 8, 1536, 256)),
            // The DisTrO report's 1.2B Llama-2.
            "1.2b" => Some(c("1.2b", 32000, 2048, 16, 8, 8, 8192, 2048)),
            _ => None,
        }
    }

    pub fn head_dim(&self) -> u32 {
        self.dim / self.heads
    }

    /// Every trainable tensor, in the canonical order used on the wire and in checkpoints.
    pub fn tensor_shapes(&self) -> Vec<(String, Vec<u32>)> {
        let d = self.dim;
        let kv = self.kv_heads * self.head_dim();
        let mut t = vec![("tok_embeddings.weight".to_string(), vec![self.vocab, d])];
        for l in 0..self.layers {
            let p = format!("layers.{l}.");
            t.push((format!("{p}attention_norm.weight"), vec![d]));
            t.push((format!("{p}attention.wq.weight"), vec![d, d]));
            t.push((format!("{p}attention.wk.weight"), vec![kv, d]));
            t.push((format!("{p}attention.wv.weight"), vec![kv, d]));
            t.push((format!("{p}attention.wo.weight"), vec![d, d]));
            t.push((format!("{p}ffn_norm.weight"), vec![d]));
            t.push((format!("{p}feed_forward.w1.weight"), vec![self.ffn, d]));
            t.push((format!("{p}feed_forward.w3.weight"), vec![self.ffn, d]));
            t.push((format!("{p}feed_forward.w2.weight"), vec![d, self.ffn]));
        }
        t.push(("norm.weight".to_string(), vec![d]));
        t.push(("output.weight".to_string(), vec![self.vocab, d]));
        t
    }

    pub fn param_count(&self) -> u64 {
        self.tensor_shapes()
            .iter()
            .map(|(_, s)| s.iter().map(|&x| x as u64).product::<u64>())
            .sum()
    }
}

/// How a round's updates are combined per DCT coefficient before the inverse DCT and the sign.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Combine {
    /// The DeMo reference: per coefficient, the mean over the updates that kept it. A
    /// coefficient only one sender kept gets that sender's full value, whatever the others did.
    #[default]
    Mean,
    /// Bounded influence: per coefficient `Σ wᵢ·vᵢ / Σ wᵢ` over **every** included update
    /// (weights from the tokens each header states, capped at the run's nominal batch), with
    /// float values first clipped to the round's median norm. One update of N moves any
    /// coefficient by at most its weight share; see `sparse::exact::aggregate_round`.
    Share,
    /// Between the two: per coefficient `Σ vᵢ / √(n·N)` over the `n` updates that kept it, of
    /// `N` included. A coefficient every update kept gets the mean; one a single sender kept
    /// gets `1/√N` of its value, where `mean` gives all of it and `share` `1/N`. With local
    /// steps the per-coefficient mean applies each lone sender's whole (noisy) progress, so the
    /// noise it adds grows with the swarm; this damps lone coefficients by `√N` instead. The
    /// sum runs in the canonical order and `√` and `/` are correctly rounded, so the result is
    /// the same on every device. Tokens are ignored, as with `mean`.
    Root,
}

impl Combine {
    pub fn is_mean(&self) -> bool {
        *self == Combine::Mean
    }
}

/// Delay compensation for the swarm's overlapped schedule, where a node trains step t on
/// parameters that still lack step t−1 (its updates are in flight). Before forward and
/// backward the node moves its weights to where the pending step will probably land,
/// `p − lr(t−1)·ŝ`, and puts them back bit for bit afterwards. It is local: nothing sent or
/// applied changes, so digests agree whatever each node chooses; the run config names it so
/// that every node of a run trains alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Lookahead {
    /// Train on the stale parameters as they are.
    #[default]
    Off,
    /// ŝ = sign of the node's full momentum before its last encode (Psyche's "error
    /// correction").
    Momentum,
    /// ŝ = the exact sign step of the node's own last update alone: the step the swarm takes
    /// if the others agree with it.
    Update,
}

impl Lookahead {
    pub fn is_off(&self) -> bool {
        *self == Lookahead::Off
    }
}

impl std::str::FromStr for Lookahead {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Lookahead::Off),
            "momentum" => Ok(Lookahead::Momentum),
            "update" => Ok(Lookahead::Update),
            other => Err(format!(
                "unknown lookahead {other:?} (expected off, momentum or update)"
            )),
        }
    }
}

/// Local steps (SparseLoCo / DiLoCo style): one protocol step is a *window* of
/// `inner_steps` AdamW steps that each node takes on its own recomputable batches, from its
/// own parameters (its inner optimizer state stays local and is never sent). At the end of a
/// window a node adds its pseudo-gradient (window-start parameters − parameters now) into an
/// error-feedback buffer decayed by `ef_decay`, sends the top-k per chunk of that buffer
/// (after a chunked DCT when `dct`, else of the raw chunk) with the run's value codec, and
/// subtracts what it sent, as the receivers will decode it, from the buffer. Every node then
/// applies the same outer step to the shared parameters: the run's combine rule over the
/// window's included updates, decoded exactly, times `outer_lr`.
///
/// In the enclosing [`OptimConfig`], `lr`, `weight_decay` and `grad_clip` are the inner
/// AdamW's, `warmup_steps` and `total_steps` count windows (the inner rate follows the same
/// warm-up and cosine over inner steps), and `beta` and `lookahead` are unused: a node always
/// starts its next window from its own end-of-window parameters while the window's updates
/// travel (see `train::node`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LocalSteps {
    /// Inner steps per window (H).
    pub inner_steps: u32,
    /// Outer step size on the combined pseudo-gradient (1 = plain averaging).
    pub outer_lr: f64,
    /// Error-feedback decay: `buf = ef_decay·buf + pseudo-gradient`.
    pub ef_decay: f64,
    /// Select the top-k of each chunk's DCT coefficients (true) or of its raw values.
    pub dct: bool,
    /// Inner AdamW moments.
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    /// Outer Nesterov momentum μ, kept by each sender on its own pseudo-gradients (0 = off):
    /// `m = μ·m + Δ`, and `Δ + μ·m` goes into the error feedback. The outer step is linear in
    /// what is sent, so the swarm's average of these is Nesterov momentum on the average
    /// pseudo-gradient (DiLoCo's outer optimizer) without any shared state: a node that leaves
    /// takes its momentum with it, and the digest still names the parameters alone.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub outer_momentum: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl Default for LocalSteps {
    fn default() -> Self {
        LocalSteps {
            // The best of the screen in docs/BENCHMARKS.md ("Local steps") for `tiny` with 16
            // nodes: short windows beat long ones at equal bytes per token.
            inner_steps: 2,
            outer_lr: 0.7,
            ef_decay: 0.95,
            dct: false,
            adam_beta1: 0.9,
            adam_beta2: 0.95,
            outer_momentum: 0.0,
        }
    }
}

/// DeMo hyperparameters (defaults as in the reference code, k as in Psyche).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimConfig {
    /// Target chunk length s per dimension.
    pub chunk: u32,
    /// Coefficients kept per chunk.
    pub topk: u32,
    pub values: ValueCodec,
    /// Momentum decay β in `delta = β·delta + lr·grad`.
    pub beta: f64,
    /// Peak learning rate (the size of the sign step).
    pub lr: f64,
    /// Decoupled weight decay: `p *= 1 − lr·wd`.
    pub weight_decay: f64,
    pub warmup_steps: u32,
    /// Steps of the cosine schedule; the rate ends at `lr·min_lr_ratio`.
    pub total_steps: u32,
    pub min_lr_ratio: f64,
    /// Clip each node's gradient to this global L2 norm (0 = off).
    pub grad_clip: f64,
    /// How updates are combined (absent = `mean`, so older run configs keep their run id).
    #[serde(default, skip_serializing_if = "Combine::is_mean")]
    pub combine: Combine,
    /// Delay compensation while a step is in flight (absent = `off`, so older run configs
    /// keep their run id).
    #[serde(default, skip_serializing_if = "Lookahead::is_off")]
    pub lookahead: Lookahead,
    /// Local steps in place of DeMo's per-step sign update (absent = DeMo, so older run
    /// configs keep their run id).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalSteps>,
}

impl OptimConfig {
    /// Inner steps per protocol step: H for local steps, 1 for DeMo.
    pub fn inner_steps(&self) -> u32 {
        self.local.as_ref().map_or(1, |l| l.inner_steps.max(1))
    }
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            chunk: 64,
            topk: 4,
            values: ValueCodec::Sign,
            beta: 0.999,
            lr: 4e-4,
            weight_decay: 0.0,
            warmup_steps: 250,
            total_steps: 25_000,
            min_lr_ratio: 0.1,
            grad_clip: 1.0,
            combine: Combine::Mean,
            lookahead: Lookahead::Off,
            local: None,
        }
    }
}

/// Linear warm-up, then cosine decay to `peak·min_ratio` at `total`; flat after.
pub fn lr_at(step: u32, peak: f64, warmup: u32, total: u32, min_ratio: f64) -> f64 {
    if warmup > 0 && step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1) as f64;
    let t = ((step.saturating_sub(warmup)) as f64 / span).min(1.0);
    let min = peak * min_ratio;
    min + 0.5 * (peak - min) * (1.0 + (std::f64::consts::PI * t).cos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_sizes() {
        let tiny = ModelConfig::named("tiny", 256).unwrap();
        assert!(tiny.param_count() < 2_000_000);
        let small = ModelConfig::named("small", 256).unwrap();
        let n = small.param_count();
        assert!((20_000_000..=50_000_000).contains(&n), "{n}");
        let big = ModelConfig::named("1.2b", 0).unwrap();
        let n = big.param_count();
        assert!((1_100_000_000..1_400_000_000).contains(&n), "{n}");
        assert_eq!(pad_vocab(50257), 50304);
    }

    #[test]
    fn schedule_shape() {
        assert!((lr_at(0, 1.0, 10, 100, 0.1) - 0.1).abs() < 1e-12);
        assert!((lr_at(9, 1.0, 10, 100, 0.1) - 1.0).abs() < 1e-12);
        assert!((lr_at(100, 1.0, 10, 100, 0.1) - 0.1).abs() < 1e-12);
        assert!(lr_at(50, 1.0, 10, 100, 0.1) < 1.0);
    }
}
