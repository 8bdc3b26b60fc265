//! The request a peer sends another over the shell's request-response protocol, and its
//! byte encoding.

use crypto::ContentId;
use thiserror::Error;

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
