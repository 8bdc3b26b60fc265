//! What a simulation measures, per step and in total. Serialized as JSON; contains nothing
//! that depends on the host (no wall time), so the same seed gives byte-identical files.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u64,
    /// Objective after the step, at the parameters most nodes hold (None: nobody applied it).
    pub loss: Option<f64>,
    /// Mean loss of the batches the nodes trained on this step (real trainers only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_loss: Option<f64>,
    /// The parameter digest most nodes hold after the step (hex; engine mode).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub digest: String,
    /// The AdamW + all-reduce baseline on the same objective, same step.
    pub baseline_loss: f64,
    /// Nodes that applied this step, and the fraction of them that hold the majority digest.
    pub applied_nodes: u32,
    pub agree: f64,
    /// Updates produced (published) for this step by all nodes.
    pub produced: u32,
    /// Updates each applying node included: mean, min, max; excluded = produced − included.
    pub included_mean: f64,
    pub included_min: u32,
    pub included_max: u32,
    pub excluded_mean: f64,
    /// Bytes through each live node's link during this step's window: mean and max.
    pub up_mean: f64,
    pub up_max: u64,
    pub down_mean: f64,
    pub down_max: u64,
    /// Step latency per node: from the step's start until the last update it included was in
    /// hand (training time included), ms.
    pub latency_p50_ms: f64,
    pub latency_p90_ms: f64,
    pub latency_max_ms: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    pub final_loss: Option<f64>,
    pub final_baseline_loss: f64,
    pub initial_loss: f64,
    pub mean_up_per_node_step: f64,
    pub mean_down_per_node_step: f64,
    pub latency_p50_ms: f64,
    pub latency_p90_ms: f64,
    pub latency_p99_ms: f64,
    pub desyncs: u64,
    pub rejected: u64,
    pub messages: u64,
    pub lost: u64,
    pub events: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    pub scenario: String,
    pub mode: String,
    pub seed: u64,
    pub nodes: usize,
    pub update_bytes: u64,
    pub steps: Vec<StepMetrics>,
    pub totals: Totals,
    /// Histogram of all step latencies: (upper bound ms, count).
    pub latency_hist_ms: Vec<(f64, u64)>,
    /// Hostile peers and the defences (engine mode, when the scenario has attackers or
    /// defences; absent otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adversary: Option<AttackStats>,
    /// Checkpoint transfers (engine mode; only when some node asked for one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoints: Option<Checkpoints>,
}

/// Checkpoint downloads and the liars among their servers (`[[checkpoint_liar]]`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Checkpoints {
    /// Downloads started, requests sent (manifests and chunks), checkpoints loaded, and
    /// downloads (or loads) that failed.
    pub downloads: u64,
    pub requests: u64,
    pub loads: u64,
    pub failures: u64,
    /// Nodes that synced on a loaded checkpoint.
    pub synced: u64,
    /// Requests sent to a lying server; of them, by a node that had already found it out.
    pub liar_requests: u64,
    pub liar_requests_after_caught: u64,
    /// Times a node found a lying server out (`Report::CheckpointLiar`).
    pub liars_found: u64,
    /// At the end: (live node, liar) pairs where the node banned the liar or never asks it
    /// for a checkpoint again.
    pub liars_caught: u64,
    /// Honest servers found out or banned for a checkpoint offence (should be 0).
    pub false_accusations: u64,
}

/// What the attackers did and what the honest nodes did about it. "Hostile" counts every
/// identity an attacker node used (Sybils use many); only honest nodes' actions are counted.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AttackStats {
    /// Attacker nodes, and the identities they used.
    pub hostile_nodes: u32,
    pub hostile_identities: u32,
    /// Hostile updates published (announced; an equivocating pair counts once).
    pub hostile_published: u64,
    /// Hostile updates in honest nodes' applied sets: in total, and per honest apply.
    pub hostile_included: u64,
    pub hostile_included_per_apply: f64,
    /// Honest updates in honest nodes' applied sets, per honest apply (false exclusions show
    /// as this falling below the honest nodes' count).
    pub honest_included_per_apply: f64,
    /// `Penalize` actions (and their points) by honest nodes against hostile identities, and
    /// against honest ones (false positives).
    pub penalties: u64,
    pub penalty_points: u64,
    pub false_penalties: u64,
    /// Bans by honest nodes of hostile identities, and of honest ones.
    pub bans: u64,
    pub false_bans: u64,
    /// Spot checks by honest nodes: of hostile senders (and how many failed), of honest
    /// senders (and how many failed: false strikes).
    pub spot_hostile: u64,
    pub spot_hostile_failed: u64,
    pub spot_honest: u64,
    pub spot_honest_failed: u64,
    /// Copies detected and equivocations proven, as seen by honest nodes (summed over them).
    pub copies: u64,
    pub equivocations: u64,
    /// Steps in which honest nodes that applied it did not all hold the same digest.
    pub honest_disagree_steps: u32,
    /// The first step from which on no honest node included any hostile update (None: some
    /// were included in the last step).
    pub excluded_from_step: Option<u64>,
}

impl Metrics {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plain data")
    }
}

/// The q-quantile of `v` (sorted in place), nearest rank.
pub fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// Log-spaced histogram (ms) of latencies.
pub fn histogram(v: &[f64]) -> Vec<(f64, u64)> {
    let mut edges = Vec::new();
    let mut e = 10.0;
    while e < 1e7 {
        edges.push(e);
        e *= 1.5;
    }
    let mut counts = vec![0u64; edges.len()];
    for &x in v {
        let i = edges
            .iter()
            .position(|&e| x <= e)
            .unwrap_or(edges.len() - 1);
        counts[i] += 1;
    }
    let last = counts.iter().rposition(|&c| c > 0).map_or(0, |i| i + 1);
    let first = counts.iter().position(|&c| c > 0).unwrap_or(0);
    edges
        .into_iter()
        .zip(counts)
        .take(last)
        .skip(first)
        .collect()
}

/// Fill the totals from the per-step rows and the raw latencies.
pub fn finish(m: &mut Metrics, lat: &mut [f64]) {
    let s = &m.steps;
    let n = s.len().max(1) as f64;
    m.totals.final_loss = s.iter().rev().find_map(|x| x.loss);
    m.totals.final_baseline_loss = s.last().map_or(0.0, |x| x.baseline_loss);
    m.totals.mean_up_per_node_step = s.iter().map(|x| x.up_mean).sum::<f64>() / n;
    m.totals.mean_down_per_node_step = s.iter().map(|x| x.down_mean).sum::<f64>() / n;
    m.latency_hist_ms = histogram(lat);
    m.totals.latency_p50_ms = quantile(lat, 0.5);
    m.totals.latency_p90_ms = quantile(lat, 0.9);
    m.totals.latency_p99_ms = quantile(lat, 0.99);
}
