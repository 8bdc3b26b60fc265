//! What the engine tells its driver besides actions to take: [`Report`]s (for logs and
//! metrics exporters) and its counters, [`Metrics`].

use crypto::{Digest, NodeId};

use super::download;
use crate::error::Offence;

/// What happened that a log or metrics exporter wants to know.
#[derive(Clone, Debug, PartialEq)]
pub enum Report {
    /// Provably invalid; the peer at fault is penalized.
    Rejected {
        from: NodeId,
        error: Offence,
    },
    /// Dropped without fault: late, duplicate, another run, full buffer, out of window.
    Ignored {
        from: NodeId,
        error: Offence,
    },
    /// The local trainer's update could not be published.
    LocalRefused {
        step: u64,
        error: Offence,
    },
    StepApplied {
        step: u64,
        included: u32,
        listed: u32,
        missing: u32,
    },
    /// Our digest for `version` was outvoted: resyncing from a checkpoint.
    Desync {
        version: u64,
        mine: Digest,
        majority: Digest,
    },
    Synced {
        version: u64,
        digest: Digest,
    },
    CheckpointUnattested {
        version: u64,
        digest: Digest,
    },
    /// A checkpoint of at least `min_version` is being downloaded from (some of) `peers`.
    CheckpointRequested {
        min_version: u64,
        peers: Vec<NodeId>,
    },
    /// A downloaded checkpoint was loaded as its manifest says (from `servers` agreeing
    /// servers); `synced`: the swarm attests it already (else the engine waits for that).
    CheckpointLoaded {
        version: u64,
        digest: Digest,
        servers: u32,
        synced: bool,
    },
    /// `peer` served a checkpoint that is provably wrong, or signed one of the attested
    /// version with another digest: it is never asked for a checkpoint again (not banned: the
    /// evidence is this node's alone, see `sync::on_download`).
    CheckpointLiar {
        peer: NodeId,
    },
    /// The checkpoint download (or its load) failed; asked again after a back-off.
    CheckpointFailed {
        reason: download::Failure,
    },
    /// A spot check's outcome and the peer's reputation afterwards.
    SpotResult {
        sender: NodeId,
        step: u64,
        gain: f64,
        reputation: i32,
    },
    /// An update's blob arrived and checked out (for latency figures: the shell stamps the
    /// time). Not reported for this node's own update.
    Verified {
        step: u64,
        sender: NodeId,
    },
    /// The later of two near-identical updates of one step was taken for a copy.
    CopySuspected {
        sender: NodeId,
        of: NodeId,
        step: u64,
        overlap_permille: u32,
    },
}

/// Counters, for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Metrics {
    pub messages: u64,
    pub rejected: u64,
    pub ignored: u64,
    pub late: u64,
    pub early: u64,
    pub duplicates: u64,
    pub equivocations: u64,
    /// Peer entries dropped to make room in the full peer table.
    pub evicted_peers: u64,
    /// Fetch wants dropped to make room for ones of higher priority.
    pub evicted_wants: u64,
    /// Headers and summaries of strangers dropped from a full step for better-known peers.
    pub evicted_updates: u64,
    /// Fetches refused for exceeding a peer's serving budget.
    pub refused_serves: u64,
    pub fetches: u64,
    pub fetch_failures: u64,
    /// Fetches given up after `fetch_timeout` (half the summary window) without an answer.
    pub fetch_timeouts: u64,
    pub steps_applied: u64,
    pub updates_applied: u64,
    pub desyncs: u64,
    pub spot_checks: u64,
    pub spot_failures: u64,
    pub copies: u64,
    /// Updates this node held but left out of its summary (condemned, copies, probation).
    pub withheld: u64,
    /// Updates listed by some summary but left out by the majority rule.
    pub outvoted: u64,
    /// Own updates uploaded to a first-hop relay instead of gossiped.
    pub uploads: u64,
    /// (A relay) uploads verified and their headers gossiped.
    pub relayed: u64,
    /// Spot checks repeated because a peer's accusation asked for them.
    pub repeated_checks: u64,
}
