//! Hostile peers: what each attacker of the simulator sends instead of its honest update.
//!
//! An attacker node runs a real engine and trains like everyone else (it keeps its momentum,
//! so its honest update is always at hand); [`Attack`] says what it publishes instead. The
//! transforms here are pure functions of their inputs and a seeded [`Rng`], so a scenario and
//! seed still give byte-identical metrics. [`content_move`] is the one catalogue of content
//! attacks, which `world` (`World::outgoing`) and `swarm run --adversary` (node/src/hostile.rs)
//! both call; how forged frames travel stays theirs.
//!
//! Attackers **collude**: they see every honest update of the step (updates are broadcast, so
//! anyone in the swarm has them within the step; attackers that need them publish a little
//! later, `WATCH_MS` in `world`), they vouch for one another in their summaries, and when asked
//! to spot-check they pass fellow attackers and fail honest peers.
//!
//! Values are in the run's codec. With 1-bit sign values (the DeMo default) an update can only
//! choose *which* coefficients it keeps and their signs: scaling, "large" noise and ε have no
//! magnitude to act on, so `scale` lies about its tokens instead and the magnitude parameters
//! matter only for `values = "f32"` / `"bf16"` runs.

use crypto::{ContentId, Digest, Identity};
use protocol::config::ValueCodec;
use protocol::run::{RunConfig, RunId};
use protocol::sparse::{pack_bits, Layout, SparseUpdate, TensorUpdate};
use protocol::wire::{kind, Message, Signed, UpdateHeader, WIRE_VERSION};
use serde::{Deserialize, Serialize};

use crate::rng::{derive, Rng};
use crate::ScenarioError;

/// One kind of hostile behaviour, with its parameter. TOML: `kind = "alie"`, `z = 1.0`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Attack {
    /// Announces its (honest) update but never serves the blob (withholding).
    Withhold,
    /// Trains but publishes nothing (a dead trainer behind a live relay).
    Silent,
    /// Large random noise: `k` random coefficients per block with random signs; for float
    /// codecs, Gaussian values of `scale` × the RMS of its honest update's values.
    Noise {
        #[serde(default = "ten")]
        scale: f32,
    },
    /// Its honest update with every value negated (gradient ascent).
    Signflip,
    /// Its honest update scaled by `factor`: float values ×factor, and the header claims
    /// ×factor tokens (with sign values the token claim is the only lever). `claim = false`
    /// scales the values only (`swarm run --adversary scale`).
    Scale {
        #[serde(default = "hundred")]
        factor: f64,
        #[serde(default = "yes", skip_serializing_if = "is_true")]
        claim: bool,
    },
    /// Its honest update as is, with the header claiming ×`factor` tokens (saturating).
    /// Not one of the measurement's rows ([`Attack::all`]): `scale` lies about tokens too.
    Overclaim {
        #[serde(default = "sixteen")]
        factor: u64,
    },
    /// "A little is enough" (Baruch et al. 2019): per coefficient the honest mean shifted
    /// against its own sign by `z`·σ of the honest updates of the step, `μ − z·σ·sign(μ)`, on
    /// the coefficients the honest updates favour most (largest |μ|), so its support looks
    /// like theirs while every contested coefficient is pushed the wrong way.
    Alie {
        #[serde(default = "one")]
        z: f64,
    },
    /// Inner-product manipulation (Xie et al. 2020): `−epsilon` × the mean of the step's honest
    /// updates, on the coefficients the honest mean is largest on (with sign values:
    /// the honest consensus, flipped).
    Ipm {
        #[serde(default = "tenth")]
        epsilon: f64,
    },
    /// A free rider: an update that carries no gradient. Float codecs: `k` zero values per
    /// block. Sign values cannot encode 0, so it keeps the first `k` coefficients of each block
    /// with alternating signs (no information, no effort).
    Zero,
    /// Republishes another (honest) peer's update of the same step under its own key: exactly
    /// (`noise = 0`: the same blob, which the engine counts once) or with a fraction `noise` of
    /// its values perturbed (sign flipped; float values jittered by that relative amount).
    Copier {
        #[serde(default = "hundredth")]
        noise: f64,
    },
    /// Replays its own update of `lag` steps ago, freshly signed for the current step.
    Stale {
        #[serde(default = "three")]
        lag: u64,
    },
    /// Equivocation: two validly signed updates for one step (honest, and sign-flipped) sent
    /// to alternate mesh peers, so different peers first see different updates.
    Equivocate,
    /// Malformed messages, one kind per step in turn (see [`Malformation`]): bad CBOR,
    /// oversize frames, wrong shapes, indices out of range or duplicated, non-finite values.
    Malformed,
    /// A Sybil flood: each attacker node comes back under a fresh identity every `every`
    /// steps (new key, new proof of work, joining through a checkpoint like any newcomer),
    /// shedding whatever reputation or ban its previous identity earned, and publishes
    /// sign-flipped updates under each.
    Sybil {
        #[serde(default = "four")]
        every: u64,
    },
}

// The attacks' default parameters: the simulator's scenarios and `swarm run --adversary`
// both take them from here.
/// `noise`: × the RMS of the honest update's values.
pub const NOISE_SCALE: f32 = 10.0;
/// `scale`: values (and, claiming, tokens) ×this.
pub const SCALE_FACTOR: f64 = 100.0;
/// `overclaim`: tokens ×this.
pub const OVERCLAIM_FACTOR: u64 = 16;
/// `alie`: z, in σ of the honest updates.
pub const ALIE_Z: f64 = 1.0;
/// `ipm`: ε.
pub const IPM_EPSILON: f64 = 0.1;
/// `copier`: the fraction of values perturbed.
pub const COPIER_NOISE: f64 = 0.01;
/// `stale`: steps back.
pub const STALE_LAG: u64 = 3;
/// `sybil`: steps per identity.
pub const SYBIL_EVERY: u64 = 4;

fn one() -> f64 {
    ALIE_Z
}
fn three() -> u64 {
    STALE_LAG
}
fn four() -> u64 {
    SYBIL_EVERY
}
fn ten() -> f32 {
    NOISE_SCALE
}
fn tenth() -> f64 {
    IPM_EPSILON
}
fn hundredth() -> f64 {
    COPIER_NOISE
}
fn hundred() -> f64 {
    SCALE_FACTOR
}
fn sixteen() -> u64 {
    OVERCLAIM_FACTOR
}
fn yes() -> bool {
    true
}
fn is_true(b: &bool) -> bool {
    *b
}

impl Attack {
    /// Every kind with its default parameter (the measurement's rows), withholding and
    /// silence first.
    pub fn all() -> Vec<Attack> {
        vec![
            Attack::Withhold,
            Attack::Silent,
            Attack::Noise { scale: ten() },
            Attack::Signflip,
            Attack::Scale {
                factor: hundred(),
                claim: true,
            },
            Attack::Alie { z: one() },
            Attack::Ipm { epsilon: tenth() },
            Attack::Zero,
            Attack::Copier { noise: hundredth() },
            Attack::Stale { lag: three() },
            Attack::Equivocate,
            Attack::Malformed,
            Attack::Sybil { every: four() },
        ]
    }

    /// The TOML/JSON name.
    pub fn name(&self) -> &'static str {
        match self {
            Attack::Withhold => "withhold",
            Attack::Silent => "silent",
            Attack::Noise { .. } => "noise",
            Attack::Signflip => "signflip",
            Attack::Scale { .. } => "scale",
            Attack::Overclaim { .. } => "overclaim",
            Attack::Alie { .. } => "alie",
            Attack::Ipm { .. } => "ipm",
            Attack::Zero => "zero",
            Attack::Copier { .. } => "copier",
            Attack::Stale { .. } => "stale",
            Attack::Equivocate => "equivocate",
            Attack::Malformed => "malformed",
            Attack::Sybil { .. } => "sybil",
        }
    }

    /// The name with its parameter, for tables (`alie z=1`).
    pub fn label(&self) -> String {
        match *self {
            Attack::Noise { scale } => format!("noise ×{scale}"),
            Attack::Scale {
                factor,
                claim: true,
            } => format!("scale ×{factor}"),
            Attack::Scale {
                factor,
                claim: false,
            } => format!("scale ×{factor} values only"),
            Attack::Overclaim { factor } => format!("overclaim ×{factor}"),
            Attack::Alie { z } => format!("alie z={z}"),
            Attack::Ipm { epsilon } => format!("ipm ε={epsilon}"),
            Attack::Copier { noise } => format!("copier noise={noise}"),
            Attack::Stale { lag } => format!("stale lag={lag}"),
            Attack::Sybil { every } => format!("sybil every={every}"),
            _ => self.name().to_string(),
        }
    }

    /// Whether it needs the step's honest updates (so it publishes after they arrive).
    pub fn watches(&self) -> bool {
        matches!(
            self,
            Attack::Alie { .. } | Attack::Ipm { .. } | Attack::Copier { .. }
        )
    }

    /// Parameters out of range, in words.
    pub fn check(&self) -> Result<(), ScenarioError> {
        let ok = match *self {
            Attack::Noise { scale } => scale.is_finite() && scale >= 0.0,
            Attack::Scale { factor, .. } => factor.is_finite() && factor > 0.0,
            Attack::Overclaim { factor } => factor >= 1,
            Attack::Alie { z } => z.is_finite() && z >= 0.0,
            Attack::Ipm { epsilon } => epsilon.is_finite() && epsilon > 0.0,
            Attack::Copier { noise } => (0.0..=1.0).contains(&noise),
            Attack::Stale { lag } => lag >= 1,
            Attack::Sybil { every } => every >= 1,
            _ => true,
        };
        if ok {
            Ok(())
        } else {
            Err(ScenarioError::AttackParameter {
                attacker: self.label(),
            })
        }
    }
}

/// `[[attacker]]` in a scenario: an [`Attack`] and who carries it out, either the listed
/// `nodes` or a `fraction` of the initial nodes (rounded, at least one; picked by the seed
/// among nodes no earlier entry took).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attacker {
    #[serde(flatten)]
    pub attack: Attack,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<usize>,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub fraction: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl Attacker {
    pub fn nodes(attack: Attack, nodes: Vec<usize>) -> Attacker {
        Attacker {
            attack,
            nodes,
            fraction: 0.0,
        }
    }

    pub fn fraction(attack: Attack, fraction: f64) -> Attacker {
        Attacker {
            attack,
            nodes: Vec::new(),
            fraction,
        }
    }

    /// How many of `n` nodes a fraction means.
    pub fn count(fraction: f64, n: usize) -> usize {
        if fraction <= 0.0 {
            0
        } else {
            ((fraction * n as f64).round() as usize).clamp(1, n)
        }
    }
}

/// Which of `n` initial nodes each attacker entry controls: listed nodes as given, fractions
/// drawn by the seed from the nodes still free. Deterministic in (entries, n, seed).
pub fn assign(attackers: &[Attacker], n: usize, seed: u64) -> Vec<(usize, Attack)> {
    let mut taken = vec![false; n];
    let mut out = Vec::new();
    for a in attackers {
        for &x in &a.nodes {
            if x < n && !taken[x] {
                taken[x] = true;
                out.push((x, a.attack));
            }
        }
    }
    let mut r = derive(&[seed, 0x6164_7672]);
    for a in attackers {
        let want = Attacker::count(a.fraction, n);
        let mut free: Vec<usize> = (0..n).filter(|&i| !taken[i]).collect();
        r.shuffle(&mut free);
        for &x in free.iter().take(want) {
            taken[x] = true;
            out.push((x, a.attack));
        }
    }
    out.sort_by_key(|p| p.0);
    out
}

// ---------------------------------------------------------------------------------------------
// content transforms

/// Dense flat view of updates over a layout (tensor by tensor, block-major, each block's
/// `h·w` coefficients contiguous: the synthetic trainer's parameter order).
pub struct Dense<'a> {
    layout: &'a Layout,
    offsets: Vec<usize>,
    len: usize,
}

impl<'a> Dense<'a> {
    pub fn new(layout: &'a Layout) -> Dense<'a> {
        let mut offsets = Vec::with_capacity(layout.tensors.len());
        let mut n = 0;
        for t in &layout.tensors {
            offsets.push(n);
            n += t.blocks() * t.block_elems();
        }
        Dense {
            layout,
            offsets,
            len: n,
        }
    }

    /// The update's values scattered into a dense vector (zeros where nothing was kept).
    pub fn scatter(&self, u: &SparseUpdate) -> Vec<f64> {
        let mut d = vec![0.0; self.len];
        for ((tu, t), &off) in u
            .tensors
            .iter()
            .zip(&self.layout.tensors)
            .zip(&self.offsets)
        {
            let (idx, vals) = tu.entries(u.codec);
            let (k, elems) = (tu.k.max(1) as usize, t.block_elems());
            for (e, (&i, &v)) in idx.iter().zip(&vals).enumerate() {
                if let Some(x) = d.get_mut(off + (e / k) * elems + i as usize) {
                    *x = v as f64;
                }
            }
        }
        d
    }

    /// A valid update keeping, per block, the `k` coefficients with the largest `rank`
    /// (ties by index), with values `value` in `codec` (sign values: the sign of `value`,
    /// 0 counting as negative).
    pub fn gather(&self, k: u32, codec: ValueCodec, rank: &[f64], value: &[f64]) -> SparseUpdate {
        let mut order: Vec<u32> = Vec::new();
        let tensors = self
            .layout
            .tensors
            .iter()
            .zip(&self.offsets)
            .map(|(t, &off)| {
                let (ke, elems) = (t.k_eff(k), t.block_elems());
                let mut idx = Vec::with_capacity(t.blocks() * ke);
                let mut vals = Vec::with_capacity(t.blocks() * ke);
                for b in 0..t.blocks() {
                    let base = off + b * elems;
                    order.clear();
                    order.extend(0..elems as u32);
                    order.sort_by(|&x, &y| {
                        rank[base + y as usize]
                            .total_cmp(&rank[base + x as usize])
                            .then(x.cmp(&y))
                    });
                    for &j in &order[..ke] {
                        idx.push(j);
                        vals.push(encode_value(codec, value[base + j as usize]));
                    }
                }
                TensorUpdate::from_entries(t, ke, codec, &idx, &vals)
            })
            .collect();
        SparseUpdate { codec, tensors }
    }
}

fn encode_value(codec: ValueCodec, v: f64) -> f32 {
    match codec {
        ValueCodec::Sign => {
            if v > 0.0 {
                1.0
            } else {
                -1.0
            }
        }
        // Finite whatever the parameter: a hostile update that fails validation is the
        // `malformed` attacker's business, not these.
        _ => (v.clamp(-1e30, 1e30)) as f32,
    }
}

/// Rebuild `u` with each value mapped by `f(entry number, value)`.
fn map_values(
    u: &SparseUpdate,
    layout: &Layout,
    mut f: impl FnMut(usize, f32) -> f32,
) -> SparseUpdate {
    let mut n = 0;
    let tensors = u
        .tensors
        .iter()
        .zip(&layout.tensors)
        .map(|(tu, t)| {
            let (idx, vals) = tu.entries(u.codec);
            let k = tu.k as usize;
            let vals: Vec<f32> = vals
                .iter()
                .map(|&v| {
                    n += 1;
                    let y = f(n - 1, v);
                    match u.codec {
                        ValueCodec::Sign => y,
                        _ => y.clamp(-1e30, 1e30),
                    }
                })
                .collect();
            TensorUpdate::from_entries(t, k, u.codec, &idx, &vals)
        })
        .collect();
    SparseUpdate {
        codec: u.codec,
        tensors,
    }
}

/// Every value negated.
pub fn signflip(u: &SparseUpdate, layout: &Layout) -> SparseUpdate {
    map_values(u, layout, |_, v| -v)
}

/// Float values ×`factor` (sign values unchanged: they have no magnitude).
pub fn scale(u: &SparseUpdate, layout: &Layout, factor: f64) -> SparseUpdate {
    match u.codec {
        ValueCodec::Sign => u.clone(),
        _ => map_values(u, layout, |_, v| (v as f64 * factor) as f32),
    }
}

/// Random coefficients with random signs; float values Gaussian with std `scale` × the RMS
/// of `honest`'s values.
pub fn noise(
    honest: &SparseUpdate,
    layout: &Layout,
    k: u32,
    scale: f32,
    rng: &mut Rng,
) -> SparseUpdate {
    let d = Dense::new(layout);
    let h = d.scatter(honest);
    let kept = h.iter().filter(|x| **x != 0.0).count().max(1);
    let rms = (h.iter().map(|x| x * x).sum::<f64>() / kept as f64).sqrt();
    let rank: Vec<f64> = (0..d.len).map(|_| rng.unit()).collect();
    let value: Vec<f64> = (0..d.len)
        .map(|_| gaussian(rng) * scale as f64 * rms.max(f64::MIN_POSITIVE))
        .collect();
    d.gather(k, honest.codec, &rank, &value)
}

/// Standard normal (Box–Muller), from the seeded stream.
fn gaussian(rng: &mut Rng) -> f64 {
    let u = rng.unit().max(1e-300);
    let v = rng.unit();
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

/// Per-coefficient mean and standard deviation of `honest` (dense, zeros where not kept).
fn moments(d: &Dense, honest: &[&SparseUpdate]) -> (Vec<f64>, Vec<f64>) {
    let n = honest.len().max(1) as f64;
    let mut s1 = vec![0.0; d.len];
    let mut s2 = vec![0.0; d.len];
    for u in honest {
        for (i, x) in d.scatter(u).into_iter().enumerate() {
            s1[i] += x;
            s2[i] += x * x;
        }
    }
    let mu: Vec<f64> = s1.iter().map(|s| s / n).collect();
    let sd = s2
        .iter()
        .zip(&mu)
        .map(|(s, m)| (s / n - m * m).max(0.0).sqrt())
        .collect();
    (mu, sd)
}

/// ALIE: `μ − z·σ·sign(μ)` on the `k` coefficients per block with the largest |μ|. With no
/// honest update in view it falls back to `own` (a lone attacker has nothing to hide behind).
pub fn alie(
    own: &SparseUpdate,
    honest: &[&SparseUpdate],
    layout: &Layout,
    k: u32,
    z: f64,
) -> SparseUpdate {
    if honest.is_empty() {
        return own.clone();
    }
    let d = Dense::new(layout);
    let (mu, sd) = moments(&d, honest);
    let rank: Vec<f64> = mu.iter().map(|m| m.abs()).collect();
    let value: Vec<f64> = mu
        .iter()
        .zip(&sd)
        .map(|(m, s)| m - z * s * if *m >= 0.0 { 1.0 } else { -1.0 })
        .collect();
    d.gather(k, own.codec, &rank, &value)
}

/// IPM: `−ε·μ` on the `k` coefficients per block with the largest |μ|.
pub fn ipm(
    own: &SparseUpdate,
    honest: &[&SparseUpdate],
    layout: &Layout,
    k: u32,
    epsilon: f64,
) -> SparseUpdate {
    if honest.is_empty() {
        return signflip(own, layout);
    }
    let d = Dense::new(layout);
    let (mu, _) = moments(&d, honest);
    let rank: Vec<f64> = mu.iter().map(|m| m.abs()).collect();
    let value: Vec<f64> = mu.iter().map(|m| -epsilon * m).collect();
    d.gather(k, own.codec, &rank, &value)
}

/// The free rider's update (see [`Attack::Zero`]).
pub fn zero(layout: &Layout, k: u32, codec: ValueCodec) -> SparseUpdate {
    let tensors = layout
        .tensors
        .iter()
        .map(|t| {
            let ke = t.k_eff(k);
            let idx: Vec<u32> = (0..t.blocks()).flat_map(|_| 0..ke as u32).collect();
            let vals: Vec<f32> = (0..idx.len())
                .map(|e| match codec {
                    ValueCodec::Sign => {
                        if e % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        }
                    }
                    _ => 0.0,
                })
                .collect();
            TensorUpdate::from_entries(t, ke, codec, &idx, &vals)
        })
        .collect();
    SparseUpdate { codec, tensors }
}

/// `victim`'s update with a fraction `noise` of its values perturbed.
pub fn copy(victim: &SparseUpdate, layout: &Layout, noise: f64, rng: &mut Rng) -> SparseUpdate {
    if noise <= 0.0 {
        return victim.clone();
    }
    let codec = victim.codec;
    map_values(victim, layout, |_, v| {
        if !rng.chance(noise) {
            return v;
        }
        match codec {
            ValueCodec::Sign => -v,
            _ => v * (1.0 + (noise * gaussian(rng)) as f32),
        }
    })
}

// ---------------------------------------------------------------------------------------------
// the catalogue: what a content attacker publishes

/// Whom `copier` copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// One of the seen updates drawn by the rng; with none seen, its own update, perturbed
    /// alike (the simulator).
    Drawn,
    /// The first seen update; with none seen, its own update as is (`swarm run`).
    First,
}

/// What a content attack works from (see [`content_move`]).
pub struct Ctx<'a> {
    /// The attacker's honest update of the step, and the tokens it trained on.
    pub own: &'a SparseUpdate,
    pub tokens: u64,
    pub layout: &'a Layout,
    pub k: u32,
    /// The run's value codec (the free rider's values).
    pub codec: ValueCodec,
    /// Others' honest updates in view: the simulator's attackers see the current step's,
    /// `swarm run --adversary` the previous step's (the last applied).
    pub seen: &'a [&'a SparseUpdate],
    /// Whether its own update of the `stale` lag ago is at hand (the caller keeps it).
    pub past: bool,
    pub pick: Pick,
    pub rng: &'a mut Rng,
}

/// Which update a [`ContentMove`] publishes.
#[derive(Clone, Debug, PartialEq)]
pub enum Body {
    /// Its own honest update, as is.
    Own,
    /// Its own update of the `stale` lag ago (the caller's, see [`Ctx::past`]).
    Past,
    /// A made-up one.
    New(SparseUpdate),
}

/// A content attacker's update for the step and the tokens its header claims.
#[derive(Clone, Debug, PartialEq)]
pub struct ContentMove {
    pub body: Body,
    pub tokens: u64,
}

/// The one catalogue of content attacks, for the simulator and `swarm run --adversary` alike:
/// what `attack` publishes in place of `cx.own`. None for the attacks that are not about
/// content (withholding, silence, equivocation, malformed messages: the caller's, which
/// delivers them its own way; see [`malformed`]).
pub fn content_move(attack: Attack, cx: Ctx) -> Option<ContentMove> {
    let Ctx {
        own,
        tokens,
        layout,
        k,
        codec,
        seen,
        past,
        pick,
        rng,
    } = cx;
    let new = |u: SparseUpdate| Body::New(u);
    let (body, tokens) = match attack {
        Attack::Withhold | Attack::Silent | Attack::Equivocate | Attack::Malformed => return None,
        Attack::Noise { scale } => (new(noise(own, layout, k, scale, rng)), tokens),
        Attack::Signflip | Attack::Sybil { .. } => (new(signflip(own, layout)), tokens),
        Attack::Scale { factor, claim } => {
            let t = if claim {
                (tokens as f64 * factor).min(u64::MAX as f64) as u64
            } else {
                tokens
            };
            (new(scale(own, layout, factor)), t)
        }
        Attack::Overclaim { factor } => (Body::Own, tokens.saturating_mul(factor)),
        Attack::Alie { z } => (new(alie(own, seen, layout, k, z)), tokens),
        Attack::Ipm { epsilon } => (new(ipm(own, seen, layout, k, epsilon)), tokens),
        Attack::Zero => (new(zero(layout, k, codec)), tokens),
        Attack::Copier { noise } => {
            let body = match pick {
                Pick::Drawn => {
                    let victim = if seen.is_empty() {
                        own
                    } else {
                        seen[rng.below(seen.len() as u64) as usize]
                    };
                    new(copy(victim, layout, noise, rng))
                }
                Pick::First => match seen.first() {
                    Some(v) => new(copy(v, layout, noise, rng)),
                    None => Body::Own,
                },
            };
            (body, tokens)
        }
        Attack::Stale { .. } => (if past { Body::Past } else { Body::Own }, tokens),
    };
    Some(ContentMove { body, tokens })
}

/// What `malformed` sends at `step` (see [`Malformation::for_step`]).
pub enum Bad {
    /// A gossip frame that fails decoding, sent as is.
    Frame(Vec<u8>),
    /// Blob bytes that fail validation, to go out under a validly signed header.
    Blob(Vec<u8>),
}

/// The `malformed` attacker's message for `step`, built from its honest update `own`.
pub fn malformed(
    step: u64,
    own: &SparseUpdate,
    layout: &Layout,
    max_message_bytes: usize,
    rng: &mut Rng,
) -> Bad {
    let m = Malformation::for_step(step);
    if m.frame_level() {
        Bad::Frame(bad_frame(m, max_message_bytes, rng))
    } else {
        Bad::Blob(bad_blob(m, own, layout))
    }
}

// ---------------------------------------------------------------------------------------------
// malformed messages and forged frames

/// What the `malformed` attacker sends at a step (in turn, by step number).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Malformation {
    /// An announce frame whose body is random bytes (not CBOR): `Malformed`.
    Garbage,
    /// A frame over the run's message limit: `Oversize`, refused before parsing.
    Oversize,
    /// A valid signed header whose blob has a tensor of the wrong shape.
    Shape,
    /// A blob with an index out of its block's range (or, where the index width cannot
    /// express one, a repeated index).
    Index,
    /// A blob with a repeated index in a block.
    Duplicate,
    /// A blob with a NaN value (in a sign-valued run: a float blob, so the codec is wrong too).
    NonFinite,
}

impl Malformation {
    pub const ALL: [Malformation; 6] = [
        Malformation::Garbage,
        Malformation::Oversize,
        Malformation::Shape,
        Malformation::Index,
        Malformation::Duplicate,
        Malformation::NonFinite,
    ];

    pub fn for_step(step: u64) -> Malformation {
        Self::ALL[(step % Self::ALL.len() as u64) as usize]
    }

    /// Whether the bad part is the frame itself (else: a valid header, a bad blob).
    pub fn frame_level(self) -> bool {
        matches!(self, Malformation::Garbage | Malformation::Oversize)
    }
}

/// A whole gossip frame that fails decoding (`Garbage`, `Oversize`).
pub fn bad_frame(m: Malformation, max_message_bytes: usize, rng: &mut Rng) -> Vec<u8> {
    let len = match m {
        Malformation::Oversize => max_message_bytes + 64,
        _ => 200,
    };
    let mut f = vec![WIRE_VERSION, kind::ANNOUNCE];
    // 0xff is a CBOR "break" with nothing to close: never a valid first byte.
    f.push(0xff);
    f.extend((0..len).map(|_| rng.next_u64() as u8));
    f
}

/// Blob bytes (canonical CBOR of a `SparseUpdate`) that decode but fail validation against
/// the layout, built from `honest`.
pub fn bad_blob(m: Malformation, honest: &SparseUpdate, layout: &Layout) -> Vec<u8> {
    let mut u = honest.clone();
    let Some(t0) = layout.tensors.first() else {
        return vec![0xff];
    };
    match m {
        Malformation::Shape => {
            if let Some(t) = u.tensors.first_mut() {
                t.shape.push(1);
                t.shape[0] = t.shape[0].saturating_add(1);
            }
        }
        Malformation::Index | Malformation::Duplicate => {
            let Some(t) = u.tensors.first_mut() else {
                return vec![0xff];
            };
            let (mut idx, _) = t.entries(honest.codec);
            let elems = t0.block_elems();
            let bits = protocol::sparse::index_bits(elems);
            let fits = (elems as u64) < (1u64 << bits);
            if m == Malformation::Index && fits {
                if let Some(x) = idx.last_mut() {
                    *x = elems as u32;
                }
            } else if idx.len() >= 2 && t.k >= 2 {
                idx[1] = idx[0];
            } else if let Some(x) = idx.first_mut() {
                // k = 1: the only way left to break a block is its range; force the top value.
                *x = ((1u64 << bits) - 1) as u32;
            }
            t.indices = pack_bits(&idx, bits);
        }
        Malformation::NonFinite => {
            let codec = match honest.codec {
                ValueCodec::Sign => ValueCodec::F32,
                c => c,
            };
            let tensors = u
                .tensors
                .iter()
                .zip(&layout.tensors)
                .map(|(tu, t)| {
                    let (idx, vals) = tu.entries(honest.codec);
                    let mut vals = vals.clone();
                    if let Some(v) = vals.first_mut() {
                        *v = f32::NAN;
                    }
                    TensorUpdate::from_entries(t, tu.k as usize, codec, &idx, &vals)
                })
                .collect();
            u = SparseUpdate { codec, tensors };
        }
        Malformation::Garbage | Malformation::Oversize => {}
    }
    u.encode()
}

/// A header for `blob`, signed by `me` for `step`, with everything else as an honest node of
/// `run` would state it; returns the gossip announce (header only: blobs are fetched) and the
/// fetch response frame.
#[allow(clippy::too_many_arguments)]
pub fn forge(
    run: &RunConfig,
    run_id: RunId,
    me: &Identity,
    pow: u64,
    step: u64,
    base: (u64, Digest),
    blob: &[u8],
    tokens: u64,
) -> (ContentId, Vec<u8>, Vec<u8>) {
    let id = UpdateHeader::blob_id(&me.node_id(), step, blob);
    let header = UpdateHeader {
        run: run_id,
        step,
        sender: me.node_id(),
        blob: id,
        blob_len: blob.len() as u64,
        codec: run.optim.values,
        topk: run.optim.topk,
        chunk: run.optim.chunk,
        tokens,
        base_version: base.0,
        base_digest: base.1,
        pow,
    };
    let signed = Signed::sign(header, me);
    let announce = Message::Announce {
        header: signed.clone(),
        blob: None,
    }
    .encode();
    let update = Message::Update {
        header: signed,
        blob: blob.to_vec(),
    }
    .encode();
    (id, announce, update)
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::config::ModelConfig;

    fn layout() -> Layout {
        let m = ModelConfig {
            name: "s".into(),
            vocab: 64,
            dim: 16,
            layers: 1,
            heads: 2,
            kv_heads: 2,
            ffn: 32,
            seq_len: 8,
            rope_theta: 1e4,
            norm_eps: 1e-5,
        };
        Layout::for_model(&m, 8)
    }

    fn some(l: &Layout, codec: ValueCodec, seed: u64) -> SparseUpdate {
        let d = Dense::new(l);
        let mut r = derive(&[seed]);
        let rank: Vec<f64> = (0..d.len).map(|_| r.unit()).collect();
        let value: Vec<f64> = (0..d.len).map(|_| r.unit() - 0.5).collect();
        d.gather(4, codec, &rank, &value)
    }

    #[test]
    fn transforms_give_valid_updates_and_malformations_fail() {
        let l = layout();
        for codec in [ValueCodec::Sign, ValueCodec::F32] {
            let h: Vec<SparseUpdate> = (0..5).map(|s| some(&l, codec, s)).collect();
            let refs: Vec<&SparseUpdate> = h.iter().collect();
            let mut r = derive(&[9]);
            let outs = [
                signflip(&h[0], &l),
                scale(&h[0], &l, 100.0),
                noise(&h[0], &l, 4, 10.0, &mut r),
                alie(&h[0], &refs, &l, 4, 1.0),
                ipm(&h[0], &refs, &l, 4, 0.1),
                zero(&l, 4, codec),
                copy(&h[0], &l, 0.05, &mut r),
            ];
            for u in &outs {
                u.validate(&l, 4, codec).unwrap();
            }
            // Sign flip really flips; an exact copy is the same blob.
            assert_eq!(
                Dense::new(&l).scatter(&outs[0])[..],
                Dense::new(&l)
                    .scatter(&h[0])
                    .iter()
                    .map(|x| -x)
                    .collect::<Vec<_>>()[..]
            );
            assert_eq!(copy(&h[1], &l, 0.0, &mut r).encode(), h[1].encode());
            for m in Malformation::ALL.iter().filter(|m| !m.frame_level()) {
                let b = bad_blob(*m, &h[0], &l);
                let bad = SparseUpdate::decode(&b, 1 << 20)
                    .map_err(|e| e.to_string())
                    .and_then(|u| u.validate(&l, 4, codec).map_err(|e| e.to_string()));
                assert!(bad.is_err(), "{m:?} {codec:?} passed validation");
            }
        }
    }

    #[test]
    fn the_catalogue_claims_tokens_and_falls_back_as_asked() {
        let l = layout();
        let own = some(&l, ValueCodec::F32, 1);
        let other = some(&l, ValueCodec::F32, 2);
        let seen = [&other];
        let mut r = derive(&[3]);
        let mut go = |a: Attack, seen: &[&SparseUpdate], past: bool, pick: Pick| {
            content_move(
                a,
                Ctx {
                    own: &own,
                    tokens: 10,
                    layout: &l,
                    k: 4,
                    codec: ValueCodec::F32,
                    seen,
                    past,
                    pick,
                    rng: &mut r,
                },
            )
        };
        let scale = |claim| Attack::Scale {
            factor: 100.0,
            claim,
        };
        assert_eq!(
            go(scale(true), &[], false, Pick::Drawn).unwrap().tokens,
            1000
        );
        assert_eq!(
            go(scale(false), &[], false, Pick::Drawn).unwrap().tokens,
            10
        );
        let over = go(Attack::Overclaim { factor: 16 }, &[], false, Pick::Drawn).unwrap();
        assert_eq!((over.body, over.tokens), (Body::Own, 160));
        let stale = Attack::Stale { lag: 3 };
        assert_eq!(go(stale, &[], true, Pick::Drawn).unwrap().body, Body::Past);
        assert_eq!(go(stale, &[], false, Pick::Drawn).unwrap().body, Body::Own);
        let copier = Attack::Copier { noise: 0.0 };
        assert_eq!(go(copier, &[], false, Pick::First).unwrap().body, Body::Own);
        assert_eq!(
            go(copier, &seen, false, Pick::First).unwrap().body,
            Body::New(other.clone())
        );
        for a in [
            Attack::Withhold,
            Attack::Silent,
            Attack::Equivocate,
            Attack::Malformed,
        ] {
            assert!(go(a, &seen, false, Pick::Drawn).is_none());
        }
    }

    #[test]
    fn fractions_pick_disjoint_seeded_nodes() {
        let a = vec![
            Attacker::nodes(Attack::Silent, vec![3]),
            Attacker::fraction(Attack::Signflip, 0.25),
        ];
        let p = assign(&a, 16, 1);
        assert_eq!(p.len(), 5);
        assert!(p.contains(&(3, Attack::Silent)));
        assert_eq!(p, assign(&a, 16, 1));
        let mut ids: Vec<usize> = p.iter().map(|x| x.0).collect();
        ids.dedup();
        assert_eq!(ids.len(), 5);
    }
}

// ---------------------------------------------------------------------------------------------
// the measurement: every attack × hostile fraction against the honest-only run

/// One attack at one hostile fraction, with or without defences, against the honest-only
/// run of the same size, seed and defences.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub attack: String,
    pub fraction: f64,
    /// `full` or `off` (the run's content defences and `optim.combine`).
    pub defence: String,
    pub hostile_nodes: u32,
    pub final_loss: f64,
    pub honest_loss: f64,
    /// `100·(final − honest)/honest`.
    pub worse_pct: f64,
    /// The same nodes silent (present, training, publishing nothing): what the run would
    /// reach if every hostile node were simply absent, the best a defence can do.
    pub absent_loss: f64,
    /// `100·(final − absent)/absent`: the harm that got through the defences.
    pub worse_vs_absent_pct: f64,
    pub stats: crate::metrics::AttackStats,
    pub rejected: u64,
    pub desyncs: u64,
}

/// The scenario `base` with its attackers replaced by `attack` at `fraction` (none when
/// `attack` is None), and with defences on (`Defence::full()`, `combine = share`) or off
/// (none, `combine = mean`: the DeMo reference).
pub fn variant(
    base: &crate::Scenario,
    attack: Option<Attack>,
    fraction: f64,
    defended: bool,
) -> crate::Scenario {
    let mut s = base.clone();
    s.attackers = attack
        .map(|a| vec![Attacker::fraction(a, fraction)])
        .unwrap_or_default();
    if defended {
        // The base's own defences when it has any (e.g. full without accusations), else all.
        let on = base.defence.resolve().is_ok_and(|d| !d.is_off());
        if !on {
            s.defence = crate::scenario::DefenceSpec::full();
        }
        s.optim.combine = protocol::config::Combine::Share;
    } else {
        s.defence = crate::scenario::DefenceSpec::Preset("off".into());
        s.optim.combine = protocol::config::Combine::Mean;
    }
    s
}

/// Run every `attacks` × `fractions` under each of `defences` (true: on), each against the
/// honest-only run with the same defences. `progress(label)` is called before each run.
pub fn sweep(
    base: &crate::Scenario,
    attacks: &[Attack],
    fractions: &[f64],
    defences: &[(bool, Vec<Attack>)],
    jobs: usize,
    progress: &(dyn Fn(&str) + Sync),
) -> Result<Vec<Row>, crate::SimError> {
    // Every run is independent and seeded by the scenario alone, so they may run on `jobs`
    // threads in any order: the rows are the same, in the same order, for any `jobs`.
    // Per defence setting: the honest-only run, the attackers-absent run per fraction (the same
    // nodes, picked by seed and fraction, silent), then each attack at each fraction.
    let mut plan: Vec<(bool, Option<Attack>, f64)> = Vec::new();
    for (defended, only) in defences {
        plan.push((*defended, None, 0.0));
        for &f in fractions {
            plan.push((*defended, Some(Attack::Silent), f));
        }
        for a in attacks {
            if *a == Attack::Silent
                || (!only.is_empty() && !only.iter().any(|o| o.name() == a.name()))
            {
                continue;
            }
            for &f in fractions {
                plan.push((*defended, Some(*a), f));
            }
        }
    }
    let label = |(d, a, f): &(bool, Option<Attack>, f64)| match a {
        None => format!("honest-only, defences {}", on_off(*d)),
        Some(Attack::Silent) => format!(
            "silent (absent) at {:.0}%, defences {}",
            f * 100.0,
            on_off(*d)
        ),
        Some(a) => format!(
            "{} at {:.0}%, defences {}",
            a.label(),
            f * 100.0,
            on_off(*d)
        ),
    };
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<Option<Result<crate::Metrics, crate::SimError>>>> =
        plan.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|sc| {
        for _ in 0..jobs.clamp(1, plan.len().max(1)) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(job) = plan.get(i) else { break };
                progress(&label(job));
                let (d, a, f) = *job;
                let r = crate::run(&variant(base, a, f, d), &mut |_, _| {});
                let failed = r.is_err();
                *results[i].lock().expect("no poisoned runs") = Some(r);
                if failed {
                    break;
                }
            });
        }
    });
    let mut done: Vec<Option<crate::Metrics>> = Vec::with_capacity(plan.len());
    for r in results {
        match r.into_inner().expect("no poisoned runs") {
            Some(Ok(m)) => done.push(Some(m)),
            Some(Err(e)) => return Err(e),
            None => done.push(None),
        }
    }
    let get = |d: bool, a: Option<Attack>, f: f64| -> Option<&crate::Metrics> {
        plan.iter()
            .position(|p| p.0 == d && p.1 == a && p.2 == f)
            .and_then(|i| done[i].as_ref())
    };
    let loss = |m: Option<&crate::Metrics>| m.and_then(|m| m.totals.final_loss).unwrap_or(f64::NAN);
    let mut rows = Vec::new();
    for (defended, only) in defences {
        let h = loss(get(*defended, None, 0.0));
        for a in attacks {
            if !only.is_empty() && !only.iter().any(|o| o.name() == a.name()) {
                continue;
            }
            for &f in fractions {
                let abs = loss(get(*defended, Some(Attack::Silent), f));
                let Some(m) = get(*defended, Some(*a), f) else {
                    continue;
                };
                let l = loss(Some(m));
                let stats = m.adversary.clone().unwrap_or_default();
                rows.push(Row {
                    attack: a.label(),
                    fraction: f,
                    defence: on_off(*defended).into(),
                    hostile_nodes: stats.hostile_nodes,
                    final_loss: l,
                    honest_loss: h,
                    worse_pct: 100.0 * (l - h) / h,
                    absent_loss: abs,
                    worse_vs_absent_pct: 100.0 * (l - abs) / abs,
                    stats,
                    rejected: m.totals.rejected,
                    desyncs: m.totals.desyncs,
                });
            }
        }
    }
    Ok(rows)
}

fn on_off(b: bool) -> &'static str {
    if b {
        "full"
    } else {
        "off"
    }
}

/// The rows as a markdown table.
pub fn markdown(rows: &[Row], target_pct: f64) -> String {
    let mut s = String::from(
        "| attack | hostile | defences | final loss | honest-only | % worse | attackers absent | % worse vs absent | caught: penalties / bans | hostile incl. per apply | published | clean from step | false pen. | disagree steps |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let st = &r.stats;
        // Over the target (NaN counts as over: no loss is no pass).
        let missed = !matches!(
            r.worse_pct.partial_cmp(&target_pct),
            Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
        );
        let flag = if r.fraction == 0.25 && r.defence == "full" && missed {
            " ✗"
        } else {
            ""
        };
        s += &format!(
            "| {} | {:.0}% ({}) | {} | {:.5} | {:.5} | {:+.1}{} | {:.5} | {:+.1} | {} / {} | {:.2} | {} | {} | {} | {} |\n",
            r.attack,
            r.fraction * 100.0,
            r.hostile_nodes,
            r.defence,
            r.final_loss,
            r.honest_loss,
            r.worse_pct,
            flag,
            r.absent_loss,
            r.worse_vs_absent_pct,
            st.penalties,
            st.bans,
            st.hostile_included_per_apply,
            st.hostile_published,
            st.excluded_from_step.map_or("never".into(), |x| x.to_string()),
            st.false_penalties,
            st.honest_disagree_steps,
        );
    }
    s
}
