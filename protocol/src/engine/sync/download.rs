//! Checkpoint transfer and direct requests, sans I/O: the request a peer sends another over
//! request-response (a direct frame, a blob, a checkpoint manifest or chunk) and
//! [`CheckpointDownload`], the joiner's side of a checkpoint transfer as a plain state machine
//! (no I/O, no clock of its own). Manifests from several peers must agree on (version,
//! digest), chunks are spread across the agreeing peers and verified one by one, and a peer
//! that served something provably wrong is named for a ban. Every way a server can fail or lie
//! is tested here without a network. The engine (`engine::sync`) drives one download at a time
//! on its own clock; the shell (`swarm run`, the simulator) only moves the bytes.

use std::collections::{BTreeMap, BTreeSet};

use crypto::{ContentId, NodeId};
use thiserror::Error;

use crate::checkpoint::{CheckpointChunk, CheckpointManifest};
use crate::error::{DecodeError, Offence};
use crate::run::{Limits, RunId};
use crate::wire::{Message, Signed};

mod request;
pub use request::{Request, UnknownRequest};

/// Peers asked for a manifest at once: two must agree, a third and fourth cover a slow or
/// lying one.
pub const MANIFEST_PEERS: usize = 4;
/// Chunk requests in flight per download, and per server.
pub const MAX_CHUNKS_INFLIGHT: usize = 8;
const MAX_CHUNKS_PER_SERVER: usize = 4;

/// Something provably wrong a checkpoint server sent: its signature (or the request it
/// answers) makes it the server's fault, and it is banned for it.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum Fault {
    #[error("answered a manifest request with message kind {0}")]
    NotAManifest(u8),
    #[error("manifest: {0}")]
    Manifest(Offence),
    #[error("manifest signed by another node")]
    ForeignManifest,
    #[error("signed manifest with {0}-byte chunks")]
    OversizeChunks(u32),
    #[error("signed manifest whose tensors are not this run's model")]
    WrongModel,
    #[error("answered a chunk request with message kind {0}")]
    NotAChunk(u8),
    #[error("asked for chunk {asked}, sent {sent}")]
    WrongChunk { asked: u32, sent: u32 },
    #[error("chunk {index}: {error}")]
    Chunk { index: u32, error: Offence },
    #[error("signed manifest: tensor {0} does not match its chunks")]
    TensorMismatch(String),
}

/// Why a download ended without a checkpoint (nobody's fault by itself).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum Failure {
    #[error("{0} peer(s) to ask; two must agree")]
    TooFewPeers(usize),
    #[error("timed out")]
    TimedOut,
    #[error("no two of {0} manifests agree")]
    NoAgreement(usize),
    #[error("every server refused, failed or lied")]
    NoServers,
    #[error("manifest does not match its chunks")]
    ManifestMismatch,
    /// The trainer did not load the verified tensors, or computed another digest for them.
    #[error("the checkpoint did not load as its manifest says")]
    NotLoaded,
}

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
        reason: Fault,
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
        reason: Failure,
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
                reason: Failure::TooFewPeers(d.answers.len()),
            });
        }
        (d, out)
    }

    pub fn finished(&self) -> bool {
        matches!(self.phase, Phase::Finished)
    }

    /// When [`CheckpointDownload::tick`] has something to decide next (unix ms), if ever.
    pub fn next_deadline(&self) -> Option<u64> {
        match self.phase {
            Phase::Finished => None,
            Phase::Manifests => Some(self.manifest_deadline.min(self.deadline)),
            Phase::Chunks { .. } => Some(self.deadline),
        }
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
    ) -> Result<Option<Signed<CheckpointManifest>>, Fault> {
        let m = match Message::decode(bytes, &self.limits) {
            Ok(Message::Manifest(m)) => m,
            Ok(other) => return Err(Fault::NotAManifest(other.kind())),
            // Another wire version is a non-answer, not a lie.
            Err(DecodeError::UnknownVersion(_)) => return Ok(None),
            Err(e) => return Err(Fault::Manifest(e.into())),
        };
        if m.body.server != peer {
            return Err(Fault::ForeignManifest);
        }
        m.verify().map_err(Fault::Manifest)?;
        let b = &m.body;
        if b.run != self.run || b.version < self.min_version {
            return Ok(None);
        }
        if b.chunk_bytes > self.limits.max_checkpoint_chunk_bytes {
            return Err(Fault::OversizeChunks(b.chunk_bytes));
        }
        let fits = b.tensors.len() == self.layout.len()
            && b.tensors.iter().zip(&self.layout).all(|(t, (n, s))| {
                t.name == *n && t.shape == *s && t.dtype == crate::checkpoint::Dtype::F32
            });
        if !fits {
            return Err(Fault::WrongModel);
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
                .map_err(|error| Fault::Chunk { index, error }),
            Ok(Message::Chunk(c)) => Err(Fault::WrongChunk {
                asked: index,
                sent: c.index,
            }),
            Ok(other) => Err(Fault::NotAChunk(other.kind())),
            Err(e) => Err(Fault::Chunk {
                index,
                error: e.into(),
            }),
        };
        match verdict {
            Ok(data) => chunks[index as usize] = Some(data),
            Err(reason) => {
                gone.insert(peer);
                out.push(DlAction::Ban { peer, reason });
            }
        }
    }

    fn fail(&mut self, reason: Failure, out: &mut Vec<DlAction>) {
        self.phase = Phase::Finished;
        out.push(DlAction::Failed { reason });
    }

    fn pump(&mut self, now: u64, out: &mut Vec<DlAction>) {
        if self.finished() {
            return;
        }
        if now >= self.deadline {
            return self.fail(Failure::TimedOut, out);
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
                            reason: Fault::TensorMismatch(t.name.clone()),
                        });
                    }
                    return self.fail(Failure::ManifestMismatch, out);
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
            return self.fail(Failure::NoServers, out);
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
            return self.fail(Failure::NoAgreement(got), out);
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
    let views: Vec<(String, Vec<u32>, crate::checkpoint::Dtype, &[u8])> = tensors
        .iter()
        .map(|(n, s, b)| (n.clone(), s.clone(), crate::checkpoint::Dtype::F32, &b[..]))
        .collect();
    let m = CheckpointManifest::build(run, version, id.node_id(), chunk_bytes, &views);
    Signed::sign(m, id)
}

/// Chunk size of served checkpoints: several chunks even for `tiny`, so a download spreads
/// over its servers, and each well inside one request timeout on a slow link (the run's
/// `max_checkpoint_chunk_bytes` caps it).
pub const SERVE_CHUNK_BYTES: u32 = 512 * 1024;

/// The unsigned manifest of a snapshot of a node's parameters, as it serves it (the engine
/// signs it: `Event::Snapshot`). Hashing the bytes is the shell's work; what is served is the
/// engine's decision.
pub fn manifest_of(
    run: RunId,
    limits: &Limits,
    server: NodeId,
    version: u64,
    tensors: &[(String, Vec<u32>, Vec<u8>)],
) -> CheckpointManifest {
    let views: Vec<(String, Vec<u32>, crate::checkpoint::Dtype, &[u8])> = tensors
        .iter()
        .map(|(n, s, b)| (n.clone(), s.clone(), crate::checkpoint::Dtype::F32, &b[..]))
        .collect();
    let chunk = SERVE_CHUNK_BYTES.min(limits.max_checkpoint_chunk_bytes);
    CheckpointManifest::build(run, version, server, chunk, &views)
}

/// The response frame for a chunk request (`Action::ServeChunk`): `data` is the byte range the
/// engine named, read from the snapshot of `version`.
pub fn chunk_frame(run: RunId, version: u64, index: u32, data: Vec<u8>) -> Vec<u8> {
    Message::Chunk(CheckpointChunk {
        run,
        version,
        index,
        data,
    })
    .encode()
}
