//! The engine's content defences (`RunConfig::defence`): the majority rule, spot checks with
//! reputation, copy detection, identity proof of work and probation. Every test checks both
//! that the hostile peer's updates stay out and that the honest nodes still agree.

mod common;

use common::*;
use crypto::NodeId;
use protocol::engine::{Action, Report};
use protocol::error::Offence;
use protocol::run::{Defence, RunConfig};

fn defended(d: Defence) -> RunConfig {
    let mut run = test_run(false);
    run.defence = d;
    run.validate().expect("the test run is valid");
    run
}

/// Steps (from `from` on) at which node `i` included an update of node `j`.
fn included_from(sim: &Sim, i: usize, j: usize, from: u64) -> Vec<u64> {
    let sender = sim.nodes[j].id;
    sim.nodes[i]
        .log
        .iter()
        .filter_map(|(_, a)| match a {
            Action::Apply { step, updates }
                if *step >= from && updates.iter().any(|u| u.sender == sender) =>
            {
                Some(*step)
            }
            _ => None,
        })
        .collect()
}

fn penalized_for(sim: &Sim, i: usize, who: &NodeId, what: fn(&Offence) -> bool) -> bool {
    sim.actions(i)
        .any(|a| matches!(a, Action::Penalize { peer, reason, .. } if peer == who && what(reason)))
}

#[test]
fn a_harmful_peer_is_spot_checked_outvoted_and_penalized() {
    let d = Defence {
        majority: true,
        spot_checks: 2,
        ..Defence::default()
    };
    let mut sim = Sim::new(defended(d), 6);
    sim.harmful.insert(5);
    sim.run_until(GENESIS + 14 * PERIOD);
    let honest = [0, 1, 2, 3, 4];
    assert_agree(&sim, &honest, 12);
    let bad = sim.nodes[5].id;
    for &i in &honest {
        // Caught within a few steps (each node checks 2 of 5 peers per step), then out for good.
        let late = included_from(&sim, i, 5, 6);
        assert!(
            late.is_empty(),
            "node {i} still included the harmful peer at {late:?}"
        );
        assert!(
            penalized_for(&sim, i, &bad, |e| *e == Offence::HarmfulUpdate),
            "node {i} never penalized the harmful peer"
        );
        assert!(sim.engine(i).reputation(&bad) < 0);
        // Honest peers keep being included: no false exclusion.
        for &j in &honest {
            if j != i {
                assert!(
                    included_from(&sim, i, j, 6).len() >= 7,
                    "node {j} lost at {i}"
                );
            }
        }
    }
}

#[test]
fn without_the_majority_rule_one_summary_forces_an_update_in() {
    // The same harmful peer, checks on but the union rule: its own summary lists its update,
    // so it stays in. This is what `majority` is for.
    let d = Defence {
        majority: false,
        spot_checks: 2,
        ..Defence::default()
    };
    let mut sim = Sim::new(defended(d), 6);
    sim.harmful.insert(5);
    sim.run_until(GENESIS + 12 * PERIOD);
    assert!(included_from(&sim, 0, 5, 6).len() >= 5);
}

#[test]
fn a_copier_is_detected_and_left_out() {
    let d = Defence {
        majority: true,
        copy_overlap_permille: 900,
        ..Defence::default()
    };
    let mut sim = Sim::new(defended(d), 5);
    sim.copies.insert(4, 1);
    sim.run_until(GENESIS + 10 * PERIOD);
    let honest = [0, 1, 2, 3];
    assert_agree(&sim, &honest, 8);
    let copier = sim.nodes[4].id;
    for &i in &honest {
        assert!(
            included_from(&sim, i, 4, 0).is_empty(),
            "node {i} included the copy"
        );
        assert!(
            included_from(&sim, i, 1, 0).len() >= 8,
            "the victim was left out at {i}"
        );
        assert!(penalized_for(&sim, i, &copier, |e| *e == Offence::Copy));
        assert!(sim.nodes[i].log.iter().any(|(_, a)| matches!(
            a,
            Action::Report(Report::CopySuspected { sender, .. }) if *sender == copier
        )));
    }
}

#[test]
fn proof_of_work_is_required_and_checked() {
    let d = Defence {
        pow_bits: 8,
        ..Defence::default()
    };
    let mut run = test_run(true);
    run.defence = d;
    let mut sim = Sim::new(run.clone(), 3);
    // A header from an identity without work: rejected, its signer penalized.
    let lazy = seed_identity(9);
    let blob = make_update(&run, 77).encode();
    let frame = announce(&run, &lazy, 1, &blob);
    sim.inject(GENESIS + PERIOD + 50, 0, lazy.node_id(), frame);
    sim.run_until(GENESIS + 6 * PERIOD);
    assert_agree(&sim, &[0, 1, 2], 4);
    for (step, (ids, _)) in sim.history(0) {
        assert_eq!(ids.len(), 3, "step {step}: the workers' updates all count");
    }
    assert!(penalized_for(&sim, 0, &lazy.node_id(), |e| *e == Offence::NoWork));
}

#[test]
fn a_newcomer_is_on_probation_until_it_passes_a_check() {
    let d = Defence {
        majority: true,
        spot_checks: 2,
        probation_steps: 2,
        ..Defence::default()
    };
    let mut sim = Sim::new(defended(d), 4);
    sim.run_until(GENESIS + 5 * PERIOD);
    // A fresh identity joins the run late (it has the parameters; think of a restarted key).
    let j = sim.add_node(20, None);
    sim.run_until(GENESIS + 16 * PERIOD);
    let newcomer = sim.nodes[j].id;
    let withheld: u64 = (0..4).map(|i| sim.engine(i).metrics().withheld).sum();
    assert!(
        withheld > 0,
        "nobody held back the newcomer's first updates"
    );
    // It passes checks and is then included like everyone else.
    let late = included_from(&sim, 0, j, 13);
    assert!(!late.is_empty(), "the newcomer never earned inclusion");
    assert!(sim.engine(0).reputation(&newcomer) > 0);
}

/// A server of provably bad checkpoints is penalized and never asked for one again; not
/// banned, since the evidence is the joiner's alone (a ban would leave its updates out there
/// only: see `engine::sync::on_download`).
#[test]
fn a_false_checkpoint_server_is_found_out_and_never_asked_again() {
    let mut sim = Sim::new(test_run(false), 4);
    // Node 1 (among the first attesters the joiner hears) corrupts every checkpoint answer it
    // serves: its manifests no longer verify.
    sim.liars.insert(1);
    sim.run_until(GENESIS + 4 * PERIOD);
    let liar = sim.nodes[1].id;
    let j = sim.add_node(9, None);
    sim.run_until(GENESIS + 12 * PERIOD);
    // The joiner asked the liar among the attesters, found it out, and synced from the others.
    assert!(sim.actions(j).any(|a| matches!(
        a,
        Action::Request { peer, .. } if *peer == liar
    )));
    assert!(sim.engine(j).is_checkpoint_liar(&liar));
    assert!(!sim.engine(j).is_banned(&liar));
    assert!(penalized_for(&sim, j, &liar, |e| matches!(
        e,
        Offence::BadCheckpoint(_)
    )));
    assert!(sim.engine(j).status().synced);
    // Never asked again once found out.
    let asked_after = sim.nodes[j]
        .log
        .iter()
        .skip_while(
            |(_, a)| !matches!(a, Action::Report(Report::CheckpointLiar { peer }) if *peer == liar),
        )
        .any(|(_, a)| matches!(a, Action::Request { peer, .. } if *peer == liar));
    assert!(!asked_after);
    // Its updates still count at the joiner, as everywhere else.
    assert_agree(&sim, &[0, 1, 2, 3, j], 11);
}

/// The last step at which any honest node included the harmful node's update.
fn last_included(sim: &Sim, honest: &[usize], bad: usize) -> Option<u64> {
    honest
        .iter()
        .filter_map(|&i| included_from(sim, i, bad, 0).into_iter().max())
        .max()
}

#[test]
fn accusations_get_a_harmful_peer_out_sooner() {
    // 12 nodes, each checking one peer per step: without accusations the harmful one waits to
    // be sampled by a majority; with them, the first catch makes everyone check it.
    let run_with = |accuse: bool| {
        let d = Defence {
            majority: true,
            spot_checks: 1,
            accuse,
            ..Defence::default()
        };
        let mut sim = Sim::new(defended(d), 12);
        sim.harmful.insert(11);
        sim.run_until(GENESIS + 16 * PERIOD);
        let honest: Vec<usize> = (0..11).collect();
        assert_agree(&sim, &honest, 14);
        let repeated: u64 = honest
            .iter()
            .map(|&i| sim.engine(i).metrics().repeated_checks)
            .sum();
        (last_included(&sim, &honest, 11), repeated)
    };
    let (without, r0) = run_with(false);
    let (with, r1) = run_with(true);
    assert_eq!(r0, 0);
    assert!(r1 > 0, "nobody repeated a check");
    let (w, wo) = (with.map_or(0, |s| s + 1), without.map_or(0, |s| s + 1));
    eprintln!("harmful update last included: step {with:?} with accusations, {without:?} without");
    assert!(
        w < wo && w <= 3,
        "harmful update included until step {with:?} with accusations, {without:?} without"
    );
}
