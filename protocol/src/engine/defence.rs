//! Content defences: equivocation proofs, spot checks and accusations, copy detection,
//! probation and local reputation (see `SECURITY.md`).

use super::*;

impl Engine {
    /// An equivocation proof (two headers or two summaries of one sender and step), from
    /// gossip. Cheap checks come before the two signature checks, and a proof is kept (and
    /// forwarded) only if it matters here: its sender sent this node something for the step,
    /// or the step has room for it. Fresh keys' proofs cost their maker one proof of work per
    /// key and nothing else; they must not fill tables (issue: item 6).
    pub(super) fn on_proof(
        &mut self,
        from: NodeId,
        tag: Option<u64>,
        p: Proof,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let claims = match &p {
            Proof::Headers(p) => {
                let (a, b) = (&p.a.body, &p.b.body);
                if a.run != self.run_id || b.run != self.run_id {
                    Err(Offence::WrongRun)
                } else if a.sender != b.sender || a.step != b.step {
                    Err(Offence::BadProof("different senders or steps"))
                } else {
                    Ok((a.sender, a.step))
                }
            }
            Proof::Summaries(p) => {
                if p.a.body.run != self.run_id || p.b.body.run != self.run_id {
                    Err(Offence::WrongRun)
                } else {
                    p.claims()
                }
            }
        };
        let (sender, step) = match claims {
            Ok(x) => x,
            Err(e) => return self.refuse(from, tag, e, out),
        };
        let in_window = self.in_window(step, now).is_ok();
        let known_here = self.steps.get(&step).is_some_and(|st| {
            st.headers.contains_key(&sender) || st.summaries.contains_key(&sender)
        });
        let dup = self
            .steps
            .get(&step)
            .is_some_and(|st| st.equivocators.contains(&sender));
        if dup || (self.is_banned(&sender) && !known_here) {
            self.metrics.duplicates += 1;
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        let full = self.steps.get(&step).is_some_and(|st| {
            st.equivocators.len() >= self.run.limits.max_updates_per_step as usize
        });
        if !in_window && !self.peers.contains_key(&sender) {
            // Old news about a key this node never heard from: nothing to do.
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        if in_window && full && !known_here && !self.peers.contains_key(&sender) {
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        let verified = match &p {
            Proof::Headers(p) => p.verify(&self.run_id),
            Proof::Summaries(p) => p.verify(&self.run_id),
        };
        if let Err(e) = verified {
            return self.refuse(from, tag, e, out);
        }
        if in_window {
            let st = self.steps.entry(step).or_default();
            st.equivocators.insert(sender);
            st.summaries.remove(&sender);
            Self::verdict(tag, Verdict::Accept, out);
        } else {
            // Old news, but still a valid proof: the sender is banned regardless.
            Self::verdict(tag, Verdict::Ignore, out);
        }
        self.metrics.equivocations += 1;
        // Only keys already in the peer table are blamed: a proof about a stranger must not
        // add it there (1,024 such proofs used to fill the table for good).
        if !self.is_banned(&sender) && self.peers.contains_key(&sender) {
            self.blame(sender, Offence::Equivocation { sender, step }, out);
        }
    }

    /// Note the first step in which `peer` was heard from (for probation).
    pub(super) fn seen(&mut self, peer: NodeId, step: u64) {
        if let Some(p) = self.peer_mut(peer) {
            if p.first_step.is_none_or(|f| step < f) {
                p.first_step = Some(step);
            }
        }
    }

    /// Whether `peer` is on probation here: first heard from more than `probation_steps`
    /// after this node synced (nodes present from the start vouch for each other), and not
    /// yet past a spot check.
    pub(super) fn on_probation(&self, peer: &NodeId) -> bool {
        let d = &self.run.defence;
        if d.probation_steps == 0 || *peer == self.me_id {
            return false;
        }
        let start = self.run.timing.step_at(self.synced_at);
        self.peers.get(peer).is_none_or(|p| {
            p.passed == 0
                && p.first_step
                    .is_none_or(|f| f > start + d.probation_steps as u64)
        })
    }

    /// Whether this node lists `sender`'s update of `step` in its summary.
    pub(super) fn listable(&self, sender: NodeId, copy: bool, _step: u64) -> bool {
        if sender == self.me_id {
            return true;
        }
        if copy {
            return false;
        }
        if self
            .peers
            .get(&sender)
            .is_some_and(|p| p.rep <= REP_OFFENDER)
        {
            return false;
        }
        !self.on_probation(&sender)
    }

    /// Sample up to `spot_checks` of the step's updates from others: peers on probation first,
    /// then the least checked (ties broken by the seeded generator), so every peer is checked
    /// regularly and newcomers quickly.
    pub(super) fn spot_checks(
        &mut self,
        step: u64,
        held: &[(NodeId, ContentId, bool)],
        out: &mut Vec<Action>,
    ) {
        let c = self.run.defence.spot_checks as usize;
        if c == 0 {
            return;
        }
        let mut cand: Vec<(bool, u32, u64, NodeId, ContentId)> = Vec::new();
        let done = self
            .steps
            .get(&step)
            .map(|s| s.checked.clone())
            .unwrap_or_default();
        for &(snd, id, _) in held {
            if snd == self.me_id || done.contains(&snd) {
                continue;
            }
            let checks = self.peers.get(&snd).map_or(0, |p| p.checks);
            let r = self.next_rand();
            cand.push((!self.on_probation(&snd), checks, r, snd, id));
        }
        cand.sort();
        for &(_, _, _, snd, id) in cand.iter().take(c) {
            self.check(step, snd, id, out);
        }
    }

    /// Ask the trainer to spot-check `sender`'s update `id` of `step`, once per step. Returns
    /// whether a check was asked for.
    pub(super) fn check(
        &mut self,
        step: u64,
        sender: NodeId,
        id: ContentId,
        out: &mut Vec<Action>,
    ) -> bool {
        let Some(st) = self.steps.get_mut(&step) else {
            return false;
        };
        let Some((b, tokens)) = st
            .headers
            .get(&sender)
            .filter(|e| e.header.body.blob == id)
            .and_then(|e| Some((e.blob.clone()?, e.header.body.tokens)))
        else {
            return false;
        };
        if !st.checked.insert(sender) {
            return false;
        }
        self.metrics.spot_checks += 1;
        if let Some(p) = self.peer_mut(sender) {
            p.checks += 1;
        }
        out.push(Action::SpotCheck {
            step,
            sender,
            blob: id,
            tokens,
            bytes: Blob(b),
        });
        true
    }

    /// Someone's spot check failed: repeat it here (see `Defence::accuse`). The accusation is
    /// forwarded if it is well-formed and the first of its accuser for the step; it proves
    /// nothing by itself, so it never lowers anyone's reputation directly.
    pub(super) fn on_accusation(
        &mut self,
        from: NodeId,
        tag: Option<u64>,
        a: Signed<Accusation>,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let (step, accuser, accused) = (a.body.step, a.body.accuser, a.body.accused);
        if !self.run.defence.accuse || a.body.run != self.run_id {
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        if let Err(e) = self.in_window(step, now) {
            Self::verdict(tag, Verdict::Ignore, out);
            return self.blame(from, e, out);
        }
        if self.is_banned(&accuser) || accuser == accused {
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        // Cheap checks before the signature. An accusation is not priced: only a peer this
        // node has heard a signed, priced header or summary from may accuse (an honest accuser
        // is a synced trainer that summarizes every step), one accusation per accuser and step
        // counts, and a step holds at most `max_updates_per_step` accusers. Fresh keys cannot
        // fill the store nor spend this node's checks.
        let heard = self
            .peers
            .get(&accuser)
            .is_some_and(|p| p.first_step.is_some());
        let max = self.run.limits.max_updates_per_step as usize;
        let held = self.steps.get(&step).map_or(0, |st| st.accusers.len());
        if !heard
            || held >= max
            || self
                .steps
                .get(&step)
                .is_some_and(|st| st.accusers.contains(&accuser))
        {
            // The rest are not forwarded.
            return Self::verdict(tag, Verdict::Ignore, out);
        }
        if let Err(e) = a.verify() {
            Self::verdict(tag, Verdict::Reject, out);
            return self.blame(from, e, out);
        }
        let budget = 2 * self.run.defence.spot_checks;
        let st = self.steps.entry(step).or_default();
        st.accusers.insert(accuser);
        Self::verdict(tag, Verdict::Accept, out);
        let synced = self.sync == SyncState::Synced;
        if accused != self.me_id && synced && st.repeats < budget {
            if self.check(step, accused, a.body.blob, out) {
                self.steps.get_mut(&step).expect("entered above").repeats += 1;
                self.metrics.repeated_checks += 1;
            }
        }
    }

    pub(super) fn on_spot(
        &mut self,
        step: u64,
        sender: NodeId,
        blob: ContentId,
        gain: f64,
        out: &mut Vec<Action>,
    ) {
        if sender == self.me_id {
            return;
        }
        // Helped on its own data: earned. Otherwise (no better, or worse, or not a number) a
        // strike; a persistent offender's strikes add up to a ban through the penalty score.
        let ok = gain > 0.0;
        let rep = match self.peer_mut(sender) {
            Some(p) => {
                if ok {
                    p.passed += 1;
                    p.rep = (p.rep + 1).min(REP_MAX);
                } else {
                    p.rep -= REP_FAIL;
                }
                p.rep
            }
            None => return,
        };
        out.push(Action::Report(Report::SpotResult {
            sender,
            step,
            gain,
            reputation: rep,
        }));
        if !ok {
            self.metrics.spot_failures += 1;
            if self.run.defence.accuse && self.sync == SyncState::Synced {
                let a = Accusation {
                    run: self.run_id,
                    step,
                    accuser: self.me_id,
                    accused: sender,
                    blob,
                };
                // Counted as heard here, so our own accusation coming back is not forwarded.
                self.steps
                    .entry(step)
                    .or_default()
                    .accusers
                    .insert(self.me_id);
                out.push(Action::Publish {
                    bytes: Message::Accusation(Signed::sign(a, &self.me)).encode(),
                });
            }
            if rep <= REP_OFFENDER {
                self.blame(sender, Offence::HarmfulUpdate, out);
            }
        }
    }

    /// Compare the newest update of `sender` in `step` with the others held for the step;
    /// if it overlaps one of them beyond the threshold, it is the later one: a copy.
    pub(super) fn detect_copy(&mut self, step: u64, sender: NodeId, out: &mut Vec<Action>) {
        let th = self.run.defence.copy_overlap_permille;
        if th == 0 {
            return;
        }
        let Some(st) = self.steps.get(&step) else {
            return;
        };
        let Some(me) = st.headers.get(&sender) else {
            return;
        };
        let mut hit = None;
        for (other, e) in &st.headers {
            if *other == sender || e.sketch.is_empty() || e.invalid || e.copy {
                continue;
            }
            let o = overlap_permille(&me.sketch, &e.sketch);
            if o >= th {
                hit = Some((*other, o));
                break;
            }
        }
        if let Some((of, o)) = hit {
            if let Some(e) = self
                .steps
                .get_mut(&step)
                .and_then(|s| s.headers.get_mut(&sender))
            {
                e.copy = true;
            }
            self.metrics.copies += 1;
            out.push(Action::Report(Report::CopySuspected {
                sender,
                of,
                step,
                overlap_permille: o,
            }));
            if sender != self.me_id {
                if let Some(p) = self.peer_mut(sender) {
                    p.rep -= REP_FAIL;
                }
                self.blame(sender, Offence::Copy, out);
            }
        }
    }

    /// This peer's local reputation (spot checks and copies; 0 = unknown).
    pub fn reputation(&self, peer: &NodeId) -> i32 {
        self.peers.get(peer).map_or(0, |p| p.rep)
    }
}

/// A consistent hash sample of an update's kept (tensor, block, index, sign) entries: the same
/// entry is kept in every update's sample, so two samples' overlap estimates the overlap of the
/// updates (about `SKETCH_KEYS` keys, whatever the model size).
pub(super) fn sketch(u: &crate::sparse::SparseUpdate) -> Vec<u64> {
    let total: u64 = u
        .tensors
        .iter()
        .map(|t| t.entries(u.codec).0.len() as u64)
        .sum();
    let limit = if total <= SKETCH_KEYS {
        u64::MAX
    } else {
        (u64::MAX / total).saturating_mul(SKETCH_KEYS)
    };
    let mut keys = Vec::new();
    for (ti, t) in u.tensors.iter().enumerate() {
        let k = (t.k as usize).max(1);
        let (idx, val) = t.entries(u.codec);
        for (j, (&i, &v)) in idx.iter().zip(&val).enumerate() {
            let raw = ((ti as u64) << 48)
                ^ (((j / k) as u64) << 20)
                ^ ((i as u64) << 1)
                ^ (v.is_sign_negative() as u64);
            let h = crate::rng::mix(raw);
            if h <= limit {
                keys.push(h);
            }
        }
    }
    keys.sort_unstable();
    keys.dedup();
    keys
}

/// Common keys of two sorted samples, in ‰ of the smaller.
pub(super) fn overlap_permille(a: &[u64], b: &[u64]) -> u32 {
    let (mut i, mut j, mut n) = (0, 0, 0u64);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => {
                n += 1;
                i += 1;
                j += 1;
            }
        }
    }
    let d = a.len().min(b.len()).max(1) as u64;
    (n * 1000 / d) as u32
}
