//! Golden vectors: every message built from fixed keys (fixed seeds) and fixed contents, its
//! frame compared byte for byte with the hex files checked in under tests/golden/, decoded and
//! re-encoded, and the examples quoted in docs/PROTOCOL.md checked against the same files.
//!
//! After an intended format change: `SWARM_BLESS=1 cargo test -p protocol --test golden`,
//! then review the diff and update docs/PROTOCOL.md.

mod common;

use std::path::PathBuf;

use common::*;
use crypto::{to_hex, ContentId, Digest, Identity};
use protocol::checkpoint::{CheckpointChunk, CheckpointManifest, Dtype};
use protocol::wire::{
    caps, domain, EquivocationProof, Hello, Message, Signed, StepSummary, SummaryEquivocation,
    PROTOCOL_VERSION,
};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn vectors() -> Vec<(&'static str, Vec<u8>)> {
    let run = test_run(true);
    let rid = run.run_id();
    let a = Identity::from_seed([1; 32]);
    let b = Identity::from_seed([2; 32]);
    let blob = make_update(&run, 5).encode();
    let header = signed_header(&run, &a, 3, &blob);
    let other = signed_header(&run, &a, 3, &make_update(&run, 6).encode());
    let hello = Message::Hello(Hello {
        version: PROTOCOL_VERSION,
        run: rid,
        node: a.node_id(),
        capabilities: caps::TRAIN | caps::SERVE_BLOBS,
        listen: vec!["/ip4/127.0.0.1/udp/4001/quic-v1".into()],
        params_version: 3,
        params_digest: Digest::of(b"params"),
    });
    let mut ids = vec![ContentId::of(b"x"), ContentId::of(b"y")];
    ids.sort();
    let summary = Message::Summary(Signed::sign(
        StepSummary {
            run: rid,
            step: 3,
            sender: b.node_id(),
            updates: ids,
            params_version: 3,
            params_digest: Digest::of(b"params"),
            pow: 0,
        },
        &b,
    ));
    // The same sender's second summary for step 3, listing nothing: with the first, a proof.
    let Message::Summary(s1) = &summary else {
        unreachable!()
    };
    let s2 = Signed::sign(
        StepSummary {
            updates: vec![],
            ..s1.body.clone()
        },
        &b,
    );
    let summary_equivocation =
        Message::SummaryEquivocation(SummaryEquivocation::new(s1.clone(), s2));
    let t1 = [1u8, 2, 3, 4, 5, 6, 7, 8];
    let t2 = [9u8, 10, 11, 12];
    let manifest = CheckpointManifest::build(
        rid,
        3,
        b.node_id(),
        5,
        &[
            ("w".into(), vec![2], Dtype::F32, &t1[..]),
            ("n".into(), vec![2], Dtype::Bf16, &t2[..]),
        ],
    );
    // Local steps: the optimizer in the run config, and an update blob with 2-bit values
    // (a per-tensor f32 step, then 2-bit codes).
    let mut local = test_run(true);
    local.optim.values = protocol::config::ValueCodec::Q2;
    local.optim.local = Some(protocol::config::LocalSteps::default());
    vec![
        ("run_config.cbor", run.canonical_bytes()),
        ("run_config_local.cbor", local.canonical_bytes()),
        ("update_q2.cbor", make_update(&local, 5).encode()),
        ("run_id", rid.0.to_vec()),
        (
            "signing_preimage",
            domain::UPDATE_HEADER.preimage(&header.raw.body),
        ),
        ("hello", hello.encode()),
        (
            "announce",
            Message::Announce {
                header: header.clone(),
                blob: Some(blob.clone()),
            }
            .encode(),
        ),
        (
            "announce_noblob",
            Message::Announce {
                header: header.clone(),
                blob: None,
            }
            .encode(),
        ),
        ("summary", summary.encode()),
        (
            "equivocation",
            Message::Equivocation(EquivocationProof::new(header.clone(), other)).encode(),
        ),
        ("summary_equivocation", summary_equivocation.encode()),
        ("update", Message::Update { header, blob }.encode()),
        (
            "manifest",
            Message::Manifest(Signed::sign(manifest, &b)).encode(),
        ),
        (
            "chunk",
            Message::Chunk(CheckpointChunk {
                run: rid,
                version: 3,
                index: 1,
                data: vec![6, 7, 8, 9, 10],
            })
            .encode(),
        ),
    ]
}

fn read_hex(name: &str) -> Vec<u8> {
    let p = dir().join(format!("{name}.hex"));
    let s = std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e} (bless with SWARM_BLESS=1)", p.display()));
    crypto::from_hex(&s.split_whitespace().collect::<String>()).expect("golden files are hex")
}

#[test]
fn golden_vectors_match() {
    let bless = std::env::var_os("SWARM_BLESS").is_some();
    for (name, bytes) in vectors() {
        if bless {
            // 64 bytes per line keeps diffs readable.
            let hex: Vec<String> = bytes.chunks(64).map(to_hex).collect();
            std::fs::write(dir().join(format!("{name}.hex")), hex.join("\n") + "\n").unwrap();
        }
        assert_eq!(
            to_hex(&read_hex(name)),
            to_hex(&bytes),
            "{name} changed: the wire format moved"
        );
    }
}

#[test]
fn golden_frames_decode_and_reencode() {
    let run = test_run(true);
    for (name, _) in vectors() {
        if name.contains('.') || name == "run_id" || name == "signing_preimage" {
            continue;
        }
        let bytes = read_hex(name);
        let m = Message::decode(&bytes, &run.limits).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(m.encode(), bytes, "{name}");
        // Signatures in the vectors verify.
        match &m {
            Message::Announce { header, .. } | Message::Update { header, .. } => {
                header.verify().unwrap()
            }
            Message::Summary(s) => s.verify().unwrap(),
            Message::Manifest(s) => s.verify().unwrap(),
            Message::Equivocation(p) => {
                p.verify(&run.run_id()).unwrap();
            }
            Message::SummaryEquivocation(p) => {
                p.verify(&run.run_id()).unwrap();
            }
            _ => {}
        }
    }
    let rid = read_hex("run_id");
    assert_eq!(
        rid,
        blake3::hash(&read_hex("run_config.cbor"))
            .as_bytes()
            .to_vec()
    );
}

#[test]
fn protocol_md_quotes_the_golden_vectors() {
    let doc = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../docs/PROTOCOL.md"),
    )
    .unwrap();
    let flat: String = doc.split_whitespace().collect();
    for name in ["hello", "summary", "chunk", "run_id"] {
        let hex = to_hex(&read_hex(name));
        assert!(
            flat.contains(&hex),
            "docs/PROTOCOL.md does not quote tests/golden/{name}.hex"
        );
    }
}
