//! The sans-IO engine that runs rounds without a coordinator.
//!
//! `Engine::handle(event, now) -> Vec<Action>`: time comes in as `now` (unix ms), randomness as
//! a seed at construction, and every map is a `BTreeMap`, so one sequence of events gives one
//! sequence of actions, byte for byte, on any machine. The network shell (node/) and the
//! simulator (sim/) turn actions into I/O and I/O into events.
//!
//! # The round (see `StepTiming`)
//! * During step t's window a node trains on its parameters (version t−1 when on time) and
//!   publishes a signed header for its update; the blob goes inline when small, else peers fetch
//!   it by id from whoever relayed the header (relays are told to forward only verified blobs:
//!   the gossip verdict is withheld until the blob checks out).
//! * At `publish_deadline(t)` updates for t stop being accepted from gossip (late ones are
//!   counted, not applied) and every synced node publishes a signed `StepSummary`: the blob ids
//!   of the valid updates it holds for t, and its own parameter version and digest.
//! * Until `apply_at(t)` summaries come in; any listed update the node lacks is fetched (from
//!   the summary's sender first). A slow or vanished peer is simply absent: nothing waits for
//!   it longer than the grace after `apply_at(t)`.
//! * At `apply_at(t)` the node applies the **union of its own summary and every summary it
//!   received for t**, restricted to updates it holds and verified, minus any sender proven to
//!   have equivocated in t, in blob-id order. Honest nodes that received the same summaries and
//!   blobs apply the same set; one that missed an update learns of it from the summaries and
//!   fetches it before applying.
//! * Summaries (signed and priced; Hellos never vote) carry parameter digests. A node whose
//!   digest for its current version is outvoted by the peers it *knows* (`Engine::known`: at
//!   least `attest_quorum` of them and a strict majority agree on another) declares itself
//!   desynced and asks them for a checkpoint, exactly like a joiner. Fresh keys never outvote
//!   a node, however many: that would let a few throwaway keys hand it their parameters.
//! * A joiner listens, and once the swarm attests a (version, digest) whose summaries it was
//!   listening for (`Engine::attested_digest`), requests a checkpoint of at least that
//!   version, loads it, and catches up by applying the following steps from the summaries it
//!   collected. A loaded checkpoint whose digest the swarm contradicts is dropped at once.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use crypto::{ContentId, Digest, Identity, NodeId};

use crate::error::WireError;
use crate::run::{RunConfig, RunId};
use crate::wire::{
    caps, Accusation, EquivocationProof, Hello, Message, Signed, StepSummary, SummaryEquivocation,
    UpdateHeader, UpdateRules, PROTOCOL_VERSION,
};

/// Something that happened, fed to [`Engine::handle`].
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A frame from the network. `tag` is the gossip message id whose validation result the
    /// transport waits for (None for direct messages such as Hello).
    Message {
        from: NodeId,
        tag: Option<u64>,
        bytes: Vec<u8>,
    },
    /// The answer to [`Action::Fetch`]: a `Message::Update` frame.
    Fetched {
        from: NodeId,
        blob: ContentId,
        bytes: Vec<u8>,
    },
    /// The fetch failed (timeout, refused, disconnected).
    FetchFailed {
        from: NodeId,
        blob: ContentId,
    },
    /// The local trainer finished its update for `step`: the encoded `SparseUpdate`.
    LocalUpdate {
        step: u64,
        blob: Vec<u8>,
        tokens: u64,
    },
    /// The timer set by [`Action::SetTimer`] fired (any extra call is harmless).
    Timer,
    PeerConnected {
        peer: NodeId,
    },
    PeerGone {
        peer: NodeId,
    },
    /// The trainer applied `step` (as asked by [`Action::Apply`]); `digest` is the parameter
    /// digest afterwards (version `step + 1`).
    Applied {
        step: u64,
        digest: Digest,
    },
    /// A checkpoint was downloaded, verified against its manifest, and loaded.
    CheckpointLoaded {
        version: u64,
        digest: Digest,
    },
    CheckpointFailed,
    /// The answer to [`Action::SpotCheck`]: `gain` is the loss on the sender's own batch before
    /// minus after applying that update alone (positive: it helped).
    SpotChecked {
        step: u64,
        sender: NodeId,
        blob: ContentId,
        gain: f64,
    },
    /// `from` served a checkpoint (manifest) whose digest does not match what the swarm
    /// attests for its version: a liar, banned.
    BadCheckpoint {
        from: NodeId,
    },
}

/// gossipsub-style validation result for a tagged message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Valid: forward it.
    Accept,
    /// Provably invalid: drop it and penalize the relay.
    Reject,
    /// Not for us (late, duplicate, another run): drop without penalty.
    Ignore,
}

/// An update's bytes, shared (blobs are megabytes; actions are cloned in tests).
#[derive(Clone, PartialEq, Eq)]
pub struct Blob(pub Arc<[u8]>);

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "Blob({} bytes)", self.0.len())
    }
}

/// One update included in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Included {
    pub blob: ContentId,
    pub sender: NodeId,
    pub tokens: u64,
    /// The encoded `SparseUpdate`, already validated against the run's layout.
    pub bytes: Blob,
}

/// What happened that a log or metrics exporter wants to know.
#[derive(Clone, Debug, PartialEq)]
pub enum Report {
    /// Provably invalid; the peer at fault is penalized.
    Rejected {
        from: NodeId,
        error: WireError,
    },
    /// Dropped without fault: late, duplicate, another run, full buffer, out of window.
    Ignored {
        from: NodeId,
        error: WireError,
    },
    /// The local trainer's update could not be published.
    LocalRefused {
        step: u64,
        error: WireError,
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

/// Something for the shell to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Gossip a frame on the run's topic.
    Publish {
        bytes: Vec<u8>,
    },
    /// Send a frame to one peer directly.
    Send {
        peer: NodeId,
        bytes: Vec<u8>,
    },
    /// Report the validation result of a tagged gossip message.
    Verdict {
        tag: u64,
        verdict: Verdict,
    },
    /// Ask `peer` for the update whose blob id is `blob` (answered by its
    /// [`Engine::serve_update`]); report back with `Fetched` or `FetchFailed`.
    Fetch {
        peer: NodeId,
        blob: ContentId,
    },
    /// Download a checkpoint of at least `min_version` from one of `peers` (in the order
    /// given), verify it against its manifest, load it and report `CheckpointLoaded`.
    RequestCheckpoint {
        min_version: u64,
        peers: Vec<NodeId>,
    },
    /// Step `step`'s window opened: train on the current parameters (version `base_version`).
    StartStep {
        step: u64,
        base_version: u64,
    },
    /// Apply step `step` with exactly these updates, in this order; answer with `Applied`.
    Apply {
        step: u64,
        updates: Vec<Included>,
    },
    Penalize {
        peer: NodeId,
        reason: WireError,
        points: u32,
    },
    Ban {
        peer: NodeId,
        reason: WireError,
    },
    /// Evaluate this peer's update alone: the loss on the sender's recomputable batch for
    /// `step` before and after applying `bytes` as a sign step to the current parameters;
    /// answer [`Event::SpotChecked`]. Sampled per step (see `Defence::spot_checks`).
    SpotCheck {
        step: u64,
        sender: NodeId,
        blob: ContentId,
        tokens: u64,
        bytes: Blob,
    },
    /// Call `handle(Event::Timer, at)` at `at`.
    SetTimer {
        at: u64,
    },
    Report(Report),
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

#[derive(Clone, Debug, PartialEq, Eq)]
enum SyncState {
    Synced,
    /// Waiting for a checkpoint. `requested`: min version asked for; `loaded`: a checkpoint
    /// the trainer loaded but that is not yet attested.
    Joining {
        requested: Option<u64>,
        loaded: Option<(u64, Digest)>,
    },
}

struct Entry {
    header: Signed<UpdateHeader>,
    blob: Option<Arc<[u8]>>,
    invalid: bool,
    /// A sample of the update's kept (coefficient, sign) keys, for copy detection.
    sketch: Vec<u64>,
    /// Taken for a copy of an earlier update of this step.
    copy: bool,
    /// The header's length contradicts the bytes of the blob it names (they hash to its id):
    /// its signer lied, and the blob id is free for a header that tells the truth.
    contradicted: bool,
    /// The `Message::Update` frame served for it, encoded at the first request.
    frame: Option<Arc<[u8]>>,
}

#[derive(Default)]
struct StepState {
    headers: BTreeMap<NodeId, Entry>,
    /// Senders proven to have signed two headers or two summaries for the step: their
    /// updates and summaries are left out of its set. At most `max_updates_per_step` of them
    /// that sent nothing here (see `on_proof`).
    equivocators: BTreeSet<NodeId>,
    summaries: BTreeMap<NodeId, Signed<StepSummary>>,
    mine: Option<Vec<ContentId>>,
    /// Senders this node spot-checked (or is checking) for the step: once each.
    checked: BTreeSet<NodeId>,
    /// Blobs of the step served, per requesting peer (see `serve_update_to`).
    served: BTreeMap<NodeId, BTreeMap<ContentId, u8>>,
    /// Accusers heard for the step (one accusation each counts), and the checks they caused.
    accusers: BTreeSet<NodeId>,
    repeats: u32,
}

struct Want {
    step: u64,
    candidates: Vec<NodeId>,
    tried: Vec<bool>,
    inflight: Option<NodeId>,
    /// Gossip tags whose verdict waits on this blob.
    tags: Vec<u64>,
    /// A held, signed header names this blob.
    headed: bool,
    /// Summary senders that listed it (the first two: all that the priority needs).
    listers: Vec<NodeId>,
    /// A trusted relay or a known peer listed it.
    vouched: bool,
}

impl Want {
    fn exhausted(&self) -> bool {
        self.inflight.is_none() && self.tried.iter().all(|&t| t)
    }

    /// What a full fetch queue keeps: a blob a held header names (2), one that two
    /// independent summaries or a trusted or known peer list (1), one a single stranger's
    /// summary lists (0): invented ids come only that way, and must not crowd out the rest.
    fn priority(&self) -> u8 {
        if self.headed {
            2
        } else if self.vouched || self.listers.len() >= 2 {
            1
        } else {
            0
        }
    }

    /// The stranger whose summary alone asks for this blob, if it is priority 0.
    fn lone_lister(&self) -> Option<NodeId> {
        (self.priority() == 0)
            .then(|| self.listers.first().copied())
            .flatten()
    }
}

/// Why a blob is wanted (see [`Want::priority`]).
#[derive(Clone, Copy)]
enum Why {
    /// A held header names it.
    Header,
    /// This peer's summary lists it.
    Listed(NodeId),
}

#[derive(Default)]
struct Peer {
    score: u32,
    banned: bool,
    connected: bool,
    capabilities: u64,
    /// Local reputation from spot checks and copy detection (see `SECURITY.md`): +1 per
    /// passed check up to `REP_MAX`, −`REP_FAIL` per failure; at or below `REP_OFFENDER`
    /// this node leaves the peer's updates out of its summaries.
    rep: i32,
    checks: u32,
    passed: u32,
    /// The step in which this peer's first header or summary was accepted.
    first_step: Option<u64>,
    /// Applied steps that included one of this peer's updates (see [`Engine::known`]).
    included: u32,
}

const REP_MAX: i32 = 8;
const REP_FAIL: i32 = 3;
const REP_OFFENDER: i32 = -3;
/// Times one peer is served one blob (see [`Engine::serve_update_to`]).
pub const SERVES_PER_BLOB: u8 = 2;
/// Steps after this node's first sync in which a peer first heard from still counts as one it
/// knew then: a joiner hears only the summaries of peers active while it listens, and those of
/// the first steps after genesis arrive a step apart.
const KNOWN_GRACE_STEPS: u64 = 2;
/// Applied steps with one of a peer's updates in them after which a peer that arrived later
/// counts as known: a sustained, checked contribution rather than a one-off proof of work.
const KNOWN_AFTER_INCLUDED: u32 = 32;
/// Keys kept per update for copy detection (a consistent hash sample of its kept entries).
const SKETCH_KEYS: u64 = 1024;

/// The per-node protocol state machine. See the module docs.
pub struct Engine {
    run: RunConfig,
    run_id: RunId,
    rules: UpdateRules,
    me: Identity,
    me_id: NodeId,
    capabilities: u64,
    listen: Vec<String>,
    /// Peers this node accepts as first hops, if they announce [`caps::RELAY`] (the shell
    /// passes the bootstrap peers its operator chose): any peer can claim the capability.
    trusted_relays: BTreeSet<NodeId>,
    sync: SyncState,
    /// Parameter version (steps applied) and digest.
    version: u64,
    digest: Digest,
    applying: Option<u64>,
    /// When this engine started listening (summaries before it were never heard).
    since: u64,
    synced_at: u64,
    /// The step of this engine's first sync (genesis or a checkpoint): peers heard from by
    /// then are the ones it knew, whose digests may outvote its own. A later resync does not
    /// move it, or keys that showed up in the meantime would become voters by waiting.
    first_synced: Option<u64>,
    /// The step up to which penalty scores have decayed (see `prune`).
    decayed_at: u64,
    next_start: u64,
    next_summary: u64,
    steps: BTreeMap<u64, StepState>,
    /// (blob id, step) → the sender it is credited to. Keyed by step too: a degenerate update
    /// (all zeros, say) has the same bytes every step, and a step's set must not depend on
    /// which earlier step a node happened to see those bytes in.
    by_blob: BTreeMap<(ContentId, u64), NodeId>,
    wants: BTreeMap<ContentId, Want>,
    /// Priority-0 wants per summary sender (see `want`).
    lone: BTreeMap<NodeId, u32>,
    inflight: usize,
    peers: BTreeMap<NodeId, Peer>,
    /// version → reporter → digest, from summaries and hellos.
    attest: BTreeMap<u64, BTreeMap<NodeId, Digest>>,
    timer: Option<u64>,
    rng: u64,
    metrics: Metrics,
    /// This identity's proof of work for the run (0 when the run requires none).
    pow: u64,
}

/// Where an engine stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub synced: bool,
    pub version: u64,
    pub digest: Digest,
    pub applying: Option<u64>,
}

enum Via {
    Gossip,
    Fetch,
}

/// Either kind of equivocation proof, as [`Engine::on_proof`] handles both alike.
enum Proof {
    Headers(EquivocationProof),
    Summaries(SummaryEquivocation),
}

impl Engine {
    /// A node of `run`. With `genesis` (the digest of the seeded initial parameters) and a
    /// `now` before step 0 is applied, it starts synced at version 0; otherwise it joins.
    pub fn new(
        run: RunConfig,
        me: Identity,
        genesis: Option<Digest>,
        now: u64,
        rng_seed: u64,
    ) -> Engine {
        let run_id = run.run_id();
        let rules = UpdateRules::new(&run);
        let me_id = me.node_id();
        let t = &run.timing;
        let cur = t.step_at(now);
        let (sync, digest) = match genesis {
            Some(d) if now < t.apply_at(0) => (SyncState::Synced, d),
            _ => (
                SyncState::Joining {
                    requested: None,
                    loaded: None,
                },
                Digest::default(),
            ),
        };
        Engine {
            run_id,
            rules,
            me,
            me_id,
            capabilities: caps::TRAIN | caps::SERVE_BLOBS | caps::SERVE_CHECKPOINTS,
            listen: Vec::new(),
            trusted_relays: BTreeSet::new(),
            sync: sync.clone(),
            version: 0,
            digest,
            applying: None,
            since: now,
            synced_at: now,
            first_synced: (sync == SyncState::Synced).then_some(0),
            decayed_at: cur,
            next_start: if now < t.genesis_ms { 0 } else { cur },
            next_summary: if now <= t.publish_deadline(cur.saturating_sub(1)) {
                cur.saturating_sub(1)
            } else {
                cur
            },
            steps: BTreeMap::new(),
            by_blob: BTreeMap::new(),
            wants: BTreeMap::new(),
            lone: BTreeMap::new(),
            inflight: 0,
            peers: BTreeMap::new(),
            attest: BTreeMap::new(),
            timer: None,
            // splitmix64 needs any nonzero-ish state; mix the seed with our key so that nodes
            // seeded alike still spread their fetches.
            rng: rng_seed ^ u64::from_le_bytes(me_id.0[..8].try_into().expect("8 bytes")),
            metrics: Metrics::default(),
            pow: crypto::pow::solve(&run_id.0, &me_id, run.defence.pow_bits),
            run,
        }
    }

    /// Listen addresses and capabilities announced in Hello.
    pub fn set_listen(&mut self, listen: Vec<String>, capabilities: u64) {
        let l = &self.run.limits;
        self.listen = listen
            .into_iter()
            .take(l.max_listen_addrs as usize)
            .filter(|a| a.len() <= l.max_addr_len as usize)
            .collect();
        self.capabilities = capabilities;
    }

    /// The peers this node may use as first-hop relays (see [`caps::RELAY`]); at most two of
    /// them, connected and announcing the capability, are used.
    pub fn set_trusted_relays(&mut self, peers: impl IntoIterator<Item = NodeId>) {
        self.trusted_relays = peers.into_iter().take(16).collect();
    }

    pub fn node_id(&self) -> NodeId {
        self.me_id
    }
    /// This identity's proof of work for the run (0 when the run requires none).
    pub fn pow(&self) -> u64 {
        self.pow
    }
    pub fn run_id(&self) -> RunId {
        self.run_id
    }
    pub fn run(&self) -> &RunConfig {
        &self.run
    }
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }
    pub fn status(&self) -> Status {
        Status {
            synced: self.sync == SyncState::Synced,
            version: self.version,
            digest: self.digest,
            applying: self.applying,
        }
    }
    pub fn is_banned(&self, peer: &NodeId) -> bool {
        self.peers.get(peer).is_some_and(|p| p.banned)
    }
    pub fn score(&self, peer: &NodeId) -> u32 {
        self.peers.get(peer).map_or(0, |p| p.score)
    }

    /// The `Message::Update` frame for `blob`, if held and verified (the answer to a peer's
    /// fetch). Does not change state.
    pub fn serve_update(&self, blob: &ContentId) -> Option<Vec<u8>> {
        let ((_, step), sender) = self
            .by_blob
            .range((*blob, 0)..=(*blob, u64::MAX))
            .next_back()?;
        let e = self.steps.get(step)?.headers.get(sender)?;
        let b = e.blob.as_ref().filter(|_| !e.invalid)?;
        Some(
            Message::Update {
                header: e.header.clone(),
                blob: b.to_vec(),
            }
            .encode(),
        )
    }

    /// The answer to `peer`'s fetch of `blob`, as `serve_update`, within this node's serving
    /// budget: a peer gets each blob of a step at most [`SERVES_PER_BLOB`] times (an honest
    /// one fetches it once, twice after a lost response), so what one peer can draw per step
    /// is bounded by twice the step's blobs, however fast it asks; a step tracks at most
    /// `max_peers` requesters. The encoded frame is built once and shared. The node shell
    /// serves fetches only through this.
    pub fn serve_update_to(&mut self, peer: NodeId, blob: &ContentId) -> Option<Arc<[u8]>> {
        let (step, sender) = self
            .by_blob
            .range((*blob, 0)..=(*blob, u64::MAX))
            .next_back()
            .map(|((_, t), s)| (*t, *s))?;
        let max_peers = self.run.limits.max_peers as usize;
        let st = self.steps.get_mut(&step)?;
        let e = st.headers.get(&sender)?;
        let b = e.blob.clone().filter(|_| !e.invalid)?;
        if !st.served.contains_key(&peer) && st.served.len() >= max_peers {
            self.metrics.refused_serves += 1;
            return None;
        }
        let n = st.served.entry(peer).or_default().entry(*blob).or_default();
        if *n >= SERVES_PER_BLOB {
            self.metrics.refused_serves += 1;
            return None;
        }
        *n += 1;
        let e = st.headers.get_mut(&sender).expect("looked up above");
        if e.frame.is_none() {
            let f = Message::Update {
                header: e.header.clone(),
                blob: b.to_vec(),
            }
            .encode();
            e.frame = Some(f.into());
        }
        e.frame.clone()
    }

    /// The Hello frame this node sends on a new connection.
    pub fn hello(&self) -> Vec<u8> {
        Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            run: self.run_id,
            node: self.me_id,
            capabilities: self.capabilities,
            listen: self.listen.clone(),
            params_version: self.version,
            params_digest: self.digest,
        })
        .encode()
    }

    /// Process one event at time `now` (unix ms).
    pub fn handle(&mut self, ev: Event, now: u64) -> Vec<Action> {
        let mut out = Vec::new();
        match ev {
            Event::Message { from, tag, bytes } => {
                self.on_message(from, tag, &bytes, now, &mut out)
            }
            Event::Fetched { from, blob, bytes } => {
                self.on_fetched(from, blob, &bytes, now, &mut out)
            }
            Event::FetchFailed { from, blob } => self.fetch_failed(from, blob),
            Event::LocalUpdate { step, blob, tokens } => {
                self.on_local(step, blob, tokens, now, &mut out)
            }
            Event::Timer => {}
            Event::PeerConnected { peer } => {
                if let Some(p) = self.peer_mut(peer) {
                    p.connected = true;
                }
                if !self.is_banned(&peer) {
                    out.push(Action::Send {
                        peer,
                        bytes: self.hello(),
                    });
                }
            }
            Event::PeerGone { peer } => {
                if let Some(p) = self.peers.get_mut(&peer) {
                    p.connected = false;
                }
                let ids: Vec<ContentId> = self
                    .wants
                    .iter()
                    .filter(|(_, w)| w.inflight == Some(peer))
                    .map(|(id, _)| *id)
                    .collect();
                for id in ids {
                    self.fetch_failed(peer, id);
                }
            }
            Event::Applied { step, digest } => {
                if self.applying == Some(step) {
                    self.applying = None;
                    self.version = step + 1;
                    self.digest = digest;
                    self.prune(now, &mut out);
                    self.check_desync(&mut out);
                }
            }
            Event::CheckpointLoaded { version, digest } => {
                if let SyncState::Joining { loaded, .. } = &mut self.sync {
                    *loaded = Some((version, digest));
                }
            }
            Event::CheckpointFailed => {
                if let SyncState::Joining { requested, .. } = &mut self.sync {
                    *requested = None;
                }
            }
            Event::SpotChecked {
                step,
                sender,
                blob,
                gain,
            } => self.on_spot(step, sender, blob, gain, &mut out),
            Event::BadCheckpoint { from } => {
                self.blame(from, WireError::FalseCheckpoint, &mut out);
                if let SyncState::Joining { requested, .. } = &mut self.sync {
                    *requested = None;
                }
            }
        }
        self.tick(now, &mut out);
        self.pump(&mut out);
        self.schedule(now, &mut out);
        out
    }

    // -----------------------------------------------------------------------------------------
    // peers and penalties

    fn peer_mut(&mut self, id: NodeId) -> Option<&mut Peer> {
        // The table is bounded, and full it makes room: a table that kept its first comers
        // for good let 1,024 throwaway keys stop this node from banning (or rating) anyone
        // new. The one to go is a stranger with nothing to lose (see `evictable`), else a
        // disconnected banned key (the transport keeps its own blacklist of those).
        if !self.peers.contains_key(&id) && self.peers.len() >= self.run.limits.max_peers as usize {
            let victim = self
                .peers
                .iter()
                .find(|(p, e)| self.evictable(p, e))
                .or_else(|| self.peers.iter().find(|(_, e)| e.banned && !e.connected))
                .map(|(p, _)| *p)?;
            self.peers.remove(&victim);
            self.metrics.evicted_peers += 1;
        }
        Some(self.peers.entry(id).or_default())
    }

    /// A peer entry worth least: not connected, not banned, not a trusted relay, no passed
    /// check nor positive reputation, no penalty score, and not a peer whose digest votes
    /// (`known`).
    fn evictable(&self, p: &NodeId, e: &Peer) -> bool {
        !e.connected
            && !e.banned
            && e.score == 0
            && e.rep <= 0
            && e.passed == 0
            && !self.trusted_relays.contains(p)
            && !self.known(p)
    }

    fn blame(&mut self, peer: NodeId, error: WireError, out: &mut Vec<Action>) {
        let points = error.penalty();
        if points == 0 {
            self.metrics.ignored += 1;
            out.push(Action::Report(Report::Ignored { from: peer, error }));
            return;
        }
        self.metrics.rejected += 1;
        out.push(Action::Report(Report::Rejected {
            from: peer,
            error: error.clone(),
        }));
        if peer == self.me_id {
            return;
        }
        let ban_score = self.run.limits.ban_score;
        let ban = match self.peer_mut(peer) {
            Some(p) => {
                p.score = p.score.saturating_add(points);
                let ban = !p.banned && p.score >= ban_score;
                p.banned |= ban;
                ban
            }
            None => points >= ban_score,
        };
        out.push(Action::Penalize {
            peer,
            reason: error.clone(),
            points,
        });
        if ban {
            out.push(Action::Ban {
                peer,
                reason: error,
            });
            for w in self.wants.values_mut() {
                if let Some(i) = w.candidates.iter().position(|c| *c == peer) {
                    w.tried[i] = true;
                }
            }
        }
    }

    fn verdict(tag: Option<u64>, verdict: Verdict, out: &mut Vec<Action>) {
        if let Some(tag) = tag {
            out.push(Action::Verdict { tag, verdict });
        }
    }

    fn next_rand(&mut self) -> u64 {
        // splitmix64: tiny, seeded, and the same everywhere.
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    // -----------------------------------------------------------------------------------------
    // windows

    /// Oldest step still kept: older messages are replays.
    fn lo_step(&self, now: u64) -> u64 {
        let past = self.run.limits.past_steps as u64;
        match self.sync {
            SyncState::Synced => self.version.saturating_sub(past),
            SyncState::Joining { .. } => self.run.timing.step_at(now).saturating_sub(past + 2),
        }
    }

    fn hi_step(&self, now: u64) -> u64 {
        self.run.timing.step_at(now) + self.run.limits.future_steps as u64
    }

    fn in_window(&self, step: u64, now: u64) -> Result<(), WireError> {
        let (lo, hi) = (self.lo_step(now), self.hi_step(now));
        if step < lo || step > hi {
            return Err(WireError::StepOutOfWindow { step, lo, hi });
        }
        Ok(())
    }

    /// Whether step `step` is already applied (or being applied) here.
    fn closed(&self, step: u64) -> bool {
        self.sync == SyncState::Synced && (step < self.version || self.applying == Some(step))
    }

    // -----------------------------------------------------------------------------------------
    // messages

    fn on_message(
        &mut self,
        from: NodeId,
        tag: Option<u64>,
        bytes: &[u8],
        now: u64,
        out: &mut Vec<Action>,
    ) {
        self.metrics.messages += 1;
        if self.is_banned(&from) {
            Self::verdict(tag, Verdict::Ignore, out);
            return;
        }
        let msg = match Message::decode(bytes, &self.run.limits) {
            Ok(m) => m,
            Err(e) => {
                let v = if e.penalty() > 0 {
                    Verdict::Reject
                } else {
                    Verdict::Ignore
                };
                Self::verdict(tag, v, out);
                self.blame(from, e, out);
                return;
            }
        };
        match msg {
            Message::Hello(h) => self.on_hello(from, h, out),
            Message::Announce { header, blob } => {
                self.on_announce(from, tag, header, blob, now, out)
            }
            Message::Summary(s) => self.on_summary(from, tag, s, now, out),
            Message::Equivocation(p) => self.on_proof(from, tag, Proof::Headers(p), now, out),
            Message::SummaryEquivocation(p) => {
                self.on_proof(from, tag, Proof::Summaries(p), now, out)
            }
            Message::Accusation(a) => self.on_accusation(from, tag, a, now, out),
            Message::Update { header, blob }
                if tag.is_none() && self.capabilities & caps::RELAY != 0 =>
            {
                self.on_upload(from, header, blob, now, out)
            }
            other => {
                // Updates, manifests and chunks come as responses, never as gossip.
                Self::verdict(tag, Verdict::Reject, out);
                self.blame(from, WireError::UnexpectedKind { kind: other.kind() }, out);
            }
        }
    }

    fn on_hello(&mut self, from: NodeId, h: Hello, out: &mut Vec<Action>) {
        if h.node != from {
            return self.blame(
                from,
                WireError::IdentityMismatch {
                    claimed: h.node,
                    peer: from,
                },
                out,
            );
        }
        if h.run != self.run_id {
            return self.blame(from, WireError::WrongRun, out);
        }
        if h.version != PROTOCOL_VERSION {
            return self.blame(
                from,
                WireError::VersionMismatch {
                    got: h.version,
                    want: PROTOCOL_VERSION,
                },
                out,
            );
        }
        if let Some(p) = self.peer_mut(from) {
            p.connected = true;
            p.capabilities = h.capabilities;
        }
        // A Hello's parameter version and digest are a hint for operators, never a vote: a
        // Hello is neither signed over the run nor priced by proof of work, so counting it let
        // three throwaway keys declare a node desynced and hand it their parameters. Only
        // signed summaries attest (`add_attest`).
    }

    fn on_announce(
        &mut self,
        from: NodeId,
        tag: Option<u64>,
        header: Signed<UpdateHeader>,
        blob: Option<Vec<u8>>,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let (step, sender) = (header.body.step, header.body.sender);
        match self.accept_header(from, header, Via::Gossip, now, out) {
            Err((e, v)) => {
                Self::verdict(tag, v, out);
                return self.blame(from, e, out);
            }
            Ok(false) => {
                self.metrics.duplicates += 1;
                return Self::verdict(tag, Verdict::Ignore, out);
            }
            Ok(true) => {}
        }
        let id = self.steps[&step].headers[&sender].header.body.blob;
        match blob {
            Some(b) => {
                let ok = self.accept_blob(from, step, sender, b, out);
                Self::verdict(tag, if ok { Verdict::Accept } else { Verdict::Reject }, out);
            }
            None => {
                // Whoever relayed the header forwards only what it verified: after a first-hop
                // relay (see `sources`), ask it, then the sender.
                let added = self.want(id, step, Why::Header, &self.sources(from, sender), out);
                match (added, tag) {
                    (true, Some(t)) => self.wants.get_mut(&id).expect("just added").tags.push(t),
                    (false, _) => Self::verdict(tag, Verdict::Ignore, out),
                    _ => {}
                }
            }
        }
    }

    /// Check and store a header. `Ok(true)`: new; `Ok(false)`: already held. On error, the
    /// caller blames the relay; blame of the signer is done here.
    fn accept_header(
        &mut self,
        from: NodeId,
        header: Signed<UpdateHeader>,
        via: Via,
        now: u64,
        out: &mut Vec<Action>,
    ) -> Result<bool, (WireError, Verdict)> {
        let h = &header.body;
        let (step, sender) = (h.step, h.sender);
        if h.run != self.run_id {
            return Err((WireError::WrongRun, Verdict::Ignore));
        }
        self.in_window(step, now)
            .map_err(|e| (e, Verdict::Ignore))?;
        let late = match via {
            Via::Gossip => now > self.run.timing.publish_deadline(step),
            Via::Fetch => false,
        };
        if late || self.closed(step) {
            self.metrics.late += 1;
            return Err((WireError::Late { step }, Verdict::Ignore));
        }
        if self.is_banned(&sender) {
            return Err((WireError::Banned, Verdict::Ignore));
        }
        header.verify().map_err(|e| (e, Verdict::Reject))?;
        if let Err(e) = self.rules.check_header(h) {
            // Signed by the sender: its fault too.
            if sender != from {
                self.blame(sender, e.clone(), out);
            }
            return Err((e, Verdict::Reject));
        }
        let st = self.steps.entry(step).or_default();
        if st.equivocators.contains(&sender) {
            return Ok(false);
        }
        if let Some(prev) = st.headers.get(&sender) {
            if prev.header.raw == header.raw {
                return Ok(false);
            }
            // Two different validly signed headers: publish both as the proof, ban the sender.
            let proof = EquivocationProof::new(prev.header.clone(), header);
            st.equivocators.insert(sender);
            self.metrics.equivocations += 1;
            out.push(Action::Publish {
                bytes: Message::Equivocation(proof).encode(),
            });
            let e = WireError::Equivocation { sender, step };
            self.blame(sender, e, out);
            return Ok(false);
        }
        let occupants: Vec<NodeId> = st.headers.keys().copied().collect();
        let evict = self
            .slot(&occupants, sender, step)
            .ok_or((WireError::BufferFull("updates per step"), Verdict::Ignore))?;
        let l = &self.run.limits;
        let st = &self.steps[&step];
        if let Some(owner) = self.by_blob.get(&(h.blob, step)) {
            // Another sender already claimed this exact blob for this step (a copy): first
            // wins, unless that claim was shown false (its length contradicts the blob) or
            // its signer equivocated: then the slot goes to this header, so that a key which
            // re-signs an honest blob id cannot keep the honest header out.
            let void = st.headers.get(owner).is_none_or(|e| e.contradicted)
                || st.equivocators.contains(owner);
            if !void {
                return Err((WireError::Duplicate, Verdict::Ignore));
            }
        }
        let cur = self.run.timing.step_at(now);
        if step > cur {
            let early: usize = self
                .steps
                .range(cur + 1..)
                .map(|(_, s)| s.headers.len())
                .sum();
            if early >= l.max_early_updates as usize {
                return Err((WireError::BufferFull("early updates"), Verdict::Ignore));
            }
            self.metrics.early += 1;
        }
        if let Some(v) = evict {
            self.evict_header(step, v, out);
        }
        self.by_blob.insert((h.blob, step), sender);
        self.seen(sender, step);
        let st = self.steps.entry(step).or_default();
        st.headers.insert(
            sender,
            Entry {
                header,
                blob: None,
                invalid: false,
                sketch: Vec::new(),
                copy: false,
                contradicted: false,
                frame: None,
            },
        );
        Ok(true)
    }

    /// How much a peer's message in `step` is worth keeping when a per-step table is full:
    /// 2 for this node and a peer it knows (`known`), 1 for one first heard from in an earlier step,
    /// 0 for one first heard from now.
    fn standing(&self, peer: &NodeId, step: u64) -> u8 {
        if *peer == self.me_id || self.known(peer) {
            2
        } else if self
            .peers
            .get(peer)
            .and_then(|p| p.first_step)
            .is_some_and(|f| f < step)
        {
            1
        } else {
            0
        }
    }

    /// Whether `new` gets a slot among `occupants` (one step's headers or summaries, at most
    /// `max_updates_per_step`), and whom it displaces: `None` if refused, `Some(None)` if there
    /// is room, `Some(Some(victim))` to take the place of a peer of lower standing (the
    /// largest id among the lowest, so every node picks alike). Peers first heard from in this
    /// step hold at most half the slots: with first-come slots, 256 keys announcing early
    /// filled every node's table and training stopped, whatever the swarm's size.
    fn slot(&self, occupants: &[NodeId], new: NodeId, step: u64) -> Option<Option<NodeId>> {
        let max = self.run.limits.max_updates_per_step as usize;
        let mine = self.standing(&new, step);
        let levels: Vec<(u8, NodeId)> = occupants
            .iter()
            .map(|p| (self.standing(p, step), *p))
            .collect();
        if mine == 0 && levels.iter().filter(|(l, _)| *l == 0).count() >= (max / 2).max(1) {
            return None;
        }
        if occupants.len() < max {
            return Some(None);
        }
        levels
            .iter()
            .filter(|(l, p)| *l < mine && *p != self.me_id)
            .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
            .map(|(_, p)| Some(*p))
    }

    /// Drop `victim`'s header of `step` to make room (see `slot`).
    fn evict_header(&mut self, step: u64, victim: NodeId, out: &mut Vec<Action>) {
        let Some(e) = self
            .steps
            .get_mut(&step)
            .and_then(|st| st.headers.remove(&victim))
        else {
            return;
        };
        self.metrics.evicted_updates += 1;
        let id = e.header.body.blob;
        if self.by_blob.get(&(id, step)) == Some(&victim) {
            self.by_blob.remove(&(id, step));
        }
        let named = self
            .steps
            .values()
            .any(|st| st.headers.values().any(|x| x.header.body.blob == id));
        if !named {
            self.resolve_want(id, Verdict::Ignore, out);
        }
    }

    /// Validate and store the blob of a held header. Returns whether it was valid.
    fn accept_blob(
        &mut self,
        from: NodeId,
        step: u64,
        sender: NodeId,
        blob: Vec<u8>,
        out: &mut Vec<Action>,
    ) -> bool {
        let Some(e) = self
            .steps
            .get_mut(&step)
            .and_then(|s| s.headers.get_mut(&sender))
        else {
            return false;
        };
        let id = e.header.body.blob;
        if e.blob.is_some() || e.invalid {
            let ok = !e.invalid;
            self.resolve_want(id, if ok { Verdict::Accept } else { Verdict::Reject }, out);
            return ok;
        }
        match self.rules.check_blob(&e.header.body, &blob) {
            Ok(u) => {
                let blob: Arc<[u8]> = blob.into();
                e.blob = Some(blob.clone());
                let sk = if self.run.defence.copy_overlap_permille > 0 {
                    sketch(&u)
                } else {
                    Vec::new()
                };
                e.sketch = sk.clone();
                // Other headers of the step that name the same blob (exact copies) share one
                // want, so they get the bytes now or never: fill them too, each checked against
                // its own header.
                let twins: Vec<(u64, NodeId)> = self
                    .steps
                    .iter()
                    .flat_map(|(t, st)| {
                        st.headers
                            .iter()
                            .filter(|(_, e)| {
                                e.header.body.blob == id && e.blob.is_none() && !e.invalid
                            })
                            .map(move |(n, _)| (*t, *n))
                    })
                    .filter(|&(t, n)| (t, n) != (step, sender))
                    .collect();
                for (t, n) in &twins {
                    let st = self.steps.get_mut(t).expect("listed above");
                    let e = st.headers.get_mut(n).expect("listed above");
                    if self.rules.check_blob(&e.header.body, &blob).is_ok() {
                        e.blob = Some(blob.clone());
                        e.sketch = sk.clone();
                    }
                }
                self.resolve_want(id, Verdict::Accept, out);
                out.push(Action::Report(Report::Verified { step, sender }));
                self.detect_copy(step, sender, out);
                for (t, n) in twins {
                    self.detect_copy(t, n, out);
                }
                true
            }
            Err(err) => {
                // A blob that matches the signed id but is invalid is the sender's fault; one
                // that does not match the id is only the relay's. A length that differs from
                // the header's while the bytes hash to its id is the signer's: the id names
                // those bytes, so the header contradicts its own blob (a key re-signing an
                // honest id with a wrong length used to get honest servers banned).
                let contradicted =
                    matches!(err, WireError::BlobLength { .. }) && ContentId::of(&blob) == id;
                let signer_fault = contradicted
                    || !matches!(
                        err,
                        WireError::BlobIdMismatch { .. } | WireError::BlobLength { .. }
                    );
                if signer_fault {
                    e.invalid = true;
                    e.contradicted = contradicted;
                    self.resolve_want(id, Verdict::Reject, out);
                    self.blame(sender, err.clone(), out);
                }
                if from != sender || !signer_fault {
                    self.blame(from, err, out);
                }
                false
            }
        }
    }

    fn on_summary(
        &mut self,
        from: NodeId,
        tag: Option<u64>,
        s: Signed<StepSummary>,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let (step, sender) = (s.body.step, s.body.sender);
        let res = (|| {
            if s.body.run != self.run_id {
                return Err((WireError::WrongRun, Verdict::Ignore));
            }
            self.in_window(step, now)
                .map_err(|e| (e, Verdict::Ignore))?;
            if now > self.run.timing.apply_at(step) || self.closed(step) {
                self.metrics.late += 1;
                return Err((WireError::Late { step }, Verdict::Ignore));
            }
            if self.is_banned(&sender) {
                return Err((WireError::Banned, Verdict::Ignore));
            }
            if sender == self.me_id {
                return Err((WireError::Duplicate, Verdict::Ignore));
            }
            let st = self.steps.entry(step).or_default();
            if st.equivocators.contains(&sender)
                || st.summaries.get(&sender).is_some_and(|p| p.raw == s.raw)
            {
                // Cheap checks first: a copy of what is held costs no signature check.
                return Err((WireError::Duplicate, Verdict::Ignore));
            }
            s.verify().map_err(|e| (e, Verdict::Reject))?;
            if !crypto::pow::check(
                &self.run_id.0,
                &sender,
                s.body.pow,
                self.run.defence.pow_bits,
            ) {
                return Err((WireError::NoWork, Verdict::Reject));
            }
            let st = self.steps.entry(step).or_default();
            if st.summaries.contains_key(&sender) {
                return Err((WireError::Equivocation { sender, step }, Verdict::Ignore));
            }
            let occupants: Vec<NodeId> = st.summaries.keys().copied().collect();
            let evict = self
                .slot(&occupants, sender, step)
                .ok_or((WireError::BufferFull("summaries per step"), Verdict::Ignore))?;
            let st = self.steps.entry(step).or_default();
            if let Some(v) = evict {
                st.summaries.remove(&v);
                self.metrics.evicted_updates += 1;
            }
            st.summaries.insert(sender, s.clone());
            Ok(())
        })();
        if let Err((e, v)) = res {
            Self::verdict(tag, v, out);
            match e {
                WireError::Duplicate => self.metrics.duplicates += 1,
                WireError::Equivocation { .. } => {
                    // Two different validly signed summaries for one step. The sender's
                    // summary and updates are out of the step here, and the proof goes to
                    // everyone so that every node leaves out the same (SECURITY.md).
                    let st = self.steps.entry(step).or_default();
                    let prev = st.summaries.remove(&sender).expect("checked above");
                    st.equivocators.insert(sender);
                    self.metrics.equivocations += 1;
                    let frame =
                        Message::SummaryEquivocation(SummaryEquivocation::new(prev, s)).encode();
                    // Two summaries of a run whose summaries may be large can exceed a frame:
                    // then only this node knows (the digest vote repairs the rest).
                    if frame.len() <= self.run.limits.max_message_bytes as usize {
                        out.push(Action::Publish { bytes: frame });
                    }
                    self.blame(sender, e, out);
                }
                _ => self.blame(from, e, out),
            }
            return;
        }
        Self::verdict(tag, Verdict::Accept, out);
        self.seen(sender, step);
        self.add_attest(s.body.params_version, sender, s.body.params_digest, now);
        for id in &s.body.updates {
            let held = self
                .by_blob
                .get(&(*id, step))
                .and_then(|snd| self.steps.get(&step)?.headers.get(snd))
                .is_some_and(|e| e.blob.is_some() || (e.invalid && !e.contradicted));
            if !held {
                self.want(
                    *id,
                    step,
                    Why::Listed(sender),
                    &self.sources(sender, from),
                    out,
                );
            }
        }
        self.check_desync(out);
    }

    /// An equivocation proof (two headers or two summaries of one sender and step), from
    /// gossip. Cheap checks come before the two signature checks, and a proof is kept (and
    /// forwarded) only if it matters here: its sender sent this node something for the step,
    /// or the step has room for it. Fresh keys' proofs cost their maker one proof of work per
    /// key and nothing else; they must not fill tables (issue: item 6).
    fn on_proof(
        &mut self,
        from: NodeId,
        tag: Option<u64>,
        p: Proof,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let claims = match &p {
            Proof::Headers(p) => {
                let (a, b) = (&p.a.body, &p.b.body);
                if a.run != self.run_id || b.run != self.run_id {
                    Err(WireError::WrongRun)
                } else if a.sender != b.sender || a.step != b.step {
                    Err(WireError::BadProof("different senders or steps"))
                } else {
                    Ok((a.sender, a.step))
                }
            }
            Proof::Summaries(p) => {
                if p.a.body.run != self.run_id || p.b.body.run != self.run_id {
                    Err(WireError::WrongRun)
                } else {
                    p.claims()
                }
            }
        };
        let (sender, step) = match claims {
            Ok(x) => x,
            Err(e) => {
                let v = if e.penalty() > 0 {
                    Verdict::Reject
                } else {
                    Verdict::Ignore
                };
                Self::verdict(tag, v, out);
                return self.blame(from, e, out);
            }
        };
        let in_window = self.in_window(step, now).is_ok();
        let known_here = self.steps.get(&step).is_some_and(|st| {
            st.headers.contains_key(&sender) || st.summaries.contains_key(&sender)
        });
        let dup = self
            .steps
            .get(&step)
            .is_some_and(|st| st.equivocators.contains(&sender));
        if dup || (self.is_banned(&sender) && !known_here) {
            self.metrics.duplicates += 1;
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        let full = self.steps.get(&step).is_some_and(|st| {
            st.equivocators.len() >= self.run.limits.max_updates_per_step as usize
        });
        if !in_window && !self.peers.contains_key(&sender) {
            // Old news about a key this node never heard from: nothing to do.
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        if in_window && full && !known_here && !self.peers.contains_key(&sender) {
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        let verified = match &p {
            Proof::Headers(p) => p.verify(&self.run_id),
            Proof::Summaries(p) => p.verify(&self.run_id),
        };
        if let Err(e) = verified {
            let v = if e.penalty() > 0 {
                Verdict::Reject
            } else {
                Verdict::Ignore
            };
            Self::verdict(tag, v, out);
            return self.blame(from, e, out);
        }
        if in_window {
            let st = self.steps.entry(step).or_default();
            st.equivocators.insert(sender);
            st.summaries.remove(&sender);
            Self::verdict(tag, Verdict::Accept, out);
        } else {
            // Old news, but still a valid proof: the sender is banned regardless.
            Self::verdict(tag, Verdict::Ignore, out);
        }
        self.metrics.equivocations += 1;
        // Only keys already in the peer table are blamed: a proof about a stranger must not
        // add it there (1,024 such proofs used to fill the table for good).
        if !self.is_banned(&sender) && self.peers.contains_key(&sender) {
            self.blame(sender, WireError::Equivocation { sender, step }, out);
        }
    }

    fn on_fetched(
        &mut self,
        from: NodeId,
        blob: ContentId,
        bytes: &[u8],
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let Some(w) = self
            .wants
            .get_mut(&blob)
            .filter(|w| w.inflight == Some(from))
        else {
            // A response we did not ask for (or no longer need): do not even decode it.
            self.metrics.ignored += 1;
            return;
        };
        let want_step = w.step;
        w.inflight = None;
        self.inflight -= 1;
        let (header, data) = match Message::decode(bytes, &self.run.limits) {
            Ok(Message::Update { header, blob }) => (header, blob),
            Ok(other) => {
                return self.blame(from, WireError::UnexpectedKind { kind: other.kind() }, out)
            }
            Err(e) => return self.blame(from, e, out),
        };
        if header.body.blob != blob {
            return self.blame(
                from,
                WireError::BlobIdMismatch {
                    got: header.body.blob,
                    want: blob,
                },
                out,
            );
        }
        let (step, sender) = (header.body.step, header.body.sender);
        if ContentId::of(&data) == blob {
            // These are the bytes the id names: a held header of this step naming it with
            // another length lied, and the fetched header may take its slot.
            let liar = self
                .by_blob
                .get(&(blob, step))
                .copied()
                .filter(|o| *o != sender)
                .filter(|o| {
                    self.steps
                        .get(&step)
                        .and_then(|st| st.headers.get(o))
                        .is_some_and(|e| {
                            !e.invalid
                                && e.blob.is_none()
                                && e.header.body.blob_len != data.len() as u64
                        })
                });
            if let Some(o) = liar {
                let e = self
                    .steps
                    .get_mut(&step)
                    .and_then(|st| st.headers.get_mut(&o))
                    .expect("checked above");
                e.invalid = true;
                e.contradicted = true;
                let want = e.header.body.blob_len;
                self.blame(
                    o,
                    WireError::BlobLength {
                        got: data.len() as u64,
                        want,
                    },
                    out,
                );
            }
        }
        if let Err((e, _)) = self.accept_header(from, header, Via::Fetch, now, out) {
            let fatal = e.penalty() > 0;
            self.blame(from, e, out);
            if !fatal {
                // Several senders may sign the same blob (colluders, or a copier publishing an
                // exact copy): the server may answer with another signer's header, a duplicate
                // here. The bytes hash to the id we wanted, so they still fill the header we
                // hold; dropping them would leave this node short of a blob its peers list.
                match self.blob_owner(want_step, blob) {
                    Some((t, owner)) => {
                        self.accept_blob(from, t, owner, data, out);
                    }
                    None => self.resolve_want(blob, Verdict::Ignore, out),
                }
            }
            return;
        }
        // The header may be an equivocation (then not stored): only a stored one gets its blob.
        let stored = self
            .steps
            .get(&step)
            .and_then(|s| s.headers.get(&sender))
            .is_some_and(|e| e.header.body.blob == blob);
        if stored {
            self.accept_blob(from, step, sender, data, out);
        } else if let Some((t, owner)) = self.blob_owner(want_step, blob) {
            self.accept_blob(from, t, owner, data, out);
        } else {
            self.resolve_want(blob, Verdict::Ignore, out);
        }
    }

    /// A stored header that names blob `id` and still lacks it: of `step` (the want's) if
    /// any, else of another kept step (one want serves every header naming the id); lowest
    /// sender first, so the choice is the same on every node.
    fn blob_owner(&self, step: u64, id: ContentId) -> Option<(u64, NodeId)> {
        let lacking = |t: u64| {
            let st = self.steps.get(&t)?;
            st.headers
                .iter()
                .find(|(_, e)| e.header.body.blob == id && e.blob.is_none() && !e.invalid)
                .map(|(n, _)| (t, *n))
        };
        // The want's own step first, then every other step a header named this id in.
        lacking(step).or_else(|| {
            self.by_blob
                .range((id, 0)..=(id, u64::MAX))
                .filter(|((_, t), _)| *t != step)
                .find_map(|((_, t), _)| lacking(*t))
        })
    }

    fn fetch_failed(&mut self, from: NodeId, blob: ContentId) {
        if let Some(w) = self.wants.get_mut(&blob) {
            if w.inflight == Some(from) {
                w.inflight = None;
                self.inflight -= 1;
                self.metrics.fetch_failures += 1;
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // fetching

    /// Want `id` for `step`, from these candidates (in order of preference). Returns whether a
    /// want exists for it now. The queue is bounded, and full it keeps the wants of highest
    /// priority (`Want::priority`): a new want takes the place of a lower one not in flight.
    /// A single stranger's summary may hold at most `max_fetch_queue / 8` priority-0 wants:
    /// four summaries of invented ids used to fill the whole queue, leaving honest headers
    /// unfetched and nothing applied.
    fn want(
        &mut self,
        id: ContentId,
        step: u64,
        why: Why,
        from: &[NodeId],
        out: &mut Vec<Action>,
    ) -> bool {
        let l = &self.run.limits;
        let (max_q, max_c) = (l.max_fetch_queue as usize, l.max_fetch_candidates as usize);
        let per_lister = (max_q / 8).max(1) as u32;
        let vouch = match why {
            Why::Listed(p) => self.trusted_relays.contains(&p) || self.known(&p),
            Why::Header => false,
        };
        let who = from.first().copied().unwrap_or(self.me_id);
        let refuse = |out: &mut Vec<Action>, what| {
            out.push(Action::Report(Report::Ignored {
                from: who,
                error: WireError::BufferFull(what),
            }));
            false
        };
        let before = self.wants.get(&id).map(|w| (w.lone_lister(), w.priority()));
        let new = Want {
            step,
            candidates: Vec::new(),
            tried: Vec::new(),
            inflight: None,
            tags: Vec::new(),
            headed: matches!(why, Why::Header),
            listers: match why {
                Why::Listed(p) => vec![p],
                Why::Header => Vec::new(),
            },
            vouched: vouch,
        };
        match before {
            None => {
                if let Some(p) = new.lone_lister() {
                    if self.lone.get(&p).copied().unwrap_or(0) >= per_lister {
                        return refuse(out, "fetches asked by one summary");
                    }
                }
                if self.wants.len() >= max_q {
                    // Make room: the lowest-priority want not in flight, exhausted ones first.
                    let p = new.priority();
                    let victim = self
                        .wants
                        .iter()
                        .filter(|(_, w)| w.inflight.is_none() && w.priority() < p)
                        .min_by_key(|(_, w)| (w.priority(), !w.exhausted()))
                        .map(|(id, _)| *id);
                    match victim {
                        Some(v) => {
                            self.metrics.evicted_wants += 1;
                            self.resolve_want(v, Verdict::Ignore, out);
                        }
                        None => return refuse(out, "fetch queue"),
                    }
                }
                if let Some(p) = new.lone_lister() {
                    *self.lone.entry(p).or_default() += 1;
                }
                self.wants.insert(id, new);
            }
            Some((lone, _)) => {
                let w = self.wants.get_mut(&id).expect("present");
                match why {
                    Why::Header => w.headed = true,
                    Why::Listed(p) => {
                        if w.listers.len() < 2 && !w.listers.contains(&p) {
                            w.listers.push(p);
                        }
                    }
                }
                w.vouched |= vouch;
                let now_lone = w.lone_lister();
                if lone.is_some() && now_lone.is_none() {
                    self.unlone(lone);
                }
            }
        }
        let banned: Vec<bool> = from
            .iter()
            .map(|p| self.is_banned(p) || *p == self.me_id)
            .collect();
        let w = self.wants.get_mut(&id).expect("present");
        for (p, b) in from.iter().zip(banned) {
            if !b && !w.candidates.contains(p) && w.candidates.len() < max_c {
                w.candidates.push(*p);
                w.tried.push(false);
            }
        }
        true
    }

    /// One priority-0 want of `lister` fewer.
    fn unlone(&mut self, lister: Option<NodeId>) {
        if let Some(p) = lister {
            if let Some(c) = self.lone.get_mut(&p) {
                *c = c.saturating_sub(1);
                if *c == 0 {
                    self.lone.remove(&p);
                }
            }
        }
    }

    fn resolve_want(&mut self, id: ContentId, v: Verdict, out: &mut Vec<Action>) {
        if let Some(w) = self.wants.remove(&id) {
            self.unlone(w.lone_lister());
            if w.inflight.is_some() {
                self.inflight -= 1;
            }
            for t in w.tags {
                out.push(Action::Verdict { tag: t, verdict: v });
            }
        }
    }

    fn pump(&mut self, out: &mut Vec<Action>) {
        let max = self.run.limits.max_inflight_fetches as usize;
        // Highest priority first (see `Want::priority`), so that invented ids asked for by
        // one summary never keep the slots from blobs a held header names.
        let mut ids: Vec<(u8, ContentId)> = self
            .wants
            .iter()
            .filter(|(_, w)| w.inflight.is_none())
            .map(|(id, w)| (2 - w.priority(), *id))
            .collect();
        ids.sort_unstable();
        // One peer holds at most half the slots: a silent one (it never answers) used to hold
        // them all until the step was applied, asked for ids only it listed.
        let cap = (max / 2).max(1);
        let mut busy: BTreeMap<NodeId, usize> = BTreeMap::new();
        for w in self.wants.values() {
            if let Some(p) = w.inflight {
                *busy.entry(p).or_default() += 1;
            }
        }
        for (_, id) in ids {
            if self.inflight >= max {
                break;
            }
            let untried: Vec<usize> = {
                let w = &self.wants[&id];
                (0..w.candidates.len()).filter(|&i| !w.tried[i]).collect()
            };
            if untried.is_empty() {
                // Nobody left to ask: release the gossip verdicts.
                let w = self.wants.get_mut(&id).expect("present");
                for t in std::mem::take(&mut w.tags) {
                    out.push(Action::Verdict {
                        tag: t,
                        verdict: Verdict::Ignore,
                    });
                }
                continue;
            }
            // Preference order for the first try (the relay), random after that to spread load;
            // candidates at their cap wait for a later pump.
            let free: Vec<usize> = {
                let w = &self.wants[&id];
                untried
                    .iter()
                    .copied()
                    .filter(|&i| busy.get(&w.candidates[i]).copied().unwrap_or(0) < cap)
                    .collect()
            };
            if free.is_empty() {
                continue;
            }
            let first = self.wants[&id].tried.iter().all(|t| !t);
            let pick = if first && free[0] == 0 {
                0
            } else {
                free[(self.next_rand() % free.len() as u64) as usize]
            };
            let w = self.wants.get_mut(&id).expect("present");
            w.tried[pick] = true;
            let peer = w.candidates[pick];
            *busy.entry(peer).or_default() += 1;
            w.inflight = Some(peer);
            self.inflight += 1;
            self.metrics.fetches += 1;
            out.push(Action::Fetch { peer, blob: id });
        }
    }

    // -----------------------------------------------------------------------------------------
    // the local update

    fn on_local(&mut self, step: u64, blob: Vec<u8>, tokens: u64, now: u64, out: &mut Vec<Action>) {
        let refuse = |error, out: &mut Vec<Action>| {
            out.push(Action::Report(Report::LocalRefused { step, error }))
        };
        if self.sync != SyncState::Synced {
            return refuse(WireError::Checkpoint("not synced"), out);
        }
        if now > self.run.timing.publish_deadline(step) || self.closed(step) {
            return refuse(WireError::Late { step }, out);
        }
        if let Err(e) = self.in_window(step, now) {
            return refuse(e, out);
        }
        if self
            .steps
            .get(&step)
            .is_some_and(|s| s.headers.contains_key(&self.me_id))
        {
            // A second update for one step would be an equivocation: never sign one.
            return refuse(WireError::Duplicate, out);
        }
        let header = UpdateHeader {
            run: self.run_id,
            step,
            sender: self.me_id,
            blob: ContentId::of(&blob),
            blob_len: blob.len() as u64,
            codec: self.rules.codec,
            topk: self.rules.topk,
            chunk: self.rules.chunk,
            tokens,
            base_version: self.version,
            base_digest: self.digest,
            pow: self.pow,
        };
        let sketch = match self
            .rules
            .check_header(&header)
            .and_then(|_| self.rules.check_blob(&header, &blob))
        {
            Ok(u) => sketch(&u),
            Err(e) => return refuse(e, out),
        };
        let signed = Signed::sign(header, &self.me);
        // With a first-hop relay connected, upload the update to it once and let it gossip
        // the header and serve the blob (a slow uplink then carries each update once). Should
        // the relay withhold it, this node's own summary still lists the blob at the publish
        // deadline and peers fetch it from here: the update is late, never lost.
        let send = match self.relays().first() {
            Some(&peer) => {
                self.metrics.uploads += 1;
                let bytes = Message::Update {
                    header: signed.clone(),
                    blob: blob.clone(),
                };
                Action::Send {
                    peer,
                    bytes: bytes.encode(),
                }
            }
            None => {
                let inline = blob.len() <= self.run.limits.inline_blob_bytes as usize;
                let bytes = Message::Announce {
                    header: signed.clone(),
                    blob: inline.then(|| blob.clone()),
                };
                Action::Publish {
                    bytes: bytes.encode(),
                }
            }
        };
        self.by_blob.insert((signed.body.blob, step), self.me_id);
        self.steps.entry(step).or_default().headers.insert(
            self.me_id,
            Entry {
                header: signed,
                blob: Some(blob.into()),
                invalid: false,
                sketch,
                copy: false,
                contradicted: false,
                frame: None,
            },
        );
        out.push(send);
    }

    /// Where to fetch a blob from, in order: the first-hop relays (they gossip only headers
    /// whose blob they hold), then `first`, then `then`.
    fn sources(&self, first: NodeId, then: NodeId) -> Vec<NodeId> {
        let mut v = self.relays();
        v.extend([first, then]);
        v
    }

    /// Trusted peers that are connected and announced [`caps::RELAY`] (not banned, not this
    /// node), lowest id first so every node picks the same one; at most two, because each is
    /// asked first for every blob and a withholding one costs a failed fetch before the
    /// fallback.
    fn relays(&self) -> Vec<NodeId> {
        if self.capabilities & caps::RELAY != 0 {
            return Vec::new();
        }
        self.trusted_relays
            .iter()
            .filter(|n| {
                **n != self.me_id
                    && self.peers.get(n).is_some_and(|p| {
                        p.connected && !p.banned && p.capabilities & caps::RELAY != 0
                    })
            })
            .copied()
            .take(2)
            .collect()
    }

    /// A relay's side of an upload: `Message::Update` sent directly by its signer. Checked as a
    /// gossiped header with its blob (the same deadline, the same rules); once the blob checks
    /// out, the header alone is gossiped, and peers fetch the blob from here.
    fn on_upload(
        &mut self,
        from: NodeId,
        header: Signed<UpdateHeader>,
        blob: Vec<u8>,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let (step, sender) = (header.body.step, header.body.sender);
        if from != sender {
            // Only a signer uploads its own update; anything else is not for us to spread.
            self.metrics.ignored += 1;
            return;
        }
        match self.accept_header(from, header.clone(), Via::Gossip, now, out) {
            Err((e, _)) => return self.blame(from, e, out),
            Ok(false) => {
                self.metrics.duplicates += 1;
                return;
            }
            Ok(true) => {}
        }
        if self.accept_blob(from, step, sender, blob, out) {
            self.metrics.relayed += 1;
            out.push(Action::Publish {
                bytes: Message::Announce { header, blob: None }.encode(),
            });
        }
    }

    // -----------------------------------------------------------------------------------------
    // attestations, desync and joining

    fn add_attest(&mut self, version: u64, who: NodeId, digest: Digest, now: u64) {
        let cur = self.run.timing.step_at(now);
        let past = self.run.limits.past_steps as u64;
        // Only versions that can matter: around the current step, bounded on both sides.
        // Saturating: a peer's version is untrusted and may be u64::MAX (a debug-build panic).
        let future = self.run.limits.future_steps as u64 + 1;
        if version.saturating_add(past + 2) < cur || version > cur.saturating_add(future) {
            return;
        }
        let max = self.run.limits.max_peers as usize;
        let who_known = self.known(&who);
        // When the table is full a known peer takes the place of a stranger: first come must
        // not let a crowd of fresh keys keep the votes that count out.
        let evict = match self.attest.get(&version) {
            Some(m) if m.len() >= max && !m.contains_key(&who) => {
                if !who_known {
                    return;
                }
                match m.keys().rev().find(|p| !self.known(p)) {
                    Some(p) => Some(*p),
                    None => return,
                }
            }
            _ => None,
        };
        let m = self.attest.entry(version).or_default();
        if let Some(p) = evict {
            m.remove(&p);
        }
        m.insert(who, digest);
    }

    /// Whether `peer`'s digests count against this node's own: a peer it already heard from
    /// when it first synced (or within [`KNOWN_GRACE_STEPS`] after), one with a passed spot
    /// check or positive reputation, one whose updates were in [`KNOWN_AFTER_INCLUDED`]
    /// applied steps, or a trusted relay; never a banned one. A fresh key costs one proof of
    /// work: had strangers a vote, a handful of throwaway keys could declare a node desynced
    /// and hand it their parameters (SECURITY.md, "Forged models").
    fn known(&self, peer: &NodeId) -> bool {
        if *peer == self.me_id || self.is_banned(peer) {
            return false;
        }
        if self.trusted_relays.contains(peer) {
            return true;
        }
        let Some(start) = self.first_synced else {
            return false;
        };
        self.peers.get(peer).is_some_and(|p| {
            p.passed > 0
                || p.rep > 0
                || p.included >= KNOWN_AFTER_INCLUDED
                || p.first_step.is_some_and(|f| f <= start + KNOWN_GRACE_STEPS)
        })
    }

    /// The digest the swarm attests for `version` and who attests it, if any: a strict
    /// majority of the voters, and at least `attest_quorum` of them. The voters are the known
    /// peers (see [`Engine::known`]) when at least `attest_quorum` of them speak for
    /// `version`, and only otherwise every peer not banned: a node that knows nobody yet (a
    /// first-time joiner) has nothing better than numbers, which proof of work prices.
    fn swarm_digest(&self, version: u64) -> Option<(Digest, Vec<NodeId>)> {
        let m = self.attest.get(&version)?;
        let all: Vec<(&NodeId, &Digest)> = m
            .iter()
            .filter(|(p, _)| !self.is_banned(p) && **p != self.me_id)
            .collect();
        let known: Vec<(&NodeId, &Digest)> =
            all.iter().copied().filter(|(p, _)| self.known(p)).collect();
        let quorum = self.run.limits.attest_quorum as usize;
        let pool = if known.len() >= quorum { known } else { all };
        let mut tally: BTreeMap<Digest, Vec<NodeId>> = BTreeMap::new();
        for (p, d) in &pool {
            tally.entry(**d).or_default().push(**p);
        }
        tally
            .into_iter()
            .filter(|(_, who)| who.len() >= quorum && 2 * who.len() > pool.len())
            .max_by(|a, b| a.1.len().cmp(&b.1.len()).then(b.0.cmp(&a.0)))
    }

    fn check_desync(&mut self, out: &mut Vec<Action>) {
        if self.sync != SyncState::Synced || self.applying.is_some() {
            return;
        }
        let Some(m) = self.attest.get(&self.version) else {
            return;
        };
        // Only known peers outvote this node, and only as a strict majority of the known
        // peers speaking for this version with this node counted on its own side: strangers
        // (fresh keys) never do, however many.
        let mut tally: BTreeMap<Digest, u32> = BTreeMap::new();
        let mut voters = 1u32;
        for (p, d) in m {
            if self.known(p) {
                voters += 1;
                *tally.entry(*d).or_default() += 1;
            }
        }
        // Largest count wins; ties go to the smaller digest (any fixed rule will do).
        let best = tally
            .iter()
            .filter(|(d, _)| **d != self.digest)
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)));
        if let Some((d, &c)) = best {
            if c >= self.run.limits.attest_quorum && 2 * c > voters {
                self.metrics.desyncs += 1;
                out.push(Action::Report(Report::Desync {
                    version: self.version,
                    mine: self.digest,
                    majority: *d,
                }));
                self.sync = SyncState::Joining {
                    requested: None,
                    loaded: None,
                };
            }
        }
    }

    fn tick_joining(&mut self, now: u64, out: &mut Vec<Action>) {
        let SyncState::Joining { requested, loaded } = self.sync.clone() else {
            return;
        };
        if let Some((v, d)) = loaded {
            // Only summaries heard in full count: a version whose summaries went out before
            // this node listened has an incomplete tally here.
            let verdict = (self.run.timing.publish_deadline(v) > self.since)
                .then(|| self.swarm_digest(v))
                .flatten();
            if verdict.as_ref().is_some_and(|(vd, _)| *vd == d) {
                self.sync = SyncState::Synced;
                self.version = v;
                self.digest = d;
                self.synced_at = now;
                if self.first_synced.is_none() {
                    self.first_synced = Some(self.run.timing.step_at(now));
                }
                self.next_start = self.run.timing.step_at(now).max(self.next_start);
                out.push(Action::Report(Report::Synced {
                    version: v,
                    digest: d,
                }));
                return;
            }
            if verdict.is_some() {
                // The swarm attests another digest for this version: what was loaded is not
                // the swarm's model, whoever served it. Never train on it; ask again.
                out.push(Action::Report(Report::CheckpointUnattested {
                    version: v,
                    digest: d,
                }));
                self.sync = SyncState::Joining {
                    requested: None,
                    loaded: None,
                };
                return;
            }
            let newest = self.attest.keys().next_back().copied().unwrap_or(0);
            // Past the furthest version `add_attest` keeps, nobody can ever attest it: a
            // far-future (or u64::MAX) version would otherwise hold the joiner forever.
            let beyond = self
                .run
                .timing
                .step_at(now)
                .saturating_add(self.run.limits.future_steps as u64 + 1);
            if newest > v.saturating_add(self.run.limits.past_steps as u64) || v > beyond {
                // Nobody attests it and the run has moved on: ask again.
                out.push(Action::Report(Report::CheckpointUnattested {
                    version: v,
                    digest: d,
                }));
                self.sync = SyncState::Joining {
                    requested: None,
                    loaded: None,
                };
            }
            return;
        }
        if requested.is_some() {
            return;
        }
        // The newest version whose summaries we heard and for which the swarm attests a
        // digest (`swarm_digest`); its attesters serve the checkpoint.
        let mut best: Option<(u64, Vec<NodeId>)> = None;
        for &v in self.attest.keys().rev() {
            if self.run.timing.publish_deadline(v) <= self.since {
                break;
            }
            if let Some((_, who)) = self.swarm_digest(v) {
                best = Some((v, who));
                break;
            }
        }
        if let Some((v, mut peers)) = best {
            // Spread checkpoint load: rotate the list by a seeded amount.
            let n = peers.len();
            let r = (self.next_rand() % n as u64) as usize;
            peers.rotate_left(r);
            self.sync = SyncState::Joining {
                requested: Some(v),
                loaded: None,
            };
            out.push(Action::RequestCheckpoint {
                min_version: v,
                peers,
            });
        }
    }

    // -----------------------------------------------------------------------------------------
    // content defences: reputation, spot checks, copies, probation

    /// Note the first step in which `peer` was heard from (for probation).
    fn seen(&mut self, peer: NodeId, step: u64) {
        if let Some(p) = self.peer_mut(peer) {
            if p.first_step.is_none_or(|f| step < f) {
                p.first_step = Some(step);
            }
        }
    }

    /// Whether `peer` is on probation here: first heard from more than `probation_steps`
    /// after this node synced (nodes present from the start vouch for each other), and not
    /// yet past a spot check.
    fn on_probation(&self, peer: &NodeId) -> bool {
        let d = &self.run.defence;
        if d.probation_steps == 0 || *peer == self.me_id {
            return false;
        }
        let start = self.run.timing.step_at(self.synced_at);
        self.peers.get(peer).is_none_or(|p| {
            p.passed == 0
                && p.first_step
                    .is_none_or(|f| f > start + d.probation_steps as u64)
        })
    }

    /// Whether this node lists `sender`'s update of `step` in its summary.
    fn listable(&self, sender: NodeId, copy: bool, _step: u64) -> bool {
        if sender == self.me_id {
            return true;
        }
        if copy {
            return false;
        }
        if self
            .peers
            .get(&sender)
            .is_some_and(|p| p.rep <= REP_OFFENDER)
        {
            return false;
        }
        !self.on_probation(&sender)
    }

    /// Sample up to `spot_checks` of the step's updates from others: peers on probation first,
    /// then the least checked (ties broken by the seeded generator), so every peer is checked
    /// regularly and newcomers quickly.
    fn spot_checks(
        &mut self,
        step: u64,
        held: &[(NodeId, ContentId, bool)],
        out: &mut Vec<Action>,
    ) {
        let c = self.run.defence.spot_checks as usize;
        if c == 0 {
            return;
        }
        let mut cand: Vec<(bool, u32, u64, NodeId, ContentId)> = Vec::new();
        let done = self
            .steps
            .get(&step)
            .map(|s| s.checked.clone())
            .unwrap_or_default();
        for &(snd, id, _) in held {
            if snd == self.me_id || done.contains(&snd) {
                continue;
            }
            let checks = self.peers.get(&snd).map_or(0, |p| p.checks);
            let r = self.next_rand();
            cand.push((!self.on_probation(&snd), checks, r, snd, id));
        }
        cand.sort();
        for &(_, _, _, snd, id) in cand.iter().take(c) {
            self.check(step, snd, id, out);
        }
    }

    /// Ask the trainer to spot-check `sender`'s update `id` of `step`, once per step. Returns
    /// whether a check was asked for.
    fn check(&mut self, step: u64, sender: NodeId, id: ContentId, out: &mut Vec<Action>) -> bool {
        let Some(st) = self.steps.get_mut(&step) else {
            return false;
        };
        let Some((b, tokens)) = st
            .headers
            .get(&sender)
            .filter(|e| e.header.body.blob == id)
            .and_then(|e| Some((e.blob.clone()?, e.header.body.tokens)))
        else {
            return false;
        };
        if !st.checked.insert(sender) {
            return false;
        }
        self.metrics.spot_checks += 1;
        if let Some(p) = self.peer_mut(sender) {
            p.checks += 1;
        }
        out.push(Action::SpotCheck {
            step,
            sender,
            blob: id,
            tokens,
            bytes: Blob(b),
        });
        true
    }

    /// Someone's spot check failed: repeat it here (see `Defence::accuse`). The accusation is
    /// forwarded if it is well-formed and the first of its accuser for the step; it proves
    /// nothing by itself, so it never lowers anyone's reputation directly.
    fn on_accusation(
        &mut self,
        from: NodeId,
        tag: Option<u64>,
        a: Signed<Accusation>,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let (step, accuser, accused) = (a.body.step, a.body.accuser, a.body.accused);
        if !self.run.defence.accuse || a.body.run != self.run_id {
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        if let Err(e) = self.in_window(step, now) {
            Self::verdict(tag, Verdict::Ignore, out);
            return self.blame(from, e, out);
        }
        if self.is_banned(&accuser) || accuser == accused {
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        // Cheap checks before the signature. An accusation is not priced: only a peer this
        // node has heard a signed, priced header or summary from may accuse (an honest accuser
        // is a synced trainer that summarizes every step), one accusation per accuser and step
        // counts, and a step holds at most `max_updates_per_step` accusers. Fresh keys cannot
        // fill the store nor spend this node's checks.
        let heard = self
            .peers
            .get(&accuser)
            .is_some_and(|p| p.first_step.is_some());
        let max = self.run.limits.max_updates_per_step as usize;
        let held = self.steps.get(&step).map_or(0, |st| st.accusers.len());
        if !heard
            || held >= max
            || self
                .steps
                .get(&step)
                .is_some_and(|st| st.accusers.contains(&accuser))
        {
            // The rest are not forwarded.
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        if let Err(e) = a.verify() {
            Self::verdict(tag, Verdict::Reject, out);
            return self.blame(from, e, out);
        }
        let budget = 2 * self.run.defence.spot_checks;
        let st = self.steps.entry(step).or_default();
        st.accusers.insert(accuser);
        Self::verdict(tag, Verdict::Accept, out);
        let synced = self.sync == SyncState::Synced;
        if accused != self.me_id && synced && st.repeats < budget {
            if self.check(step, accused, a.body.blob, out) {
                self.steps.get_mut(&step).expect("entered above").repeats += 1;
                self.metrics.repeated_checks += 1;
            }
        }
    }

    fn on_spot(
        &mut self,
        step: u64,
        sender: NodeId,
        blob: ContentId,
        gain: f64,
        out: &mut Vec<Action>,
    ) {
        if sender == self.me_id {
            return;
        }
        // Helped on its own data: earned. Otherwise (no better, or worse, or not a number) a
        // strike; a persistent offender's strikes add up to a ban through the penalty score.
        let ok = gain > 0.0;
        let rep = match self.peer_mut(sender) {
            Some(p) => {
                if ok {
                    p.passed += 1;
                    p.rep = (p.rep + 1).min(REP_MAX);
                } else {
                    p.rep -= REP_FAIL;
                }
                p.rep
            }
            None => return,
        };
        out.push(Action::Report(Report::SpotResult {
            sender,
            step,
            gain,
            reputation: rep,
        }));
        if !ok {
            self.metrics.spot_failures += 1;
            if self.run.defence.accuse && self.sync == SyncState::Synced {
                let a = Accusation {
                    run: self.run_id,
                    step,
                    accuser: self.me_id,
                    accused: sender,
                    blob,
                };
                // Counted as heard here, so our own accusation coming back is not forwarded.
                self.steps
                    .entry(step)
                    .or_default()
                    .accusers
                    .insert(self.me_id);
                out.push(Action::Publish {
                    bytes: Message::Accusation(Signed::sign(a, &self.me)).encode(),
                });
            }
            if rep <= REP_OFFENDER {
                self.blame(sender, WireError::HarmfulUpdate, out);
            }
        }
    }

    /// Compare the newest update of `sender` in `step` with the others held for the step;
    /// if it overlaps one of them beyond the threshold, it is the later one: a copy.
    fn detect_copy(&mut self, step: u64, sender: NodeId, out: &mut Vec<Action>) {
        let th = self.run.defence.copy_overlap_permille;
        if th == 0 {
            return;
        }
        let Some(st) = self.steps.get(&step) else {
            return;
        };
        let Some(me) = st.headers.get(&sender) else {
            return;
        };
        let mut hit = None;
        for (other, e) in &st.headers {
            if *other == sender || e.sketch.is_empty() || e.invalid || e.copy {
                continue;
            }
            let o = overlap_permille(&me.sketch, &e.sketch);
            if o >= th {
                hit = Some((*other, o));
                break;
            }
        }
        if let Some((of, o)) = hit {
            if let Some(e) = self
                .steps
                .get_mut(&step)
                .and_then(|s| s.headers.get_mut(&sender))
            {
                e.copy = true;
            }
            self.metrics.copies += 1;
            out.push(Action::Report(Report::CopySuspected {
                sender,
                of,
                step,
                overlap_permille: o,
            }));
            if sender != self.me_id {
                if let Some(p) = self.peer_mut(sender) {
                    p.rep -= REP_FAIL;
                }
                self.blame(sender, WireError::Copy, out);
            }
        }
    }

    /// The digest the swarm attests for `version` (see `swarm_digest`: a strict majority of the
    /// known peers, or of all peers while too few known ones speak), if any: what a joiner
    /// checks a served checkpoint's manifest against.
    pub fn attested_digest(&self, version: u64) -> Option<Digest> {
        self.swarm_digest(version).map(|(d, _)| d)
    }

    /// This peer's local reputation (spot checks and copies; 0 = unknown).
    pub fn reputation(&self, peer: &NodeId) -> i32 {
        self.peers.get(peer).map_or(0, |p| p.rep)
    }

    // -----------------------------------------------------------------------------------------
    // the clock

    fn tick(&mut self, now: u64, out: &mut Vec<Action>) {
        self.tick_joining(now, out);
        // While joining nothing is applied, so the window moves with the clock: prune here too.
        if self.sync != SyncState::Synced {
            self.prune(now, out);
        }
        let t = self.run.timing.clone();
        let synced = self.sync == SyncState::Synced;
        // Step starts: only the current one (a node that slept skips what it missed).
        if synced && now >= t.genesis_ms {
            let cur = t.step_at(now);
            if cur >= self.next_start {
                self.next_start = cur + 1;
                out.push(Action::StartStep {
                    step: cur,
                    base_version: self.version,
                });
            }
        }
        // Summaries at each publish deadline.
        while now >= t.publish_deadline(self.next_summary) {
            let step = self.next_summary;
            self.next_summary += 1;
            let st = self.steps.entry(step).or_default();
            let held: Vec<(NodeId, ContentId, bool)> = st
                .headers
                .iter()
                .filter(|(s, e)| e.blob.is_some() && !e.invalid && !st.equivocators.contains(*s))
                .map(|(s, e)| (*s, e.header.body.blob, e.copy))
                .collect();
            // What this node vouches for: not what its own checks condemned (see `listable`).
            let mut ids: Vec<ContentId> = Vec::with_capacity(held.len());
            for &(snd, id, copy) in &held {
                if self.listable(snd, copy, step) {
                    ids.push(id);
                } else {
                    self.metrics.withheld += 1;
                }
            }
            // Exact copies share one id: a summary lists each id once (strictly ascending).
            ids.sort();
            ids.dedup();
            if synced {
                self.spot_checks(step, &held, out);
            }
            // Our own view counts toward inclusion only if others heard it too: a summary that
            // was never published (while joining, or after sleeping past apply time) would let
            // this node include what nobody else does.
            if synced && now <= t.apply_at(step) {
                self.steps.entry(step).or_default().mine = Some(ids.clone());
                let s = StepSummary {
                    run: self.run_id,
                    step,
                    sender: self.me_id,
                    updates: ids,
                    params_version: self.version,
                    params_digest: self.digest,
                    pow: self.pow,
                };
                out.push(Action::Publish {
                    bytes: Message::Summary(Signed::sign(s, &self.me)).encode(),
                });
            }
        }
        // Apply the next step once its time has come and what the summaries list is here (or
        // can no longer be had).
        if self.sync == SyncState::Synced && self.applying.is_none() {
            let step = self.version;
            if now >= t.apply_at(step) {
                let hard = t.apply_at(step).max(self.synced_at) + t.grace_ms;
                let majority = self.run.defence.majority;
                let st = self.steps.entry(step).or_default();
                // Votes per blob id: one per summary (ours included when it was published).
                let mut votes: BTreeMap<ContentId, u32> = BTreeMap::new();
                let mut voters = 0u32;
                if let Some(m) = &st.mine {
                    voters += 1;
                    for id in m {
                        *votes.entry(*id).or_default() += 1;
                    }
                }
                for (p, s) in &st.summaries {
                    if !self.peers.get(p).is_some_and(|x| x.banned) {
                        voters += 1;
                        for id in &s.body.updates {
                            *votes.entry(*id).or_default() += 1;
                        }
                    }
                }
                // Union (any summary suffices), or with `Defence::majority` more than half of
                // the summaries: then a hostile minority can neither push its own updates in
                // nor keep honest ones out.
                let before = votes.len() as u64;
                let listed: BTreeSet<ContentId> = votes
                    .into_iter()
                    .filter(|&(_, v)| !majority || 2 * v > voters)
                    .map(|(id, _)| id)
                    .collect();
                self.metrics.outvoted += before - listed.len() as u64;
                let mut included = Vec::new();
                let mut missing = 0u32;
                let mut waiting = false;
                for id in &listed {
                    let e = self
                        .by_blob
                        .get(&(*id, step))
                        .and_then(|snd| st.headers.get(snd).map(|e| (snd, e)));
                    match e {
                        Some((snd, e)) if e.blob.is_some() && !e.invalid => {
                            if !st.equivocators.contains(snd) {
                                included.push(Included {
                                    blob: *id,
                                    sender: *snd,
                                    tokens: e.header.body.tokens,
                                    bytes: Blob(e.blob.clone().expect("checked")),
                                });
                            }
                        }
                        Some((_, e)) if e.invalid => {}
                        _ => {
                            missing += 1;
                            waiting |= self.wants.get(id).is_some_and(|w| !w.exhausted());
                        }
                    }
                }
                if !waiting || now >= hard {
                    let n = included.len() as u32;
                    for u in &included {
                        if let Some(p) = self.peers.get_mut(&u.sender) {
                            p.included = p.included.saturating_add(1);
                        }
                    }
                    self.metrics.steps_applied += 1;
                    self.metrics.updates_applied += n as u64;
                    self.applying = Some(step);
                    out.push(Action::Report(Report::StepApplied {
                        step,
                        included: n,
                        listed: listed.len() as u32,
                        missing,
                    }));
                    out.push(Action::Apply {
                        step,
                        updates: included,
                    });
                    let stale: Vec<ContentId> = self
                        .wants
                        .iter()
                        .filter(|(_, w)| w.step <= step)
                        .map(|(id, _)| *id)
                        .collect();
                    for id in stale {
                        self.resolve_want(id, Verdict::Ignore, out);
                    }
                }
            }
        }
    }

    /// Drop what is older than the kept window.
    fn prune(&mut self, now: u64, out: &mut Vec<Action>) {
        // Penalty scores decay, one step at a time: small penalties an honest peer collects
        // now and then (skew, a lost race) must not add up to a ban over a long run. A peer
        // that keeps offending outpaces the decay; a ban itself is for good.
        let cur = self.run.timing.step_at(now);
        if cur > self.decayed_at {
            let steps = (cur - self.decayed_at).min(64) as u32;
            self.decayed_at = cur;
            for p in self.peers.values_mut().filter(|p| !p.banned) {
                for _ in 0..steps {
                    p.score = p.score.saturating_sub((p.score / 16).max(1));
                }
            }
        }
        let lo = self.lo_step(now);
        let keep = self.steps.split_off(&lo);
        let old = std::mem::replace(&mut self.steps, keep);
        for (k, st) in &old {
            for e in st.headers.values() {
                self.by_blob.remove(&(e.header.body.blob, *k));
            }
        }
        let stale: Vec<ContentId> = self
            .wants
            .iter()
            .filter(|(_, w)| w.step < lo)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.resolve_want(id, Verdict::Ignore, out);
        }
        let alo = self
            .run
            .timing
            .step_at(now)
            .saturating_sub(self.run.limits.past_steps as u64 + 2)
            .min(lo);
        self.attest = self.attest.split_off(&alo);
    }

    fn schedule(&mut self, now: u64, out: &mut Vec<Action>) {
        let t = &self.run.timing;
        let mut at = t.publish_deadline(self.next_summary);
        if self.sync == SyncState::Synced {
            at = at.min(t.step_start(self.next_start));
            if self.applying.is_none() {
                let a = t.apply_at(self.version);
                // While waiting on fetches past apply time, wake at the hard deadline.
                at = at.min(if a <= now {
                    a.max(self.synced_at) + t.grace_ms
                } else {
                    a
                });
            }
        }
        if at > now && self.timer != Some(at) {
            self.timer = Some(at);
            out.push(Action::SetTimer { at });
        }
    }
}

/// A consistent hash sample of an update's kept (tensor, block, index, sign) entries: the same
/// entry is kept in every update's sample, so two samples' overlap estimates the overlap of the
/// updates (about `SKETCH_KEYS` keys, whatever the model size).
fn sketch(u: &crate::sparse::SparseUpdate) -> Vec<u64> {
    let total: u64 = u
        .tensors
        .iter()
        .map(|t| t.entries(u.codec).0.len() as u64)
        .sum();
    let limit = if total <= SKETCH_KEYS {
        u64::MAX
    } else {
        (u64::MAX / total).saturating_mul(SKETCH_KEYS)
    };
    let mut keys = Vec::new();
    for (ti, t) in u.tensors.iter().enumerate() {
        let k = (t.k as usize).max(1);
        let (idx, val) = t.entries(u.codec);
        for (j, (&i, &v)) in idx.iter().zip(&val).enumerate() {
            let raw = ((ti as u64) << 48)
                ^ (((j / k) as u64) << 20)
                ^ ((i as u64) << 1)
                ^ (v.is_sign_negative() as u64);
            let h = mix64(raw);
            if h <= limit {
                keys.push(h);
            }
        }
    }
    keys.sort_unstable();
    keys.dedup();
    keys
}

fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Common keys of two sorted samples, in ‰ of the smaller.
fn overlap_permille(a: &[u64], b: &[u64]) -> u32 {
    let (mut i, mut j, mut n) = (0, 0, 0u64);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let d = a.len().min(b.len()).max(1) as u64;
    (n * 1000 / d) as u32
}
