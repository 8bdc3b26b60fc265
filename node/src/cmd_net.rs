//! `swarm run` and `swarm bootstrap`: a tokio event loop that owns the sans-IO engine and the
//! libp2p swarm, turns network I/O into engine events and engine actions into I/O, and hands
//! training and applying to the trainer thread.
//!
//! Time given to the engine is unix milliseconds: the run's step clock is wall-clock time, the
//! same on every machine up to skew (which the run's grace absorbs).
//!
//! Checkpoints, both ways (the decisions are the engine's, `protocol::engine::sync`; this loop
//! moves the bytes):
//! * Serving: after every applied step the trainer hands over a [`Snapshot`] of the parameters
//!   (they change only when a step is applied); its manifest goes to the engine
//!   (`Event::Snapshot`), which signs it and decides which versions are served
//!   (`protocol::engine::KEEP_SNAPSHOTS`); the bytes of exactly those are kept here. A peer's manifest
//!   or chunk request goes to the engine (`Event::Requested`); its `Respond` is sent as is, its
//!   `ServeChunk` is read from the snapshot of that version.
//! * Joining: the engine's `Request`s (manifests, then chunks) go out over request-response and
//!   their answers come back as `Response`/`RequestFailed`; its `LoadCheckpoint` goes to the
//!   trainer, and `CheckpointLoaded` back to the engine. Servers it bans are blacklisted in
//!   gossipsub, disconnected and refused thereafter, like every banned peer.
//! * `--checkpoint-dir`: see `trainer` for the crash-safe writes; on start the newest
//!   checkpoint that loads is resumed, and if the swarm has moved past it the engine fetches a
//!   newer one from peers as above.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::net::{self, Behaviour, BehaviourEvent, NetConfig, RateLimit, Request, Transport};
use anyhow::{bail, Context, Result};
use clap::Args;
use crypto::{ContentId, Digest, Identity, NodeId};
use futures::StreamExt;
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance, MessageId};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{dial_opts::DialOpts, SwarmEvent};
use libp2p::{identify, kad, request_response, Multiaddr, PeerId, Swarm};
use prometheus_client::metrics::gauge::Gauge;
use protocol::download;
use protocol::engine::{Action, Blob, Engine, Event, Included, Report, Verdict};
use protocol::error::Offence;
use protocol::run::RunConfig;
use protocol::wire::caps;
use tokio::sync::mpsc;

use crate::hostile::{falsify, Adversary, Forge, Hostile, Move};
use crate::status::{StatusLine, StatusSink};
use crate::trainer::{self, Cmd, Reply, Snapshot, Trainer};

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[derive(Args, Debug)]
#[command(
    after_help = "Example (a local swarm):\n  swarm keygen --out b.key && swarm bootstrap --listen /ip4/127.0.0.1/tcp/4001 --key b.key\n  \
swarm keygen --out n1.key && swarm run --run node/runs/tiny-local.toml --key n1.key \\\n      --bootstrap /ip4/127.0.0.1/tcp/4001/p2p/$(swarm id b.key) --genesis-ms $(( $(date +%s%3N) + 20000 ))\n\n\
Or simply: swarm demo"
)]
pub struct RunArgs {
    /// The run config (protocol `RunConfig` as TOML); every node of a run uses the same one.
    #[arg(long)]
    pub run: PathBuf,
    /// This node's identity (see `swarm keygen`).
    #[arg(long)]
    pub key: PathBuf,
    /// Bootstrap peers, as multiaddrs ending in /p2p/PEER_ID.
    #[arg(long, num_args = 1..)]
    pub bootstrap: Vec<Multiaddr>,
    /// Listen addresses (TCP and/or QUIC).
    #[arg(long, num_args = 1.., default_values_t = ["/ip4/0.0.0.0/tcp/0".parse::<Multiaddr>().expect("valid")])]
    pub listen: Vec<Multiaddr>,
    /// Override the run's genesis (unix ms of step 0's start). All nodes must agree: it is part
    /// of the run id.
    #[arg(long)]
    pub genesis_ms: Option<u64>,
    /// auto (CUDA when present), cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// The data file for runs that train on a file (synthetic runs need none).
    #[arg(long)]
    pub data: Option<String>,
    /// Where to keep checkpoints (`v{VERSION}.safetensors`, the newest two). On start, the
    /// newest one is resumed (use the same --key); a node behind the swarm then fetches a newer
    /// checkpoint from its peers.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint every N applied steps (with --checkpoint-dir).
    #[arg(long, default_value_t = 1)]
    pub checkpoint_every: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Append one JSON line per applied step (step, loss, peers, bytes, digest) to this file.
    #[arg(long)]
    pub status: Option<PathBuf>,
    /// Leave after applying this many steps (after lingering two periods to serve peers).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Held-out loss of this node's parameters every N applied steps (0: never), on
    /// --eval-batches batches of the run's size from the held-out stream `swarm eval` and
    /// `swarm demo` use; in the status lines, the TUI and /metrics (`swarm_eval_loss`).
    #[arg(long, default_value_t = 20)]
    pub eval_every: u64,
    /// Batches per held-out evaluation (forward passes only).
    #[arg(long, default_value_t = 4)]
    pub eval_batches: usize,
    /// A live view of this node in the terminal (step clock, losses, peers, bytes, updates
    /// included, penalties and bans, checkpoints, the log): press q to leave. Needs stdout
    /// to be a terminal; otherwise the plain status lines are kept. Logs go to the view's log
    /// pane instead of stderr.
    #[arg(long)]
    pub tui: bool,
    /// Local batch (sequences per step), for weaker hardware; the header carries the tokens.
    #[arg(long)]
    pub batch: Option<usize>,
    /// libtorch CPU threads.
    #[arg(long)]
    pub threads: Option<i32>,
    /// FOR TESTS ONLY: behave as a hostile peer (every attacker of the simulator that one
    /// process can be; see node/src/hostile.rs). Used by the fault drills to show the
    /// defences at work on real processes.
    #[arg(long, value_enum, hide_short_help = true)]
    pub adversary: Option<Adversary>,
    /// gossipsub mesh degree. With a relay among the --bootstrap peers (`swarm bootstrap
    /// --relay`) updates do not travel the mesh, only headers and summaries do, and 2 keeps
    /// this node's control traffic well below its update (see docs/BENCHMARKS.md).
    #[arg(long, default_value_t = crate::net::DEFAULT_MESH)]
    pub mesh: usize,
    /// Set by `swarm bootstrap --run`: what this node does in the run.
    #[arg(skip)]
    pub role: Role,
    /// Set by `swarm bootstrap --addr-file`.
    #[arg(skip)]
    pub addr_file: Option<PathBuf>,
}

/// What a node does in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Role {
    /// Trains, publishes its updates, applies, serves (`swarm run`).
    #[default]
    Trainer,
    /// A seed in the run (`swarm bootstrap --run`): follows it without training — applies
    /// every step, relays gossip, serves blobs and checkpoints, attests digests.
    Seed,
    /// A seed that is also a first hop (`--relay`): takes each trainer's update as a direct
    /// upload, verifies it, gossips the header and serves the blob.
    Relay,
}

impl Role {
    /// What the node announces in its Hello.
    fn capabilities(self) -> u64 {
        let serve = caps::SERVE_BLOBS | caps::SERVE_CHECKPOINTS;
        match self {
            Role::Trainer => caps::TRAIN | serve,
            Role::Seed => serve,
            Role::Relay => serve | caps::RELAY,
        }
    }
}

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
swarm bootstrap --listen /ip4/0.0.0.0/tcp/4001 --key seed.key\n      \
discovery only: trainers find each other through it\n  \
swarm bootstrap --listen /ip4/0.0.0.0/tcp/4001 --key seed.key --run run.toml --relay\n      \
a seed in the run and its first hop: each trainer uploads its update to it once, it gossips\n      \
the header and serves the blob to everyone (put it where upload bandwidth is plentiful)")]
pub struct BootstrapArgs {
    /// Listen address, e.g. /ip4/0.0.0.0/tcp/4001 or /ip4/0.0.0.0/udp/4001/quic-v1.
    #[arg(long, num_args = 1.., required = true)]
    pub listen: Vec<Multiaddr>,
    /// This peer's identity (see `swarm keygen`); its PeerId goes into the /p2p/ part of the
    /// address trainers pass as --bootstrap.
    #[arg(long)]
    pub key: PathBuf,
    /// Write the full listen multiaddrs (with /p2p/ID), one a line, to this file once known.
    #[arg(long)]
    pub addr_file: Option<PathBuf>,
    /// Also take part in this run (the same file the trainers use) without training: join its
    /// topic and relay gossip, apply every step, serve update blobs and checkpoints to
    /// joiners, attest parameter digests. Without it the peer helps discovery only.
    #[arg(long)]
    pub run: Option<PathBuf>,
    /// Be the run's first hop (needs --run): trainers that list this peer as --bootstrap upload
    /// each update to it once instead of gossiping it, and fetch the others' blobs from it
    /// first, so a trainer's upload per step is about one update whatever the swarm's size
    /// (give them `--mesh 2` too). The relay uploads N·(N−1) updates per step. If it withholds
    /// an update, its sender's summary still lists it and peers fetch it from the sender.
    #[arg(long, requires = "run")]
    pub relay: bool,
    /// With --run: override the run's genesis (unix ms), as the trainers do.
    #[arg(long, requires = "run")]
    pub genesis_ms: Option<u64>,
    /// With --run: one JSON line per applied step, as `swarm run --status`.
    #[arg(long, requires = "run")]
    pub status: Option<PathBuf>,
    /// With --run: leave after this many steps.
    #[arg(long, requires = "run")]
    pub steps: Option<u64>,
    /// With --run: the run's data file (spot checks recompute peers' batches from it).
    #[arg(long, requires = "run")]
    pub data: Option<String>,
    /// With --run: serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, requires = "run")]
    pub metrics: Option<SocketAddr>,
}

pub fn load_run(path: &std::path::Path, genesis_ms: Option<u64>) -> Result<RunConfig> {
    let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    let mut run: RunConfig =
        toml::from_str(&text).with_context(|| format!("{}: not a run config", path.display()))?;
    if let Some(g) = genesis_ms {
        run.timing.genesis_ms = g;
    }
    run.validate().with_context(|| path.display().to_string())?;
    Ok(run)
}

fn split_p2p(a: &Multiaddr) -> Option<(PeerId, Multiaddr)> {
    let mut a = a.clone();
    match a.pop()? {
        Protocol::P2p(p) => Some((p, a)),
        _ => None,
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    // Two workers: libp2p's tasks and ours. Training has its own thread.
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

pub fn bootstrap(a: BootstrapArgs) -> Result<()> {
    if let Some(run_file) = a.run {
        return run_cli(
            RunArgs {
                run: run_file,
                key: a.key,
                bootstrap: Vec::new(),
                listen: a.listen,
                genesis_ms: a.genesis_ms,
                device: "cpu".into(),
                data: a.data,
                checkpoint_dir: None,
                checkpoint_every: 1,
                metrics: a.metrics,
                status: a.status,
                steps: a.steps,
                // A seed's parameters are the swarm's: its trainers report the loss.
                eval_every: 0,
                eval_batches: 1,
                tui: false,
                batch: None,
                threads: Some(1),
                adversary: None,
                mesh: crate::net::DEFAULT_MESH,
                role: if a.relay { Role::Relay } else { Role::Seed },
                addr_file: a.addr_file,
            },
            None,
        );
    }
    let id = Identity::load(&a.key).map_err(|e| anyhow::anyhow!("{}: {e}", a.key.display()))?;
    runtime()?.block_on(async move {
        let mut reg = libp2p::metrics::Registry::default();
        let mut swarm = net::build_swarm(net::keypair(&id), &NetConfig::bootstrap(), &mut reg)?;
        for l in &a.listen {
            swarm.listen_on(l.clone())?;
        }
        let me = *swarm.local_peer_id();
        let mut addrs = Vec::new();
        loop {
            tokio::select! {
                ev = swarm.select_next_some() => match ev {
                    SwarmEvent::NewListenAddr { address, .. } => {
                        let full = address.with(Protocol::P2p(me));
                        println!("{full}");
                        addrs.push(full.to_string());
                        if let Some(f) = &a.addr_file {
                            std::fs::write(f, addrs.join("\n") + "\n")?;
                        }
                    }
                    SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received { peer_id, info, .. })) => {
                        for addr in info.listen_addrs.into_iter().take(8) {
                            swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                        }
                    }
                    SwarmEvent::Behaviour(BehaviourEvent::Rr(request_response::Event::Message {
                        message: request_response::Message::Request { channel, .. }, ..
                    })) => {
                        // A bootstrap peer holds no blobs and is in no run.
                        let _ = swarm.behaviour_mut().rr.send_response(channel, Vec::new());
                    }
                    _ => {}
                },
                _ = shutdown() => return Ok(()),
            }
        }
    })
}

async fn shutdown() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

struct Gauges {
    step: Gauge,
    peers: Gauge,
    loss: Gauge<f64, std::sync::atomic::AtomicU64>,
    eval: Gauge<f64, std::sync::atomic::AtomicU64>,
    rejected: Gauge,
    fetches: Gauge,
}

/// Most gossip messages awaiting a verdict; beyond it the oldest tag is forgotten (gossipsub
/// itself gives up on unvalidated messages after its duplicate-cache time).
const MAX_TAGS: usize = 4096;
/// Trainer command queue: a step's Train plus Applies in flight.
const TRAINER_QUEUE: usize = 8;
/// Models up to this many parameters are snapshotted after every step; bigger ones only after
/// a peer asked for a manifest recently (a copy per step would cost real time).
const SNAPSHOT_EVERY_STEP_PARAMS: i64 = 16 << 20;
/// Trainer commands queued beyond which spot checks are skipped (see `Action::SpotCheck`).
const MAX_SPOT_BACKLOG: usize = 4;

struct Node {
    engine: Engine,
    swarm: Swarm<Behaviour>,
    gossip: Gossip,
    fetches: HashMap<request_response::OutboundRequestId, (NodeId, ContentId)>,
    trainer: TrainerQueue,
    members: BTreeMap<PeerId, NodeId>,
    rate: RateLimit,
    report: Reporting,
    per_step: PerStep,
    steps: Option<u64>,
    done_at: Option<u64>,
    ckpt: CheckpointIo,
    hostile: Option<Hostile>,
    /// Blobs a hostile node forged and serves itself (id → `Update` frame), newest last.
    forged: VecDeque<(ContentId, Vec<u8>)>,
    /// Signs forged frames of a hostile node (the engine holds its own copy of the identity).
    id: Identity,
    role: Role,
    addr_file: Option<PathBuf>,
    listen_addrs: Vec<String>,
}

/// Checkpoints as bytes: the snapshots this node serves, where and how often it saves, and
/// the requests in flight both ways. Every decision about them (which to ask for, whom to
/// believe, what to serve to whom) is the engine's (`engine::sync`).
struct CheckpointIo {
    /// `--checkpoint-dir`, and every how many steps a checkpoint is written there.
    dir: Option<PathBuf>,
    every: u64,
    /// A downloaded checkpoint's version, loaded but not yet saved: it is written only once
    /// the engine syncs on it.
    unsaved_load: Option<u64>,
    /// Snapshots whose manifests the engine serves, oldest first (the bytes chunks are read
    /// from).
    snapshots: VecDeque<Arc<Snapshot>>,
    /// The model's parameter count (big models are snapshotted only on demand).
    params: i64,
    snapshot_until: u64,
    /// The engine's checkpoint requests in flight.
    requests: HashMap<request_response::OutboundRequestId, (NodeId, Request)>,
    /// Peers' checkpoint requests the engine is answering, by the token it was given.
    inbound: HashMap<u64, request_response::ResponseChannel<Vec<u8>>>,
    next_token: u64,
}

/// The run's gossip topic, and the messages awaiting the engine's verdict (tag → gossipsub
/// message id and source).
struct Gossip {
    topic: IdentTopic,
    tags: BTreeMap<u64, (MessageId, PeerId)>,
    next_tag: u64,
}

impl Gossip {
    /// A tag for a message awaiting its verdict; beyond [`MAX_TAGS`] the oldest is forgotten.
    fn tag(&mut self, id: MessageId, source: PeerId) -> u64 {
        self.next_tag += 1;
        if self.tags.len() >= MAX_TAGS {
            self.tags.pop_first();
        }
        self.tags.insert(self.next_tag, (id, source));
        self.next_tag
    }
}

/// The trainer's command queue, and the commands it had no room for yet (Applies must never
/// be dropped).
struct TrainerQueue {
    tx: mpsc::Sender<Cmd>,
    backlog: VecDeque<Cmd>,
}

impl TrainerQueue {
    fn send(&mut self, c: Cmd) {
        self.backlog.push_back(c);
        self.flush();
    }

    fn flush(&mut self) {
        while let Some(c) = self.backlog.pop_front() {
            match self.tx.try_send(c) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(c)) => {
                    self.backlog.push_front(c);
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return,
            }
        }
    }
}

/// Where a node reports: `--status` lines (and `NodeConfig::observer`), the `--metrics`
/// gauges, the `--tui` view.
struct Reporting {
    /// This node's peer id, as its status lines name it.
    name: String,
    reg: Arc<Mutex<libp2p::metrics::Registry>>,
    gauges: Gauges,
    status: Option<StatusSink<std::fs::File>>,
    /// Every status line also goes here.
    observer: Option<mpsc::UnboundedSender<StatusLine>>,
    /// The bandwidth counters at the last status line.
    last_bw: (u64, u64),
    /// Penalties and bans handed out (the status line's counters).
    penalties: u64,
    bans: u64,
    /// `--tui`: the live view's feed (bounded; a full queue drops the frame, never blocks).
    tui: Option<crate::tui::Feed>,
}

impl Reporting {
    /// Tell the live view (`--tui`), if there is one; never waits.
    fn show(&self, u: crate::tui::Update) {
        if let Some(t) = &self.tui {
            t.send(u);
        }
    }
}

/// Per-step bookkeeping for the status lines, the newest [`KEEP_STEPS`] steps.
#[derive(Default)]
struct PerStep {
    /// Per step: the local batch's loss and the training time (ms).
    losses: BTreeMap<u64, (f64, u64)>,
    /// Size of this node's last update.
    update_bytes: u64,
    /// Per step: (own tokens, tokens of the applied set).
    tokens: BTreeMap<u64, (u64, u64)>,
    /// Per step: when this node handed its update to the engine (unix ms).
    published: BTreeMap<u64, u64>,
    /// Per step: when each peer's update checked out here (sender → unix ms), for the
    /// "publish until everyone holds it" figure (`swarm demo` joins the nodes' status lines).
    arrivals: BTreeMap<u64, BTreeMap<String, u64>>,
}

/// Run peers from which on discovery slows down: twice gossipsub's `mesh_n_low`; gossip and
/// the slower kademlia walks find the rest.
const DISCOVER_ENOUGH_PEERS: usize = 4;

/// Steps of per-step bookkeeping kept (status lines are written a step behind at most).
const KEEP_STEPS: usize = 64;

/// Drop all but the newest [`KEEP_STEPS`] steps of a per-step map.
fn keep_recent<V>(m: &mut BTreeMap<u64, V>) {
    while m.len() > KEEP_STEPS {
        m.pop_first();
    }
}

impl Node {
    fn feed(&mut self, ev: Event) {
        let acts = self.engine.handle(ev, now_ms());
        for a in acts {
            self.act(a);
        }
    }

    fn to_trainer(&mut self, c: Cmd) {
        self.trainer.send(c);
    }

    fn flush_trainer(&mut self) {
        self.trainer.flush();
    }

    fn act(&mut self, a: Action) {
        match a {
            Action::Publish { bytes } => self.publish(bytes),
            Action::Send { peer, bytes } => {
                self.swarm
                    .behaviour_mut()
                    .rr
                    .send_request(&net::peer_id(&peer), Request::Frame(bytes));
            }
            Action::Verdict { tag, verdict } => self.on_verdict(tag, verdict),
            Action::Fetch { peer, blob } => self.fetch(peer, blob),
            Action::Request { peer, req } => self.request(peer, req),
            Action::Respond { token, bytes } => self.respond(token, bytes),
            Action::ServeChunk {
                token,
                version,
                index,
                offset,
                len,
            } => self.serve_chunk(token, version, index, offset, len),
            Action::Snapshot => self.on_joiner(),
            Action::LoadCheckpoint {
                version, tensors, ..
            } => self.to_trainer(Cmd::Load { version, tensors }),
            Action::StartStep { step, .. } => self.start_step(step),
            Action::Apply { step, .. } if self.steps.is_some_and(|n| step >= n) => {
                // Past the run's last step (`--steps`): the node is winding down, and applying
                // would move its parameters (and last checkpoint) past the version it reports.
                tracing::debug!(step, "past the last step: not applied");
            }
            Action::Apply { step, updates } => self.apply(step, updates),
            Action::Penalize { peer, reason, .. } => self.penalize(peer, reason),
            Action::Ban { peer, reason } => self.ban(peer, reason),
            Action::SpotCheck {
                step,
                sender,
                blob,
                tokens,
                bytes,
            } => self.spot_check(step, sender, blob, tokens, bytes),
            Action::Report(r) => self.on_report(r),
        }
    }

    /// Publish a frame on the run's gossip topic (a failure, e.g. no peers yet, is logged).
    fn publish(&mut self, bytes: Vec<u8>) {
        if let Err(e) = self
            .swarm
            .behaviour_mut()
            .gossipsub
            .publish(self.gossip.topic.clone(), bytes)
        {
            tracing::debug!("publish: {e}");
        }
    }

    /// Tell gossipsub the engine's verdict on a message it held back for validation.
    fn on_verdict(&mut self, tag: u64, verdict: Verdict) {
        if let Some((id, src)) = self.gossip.tags.remove(&tag) {
            let v = match verdict {
                Verdict::Accept => MessageAcceptance::Accept,
                Verdict::Reject => MessageAcceptance::Reject,
                Verdict::Ignore => MessageAcceptance::Ignore,
            };
            self.swarm
                .behaviour_mut()
                .gossipsub
                .report_message_validation_result(&id, &src, v);
        }
    }

    /// Ask a peer for an update blob, remembering which request it was.
    fn fetch(&mut self, peer: NodeId, blob: ContentId) {
        let r = self
            .swarm
            .behaviour_mut()
            .rr
            .send_request(&net::peer_id(&peer), Request::Blob(blob));
        self.fetches.insert(r, (peer, blob));
    }

    /// Send a checkpoint request to a peer, remembering it for the answer.
    fn request(&mut self, peer: NodeId, req: Request) {
        let id = self
            .swarm
            .behaviour_mut()
            .rr
            .send_request(&net::peer_id(&peer), req.clone());
        self.ckpt.requests.insert(id, (peer, req));
    }

    /// Answer a checkpoint chunk request from a kept snapshot (empty when it is gone).
    fn serve_chunk(&mut self, token: u64, version: u64, index: u32, offset: u64, len: u64) {
        let frame = self
            .ckpt
            .snapshots
            .iter()
            .find(|s| s.version == version)
            .map(|s| s.stream_range(offset, len))
            .map(|data| download::chunk_frame(self.engine.run_id(), version, index, data));
        self.respond(token, frame.unwrap_or_default());
    }

    /// Someone asked for a snapshot: keep taking them for a while (large models only).
    fn on_joiner(&mut self) {
        // Someone is joining: a large model keeps snapshots for a while so that its
        // retry finds one (a small one takes one after every step anyway).
        if self.ckpt.params > SNAPSHOT_EVERY_STEP_PARAMS {
            self.ckpt.snapshot_until = now_ms() + 20 * self.engine.run().timing.period_ms;
            self.to_trainer(Cmd::Snapshot);
        }
    }

    /// A step starts: a trainer that is still running trains it.
    fn start_step(&mut self, step: u64) {
        // Seeds and relays follow the run without training.
        if self.done_at.is_none() && self.role == Role::Trainer {
            self.to_trainer(Cmd::Train { step });
        }
    }

    /// Apply a step's updates: the hostile part sees them, the step's tokens are counted, and
    /// the trainer applies them.
    fn apply(&mut self, step: u64, updates: Vec<Included>) {
        if let Some(h) = self.hostile.as_mut() {
            h.on_applied(self.engine.run(), &self.engine.node_id(), &updates);
        }
        let t: u64 = updates.iter().map(|u| u.tokens).sum();
        self.per_step.tokens.entry(step).or_default().1 = t;
        self.to_trainer(Cmd::Apply { step, updates })
    }

    /// A peer is penalized: logged, counted, shown, and its gossip score lowered.
    fn penalize(&mut self, peer: NodeId, reason: Offence) {
        tracing::info!(%peer, %reason, "penalized");
        self.report.penalties += 1;
        self.show(crate::tui::Update::Offence {
            peer: peer.peer_id_string(),
            reason: reason.to_string(),
            ban: false,
        });
        let s = self.engine.score(&peer) as f64;
        self.swarm
            .behaviour_mut()
            .gossipsub
            .set_application_score(&net::peer_id(&peer), -s);
    }

    /// A peer is banned: logged, counted, shown, and cut off.
    fn ban(&mut self, peer: NodeId, reason: Offence) {
        tracing::warn!(%peer, %reason, "banned");
        self.report.bans += 1;
        self.show(crate::tui::Update::Offence {
            peer: peer.peer_id_string(),
            reason: reason.to_string(),
            ban: true,
        });
        self.cut_off(&peer);
    }

    /// Spot-check a peer's update on the trainer, unless the trainer is behind.
    fn spot_check(&mut self, step: u64, sender: NodeId, blob: ContentId, tokens: u64, bytes: Blob) {
        // Checks are advisory and cost two forward passes each: under a backlog (a
        // slow machine) skip them rather than fall behind the step clock.
        if self.trainer.backlog.len() < MAX_SPOT_BACKLOG {
            self.to_trainer(Cmd::SpotCheck {
                step,
                sender,
                blob,
                tokens,
                bytes: bytes.0.to_vec(),
            });
        }
    }

    /// What the engine reports: logged; a synced download is saved, arrivals are timed.
    fn on_report(&mut self, r: Report) {
        match r {
            Report::StepApplied {
                step,
                included,
                listed,
                missing,
            } => {
                tracing::debug!(step, included, listed, missing, "step set decided")
            }
            Report::Rejected { from, error } => tracing::info!(%from, %error, "rejected"),
            Report::Synced { version, digest } => {
                tracing::info!(version, digest = %&digest.to_hex()[..12], "synced");
                if self.ckpt.unsaved_load.take() == Some(version) {
                    self.save_checkpoint();
                }
            }
            Report::CheckpointUnattested { version, digest } => {
                if self.ckpt.unsaved_load == Some(version) {
                    self.ckpt.unsaved_load = None;
                }
                tracing::warn!(
                    version,
                    digest = %&digest.to_hex()[..12],
                    "the loaded checkpoint is not the one the swarm attests; not saved, asking again"
                )
            }
            Report::Ignored { from, error } => tracing::debug!(%from, %error, "ignored"),
            Report::Verified { step, sender } => {
                let a = self.per_step.arrivals.entry(step).or_default();
                if a.len() < self.engine.run().limits.max_updates_per_step as usize {
                    a.entry(sender.peer_id_string()).or_insert_with(now_ms);
                }
                keep_recent(&mut self.per_step.arrivals);
            }
            Report::CheckpointRequested { min_version, peers } => {
                let names: Vec<String> = peers.iter().map(|p| p.peer_id_string()).collect();
                self.show(crate::tui::Update::Checkpoint(format!(
                    "downloading ≥ v{min_version} from {} peers",
                    peers.len()
                )));
                tracing::info!(
                    min_version,
                    peers = peers.len(),
                    "requesting a checkpoint from {}",
                    names.join(" ")
                );
            }
            Report::CheckpointLiar { peer } => tracing::warn!(
                %peer,
                "banned from serving checkpoints: served a false checkpoint"
            ),
            Report::CheckpointFailed { reason } => {
                tracing::warn!("checkpoint download failed: {reason}")
            }
            Report::CheckpointLoaded {
                version,
                digest,
                servers,
                synced,
            } => {
                tracing::info!(
                    version,
                    digest = %&digest.to_hex()[..12],
                    servers,
                    synced,
                    "checkpoint loaded"
                );
                self.to_trainer(Cmd::Snapshot);
                // Written to disk only once the engine is synced on it (now, or when the
                // swarm's attestation comes): a checkpoint nobody attested must not be
                // resumed after a restart, nor prune the honest files beside it.
                if synced {
                    self.save_checkpoint();
                } else {
                    self.ckpt.unsaved_load = Some(version);
                }
            }
            other => tracing::info!("{other:?}"),
        }
    }

    fn on_swarm(&mut self, ev: SwarmEvent<BehaviourEvent>) {
        match ev {
            SwarmEvent::NewListenAddr { address, .. } => {
                let full = address.with(Protocol::P2p(*self.swarm.local_peer_id()));
                tracing::info!("listening on {full}");
                if self.role != Role::Trainer {
                    // A seed's addresses are what operators hand out: on stdout, as without --run.
                    println!("{full}");
                }
                self.listen_addrs.push(full.to_string());
                if let Some(f) = &self.addr_file {
                    if let Err(e) = std::fs::write(f, self.listen_addrs.join("\n") + "\n") {
                        tracing::warn!("{}: {e}", f.display());
                    }
                }
            }
            SwarmEvent::ConnectionEstablished { peer_id, .. } if self.is_banned(&peer_id) => {
                let _ = self.swarm.disconnect_peer_id(peer_id);
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established: 0,
                ..
            } => {
                if let Some(n) = self.members.remove(&peer_id) {
                    self.feed(Event::PeerGone { peer: n });
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(g)) => match g {
                gossipsub::Event::Message {
                    propagation_source,
                    message_id,
                    message,
                } => {
                    let Some(from) = net::node_id(&propagation_source) else {
                        let _ = self
                            .swarm
                            .behaviour_mut()
                            .gossipsub
                            .report_message_validation_result(
                                &message_id,
                                &propagation_source,
                                MessageAcceptance::Ignore,
                            );
                        return;
                    };
                    let tag = self.gossip.tag(message_id, propagation_source);
                    self.feed(Event::Message {
                        from,
                        tag: Some(tag),
                        bytes: message.data,
                    });
                }
                gossipsub::Event::Subscribed { peer_id, topic }
                    if topic == self.gossip.topic.hash() =>
                {
                    if let Some(n) = net::node_id(&peer_id) {
                        if self.members.insert(peer_id, n).is_none() {
                            self.feed(Event::PeerConnected { peer: n });
                        }
                    }
                }
                _ => {}
            },
            SwarmEvent::Behaviour(BehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) => {
                for addr in info.listen_addrs.into_iter().take(8) {
                    self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Kad(kad::Event::RoutingUpdated {
                peer,
                addresses,
                ..
            })) => {
                if !self.swarm.is_connected(&peer) && self.swarm.connected_peers().count() < 64 {
                    let _ = self.swarm.dial(
                        DialOpts::peer_id(peer)
                            .addresses(addresses.into_vec())
                            .build(),
                    );
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Rr(r)) => self.on_rr(r),
            _ => {}
        }
    }

    fn on_rr(&mut self, r: request_response::Event<Request, Vec<u8>>) {
        match r {
            request_response::Event::Message { peer, message, .. } => match message {
                request_response::Message::Request {
                    request, channel, ..
                } => {
                    if self.is_banned(&peer) || !self.rate.allow(peer, now_ms()) {
                        // Dropping the channel tells the peer we refused.
                        return;
                    }
                    if let Request::Manifest { .. } | Request::Chunk { .. } = request {
                        // The engine decides (`Respond` / `ServeChunk`, answered at once).
                        let Some(from) = net::node_id(&peer) else {
                            return;
                        };
                        self.ckpt.next_token += 1;
                        let token = self.ckpt.next_token;
                        self.ckpt.inbound.insert(token, channel);
                        self.feed(Event::Requested {
                            peer: from,
                            token,
                            req: request,
                        });
                        // Unanswered (never, today): dropping the channel refuses.
                        self.ckpt.inbound.remove(&token);
                        return;
                    }
                    let resp = match request {
                        Request::Frame(bytes) => {
                            if let Some(from) = net::node_id(&peer) {
                                self.feed(Event::Message {
                                    from,
                                    tag: None,
                                    bytes,
                                });
                            }
                            Vec::new()
                        }
                        // Within the engine's per-peer serving budget (each blob of a
                        // step at most twice per peer), on top of the request rate limit.
                        Request::Blob(id) => net::node_id(&peer)
                            .and_then(|from| self.engine.serve_update_to(from, &id))
                            .map(|f| f.to_vec())
                            .or_else(|| {
                                let f = self.forged.iter().find(|(f, _)| *f == id);
                                f.map(|(_, b)| b.clone())
                            })
                            .unwrap_or_default(),
                        Request::Manifest { .. } | Request::Chunk { .. } => Vec::new(),
                    };
                    let _ = self.swarm.behaviour_mut().rr.send_response(channel, resp);
                }
                request_response::Message::Response {
                    request_id,
                    response,
                } => {
                    if let Some((from, req)) = self.ckpt.requests.remove(&request_id) {
                        self.feed(Event::Response {
                            peer: from,
                            req,
                            bytes: response,
                        });
                        return;
                    }
                    if let Some((from, blob)) = self.fetches.remove(&request_id) {
                        if response.is_empty() {
                            self.feed(Event::FetchFailed { from, blob });
                        } else {
                            self.feed(Event::Fetched {
                                from,
                                blob,
                                bytes: response,
                            });
                        }
                    }
                }
            },
            request_response::Event::OutboundFailure {
                request_id, error, ..
            } => {
                if let Some((from, req)) = self.ckpt.requests.remove(&request_id) {
                    tracing::debug!(%from, %error, ?req, "checkpoint request failed");
                    self.feed(Event::RequestFailed { peer: from, req });
                    return;
                }
                if let Some((from, blob)) = self.fetches.remove(&request_id) {
                    tracing::debug!(%from, %error, "fetch failed");
                    self.feed(Event::FetchFailed { from, blob });
                }
            }
            _ => {}
        }
    }

    fn on_trainer(&mut self, r: Reply) -> Result<()> {
        match r {
            Reply::Ready { .. } => {}
            Reply::Snapshot(snap) => self.add_snapshot(snap),
            Reply::SpotChecked {
                step,
                sender,
                blob,
                gain,
            } => {
                tracing::debug!(step, %sender, gain, "spot check");
                self.feed(Event::SpotChecked {
                    step,
                    sender,
                    blob,
                    gain,
                });
            }
            Reply::Loaded { version, digest } => self.on_loaded(version, digest),
            Reply::Trained {
                step,
                blob,
                tokens,
                loss,
                ms,
            } => {
                self.per_step.update_bytes = blob.len() as u64;
                self.per_step.losses.insert(step, (loss, ms));
                keep_recent(&mut self.per_step.losses);
                self.report.gauges.loss.set(loss);
                self.per_step.tokens.entry(step).or_default().0 = tokens;
                keep_recent(&mut self.per_step.tokens);
                self.per_step.published.insert(step, now_ms());
                keep_recent(&mut self.per_step.published);
                if self.hostile.is_some() {
                    self.act_hostile(step, blob, tokens);
                } else {
                    self.feed(Event::LocalUpdate { step, blob, tokens });
                }
            }
            Reply::Applied {
                step,
                digest,
                ms,
                included,
                eval,
            } => {
                // Queued before the engine hears of it (it may answer with the next Apply at
                // once, while catching up); the trainer labels both with the version it holds.
                let last = self.steps.is_some_and(|n| step + 1 == n);
                if let Some(dir) = self.ckpt.dir.clone() {
                    if (step + 1) % self.ckpt.every.max(1) == 0 || last {
                        self.to_trainer(Cmd::Save { dir });
                    }
                }
                if self.ckpt.params <= SNAPSHOT_EVERY_STEP_PARAMS
                    || now_ms() < self.ckpt.snapshot_until
                {
                    self.to_trainer(Cmd::Snapshot);
                }
                self.feed(Event::Applied {
                    step,
                    digest: Digest(digest),
                });
                if let Some(e) = eval {
                    self.report.gauges.eval.set(e);
                }
                self.write_status(step, Digest(digest), ms, included, eval);
                if last && self.done_at.is_none() {
                    self.done_at = Some(now_ms() + 2 * self.engine.run().timing.period_ms);
                }
            }
            Reply::Saved { version, path } => {
                let what = match path {
                    Ok(p) => {
                        tracing::debug!(version, "saved {}", p.display());
                        format!("saved v{version}")
                    }
                    Err(e) => {
                        tracing::warn!(version, "checkpoint not written: {e}");
                        format!("v{version} NOT written: {e}")
                    }
                };
                self.show(crate::tui::Update::Checkpoint(what));
            }
            Reply::Failed(e) => bail!("trainer: {e}"),
        }
        self.flush_trainer();
        Ok(())
    }

    /// `--adversary`: what the hostile node does with its honest update (see `hostile`).
    fn act_hostile(&mut self, step: u64, blob: Vec<u8>, tokens: u64) {
        let Some(h) = self.hostile.as_mut() else {
            return;
        };
        let st = self.engine.status();
        let forge = Forge {
            run_id: self.engine.run_id(),
            me: &self.id,
            pow: self.engine.pow(),
            base: (st.version, st.digest),
        };
        match h.act(self.engine.run(), forge, step, blob, tokens) {
            Move::Update { blob, tokens } => self.feed(Event::LocalUpdate { step, blob, tokens }),
            Move::Nothing => {}
            Move::Raw { gossip, serve } => {
                tracing::info!(
                    step,
                    frames = gossip.len(),
                    "hostile: gossiping forged frames"
                );
                for f in gossip {
                    let t = self.gossip.topic.clone();
                    if let Err(e) = self.swarm.behaviour_mut().gossipsub.publish(t, f) {
                        tracing::debug!("hostile publish: {e}");
                    }
                }
                self.forged.extend(serve);
                while self.forged.len() > crate::hostile::SERVE_KEEP {
                    self.forged.pop_front();
                }
            }
        }
    }

    // ---------------------------------------------------------------------------------------
    // checkpoints (see the module docs)

    fn add_snapshot(&mut self, snap: Arc<Snapshot>) {
        // Hashing a snapshot into its manifest reads every byte: not twice for one version.
        if self
            .ckpt
            .snapshots
            .iter()
            .any(|s| s.version == snap.version)
        {
            return;
        }
        let snap = match &self.hostile {
            Some(h) if h.kind == Adversary::FalseCheckpoint => Arc::new(falsify(&snap)),
            _ => snap,
        };
        let manifest = download::manifest_of(
            self.engine.run_id(),
            &self.engine.run().limits,
            self.engine.node_id(),
            snap.version,
            &snap.tensors,
        );
        if manifest.digest.0 != snap.digest {
            // The trainer's digest and the manifest's are computed the same way; a mismatch is
            // a bug, and serving it would get this node banned by every joiner.
            tracing::error!(
                version = snap.version,
                "snapshot digest mismatch: not serving it"
            );
            return;
        }
        self.feed(Event::Snapshot { manifest });
        // Which versions are served (the newest few; a resync to an older one drops the
        // rest) is the engine's call: keep the bytes of exactly those.
        let served = self.engine.served_versions();
        self.ckpt.snapshots.retain(|s| served.contains(&s.version));
        if served.contains(&snap.version) {
            self.ckpt.snapshots.push_back(snap);
        }
    }

    /// Answer a peer's checkpoint request as the engine said (empty bytes: "not here").
    fn respond(&mut self, token: u64, bytes: Vec<u8>) {
        if let Some(ch) = self.ckpt.inbound.remove(&token) {
            let _ = self.swarm.behaviour_mut().rr.send_response(ch, bytes);
        }
    }

    /// Whether the engine banned this peer (the one ban list; the transport refuses it).
    fn is_banned(&self, peer: &PeerId) -> bool {
        net::node_id(peer).is_some_and(|n| self.engine.is_banned(&n))
    }

    /// Save the parameters into `--checkpoint-dir`, if one was given.
    fn save_checkpoint(&mut self) {
        if let Some(dir) = self.ckpt.dir.clone() {
            self.to_trainer(Cmd::Save { dir });
        }
    }

    /// No more gossip from or to `peer`, and its connections closed.
    fn cut_off(&mut self, peer: &NodeId) {
        let p = net::peer_id(peer);
        self.swarm.behaviour_mut().gossipsub.blacklist_peer(&p);
        let _ = self.swarm.disconnect_peer_id(p);
    }

    /// The trainer loaded a checkpoint the engine asked for: tell the engine what it holds
    /// (it answers `Report::CheckpointLoaded` if that is what the manifest named).
    fn on_loaded(&mut self, version: u64, digest: Result<[u8; 32], String>) {
        match digest {
            Ok(d) => self.feed(Event::CheckpointLoaded {
                version,
                digest: Digest(d),
            }),
            Err(e) => {
                tracing::warn!(version, "checkpoint did not load: {e}");
                self.feed(Event::CheckpointFailed);
            }
        }
    }

    /// Log the applied step and append it to `--status`. A failed write (a full disk, a
    /// removed file) is logged, once, and the node goes on: the status file is a report, and
    /// losing a line of it must not stop training.
    fn write_status(
        &mut self,
        step: u64,
        digest: Digest,
        apply_ms: u64,
        included: usize,
        eval_loss: Option<f64>,
    ) {
        let bw = net::bandwidth(&self.report.reg.lock().expect("registry lock"));
        let (din, dout) = (
            bw.0.saturating_sub(self.report.last_bw.0),
            bw.1.saturating_sub(self.report.last_bw.1),
        );
        self.report.last_bw = bw;
        let m = self.engine.metrics().clone();
        let (tokens, included_tokens) = self.per_step.tokens.get(&step).copied().unwrap_or((0, 0));
        let (loss, train_ms) = self
            .per_step
            .losses
            .get(&step)
            .copied()
            .map_or((None, 0), |(l, t)| (Some(l), t));
        self.report.gauges.step.set(step as i64 + 1);
        self.report.gauges.peers.set(self.members.len() as i64);
        self.report.gauges.rejected.set(m.rejected as i64);
        self.report.gauges.fetches.set(m.fetches as i64);
        let line = StatusLine {
            node: self.report.name.clone(),
            step,
            version: step + 1,
            loss,
            peers: self.members.len(),
            included,
            update_bytes: self.per_step.update_bytes,
            bytes_out: dout,
            bytes_in: din,
            train_ms,
            apply_ms,
            digest: digest.to_hex(),
            t_ms: now_ms(),
            rejected: m.rejected,
            fetches: m.fetches,
            tokens,
            included_tokens,
            published_ms: self.per_step.published.get(&step).copied(),
            arrivals: self
                .per_step
                .arrivals
                .get(&step)
                .cloned()
                .unwrap_or_default(),
            eval_loss,
            penalties: self.report.penalties,
            bans: self.report.bans,
        };
        tracing::info!(
            step,
            loss = loss.unwrap_or(f64::NAN),
            peers = line.peers,
            included,
            out = dout,
            r#in = din,
            digest = &line.digest[..12],
            "applied"
        );
        if let Some(f) = &mut self.report.status {
            f.line(&serde_json::to_string(&line).expect("a status line serializes"));
        }
        if let Some(o) = &self.report.observer {
            let _ = o.send(line.clone());
        }
        self.show(crate::tui::Update::Status(Box::new(line)));
    }

    /// Tell the live view (`--tui`), if there is one; never waits.
    fn show(&self, u: crate::tui::Update) {
        self.report.show(u);
    }
}

async fn serve_metrics(addr: SocketAddr, reg: Arc<Mutex<libp2p::metrics::Registry>>) -> Result<()> {
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("metrics on {addr}"))?;
    tracing::info!("metrics at http://{addr}/metrics");
    crate::metrics::serve(l, reg).await?;
    Ok(())
}

/// The trainer, resumed from the newest checkpoint in `dir` that loads (older ones are tried
/// if the newest does not; temp files of an interrupted save are removed).
fn make_trainer(
    run: &RunConfig,
    corpus: train::data::Corpus,
    me: &NodeId,
    batch: usize,
    device: tch::Device,
    dir: Option<&std::path::Path>,
) -> Result<Trainer> {
    let mut t = Trainer::new(run, corpus, me.0.to_vec(), batch, device)?;
    if let Some(dir) = dir {
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.filter_map(|e| e.ok()) {
                if e.path().extension().is_some_and(|x| x == "tmp") {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        for (v, p) in trainer::list_checkpoints(dir) {
            match t.resume(v, &p) {
                Ok(()) => {
                    tracing::info!(version = v, "resuming from {}", p.display());
                    break;
                }
                Err(e) => tracing::warn!("{}: {e:#}; trying an older checkpoint", p.display()),
            }
        }
    }
    Ok(t)
}

/// Everything [`run`] needs, resolved: `swarm run`'s flags read and checked
/// ([`NodeConfig::from_args`]), or a test's choice ([`NodeConfig::new`]).
pub struct NodeConfig {
    /// The run (every node of a run uses the same one).
    pub run: RunConfig,
    /// This node's identity.
    pub id: Identity,
    /// Bootstrap peers, as multiaddrs ending in /p2p/PEER_ID.
    pub bootstrap: Vec<Multiaddr>,
    /// Listen addresses, of the transport `run` is given.
    pub listen: Vec<Multiaddr>,
    pub device: tch::Device,
    /// libtorch CPU threads (a process-wide setting).
    pub threads: Option<i32>,
    /// The data file for runs that train on a file.
    pub data: Option<String>,
    pub checkpoint_dir: Option<PathBuf>,
    /// A checkpoint every N applied steps (with `checkpoint_dir`).
    pub checkpoint_every: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    pub metrics: Option<SocketAddr>,
    /// `--status`: the file status lines are appended to.
    pub status: Option<PathBuf>,
    /// Every status line is also sent here (how in-process tests watch a node).
    pub observer: Option<mpsc::UnboundedSender<StatusLine>>,
    /// Leave after applying this many steps (after lingering two periods to serve peers).
    pub steps: Option<u64>,
    pub eval_every: u64,
    pub eval_batches: usize,
    /// Sequences per step.
    pub batch: usize,
    pub adversary: Option<Adversary>,
    pub mesh: usize,
    pub role: Role,
    pub addr_file: Option<PathBuf>,
    /// `--tui`: where tracing writes while the view draws; the view runs when set.
    pub tui: Option<crate::tui::LogRing>,
}

impl NodeConfig {
    /// A trainer of `run` with identity `id`: no addresses, CPU, the run's batch, no held-out
    /// evaluation, no status file, checkpoint directory, metrics or view, and no last step.
    pub fn new(run: RunConfig, id: Identity) -> NodeConfig {
        NodeConfig {
            batch: run.batch_seqs as usize,
            run,
            id,
            bootstrap: Vec::new(),
            listen: Vec::new(),
            device: tch::Device::Cpu,
            threads: None,
            data: None,
            checkpoint_dir: None,
            checkpoint_every: 1,
            metrics: None,
            status: None,
            observer: None,
            steps: None,
            eval_every: 0,
            eval_batches: 1,
            adversary: None,
            mesh: crate::net::DEFAULT_MESH,
            role: Role::Trainer,
            addr_file: None,
            tui: None,
        }
    }

    /// `swarm run`'s flags: the run file and key read, the device parsed. `log`: where tracing
    /// writes while `--tui` draws (main sets it up; `None` without a view).
    pub fn from_args(a: RunArgs, log: Option<crate::tui::LogRing>) -> Result<NodeConfig> {
        let run = load_run(&a.run, a.genesis_ms)?;
        let id = Identity::load(&a.key).map_err(|e| anyhow::anyhow!("{}: {e}", a.key.display()))?;
        let device = train::parse_device(&a.device)?;
        let batch = a.batch.unwrap_or(run.batch_seqs as usize).max(1);
        Ok(NodeConfig {
            run,
            id,
            bootstrap: a.bootstrap,
            listen: a.listen,
            device,
            threads: a.threads,
            data: a.data,
            checkpoint_dir: a.checkpoint_dir,
            checkpoint_every: a.checkpoint_every,
            metrics: a.metrics,
            status: a.status,
            observer: None,
            steps: a.steps,
            eval_every: a.eval_every,
            eval_batches: a.eval_batches,
            batch,
            adversary: a.adversary,
            mesh: a.mesh,
            role: a.role,
            addr_file: a.addr_file,
            tui: log,
        })
    }
}

/// `swarm run` (and `swarm bootstrap --run`): [`run`] on TCP and QUIC until SIGINT or SIGTERM.
/// `log`: where tracing writes while `--tui` draws (main sets it up; `None` without a view).
pub fn run_cli(a: RunArgs, log: Option<crate::tui::LogRing>) -> Result<()> {
    let cfg = NodeConfig::from_args(a, log)?;
    runtime()?.block_on(run(cfg, Transport::Network, shutdown()))
}

/// One node: the trainer thread, the engine and the libp2p swarm on `transport`, until the
/// node has applied its last step (`cfg.steps`), `shutdown` completes, the view is quit or
/// something fails. Returns once the trainer thread has stopped (after the command it was
/// running), so the same checkpoint directory can be used again at once.
pub async fn run(
    cfg: NodeConfig,
    transport: Transport,
    shutdown: impl Future<Output = ()>,
) -> Result<()> {
    let (cmd_tx, mut rep_rx, thread) = start_trainer(&cfg).await?;
    let result = drive(cfg, transport, shutdown, cmd_tx, &mut rep_rx).await;
    drop(rep_rx);
    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
    result
}

/// The trainer, on its own thread: the data, the model (resumed from the checkpoint
/// directory), and its command and reply queues. The blocking work runs off the async threads.
async fn start_trainer(
    cfg: &NodeConfig,
) -> Result<(
    mpsc::Sender<Cmd>,
    mpsc::Receiver<Reply>,
    std::thread::JoinHandle<()>,
)> {
    let (run, data, me) = (cfg.run.clone(), cfg.data.clone(), cfg.id.node_id());
    let (batch, device, dir) = (cfg.batch, cfg.device, cfg.checkpoint_dir.clone());
    let (threads, every, batches) = (cfg.threads, cfg.eval_every, cfg.eval_batches);
    let trainer = tokio::task::spawn_blocking(move || -> Result<Trainer> {
        if let Some(t) = threads {
            tch::set_num_threads(t);
        }
        let spec = trainer::data_spec(&run, data.as_deref())?;
        let corpus = train::data::Corpus::open(&spec)?;
        if corpus.vocab() as u32 > run.model.vocab {
            bail!(
                "data vocabulary {} exceeds the model's {}",
                corpus.vocab(),
                run.model.vocab
            );
        }
        Ok(
            make_trainer(&run, corpus, &me, batch, device, dir.as_deref())?
                .with_eval(every, batches),
        )
    })
    .await??;
    let (cmd_tx, cmd_rx) = mpsc::channel::<Cmd>(TRAINER_QUEUE);
    let (rep_tx, rep_rx) = mpsc::channel::<Reply>(TRAINER_QUEUE);
    let thread = std::thread::Builder::new()
        .name("trainer".into())
        .spawn(move || trainer.serve(cmd_rx, rep_tx))?;
    Ok((cmd_tx, rep_rx, thread))
}

/// What the trainer holds when the loop starts.
struct Started {
    /// The parameters' digest (the genesis when `resumed` is 0).
    digest: Digest,
    params: i64,
    /// The version resumed from the checkpoint directory (0: none).
    resumed: u64,
    /// The first snapshot: the version served from the start.
    first: Arc<Snapshot>,
}

async fn trainer_ready(
    cmd_tx: &mpsc::Sender<Cmd>,
    rep_rx: &mut mpsc::Receiver<Reply>,
) -> Result<Started> {
    let (digest, params, resumed) = match rep_rx.recv().await {
        Some(Reply::Ready {
            digest,
            params,
            version,
        }) => {
            tracing::info!(params, version, digest = %Digest(digest).to_hex(), "model ready");
            (Digest(digest), params, version)
        }
        Some(Reply::Failed(e)) => bail!("trainer: {e}"),
        _ => bail!("trainer exited"),
    };
    cmd_tx
        .send(Cmd::Snapshot)
        .await
        .map_err(|_| anyhow::anyhow!("trainer exited"))?;
    let first = match rep_rx.recv().await {
        Some(Reply::Snapshot(s)) => s,
        Some(Reply::Failed(e)) => bail!("trainer: {e}"),
        _ => bail!("trainer exited"),
    };
    Ok(Started {
        digest,
        params,
        resumed,
        first,
    })
}

/// Everything after the trainer is up: the swarm, the engine, the node, its loop.
async fn drive(
    cfg: NodeConfig,
    transport: Transport,
    shutdown: impl Future<Output = ()>,
    cmd_tx: mpsc::Sender<Cmd>,
    rep_rx: &mut mpsc::Receiver<Reply>,
) -> Result<()> {
    let started = trainer_ready(&cmd_tx, rep_rx).await?;
    let mut reg = libp2p::metrics::Registry::default();
    let mut ncfg = NetConfig::for_run(&cfg.run);
    ncfg.mesh = cfg.mesh;
    let swarm = net::build_swarm_on(transport, net::keypair(&cfg.id), &ncfg, &mut reg)?;
    let gauges = Gauges::register(&mut reg);
    let reg = Arc::new(Mutex::new(reg));
    let engine = new_engine(&cfg, &started);
    let mut node = Node::new(&cfg, engine, swarm, cmd_tx, reg.clone(), gauges, &started)?;
    node.start(&cfg, started)?;
    if let Some(addr) = cfg.metrics {
        tokio::spawn(async move {
            if let Err(e) = serve_metrics(addr, reg).await {
                tracing::warn!("metrics server: {e:#}");
            }
        });
    }
    // `--tui`: the view runs on its own thread until `_view` drops (any return below).
    let quit = Arc::new(tokio::sync::Notify::new());
    let _view = node.start_view(&cfg, quit.clone())?;
    node.event_loop(rep_rx, shutdown, &quit, !cfg.bootstrap.is_empty())
        .await
}

impl Gauges {
    /// The node's gauges, registered in `reg` (what `--metrics` serves).
    fn register(reg: &mut libp2p::metrics::Registry) -> Gauges {
        let gauges = Gauges {
            step: Gauge::default(),
            peers: Gauge::default(),
            loss: Gauge::default(),
            eval: Gauge::default(),
            rejected: Gauge::default(),
            fetches: Gauge::default(),
        };
        reg.register(
            "swarm_version",
            "Parameter version (steps applied)",
            gauges.step.clone(),
        );
        reg.register(
            "swarm_peers",
            "Connected peers of this run",
            gauges.peers.clone(),
        );
        reg.register(
            "swarm_train_loss",
            "Loss of the last local batch",
            gauges.loss.clone(),
        );
        reg.register(
            "swarm_eval_loss",
            "Held-out loss of this node's parameters (every --eval-every steps)",
            gauges.eval.clone(),
        );
        reg.register(
            "swarm_rejected",
            "Messages rejected as invalid",
            gauges.rejected.clone(),
        );
        reg.register("swarm_fetches", "Blob fetches", gauges.fetches.clone());
        gauges
    }
}

/// The engine, from the genesis or (a resumed checkpoint) joining: only version 0 is the
/// genesis; a resumed checkpoint is offered to the engine by [`Node::start`].
fn new_engine(cfg: &NodeConfig, started: &Started) -> Engine {
    let now = now_ms();
    let me = cfg.id.node_id();
    let rng_seed = u64::from_le_bytes(me.0[8..16].try_into().expect("8 bytes")) ^ now;
    let engine = Engine::new(
        cfg.run.clone(),
        Identity::from_seed(cfg.id.seed()),
        (started.resumed == 0).then_some(started.digest),
        now,
        rng_seed,
    );
    if !engine.status().synced {
        tracing::warn!("started after step 0 was applied: joining (needs a checkpoint)");
    }
    engine
}

impl Node {
    fn new(
        cfg: &NodeConfig,
        engine: Engine,
        swarm: Swarm<Behaviour>,
        trainer: mpsc::Sender<Cmd>,
        reg: Arc<Mutex<libp2p::metrics::Registry>>,
        gauges: Gauges,
        started: &Started,
    ) -> Result<Node> {
        let status = match &cfg.status {
            Some(p) => Some(StatusSink::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .with_context(|| p.display().to_string())?,
            )),
            None => None,
        };
        if let Some(adv) = cfg.adversary {
            tracing::warn!(
                ?adv,
                "running as a HOSTILE peer (--adversary): for tests only"
            );
        }
        Ok(Node {
            engine,
            swarm,
            gossip: Gossip {
                topic: IdentTopic::new(cfg.run.topic()),
                tags: BTreeMap::new(),
                next_tag: 0,
            },
            fetches: HashMap::new(),
            trainer: TrainerQueue {
                tx: trainer,
                backlog: VecDeque::new(),
            },
            members: BTreeMap::new(),
            // Per peer: a few fetches per step per update is plenty; bursts cover a repair.
            rate: RateLimit::new(50.0, 200.0, cfg.run.limits.max_peers as usize),
            report: Reporting {
                name: cfg.id.node_id().peer_id_string(),
                reg,
                gauges,
                status,
                observer: cfg.observer.clone(),
                last_bw: (0, 0),
                penalties: 0,
                bans: 0,
                tui: None,
            },
            per_step: PerStep::default(),
            steps: cfg.steps,
            done_at: None,
            ckpt: CheckpointIo {
                dir: cfg.checkpoint_dir.clone(),
                every: cfg.checkpoint_every,
                unsaved_load: None,
                snapshots: VecDeque::new(),
                params: started.params,
                snapshot_until: 0,
                requests: HashMap::new(),
                inbound: HashMap::new(),
                next_token: 0,
            },
            hostile: cfg.adversary.map(Hostile::new),
            forged: VecDeque::new(),
            id: Identity::from_seed(cfg.id.seed()),
            role: cfg.role,
            addr_file: cfg.addr_file.clone(),
            listen_addrs: Vec::new(),
        })
    }

    /// Into the run: the role, the first snapshot served, a resumed checkpoint offered, the
    /// topic joined, listening, and the bootstrap peers dialed.
    fn start(&mut self, cfg: &NodeConfig, started: Started) -> Result<()> {
        if cfg.role != Role::Trainer {
            self.engine.set_listen(Vec::new(), cfg.role.capabilities());
            tracing::info!(role = ?cfg.role, "following the run without training");
        }
        self.add_snapshot(started.first);
        let resumed = started.resumed;
        if resumed > 0 && now_ms() < self.engine.run().timing.publish_deadline(resumed) {
            // Restarted within the step after the one saved: the swarm will attest exactly
            // this version, so no download is needed. Later, the engine asks peers for a
            // newer one instead (the summaries to catch up from this one were never heard).
            self.feed(Event::CheckpointLoaded {
                version: resumed,
                digest: started.digest,
            });
        }
        // First hops are only the bootstrap peers the operator chose (any peer can claim the
        // relay capability; SECURITY.md).
        self.engine.set_trusted_relays(
            cfg.bootstrap
                .iter()
                .filter_map(split_p2p)
                .filter_map(|(p, _)| net::node_id(&p)),
        );
        let topic = self.gossip.topic.clone();
        self.swarm.behaviour_mut().gossipsub.subscribe(&topic)?;
        for l in &cfg.listen {
            self.swarm.listen_on(l.clone())?;
        }
        for b in &cfg.bootstrap {
            match split_p2p(b) {
                Some((p, addr)) => {
                    self.swarm.behaviour_mut().kad.add_address(&p, addr);
                }
                None => {
                    tracing::warn!("bootstrap address {b} has no /p2p/PEER_ID; dialing it anyway")
                }
            }
            self.swarm.dial(b.clone())?;
        }
        Ok(())
    }

    /// `--tui`: the live view on its own thread (until the returned handle drops); `quit` is
    /// notified when the person leaves it.
    fn start_view(
        &mut self,
        cfg: &NodeConfig,
        quit: Arc<tokio::sync::Notify>,
    ) -> Result<Option<crate::tui::Tui>> {
        let Some(log) = cfg.tui.clone() else {
            return Ok(None);
        };
        let t = &cfg.run.timing;
        let view = crate::tui::View::new(
            self.report.name.clone(),
            cfg.run.name.clone(),
            t.genesis_ms,
            t.period_ms,
            log,
        );
        let t = crate::tui::Tui::start(view, move || quit.notify_one())
            .context("--tui: taking over the terminal")?;
        self.report.tui = Some(t.feed.clone());
        Ok(Some(t))
    }

    /// The loop: swarm events, trainer replies, the engine's timer, a periodic tick and
    /// discovery, until the last step is done, `shutdown` completes or the view is quit.
    async fn event_loop(
        &mut self,
        rep_rx: &mut mpsc::Receiver<Reply>,
        shutdown: impl Future<Output = ()>,
        quit: &tokio::sync::Notify,
        has_bootstrap: bool,
    ) -> Result<()> {
        tokio::pin!(shutdown);
        self.feed(Event::Timer);
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        let mut discover = tokio::time::interval(Duration::from_secs(5));
        let mut last_discover = 0u64;
        loop {
            // The engine's one timer, re-armed every turn to what it asks for now.
            let timer = self.engine.poll_timeout();
            let wait = timer.map_or(Duration::from_secs(3600), |t| {
                Duration::from_millis(t.saturating_sub(now_ms()))
            });
            tokio::select! {
                ev = self.swarm.select_next_some() => self.on_swarm(ev),
                r = rep_rx.recv() => match r {
                    Some(r) => self.on_trainer(r)?,
                    None => bail!("trainer thread exited"),
                },
                _ = tokio::time::sleep(wait), if timer.is_some() => self.feed(Event::Timer),
                _ = tick.tick() => {
                    if self.on_tick() {
                        tracing::info!("reached {} steps; leaving", self.steps.unwrap_or(0));
                        return Ok(());
                    }
                }
                _ = discover.tick() => self.on_discover(&mut last_discover, has_bootstrap),
                _ = quit.notified() => return Ok(()),
                _ = &mut shutdown => return Ok(()),
            }
        }
    }

    /// The loop's periodic tick; true when the node is done (its last step applied and
    /// served for a while).
    fn on_tick(&mut self) -> bool {
        // Timer events are idempotent: a periodic one is a safety net beside the engine's own
        // deadline (`poll_timeout`).
        self.feed(Event::Timer);
        self.flush_trainer();
        self.done_at.is_some_and(|d| now_ms() >= d)
    }

    /// A kademlia bootstrap is a burst of queries to every known peer: often while this node
    /// knows few peers of the run, then once a minute (at every 5 s it was most of a node's
    /// upload per step once updates went to a relay).
    fn on_discover(&mut self, last_discover: &mut u64, has_bootstrap: bool) {
        let few = self.members.len() < DISCOVER_ENOUGH_PEERS;
        let since = now_ms().saturating_sub(*last_discover);
        if has_bootstrap && (few || since >= 60_000) {
            *last_discover = now_ms();
            let _ = self.swarm.behaviour_mut().kad.bootstrap();
        }
        self.show(crate::tui::Update::Peers(self.members.len()));
    }
}

#[cfg(test)]
mod run_file_tests {
    /// Every run file the project ships parses, validates (timing, limits, and an update that
    /// fits `max_blob_bytes`) and names a known optimizer.
    #[test]
    fn every_shipped_run_file_loads() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("runs");
        let mut seen = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                let run = super::load_run(&p, None).unwrap();
                let blob =
                    protocol::sparse::encoded_size(&run.layout(), run.optim.topk, run.optim.values);
                assert!(
                    blob as u64 <= run.limits.max_blob_bytes as u64,
                    "{}",
                    p.display()
                );
                seen += 1;
            }
        }
        assert!(seen >= 3, "{seen} run files");
        let local = super::load_run(&dir.join("tiny-local-steps.toml"), None).unwrap();
        let l = local
            .optim
            .local
            .clone()
            .expect("tiny-local-steps.toml runs local steps");
        assert_eq!(l.inner_steps, 2);
        assert_eq!(local.nominal_tokens(), 4 * 64 * 2);
    }
}
