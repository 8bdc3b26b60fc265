//! Fetching: which blobs are wanted and why (their priority when the queue is full), which
//! candidate to ask next, what a fetched blob is checked against; serving blobs to peers within
//! a budget.

use super::*;

pub(super) struct Want {
    pub(super) step: u64,
    pub(super) candidates: Vec<NodeId>,
    pub(super) tried: Vec<bool>,
    pub(super) inflight: Option<NodeId>,
    /// When the fetch in flight was sent (unix ms): past `since + fetch_timeout`, while a
    /// candidate is untried, that one is asked too.
    pub(super) since: u64,
    /// Peers asked earlier whose fetch timed out here but has neither answered nor failed:
    /// their answer is still taken, and the want is not exhausted while they may give one.
    pub(super) pending: Vec<NodeId>,
    /// Gossip tags whose verdict waits on this blob.
    pub(super) tags: Vec<u64>,
    /// A held, signed header names this blob.
    pub(super) headed: bool,
    /// Summary senders that listed it (the first two: all that the priority needs).
    pub(super) listers: Vec<NodeId>,
    /// A trusted relay or a known peer listed it.
    pub(super) vouched: bool,
}

impl Want {
    pub(super) fn exhausted(&self) -> bool {
        self.inflight.is_none() && self.pending.is_empty() && self.tried.iter().all(|&t| t)
    }

    /// `peer` was asked for the blob and may still answer: the fetch in flight, or one that
    /// timed out here (a slow honest server may still be the first to deliver).
    pub(super) fn awaits(&self, peer: NodeId) -> bool {
        self.inflight == Some(peer) || self.pending.contains(&peer)
    }

    fn untried(&self) -> bool {
        self.tried.iter().any(|&t| !t)
    }

    /// What a full fetch queue keeps: a blob a held header names (2), one that two
    /// independent summaries or a trusted or known peer list (1), one a single stranger's
    /// summary lists (0): invented ids come only that way, and must not crowd out the rest.
    pub(super) fn priority(&self) -> u8 {
        if self.headed {
            2
        } else if self.vouched || self.listers.len() >= 2 {
            1
        } else {
            0
        }
    }

    /// The stranger whose summary alone asks for this blob, if it is priority 0.
    pub(super) fn lone_lister(&self) -> Option<NodeId> {
        (self.priority() == 0)
            .then(|| self.listers.first().copied())
            .flatten()
    }
}

/// Why a blob is wanted (see [`Want::priority`]).
#[derive(Clone, Copy)]
pub(super) enum Why {
    /// A held header names it.
    Header,
    /// This peer's summary lists it.
    Listed(NodeId),
}

impl Engine {
    /// The `Message::Update` frame for `blob`, if held and verified (the answer to a peer's
    /// fetch). Does not change state.
    pub fn serve_update(&self, blob: &ContentId) -> Option<Vec<u8>> {
        let ((_, step), sender) = self
            .by_blob
            .range((*blob, 0)..=(*blob, u64::MAX))
            .next_back()?;
        let e = self.steps.get(step)?.headers.get(sender)?;
        let b = e.blob.as_ref().filter(|_| !e.invalid)?;
        Some(
            Message::Update {
                header: e.header.clone(),
                blob: b.to_vec(),
            }
            .encode(),
        )
    }

    /// The answer to `peer`'s fetch of `blob`, as `serve_update`, within this node's serving
    /// budget: a peer gets each blob of a step at most [`SERVES_PER_BLOB`] times (an honest
    /// one fetches it once, twice after a lost response), so what one peer can draw per step
    /// is bounded by twice the step's blobs, however fast it asks; a step tracks at most
    /// `max_peers` requesters. The encoded frame is built once and shared. The node shell
    /// serves fetches only through this.
    pub fn serve_update_to(&mut self, peer: NodeId, blob: &ContentId) -> Option<Arc<[u8]>> {
        let (step, sender) = self
            .by_blob
            .range((*blob, 0)..=(*blob, u64::MAX))
            .next_back()
            .map(|((_, t), s)| (*t, *s))?;
        let max_peers = self.run.limits.max_peers as usize;
        let st = self.steps.get_mut(&step)?;
        let e = st.headers.get(&sender)?;
        let b = e.blob.clone().filter(|_| !e.invalid)?;
        if !st.served.contains_key(&peer) && st.served.len() >= max_peers {
            self.metrics.refused_serves += 1;
            return None;
        }
        let n = st.served.entry(peer).or_default().entry(*blob).or_default();
        if *n >= SERVES_PER_BLOB {
            self.metrics.refused_serves += 1;
            return None;
        }
        *n += 1;
        let e = st.headers.get_mut(&sender).expect("looked up above");
        if e.frame.is_none() {
            let f = Message::Update {
                header: e.header.clone(),
                blob: b.to_vec(),
            }
            .encode();
            e.frame = Some(f.into());
        }
        e.frame.clone()
    }

    pub(super) fn on_fetched(
        &mut self,
        from: NodeId,
        blob: ContentId,
        bytes: &[u8],
        now: u64,
        out: &mut Vec<Action>,
    ) {
        let Some(w) = self.wants.get_mut(&blob).filter(|w| w.awaits(from)) else {
            // A response we did not ask for (or no longer need): do not even decode it.
            self.metrics.ignored += 1;
            return;
        };
        let want_step = w.step;
        // A late answer to a fetch that timed out leaves the one now in flight alone.
        if w.inflight == Some(from) {
            w.inflight = None;
            self.inflight -= 1;
        } else {
            w.pending.retain(|p| *p != from);
        }
        let (header, data) = match Message::decode(bytes, &self.run.limits) {
            Ok(Message::Update { header, blob }) => (header, blob),
            Ok(other) => {
                return self.blame(from, Offence::UnexpectedKind { kind: other.kind() }, out)
            }
            Err(e) => return self.blame(from, e.into(), out),
        };
        if header.body.blob != blob {
            return self.blame(
                from,
                Offence::BlobIdMismatch {
                    got: header.body.blob,
                    want: blob,
                },
                out,
            );
        }
        let claimed = self
            .by_blob
            .get(&(blob, header.body.step))
            .is_some_and(|o| *o != header.body.sender);
        if claimed && header.body.names(&data) {
            // These bytes are the blob the id names, bound to this header's sender: a held
            // header of another sender naming the same id re-signed it, and the fetched header
            // takes its slot.
            self.contradict_claims(&header.body, out);
        }
        let (step, sender) = (header.body.step, header.body.sender);
        if let Err((e, _)) = self.accept_header(from, header, Via::Fetch, now, out) {
            let fatal = e.penalty() > 0;
            self.blame(from, e, out);
            if !fatal {
                // Several senders may sign the same blob (colluders, or a copier publishing an
                // exact copy): the server may answer with another signer's header, a duplicate
                // here. The bytes hash to the id we wanted, so they still fill the header we
                // hold; dropping them would leave this node short of a blob its peers list.
                match self.blob_owner(want_step, blob) {
                    Some((t, owner)) => {
                        self.accept_blob(from, t, owner, data, out);
                    }
                    None => self.resolve_want(blob, Verdict::Ignore, out),
                }
            }
            return;
        }
        // The header may be an equivocation (then not stored): only a stored one gets its blob.
        let stored = self
            .steps
            .get(&step)
            .and_then(|s| s.headers.get(&sender))
            .is_some_and(|e| e.header.body.blob == blob);
        if stored {
            self.accept_blob(from, step, sender, data, out);
        } else if let Some((t, owner)) = self.blob_owner(want_step, blob) {
            self.accept_blob(from, t, owner, data, out);
        } else {
            self.resolve_want(blob, Verdict::Ignore, out);
        }
    }

    /// `owner` is proven the sender whose blob its id names (bytes that hash to the id under
    /// it are at hand): a held header of another sender claiming the same id in that step
    /// lied (it re-signed an honest id, with whatever length and tokens), is left out for
    /// good and blamed, and frees the id for `owner`'s header. Every node that sees the bytes
    /// decides alike, whichever header reached it first.
    pub(super) fn contradict_claims(&mut self, owner: &UpdateHeader, out: &mut Vec<Action>) {
        let (id, step) = (owner.blob, owner.step);
        let Some(o) = self
            .by_blob
            .get(&(id, step))
            .copied()
            .filter(|o| *o != owner.sender)
        else {
            return;
        };
        let Some(e) = self
            .steps
            .get_mut(&step)
            .and_then(|st| st.headers.get_mut(&o))
            .filter(|e| !e.contradicted)
        else {
            return;
        };
        e.invalid = true;
        e.contradicted = true;
        self.blame(o, Offence::ForeignBlob { blob: id }, out);
    }

    /// A stored header that names blob `id` and still lacks it: of `step` (the want's) if
    /// any, else of another kept step (one want serves every header naming the id); lowest
    /// sender first, so the choice is the same on every node.
    pub(super) fn blob_owner(&self, step: u64, id: ContentId) -> Option<(u64, NodeId)> {
        let lacking = |t: u64| {
            let st = self.steps.get(&t)?;
            st.headers
                .iter()
                .find(|(_, e)| e.header.body.blob == id && e.blob.is_none() && !e.invalid)
                .map(|(n, _)| (t, *n))
        };
        // The want's own step first, then every other step a header named this id in.
        lacking(step).or_else(|| {
            self.by_blob
                .range((id, 0)..=(id, u64::MAX))
                .filter(|((_, t), _)| *t != step)
                .find_map(|((_, t), _)| lacking(*t))
        })
    }

    /// How long one fetch may stay in flight before the next candidate is asked as well: half
    /// the summary window (at least the grace), so that a peer that never answers costs a
    /// want at most half the time its repair fetches have, and a second candidate still has
    /// the other half. The shell's own request timeout (a whole period) used to be the only
    /// limit, and one silent source named first kept an honest update out of the step.
    pub(super) fn fetch_timeout(&self) -> u64 {
        let t = &self.run.timing;
        (t.summary_ms / 2).max(t.grace_ms).max(1)
    }

    /// Fetches in flight past their time-out, where another candidate is untried, free their
    /// slot for the next candidate. The timed-out request stays pending (its answer is still
    /// taken, and the want is not given up before it answers or fails), so where nobody else
    /// can be asked nothing changes. Not a penalty: slowness proves nothing.
    pub(super) fn expire_fetches(&mut self, now: u64) {
        let limit = self.fetch_timeout();
        let mut expired = 0;
        for w in self.wants.values_mut() {
            if w.untried() && now >= w.since.saturating_add(limit) {
                if let Some(p) = w.inflight.take() {
                    w.pending.push(p);
                    expired += 1;
                }
            }
        }
        self.inflight -= expired;
        self.metrics.fetch_timeouts += expired as u64;
    }

    /// The earliest time-out of a fetch in flight that would free a slot, for the timer.
    pub(super) fn next_fetch_timeout(&self) -> Option<u64> {
        let limit = self.fetch_timeout();
        self.wants
            .values()
            .filter(|w| w.inflight.is_some() && w.untried())
            .map(|w| w.since.saturating_add(limit))
            .min()
    }

    pub(super) fn fetch_failed(&mut self, from: NodeId, blob: ContentId) {
        if let Some(w) = self.wants.get_mut(&blob) {
            if w.inflight == Some(from) {
                w.inflight = None;
                self.inflight -= 1;
                self.metrics.fetch_failures += 1;
            } else if w.pending.contains(&from) {
                w.pending.retain(|p| *p != from);
                self.metrics.fetch_failures += 1;
            }
        }
    }

    /// Want `id` for `step`, from these candidates (in order of preference). Returns whether a
    /// want exists for it now. The queue is bounded, and full it keeps the wants of highest
    /// priority (`Want::priority`): a new want takes the place of a lower one not in flight.
    /// A single stranger's summary may hold at most `max_fetch_queue / 8` priority-0 wants:
    /// four summaries of invented ids used to fill the whole queue, leaving honest headers
    /// unfetched and nothing applied.
    pub(super) fn want(
        &mut self,
        id: ContentId,
        step: u64,
        why: Why,
        from: &[NodeId],
        out: &mut Vec<Action>,
    ) -> bool {
        let l = &self.run.limits;
        let (max_q, max_c) = (l.max_fetch_queue as usize, l.max_fetch_candidates as usize);
        let per_lister = (max_q / 8).max(1) as u32;
        let vouch = match why {
            Why::Listed(p) => self.trusted_relays.contains(&p) || self.known(&p),
            Why::Header => false,
        };
        let who = from.first().copied().unwrap_or(self.me_id);
        let refuse = |out: &mut Vec<Action>, what| {
            out.push(Action::Report(Report::Ignored {
                from: who,
                error: Offence::BufferFull(what),
            }));
            false
        };
        let before = self.wants.get(&id).map(|w| (w.lone_lister(), w.priority()));
        let new = Want {
            step,
            candidates: Vec::new(),
            tried: Vec::new(),
            inflight: None,
            since: 0,
            pending: Vec::new(),
            tags: Vec::new(),
            headed: matches!(why, Why::Header),
            listers: match why {
                Why::Listed(p) => vec![p],
                Why::Header => Vec::new(),
            },
            vouched: vouch,
        };
        match before {
            None => {
                if let Some(p) = new.lone_lister() {
                    if self.lone.get(&p).copied().unwrap_or(0) >= per_lister {
                        return refuse(out, "fetches asked by one summary");
                    }
                }
                if self.wants.len() >= max_q {
                    // Make room: the lowest-priority want not in flight, exhausted ones first.
                    let p = new.priority();
                    let victim = self
                        .wants
                        .iter()
                        .filter(|(_, w)| w.inflight.is_none() && w.priority() < p)
                        .min_by_key(|(_, w)| (w.priority(), !w.exhausted()))
                        .map(|(id, _)| *id);
                    match victim {
                        Some(v) => {
                            self.metrics.evicted_wants += 1;
                            self.resolve_want(v, Verdict::Ignore, out);
                        }
                        None => return refuse(out, "fetch queue"),
                    }
                }
                if let Some(p) = new.lone_lister() {
                    *self.lone.entry(p).or_default() += 1;
                }
                self.wants.insert(id, new);
            }
            Some((lone, _)) => {
                let w = self.wants.get_mut(&id).expect("present");
                match why {
                    Why::Header => w.headed = true,
                    Why::Listed(p) => {
                        if w.listers.len() < 2 && !w.listers.contains(&p) {
                            w.listers.push(p);
                        }
                    }
                }
                w.vouched |= vouch;
                let now_lone = w.lone_lister();
                if lone.is_some() && now_lone.is_none() {
                    self.unlone(lone);
                }
            }
        }
        let banned: Vec<bool> = from
            .iter()
            .map(|p| self.is_banned(p) || *p == self.me_id)
            .collect();
        let w = self.wants.get_mut(&id).expect("present");
        for (p, b) in from.iter().zip(banned) {
            if !b && !w.candidates.contains(p) && w.candidates.len() < max_c {
                w.candidates.push(*p);
                w.tried.push(false);
            }
        }
        true
    }

    /// One priority-0 want of `lister` fewer.
    pub(super) fn unlone(&mut self, lister: Option<NodeId>) {
        if let Some(p) = lister {
            if let Some(c) = self.lone.get_mut(&p) {
                *c = c.saturating_sub(1);
                if *c == 0 {
                    self.lone.remove(&p);
                }
            }
        }
    }

    pub(super) fn resolve_want(&mut self, id: ContentId, v: Verdict, out: &mut Vec<Action>) {
        if let Some(w) = self.wants.remove(&id) {
            self.unlone(w.lone_lister());
            if w.inflight.is_some() {
                self.inflight -= 1;
            }
            for t in w.tags {
                out.push(Action::Verdict { tag: t, verdict: v });
            }
        }
    }

    pub(super) fn pump(&mut self, now: u64, out: &mut Vec<Action>) {
        let max = self.run.limits.max_inflight_fetches as usize;
        // Highest priority first (see `Want::priority`), so that invented ids asked for by
        // one summary never keep the slots from blobs a held header names.
        let mut ids: Vec<(u8, ContentId)> = self
            .wants
            .iter()
            .filter(|(_, w)| w.inflight.is_none())
            .map(|(id, w)| (2 - w.priority(), *id))
            .collect();
        ids.sort_unstable();
        // One peer holds at most half the slots: a silent one (it never answers) used to hold
        // them all until the step was applied, asked for ids only it listed.
        let cap = (max / 2).max(1);
        let mut busy: BTreeMap<NodeId, usize> = BTreeMap::new();
        for w in self.wants.values() {
            if let Some(p) = w.inflight {
                *busy.entry(p).or_default() += 1;
            }
        }
        for (_, id) in ids {
            if self.inflight >= max {
                break;
            }
            let untried: Vec<usize> = {
                let w = &self.wants[&id];
                (0..w.candidates.len()).filter(|&i| !w.tried[i]).collect()
            };
            if untried.is_empty() {
                // Nobody left to ask: release the gossip verdicts.
                let w = self.wants.get_mut(&id).expect("present");
                for t in std::mem::take(&mut w.tags) {
                    out.push(Action::Verdict {
                        tag: t,
                        verdict: Verdict::Ignore,
                    });
                }
                continue;
            }
            // Preference order for the first try (the relay), random after that to spread load;
            // candidates at their cap wait for a later pump.
            let free: Vec<usize> = {
                let w = &self.wants[&id];
                untried
                    .iter()
                    .copied()
                    .filter(|&i| busy.get(&w.candidates[i]).copied().unwrap_or(0) < cap)
                    .collect()
            };
            if free.is_empty() {
                continue;
            }
            let first = self.wants[&id].tried.iter().all(|t| !t);
            let pick = if first && free[0] == 0 {
                0
            } else {
                free[(self.next_rand() % free.len() as u64) as usize]
            };
            let w = self.wants.get_mut(&id).expect("present");
            w.tried[pick] = true;
            let peer = w.candidates[pick];
            *busy.entry(peer).or_default() += 1;
            w.inflight = Some(peer);
            w.since = now;
            self.inflight += 1;
            self.metrics.fetches += 1;
            out.push(Action::Fetch { peer, blob: id });
        }
    }
}
