//! What a simulation measures, per step and in total. Serialized as JSON; contains nothing
//! that depends on the host (no wall time), so the same seed gives byte-identical files.

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub step: u64,
    /// Objective after the step, at the parameters most nodes hold (None: nobody applied it).
    pub loss: Option<f64>,
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
