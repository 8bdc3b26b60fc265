//! The sans-IO engine that runs rounds without a coordinator.
//!
//! `Engine::handle(event, now) -> Vec<Action>`: time comes in as `now` (unix ms), randomness as
//! a seed at construction, and every map is a `BTreeMap`, so one sequence of events gives one
//! sequence of actions, byte for byte, on any machine. The network shell (node/) and the
//! simulator (sim/) turn actions into I/O and I/O into events.
//!
//! Time out is asked for, not announced, as in quinn-proto's `Connection`: after each `handle`
//! the driver calls `Engine::poll_timeout()` and arms its one timer to that instant (unix ms),
//! calling `handle(Event::Timer, at)` when it comes. `None` means nothing is due; an answer
//! never lies before the `now` of the last `handle`. Extra `Timer` events are harmless.
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
//!   listening for (`sync::swarm_digest`), downloads a checkpoint of at least that version
//!   from its attesters (`Action::Request`: manifests, then chunks, verified one by one),
//!   has it loaded (`Action::LoadCheckpoint`), and catches up by applying the following steps
//!   from the summaries it collected. A loaded checkpoint whose digest the swarm contradicts
//!   is dropped at once. Synced nodes serve the checkpoints they hold (`Event::Requested`).
//!
//! # The parts
//! `Engine` is one state (this file: its fields, the events and actions, `handle`; its settings
//! and accessors are in `access`) driven by parts that each own one concern, the way
//! iroh-gossip's topic state owns its layers:
//! * `accept`: a message from a peer: hello, header, blob, summary; what is credited to whom.
//! * `fetch`: which blobs are wanted, from whom, in what order; serving them to peers.
//! * `round`: the step windows, the node's own update and the clock (apply, summaries, timer).
//! * `defence`: equivocation proofs, spot checks, accusations, copies, probation, reputation.
//! * `peers`: the peer table, penalties and bans, the Hello this node sends.
//! * `sync`: attestations, desync detection and joining: which checkpoint to ask for, from
//!   whom, the download itself (`sync::download`), liars and back-off; serving checkpoints
//!   (`sync::serve`).
//!
//! The parts are `impl Engine` blocks over the same fields (no part owns a copy of another's
//! state, so no two copies can disagree); what one part calls in another is `pub(super)`.

mod accept;
mod access;
mod defence;
mod fetch;
mod peers;
mod report;
mod round;
mod sync;
mod tally;
use tally::Tally;

use defence::sketch;
use fetch::{Want, Why};
use peers::Peer;
use sync::{Checkpoints, SyncState};

pub use access::Status;
pub use report::{Metrics, Report};

use download::Request;
pub use sync::{download, KEEP_SNAPSHOTS};

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use crypto::{ContentId, Digest, Identity, NodeId};

use crate::error::Offence;
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
    /// The instant given by [`Engine::poll_timeout`] came (any extra call is harmless).
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
    /// The answer to [`Action::LoadCheckpoint`] (or, unasked, a checkpoint the shell resumed
    /// from disk): the trainer holds `version`, whose parameter digest it computed as `digest`.
    CheckpointLoaded {
        version: u64,
        digest: Digest,
    },
    /// The trainer could not load what [`Action::LoadCheckpoint`] gave it.
    CheckpointFailed,
    /// The answer to [`Action::Request`]; empty bytes mean "not here".
    Response {
        peer: NodeId,
        req: Request,
        bytes: Vec<u8>,
    },
    /// [`Action::Request`] got no answer (timeout, refused, disconnected).
    RequestFailed {
        peer: NodeId,
        req: Request,
    },
    /// `peer` asks this node for a checkpoint manifest or chunk; answer it as the engine says
    /// with the same `token` ([`Action::Respond`] or [`Action::ServeChunk`]).
    Requested {
        peer: NodeId,
        token: u64,
        req: Request,
    },
    /// The shell holds a snapshot of the parameters (`manifest`, built by
    /// `download::manifest_of` from its bytes) and can read chunks of it: the engine signs and
    /// serves it while it is among the newest few.
    Snapshot {
        manifest: crate::checkpoint::CheckpointManifest,
    },
    /// The answer to [`Action::SpotCheck`]: `gain` is the loss on the sender's own batch before
    /// minus after applying that update alone (positive: it helped).
    SpotChecked {
        step: u64,
        sender: NodeId,
        blob: ContentId,
        gain: f64,
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
    /// [`Engine::serve_update`]); report back with `Fetched` or `FetchFailed`. The engine
    /// asks the next candidate if no answer came within half the summary window, and still
    /// takes this one's answer if it comes later.
    Fetch {
        peer: NodeId,
        blob: ContentId,
    },
    /// Send `peer` this request over request-response (a checkpoint manifest or chunk) and
    /// report the answer with [`Event::Response`] or [`Event::RequestFailed`].
    Request {
        peer: NodeId,
        req: Request,
    },
    /// Answer the inbound request `token` with these bytes (a manifest frame, or empty: "not
    /// here", also what a refusal looks like).
    Respond {
        token: u64,
        bytes: Vec<u8>,
    },
    /// Answer the inbound request `token` with chunk `index` of the snapshot of `version`: the
    /// `len` bytes at `offset` of its tensors' concatenated bytes, framed by
    /// `download::chunk_frame`.
    ServeChunk {
        token: u64,
        version: u64,
        index: u32,
        offset: u64,
        len: u64,
    },
    /// A peer asked for a version this node could serve but holds no snapshot of: take one
    /// ([`Event::Snapshot`]) if snapshots are not taken after every step anyway.
    Snapshot,
    /// Load these verified tensors (manifest = model order) as parameter version `version`
    /// (digest `digest`); answer [`Event::CheckpointLoaded`] or [`Event::CheckpointFailed`].
    LoadCheckpoint {
        version: u64,
        digest: Digest,
        tensors: Vec<Vec<u8>>,
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
        reason: Offence,
        points: u32,
    },
    Ban {
        peer: NodeId,
        reason: Offence,
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
    Report(Report),
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
    /// Checkpoints both ways: the download, the load, back-off, and what this node serves.
    ckpt: Checkpoints,
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
    /// When this engine wants `Event::Timer` next (see `poll_timeout`); set by `schedule`.
    timer: Option<u64>,
    rng: crate::rng::Rng,
    metrics: Metrics,
    /// This identity's proof of work for the run (0 when the run requires none).
    pow: u64,
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
            ckpt: Checkpoints::default(),
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
            rng: crate::rng::Rng::from_state(
                rng_seed ^ u64::from_le_bytes(me_id.0[..8].try_into().expect("8 bytes")),
            ),
            metrics: Metrics::default(),
            pow: crypto::pow::solve(&run_id.0, &me_id, run.defence.pow_bits),
            run,
        }
    }

    /// The instant (unix ms) at which the driver should call `handle(Event::Timer, at)`, as of
    /// the last `handle`; `None` when nothing is due. Ask after every `handle` and re-arm: the
    /// answer moves as events come in (quinn-proto's `Connection::poll_timeout` is the model).
    pub fn poll_timeout(&self) -> Option<u64> {
        self.timer
    }

    /// Process one event at time `now` (unix ms); then ask [`Engine::poll_timeout`].
    pub fn handle(&mut self, ev: Event, now: u64) -> Vec<Action> {
        let mut out = Vec::new();
        self.expire_fetches(now);
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
                    .filter(|(_, w)| w.awaits(peer))
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
                self.on_loaded(version, digest, now, &mut out)
            }
            Event::CheckpointFailed => {
                if self.ckpt.loading.is_some() {
                    self.checkpoint_failed(download::Failure::NotLoaded, now, &mut out);
                }
            }
            Event::Response { peer, req, bytes } => {
                self.on_response(peer, &req, Some(&bytes), now, &mut out)
            }
            Event::RequestFailed { peer, req } => self.on_response(peer, &req, None, now, &mut out),
            Event::Requested { peer, token, req } => self.serve_request(peer, token, req, &mut out),
            Event::Snapshot { manifest } => self.add_snapshot(manifest, &mut out),
            Event::SpotChecked {
                step,
                sender,
                blob,
                gain,
            } => self.on_spot(step, sender, blob, gain, &mut out),
        }
        self.tick(now, &mut out);
        self.pump(now, &mut out);
        self.schedule(now);
        out
    }
}
