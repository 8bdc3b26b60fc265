//! An in-memory network of engines for tests: a deterministic event queue, flood gossip,
//! request-response fetches and checkpoint requests served by the target's engine, and a fake
//! trainer whose parameters are one 32-byte tensor, a hash chain over the exact sets it applied
//! (same sets in, same digest out); its digest is that tensor's parameter digest, so served
//! checkpoints verify like real ones.
// Shared by several test crates, each using part of it: `pub` is how they reach it.
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeMap;

use crypto::{ContentId, Digest, Identity, NodeId};
use protocol::config::{ModelConfig, OptimConfig, ValueCodec};
use protocol::engine::{Action, Engine, Event};
use protocol::run::{DataSpec, RunConfig, StepTiming};
use protocol::sparse::{SparseUpdate, TensorUpdate};

pub const GENESIS: u64 = 1_000_000;
pub const PERIOD: u64 = 1000;

pub fn tiny_model() -> ModelConfig {
    ModelConfig {
        name: "test".into(),
        vocab: 64,
        dim: 16,
        layers: 1,
        heads: 2,
        kv_heads: 2,
        ffn: 32,
        seq_len: 8,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
    }
}

/// A run of the tiny model; `inline`: whether blobs ride in the gossip announcement.
pub fn test_run(inline: bool) -> RunConfig {
    let optim = OptimConfig {
        chunk: 8,
        topk: 2,
        values: ValueCodec::Sign,
        ..OptimConfig::default()
    };
    let timing = StepTiming {
        genesis_ms: GENESIS,
        period_ms: PERIOD,
        grace_ms: 100,
        summary_ms: 400,
    };
    let mut run = RunConfig::new(
        "test",
        tiny_model(),
        optim,
        DataSpec::Synthetic { seed: 7, vocab: 64 },
        timing,
    );
    if !inline {
        run.limits.inline_blob_bytes = 0;
    }
    run.validate().expect("the test run is valid");
    run
}

pub fn seed_identity(i: u8) -> Identity {
    Identity::from_seed([i + 1; 32])
}

use protocol::rng::mix;

/// The blob id of simulated node `i`'s update for `step`, as its trainer makes it (seed
/// `i << 32 | step`) and its engine names it.
pub fn sim_update_id(run: &RunConfig, i: u64, step: u64) -> ContentId {
    let blob = make_update(run, i << 32 | step).encode();
    protocol::wire::UpdateHeader::blob_id(&seed_identity(i as u8).node_id(), step, &blob)
}

/// A valid update of the run's layout, different for each seed.
pub fn make_update(run: &RunConfig, seed: u64) -> SparseUpdate {
    let layout = run.layout();
    let k = run.optim.topk;
    let tensors = layout
        .tensors
        .iter()
        .enumerate()
        .map(|(ti, t)| {
            let ke = t.k_eff(k);
            let elems = t.block_elems();
            let mut idx = Vec::new();
            let mut vals = Vec::new();
            for b in 0..t.blocks() {
                let start =
                    (mix(seed ^ (ti as u64) << 32 ^ b as u64) % (elems - ke + 1) as u64) as u32;
                for j in 0..ke as u32 {
                    idx.push(start + j);
                    vals.push(if mix(seed + j as u64) & 1 == 0 {
                        1.0
                    } else {
                        -1.0
                    });
                }
            }
            TensorUpdate::from_entries(t, ke, run.optim.values, &idx, &vals)
        })
        .collect();
    SparseUpdate {
        codec: run.optim.values,
        tensors,
    }
}

pub fn genesis_digest() -> Digest {
    Digest::of(b"test genesis parameters")
}

/// The fake trainer's one tensor: its name and shape.
pub const PARAMS: (&str, [u32; 1]) = ("p", [8]);

/// The parameter digest of the fake parameters `chain`.
pub fn params_digest(chain: &Digest) -> Digest {
    protocol::checkpoint::f32_params_digest([(PARAMS.0, &PARAMS.1[..], &chain.0[..])])
}

/// The fake trainer's parameters after applying `ids` for `step` on `prev`.
pub fn next_digest(prev: &Digest, step: u64, ids: &[ContentId]) -> Digest {
    let mut b = prev.0.to_vec();
    b.extend_from_slice(&step.to_le_bytes());
    for id in ids {
        b.extend_from_slice(&id.0);
    }
    Digest::of(&b)
}

pub struct SimNode {
    pub engine: Engine,
    pub id: NodeId,
    pub alive: bool,
    pub trains: bool,
    /// (step, included blob ids, digest after)
    pub applied: Vec<(u64, Vec<ContentId>, Digest)>,
    pub log: Vec<(u64, Action)>,
    version: u64,
    /// The fake parameters (see [`next_digest`]) and their digest.
    chain: Digest,
    digest: Digest,
    /// Snapshots taken for serving checkpoints: version → parameters.
    snaps: BTreeMap<u64, Digest>,
    /// The last instant a Timer was queued for (from `Engine::poll_timeout`).
    timer: Option<u64>,
}

pub type DropFn = Box<dyn FnMut(u64, usize, usize, &Event) -> bool>;

pub struct Sim {
    pub run: RunConfig,
    pub nodes: Vec<SimNode>,
    queue: BTreeMap<(u64, u64), (usize, Event)>,
    seq: u64,
    pub now: u64,
    pub latency: u64,
    pub train_ms: u64,
    /// Return true to drop the event (time, from, to, event) before delivery.
    pub drop: DropFn,
    /// Nodes whose updates a spot check finds harmful (the others' help).
    pub harmful: std::collections::BTreeSet<usize>,
    /// node → victim: the node publishes the victim's update with one entry changed.
    pub copies: BTreeMap<usize, usize>,
    /// Whether a node that accepts an injected message forwards it to every other node, as
    /// gossipsub does after an `Accept` verdict (engines' own publishes always flood).
    pub forward_injected: bool,
    /// Tags of injected (or forwarded) messages → their bytes, for `forward_injected`.
    injected: BTreeMap<u64, Vec<u8>>,
    /// Update frames that peers outside the simulation (attackers) serve, by blob id.
    pub served: BTreeMap<ContentId, Vec<u8>>,
    /// Peers outside the simulation that never answer a fetch (no response, no failure).
    pub silent: std::collections::BTreeSet<NodeId>,
    /// Nodes that corrupt every checkpoint answer they serve (one byte flipped).
    pub liars: std::collections::BTreeSet<usize>,
    /// Inbound checkpoint requests being served: token → (server, client, request).
    requests: BTreeMap<u64, (usize, usize, protocol::download::Request)>,
}

impl Sim {
    pub fn new(run: RunConfig, n: usize) -> Sim {
        let mut s = Sim {
            run,
            nodes: Vec::new(),
            queue: BTreeMap::new(),
            seq: 0,
            now: GENESIS - 500,
            latency: 10,
            train_ms: 300,
            drop: Box::new(|_, _, _, _| false),
            harmful: Default::default(),
            copies: BTreeMap::new(),
            forward_injected: false,
            injected: BTreeMap::new(),
            served: BTreeMap::new(),
            silent: Default::default(),
            liars: Default::default(),
            requests: BTreeMap::new(),
        };
        for i in 0..n {
            s.add_node(i as u8, Some(genesis_digest()));
        }
        s
    }

    pub fn index(&self, id: &NodeId) -> Option<usize> {
        self.nodes.iter().position(|n| n.id == *id)
    }

    /// Add a node (a joiner when `genesis` is None or it is too late for version 0) and
    /// connect it to everyone. `genesis` is the fake parameters (see [`genesis_digest`]).
    pub fn add_node(&mut self, i: u8, genesis: Option<Digest>) -> usize {
        let id = seed_identity(i);
        let node_id = id.node_id();
        let mut engine = Engine::new(
            self.run.clone(),
            id,
            genesis.as_ref().map(params_digest),
            self.now,
            42 + i as u64,
        );
        engine.set_checkpoint_layout(vec![(PARAMS.0.to_string(), PARAMS.1.to_vec())]);
        let me = self.nodes.len();
        self.nodes.push(SimNode {
            engine,
            id: node_id,
            alive: true,
            trains: true,
            applied: Vec::new(),
            log: Vec::new(),
            version: 0,
            chain: genesis.unwrap_or_default(),
            digest: genesis.as_ref().map(params_digest).unwrap_or_default(),
            snaps: BTreeMap::new(),
            timer: None,
        });
        let t = self.now;
        for j in 0..me {
            let pj = self.nodes[j].id;
            self.push(t, me, Event::PeerConnected { peer: pj });
            self.push(t, j, Event::PeerConnected { peer: node_id });
        }
        self.push(t, me, Event::Timer);
        me
    }

    pub fn push(&mut self, at: u64, to: usize, ev: Event) {
        self.seq += 1;
        self.queue.insert((at, self.seq), (to, ev));
    }

    /// Deliver raw bytes to node `to` as gossip from `from`.
    pub fn inject(&mut self, at: u64, to: usize, from: NodeId, bytes: Vec<u8>) {
        let tag = self.seq + 1_000_000;
        self.injected.insert(tag, bytes.clone());
        self.push(
            at,
            to,
            Event::Message {
                from,
                tag: Some(tag),
                bytes,
            },
        );
    }

    pub fn run_until(&mut self, end: u64) {
        while let Some((&(at, seq), _)) = self.queue.iter().next() {
            if at > end {
                break;
            }
            let (to, ev) = self
                .queue
                .remove(&(at, seq))
                .expect("the key was just found");
            self.now = at;
            if !self.nodes[to].alive {
                continue;
            }
            let actions = self.nodes[to].engine.handle(ev, at);
            for a in actions {
                self.nodes[to].log.push((at, a.clone()));
                self.act(to, a);
            }
            // One Timer per new instant: stale ones fire harmlessly.
            let armed = self.nodes[to].timer;
            if let Some(t) = self.nodes[to]
                .engine
                .poll_timeout()
                .filter(|&t| armed != Some(t))
            {
                self.nodes[to].timer = Some(t);
                self.push(t, to, Event::Timer);
            }
        }
        self.now = end;
    }

    fn deliver(&mut self, from: usize, to: usize, at: u64, ev: Event) {
        if !(self.drop)(at, from, to, &ev) {
            self.push(at, to, ev);
        }
    }

    fn act(&mut self, me: usize, a: Action) {
        let now = self.now;
        let lat = self.latency;
        let my_id = self.nodes[me].id;
        match a {
            Action::Publish { bytes } => {
                for j in 0..self.nodes.len() {
                    if j != me {
                        let tag = self.seq;
                        self.deliver(
                            me,
                            j,
                            now + lat,
                            Event::Message {
                                from: my_id,
                                tag: Some(tag),
                                bytes: bytes.clone(),
                            },
                        );
                    }
                }
            }
            Action::Send { peer, bytes } => {
                if let Some(j) = self.index(&peer) {
                    self.deliver(
                        me,
                        j,
                        now + lat,
                        Event::Message {
                            from: my_id,
                            tag: None,
                            bytes,
                        },
                    );
                }
            }
            Action::Verdict {
                tag,
                verdict: protocol::engine::Verdict::Accept,
            } if self.forward_injected && self.injected.contains_key(&tag) => {
                let bytes = self.injected[&tag].clone();
                for j in 0..self.nodes.len() {
                    if j != me {
                        self.inject(now + lat, j, my_id, bytes.clone());
                    }
                }
            }
            Action::Fetch { peer, .. } if self.silent.contains(&peer) => {}
            Action::Fetch { peer, blob } => {
                let resp = match self.index(&peer) {
                    Some(j) if self.nodes[j].alive => self.nodes[j].engine.serve_update(&blob),
                    Some(_) => None,
                    None => self.served.get(&blob).cloned(),
                };
                let ev = match resp {
                    Some(bytes) => Event::Fetched {
                        from: peer,
                        blob,
                        bytes,
                    },
                    None => Event::FetchFailed { from: peer, blob },
                };
                let from = self.index(&peer).unwrap_or(me);
                self.deliver(from, me, now + 2 * lat, ev);
            }
            Action::Request { peer, req } => match self.index(&peer) {
                Some(j) if self.nodes[j].alive => {
                    if let protocol::download::Request::Manifest { .. } = req {
                        // The server snapshots what it holds (a real node: after each step).
                        let (v, chain) = (self.nodes[j].version, self.nodes[j].chain);
                        self.nodes[j].snaps.insert(v, chain);
                        let manifest = protocol::download::manifest_of(
                            self.run.run_id(),
                            &self.run.limits,
                            peer,
                            v,
                            &[(PARAMS.0.to_string(), PARAMS.1.to_vec(), chain.0.to_vec())],
                        );
                        self.deliver(me, j, now + lat, Event::Snapshot { manifest });
                    }
                    self.seq += 1;
                    let token = self.seq;
                    self.requests.insert(token, (j, me, req.clone()));
                    self.deliver(
                        me,
                        j,
                        now + lat,
                        Event::Requested {
                            peer: my_id,
                            token,
                            req,
                        },
                    );
                }
                _ => self.push(now + 100, me, Event::RequestFailed { peer, req }),
            },
            Action::Respond { token, bytes } => self.respond(me, token, bytes),
            Action::ServeChunk {
                token,
                version,
                index,
                offset,
                len,
            } => {
                let data = self.nodes[me].snaps.get(&version).map(|c| {
                    let (lo, hi) = (offset as usize, (offset + len) as usize);
                    c.0[lo.min(32)..hi.min(32)].to_vec()
                });
                let frame = data
                    .map(|d| protocol::download::chunk_frame(self.run.run_id(), version, index, d));
                self.respond(me, token, frame.unwrap_or_default());
            }
            Action::LoadCheckpoint {
                version, tensors, ..
            } => {
                let n = &mut self.nodes[me];
                let ev = match tensors
                    .first()
                    .and_then(|t| <[u8; 32]>::try_from(&t[..]).ok())
                {
                    Some(p) => {
                        n.chain = Digest(p);
                        n.digest = params_digest(&n.chain);
                        n.version = version;
                        Event::CheckpointLoaded {
                            version,
                            digest: n.digest,
                        }
                    }
                    None => Event::CheckpointFailed,
                };
                self.push(now + 50, me, ev);
            }
            Action::StartStep { step, .. } if self.nodes[me].trains => {
                let src = self.copies.get(&me).copied().unwrap_or(me);
                let seed = (src as u64) << 32 | step;
                let mut u = make_update(&self.run, seed);
                if src != me {
                    // A copy with a little noise: one entry's sign flipped, so its blob id
                    // differs from the victim's.
                    let t = &self.run.layout().tensors[0];
                    let (idx, mut vals) = u.tensors[0].entries(u.codec);
                    vals[0] = -vals[0];
                    let k = u.tensors[0].k as usize;
                    u.tensors[0] =
                        protocol::sparse::TensorUpdate::from_entries(t, k, u.codec, &idx, &vals);
                }
                let blob = u.encode();
                // A copier must first see what it copies.
                let delay = if src != me { 100 } else { 0 };
                self.push(
                    now + self.train_ms + delay,
                    me,
                    Event::LocalUpdate {
                        step,
                        blob,
                        tokens: 32,
                    },
                );
            }
            Action::Apply { step, updates } => {
                let n = &mut self.nodes[me];
                assert_eq!(n.version, step, "applied out of order");
                let ids: Vec<ContentId> = updates.iter().map(|u| u.blob).collect();
                let mut sorted = ids.clone();
                sorted.sort();
                assert_eq!(ids, sorted, "apply order must be canonical");
                n.chain = next_digest(&n.chain, step, &ids);
                n.digest = params_digest(&n.chain);
                n.version = step + 1;
                n.applied.push((step, ids, n.digest));
                let d = n.digest;
                self.push(now + 5, me, Event::Applied { step, digest: d });
            }
            Action::SpotCheck {
                step, sender, blob, ..
            } => {
                let bad = self
                    .index(&sender)
                    .is_some_and(|j| self.harmful.contains(&j));
                let gain = if bad { -0.5 } else { 0.5 };
                self.push(
                    now + 20,
                    me,
                    Event::SpotChecked {
                        step,
                        sender,
                        blob,
                        gain,
                    },
                );
            }
            _ => {}
        }
    }

    /// Server `me` answers checkpoint request `token` (a liar with one byte flipped).
    fn respond(&mut self, me: usize, token: u64, mut bytes: Vec<u8>) {
        let Some((_, client, req)) = self.requests.remove(&token) else {
            return;
        };
        if self.liars.contains(&me) {
            if let Some(b) = bytes.last_mut() {
                *b ^= 0x55;
            }
        }
        let peer = self.nodes[me].id;
        let at = self.now + self.latency;
        self.deliver(me, client, at, Event::Response { peer, req, bytes });
    }

    pub fn actions(&self, i: usize) -> impl Iterator<Item = &Action> {
        self.nodes[i].log.iter().map(|(_, a)| a)
    }

    /// (step → (ids, digest)) for node i.
    pub fn history(&self, i: usize) -> BTreeMap<u64, (Vec<ContentId>, Digest)> {
        self.nodes[i]
            .applied
            .iter()
            .map(|(s, ids, d)| (*s, (ids.clone(), *d)))
            .collect()
    }
}

/// A header for `blob` by `id` for `step`, signed.
pub fn signed_header(
    run: &RunConfig,
    id: &Identity,
    step: u64,
    blob: &[u8],
) -> protocol::wire::Signed<protocol::wire::UpdateHeader> {
    let h = protocol::wire::UpdateHeader {
        run: run.run_id(),
        step,
        sender: id.node_id(),
        blob: protocol::wire::UpdateHeader::blob_id(&id.node_id(), step, blob),
        blob_len: blob.len() as u64,
        codec: run.optim.values,
        topk: run.optim.topk,
        chunk: run.optim.chunk,
        tokens: 32,
        base_version: step.saturating_sub(1),
        base_digest: Digest::default(),
        pow: 0,
    };
    protocol::wire::Signed::sign(h, id)
}

/// An Announce frame with the blob inline.
pub fn announce(run: &RunConfig, id: &Identity, step: u64, blob: &[u8]) -> Vec<u8> {
    protocol::wire::Message::Announce {
        header: signed_header(run, id, step, blob),
        blob: Some(blob.to_vec()),
    }
    .encode()
}

impl SimNode {
    /// Flip the fake parameters, so the next digests differ from everyone else's.
    pub fn corrupt(&mut self) {
        self.chain = Digest::of(b"corrupted");
        self.digest = params_digest(&self.chain);
    }
}
