//! The engine drives rounds among in-memory nodes: updates are published, fetched, validated,
//! included and applied identically; bad, replayed and equivocating messages are refused with
//! their typed cause and their senders penalized; laggards repair, joiners catch up.

mod common;

use common::*;
use crypto::Identity;
use protocol::engine::{Action, Event, Report};
use protocol::error::{DecodeError, Offence};
use protocol::sparse::SparseError;
use protocol::wire::{Message, UpdateHeader};

fn penalized(sim: &Sim, i: usize, who: &crypto::NodeId) -> Vec<Offence> {
    sim.actions(i)
        .filter_map(|a| match a {
            Action::Penalize { peer, reason, .. } if peer == who => Some(reason.clone()),
            _ => None,
        })
        .collect()
}

fn banned(sim: &Sim, i: usize, who: &crypto::NodeId) -> bool {
    sim.actions(i)
        .any(|a| matches!(a, Action::Ban { peer, .. } if peer == who))
}

#[test]
fn four_nodes_fetch_validate_and_apply_identically() {
    let mut sim = Sim::new(test_run(false), 4);
    sim.run_until(GENESIS + 8 * PERIOD);
    assert_agree(&sim, &[0, 1, 2, 3], 6);
    for (step, (ids, _)) in sim.history(0) {
        assert_eq!(
            ids.len(),
            4,
            "step {step} should include every node's update"
        );
    }
    for i in 0..4 {
        let m = sim.engine(i).metrics();
        assert!(
            m.fetches >= 3 * 6,
            "blobs are fetched when not inline: {m:?}"
        );
        assert_eq!(m.rejected, 0, "{m:?}");
        assert!(!sim.actions(i).any(|a| matches!(a, Action::Penalize { .. })));
    }
}

#[test]
fn inline_blobs_need_no_fetch() {
    let mut sim = Sim::new(test_run(true), 3);
    sim.run_until(GENESIS + 6 * PERIOD);
    assert_agree(&sim, &[0, 1, 2], 4);
    assert_eq!(sim.engine(0).metrics().fetches, 0);
    assert!(sim.history(0).values().all(|(ids, _)| ids.len() == 3));
}

#[test]
fn same_events_same_actions_byte_for_byte() {
    let run = |_: ()| {
        let mut sim = Sim::new(test_run(false), 4);
        sim.run_until(GENESIS + 5 * PERIOD);
        sim.nodes
            .iter()
            .map(|n| format!("{:?}", n.log))
            .collect::<Vec<_>>()
    };
    let a = run(());
    let b = run(());
    assert_eq!(a, b);
    // And the frames themselves, not only their debug form.
    let frames = |_: ()| {
        let mut sim = Sim::new(test_run(false), 3);
        sim.run_until(GENESIS + 3 * PERIOD);
        sim.nodes[1]
            .log
            .iter()
            .filter_map(|(t, a)| match a {
                Action::Publish { bytes } => Some((*t, bytes.clone())),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(frames(()), frames(()));
}

fn rejected_with(sim: &Sim, i: usize, pred: impl Fn(&Offence) -> bool) -> bool {
    sim.actions(i)
        .any(|a| matches!(a, Action::Report(Report::Rejected { error, .. }) if pred(error)))
}

#[test]
fn malformed_bad_signature_and_invalid_content_are_penalized() {
    let run = test_run(true);
    let mut sim = Sim::new(run.clone(), 3);
    let m = Identity::from_seed([200; 32]);
    let mid = m.node_id();
    let t = GENESIS + PERIOD + 100;
    // 1. garbage
    sim.inject(t, 0, mid, vec![1, 2, 0xff, 0x00]);
    // 2. a valid frame whose signature was tampered with
    let blob = make_update(&run, 999).encode();
    let mut h = signed_header(&run, &m, 1, &blob);
    h.raw.sig.0[5] ^= 1;
    sim.inject(
        t + 1,
        0,
        mid,
        Message::Announce {
            header: h,
            blob: Some(blob.clone()),
        }
        .encode(),
    );
    // 3. validly signed, but the update repeats an index within a block
    let mut bad = make_update(&run, 998);
    let tl = &run.layout().tensors[0];
    let bits = protocol::sparse::index_bits(tl.block_elems());
    let n = tl.blocks() * tl.k_eff(run.optim.topk);
    bad.tensors[0].indices = protocol::sparse::pack_bits(&vec![5u32; n], bits);
    let bad = bad.encode();
    sim.inject(t + 2, 1, mid, announce(&run, &m, 1, &bad));
    // 4. an oversized frame
    sim.inject(t + 3, 2, mid, vec![1u8; 70 * 1024]);
    // 5. another run: ignored, not penalized
    let mut other = run.clone();
    other.seed = 1234;
    sim.inject(
        t + 4,
        2,
        crypto::NodeId([9; 32]),
        announce(&other, &m, 1, &blob),
    );
    sim.run_until(GENESIS + 5 * PERIOD);

    assert!(rejected_with(&sim, 0, |e| matches!(
        e,
        Offence::Decode(DecodeError::Malformed { .. } | DecodeError::UnknownKind(_))
    )));
    assert!(rejected_with(&sim, 0, |e| matches!(
        e,
        Offence::BadSignature { .. }
    )));
    assert!(rejected_with(&sim, 1, |e| matches!(
        e,
        Offence::Decode(DecodeError::Sparse(SparseError::DuplicateIndex { .. }))
    )));
    assert!(rejected_with(&sim, 2, |e| matches!(
        e,
        Offence::Decode(DecodeError::Oversize { .. })
    )));
    assert!(sim.actions(2).any(|a| matches!(
        a,
        Action::Report(Report::Ignored {
            error: Offence::WrongRun,
            ..
        })
    )));
    assert!(penalized(&sim, 2, &crypto::NodeId([9; 32])).is_empty());
    assert_eq!(penalized(&sim, 0, &mid).len(), 2);
    assert!(matches!(
        penalized(&sim, 1, &mid)[..],
        [Offence::Decode(DecodeError::Sparse(
            SparseError::DuplicateIndex { .. }
        ))]
    ));
    // The honest round is unaffected, and nothing of M's was applied.
    assert_agree(&sim, &[0, 1, 2], 3);
    let bad_id = UpdateHeader::blob_id(&m.node_id(), 1, &bad);
    assert!(sim
        .history(1)
        .values()
        .all(|(ids, _)| ids.len() == 3 && !ids.contains(&bad_id)));
}

#[test]
fn replayed_message_outside_window_is_refused() {
    let mut sim = Sim::new(test_run(true), 3);
    sim.run_until(GENESIS + PERIOD);
    let frame = sim.nodes[1]
        .log
        .iter()
        .find_map(|(_, a)| match a {
            Action::Publish { bytes } if bytes[1] == protocol::wire::kind::ANNOUNCE => {
                Some(bytes.clone())
            }
            _ => None,
        })
        .expect("node 1 announced its step-0 update");
    let relay = crypto::NodeId([7; 32]);
    sim.run_until(GENESIS + 7 * PERIOD);
    sim.inject(sim.now, 0, relay, frame.clone());
    sim.run_until(GENESIS + 8 * PERIOD);
    assert!(rejected_with(&sim, 0, |e| matches!(
        e,
        Offence::StepOutOfWindow { step: 0, .. }
    )));
    assert!(matches!(
        penalized(&sim, 0, &relay)[..],
        [Offence::StepOutOfWindow { .. }]
    ));
    // Step 0 was applied once.
    let h = sim.history(0);
    let id = match Message::decode(&frame, &sim.run.limits).unwrap() {
        Message::Announce { header, .. } => header.body.blob,
        _ => unreachable!(),
    };
    assert_eq!(h.values().filter(|(ids, _)| ids.contains(&id)).count(), 1);
}

#[test]
fn late_arrival_is_counted_not_applied() {
    let run = test_run(true);
    let mut sim = Sim::new(run.clone(), 3);
    let m = Identity::from_seed([201; 32]);
    let blob = make_update(&run, 77).encode();
    // Step 2's deadline is GENESIS + 3·PERIOD + grace; arrive after it.
    sim.inject(
        GENESIS + 3 * PERIOD + 150,
        0,
        m.node_id(),
        announce(&run, &m, 2, &blob),
    );
    sim.run_until(GENESIS + 6 * PERIOD);
    assert!(sim.engine(0).metrics().late >= 1);
    assert!(sim.actions(0).any(|a| matches!(
        a,
        Action::Report(Report::Ignored {
            error: Offence::Late { step: 2 },
            ..
        })
    )));
    assert!(penalized(&sim, 0, &m.node_id()).is_empty());
    assert!(!sim.history(0)[&2]
        .0
        .contains(&UpdateHeader::blob_id(&m.node_id(), 2, &blob)));
    assert_agree(&sim, &[0, 1, 2], 4);
}

#[test]
fn equivocation_is_proven_banned_and_excluded_everywhere() {
    let run = test_run(true);
    let mut sim = Sim::new(run.clone(), 4);
    let m = Identity::from_seed([202; 32]);
    let (a, b) = (
        make_update(&run, 1001).encode(),
        make_update(&run, 1002).encode(),
    );
    let t = GENESIS + 2 * PERIOD + 500;
    sim.inject(t, 0, m.node_id(), announce(&run, &m, 2, &a));
    sim.inject(t, 1, m.node_id(), announce(&run, &m, 2, &a));
    sim.inject(t, 2, m.node_id(), announce(&run, &m, 2, &b));
    sim.inject(t, 3, m.node_id(), announce(&run, &m, 2, &b));
    sim.run_until(GENESIS + 7 * PERIOD);
    let (ia, ib) = (
        UpdateHeader::blob_id(&m.node_id(), 2, &a),
        UpdateHeader::blob_id(&m.node_id(), 2, &b),
    );
    for i in 0..4 {
        assert!(
            banned(&sim, i, &m.node_id()),
            "node {i} did not ban the equivocator"
        );
        assert!(penalized(&sim, i, &m.node_id())
            .iter()
            .any(|e| matches!(e, Offence::Equivocation { step: 2, .. })));
        let (ids, _) = &sim.history(i)[&2];
        assert!(
            !ids.contains(&ia) && !ids.contains(&ib),
            "node {i} applied an equivocated update"
        );
        assert_eq!(ids.len(), 4);
    }
    // Someone published a proof, and it verifies for anyone.
    let proof = sim
        .actions(0)
        .chain(sim.actions(2))
        .find_map(|a| match a {
            Action::Publish { bytes } if bytes[1] == protocol::wire::kind::EQUIVOCATION => {
                Some(bytes.clone())
            }
            _ => None,
        })
        .expect("a proof was published");
    match Message::decode(&proof, &run.limits).unwrap() {
        Message::Equivocation(p) => assert_eq!(p.verify(&run.run_id()).unwrap(), (m.node_id(), 2)),
        _ => unreachable!(),
    }
    assert_agree(&sim, &[0, 1, 2, 3], 5);
}

#[test]
fn missed_announcements_are_repaired_from_summaries() {
    let mut sim = Sim::new(test_run(false), 4);
    // Node 3 never hears node 1's announcements.
    sim.drop = Box::new(|_, from, to, ev| {
        from == 1
            && to == 3
            && matches!(ev, Event::Message { bytes, .. } if bytes[1] == protocol::wire::kind::ANNOUNCE)
    });
    sim.run_until(GENESIS + 7 * PERIOD);
    assert_agree(&sim, &[0, 1, 2, 3], 5);
    assert!(sim.history(3).values().all(|(ids, _)| ids.len() == 4));
}

#[test]
fn a_vanished_peer_does_not_stall_the_round() {
    let mut sim = Sim::new(test_run(false), 4);
    sim.run_until(GENESIS + 3 * PERIOD + 200);
    sim.net.peers[3].alive = false;
    sim.run_until(GENESIS + 9 * PERIOD);
    assert_agree(&sim, &[0, 1, 2], 7);
    let h = sim.history(0);
    // Each step is applied at its apply time (no waiting for the dead node).
    assert!(h[&4].0.len() == 3 && h[&7].0.len() == 3);
    let applied_at: Vec<u64> = sim.nodes[0]
        .log
        .iter()
        .filter_map(|(t, a)| matches!(a, Action::Apply { step: 5.., .. }).then_some(*t))
        .collect();
    for (k, t) in applied_at.iter().enumerate() {
        let step = 5 + k as u64;
        assert!(
            *t <= sim.run.timing.apply_at(step) + sim.run.timing.grace_ms,
            "step {step} applied at {t}"
        );
    }
}

#[test]
fn a_joiner_takes_a_checkpoint_and_catches_up() {
    let mut sim = Sim::new(test_run(false), 4);
    sim.run_until(GENESIS + 3 * PERIOD + 300);
    let j = sim.add_node(9, None);
    sim.run_until(GENESIS + 11 * PERIOD);
    assert!(sim.engine(j).status().synced);
    assert!(sim
        .actions(j)
        .any(|a| matches!(a, Action::Report(Report::CheckpointRequested { .. }))));
    assert!(
        sim.history(j).len() >= 4,
        "joiner applied {:?}",
        sim.history(j).keys().collect::<Vec<_>>()
    );
    assert_agree(&sim, &[0, 1, 2, 3, j], 9);
    // Once synced it trains too: the last steps include five updates.
    assert_eq!(sim.history(0)[&9].0.len(), 5);
}

#[test]
fn a_node_with_a_wrong_digest_resyncs() {
    let mut sim = Sim::new(test_run(false), 4);
    sim.run_until(GENESIS + 2 * PERIOD + 700);
    // Corrupt node 3's parameters (as a mis-rounded apply would).
    sim.nodes[3].corrupt();
    sim.run_until(GENESIS + 10 * PERIOD);
    assert!(sim
        .actions(3)
        .any(|a| matches!(a, Action::Report(Report::Desync { .. }))));
    assert!(sim
        .actions(3)
        .any(|a| matches!(a, Action::Report(Report::Synced { .. }))));
    let (h0, h3) = (sim.history(0), sim.history(3));
    let last = *h3.keys().next_back().unwrap();
    assert!(last >= 8);
    assert_eq!(h0[&last], h3[&last]);
}

#[test]
fn early_arrivals_are_buffered_within_their_bound() {
    let mut run = test_run(true);
    run.limits.max_early_updates = 3;
    let mut sim = Sim::new(run.clone(), 2);
    // During step 1, five Sybils announce updates for step 2 (its window has not opened).
    let t = GENESIS + PERIOD + 200;
    let mut ids = Vec::new();
    for s in 0..5u8 {
        let m = Identity::from_seed([210 + s; 32]);
        let blob = make_update(&run, 5000 + s as u64).encode();
        ids.push(UpdateHeader::blob_id(&m.node_id(), 2, &blob));
        sim.inject(t + s as u64, 0, m.node_id(), announce(&run, &m, 2, &blob));
    }
    sim.run_until(GENESIS + 6 * PERIOD);
    let full = sim
        .actions(0)
        .filter(|a| {
            matches!(
                a,
                Action::Report(Report::Ignored {
                    error: Offence::BufferFull("early updates"),
                    ..
                })
            )
        })
        .count();
    assert_eq!(full, 2);
    assert_eq!(sim.engine(0).metrics().early, 3);
    // The three buffered ones were applied in step 2, at both nodes (node 1 fetched them).
    let h = sim.history(1);
    assert_eq!(h[&2].0.iter().filter(|id| ids.contains(id)).count(), 3);
    assert_agree(&sim, &[0, 1], 4);
}

/// Node 3 of 4 is a first-hop relay (`caps::RELAY`, no training).
fn relay_sim() -> Sim {
    use protocol::wire::caps;
    let mut sim = Sim::new(test_run(false), 4);
    sim.nodes[3].trains = false;
    sim.engine_mut(3).set_listen(
        Vec::new(),
        caps::SERVE_BLOBS | caps::SERVE_CHECKPOINTS | caps::RELAY,
    );
    let relay = sim.nodes[3].id;
    for i in 0..3 {
        sim.engine_mut(i).set_trusted_relays([relay]);
    }
    sim
}

#[test]
fn with_a_relay_each_trainer_uploads_once_and_fetches_from_the_relay() {
    let mut sim = relay_sim();
    sim.run_until(GENESIS + 8 * PERIOD);
    assert_agree(&sim, &[0, 1, 2, 3], 6);
    for (step, (ids, _)) in sim.history(0) {
        assert_eq!(ids.len(), 3, "step {step}: every trainer's update included");
    }
    let relay = sim.nodes[3].id;
    for i in 0..3 {
        let m = sim.engine(i).metrics();
        assert!(m.uploads >= 6, "node {i} uploads to the relay: {m:?}");
        // Its own update never goes out as gossip: only summaries do.
        let own_announces = sim
            .actions(i)
            .filter(|a| match a {
                Action::Publish { bytes } => matches!(
                    Message::decode(bytes, &sim.run.limits),
                    Ok(Message::Announce { .. })
                ),
                _ => false,
            })
            .count();
        assert_eq!(own_announces, 0, "node {i} gossiped an update");
        let elsewhere = sim
            .actions(i)
            .filter(|a| matches!(a, Action::Fetch { peer, .. } if *peer != relay))
            .count();
        assert_eq!(
            elsewhere, 0,
            "node {i} fetched from a trainer, not the relay"
        );
        assert_eq!(m.rejected, 0, "{m:?}");
    }
    let r = sim.engine(3).metrics();
    assert!(r.relayed >= 18, "the relay gossips what it verified: {r:?}");
}

#[test]
fn a_relay_nobody_chose_is_not_used() {
    let mut sim = relay_sim();
    for i in 0..3 {
        sim.engine_mut(i).set_trusted_relays([]);
    }
    sim.run_until(GENESIS + 8 * PERIOD);
    assert_agree(&sim, &[0, 1, 2, 3], 6);
    for i in 0..3 {
        assert_eq!(sim.engine(i).metrics().uploads, 0);
    }
    assert_eq!(sim.engine(3).metrics().relayed, 0);
}

#[test]
fn a_withholding_relay_delays_updates_but_loses_none() {
    let mut sim = relay_sim();
    // The relay swallows every upload (direct messages after the hellos).
    sim.drop = Box::new(|at, _from, to, ev| {
        to == 3 && at > GENESIS && matches!(ev, Event::Message { tag: None, .. })
    });
    sim.run_until(GENESIS + 8 * PERIOD);
    assert_agree(&sim, &[0, 1, 2, 3], 6);
    for (step, (ids, _)) in sim.history(0) {
        assert_eq!(
            ids.len(),
            3,
            "step {step}: summaries list each update and peers fetch it from its sender"
        );
    }
    assert_eq!(sim.engine(3).metrics().relayed, 0);
}

/// A Hello (and so an attestation) claiming parameters version u64::MAX used to overflow
/// `add_attest`'s window arithmetic: a panic in debug builds, from one unsigned message.
#[test]
fn hello_with_version_u64_max_is_ignored_not_a_panic() {
    let run = test_run(true);
    let mut sim = Sim::new(run.clone(), 3);
    let liar = Identity::from_seed([202; 32]);
    let hello = Message::Hello(protocol::wire::Hello {
        version: protocol::wire::PROTOCOL_VERSION,
        run: run.run_id(),
        node: liar.node_id(),
        capabilities: 0,
        listen: vec![],
        params_version: u64::MAX,
        params_digest: crypto::Digest::of(b"forged"),
    });
    for at in [GENESIS + 10, GENESIS + 3 * PERIOD] {
        sim.inject(at, 0, liar.node_id(), hello.encode());
    }
    sim.run_until(GENESIS + 6 * PERIOD);
    assert_agree(&sim, &[0, 1, 2], 4);
}

/// A joiner's trainer reports a loaded checkpoint of version u64::MAX (what a lying server
/// can hand it): no overflow, no waiting forever for an attestation that cannot come. It is
/// reported unattested at once, and the joiner asks again and catches up with the swarm.
#[test]
fn a_loaded_checkpoint_of_version_u64_max_is_dropped_and_the_joiner_recovers() {
    let mut sim = Sim::new(test_run(false), 4);
    sim.run_until(GENESIS + 3 * PERIOD + 300);
    let j = sim.add_node(9, None);
    sim.push(
        GENESIS + 3 * PERIOD + 310,
        j,
        Event::CheckpointLoaded {
            version: u64::MAX,
            digest: crypto::Digest::of(b"forged"),
        },
    );
    sim.run_until(GENESIS + 11 * PERIOD);
    assert!(sim.actions(j).any(|a| matches!(
        a,
        Action::Report(Report::CheckpointUnattested {
            version: u64::MAX,
            ..
        })
    )));
    assert!(sim.engine(j).status().synced);
    assert!(sim.history(j).len() >= 4);
    assert_agree(&sim, &[0, 1, 2, 3, j], 9);
}
