//! Training data. The batch a node trains on at step t is a pure function of
//! (run seed, node identity, step), so anyone can recompute any node's batch.

use crate::rng::Rng;
use crate::{DataError, TrainError};
use tch::{Device, Kind, Tensor};

/// A seeded random Markov chain of order 2 over a small vocabulary: every context (a, b) has
/// `branch` possible next tokens with random weights. Its entropy rate is computed exactly
/// from the stationary distribution, so every run knows its loss floor.
#[derive(Clone, Debug)]
pub struct MarkovChain {
    pub vocab: usize,
    pub branch: usize,
    /// Per context `a·V + b`: the next tokens and their cumulative probabilities.
    next: Vec<Vec<(u32, f64)>>,
    /// Stationary distribution over contexts, as a CDF for sampling start states.
    cdf: Vec<f64>,
    /// Entropy rate H(X_t | X_{t-2}, X_{t-1}) in nats.
    pub entropy_rate: f64,
    /// H(X_1 | X_0) under the stationary distribution, in nats.
    pub first_order_entropy: f64,
}

impl MarkovChain {
    pub fn new(seed: u64, vocab: usize, branch: usize) -> MarkovChain {
        let v = vocab;
        let mut rng = Rng::derive(
            "swarm synthetic corpus v1",
            &[
                &seed.to_le_bytes(),
                &(v as u64).to_le_bytes(),
                &(branch as u64).to_le_bytes(),
            ],
        );
        let mut probs: Vec<Vec<(u32, f64)>> = Vec::with_capacity(v * v);
        for _ in 0..v * v {
            let mut toks: Vec<u32> = Vec::with_capacity(branch);
            while toks.len() < branch.min(v) {
                let t = rng.below(v as u64) as u32;
                if !toks.contains(&t) {
                    toks.push(t);
                }
            }
            toks.sort();
            // Weights ~ Exp(1) (a Dirichlet(1) draw once normalized).
            let w: Vec<f64> = toks
                .iter()
                .map(|_| -(1.0 - rng.next_f64()).ln() + 1e-3)
                .collect();
            let sum: f64 = w.iter().sum();
            probs.push(
                toks.into_iter()
                    .zip(w.into_iter().map(|x| x / sum))
                    .collect(),
            );
        }
        // Stationary distribution over contexts by power iteration on the lazy chain
        // (½I + ½P has the same stationary law and always converges).
        let mut pi = vec![1.0 / (v * v) as f64; v * v];
        for _ in 0..200_000 {
            let mut nxt: Vec<f64> = pi.iter().map(|p| 0.5 * p).collect();
            for (ctx, row) in probs.iter().enumerate() {
                let b = ctx % v;
                for &(c, p) in row {
                    nxt[b * v + c as usize] += 0.5 * pi[ctx] * p;
                }
            }
            let diff: f64 = nxt.iter().zip(&pi).map(|(a, b)| (a - b).abs()).sum();
            pi = nxt;
            if diff < 1e-15 {
                break;
            }
        }
        let s: f64 = pi.iter().sum();
        pi.iter_mut().for_each(|p| *p /= s);
        let h_row = |row: &[(u32, f64)]| -> f64 {
            row.iter()
                .map(|&(_, p)| if p > 0.0 { -p * p.ln() } else { 0.0 })
                .sum()
        };
        let entropy_rate: f64 = probs.iter().zip(&pi).map(|(r, p)| p * h_row(r)).sum();
        // H(X1|X0) = H(X0,X1) − H(X0) under the stationary pair law.
        let h_joint: f64 = pi.iter().filter(|&&p| p > 0.0).map(|&p| -p * p.ln()).sum();
        let mut marg = vec![0.0; v];
        for (ctx, p) in pi.iter().enumerate() {
            marg[ctx / v] += p;
        }
        let h_marg: f64 = marg
            .iter()
            .filter(|&&p| p > 0.0)
            .map(|&p| -p * p.ln())
            .sum();
        let mut cdf = Vec::with_capacity(v * v);
        let mut acc = 0.0;
        for p in &pi {
            acc += p;
            cdf.push(acc);
        }
        let next = probs
            .into_iter()
            .map(|row| {
                let mut acc = 0.0;
                row.into_iter()
                    .map(|(t, p)| {
                        acc += p;
                        (t, acc)
                    })
                    .collect()
            })
            .collect();
        MarkovChain {
            vocab: v,
            branch,
            next,
            cdf,
            entropy_rate,
            first_order_entropy: h_joint - h_marg,
        }
    }

    /// The best achievable mean loss on a sequence predicting `len` targets from its prefix:
    /// the first target has only one token of context, the rest have two.
    pub fn loss_floor(&self, len: usize) -> f64 {
        (self.first_order_entropy + (len as f64 - 1.0) * self.entropy_rate) / len as f64
    }

    /// `len` tokens, starting from a stationary context.
    pub fn sample(&self, rng: &mut Rng, len: usize) -> Vec<u32> {
        let u = rng.next_f64();
        let ctx = self
            .cdf
            .partition_point(|&c| c <= u)
            .min(self.cdf.len() - 1);
        let (mut a, mut b) = ((ctx / self.vocab) as u32, (ctx % self.vocab) as u32);
        let mut out = Vec::with_capacity(len);
        out.push(a);
        out.push(b);
        while out.len() < len {
            let row = &self.next[a as usize * self.vocab + b as usize];
            let u = rng.next_f64();
            let c = row
                .iter()
                .find(|&&(_, c)| u < c)
                .unwrap_or(
                    row.last()
                        .expect("a row of the transition table is never empty"),
                )
                .0;
            out.push(c);
            a = b;
            b = c;
        }
        out.truncate(len);
        out
    }
}

/// Token storage: owned, or a memory-mapped flat shard of little-endian u16 / u32 tokens.
pub enum Tokens {
    Owned(Vec<u32>),
    U16(memmap2::Mmap),
    U32(memmap2::Mmap),
}

impl Tokens {
    pub fn len(&self) -> usize {
        match self {
            Tokens::Owned(v) => v.len(),
            Tokens::U16(m) => m.len() / 2,
            Tokens::U32(m) => m.len() / 4,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn get(&self, i: usize) -> u32 {
        match self {
            Tokens::Owned(v) => v[i],
            Tokens::U16(m) => u16::from_le_bytes([m[2 * i], m[2 * i + 1]]) as u32,
            Tokens::U32(m) => {
                u32::from_le_bytes([m[4 * i], m[4 * i + 1], m[4 * i + 2], m[4 * i + 3]])
            }
        }
    }
}

/// Where a run's tokens come from.
pub enum Corpus {
    Synthetic(MarkovChain),
    /// A token stream; the last tenth is held out for evaluation.
    Stream {
        tokens: Tokens,
        vocab: usize,
        describe: String,
    },
}

/// How to read `--data`.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSpec {
    Synthetic {
        seed: u64,
        vocab: usize,
        branch: usize,
    },
    /// UTF-8 text, byte-level tokens (vocab 256), or through a HF `tokenizer.json`.
    Text {
        path: String,
        tokenizer: Option<String>,
    },
    /// A flat shard of little-endian tokens of `width` bits (16 or 32), memory-mapped.
    Shard {
        path: String,
        width: u32,
        vocab: usize,
    },
}

impl DataSpec {
    /// The corpus a node of `run` trains on. A synthetic run is a pure function of the run
    /// file (branch 4: the chain of `swarm train`'s default corpus); a text or token run needs
    /// the node's local copy of the file (`local`).
    pub fn for_run(
        run: &protocol::run::RunConfig,
        local: Option<&str>,
    ) -> Result<DataSpec, TrainError> {
        use protocol::run::DataSpec as Run;
        match (&run.data, local) {
            (Run::Synthetic { seed, vocab }, _) => Ok(DataSpec::Synthetic {
                seed: *seed,
                vocab: *vocab as usize,
                branch: 4,
            }),
            (Run::Text { tokenizer, .. }, Some(path)) => Ok(DataSpec::Text {
                path: path.to_string(),
                tokenizer: (!tokenizer.is_empty() && tokenizer != "bytes")
                    .then(|| tokenizer.clone()),
            }),
            (
                Run::Tokens {
                    vocab,
                    bytes_per_token,
                    ..
                },
                Some(path),
            ) => Ok(DataSpec::Shard {
                path: path.to_string(),
                width: *bytes_per_token as u32 * 8,
                vocab: *vocab as usize,
            }),
            _ => Err(DataError::NoFile.into()),
        }
    }

    pub fn synthetic_default() -> DataSpec {
        DataSpec::Synthetic {
            seed: 1,
            vocab: 32,
            branch: 4,
        }
    }
}

/// Held-out stream fraction for evaluation.
pub const EVAL_FRACTION: f64 = 0.1;

impl Corpus {
    pub fn open(spec: &DataSpec) -> Result<Corpus, TrainError> {
        match spec {
            DataSpec::Synthetic {
                seed,
                vocab,
                branch,
            } => Ok(Corpus::Synthetic(MarkovChain::new(*seed, *vocab, *branch))),
            DataSpec::Text { path, tokenizer } => {
                let text = std::fs::read(path).map_err(|source| DataError::Unreadable {
                    path: path.into(),
                    source,
                })?;
                let (tokens, vocab, how) = match tokenizer {
                    None => (
                        text.iter().map(|&b| b as u32).collect::<Vec<_>>(),
                        256,
                        "bytes".to_string(),
                    ),
                    Some(tok) => {
                        let t = tokenizers::Tokenizer::from_file(tok).map_err(|source| {
                            DataError::Tokenizer {
                                path: tok.into(),
                                source,
                            }
                        })?;
                        let s = String::from_utf8(text).map_err(|e| DataError::NotUtf8 {
                            path: path.into(),
                            source: e.utf8_error(),
                        })?;
                        let enc = t.encode(s, false).map_err(|source| DataError::Tokenize {
                            path: path.into(),
                            source,
                        })?;
                        (
                            enc.get_ids().to_vec(),
                            t.get_vocab_size(true),
                            format!("tokenizer {tok}"),
                        )
                    }
                };
                Self::stream(Tokens::Owned(tokens), vocab, format!("{path} ({how})"))
            }
            DataSpec::Shard { path, width, vocab } => {
                let unreadable = |source| DataError::Unreadable {
                    path: path.into(),
                    source,
                };
                let f = std::fs::File::open(path).map_err(unreadable)?;
                // Safety: the shard is read-only input; a concurrent writer would only change
                // which tokens we read, not memory safety of the slice bounds we check.
                let m = unsafe { memmap2::Mmap::map(&f) }.map_err(unreadable)?;
                let tokens = match width {
                    16 => Tokens::U16(m),
                    32 => Tokens::U32(m),
                    w => return Err(DataError::TokenWidth(*w).into()),
                };
                let vocab = if *vocab > 0 {
                    *vocab
                } else {
                    (0..tokens.len()).map(|i| tokens.get(i)).max().unwrap_or(0) as usize + 1
                };
                Self::stream(tokens, vocab, format!("{path} (u{width} shard)"))
            }
        }
    }

    fn stream(tokens: Tokens, vocab: usize, describe: String) -> Result<Corpus, TrainError> {
        if tokens.len() < 1000 {
            return Err(DataError::TooShort {
                describe,
                tokens: tokens.len(),
            }
            .into());
        }
        Ok(Corpus::Stream {
            tokens,
            vocab,
            describe,
        })
    }

    pub fn vocab(&self) -> usize {
        match self {
            Corpus::Synthetic(m) => m.vocab,
            Corpus::Stream { vocab, .. } => *vocab,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Corpus::Synthetic(m) => format!(
                "synthetic order-2 Markov chain, vocab {}, branch {}, entropy rate {:.4} nats/token",
                m.vocab, m.branch, m.entropy_rate
            ),
            Corpus::Stream { describe, tokens, vocab } => format!("{describe}: {} tokens, vocab {vocab}", tokens.len()),
        }
    }

    /// The lowest mean loss any model can reach on `seq`-token sequences, when known.
    pub fn loss_floor(&self, seq: usize) -> Option<f64> {
        match self {
            Corpus::Synthetic(m) => Some(m.loss_floor(seq)),
            Corpus::Stream { .. } => None,
        }
    }

    /// `batch` sequences of `seq + 1` tokens, a pure function of its arguments. `split` is
    /// "train" or "eval" (held-out: fresh chain samples, or the stream's last tenth).
    pub fn sequences(
        &self,
        split: &str,
        seed: u64,
        node: &[u8],
        step: u64,
        batch: usize,
        seq: usize,
    ) -> Vec<Vec<u32>> {
        let mut rng = Rng::derive(
            "swarm batch v1",
            &[
                split.as_bytes(),
                &seed.to_le_bytes(),
                node,
                &step.to_le_bytes(),
            ],
        );
        match self {
            Corpus::Synthetic(m) => (0..batch).map(|_| m.sample(&mut rng, seq + 1)).collect(),
            Corpus::Stream { tokens, .. } => {
                let n = tokens.len();
                let cut = ((n as f64) * (1.0 - EVAL_FRACTION)) as usize;
                let (lo, hi) = if split == "eval" { (cut, n) } else { (0, cut) };
                let span = (hi - lo).saturating_sub(seq + 1).max(1) as u64;
                (0..batch)
                    .map(|_| {
                        let start = lo + rng.below(span) as usize;
                        (start..start + seq + 1)
                            .map(|i| tokens.get(i.min(n - 1)))
                            .collect()
                    })
                    .collect()
            }
        }
    }

    /// (inputs, targets), each `[batch, seq]` i64 on `device`.
    pub fn batch(
        &self,
        split: &str,
        seed: u64,
        node: &[u8],
        step: u64,
        batch: usize,
        seq: usize,
        device: Device,
    ) -> (Tensor, Tensor) {
        let seqs = self.sequences(split, seed, node, step, batch, seq);
        let flat: Vec<i64> = seqs
            .iter()
            .flat_map(|s| s.iter().map(|&t| t as i64))
            .collect();
        let all = Tensor::from_slice(&flat)
            .view([batch as i64, seq as i64 + 1])
            .to_kind(Kind::Int64);
        let x = all.narrow(1, 0, seq as i64).to_device(device);
        let y = all.narrow(1, 1, seq as i64).to_device(device);
        (x, y)
    }
}
