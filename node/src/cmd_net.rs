//! `swarm run` and `swarm bootstrap`: a tokio event loop that owns the sans-IO engine and the
//! libp2p swarm, turns network I/O into engine events and engine actions into I/O, and hands
//! training and applying to the trainer thread.
//!
//! Time given to the engine is unix milliseconds: the run's step clock is wall-clock time, the
//! same on every machine up to skew (which the run's grace absorbs).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::Args;
use crypto::{ContentId, Digest, Identity, NodeId};
use futures::StreamExt;
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance, MessageId};
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{dial_opts::DialOpts, SwarmEvent};
use libp2p::{identify, kad, request_response, Multiaddr, PeerId, Swarm};
use node::net::{self, Behaviour, BehaviourEvent, NetConfig, RateLimit, Request};
use prometheus_client::metrics::gauge::Gauge;
use protocol::engine::{Action, Engine, Event, Report, Verdict};
use protocol::run::RunConfig;
use serde::Serialize;
use tokio::sync::mpsc;

use crate::trainer::{self, Cmd, Reply, Trainer};

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
    /// Where to keep checkpoints.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Append one JSON line per applied step (step, loss, peers, bytes, digest) to this file.
    #[arg(long)]
    pub status: Option<PathBuf>,
    /// Leave after applying this many steps (after lingering two periods to serve peers).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Local batch (sequences per step), for weaker hardware; the header carries the tokens.
    #[arg(long)]
    pub batch: Option<usize>,
    /// libtorch CPU threads.
    #[arg(long)]
    pub threads: Option<i32>,
}

#[derive(Args, Debug)]
pub struct BootstrapArgs {
    /// Listen address, e.g. /ip4/0.0.0.0/tcp/4001 or /ip4/0.0.0.0/udp/4001/quic-v1.
    #[arg(long, num_args = 1.., required = true)]
    pub listen: Vec<Multiaddr>,
    #[arg(long)]
    pub key: PathBuf,
    /// Write the full listen multiaddrs (with /p2p/ID), one a line, to this file once known.
    #[arg(long)]
    pub addr_file: Option<PathBuf>,
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

/// One line of `--status`.
#[derive(Serialize, Default, Clone)]
pub struct StatusLine {
    pub node: String,
    pub step: u64,
    pub version: u64,
    pub loss: Option<f64>,
    pub peers: usize,
    pub included: usize,
    pub update_bytes: u64,
    /// Bytes sent / received during this step (libp2p bandwidth counters).
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub train_ms: u64,
    pub apply_ms: u64,
    pub digest: String,
    pub t_ms: u64,
    pub rejected: u64,
    pub fetches: u64,
}

struct Gauges {
    step: Gauge,
    peers: Gauge,
    loss: Gauge<f64, std::sync::atomic::AtomicU64>,
    rejected: Gauge,
    fetches: Gauge,
}

/// Most gossip messages awaiting a verdict; beyond it the oldest tag is forgotten (gossipsub
/// itself gives up on unvalidated messages after its duplicate-cache time).
const MAX_TAGS: usize = 4096;
/// Trainer command queue: a step's Train plus Applies in flight.
const TRAINER_QUEUE: usize = 8;

struct Node {
    engine: Engine,
    swarm: Swarm<Behaviour>,
    topic: IdentTopic,
    tags: BTreeMap<u64, (MessageId, PeerId)>,
    next_tag: u64,
    fetches: HashMap<request_response::OutboundRequestId, (NodeId, ContentId)>,
    trainer: mpsc::Sender<Cmd>,
    /// Commands the trainer queue had no room for yet (Applies must never be dropped).
    backlog: VecDeque<Cmd>,
    timer: Option<u64>,
    members: BTreeMap<PeerId, NodeId>,
    rate: RateLimit,
    reg: Arc<Mutex<libp2p::metrics::Registry>>,
    gauges: Gauges,
    status: Option<std::fs::File>,
    losses: BTreeMap<u64, (f64, u64)>,
    update_bytes: u64,
    last_bw: (u64, u64),
    steps: Option<u64>,
    done_at: Option<u64>,
    ckpt_dir: Option<PathBuf>,
    name: String,
}

impl Node {
    fn feed(&mut self, ev: Event) {
        let acts = self.engine.handle(ev, now_ms());
        for a in acts {
            self.act(a);
        }
    }

    fn to_trainer(&mut self, c: Cmd) {
        self.backlog.push_back(c);
        self.flush_trainer();
    }

    fn flush_trainer(&mut self) {
        while let Some(c) = self.backlog.pop_front() {
            match self.trainer.try_send(c) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(c)) => {
                    self.backlog.push_front(c);
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return,
            }
        }
    }

    fn act(&mut self, a: Action) {
        match a {
            Action::Publish { bytes } => {
                if let Err(e) = self
                    .swarm
                    .behaviour_mut()
                    .gossipsub
                    .publish(self.topic.clone(), bytes)
                {
                    tracing::debug!("publish: {e}");
                }
            }
            Action::Send { peer, bytes } => {
                self.swarm
                    .behaviour_mut()
                    .rr
                    .send_request(&net::peer_id(&peer), Request::Frame(bytes));
            }
            Action::Verdict { tag, verdict } => {
                if let Some((id, src)) = self.tags.remove(&tag) {
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
            Action::Fetch { peer, blob } => {
                let r = self
                    .swarm
                    .behaviour_mut()
                    .rr
                    .send_request(&net::peer_id(&peer), Request::Blob(blob));
                self.fetches.insert(r, (peer, blob));
            }
            Action::RequestCheckpoint { min_version, peers } => {
                // Checkpoint transfer is not wired yet: report failure so the engine retries
                // later instead of waiting forever.
                tracing::warn!(
                    min_version,
                    peers = peers.len(),
                    "checkpoint requested; transfer not implemented yet"
                );
                self.feed(Event::CheckpointFailed);
            }
            Action::StartStep { step, .. } => {
                if self.done_at.is_none() {
                    self.to_trainer(Cmd::Train { step });
                }
            }
            Action::Apply { step, updates } => self.to_trainer(Cmd::Apply { step, updates }),
            Action::Penalize { peer, reason, .. } => {
                tracing::info!(%peer, %reason, "penalized");
                let s = self.engine.score(&peer) as f64;
                self.swarm
                    .behaviour_mut()
                    .gossipsub
                    .set_application_score(&net::peer_id(&peer), -s);
            }
            Action::Ban { peer, reason } => {
                tracing::warn!(%peer, %reason, "banned");
                let p = net::peer_id(&peer);
                self.swarm.behaviour_mut().gossipsub.blacklist_peer(&p);
                let _ = self.swarm.disconnect_peer_id(p);
            }
            Action::SetTimer { at } => self.timer = Some(at),
            Action::Report(r) => match r {
                Report::StepApplied {
                    step,
                    included,
                    listed,
                    missing,
                } => {
                    tracing::debug!(step, included, listed, missing, "step set decided")
                }
                Report::Rejected { from, error } => tracing::info!(%from, %error, "rejected"),
                Report::Ignored { from, error } => tracing::debug!(%from, %error, "ignored"),
                other => tracing::info!("{other:?}"),
            },
        }
    }

    fn on_swarm(&mut self, ev: SwarmEvent<BehaviourEvent>) {
        match ev {
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::info!(
                    "listening on {}",
                    address
                        .clone()
                        .with(Protocol::P2p(*self.swarm.local_peer_id()))
                );
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
                    self.next_tag += 1;
                    let tag = self.next_tag;
                    if self.tags.len() >= MAX_TAGS {
                        self.tags.pop_first();
                    }
                    self.tags.insert(tag, (message_id, propagation_source));
                    self.feed(Event::Message {
                        from,
                        tag: Some(tag),
                        bytes: message.data,
                    });
                }
                gossipsub::Event::Subscribed { peer_id, topic } if topic == self.topic.hash() => {
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
                    if !self.rate.allow(peer, now_ms()) {
                        // Dropping the channel tells the peer we refused.
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
                        Request::Blob(id) => self.engine.serve_update(&id).unwrap_or_default(),
                    };
                    let _ = self.swarm.behaviour_mut().rr.send_response(channel, resp);
                }
                request_response::Message::Response {
                    request_id,
                    response,
                } => {
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
            Reply::Trained {
                step,
                blob,
                tokens,
                loss,
                ms,
            } => {
                self.update_bytes = blob.len() as u64;
                self.losses.insert(step, (loss, ms));
                while self.losses.len() > 64 {
                    self.losses.pop_first();
                }
                self.gauges.loss.set(loss);
                self.feed(Event::LocalUpdate { step, blob, tokens });
            }
            Reply::Applied {
                step,
                digest,
                ms,
                included,
            } => {
                self.feed(Event::Applied {
                    step,
                    digest: Digest(digest),
                });
                self.write_status(step, Digest(digest), ms, included)?;
                if let Some(n) = self.steps {
                    if step + 1 >= n && self.done_at.is_none() {
                        self.done_at = Some(now_ms() + 2 * self.engine.run().timing.period_ms);
                        if let Some(dir) = self.ckpt_dir.clone() {
                            std::fs::create_dir_all(&dir)?;
                            let path = dir.join(format!("v{}.safetensors", step + 1));
                            self.to_trainer(Cmd::Save {
                                version: step + 1,
                                path,
                            });
                        }
                    }
                }
            }
            Reply::Saved { version, path } => tracing::info!(version, "saved {}", path.display()),
            Reply::Failed(e) => bail!("trainer: {e}"),
        }
        self.flush_trainer();
        Ok(())
    }

    fn write_status(
        &mut self,
        step: u64,
        digest: Digest,
        apply_ms: u64,
        included: usize,
    ) -> Result<()> {
        let bw = net::bandwidth(&self.reg.lock().expect("registry lock"));
        let (din, dout) = (
            bw.0.saturating_sub(self.last_bw.0),
            bw.1.saturating_sub(self.last_bw.1),
        );
        self.last_bw = bw;
        let m = self.engine.metrics().clone();
        let (loss, train_ms) = self
            .losses
            .get(&step)
            .copied()
            .map_or((None, 0), |(l, t)| (Some(l), t));
        self.gauges.step.set(step as i64 + 1);
        self.gauges.peers.set(self.members.len() as i64);
        self.gauges.rejected.set(m.rejected as i64);
        self.gauges.fetches.set(m.fetches as i64);
        let line = StatusLine {
            node: self.name.clone(),
            step,
            version: step + 1,
            loss,
            peers: self.members.len(),
            included,
            update_bytes: self.update_bytes,
            bytes_out: dout,
            bytes_in: din,
            train_ms,
            apply_ms,
            digest: digest.to_hex(),
            t_ms: now_ms(),
            rejected: m.rejected,
            fetches: m.fetches,
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
        if let Some(f) = &mut self.status {
            writeln!(f, "{}", serde_json::to_string(&line)?)?;
            f.flush()?;
        }
        Ok(())
    }
}

async fn serve_metrics(addr: SocketAddr, reg: Arc<Mutex<libp2p::metrics::Registry>>) -> Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("metrics on {addr}"))?;
    tracing::info!("metrics at http://{addr}/metrics");
    loop {
        let (mut s, _) = l.accept().await?;
        let reg = reg.clone();
        tokio::spawn(async move {
            // One small GET; a bounded read is all a scraper needs.
            let mut buf = [0u8; 1024];
            let n = match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
                Ok(Ok(n)) => n,
                _ => return,
            };
            let req = String::from_utf8_lossy(&buf[..n]);
            let (status, body) = if req.starts_with("GET /metrics") {
                let mut text = String::new();
                let _ = prometheus_client::encoding::text::encode(
                    &mut text,
                    &reg.lock().expect("registry lock"),
                );
                ("200 OK", text)
            } else {
                ("404 Not Found", "try /metrics\n".to_string())
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(resp.as_bytes()).await;
        });
    }
}

pub fn run(a: RunArgs) -> Result<()> {
    let run = load_run(&a.run, a.genesis_ms)?;
    let id = Identity::load(&a.key).map_err(|e| anyhow::anyhow!("{}: {e}", a.key.display()))?;
    let device = train::parse_device(&a.device)?;
    if let Some(t) = a.threads {
        tch::set_num_threads(t);
    }
    let spec = trainer::data_spec(&run, a.data.as_deref())?;
    let corpus = train::data::Corpus::open(&spec)?;
    if corpus.vocab() as u32 > run.model.vocab {
        bail!(
            "data vocabulary {} exceeds the model's {}",
            corpus.vocab(),
            run.model.vocab
        );
    }
    let batch = a.batch.unwrap_or(run.batch_seqs as usize).max(1);
    let me = id.node_id();
    let (cmd_tx, cmd_rx) = mpsc::channel::<Cmd>(TRAINER_QUEUE);
    let (rep_tx, mut rep_rx) = mpsc::channel::<Reply>(TRAINER_QUEUE);
    let trainer = Trainer::new(&run, corpus, me.0.to_vec(), batch, device, None)?;
    std::thread::Builder::new()
        .name("trainer".into())
        .spawn(move || trainer.serve(cmd_rx, rep_tx))?;

    runtime()?.block_on(async move {
        let genesis = match rep_rx.recv().await {
            Some(Reply::Ready { digest, params }) => {
                tracing::info!(params, digest = %Digest(digest).to_hex(), "model ready");
                Digest(digest)
            }
            Some(Reply::Failed(e)) => bail!("trainer: {e}"),
            _ => bail!("trainer exited"),
        };
        let mut reg = libp2p::metrics::Registry::default();
        let swarm = net::build_swarm(net::keypair(&id), &NetConfig::for_run(&run), &mut reg)?;
        let gauges = Gauges {
            step: Gauge::default(),
            peers: Gauge::default(),
            loss: Gauge::default(),
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
            "swarm_rejected",
            "Messages rejected as invalid",
            gauges.rejected.clone(),
        );
        reg.register("swarm_fetches", "Blob fetches", gauges.fetches.clone());
        let reg = Arc::new(Mutex::new(reg));
        let now = now_ms();
        let rng_seed = u64::from_le_bytes(me.0[8..16].try_into().expect("8 bytes")) ^ now;
        let engine = Engine::new(run.clone(), id, Some(genesis), now, rng_seed);
        if !engine.status().synced {
            tracing::warn!("started after step 0 was applied: joining (needs a checkpoint)");
        }
        let topic = IdentTopic::new(run.topic());
        let status = match &a.status {
            Some(p) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .with_context(|| p.display().to_string())?,
            ),
            None => None,
        };
        let mut node = Node {
            engine,
            swarm,
            topic: topic.clone(),
            tags: BTreeMap::new(),
            next_tag: 0,
            fetches: HashMap::new(),
            trainer: cmd_tx,
            backlog: VecDeque::new(),
            timer: None,
            members: BTreeMap::new(),
            // Per peer: a few fetches per step per update is plenty; bursts cover a repair.
            rate: RateLimit::new(50.0, 200.0, run.limits.max_peers as usize),
            reg: reg.clone(),
            gauges,
            status,
            losses: BTreeMap::new(),
            update_bytes: 0,
            last_bw: (0, 0),
            steps: a.steps,
            done_at: None,
            ckpt_dir: a.checkpoint_dir.clone(),
            name: me.peer_id_string(),
        };
        node.swarm.behaviour_mut().gossipsub.subscribe(&topic)?;
        for l in &a.listen {
            node.swarm.listen_on(l.clone())?;
        }
        for b in &a.bootstrap {
            match split_p2p(b) {
                Some((p, addr)) => {
                    node.swarm.behaviour_mut().kad.add_address(&p, addr);
                }
                None => {
                    tracing::warn!("bootstrap address {b} has no /p2p/PEER_ID; dialing it anyway")
                }
            }
            node.swarm.dial(b.clone())?;
        }
        if let Some(addr) = a.metrics {
            let reg = reg.clone();
            tokio::spawn(async move {
                if let Err(e) = serve_metrics(addr, reg).await {
                    tracing::warn!("metrics server: {e:#}");
                }
            });
        }
        node.feed(Event::Timer);
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        let mut discover = tokio::time::interval(Duration::from_secs(5));
        loop {
            let wait = node.timer.map_or(Duration::from_secs(3600), |t| {
                Duration::from_millis(t.saturating_sub(now_ms()))
            });
            tokio::select! {
                ev = node.swarm.select_next_some() => node.on_swarm(ev),
                r = rep_rx.recv() => match r {
                    Some(r) => node.on_trainer(r)?,
                    None => bail!("trainer thread exited"),
                },
                _ = tokio::time::sleep(wait), if node.timer.is_some() => {
                    node.timer = None;
                    node.feed(Event::Timer);
                }
                _ = tick.tick() => {
                    // Timers are idempotent: a periodic one guards against a lost wake-up.
                    node.feed(Event::Timer);
                    node.flush_trainer();
                    if node.done_at.is_some_and(|d| now_ms() >= d) {
                        tracing::info!("reached {} steps; leaving", node.steps.unwrap_or(0));
                        return Ok(());
                    }
                }
                _ = discover.tick() => {
                    if !a.bootstrap.is_empty() {
                        let _ = node.swarm.behaviour_mut().kad.bootstrap();
                    }
                }
                _ = shutdown() => return Ok(()),
            }
        }
    })
}
