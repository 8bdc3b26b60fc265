//! The trainer of a network node: libtorch is synchronous and a step takes hundreds of
//! milliseconds, so it runs on its own thread and talks to the event loop over bounded
//! channels. It owns the model, the DeMo momentum and the codec; the loop owns the engine.
//!
//! Commands are handled strictly in order, so a `Train` queued after an `Apply` trains on the
//! parameters that `Apply` produced. Parameters change only in `Apply` and `Load` (DeMo's
//! training step touches the momentum, never the weights), so the thread tracks the version
//! they hold (steps applied) itself: `Save` and `Snapshot` always describe exactly the
//! parameters of the version they report, whatever else is queued around them.
//!
//! Checkpoints on disk (`--checkpoint-dir`) are `v{version}.safetensors`, written to a temp file,
//! fsynced, renamed into place and the directory fsynced, so a `kill -9` at any instant leaves
//! either the old set or the new one, never a torn file; only the newest [`KEEP_CHECKPOINTS`]
//! are kept. The DeMo momentum is not part of a checkpoint: a node that loads one (from disk
//! or from peers) starts with zero momentum, which changes only what it contributes next, never
//! the parameters everyone applies.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use protocol::checkpoint::f32_params_digest;
use protocol::engine::Included;
use protocol::run::RunConfig;
use protocol::sparse::SparseUpdate;
use tch::{Device, Kind, Tensor};
use train::data::{Corpus, DataSpec};
use train::node::NodeTrainer;

pub enum Cmd {
    /// Train step `step` on the current parameters and answer `Trained`.
    Train { step: u64 },
    /// Apply exactly these updates (already validated, in the engine's order); answer `Applied`.
    Apply { step: u64, updates: Vec<Included> },
    /// Save the parameters (a checkpoint of the version they hold) into `dir` as
    /// `v{version}.safetensors`, atomically, keeping the newest [`KEEP_CHECKPOINTS`].
    Save { dir: PathBuf },
    /// Answer `Snapshot` with a CPU copy of the parameters (for serving checkpoints).
    Snapshot,
    /// Replace the parameters with these tensors (model order, raw f32 little-endian bytes,
    /// already verified against a manifest) as version `version`; zero the DeMo momentum.
    Load { version: u64, tensors: Vec<Vec<u8>> },
    /// The engine's spot check of one peer's update: the loss on the sender's own batch for
    /// `step` (recomputable: batches are a pure function of seed, node id and step) before
    /// minus after applying that update alone as a sign step; the parameters are restored.
    /// Answer `SpotChecked`.
    SpotCheck {
        step: u64,
        sender: crypto::NodeId,
        blob: crypto::ContentId,
        tokens: u64,
        bytes: Vec<u8>,
    },
}

/// Checkpoint files kept in `--checkpoint-dir`.
pub const KEEP_CHECKPOINTS: usize = 2;

/// The parameters of one version, as bytes: what a node serves to joiners. Shared, because a
/// manifest and every chunk request of a download read the same copy while training goes on.
pub struct Snapshot {
    pub version: u64,
    pub digest: [u8; 32],
    /// (name, shape, raw f32 little-endian bytes), in model order.
    pub tensors: Vec<(String, Vec<u32>, Vec<u8>)>,
}

impl Snapshot {
    /// The snapshot of `tensors` as version `version`, with the protocol's parameter digest.
    pub fn new(version: u64, tensors: Vec<(String, Vec<u32>, Vec<u8>)>) -> Snapshot {
        let digest = f32_params_digest(
            tensors
                .iter()
                .map(|(n, s, b)| (n.as_str(), s.as_slice(), b.as_slice())),
        );
        Snapshot {
            version,
            digest: digest.0,
            tensors,
        }
    }

    /// The byte range `[start, start + len)` of the concatenated tensor stream.
    pub fn stream_range(&self, start: u64, len: u64) -> Vec<u8> {
        let mut out = Vec::with_capacity(len as usize);
        let end = start + len;
        let mut off = 0u64;
        for (_, _, b) in &self.tensors {
            let (lo, hi) = (off, off + b.len() as u64);
            if hi > start && lo < end {
                let a = start.max(lo) - lo;
                let z = end.min(hi) - lo;
                out.extend_from_slice(&b[a as usize..z as usize]);
            }
            off = hi;
            if off >= end {
                break;
            }
        }
        out
    }
}

pub enum Reply {
    Ready {
        digest: [u8; 32],
        params: i64,
        /// The version the parameters hold (0, or a checkpoint's when resuming).
        version: u64,
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
        /// Held-out loss of the parameters now held, every `--eval-every` versions.
        eval: Option<f64>,
    },
    /// A checkpoint written (or why not: a full disk is the operator's problem, not a reason
    /// to leave the run).
    Saved {
        version: u64,
        path: Result<PathBuf, String>,
    },
    Snapshot(Arc<Snapshot>),
    /// The digest after loading, or why the tensors did not fit the model.
    Loaded {
        version: u64,
        digest: Result<[u8; 32], String>,
    },
    SpotChecked {
        step: u64,
        sender: crypto::NodeId,
        blob: crypto::ContentId,
        /// NaN when the update does not even decode (the engine validated it, so a bug).
        gain: f64,
    },
    Failed(String),
}

/// The trainer's view of the run's data: protocol data specs map onto the trainer's corpora.
pub fn data_spec(run: &RunConfig, local: Option<&str>) -> Result<DataSpec> {
    Ok(DataSpec::for_run(run, local)?)
}

pub struct Trainer {
    run: RunConfig,
    /// The node's model, optimizer state and step: what every node computes (`train::node`).
    node: NodeTrainer,
    corpus: Corpus,
    snapshot: Option<Arc<Snapshot>>,
    /// Evaluate every this many versions (0: never), on this many held-out batches.
    eval_every: u64,
    eval_batches: usize,
}

/// `v{N}.safetensors` → N.
fn checkpoint_version(p: &Path) -> Option<u64> {
    let name = p.file_name()?.to_str()?;
    name.strip_prefix('v')?
        .strip_suffix(".safetensors")?
        .parse()
        .ok()
}

/// Checkpoints in `dir`, newest first. Temp files of an interrupted save are not listed.
pub fn list_checkpoints(dir: &Path) -> Vec<(u64, PathBuf)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<(u64, PathBuf)> = rd
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter_map(|p| checkpoint_version(&p).map(|v| (v, p)))
        .collect();
    v.sort_by(|a, b| b.0.cmp(&a.0));
    v
}

impl Trainer {
    pub fn new(
        run: &RunConfig,
        corpus: Corpus,
        node: Vec<u8>,
        batch: usize,
        device: Device,
    ) -> Result<Trainer> {
        Ok(Trainer {
            run: run.clone(),
            node: NodeTrainer::new(run, node, batch, device),
            corpus,
            snapshot: None,
            eval_every: 0,
            eval_batches: 0,
        })
    }

    /// Report the held-out loss every `every` versions (0: never) on `batches` batches of
    /// the run's size: the same held-out stream and seed as `swarm demo`'s and `swarm
    /// eval`'s final figure, so the curve ends where the report's number is.
    pub fn with_eval(mut self, every: u64, batches: usize) -> Trainer {
        self.eval_every = every;
        self.eval_batches = batches.max(1);
        self
    }

    /// The held-out loss if version `version` is one to evaluate.
    fn maybe_eval(&self, version: u64) -> Option<f64> {
        if self.eval_every == 0 || version % self.eval_every != 0 {
            return None;
        }
        Some(train::run::eval_loss(
            &self.node.model,
            &self.corpus,
            self.run.seed,
            self.eval_batches,
            self.run.batch_seqs as usize,
        ))
    }

    /// Resume from checkpoint file `path` of `version`. Every tensor is checked before any is
    /// copied, so a refused file leaves the model as it was.
    pub fn resume(&mut self, version: u64, path: &Path) -> Result<()> {
        let map: std::collections::BTreeMap<String, Tensor> = Tensor::read_safetensors(path)
            .with_context(|| format!("reading {}", path.display()))?
            .into_iter()
            .collect();
        let model = &self.node.model;
        for (n, p) in model.names.iter().zip(&model.params) {
            let t = map
                .get(n)
                .with_context(|| format!("{}: no tensor {n}", path.display()))?;
            if t.size() != p.size() || t.kind() != Kind::Float {
                anyhow::bail!("{}: {n} is {:?} {:?}", path.display(), t.kind(), t.size());
            }
        }
        self.node
            .model
            .load(path)
            .with_context(|| format!("loading {}", path.display()))?;
        self.node.reset_state(version);
        self.snapshot = None;
        Ok(())
    }

    /// The parameters as bytes; cached per version (the parameters change only with it).
    fn snapshot(&mut self) -> Arc<Snapshot> {
        if let Some(s) = self
            .snapshot
            .as_ref()
            .filter(|s| s.version == self.node.version)
        {
            return s.clone();
        }
        let model = &self.node.model;
        let tensors: Vec<(String, Vec<u32>, Vec<u8>)> = model
            .names
            .iter()
            .zip(&model.params)
            .map(|(n, p)| {
                (
                    n.clone(),
                    p.size().iter().map(|&d| d as u32).collect(),
                    train::model::f32_le_bytes(p),
                )
            })
            .collect();
        let snap = Arc::new(Snapshot::new(self.node.version, tensors));
        self.snapshot = Some(snap.clone());
        snap
    }

    fn load(&mut self, version: u64, tensors: &[Vec<u8>]) -> Result<[u8; 32]> {
        let model = &mut self.node.model;
        if tensors.len() != model.params.len() {
            anyhow::bail!(
                "checkpoint has {} tensors, the model {}",
                tensors.len(),
                model.params.len()
            );
        }
        // Check every size before touching anything: a refused load leaves the model as it was.
        for ((p, b), n) in model.params.iter().zip(tensors).zip(&model.names) {
            if b.len() as i64 != p.numel() as i64 * 4 {
                anyhow::bail!("{n}: {} bytes for {} values", b.len(), p.numel());
            }
        }
        tch::no_grad(|| {
            for (p, b) in model.params.iter_mut().zip(tensors) {
                let vals: Vec<f32> = b
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect();
                let t = Tensor::from_slice(&vals).view(p.size().as_slice());
                p.copy_(&t.to_device(p.device()));
            }
        });
        // Momentum belongs to the parameters it was accumulated on: start afresh.
        self.node.reset_state(version);
        self.snapshot = None;
        Ok(self.node.digest())
    }

    /// Write `v{version}.safetensors` into `dir` (see the module docs) and prune old ones.
    fn save(&self, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
        let path = dir.join(format!("v{}.safetensors", self.node.version));
        // `Llama::save` writes a temp file beside `path`, fsyncs it and renames it into place.
        self.node.model.save(&path)?;
        // The rename is durable only once the directory entry is.
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("fsync {}", dir.display()))?;
        for (_, old) in list_checkpoints(dir).into_iter().skip(KEEP_CHECKPOINTS) {
            let _ = std::fs::remove_file(old);
        }
        Ok(path)
    }

    fn train(&mut self, step: u64) -> (Vec<u8>, u64, f64) {
        let t = self.node.train(&self.corpus, step);
        (t.update.encode(), t.tokens, t.loss)
    }

    /// Apply round `step` (an empty set leaves the parameters alone, as on every honest node
    /// that saw it); the parameters then hold version `step + 1`.
    fn apply(&mut self, step: u64, updates: &[Included]) -> Result<()> {
        let max = self.run.limits.max_blob_bytes as usize;
        let decoded: Vec<SparseUpdate> = updates
            .iter()
            .map(|u| SparseUpdate::decode(&u.bytes.0, max))
            .collect::<Result<_, _>>()
            .map_err(|e| anyhow::anyhow!("an update the engine validated failed to decode: {e}"))?;
        // Weighted by the tokens each header states (mixed hardware), as the run combines.
        let set: Vec<(&SparseUpdate, u64)> = decoded
            .iter()
            .zip(updates)
            .map(|(d, u)| (d, u.tokens))
            .collect();
        self.node.apply(step, &set);
        Ok(())
    }

    /// See [`Cmd::SpotCheck`]. The batch is the sender's, sized by the tokens its header
    /// states (capped at the run's batch), so an honest sender's update lowers it.
    fn spot_check(&mut self, step: u64, sender: &crypto::NodeId, tokens: u64, bytes: &[u8]) -> f64 {
        let Ok(u) = SparseUpdate::decode(bytes, self.run.limits.max_blob_bytes as usize) else {
            return f64::NAN;
        };
        self.node
            .spot_check(&self.corpus, &sender.0, step, &u, tokens)
    }

    /// Serve commands until the loop hangs up.
    pub fn serve(
        mut self,
        mut cmds: tokio::sync::mpsc::Receiver<Cmd>,
        replies: tokio::sync::mpsc::Sender<Reply>,
    ) {
        let _ = replies.blocking_send(Reply::Ready {
            digest: self.node.digest(),
            params: self.node.model.numel(),
            version: self.node.version,
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
                    Ok(()) => {
                        let digest = self.node.digest();
                        let ms = t0.elapsed().as_millis() as u64;
                        Reply::Applied {
                            step,
                            digest,
                            ms,
                            included: updates.len(),
                            eval: self.maybe_eval(step + 1),
                        }
                    }
                    Err(e) => Reply::Failed(e.to_string()),
                },
                Cmd::Save { dir } => Reply::Saved {
                    version: self.node.version,
                    path: self
                        .save(&dir)
                        .map_err(|e| format!("saving into {}: {e:#}", dir.display())),
                },
                Cmd::Snapshot => Reply::Snapshot(self.snapshot()),
                Cmd::SpotCheck {
                    step,
                    sender,
                    blob,
                    tokens,
                    bytes,
                } => Reply::SpotChecked {
                    step,
                    sender,
                    blob,
                    gain: self.spot_check(step, &sender, tokens, &bytes),
                },
                Cmd::Load { version, tensors } => Reply::Loaded {
                    version,
                    digest: self.load(version, &tensors).map_err(|e| format!("{e:#}")),
                },
            };
            if replies.blocking_send(r).is_err() {
                return;
            }
        }
    }
}
