//! Properties: decode(encode(m)) = m for every message, and the decoders of untrusted bytes
//! (the same ones the cargo-fuzz targets in /fuzz drive) never panic, and whatever they accept
//! re-encodes to exactly the input (canonical form). Bounded case counts keep this in the
//! normal test suite.

mod common;

use common::*;
use crypto::{ContentId, Digest, Identity, NodeId};
use proptest::prelude::*;
use protocol::cbor::precheck;
use protocol::checkpoint::{CheckpointChunk, CheckpointManifest, Dtype};
use protocol::engine::{Engine, Event};
use protocol::wire::{
    EquivocationProof, Hello, Message, Signed, StepSummary, SummaryEquivocation, UpdateRules,
};

fn cfg() -> ProptestConfig {
    ProptestConfig {
        cases: 256,
        ..ProptestConfig::default()
    }
}

fn d32() -> impl Strategy<Value = [u8; 32]> {
    any::<[u8; 32]>()
}

fn golden_frames() -> Vec<Vec<u8>> {
    let run = test_run(true);
    let a = Identity::from_seed([1; 32]);
    let blob = make_update(&run, 5).encode();
    let h = signed_header(&run, &a, 3, &blob);
    let h2 = signed_header(&run, &a, 3, &make_update(&run, 6).encode());
    vec![
        Message::Announce {
            header: h.clone(),
            blob: Some(blob.clone()),
        }
        .encode(),
        Message::Announce {
            header: h.clone(),
            blob: None,
        }
        .encode(),
        Message::Update {
            header: h.clone(),
            blob: blob.clone(),
        }
        .encode(),
        Message::Equivocation(EquivocationProof::new(h, h2)).encode(),
        Message::Summary(Signed::sign(
            StepSummary {
                run: run.run_id(),
                step: 1,
                sender: a.node_id(),
                updates: vec![ContentId::of(b"q")],
                params_version: 1,
                params_digest: Digest::default(),
                pow: 0,
            },
            &a,
        ))
        .encode(),
    ]
}

/// Whatever the decoder accepts must be canonical: re-encoding gives the input back.
fn check_frame(bytes: &[u8]) {
    let run = test_run(true);
    if let Ok(m) = Message::decode(bytes, &run.limits) {
        assert_eq!(m.encode(), bytes);
        if let Message::Equivocation(p) = &m {
            let _ = p.verify(&run.run_id());
        }
        if let Message::SummaryEquivocation(p) = &m {
            let _ = p.verify(&run.run_id());
        }
    }
}

proptest! {
    #![proptest_config(cfg())]

    #[test]
    fn hello_round_trips(run in d32(), node in d32(), caps in any::<u64>(), v in any::<u64>(), dg in d32(),
                         listen in proptest::collection::vec("[a-z0-9/.:-]{0,40}", 0..8)) {
        let m = Message::Hello(Hello { version: 1, run: Digest(run), node: NodeId(node), capabilities: caps, listen, params_version: v, params_digest: Digest(dg) });
        let l = test_run(true).limits;
        prop_assert_eq!(Message::decode(&m.encode(), &l).unwrap(), m);
    }

    #[test]
    fn summary_round_trips(seed in any::<u8>(), step in any::<u64>(), ids in proptest::collection::btree_set(d32(), 0..20), v in any::<u64>()) {
        let id = Identity::from_seed([seed; 32]);
        let updates: Vec<ContentId> = ids.into_iter().map(ContentId).collect();
        let s = Signed::sign(StepSummary { run: Digest([1; 32]), step, sender: id.node_id(), updates, params_version: v, params_digest: Digest([2; 32]), pow: 0 }, &id);
        let other = Signed::sign(StepSummary { params_version: v ^ 1, ..s.body.clone() }, &id);
        let m = Message::Summary(s.clone());
        let back = Message::decode(&m.encode(), &test_run(true).limits).unwrap();
        if let Message::Summary(s) = &back { s.verify().unwrap(); }
        prop_assert_eq!(back, m);
        // Two of them are a proof that checks out, and round-trips.
        let p = Message::SummaryEquivocation(SummaryEquivocation::new(s, other));
        let back = Message::decode(&p.encode(), &test_run(true).limits).unwrap();
        if let Message::SummaryEquivocation(p) = &back {
            prop_assert_eq!(p.verify(&Digest([1; 32])).unwrap(), (id.node_id(), step));
        }
        prop_assert_eq!(back, p);
    }

    #[test]
    fn updates_and_proofs_round_trip(seed in any::<u8>(), step in 0u64..1000, useed in any::<u64>(), inline in any::<bool>()) {
        let run = test_run(true);
        let id = Identity::from_seed([seed; 32]);
        let blob = make_update(&run, useed).encode();
        let h = signed_header(&run, &id, step, &blob);
        let l = &run.limits;
        for m in [
            Message::Announce { header: h.clone(), blob: inline.then(|| blob.clone()) },
            Message::Update { header: h.clone(), blob: blob.clone() },
            Message::Equivocation(EquivocationProof::new(h.clone(), signed_header(&run, &id, step, &make_update(&run, useed ^ 1).encode()))),
        ] {
            prop_assert_eq!(Message::decode(&m.encode(), l).unwrap(), m);
        }
        // And the blob passes the run's rules.
        UpdateRules::new(&run).check_blob(&h.body, &blob).unwrap();
    }

    #[test]
    fn checkpoint_messages_round_trip(data in proptest::collection::vec(any::<u8>(), 0..300), cb in 1u32..64, index in any::<u32>()) {
        let run = test_run(true);
        let id = Identity::from_seed([3; 32]);
        let n = (data.len() / 4) as u32;
        let m = CheckpointManifest::build(run.run_id(), 2, id.node_id(), cb, &[("t".into(), vec![n], Dtype::F32, &data[..(n as usize) * 4])]);
        let mm = Message::Manifest(Signed::sign(m, &id));
        prop_assert_eq!(Message::decode(&mm.encode(), &run.limits).unwrap(), mm);
        let c = Message::Chunk(CheckpointChunk { run: run.run_id(), version: 2, index, data });
        prop_assert_eq!(Message::decode(&c.encode(), &run.limits).unwrap(), c);
    }

    // ---- the fuzz targets' bodies, on random and mutated inputs ----

    #[test]
    fn frame_decoder_never_panics_on_noise(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        check_frame(&bytes);
        let mut framed = vec![1u8, bytes.first().copied().unwrap_or(2) % 8];
        framed.extend_from_slice(&bytes);
        check_frame(&framed);
        let _ = precheck(&bytes);
    }

    #[test]
    fn frame_decoder_never_panics_on_mutations(which in 0usize..5, edits in proptest::collection::vec((any::<u16>(), any::<u8>(), 0u8..3), 1..6)) {
        let mut f = golden_frames()[which].clone();
        for (pos, val, op) in edits {
            let p = pos as usize % (f.len() + 1);
            match op {
                0 if p < f.len() => f[p] = val,
                1 => f.insert(p, val),
                _ => f.truncate(p.max(2)),
            }
        }
        check_frame(&f);
    }

    #[test]
    fn blob_validation_never_panics_on_mutations(useed in any::<u64>(), edits in proptest::collection::vec((any::<u16>(), any::<u8>()), 1..6), trunc in any::<u16>()) {
        let run = test_run(true);
        let rules = UpdateRules::new(&run);
        let mut b = make_update(&run, useed).encode();
        for (pos, val) in edits {
            let p = pos as usize % b.len();
            b[p] = val;
        }
        b.truncate(trunc as usize % (b.len() + 1) + 1);
        // Bypass the id check (a real sender would sign whatever it sends).
        let id = Identity::from_seed([4; 32]);
        let h = signed_header(&run, &id, 1, &b);
        if rules.check_blob(&h.body, &b).is_ok() {
            prop_assert!(protocol::sparse::SparseUpdate::decode(&b, b.len()).unwrap().encode() == b);
        }
    }

    #[test]
    fn engine_never_panics_on_hostile_events(frames in proptest::collection::vec((0usize..5, any::<u16>(), any::<u8>(), any::<bool>()), 1..12)) {
        let run = test_run(false);
        let mut e = Engine::new(run, Identity::from_seed([5; 32]), Some(genesis_digest()), GENESIS - 10, 1);
        let golden = golden_frames();
        let mut now = GENESIS;
        for (k, (w, pos, val, fetched)) in frames.into_iter().enumerate() {
            let mut f = golden[w].clone();
            let p = pos as usize % f.len();
            if k % 2 == 1 { f[p] = val; }
            now += 97;
            let from = NodeId([val; 32]);
            let ev = if fetched {
                Event::Fetched { from, blob: ContentId::of(&f), bytes: f }
            } else {
                Event::Message { from, tag: Some(k as u64), bytes: f }
            };
            let _ = e.handle(ev, now);
            let _ = e.handle(Event::Timer, now);
            // The next wake-up never lies in the past.
            prop_assert!(e.poll_timeout().is_none_or(|t| t > now));
        }
    }
}
