//! Attestations of (version, digest), desync detection, and joining: when to ask for which
//! checkpoint, from whom, the download itself ([`download::CheckpointDownload`], driven on the
//! engine's clock), which servers lied (never asked again; banned when they contradicted their
//! own attestation), the back-off after a failure, and when a loaded checkpoint counts as
//! attested. Serving checkpoints to others is [`serve`].

pub mod download;
mod serve;

pub use serve::KEEP_SNAPSHOTS;

use super::*;
use download::{CheckpointDownload, DlAction, Failure};

/// Checkpoints both ways: at most one download, then its load; what this node serves.
#[derive(Default)]
pub(in crate::engine) struct Checkpoints {
    /// The model's tensors (name, shape), for checking manifests: from the first snapshot
    /// (or [`Engine::set_checkpoint_layout`]).
    layout: Vec<(String, Vec<u32>)>,
    download: Option<Fetching>,
    pub(in crate::engine) loading: Option<Loading>,
    /// No download starts before this instant (unix ms): right after a failure every peer
    /// would give the same answer.
    retry_at: u64,
    /// Served versions, oldest first.
    served: std::collections::VecDeque<serve::Served>,
}

struct Fetching {
    dl: CheckpointDownload,
    min_version: u64,
    /// The digest the asked peers attested for `min_version` when they were asked.
    attested: Digest,
    /// The peers asked (they had attested `min_version`).
    asked: Vec<NodeId>,
}

/// A downloaded checkpoint the trainer is loading.
pub(in crate::engine) struct Loading {
    version: u64,
    digest: Digest,
    /// The agreeing servers it came from.
    servers: Vec<NodeId>,
    /// Servers that signed the same version with another digest.
    dissenters: Vec<NodeId>,
    asked: Vec<NodeId>,
    min_version: u64,
    /// What the asked peers had attested for `min_version`.
    attested: Digest,
}

/// The servers of a loaded checkpoint that provably contradicted themselves: each was asked
/// because it attested `min_version` with the swarm's digest in a signed summary, then signed
/// a manifest of that version with the digest just loaded, which the engine does not accept.
/// Only while the swarm's attested digest for the version is still known and differs: once
/// the attestation has aged out of the engine's window (a slow download, a swarm that moved
/// on), "not synced" is no evidence against anyone, and banning then cut honest servers off.
fn contradicted_attesters(
    synced: bool,
    loaded: (u64, Digest),
    min_version: u64,
    attested: Option<Digest>,
    servers: &[NodeId],
    asked: &[NodeId],
) -> Vec<NodeId> {
    let (version, digest) = loaded;
    if synced || version != min_version || attested.is_none_or(|a| a == digest) {
        return Vec::new();
    }
    servers
        .iter()
        .filter(|s| asked.contains(s))
        .copied()
        .collect()
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum SyncState {
    Synced,
    /// Waiting for a checkpoint. `requested`: min version asked for; `loaded`: a checkpoint
    /// the trainer loaded but that is not yet attested.
    Joining {
        requested: Option<u64>,
        loaded: Option<(u64, Digest)>,
    },
}

impl Engine {
    pub(super) fn add_attest(&mut self, version: u64, who: NodeId, digest: Digest, now: u64) {
        let cur = self.run.timing.step_at(now);
        let past = self.run.limits.past_steps as u64;
        // Only versions that can matter: around the current step, bounded on both sides.
        // Saturating: a peer's version is untrusted and may be u64::MAX (a debug-build panic).
        let future = self.run.limits.future_steps as u64 + 1;
        if version.saturating_add(past + 2) < cur || version > cur.saturating_add(future) {
            return;
        }
        let max = self.run.limits.max_peers as usize;
        let who_known = self.known(&who);
        // When the table is full a known peer takes the place of a stranger: first come must
        // not let a crowd of fresh keys keep the votes that count out.
        let evict = match self.attest.get(&version) {
            Some(m) if m.len() >= max && !m.contains_key(&who) => {
                if !who_known {
                    return;
                }
                match m.keys().rev().find(|p| !self.known(p)) {
                    Some(p) => Some(*p),
                    None => return,
                }
            }
            _ => None,
        };
        let m = self.attest.entry(version).or_default();
        if let Some(p) = evict {
            m.remove(&p);
        }
        m.insert(who, digest);
    }

    /// Whether `peer`'s digests count against this node's own: a peer it already heard from
    /// when it first synced (or within [`KNOWN_GRACE_STEPS`] after), one with a passed spot
    /// check or positive reputation, one whose updates were in [`KNOWN_AFTER_INCLUDED`]
    /// applied steps, or a trusted relay; never a banned one. A fresh key costs one proof of
    /// work: had strangers a vote, a handful of throwaway keys could declare a node desynced
    /// and hand it their parameters (SECURITY.md, "Forged models").
    pub(super) fn known(&self, peer: &NodeId) -> bool {
        self.established(peer)
            || (*peer != self.me_id
                && !self.is_banned(peer)
                && self.first_synced.is_some()
                && self
                    .peers
                    .get(peer)
                    .is_some_and(|p| p.passed > 0 || p.rep > 0))
    }

    /// Known for reasons that take time or the operator's word: a trusted relay, present by
    /// the step this node first synced (+ grace), or in [`KNOWN_AFTER_INCLUDED`] applied steps
    /// (see [`Engine::standing`]). Never a banned peer.
    pub(super) fn established(&self, peer: &NodeId) -> bool {
        if *peer == self.me_id || self.is_banned(peer) {
            return false;
        }
        if self.trusted_relays.contains(peer) {
            return true;
        }
        let Some(start) = self.first_synced else {
            return false;
        };
        self.peers.get(peer).is_some_and(|p| {
            p.included >= KNOWN_AFTER_INCLUDED
                || p.first_step.is_some_and(|f| f <= start + KNOWN_GRACE_STEPS)
        })
    }

    /// The digest the swarm attests for `version` and who attests it, if any: a strict
    /// majority of the voters, and at least `attest_quorum` of them. The voters are the known
    /// peers (see [`Engine::known`]) when at least `attest_quorum` of them speak for
    /// `version`, and only otherwise every peer not banned: a node that knows nobody yet (a
    /// first-time joiner) has nothing better than numbers, which proof of work prices.
    pub(super) fn swarm_digest(&self, version: u64) -> Option<(Digest, Vec<NodeId>)> {
        let m = self.attest.get(&version)?;
        let all: Vec<(&NodeId, &Digest)> = m
            .iter()
            .filter(|(p, _)| !self.is_banned(p) && **p != self.me_id)
            .collect();
        let known: Vec<(&NodeId, &Digest)> =
            all.iter().copied().filter(|(p, _)| self.known(p)).collect();
        let quorum = self.run.limits.attest_quorum as usize;
        let pool = if known.len() >= quorum { known } else { all };
        let mut tally = Tally::new();
        for (_, d) in &pool {
            tally.voter([**d]);
        }
        let d = tally.majority(quorum as u32)?;
        Some((
            d,
            pool.iter()
                .filter(|(_, x)| **x == d)
                .map(|(p, _)| **p)
                .collect(),
        ))
    }

    pub(super) fn check_desync(&mut self, out: &mut Vec<Action>) {
        if self.sync != SyncState::Synced || self.applying.is_some() {
            return;
        }
        let Some(m) = self.attest.get(&self.version) else {
            return;
        };
        // Only known peers outvote this node, and only as a strict majority of the known
        // peers speaking for this version with this node counted on its own side: strangers
        // (fresh keys) never do, however many.
        let mut tally = Tally::new();
        tally.voter([self.digest]);
        for (p, d) in m {
            if self.known(p) {
                tally.voter([*d]);
            }
        }
        if let Some(d) = tally
            .majority(self.run.limits.attest_quorum)
            .filter(|d| *d != self.digest)
        {
            self.metrics.desyncs += 1;
            out.push(Action::Report(Report::Desync {
                version: self.version,
                mine: self.digest,
                majority: d,
            }));
            self.sync = SyncState::Joining {
                requested: None,
                loaded: None,
            };
        }
    }

    /// The loaded checkpoint `(v, d)` is not the swarm's (or can no longer be attested):
    /// report it, never train on it, and ask again.
    fn drop_loaded(&mut self, v: u64, d: Digest, out: &mut Vec<Action>) {
        out.push(Action::Report(Report::CheckpointUnattested {
            version: v,
            digest: d,
        }));
        self.sync = SyncState::Joining {
            requested: None,
            loaded: None,
        };
    }

    pub(super) fn tick_joining(&mut self, now: u64, out: &mut Vec<Action>) {
        self.tick_download(now, out);
        let SyncState::Joining { requested, loaded } = self.sync.clone() else {
            return;
        };
        if let Some((v, d)) = loaded {
            // Only summaries heard in full count: a version whose summaries went out before
            // this node listened has an incomplete tally here.
            let verdict = (self.run.timing.publish_deadline(v) > self.since)
                .then(|| self.swarm_digest(v))
                .flatten();
            if verdict.as_ref().is_some_and(|(vd, _)| *vd == d) {
                self.sync = SyncState::Synced;
                self.version = v;
                self.digest = d;
                self.synced_at = now;
                if self.first_synced.is_none() {
                    self.first_synced = Some(self.run.timing.step_at(now));
                }
                self.next_start = self.run.timing.step_at(now).max(self.next_start);
                out.push(Action::Report(Report::Synced {
                    version: v,
                    digest: d,
                }));
                return;
            }
            if verdict.is_some() {
                // The swarm attests another digest for this version: what was loaded is not
                // the swarm's model, whoever served it. Never train on it; ask again.
                self.drop_loaded(v, d, out);
                return;
            }
            let newest = self.attest.keys().next_back().copied().unwrap_or(0);
            // Past the furthest version `add_attest` keeps, nobody can ever attest it: a
            // far-future (or u64::MAX) version would otherwise hold the joiner forever.
            let beyond = self
                .run
                .timing
                .step_at(now)
                .saturating_add(self.run.limits.future_steps as u64 + 1);
            if newest > v.saturating_add(self.run.limits.past_steps as u64) || v > beyond {
                // Nobody attests it and the run has moved on: ask again.
                self.drop_loaded(v, d, out);
            }
            return;
        }
        if requested.is_some() || now < self.ckpt.retry_at {
            return;
        }
        // The newest version whose summaries we heard and for which the swarm attests a
        // digest (`swarm_digest`); its attesters serve the checkpoint.
        let mut best: Option<(u64, Digest, Vec<NodeId>)> = None;
        for &v in self.attest.keys().rev() {
            if self.run.timing.publish_deadline(v) <= self.since {
                break;
            }
            if let Some((d, who)) = self.swarm_digest(v) {
                best = Some((v, d, who));
                break;
            }
        }
        if let Some((v, d, mut peers)) = best {
            // Spread checkpoint load: rotate the list by a seeded amount.
            let n = peers.len();
            let r = (self.next_rand() % n as u64) as usize;
            peers.rotate_left(r);
            self.sync = SyncState::Joining {
                requested: Some(v),
                loaded: None,
            };
            self.start_download(v, d, peers, now, out);
        }
    }

    /// Whether this node found `peer` signing a checkpoint the swarm does not attest: it is
    /// never asked for one again (but not banned).
    pub fn is_checkpoint_liar(&self, peer: &NodeId) -> bool {
        self.peers.get(peer).is_some_and(|p| p.ckpt_liar)
    }

    /// The model's tensors (name, shape), which a served manifest must describe; otherwise
    /// taken from the first [`Event::Snapshot`].
    pub fn set_checkpoint_layout(&mut self, layout: Vec<(String, Vec<u32>)>) {
        self.ckpt.layout = layout;
    }

    /// Download a checkpoint of at least `min_version` from `peers` (who attested `attested`
    /// for it, in order): never from a banned peer nor one that signed a false checkpoint.
    fn start_download(
        &mut self,
        min_version: u64,
        attested: Digest,
        peers: Vec<NodeId>,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let peers: Vec<NodeId> = peers
            .into_iter()
            .filter(|p| !self.is_banned(p) && !self.peers.get(p).is_some_and(|e| e.ckpt_liar))
            .collect();
        let t = &self.run.timing;
        let (manifest_ms, total_ms) = (t.period_ms.max(1000), 6 * t.period_ms.max(1000));
        out.push(Action::Report(Report::CheckpointRequested {
            min_version,
            peers: peers.clone(),
        }));
        let (dl, acts) = CheckpointDownload::start(
            self.run_id,
            self.run.limits.clone(),
            self.ckpt.layout.clone(),
            min_version,
            &peers,
            now,
            manifest_ms,
            total_ms,
        );
        self.ckpt.download = Some(Fetching {
            dl,
            min_version,
            attested,
            asked: peers,
        });
        self.on_download(acts, now, out);
    }

    /// The answer (`Some(bytes)`) to a checkpoint request, or its failure (`None`).
    pub(super) fn on_response(
        &mut self,
        peer: NodeId,
        req: &Request,
        bytes: Option<&[u8]>,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let Some(f) = self.ckpt.download.as_mut() else {
            return;
        };
        let acts = match bytes {
            Some(b) => f.dl.on_response(peer, req, b, now),
            None => f.dl.on_failure(peer, req, now),
        };
        self.on_download(acts, now, out);
    }

    /// The download's deadlines (every `handle`).
    pub(super) fn tick_download(&mut self, now: u64, out: &mut Vec<Action>) {
        if let Some(f) = self.ckpt.download.as_mut() {
            let acts = f.dl.tick(now);
            self.on_download(acts, now, out);
        }
    }

    fn on_download(&mut self, acts: Vec<DlAction>, now: u64, out: &mut Vec<Action>) {
        for a in acts {
            match a {
                DlAction::Ask { peer, request } => out.push(Action::Request { peer, req: request }),
                DlAction::Ban { peer, reason } => {
                    // Provably wrong, but the evidence is this node's alone: the server is
                    // never asked for a checkpoint again and penalized once, not banned. A ban
                    // would leave its updates out here only, and this node would apply other
                    // sets than its peers and resync over and over (the simulator's
                    // `ckpt_liars` scenario showed it).
                    if !self.is_checkpoint_liar(&peer) {
                        if let Some(p) = self.peer_mut(peer) {
                            p.ckpt_liar = true;
                        }
                        out.push(Action::Report(Report::CheckpointLiar { peer }));
                        self.blame(peer, Offence::BadCheckpoint(Box::new(reason)), out);
                    }
                }
                DlAction::Done {
                    version,
                    digest,
                    tensors,
                    servers,
                    dissenters,
                } => {
                    let Some(f) = self.ckpt.download.take() else {
                        continue;
                    };
                    self.ckpt.loading = Some(Loading {
                        version,
                        digest,
                        servers,
                        dissenters,
                        asked: f.asked,
                        min_version: f.min_version,
                        attested: f.attested,
                    });
                    out.push(Action::LoadCheckpoint {
                        version,
                        digest,
                        tensors,
                    });
                }
                DlAction::Failed { reason } => self.checkpoint_failed(reason, now, out),
            }
        }
    }

    /// The download or its load failed: ask again, after a back-off of half a period.
    pub(super) fn checkpoint_failed(&mut self, reason: Failure, now: u64, out: &mut Vec<Action>) {
        self.ckpt.download = None;
        self.ckpt.loading = None;
        self.ckpt.retry_at = now + self.run.timing.period_ms / 2;
        if let SyncState::Joining { requested, .. } = &mut self.sync {
            *requested = None;
        }
        out.push(Action::Report(Report::CheckpointFailed { reason }));
    }

    /// The trainer holds `version` with `digest`: a checkpoint this engine downloaded (it must
    /// be the one the manifest named), or one the shell resumed from disk.
    pub(super) fn on_loaded(
        &mut self,
        version: u64,
        digest: Digest,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let l = self.ckpt.loading.take();
        if l.as_ref()
            .is_some_and(|l| (l.version, l.digest) != (version, digest))
        {
            return self.checkpoint_failed(Failure::NotLoaded, now, out);
        }
        if let SyncState::Joining { loaded, .. } = &mut self.sync {
            *loaded = Some((version, digest));
        }
        let Some(l) = l else {
            return;
        };
        self.tick_joining(now, out);
        let synced = self.sync == SyncState::Synced;
        let attested = self.swarm_digest(version).map(|(d, _)| d);
        // Only servers that signed a manifest against the digest they themselves attested
        // when asked: a swarm whose majority moved on since (a partition that healed) is no
        // evidence against a server that served what it had attested.
        let servers: &[NodeId] = if digest != l.attested {
            &l.servers
        } else {
            &[]
        };
        for s in contradicted_attesters(
            synced,
            (version, digest),
            l.min_version,
            attested,
            servers,
            &l.asked,
        ) {
            self.blame(s, Offence::FalseCheckpoint, out);
        }
        out.push(Action::Report(Report::CheckpointLoaded {
            version,
            digest,
            servers: l.servers.len() as u32,
            synced,
        }));
        if synced {
            // What was loaded is what a quorum attests: a signed manifest of the same version
            // with another digest is a false checkpoint (SECURITY.md). Its signer is never
            // asked for a checkpoint again, but not cut off: bans are local, and a node that
            // alone dropped its updates would apply other sets than its peers.
            for d in l.dissenters {
                if let Some(p) = self.peer_mut(d) {
                    p.ckpt_liar = true;
                }
                out.push(Action::Report(Report::CheckpointLiar { peer: d }));
            }
        }
    }

    /// When checkpoint work is due next (a download deadline, the end of a back-off).
    pub(super) fn checkpoint_wakeup(&self, now: u64) -> Option<u64> {
        let dl = self
            .ckpt
            .download
            .as_ref()
            .and_then(|f| f.dl.next_deadline());
        let retry = matches!(
            self.sync,
            SyncState::Joining {
                requested: None,
                ..
            }
        )
        .then_some(self.ckpt.retry_at)
        .filter(|&r| r > now);
        dl.into_iter().chain(retry).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_are_banned_only_on_evidence_the_engine_still_holds() {
        let (a, b, c) = (NodeId([1; 32]), NodeId([2; 32]), NodeId([3; 32]));
        let (loaded, other) = (Digest([7; 32]), Digest([8; 32]));
        let servers = [a, b];
        let asked = [a, c];
        // Attested digest known and different: the asked servers that served it lied.
        assert_eq!(
            contradicted_attesters(false, (5, loaded), 5, Some(other), &servers, &asked),
            vec![a]
        );
        // The attestation aged out (a slow download, a swarm that moved on): no evidence.
        assert!(contradicted_attesters(false, (5, loaded), 5, None, &servers, &asked).is_empty());
        // It attests what was loaded, synced, or a newer version than asked for: nothing.
        assert!(
            contradicted_attesters(false, (5, loaded), 5, Some(loaded), &servers, &asked)
                .is_empty()
        );
        assert!(
            contradicted_attesters(true, (5, loaded), 5, Some(other), &servers, &asked).is_empty()
        );
        assert!(
            contradicted_attesters(false, (6, loaded), 5, Some(other), &servers, &asked).is_empty()
        );
    }
}
