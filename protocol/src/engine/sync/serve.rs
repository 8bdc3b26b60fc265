//! Serving checkpoints: which snapshots this node offers and whether it answers a request.
//!
//! The shell holds the bytes of its newest snapshots and tells the engine of each
//! ([`Event::Snapshot`], with the manifest it hashed); the engine signs the manifest and keeps
//! the newest [`KEEP_SNAPSHOTS`], so a joiner's chunk requests keep reading one consistent
//! version while training goes on. Only a synced node serves, never to a banned peer, and it
//! serves the *oldest* kept version at least the one asked for, so peers a step apart still
//! hand out the same one. A chunk is named by its byte range; the shell reads it.

use super::*;
use crate::checkpoint::CheckpointManifest;

/// Parameter versions kept for serving checkpoints: a download in progress keeps reading its
/// version for two more steps.
pub const KEEP_SNAPSHOTS: usize = 3;

/// One served version: its manifest and the signed `Message::Manifest` frame.
pub(super) struct Served {
    manifest: CheckpointManifest,
    frame: Vec<u8>,
}

impl Engine {
    /// The shell holds a snapshot described by `m`: sign it and serve it.
    pub(in crate::engine) fn add_snapshot(&mut self, m: CheckpointManifest, out: &mut Vec<Action>) {
        if self.ckpt.layout.is_empty() {
            self.ckpt.layout = m
                .tensors
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone()))
                .collect();
        }
        if m.server != self.me_id || m.run != self.run_id {
            return;
        }
        let served = &mut self.ckpt.served;
        match served.back().map(|s| s.manifest.version) {
            // A reload to an older version (a resync): what was served is no longer ours.
            Some(v) if v > m.version => served.clear(),
            Some(v) if v == m.version => return,
            _ => {}
        }
        let frame = Message::Manifest(Signed::sign(m.clone(), &self.me)).encode();
        if frame.len() as u64 > self.run.limits.max_manifest_bytes as u64 {
            out.push(Action::Report(Report::Ignored {
                from: self.me_id,
                error: Offence::Checkpoint("manifest over the run's max_manifest_bytes"),
            }));
            return;
        }
        let served = &mut self.ckpt.served;
        served.push_back(Served { manifest: m, frame });
        while served.len() > KEEP_SNAPSHOTS {
            served.pop_front();
        }
    }

    /// The versions this node serves now, oldest first.
    pub fn served_versions(&self) -> Vec<u64> {
        self.ckpt
            .served
            .iter()
            .map(|s| s.manifest.version)
            .collect()
    }

    /// `peer` asks for a manifest or a chunk (request `token`): answer it, or refuse with an
    /// empty answer.
    pub(in crate::engine) fn serve_request(
        &mut self,
        peer: NodeId,
        token: u64,
        req: Request,
        out: &mut Vec<Action>,
    ) {
        // Serve only what this node stands behind: it is synced, and the version is one it
        // applied (or loaded) and still holds.
        let serving = self.sync == SyncState::Synced && !self.is_banned(&peer);
        let empty = Action::Respond {
            token,
            bytes: Vec::new(),
        };
        match req {
            Request::Manifest { min_version } if serving => {
                let found = self
                    .ckpt
                    .served
                    .iter()
                    .find(|s| s.manifest.version >= min_version)
                    .map(|s| s.frame.clone());
                // Only a version this node holds or has passed can be snapshotted for a retry:
                // a request for a later one (`u64::MAX`, from anyone) must not make a large
                // model copy its parameters.
                if found.is_none() && min_version <= self.version {
                    out.push(Action::Snapshot);
                }
                out.push(found.map_or(empty, |bytes| Action::Respond { token, bytes }));
            }
            Request::Chunk { version, index } if serving => {
                let range = self
                    .ckpt
                    .served
                    .iter()
                    .find(|s| s.manifest.version == version)
                    .and_then(|s| {
                        let len = s.manifest.chunk_len(index)?;
                        Some((index as u64 * s.manifest.chunk_bytes as u64, len))
                    });
                out.push(match range {
                    Some((offset, len)) => Action::ServeChunk {
                        token,
                        version,
                        index,
                        offset,
                        len,
                    },
                    None => empty,
                });
            }
            _ => out.push(empty),
        }
    }
}
