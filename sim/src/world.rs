//! Engine mode: one real `protocol::engine::Engine` per node, over the network model, with a
//! modelled gossip layer.
//!
//! Gossip (stands for gossipsub with `validate_messages()` and content-addressed message ids):
//! every node keeps a fixed mesh of about `mesh_degree` peers. A published frame goes to every
//! mesh peer. A receiver drops a frame whose content id (blake3) it has seen (duplicate
//! suppression; the bytes were still transferred, as without IDONTWANT), hands a new one to its
//! engine with a tag, and forwards it to its other mesh peers only once the engine's verdict for
//! that tag is `Accept`; for header-only announces the engine gives that verdict after the blob
//! was fetched and verified, so relays forward only what they can serve. Blobs are always
//! fetched by id (`inline_blob_bytes = 0`, as for every real-size update, which exceeds the
//! 48 KiB inline limit): a request to the chosen holder, answered from its engine's
//! `serve_update`; a lost request or response, a dead or partitioned peer is reported as
//! `FetchFailed` after `fetch_timeout_ms`, and a holder without the blob answers at once.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use crypto::{ContentId, Digest, Identity, NodeId};
use protocol::engine::{Action, Engine, Event, Report, Verdict};
use protocol::run::{DataSpec, RunConfig, StepTiming};
use protocol::sparse::{encoded_size, SparseUpdate};

use crate::metrics::{finish, quantile, Metrics, StepMetrics};
use crate::net::{LinkProfile, Network, Partition};
use crate::queue::{EventQueue, Micros};
use crate::rng::{derive, Rng};
use crate::scenario::{Attacker, Fault, Scenario};
use crate::synth::{AdamBaseline, Synthetic, Trainer};
use crate::SimError;

const GENESIS_MS: u64 = 10_000;

enum Ev {
    Engine {
        node: usize,
        ev: Event,
    },
    Gossip {
        node: usize,
        from: usize,
        id: ContentId,
        bytes: Arc<Vec<u8>>,
    },
    FetchReq {
        server: usize,
        client: usize,
        blob: ContentId,
    },
    Checkpoint {
        node: usize,
        params: Arc<Vec<f32>>,
        version: u64,
        digest: Digest,
    },
    Fault(usize),
    Recover(usize),
    StepMark(u64),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Honest,
    Withhold,
    Silent,
}

struct Node {
    engine: Option<Engine>,
    id: NodeId,
    alive: bool,
    role: Role,
    compute_ms: u64,
    params: Arc<Vec<f32>>,
    digest: Digest,
    mesh: BTreeSet<usize>,
    seen: HashSet<ContentId>,
    timer: Option<u64>,
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
}

pub struct World {
    sc: Scenario,
    run: RunConfig,
    q: EventQueue<Ev>,
    net: Network,
    nodes: Vec<Node>,
    index: HashMap<NodeId, usize>,
    trainer: Synthetic,
    /// (tag) → (node, from, id, bytes): frames waiting for their engine's verdict.
    pending: HashMap<u64, (usize, usize, ContentId, Arc<Vec<u8>>)>,
    next_tag: u64,
    /// Apply results shared by nodes that apply the same set to the same parameters.
    cache: HashMap<[u8; 32], (u64, Arc<Vec<f32>>, Digest)>,
    losses: HashMap<Digest, f64>,
    wire_extra: u64,
    rng: Rng,
    applied: Vec<Applied>,
    produced: BTreeMap<u64, u32>,
    bytes: Vec<(Vec<u64>, Vec<u64>, Vec<bool>)>,
    desyncs: u64,
    rejected: u64,
    events: u64,
    genesis: Digest,
}

fn identity(seed: u64, i: usize) -> Identity {
    let mut s = [0u8; 32];
    s[..8].copy_from_slice(&seed.to_le_bytes());
    s[8..16].copy_from_slice(&(i as u64).to_le_bytes());
    s[16] = 0x5a;
    Identity::from_seed(s)
}

fn params_digest(p: &[f32]) -> Digest {
    let mut b = Vec::with_capacity(p.len() * 4);
    for x in p {
        b.extend_from_slice(&x.to_le_bytes());
    }
    Digest::of(&b)
}

impl World {
    pub fn new(sc: &Scenario) -> Result<World, SimError> {
        let model = sc.model.config();
        let optim = sc.optim.config(sc.steps);
        let timing = StepTiming {
            genesis_ms: GENESIS_MS,
            period_ms: sc.timing.period_ms,
            grace_ms: sc.timing.grace_ms,
            summary_ms: sc.timing.summary_ms,
        };
        let mut run = RunConfig::new(
            &sc.name,
            model,
            optim.clone(),
            DataSpec::Synthetic {
                seed: sc.seed,
                vocab: sc.model.vocab,
            },
            timing,
        );
        run.seed = sc.seed;
        run.limits.inline_blob_bytes = 0;
        run.validate()
            .map_err(|e| SimError::Scenario(e.to_string()))?;
        let layout = run.layout();
        let actual = encoded_size(&layout, optim.topk, optim.values) as u64;
        let wire_extra = sc.model.wire_blob_bytes.saturating_sub(actual);
        let trainer = Synthetic::new(layout, optim, sc.optim.noise, sc.seed);
        let init = Arc::new(trainer.init());
        let genesis = params_digest(&init);
        let classes = sc.node_classes();
        let net = Network::new(
            classes
                .iter()
                .map(|&c| sc.classes[c].link.clone())
                .collect(),
            sc.seed,
        );
        let mut w = World {
            run,
            q: EventQueue::new((GENESIS_MS - 500) * 1000),
            net,
            nodes: Vec::new(),
            index: HashMap::new(),
            trainer,
            pending: HashMap::new(),
            next_tag: 1,
            cache: HashMap::new(),
            losses: HashMap::new(),
            wire_extra,
            rng: derive(&[sc.seed, 0x6d657368]),
            applied: Vec::new(),
            produced: BTreeMap::new(),
            bytes: Vec::new(),
            desyncs: 0,
            rejected: 0,
            events: 0,
            genesis,
            sc: sc.clone(),
        };
        let l0 = w.trainer.loss(&init);
        w.losses.insert(genesis, l0);
        for (i, &c) in classes.iter().enumerate() {
            w.spawn(i, sc.classes[c].compute_ms, Some(init.clone()));
        }
        // A random mesh: each node links to mesh_degree/2 others (both directions), so the
        // average degree is about mesh_degree.
        let n = w.nodes.len();
        let half = sc.gossip.mesh_degree.div_ceil(2).min(n.saturating_sub(1));
        for i in 0..n {
            let mut added = 0;
            let mut tries = 0;
            while added < half && tries < 50 * half {
                tries += 1;
                let j = w.rng.below(n as u64) as usize;
                if j != i && w.nodes[i].mesh.insert(j) {
                    w.nodes[j].mesh.insert(i);
                    added += 1;
                }
            }
        }
        for i in 0..n {
            w.connect_mesh(i);
        }
        for a in &sc.attackers {
            let (nodes, role) = match a {
                Attacker::Withhold { nodes } => (nodes, Role::Withhold),
                Attacker::Silent { nodes } => (nodes, Role::Silent),
            };
            for &x in nodes {
                if x < n {
                    w.nodes[x].role = role;
                }
            }
        }
        let t = w.run.timing.clone();
        for (fi, f) in sc.faults.iter().enumerate() {
            let at = match f {
                Fault::Crash {
                    at_step, offset_ms, ..
                } => t.step_start(*at_step) + offset_ms,
                Fault::Join { at_step, .. }
                | Fault::Partition { at_step, .. }
                | Fault::Degrade { at_step, .. } => t.step_start(*at_step),
            };
            w.q.push(at * 1000, Ev::Fault(fi));
        }
        for s in 0..=sc.steps {
            w.q.push(t.step_start(s) * 1000, Ev::StepMark(s));
        }
        Ok(w)
    }

    /// A node process at index `i` (new or restarted): genesis params when starting on time,
    /// else a joiner.
    fn spawn(&mut self, i: usize, compute_ms: u64, params: Option<Arc<Vec<f32>>>) {
        let now_ms = self.q.now() / 1000;
        let incarnation = self.nodes.get(i).map_or(0, |n| n.incarnation + 1);
        let idn = identity(self.sc.seed, i + 100_000 * incarnation as usize);
        let id = idn.node_id();
        let genesis = params.as_ref().map(|_| self.genesis);
        let engine = Engine::new(
            self.run.clone(),
            idn,
            genesis,
            now_ms,
            self.sc.seed ^ i as u64,
        );
        let node = Node {
            engine: Some(engine),
            id,
            alive: true,
            role: Role::Honest,
            compute_ms,
            params: params.unwrap_or_default(),
            digest: genesis.unwrap_or_default(),
            mesh: BTreeSet::new(),
            seen: HashSet::new(),
            timer: None,
            arrivals: HashMap::new(),
            incarnation,
        };
        if i < self.nodes.len() {
            let old = std::mem::replace(&mut self.nodes[i], node);
            self.index.remove(&old.id);
            self.nodes[i].mesh = old.mesh;
            self.nodes[i].role = old.role;
        } else {
            self.nodes.push(node);
        }
        self.index.insert(id, i);
        self.trainer.reset_node(i);
        self.q.push(
            self.q.now(),
            Ev::Engine {
                node: i,
                ev: Event::Timer,
            },
        );
    }

    fn connect_mesh(&mut self, i: usize) {
        let now = self.q.now();
        let peers: Vec<usize> = self.nodes[i].mesh.iter().copied().collect();
        for j in peers {
            if self.nodes[j].alive {
                let (pi, pj) = (self.nodes[i].id, self.nodes[j].id);
                self.q.push(
                    now,
                    Ev::Engine {
                        node: i,
                        ev: Event::PeerConnected { peer: pj },
                    },
                );
                self.q.push(
                    now,
                    Ev::Engine {
                        node: j,
                        ev: Event::PeerConnected { peer: pi },
                    },
                );
            }
        }
    }

    /// Run to the end; `progress(step, steps)` is called at each step boundary.
    pub fn run(mut self, progress: &mut dyn FnMut(u64, u64)) -> Metrics {
        let t = self.run.timing.clone();
        let end = (t.apply_at(self.sc.steps.saturating_sub(1)) + t.grace_ms + 100) * 1000;
        while let Some((now, ev)) = self.q.pop_until(end) {
            self.events += 1;
            match ev {
                Ev::StepMark(s) => {
                    if s > 0 {
                        let (up, down) = self.net.take_counters();
                        let alive = self.nodes.iter().map(|n| n.alive).collect();
                        self.bytes.push((up, down, alive));
                    }
                    progress(s, self.sc.steps);
                }
                Ev::Engine { node, ev } => self.deliver(node, ev, now),
                Ev::Gossip {
                    node,
                    from,
                    id,
                    bytes,
                } => {
                    if !self.nodes[node].alive || !self.nodes[node].seen.insert(id) {
                        continue;
                    }
                    let tag = self.next_tag;
                    self.next_tag += 1;
                    self.pending.insert(tag, (node, from, id, bytes.clone()));
                    let from_id = self.nodes[from].id;
                    self.deliver(
                        node,
                        Event::Message {
                            from: from_id,
                            tag: Some(tag),
                            bytes: bytes.to_vec(),
                        },
                        now,
                    );
                }
                Ev::FetchReq {
                    server,
                    client,
                    blob,
                } => self.serve(server, client, blob, now),
                Ev::Checkpoint {
                    node,
                    params,
                    version,
                    digest,
                } => {
                    if self.nodes[node].alive {
                        self.nodes[node].params = params;
                        self.nodes[node].digest = digest;
                        self.deliver(node, Event::CheckpointLoaded { version, digest }, now);
                    }
                }
                Ev::Fault(fi) => self.fault(fi, now),
                Ev::Recover(i) => {
                    let c = self.nodes[i].compute_ms;
                    self.net.set_down(i, false, now);
                    self.spawn(i, c, None);
                    self.connect_mesh(i);
                }
            }
        }
        self.metrics()
    }

    fn fault(&mut self, fi: usize, now: Micros) {
        match self.sc.faults[fi].clone() {
            Fault::Crash {
                node, recover_step, ..
            } => {
                if node < self.nodes.len() {
                    self.nodes[node].alive = false;
                    self.nodes[node].engine = None;
                    self.net.set_down(node, true, now);
                    if let Some(r) = recover_step {
                        self.q
                            .push(self.run.timing.step_start(r) * 1000, Ev::Recover(node));
                    }
                }
            }
            Fault::Join { count, class, .. } => {
                let c = self.sc.classes[class].clone();
                for _ in 0..count {
                    let i = self.net.add(c.link.clone());
                    self.spawn(i, c.compute_ms, None);
                    let alive: Vec<usize> = (0..i).filter(|&j| self.nodes[j].alive).collect();
                    let mut pick = alive.clone();
                    self.rng.shuffle(&mut pick);
                    for &j in pick.iter().take(self.sc.gossip.mesh_degree) {
                        self.nodes[i].mesh.insert(j);
                        self.nodes[j].mesh.insert(i);
                    }
                    self.connect_mesh(i);
                }
            }
            Fault::Partition {
                heal_step, lo, hi, ..
            } => {
                let until = self.run.timing.step_start(heal_step) * 1000;
                self.net.partitions.push(Partition {
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
                    let l: &mut LinkProfile = &mut self.net.links[node];
                    l.up_mbit *= factor;
                    l.down_mbit *= factor;
                    self.nodes[node].compute_ms =
                        (self.nodes[node].compute_ms as f64 * slowdown) as u64;
                }
            }
        }
    }

    fn deliver(&mut self, i: usize, ev: Event, now: Micros) {
        if !self.nodes[i].alive {
            return;
        }
        if let Event::Fetched { blob, .. } = &ev {
            self.nodes[i].arrivals.entry(*blob).or_insert(now);
        }
        let local = match &ev {
            Event::LocalUpdate { step, .. } => Some(*step),
            _ => None,
        };
        let Some(engine) = self.nodes[i].engine.as_mut() else {
            return;
        };
        let actions = engine.handle(ev, now / 1000);
        for a in actions {
            if let (Some(step), Action::Publish { bytes }) = (local, &a) {
                if bytes.get(1) == Some(&protocol::wire::kind::ANNOUNCE) {
                    *self.produced.entry(step).or_default() += 1;
                }
            }
            self.act(i, a, now);
        }
    }

    fn send_gossip(
        &mut self,
        i: usize,
        id: ContentId,
        bytes: Arc<Vec<u8>>,
        except: Option<usize>,
        now: Micros,
    ) {
        let peers: Vec<usize> = self.nodes[i]
            .mesh
            .iter()
            .copied()
            .filter(|&j| Some(j) != except)
            .collect();
        for j in peers {
            if let Ok(at) = self.net.send(i, j, bytes.len() as u64, now) {
                self.q.push(
                    at,
                    Ev::Gossip {
                        node: j,
                        from: i,
                        id,
                        bytes: bytes.clone(),
                    },
                );
            }
        }
    }

    fn timeout(&self) -> Micros {
        self.sc.gossip.fetch_timeout_ms * 1000
    }

    fn serve(&mut self, server: usize, client: usize, blob: ContentId, now: Micros) {
        let fail = Ev::Engine {
            node: client,
            ev: Event::FetchFailed {
                from: self.nodes[server].id,
                blob,
            },
        };
        if !self.nodes[server].alive {
            return self.q.push(now + self.timeout(), fail);
        }
        let resp = match self.nodes[server].role {
            Role::Withhold => None,
            _ => self.nodes[server]
                .engine
                .as_ref()
                .and_then(|e| e.serve_update(&blob)),
        };
        match resp {
            Some(frame) => {
                let bytes = frame.len() as u64 + self.wire_extra;
                match self.net.send(server, client, bytes, now) {
                    Ok(at) => {
                        let ev = Event::Fetched {
                            from: self.nodes[server].id,
                            blob,
                            bytes: frame,
                        };
                        self.q.push(at, Ev::Engine { node: client, ev });
                    }
                    Err(_) => self.q.push(now + self.timeout(), fail),
                }
            }
            None => match self.net.send(server, client, 64, now) {
                Ok(at) => self.q.push(at, fail),
                Err(_) => self.q.push(now + self.timeout(), fail),
            },
        }
    }

    fn act(&mut self, i: usize, a: Action, now: Micros) {
        match a {
            Action::Publish { bytes } => {
                let id = ContentId::of(&bytes);
                self.nodes[i].seen.insert(id);
                self.send_gossip(i, id, Arc::new(bytes), None, now);
            }
            Action::Send { peer, bytes } => {
                if let Some(&j) = self.index.get(&peer) {
                    if let Ok(at) = self.net.send(i, j, bytes.len() as u64, now) {
                        let from = self.nodes[i].id;
                        self.q.push(
                            at,
                            Ev::Engine {
                                node: j,
                                ev: Event::Message {
                                    from,
                                    tag: None,
                                    bytes,
                                },
                            },
                        );
                    }
                }
            }
            Action::Verdict { tag, verdict } => {
                if let Some((node, from, id, bytes)) = self.pending.remove(&tag) {
                    if verdict == Verdict::Accept && self.nodes[node].alive {
                        self.send_gossip(node, id, bytes, Some(from), now);
                    }
                }
            }
            Action::Fetch { peer, blob } => {
                let fail = Ev::Engine {
                    node: i,
                    ev: Event::FetchFailed { from: peer, blob },
                };
                match self.index.get(&peer).copied() {
                    Some(j) => match self.net.send(i, j, self.sc.gossip.request_bytes, now) {
                        Ok(at) => self.q.push(
                            at,
                            Ev::FetchReq {
                                server: j,
                                client: i,
                                blob,
                            },
                        ),
                        Err(_) => self.q.push(now + self.timeout(), fail),
                    },
                    None => self.q.push(now + self.timeout(), fail),
                }
            }
            Action::RequestCheckpoint { peers, .. } => {
                let src = peers
                    .iter()
                    .filter_map(|p| self.index.get(p).copied())
                    .find(|&j| {
                        self.nodes[j].alive
                            && self.nodes[j]
                                .engine
                                .as_ref()
                                .is_some_and(|e| e.status().synced)
                    });
                let Some(j) = src else {
                    return self.q.push(
                        now + 1_000_000,
                        Ev::Engine {
                            node: i,
                            ev: Event::CheckpointFailed,
                        },
                    );
                };
                let st = self.nodes[j].engine.as_ref().expect("alive").status();
                let bytes = match self.sc.model.checkpoint_bytes {
                    0 => self.nodes[j].params.len() as u64 * 4,
                    b => b,
                };
                // The snapshot is taken when the transfer starts, as a server streams a version.
                let (params, digest) = (self.nodes[j].params.clone(), self.nodes[j].digest);
                match self.net.send(j, i, bytes, now) {
                    Ok(at) => self.q.push(
                        at,
                        Ev::Checkpoint {
                            node: i,
                            params,
                            version: st.version,
                            digest,
                        },
                    ),
                    Err(_) => self.q.push(
                        now + self.timeout(),
                        Ev::Engine {
                            node: i,
                            ev: Event::CheckpointFailed,
                        },
                    ),
                }
            }
            Action::StartStep { step, .. } => {
                if self.nodes[i].role == Role::Silent {
                    return;
                }
                let params = self.nodes[i].params.clone();
                let upd = self.trainer.local_update(i, step, &params);
                let blob = upd.encode();
                let at = now + self.nodes[i].compute_ms * 1000;
                self.nodes[i].arrivals.insert(ContentId::of(&blob), at);
                self.q.push(
                    at,
                    Ev::Engine {
                        node: i,
                        ev: Event::LocalUpdate {
                            step,
                            blob,
                            tokens: 1,
                        },
                    },
                );
            }
            Action::Apply { step, updates } => self.apply(i, step, updates, now),
            Action::SetTimer { at } => {
                if self.nodes[i].timer != Some(at) {
                    self.nodes[i].timer = Some(at);
                    self.q.push(
                        at * 1000,
                        Ev::Engine {
                            node: i,
                            ev: Event::Timer,
                        },
                    );
                }
            }
            Action::Report(r) => match r {
                Report::Desync { .. } => self.desyncs += 1,
                Report::Rejected { .. } => self.rejected += 1,
                _ => {}
            },
            Action::Penalize { .. } | Action::Ban { .. } => {}
        }
    }

    fn apply(
        &mut self,
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
        let (params, digest) = match self.cache.get(&key) {
            Some((_, p, d)) => (p.clone(), *d),
            None => {
                let decoded: Vec<SparseUpdate> = updates
                    .iter()
                    .map(|u| {
                        SparseUpdate::decode(&u.bytes.0, u.bytes.0.len())
                            .expect("the engine validated it")
                    })
                    .collect();
                let p = Arc::new(self.trainer.apply(step, &self.nodes[i].params, &decoded));
                let d = params_digest(&p);
                self.losses
                    .entry(d)
                    .or_insert_with(|| self.trainer.loss(&p));
                self.cache.retain(|_, (s, _, _)| *s + 3 > step);
                self.cache.insert(key, (step, p.clone(), d));
                (p, d)
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
        n.digest = digest;
        self.applied.push(Applied {
            step,
            digest,
            included: updates.len() as u32,
            latency_ms,
        });
        self.q.push(
            now + 1000,
            Ev::Engine {
                node: i,
                ev: Event::Applied { step, digest },
            },
        );
    }

    fn metrics(self) -> Metrics {
        let sc = &self.sc;
        let mut base = AdamBaseline::new(self.trainer.init(), sc.optim.adamw_lr, 0.0);
        let mut by_step: BTreeMap<u64, Vec<&Applied>> = BTreeMap::new();
        for a in &self.applied {
            by_step.entry(a.step).or_default().push(a);
        }
        let mut all_lat = Vec::new();
        let mut rows = Vec::new();
        for s in 0..sc.steps {
            base.step(&self.trainer, s, sc.nodes());
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
                baseline_loss: self.trainer.loss(&base.params),
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
                &self.trainer.layout,
                sc.optim.topk,
                protocol::config::ValueCodec::Sign,
            ) as u64
                + self.wire_extra,
            steps: rows,
            ..Default::default()
        };
        m.totals.initial_loss = self.trainer.loss(&self.trainer.init());
        m.totals.desyncs = self.desyncs;
        m.totals.rejected = self.rejected;
        m.totals.messages = self.net.messages;
        m.totals.lost = self.net.lost;
        m.totals.events = self.events;
        finish(&mut m, &mut all_lat);
        m
    }
}
