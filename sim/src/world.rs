//! Engine mode: one real `protocol::engine::Engine` per node, on the engines' network
//! (`protocol::testnet`, which the protocol's tests use too) over the network model.
//!
//! The network carries what engines send (stands for gossipsub with `validate_messages()` and
//! content-addressed message ids, and request-response): every node keeps a fixed mesh of
//! about `mesh_degree` peers. A published frame goes to every mesh peer. A receiver drops a
//! frame whose content id (blake3) it has seen (duplicate suppression; the bytes were still
//! transferred, as without IDONTWANT), hands a new one to its engine with a tag, and forwards
//! it to its other mesh peers only once the engine's verdict for that tag is `Accept`; for
//! header-only announces the engine gives that verdict after the blob was fetched and
//! verified, so relays forward only what they can serve. Blobs are always fetched by id
//! (`inline_blob_bytes = 0`, as for every real-size update, which exceeds the 48 KiB inline
//! limit): a request to the chosen holder, answered from its engine's `serve_update`; a lost
//! request or response, a dead or partitioned peer is reported as `FetchFailed` after
//! `fetch_timeout_ms`, and a holder without the blob answers at once.
//!
//! Checkpoints travel as the engines ask (`Action::Request`: manifests, then chunks), with the
//! same latency, serialization and failures: a server is sent `Event::Requested`, takes a
//! snapshot of its parameters first for a manifest request (`Event::Snapshot`; a real node
//! takes one after every step), and its engine's `Respond`/`ServeChunk` is read from that
//! snapshot (the trainer's `checkpoint_tensors`). `[[checkpoint_liar]]` nodes lie while
//! serving (a flipped chunk byte, or a manifest of other parameters).
//!
//! This module is that network's [`Host`]: the trainers, the attackers (what they send and
//! serve), faults, and the metrics.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use crypto::{ContentId, Digest, Identity, NodeId};
use protocol::download::{self, Request};
use protocol::engine::{Action, Engine, Event, Report};
use protocol::error::Offence;
use protocol::run::{DataSpec, RunConfig, StepTiming};
use protocol::sparse::{encoded_size, SparseUpdate};
use protocol::wire::UpdateHeader;

use crate::adversary::{self, Attack, Bad, Body};
use crate::metrics::{finish, quantile, AttackStats, Metrics, StepMetrics};
use crate::net::{LinkProfile, Network, Partition};
use crate::rng::{derive, Rng};
use crate::scenario::{Fault, Lie, Scenario, TrainerKind};
use crate::synth::{Local, SimTrainer, Synthetic};
use crate::SimError;
use protocol::testnet::{Host, Micros, Net, Wire};

const GENESIS_MS: u64 = 10_000;
/// How long attackers that use the step's honest updates (ALIE, IPM, copier) wait for them
/// after their own training: about one header hop plus one blob fetch on a fast link.
const WATCH_MS: u64 = 200;
/// Virtual time a spot check takes (two forward passes on one batch).
const SPOT_MS: u64 = 5;

/// The world's own events (the network's travel beside them in its queue).
enum Ev {
    Fault(usize),
    Recover(usize),
    StepMark(u64),
    /// An attacker's publication time for `step` (its honest update in hand).
    Hostile {
        node: usize,
        incarnation: u64,
        step: u64,
        local: Local,
    },
}

/// What a node does with the protocol besides following it: honest, or one of the
/// attacks of [`adversary`] (what it sends is made in [`World::outgoing`]; withholders
/// misbehave when serving, in [`World::serve`]; all attackers collude in spot checks).
#[derive(Clone, Copy, PartialEq)]
pub enum Conduct {
    Honest,
    Hostile(Attack),
}

/// What a node publishes for a step, made from its honest update by its role.
enum Outgoing {
    Nothing,
    /// A blob for its own engine to sign and publish (and the tokens it states).
    Local {
        blob: Vec<u8>,
        tokens: u64,
    },
    /// Frames the world sends in its name, bypassing its engine (which would refuse them):
    /// (mesh peer, gossip frame), and (blob id, fetch response) to serve.
    Forged {
        sends: Vec<(usize, Vec<u8>)>,
        serve: Vec<(ContentId, Vec<u8>)>,
    },
}

/// One node beside its engine (which is the network's: `Net::peers`).
struct Node {
    role: Conduct,
    compute_ms: u64,
    params: Arc<Vec<f32>>,
    /// The parameters' version and wire digest (`SimTrainer::wire_digest`, what engines see).
    version: u64,
    digest: Digest,
    /// Snapshots served as checkpoints, oldest first: (version, parameters).
    snaps: Vec<(u64, Arc<Vec<f32>>)>,
    /// When each blob was in hand here (own update, or fetched), µs.
    arrivals: HashMap<ContentId, Micros>,
    incarnation: u64,
}

/// One applied step at one node.
struct Applied {
    step: u64,
    digest: Digest,
    included: u32,
    latency_ms: Option<f64>,
    /// Applied by an honest node; how many hostile updates it included.
    honest: bool,
    hostile: u32,
}

/// An apply result: (step, parameters, metrics digest, wire digest).
type Cached = (u64, Arc<Vec<f32>>, Digest, Digest);

/// The engines' network and the world around it.
pub struct World {
    net: Net<Ev, Network>,
    s: State,
}

/// Everything but the engines and the links: the network's [`Host`].
struct State {
    sc: Scenario,
    run: RunConfig,
    nodes: Vec<Node>,
    trainer: Box<dyn SimTrainer>,
    /// The step of the `LocalUpdate` the engine being handed an event is handling, if any: set
    /// by `Host::event`, read by `Host::sees` for that event's actions. It stays the current
    /// event's because no action handler here hands an engine an event synchronously.
    local: Option<u64>,
    /// Apply results shared by nodes that apply the same set to the same parameters.
    cache: HashMap<[u8; 32], Cached>,
    losses: HashMap<Digest, f64>,
    wire_extra: u64,
    rng: Rng,
    applied: Vec<Applied>,
    produced: BTreeMap<u64, u32>,
    bytes: Vec<(Vec<u64>, Vec<u64>, Vec<bool>)>,
    desyncs: u64,
    rejected: u64,
    genesis: Digest,
    /// The genesis parameters' wire digest (what engines start from).
    genesis_wire: Digest,
    /// The checkpoint tensors (name, shape) every engine checks manifests against.
    ckpt_layout: Vec<(String, Vec<u32>)>,
    /// How each lying checkpoint server lies.
    liars: HashMap<usize, Lie>,
    /// (client, liar) pairs where the client banned the liar or found it out.
    caught: HashSet<(usize, usize)>,
    ckpt: crate::metrics::Checkpoints,
    /// Per step: (sum, count) of the train losses nodes reported (real trainers only).
    train_losses: BTreeMap<u64, (f64, u32)>,
    run_id: protocol::run::RunId,
    /// Every identity an attacker node has used.
    hostile_ids: HashSet<NodeId>,
    /// Fetch responses attackers serve for their forged headers: blob id → (step, frame).
    forged: HashMap<ContentId, (u64, Vec<u8>)>,
    /// Honest updates of recent steps, in the order they were made (what colluding attackers
    /// see); kept only when some attacker watches.
    honest_updates: BTreeMap<u64, Vec<SparseUpdate>>,
    /// Stale replayers' own past updates: (node, step) → update.
    own_past: BTreeMap<(usize, u64), SparseUpdate>,
    /// Proof-of-work nonces of attacker identities (forged headers need them).
    pow: HashMap<NodeId, u64>,
    adv: AttackStats,
}

/// The identity of simulated node `i` under `seed` (a restarted node `i` of incarnation `c`
/// is `i + 100_000·c`). `swarm demo --key-seed SEED` gives its trainers these keys, so a
/// simulated node and a real one train on the same batches.
pub fn identity(seed: u64, i: usize) -> Identity {
    let mut s = [0u8; 32];
    s[..8].copy_from_slice(&seed.to_le_bytes());
    s[8..16].copy_from_slice(&(i as u64).to_le_bytes());
    s[16] = 0x5a;
    Identity::from_seed(s)
}

/// The run config and trainer a scenario asks for.
fn make_run(
    sc: &Scenario,
    timing: StepTiming,
) -> Result<(RunConfig, Box<dyn SimTrainer>), SimError> {
    let tr = &sc.trainer;
    let mut run = match (tr.kind, tr.run.is_empty()) {
        (TrainerKind::Tiny, false) => {
            let text = std::fs::read_to_string(&tr.run).map_err(|source| SimError::Io {
                path: tr.run.clone().into(),
                source,
            })?;
            let mut r: RunConfig = toml::from_str(&text).map_err(|e| SimError::RunFile {
                path: tr.run.clone().into(),
                source: Box::new(e),
            })?;
            r.timing = timing;
            r
        }
        (kind, _) => {
            let (model, data) = match kind {
                TrainerKind::Synthetic => (
                    sc.model.config(),
                    DataSpec::Synthetic {
                        seed: sc.seed,
                        vocab: sc.model.vocab,
                    },
                ),
                TrainerKind::Tiny => (
                    protocol::config::ModelConfig::named("tiny", 64).expect("a preset"),
                    DataSpec::Synthetic {
                        seed: tr.data_seed,
                        vocab: tr.data_vocab,
                    },
                ),
            };
            let mut r = RunConfig::new(&sc.name, model, sc.optim.config(sc.steps), data, timing);
            r.seed = sc.seed;
            r.batch_seqs = tr.batch;
            r
        }
    };
    // Every blob goes announce-then-fetch, the path real-size updates take (see the module
    // docs); results do not depend on it.
    run.limits.inline_blob_bytes = 0;
    if sc.model.checkpoint_chunk_bytes > 0 {
        run.limits.max_checkpoint_chunk_bytes = sc.model.checkpoint_chunk_bytes;
    }
    // The scenario's defences (a run file keeps its own unless the scenario sets some).
    let defence = sc.defence.resolve()?;
    if !defence.is_off() || tr.run.is_empty() {
        run.defence = defence;
    }
    run.validate().map_err(SimError::Run)?;
    let trainer: Box<dyn SimTrainer> = match tr.kind {
        TrainerKind::Synthetic => {
            let mut t = Synthetic::new(run.layout(), run.optim.clone(), sc.optim.noise, sc.seed);
            t.tokens = run.nominal_tokens();
            t.adamw_lr = sc.optim.adamw_lr;
            Box::new(t)
        }
        #[cfg(feature = "torch")]
        TrainerKind::Tiny => Box::new(crate::tiny::Tiny::new(&run, sc)?),
        #[cfg(not(feature = "torch"))]
        TrainerKind::Tiny => return Err(crate::ScenarioError::TinyNeedsTorch.into()),
    };
    Ok((run, trainer))
}

impl World {
    pub fn new(sc: &Scenario) -> Result<World, SimError> {
        let timing = StepTiming {
            genesis_ms: GENESIS_MS,
            period_ms: sc.timing.period_ms,
            grace_ms: sc.timing.grace_ms,
            summary_ms: sc.timing.summary_ms,
        };
        let (run, mut trainer) = make_run(sc, timing)?;
        let run_id = run.run_id();
        let optim = &run.optim;
        let actual = encoded_size(&run.layout(), optim.topk, optim.values) as u64;
        let wire_extra = sc.model.wire_blob_bytes.saturating_sub(actual);
        let init = Arc::new(trainer.init());
        let genesis = trainer.digest(&init);
        let genesis_wire = trainer.wire_digest(&init);
        let ckpt_layout = trainer
            .checkpoint_tensors(&init)
            .into_iter()
            .map(|(n, s, _)| (n, s))
            .collect();
        let classes = sc.node_classes();
        let net = Net::new(
            (GENESIS_MS - 500) * 1000,
            sc.network(),
            sc.gossip.fetch_timeout_ms * 1000,
            sc.gossip.request_bytes,
        );
        let s = State {
            run,
            nodes: Vec::new(),
            trainer,
            local: None,
            cache: HashMap::new(),
            losses: HashMap::new(),
            wire_extra,
            rng: derive(&[sc.seed, 0x6d657368]),
            applied: Vec::new(),
            produced: BTreeMap::new(),
            bytes: Vec::new(),
            desyncs: 0,
            rejected: 0,
            genesis,
            genesis_wire,
            ckpt_layout,
            liars: sc
                .checkpoint_liars
                .iter()
                .map(|l| (l.node, l.lie))
                .collect(),
            caught: HashSet::new(),
            ckpt: Default::default(),
            train_losses: BTreeMap::new(),
            run_id,
            hostile_ids: HashSet::new(),
            forged: HashMap::new(),
            honest_updates: BTreeMap::new(),
            own_past: BTreeMap::new(),
            pow: HashMap::new(),
            adv: AttackStats::default(),
            sc: sc.clone(),
        };
        let mut w = World { net, s };
        let (net, s) = (&mut w.net, &mut w.s);
        let l0 = s.trainer.eval(&init);
        s.losses.insert(genesis, l0);
        for (i, &c) in classes.iter().enumerate() {
            s.spawn(net, i, sc.classes[c].compute_ms, Some(init.clone()));
        }
        // A random mesh: each node links to mesh_degree/2 others (both directions), so the
        // average degree is about mesh_degree.
        let n = s.nodes.len();
        let half = sc.gossip.mesh_degree.div_ceil(2).min(n.saturating_sub(1));
        for i in 0..n {
            let mut added = 0;
            let mut tries = 0;
            while added < half && tries < 50 * half {
                tries += 1;
                let j = s.rng.below(n as u64) as usize;
                if j != i && !net.peers[i].mesh.contains(&j) {
                    net.link(i, j);
                    added += 1;
                }
            }
        }
        for i in 0..n {
            net.connect(i);
        }
        for (x, attack) in adversary::assign(&sc.attackers, n, sc.seed) {
            s.nodes[x].role = Conduct::Hostile(attack);
            s.hostile_ids.insert(net.peers[x].id);
        }
        let t = s.run.timing.clone();
        for (fi, f) in sc.faults.iter().enumerate() {
            net.q.push(f.at_ms(&t) * 1000, Wire::World(Ev::Fault(fi)));
        }
        for step in 0..=sc.steps {
            net.q
                .push(t.step_start(step) * 1000, Wire::World(Ev::StepMark(step)));
        }
        Ok(w)
    }

    /// Run to the end; `progress(step, steps)` is called at each step boundary.
    pub fn run(mut self, progress: &mut dyn FnMut(u64, u64)) -> Result<Metrics, SimError> {
        let t = self.s.run.timing.clone();
        let end = (t.apply_at(self.s.sc.steps.saturating_sub(1)) + t.grace_ms + 100) * 1000;
        let (net, s) = (&mut self.net, &mut self.s);
        while let Some((now, ev)) = net.next(end, s) {
            match ev {
                Ev::StepMark(step) => {
                    if step > 0 {
                        let (up, down) = net.links.take_counters();
                        let alive = net.peers.iter().map(|p| p.alive).collect();
                        s.bytes.push((up, down, alive));
                    }
                    s.step_mark(net, step);
                    progress(step, s.sc.steps);
                }
                Ev::Hostile {
                    node,
                    incarnation,
                    step,
                    local,
                } => {
                    if net.peers[node].alive && s.nodes[node].incarnation == incarnation {
                        s.publish(net, node, step, local, now);
                    }
                }
                Ev::Fault(fi) => s.fault(net, fi, now),
                Ev::Recover(i) => {
                    let c = s.nodes[i].compute_ms;
                    net.links.set_down(i, false, now);
                    s.spawn(net, i, c, None);
                    net.connect(i);
                }
            }
        }
        self.s.metrics(&self.net)
    }
}

/// The engines' network over the modelled links.
type Engines = Net<Ev, Network>;

impl State {
    /// A node process at index `i` (new or restarted): genesis params when starting on time,
    /// else a joiner.
    fn spawn(
        &mut self,
        net: &mut Engines,
        i: usize,
        compute_ms: u64,
        params: Option<Arc<Vec<f32>>>,
    ) {
        let now = net.now();
        let incarnation = self.nodes.get(i).map_or(0, |n| n.incarnation + 1);
        let idn = identity(self.sc.seed, i + 100_000 * incarnation as usize);
        let id = idn.node_id();
        let genesis = params.as_ref().map(|_| self.genesis_wire);
        let mut engine = Engine::new(
            self.run.clone(),
            idn,
            genesis,
            now / 1000,
            self.sc.seed ^ i as u64,
        );
        engine.set_checkpoint_layout(self.ckpt_layout.clone());
        let node = Node {
            role: Conduct::Honest,
            compute_ms,
            params: params.unwrap_or_default(),
            version: 0,
            digest: genesis.unwrap_or_default(),
            snaps: Vec::new(),
            arrivals: HashMap::new(),
            incarnation,
        };
        if i < self.nodes.len() {
            let old = std::mem::replace(&mut self.nodes[i], node);
            self.nodes[i].role = old.role;
            if old.role != Conduct::Honest {
                self.hostile_ids.insert(id);
            }
        } else {
            self.nodes.push(node);
        }
        net.place(i, engine);
        self.trainer.reset_node(i);
        net.push_event(now, i, Event::Timer);
    }

    fn fault(&mut self, net: &mut Engines, fi: usize, now: Micros) {
        match self.sc.faults[fi].clone() {
            Fault::Crash {
                node, recover_step, ..
            } => {
                if node < self.nodes.len() {
                    net.crash(node);
                    net.links.set_down(node, true, now);
                    if let Some(r) = recover_step {
                        let at = self.run.timing.step_start(r) * 1000;
                        net.q.push(at, Wire::World(Ev::Recover(node)));
                    }
                }
            }
            Fault::Join { count, class, .. } => {
                let c = self.sc.classes[class].clone();
                for _ in 0..count {
                    let i = net.links.add(c.link.clone());
                    self.spawn(net, i, c.compute_ms, None);
                    let alive: Vec<usize> = (0..i).filter(|&j| net.peers[j].alive).collect();
                    let mut pick = alive.clone();
                    self.rng.shuffle(&mut pick);
                    for &j in pick.iter().take(self.sc.gossip.mesh_degree) {
                        net.link(i, j);
                    }
                    net.connect(i);
                }
            }
            Fault::Partition {
                heal_step, lo, hi, ..
            } => {
                let until = self.run.timing.step_start(heal_step) * 1000;
                net.links.partitions.push(Partition {
                    from: now,
                    until,
                    lo,
                    hi,
                });
            }
            Fault::Degrade {
                node,
                factor,
                slowdown,
                ..
            } => {
                if node < self.nodes.len() {
                    let l: &mut LinkProfile = &mut net.links.links[node];
                    l.up_mbit *= factor;
                    l.down_mbit *= factor;
                    self.nodes[node].compute_ms =
                        (self.nodes[node].compute_ms as f64 * slowdown) as u64;
                }
            }
        }
    }

    /// Node `i`'s checkpoint request to `peer`, counted for the lying-server figures (the
    /// network carries it).
    fn count_request(&mut self, net: &Engines, i: usize, peer: &NodeId) {
        self.ckpt.requests += 1;
        let j = net.index.get(peer).copied();
        if let Some(j) = j.filter(|j| self.liars.contains_key(j)) {
            self.ckpt.liar_requests += 1;
            let caught = self.caught.contains(&(i, j))
                || net.peers[i]
                    .engine
                    .as_ref()
                    .is_some_and(|e| e.is_banned(peer) || e.is_checkpoint_liar(peer));
            self.ckpt.liar_requests_after_caught += caught as u64;
        }
    }
    /// A chunk frame of node `i`'s kept snapshot `version` (a lying server corrupts it).
    fn chunk(&self, i: usize, version: u64, index: u32, offset: u64, len: u64) -> Vec<u8> {
        let snap = self.nodes[i].snaps.iter().find(|(v, _)| *v == version);
        let frame = snap.map(|(_, p)| {
            let (lo, hi) = ((offset / 4) as usize, ((offset + len) / 4) as usize);
            let mut data: Vec<u8> = p[lo.min(p.len())..hi.min(p.len())]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            if self.liars.get(&i) == Some(&Lie::Chunk) {
                if let Some(b) = data.first_mut() {
                    *b ^= 0xff;
                }
            }
            download::chunk_frame(self.run_id, version, index, data)
        });
        frame.unwrap_or_default()
    }

    /// The verified checkpoint becomes node `i`'s parameters; the engine hears it loaded.
    fn load_checkpoint(
        &mut self,
        net: &mut Engines,
        i: usize,
        version: u64,
        tensors: &[Vec<u8>],
        now: Micros,
    ) {
        self.ckpt.loads += 1;
        let params: Vec<f32> = tensors
            .iter()
            .flat_map(|t| t.chunks_exact(4))
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        let digest = self.trainer.wire_digest(&params);
        let n = &mut self.nodes[i];
        n.params = Arc::new(params);
        n.version = version;
        n.digest = digest;
        net.push_event(now + 1000, i, Event::CheckpointLoaded { version, digest });
    }

    /// Node `i` trains `step`; its update (or an attacker's replacement) reaches its engine
    /// after the scenario's compute time.
    fn start_step(
        &mut self,
        net: &mut Engines,
        i: usize,
        step: u64,
        base_version: u64,
        now: Micros,
    ) {
        let params = self.nodes[i].params.clone();
        let id = net.peers[i].id;
        let local = self.trainer.train(i, &id, step, base_version, &params);
        if let Some(l) = local.train_loss {
            let e = self.train_losses.entry(step).or_default();
            e.0 += l;
            e.1 += 1;
        }
        // Virtual time: the scenario's compute time, never the host's.
        let at = now + self.nodes[i].compute_ms * 1000;
        match self.nodes[i].role {
            Conduct::Honest => {
                if self.sc.attackers.iter().any(|a| a.attack.watches()) {
                    let v = self.honest_updates.entry(step).or_default();
                    v.push(local.update.clone());
                }
            }
            Conduct::Hostile(a) => {
                if let Attack::Stale { .. } = a {
                    self.own_past.insert((i, step), local.update.clone());
                }
                // Attackers publish at their own time, with what they have seen by then.
                let wait = if a.watches() { WATCH_MS * 1000 } else { 0 };
                let incarnation = self.nodes[i].incarnation;
                let ev = Ev::Hostile {
                    node: i,
                    incarnation,
                    step,
                    local,
                };
                return net.q.push(at + wait, Wire::World(ev));
            }
        }
        let Outgoing::Local { blob, tokens } = self.outgoing(net, i, step, local) else {
            return;
        };
        let id = UpdateHeader::blob_id(&net.peers[i].id, step, &blob);
        self.nodes[i].arrivals.insert(id, at);
        net.push_event(at, i, Event::LocalUpdate { step, blob, tokens });
    }

    /// What honest engines report, counted for the metrics.
    fn count_report(&mut self, net: &Engines, i: usize, r: Report) {
        let honest = self.nodes[i].role == Conduct::Honest;
        match r {
            Report::Desync { .. } => self.desyncs += 1,
            Report::CheckpointRequested { .. } => self.ckpt.downloads += 1,
            Report::CheckpointFailed { .. } => self.ckpt.failures += 1,
            Report::Synced { .. } => self.ckpt.synced += 1,
            Report::CheckpointLiar { peer } => match net.index.get(&peer) {
                Some(&j) if self.liars.contains_key(&j) => {
                    self.caught.insert((i, j));
                    self.ckpt.liars_found += 1;
                }
                _ => self.ckpt.false_accusations += 1,
            },
            Report::Rejected { .. } => self.rejected += 1,
            Report::SpotResult { sender, gain, .. } if honest => {
                // `gain > 0` is the engine's pass rule (NaN fails).
                let failed = !(gain > 0.0);
                if self.hostile_ids.contains(&sender) {
                    self.adv.spot_hostile += 1;
                    self.adv.spot_hostile_failed += failed as u64;
                } else {
                    self.adv.spot_honest += 1;
                    self.adv.spot_honest_failed += failed as u64;
                }
            }
            Report::CopySuspected { .. } if honest => self.adv.copies += 1,
            _ => {}
        }
    }

    /// A penalty an honest node gave, counted as deserved or not.
    fn count_penalty(&mut self, i: usize, peer: NodeId, reason: Offence, points: u32) {
        if self.nodes[i].role == Conduct::Honest {
            if self.hostile_ids.contains(&peer) {
                self.adv.penalties += 1;
                self.adv.penalty_points += points as u64;
            } else {
                self.adv.false_penalties += 1;
            }
            if matches!(reason, Offence::Equivocation { .. }) {
                self.adv.equivocations += 1;
            }
        }
    }

    /// The shell disconnects a banned peer; counted as deserved or not.
    fn ban(&mut self, net: &mut Engines, i: usize, peer: NodeId, reason: Offence, now: Micros) {
        // The shell disconnects a banned peer; gossipsub grafts others in its place.
        if let Some(&j) = net.index.get(&peer) {
            self.unlink(net, i, j, now);
            let ckpt = matches!(reason, Offence::BadCheckpoint(_) | Offence::FalseCheckpoint);
            if self.liars.contains_key(&j) {
                self.caught.insert((i, j));
            } else if ckpt && !self.hostile_ids.contains(&peer) {
                self.ckpt.false_accusations += 1;
            }
        }
        if self.nodes[i].role == Conduct::Honest {
            if self.hostile_ids.contains(&peer) {
                self.adv.bans += 1;
            } else {
                self.adv.false_bans += 1;
            }
        }
    }

    /// A spot check's gain: honest nodes recompute the sender's step; colluders pass each
    /// other and fail everyone else.
    fn spot_gain(&mut self, i: usize, step: u64, sender: NodeId, tokens: u64, bytes: &[u8]) -> f64 {
        match self.nodes[i].role {
            Conduct::Hostile(_) => {
                if self.hostile_ids.contains(&sender) {
                    1.0
                } else {
                    -1.0
                }
            }
            // The engine validated the blob; a decode failure would be a bug, and NaN
            // is a failed check, never a panic.
            Conduct::Honest => match SparseUpdate::decode(bytes, bytes.len()) {
                Ok(u) => {
                    let params = self.nodes[i].params.clone();
                    self.trainer.spot_check(&sender, step, &params, &u, tokens)
                }
                Err(_) => f64::NAN,
            },
        }
    }

    /// The one place a node's outgoing update is made from its honest one, by its role: the
    /// blob its engine publishes and the tokens its header states, nothing, or frames forged
    /// in its name (equivocation, malformed messages: what an honest engine refuses to sign).
    /// Content attacks are `adversary::content_move`'s, the catalogue `swarm run` shares.
    fn outgoing(&mut self, net: &Engines, i: usize, step: u64, honest: Local) -> Outgoing {
        let attack = match self.nodes[i].role {
            Conduct::Honest | Conduct::Hostile(Attack::Withhold) => {
                return Outgoing::Local {
                    blob: honest.update.encode(),
                    tokens: honest.tokens,
                }
            }
            Conduct::Hostile(Attack::Silent) => return Outgoing::Nothing,
            Conduct::Hostile(a) => a,
        };
        let layout = self.run.layout();
        let k = self.run.optim.topk;
        let mut rng = derive(&[self.sc.seed, i as u64, step, 0x686f_7374]);
        let Local { update, tokens, .. } = honest;
        let local = |u: &SparseUpdate, tokens: u64| Outgoing::Local {
            blob: u.encode(),
            tokens,
        };
        let seen: Vec<&SparseUpdate> = self
            .honest_updates
            .get(&step)
            .map(|v| v.iter().collect())
            .unwrap_or_default();
        let past = match attack {
            Attack::Stale { lag } => step
                .checked_sub(lag)
                .and_then(|s| self.own_past.get(&(i, s))),
            _ => None,
        };
        let cx = adversary::Ctx {
            own: &update,
            tokens,
            layout: &layout,
            k,
            codec: update.codec,
            seen: &seen,
            past: past.is_some(),
            pick: adversary::Pick::Drawn,
            rng: &mut rng,
        };
        if let Some(m) = adversary::content_move(attack, cx) {
            return match m.body {
                Body::Own => local(&update, m.tokens),
                Body::Past => local(past.expect("kept"), m.tokens),
                Body::New(u) => local(&u, m.tokens),
            };
        }
        match attack {
            Attack::Equivocate => {
                let flipped = adversary::signflip(&update, &layout);
                let (a, fa) = self.forge(net, i, step, &update.encode(), tokens);
                let (b, fb) = self.forge(net, i, step, &flipped.encode(), tokens);
                // Alternate mesh peers get different versions; relays spread both.
                let sends = net.peers[i]
                    .mesh
                    .iter()
                    .enumerate()
                    .map(|(n, &j)| (j, if n % 2 == 0 { a.1.clone() } else { b.1.clone() }))
                    .collect();
                Outgoing::Forged {
                    sends,
                    serve: vec![(a.0, fa), (b.0, fb)],
                }
            }
            Attack::Malformed => {
                let max = self.run.limits.max_message_bytes as usize;
                let (frame, serve) =
                    match adversary::malformed(step, &update, &layout, max, &mut rng) {
                        Bad::Frame(f) => (f, Vec::new()),
                        Bad::Blob(blob) => {
                            let ((id, ann), upd) = self.forge(net, i, step, &blob, tokens);
                            (ann, vec![(id, upd)])
                        }
                    };
                let sends = net.peers[i]
                    .mesh
                    .iter()
                    .map(|&j| (j, frame.clone()))
                    .collect();
                Outgoing::Forged { sends, serve }
            }
            _ => unreachable!("content attacks are the catalogue's"),
        }
    }

    /// A header for `blob` signed by node `i`'s current identity: ((blob id, announce frame),
    /// fetch response frame).
    fn forge(
        &mut self,
        net: &Engines,
        i: usize,
        step: u64,
        blob: &[u8],
        tokens: u64,
    ) -> ((ContentId, Vec<u8>), Vec<u8>) {
        let (n, p) = (&self.nodes[i], &net.peers[i]);
        let me = identity(self.sc.seed, i + 100_000 * n.incarnation as usize);
        let base = p
            .engine
            .as_ref()
            .map(|e| {
                let st = e.status();
                (st.version, st.digest)
            })
            .unwrap_or_default();
        let (run_id, bits) = (self.run_id, self.run.defence.pow_bits);
        let pow = *self
            .pow
            .entry(p.id)
            .or_insert_with(|| crypto::pow::solve(&run_id.0, &me.node_id(), bits));
        let (id, ann, upd) =
            adversary::forge(&self.run, self.run_id, &me, pow, step, base, blob, tokens);
        ((id, ann), upd)
    }

    /// An attacker publishes for `step` (at its publication time): through its engine, or by
    /// sending forged frames to its mesh peers.
    fn publish(&mut self, net: &mut Engines, i: usize, step: u64, local: Local, now: Micros) {
        match self.outgoing(net, i, step, local) {
            Outgoing::Nothing => {}
            Outgoing::Local { blob, tokens } => {
                let id = UpdateHeader::blob_id(&net.peers[i].id, step, &blob);
                self.nodes[i].arrivals.insert(id, now);
                net.deliver(i, Event::LocalUpdate { step, blob, tokens }, now, self);
            }
            Outgoing::Forged { sends, serve } => {
                *self.produced.entry(step).or_default() += 1;
                self.adv.hostile_published += 1;
                for (id, frame) in serve {
                    self.forged.insert(id, (step, frame));
                }
                for (j, frame) in sends {
                    let id = ContentId::of(&frame);
                    net.peers[i].seen.insert(id);
                    net.gossip_to(i, j, id, Arc::new(frame), now);
                }
            }
        }
    }

    /// Node `i` drops its mesh link to `j` (it banned `j`) and, if its mesh fell below half
    /// its degree, grafts random live peers it has not banned (gossipsub's `mesh_n_low`).
    fn unlink(&mut self, net: &mut Engines, i: usize, j: usize, now: Micros) {
        net.peers[i].mesh.remove(&j);
        net.peers[j].mesh.remove(&i);
        let low = self.sc.gossip.mesh_degree.div_ceil(2);
        let n = self.nodes.len();
        let mut tries = 0;
        while net.peers[i].mesh.len() < low && tries < 4 * n {
            tries += 1;
            let c = self.rng.below(n as u64) as usize;
            let ok = c != i
                && c != j
                && net.peers[c].alive
                && !net.peers[i].mesh.contains(&c)
                && net.peers[i]
                    .engine
                    .as_ref()
                    .is_some_and(|e| !e.is_banned(&net.peers[c].id));
            if ok {
                net.link(i, c);
                let (pi, pc) = (net.peers[i].id, net.peers[c].id);
                net.push_event(now, i, Event::PeerConnected { peer: pc });
                net.push_event(now, c, Event::PeerConnected { peer: pi });
            }
        }
    }

    /// A fresh identity (a Sybil's next one) connects to `mesh_degree` random live peers, as
    /// a joiner does.
    fn regraft(&mut self, net: &mut Engines, i: usize) {
        let old: Vec<usize> = net.peers[i].mesh.iter().copied().collect();
        for j in old {
            net.peers[j].mesh.remove(&i);
        }
        net.peers[i].mesh.clear();
        let mut pick: Vec<usize> = (0..self.nodes.len())
            .filter(|&j| j != i && net.peers[j].alive)
            .collect();
        self.rng.shuffle(&mut pick);
        for &j in pick.iter().take(self.sc.gossip.mesh_degree) {
            net.link(i, j);
        }
    }

    /// Step boundary bookkeeping: Sybils take fresh identities; old attacker state is dropped.
    fn step_mark(&mut self, net: &mut Engines, s: u64) {
        for i in 0..self.nodes.len() {
            if let Conduct::Hostile(Attack::Sybil { every }) = self.nodes[i].role {
                if s > 0 && s.is_multiple_of(every) && net.peers[i].alive {
                    let c = self.nodes[i].compute_ms;
                    self.spawn(net, i, c, None);
                    self.regraft(net, i);
                    net.connect(i);
                }
            }
        }
        let keep = s.saturating_sub(self.run.limits.past_steps as u64 + 2);
        self.forged.retain(|_, (step, _)| *step >= keep);
        self.honest_updates = self.honest_updates.split_off(&s.saturating_sub(1));
        let lag = self
            .sc
            .attackers
            .iter()
            .filter_map(|a| match a.attack {
                Attack::Stale { lag } => Some(lag),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        self.own_past.retain(|(_, step), _| step + lag + 1 >= s);
    }

    fn apply(
        &mut self,
        net: &mut Engines,
        i: usize,
        step: u64,
        updates: Vec<protocol::engine::Included>,
        now: Micros,
    ) {
        let mut key = self.nodes[i].digest.0.to_vec();
        key.extend_from_slice(&step.to_le_bytes());
        for u in &updates {
            key.extend_from_slice(&u.blob.0);
        }
        let key = Digest::of(&key).0;
        let (params, digest, wire) = match self.cache.get(&key) {
            Some((_, p, d, w)) => (p.clone(), *d, *w),
            None => {
                let decoded: Vec<SparseUpdate> = updates
                    .iter()
                    .map(|u| {
                        SparseUpdate::decode(&u.bytes.0, u.bytes.0.len())
                            .expect("the engine validated it")
                    })
                    .collect();
                let set: Vec<(&SparseUpdate, u64)> = decoded
                    .iter()
                    .zip(&updates)
                    .map(|(d, u)| (d, u.tokens))
                    .collect();
                let p = Arc::new(self.trainer.apply_round(step, &self.nodes[i].params, &set));
                let d = self.trainer.digest(&p);
                let w = self.trainer.wire_digest(&p);
                if !self.losses.contains_key(&d) {
                    let l = self.trainer.eval(&p);
                    self.losses.insert(d, l);
                }
                self.cache.retain(|_, (s, _, _, _)| *s + 3 > step);
                self.cache.insert(key, (step, p.clone(), d, w));
                (p, d, w)
            }
        };
        let start = self.run.timing.step_start(step) * 1000;
        let n = &mut self.nodes[i];
        let latency_ms = updates
            .iter()
            .filter_map(|u| n.arrivals.get(&u.blob))
            .max()
            .map(|&t| t.saturating_sub(start) as f64 / 1000.0);
        n.arrivals.retain(|_, t| *t + 4 * 1000 * 1000 * 60 > now);
        n.params = params;
        n.version = step + 1;
        n.digest = wire;
        let honest = n.role == Conduct::Honest;
        let hostile = updates
            .iter()
            .filter(|u| self.hostile_ids.contains(&u.sender))
            .count() as u32;
        self.applied.push(Applied {
            step,
            digest,
            included: updates.len() as u32,
            latency_ms,
            honest,
            hostile,
        });
        net.push_event(now + 1000, i, Event::Applied { step, digest: wire });
    }

    fn adversary_stats(&self) -> AttackStats {
        let mut a = self.adv.clone();
        a.hostile_nodes = self
            .nodes
            .iter()
            .filter(|n| n.role != Conduct::Honest)
            .count() as u32;
        a.hostile_identities = self.hostile_ids.len() as u32;
        let honest: Vec<&Applied> = self.applied.iter().filter(|x| x.honest).collect();
        let k = honest.len().max(1) as f64;
        a.hostile_included = honest.iter().map(|x| x.hostile as u64).sum();
        a.hostile_included_per_apply = a.hostile_included as f64 / k;
        a.honest_included_per_apply = honest
            .iter()
            .map(|x| (x.included - x.hostile) as f64)
            .sum::<f64>()
            / k;
        let mut by_step: BTreeMap<u64, (BTreeSet<Digest>, u32)> = BTreeMap::new();
        for x in &honest {
            let e = by_step.entry(x.step).or_default();
            e.0.insert(x.digest);
            e.1 += x.hostile;
        }
        a.honest_disagree_steps = by_step.values().filter(|e| e.0.len() > 1).count() as u32;
        let last_hostile = by_step.iter().filter(|e| e.1 .1 > 0).map(|e| *e.0).max();
        let last = by_step.keys().next_back().copied();
        a.excluded_from_step = match (last_hostile, last) {
            (None, _) => Some(0),
            (Some(h), Some(l)) if h < l => Some(h + 1),
            _ => None,
        };
        a
    }

    fn metrics(mut self, net: &Engines) -> Result<Metrics, SimError> {
        let sc = self.sc.clone();
        // Without a baseline its column is NaN (null in the JSON; the plot leaves it out).
        let baseline = if sc.trainer.baseline || sc.trainer.kind == TrainerKind::Synthetic {
            self.trainer.baseline(sc.steps, sc.nodes())?
        } else {
            vec![f64::NAN; sc.steps as usize]
        };
        let mut by_step: BTreeMap<u64, Vec<&Applied>> = BTreeMap::new();
        for a in &self.applied {
            by_step.entry(a.step).or_default().push(a);
        }
        let mut all_lat = Vec::new();
        let mut rows = Vec::new();
        for s in 0..sc.steps {
            let v = by_step.get(&s).cloned().unwrap_or_default();
            let mut tally: BTreeMap<Digest, u32> = BTreeMap::new();
            for a in &v {
                *tally.entry(a.digest).or_default() += 1;
            }
            let maj = tally.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)));
            let produced = self.produced.get(&s).copied().unwrap_or(0);
            let inc: Vec<u32> = v.iter().map(|a| a.included).collect();
            let mut lat: Vec<f64> = v.iter().filter_map(|a| a.latency_ms).collect();
            all_lat.extend(lat.iter().copied());
            let (mut up_m, mut up_x, mut dn_m, mut dn_x) = (0.0, 0, 0.0, 0);
            if let Some((up, down, alive)) = self.bytes.get(s as usize) {
                let live: Vec<usize> = (0..alive.len()).filter(|&i| alive[i]).collect();
                let k = live.len().max(1) as f64;
                up_m = live.iter().map(|&i| up[i] as f64).sum::<f64>() / k;
                dn_m = live.iter().map(|&i| down[i] as f64).sum::<f64>() / k;
                up_x = live.iter().map(|&i| up[i]).max().unwrap_or(0);
                dn_x = live.iter().map(|&i| down[i]).max().unwrap_or(0);
            }
            let im = if inc.is_empty() {
                0.0
            } else {
                inc.iter().sum::<u32>() as f64 / inc.len() as f64
            };
            rows.push(StepMetrics {
                step: s,
                loss: maj.and_then(|(d, _)| self.losses.get(d).copied()),
                train_loss: self
                    .train_losses
                    .get(&s)
                    .map(|&(sum, n)| sum / n.max(1) as f64),
                digest: maj.map_or(String::new(), |(d, _)| d.to_hex()),
                baseline_loss: baseline.get(s as usize).copied().unwrap_or(f64::NAN),
                applied_nodes: v.len() as u32,
                agree: maj.map_or(0.0, |(_, c)| *c as f64 / v.len() as f64),
                produced,
                included_mean: im,
                included_min: inc.iter().copied().min().unwrap_or(0),
                included_max: inc.iter().copied().max().unwrap_or(0),
                excluded_mean: (produced as f64 - im).max(0.0),
                up_mean: up_m,
                up_max: up_x,
                down_mean: dn_m,
                down_max: dn_x,
                latency_p50_ms: quantile(&mut lat, 0.5),
                latency_p90_ms: quantile(&mut lat, 0.9),
                latency_max_ms: quantile(&mut lat, 1.0),
            });
        }
        let mut m = Metrics {
            scenario: sc.name.clone(),
            mode: "engine".into(),
            seed: sc.seed,
            nodes: self.nodes.len(),
            update_bytes: encoded_size(
                self.trainer.layout(),
                self.run.optim.topk,
                self.run.optim.values,
            ) as u64
                + self.wire_extra,
            steps: rows,
            ..Default::default()
        };
        m.totals.initial_loss = self.losses.get(&self.genesis).copied().unwrap_or(f64::NAN);
        m.totals.desyncs = self.desyncs;
        m.totals.rejected = self.rejected;
        m.totals.messages = net.links.messages;
        m.totals.lost = net.links.lost;
        m.totals.events = net.events;
        finish(&mut m, &mut all_lat);
        if !self.sc.attackers.is_empty() || !self.run.defence.is_off() {
            m.adversary = Some(self.adversary_stats());
        }
        if self.ckpt.downloads > 0 {
            let mut c = self.ckpt.clone();
            for (i, n) in net.peers.iter().enumerate() {
                let Some(e) = n.engine.as_ref().filter(|_| n.alive) else {
                    continue;
                };
                for &j in self.liars.keys().filter(|&&j| j != i) {
                    let l = &net.peers[j].id;
                    c.liars_caught += (e.is_banned(l) || e.is_checkpoint_liar(l)) as u64;
                }
            }
            m.checkpoints = Some(c);
        }
        Ok(m)
    }
}

/// What the engines' network leaves to the world.
impl Host<Ev, Network> for State {
    /// What a node's engine asked for beyond the network, done in the simulated world (one
    /// method per action).
    fn act(&mut self, net: &mut Engines, i: usize, a: Action, now: Micros) {
        match a {
            Action::ServeChunk {
                token,
                version,
                index,
                offset,
                len,
            } => {
                let frame = self.chunk(i, version, index, offset, len);
                net.respond(i, token, frame, now, self);
            }
            // Snapshots are taken on demand, before each manifest request is served.
            Action::Snapshot => {}
            Action::LoadCheckpoint {
                version, tensors, ..
            } => self.load_checkpoint(net, i, version, &tensors, now),
            Action::StartStep { step, base_version } => {
                self.start_step(net, i, step, base_version, now)
            }
            Action::Apply { step, updates } => self.apply(net, i, step, updates, now),
            Action::Report(r) => self.count_report(net, i, r),
            Action::Penalize {
                peer,
                reason,
                points,
            } => self.count_penalty(i, peer, reason, points),
            Action::Ban { peer, reason } => self.ban(net, i, peer, reason, now),
            Action::SpotCheck {
                step,
                sender,
                blob,
                tokens,
                bytes,
            } => {
                let gain = self.spot_gain(i, step, sender, tokens, &bytes.0);
                let ev = Event::SpotChecked {
                    step,
                    sender,
                    blob,
                    gain,
                };
                net.push_event(now + SPOT_MS * 1000, i, ev);
            }
            // The network's own (publish, send, verdict, fetch, request, respond).
            _ => {}
        }
    }

    fn event(&mut self, i: usize, ev: &Event, now: Micros) {
        if let Event::Fetched { blob, .. } = ev {
            self.nodes[i].arrivals.entry(*blob).or_insert(now);
        }
        self.local = match ev {
            Event::LocalUpdate { step, .. } => Some(*step),
            _ => None,
        };
    }

    /// Updates produced (an announce published for a local update), and checkpoint requests.
    fn sees(&mut self, net: &Engines, i: usize, a: &Action, _now: Micros) {
        match (self.local, a) {
            (Some(step), Action::Publish { bytes })
                if bytes.get(1) == Some(&protocol::wire::kind::ANNOUNCE) =>
            {
                *self.produced.entry(step).or_default() += 1;
                if self.nodes[i].role != Conduct::Honest {
                    self.adv.hostile_published += 1;
                }
            }
            (_, Action::Request { peer, .. }) => self.count_request(net, i, peer),
            _ => {}
        }
    }

    /// Withholders serve nothing; attackers serve the updates they forged.
    fn serve(&mut self, net: &Engines, server: usize, blob: &ContentId) -> Option<Vec<u8>> {
        match self.nodes[server].role {
            Conduct::Hostile(Attack::Withhold) => None,
            Conduct::Hostile(_) if self.forged.contains_key(blob) => {
                self.forged.get(blob).map(|f| f.1.clone())
            }
            _ => net.peers[server]
                .engine
                .as_ref()
                .and_then(|e| e.serve_update(blob)),
        }
    }

    /// A modelled update size is charged in full.
    fn blob_bytes(&self, frame: &[u8]) -> u64 {
        frame.len() as u64 + self.wire_extra
    }

    /// `server` snapshots its parameters for serving, unless it holds that version already
    /// (a liar of [`Lie::Manifest`] snapshots other parameters under the same version).
    fn snapshot(&mut self, net: &mut Engines, server: usize, now: Micros) {
        let n = &self.nodes[server];
        let v = n.version;
        if n.snaps.iter().any(|(s, _)| *s == v) {
            return;
        }
        let mut params = n.params.clone();
        if self.liars.get(&server) == Some(&Lie::Manifest) {
            let mut p = params.to_vec();
            if let Some(x) = p.first_mut() {
                *x += 1.0;
            }
            params = Arc::new(p);
        }
        let tensors = self.trainer.checkpoint_tensors(&params);
        let manifest = download::manifest_of(
            self.run_id,
            &self.run.limits,
            net.peers[server].id,
            v,
            &tensors,
        );
        let n = &mut self.nodes[server];
        n.snaps.retain(|(s, _)| *s < v);
        n.snaps.push((v, params));
        if n.snaps.len() > protocol::engine::KEEP_SNAPSHOTS {
            n.snaps.remove(0);
        }
        net.deliver(server, Event::Snapshot { manifest }, now, self);
    }

    /// A modelled checkpoint size is charged chunk by chunk, in proportion.
    fn respond(
        &mut self,
        _net: &Engines,
        server: usize,
        req: &Request,
        bytes: &mut Vec<u8>,
    ) -> u64 {
        let real = self.nodes[server].params.len() as u64 * 4;
        match (req, self.sc.model.checkpoint_bytes) {
            (Request::Chunk { .. }, b) if b > 0 && real > 0 => {
                (bytes.len() as u64).saturating_mul(b) / real
            }
            _ => bytes.len() as u64,
        }
    }
}
