//! The wire format: every message, its signature rule, and the one codec that turns bytes into
//! messages. See docs/PROTOCOL.md for the bytes.
//!
//! A frame is `version (1 byte) ‖ kind (1 byte) ‖ CBOR body`. Decoding untrusted bytes goes, in
//! order: size against the run's limit for that kind → structural CBOR pre-check (bounded
//! allocation) → serde decode → canonical re-encoding must reproduce the bytes exactly (one
//! content, one byte string, one content id) → count and ordering bounds. Signatures are checked
//! separately ([`Signed::verify`]) so that the engine can discard messages of another run or of
//! a step outside its window before spending a signature check on them.

use crypto::{ContentId, Digest, Domain, Identity, NodeId, Signature};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::cbor::precheck;
use crate::checkpoint::{CheckpointChunk, CheckpointManifest};
use crate::config::ValueCodec;
use crate::error::{CborError, DecodeError, Offence};
use crate::run::{Limits, RunConfig, RunId};
use crate::sparse::{Layout, SparseUpdate};

/// First byte of every frame.
pub const WIRE_VERSION: u8 = 1;
/// The protocol version a node announces in [`Hello`]. 2: update blob ids are bound to their
/// sender and step ([`UpdateHeader::blob_id`]); version-1 nodes named a blob by its plain
/// blake3 and would refuse every blob of a version-2 node.
pub const PROTOCOL_VERSION: u32 = 2;

/// Signature domains, one per signed message kind and version.
pub mod domain {
    use crypto::Domain;
    pub const UPDATE_HEADER: Domain = Domain::new("swarm/update-header/v1");
    pub const STEP_SUMMARY: Domain = Domain::new("swarm/step-summary/v1");
    pub const CHECKPOINT_MANIFEST: Domain = Domain::new("swarm/checkpoint-manifest/v1");
    pub const ACCUSATION: Domain = Domain::new("swarm/accusation/v1");
}

/// Frame kinds (the second byte).
pub mod kind {
    pub const HELLO: u8 = 1;
    pub const ANNOUNCE: u8 = 2;
    pub const SUMMARY: u8 = 3;
    pub const EQUIVOCATION: u8 = 4;
    pub const UPDATE: u8 = 5;
    pub const MANIFEST: u8 = 6;
    pub const CHUNK: u8 = 7;
    pub const ACCUSATION: u8 = 8;
    pub const SUMMARY_EQUIVOCATION: u8 = 9;
}

/// Capability bits in [`Hello`].
pub mod caps {
    /// Trains and publishes updates.
    pub const TRAIN: u64 = 1;
    /// Serves update blobs by id.
    pub const SERVE_BLOBS: u64 = 2;
    /// Serves checkpoints.
    pub const SERVE_CHECKPOINTS: u64 = 4;
    /// A first hop (`swarm bootstrap --relay`): takes `Message::Update` uploads sent to it
    /// directly by their signers, verifies them, gossips their headers and serves their
    /// blobs, so that a node on a slow uplink uploads each update once.
    pub const RELAY: u64 = 8;
}

// ---------------------------------------------------------------------------------------------
// message bodies

/// The small signed announcement of one node's update for one step. The blob travels apart
/// (inline when small, else fetched by id), so a header can be checked, relayed and kept as
/// evidence without the megabytes behind it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateHeader {
    pub run: RunId,
    pub step: u64,
    pub sender: NodeId,
    /// The blob's id, [`UpdateHeader::blob_id`] of the sender, the step and the blob (the
    /// CBOR-encoded [`SparseUpdate`]).
    pub blob: ContentId,
    pub blob_len: u64,
    pub codec: ValueCodec,
    pub topk: u32,
    pub chunk: u32,
    /// Tokens the sender trained on for this update.
    pub tokens: u64,
    /// The parameters the update was computed on: version (steps applied) and their digest.
    pub base_version: u64,
    pub base_digest: Digest,
    /// Identity proof of work for runs that require it (`crypto::pow`); absent when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pow: u64,
}

impl UpdateHeader {
    /// Context string of [`UpdateHeader::blob_id`] (blake3 key derivation).
    pub const BLOB_ID_CONTEXT: &'static str = "swarm 2026 update blob id v1";

    /// The id a header must name for `blob`: blake3 (key-derivation mode) of the sender's
    /// public key, the step (u64 little-endian) and the blob. Binding the id to its sender
    /// means that a key re-signing an honest header's id, whatever length and token count it
    /// states, names bytes that are not its own: the bytes themselves prove it (they hash to
    /// the id only under the honest sender), so every node that sees them resolves the claim
    /// the same way. Binding the step keeps a blob from being replayed into another step.
    pub fn blob_id(sender: &NodeId, step: u64, blob: &[u8]) -> ContentId {
        ContentId::derived(
            Self::BLOB_ID_CONTEXT,
            &[sender.as_bytes(), &step.to_le_bytes(), blob],
        )
    }

    /// Whether `blob` is the blob this header names.
    pub fn names(&self, blob: &[u8]) -> bool {
        Self::blob_id(&self.sender, self.step, blob) == self.blob
    }
}

/// What a node holds for step `step` when that step's publish deadline passes, and where its
/// parameters stand. Every node applies the union of the summaries it received (see the engine).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepSummary {
    pub run: RunId,
    pub step: u64,
    pub sender: NodeId,
    /// Blob ids of the valid updates held for `step`, strictly ascending.
    pub updates: Vec<ContentId>,
    /// The sender's parameter version (steps applied) and digest when it sent this.
    pub params_version: u64,
    pub params_digest: Digest,
    /// Identity proof of work, as in [`UpdateHeader::pow`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pow: u64,
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

/// Sent once on each new connection. Not signed: the transport (libp2p noise) already
/// authenticates the peer, and the engine checks that `node` is that peer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub version: u32,
    pub run: RunId,
    pub node: NodeId,
    pub capabilities: u64,
    pub listen: Vec<String>,
    pub params_version: u64,
    pub params_digest: Digest,
}

/// A message body that is signed by one of the nodes it names.
pub trait SignedBody: Serialize + DeserializeOwned + Clone {
    const DOMAIN: Domain;
    const WHAT: &'static str;
    fn signer(&self) -> NodeId;
}

impl SignedBody for UpdateHeader {
    const DOMAIN: Domain = domain::UPDATE_HEADER;
    const WHAT: &'static str = "update header";
    fn signer(&self) -> NodeId {
        self.sender
    }
}

impl SignedBody for StepSummary {
    const DOMAIN: Domain = domain::STEP_SUMMARY;
    const WHAT: &'static str = "step summary";
    fn signer(&self) -> NodeId {
        self.sender
    }
}

/// "My spot check of `accused`'s update for `step` (blob `blob`) failed": a pointer, not a
/// proof. Batches are recomputable, so a receiver that holds the update checks it itself (see
/// `Defence::accuse`), which brings detection from several steps down to about one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accusation {
    pub run: RunId,
    pub step: u64,
    pub accuser: NodeId,
    pub accused: NodeId,
    pub blob: ContentId,
}

impl SignedBody for Accusation {
    const DOMAIN: Domain = domain::ACCUSATION;
    const WHAT: &'static str = "accusation";
    fn signer(&self) -> NodeId {
        self.accuser
    }
}

impl SignedBody for CheckpointManifest {
    const DOMAIN: Domain = domain::CHECKPOINT_MANIFEST;
    const WHAT: &'static str = "checkpoint manifest";
    fn signer(&self) -> NodeId {
        self.server
    }
}

/// The wire form of anything signed: the exact body bytes and the signature over them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignedBytes {
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
    pub sig: Signature,
}

/// A decoded signed message, with the bytes it was decoded from (the signature covers those).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signed<T> {
    pub body: T,
    pub raw: SignedBytes,
}

impl<T: SignedBody> Signed<T> {
    /// Encode and sign `body` with `id` (which must be the body's signer).
    pub fn sign(body: T, id: &Identity) -> Signed<T> {
        debug_assert_eq!(
            body.signer(),
            id.node_id(),
            "signing a body that names another signer"
        );
        let bytes = to_cbor(&body);
        let sig = id.sign(T::DOMAIN, &bytes);
        Signed {
            body,
            raw: SignedBytes { body: bytes, sig },
        }
    }

    /// Decode the body of `raw` (size-checked, canonical). Does not check the signature.
    pub fn from_raw(raw: SignedBytes, max_body: usize) -> Result<Signed<T>, DecodeError> {
        let body = decode_cbor::<T>(&raw.body, max_body, T::WHAT)?;
        Ok(Signed { body, raw })
    }

    /// Strictly verify the signature against the signer named in the body.
    pub fn verify(&self) -> Result<(), Offence> {
        self.body
            .signer()
            .verify(T::DOMAIN, &self.raw.body, &self.raw.sig)
            .map_err(|e| match e {
                crypto::CryptoError::BadSignature => Offence::BadSignature { what: T::WHAT },
                _ => Offence::BadKey { what: T::WHAT },
            })
    }

    /// Content id of the signed body bytes.
    pub fn id(&self) -> ContentId {
        ContentId::of(&self.raw.body)
    }
}

/// Two different validly signed update headers from one sender for one step: anyone can check
/// it, nobody but the key holder can make one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EquivocationProof {
    /// `a.raw.body < b.raw.body` bytewise, so that one pair has one proof.
    pub a: Signed<UpdateHeader>,
    pub b: Signed<UpdateHeader>,
}

impl EquivocationProof {
    pub fn new(x: Signed<UpdateHeader>, y: Signed<UpdateHeader>) -> EquivocationProof {
        if x.raw.body <= y.raw.body {
            EquivocationProof { a: x, b: y }
        } else {
            EquivocationProof { a: y, b: x }
        }
    }

    /// Check the proof for `run`; on success, who equivocated and at which step.
    pub fn verify(&self, run: &RunId) -> Result<(NodeId, u64), Offence> {
        let (a, b) = (&self.a.body, &self.b.body);
        if a.run != *run || b.run != *run {
            return Err(Offence::WrongRun);
        }
        if a.sender != b.sender {
            return Err(Offence::BadProof("different senders"));
        }
        if a.step != b.step {
            return Err(Offence::BadProof("different steps"));
        }
        if self.a.raw.body >= self.b.raw.body {
            return Err(Offence::BadProof("headers identical or out of order"));
        }
        self.a.verify()?;
        self.b.verify()?;
        Ok((a.sender, a.step))
    }
}

/// Two different validly signed step summaries from one sender for one step: the summary
/// counterpart of [`EquivocationProof`]. One key telling half the swarm one set and the other
/// half another would make the halves apply different sets; with this proof every node drops
/// that sender's summary and updates for the step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SummaryEquivocation {
    /// `a.raw.body < b.raw.body` bytewise, so that one pair has one proof.
    pub a: Signed<StepSummary>,
    pub b: Signed<StepSummary>,
}

impl SummaryEquivocation {
    pub fn new(x: Signed<StepSummary>, y: Signed<StepSummary>) -> SummaryEquivocation {
        if x.raw.body <= y.raw.body {
            SummaryEquivocation { a: x, b: y }
        } else {
            SummaryEquivocation { a: y, b: x }
        }
    }

    /// The sender and step, from the bodies alone (no signature check): what the engine looks
    /// at before spending two signature checks on a proof it may not need.
    pub fn claims(&self) -> Result<(NodeId, u64), Offence> {
        let (a, b) = (&self.a.body, &self.b.body);
        if a.sender != b.sender {
            return Err(Offence::BadProof("different senders"));
        }
        if a.step != b.step {
            return Err(Offence::BadProof("different steps"));
        }
        if self.a.raw.body >= self.b.raw.body {
            return Err(Offence::BadProof("summaries identical or out of order"));
        }
        Ok((a.sender, a.step))
    }

    /// Check the proof for `run`; on success, who equivocated and at which step.
    pub fn verify(&self, run: &RunId) -> Result<(NodeId, u64), Offence> {
        if self.a.body.run != *run || self.b.body.run != *run {
            return Err(Offence::WrongRun);
        }
        let who = self.claims()?;
        self.a.verify()?;
        self.b.verify()?;
        Ok(who)
    }
}

/// A decoded frame.
// Decoded messages are short-lived and handled one at a time; boxing the headers would only
// add allocations.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq)]
pub enum Message {
    Hello(Hello),
    /// Gossip: a header, with the blob inline when it is at most `inline_blob_bytes`.
    Announce {
        header: Signed<UpdateHeader>,
        blob: Option<Vec<u8>>,
    },
    Summary(Signed<StepSummary>),
    Equivocation(EquivocationProof),
    /// A fetch response: a header and its blob.
    Update {
        header: Signed<UpdateHeader>,
        blob: Vec<u8>,
    },
    Manifest(Signed<CheckpointManifest>),
    Chunk(CheckpointChunk),
    /// Gossip: a failed spot check, for others to repeat.
    Accusation(Signed<Accusation>),
    /// Gossip: proof that a sender signed two summaries for one step.
    SummaryEquivocation(SummaryEquivocation),
}

// Wire shapes of the frames that contain signed parts.
#[derive(Serialize, Deserialize)]
struct AnnounceWire {
    header: SignedBytes,
    #[serde(with = "serde_bytes")]
    blob: Option<Vec<u8>>,
}
#[derive(Serialize, Deserialize)]
struct UpdateWire {
    header: SignedBytes,
    #[serde(with = "serde_bytes")]
    blob: Vec<u8>,
}
#[derive(Serialize, Deserialize)]
struct EquivocationWire {
    a: SignedBytes,
    b: SignedBytes,
}

// ---------------------------------------------------------------------------------------------
// codec

/// Canonical CBOR of plain data.
pub fn to_cbor<T: Serialize>(v: &T) -> Vec<u8> {
    serde_cbor::to_vec(v).expect("plain data always serializes")
}

/// Decode one CBOR item of untrusted bytes: size, structure, serde, canonical form.
pub fn decode_cbor<T: Serialize + DeserializeOwned>(
    b: &[u8],
    max: usize,
    what: &'static str,
) -> Result<T, DecodeError> {
    if b.len() > max {
        return Err(DecodeError::Oversize {
            what,
            len: b.len(),
            max,
        });
    }
    precheck(b).map_err(|e| DecodeError::Malformed {
        what,
        reason: CborError::Structure(e),
    })?;
    let v: T = serde_cbor::from_slice(b).map_err(|e| DecodeError::Malformed {
        what,
        reason: CborError::Serde(e.to_string()),
    })?;
    if to_cbor(&v) != b {
        return Err(DecodeError::NonCanonical(what));
    }
    Ok(v)
}

fn frame(kind: u8, body: Vec<u8>) -> Vec<u8> {
    let mut f = Vec::with_capacity(body.len() + 2);
    f.push(WIRE_VERSION);
    f.push(kind);
    f.extend_from_slice(&body);
    f
}

/// Framing overhead allowed on top of a blob or chunk (CBOR heads, the header, field names).
const FRAME_SLACK: usize = 256;

impl Message {
    pub fn kind(&self) -> u8 {
        match self {
            Message::Hello(_) => kind::HELLO,
            Message::Announce { .. } => kind::ANNOUNCE,
            Message::Summary(_) => kind::SUMMARY,
            Message::Equivocation(_) => kind::EQUIVOCATION,
            Message::Update { .. } => kind::UPDATE,
            Message::Manifest(_) => kind::MANIFEST,
            Message::Chunk(_) => kind::CHUNK,
            Message::Accusation(_) => kind::ACCUSATION,
            Message::SummaryEquivocation(_) => kind::SUMMARY_EQUIVOCATION,
        }
    }

    /// The frame bytes.
    pub fn encode(&self) -> Vec<u8> {
        let body = match self {
            Message::Hello(h) => to_cbor(h),
            Message::Announce { header, blob } => to_cbor(&AnnounceWire {
                header: header.raw.clone(),
                blob: blob.clone(),
            }),
            Message::Summary(s) => to_cbor(&s.raw),
            Message::Equivocation(p) => to_cbor(&EquivocationWire {
                a: p.a.raw.clone(),
                b: p.b.raw.clone(),
            }),
            Message::Update { header, blob } => to_cbor(&UpdateWire {
                header: header.raw.clone(),
                blob: blob.clone(),
            }),
            Message::Manifest(m) => to_cbor(&m.raw),
            Message::Chunk(c) => to_cbor(c),
            Message::Accusation(a) => to_cbor(&a.raw),
            Message::SummaryEquivocation(p) => to_cbor(&EquivocationWire {
                a: p.a.raw.clone(),
                b: p.b.raw.clone(),
            }),
        };
        frame(self.kind(), body)
    }

    /// The largest frame of `kind` that `limits` allow.
    pub fn max_frame(kind: u8, l: &Limits) -> usize {
        match kind {
            kind::UPDATE => (l.max_blob_bytes as usize)
                .saturating_add(l.max_header_bytes as usize + FRAME_SLACK),
            kind::MANIFEST => (l.max_manifest_bytes as usize).saturating_add(FRAME_SLACK),
            kind::CHUNK => (l.max_checkpoint_chunk_bytes as usize).saturating_add(FRAME_SLACK),
            _ => l.max_message_bytes as usize,
        }
    }

    /// Decode an untrusted frame. Never panics; allocates at most a small multiple of
    /// `bytes.len()`, which is bounded by the run's limit for the frame's kind before anything
    /// is parsed.
    pub fn decode(bytes: &[u8], l: &Limits) -> Result<Message, DecodeError> {
        if bytes.len() < 2 {
            return Err(DecodeError::Truncated);
        }
        if bytes[0] != WIRE_VERSION {
            return Err(DecodeError::UnknownVersion(bytes[0]));
        }
        let k = bytes[1];
        if !(kind::HELLO..=kind::SUMMARY_EQUIVOCATION).contains(&k) {
            return Err(DecodeError::UnknownKind(k));
        }
        let max = Message::max_frame(k, l);
        if bytes.len() > max {
            return Err(DecodeError::Oversize {
                what: "frame",
                len: bytes.len(),
                max,
            });
        }
        let body = &bytes[2..];
        let hb = l.max_header_bytes as usize;
        let msg = match k {
            kind::HELLO => {
                let h: Hello = decode_cbor(body, max, "hello")?;
                bound(
                    "listen addresses",
                    h.listen.len(),
                    l.max_listen_addrs as usize,
                )?;
                if let Some(a) = h.listen.iter().find(|a| a.len() > l.max_addr_len as usize) {
                    return Err(DecodeError::Oversize {
                        what: "listen address",
                        len: a.len(),
                        max: l.max_addr_len as usize,
                    });
                }
                Message::Hello(h)
            }
            kind::ANNOUNCE => {
                let w: AnnounceWire = decode_cbor(body, max, "announce")?;
                if let Some(b) = &w.blob {
                    bound_bytes("inline blob", b.len(), l.inline_blob_bytes as usize)?;
                }
                Message::Announce {
                    header: Signed::from_raw(w.header, hb)?,
                    blob: w.blob,
                }
            }
            kind::SUMMARY => {
                let raw: SignedBytes = decode_cbor(body, max, "summary")?;
                Message::Summary(summary(raw, max, l)?)
            }
            kind::EQUIVOCATION => {
                let w: EquivocationWire = decode_cbor(body, max, "equivocation proof")?;
                Message::Equivocation(EquivocationProof {
                    a: Signed::from_raw(w.a, hb)?,
                    b: Signed::from_raw(w.b, hb)?,
                })
            }
            kind::UPDATE => {
                let w: UpdateWire = decode_cbor(body, max, "update")?;
                bound_bytes("blob", w.blob.len(), l.max_blob_bytes as usize)?;
                Message::Update {
                    header: Signed::from_raw(w.header, hb)?,
                    blob: w.blob,
                }
            }
            kind::MANIFEST => {
                let raw: SignedBytes = decode_cbor(body, max, "manifest")?;
                let m: Signed<CheckpointManifest> = Signed::from_raw(raw, max)?;
                m.body.check_structure()?;
                Message::Manifest(m)
            }
            kind::CHUNK => {
                let c: CheckpointChunk = decode_cbor(body, max, "checkpoint chunk")?;
                bound_bytes(
                    "checkpoint chunk",
                    c.data.len(),
                    l.max_checkpoint_chunk_bytes as usize,
                )?;
                Message::Chunk(c)
            }
            kind::ACCUSATION => {
                let raw: SignedBytes = decode_cbor(body, max, "accusation")?;
                Message::Accusation(Signed::from_raw(raw, hb)?)
            }
            kind::SUMMARY_EQUIVOCATION => {
                let w: EquivocationWire = decode_cbor(body, max, "summary equivocation proof")?;
                Message::SummaryEquivocation(SummaryEquivocation {
                    a: summary(w.a, max, l)?,
                    b: summary(w.b, max, l)?,
                })
            }
            _ => unreachable!("kind range checked above"),
        };
        Ok(msg)
    }
}

/// A signed summary's body, decoded and bounded as in a `Summary` frame.
fn summary(raw: SignedBytes, max: usize, l: &Limits) -> Result<Signed<StepSummary>, DecodeError> {
    let s: Signed<StepSummary> = Signed::from_raw(raw, max)?;
    bound(
        "summary updates",
        s.body.updates.len(),
        l.max_updates_per_step as usize,
    )?;
    ascending("summary updates", &s.body.updates)?;
    Ok(s)
}

fn bound(what: &'static str, n: usize, max: usize) -> Result<(), DecodeError> {
    if n > max {
        return Err(DecodeError::TooMany { what, n, max });
    }
    Ok(())
}

fn bound_bytes(what: &'static str, len: usize, max: usize) -> Result<(), DecodeError> {
    if len > max {
        return Err(DecodeError::Oversize { what, len, max });
    }
    Ok(())
}

pub(crate) fn ascending<T: Ord>(what: &'static str, v: &[T]) -> Result<(), DecodeError> {
    if v.windows(2).any(|w| w[0] >= w[1]) {
        return Err(DecodeError::NotAscending(what));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// validation against the run

/// What an update must satisfy in a given run: header parameters, blob size and id, and the
/// blob's content against the model's layout.
#[derive(Clone, Debug)]
pub struct UpdateRules {
    pub run: RunId,
    pub layout: Layout,
    pub topk: u32,
    pub chunk: u32,
    pub codec: ValueCodec,
    pub max_blob: u64,
    pub pow_bits: u32,
}

impl UpdateRules {
    pub fn new(run: &RunConfig) -> UpdateRules {
        UpdateRules {
            run: run.run_id(),
            layout: run.layout(),
            topk: run.optim.topk,
            chunk: run.optim.chunk,
            codec: run.optim.values,
            max_blob: run.limits.max_blob_bytes,
            pow_bits: run.defence.pow_bits,
        }
    }

    /// Cheap checks of a header's fields against the run (no signature, no blob).
    pub fn check_header(&self, h: &UpdateHeader) -> Result<(), Offence> {
        if h.run != self.run {
            return Err(Offence::WrongRun);
        }
        let mismatch =
            |field, got: u64, want: u64| Err(Offence::HeaderMismatch { field, got, want });
        if h.codec != self.codec {
            return mismatch("codec", h.codec as u64, self.codec as u64);
        }
        if h.topk != self.topk {
            return mismatch("topk", h.topk as u64, self.topk as u64);
        }
        if h.chunk != self.chunk {
            return mismatch("chunk", h.chunk as u64, self.chunk as u64);
        }
        if !crypto::pow::check(&self.run.0, &h.sender, h.pow, self.pow_bits) {
            return Err(Offence::NoWork);
        }
        if h.blob_len > self.max_blob {
            return Err(DecodeError::Oversize {
                what: "blob (declared)",
                len: h.blob_len as usize,
                max: self.max_blob as usize,
            }
            .into());
        }
        Ok(())
    }

    /// Check a blob against its (already checked) header: length, content id, structure,
    /// canonical encoding, and content against the layout. Returns the decoded update.
    pub fn check_blob(&self, h: &UpdateHeader, blob: &[u8]) -> Result<SparseUpdate, Offence> {
        if blob.len() as u64 != h.blob_len {
            return Err(Offence::BlobLength {
                got: blob.len() as u64,
                want: h.blob_len,
            });
        }
        let id = UpdateHeader::blob_id(&h.sender, h.step, blob);
        if id != h.blob {
            return Err(Offence::BlobIdMismatch {
                got: id,
                want: h.blob,
            });
        }
        precheck(blob).map_err(|e| DecodeError::Malformed {
            what: "blob",
            reason: CborError::Structure(e),
        })?;
        let u = SparseUpdate::decode(blob, self.max_blob as usize)?;
        u.validate(&self.layout, self.topk, self.codec)?;
        Ok(u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crypto::Identity;

    fn limits() -> Limits {
        Limits::for_blob(1 << 20)
    }

    fn hello() -> Hello {
        Hello {
            version: 1,
            run: Digest([1; 32]),
            node: NodeId([2; 32]),
            capabilities: 3,
            listen: vec!["/ip4/1.2.3.4/tcp/1".into()],
            params_version: 4,
            params_digest: Digest([5; 32]),
        }
    }

    #[test]
    fn non_canonical_encodings_are_refused() {
        // The packed (integer-keyed) form decodes with serde_cbor but is not ours.
        let packed = serde_cbor::ser::to_vec_packed(&hello()).unwrap();
        assert!(matches!(
            Message::decode(&frame(kind::HELLO, packed), &limits()),
            Err(DecodeError::NonCanonical("hello"))
        ));
        // An unknown extra field.
        let mut v = serde_cbor::value::to_value(hello()).unwrap();
        if let serde_cbor::Value::Map(m) = &mut v {
            m.insert(
                serde_cbor::Value::Text("zzz".into()),
                serde_cbor::Value::Integer(1),
            );
        }
        let extra = serde_cbor::to_vec(&v).unwrap();
        assert!(Message::decode(&frame(kind::HELLO, extra), &limits()).is_err());
        // The canonical one is fine.
        let ok = Message::Hello(hello());
        assert_eq!(Message::decode(&ok.encode(), &limits()).unwrap(), ok);
    }

    #[test]
    fn framing_errors_are_typed() {
        let l = limits();
        assert_eq!(Message::decode(&[1], &l), Err(DecodeError::Truncated));
        assert_eq!(
            Message::decode(&[2, 1, 0], &l),
            Err(DecodeError::UnknownVersion(2))
        );
        assert_eq!(
            Message::decode(&[1, 99, 0], &l),
            Err(DecodeError::UnknownKind(99))
        );
        let big = vec![0u8; l.max_message_bytes as usize + 1];
        let mut f = vec![1, kind::SUMMARY];
        f.extend_from_slice(&big);
        assert!(matches!(
            Message::decode(&f, &l),
            Err(DecodeError::Oversize { what: "frame", .. })
        ));
    }

    #[test]
    fn header_frame_fits_512_bytes_and_summary_order_is_enforced() {
        let id = Identity::from_seed([1; 32]);
        let h = UpdateHeader {
            run: Digest([1; 32]),
            step: u64::MAX,
            sender: id.node_id(),
            blob: ContentId([2; 32]),
            blob_len: u64::MAX,
            codec: ValueCodec::F32,
            topk: u32::MAX,
            chunk: u32::MAX,
            tokens: u64::MAX,
            base_version: u64::MAX,
            base_digest: Digest([3; 32]),
            pow: 0,
        };
        let f = Message::Announce {
            header: Signed::sign(h, &id),
            blob: None,
        }
        .encode();
        assert!(f.len() <= 512, "{}", f.len());
        let s = StepSummary {
            run: Digest([1; 32]),
            step: 1,
            sender: id.node_id(),
            updates: vec![ContentId([9; 32]), ContentId([3; 32])],
            params_version: 0,
            params_digest: Digest([0; 32]),
            pow: 0,
        };
        let f = Message::Summary(Signed::sign(s, &id)).encode();
        assert_eq!(
            Message::decode(&f, &limits()),
            Err(DecodeError::NotAscending("summary updates"))
        );
    }
}
