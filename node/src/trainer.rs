//! The trainer of a network node: libtorch is synchronous and a step takes hundreds of
//! milliseconds, so it runs on its own thread and talks to the event loop over bounded
//! channels. It owns the model, the DeMo momentum and the codec; the loop owns the engine.
//!
//! Commands are handled strictly in order, so a `Train` queued after an `Apply` trains on the
//! parameters that `Apply` produced: the thread never needs to know about versions.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use protocol::config::lr_at;
use protocol::engine::Included;
use protocol::run::{DataSpec as RunData, RunConfig};
use protocol::sparse::{self, SparseUpdate};
use tch::Device;
use train::data::{Corpus, DataSpec};
use train::demo::{apply_sign_step, DctCodec, DemoState};
use train::model::Llama;

pub enum Cmd {
    /// Train step `step` on the current parameters and answer `Trained`.
    Train { step: u64 },
    /// Apply exactly these updates (already validated, in the engine's order); answer `Applied`.
    Apply { step: u64, updates: Vec<Included> },
    /// Save the parameters (a checkpoint of `version`) to `path`.
    Save { version: u64, path: PathBuf },
}

pub enum Reply {
    Ready {
        digest: [u8; 32],
        params: i64,
    },
    Trained {
        step: u64,
        blob: Vec<u8>,
        tokens: u64,
        loss: f64,
        ms: u64,
    },
    Applied {
        step: u64,
        digest: [u8; 32],
        ms: u64,
        included: usize,
    },
    Saved {
        version: u64,
        path: PathBuf,
    },
    Failed(String),
}

/// The trainer's view of the run's data: protocol data specs map onto the trainer's corpora.
pub fn data_spec(run: &RunConfig, local: Option<&str>) -> Result<DataSpec> {
    match (&run.data, local) {
        // Branch 4: the chain of `swarm train`'s default synthetic corpus.
        (RunData::Synthetic { seed, vocab }, _) => Ok(DataSpec::Synthetic {
            seed: *seed,
            vocab: *vocab as usize,
            branch: 4,
        }),
        (RunData::Text { tokenizer, .. }, Some(path)) => Ok(DataSpec::Text {
            path: path.to_string(),
            tokenizer: (!tokenizer.is_empty() && tokenizer != "bytes").then(|| tokenizer.clone()),
        }),
        (
            RunData::Tokens {
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
        _ => anyhow::bail!("this run trains on a file: pass it with --data PATH"),
    }
}

pub struct Trainer {
    run: RunConfig,
    model: Llama,
    state: DemoState,
    codec: DctCodec,
    corpus: Corpus,
    node: Vec<u8>,
    batch: usize,
    device: Device,
}

impl Trainer {
    pub fn new(
        run: &RunConfig,
        corpus: Corpus,
        node: Vec<u8>,
        batch: usize,
        device: Device,
        resume: Option<&std::path::Path>,
    ) -> Result<Trainer> {
        let mut model = Llama::new(&run.model, device, run.seed);
        if let Some(p) = resume {
            model
                .load(p)
                .with_context(|| format!("loading {}", p.display()))?;
        }
        let state = DemoState::new(&model.params);
        let codec = DctCodec::new(run.layout(), device);
        Ok(Trainer {
            run: run.clone(),
            model,
            state,
            codec,
            corpus,
            node,
            batch,
            device,
        })
    }

    fn lr(&self, step: u64) -> f64 {
        let o = &self.run.optim;
        lr_at(
            step.min(u32::MAX as u64) as u32,
            o.lr,
            o.warmup_steps,
            o.total_steps,
            o.min_lr_ratio,
        )
    }

    fn train(&mut self, step: u64) -> (Vec<u8>, u64, f64) {
        let seq = self.run.model.seq_len as usize;
        let (x, y) = self.corpus.batch(
            "train",
            self.run.seed,
            &self.node,
            step,
            self.batch,
            seq,
            self.device,
        );
        self.model.zero_grad();
        let loss = self.model.loss(&x, &y);
        loss.backward();
        let l = loss.double_value(&[]);
        let grads = self.model.grads();
        let lr = self.lr(step);
        let o = &self.run.optim;
        self.state.accumulate(&grads, lr, o);
        let u = self.codec.encode(&mut self.state.delta, o.topk, o.values);
        (u.encode(), (self.batch * seq) as u64, l)
    }

    fn apply(&mut self, step: u64, updates: &[Included]) -> Result<()> {
        // Nothing to apply: every honest node sees the same empty set and leaves the
        // parameters alone, so digests still agree.
        if updates.is_empty() {
            return Ok(());
        }
        let max = self.run.limits.max_blob_bytes as usize;
        let decoded: Vec<SparseUpdate> = updates
            .iter()
            .map(|u| SparseUpdate::decode(&u.bytes.0, max))
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("an update the engine validated failed to decode: {e}"))?;
        let refs: Vec<&SparseUpdate> = decoded.iter().collect();
        let agg = sparse::aggregate(&self.run.layout(), &refs);
        let signs = self.codec.exact_sign(&agg);
        apply_sign_step(
            &self.model.params,
            &signs,
            self.lr(step),
            self.run.optim.weight_decay,
        );
        Ok(())
    }

    /// Serve commands until the loop hangs up.
    pub fn serve(
        mut self,
        mut cmds: tokio::sync::mpsc::Receiver<Cmd>,
        replies: tokio::sync::mpsc::Sender<Reply>,
    ) {
        let _ = replies.blocking_send(Reply::Ready {
            digest: self.model.digest(),
            params: self.model.numel(),
        });
        while let Some(c) = cmds.blocking_recv() {
            let t0 = Instant::now();
            let r = match c {
                Cmd::Train { step } => {
                    let (blob, tokens, loss) = self.train(step);
                    Reply::Trained {
                        step,
                        blob,
                        tokens,
                        loss,
                        ms: t0.elapsed().as_millis() as u64,
                    }
                }
                Cmd::Apply { step, updates } => match self.apply(step, &updates) {
                    Ok(()) => Reply::Applied {
                        step,
                        digest: self.model.digest(),
                        ms: t0.elapsed().as_millis() as u64,
                        included: updates.len(),
                    },
                    Err(e) => Reply::Failed(e.to_string()),
                },
                Cmd::Save { version, path } => match self.model.save(&path) {
                    Ok(()) => Reply::Saved { version, path },
                    Err(e) => Reply::Failed(format!("saving {}: {e}", path.display())),
                },
            };
            if replies.blocking_send(r).is_err() {
                return;
            }
        }
    }
}
