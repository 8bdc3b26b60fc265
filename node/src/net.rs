//! The libp2p side of a node: one `Behaviour` (gossipsub, identify, kademlia, request-response,
//! connection limits) and the small pieces around it that are easy to get wrong.
//!
//! * gossipsub validates manually (`validate_messages`): nothing is forwarded until the engine's
//!   verdict, so a relay only forwards what it checked. Message ids are blake3 of the data, so a
//!   re-signed copy of the same frame collapses into one. `max_transmit_size` comes from the run
//!   config, so every node of a run drops exactly the same oversize frames (a frame over a
//!   receiver's limit is dropped silently). One topic per run namespaces the traffic; we never
//!   set `protocol_id_prefix`, which would lose gossipsub 1.2's IDONTWANT.
//! * Peer scoring punishes invalid messages heavily (P4) and leaves the mesh-delivery penalties
//!   (P3/P3b) off: a run publishes a handful of messages per step, a rate at which those
//!   penalties misfire on honest peers.
//! * Request-response carries direct frames (Hello), blob fetches by content id and
//!   checkpoints (a signed manifest for a minimum version, then chunks by (version, index)).
//!   Every frame is length-prefixed and its length is checked against a cap before anything is
//!   allocated; requests have fixed lengths per kind.
//! * [`CheckpointDownload`] is the joiner's side of a checkpoint transfer as a plain state
//!   machine (no I/O, no clock of its own), so every way a server can fail or lie is tested
//!   without a network: manifests from several peers must agree on (version, digest), chunks
//!   are spread across the agreeing peers and verified one by one, and a peer that served
//!   something provably wrong is named for a ban.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use crypto::{ContentId, NodeId};
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use libp2p::gossipsub::{self, MessageAuthenticity, MessageId, TopicHash, ValidationMode};
use libp2p::identity::Keypair;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{
    connection_limits, identify, kad, noise, request_response, tcp, yamux, PeerId, StreamProtocol,
    Swarm,
};
use protocol::checkpoint::CheckpointManifest;
use protocol::run::{Limits, RunConfig, RunId};
use protocol::wire::{Message, Signed};
use thiserror::Error;

pub const REQ_PROTOCOL: &str = "/swarm/req/1";
pub const KAD_PROTOCOL: &str = "/swarm/kad/1";
pub const IDENTIFY_PROTOCOL: &str = "/swarm/id/1";

#[derive(Debug, Error)]
pub enum NetError {
    #[error("transport: {0}")]
    Transport(String),
    #[error("gossipsub config: {0}")]
    Gossip(String),
    #[error("peer id: {0}")]
    PeerId(String),
}

/// Sizes every node of a run must agree on, derived from the run config alone.
#[derive(Clone, Debug)]
pub struct NetConfig {
    /// gossipsub's `max_transmit_size`: the engine's largest frame plus the RPC envelope
    /// (author key, signature, seqno, topic).
    pub max_transmit: usize,
    /// Largest request frame: a direct Hello, or an update uploaded to a relay (header + blob).
    pub max_request: usize,
    /// Largest response (an update frame: header + blob; or a checkpoint chunk/manifest).
    pub max_response: usize,
    /// The run's topic; None for a node that only helps discovery (a bootstrap peer).
    pub topic: Option<String>,
    pub max_connections: u32,
    pub request_timeout: Duration,
    /// gossipsub's mesh degree (`mesh_n`; the others follow from it, see [`gossip_config`]).
    pub mesh: usize,
}

/// Connections others may open to this node, of `max` in all: a quarter stays for the
/// connections it dials itself (its bootstrap peers, the peers discovery finds), so that keys
/// dialing in by the hundred cannot take every slot and eclipse it. One cap for both
/// directions let 128 keys do that.
pub fn max_inbound(max: u32) -> u32 {
    max - max / 4
}

/// gossipsub's default mesh degree.
pub const DEFAULT_MESH: usize = 6;

/// Room gossipsub's protobuf envelope takes around our frame: 36-byte key, 64-byte signature,
/// seqno, topic string (~80 bytes) and field tags, with headroom.
const GOSSIP_ENVELOPE: usize = 1024;
/// Room around a blob in an update response: signed header and CBOR framing.
const RESPONSE_ENVELOPE: usize = 4096;

impl NetConfig {
    pub fn for_run(run: &RunConfig) -> NetConfig {
        let l = &run.limits;
        let update = l.max_blob_bytes as usize + l.max_header_bytes as usize + RESPONSE_ENVELOPE;
        let ckpt =
            (l.max_checkpoint_chunk_bytes.max(l.max_manifest_bytes) as usize) + RESPONSE_ENVELOPE;
        NetConfig {
            max_transmit: l.max_message_bytes as usize + GOSSIP_ENVELOPE,
            max_request: (l.max_message_bytes as usize).max(update),
            max_response: update.max(ckpt),
            topic: Some(run.topic()),
            max_connections: 256,
            // Long enough for a multi-megabyte blob on a slow link; a step's summary window
            // bounds how long a fetch can be useful anyway.
            request_timeout: Duration::from_millis(run.timing.summary_ms.max(run.timing.period_ms)),
            mesh: DEFAULT_MESH,
        }
    }

    /// A discovery-only node: no topic; small frames.
    pub fn bootstrap() -> NetConfig {
        NetConfig {
            max_transmit: 64 * 1024,
            max_request: 16 * 1024,
            max_response: 16 * 1024,
            topic: None,
            max_connections: 1024,
            request_timeout: Duration::from_secs(10),
            mesh: DEFAULT_MESH,
        }
    }
}

/// A request on [`REQ_PROTOCOL`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// A direct protocol frame (e.g. Hello); answered with an empty response.
    Frame(Vec<u8>),
    /// The `Message::Update` frame of this blob id; empty if the peer does not hold it.
    Blob(ContentId),
    /// A `Message::Manifest` frame for the oldest parameter version the peer still serves
    /// that is at least `min_version` (oldest, so that peers a step apart still agree); empty
    /// if none.
    Manifest { min_version: u64 },
    /// A `Message::Chunk` frame: piece `index` of checkpoint `version`; empty if not held.
    Chunk { version: u64, index: u32 },
}

impl Request {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Request::Frame(b) => [&[0u8][..], b].concat(),
            Request::Blob(id) => [&[1u8][..], &id.0].concat(),
            Request::Manifest { min_version } => [&[2u8][..], &min_version.to_le_bytes()].concat(),
            Request::Chunk { version, index } => {
                [&[3u8][..], &version.to_le_bytes(), &index.to_le_bytes()].concat()
            }
        }
    }
    pub fn decode(b: &[u8]) -> io::Result<Request> {
        match b.split_first() {
            Some((0, rest)) => Ok(Request::Frame(rest.to_vec())),
            Some((1, rest)) if rest.len() == 32 => {
                Ok(Request::Blob(ContentId(rest.try_into().expect("32 bytes"))))
            }
            Some((2, rest)) if rest.len() == 8 => Ok(Request::Manifest {
                min_version: u64::from_le_bytes(rest.try_into().expect("8 bytes")),
            }),
            Some((3, rest)) if rest.len() == 12 => Ok(Request::Chunk {
                version: u64::from_le_bytes(rest[..8].try_into().expect("8 bytes")),
                index: u32::from_le_bytes(rest[8..].try_into().expect("4 bytes")),
            }),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "unknown request",
            )),
        }
    }
}

/// Length-prefixed raw bytes with a cap per direction. A peer announcing a longer frame is cut
/// off before we allocate for it.
#[derive(Clone, Debug)]
pub struct Codec {
    pub max_request: usize,
    pub max_response: usize,
}

async fn read_frame<T: AsyncRead + Unpin + Send>(io: &mut T, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let n = u32::from_be_bytes(len) as usize;
    if n > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {n} bytes over the cap of {max}"),
        ));
    }
    let mut buf = vec![0u8; n];
    io.read_exact(&mut buf).await?;
    Ok(buf)
}

async fn write_frame<T: AsyncWrite + Unpin + Send>(
    io: &mut T,
    b: &[u8],
    max: usize,
) -> io::Result<()> {
    if b.len() > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("frame of {} bytes over the cap of {max}", b.len()),
        ));
    }
    io.write_all(&(b.len() as u32).to_be_bytes()).await?;
    io.write_all(b).await?;
    io.close().await
}

impl request_response::Codec for Codec {
    type Protocol = StreamProtocol;
    type Request = Request;
    /// Raw bytes; empty means "not here".
    type Response = Vec<u8>;

    async fn read_request<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<Request> {
        // +1: the request kind byte.
        Request::decode(&read_frame(io, self.max_request + 1).await?)
    }
    async fn read_response<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<Vec<u8>> {
        read_frame(io, self.max_response).await
    }
    async fn write_request<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        r: Request,
    ) -> io::Result<()> {
        write_frame(io, &r.encode(), self.max_request + 1).await
    }
    async fn write_response<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        r: Vec<u8>,
    ) -> io::Result<()> {
        write_frame(io, &r, self.max_response).await
    }
}

#[derive(NetworkBehaviour)]
pub struct Behaviour {
    pub limits: connection_limits::Behaviour,
    pub gossipsub: gossipsub::Behaviour,
    pub identify: identify::Behaviour,
    pub kad: kad::Behaviour<kad::store::MemoryStore>,
    pub rr: request_response::Behaviour<Codec>,
}

/// Content-addressed ids: the same bytes are the same message, whoever re-signed them.
fn message_id(m: &gossipsub::Message) -> MessageId {
    MessageId::from(blake3::hash(&m.data).as_bytes().to_vec())
}

/// gossipsub for a run. `cfg.mesh` below the default makes a lean mesh, for nodes whose
/// updates go through a relay (`swarm run --mesh 2`): only headers and summaries then travel
/// the mesh, and each message forwarded to six peers, plus lazy IHAVE gossip to six more and
/// a flood-published summary to every peer, cost more than the update itself (measured:
/// docs/BENCHMARKS.md). Fewer forwards, IHAVE to as many peers as the mesh holds, and own
/// messages to mesh peers only (the relay still flood-publishes the headers it verified).
pub fn gossip_config(cfg: &NetConfig) -> Result<gossipsub::Config, NetError> {
    let n = cfg.mesh.clamp(1, 12);
    let mut b = gossipsub::ConfigBuilder::default();
    b.validation_mode(ValidationMode::Strict)
        .validate_messages()
        .message_id_fn(message_id)
        .max_transmit_size(cfg.max_transmit)
        .heartbeat_interval(Duration::from_millis(700))
        .mesh_n(n)
        // Small swarms: keep everyone in the mesh rather than waiting for a full one.
        .mesh_n_low(if n >= DEFAULT_MESH { 2 } else { 1 })
        .mesh_n_high((2 * n).max(n + 1))
        .mesh_outbound_min(if n >= 2 { 1 } else { 0 });
    if n < DEFAULT_MESH {
        b.gossip_lazy(n).flood_publish(false);
    }
    b.build().map_err(|e| NetError::Gossip(e.to_string()))
}

/// Score parameters: a provably invalid message costs a relay most of the way to the graylist.
pub fn score_params(
    topic: Option<&TopicHash>,
) -> (gossipsub::PeerScoreParams, gossipsub::PeerScoreThresholds) {
    let mut p = gossipsub::PeerScoreParams::default();
    // Loopback test swarms share one IP; a real deployment sees one node per loopback at most.
    p.ip_colocation_factor_whitelist = HashSet::from([
        IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(Ipv6Addr::LOCALHOST),
    ]);
    if let Some(t) = topic {
        let tp = gossipsub::TopicScoreParams {
            topic_weight: 1.0,
            invalid_message_deliveries_weight: -100.0,
            invalid_message_deliveries_decay: 0.9,
            // Low-rate topic: mesh-delivery penalties would punish honest quiet peers.
            mesh_message_deliveries_weight: 0.0,
            mesh_failure_penalty_weight: 0.0,
            first_message_deliveries_weight: 1.0,
            first_message_deliveries_cap: 50.0,
            ..Default::default()
        };
        p.topics.insert(t.clone(), tp);
    }
    (p, gossipsub::PeerScoreThresholds::default())
}

pub fn build_behaviour(key: &Keypair, cfg: &NetConfig) -> Result<Behaviour, NetError> {
    let me = key.public().to_peer_id();
    let mut gossipsub = gossipsub::Behaviour::new(
        MessageAuthenticity::Signed(key.clone()),
        gossip_config(cfg)?,
    )
    .map_err(|e| NetError::Gossip(e.to_string()))?;
    let topic = cfg
        .topic
        .as_ref()
        .map(|t| gossipsub::IdentTopic::new(t.clone()).hash());
    let (p, th) = score_params(topic.as_ref());
    gossipsub.with_peer_score(p, th).map_err(NetError::Gossip)?;
    let identify = identify::Behaviour::new(identify::Config::new(
        IDENTIFY_PROTOCOL.into(),
        key.public(),
    ));
    let mut kcfg = kad::Config::new(StreamProtocol::new(KAD_PROTOCOL));
    kcfg.set_query_timeout(Duration::from_secs(30));
    let mut kad = kad::Behaviour::with_config(me, kad::store::MemoryStore::new(me), kcfg);
    // Loopback and private addresses are never "confirmed external", so kad would stay a
    // client and nobody could discover anyone: every node serves the DHT.
    kad.set_mode(Some(kad::Mode::Server));
    let rr = request_response::Behaviour::with_codec(
        Codec {
            max_request: cfg.max_request,
            max_response: cfg.max_response,
        },
        [(
            StreamProtocol::new(REQ_PROTOCOL),
            request_response::ProtocolSupport::Full,
        )],
        request_response::Config::default()
            .with_request_timeout(cfg.request_timeout)
            .with_max_concurrent_streams(64),
    );
    let limits = connection_limits::Behaviour::new(
        connection_limits::ConnectionLimits::default()
            .with_max_established(Some(cfg.max_connections))
            .with_max_established_incoming(Some(max_inbound(cfg.max_connections)))
            .with_max_established_per_peer(Some(2))
            .with_max_pending_incoming(Some(64))
            .with_max_pending_outgoing(Some(64)),
    );
    Ok(Behaviour {
        limits,
        gossipsub,
        identify,
        kad,
        rr,
    })
}

/// A tokio swarm listening on TCP (noise + yamux) and QUIC, with bandwidth counted into
/// `registry` (the `libp2p_bandwidth` family: bytes after encryption is removed, per direction).
pub fn build_swarm(
    key: Keypair,
    cfg: &NetConfig,
    registry: &mut libp2p::metrics::Registry,
) -> Result<Swarm<Behaviour>, NetError> {
    let cfg = cfg.clone();
    let swarm = libp2p::SwarmBuilder::with_existing_identity(key)
        .with_tokio()
        .with_tcp(
            tcp::Config::default().nodelay(true),
            noise::Config::new,
            yamux::Config::default,
        )
        .map_err(|e| NetError::Transport(e.to_string()))?
        .with_quic()
        .with_bandwidth_metrics(registry)
        .with_behaviour(|k| {
            build_behaviour(k, &cfg)
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
        })
        .map_err(|e| NetError::Transport(e.to_string()))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(120)))
        .build();
    Ok(swarm)
}

pub fn keypair(id: &crypto::Identity) -> Keypair {
    Keypair::ed25519_from_bytes(id.seed()).expect("a 32-byte ed25519 seed is always valid")
}

pub fn peer_id(n: &NodeId) -> PeerId {
    PeerId::from_bytes(&n.peer_id_bytes()).expect("an ed25519 node id is a valid peer id")
}

pub fn node_id(p: &PeerId) -> Option<NodeId> {
    NodeId::from_peer_id_bytes(&p.to_bytes()).ok()
}

/// Sum of the `libp2p_bandwidth` counters in `registry`: (inbound, outbound) bytes.
pub fn bandwidth(registry: &libp2p::metrics::Registry) -> (u64, u64) {
    let mut text = String::new();
    if prometheus_client::encoding::text::encode(&mut text, registry).is_err() {
        return (0, 0);
    }
    let (mut inb, mut outb) = (0u64, 0u64);
    for l in text.lines().filter(|l| l.starts_with("libp2p_bandwidth")) {
        let Some(v) = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        if l.contains("direction=\"Inbound\"") {
            inb += v as u64;
        } else if l.contains("direction=\"Outbound\"") {
            outb += v as u64;
        }
    }
    (inb, outb)
}

/// A token bucket per peer for inbound requests: `rate` per second, bursts up to `burst`. The
/// table is bounded; when full, the quietest entries (full buckets) are forgotten first.
pub struct RateLimit {
    rate: f64,
    burst: f64,
    max_peers: usize,
    buckets: BTreeMap<PeerId, (f64, u64)>,
}

impl RateLimit {
    pub fn new(rate: f64, burst: f64, max_peers: usize) -> RateLimit {
        RateLimit {
            rate,
            burst,
            max_peers,
            buckets: BTreeMap::new(),
        }
    }

    /// Whether `peer` may make one more request at `now_ms`.
    pub fn allow(&mut self, peer: PeerId, now_ms: u64) -> bool {
        if !self.buckets.contains_key(&peer) && self.buckets.len() >= self.max_peers {
            let (rate, burst) = (self.rate, self.burst);
            self.buckets.retain(|_, (tokens, at)| {
                *tokens + now_ms.saturating_sub(*at) as f64 / 1000.0 * rate < burst
            });
            if self.buckets.len() >= self.max_peers {
                return false;
            }
        }
        let (tokens, at) = self.buckets.entry(peer).or_insert((self.burst, now_ms));
        *tokens =
            (*tokens + now_ms.saturating_sub(*at) as f64 / 1000.0 * self.rate).min(self.burst);
        *at = now_ms;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Peers asked for a manifest at once: two must agree, a third and fourth cover a slow or
/// lying one.
pub const MANIFEST_PEERS: usize = 4;
/// Chunk requests in flight per download, and per server.
pub const MAX_CHUNKS_INFLIGHT: usize = 8;
const MAX_CHUNKS_PER_SERVER: usize = 4;

/// What a [`CheckpointDownload`] wants done.
#[derive(Clone, Debug, PartialEq)]
pub enum DlAction {
    /// Send `peer` this request ([`Request::Manifest`] or [`Request::Chunk`]) and report the
    /// answer with [`CheckpointDownload::on_response`] or [`CheckpointDownload::on_failure`].
    Ask {
        peer: NodeId,
        request: Request,
    },
    /// `peer` served something provably wrong (a bad signature, a chunk that does not hash to
    /// what its own signed manifest says, a signed manifest that does not fit the run's model
    /// or whose tensors do not match its chunks): ban it.
    Ban {
        peer: NodeId,
        reason: String,
    },
    /// Every chunk arrived and verified; `tensors` are in manifest (= model) order.
    Done {
        version: u64,
        digest: crypto::Digest,
        tensors: Vec<Vec<u8>>,
        servers: Vec<NodeId>,
        /// Peers that signed a manifest of the same version with another digest: liars once
        /// the loaded digest turns out to be the attested one (the shell bans them then).
        dissenters: Vec<NodeId>,
    },
    Failed {
        reason: String,
    },
}

enum Phase {
    Manifests,
    Chunks {
        manifest: CheckpointManifest,
        servers: Vec<NodeId>,
        /// Servers that refused, failed or lied: not asked again by this download.
        out: BTreeSet<NodeId>,
        chunks: Vec<Option<Vec<u8>>>,
        /// index → server asked.
        inflight: BTreeMap<u32, NodeId>,
        next: usize,
    },
    Finished,
}

/// The joiner's side of one checkpoint transfer. See the module docs.
pub struct CheckpointDownload {
    run: RunId,
    limits: Limits,
    min_version: u64,
    /// The local model's tensors: (name, shape), all f32.
    layout: Vec<(String, Vec<u32>)>,
    /// Manifest answers: None while pending, Some(None) for "no" or a fault.
    answers: BTreeMap<NodeId, Option<Option<Signed<CheckpointManifest>>>>,
    phase: Phase,
    manifest_deadline: u64,
    deadline: u64,
}

impl CheckpointDownload {
    /// Ask up to [`MANIFEST_PEERS`] of `peers` (in the order given) for a manifest of at least
    /// `min_version`. Manifests are awaited until `now + manifest_ms`; everything must be done
    /// by `now + total_ms`.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        run: RunId,
        limits: Limits,
        layout: Vec<(String, Vec<u32>)>,
        min_version: u64,
        peers: &[NodeId],
        now: u64,
        manifest_ms: u64,
        total_ms: u64,
    ) -> (CheckpointDownload, Vec<DlAction>) {
        let mut d = CheckpointDownload {
            run,
            limits,
            min_version,
            layout,
            answers: BTreeMap::new(),
            phase: Phase::Manifests,
            manifest_deadline: now + manifest_ms,
            deadline: now + total_ms,
        };
        let mut out = Vec::new();
        let mut uniq = BTreeSet::new();
        for p in peers
            .iter()
            .filter(|p| uniq.insert(**p))
            .take(MANIFEST_PEERS)
        {
            d.answers.insert(*p, None);
            out.push(DlAction::Ask {
                peer: *p,
                request: Request::Manifest { min_version },
            });
        }
        if d.answers.len() < 2 {
            d.phase = Phase::Finished;
            out.push(DlAction::Failed {
                reason: format!("{} peer(s) to ask; two must agree", d.answers.len()),
            });
        }
        (d, out)
    }

    pub fn finished(&self) -> bool {
        matches!(self.phase, Phase::Finished)
    }

    /// Bytes downloaded so far would be at most this (the model's size).
    pub fn expected_bytes(&self) -> u64 {
        self.layout
            .iter()
            .map(|(_, s)| s.iter().fold(4u64, |a, &d| a.saturating_mul(d as u64)))
            .sum()
    }

    /// The answer to a request this download asked for. Empty means "not here".
    pub fn on_response(
        &mut self,
        peer: NodeId,
        request: &Request,
        bytes: &[u8],
        now: u64,
    ) -> Vec<DlAction> {
        let mut out = Vec::new();
        match request {
            Request::Manifest { .. } => self.on_manifest(peer, bytes, now, &mut out),
            Request::Chunk { index, .. } => self.on_chunk(peer, *index, bytes, &mut out),
            _ => {}
        }
        self.pump(now, &mut out);
        out
    }

    /// The request failed without an answer (timeout, refused, disconnected).
    pub fn on_failure(&mut self, peer: NodeId, request: &Request, now: u64) -> Vec<DlAction> {
        let mut out = Vec::new();
        match (request, &mut self.phase) {
            (Request::Manifest { .. }, Phase::Manifests) => {
                if let Some(a @ None) = self.answers.get_mut(&peer) {
                    *a = Some(None);
                }
            }
            (
                Request::Chunk { index, .. },
                Phase::Chunks {
                    inflight,
                    out: gone,
                    ..
                },
            ) => {
                if inflight.get(index) == Some(&peer) {
                    inflight.remove(index);
                    gone.insert(peer);
                }
            }
            _ => {}
        }
        self.pump(now, &mut out);
        out
    }

    /// Deadlines.
    pub fn tick(&mut self, now: u64) -> Vec<DlAction> {
        let mut out = Vec::new();
        self.pump(now, &mut out);
        out
    }

    fn on_manifest(&mut self, peer: NodeId, bytes: &[u8], _now: u64, out: &mut Vec<DlAction>) {
        if !matches!(self.phase, Phase::Manifests) || self.answers.get(&peer) != Some(&None) {
            return;
        }
        let verdict = if bytes.is_empty() {
            Ok(None)
        } else {
            self.check_manifest(peer, bytes)
        };
        let got = match verdict {
            Ok(m) => m,
            Err(reason) => {
                out.push(DlAction::Ban { peer, reason });
                None
            }
        };
        self.answers.insert(peer, Some(got));
    }

    /// `Ok(None)`: a harmless non-answer (another run, too old); `Err`: provably wrong.
    fn check_manifest(
        &self,
        peer: NodeId,
        bytes: &[u8],
    ) -> Result<Option<Signed<CheckpointManifest>>, String> {
        let m = match Message::decode(bytes, &self.limits) {
            Ok(Message::Manifest(m)) => m,
            Ok(other) => {
                return Err(format!(
                    "answered a manifest request with {:?}",
                    other.kind()
                ))
            }
            Err(e) if e.penalty() > 0 => return Err(format!("manifest: {e}")),
            Err(_) => return Ok(None),
        };
        if m.body.server != peer {
            return Err("manifest signed by another node".into());
        }
        m.verify().map_err(|e| format!("manifest: {e}"))?;
        let b = &m.body;
        if b.run != self.run || b.version < self.min_version {
            return Ok(None);
        }
        if b.chunk_bytes > self.limits.max_checkpoint_chunk_bytes {
            return Err(format!(
                "signed manifest with {}-byte chunks",
                b.chunk_bytes
            ));
        }
        let fits = b.tensors.len() == self.layout.len()
            && b.tensors.iter().zip(&self.layout).all(|(t, (n, s))| {
                t.name == *n && t.shape == *s && t.dtype == protocol::checkpoint::Dtype::F32
            });
        if !fits {
            return Err("signed manifest whose tensors are not this run's model".into());
        }
        Ok(Some(m))
    }

    fn on_chunk(&mut self, peer: NodeId, index: u32, bytes: &[u8], out: &mut Vec<DlAction>) {
        let Phase::Chunks {
            manifest,
            out: gone,
            chunks,
            inflight,
            ..
        } = &mut self.phase
        else {
            return;
        };
        if inflight.get(&index) != Some(&peer) {
            return;
        }
        inflight.remove(&index);
        if bytes.is_empty() {
            // It no longer holds that version (it moved on): no fault, ask someone else.
            gone.insert(peer);
            return;
        }
        let verdict = match Message::decode(bytes, &self.limits) {
            Ok(Message::Chunk(c)) if c.index == index => manifest
                .verify_chunk(&c)
                .map(|_| c.data)
                .map_err(|e| format!("chunk {index}: {e}")),
            Ok(Message::Chunk(c)) => Err(format!("asked for chunk {index}, sent {}", c.index)),
            Ok(other) => Err(format!("answered a chunk request with {:?}", other.kind())),
            Err(e) => Err(format!("chunk {index}: {e}")),
        };
        match verdict {
            Ok(data) => chunks[index as usize] = Some(data),
            Err(reason) => {
                gone.insert(peer);
                out.push(DlAction::Ban { peer, reason });
            }
        }
    }

    fn fail(&mut self, reason: String, out: &mut Vec<DlAction>) {
        self.phase = Phase::Finished;
        out.push(DlAction::Failed { reason });
    }

    fn pump(&mut self, now: u64, out: &mut Vec<DlAction>) {
        if self.finished() {
            return;
        }
        if now >= self.deadline {
            return self.fail("timed out".into(), out);
        }
        if matches!(self.phase, Phase::Manifests) {
            let pending = self.answers.values().any(|a| a.is_none());
            if pending && now < self.manifest_deadline {
                return;
            }
            self.choose(out);
            if self.finished() {
                return;
            }
        }
        let Phase::Chunks {
            manifest,
            servers,
            out: gone,
            chunks,
            inflight,
            next,
        } = &mut self.phase
        else {
            return;
        };
        let live: Vec<NodeId> = servers
            .iter()
            .filter(|s| !gone.contains(s))
            .copied()
            .collect();
        if chunks.iter().all(|c| c.is_some()) {
            let stream: Vec<u8> = chunks
                .iter_mut()
                .flat_map(|c| c.take().unwrap_or_default())
                .collect();
            let (manifest, servers) = (manifest.clone(), servers.clone());
            let mut tensors = Vec::with_capacity(manifest.tensors.len());
            let mut off = 0usize;
            for t in &manifest.tensors {
                let n = t.byte_len() as usize;
                let b = stream[off..off + n].to_vec();
                off += n;
                if crypto::Digest::of(&b) != t.hash {
                    // Every chunk matched the chunk hashes these servers signed, so the manifest
                    // they signed contradicts itself: each of them is at fault.
                    for s in &servers {
                        out.push(DlAction::Ban {
                            peer: *s,
                            reason: format!(
                                "signed manifest: tensor {} does not match its chunks",
                                t.name
                            ),
                        });
                    }
                    return self.fail("manifest does not match its chunks".into(), out);
                }
                tensors.push(b);
            }
            let dissenters = self
                .answers
                .iter()
                .filter_map(|(p, a)| {
                    let m = a.as_ref()?.as_ref()?;
                    (m.body.version == manifest.version && m.body.digest != manifest.digest)
                        .then_some(*p)
                })
                .collect();
            self.phase = Phase::Finished;
            out.push(DlAction::Done {
                version: manifest.version,
                digest: manifest.digest,
                tensors,
                servers,
                dissenters,
            });
            return;
        }
        if live.is_empty() {
            return self.fail("every server refused, failed or lied".into(), out);
        }
        let mut load: BTreeMap<NodeId, usize> = BTreeMap::new();
        for s in inflight.values() {
            *load.entry(*s).or_default() += 1;
        }
        for i in 0..chunks.len() as u32 {
            if inflight.len() >= MAX_CHUNKS_INFLIGHT {
                break;
            }
            if chunks[i as usize].is_some() || inflight.contains_key(&i) {
                continue;
            }
            // Round robin over the servers with room: spreads the download across them.
            let Some(peer) = (0..live.len())
                .map(|k| live[(*next + k) % live.len()])
                .find(|s| load.get(s).copied().unwrap_or(0) < MAX_CHUNKS_PER_SERVER)
            else {
                break;
            };
            *next = next.wrapping_add(1);
            *load.entry(peer).or_default() += 1;
            inflight.insert(i, peer);
            out.push(DlAction::Ask {
                peer,
                request: Request::Chunk {
                    version: manifest.version,
                    index: i,
                },
            });
        }
    }

    /// Pick the (version, digest, chunking) at least two peers signed; most signers first,
    /// then the older version (the one the swarm attested longest).
    fn choose(&mut self, out: &mut Vec<DlAction>) {
        let mut groups: BTreeMap<(u64, crypto::Digest, u32, Vec<ContentId>), Vec<NodeId>> =
            BTreeMap::new();
        for (p, a) in &self.answers {
            if let Some(Some(m)) = a {
                let b = &m.body;
                groups
                    .entry((b.version, b.digest, b.chunk_bytes, b.chunks.clone()))
                    .or_default()
                    .push(*p);
            }
        }
        let best = groups
            .into_iter()
            .filter(|(_, v)| v.len() >= 2)
            .max_by(|a, b| a.1.len().cmp(&b.1.len()).then(b.0 .0.cmp(&a.0 .0)));
        let Some((key, servers)) = best else {
            let got = self
                .answers
                .values()
                .filter(|a| matches!(a, Some(Some(_))))
                .count();
            return self.fail(format!("no two of {} manifests agree", got), out);
        };
        let manifest = self.answers[&servers[0]]
            .as_ref()
            .and_then(|a| a.as_ref())
            .expect("a member of the group")
            .body
            .clone();
        debug_assert_eq!(manifest.version, key.0);
        self.phase = Phase::Chunks {
            chunks: vec![None; manifest.chunks.len()],
            manifest,
            servers,
            out: BTreeSet::new(),
            inflight: BTreeMap::new(),
            next: 0,
        };
    }
}

/// The manifest a node serves for a snapshot of its parameters, chunked at `chunk_bytes`.
pub fn build_manifest(
    id: &crypto::Identity,
    run: RunId,
    version: u64,
    chunk_bytes: u32,
    tensors: &[(String, Vec<u32>, Vec<u8>)],
) -> Signed<CheckpointManifest> {
    let views: Vec<(String, Vec<u32>, protocol::checkpoint::Dtype, &[u8])> = tensors
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                s.clone(),
                protocol::checkpoint::Dtype::F32,
                &b[..],
            )
        })
        .collect();
    let m = CheckpointManifest::build(run, version, id.node_id(), chunk_bytes, &views);
    Signed::sign(m, id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limit_refills_and_bounds_its_table() {
        let mut r = RateLimit::new(10.0, 3.0, 2);
        let p = PeerId::random();
        assert!((0..3).all(|_| r.allow(p, 0)));
        assert!(!r.allow(p, 0));
        assert!(r.allow(p, 100));
        let (q, s) = (PeerId::random(), PeerId::random());
        assert!(r.allow(q, 100));
        // Table full of active peers: a third is refused rather than growing the table.
        assert!(!r.allow(s, 100));
        // Much later every bucket is full again and may be forgotten.
        assert!(r.allow(s, 100_000));
    }

    #[test]
    fn requests_round_trip_and_unknown_kinds_are_refused() {
        for r in [
            Request::Frame(vec![1, 2, 3]),
            Request::Blob(ContentId([7; 32])),
        ] {
            assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }
        assert!(Request::decode(&[9, 1]).is_err());
        assert!(Request::decode(&[1, 1, 2]).is_err());
        for r in [
            Request::Manifest { min_version: 7 },
            Request::Chunk {
                version: 9,
                index: 3,
            },
        ] {
            assert_eq!(Request::decode(&r.encode()).unwrap(), r);
            // Fixed lengths: one byte more or less is refused.
            let mut long = r.encode();
            long.push(0);
            assert!(Request::decode(&long).is_err());
            assert!(Request::decode(&long[..long.len() - 2]).is_err());
        }
    }

    // ---- checkpoint download ------------------------------------------------------------

    use crypto::Identity;
    use protocol::checkpoint::CheckpointChunk;

    const CHUNK: u32 = 100;

    fn limits() -> Limits {
        let mut l = Limits::for_blob(8192);
        l.max_checkpoint_chunk_bytes = 4096;
        l
    }

    /// Two tensors, 3·40 + 2·2·4 = 136 bytes: two chunks of 100.
    fn tensors(salt: u8) -> Vec<(String, Vec<u32>, Vec<u8>)> {
        vec![
            (
                "a".into(),
                vec![3, 10],
                (0..120).map(|i| i as u8 ^ salt).collect(),
            ),
            ("b".into(), vec![2, 2], vec![salt; 16]),
        ]
    }

    fn layout() -> Vec<(String, Vec<u32>)> {
        tensors(0).into_iter().map(|(n, s, _)| (n, s)).collect()
    }

    fn stream(t: &[(String, Vec<u32>, Vec<u8>)]) -> Vec<u8> {
        t.iter().flat_map(|(_, _, b)| b.clone()).collect()
    }

    fn chunk_frame(run: RunId, version: u64, index: u32, data: &[u8]) -> Vec<u8> {
        let lo = index as usize * CHUNK as usize;
        let hi = (lo + CHUNK as usize).min(data.len());
        Message::Chunk(CheckpointChunk {
            run,
            version,
            index,
            data: data[lo..hi].to_vec(),
        })
        .encode()
    }

    struct World {
        run: RunId,
        ids: Vec<Identity>,
    }

    impl World {
        fn new(n: usize) -> World {
            World {
                run: crypto::Digest([5; 32]),
                ids: (0..n)
                    .map(|i| Identity::from_seed([i as u8 + 1; 32]))
                    .collect(),
            }
        }
        fn node(&self, i: usize) -> NodeId {
            self.ids[i].node_id()
        }
        fn manifest(&self, i: usize, version: u64, t: &[(String, Vec<u32>, Vec<u8>)]) -> Vec<u8> {
            Message::Manifest(build_manifest(&self.ids[i], self.run, version, CHUNK, t)).encode()
        }
        fn start(&self, peers: &[usize]) -> (CheckpointDownload, Vec<DlAction>) {
            let p: Vec<NodeId> = peers.iter().map(|&i| self.node(i)).collect();
            CheckpointDownload::start(self.run, limits(), layout(), 5, &p, 0, 1000, 10_000)
        }
    }

    fn asks(acts: &[DlAction]) -> Vec<(NodeId, Request)> {
        acts.iter()
            .filter_map(|a| match a {
                DlAction::Ask { peer, request } => Some((*peer, request.clone())),
                _ => None,
            })
            .collect()
    }

    fn bans(acts: &[DlAction]) -> Vec<NodeId> {
        acts.iter()
            .filter_map(|a| match a {
                DlAction::Ban { peer, .. } => Some(*peer),
                _ => None,
            })
            .collect()
    }

    /// Answer every chunk request from `serve(peer) -> stream`, until the download ends.
    fn serve_chunks(
        w: &World,
        d: &mut CheckpointDownload,
        mut acts: Vec<DlAction>,
        version: u64,
        serve: impl Fn(NodeId) -> Vec<u8>,
    ) -> Vec<DlAction> {
        let mut all = Vec::new();
        for _ in 0..100 {
            let q = asks(&acts);
            all.extend(acts.drain(..));
            if q.is_empty() {
                break;
            }
            for (peer, req) in q {
                let Request::Chunk { index, .. } = req else {
                    continue;
                };
                let f = chunk_frame(w.run, version, index, &serve(peer));
                acts.extend(d.on_response(peer, &req, &f, 1));
            }
        }
        all
    }

    #[test]
    fn two_agreeing_servers_share_the_download_and_it_verifies() {
        let w = World::new(3);
        let t = tensors(1);
        let (mut d, acts) = w.start(&[0, 1, 2]);
        assert_eq!(asks(&acts).len(), 3);
        let mut acts = Vec::new();
        for i in 0..3 {
            // Node 2 is a step ahead: the other two agree on version 5.
            let (v, tt) = if i == 2 {
                (6, tensors(9))
            } else {
                (5, t.clone())
            };
            acts = d.on_response(
                w.node(i),
                &Request::Manifest { min_version: 5 },
                &w.manifest(i, v, &tt),
                1,
            );
        }
        let chunk_asks = asks(&acts);
        assert_eq!(chunk_asks.len(), 2, "{acts:?}");
        let servers: BTreeSet<NodeId> = chunk_asks.iter().map(|(p, _)| *p).collect();
        assert_eq!(
            servers,
            BTreeSet::from([w.node(0), w.node(1)]),
            "spread over both"
        );
        let all = serve_chunks(&w, &mut d, acts, 5, |_| stream(&t));
        let done = all.iter().find_map(|a| match a {
            DlAction::Done {
                version,
                digest,
                tensors,
                servers,
                ..
            } => Some((*version, *digest, tensors.clone(), servers.len())),
            _ => None,
        });
        let (v, digest, got, n) = done.expect("done");
        assert_eq!((v, n), (5, 2));
        assert_eq!(got, t.iter().map(|x| x.2.clone()).collect::<Vec<_>>());
        assert_eq!(
            digest,
            CheckpointManifest::build(
                w.run,
                5,
                w.node(0),
                CHUNK,
                &t.iter()
                    .map(|(n, s, b)| (
                        n.clone(),
                        s.clone(),
                        protocol::checkpoint::Dtype::F32,
                        &b[..]
                    ))
                    .collect::<Vec<_>>()
            )
            .digest
        );
        assert!(bans(&all).is_empty());
        assert!(d.finished());
    }

    #[test]
    fn disagreeing_manifests_fail_and_one_peer_is_not_enough() {
        let w = World::new(3);
        let (_, acts) = w.start(&[0]);
        assert!(
            matches!(acts.last(), Some(DlAction::Failed { .. })),
            "{acts:?}"
        );
        let (mut d, _) = w.start(&[0, 1]);
        d.on_response(
            w.node(0),
            &Request::Manifest { min_version: 5 },
            &w.manifest(0, 5, &tensors(1)),
            1,
        );
        let acts = d.on_response(
            w.node(1),
            &Request::Manifest { min_version: 5 },
            &w.manifest(1, 5, &tensors(2)),
            1,
        );
        assert!(
            matches!(acts.last(), Some(DlAction::Failed { .. })),
            "{acts:?}"
        );
        // Different digests are not provable lies by themselves: nobody is banned.
        assert!(bans(&acts).is_empty());
    }

    #[test]
    fn a_bad_chunk_bans_its_server_and_the_other_serves_it() {
        let w = World::new(2);
        let t = tensors(1);
        let (mut d, _) = w.start(&[0, 1]);
        d.on_response(
            w.node(0),
            &Request::Manifest { min_version: 5 },
            &w.manifest(0, 5, &t),
            1,
        );
        let acts = d.on_response(
            w.node(1),
            &Request::Manifest { min_version: 5 },
            &w.manifest(1, 5, &t),
            1,
        );
        let liar = w.node(1);
        let all = serve_chunks(&w, &mut d, acts, 5, |p| {
            let mut s = stream(&t);
            if p == liar {
                s[3] ^= 0xff;
            }
            s
        });
        assert_eq!(bans(&all), vec![liar]);
        assert!(
            all.iter().any(|a| matches!(a, DlAction::Done { .. })),
            "{all:?}"
        );
    }

    #[test]
    fn forged_wrong_model_and_self_contradicting_manifests_are_banned() {
        let w = World::new(4);
        let t = tensors(1);
        let (mut d, _) = w.start(&[0, 1, 2, 3]);
        let m = Request::Manifest { min_version: 5 };
        // 0: signature of another key over 0's manifest.
        let mut forged = build_manifest(&w.ids[0], w.run, 5, CHUNK, &t);
        forged.raw.sig = w.ids[1].sign(
            protocol::wire::domain::CHECKPOINT_MANIFEST,
            &forged.raw.body,
        );
        let a0 = d.on_response(w.node(0), &m, &Message::Manifest(forged).encode(), 1);
        assert_eq!(bans(&a0), vec![w.node(0)]);
        // 1: a validly signed manifest of another model.
        let other = vec![("a".to_string(), vec![4u32], vec![0u8; 16])];
        let a1 = d.on_response(w.node(1), &m, &w.manifest(1, 5, &other), 1);
        assert_eq!(bans(&a1), vec![w.node(1)]);
        // 2 and 3 agree on a manifest whose chunk hashes were computed over other bytes than
        // its tensor hashes: every chunk verifies, the tensors do not.
        let good = build_manifest(&w.ids[2], w.run, 5, CHUNK, &t).body;
        let lie_bytes = tensors(7);
        let lie_chunks = build_manifest(&w.ids[2], w.run, 5, CHUNK, &lie_bytes)
            .body
            .chunks;
        let mut acts = Vec::new();
        for i in [2, 3] {
            let mut b = good.clone();
            b.server = w.node(i);
            b.chunks = lie_chunks.clone();
            acts = d.on_response(
                w.node(i),
                &m,
                &Message::Manifest(Signed::sign(b, &w.ids[i])).encode(),
                1,
            );
        }
        let all = serve_chunks(&w, &mut d, acts, 5, |_| stream(&lie_bytes));
        let mut b = bans(&all);
        b.sort();
        let mut want = vec![w.node(2), w.node(3)];
        want.sort();
        assert_eq!(b, want);
        assert!(
            matches!(all.last(), Some(DlAction::Failed { .. })),
            "{all:?}"
        );
    }

    #[test]
    fn refusals_and_timeouts_end_in_failure_not_a_hang() {
        let w = World::new(2);
        let t = tensors(1);
        let (mut d, _) = w.start(&[0, 1]);
        let m = Request::Manifest { min_version: 5 };
        d.on_response(w.node(0), &m, &w.manifest(0, 5, &t), 1);
        let acts = d.on_response(w.node(1), &m, &w.manifest(1, 5, &t), 1);
        // Both servers moved on and no longer hold version 5.
        let mut acts = acts;
        for _ in 0..4 {
            let q = asks(&acts);
            acts.clear();
            for (p, r) in q {
                acts.extend(d.on_response(p, &r, &[], 2));
            }
        }
        assert!(d.finished());
        // A silent peer: the manifest deadline decides with what came in, then the total one.
        let (mut d, _) = w.start(&[0, 1]);
        d.on_response(w.node(0), &m, &w.manifest(0, 5, &t), 1);
        assert!(d.tick(500).is_empty());
        let acts = d.tick(1000);
        assert!(
            matches!(acts.last(), Some(DlAction::Failed { .. })),
            "{acts:?}"
        );
        let (mut d, _) = w.start(&[0, 1]);
        d.on_response(w.node(0), &m, &w.manifest(0, 5, &t), 1);
        d.on_response(w.node(1), &m, &w.manifest(1, 5, &t), 1);
        let acts = d.tick(10_000);
        assert!(
            matches!(acts.last(), Some(DlAction::Failed { .. })),
            "{acts:?}"
        );
        let _ = bans(&acts);
    }
}
