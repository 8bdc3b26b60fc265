//! Messages from peers: hello, announce (header with or without its blob), summaries;
//! the slots a step has for headers and who is credited with which blob.

use super::*;

impl Engine {
    pub(super) fn on_message(
        &mut self,
        from: NodeId,
        tag: Option<u64>,
        bytes: &[u8],
        now: u64,
        out: &mut Vec<Action>,
    ) {
        self.metrics.messages += 1;
        if self.is_banned(&from) {
            Self::verdict(tag, Verdict::Ignore, out);
            return;
        }
        let msg = match Message::decode(bytes, &self.run.limits) {
            Ok(m) => m,
            Err(e) => {
                self.refuse(from, tag, e.into(), out);
                return;
            }
        };
        match msg {
            Message::Hello(h) => self.on_hello(from, h, out),
            Message::Announce { header, blob } => {
                self.on_announce(from, tag, header, blob, now, out)
            }
            Message::Summary(s) => self.on_summary(from, tag, s, now, out),
            Message::Equivocation(p) => self.on_proof(from, tag, Proof::Headers(p), now, out),
            Message::SummaryEquivocation(p) => {
                self.on_proof(from, tag, Proof::Summaries(p), now, out)
            }
            Message::Accusation(a) => self.on_accusation(from, tag, a, now, out),
            Message::Update { header, blob }
                if tag.is_none() && self.capabilities & caps::RELAY != 0 =>
            {
                self.on_upload(from, header, blob, now, out)
            }
            other => {
                // Updates, manifests and chunks come as responses, never as gossip.
                Self::verdict(tag, Verdict::Reject, out);
                self.blame(from, Offence::UnexpectedKind { kind: other.kind() }, out);
            }
        }
    }

    pub(super) fn on_hello(&mut self, from: NodeId, h: Hello, out: &mut Vec<Action>) {
        if h.node != from {
            return self.blame(
                from,
                Offence::IdentityMismatch {
                    claimed: h.node,
                    peer: from,
                },
                out,
            );
        }
        if h.run != self.run_id {
            return self.blame(from, Offence::WrongRun, out);
        }
        if h.version != PROTOCOL_VERSION {
            return self.blame(
                from,
                Offence::VersionMismatch {
                    got: h.version,
                    want: PROTOCOL_VERSION,
                },
                out,
            );
        }
        if let Some(p) = self.peer_mut(from) {
            p.connected = true;
            p.capabilities = h.capabilities;
        }
        // A Hello's parameter version and digest are a hint for operators, never a vote: a
        // Hello is neither signed over the run nor priced by proof of work, so counting it let
        // three throwaway keys declare a node desynced and hand it their parameters. Only
        // signed summaries attest (`add_attest`).
    }

    pub(super) fn on_announce(
        &mut self,
        from: NodeId,
        tag: Option<u64>,
        header: Signed<UpdateHeader>,
        blob: Option<Vec<u8>>,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let (step, sender) = (header.body.step, header.body.sender);
        let claimed = self
            .by_blob
            .get(&(header.body.blob, step))
            .is_some_and(|o| *o != sender);
        if claimed && blob.as_deref().is_some_and(|b| header.body.names(b)) {
            // Bytes bound to this header's sender and step by the id: another key that claimed
            // the id first re-signed it (see `contradict_claims`). No signature is needed for
            // that conclusion: only these bytes under this sender hash to the id.
            self.contradict_claims(&header.body, out);
        }
        match self.accept_header(from, header, Via::Gossip, now, out) {
            Err((e, v)) => {
                Self::verdict(tag, v, out);
                return self.blame(from, e, out);
            }
            Ok(false) => {
                self.metrics.duplicates += 1;
                return Self::verdict(tag, Verdict::Ignore, out);
            }
            Ok(true) => {}
        }
        let id = self.steps[&step].headers[&sender].header.body.blob;
        match blob {
            Some(b) => {
                let ok = self.accept_blob(from, step, sender, b, out);
                Self::verdict(tag, if ok { Verdict::Accept } else { Verdict::Reject }, out);
            }
            None => {
                // Whoever relayed the header forwards only what it verified: after a first-hop
                // relay (see `sources`), ask it, then the sender.
                let added = self.want(id, step, Why::Header, &self.sources(from, sender), out);
                match (added, tag) {
                    (true, Some(t)) => self.wants.get_mut(&id).expect("just added").tags.push(t),
                    (false, _) => Self::verdict(tag, Verdict::Ignore, out),
                    _ => {}
                }
            }
        }
    }

    /// Check and store a header. `Ok(true)`: new; `Ok(false)`: already held. On error, the
    /// caller blames the relay; blame of the signer is done here.
    pub(super) fn accept_header(
        &mut self,
        from: NodeId,
        header: Signed<UpdateHeader>,
        via: Via,
        now: u64,
        out: &mut Vec<Action>,
    ) -> Result<bool, (Offence, Verdict)> {
        let h = &header.body;
        let (step, sender) = (h.step, h.sender);
        if h.run != self.run_id {
            return Err((Offence::WrongRun, Verdict::Ignore));
        }
        self.in_window(step, now)
            .map_err(|e| (e, Verdict::Ignore))?;
        let late = match via {
            Via::Gossip => now > self.run.timing.publish_deadline(step),
            Via::Fetch => false,
        };
        if late || self.closed(step) {
            self.metrics.late += 1;
            return Err((Offence::Late { step }, Verdict::Ignore));
        }
        if self.is_banned(&sender) {
            return Err((Offence::Banned, Verdict::Ignore));
        }
        header.verify().map_err(|e| (e, Verdict::Reject))?;
        if let Err(e) = self.rules.check_header(h) {
            // Signed by the sender: its fault too.
            if sender != from {
                self.blame(sender, e.clone(), out);
            }
            return Err((e, Verdict::Reject));
        }
        let st = self.steps.entry(step).or_default();
        if st.equivocators.contains(&sender) {
            return Ok(false);
        }
        if let Some(prev) = st.headers.get(&sender) {
            if prev.header.raw == header.raw {
                return Ok(false);
            }
            // Two different validly signed headers: publish both as the proof, ban the sender.
            let proof = EquivocationProof::new(prev.header.clone(), header);
            st.equivocators.insert(sender);
            self.metrics.equivocations += 1;
            out.push(Action::Publish {
                bytes: Message::Equivocation(proof).encode(),
            });
            let e = Offence::Equivocation { sender, step };
            self.blame(sender, e, out);
            return Ok(false);
        }
        let occupants: Vec<NodeId> = st.headers.keys().copied().collect();
        let evict = self
            .slot(&occupants, sender, step)
            .ok_or((Offence::BufferFull("updates per step"), Verdict::Ignore))?;
        let l = &self.run.limits;
        let st = &self.steps[&step];
        if let Some(owner) = self.by_blob.get(&(h.blob, step)) {
            // Another sender already claimed this exact blob for this step (a copy): first
            // wins, unless that claim was shown false (its length contradicts the blob) or
            // its signer equivocated: then the slot goes to this header, so that a key which
            // re-signs an honest blob id cannot keep the honest header out.
            let void = st.headers.get(owner).is_none_or(|e| e.contradicted)
                || st.equivocators.contains(owner);
            if !void {
                return Err((Offence::Duplicate, Verdict::Ignore));
            }
        }
        let cur = self.run.timing.step_at(now);
        if step > cur {
            let early: usize = self
                .steps
                .range(cur + 1..)
                .map(|(_, s)| s.headers.len())
                .sum();
            if early >= l.max_early_updates as usize {
                return Err((Offence::BufferFull("early updates"), Verdict::Ignore));
            }
            self.metrics.early += 1;
        }
        if let Some(v) = evict {
            self.evict_header(step, v, out);
        }
        self.by_blob.insert((h.blob, step), sender);
        self.seen(sender, step);
        let st = self.steps.entry(step).or_default();
        st.headers.insert(
            sender,
            Entry {
                header,
                blob: None,
                invalid: false,
                sketch: Vec::new(),
                copy: false,
                contradicted: false,
                frame: None,
            },
        );
        Ok(true)
    }

    /// How much a peer's message in `step` is worth keeping when a per-step table is full:
    /// 3 for this node and the peers whose standing no throwaway key can earn quickly (present
    /// from its start, a trusted relay, updates in many applied steps), 2 for one known
    /// otherwise (a passed spot check or reputation: a free rider's constant update can pass
    /// a check by chance, and the real-process drill saw such crowd keys, level with the
    /// peers of the start, keep a late honest update out at one node), 1 for one first heard
    /// from in an earlier step, 0 for one first heard from now.
    pub(super) fn standing(&self, peer: &NodeId, step: u64) -> u8 {
        if *peer == self.me_id || self.established(peer) {
            3
        } else if self.known(peer) {
            2
        } else if self
            .peers
            .get(peer)
            .and_then(|p| p.first_step)
            .is_some_and(|f| f < step)
        {
            1
        } else {
            0
        }
    }

    /// Whether `new` gets a slot among `occupants` (one step's headers or summaries, at most
    /// `max_updates_per_step`), and whom it displaces: `None` if refused, `Some(None)` if there
    /// is room, `Some(Some(victim))` to take the place of a peer of lower standing (the
    /// largest id among the lowest, so every node picks alike). Peers first heard from in this
    /// step hold at most half the slots: with first-come slots, 256 keys announcing early
    /// filled every node's table and training stopped, whatever the swarm's size.
    pub(super) fn slot(
        &self,
        occupants: &[NodeId],
        new: NodeId,
        step: u64,
    ) -> Option<Option<NodeId>> {
        let max = self.run.limits.max_updates_per_step as usize;
        let mine = self.standing(&new, step);
        let levels: Vec<(u8, NodeId)> = occupants
            .iter()
            .map(|p| (self.standing(p, step), *p))
            .collect();
        if mine == 0 && levels.iter().filter(|(l, _)| *l == 0).count() >= (max / 2).max(1) {
            return None;
        }
        if occupants.len() < max {
            return Some(None);
        }
        levels
            .iter()
            .filter(|(l, p)| *l < mine && *p != self.me_id)
            .min_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)))
            .map(|(_, p)| Some(*p))
    }

    /// Drop `victim`'s header of `step` to make room (see `slot`).
    pub(super) fn evict_header(&mut self, step: u64, victim: NodeId, out: &mut Vec<Action>) {
        let Some(e) = self
            .steps
            .get_mut(&step)
            .and_then(|st| st.headers.remove(&victim))
        else {
            return;
        };
        self.metrics.evicted_updates += 1;
        let id = e.header.body.blob;
        if self.by_blob.get(&(id, step)) == Some(&victim) {
            self.by_blob.remove(&(id, step));
        }
        let named = self
            .steps
            .values()
            .any(|st| st.headers.values().any(|x| x.header.body.blob == id));
        if !named {
            self.resolve_want(id, Verdict::Ignore, out);
        }
    }

    /// Validate and store the blob of a held header. Returns whether it was valid.
    pub(super) fn accept_blob(
        &mut self,
        from: NodeId,
        step: u64,
        sender: NodeId,
        blob: Vec<u8>,
        out: &mut Vec<Action>,
    ) -> bool {
        let Some(e) = self
            .steps
            .get_mut(&step)
            .and_then(|s| s.headers.get_mut(&sender))
        else {
            return false;
        };
        let id = e.header.body.blob;
        if e.blob.is_some() || e.invalid {
            let ok = !e.invalid;
            self.resolve_want(id, if ok { Verdict::Accept } else { Verdict::Reject }, out);
            return ok;
        }
        match self.rules.check_blob(&e.header.body, &blob) {
            Ok(u) => {
                let blob: Arc<[u8]> = blob.into();
                e.blob = Some(blob.clone());
                let sk = if self.run.defence.copy_overlap_permille > 0 {
                    sketch(&u)
                } else {
                    Vec::new()
                };
                e.sketch = sk;
                // The id is bound to its sender and step (`UpdateHeader::blob_id`), so no other
                // header can name these bytes truthfully: one that claimed the id re-signed it.
                let owner = e.header.body.clone();
                self.contradict_claims(&owner, out);
                self.resolve_want(id, Verdict::Accept, out);
                out.push(Action::Report(Report::Verified { step, sender }));
                self.detect_copy(step, sender, out);
                true
            }
            Err(err) => {
                // A blob that matches the signed id but is invalid is the sender's fault; one
                // that does not match the id is only the relay's. A length that differs from
                // the header's while the bytes hash to its id is the signer's: the id names
                // those bytes, so the header contradicts its own blob. (A key re-signing an
                // honest id names bytes bound to another sender: `contradict_claims` catches
                // it when the honest header and its bytes are at hand.)
                let contradicted = matches!(err, Offence::BlobLength { .. })
                    && UpdateHeader::blob_id(&sender, step, &blob) == id;
                let signer_fault = contradicted
                    || !matches!(
                        err,
                        Offence::BlobIdMismatch { .. } | Offence::BlobLength { .. }
                    );
                if signer_fault {
                    e.invalid = true;
                    e.contradicted = contradicted;
                    self.resolve_want(id, Verdict::Reject, out);
                    self.blame(sender, err.clone(), out);
                }
                if from != sender || !signer_fault {
                    self.blame(from, err, out);
                }
                false
            }
        }
    }

    pub(super) fn on_summary(
        &mut self,
        from: NodeId,
        tag: Option<u64>,
        s: Signed<StepSummary>,
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let (step, sender) = (s.body.step, s.body.sender);
        let res = (|| {
            if s.body.run != self.run_id {
                return Err((Offence::WrongRun, Verdict::Ignore));
            }
            self.in_window(step, now)
                .map_err(|e| (e, Verdict::Ignore))?;
            if now > self.run.timing.apply_at(step) || self.closed(step) {
                self.metrics.late += 1;
                return Err((Offence::Late { step }, Verdict::Ignore));
            }
            if self.is_banned(&sender) {
                return Err((Offence::Banned, Verdict::Ignore));
            }
            if sender == self.me_id {
                return Err((Offence::Duplicate, Verdict::Ignore));
            }
            let st = self.steps.entry(step).or_default();
            if st.equivocators.contains(&sender)
                || st.summaries.get(&sender).is_some_and(|p| p.raw == s.raw)
            {
                // Cheap checks first: a copy of what is held costs no signature check.
                return Err((Offence::Duplicate, Verdict::Ignore));
            }
            s.verify().map_err(|e| (e, Verdict::Reject))?;
            if !crypto::pow::check(
                &self.run_id.0,
                &sender,
                s.body.pow,
                self.run.defence.pow_bits,
            ) {
                return Err((Offence::NoWork, Verdict::Reject));
            }
            let st = self.steps.entry(step).or_default();
            if st.summaries.contains_key(&sender) {
                return Err((Offence::Equivocation { sender, step }, Verdict::Ignore));
            }
            let occupants: Vec<NodeId> = st.summaries.keys().copied().collect();
            let evict = self
                .slot(&occupants, sender, step)
                .ok_or((Offence::BufferFull("summaries per step"), Verdict::Ignore))?;
            let st = self.steps.entry(step).or_default();
            if let Some(v) = evict {
                st.summaries.remove(&v);
                self.metrics.evicted_updates += 1;
            }
            st.summaries.insert(sender, s.clone());
            Ok(())
        })();
        if let Err((e, v)) = res {
            Self::verdict(tag, v, out);
            match e {
                Offence::Duplicate => self.metrics.duplicates += 1,
                Offence::Equivocation { .. } => {
                    // Two different validly signed summaries for one step. The sender's
                    // summary and updates are out of the step here, and the proof goes to
                    // everyone so that every node leaves out the same (SECURITY.md).
                    let st = self.steps.entry(step).or_default();
                    let prev = st.summaries.remove(&sender).expect("checked above");
                    st.equivocators.insert(sender);
                    self.metrics.equivocations += 1;
                    let frame =
                        Message::SummaryEquivocation(SummaryEquivocation::new(prev, s)).encode();
                    // Two summaries of a run whose summaries may be large can exceed a frame:
                    // then only this node knows (the digest vote repairs the rest).
                    if frame.len() <= self.run.limits.max_message_bytes as usize {
                        out.push(Action::Publish { bytes: frame });
                    }
                    self.blame(sender, e, out);
                }
                _ => self.blame(from, e, out),
            }
            return;
        }
        Self::verdict(tag, Verdict::Accept, out);
        self.seen(sender, step);
        self.add_attest(s.body.params_version, sender, s.body.params_digest, now);
        for id in &s.body.updates {
            let held = self
                .by_blob
                .get(&(*id, step))
                .and_then(|snd| self.steps.get(&step)?.headers.get(snd))
                .is_some_and(|e| e.blob.is_some() || (e.invalid && !e.contradicted));
            if !held {
                self.want(
                    *id,
                    step,
                    Why::Listed(sender),
                    &self.sources(sender, from),
                    out,
                );
            }
        }
        self.check_desync(out);
    }
}
