//! Every reason a message is refused, each naming its cause so that the peer at fault can be
//! penalized precisely (and an honest one that merely relayed something late is not).

use crypto::{ContentId, NodeId};
use thiserror::Error;

use crate::sparse::SparseError;

/// Why a message was refused or ignored.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum WireError {
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
    #[error("message kind {kind} not accepted on this path")]
    UnexpectedKind { kind: u8 },
    #[error("malformed {what}: {reason}")]
    Malformed { what: &'static str, reason: String },
    #[error("{0} is not in canonical encoding")]
    NonCanonical(&'static str),
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
    #[error("invalid update: {0}")]
    Sparse(#[from] SparseError),
    #[error("{what}: {n} entries, over the limit of {max}")]
    TooMany {
        what: &'static str,
        n: usize,
        max: usize,
    },
    #[error("{0}: entries not strictly ascending")]
    NotAscending(&'static str),
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
    #[error("unsolicited response")]
    Unsolicited,
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
}

impl WireError {
    /// Penalty points for the peer at fault. Provably invalid content costs a lot; what an
    /// honest peer can produce by being slow or by relaying a replay costs little or nothing.
    pub fn penalty(&self) -> u32 {
        use WireError::*;
        match self {
            Equivocation { .. } => 1000,
            BadSignature { .. } | BadKey { .. } | BadProof(_) | IdentityMismatch { .. } => 50,
            Oversize { .. }
            | Truncated
            | UnknownKind(_)
            | UnexpectedKind { .. }
            | Malformed { .. }
            | NonCanonical(_) => 20,
            HeaderMismatch { .. }
            | BlobLength { .. }
            | BlobIdMismatch { .. }
            | ForeignBlob { .. }
            | Sparse(_)
            | TooMany { .. }
            | NotAscending(_) => 20,
            Checkpoint(_) => 20,
            // Without work the identity is not admitted; a cheap key is no misconduct yet.
            NoWork => 5,
            // Content offences are judged from noisy evidence: the engine accumulates them in
            // its reputation table and bans only persistent offenders (see SECURITY.md).
            HarmfulUpdate | Copy => 10,
            FalseCheckpoint => 1000,
            // One step either side is what an honest relay's clock skew (or a message that
            // crossed a step boundary on the way) produces: no misconduct.
            StepOutOfWindow { step, lo, hi }
                if step.saturating_add(1) >= *lo && *step <= hi.saturating_add(1) =>
            {
                0
            }
            StepOutOfWindow { .. } => 2,
            Unsolicited => 1,
            // Another run, another version, late, duplicates and full buffers: not misconduct.
            UnknownVersion(_)
            | WrongRun
            | VersionMismatch { .. }
            | Late { .. }
            | Banned
            | Duplicate
            | BufferFull(_) => 0,
        }
    }
}
