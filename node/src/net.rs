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
//! * The requests themselves live in `protocol::download` (re-exported here); what is asked,
//!   answered and believed is the engine's (`protocol::engine::sync`), tested and fuzzed
//!   without a network.

use std::collections::{BTreeMap, HashSet};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use crypto::NodeId;
use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use libp2p::core::transport::MemoryTransport;
use libp2p::core::{upgrade, Transport as _};
use libp2p::gossipsub::{self, MessageAuthenticity, MessageId, TopicHash, ValidationMode};
use libp2p::identity::Keypair;
use libp2p::swarm::NetworkBehaviour;
use libp2p::{
    connection_limits, identify, kad, noise, request_response, tcp, yamux, PeerId, StreamProtocol,
    Swarm,
};
use protocol::run::RunConfig;
use thiserror::Error;

pub use protocol::download::Request;

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
    /// Inbound connections from one IP address (see [`crate::iplimit`]); loopback is exempt
    /// when `exempt_loopback` (local swarms run every node on 127.0.0.1).
    pub max_per_ip: u32,
    pub exempt_loopback: bool,
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

/// Inbound connections one IP address may hold: a few nodes behind one NAT fit, a machine
/// with a hundred keys does not (with two connections per peer: 4 peers).
pub const MAX_PER_IP: u32 = 8;

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
            max_per_ip: MAX_PER_IP,
            exempt_loopback: true,
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
            max_per_ip: MAX_PER_IP,
            exempt_loopback: true,
            mesh: DEFAULT_MESH,
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
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
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
    pub per_ip: crate::iplimit::Behaviour,
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
        per_ip: crate::iplimit::Behaviour::new(cfg.max_per_ip, cfg.exempt_loopback),
        gossipsub,
        identify,
        kad,
        rr,
    })
}

/// Which libp2p transport a node's swarm runs on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Transport {
    /// TCP (noise + yamux) and QUIC: what `swarm run` listens on and dials.
    #[default]
    Network,
    /// libp2p's in-process memory transport (noise + yamux over `/memory/N` addresses), so
    /// that several nodes run in one process (the in-process tests).
    Memory,
}

/// A tokio swarm listening on TCP (noise + yamux) and QUIC, with bandwidth counted into
/// `registry` (the `libp2p_bandwidth` family: bytes after encryption is removed, per direction).
pub fn build_swarm(
    key: Keypair,
    cfg: &NetConfig,
    registry: &mut libp2p::metrics::Registry,
) -> Result<Swarm<Behaviour>, NetError> {
    build_swarm_on(Transport::Network, key, cfg, registry)
}

/// As [`build_swarm`], on the given transport.
pub fn build_swarm_on(
    transport: Transport,
    key: Keypair,
    cfg: &NetConfig,
    registry: &mut libp2p::metrics::Registry,
) -> Result<Swarm<Behaviour>, NetError> {
    let cfg = cfg.clone();
    let behaviour = move |k: &Keypair| {
        build_behaviour(k, &cfg)
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
    };
    let idle = |c: libp2p::swarm::Config| c.with_idle_connection_timeout(Duration::from_secs(120));
    let tokio = libp2p::SwarmBuilder::with_existing_identity(key).with_tokio();
    let swarm = match transport {
        Transport::Network => tokio
            .with_tcp(
                tcp::Config::default().nodelay(true),
                noise::Config::new,
                yamux::Config::default,
            )
            .map_err(|e| NetError::Transport(e.to_string()))?
            .with_quic()
            .with_bandwidth_metrics(registry)
            .with_behaviour(behaviour)
            .map_err(|e| NetError::Transport(e.to_string()))?
            .with_swarm_config(idle)
            .build(),
        Transport::Memory => tokio
            .with_other_transport(|k| {
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(
                    MemoryTransport::default()
                        .upgrade(upgrade::Version::V1)
                        .authenticate(noise::Config::new(k)?)
                        .multiplex(yamux::Config::default()),
                )
            })
            .map_err(|e| NetError::Transport(e.to_string()))?
            .with_bandwidth_metrics(registry)
            .with_behaviour(behaviour)
            .map_err(|e| NetError::Transport(e.to_string()))?
            .with_swarm_config(idle)
            .build(),
    };
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
}
