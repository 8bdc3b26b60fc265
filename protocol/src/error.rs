//! Why a message is refused, in two layers: [`DecodeError`], bytes that do not parse (the
//! frame, its CBOR, its bounds), and [`Offence`], what a peer did, each naming its cause so
//! that the peer at fault can be penalized precisely (and an honest one that merely relayed
//! something late is not). A frame that does not decode is an offence too:
//! [`Offence::Decode`].

use crypto::{ContentId, NodeId};
use thiserror::Error;

use crate::cbor::PrecheckError;
use crate::sparse::SparseError;

/// Bytes that do not parse: a frame, a CBOR item, a blob, or their bounds.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum DecodeError {
    #[error("{what} is {len} bytes, over the limit of {max}")]
    Oversize {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("empty or truncated frame")]
    Truncated,
    #[error("unknown wire version {0}")]
    UnknownVersion(u8),
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("malformed {what}: {reason}")]
    Malformed {
        what: &'static str,
        reason: CborError,
    },
    #[error("{0} is not in canonical encoding")]
    NonCanonical(&'static str),
    #[error("{what}: {n} entries, over the limit of {max}")]
    TooMany {
        what: &'static str,
        n: usize,
        max: usize,
    },
    #[error("{0}: entries not strictly ascending")]
    NotAscending(&'static str),
    /// A signed manifest that contradicts itself (see `CheckpointManifest::check_structure`).
    #[error("checkpoint {0}")]
    Manifest(&'static str),
    #[error("invalid update: {0}")]
    Sparse(#[from] SparseError),
}

/// Why a CBOR item did not parse.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CborError {
    /// Refused by the structural pre-check (`crate::cbor::precheck`), before serde.
    #[error("{0}")]
    Structure(PrecheckError),
    /// Refused by serde: the item is not the expected type (the message is serde_cbor's).
    #[error("{0}")]
    Serde(String),
}

/// What a peer did that got its message refused or ignored, and what that costs it
/// ([`Offence::penalty`]; zero for what an honest peer does too).
#[derive(Debug, Error, Clone, PartialEq)]
pub enum Offence {
    /// The bytes did not parse.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    #[error("message kind {kind} not accepted on this path")]
    UnexpectedKind { kind: u8 },
    #[error("bad signature on {what}")]
    BadSignature { what: &'static str },
    #[error("{what}: signer key is not a valid ed25519 key")]
    BadKey { what: &'static str },
    #[error("message of another run")]
    WrongRun,
    #[error("wire version {got}, this node speaks {want}")]
    VersionMismatch { got: u32, want: u32 },
    #[error("step {step} outside the accepted window [{lo}, {hi}]")]
    StepOutOfWindow { step: u64, lo: u64, hi: u64 },
    #[error("step {step} closed for updates")]
    Late { step: u64 },
    #[error("header {field} is {got}, the run requires {want}")]
    HeaderMismatch {
        field: &'static str,
        got: u64,
        want: u64,
    },
    #[error("blob is {got} bytes, its header says {want}")]
    BlobLength { got: u64, want: u64 },
    #[error("blob hashes to {got:?}, its header names {want:?}")]
    BlobIdMismatch { got: ContentId, want: ContentId },
    #[error("header names blob {blob:?}, which belongs to another sender")]
    ForeignBlob { blob: ContentId },
    #[error("hello from {claimed:?} arrived over the connection of {peer:?}")]
    IdentityMismatch { claimed: NodeId, peer: NodeId },
    #[error("two different signed updates from {sender:?} for step {step}")]
    Equivocation { sender: NodeId, step: u64 },
    #[error("not an equivocation proof: {0}")]
    BadProof(&'static str),
    #[error("signer is banned")]
    Banned,
    #[error("duplicate message")]
    Duplicate,
    #[error("{0} buffer full")]
    BufferFull(&'static str),
    #[error("checkpoint {0}")]
    Checkpoint(&'static str),
    #[error("identity proof of work missing or too weak")]
    NoWork,
    #[error("spot check: the update made its own batch's loss worse")]
    HarmfulUpdate,
    #[error("update copies another peer's update of the same step")]
    Copy,
    #[error("served a checkpoint whose digest the swarm does not attest")]
    FalseCheckpoint,
    /// A checkpoint server sent something provably wrong (see `download::Fault`).
    #[error("bad checkpoint: {0}")]
    BadCheckpoint(Box<crate::download::Fault>),
}

impl From<SparseError> for Offence {
    fn from(e: SparseError) -> Offence {
        Offence::Decode(DecodeError::Sparse(e))
    }
}

impl Offence {
    /// Penalty points for the peer at fault. Provably invalid content costs a lot; what an
    /// honest peer can produce by being slow or by relaying a replay costs little or nothing.
    pub fn penalty(&self) -> u32 {
        use Offence::*;
        match self {
            Equivocation { .. } => 1000,
            BadSignature { .. } | BadKey { .. } | BadProof(_) | IdentityMismatch { .. } => 50,
            // Another wire version is not misconduct; bytes that do not parse are.
            Decode(DecodeError::UnknownVersion(_)) => 0,
            Decode(_) | UnexpectedKind { .. } => 20,
            HeaderMismatch { .. }
            | BlobLength { .. }
            | BlobIdMismatch { .. }
            | ForeignBlob { .. } => 20,
            Checkpoint(_) => 20,
            // Without work the identity is not admitted; a cheap key is no misconduct yet.
            NoWork => 5,
            // Content offences are judged from noisy evidence: the engine accumulates them in
            // its reputation table and bans only persistent offenders (see SECURITY.md).
            HarmfulUpdate | Copy => 10,
            FalseCheckpoint => 1000,
            // Provable, but to this node alone: penalized once, never asked for a checkpoint
            // again, not banned (see `engine::sync::on_download`).
            BadCheckpoint(_) => 20,
            // One step either side is what an honest relay's clock skew (or a message that
            // crossed a step boundary on the way) produces: no misconduct.
            StepOutOfWindow { step, lo, hi }
                if step.saturating_add(1) >= *lo && *step <= hi.saturating_add(1) =>
            {
                0
            }
            StepOutOfWindow { .. } => 2,
            // Another run, another version, late, duplicates and full buffers: not misconduct.
            WrongRun
            | VersionMismatch { .. }
            | Late { .. }
            | Banned
            | Duplicate
            | BufferFull(_) => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The points of every decode error as an offence: 20, but another wire version (0).
    #[test]
    fn decode_penalties() {
        let e = [
            DecodeError::Oversize {
                what: "frame",
                len: 2,
                max: 1,
            },
            DecodeError::Truncated,
            DecodeError::UnknownKind(99),
            DecodeError::Malformed {
                what: "hello",
                reason: CborError::Structure(PrecheckError::Tagged),
            },
            DecodeError::NonCanonical("hello"),
            DecodeError::TooMany {
                what: "x",
                n: 2,
                max: 1,
            },
            DecodeError::NotAscending("x"),
            DecodeError::Manifest("chunk hash"),
            DecodeError::Sparse(SparseError::TensorCount { got: 1, want: 2 }),
        ];
        for d in e {
            assert_eq!(Offence::from(d.clone()).penalty(), 20, "{d}");
        }
        assert_eq!(Offence::from(DecodeError::UnknownVersion(2)).penalty(), 0);
        assert_eq!(
            Offence::from(DecodeError::Malformed {
                what: "blob",
                reason: CborError::Structure(PrecheckError::TrailingBytes),
            })
            .to_string(),
            "malformed blob: trailing bytes after the item"
        );
    }
}
