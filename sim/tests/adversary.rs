//! Every attacker of `sim::adversary` in a short engine-mode run with the content defences on
//! (`defence = "full"`, `combine = "share"`): each is caught (penalized, banned or left out of
//! the applied sets, as counted in `Metrics::adversary`) or harmless (final loss within a
//! stated bound of the same run with the hostile nodes silent, i.e. absent), and the honest
//! nodes always apply the same parameters.

use sim::adversary::{variant, Attack};
use sim::metrics::AttackStats;
use sim::net::LinkProfile;
use sim::scenario::{NodeClass, Scenario};
use sim::Metrics;

const NODES: usize = 12;
/// A quarter of the nodes: 3 of 12.
const FRACTION: f64 = 0.25;

fn base() -> Scenario {
    let mut s = Scenario {
        name: "adv".into(),
        seed: 5,
        steps: 12,
        classes: vec![NodeClass {
            count: NODES,
            link: LinkProfile {
                up_mbit: 1000.0,
                down_mbit: 1000.0,
                latency_ms: 10.0,
                jitter_ms: 5.0,
                loss: 0.0,
            },
            compute_ms: 300,
        }],
        ..Scenario::default()
    };
    s.optim.lr = 0.05;
    s
}

fn run(sc: &Scenario) -> Metrics {
    sim::run(sc, &mut |_, _| {}).expect("the scenario runs")
}

fn attacked(a: Attack) -> (Metrics, AttackStats) {
    let m = run(&variant(&base(), Some(a), FRACTION, true));
    let st = m.adversary.clone().expect("attack stats");
    assert_eq!(st.hostile_nodes, 3, "{a:?}");
    // The invariant every attack must leave alone: honest nodes apply the same parameters,
    // and no honest node is penalized for an attacker's doing.
    assert_eq!(st.honest_disagree_steps, 0, "{a:?}: {st:?}");
    assert_eq!((st.false_penalties, st.false_bans), (0, 0), "{a:?}: {st:?}");
    (m, st)
}

fn loss(m: &Metrics) -> f64 {
    m.totals.final_loss.expect("a final loss")
}

/// Final loss with the same nodes silent: what the run reaches if the attackers are simply
/// absent, the best any defence can do.
fn absent() -> f64 {
    loss(&run(&variant(
        &base(),
        Some(Attack::Silent),
        FRACTION,
        true,
    )))
}

fn within(m: &Metrics, reference: f64, pct: f64, what: &str) {
    let l = loss(m);
    assert!(
        l <= reference * (1.0 + pct / 100.0),
        "{what}: final loss {l} vs {reference} with the attackers absent (bound +{pct}%)"
    );
}

#[test]
fn content_attacks_are_spot_checked_and_left_out() {
    let abs = absent();
    for a in [
        Attack::Signflip,
        Attack::Noise { scale: 10.0 },
        Attack::Zero,
    ] {
        let (m, st) = attacked(a);
        assert!(
            st.spot_hostile_failed > 0 && st.penalties > 0,
            "{a:?} never failed a spot check: {st:?}"
        );
        // Once enough honest nodes have condemned a sign flipper the majority rule keeps it
        // out for good; the harm is what got in before that (a few steps). Noise and the
        // free rider pass some checks early on (a random direction's gain on the objective is
        // noisy while far from the optimum), so they are caught more slowly.
        if a == Attack::Signflip {
            let clean = st.excluded_from_step.unwrap_or(u64::MAX);
            assert!(clean <= 9, "{a:?} still included late: {st:?}");
        }
        // Bounds: the damage of the first steps (the synthetic trainer's identity basis moves
        // a coordinate that only one sender kept by the full rate, whatever its weight).
        within(&m, abs, 30.0, a.name());
    }
}

#[test]
fn alie_and_ipm_do_no_harm_under_share() {
    let abs = absent();
    for a in [Attack::Alie { z: 1.0 }, Attack::Ipm { epsilon: 0.1 }] {
        let (m, st) = attacked(a);
        // Colluders compute the same vector: one blob, counted once ("first wins").
        assert!(st.hostile_included_per_apply <= 1.0, "{a:?}: {st:?}");
        within(&m, abs, 2.0, a.name());
    }
}

#[test]
fn overclaimed_tokens_and_stale_replays_are_harmless() {
    let abs = absent();
    // With sign values `scale` can only overstate its tokens, which `share` caps: it is an
    // honest contributor at honest weight. A stale replay is an honest update a few steps old.
    for a in [
        Attack::Scale {
            factor: 100.0,
            claim: true,
        },
        Attack::Stale { lag: 3 },
    ] {
        let (m, _) = attacked(a);
        within(&m, abs, 2.0, a.name());
    }
}

#[test]
fn copies_are_detected_or_counted_once() {
    let abs = absent();
    let (m, st) = attacked(Attack::Copier { noise: 0.01 });
    assert!(st.copies > 0 && st.penalties > 0, "{st:?}");
    assert_eq!(st.hostile_included, 0, "{st:?}");
    within(&m, abs, 2.0, "copier");
    // An exact copy is the victim's blob: a duplicate, ignored without penalty, never twice.
    let (m, st) = attacked(Attack::Copier { noise: 0.0 });
    assert_eq!(st.hostile_included, 0, "{st:?}");
    within(&m, abs, 2.0, "exact copier");
}

#[test]
fn equivocators_malformed_senders_and_withholders_are_kept_out() {
    let abs = absent();
    let (m, st) = attacked(Attack::Equivocate);
    assert!(st.equivocations > 0 && st.bans > 0, "{st:?}");
    assert_eq!(st.hostile_included, 0, "{st:?}");
    within(&m, abs, 2.0, "equivocate");

    let (m, st) = attacked(Attack::Malformed);
    assert!(m.totals.rejected > 0, "{:?}", m.totals);
    assert!(st.penalties > 0 && st.bans > 0, "{st:?}");
    assert_eq!(st.hostile_included, 0, "{st:?}");
    within(&m, abs, 2.0, "malformed");

    let (m, st) = attacked(Attack::Withhold);
    assert_eq!(st.hostile_included, 0, "{st:?}");
    within(&m, abs, 2.0, "withhold");
}

#[test]
fn sybils_pay_work_and_probation_for_each_identity() {
    let abs = absent();
    let (m, st) = attacked(Attack::Sybil { every: 4 });
    // Fresh identities at steps 4, 8 and 12 (the end).
    assert_eq!(st.hostile_identities, 12, "{st:?}");
    assert!(st.spot_hostile_failed > 0, "{st:?}");
    within(&m, abs, 30.0, "sybil");
}

#[test]
fn attacks_are_deterministic_and_defences_on_cost_nothing_honest() {
    let mut sc = variant(&base(), Some(Attack::Equivocate), FRACTION, true);
    sc.steps = 6;
    sc.attackers
        .push(sim::adversary::Attacker::nodes(Attack::Malformed, vec![0]));
    let a = run(&sc).to_json();
    assert_eq!(a, run(&sc).to_json());
    // Honest only, defences on: spot checks run and never fail an honest update here.
    let m = run(&variant(&base(), None, 0.0, true));
    let st = m.adversary.unwrap();
    assert!(st.spot_honest > 0, "{st:?}");
    assert_eq!(
        st.spot_honest_failed + st.false_penalties + st.false_bans,
        0,
        "{st:?}"
    );
}

#[test]
fn attackers_and_defences_parse_from_toml() {
    let sc = Scenario::from_toml(
        r#"
        defence = "full"
        [[attacker]]
        kind = "alie"
        fraction = 0.25
        z = 1.5
        [[attacker]]
        kind = "sybil"
        nodes = [1, 2]
        "#,
    )
    .unwrap();
    assert_eq!(sc.attackers[0].attack, Attack::Alie { z: 1.5 });
    assert_eq!(sc.attackers[1].attack, Attack::Sybil { every: 4 });
    assert_eq!(
        sc.defence.resolve().unwrap(),
        protocol::run::Defence::full()
    );
    let t = Scenario::from_toml("[defence]\nmajority = true\nspot_checks = 3\n").unwrap();
    assert_eq!(t.defence.resolve().unwrap().spot_checks, 3);
    assert!(Scenario::from_toml("defence = \"most\"").is_err());
    assert!(Scenario::from_toml("[[attacker]]\nkind = \"scale\"\nfraction = 1.5").is_err());
    assert!(Scenario::from_toml("[[attacker]]\nkind = \"ipm\"\nnodes = [99]").is_err());
}

/// Several colluders publishing the *same* blob (the free rider's fixed update) make honest
/// nodes attribute it to different senders, and a server may answer a fetch with another
/// signer's header. `Engine::on_fetched` takes the bytes for the header it holds (they hash to
/// the wanted id), and `accept_blob` fills every header of the step naming that id, so honest
/// nodes never miss such a blob: they agree on every step, with no resync.
#[test]
fn identical_blobs_from_several_senders() {
    let m = run(&variant(&base(), Some(Attack::Zero), FRACTION, true));
    let st = m.adversary.unwrap();
    assert_eq!(st.honest_disagree_steps, 0, "{st:?}");
    assert_eq!(m.totals.desyncs, 0, "{:?}", m.totals);
    let last = m.steps.last().unwrap();
    assert_eq!(last.agree, 1.0, "{last:?}");
}
