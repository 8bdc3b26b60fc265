//! Checkpoints in the simulator: joiners download them from the engines that serve them, over
//! the modelled links, and lying servers are found out (`scenarios/ckpt_liars.toml`).

use sim::scenario::Scenario;

fn liars() -> Scenario {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios/ckpt_liars.toml");
    Scenario::load(&p).unwrap()
}

#[test]
fn joiners_sync_from_honest_servers_and_liars_are_never_asked_again() {
    let sc = liars();
    let m = sim::run(&sc, &mut |_, _| {}).unwrap();
    let c = m.checkpoints.clone().expect("checkpoints were downloaded");
    eprintln!("{c:?}");
    // The three joiners loaded a checkpoint (one after a failed first try and its back-off),
    // synced, and apply with everyone else.
    assert_eq!(m.nodes, 9);
    assert!(c.synced >= 3 && c.loads >= 3 && c.failures >= 1, "{c:?}");
    let last = m.steps.last().unwrap();
    assert_eq!(last.applied_nodes, 9, "{last:?}");
    assert_eq!(last.agree, 1.0, "{last:?}");
    // The liars were asked and found out (a bad chunk, or a manifest two others outvoted):
    // never asked for a checkpoint again, yet not banned, so their (honest) updates still
    // count everywhere and every node agrees. No honest server was accused.
    assert!(c.liar_requests > 0, "{c:?}");
    assert!(c.liars_found >= 2 && c.liars_caught >= 2, "{c:?}");
    assert_eq!(c.liar_requests_after_caught, 0, "{c:?}");
    assert_eq!(c.false_accusations, 0, "{c:?}");
    assert!(m.steps.iter().all(|s| s.agree == 1.0), "{:?}", m.steps);
    // Seeded: the same scenario gives the same bytes.
    assert_eq!(
        m.to_json(),
        sim::run(&sc, &mut |_, _| {}).unwrap().to_json()
    );
}
