//! Checkpoint transfer and direct requests, sans I/O: the request a peer sends another over
//! request-response (a direct frame, a blob, a checkpoint manifest or chunk) and
//! [`CheckpointDownload`], the joiner's side of a checkpoint transfer as a plain state machine
//! (no I/O, no clock of its own). Manifests from several peers must agree on (version,
//! digest), chunks are spread across the agreeing peers and verified one by one, and a peer
//! that served something provably wrong is named for a ban. Every way a server can fail or lie
//! is tested here without a network; the shell (`node::net`, `swarm run`) moves the bytes.

use std::collections::{BTreeMap, BTreeSet};

use crypto::{ContentId, NodeId};
use thiserror::Error;

use crate::checkpoint::CheckpointManifest;
use crate::error::DecodeError;
use crate::run::{Limits, RunId};
use crate::wire::{Message, Signed};

/// A request of unknown kind or of the wrong length for its kind.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("unknown request")]
pub struct UnknownRequest;

/// A request on the shell's request-response protocol (`/swarm/req/1`).
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
    /// Decode a request (the shell has already capped its length). Each kind has a fixed
    /// length but `Frame`, whose contents the engine decodes with its own caps.
    pub fn decode(b: &[u8]) -> Result<Request, UnknownRequest> {
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
            _ => Err(UnknownRequest),
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
            // Another wire version is a non-answer, not a lie.
            Err(DecodeError::UnknownVersion(_)) => return Ok(None),
            Err(e) => return Err(format!("manifest: {e}")),
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
                t.name == *n && t.shape == *s && t.dtype == crate::checkpoint::Dtype::F32
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
    let views: Vec<(String, Vec<u32>, crate::checkpoint::Dtype, &[u8])> = tensors
        .iter()
        .map(|(n, s, b)| (n.clone(), s.clone(), crate::checkpoint::Dtype::F32, &b[..]))
        .collect();
    let m = CheckpointManifest::build(run, version, id.node_id(), chunk_bytes, &views);
    Signed::sign(m, id)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    use crate::checkpoint::CheckpointChunk;
    use crypto::Identity;

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
                    .map(|(n, s, b)| (n.clone(), s.clone(), crate::checkpoint::Dtype::F32, &b[..]))
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
        forged.raw.sig = w.ids[1].sign(crate::wire::domain::CHECKPOINT_MANIFEST, &forged.raw.body);
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
