//! `swarm eval`: held-out loss, perplexity and bits per byte of a model on a corpus.
//!
//! A token stream (text or shard) is read as consecutive, non-overlapping windows of the
//! model's sequence length, so every token of the range is scored once and two runs of the
//! same checkpoint on the same file agree exactly; by default the range is the stream's
//! held-out last tenth (what `swarm train` and `swarm run` never train on). The synthetic
//! corpus has no held-out file: fresh chain samples are scored, beside the corpus's exact floor.

use crate::data::{Corpus, EVAL_FRACTION};
use crate::model::Llama;
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// Which tokens of a stream to score.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// The last tenth of the stream, held out from training.
    Heldout,
    /// The whole stream (a file of its own that no node trained on).
    All,
}

#[derive(Clone, Debug)]
pub struct EvalOptions {
    pub split: Split,
    /// Stop after this many scored tokens (0 = no limit).
    pub max_tokens: u64,
    /// Sequences per forward pass.
    pub batch: usize,
    /// Seed of the synthetic corpus's samples.
    pub seed: u64,
    /// Mean UTF-8 bytes per token of the text, when the tokens are text (1 for bytes).
    pub bytes_per_token: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EvalReport {
    pub data: String,
    pub split: Split,
    pub tokens: u64,
    /// Mean next-token cross-entropy, nats per token.
    pub loss: f64,
    pub perplexity: f64,
    pub bits_per_token: f64,
    /// `bits_per_token / bytes_per_token`; absent for tokens that are not text.
    pub bits_per_byte: Option<f64>,
    pub bytes_per_token: Option<f64>,
    /// The lowest loss any model reaches on this corpus, when known (synthetic).
    pub loss_floor: Option<f64>,
}

/// Score `model` on `corpus` (see the module docs).
pub fn evaluate(model: &Llama, corpus: &Corpus, o: &EvalOptions) -> EvalReport {
    let seq = model.cfg.seq_len as usize;
    let batch = o.batch.max(1);
    let limit = if o.max_tokens == 0 {
        u64::MAX
    } else {
        o.max_tokens
    };
    let dev = model.device();
    // Summed nats and scored tokens.
    let (mut nats, mut tokens) = (0.0f64, 0u64);
    // (nats summed, tokens) of one batch of windows.
    let score = |rows: &[Vec<i64>]| -> (f64, u64) {
        let flat: Vec<i64> = rows.iter().flatten().copied().collect();
        let all = Tensor::from_slice(&flat).view([rows.len() as i64, seq as i64 + 1]);
        let x = all.narrow(1, 0, seq as i64).to_device(dev);
        let y = all.narrow(1, 1, seq as i64).to_device(dev);
        let n = (rows.len() * seq) as u64;
        let l = tch::no_grad(|| model.loss(&x, &y).to_kind(Kind::Double).double_value(&[]));
        (l * n as f64, n)
    };
    match corpus {
        Corpus::Stream { tokens: t, .. } => {
            let n = t.len();
            let lo = match o.split {
                Split::Heldout => ((n as f64) * (1.0 - EVAL_FRACTION)) as usize,
                Split::All => 0,
            };
            let mut rows = Vec::with_capacity(batch);
            let mut start = lo;
            while start + seq < n && (tokens + ((rows.len() + 1) * seq) as u64) <= limit {
                rows.push((start..=start + seq).map(|i| t.get(i) as i64).collect());
                start += seq;
                if rows.len() == batch {
                    let (l, k) = score(&rows);
                    (nats, tokens) = (nats + l, tokens + k);
                    rows.clear();
                }
            }
            if !rows.is_empty() {
                let (l, k) = score(&rows);
                (nats, tokens) = (nats + l, tokens + k);
            }
        }
        Corpus::Synthetic(_) => {
            let per = (batch * seq) as u64;
            let batches = if limit == u64::MAX {
                64
            } else {
                limit.div_ceil(per).max(1)
            };
            for i in 0..batches {
                let rows: Vec<Vec<i64>> = corpus
                    .sequences("eval", o.seed, b"swarm eval", i, batch, seq)
                    .into_iter()
                    .map(|s| s.into_iter().map(|t| t as i64).collect())
                    .collect();
                let (l, k) = score(&rows);
                (nats, tokens) = (nats + l, tokens + k);
            }
        }
    }
    let loss = if tokens > 0 {
        nats / tokens as f64
    } else {
        f64::NAN
    };
    let bpt = loss / std::f64::consts::LN_2;
    EvalReport {
        data: corpus.describe(),
        split: o.split,
        tokens,
        loss,
        perplexity: loss.exp(),
        bits_per_token: bpt,
        bits_per_byte: o.bytes_per_token.map(|b| bpt / b),
        bytes_per_token: o.bytes_per_token,
        loss_floor: corpus.loss_floor(seq),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{Corpus, DataSpec};
    use protocol::config::ModelConfig;

    #[test]
    fn a_stream_is_scored_once_per_token_and_bits_per_byte_follow() {
        let dir = std::env::temp_dir().join(format!("swarm-eval-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.txt");
        std::fs::write(
            &path,
            "the quick brown fox jumps over the lazy dog. ".repeat(200),
        )
        .unwrap();
        let corpus = Corpus::open(&DataSpec::Text {
            path: path.display().to_string(),
            tokenizer: None,
        })
        .unwrap();
        let cfg = ModelConfig::named("tiny", 256).unwrap();
        let m = Llama::new(&cfg, tch::Device::Cpu, 0);
        let o = EvalOptions {
            split: Split::All,
            max_tokens: 0,
            batch: 3,
            seed: 0,
            bytes_per_token: Some(1.0),
        };
        let r = evaluate(&m, &corpus, &o);
        let n = 45 * 200;
        // Whole windows of 64 targets (each needs 65 tokens) fit (n - 1) / 64 times.
        assert_eq!(r.tokens, ((n - 1) / 64 * 64) as u64);
        // An untrained model is near uniform over 256 bytes: ~8 bits per byte.
        assert!((r.bits_per_byte.unwrap() - 8.0).abs() < 0.5, "{r:?}");
        assert!((r.perplexity - r.loss.exp()).abs() < 1e-9);
        // Batching does not change the figure; the held-out tenth is a tenth.
        let r1 = evaluate(
            &m,
            &corpus,
            &EvalOptions {
                batch: 1,
                ..o.clone()
            },
        );
        assert!((r1.loss - r.loss).abs() < 1e-5);
        let h = evaluate(
            &m,
            &corpus,
            &EvalOptions {
                split: Split::Heldout,
                ..o.clone()
            },
        );
        assert!(h.tokens < r.tokens / 9 && h.tokens > 0);
        let capped = evaluate(
            &m,
            &corpus,
            &EvalOptions {
                max_tokens: 200,
                ..o
            },
        );
        assert_eq!(capped.tokens, 192);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
