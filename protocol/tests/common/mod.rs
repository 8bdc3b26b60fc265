//! Engines for tests on `protocol::testnet` (the in-memory network the simulator uses too):
//! a full mesh with a fixed latency, and a fake
//! trainer whose parameters are one 32-byte tensor, a hash chain over the exact sets it applied
//! (same sets in, same digest out); its digest is that tensor's parameter digest, so served
//! checkpoints verify like real ones.
// Shared by several test crates, each using part of it: `pub` is how they reach it.
#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, BTreeSet};

use crypto::{ContentId, Digest, Identity, NodeId};
use protocol::config::{ModelConfig, OptimConfig, ValueCodec};
use protocol::engine::{Action, Engine, Event};
use protocol::run::{DataSpec, RunConfig, StepTiming};
use protocol::sparse::{SparseUpdate, TensorUpdate};
use protocol::testnet::{Fixed, Host, Micros, Net};

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
    pub id: NodeId,
    pub trains: bool,
    /// (step, included blob ids, digest after)
    pub applied: Vec<(u64, Vec<ContentId>, Digest)>,
    /// Every action its engine asked for, with the time (ms).
    pub log: Vec<(u64, Action)>,
    version: u64,
    /// The fake parameters (see [`next_digest`]) and their digest.
    chain: Digest,
    digest: Digest,
    /// Snapshots taken for serving checkpoints: version → parameters.
    snaps: BTreeMap<u64, Digest>,
}

pub type DropFn = Box<dyn FnMut(u64, usize, usize, &Event) -> bool>;

/// Engines on `protocol::testnet` (flood gossip over a full mesh, fixed latency, no relaying
/// unless `net.relay` is turned on), around the fake world below.
pub struct Sim {
    pub net: Net<(), Fixed>,
    pub world: World,
}

/// What is outside the engines: the fake trainers, peers outside the network, drop rules.
pub struct World {
    pub run: RunConfig,
    pub nodes: Vec<SimNode>,
    /// The time (ms) the last `run_until` ran to.
    pub now: u64,
    pub train_ms: u64,
    /// Return true to drop the event (time, from, to, event) before delivery.
    pub drop: DropFn,
    /// Nodes whose updates a spot check finds harmful (the others' help).
    pub harmful: BTreeSet<usize>,
    /// node → victim: the node publishes the victim's update with one entry changed.
    pub copies: BTreeMap<usize, usize>,
    /// Update frames that peers outside the simulation (attackers) serve, by blob id.
    pub served: BTreeMap<ContentId, Vec<u8>>,
    /// Peers outside the simulation that never answer a fetch (no response, no failure).
    pub silent: BTreeSet<NodeId>,
    /// Nodes that corrupt every checkpoint answer they serve (one byte flipped).
    pub liars: BTreeSet<usize>,
    /// Gossip tags of frames from peers outside the simulation.
    pub outside_tags: BTreeSet<u64>,
    /// Every gossip frame an engine was handed: (node, sender, content id).
    pub heard: Vec<(usize, NodeId, ContentId)>,
}

impl std::ops::Deref for Sim {
    type Target = World;
    fn deref(&self) -> &World {
        &self.world
    }
}

impl std::ops::DerefMut for Sim {
    fn deref_mut(&mut self) -> &mut World {
        &mut self.world
    }
}

impl Sim {
    pub fn new(run: RunConfig, n: usize) -> Sim {
        let latency = 10;
        // A request to a dead or unknown peer fails about a round trip later.
        let net = Net::new(
            (GENESIS - 500) * 1000,
            Fixed(latency * 1000),
            2 * latency * 1000,
            64,
        );
        let mut s = Sim {
            net,
            world: World {
                run,
                nodes: Vec::new(),
                now: GENESIS - 500,
                train_ms: 300,
                drop: Box::new(|_, _, _, _| false),
                harmful: Default::default(),
                copies: BTreeMap::new(),
                served: BTreeMap::new(),
                silent: Default::default(),
                liars: Default::default(),
                outside_tags: Default::default(),
                heard: Vec::new(),
            },
        };
        s.net.relay = false;
        for i in 0..n {
            s.add_node(i as u8, Some(genesis_digest()));
        }
        s
    }

    pub fn index(&self, id: &NodeId) -> Option<usize> {
        self.net.index.get(id).copied()
    }

    pub fn engine(&self, i: usize) -> &Engine {
        self.net.engine(i)
    }

    pub fn engine_mut(&mut self, i: usize) -> &mut Engine {
        self.net.peers[i]
            .engine
            .as_mut()
            .expect("a live node has an engine")
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
            self.net.now() / 1000,
            42 + i as u64,
        );
        engine.set_checkpoint_layout(vec![(PARAMS.0.to_string(), PARAMS.1.to_vec())]);
        let me = self.net.peers.len();
        self.world.nodes.push(SimNode {
            id: node_id,
            trains: true,
            applied: Vec::new(),
            log: Vec::new(),
            version: 0,
            chain: genesis.unwrap_or_default(),
            digest: genesis.as_ref().map(params_digest).unwrap_or_default(),
            snaps: BTreeMap::new(),
        });
        self.net.place(me, engine);
        for j in 0..me {
            self.net.link(me, j);
        }
        self.net.connect(me);
        let now = self.net.now();
        self.net.push_event(now, me, Event::Timer);
        me
    }

    /// Deliver `ev` to node `to`'s engine at `at` (ms).
    pub fn push(&mut self, at: u64, to: usize, ev: Event) {
        self.net.push_event(at * 1000, to, ev);
    }

    /// Deliver raw bytes to node `to` as gossip from `from`, at `at` (ms).
    pub fn inject(&mut self, at: u64, to: usize, from: NodeId, bytes: Vec<u8>) {
        self.net.inject(at * 1000, to, from, bytes);
    }

    pub fn run_until(&mut self, end: u64) {
        while self.net.next(end * 1000, &mut self.world).is_some() {}
        self.net.q.advance(end * 1000);
        self.world.now = end;
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

impl Host<(), Fixed> for World {
    fn act(&mut self, net: &mut Net<(), Fixed>, me: usize, a: Action, now: Micros) {
        match a {
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
                net.respond(me, token, frame.unwrap_or_default(), now, self);
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
                net.push_event(now + 50_000, me, ev);
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
                let ev = Event::LocalUpdate {
                    step,
                    blob,
                    tokens: 32,
                };
                net.push_event(now + (self.train_ms + delay) * 1000, me, ev);
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
                let digest = n.digest;
                net.push_event(now + 5_000, me, Event::Applied { step, digest });
            }
            Action::SpotCheck {
                step, sender, blob, ..
            } => {
                let bad = net
                    .index
                    .get(&sender)
                    .is_some_and(|j| self.harmful.contains(j));
                let gain = if bad { -0.5 } else { 0.5 };
                let ev = Event::SpotChecked {
                    step,
                    sender,
                    blob,
                    gain,
                };
                net.push_event(now + 20_000, me, ev);
            }
            _ => {}
        }
    }

    fn event(&mut self, node: usize, ev: &Event, _now: Micros) {
        if let Event::Message {
            from,
            tag: Some(tag),
            bytes,
        } = ev
        {
            if !self.nodes.iter().any(|n| n.id == *from) {
                self.outside_tags.insert(*tag);
            }
            self.heard.push((node, *from, ContentId::of(bytes)));
        }
    }

    fn sees(&mut self, _net: &Net<(), Fixed>, node: usize, a: &Action, now: Micros) {
        self.nodes[node].log.push((now / 1000, a.clone()));
    }

    fn drops(&mut self, at: Micros, from: usize, to: usize, ev: &Event) -> bool {
        (self.drop)(at / 1000, from, to, ev)
    }

    fn fetch_outside(
        &mut self,
        net: &Net<(), Fixed>,
        peer: NodeId,
        blob: &ContentId,
        now: Micros,
    ) -> Option<(Micros, Option<Vec<u8>>)> {
        if self.silent.contains(&peer) {
            return None;
        }
        // A round trip on the test's links.
        Some((now + 2 * net.links.0, self.served.get(blob).cloned()))
    }

    /// The server snapshots what it holds (a real node: after each step).
    fn snapshot(&mut self, net: &mut Net<(), Fixed>, server: usize, now: Micros) {
        let n = &mut self.nodes[server];
        let (v, chain) = (n.version, n.chain);
        n.snaps.insert(v, chain);
        let manifest = protocol::download::manifest_of(
            self.run.run_id(),
            &self.run.limits,
            n.id,
            v,
            &[(PARAMS.0.to_string(), PARAMS.1.to_vec(), chain.0.to_vec())],
        );
        net.deliver(server, Event::Snapshot { manifest }, now, self);
    }

    /// A liar flips the last byte of every answer.
    fn respond(
        &mut self,
        _net: &Net<(), Fixed>,
        server: usize,
        _req: &protocol::download::Request,
        bytes: &mut Vec<u8>,
    ) -> u64 {
        if self.liars.contains(&server) {
            if let Some(b) = bytes.last_mut() {
                *b ^= 0x55;
            }
        }
        bytes.len() as u64
    }
}

/// `nodes` applied the same sets with the same digests at every step they share, at least
/// `min_steps` of them, and none fell more than a step behind the first.
pub fn assert_agree(sim: &Sim, nodes: &[usize], min_steps: usize) {
    let h0 = sim.history(nodes[0]);
    assert!(h0.len() >= min_steps, "only {} steps applied", h0.len());
    for &i in &nodes[1..] {
        let h = sim.history(i);
        for (step, v) in &h0 {
            if let Some(w) = h.get(step) {
                assert_eq!(v, w, "node {i} disagrees at step {step}");
            }
        }
        let (last, last0) = (
            h.keys().next_back().copied().unwrap_or(0),
            *h0.keys().next_back().expect("node 0 applied a step"),
        );
        assert!(
            last + 1 >= last0,
            "node {i} fell behind: step {last} vs {last0}"
        );
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
