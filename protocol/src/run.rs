//! What defines a run: model, data, optimizer, seed, step timing and every bound the engine
//! enforces. Its blake3 (of the canonical CBOR) is the run id; every message names the run it
//! belongs to, and messages of another run are ignored.

use crypto::Digest;
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::config::{ModelConfig, OptimConfig};
use crate::sparse::{encoded_size, Layout};

/// The run id: blake3 of the run config's canonical CBOR.
pub type RunId = Digest;

/// Where the training tokens come from. Plain data: the trainer interprets it, the protocol
/// only hashes it into the run id so that nodes of different data never mix.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum DataSpec {
    /// Tokens drawn from a seeded generator (tests, the simulator, smoke runs).
    Synthetic { seed: u64, vocab: u32 },
    /// A text corpus, identified by the blake3 of its bytes, and the tokenizer to apply.
    Text {
        name: String,
        blake3: Digest,
        tokenizer: String,
    },
    /// A pre-tokenized corpus (little-endian token ids of `bytes_per_token` bytes).
    Tokens {
        name: String,
        blake3: Digest,
        vocab: u32,
        bytes_per_token: u8,
    },
}

/// Step clock. Step `t` runs in `[genesis + t·period, genesis + (t+1)·period)`; its updates are
/// accepted until `publish_deadline(t) = genesis + (t+1)·period + grace`; summaries of what each
/// node holds for `t` are published then and accepted until
/// `apply_at(t) = publish_deadline(t) + summary`, when every node applies step `t`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepTiming {
    /// Unix time of step 0's start, milliseconds.
    pub genesis_ms: u64,
    pub period_ms: u64,
    /// Tolerance for clock skew and propagation after a step's window closes.
    pub grace_ms: u64,
    /// How long summaries (and the repair fetches they trigger) have before a step is applied.
    pub summary_ms: u64,
}

impl StepTiming {
    pub fn step_start(&self, t: u64) -> u64 {
        self.genesis_ms
            .saturating_add(t.saturating_mul(self.period_ms))
    }
    pub fn publish_deadline(&self, t: u64) -> u64 {
        self.step_start(t.saturating_add(1))
            .saturating_add(self.grace_ms)
    }
    pub fn apply_at(&self, t: u64) -> u64 {
        self.publish_deadline(t).saturating_add(self.summary_ms)
    }
    /// The step whose window contains `now` (0 before genesis).
    pub fn step_at(&self, now: u64) -> u64 {
        now.saturating_sub(self.genesis_ms) / self.period_ms.max(1)
    }
}

/// Every bound on sizes, counts and queues. Nothing the engine keeps grows past these.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Largest update blob (checked before decoding).
    pub max_blob_bytes: u64,
    /// Blobs up to this size travel inside the gossip announcement; larger ones are fetched.
    pub inline_blob_bytes: u32,
    /// Largest gossip frame (must not exceed the transport's own limit, e.g. gossipsub's
    /// `max_transmit_size`, or frames are dropped silently).
    pub max_message_bytes: u32,
    /// Largest signed header body.
    pub max_header_bytes: u32,
    /// Most senders (updates) per step; also the most summaries kept per step.
    pub max_updates_per_step: u32,
    /// Most updates buffered for steps whose window has not opened yet.
    pub max_early_updates: u32,
    /// How many steps ahead of the local clock a message may be (skew tolerance).
    pub future_steps: u32,
    /// How many applied steps stay kept (to serve laggards and joiners); older messages are
    /// replays and are refused.
    pub past_steps: u32,
    /// Most peers tracked (scores, reported digests).
    pub max_peers: u32,
    pub max_inflight_fetches: u32,
    /// Most blobs waiting to be fetched.
    pub max_fetch_queue: u32,
    /// Most peers tried for one blob.
    pub max_fetch_candidates: u32,
    pub max_listen_addrs: u32,
    pub max_addr_len: u32,
    pub max_manifest_bytes: u32,
    pub max_checkpoint_chunk_bytes: u32,
    /// Penalty points at which a peer is banned.
    pub ban_score: u32,
    /// Distinct peers that must attest a parameter digest before a joiner trusts a checkpoint
    /// with it, or before a node concludes that its own digest is the odd one out.
    pub attest_quorum: u32,
}

impl Limits {
    /// Bounds sized for an update of `blob_bytes`.
    pub fn for_blob(blob_bytes: u64) -> Limits {
        Limits {
            max_blob_bytes: blob_bytes,
            inline_blob_bytes: 48 * 1024,
            max_message_bytes: 64 * 1024,
            max_header_bytes: 512,
            max_updates_per_step: 256,
            max_early_updates: 256,
            future_steps: 2,
            past_steps: 4,
            max_peers: 1024,
            max_inflight_fetches: 8,
            max_fetch_queue: 1024,
            max_fetch_candidates: 8,
            max_listen_addrs: 8,
            max_addr_len: 256,
            max_manifest_bytes: 4 * 1024 * 1024,
            max_checkpoint_chunk_bytes: 4 * 1024 * 1024,
            ban_score: 100,
            attest_quorum: 2,
        }
    }
}

/// How a run defends its aggregate against hostile peers (see docs/SECURITY.md). Every field's
/// default is "off", and a config that leaves the whole table out keeps its run id.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Defence {
    /// Include an update only if more than half of the step's summaries list it (instead of
    /// any one). An honest node leaves out of its summary what its checks condemned, so a
    /// minority of summarizers can neither force a bad update in nor keep a good one out.
    pub majority: bool,
    /// Updates of other peers each node spot-checks per step (loss after applying that update
    /// alone, on the sender's recomputable batch).
    pub spot_checks: u32,
    /// Top-k index overlap (‰ of the later update's kept coefficients) at or above which the
    /// later of two updates of a step is treated as a copy (0 = off).
    pub copy_overlap_permille: u32,
    /// Leading zero bits required of `blake3(pow domain ‖ run ‖ sender ‖ nonce)` on every
    /// header and summary (0 = no proof of work).
    pub pow_bits: u32,
    /// A peer first heard from more than this many steps after the node synced is on probation
    /// until it passes a spot check: its updates are not listed (0 = no probation).
    pub probation_steps: u32,
    /// Gossip each failed spot check as an `Accusation`; a node that hears one repeats the
    /// check itself (at most one accusation per accuser and `2 × spot_checks` repeats per
    /// step), so most honest nodes condemn an offender in the step after the first catch
    /// instead of waiting to sample it. Absent from the run id when off (older runs keep
    /// theirs).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub accuse: bool,
}

impl Defence {
    pub fn is_off(&self) -> bool {
        *self == Defence::default()
    }

    /// Every defence on, with the settings docs/BENCHMARKS.md measured.
    pub fn full() -> Defence {
        Defence {
            majority: true,
            spot_checks: 2,
            copy_overlap_permille: 900,
            pow_bits: 8,
            probation_steps: 4,
            accuse: true,
        }
    }
}

/// A whole run. The run id commits to every field.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunConfig {
    pub name: String,
    pub model: ModelConfig,
    pub optim: OptimConfig,
    pub data: DataSpec,
    /// Sequences each node trains on per step.
    pub batch_seqs: u32,
    /// Seed of the initial parameters (every node starts from the same version 0).
    pub seed: u64,
    pub timing: StepTiming,
    pub limits: Limits,
    /// Defences against hostile peers (absent = off).
    #[serde(default, skip_serializing_if = "Defence::is_off")]
    pub defence: Defence,
}

#[derive(Debug, Error, Clone, PartialEq)]
pub enum RunConfigError {
    #[error("step period must be positive")]
    ZeroPeriod,
    #[error("grace ({grace} ms) + summary ({summary} ms) must fit in one period ({period} ms), or step t+1 would start before step t-1 is applied")]
    TimingOverlap {
        grace: u64,
        summary: u64,
        period: u64,
    },
    #[error("limit {0} must be positive")]
    ZeroLimit(&'static str),
    #[error("an update of this model is {need} bytes, over max_blob_bytes {max}")]
    BlobTooSmall { need: u64, max: u64 },
    #[error("inline_blob_bytes {inline} leaves no room in max_message_bytes {msg}")]
    InlineTooLarge { inline: u32, msg: u32 },
}

impl RunConfig {
    /// The canonical CBOR of the config (what the run id hashes).
    pub fn canonical_bytes(&self) -> Vec<u8> {
        serde_cbor::to_vec(self).expect("plain data always serializes")
    }

    pub fn run_id(&self) -> RunId {
        Digest::of(&self.canonical_bytes())
    }

    /// The gossip topic of this run: one run, one namespace (see the gossipsub note on
    /// `protocol_id_prefix`: namespace by topic).
    pub fn topic(&self) -> String {
        format!("swarm/{}/v1", self.run_id().to_hex())
    }

    /// Tokens of one node's full protocol step (`batch_seqs · seq_len`, times the window's
    /// inner steps for local steps): the cap and unit of an update's weight (see
    /// `sparse::token_weight`).
    pub fn nominal_tokens(&self) -> u64 {
        self.batch_seqs as u64 * self.model.seq_len as u64 * self.optim.inner_steps() as u64
    }

    pub fn layout(&self) -> Layout {
        Layout::for_model(&self.model, self.optim.chunk)
    }

    /// A config for `model` with bounds sized to its update and the given timing.
    pub fn new(
        name: &str,
        model: ModelConfig,
        optim: OptimConfig,
        data: DataSpec,
        timing: StepTiming,
    ) -> RunConfig {
        let layout = Layout::for_model(&model, optim.chunk);
        let blob = encoded_size(&layout, optim.topk, optim.values) as u64;
        // Headroom over the exact size costs nothing and keeps the limit a bound, not a value.
        let limits = Limits::for_blob(blob + blob / 8 + 1024);
        RunConfig {
            name: name.into(),
            model,
            optim,
            data,
            batch_seqs: 4,
            seed: 0,
            timing,
            limits,
            defence: Defence::default(),
        }
    }

    pub fn validate(&self) -> Result<(), RunConfigError> {
        let t = &self.timing;
        if t.period_ms == 0 {
            return Err(RunConfigError::ZeroPeriod);
        }
        if t.grace_ms.saturating_add(t.summary_ms) > t.period_ms {
            return Err(RunConfigError::TimingOverlap {
                grace: t.grace_ms,
                summary: t.summary_ms,
                period: t.period_ms,
            });
        }
        let l = &self.limits;
        for (name, v) in [
            ("max_blob_bytes", l.max_blob_bytes),
            ("max_message_bytes", l.max_message_bytes as u64),
            ("max_header_bytes", l.max_header_bytes as u64),
            ("max_updates_per_step", l.max_updates_per_step as u64),
            ("past_steps", l.past_steps as u64),
            ("max_peers", l.max_peers as u64),
            ("max_inflight_fetches", l.max_inflight_fetches as u64),
            ("max_fetch_queue", l.max_fetch_queue as u64),
            ("max_fetch_candidates", l.max_fetch_candidates as u64),
            ("ban_score", l.ban_score as u64),
            ("attest_quorum", l.attest_quorum as u64),
        ] {
            if v == 0 {
                return Err(RunConfigError::ZeroLimit(name));
            }
        }
        if l.inline_blob_bytes as u64 + l.max_header_bytes as u64 + 256 > l.max_message_bytes as u64
        {
            return Err(RunConfigError::InlineTooLarge {
                inline: l.inline_blob_bytes,
                msg: l.max_message_bytes,
            });
        }
        let need = encoded_size(&self.layout(), self.optim.topk, self.optim.values) as u64;
        if need > l.max_blob_bytes {
            return Err(RunConfigError::BlobTooSmall {
                need,
                max: l.max_blob_bytes,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run() -> RunConfig {
        let m = ModelConfig::named("tiny", 256).unwrap();
        let t = StepTiming {
            genesis_ms: 0,
            period_ms: 1000,
            grace_ms: 100,
            summary_ms: 400,
        };
        RunConfig::new(
            "t",
            m,
            OptimConfig::default(),
            DataSpec::Synthetic {
                seed: 1,
                vocab: 256,
            },
            t,
        )
    }

    #[test]
    fn run_id_commits_to_every_field_and_validation_catches_bad_timing() {
        let a = run();
        a.validate().unwrap();
        let mut b = a.clone();
        b.seed = 1;
        assert_ne!(a.run_id(), b.run_id());
        let mut c = a.clone();
        c.limits.past_steps += 1;
        assert_ne!(a.run_id(), c.run_id());
        assert_eq!(a.run_id(), a.clone().run_id());
        c.timing.summary_ms = 950;
        assert!(matches!(
            c.validate(),
            Err(RunConfigError::TimingOverlap { .. })
        ));
        let mut d = a.clone();
        d.limits.max_blob_bytes = 10;
        assert!(matches!(
            d.validate(),
            Err(RunConfigError::BlobTooSmall { .. })
        ));
        assert!(a.topic().starts_with("swarm/") && a.topic().ends_with("/v1"));
    }

    #[test]
    fn step_clock() {
        let t = StepTiming {
            genesis_ms: 10_000,
            period_ms: 1000,
            grace_ms: 100,
            summary_ms: 400,
        };
        assert_eq!(t.step_at(9_000), 0);
        assert_eq!(t.step_at(11_999), 1);
        assert_eq!(t.publish_deadline(1), 12_100);
        assert_eq!(t.apply_at(1), 12_500);
        // Step t−1 is applied before step t+1 starts.
        assert!(t.apply_at(1) <= t.step_start(3));
    }
}
