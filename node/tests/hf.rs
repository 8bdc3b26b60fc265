//! `swarm export` / `swarm import` / `swarm eval` against Hugging Face `transformers` itself
//! (installed into the project's virtualenv by scripts/setup.sh): an exported `tiny` and
//! `small` load as `LlamaForCausalLM` with logits equal to swarm's to 1e-4 on a fixed batch,
//! the import of the export is bit-identical to the checkpoint, and the imported file trains on.

// A test: an unwrap that fails is a failing test, with its line (helpers included).
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use train::model::Llama;
use train::tch::{Device, Kind, Tensor};

fn swarm(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_swarm"))
        .args(args)
        .output()
        .expect("swarm runs");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "swarm {args:?} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The virtualenv's python (cargo passes VIRTUAL_ENV from .cargo/config.toml, which
/// scripts/setup.sh writes).
fn python() -> PathBuf {
    let venv = std::env::var("VIRTUAL_ENV").expect(
        "VIRTUAL_ENV is unset: run the tests through ./scripts/test.sh (or scripts/setup.sh first)",
    );
    Path::new(&venv).join("bin/python")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("swarm-hf-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A model whose logits are far from uniform, so a wrong RoPE layout, norm or head shows
/// (the seeded initialization, std 0.02, gives nearly flat logits): every weight redrawn at a
/// larger scale, norms around 1.
fn spread_model(name: &str, seed: i64) -> Llama {
    let cfg = protocol::config::ModelConfig::named(name, 256).unwrap();
    let mut m = Llama::new(&cfg, Device::Cpu, 0);
    train::tch::manual_seed(seed);
    let tensors: Vec<(String, Tensor)> = m
        .names
        .iter()
        .zip(&m.params)
        .map(|(n, p)| {
            let r = Tensor::randn(p.size(), (Kind::Float, Device::Cpu));
            let v = if n.ends_with("norm.weight") {
                r * 0.2 + 1.0
            } else {
                r * (1.5 / (p.size()[p.size().len() - 1] as f64).sqrt())
            };
            (n.clone(), v)
        })
        .collect();
    m.set_params(&tensors).unwrap();
    m
}

fn check_against_transformers(name: &str, batch: i64) {
    let dir = tmp(name);
    let m = spread_model(name, 11);
    let ckpt = dir.join("v1.safetensors");
    m.save(&ckpt).unwrap();
    let hf = dir.join("hf");
    swarm(&[
        "export",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--out",
        hf.to_str().unwrap(),
    ]);
    for f in ["model.safetensors", "config.json", "generation_config.json"] {
        assert!(hf.join(f).is_file(), "{f} missing");
    }
    // A fixed batch of full-length sequences: RoPE errors grow with position.
    let t = m.cfg.seq_len as i64;
    let tokens = Tensor::arange(batch * t, (Kind::Int64, Device::Cpu))
        .view([batch, t])
        .g_mul_scalar(7919)
        .remainder(m.cfg.vocab as i64);
    let logits = train::tch::no_grad(|| m.forward(&tokens));
    let max_logit = logits.abs().max().double_value(&[]);
    assert!(
        max_logit > 3.0,
        "logits too flat to test anything: {max_logit}"
    );
    let reference = dir.join("ref.safetensors");
    Tensor::write_safetensors(&[("tokens", tokens), ("logits", logits)], &reference).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/hf_check.py");
    let out = Command::new(python())
        .arg(&script)
        .arg(&hf)
        .arg(&reference)
        .arg("1e-4")
        .output()
        .expect("python runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{name}: transformers disagrees with swarm: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(j["class"], "LlamaForCausalLM");
    eprintln!("{name}: {stdout}");

    // Import of the export: the same parameters, bit for bit.
    let back = dir.join("imported.safetensors");
    let text = swarm(&[
        "import",
        "--hf",
        hf.to_str().unwrap(),
        "--out",
        back.to_str().unwrap(),
        "--name",
        name,
    ]);
    let digest = train::run::hex(&m.digest());
    assert!(
        text.contains(&digest),
        "import changed the parameters:\n{text}\nwant {digest}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tiny_export_loads_in_transformers_with_equal_logits() {
    check_against_transformers("tiny", 3);
}

#[test]
fn small_export_loads_in_transformers_with_equal_logits() {
    check_against_transformers("small", 1);
}

/// An imported checkpoint trains on (`swarm train --init`), and `swarm eval` scores it: the
/// loss it reports for the imported weights is the loss `swarm train` starts from, and
/// training lowers it.
#[test]
fn an_imported_checkpoint_trains_on_and_evaluates() {
    let dir = tmp("train");
    let m = spread_model("tiny", 3);
    let ckpt = dir.join("v1.safetensors");
    m.save(&ckpt).unwrap();
    let hf = dir.join("hf");
    let imported = dir.join("imported.safetensors");
    swarm(&[
        "export",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--out",
        hf.to_str().unwrap(),
    ]);
    swarm(&[
        "import",
        "--hf",
        hf.to_str().unwrap(),
        "--out",
        imported.to_str().unwrap(),
    ]);
    let text = dir.join("text.txt");
    std::fs::write(
        &text,
        "Now is the winter of our discontent made glorious summer by this sun of York. "
            .repeat(150),
    )
    .unwrap();
    let eval = |ck: &Path| -> serde_json::Value {
        let out = swarm(&[
            "eval",
            "--checkpoint",
            ck.to_str().unwrap(),
            "--data",
            text.to_str().unwrap(),
            "--threads",
            "1",
        ]);
        serde_json::from_str(&out).unwrap()
    };
    let before = eval(&imported);
    let bpb = before["bits_per_byte"].as_f64().unwrap();
    let loss = before["loss"].as_f64().unwrap();
    assert!(
        (bpb - loss / std::f64::consts::LN_2).abs() < 1e-9,
        "{before}"
    );
    assert!(before["tokens"].as_u64().unwrap() > 500, "{before}");
    // The imported weights are the spread model's, not a fresh initialization (≈ ln 256).
    assert!(loss > 6.0, "{before}");
    let trained = dir.join("trained.safetensors");
    swarm(&[
        "train",
        "--init",
        imported.to_str().unwrap(),
        "--optimizer",
        "adamw",
        "--replicas",
        "1",
        "--steps",
        "30",
        "--data",
        text.to_str().unwrap(),
        "--threads",
        "1",
        "--eval-every",
        "0",
        "--save",
        trained.to_str().unwrap(),
    ]);
    let after = eval(&trained);
    assert!(
        after["loss"].as_f64().unwrap() < loss - 1.0,
        "training from the import did not lower the loss: {before} -> {after}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
