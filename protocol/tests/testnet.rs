//! The engines' network itself (`protocol::testnet`), which the simulator runs on too: gossip
//! relayed only after an engine accepts it (and not at all with relaying off), and each frame
//! handed to an engine once.

mod common;

use std::collections::BTreeMap;

use common::*;

/// Nodes 0 and 2 are linked only through node 1 (direct messages still reach anyone).
fn line() -> Sim {
    let mut sim = Sim::new(test_run(true), 3);
    sim.net.relay = true;
    sim.net.peers[0].mesh.remove(&2);
    sim.net.peers[2].mesh.remove(&0);
    sim
}

#[test]
fn gossip_crosses_a_line_through_the_relay_that_accepted_it() {
    let mut sim = line();
    sim.run_until(GENESIS + 6 * PERIOD);
    let (n0, n2) = (sim.nodes[0].id, sim.nodes[2].id);
    // No gossip frame travels over the missing link...
    assert!(!sim
        .heard
        .iter()
        .any(|(to, from, _)| (*to == 2 && *from == n0) || (*to == 0 && *from == n2)));
    // ...yet every node hears every update and applies the same sets.
    for i in 0..3 {
        let h = sim.history(i);
        assert!(h.len() >= 4, "node {i} applied {} steps", h.len());
        for (step, (ids, d)) in &h {
            assert_eq!(ids.len(), 3, "node {i} step {step}");
            assert_eq!(sim.history(0).get(step).map(|v| &v.1), Some(d));
        }
    }
}

#[test]
fn without_relaying_a_line_loses_the_far_side_gossip() {
    let mut sim = line();
    sim.net.relay = false;
    sim.run_until(GENESIS + 6 * PERIOD);
    let n0 = sim.nodes[0].id;
    assert!(!sim
        .heard
        .iter()
        .any(|(to, from, _)| *to == 2 && *from == n0));
    let n1 = sim.nodes[1].id;
    let direct = sim
        .heard
        .iter()
        .any(|(to, from, _)| *to == 2 && *from == n1);
    assert!(direct, "node 1's own frames still reach node 2");
}

#[test]
fn each_gossip_frame_reaches_each_engine_once() {
    let mut sim = Sim::new(test_run(true), 5);
    sim.net.relay = true;
    sim.run_until(GENESIS + 5 * PERIOD);
    let mut seen: BTreeMap<(usize, crypto::ContentId), u32> = BTreeMap::new();
    for (to, _, id) in &sim.heard {
        *seen.entry((*to, *id)).or_default() += 1;
    }
    assert!(seen.len() > 50, "only {} frames", seen.len());
    assert!(
        seen.values().all(|&n| n == 1),
        "a frame was handed over twice"
    );
}
