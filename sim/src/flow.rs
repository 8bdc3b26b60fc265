//! Flow mode: the round at thousands of nodes.
//!
//! Running a real engine per node costs O(N²) signature checks and decodes per step (every
//! node verifies every header and every summary), so past a few hundred nodes the simulator
//! models the engine instead of running it. What is kept exactly: the network model (every
//! header, fetch request and blob is a message through the per-node link queues), the gossip
//! mesh with announce-then-fetch (a node forwards a header to its mesh only once it holds and
//! verified the blob; each receiver fetches the blob from the first neighbour that announced
//! it; duplicate headers are suppressed but cost their bytes), the step clock, the synthetic
//! trainer and its real updates. What is modelled: a node includes an update for step t if it
//! holds the blob by `apply_at(t) + grace` (gossip until the publish deadline, then the
//! summary-driven repair fetches, merged into one flood); summaries are charged as bytes
//! (each publisher's summary, 300 B + 33 B per id, times the header duplication factor
//! measured in the same step) but their timing is assumed to fit in `summary_ms`; the step
//! applies the set most nodes hold, and a node holding another set counts as desynced (in the
//! engine it would resync from a checkpoint). No signatures are made or checked.
//!
//! Policies (`scenario::Policy`): `all` includes every node's update; `committee` bounds each
//! node's download at m updates per step (see `Policy::Committee`).

use std::collections::BTreeMap;

use protocol::run::StepTiming;
use protocol::sparse::{encoded_size, Layout, SparseUpdate};

use crate::metrics::{finish, quantile, Metrics, StepMetrics};
use crate::net::{Network, Partition};
use crate::rng::{derive, mix};
use crate::scenario::{Fault, Policy, Scenario};
use crate::synth::{AdamBaseline, Synthetic};
use protocol::testnet::{EventQueue, Micros};

const NONE: Micros = Micros::MAX;

enum Fe {
    Start(u64),
    Ready {
        t: u64,
        b: usize,
    },
    Header {
        t: u64,
        b: usize,
        node: usize,
        from: usize,
    },
    Req {
        t: u64,
        b: usize,
        server: usize,
        client: usize,
        tries: u8,
    },
    Blob {
        t: u64,
        b: usize,
        node: usize,
    },
    Finalize(u64),
    Mark(u64),
    Fault(usize),
    Recover(usize),
}

struct StepState {
    members: Vec<usize>,
    updates: Vec<SparseUpdate>,
    /// node × member: when the blob was in hand (NONE: not yet), and whether it was asked for.
    arrival: Vec<Micros>,
    asked: Vec<bool>,
    headers: u64,
}

struct Row {
    applied: u32,
    agree: f64,
    produced: u32,
    included: Vec<u32>,
    latency: Vec<f64>,
    loss: f64,
}

pub fn run(sc: &Scenario, progress: &mut dyn FnMut(u64, u64)) -> Metrics {
    let mut f = Flow::new(sc);
    f.schedule();
    let initial_loss = f.trainer.loss(&f.params);
    let mut events = 0u64;
    while let Some((now, ev)) = f.q.pop() {
        events += 1;
        match ev {
            Fe::Mark(s) => {
                if s > 0 {
                    let (u, d) = f.net.take_counters();
                    f.bytes.push((u, d, f.alive.clone()));
                }
                progress(s, sc.steps);
            }
            Fe::Fault(fi) => f.fault(fi, now),
            Fe::Recover(node) => {
                if node < f.n {
                    f.alive[node] = true;
                    f.net.set_down(node, false, now);
                }
            }
            Fe::Start(t) => f.start(t, now),
            Fe::Ready { t, b } => {
                let st = f.steps.get_mut(&t).expect("live step");
                let node = st.members[b];
                if f.alive[node] && now <= us(f.timing.publish_deadline(t)) {
                    f.q.push(now, Fe::Blob { t, b, node });
                }
            }
            Fe::Blob { t, b, node } => f.blob(t, b, node, now),
            Fe::Header { t, b, node, from } => f.header(t, b, node, from, now),
            Fe::Req {
                t,
                b,
                server,
                client,
                tries,
            } => f.request(t, b, server, client, tries, now),
            Fe::Finalize(t) => f.finalize(t),
        }
    }
    f.metrics(initial_loss, events)
}

/// Milliseconds to the queue's microseconds.
fn us(ms: u64) -> Micros {
    ms * 1000
}

/// The simulation's state while its events run.
struct Flow<'a> {
    sc: &'a Scenario,
    n: usize,
    blob_bytes: u64,
    compute: Vec<u64>,
    timing: StepTiming,
    timeout: Micros,
    mesh: Vec<Vec<usize>>,
    net: Network,
    q: EventQueue<Fe>,
    trainer: Synthetic,
    params: Vec<f32>,
    alive: Vec<bool>,
    reputation: Vec<u64>,
    steps: BTreeMap<u64, StepState>,
    rows: BTreeMap<u64, Row>,
    bytes: Vec<(Vec<u64>, Vec<u64>, Vec<bool>)>,
    desyncs: u64,
}

impl<'a> Flow<'a> {
    /// The nodes, their links and mesh, the trainer and the step clock of `sc`.
    fn new(sc: &'a Scenario) -> Flow<'a> {
        let model = sc.model.config();
        let optim = sc.optim.config(sc.steps);
        let layout = Layout::for_model(&model, optim.chunk);
        let actual = encoded_size(&layout, optim.topk, optim.values) as u64;
        let blob_bytes = if sc.model.wire_blob_bytes > 0 {
            sc.model.wire_blob_bytes
        } else {
            actual
        };
        let trainer = Synthetic::new(layout, optim, sc.optim.noise, sc.seed);
        let classes = sc.node_classes();
        let n = classes.len();
        let compute: Vec<u64> = classes
            .iter()
            .map(|&c| sc.classes[c].compute_ms * 1000)
            .collect();
        let net = sc.network();
        let timing = StepTiming {
            genesis_ms: 10_000,
            period_ms: sc.timing.period_ms,
            grace_ms: sc.timing.grace_ms,
            summary_ms: sc.timing.summary_ms,
        };
        let mesh = build_mesh(sc, n);
        let q = EventQueue::new(us(timing.genesis_ms));
        let params = trainer.init();
        Flow {
            sc,
            n,
            blob_bytes,
            compute,
            timing,
            timeout: us(sc.gossip.fetch_timeout_ms),
            mesh,
            net,
            q,
            trainer,
            params,
            alive: vec![true; n],
            reputation: vec![0u64; n],
            steps: BTreeMap::new(),
            rows: BTreeMap::new(),
            bytes: Vec::new(),
            desyncs: 0,
        }
    }

    /// Queues every step's start, finalization and boundary mark, and every fault.
    fn schedule(&mut self) {
        let (sc, timing, q) = (self.sc, &self.timing, &mut self.q);
        for s in 0..sc.steps {
            q.push(us(timing.step_start(s)), Fe::Start(s));
            q.push(us(timing.apply_at(s) + timing.grace_ms), Fe::Finalize(s));
        }
        for s in 0..=sc.steps {
            q.push(us(timing.step_start(s)), Fe::Mark(s));
        }
        for (fi, f) in sc.faults.iter().enumerate() {
            q.push(us(f.at_ms(&timing)), Fe::Fault(fi));
        }
    }

    /// Fault `fi` strikes at `now`.
    fn fault(&mut self, fi: usize, now: Micros) {
        let n = self.n;
        match &self.sc.faults[fi] {
            Fault::Crash {
                node, recover_step, ..
            } if *node < n => {
                self.alive[*node] = false;
                self.reputation[*node] = 0;
                self.net.set_down(*node, true, now);
                self.trainer.reset_node(*node);
                if let Some(r) = recover_step {
                    // Recovery: back online at the start of step r (the checkpoint download
                    // is not modelled here); reputation starts from zero.
                    self.q
                        .push(us(self.timing.step_start(*r)), Fe::Recover(*node));
                }
            }
            Fault::Partition {
                heal_step, lo, hi, ..
            } => self.net.partitions.push(Partition {
                from: now,
                until: us(self.timing.step_start(*heal_step)),
                lo: *lo,
                hi: *hi,
            }),
            Fault::Degrade { node, factor, .. } if *node < n => {
                self.net.links[*node].up_mbit *= factor;
                self.net.links[*node].down_mbit *= factor;
            }
            _ => {}
        }
    }

    /// Step `t` starts: the policy picks its publishers, who train and publish once computed;
    /// the rest accumulate.
    fn start(&mut self, t: u64, now: Micros) {
        let sc = self.sc;
        let n = self.n;
        let live: Vec<usize> = (0..n).filter(|&i| self.alive[i]).collect();
        let members: Vec<usize> = match &sc.flow.policy {
            Policy::All => live.clone(),
            Policy::Committee { m, min_reputation } => {
                let mut c: Vec<usize> = live
                    .iter()
                    .copied()
                    .filter(|&i| self.reputation[i] >= *min_reputation)
                    .collect();
                if c.len() < *m {
                    // Too few reputable nodes (the run's first steps): everyone is eligible.
                    c = live.clone();
                }
                c.sort_by_key(|&i| mix(sc.seed ^ mix(t ^ mix(i as u64))));
                c.truncate(*m);
                c.sort_unstable();
                c
            }
        };
        let mut updates = Vec::with_capacity(members.len());
        let mut mi = 0;
        for &i in &live {
            if mi < members.len() && members[mi] == i {
                updates.push(self.trainer.local_update(i, t, &self.params));
                self.q.push(now + self.compute[i], Fe::Ready { t, b: mi });
                mi += 1;
            } else {
                self.trainer.accumulate(i, t, &self.params);
            }
        }
        let c = members.len();
        self.steps.insert(
            t,
            StepState {
                members,
                updates,
                arrival: vec![NONE; n * c],
                asked: vec![false; n * c],
                headers: 0,
            },
        );
    }

    /// `node` holds and has verified blob `b` of step `t`: it announces it to its mesh.
    fn blob(&mut self, t: u64, b: usize, node: usize, now: Micros) {
        let Some(st) = self.steps.get_mut(&t) else {
            return;
        };
        let c = st.members.len();
        if !self.alive[node] || st.arrival[node * c + b] != NONE {
            return;
        }
        st.arrival[node * c + b] = now;
        st.asked[node * c + b] = true;
        // Verified: announce to the mesh.
        for &p in &self.mesh[node] {
            if let Ok(at) = self.net.send(node, p, self.sc.flow.header_bytes, now) {
                self.q.push(
                    at,
                    Fe::Header {
                        t,
                        b,
                        node: p,
                        from: node,
                    },
                );
            }
        }
    }

    /// `node` hears blob `b`'s header from `from`: it asks `from` for the blob, once.
    fn header(&mut self, t: u64, b: usize, node: usize, from: usize, now: Micros) {
        let Some(st) = self.steps.get_mut(&t) else {
            return;
        };
        let c = st.members.len();
        st.headers += 1;
        if !self.alive[node] || st.asked[node * c + b] {
            return;
        }
        st.asked[node * c + b] = true;
        let (at, tries) = match self.net.send(node, from, self.sc.gossip.request_bytes, now) {
            Ok(at) => (at, 0),
            Err(_) => (now + self.timeout, 1),
        };
        self.q.push(
            at,
            Fe::Req {
                t,
                b,
                server: from,
                client: node,
                tries,
            },
        );
    }

    /// `server` answers `client`'s request for blob `b`, retried up to 3 times on failure.
    fn request(&mut self, t: u64, b: usize, server: usize, client: usize, tries: u8, now: Micros) {
        if !self.steps.contains_key(&t) || !self.alive[client] {
            return;
        }
        match self.net.send(server, client, self.blob_bytes, now) {
            Ok(at) => self.q.push(at, Fe::Blob { t, b, node: client }),
            Err(_) if tries < 3 => self.q.push(
                now + self.timeout,
                Fe::Req {
                    t,
                    b,
                    server,
                    client,
                    tries: tries + 1,
                },
            ),
            Err(_) => {}
        }
    }

    /// Step `t` applies the set most nodes hold; the others desync. Records the step's row.
    fn finalize(&mut self, t: u64) {
        let n = self.n;
        let st = self.steps.remove(&t).expect("live step");
        let c = st.members.len();
        let start = us(self.timing.step_start(t));
        let mut sets: BTreeMap<Vec<bool>, u32> = BTreeMap::new();
        let mut held = Vec::new();
        let mut row = Row {
            applied: 0,
            agree: 0.0,
            produced: c as u32,
            included: Vec::new(),
            latency: Vec::new(),
            loss: 0.0,
        };
        for i in 0..n {
            if !self.alive[i] {
                held.push(Vec::new());
                continue;
            }
            let a = &st.arrival[i * c..(i + 1) * c];
            let set: Vec<bool> = a.iter().map(|&x| x != NONE).collect();
            row.included.push(set.iter().filter(|&&x| x).count() as u32);
            if let Some(&last) = a.iter().filter(|&&x| x != NONE).max() {
                row.latency.push(last.saturating_sub(start) as f64 / 1000.0);
            }
            *sets.entry(set.clone()).or_default() += 1;
            held.push(set);
            row.applied += 1;
        }
        let best = sets
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(s, k)| (s.clone(), *k));
        if let Some((set, k)) = best {
            row.agree = k as f64 / row.applied.max(1) as f64;
            let ups: Vec<SparseUpdate> = (0..c)
                .filter(|&b| set[b])
                .map(|b| st.updates[b].clone())
                .collect();
            self.params = self.trainer.apply(t, &self.params, &ups);
            for i in 0..n {
                if self.alive[i] {
                    if held[i] == set {
                        self.reputation[i] += 1;
                    } else {
                        self.reputation[i] = 0;
                        self.desyncs += 1;
                    }
                }
            }
        }
        row.loss = self.trainer.loss(&self.params);
        self.charge_summaries(c, st.headers, row.applied);
        self.rows.insert(t, row);
    }

    /// Summaries: bytes only, at the duplication factor headers showed this step (`c`
    /// publishers' blobs, `headers` header deliveries, `applied` live nodes).
    fn charge_summaries(&mut self, c: usize, headers: u64, applied: u32) {
        let sc = self.sc;
        let publishers = match sc.flow.policy {
            Policy::All => applied as u64,
            Policy::Committee { .. } => c as u64,
        };
        let live = applied.max(1) as u64;
        let dup = if c > 0 {
            headers as f64 / (c as f64 * live as f64)
        } else {
            1.0
        };
        let per = ((sc.flow.summary_bytes + 33 * c as u64) as f64
            * publishers as f64
            * dup.max(1.0)) as u64;
        for i in 0..self.n {
            if self.alive[i] {
                self.net.up_bytes[i] += per;
                self.net.down_bytes[i] += per;
            }
        }
    }

    /// Rows → metrics, with the baseline alongside.
    fn metrics(mut self, initial_loss: f64, events: u64) -> Metrics {
        let sc = self.sc;
        let trainer = &self.trainer;
        let mut base = AdamBaseline::new(trainer.init(), sc.optim.adamw_lr, 0.0);
        let mut all_lat = Vec::new();
        let mut out = Vec::new();
        for s in 0..sc.steps {
            base.step(trainer, s, self.n);
            let Some(mut r) = self.rows.remove(&s) else {
                continue;
            };
            all_lat.extend(r.latency.iter().copied());
            let (mut um, mut ux, mut dm, mut dx) = (0.0, 0, 0.0, 0);
            if let Some((u, d, a)) = self.bytes.get(s as usize) {
                let live: Vec<usize> = (0..a.len()).filter(|&i| a[i]).collect();
                let k = live.len().max(1) as f64;
                um = live.iter().map(|&i| u[i] as f64).sum::<f64>() / k;
                dm = live.iter().map(|&i| d[i] as f64).sum::<f64>() / k;
                ux = live.iter().map(|&i| u[i]).max().unwrap_or(0);
                dx = live.iter().map(|&i| d[i]).max().unwrap_or(0);
            }
            let im = r.included.iter().sum::<u32>() as f64 / r.included.len().max(1) as f64;
            out.push(StepMetrics {
                step: s,
                loss: Some(r.loss),
                baseline_loss: trainer.loss(&base.params),
                applied_nodes: r.applied,
                agree: r.agree,
                produced: r.produced,
                included_mean: im,
                included_min: r.included.iter().copied().min().unwrap_or(0),
                included_max: r.included.iter().copied().max().unwrap_or(0),
                excluded_mean: (r.produced as f64 - im).max(0.0),
                up_mean: um,
                up_max: ux,
                down_mean: dm,
                down_max: dx,
                latency_p50_ms: quantile(&mut r.latency, 0.5),
                latency_p90_ms: quantile(&mut r.latency, 0.9),
                latency_max_ms: quantile(&mut r.latency, 1.0),
                ..Default::default()
            });
        }
        let mut m = Metrics {
            scenario: sc.name.clone(),
            mode: "flow".into(),
            seed: sc.seed,
            nodes: self.n,
            update_bytes: self.blob_bytes,
            steps: out,
            ..Default::default()
        };
        m.totals.initial_loss = initial_loss;
        m.totals.desyncs = self.desyncs;
        m.totals.messages = self.net.messages;
        m.totals.lost = self.net.lost;
        m.totals.events = events;
        finish(&mut m, &mut all_lat);
        m
    }
}

/// The gossip mesh, as in engine mode: mesh_degree/2 random links per node, both directions.
fn build_mesh(sc: &Scenario, n: usize) -> Vec<Vec<usize>> {
    let mut rng = derive(&[sc.seed, 0x6d657368]);
    let mut mesh: Vec<Vec<usize>> = vec![Vec::new(); n];
    let half = sc.gossip.mesh_degree.div_ceil(2).min(n.saturating_sub(1));
    for i in 0..n {
        let mut added = 0;
        let mut tries = 0;
        while added < half && tries < 50 * half {
            tries += 1;
            let j = rng.below(n as u64) as usize;
            if j != i && !mesh[i].contains(&j) {
                mesh[i].push(j);
                mesh[j].push(i);
                added += 1;
            }
        }
    }
    for m in &mut mesh {
        m.sort_unstable();
    }
    mesh
}
