//! Attestations of (version, digest), desync detection, and joining: when to ask for which
//! checkpoint and when a loaded one counts as attested.

use super::*;

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
        let mut tally: BTreeMap<Digest, Vec<NodeId>> = BTreeMap::new();
        for (p, d) in &pool {
            tally.entry(**d).or_default().push(**p);
        }
        tally
            .into_iter()
            .filter(|(_, who)| who.len() >= quorum && 2 * who.len() > pool.len())
            .max_by(|a, b| a.1.len().cmp(&b.1.len()).then(b.0.cmp(&a.0)))
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
        let mut tally: BTreeMap<Digest, u32> = BTreeMap::new();
        let mut voters = 1u32;
        for (p, d) in m {
            if self.known(p) {
                voters += 1;
                *tally.entry(*d).or_default() += 1;
            }
        }
        // Largest count wins; ties go to the smaller digest (any fixed rule will do).
        let best = tally
            .iter()
            .filter(|(d, _)| **d != self.digest)
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)));
        if let Some((d, &c)) = best {
            if c >= self.run.limits.attest_quorum && 2 * c > voters {
                self.metrics.desyncs += 1;
                out.push(Action::Report(Report::Desync {
                    version: self.version,
                    mine: self.digest,
                    majority: *d,
                }));
                self.sync = SyncState::Joining {
                    requested: None,
                    loaded: None,
                };
            }
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
        if requested.is_some() {
            return;
        }
        // The newest version whose summaries we heard and for which the swarm attests a
        // digest (`swarm_digest`); its attesters serve the checkpoint.
        let mut best: Option<(u64, Vec<NodeId>)> = None;
        for &v in self.attest.keys().rev() {
            if self.run.timing.publish_deadline(v) <= self.since {
                break;
            }
            if let Some((_, who)) = self.swarm_digest(v) {
                best = Some((v, who));
                break;
            }
        }
        if let Some((v, mut peers)) = best {
            // Spread checkpoint load: rotate the list by a seeded amount.
            let n = peers.len();
            let r = (self.next_rand() % n as u64) as usize;
            peers.rotate_left(r);
            self.sync = SyncState::Joining {
                requested: Some(v),
                loaded: None,
            };
            out.push(Action::RequestCheckpoint {
                min_version: v,
                peers,
            });
        }
    }

    /// The digest the swarm attests for `version` (see `swarm_digest`: a strict majority of the
    /// known peers, or of all peers while too few known ones speak), if any: what a joiner
    /// checks a served checkpoint's manifest against.
    pub fn attested_digest(&self, version: u64) -> Option<Digest> {
        self.swarm_digest(version).map(|(d, _)| d)
    }
}
