//! `swarm run --adversary KIND`: a hostile node, FOR TESTS ONLY — the fault drills run one
//! beside honest processes to show the defences at work over a real network (issue 6). Every
//! kind the simulator also has maps onto its `sim::adversary::Attack` ([`Adversary::attack`])
//! with the same parameters, and the content attacks are the simulator's one catalogue
//! (`sim::adversary::content_move`), so a drill and a simulated run attack in the same way.
//! They replace the honest update that the engine then signs and publishes; the
//! protocol-level ones (withholding, equivocation, malformed blobs) bypass the engine, which
//! would refuse to sign them, and gossip forged frames directly; those, and the node-only
//! kinds below, are this file's.
//!
//! Throwaway keys (issue 13): `forge-votes` signs two summaries per step that attest
//! parameters nobody holds (forged votes and a fork attempt in one), and `crowd` brings 16
//! fresh keys, proof of work paid once each, that announce a free-rider update every step from
//! step [`CROWD_FROM`] on to crowd the per-step tables out. A full Sybil flood of churning
//! identities stays the simulator's (`sybil`, in process). ALIE and IPM see only the
//! previous step's honest updates (one step stale: the simulator's attackers see the current
//! step's).

use std::collections::VecDeque;

use crypto::{ContentId, Digest, Identity, NodeId};
use protocol::engine::Included;
use protocol::run::{RunConfig, RunId};
use protocol::sparse::{Layout, SparseUpdate};
use protocol::wire::{Message, Signed, StepSummary};
use sim::adversary::{self as adv, Attack};
use sim::rng::Rng;

use crate::trainer::Snapshot;

/// The behaviours of `--adversary`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Adversary {
    /// Every value of the honest update negated.
    Signflip,
    /// Random coefficients with random signs, ×10 where values carry magnitudes.
    Noise,
    /// A fixed all-zero update (a free rider).
    Zero,
    /// The honest update, claiming 16× its tokens.
    Overclaim,
    /// The honest update ×100 (values that carry magnitudes only: 1-bit signs cannot grow).
    Scale,
    /// "A little is enough": μ − σ·sign(μ) of the previous step's honest updates.
    Alie,
    /// Inner-product manipulation: −0.1·μ of the previous step's honest updates.
    Ipm,
    /// Another peer's update from the previous step with 1 % of its entries changed.
    Copier,
    /// Its own honest update of three steps ago, again.
    Stale,
    /// Trains but never publishes.
    Silent,
    /// Announces its update and never serves the blob.
    Withhold,
    /// Signs two different updates for every step (the honest one and its sign flip).
    Equivocate,
    /// Bad frames and blobs, a different malformation each step (garbage, oversize, wrong
    /// shape, index out of range, duplicate index, non-finite value).
    Malformed,
    /// Trains honestly but serves joiners checkpoints with one parameter changed (signed
    /// manifests of a digest nobody attested).
    FalseCheckpoint,
    /// Every step: two different signed, priced summaries (one lists its update, one lists
    /// nothing), both attesting a parameter digest nobody holds for its current version.
    ForgeVotes,
    /// From step [`CROWD_FROM`] on, [`CROWD_KEYS`] throwaway keys each announce a free-rider
    /// (all-zero) update every step, claiming 1 token each.
    Crowd,
}

/// First step of `crowd`: after the grace in which every peer present at the start counts as
/// known, so the crowd's keys are strangers, as a crowd that turns up mid-run is.
pub const CROWD_FROM: u64 = 6;
/// Tokens `forge-votes` claims for its update (crowd updates claim 1).
pub const FORGER_TOKENS: u64 = 100;
/// Keys of `crowd`.
pub const CROWD_KEYS: usize = 16;
/// Blobs a hostile node keeps serving (a crowd's two steps and then some).
pub const SERVE_KEEP: usize = 4 * CROWD_KEYS;

impl Adversary {
    /// The simulator's attack this is, with its default parameters; None for the node-only
    /// kinds (false checkpoints, forged votes, the crowd). Where the node differs it says so
    /// here: `scale` claims no extra tokens.
    pub fn attack(self) -> Option<Attack> {
        Some(match self {
            Adversary::Signflip => Attack::Signflip,
            Adversary::Noise => Attack::Noise {
                scale: adv::NOISE_SCALE,
            },
            Adversary::Zero => Attack::Zero,
            Adversary::Overclaim => Attack::Overclaim {
                factor: adv::OVERCLAIM_FACTOR,
            },
            Adversary::Scale => Attack::Scale {
                factor: adv::SCALE_FACTOR,
                claim: false,
            },
            Adversary::Alie => Attack::Alie { z: adv::ALIE_Z },
            Adversary::Ipm => Attack::Ipm {
                epsilon: adv::IPM_EPSILON,
            },
            Adversary::Copier => Attack::Copier {
                noise: adv::COPIER_NOISE,
            },
            Adversary::Stale => Attack::Stale {
                lag: adv::STALE_LAG,
            },
            Adversary::Silent => Attack::Silent,
            Adversary::Withhold => Attack::Withhold,
            Adversary::Equivocate => Attack::Equivocate,
            Adversary::Malformed => Attack::Malformed,
            Adversary::FalseCheckpoint | Adversary::ForgeVotes | Adversary::Crowd => return None,
        })
    }
}

/// What the hostile node does with a step's honest update.
pub enum Move {
    /// Hand this update to the engine, which signs and publishes it as usual.
    Update { blob: Vec<u8>, tokens: u64 },
    /// Publish nothing.
    Nothing,
    /// Bypass the engine: gossip these frames, and serve these blobs (id → `Update` frame)
    /// to whoever asks.
    Raw {
        gossip: Vec<Vec<u8>>,
        serve: Vec<(ContentId, Vec<u8>)>,
    },
}

/// What forging a signed header needs from the engine.
pub struct Forge<'a> {
    pub run_id: RunId,
    pub me: &'a Identity,
    pub pow: u64,
    /// The parameters the update claims to be trained on (version, digest).
    pub base: (u64, Digest),
}

/// Others' updates kept from the last applied step.
const KEEP_SEEN: usize = 64;

pub struct Hostile {
    pub kind: Adversary,
    seen: Vec<SparseUpdate>,
    own: VecDeque<(u64, Vec<u8>)>,
    /// `crowd`'s keys and their proofs of work (made on first use).
    crowd: Vec<(Identity, u64)>,
}

impl Hostile {
    pub fn new(kind: Adversary) -> Hostile {
        Hostile {
            kind,
            seen: Vec::new(),
            own: VecDeque::new(),
            crowd: Vec::new(),
        }
    }

    /// The updates applied in a step: the others' are the honest sample for the next step.
    pub fn on_applied(&mut self, run: &RunConfig, me: &NodeId, updates: &[Included]) {
        let max = run.limits.max_blob_bytes as usize;
        self.seen = updates
            .iter()
            .filter(|u| u.sender != *me)
            .take(KEEP_SEEN)
            .filter_map(|u| SparseUpdate::decode(&u.bytes.0, max).ok())
            .collect();
    }

    /// The hostile move for `step`, given the honest update the trainer produced.
    pub fn act(
        &mut self,
        run: &RunConfig,
        forge: Forge,
        step: u64,
        blob: Vec<u8>,
        tokens: u64,
    ) -> Move {
        let layout = run.layout();
        let k = run.optim.topk;
        let mut rng = sim::rng::derive(&[0xbad, run.seed, step]);
        let attack = self.kind.attack();
        if let Some(Attack::Stale { lag }) = attack {
            self.own.push_back((step, blob.clone()));
            while self.own.len() > lag as usize + 1 {
                self.own.pop_front();
            }
        }
        let Ok(u) = SparseUpdate::decode(&blob, run.limits.max_blob_bytes as usize) else {
            return Move::Update { blob, tokens };
        };
        if let Some(attack) = attack {
            // Its oldest kept update, if it is `lag` steps old or more.
            let past = match attack {
                Attack::Stale { lag } => self.own.front().filter(|(s, _)| *s + lag <= step),
                _ => None,
            };
            let honest: Vec<&SparseUpdate> = self.seen.iter().collect();
            let cx = adv::Ctx {
                own: &u,
                tokens,
                layout: &layout,
                k,
                codec: run.optim.values,
                seen: &honest,
                past: past.is_some(),
                pick: adv::Pick::First,
                rng: &mut rng,
            };
            if let Some(m) = adv::content_move(attack, cx) {
                let blob = match m.body {
                    adv::Body::Own => blob,
                    adv::Body::Past => past.expect("kept").1.clone(),
                    adv::Body::New(u) => u.encode(),
                };
                return Move::Update {
                    blob,
                    tokens: m.tokens,
                };
            }
        }
        let forged = |b: &[u8]| forge_frames(run, &forge, step, b, tokens);
        match self.kind {
            Adversary::Signflip
            | Adversary::Noise
            | Adversary::Zero
            | Adversary::Overclaim
            | Adversary::Scale
            | Adversary::Alie
            | Adversary::Ipm
            | Adversary::Copier
            | Adversary::Stale => unreachable!("content attacks are the catalogue's"),
            Adversary::Silent => Move::Nothing,
            Adversary::Withhold => {
                let (_, announce, _) = forged(&blob);
                Move::Raw {
                    gossip: vec![announce],
                    serve: Vec::new(),
                }
            }
            Adversary::Equivocate => {
                let flipped = adv::signflip(&u, &layout).encode();
                let (a, ann_a, upd_a) = forged(&blob);
                let (b, ann_b, upd_b) = forged(&flipped);
                Move::Raw {
                    gossip: vec![ann_a, ann_b],
                    serve: vec![(a, upd_a), (b, upd_b)],
                }
            }
            Adversary::Malformed => {
                malformed_move(run, &forge, step, &u, &layout, tokens, &mut rng)
            }
            Adversary::FalseCheckpoint => Move::Update { blob, tokens },
            Adversary::ForgeVotes => forge_votes(run, &forge, step, &blob),
            Adversary::Crowd => self.crowd_move(run, &forge, step, &layout, k),
        }
    }

    /// `crowd`: from step `CROWD_FROM`, a zero update from each of `CROWD_KEYS` identities
    /// derived from this node's key (made, with their proofs of work, on first use).
    fn crowd_move(
        &mut self,
        run: &RunConfig,
        forge: &Forge,
        step: u64,
        layout: &Layout,
        k: u32,
    ) -> Move {
        if step < CROWD_FROM {
            return Move::Nothing;
        }
        if self.crowd.is_empty() {
            let seed = forge.me.seed();
            self.crowd = (0..CROWD_KEYS as u64)
                .map(|i| {
                    let id = Identity::from_seed(
                        *blake3::hash(&[&seed[..], &i.to_le_bytes()].concat()).as_bytes(),
                    );
                    let pow =
                        crypto::pow::solve(&forge.run_id.0, &id.node_id(), run.defence.pow_bits);
                    (id, pow)
                })
                .collect();
        }
        let free = adv::zero(layout, k, run.optim.values).encode();
        let (mut gossip, mut serve) = (Vec::new(), Vec::new());
        for (id, pow) in &self.crowd {
            let (bid, announce, upd) =
                adv::forge(run, forge.run_id, id, *pow, step, forge.base, &free, 1);
            gossip.push(announce);
            serve.push((bid, upd));
        }
        Move::Raw { gossip, serve }
    }
}

/// A forged header for blob `b` claiming `tokens`, signed by `forge`'s identity: the blob id,
/// the announce frame and the update frame.
fn forge_frames(
    run: &RunConfig,
    forge: &Forge,
    step: u64,
    b: &[u8],
    tokens: u64,
) -> (ContentId, Vec<u8>, Vec<u8>) {
    adv::forge(
        run,
        forge.run_id,
        forge.me,
        forge.pow,
        step,
        forge.base,
        b,
        tokens,
    )
}

/// `malformed`: this step's malformation of the node's own update, either a bad frame or a
/// forged header for a bad blob.
fn malformed_move(
    run: &RunConfig,
    forge: &Forge,
    step: u64,
    u: &SparseUpdate,
    layout: &Layout,
    tokens: u64,
    rng: &mut Rng,
) -> Move {
    let max = run.limits.max_message_bytes as usize;
    match adv::malformed(step, u, layout, max, rng) {
        adv::Bad::Frame(f) => Move::Raw {
            gossip: vec![f],
            serve: Vec::new(),
        },
        adv::Bad::Blob(bad) => {
            let (id, announce, upd) = forge_frames(run, forge, step, &bad, tokens);
            Move::Raw {
                gossip: vec![announce],
                serve: vec![(id, upd)],
            }
        }
    }
}

/// `forge-votes`: an update claiming `FORGER_TOKENS`, and two summaries signed over a made-up
/// parameter digest (one listing the update, one empty).
fn forge_votes(run: &RunConfig, forge: &Forge, step: u64, blob: &[u8]) -> Move {
    // The update claims a token count no honest node makes, so a drill can tell
    // from the applied tokens whether it ever got in.
    let (id, announce, upd) = forge_frames(run, forge, step, blob, FORGER_TOKENS);
    let forged = Digest(*blake3::hash(&[&b"forged"[..], &step.to_le_bytes()].concat()).as_bytes());
    let summary = |updates: Vec<ContentId>| {
        Message::Summary(Signed::sign(
            StepSummary {
                run: forge.run_id,
                step,
                sender: forge.me.node_id(),
                updates,
                params_version: forge.base.0,
                params_digest: forged,
                pow: forge.pow,
            },
            forge.me,
        ))
        .encode()
    };
    Move::Raw {
        gossip: vec![announce, summary(vec![id]), summary(Vec::new())],
        serve: vec![(id, upd)],
    }
}

/// `false-checkpoint`: the served copy of the parameters with one value changed (the first
/// parameter's low byte), so its digest is one no honest peer attests.
pub fn falsify(snap: &Snapshot) -> Snapshot {
    let mut tensors = snap.tensors.clone();
    if let Some(b) = tensors.first_mut().and_then(|t| t.2.first_mut()) {
        *b ^= 1;
    }
    Snapshot::new(snap.version, tensors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    #[test]
    fn kinds_map_onto_the_simulators_attacks_by_name() {
        let mut mapped = 0;
        for kind in Adversary::value_variants() {
            let name = kind
                .to_possible_value()
                .expect("named")
                .get_name()
                .to_string();
            if let Some(a) = kind.attack() {
                assert_eq!(a.name(), name);
                a.check().unwrap();
                mapped += 1;
            } else {
                assert!(["false-checkpoint", "forge-votes", "crowd"].contains(&name.as_str()));
            }
        }
        assert_eq!(mapped, Adversary::value_variants().len() - 3);
    }
}
