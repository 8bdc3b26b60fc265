//! The bodies of the fuzz targets, as plain functions: `fuzz_targets/*.rs` hand them
//! libFuzzer's inputs (nightly, `cargo +nightly fuzz run <target>`), and `tests/corpus.rs`
//! runs each over its seed corpus on stable, so that the suite builds every target and replays
//! its corpus where cargo-fuzz is absent. Each function panics only on a real bug.

pub mod common;

use crypto::{ContentId, Digest, Identity, NodeId};
use protocol::engine::{Engine, Event, Verdict};
use protocol::wire::{
    Accusation, EquivocationProof, Message, Signed, StepSummary, SummaryEquivocation, UpdateHeader,
    UpdateRules,
};

/// Every frame kind: the decoder never panics, and what it accepts is canonical.
pub fn frame(data: &[u8]) {
    let run = common::run();
    if let Ok(m) = Message::decode(data, &run.limits) {
        assert_eq!(m.encode(), data);
        match &m {
            Message::Equivocation(p) => {
                let _ = p.verify(&run.run_id());
            }
            Message::SummaryEquivocation(p) => {
                let _ = p.verify(&run.run_id());
            }
            Message::Announce { header, .. } | Message::Update { header, .. } => {
                let _ = header.verify();
            }
            Message::Summary(s) => {
                let _ = s.verify();
            }
            Message::Accusation(a) => {
                let _ = a.verify();
            }
            _ => {}
        }
    }
}

/// The update blob: size, structure, decode, canonical form, validation against the layout.
pub fn blob(data: &[u8]) {
    let run = common::run();
    let rules = UpdateRules::new(&run);
    let header = UpdateHeader {
        run: run.run_id(),
        step: 0,
        sender: NodeId([0; 32]),
        blob: UpdateHeader::blob_id(&NodeId([0; 32]), 0, data),
        blob_len: data.len() as u64,
        codec: run.optim.values,
        topk: run.optim.topk,
        chunk: run.optim.chunk,
        tokens: 0,
        base_version: 0,
        base_digest: Digest::default(),
        pow: 0,
    };
    let _ = rules.check_blob(&header, data);
}

/// The structural CBOR pre-check run before serde on every untrusted input.
pub fn cbor_precheck(data: &[u8]) {
    let _ = protocol::cbor::precheck(data);
}

/// PeerId parsing (base58btc + multihash), as `swarm` does for ids given on the command line.
pub fn peer_id(data: &[u8]) {
    if let Ok(s) = std::str::from_utf8(data) {
        if let Ok(id) = NodeId::from_peer_id_str(s) {
            assert_eq!(NodeId::from_peer_id_str(&id.peer_id_string()).unwrap(), id);
        }
    }
    let _ = NodeId::from_peer_id_bytes(data);
}

fn engine_at_genesis() -> Engine {
    Engine::new(
        common::run(),
        Identity::from_seed([5; 32]),
        Some(Digest::default()),
        999_990,
        1,
    )
}

/// The engine fed raw hostile frames (as gossip and as fetch responses) and arbitrary timing.
/// Input: a sequence of `[ctrl, len, bytes…]` records.
pub fn engine(data: &[u8]) {
    let mut e = engine_at_genesis();
    let mut now = 1_000_000u64;
    let mut rest = data;
    while rest.len() >= 2 {
        let (ctrl, len) = (rest[0], rest[1] as usize);
        let body = &rest[2..(2 + len).min(rest.len())];
        rest = &rest[(2 + len).min(rest.len())..];
        now += (ctrl as u64 & 0x0f) * 150;
        let from = NodeId([ctrl; 32]);
        let ev = match ctrl >> 6 {
            0 => Event::Message {
                from,
                tag: Some(now),
                bytes: body.to_vec(),
            },
            1 => Event::Fetched {
                from,
                blob: ContentId::of(body),
                bytes: body.to_vec(),
            },
            2 => Event::Applied {
                step: ctrl as u64 & 7,
                digest: Digest::of(body),
            },
            _ => Event::Timer,
        };
        let _ = e.handle(ev, now);
    }
}

/// Reads little fields off the fuzzer's bytes (zeros once they run out).
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }
    fn small(&mut self, n: u64) -> u64 {
        self.u8() as u64 % n.max(1)
    }
    fn digest(&mut self) -> Digest {
        Digest::of(&[self.u8(), self.u8()])
    }
    fn ids(&mut self) -> Vec<ContentId> {
        let n = self.small(4);
        let mut v: Vec<ContentId> = (0..n).map(|_| ContentId::of(&[self.u8() % 8])).collect();
        v.sort();
        v.dedup();
        v
    }
}

/// The engine fed *validly signed* messages from a fixed pool of keys, so that fuzzed bodies
/// pass the signature checks and reach what lies behind them: summaries and attestations,
/// equivocation proofs of both kinds, accusations, fetches, applies and checkpoint loads.
/// After each record it checks an invariant a hostile input must never break. Returns how many
/// messages the engine accepted (gossip verdict `Accept`), so tests can see it got that far.
pub fn engine_signed(data: &[u8]) -> usize {
    let mut accepted = 0;
    let run = common::run();
    let keys: Vec<Identity> = (0..4u8)
        .map(|i| Identity::from_seed([40 + i; 32]))
        .collect();
    let mut e = engine_at_genesis();
    let mut now = 1_000_000u64;
    let mut b = Bytes(data);
    let header = |b: &mut Bytes, k: &Identity, step: u64| {
        let blob_seed = b.u8();
        let blob = vec![blob_seed; 1 + blob_seed as usize % 64];
        let h = UpdateHeader {
            run: run.run_id(),
            step,
            sender: k.node_id(),
            blob: UpdateHeader::blob_id(&k.node_id(), step, &blob),
            blob_len: if b.u8() & 1 == 0 {
                blob.len() as u64
            } else {
                b.u8() as u64
            },
            codec: run.optim.values,
            topk: run.optim.topk,
            chunk: run.optim.chunk,
            tokens: b.small(64),
            base_version: step.saturating_sub(1),
            base_digest: Digest::default(),
            pow: 0,
        };
        (Signed::sign(h, k), blob)
    };
    let summary = |b: &mut Bytes, k: &Identity, step: u64| {
        let version = step.saturating_add(b.small(3)).saturating_sub(1);
        let s = StepSummary {
            run: run.run_id(),
            step,
            sender: k.node_id(),
            updates: b.ids(),
            params_version: if b.u8() == 255 { u64::MAX } else { version },
            params_digest: b.digest(),
            pow: 0,
        };
        Signed::sign(s, k)
    };
    while !b.0.is_empty() {
        let ctrl = b.u8();
        now += b.small(8) * 125;
        let k = &keys[(ctrl & 3) as usize];
        let from = if b.u8() & 1 == 0 {
            k.node_id()
        } else {
            keys[b.small(4) as usize].node_id()
        };
        let cur = run.timing.step_at(now);
        let step = cur.saturating_add(b.small(4)).saturating_sub(2);
        let msg = |m: Message| Event::Message {
            from,
            tag: Some(now),
            bytes: m.encode(),
        };
        let ev = match (ctrl >> 2) % 10 {
            0 => {
                let (h, blob) = header(&mut b, k, step);
                let inline = b.u8() & 1 == 0;
                msg(Message::Announce {
                    header: h,
                    blob: inline.then_some(blob),
                })
            }
            1 => msg(Message::Summary(summary(&mut b, k, step))),
            2 => {
                let (x, _) = header(&mut b, k, step);
                let (y, _) = header(&mut b, k, step);
                msg(Message::Equivocation(EquivocationProof::new(x, y)))
            }
            3 => {
                let x = summary(&mut b, k, step);
                let y = summary(&mut b, k, step);
                msg(Message::SummaryEquivocation(SummaryEquivocation::new(x, y)))
            }
            4 => {
                let a = Accusation {
                    run: run.run_id(),
                    step,
                    accuser: k.node_id(),
                    accused: keys[b.small(4) as usize].node_id(),
                    blob: ContentId::of(&[b.u8() % 8]),
                };
                msg(Message::Accusation(Signed::sign(a, k)))
            }
            5 => {
                let (h, blob) = header(&mut b, k, step);
                Event::Fetched {
                    from,
                    blob: h.body.blob,
                    bytes: Message::Update { header: h, blob }.encode(),
                }
            }
            6 => Event::Applied {
                step: e.status().version,
                digest: b.digest(),
            },
            7 => Event::CheckpointLoaded {
                version: if b.u8() == 255 { u64::MAX } else { step },
                digest: b.digest(),
            },
            8 => Event::FetchFailed {
                from,
                blob: ContentId::of(&[b.u8() % 8]),
            },
            _ => Event::Timer,
        };
        for a in e.handle(ev, now) {
            if let protocol::engine::Action::Verdict {
                verdict: Verdict::Accept,
                ..
            } = a
            {
                accepted += 1;
            }
        }
        // Nothing a peer sends may make the engine count more steps applied than exist.
        assert!(e.metrics().steps_applied <= run.timing.step_at(now) + 2);
    }
    accepted
}

/// A request-response request: the decoder never panics, and what it accepts is canonical.
pub fn request(data: &[u8]) {
    if let Ok(r) = protocol::download::Request::decode(data) {
        assert_eq!(r.encode(), data);
    }
}

/// The joiner's side of a checkpoint transfer (`protocol::download::CheckpointDownload`),
/// driven by the input: three honest servers of one checkpoint and a liar that signs another
/// of the same version. Each input byte picks a pending request and answers it honestly, with
/// bytes taken from the input, with a failure, or lets time pass. Whatever the order, the
/// download never panics, never finishes with parameters the honest servers did not sign
/// (one liar cannot make two agree, and no server's answer counts for another), and never
/// names for a ban a server that only ever answered honestly. Returns whether it finished.
pub fn download(data: &[u8]) -> bool {
    use protocol::download::{build_manifest, CheckpointDownload, DlAction, Request};

    const CHUNK: u32 = 64;
    let run = Digest([9; 32]);
    let mut limits = protocol::run::Limits::for_blob(8192);
    limits.max_checkpoint_chunk_bytes = 4096;
    let honest: Vec<(String, Vec<u32>, Vec<u8>)> = vec![
        ("a".into(), vec![4, 10], (0..160).map(|i| i as u8).collect()),
        ("b".into(), vec![2, 2], vec![3; 16]),
    ];
    let mut lie = honest.clone();
    lie[0].2[0] ^= 1;
    let layout: Vec<(String, Vec<u32>)> = honest
        .iter()
        .map(|(n, s, _)| (n.clone(), s.clone()))
        .collect();
    let ids: Vec<Identity> = (0..4u8)
        .map(|i| Identity::from_seed([40 + i; 32]))
        .collect();
    let peers: Vec<NodeId> = ids.iter().map(|i| i.node_id()).collect();
    let version = 12;
    let tensors = |p: usize| if p == 3 { &lie } else { &honest };
    let manifests: Vec<_> = (0..4)
        .map(|p| build_manifest(&ids[p], run, version, CHUNK, tensors(p)))
        .collect();
    let honest_digest = manifests[0].body.digest;
    let answer = |p: usize, r: &Request| -> Vec<u8> {
        match *r {
            Request::Manifest { min_version } if min_version <= version => {
                Message::Manifest(manifests[p].clone()).encode()
            }
            Request::Chunk { version: v, index } if v == version => {
                let stream: Vec<u8> = tensors(p).iter().flat_map(|t| t.2.clone()).collect();
                let lo = (index as usize * CHUNK as usize).min(stream.len());
                let hi = (lo + CHUNK as usize).min(stream.len());
                Message::Chunk(protocol::checkpoint::CheckpointChunk {
                    run,
                    version,
                    index,
                    data: stream[lo..hi].to_vec(),
                })
                .encode()
            }
            _ => Vec::new(),
        }
    };
    let mut now = 1_000u64;
    let (mut d, first) =
        CheckpointDownload::start(run, limits, layout, version, &peers, now, 2_000, 12_000);
    let mut pending: Vec<(usize, Request)> = Vec::new();
    // Servers that were ever given something other than their honest answer.
    let mut dirty = [false, false, false, true];
    let mut done = false;
    let mut check =
        |acts: Vec<DlAction>, pending: &mut Vec<(usize, Request)>, dirty: &[bool; 4]| {
            for a in acts {
                match a {
                    DlAction::Ask { peer, request } => {
                        let p = peers
                            .iter()
                            .position(|x| *x == peer)
                            .expect("asks only the peers given");
                        pending.push((p, request));
                    }
                    DlAction::Ban { peer, reason } => {
                        let p = peers
                            .iter()
                            .position(|x| *x == peer)
                            .expect("bans only the peers given");
                        assert!(dirty[p], "honest server {p} banned: {reason}");
                    }
                    DlAction::Done { digest, .. } => {
                        assert_eq!(
                            digest, honest_digest,
                            "finished on parameters no two honest servers signed"
                        );
                        done = true;
                    }
                    DlAction::Failed { .. } => {}
                }
            }
        };
    check(first, &mut pending, &dirty);
    let mut i = 0;
    while i < data.len() && !d.finished() {
        let b = data[i];
        i += 1;
        if pending.is_empty() || b & 3 == 3 {
            now += (b >> 2) as u64 * 100;
            let acts = d.tick(now);
            check(acts, &mut pending, &dirty);
            continue;
        }
        let (p, r) = pending.remove((b >> 2) as usize % pending.len());
        let acts = match b & 3 {
            0 => d.on_response(peers[p], &r, &answer(p, &r), now),
            1 => {
                let n = data.get(i).copied().unwrap_or(0) as usize;
                let bytes = data
                    .get(i + 1..(i + 1 + n).min(data.len()))
                    .unwrap_or(&[])
                    .to_vec();
                i += 1 + n;
                if bytes != answer(p, &r) {
                    dirty[p] = true;
                }
                d.on_response(peers[p], &r, &bytes, now)
            }
            _ => d.on_failure(peers[p], &r, now),
        };
        check(acts, &mut pending, &dirty);
    }
    drop(check);
    done
}
