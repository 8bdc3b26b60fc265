//! Checkpoints: a signed manifest that commits to every tensor and to every chunk of the byte
//! stream, so a joiner can verify each chunk as it arrives (from any peer) and the whole
//! against a parameter digest that other nodes attest in their summaries.
//!
//! The byte stream is the concatenation, in manifest order, of each tensor's raw little-endian
//! bytes; it is cut into `chunk_bytes`-sized chunks (the last may be shorter).

use crypto::{ContentId, Digest, NodeId};
use serde::{Deserialize, Serialize};

use crate::error::{DecodeError, Offence};
use crate::run::RunId;

/// Element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    pub fn size(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }
}

/// One tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub shape: Vec<u32>,
    pub dtype: Dtype,
    /// blake3 of the tensor's raw little-endian bytes.
    pub hash: Digest,
}

impl TensorEntry {
    pub fn byte_len(&self) -> u64 {
        self.shape
            .iter()
            .fold(self.dtype.size(), |a, &d| a.saturating_mul(d as u64))
    }
}

/// The parameter digest: what nodes compare to know they hold the same parameters.
///
/// `blake3("swarm-params-v1" ‖ for each tensor: u32le(len name) ‖ name ‖ u32le(ndim) ‖
/// u32le(dim)… ‖ dtype byte (0 = f32, 1 = bf16) ‖ hash)`. The trainer computes each tensor's
/// blake3 over its raw little-endian bytes and calls this.
pub fn params_digest(tensors: &[TensorEntry]) -> Digest {
    let mut h = blake3::Hasher::new();
    h.update(b"swarm-params-v1");
    for t in tensors {
        h.update(&(t.name.len() as u32).to_le_bytes());
        h.update(t.name.as_bytes());
        h.update(&(t.shape.len() as u32).to_le_bytes());
        for d in &t.shape {
            h.update(&d.to_le_bytes());
        }
        h.update(&[match t.dtype {
            Dtype::F32 => 0,
            Dtype::Bf16 => 1,
        }]);
        h.update(t.hash.as_bytes());
    }
    Digest(*h.finalize().as_bytes())
}

/// [`params_digest`] of f32 tensors given as (name, shape, raw little-endian bytes): the one
/// way the trainer, the node's served snapshots and the simulator name their parameters.
pub fn f32_params_digest<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a [u32], &'a [u8])>,
) -> Digest {
    let entries: Vec<TensorEntry> = tensors
        .into_iter()
        .map(|(name, shape, bytes)| TensorEntry {
            name: name.to_string(),
            shape: shape.to_vec(),
            dtype: Dtype::F32,
            hash: Digest::of(bytes),
        })
        .collect();
    params_digest(&entries)
}

/// Signed by the node serving the checkpoint: a bad checkpoint is then provably its fault.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointManifest {
    pub run: RunId,
    /// Parameter version: the number of steps applied.
    pub version: u64,
    /// [`params_digest`] of `tensors`.
    pub digest: Digest,
    pub tensors: Vec<TensorEntry>,
    pub chunk_bytes: u32,
    /// blake3 of each chunk of the byte stream.
    pub chunks: Vec<ContentId>,
    pub server: NodeId,
}

/// One piece of a checkpoint's byte stream.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointChunk {
    pub run: RunId,
    pub version: u64,
    pub index: u32,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

impl CheckpointManifest {
    /// Build a manifest for tensors given as (name, shape, dtype, raw bytes).
    pub fn build(
        run: RunId,
        version: u64,
        server: NodeId,
        chunk_bytes: u32,
        tensors: &[(String, Vec<u32>, Dtype, &[u8])],
    ) -> CheckpointManifest {
        let entries: Vec<TensorEntry> = tensors
            .iter()
            .map(|(n, s, d, b)| TensorEntry {
                name: n.clone(),
                shape: s.clone(),
                dtype: *d,
                hash: Digest::of(b),
            })
            .collect();
        // Hash chunks of the concatenated stream without materializing it.
        let mut chunks = Vec::new();
        let mut cur = blake3::Hasher::new();
        let mut fill = 0usize;
        let cb = chunk_bytes.max(1) as usize;
        for (_, _, _, mut b) in tensors.iter().cloned() {
            while !b.is_empty() {
                let take = (cb - fill).min(b.len());
                cur.update(&b[..take]);
                fill += take;
                b = &b[take..];
                if fill == cb {
                    chunks.push(ContentId(*cur.finalize().as_bytes()));
                    cur = blake3::Hasher::new();
                    fill = 0;
                }
            }
        }
        if fill > 0 {
            chunks.push(ContentId(*cur.finalize().as_bytes()));
        }
        let digest = params_digest(&entries);
        CheckpointManifest {
            run,
            version,
            digest,
            tensors: entries,
            chunk_bytes,
            chunks,
            server,
        }
    }

    pub fn total_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .fold(0u64, |a, t| a.saturating_add(t.byte_len()))
    }

    /// Internal consistency: the digest matches the tensors, the chunk count matches the size.
    pub fn check_structure(&self) -> Result<(), DecodeError> {
        if self.chunk_bytes == 0 {
            return Err(DecodeError::Manifest("zero chunk size"));
        }
        if params_digest(&self.tensors) != self.digest {
            return Err(DecodeError::Manifest("digest does not match tensors"));
        }
        let want = self.total_bytes().div_ceil(self.chunk_bytes as u64);
        if self.chunks.len() as u64 != want {
            return Err(DecodeError::Manifest("chunk count does not match size"));
        }
        Ok(())
    }

    /// Expected length of chunk `i`.
    pub fn chunk_len(&self, i: u32) -> Option<u64> {
        let total = self.total_bytes();
        let start = (i as u64).checked_mul(self.chunk_bytes as u64)?;
        if (i as usize) >= self.chunks.len() || start >= total {
            return None;
        }
        Some((total - start).min(self.chunk_bytes as u64))
    }

    /// Check a received chunk against this manifest.
    pub fn verify_chunk(&self, c: &CheckpointChunk) -> Result<(), Offence> {
        if c.run != self.run {
            return Err(Offence::WrongRun);
        }
        if c.version != self.version {
            return Err(Offence::Checkpoint("chunk of another version"));
        }
        let len = self
            .chunk_len(c.index)
            .ok_or(Offence::Checkpoint("chunk index out of range"))?;
        if c.data.len() as u64 != len {
            return Err(Offence::Checkpoint("chunk length"));
        }
        if ContentId::of(&c.data) != self.chunks[c.index as usize] {
            return Err(Offence::Checkpoint("chunk hash"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_chunks_verify() {
        let a = [1u8; 10];
        let b = [2u8; 7];
        let m = CheckpointManifest::build(
            Digest([0; 32]),
            3,
            NodeId([0; 32]),
            4,
            &[
                ("a".into(), vec![10], Dtype::F32, &a[..]),
                ("b".into(), vec![7], Dtype::F32, &b[..]),
            ],
        );
        // byte_len uses the dtype: these shapes say 40 + 28 bytes, so the structure is wrong.
        assert!(m.check_structure().is_err());
        let a = [1u8; 12];
        let b = [2u8; 8];
        let m = CheckpointManifest::build(
            Digest([0; 32]),
            3,
            NodeId([0; 32]),
            7,
            &[
                ("a".into(), vec![3], Dtype::F32, &a[..]),
                ("b".into(), vec![2, 2], Dtype::Bf16, &b[..]),
            ],
        );
        m.check_structure().unwrap();
        let stream: Vec<u8> = a.iter().chain(&b).copied().collect();
        for (i, piece) in stream.chunks(7).enumerate() {
            let c = CheckpointChunk {
                run: m.run,
                version: 3,
                index: i as u32,
                data: piece.to_vec(),
            };
            m.verify_chunk(&c).unwrap();
            let mut bad = c.clone();
            bad.data[0] ^= 1;
            assert!(m.verify_chunk(&bad).is_err());
        }
        let c = CheckpointChunk {
            run: m.run,
            version: 3,
            index: 3,
            data: vec![],
        };
        assert!(m.verify_chunk(&c).is_err());
    }
}
