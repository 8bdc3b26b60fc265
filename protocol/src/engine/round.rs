//! The round: which steps' windows are open, the node's own update (header, first hops,
//! uploads), and the clock that publishes summaries, applies steps, prunes and sets the timer.

use super::*;

impl Engine {
    /// Oldest step still kept: older messages are replays.
    pub(super) fn lo_step(&self, now: u64) -> u64 {
        let past = self.run.limits.past_steps as u64;
        match self.sync {
            SyncState::Synced => self.version.saturating_sub(past),
            SyncState::Joining { .. } => self.run.timing.step_at(now).saturating_sub(past + 2),
        }
    }

    pub(super) fn hi_step(&self, now: u64) -> u64 {
        self.run.timing.step_at(now) + self.run.limits.future_steps as u64
    }

    pub(super) fn in_window(&self, step: u64, now: u64) -> Result<(), Offence> {
        let (lo, hi) = (self.lo_step(now), self.hi_step(now));
        if step < lo || step > hi {
            return Err(Offence::StepOutOfWindow { step, lo, hi });
        }
        Ok(())
    }

    /// Whether step `step` is already applied (or being applied) here.
    pub(super) fn closed(&self, step: u64) -> bool {
        self.sync == SyncState::Synced && (step < self.version || self.applying == Some(step))
    }

    pub(super) fn on_local(
        &mut self,
        step: u64,
        blob: Vec<u8>,
        tokens: u64,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let refuse = |error, out: &mut Vec<Action>| {
            out.push(Action::Report(Report::LocalRefused { step, error }))
        };
        if self.sync != SyncState::Synced {
            return refuse(Offence::Checkpoint("not synced"), out);
        }
        if now > self.run.timing.publish_deadline(step) || self.closed(step) {
            return refuse(Offence::Late { step }, out);
        }
        if let Err(e) = self.in_window(step, now) {
            return refuse(e, out);
        }
        if self
            .steps
            .get(&step)
            .is_some_and(|s| s.headers.contains_key(&self.me_id))
        {
            // A second update for one step would be an equivocation: never sign one.
            return refuse(Offence::Duplicate, out);
        }
        let header = UpdateHeader {
            run: self.run_id,
            step,
            sender: self.me_id,
            blob: UpdateHeader::blob_id(&self.me_id, step, &blob),
            blob_len: blob.len() as u64,
            codec: self.rules.codec,
            topk: self.rules.topk,
            chunk: self.rules.chunk,
            tokens,
            base_version: self.version,
            base_digest: self.digest,
            pow: self.pow,
        };
        let sketch = match self
            .rules
            .check_header(&header)
            .and_then(|_| self.rules.check_blob(&header, &blob))
        {
            Ok(u) => sketch(&u),
            Err(e) => return refuse(e, out),
        };
        // This node's update takes a slot like a known peer's: added on top of a full table
        // it made this node's summary list `max + 1` updates, which every peer refuses (and
        // blames this node for) — a crowd of keys that stayed a step could do that to every
        // honest node (issue 13, item 5). A lower-standing occupant makes room; a table full
        // of known peers keeps this node's update out here as it would anywhere else.
        let occupants: Vec<NodeId> = self
            .steps
            .get(&step)
            .map(|s| s.headers.keys().copied().collect())
            .unwrap_or_default();
        match self.slot(&occupants, self.me_id, step) {
            Some(Some(victim)) => self.evict_header(step, victim, out),
            Some(None) => {}
            None => return refuse(Offence::BufferFull("updates per step"), out),
        }
        let signed = Signed::sign(header, &self.me);
        // With a first-hop relay connected, upload the update to it once and let it gossip
        // the header and serve the blob (a slow uplink then carries each update once). Should
        // the relay withhold it, this node's own summary still lists the blob at the publish
        // deadline and peers fetch it from here: the update is late, never lost.
        let send = match self.relays().first() {
            Some(&peer) => {
                self.metrics.uploads += 1;
                let bytes = Message::Update {
                    header: signed.clone(),
                    blob: blob.clone(),
                };
                Action::Send {
                    peer,
                    bytes: bytes.encode(),
                }
            }
            None => {
                let inline = blob.len() <= self.run.limits.inline_blob_bytes as usize;
                let bytes = Message::Announce {
                    header: signed.clone(),
                    blob: inline.then(|| blob.clone()),
                };
                Action::Publish {
                    bytes: bytes.encode(),
                }
            }
        };
        self.by_blob.insert((signed.body.blob, step), self.me_id);
        self.steps.entry(step).or_default().headers.insert(
            self.me_id,
            Entry {
                header: signed,
                blob: Some(blob.into()),
                invalid: false,
                sketch,
                copy: false,
                contradicted: false,
                frame: None,
            },
        );
        out.push(send);
    }

    /// Where to fetch a blob from, in order: the first-hop relays (they gossip only headers
    /// whose blob they hold), then `first`, then `then`.
    pub(super) fn sources(&self, first: NodeId, then: NodeId) -> Vec<NodeId> {
        let mut v = self.relays();
        v.extend([first, then]);
        v
    }

    /// Trusted peers that are connected and announced [`caps::RELAY`] (not banned, not this
    /// node), lowest id first so every node picks the same one; at most two, because each is
    /// asked first for every blob and a withholding one costs a failed fetch before the
    /// fallback.
    pub(super) fn relays(&self) -> Vec<NodeId> {
        if self.capabilities & caps::RELAY != 0 {
            return Vec::new();
        }
        self.trusted_relays
            .iter()
            .filter(|n| {
                **n != self.me_id
                    && self.peers.get(n).is_some_and(|p| {
                        p.connected && !p.banned && p.capabilities & caps::RELAY != 0
                    })
            })
            .copied()
            .take(2)
            .collect()
    }

    /// A relay's side of an upload: `Message::Update` sent directly by its signer. Checked as a
    /// gossiped header with its blob (the same deadline, the same rules); once the blob checks
    /// out, the header alone is gossiped, and peers fetch the blob from here.
    pub(super) fn on_upload(
        &mut self,
        from: NodeId,
        header: Signed<UpdateHeader>,
        blob: Vec<u8>,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let (step, sender) = (header.body.step, header.body.sender);
        if from != sender {
            // Only a signer uploads its own update; anything else is not for us to spread.
            self.metrics.ignored += 1;
            return;
        }
        match self.accept_header(from, header.clone(), Via::Gossip, now, out) {
            Err((e, _)) => return self.blame(from, e, out),
            Ok(false) => {
                self.metrics.duplicates += 1;
                return;
            }
            Ok(true) => {}
        }
        if self.accept_blob(from, step, sender, blob, out) {
            self.metrics.relayed += 1;
            out.push(Action::Publish {
                bytes: Message::Announce { header, blob: None }.encode(),
            });
        }
    }

    pub(super) fn tick(&mut self, now: u64, out: &mut Vec<Action>) {
        self.tick_joining(now, out);
        // While joining nothing is applied, so the window moves with the clock: prune here too.
        if self.sync != SyncState::Synced {
            self.prune(now, out);
        }
        let t = self.run.timing.clone();
        let synced = self.sync == SyncState::Synced;
        // Step starts: only the current one (a node that slept skips what it missed).
        if synced && now >= t.genesis_ms {
            let cur = t.step_at(now);
            if cur >= self.next_start {
                self.next_start = cur + 1;
                out.push(Action::StartStep {
                    step: cur,
                    base_version: self.version,
                });
            }
        }
        // Summaries at each publish deadline.
        while now >= t.publish_deadline(self.next_summary) {
            let step = self.next_summary;
            self.next_summary += 1;
            self.summarize(step, now, synced, &t, out);
        }
        // Apply the next step once its time has come and what the summaries list is here (or
        // can no longer be had).
        if self.sync == SyncState::Synced && self.applying.is_none() {
            let step = self.version;
            if now >= t.apply_at(step) {
                self.try_apply(step, now, &t, out);
            }
        }
    }

    /// Step `step`'s publish deadline has passed: spot-checks what is held and, while it can
    /// still count, publishes this node's summary of it.
    fn summarize(
        &mut self,
        step: u64,
        now: u64,
        synced: bool,
        t: &crate::run::StepTiming,
        out: &mut Vec<Action>,
    ) {
        let st = self.steps.entry(step).or_default();
        let held: Vec<(NodeId, ContentId, bool)> = st
            .headers
            .iter()
            .filter(|(s, e)| e.blob.is_some() && !e.invalid && !st.equivocators.contains(*s))
            .map(|(s, e)| (*s, e.header.body.blob, e.copy))
            .collect();
        // What this node vouches for: not what its own checks condemned (see `listable`).
        let mut ids: Vec<ContentId> = Vec::with_capacity(held.len());
        for &(snd, id, copy) in &held {
            if self.listable(snd, copy, step) {
                ids.push(id);
            } else {
                self.metrics.withheld += 1;
            }
        }
        // Exact copies share one id: a summary lists each id once (strictly ascending).
        ids.sort();
        ids.dedup();
        if synced {
            self.spot_checks(step, &held, out);
        }
        // Our own view counts toward inclusion only if others heard it too: a summary that
        // was never published (while joining, or after sleeping past apply time) would let
        // this node include what nobody else does.
        if synced && now <= t.apply_at(step) {
            self.steps.entry(step).or_default().mine = Some(ids.clone());
            let s = StepSummary {
                run: self.run_id,
                step,
                sender: self.me_id,
                updates: ids,
                params_version: self.version,
                params_digest: self.digest,
                pow: self.pow,
            };
            out.push(Action::Publish {
                bytes: Message::Summary(Signed::sign(s, &self.me)).encode(),
            });
        }
    }

    /// Applies step `step` (its apply time has come) if every update its summaries list is
    /// here, or cannot be had any more, or the hard deadline has passed.
    fn try_apply(
        &mut self,
        step: u64,
        now: u64,
        t: &crate::run::StepTiming,
        out: &mut Vec<Action>,
    ) {
        let hard = t.apply_at(step).max(self.synced_at) + t.grace_ms;
        let listed = self.listed(step);
        let (included, missing, waiting) = self.gather(step, &listed);
        if !waiting || now >= hard {
            let n = included.len() as u32;
            for u in &included {
                if let Some(p) = self.peers.get_mut(&u.sender) {
                    p.included = p.included.saturating_add(1);
                }
            }
            self.metrics.steps_applied += 1;
            self.metrics.updates_applied += n as u64;
            self.applying = Some(step);
            out.push(Action::Report(Report::StepApplied {
                step,
                included: n,
                listed: listed.len() as u32,
                missing,
            }));
            out.push(Action::Apply {
                step,
                updates: included,
            });
            let stale: Vec<ContentId> = self
                .wants
                .iter()
                .filter(|(_, w)| w.step <= step)
                .map(|(id, _)| *id)
                .collect();
            for id in stale {
                self.resolve_want(id, Verdict::Ignore, out);
            }
        }
    }

    /// The blob ids step `step`'s summaries list, by the run's rule (union or majority).
    fn listed(&mut self, step: u64) -> BTreeSet<ContentId> {
        let majority = self.run.defence.majority;
        let st = self.steps.entry(step).or_default();
        // One voter per summary (ours included when it was published).
        let mut tally = Tally::new();
        if let Some(m) = &st.mine {
            tally.voter(m.iter().copied());
        }
        for (p, s) in &st.summaries {
            if !self.peers.get(p).is_some_and(|x| x.banned) {
                tally.voter(s.body.updates.iter().copied());
            }
        }
        // Union (any summary suffices), or with `Defence::majority` more than half of
        // the summaries: then a hostile minority can neither push its own updates in
        // nor keep honest ones out.
        let before = tally.choices() as u64;
        let listed: BTreeSet<ContentId> = tally.chosen(!majority).collect();
        self.metrics.outvoted += before - listed.len() as u64;
        listed
    }

    /// The listed updates held here for step `step` (equivocators' left out), how many are
    /// missing, and whether a fetch for one of them is still under way.
    fn gather(&self, step: u64, listed: &BTreeSet<ContentId>) -> (Vec<Included>, u32, bool) {
        let st = &self.steps[&step];
        let mut included = Vec::new();
        let mut missing = 0u32;
        let mut waiting = false;
        for id in listed {
            let e = self
                .by_blob
                .get(&(*id, step))
                .and_then(|snd| st.headers.get(snd).map(|e| (snd, e)));
            match e {
                Some((snd, e)) if e.blob.is_some() && !e.invalid => {
                    if !st.equivocators.contains(snd) {
                        included.push(Included {
                            blob: *id,
                            sender: *snd,
                            tokens: e.header.body.tokens,
                            bytes: Blob(e.blob.clone().expect("checked")),
                        });
                    }
                }
                Some((_, e)) if e.invalid => {}
                _ => {
                    missing += 1;
                    waiting |= self.wants.get(id).is_some_and(|w| !w.exhausted());
                }
            }
        }
        (included, missing, waiting)
    }

    /// Drop what is older than the kept window.
    pub(super) fn prune(&mut self, now: u64, out: &mut Vec<Action>) {
        // Penalty scores decay, one step at a time: small penalties an honest peer collects
        // now and then (skew, a lost race) must not add up to a ban over a long run. A peer
        // that keeps offending outpaces the decay; a ban itself is for good.
        let cur = self.run.timing.step_at(now);
        if cur > self.decayed_at {
            let steps = (cur - self.decayed_at).min(64) as u32;
            self.decayed_at = cur;
            for p in self.peers.values_mut().filter(|p| !p.banned) {
                for _ in 0..steps {
                    p.score = p.score.saturating_sub((p.score / 16).max(1));
                }
            }
        }
        let lo = self.lo_step(now);
        let keep = self.steps.split_off(&lo);
        let old = std::mem::replace(&mut self.steps, keep);
        for (k, st) in &old {
            for e in st.headers.values() {
                self.by_blob.remove(&(e.header.body.blob, *k));
            }
        }
        let stale: Vec<ContentId> = self
            .wants
            .iter()
            .filter(|(_, w)| w.step < lo)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.resolve_want(id, Verdict::Ignore, out);
        }
        let alo = self
            .run
            .timing
            .step_at(now)
            .saturating_sub(self.run.limits.past_steps as u64 + 2)
            .min(lo);
        self.attest = self.attest.split_off(&alo);
    }

    /// The next instant this engine must be woken at (see [`Engine::poll_timeout`]).
    pub(super) fn schedule(&mut self, now: u64) {
        let t = &self.run.timing;
        let mut at = t.publish_deadline(self.next_summary);
        if self.sync == SyncState::Synced {
            at = at.min(t.step_start(self.next_start));
            if self.applying.is_none() {
                let a = t.apply_at(self.version);
                // While waiting on fetches past apply time, wake at the hard deadline.
                at = at.min(if a <= now {
                    a.max(self.synced_at) + t.grace_ms
                } else {
                    a
                });
            }
        }
        // A fetch in flight is given up at its time-out: wake then to ask the next candidate.
        if let Some(f) = self.next_fetch_timeout() {
            at = at.min(f);
        }
        // A checkpoint download's deadline, or the end of its back-off.
        if let Some(c) = self.checkpoint_wakeup(now) {
            at = at.min(c);
        }
        // A wake-up already due has fired (or is being handled now): forget it, so that
        // `poll_timeout` never names an instant in the past.
        if self.timer.is_some_and(|t| t <= now) {
            self.timer = None;
        }
        if at > now {
            self.timer = Some(at);
        }
    }
}
