//! The joiner's side of a checkpoint transfer (`protocol::download::CheckpointDownload`) against
//! every way a server can fail or lie, without a network; and the request kinds' encoding.
use std::collections::BTreeSet;

use crypto::{ContentId, NodeId};
use protocol::checkpoint::CheckpointManifest;
use protocol::download::*;
use protocol::run::{Limits, RunId};
use protocol::wire::{Message, Signed};

#[test]
fn requests_round_trip_and_unknown_kinds_are_refused() {
    for r in [
        Request::Frame(vec![1, 2, 3]),
        Request::Blob(ContentId([7; 32])),
    ] {
        assert_eq!(Request::decode(&r.encode()).unwrap(), r);
    }
    assert!(Request::decode(&[9, 1]).is_err());
    assert!(Request::decode(&[1, 1, 2]).is_err());
    for r in [
        Request::Manifest { min_version: 7 },
        Request::Chunk {
            version: 9,
            index: 3,
        },
    ] {
        assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        // Fixed lengths: one byte more or less is refused.
        let mut long = r.encode();
        long.push(0);
        assert!(Request::decode(&long).is_err());
        assert!(Request::decode(&long[..long.len() - 2]).is_err());
    }
}

// ---- checkpoint download ------------------------------------------------------------

use crypto::Identity;
use protocol::checkpoint::CheckpointChunk;

const CHUNK: u32 = 100;

fn limits() -> Limits {
    let mut l = Limits::for_blob(8192);
    l.max_checkpoint_chunk_bytes = 4096;
    l
}

/// Two tensors, 3·40 + 2·2·4 = 136 bytes: two chunks of 100.
fn tensors(salt: u8) -> Vec<(String, Vec<u32>, Vec<u8>)> {
    vec![
        (
            "a".into(),
            vec![3, 10],
            (0..120).map(|i| i as u8 ^ salt).collect(),
        ),
        ("b".into(), vec![2, 2], vec![salt; 16]),
    ]
}

fn layout() -> Vec<(String, Vec<u32>)> {
    tensors(0).into_iter().map(|(n, s, _)| (n, s)).collect()
}

fn stream(t: &[(String, Vec<u32>, Vec<u8>)]) -> Vec<u8> {
    t.iter().flat_map(|(_, _, b)| b.clone()).collect()
}

fn chunk_frame(run: RunId, version: u64, index: u32, data: &[u8]) -> Vec<u8> {
    let lo = index as usize * CHUNK as usize;
    let hi = (lo + CHUNK as usize).min(data.len());
    Message::Chunk(CheckpointChunk {
        run,
        version,
        index,
        data: data[lo..hi].to_vec(),
    })
    .encode()
}

struct World {
    run: RunId,
    ids: Vec<Identity>,
}

impl World {
    fn new(n: usize) -> World {
        World {
            run: crypto::Digest([5; 32]),
            ids: (0..n)
                .map(|i| Identity::from_seed([i as u8 + 1; 32]))
                .collect(),
        }
    }
    fn node(&self, i: usize) -> NodeId {
        self.ids[i].node_id()
    }
    fn manifest(&self, i: usize, version: u64, t: &[(String, Vec<u32>, Vec<u8>)]) -> Vec<u8> {
        Message::Manifest(build_manifest(&self.ids[i], self.run, version, CHUNK, t)).encode()
    }
    fn start(&self, peers: &[usize]) -> (CheckpointDownload, Vec<DlAction>) {
        let p: Vec<NodeId> = peers.iter().map(|&i| self.node(i)).collect();
        CheckpointDownload::start(self.run, limits(), layout(), 5, &p, 0, 1000, 10_000)
    }
}

fn asks(acts: &[DlAction]) -> Vec<(NodeId, Request)> {
    acts.iter()
        .filter_map(|a| match a {
            DlAction::Ask { peer, request } => Some((*peer, request.clone())),
            _ => None,
        })
        .collect()
}

fn bans(acts: &[DlAction]) -> Vec<NodeId> {
    acts.iter()
        .filter_map(|a| match a {
            DlAction::Ban { peer, .. } => Some(*peer),
            _ => None,
        })
        .collect()
}

/// Answer every chunk request from `serve(peer) -> stream`, until the download ends.
fn serve_chunks(
    w: &World,
    d: &mut CheckpointDownload,
    mut acts: Vec<DlAction>,
    version: u64,
    serve: impl Fn(NodeId) -> Vec<u8>,
) -> Vec<DlAction> {
    let mut all = Vec::new();
    for _ in 0..100 {
        let q = asks(&acts);
        all.extend(acts.drain(..));
        if q.is_empty() {
            break;
        }
        for (peer, req) in q {
            let Request::Chunk { index, .. } = req else {
                continue;
            };
            let f = chunk_frame(w.run, version, index, &serve(peer));
            acts.extend(d.on_response(peer, &req, &f, 1));
        }
    }
    all
}

#[test]
fn two_agreeing_servers_share_the_download_and_it_verifies() {
    let w = World::new(3);
    let t = tensors(1);
    let (mut d, acts) = w.start(&[0, 1, 2]);
    assert_eq!(asks(&acts).len(), 3);
    let mut acts = Vec::new();
    for i in 0..3 {
        // Node 2 is a step ahead: the other two agree on version 5.
        let (v, tt) = if i == 2 {
            (6, tensors(9))
        } else {
            (5, t.clone())
        };
        acts = d.on_response(
            w.node(i),
            &Request::Manifest { min_version: 5 },
            &w.manifest(i, v, &tt),
            1,
        );
    }
    let chunk_asks = asks(&acts);
    assert_eq!(chunk_asks.len(), 2, "{acts:?}");
    let servers: BTreeSet<NodeId> = chunk_asks.iter().map(|(p, _)| *p).collect();
    assert_eq!(
        servers,
        BTreeSet::from([w.node(0), w.node(1)]),
        "spread over both"
    );
    let all = serve_chunks(&w, &mut d, acts, 5, |_| stream(&t));
    let done = all.iter().find_map(|a| match a {
        DlAction::Done {
            version,
            digest,
            tensors,
            servers,
            ..
        } => Some((*version, *digest, tensors.clone(), servers.len())),
        _ => None,
    });
    let (v, digest, got, n) = done.expect("done");
    assert_eq!((v, n), (5, 2));
    assert_eq!(got, t.iter().map(|x| x.2.clone()).collect::<Vec<_>>());
    assert_eq!(
        digest,
        CheckpointManifest::build(
            w.run,
            5,
            w.node(0),
            CHUNK,
            &t.iter()
                .map(|(n, s, b)| (
                    n.clone(),
                    s.clone(),
                    protocol::checkpoint::Dtype::F32,
                    &b[..]
                ))
                .collect::<Vec<_>>()
        )
        .digest
    );
    assert!(bans(&all).is_empty());
    assert!(d.finished());
}

#[test]
fn disagreeing_manifests_fail_and_one_peer_is_not_enough() {
    let w = World::new(3);
    let (_, acts) = w.start(&[0]);
    assert!(
        matches!(acts.last(), Some(DlAction::Failed { .. })),
        "{acts:?}"
    );
    let (mut d, _) = w.start(&[0, 1]);
    d.on_response(
        w.node(0),
        &Request::Manifest { min_version: 5 },
        &w.manifest(0, 5, &tensors(1)),
        1,
    );
    let acts = d.on_response(
        w.node(1),
        &Request::Manifest { min_version: 5 },
        &w.manifest(1, 5, &tensors(2)),
        1,
    );
    assert!(
        matches!(acts.last(), Some(DlAction::Failed { .. })),
        "{acts:?}"
    );
    // Different digests are not provable lies by themselves: nobody is banned.
    assert!(bans(&acts).is_empty());
}

#[test]
fn a_bad_chunk_bans_its_server_and_the_other_serves_it() {
    let w = World::new(2);
    let t = tensors(1);
    let (mut d, _) = w.start(&[0, 1]);
    d.on_response(
        w.node(0),
        &Request::Manifest { min_version: 5 },
        &w.manifest(0, 5, &t),
        1,
    );
    let acts = d.on_response(
        w.node(1),
        &Request::Manifest { min_version: 5 },
        &w.manifest(1, 5, &t),
        1,
    );
    let liar = w.node(1);
    let all = serve_chunks(&w, &mut d, acts, 5, |p| {
        let mut s = stream(&t);
        if p == liar {
            s[3] ^= 0xff;
        }
        s
    });
    assert_eq!(bans(&all), vec![liar]);
    assert!(
        all.iter().any(|a| matches!(a, DlAction::Done { .. })),
        "{all:?}"
    );
}

#[test]
fn forged_wrong_model_and_self_contradicting_manifests_are_banned() {
    let w = World::new(4);
    let t = tensors(1);
    let (mut d, _) = w.start(&[0, 1, 2, 3]);
    let m = Request::Manifest { min_version: 5 };
    // 0: signature of another key over 0's manifest.
    let mut forged = build_manifest(&w.ids[0], w.run, 5, CHUNK, &t);
    forged.raw.sig = w.ids[1].sign(
        protocol::wire::domain::CHECKPOINT_MANIFEST,
        &forged.raw.body,
    );
    let a0 = d.on_response(w.node(0), &m, &Message::Manifest(forged).encode(), 1);
    assert_eq!(bans(&a0), vec![w.node(0)]);
    // 1: a validly signed manifest of another model.
    let other = vec![("a".to_string(), vec![4u32], vec![0u8; 16])];
    let a1 = d.on_response(w.node(1), &m, &w.manifest(1, 5, &other), 1);
    assert_eq!(bans(&a1), vec![w.node(1)]);
    // 2 and 3 agree on a manifest whose chunk hashes were computed over other bytes than
    // its tensor hashes: every chunk verifies, the tensors do not.
    let good = build_manifest(&w.ids[2], w.run, 5, CHUNK, &t).body;
    let lie_bytes = tensors(7);
    let lie_chunks = build_manifest(&w.ids[2], w.run, 5, CHUNK, &lie_bytes)
        .body
        .chunks;
    let mut acts = Vec::new();
    for i in [2, 3] {
        let mut b = good.clone();
        b.server = w.node(i);
        b.chunks = lie_chunks.clone();
        acts = d.on_response(
            w.node(i),
            &m,
            &Message::Manifest(Signed::sign(b, &w.ids[i])).encode(),
            1,
        );
    }
    let all = serve_chunks(&w, &mut d, acts, 5, |_| stream(&lie_bytes));
    let mut b = bans(&all);
    b.sort();
    let mut want = vec![w.node(2), w.node(3)];
    want.sort();
    assert_eq!(b, want);
    assert!(
        matches!(all.last(), Some(DlAction::Failed { .. })),
        "{all:?}"
    );
}

#[test]
fn refusals_and_timeouts_end_in_failure_not_a_hang() {
    let w = World::new(2);
    let t = tensors(1);
    let (mut d, _) = w.start(&[0, 1]);
    let m = Request::Manifest { min_version: 5 };
    d.on_response(w.node(0), &m, &w.manifest(0, 5, &t), 1);
    let acts = d.on_response(w.node(1), &m, &w.manifest(1, 5, &t), 1);
    // Both servers moved on and no longer hold version 5.
    let mut acts = acts;
    for _ in 0..4 {
        let q = asks(&acts);
        acts.clear();
        for (p, r) in q {
            acts.extend(d.on_response(p, &r, &[], 2));
        }
    }
    assert!(d.finished());
    // A silent peer: the manifest deadline decides with what came in, then the total one.
    let (mut d, _) = w.start(&[0, 1]);
    d.on_response(w.node(0), &m, &w.manifest(0, 5, &t), 1);
    assert!(d.tick(500).is_empty());
    let acts = d.tick(1000);
    assert!(
        matches!(acts.last(), Some(DlAction::Failed { .. })),
        "{acts:?}"
    );
    let (mut d, _) = w.start(&[0, 1]);
    d.on_response(w.node(0), &m, &w.manifest(0, 5, &t), 1);
    d.on_response(w.node(1), &m, &w.manifest(1, 5, &t), 1);
    let acts = d.tick(10_000);
    assert!(
        matches!(acts.last(), Some(DlAction::Failed { .. })),
        "{acts:?}"
    );
    let _ = bans(&acts);
}
