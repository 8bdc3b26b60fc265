//! Every fuzz target, run once over its corpus on stable: the protocol's golden frames and
//! single-byte mutations and truncations of them, deterministic pseudo-random inputs, and
//! whatever `cargo fuzz` saved under `corpus/<target>/` (and `artifacts/<target>/`, the
//! crashes it found: they must stay fixed). Where nightly cargo-fuzz is installed,
//! `scripts/test.sh` also fuzzes each target for a bounded time.

use std::path::{Path, PathBuf};

type Target = fn(&[u8]);

const TARGETS: [(&str, Target); 8] = [
    ("frame", swarm_fuzz::frame),
    ("blob", swarm_fuzz::blob),
    ("cbor_precheck", swarm_fuzz::cbor_precheck),
    ("engine", swarm_fuzz::engine),
    ("engine_signed", |d| {
        swarm_fuzz::engine_signed(d);
    }),
    ("peer_id", swarm_fuzz::peer_id),
    ("request", swarm_fuzz::request),
    ("download", |d| {
        swarm_fuzz::download(d);
    }),
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn from_hex(s: &str) -> Vec<u8> {
    let h: String = s.split_whitespace().collect();
    (0..h.len() / 2)
        .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

fn files(dir: &Path) -> Vec<Vec<u8>> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    paths
        .into_iter()
        .filter(|p| p.is_file())
        .filter_map(|p| std::fs::read(p).ok())
        .collect()
}

fn golden() -> Vec<Vec<u8>> {
    let dir = root().join("../protocol/tests/golden");
    let mut names: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("protocol/tests/golden")
        .map(|e| e.unwrap().path())
        .collect();
    names.sort();
    names
        .iter()
        .map(|p| from_hex(&std::fs::read_to_string(p).unwrap()))
        .collect()
}

/// splitmix64: a fixed stream of inputs, the same on every machine.
fn pseudo_random(n: usize, max_len: usize, seed: u64) -> Vec<Vec<u8>> {
    let mut rng = protocol::rng::Rng::from_state(seed);
    let mut next = move || rng.next_u64();
    (0..n)
        .map(|_| {
            let len = (next() as usize) % (max_len + 1);
            (0..len).map(|_| next() as u8).collect()
        })
        .collect()
}

fn seeds() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for g in golden() {
        // Truncations and one-byte changes, spread over the frame.
        let stride = (g.len() / 48).max(1);
        for i in (0..g.len()).step_by(stride) {
            out.push(g[..i].to_vec());
            for x in [0x00u8, 0x01, 0x80, 0xff] {
                let mut m = g.clone();
                m[i] ^= x | 1;
                out.push(m);
            }
        }
        out.push(g);
    }
    out.extend(pseudo_random(300, 512, 7));
    out
}

#[test]
fn every_target_survives_its_corpus() {
    let common = seeds();
    for (name, target) in TARGETS {
        let t0 = std::time::Instant::now();
        // The signed-message target reads its input as choices, not as a frame: mutations of
        // the golden frames teach it nothing, and each input signs dozens of messages.
        let mut inputs = if name == "engine_signed" {
            pseudo_random(1000, 1024, 3)
        } else if name == "download" {
            // Choices, too: each byte picks an answer (see `swarm_fuzz::download`).
            let mut v = pseudo_random(2000, 256, 5);
            // All honest answers, in every order the picks give: the download must finish.
            v.extend((0..64u8).map(|k| vec![k << 2; 64]));
            v
        } else {
            common.clone()
        };
        inputs.extend(files(&root().join("corpus").join(name)));
        inputs.extend(files(&root().join("artifacts").join(name)));
        for input in &inputs {
            target(input);
        }
        eprintln!("{name}: {} inputs in {:?}", inputs.len(), t0.elapsed());
    }
}

/// The download target reaches the end: with honest answers it finishes on the honest
/// checkpoint (so the corpus exercises the chunk phase, not only the manifests).
#[test]
fn download_inputs_reach_the_chunk_phase() {
    // Every byte answers the first pending request honestly (op 0, pick 0).
    assert!(swarm_fuzz::download(&[0u8; 64]));
}

/// The signed-message target reaches past the signature checks: over its pseudo-random inputs
/// some messages are accepted (not all refused before the engine looks at them).
#[test]
fn signed_inputs_reach_the_engine_logic() {
    let accepted: usize = pseudo_random(50, 2048, 11)
        .iter()
        .map(|i| swarm_fuzz::engine_signed(i))
        .sum();
    assert!(
        accepted > 0,
        "no signed message got past the engine's checks"
    );
}
