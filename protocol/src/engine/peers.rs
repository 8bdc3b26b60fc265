//! The peer table: penalties, bans, eviction of idle strangers, the Hello this node sends.

use super::*;

#[derive(Default)]
pub(super) struct Peer {
    pub(super) score: u32,
    pub(super) banned: bool,
    pub(super) connected: bool,
    pub(super) capabilities: u64,
    /// Local reputation from spot checks and copy detection (see `SECURITY.md`): +1 per
    /// passed check up to `REP_MAX`, −`REP_FAIL` per failure; at or below `REP_OFFENDER`
    /// this node leaves the peer's updates out of its summaries.
    pub(super) rep: i32,
    pub(super) checks: u32,
    pub(super) passed: u32,
    /// The step in which this peer's first header or summary was accepted.
    pub(super) first_step: Option<u64>,
    /// Applied steps that included one of this peer's updates (see [`Engine::known`]).
    pub(super) included: u32,
    /// Served a provably wrong checkpoint, or signed one of a version the swarm attests with
    /// another digest: never asked for a checkpoint again (see `sync`), but not banned.
    pub(super) ckpt_liar: bool,
}

impl Engine {
    /// The Hello frame this node sends on a new connection.
    pub fn hello(&self) -> Vec<u8> {
        Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            run: self.run_id,
            node: self.me_id,
            capabilities: self.capabilities,
            listen: self.listen.clone(),
            params_version: self.version,
            params_digest: self.digest,
        })
        .encode()
    }

    pub(super) fn peer_mut(&mut self, id: NodeId) -> Option<&mut Peer> {
        // The table is bounded, and full it makes room: a table that kept its first comers
        // for good let 1,024 throwaway keys stop this node from banning (or rating) anyone
        // new. The one to go is a stranger with nothing to lose (see `evictable`), else a
        // disconnected banned key (the transport keeps its own blacklist of those).
        if !self.peers.contains_key(&id) && self.peers.len() >= self.run.limits.max_peers as usize {
            let victim = self
                .peers
                .iter()
                .find(|(p, e)| self.evictable(p, e))
                .or_else(|| self.peers.iter().find(|(_, e)| e.banned && !e.connected))
                .map(|(p, _)| *p)?;
            self.peers.remove(&victim);
            self.metrics.evicted_peers += 1;
        }
        Some(self.peers.entry(id).or_default())
    }

    /// A peer entry worth least: not connected, not banned, not a trusted relay, no passed
    /// check nor positive reputation, no penalty score, and not a peer whose digest votes
    /// (`known`).
    pub(super) fn evictable(&self, p: &NodeId, e: &Peer) -> bool {
        !e.connected
            && !e.banned
            && e.score == 0
            && e.rep <= 0
            && e.passed == 0
            && !e.ckpt_liar
            && !self.trusted_relays.contains(p)
            && !self.known(p)
    }

    pub(super) fn blame(&mut self, peer: NodeId, error: Offence, out: &mut Vec<Action>) {
        let points = error.penalty();
        if points == 0 {
            self.metrics.ignored += 1;
            out.push(Action::Report(Report::Ignored { from: peer, error }));
            return;
        }
        self.metrics.rejected += 1;
        out.push(Action::Report(Report::Rejected {
            from: peer,
            error: error.clone(),
        }));
        if peer == self.me_id {
            return;
        }
        let ban_score = self.run.limits.ban_score;
        let ban = match self.peer_mut(peer) {
            Some(p) => {
                p.score = p.score.saturating_add(points);
                let ban = !p.banned && p.score >= ban_score;
                p.banned |= ban;
                ban
            }
            None => points >= ban_score,
        };
        out.push(Action::Penalize {
            peer,
            reason: error.clone(),
            points,
        });
        if ban {
            out.push(Action::Ban {
                peer,
                reason: error,
            });
            for w in self.wants.values_mut() {
                if let Some(i) = w.candidates.iter().position(|c| *c == peer) {
                    w.tried[i] = true;
                }
            }
        }
    }

    /// Refuse a message: reject it for gossip when `e` is an offence (it has a penalty), else
    /// ignore it; then blame `from` for it.
    pub(super) fn refuse(
        &mut self,
        from: NodeId,
        tag: Option<u64>,
        e: Offence,
        out: &mut Vec<Action>,
    ) {
        let v = if e.penalty() > 0 {
            Verdict::Reject
        } else {
            Verdict::Ignore
        };
        Self::verdict(tag, v, out);
        self.blame(from, e, out);
    }

    pub(super) fn verdict(tag: Option<u64>, verdict: Verdict, out: &mut Vec<Action>) {
        if let Some(tag) = tag {
            out.push(Action::Verdict { tag, verdict });
        }
    }

    pub(super) fn next_rand(&mut self) -> u64 {
        self.rng.next_u64()
    }
}
